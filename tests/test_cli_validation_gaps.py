"""Input checks a QA pass found missing: `query` with an EP size the model's experts do not divide, an imported
profile key with such an EP size, `model predict -g 0`, `model sweep --values ""`, sweep rows that said n/a
without a reason (and a matplotlib warning on the terminal), `status`/`retune` against a daemon that cannot answer
(--json, a regular file as the socket, a TCP key the daemon refuses), and stray line breaks in the help of every command (listings and descriptions)."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(120)


def run(*args: str, home: Path, **env: str):
    env = {"MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"), "MOETUNE_CONFIG": "",
           "COLUMNS": "200", **env}
    return CliRunner().invoke(app, list(args), env=env)


def no_traceback(r) -> None:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output and "Warning" not in r.output, r.output


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


# -- 1: query refuses an EP size the experts do not divide (as tune does) --------------------------------------
@pytest.mark.parametrize("ep", [3, 7])
def test_query_refuses_an_ep_size_that_does_not_divide_the_experts(tmp_path: Path, ep: int) -> None:
    r = run("query", "--model", "qwen3-30b", "--ep", str(ep), "--tokens", "128", home=tmp_path)
    no_traceback(r)
    assert r.exit_code == 2, r.output
    assert f"qwen3-30b: 128 experts do not divide evenly over an EP group of {ep}" in flat(r.output), r.output
    assert "--ep" in r.output


def test_query_and_tune_word_the_refusal_the_same_way(tmp_path: Path) -> None:
    from moetune.runtime.shapes import get_model

    with pytest.raises(ValueError) as e:
        get_model("qwen3-30b").check_ep(7)
    r = run("tune", "--model", "qwen3-30b", "--ep-size", "7", "--preset", "nvlink-h200x2", "--trials", "1",
            home=tmp_path)
    assert r.exit_code == 2 and str(e.value) in flat(r.output), r.output


@pytest.mark.parametrize("tokens", ["0", "-1", "4194305", "99999999999999999999"])
def test_query_refuses_the_token_counts_model_predict_refuses(tmp_path: Path, tokens: str) -> None:
    """`query --tokens 0` and `--tokens 99999999999999999999` answered a profile, exit 0; `tune` refuses 0 and
    `model predict` 0 and above 4M: one rule (runtime/shapes.py tokens_per_gpu_problem), worded alike."""
    r = run("query", "--model", "qwen3-30b", "--ep", "2", "--tokens", tokens, "--socket",
            f"ipc://{tmp_path}/none.sock", "--timeout-ms", "100", home=tmp_path)
    no_traceback(r)
    assert r.exit_code == 2 and "--tokens" in r.output, r.output
    p = run("model", "predict", "-p", "nvlink-h200x2", "--tokens", tokens, home=tmp_path)
    assert p.exit_code == 2, p.output
    said = flat(p.output).split("--tokens ", 1)[1]  # predict: "--tokens <why>", query: Typer's "... '--tokens': <why>"
    assert said.split(" (at most")[0] in flat(r.output), (p.output, r.output)
    ok = run("query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "4194304", "--format", "json", "--socket",
             f"ipc://{tmp_path}/none.sock", "--timeout-ms", "100", home=tmp_path)
    assert ok.exit_code == 0, ok.output


# -- 2: a profile key whose experts do not divide over its EP size is refused (import included) ---------------
def _key(**kw: object) -> ProfileKey:
    base = dict(fingerprint="fp-q", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=16)
    return ProfileKey(**{**base, **kw})  # type: ignore[arg-type]


def test_profile_key_refuses_experts_that_do_not_divide_over_its_ep_size() -> None:
    with pytest.raises(ValueError, match="profile key: 127 experts do not divide evenly over an EP group of 2"):
        _key(experts=127)
    assert _key(experts=128, ep_size=4, nodes=2).experts == 128


def test_profiles_import_refuses_a_key_with_127_experts_over_ep_2(tmp_path: Path) -> None:
    from moetune.tuner.store.store import Store

    src = tmp_path / "src.db"
    with Store(src) as s:
        s.upsert_fingerprint("fp-q", {}, origin="local")  # no facts: an import checks facts (`facts_problem`)
        s.put_profile(ProfileRecord(key=_key(), knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5,
                                    backend="model:t"))
    r = run("profiles", "export", "-", "--db", str(src), home=tmp_path / "h")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    doc["profiles"][0]["key"]["experts"] = 127
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    dst = tmp_path / "dst.db"
    r = run("profiles", "import", str(f), "--db", str(dst), home=tmp_path / "h")
    no_traceback(r)
    assert r.exit_code == 2, r.output
    assert "127 experts do not divide evenly over an EP group of 2" in flat(r.output), r.output
    assert "profiles[0]" in r.output


# -- 3: `model predict -g 0` and `model sweep --values ""` are refused ------------------------------------------
@pytest.mark.parametrize("cmd", ["predict", "sweep"])
@pytest.mark.parametrize("g", ["0", "-3"])
def test_model_gpus_per_node_below_one_is_refused_naming_the_option(tmp_path: Path, cmd: str, g: str) -> None:
    r = run("model", cmd, "-p", "nvlink-h200x2", "-n", "1", "-g", g, home=tmp_path)
    no_traceback(r)
    assert r.exit_code == 2, r.output
    assert f"--gpus-per-node must be >= 1, got {g}" in flat(r.output), r.output


@pytest.mark.parametrize("cmd", ["predict", "sweep"])
@pytest.mark.parametrize("tile", ["0", "-3", str(2**22 + 1), str(10**30), str(10**400)])
def test_model_tile_outside_its_range_is_refused_naming_the_option(tmp_path: Path, cmd: str, tile: str) -> None:
    """--tile is checked as --tokens is (the Workload's rule, the option named): a tile above the most tokens per GPU
    moetune handles was modelled (10**30: every expert padded to 10**30 rows, an absurd layer time) or crashed
    (10**400: OverflowError, a traceback)."""
    r = run("model", cmd, "-p", "nvlink-h200x2", "-n", "1", "--tile", tile, home=tmp_path)
    no_traceback(r)
    assert r.exit_code == 2, r.output
    assert flat(r.output).startswith("error: --tile must be"), r.output


@pytest.mark.parametrize("tile", ["1", "128", str(2**22)])
def test_model_tile_within_its_range_is_modelled(tmp_path: Path, tile: str) -> None:
    # a tile above the tokens an expert receives is a kernel's fixed tile (decode: one token per GPU, tile 128)
    r = run("model", "predict", "-p", "nvlink-h200x2", "-t", "1", "--tile", tile, "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["workload"]["tile"] == int(tile)


@pytest.mark.parametrize("values", [""])
def test_model_sweep_refuses_an_empty_values_list(tmp_path: Path, values: str) -> None:
    r = run("model", "sweep", "-p", "nvlink-h200x2", "-n", "1", "--values", values, home=tmp_path)
    no_traceback(r)
    assert r.exit_code == 2, r.output
    assert "--values: expected comma-separated integers" in flat(r.output), r.output


# -- 4: a sweep says why a point is n/a; no plot (and no matplotlib warning) when nothing can be drawn -----------
def test_model_sweep_rows_name_the_reason_they_are_na(tmp_path: Path) -> None:
    out = tmp_path / "x.png"
    # --nodes 4 on a one-node preset: every point is n/a
    r = run("model", "sweep", "-p", "nvlink-h200x2", "-n", "4", "--out", str(out), home=tmp_path)
    no_traceback(r)
    text = flat(r.output)
    assert "n/a (1)" in text and "(1) preset 'nvlink-h200x2' has no network between nodes; use nodes=1" in text, text
    assert "nothing modelled (no plot written to" in text and not out.exists()
    assert r.exit_code == 1, r.output


def test_model_sweep_with_nothing_modelled_fails_without_out_too(tmp_path: Path) -> None:
    r = run("model", "sweep", "-p", "nvlink-h200x2", "-n", "4", home=tmp_path)
    no_traceback(r)
    assert r.exit_code == 1 and "nothing modelled: every point of the sweep is n/a" in flat(r.output), r.output


def test_model_sweep_default_nodes_fit_the_preset(tmp_path: Path) -> None:
    """The default --nodes is 4, or the preset's most nodes when fewer: a one-node preset's sweep is modelled."""
    r = run("model", "sweep", "-p", "nvlink-h200x2", "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    points = [p for s in json.loads(r.stdout)["series"].values() for p in s]
    assert points and all("error" not in p for p in points), points


def test_model_sweep_json_names_no_plot_it_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "x.png"
    r = run("model", "sweep", "-p", "nvlink-h200x2", "-n", "4", "--json", "--out", str(out), home=tmp_path)
    assert r.exit_code == 1 and not out.exists()
    doc = json.loads(r.stdout)
    assert doc["plot"] is None and all("use nodes=1" in p["error"] for s in doc["series"].values() for p in s)


def test_model_sweep_plot_shows_no_python_warning(tmp_path: Path) -> None:
    import warnings

    from moetune.tuner.cli.model_plot import plot

    out = tmp_path / "one.png"
    # one point per series and a series with nothing to draw: matplotlib warns of both
    series = {"a": [{"x": 1, "latency_us": 3.0, "fences": 0}], "b": [{"x": 1, "error": "no", "modelled": True}]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot({"b": series["b"]}, "nodes", out, "t")
        plot(series, "nodes", out, "t")
    assert not caught, [str(w.message) for w in caught]
    assert out.exists()


# -- 6: command descriptions carry no stray line breaks of their docstrings -------------------------------------
# Every group and every command of the app, walked rather than listed: a new command is checked without a test edit.
def _walk(cmd=None, path: tuple[str, ...] = ()):
    cmd = typer.main.get_command(app) if cmd is None else cmd
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        if not sub.hidden:
            yield from _walk(sub, (*path, name))


GROUPS = [path for path, cmd in _walk() if isinstance(cmd, typer.core.TyperGroup)]
COMMANDS = [(path, cmd) for path, cmd in _walk() if path and cmd.help]


def _listing(*group: str) -> list[str]:
    r = CliRunner().invoke(app, [*group, "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    panel = r.output.split("Commands")[1].split("╰")[0]
    return [line for line in panel.splitlines()[1:] if line.strip("│ ")]


def test_every_group_is_walked() -> None:
    assert {(), ("model",), ("keys",), ("bench",), ("tune",), ("db",)} <= set(GROUPS), GROUPS


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: " ".join(g) or "moetune")
def test_command_listing_has_one_line_per_command(group: tuple[str, ...]) -> None:
    rows = _listing(*group)
    # a row that does not start with a command name continues the one above: a line break of its docstring
    assert all(line.startswith("│ ") and line[2] != " " for line in rows), "\n".join(rows)


@pytest.mark.parametrize(("cmd", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_description_is_wrapped_by_the_terminal_only(cmd: tuple[str, ...], command) -> None:
    r = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "400"})
    desc = r.output.split("Usage:")[1].split("╭")[0]
    lines = [line.strip() for line in desc.splitlines()[1:] if line.strip()]
    paragraphs = [p for p in inspect.cleandoc(command.help).split("\n\n") if p.strip()]
    assert len(lines) == len(paragraphs), lines  # each paragraph on one line at 400 columns
    # Rich joins a paragraph's lines on this page, so the count above holds whatever the docstring's line breaks;
    # they show in the group's listing and where the help is read as written: checked in the docstring itself
    assert not [p for p in paragraphs if "\n" in p], paragraphs


# -- 5: status/retune say what kept the daemon from answering (once; as JSON with --json) -----------------------
@pytest.mark.parametrize("cmd", ["status", "retune"])
def test_json_error_is_one_json_object_on_stdout(tmp_path: Path, cmd: str) -> None:
    r = run(cmd, "--json", "--timeout-ms", "200", home=tmp_path)
    no_traceback(r)
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and "no daemon socket at ipc://" in doc["error"], doc


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_status_says_the_socket_path_is_not_a_socket(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "not_a_socket"
    p.mkdir() if kind == "dir" else p.write_text("")
    r = run("status", "--socket", f"ipc://{p}", "--timeout-ms", "200", home=tmp_path / "h")
    no_traceback(r)
    what = "a directory" if kind == "dir" else "a regular file"
    assert r.exit_code == 1 and f"{p} is {what}, not a socket" in flat(r.output), r.output
    assert "no reply" not in r.output


@pytest.fixture()
def curve_daemon(tmp_path: Path):
    """A daemon on tcp:// with CURVE whose allow-list holds alice's key only; yields (endpoint, server public key,
    alice's secret key file)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import daemon_fakes as F

    from moetune.runtime.testing.launch import free_port
    from moetune.tuner.cli.keys import allow_client, generate_keys
    from moetune.tuner.daemon.server import Daemon

    server_pub, server_secret = generate_keys(tmp_path / "keys")
    alice_pub, alice_secret = generate_keys(tmp_path / "alice", "alice")
    allow_client(alice_pub, tmp_path / "keys" / "clients")
    facts = F.FakeFacts({"gpu_model": "H200"})
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint=endpoint,
               pub_endpoint=f"tcp://127.0.0.1:{free_port()}", curve_secret_key_file=str(server_secret),
               discover=lambda: facts, rediscover_interval_s=0).start(background=True)
    try:
        yield endpoint, server_pub, alice_secret
    finally:
        d.stop()


