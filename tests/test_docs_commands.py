"""The commands README.md and docs/ show against the CLI, and what the CLI prints against what the docs promise:
every `moetune ...` a reader can copy parses (its subcommands, options and required arguments exist), a
MODELLED number is printed with its label, and `status` / `query` / `fabric diff` say what their numbers are."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from moetune.tuner.cli import app

# The click Typer parses with: its own copy where it carries one (whether or not click is installed too: the GPU
# machine has both, and click's exception classes are not the ones Typer's copy raises), else click.
try:
    from typer._click import Context
    from typer._click import exceptions as E
except ImportError:
    from click import Context
    from click import exceptions as E

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
# docs/fabric-model.md is left to its own tests (test_fabric_model_cli.py)
DOCS = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "fabric-model.md")]
# the systemd unit's header comment is an operator's install guide too: its `moetune ...` spans are checked with the docs
UNIT = ROOT / "tuner" / "daemon" / "deploy" / "moetune.service"


def _snippets(text: str) -> list[tuple[str, bool]]:
    """(`moetune ...` as a reader copies it, whether it is a whole command line): the lines of indented or fenced
    code blocks are whole commands; an inline code span may name a command only in part (`moetune tune show`)."""
    out = [(m.group(1), False) for m in re.finditer(r"`(moetune [^`]+)`", text)]
    fenced = False
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():  # a command continued over lines, joined
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        s = line.strip().removeprefix("$ ")
        if (fenced or line.startswith("    ")) and s.startswith("moetune ") and "`" not in s:
            out.append((s, True))
    return out


def _args(snippet: str) -> list[str] | None:
    s = re.split(r"\s(?:#|&|\||;)|\s&$|&$", snippet)[0]
    s = re.sub(r"\[([^\]]*)\]", r"\1", s)  # [--study NAME]: the optional part, given
    s = re.sub(r"<[^>]*>", "X", s)  # <start file>: one placeholder
    try:
        toks = shlex.split(s)[1:]
    except ValueError:
        return None
    return [t for t in toks if t not in ("...", "…")]


def _gives_arguments(cmd: Any, args: list[str]) -> bool:
    """Whether `args` hold a positional argument (not an option's value): then an inline span is a usage."""
    takes_value = {o for p in cmd.params if not getattr(p, "is_flag", False) and getattr(p, "opts", None)
                   for o in p.opts if o.startswith("-")}
    it = iter(args)
    for a in it:
        if a.startswith("-"):
            if a in takes_value:
                next(it, None)
        else:
            return True
    return False


def _check(root: Any, args: list[str], whole: bool) -> str | None:
    """None when `args` parses as a command line; else what is wrong (placeholder values are fine)."""
    cmd = root
    path = ["moetune"]
    while hasattr(cmd, "get_command") and args and not args[0].startswith("-"):
        name = args[0]
        if "/" in name or "|" in name:  # `bench list/run/summarize`: names several commands in one
            return None
        sub = cmd.get_command(Context(cmd), name)
        if sub is None:
            if getattr(cmd, "invoke_without_command", False):
                break  # a group that also runs with options (`moetune tune --model ...`)
            return f"no command {' '.join(path)} {name}"
        cmd, path, args = sub, [*path, name], args[1:]
    args = [a for a in args if a not in ("--help", "--version")]  # eager: they print and exit
    if not args and hasattr(cmd, "get_command"):
        return None  # a group named alone (its --help)
    try:
        ctx = cmd.make_context(" ".join(path), list(args), resilient_parsing=False)
        ctx.close()
    except E.NoSuchOption as e:
        return f"{' '.join(path)}: {e.format_message()}"
    except E.MissingParameter as e:  # an inline mention of a command (options only) may leave out what it needs
        return f"{' '.join(path)}: {e.format_message()}" if whole or _gives_arguments(cmd, args) else None
    except E.BadParameter:
        return None  # a placeholder value (N, DIR, H) where a number or an existing path goes
    except E.UsageError as e:
        msg = e.format_message()
        if "extra argument" in msg or "No such command" in msg:
            return f"{' '.join(path)}: {msg}"
    return None


def test_every_documented_command_parses() -> None:
    root = typer.main.get_command(app)
    bad = []
    for doc in [*DOCS, UNIT]:
        for snip, whole in _snippets(doc.read_text()):
            args = _args(snip)
            if args is None:
                continue
            problem = _check(root, args, whole)
            if problem:
                bad.append(f"{doc.relative_to(ROOT)}: `{snip}`: {problem}")
    assert not bad, "\n".join(bad)


def _unit_commands() -> list[str]:
    """The `moetune ...` command lines of the unit's header comment, as an operator types them (after `sudo -u
    moetune`, as the daemon's user)."""
    out = []
    for line in UNIT.read_text().splitlines():
        s = line.lstrip("#").strip().removeprefix("sudo -u moetune ")
        if line.startswith("#") and s.startswith("moetune "):
            out.append(s)
    return out


def test_the_units_commands_parse() -> None:
    """The unit's TCP/CURVE steps (`moetune keys generate/client/allow`) are commands the CLI takes, whole."""
    cmds = _unit_commands()
    assert any(c.startswith("moetune keys generate ") for c in cmds), cmds  # the scan sees them
    root = typer.main.get_command(app)
    bad = [f"`{c}`: {problem}" for c in cmds if (a := _args(c)) is not None and (problem := _check(root, a, True))]
    assert not bad, "\n".join(bad)


def _schema() -> dict[str, set[str]]:
    import dataclasses

    from moetune.runtime.config import Config

    return {sec: {f.name for f in dataclasses.fields(getattr(Config(), sec))} for sec in ("store", "daemon", "client", "tune")}


def _unit_config_keys() -> list[tuple[str, str]]:
    """(section, key) of every TOML line the unit's header comment shows: `#   [daemon] socket = ...` and its
    continuation lines `#            key = ...`."""
    out, section = [], None
    for line in UNIT.read_text().splitlines():
        m = re.match(r"#\s+(?:\[(\w+)\]\s+)?([a-z_]+) = ", line)
        if not line.startswith("#"):
            section = None
        elif m and (m.group(1) or section):
            section = m.group(1) or section
            out.append((section, m.group(2)))
        elif not m:
            section = None
    return out


def test_the_unit_and_readme_name_only_config_keys_the_schema_takes() -> None:
    """A key named in the unit's TOML lines or as `daemon.KEY` / `client.KEY` in the README (the TCP/CURVE steps)
    is one load_config accepts: a misspelt key is an error that stops the daemon."""
    schema = _schema()
    unit = _unit_config_keys()
    assert ("daemon", "curve_secret_key_file") in unit and ("client", "curve_server_key_file") in unit, unit
    readme = [(m.group(1), m.group(2)) for m in
              re.finditer(r"`(daemon|client)\.([a-z_]+)(?: = [^`]*)?`", (ROOT / "README.md").read_text())]
    readme = [k for k in readme if k != ("daemon", "json")]  # the daemon's info file, not a key
    assert ("daemon", "socket") in readme
    bad = [f"{where}: {sec}.{key}" for where, keys in (("moetune.service", unit), ("README.md", readme))
           for sec, key in keys if key not in schema.get(sec, set())]
    assert not bad, bad


def _run(*args: str, home: Path, **env: str):
    env = {"MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"), "MOETUNE_CONFIG": "",
           "MOETUNE_DAEMON_SOCKET": f"ipc://{home}/none/daemon.sock", "COLUMNS": "200", **env}
    return CliRunner().invoke(app, list(args), env=env)


