"""The CLI's `--help` against its code, and its exit codes on a machine without a GPU or a daemon: every option
says what it means (units, defaults the code really has), options given in the config file are the ones used, and
a command that could not do what was asked ends with a clear message and a non-zero exit, never a traceback."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from cli_commands import cli_commands

pytestmark = pytest.mark.timeout(120)


def _run(*args: str, home: Path, **env: str):
    env = {"MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"), "MOETUNE_CONFIG": "",
           "COLUMNS": "200", **env}
    return CliRunner().invoke(app, list(args), env=env)


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", r.output))


def _no_traceback(r) -> None:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output


# -- status / retune / query --config: the [client] keys of that file are the ones used --------------------------
def test_status_over_curve_tcp_uses_the_client_keys_of_the_config_given(tmp_path: Path) -> None:
    """`moetune status --config client.toml`: its [client] curve_server_key_file and key pair were ignored (the
    profile client read only the default config chain), so the command refused plain-text TCP, naming the very
    setting the file gave."""
    from moetune.runtime.testing.launch import free_port
    from moetune.tuner.cli.keys import allow_client, generate_keys
    from moetune.tuner.daemon.server import Daemon

    server_pub, server_secret = generate_keys(tmp_path / "keys")
    cpub, csec = generate_keys(tmp_path / "bob", "bob")
    allow_client(cpub, tmp_path / "keys" / "clients")
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(store=store, endpoint=endpoint, pub_endpoint=f"tcp://127.0.0.1:{free_port()}",
               curve_secret_key_file=str(server_secret), discover=lambda: facts,
               rediscover_interval_s=0).start(background=True)
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[client]\nsocket = "{endpoint}"\ncurve_server_key_file = "{server_pub}"\n'
                   f'curve_secret_key_file = "{csec}"\n')
    try:
        r = _run("status", "--json", "--config", str(cfg), "--timeout-ms", "3000", home=tmp_path / "home")
    finally:
        d.stop()
    _no_traceback(r)
    assert r.exit_code == 0, r.output
    assert '"endpoint"' in r.output and endpoint in r.output


def test_unusable_daemon_public_key_file_is_a_clear_error(tmp_path: Path) -> None:
    """daemon.curve_public_key_file naming a missing file ended `moetune status` in zmq's OSError traceback."""
    cfg = tmp_path / "c.toml"
    missing = tmp_path / "gone.key"
    cfg.write_text(f'[daemon]\ncurve_public_key_file = "{missing}"\n[client]\nsocket = "tcp://127.0.0.1:5999"\n')
    for cmd in (["status"], ["retune"], ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16"]):
        r = _run(*cmd, "--config", str(cfg), home=tmp_path / "home")
        _no_traceback(r)
        assert r.exit_code == 2, (cmd, r.output)
        assert "curve_public_key_file" in r.output and str(missing) in r.output.replace("\n", ""), r.output


# -- --help: every option says what it is; defaults as the code has them ---------------------------------------
def test_every_option_of_every_command_has_help() -> None:
    """status/retune --timeout-ms, retune --reason and six options of `model sweep` (--model, --nodes, --tokens,
    --gpus-per-node, --routing, --tile) showed no text at all: no unit, no meaning."""
    bare = [f"moetune {' '.join(path)} {p.opts[0]}" for path, cmd in cli_commands() for p in cmd.params
            if not getattr(p, "hidden", False) and p.param_type_name == "option" and not (p.help or "").strip()]
    assert not bare, bare


def test_help_states_units_and_the_defaults_the_code_uses() -> None:
    """The defaults are read from the code the help describes (the config's and the bring-up plan's)."""
    from moetune.runtime.config import ClientConfig, TuneConfig
    from moetune.tuner.bringup.flow import Plan

    for cmd in (("status",), ("retune",)):
        assert re.search(r"--timeout-ms .*Milliseconds", _help(*cmd)), cmd
    client_ms = ClientConfig().timeout_ms
    assert f"--timeout-ms <int> Time budget for the whole lookup, in milliseconds, 1 to 86400000 (default: [client] " \
           f"timeout_ms, {client_ms})" in _help("query")
    tune = _help("tune")
    # the config's [tune] timeout_s bounds a tune where --timeout is not given; [tune] backend picks the backend
    assert f"default: config [tune] timeout_s, {TuneConfig().timeout_s:g})" in tune, tune
    assert f"default: config [tune] backend, {TuneConfig().backend})" in tune, tune
    prof = _help("profile")
    toks = ",".join(map(str, Plan().tokens))
    quick = ",".join(map(str, Plan.quick().tokens))
    assert f"default: {toks}, with --quick {quick})" in prof, prof
    assert f"default: {Plan().trials}, with --quick {Plan.quick().trials})" in prof, prof
    assert f"(default: {Plan().models[0]})" in prof and len(Plan().models) == 1, prof
    # the results table and BENCHMARKS.md are the source tree's, not the current directory's
    assert "of the moetune source tree" in _help("bench", "run")
    assert _help("bench", "summarize").count("of the moetune source tree") == 2


# -- tune: an EP size or node count below 1 is an error, not the default ----------------------------------------
@pytest.mark.parametrize(("opt", "value"), [("--ep-size", "0"), ("--nodes", "0"), ("--ep-size", "-8")])
def test_tune_refuses_ep_size_and_nodes_below_one(tmp_path: Path, opt: str, value: str) -> None:
    """`--ep-size 0` was read as "not given": the tune ran (exit 0) on GPUs per node × nodes instead."""
    r = _run("tune", "--model", "qwen3-30b", "--preset", "ndr-ibrc-h100x8", "--tokens", "16", "--trials", "1",
             opt, value, home=tmp_path)
    _no_traceback(r)
    assert r.exit_code == 2, r.output
    assert f"{opt} must be >= 1, got {value}" in r.output
    assert not (tmp_path / "moetune.db").exists()  # refused before anything was tuned or stored


# -- tune: a run the time budget cut short says so ----------------------------------------------------------------
def test_tune_says_when_its_time_budget_ended_the_studies_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--timeout` (default [tune] timeout_s) may stop the studies before their trials are done: stderr names each
    study cut short with the trials it ran of those asked, --json says it per study (not only the winners, as if the
    search had run in full), and the exit stays 0 where a profile was stored."""
    import json
    from datetime import datetime, timedelta

    from moetune.tuner.search.model_backend import ModelBackend

    evaluate = ModelBackend.evaluate
    calls: list[datetime] = []

    def slow_second_call(self: ModelBackend, *a: object, **kw: object):
        # call 1 is tune's feasibility check of the first study; call 2 is that study's first trial, so Optuna's
        # clock (wall time, like this one) started before it. Holding call 2 until a whole budget has passed since
        # it began ends that study after this trial and leaves no time for the second study: no clock race.
        calls.append(datetime.now())
        if len(calls) == 2:
            until = calls[1] + timedelta(seconds=1.0)
            while datetime.now() < until:  # poll: a deadline, not a guessed sleep
                time.sleep(0.01)
        return evaluate(self, *a, **kw)

    monkeypatch.setattr(ModelBackend, "evaluate", slow_second_call)
    args = ("tune", "--model", "qwen3-30b", "--preset", "ndr-ibrc-h100x8", "--tokens", "16,1024", "--trials", "10",
            "--timeout", "1")
    r = _run(*args, "--json", home=tmp_path, COLUMNS="80")
    _no_traceback(r)
    assert r.exit_code == 0, r.output  # the first study stored a profile
    rows = json.loads(r.stdout)
    assert [row["tokens"] for row in rows] == [16, 1024]
    assert rows[0]["stopped_by_timeout"] and 1 <= rows[0]["trials"] < 10 and rows[0]["trials_asked"] == 10
    assert rows[0]["written"]
    assert rows[1]["stopped_by_timeout"] and rows[1]["trials"] == 0
    err = re.sub(r"\s+", " ", r.stderr)
    assert "the time budget (--timeout, 1 s) ended the tune early: 2 of 2 studies" in err, err
    assert f"S=16: {rows[0]['trials']} of 10 trials" in err and "S=1024: 0 of 10 trials (not started)" in err, err
    assert "the time budget ended before this study started" in err, err
    assert max(len(line) for line in r.stderr.splitlines()) <= 80, r.stderr  # wrapped (a 132-column line)

    # a run with the budget to spare says nothing of the kind (and each row says it was not stopped)
    calls.clear()
    monkeypatch.setattr(ModelBackend, "evaluate", evaluate)
    r = _run(*args[:-1], "600", "--json", "--db", str(tmp_path / "other.db"), "--storage",
             f"sqlite:///{tmp_path / 'other-studies.db'}", home=tmp_path)
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert not any(row["stopped_by_timeout"] for row in rows) and "ended the tune early" not in r.stderr
    # the budget is shared over the two studies: the first got half of it, and stderr says what each got
    assert rows[0]["budget_s"] == pytest.approx(300, abs=1) and rows[1]["budget_s"] > 300 - 1, rows
    err = re.sub(r"\s+", " ", r.stderr)
    assert "the time budget (--timeout, 600 s) shared over 2 studies, each the time left / the studies left: " \
           "proxy:ibrc qwen3-30b S=16 300.0 s (took" in err, err


# -- one spelling per meaning: aliases where two commands spelled one thing differently --------------------------
def test_tune_takes_capture_like_profile_and_bench_ep_takes_comm_like_tune(tmp_path: Path) -> None:
    """`profile/report/serve --capture DIR` vs `tune --from DIR`; `tune --comm gloo` vs `bench ep --backend gloo`."""
    missing = tmp_path / "nope"
    r = _run("tune", "--model", "qwen3-30b", "--backend", "local", "--capture", str(missing), home=tmp_path)
    _no_traceback(r)
    assert r.exit_code == 2 and "no such directory" in r.output, r.output
    r = _run("bench", "ep", "--comm", "mpi", home=tmp_path)
    _no_traceback(r)
    assert r.exit_code == 2 and "--backend must be gloo or nccl, got 'mpi'" in r.output, r.output


def test_capture_alias_errors_name_it_and_fabric_show_and_diff_take_it(tmp_path: Path) -> None:
    """`tune --capture DIR` (alias of --from) failed naming only --from, an option the user never typed; `fabric
    show/diff` took only --from where profile/report/serve/tune take --capture. Errors name both spellings; both
    spellings work, and --from stays as documented."""
    missing = tmp_path / "nope"
    for opt in ("--capture", "--from"):
        r = _run("tune", "--model", "qwen3-30b", "--backend", "local", opt, str(missing), home=tmp_path)
        _no_traceback(r)
        assert r.exit_code == 2 and f"--from/--capture {missing}: no such directory" in r.output, r.output
    cap = str(Path(__file__).parent / "captures" / "dgx-h100")
    shown = {opt: _run("fabric", "show", opt, cap, "--json", home=tmp_path) for opt in ("--from", "--capture")}
    assert all(r.exit_code == 0 for r in shown.values()), {o: r.output for o, r in shown.items()}
    import json

    fps = {o: json.loads(r.stdout)["fingerprint"] for o, r in shown.items()}
    assert fps["--capture"] == fps["--from"]
    assert _run("fabric", "show", "--capture", cap, "--record", home=tmp_path).exit_code == 0
    for opt in ("--from", "--capture"):
        r = _run("fabric", "diff", opt, cap, home=tmp_path)
        _no_traceback(r)
        assert r.exit_code == 0 and "fingerprint unchanged" in r.output, r.output
    for cmd in ("show", "diff"):
        assert "--from, --capture" in _help("fabric", cmd), _help("fabric", cmd)


# -- fabric diff: the default is the last fingerprint of a node, not a preset's key ------------------------------
def test_fabric_diff_default_skips_a_model_tunes_preset_key(tmp_path: Path) -> None:
    """After `moetune tune --backend model --preset P` (which records the preset's key, without facts) a plain
    `moetune fabric diff` failed: 'the store has fingerprint preset:... but not its facts'."""
    cap = str(Path(__file__).parent / "captures" / "dgx-h100")
    assert _run("fabric", "show", "--from", cap, "--record", home=tmp_path).exit_code == 0
    r = _run("tune", "--model", "qwen3-30b", "--preset", "ndr-ibrc-h100x8", "--tokens", "16", "--trials", "1",
             home=tmp_path)
    assert r.exit_code == 0, r.output
    r = _run("fabric", "diff", "--from", cap, home=tmp_path)
    _no_traceback(r)
    assert r.exit_code == 0 and "fingerprint unchanged" in r.output, r.output


# -- options that did nothing ------------------------------------------------------------------------------------
def test_bench_ep_verify_with_the_plain_baseline_is_refused(tmp_path: Path) -> None:
    """`bench ep --impl plain --verify` built no layer, so nothing was checked, and it exited 0 as if it passed."""
    r = _run("bench", "ep", "--impl", "plain", "--verify", "--tokens", "4", "--model", "custom:64,32,8,2",
             "--iters", "1", "--warmup", "0", home=tmp_path)
    _no_traceback(r)
    assert r.exit_code == 2 and "--verify" in r.output and "--impl plain" in r.output, r.output


@pytest.mark.parametrize("extra", [("--knobs", "compression=fp8_e4m3"), ("--layout", "dense")])
def test_bench_ep_knobs_or_layout_with_the_plain_baseline_are_refused(tmp_path: Path, extra: tuple[str, str]) -> None:
    """`bench ep --impl plain --knobs compression=fp8_e4m3` timed the uncompressed baseline (it reads no knob; it has
    one layout) and its report listed compression fp8_e4m3 among the knobs, exit 0: refused before any rank starts."""
    r = _run("bench", "ep", "--impl", "plain", *extra, "--tokens", "4", "--model", "custom:64,32,8,2",
             "--iters", "1", "--warmup", "0", home=tmp_path)
    _no_traceback(r)
    assert r.exit_code == 2 and extra[0] in r.output and "--impl plain" in r.output, r.output


def test_fabric_show_says_db_and_config_are_for_record() -> None:
    """`fabric show --db X` without --record reads and writes no database: the help says what they are for."""
    h = _help("fabric", "show")
    assert re.search(r"--db .*--record writes to", h) and re.search(r"--config .*for --record", h), h


def test_bench_moe_says_what_it_times_before_the_long_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench moe` on a machine without a GPU printed nothing for minutes (the default S list runs on the CPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(app, ["bench", "moe", "--engine", "unfused", "--model", "custom:128,64,8,2", "--tokens",
                                 "4", "--iters", "2", "--warmup", "0", "--json"])
    assert r.exit_code == 0, r.output
    # --warmup 0 is raised to --rotate (4): one untimed call per rotated input
    assert "timing unfused at S=4 (4 + 2 calls each) on the CPU (no CUDA device" in r.stderr, r.stderr
    assert r.stdout.strip().startswith("{")  # stdout stays the JSON report


def test_bench_moe_shows_each_case_as_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench moe` is not silent after its first line until every case has run (minutes): each (engine, S) case
    is named on stderr as it starts; stdout stays the one JSON report."""
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(app, ["bench", "moe", "--engine", "unfused", "--model", "custom:128,64,8,2", "--tokens",
                                 "4,16", "--iters", "2", "--warmup", "0", "--json"])
    assert r.exit_code == 0, r.output
    err = r.stderr
    assert "unfused S=4 (1/2)" in err and "unfused S=16 (2/2)" in err, err
    assert err.index("unfused S=4 (1/2)") < err.index("unfused S=16 (2/2)")
    rep = json.loads(r.stdout)  # the whole of stdout: nothing else printed there
    assert [c["S"] for c in rep["cases"]] == [4, 16]


# -- Ctrl-C before a command's own handling: one line, exit 130, never a traceback ---------------------------------
# A Ctrl-C that lands while the module NAME is imported: the handler raises KeyboardInterrupt in the import, as a real
# Ctrl-C does (sent from inside the process, so the test does not depend on timing)
_CTRL_C_AT_IMPORT = """
import os, signal, sys
class CtrlCAt:
    def find_spec(self, name, path=None, target=None):
        if name == {name!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlCAt())
sys.argv = ["moetune", *{args!r}]
from moetune.tuner.cli import main
main()
"""

# `moetune profile` with a Ctrl-C while its fabric discovery reads the node (the bring-up flow's construction)
_CTRL_C_IN_DISCOVERY = """
import sys
from moetune.tuner.bringup import flow
class Discovering:
    def __init__(self, **kw):
        raise KeyboardInterrupt
flow.Bringup = Discovering
sys.argv = ["moetune", "profile", "--quick"]
from moetune.tuner.cli import main
main()
"""


def _script(code: str, home: Path):
    import os
    import subprocess

    env = {**os.environ, "MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"),
           "MOETUNE_CONFIG": "", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=100)


@pytest.mark.parametrize("name", ["importlib.metadata", "typer", "rich.console"])
def test_ctrl_c_while_the_cli_is_imported_is_one_line_and_exit_130(tmp_path: Path, name: str) -> None:
    """A Ctrl-C in the first few tenths of a second of any command (the imports of `moetune.tuner` and of the app)
    printed a traceback from inside an import and ended the process by the signal, before the CLI had any code
    running to catch it."""
    groups = sorted({path[0] for path, _cmd in cli_commands()})
    assert {"profile", "tune", "serve", "db"} <= set(groups)
    for group in groups:
        r = _script(_CTRL_C_AT_IMPORT.format(name=name, args=[group]), tmp_path / "home")
        assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, (group, r.stderr[-2000:])
        assert r.returncode == 130, (group, r.returncode, r.stderr[-2000:])
        assert r.stderr.strip().splitlines() == ["interrupted: before the command started; nothing was done"], group


@pytest.mark.parametrize("code", [_CTRL_C_AT_IMPORT.format(name="optuna", args=["profile", "--quick"]),
                                  _CTRL_C_IN_DISCOVERY], ids=["its-imports", "discovery"])
def test_ctrl_c_before_profiles_stages_start_is_one_line_and_exit_130(tmp_path: Path, code: str) -> None:
    """`moetune profile` interrupted in its own imports or its fabric discovery, before its stages (and their
    "interrupted: ..." line) start: Typer made that a bare exit 130 with nothing said."""
    r = _script(code, tmp_path / "home")
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines() == ["interrupted"], r.stderr


# a Ctrl-C inside a compiled module's initialisation: pybind11 raises "ImportError: initialization failed" from the
# KeyboardInterrupt (as matplotlib's ft2font did under `model sweep`); here the import of matplotlib does the same
_CTRL_C_IN_A_COMPILED_IMPORT = """
import sys
class BrokenInit:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib":
            sys.meta_path.remove(self)
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as e:
                raise ImportError("initialization failed") from e
        return None
sys.meta_path.insert(0, BrokenInit())
sys.argv = ["moetune", "model", "sweep", "--preset", "nvlink-h200x2", "--model", "qwen3-30b", "--over", "tokens",
            "--values", "128,256", "--out", {out!r}]
from moetune.tuner.cli import main
main()
"""


def test_ctrl_c_that_breaks_a_compiled_import_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """Ctrl-C while `model sweep` imported matplotlib for its plot: the compiled module's initialisation turned the
    KeyboardInterrupt into "ImportError: initialization failed", which Typer does not catch: its traceback, then a
    core dump from the half-made module at the interpreter's exit. Any error raised from a KeyboardInterrupt ends the
    command as that interrupt: one line, exit 130."""
    r = _script(_CTRL_C_IN_A_COMPILED_IMPORT.format(out=str(tmp_path / "sweep.png")), tmp_path / "home")
    assert "Traceback" not in r.stderr and "ImportError" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines() == ["interrupted"], r.stderr


# a Ctrl-C inside torch's compiled initialisation: it imports NumPy from C++ and drops the error of that import, so
# the KeyboardInterrupt raised in it was lost and the command ran on to the end (exit 0)
_CTRL_C_IN_TORCH_INIT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive start has it
class CtrlCInTorchInit:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy.linalg" and "torch" in sys.modules and "torch._C" not in sys.modules:
            sys.meta_path.remove(self)
            print("ctrl-c sent inside torch's initialisation", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlCInTorchInit())
sys.argv = ["moetune", "bench", "moe", "--engine", "unfused", "--model", "custom:128,64,8,2", "--tokens", "4",
            "--iters", "1", "--warmup", "0"]
from moetune.tuner.cli import main
main()
"""


def test_ctrl_c_inside_torchs_initialisation_ends_the_command_once_torch_is_loaded(tmp_path: Path) -> None:
    """torch's C++ initialisation imports NumPy and clears any error that import raises: a Ctrl-C landing there (0.2-0.3
    s into `bench moe` on a 2-core machine, about one start in three) was lost and the command ran to the end, exit 0.
    The CLI holds Ctrl-C back while torch is imported and acts on it once the import is done: one line, exit 130."""
    r = _script(_CTRL_C_IN_TORCH_INIT, tmp_path / "home")
    if "ctrl-c sent inside torch's initialisation" not in r.stderr:
        pytest.skip("this torch does not import numpy.linalg from its initialisation: the Ctrl-C was never sent there")
    assert "Traceback" not in r.stderr and "terminate called" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1] == "interrupted", r.stderr[-2000:]