@pytest.mark.parametrize("who", ["unlisted", "no_own_key"])
@pytest.mark.parametrize("json_out", [False, True])
def test_status_says_the_daemon_refused_this_clients_key(tmp_path: Path, curve_daemon, who: str,
                                                          json_out: bool) -> None:
    from moetune.tuner.cli.keys import generate_keys

    endpoint, server_pub, _ = curve_daemon
    cfg = tmp_path / "client.toml"
    text = f'[client]\nsocket = "{endpoint}"\ncurve_server_key_file = "{server_pub}"\n'
    bob_pub = bob_secret = None
    if who == "unlisted":  # a key pair of its own, never allowed on the daemon
        bob_pub, bob_secret = generate_keys(tmp_path / "bob", "bob")
        text += f'curve_secret_key_file = "{bob_secret}"\n'
    cfg.write_text(text)
    r = run("status", "--config", str(cfg), "--timeout-ms", "1000", *(["--json"] if json_out else []),
            home=tmp_path / "h")
    no_traceback(r)
    assert r.exit_code == 1, r.output
    # what is wrong, and what to do: which public key to allow, where, and the restart (the allow-list is read at start)
    why = (f"the daemon at {endpoint} refused this client's key (not on its allow-list?): allow its public key {bob_pub} "
           f"(the one beside client.curve_secret_key_file {bob_secret}) on the daemon's host (`moetune keys allow FILE "
           "DIR`, as the daemon's user), then restart the daemon (`systemctl restart moetune`): it reads its "
           "allow-list when it starts" if who == "unlisted" else
           f"the daemon at {endpoint} refused this client: it has no CURVE key of its own (set "
           "client.curve_secret_key_file to a key on the daemon's allow-list: `moetune keys client`)")
    if json_out:
        assert json.loads(r.stdout) == {"ok": False, "error": why}
    else:
        assert why in flat(r.output) and "no reply" not in r.output, r.output