def test_bench_run_labels_modelled_rows(tmp_path: Path) -> None:
    """fabric-model's rows are predictions (unit `x MODELLED` in summary.csv): the table `bench run` prints showed
    `speedup[16nodes] 12.1` with no unit and no label."""
    r = _run("bench", "run", "fabric-model", "--smoke", "--results", str(tmp_path / "s.csv"), home=tmp_path)
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if "speedup[16nodes]" in ln)
    assert "MODELLED" in line, r.output
    flat = re.sub(r"\s+", " ", r.output)
    assert "rows appended (smoke; the MODELLED ones are predictions, not measurements)" in flat, flat
    assert "(measured)" not in flat  # a run of predictions was titled "measured" before


def test_bench_run_of_predictions_is_never_titled_measured(tmp_path: Path) -> None:
    r = _run("bench", "run", "fabric-model", "--results", str(tmp_path / "s.csv"), "--launches", "1", home=tmp_path)
    assert r.exit_code == 0, r.output
    flat = re.sub(r"\s+", " ", r.output)
    assert "rows appended (run here; the MODELLED ones are predictions, not measurements" in flat, flat


def test_tune_progress_labels_a_modelled_best() -> None:
    import io

    from rich.console import Console

    from moetune.tuner.cli._progress import RichProgress

    buf = io.StringIO()
    bar = RichProgress(Console(file=buf, width=200), label="MODELLED")
    task = bar.add("proxy:ibrc qwen3-30b S=128", total=2)
    bar.update(task, 2, best=37.3)
    bar.close()
    assert "best 37.3 µs MODELLED" in buf.getvalue()


