"""One meaning, one option name across commands: a capture directory is `--capture` everywhere (`--from` kept where
it was), the daemon's client allow-list is `--clients-dir` on `serve` as on `keys` (`--curve-clients-dir` kept),
every timeout's help says its unit and a value that cannot be a timeout is refused naming it, and the commands whose
output a script would parse offer `--json`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from moetune.tuner.cli import app

CAPTURES = Path(__file__).parent / "captures"


def _run(*args: str, home: Path | None = None):
    env = {"COLUMNS": "200"}
    if home is not None:
        env.update(MOETUNE_HOME=str(home), HOME=str(home), XDG_CONFIG_HOME=str(home / "cfg"), MOETUNE_CONFIG="")
    return CliRunner().invoke(app, list(args), env=env)


def _commands() -> dict[str, Any]:
    """Every leaf command by its words ("fabric show", "serve", ...)."""
    out: dict[str, Any] = {}

    def walk(cmd: Any, words: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if words and any(getattr(p, "opts", None) for p in cmd.params):  # a group that runs itself: `tune`
            out[" ".join(words)] = cmd
        if subs:
            for name, sub in subs.items():
                walk(sub, [*words, name])
        else:
            out[" ".join(words)] = cmd
    walk(typer.main.get_command(app), [])
    return out


def _options(cmd: Any) -> dict[str, Any]:
    return {o: p for p in cmd.params for o in getattr(p, "opts", [])}


def _refused(r, *needles: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    text = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", r.output))
    for n in needles:
        assert n in text, (n, text)


# -- capture directory --------------------------------------------------------------------------------------------
def test_every_command_reading_a_capture_takes_capture_and_keeps_from() -> None:
    cmds = _commands()
    for words in ("profile", "report", "serve", "tune", "fabric show", "fabric diff"):
        assert "--capture" in _options(cmds[words]), words
    for words in ("tune", "fabric show", "fabric diff"):  # the older spelling still works there
        opts = _options(cmds[words])
        assert opts["--from"] is opts["--capture"], words


# -- the client allow-list ----------------------------------------------------------------------------------------
def test_serve_takes_clients_dir_as_keys_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`keys client/allow --clients-dir DIR` fills the allow-list `serve --curve-clients-dir DIR` reads: serve took
    only the longer name."""
    from moetune.tuner.daemon import server

    got: list[Any] = []
    monkeypatch.setattr(server, "run_daemon", lambda **kw: got.append(kw["curve_clients_dir"]) or 0)
    allow = tmp_path / "allow"
    for opt in ("--clients-dir", "--curve-clients-dir"):
        r = _run("serve", "--socket", f"ipc://{tmp_path}/d.sock", opt, str(allow), home=tmp_path)
        assert r.exit_code == 0, (opt, r.output)
    assert got == [allow, allow]
    assert "keys client/allow" in re.sub(r"\s+", " ", _run("serve", "--help").output)


def test_keys_client_and_allow_print_json(tmp_path: Path) -> None:
    """`keys generate` had --json; `keys client` and `keys allow` printed only prose a script had to parse."""
    srv, elsewhere = tmp_path / "srv", tmp_path / "x"
    assert _run("keys", "generate", str(srv)).exit_code == 0
    r = _run("keys", "client", str(srv), "--name", "bob", "--admin", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"public": str(srv / "client-bob" / "bob.key"),
                                    "secret": str(srv / "client-bob" / "bob.key_secret"),
                                    "allowed": str(srv / "clients" / "bob.key"), "admin": str(srv / "admins" / "bob.key")}
    assert _run("keys", "generate", str(elsewhere), "--name", "carol").exit_code == 0
    r = _run("keys", "allow", str(elsewhere / "carol.key"), str(srv), "--clients-dir", str(tmp_path / "cl"), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"allowed": str(tmp_path / "cl" / "carol.key"), "admin": None}
    assert (tmp_path / "cl" / "carol.key").is_file()
    r = _run("keys", "allow", str(elsewhere / "carol.key"), str(srv), "--force")  # the prose is unchanged
    assert r.exit_code == 0 and r.output.startswith(f"allowed: {srv / 'clients' / 'carol.key'}"), r.output


# -- timeouts -----------------------------------------------------------------------------------------------------
def test_every_timeout_help_says_its_unit() -> None:
    """fabric show/capture/diff --timeout said only "(s)"."""
    seen = []
    for words, cmd in _commands().items():
        for opt, p in _options(cmd).items():
            if opt.startswith("--timeout"):
                unit = "milliseconds" if opt == "--timeout-ms" else "seconds"
                assert unit in (p.help or "").lower(), (words, opt, p.help)
                seen.append(f"{words} {opt}")
    for must in ("query --timeout-ms", "status --timeout-ms", "retune --timeout-ms", "tune --timeout",
                 "bench ep --timeout", "fabric show --timeout", "fabric capture --timeout", "fabric diff --timeout"):
        assert must in seen, (must, seen)


@pytest.mark.parametrize("value", ["nan", "0", "-1", "61", "inf"])
def test_fabric_timeout_out_of_range_is_refused_naming_seconds(value: str, tmp_path: Path) -> None:
    """`--timeout nan` was refused as "should be less than or equal to 60" and no refusal named the unit."""
    cap = str(CAPTURES / "h200x1")
    for args in (["fabric", "show", "--capture", cap], ["fabric", "diff", "--capture", cap, "--against", cap],
                 ["fabric", "capture", str(tmp_path / "c")]):
        _refused(_run(*args, "--timeout", value, home=tmp_path), "--timeout", "number of seconds from 0.1 to 60")
    assert not (tmp_path / "c").exists()


def test_fabric_timeout_takes_fractional_seconds(tmp_path: Path) -> None:
    r = _run("fabric", "show", "--capture", str(CAPTURES / "h200x1"), "--timeout", "0.5", "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["fingerprint"]


@pytest.mark.parametrize("value", ["1.5", "0.5", "abc"])
def test_timeout_ms_refuses_a_fraction(value: str, tmp_path: Path) -> None:
    """Milliseconds are whole: 1.5 is refused (not rounded), naming the option."""
    for args in (["status"], ["retune"], ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16"]):
        _refused(_run(*args, "--timeout-ms", value, home=tmp_path), "--timeout-ms", "valid int")  # "...valid int." or "...valid integer", by Typer version


# -- --json for scripts -------------------------------------------------------------------------------------------
def test_commands_printing_results_offer_json() -> None:
    cmds = _commands()
    for words in ("status", "retune", "query", "profiles list", "profiles show", "profiles import", "fabric show",
                  "fabric capture", "fabric diff", "bench moe", "bench ep", "bench knobs", "bench list", "tune",
                  "tune show", "model predict", "model sweep", "model presets", "model calibrate", "profile",
                  "db current", "db check", "keys generate", "keys client", "keys allow"):
        assert "--json" in _options(cmds[words]), words