def test_status_says_the_server_key_is_not_the_daemons(tmp_path: Path, curve_daemon) -> None:
    """An allowed client whose client.curve_server_key_file holds another key than the daemon's public key (an
    operator's copy of the wrong file): the daemon breaks off the handshake, which read as "no reply", the same as
    no daemon at all, naming neither the key file nor what to check."""
    from moetune.tuner.cli.keys import generate_keys

    endpoint, _, alice_secret = curve_daemon
    other_pub, _ = generate_keys(tmp_path / "other", "other")  # a valid public key, not this daemon's
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[client]\nsocket = "{endpoint}"\ncurve_server_key_file = "{other_pub}"\n'
                   f'curve_secret_key_file = "{alice_secret}"\n')
    r = run("status", "--config", str(cfg), "--timeout-ms", "1000", home=tmp_path / "h")
    no_traceback(r)
    out = flat(r.output)
    assert r.exit_code == 1 and "no reply" not in out, r.output
    assert f"the daemon at {endpoint} broke off the CURVE handshake" in out and str(other_pub) in out, r.output


def test_status_says_nothing_listens_on_the_tcp_endpoint(tmp_path: Path) -> None:
    """A CURVE client whose TCP daemon is down (stopped, killed): the connection is refused, which read as "no reply
    within N ms", saying neither that nothing listens there nor what to do."""
    from moetune.runtime.testing.launch import free_port
    from moetune.tuner.cli.keys import generate_keys

    server_pub, _ = generate_keys(tmp_path / "keys")
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[client]\nsocket = "{endpoint}"\ncurve_server_key_file = "{server_pub}"\n')
    r = run("status", "--config", str(cfg), "--timeout-ms", "1000", home=tmp_path / "h")
    no_traceback(r)
    out = flat(r.output)
    assert r.exit_code == 1 and "no reply" not in out, r.output
    assert f"nothing accepts connections at {endpoint}" in out and "moetune serve" in out, r.output