def test_query_shows_where_a_preset_profile_came_from(tmp_path: Path) -> None:
    """README: a preset profile's `measured_on` is `preset:NAME:DIGEST` and `query` shows it; query --format json printed
    "measured_on": "" for such a profile taken from the database."""
    from moetune.runtime.profiles import node_identity

    if node_identity.local_gpu_uuids():
        # with GPUs the node's identity must match a recorded fingerprint before the database is read at all
        # (none does here: only the preset's key is recorded), so the database path this checks never runs
        pytest.skip("this node has NVIDIA GPUs: its identity matches no recorded fingerprint in this test")
    r = _run("tune", "--backend", "model", "--preset", "ndr-ibrc-h100x8", "--model", "qwen3-30b", "--tokens", "128",
             "--trials", "2", "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    assert "(MODELLED" not in r.output  # --json: rows only
    q = _run("query", "--model", "qwen3-30b", "--ep", "8", "--tokens", "128", "--format", "json", "--timeout-ms", "100",
             home=tmp_path, MOETUNE_CLIENT_ALLOW_MODELLED="1")
    assert q.exit_code == 0, q.output
    # stdout alone, and all of it: one JSON document (Result.output also holds stderr, where a log line is allowed)
    got = json.loads(q.stdout)
    assert got["provenance"] == "preset" and got["measured_on"] == got["key"]["fingerprint"], got
    assert got["measured_on"].startswith("preset:ndr-ibrc-h100x8:") and got["preset_shipped"] is True, got


def test_tune_table_says_modelled(tmp_path: Path) -> None:
    r = _run("tune", "--backend", "model", "--preset", "ndr-ibrc-h100x8", "--model", "qwen3-30b", "--tokens", "128",
             "--trials", "2", home=tmp_path)
    assert r.exit_code == 0, r.output
    assert "tuned profiles (MODELLED: predicted, not measured)" in r.output


def test_fabric_diff_default_skips_a_preset_key(tmp_path: Path) -> None:
    """A model tune records its preset's key (no facts); `fabric diff` without --against then said `the store has
    fingerprint preset:... but not its facts` instead of what to do."""
    r = _run("tune", "--backend", "model", "--preset", "ndr-ibrc-h100x8", "--model", "qwen3-30b", "--tokens", "128",
             "--trials", "1", "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    d = _run("fabric", "diff", "--from", str(ROOT / "tests/captures/h200x1"), home=tmp_path)
    assert d.exit_code == 2, d.output
    out = re.sub(r"\s+", " ", d.output)
    assert "but not its facts" not in out and "no discovered fingerprint" in out and "fabric show --record" in out
    s = _run("fabric", "show", "--from", str(ROOT / "tests/captures/h200x2"), "--record", home=tmp_path)
    assert s.exit_code == 0, s.output
    d = _run("fabric", "diff", "--from", str(ROOT / "tests/captures/h200x1"), home=tmp_path)
    assert d.exit_code == 1 and "GPU 1 missing" in d.output, d.output


def test_status_says_which_profiles_each_count_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    """profiles_current counts every fingerprint in the database, the provenance row only this node's: unlabelled,
    `profiles_current 3` beside `measured: 0, node_model: 0, preset: 0` read as a contradiction."""
    from types import SimpleNamespace

    import moetune.tuner.cli.query as Q

    jobs = SimpleNamespace(running=None, queued=[], capacity=4, recent=[])
    st = SimpleNamespace(endpoint="ipc:///x", pub_endpoint="ipc:///y", db="/d", epoch="e", pid=1, daemon_version="0",
                         fingerprint="f", version=0, profiles_current=3, profiles_stale=0, requests=1,
                         last_discovery="t", last_discovery_ok=True, last_discovery_message="", uptime_s=1.0,
                         provenance={"measured": 0, "node_model": 0, "preset": 0}, tune_notice="", jobs=jobs,
                         store_damaged="", profiles_not_served=0, retune_refusals=[])
    monkeypatch.setattr(Q, "daemon_call", lambda *a, **k: st)
    r = CliRunner().invoke(app, ["status"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "profiles_current (all fingerprints)" in r.output
    assert "provenance (this fingerprint)" in r.output


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", r.output))


def test_help_gives_the_defaults_and_what_env_prints() -> None:
    """serve's --metrics-port/--rediscover-interval/--log-level showed no default (they come from the config), and
    query's --format said only `table | json | env`."""
    h = _help("serve")
    assert "daemon.metrics_port, 0" in h and "daemon.rediscover_interval_s, 60" in h and "daemon.log_level, info" in h
    q = _help("query")
    assert "export" in q and "MOETUNE_PROFILE_HASH" in q


def test_model_predict_table_says_which_layout_it_modelled(tmp_path: Path) -> None:
    """The wire layout a prediction assumed (the runtime's per-destination-rank rows, or `expert_tiles`) was only in
    --json's notes; the table a reader sees named none."""
    args = ("model", "predict", "--preset", "slingshot11-libfabric-a100x4", "--nodes", "4", "--tokens", "256",
            "--knobs", "transport=proxy,signalling=decoupled,fence_mode=nic_ordered")
    j = _run(*args, "--json", home=tmp_path)
    assert j.exit_code == 0, j.output
    notes = [n for n in json.loads(j.stdout)["notes"] if not n.startswith("MODELLED")]
    assert notes
    t = _run(*args, home=tmp_path)
    assert t.exit_code == 0, t.output
    flat = re.sub(r"\s+", " ", t.output)
    for n in notes:
        assert re.sub(r"\s+", " ", n) in flat, (n, t.output)


def _strict(root: Any, args: list[str]) -> str | None:
    """None when `args` parses as a command line with its real values (a help example holds no placeholder)."""
    cmd, path = root, ["moetune"]
    while hasattr(cmd, "get_command") and args and not args[0].startswith("-"):
        sub = cmd.get_command(Context(cmd), args[0])
        if sub is None:
            if getattr(cmd, "invoke_without_command", False):
                break
            return f"no command {' '.join(path)} {args[0]}"
        cmd, path, args = sub, [*path, args[0]], args[1:]
    try:
        cmd.make_context(" ".join(path), list(args), resilient_parsing=False).close()
    except E.ClickException as e:  # an unknown option, a bad value, a missing one: the example is wrong
        return f"{' '.join(path)}: {e.format_message()}"
    return None


def test_every_help_example_is_shown_and_parses_against_its_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Examples of query, profile, tune, serve and model predict (tuner/cli/_help.EXAMPLES): each is in its --help,
    and each command line parses against the real command with its values (no option gone, no value refused)."""
    from moetune.tuner.cli._help import EXAMPLES, example_lines

    monkeypatch.chdir(ROOT)  # bench/plans/h200x2.toml is named from the repository's root
    root = typer.main.get_command(app)
    # serve: how to run it in the foreground, stop it, and ask a daemon on a socket of its own (its --help said none)
    assert {("query",), ("profile",), ("tune",), ("model", "predict"), ("serve",)} <= set(EXAMPLES)
    bad = []
    for path, items in EXAMPLES.items():
        r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "300"})
        assert r.exit_code == 0, r.output
        shown = re.sub(r"\s+", " ", r.output)
        assert "Examples:" in shown, (path, shown)
        for (_why, line), run in zip(items, example_lines(path), strict=True):
            assert line in shown, (path, line)
            assert run.startswith(f"moetune {' '.join(path)}"), run
            problem = _strict(root, shlex.split(run)[1:])
            if problem:
                bad.append(f"{line}: {problem}")
    assert not bad, "\n".join(bad)
    assert 'eval "$(moetune query ' in " ".join(line for _w, line in EXAMPLES[("query",)])


def test_the_plan_files_of_profiles_help_load(tmp_path: Path) -> None:
    """The plan `profile --help` shows, and the file it names, load as `--plan` loads them."""
    from moetune.tuner.bringup.flow import Plan
    from moetune.tuner.cli._help import PLAN_SAMPLE, examples

    assert "bench/plans/h200x2.toml" in examples(("profile",))
    sample = tmp_path / "plan.toml"
    sample.write_text(PLAN_SAMPLE)
    for file in (sample, ROOT / "bench" / "plans" / "h200x2.toml"):
        plan = Plan.from_file(file, Plan())
        plan.validate("plan")
        assert plan.models == ["qwen3-30b"] and plan.tokens == [1024, 4096], file


def test_the_help_examples_that_run_quickly_run(tmp_path: Path) -> None:
    """query (both forms), model predict and the model-backend tune run as shown (the tune with fewer trials)."""
    from moetune.tuner.cli._help import example_lines

    for path in (("query",), ("model", "predict")):
        for line in example_lines(path):
            r = _run(*shlex.split(line)[1:], home=tmp_path)
            assert r.exit_code == 0, (line, r.output)
    env = _run(*shlex.split(example_lines(("query",))[1])[1:], home=tmp_path)
    assert "export MOETUNE_PROFILE_HASH=" in env.stdout
    tune = example_lines(("tune",))[0]
    assert "--backend model" in tune
    r = _run(*shlex.split(tune)[1:], "--trials", "2", home=tmp_path)
    assert r.exit_code == 0, r.output
