"""`launch()` and `moetune bench ep` stopped part way leave no rank running:

- interrupted while it waits (Ctrl-C, or SIGTERM raised as KeyboardInterrupt), launch() joined each rank for 5 s
  before ending it: a SIGTERM'd `bench ep` kept running world x 5 s, its ranks measuring for nobody. It ends them
  at once now.
- a launcher killed outright (SIGKILL, or a second Ctrl-C while it ended them) left its ranks running to the end of
  their benchmark, re-parented to init; each rank now dies with it (PR_SET_PDEATHSIG).
- SIGTERM killed `bench ep` with no word (its ranks orphaned); it ends as Ctrl-C does now, one line, exit 143.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_checks import gone_within, kill

pytestmark = pytest.mark.timeout(120)

# ranks that say where they are (a file each, written whole) and then wait a minute, as a benchmark mid-run
SLEEPY_RANK = """
import os, time

def sleepy(rank, world, folder):
    path = os.path.join(folder, f"rank{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(60)
"""

# a launcher whose SIGTERM raises KeyboardInterrupt (as `sigterm_interrupts` does in the CLI)
LAUNCHER = """
import signal, sys
from moetune.runtime.testing.launch import launch

from sleepy_rank import sleepy

def interrupt(*_):
    raise KeyboardInterrupt

signal.signal(signal.SIGTERM, interrupt)
try:
    launch(sleepy, 2, args=(sys.argv[1],), timeout_s=60)
except KeyboardInterrupt:
    sys.exit(130)
"""


def _start_launcher(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """The launcher running two sleeping ranks; their pids once both are in their function."""
    (tmp_path / "sleepy_rank.py").write_text(SLEEPY_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    marks = [tmp_path / "rank0", tmp_path / "rank1"]
    deadline = time.monotonic() + 90
    while not all(m.exists() for m in marks) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not all(m.exists() for m in marks):
        kill([], proc)
        raise AssertionError(f"the ranks did not start: {proc.communicate()}")
    return proc, [int(m.read_text()) for m in marks]


def test_an_interrupted_launch_ends_its_ranks_at_once(tmp_path: Path) -> None:
    proc, ranks = _start_launcher(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert gone_within(ranks, 3.0) == [], "the ranks outlived the interrupt by 3 s (joined 5 s each first)"
        proc.communicate(timeout=10)
        assert proc.returncode == 130
    finally:
        kill(ranks, proc)


def test_a_launcher_killed_outright_takes_its_ranks_with_it(tmp_path: Path) -> None:
    proc, ranks = _start_launcher(tmp_path)
    try:
        proc.kill()
        proc.wait()
        assert gone_within(ranks, 3.0) == [], "the ranks kept running, re-parented to init"
    finally:
        kill(ranks, proc)


def _spawned_ranks(parent: int) -> list[int]:
    """The children of `parent` that multiprocessing's spawn started (not its resource tracker)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"spawn_main" in cmd:
            found.append(int(d))
    return found


BENCH_EP = """
import sys
sys.argv = ["moetune", "bench", "ep", "--world", "2", "--backend", "gloo", "--model", "custom:64,32,8,2",
            "--tokens", "4", "--iters", "1000000", "--warmup", "0", "--json"]
from moetune.tuner.cli import main
main()
"""


def test_sigterm_ends_bench_ep_with_a_line_and_no_rank_left(tmp_path: Path) -> None:
    """`kill` of a `bench ep` mid-run: one line saying nothing was printed and the ranks were ended, exit 143; its
    ranks are gone when it exits (they were terminated, not left to measure for nobody)."""
    out, err = tmp_path / "out", tmp_path / "err"  # files, not pipes: an orphaned rank would hold a pipe open
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([sys.executable, "-c", BENCH_EP], env={**os.environ, "COLUMNS": "200"}, stdout=o,
                                stderr=e)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(ranks) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            ranks = _spawned_ranks(proc.pid)
        assert len(ranks) == 2, (proc.poll(), err.read_text())
        time.sleep(1.0)  # into their imports or their benchmark: either way nobody else ends them
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        said = err.read_text()
        assert proc.returncode == 143, said
        assert ("terminated (SIGTERM): the benchmark was stopped and its 2 rank process(es) ended; no report "
                "printed") in " ".join(said.split()), said
        assert out.read_text() == "" and "Traceback" not in said and "Aborted" not in said
        assert gone_within(ranks, 0.5) == [], "a rank outlived `bench ep`"
    finally:
        kill(ranks, proc)