@pytest.mark.parametrize("cmd", [["status"], ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16"]])
def test_tcp_without_the_daemons_key_is_said_once(tmp_path: Path, cmd: list[str]) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "client.toml"
    cfg.write_text('[client]\nsocket = "tcp://127.0.0.1:5999"\n')
    home = tmp_path / "h"
    env = dict(os.environ, MOETUNE_HOME=str(home), HOME=str(home), XDG_CONFIG_HOME=str(home / "cfg"),
               MOETUNE_CONFIG="", COLUMNS="200")
    # a real process: the client's log line goes to the real stderr (CliRunner's capture does not see it)
    r = subprocess.run([sys.executable, "-c", "import sys; from moetune.tuner.cli import main; sys.exit(main())",
                        *cmd, "--config", str(cfg), "--timeout-ms", "200"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert "Traceback" not in r.stderr, r.stderr
    # status says it on stderr; query in its table's footer (the client's log copy on stderr is dropped)
    said = flat(r.stderr) + " " + flat(r.stdout)
    assert said.count("no CURVE public key of the daemon is configured") == 1, said


def test_status_json_answer_says_ok(tmp_path: Path, curve_daemon) -> None:
    endpoint, server_pub, alice_secret = curve_daemon
    cfg = tmp_path / "alice.toml"
    cfg.write_text(f'[client]\nsocket = "{endpoint}"\ncurve_server_key_file = "{server_pub}"\n'
                   f'curve_secret_key_file = "{alice_secret}"\n')
    r = run("status", "--json", "--config", str(cfg), "--timeout-ms", "3000", home=tmp_path / "h")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["endpoint"] == endpoint


def test_model_sweep_over_nodes_stops_at_the_presets_most_nodes(tmp_path: Path) -> None:
    r = run("model", "sweep", "-p", "nvlink-h200x2", "--over", "nodes", "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    assert {p["x"] for s in json.loads(r.stdout)["series"].values() for p in s} == {1}


@pytest.mark.parametrize(("layout", "note"), [("dense", "dense layout: every capacity slot (S rows) to every rank"),
                                              ("packed", "each token once per destination rank")])
def test_model_predict_notes_name_the_layout_modelled(tmp_path: Path, layout: str, note: str) -> None:
    r = run("model", "predict", "-p", "nvlink-h200x2", "-t", "4096", "-k", "transport=collective", "--layout", layout,
            "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    notes = json.loads(r.stdout)["notes"]
    assert any(note in n for n in notes) and notes[0].startswith("MODELLED"), notes


@pytest.mark.parametrize("args", [("presets",), ("predict", "-p", "slingshot11-libfabric-a100x4", "-n", "4")])
def test_model_tables_cut_nothing_at_80_columns(tmp_path: Path, args: tuple[str, ...]) -> None:
    r = run("model", *args, home=tmp_path, COLUMNS="80")
    assert r.exit_code == 0, r.output
    assert "…" not in r.output, r.output
    if args == ("presets",):  # its table fits (the transports left out, and named as left out)
        assert max(len(line.rstrip()) for line in r.output.splitlines()) <= 80, r.output
        assert "not shown at 80 columns: transports" in r.output, r.output
