"""Progress where stderr is no terminal (CI logs, the systemd journal, `2>log`): Rich Live draws nothing there until
it stops, so a bar would leave `moetune tune --backend local ... 2>log` writing nothing for minutes and then one bar
saying elapsed 0:00:00. The shared helper (tuner/cli/_progress.py) prints plain lines there instead; a terminal
keeps the bar."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.cli._progress import RichProgress

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parent.parent


def _pipe() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=80), buf  # a StringIO is no terminal


def test_a_line_per_completed_step_with_done_total_and_elapsed() -> None:
    con, buf = _pipe()
    bar = RichProgress(con, every_s=0, heartbeat_s=0)
    task = bar.add("proxy:ibrc qwen3-30b S=128", total=3)
    assert "proxy:ibrc qwen3-30b S=128: started, 0/3 done, elapsed 0:00:00" in buf.getvalue()  # before any step
    for i in (1, 2, 3):
        bar.update(task, i, best=100.0 - i)
    bar.close()
    lines = buf.getvalue().splitlines()
    assert [ln for ln in lines if " done, best " in ln] == [
        f"proxy:ibrc qwen3-30b S=128: {i}/3 done, best {100 - i:.1f} µs, elapsed 0:00:00" for i in (1, 2, 3)], lines


def test_fast_steps_are_throttled_but_the_last_is_always_printed() -> None:
    con, buf = _pipe()
    bar = RichProgress(con, every_s=60, heartbeat_s=0)
    task = bar.add("t", total=100)
    for i in range(1, 101):
        bar.update(task, i)
    bar.close()
    lines = buf.getvalue().splitlines()
    assert lines == ["t: started, 0/100 done, elapsed 0:00:00", "t: 100/100 done, elapsed 0:00:00"], lines


def test_close_prints_the_count_a_throttled_update_left_unprinted() -> None:
    """An interrupted run: the last count reached is in the log, not the count of the last printed line."""
    con, buf = _pipe()
    bar = RichProgress(con, every_s=60, heartbeat_s=0)
    task = bar.add("t", total=10)
    bar.update(task, 4, best=12.0)
    bar.close()
    bar.close()  # idempotent
    assert buf.getvalue().splitlines()[-1] == "t: 4/10 done, best 12.0 µs, elapsed 0:00:00"
    assert buf.getvalue().count("4/10") == 1


def test_a_step_named_as_it_starts_is_printed_with_its_number() -> None:
    con, buf = _pipe()
    bar = RichProgress(con, every_s=60, heartbeat_s=0)
    task = bar.add("MoE layer on cpu", total=2)
    bar.update(task, 0, description="unfused S=4")
    bar.update(task, 1, description="unfused S=16")
    bar.update(task, 2)
    bar.close()
    out = buf.getvalue()
    assert "unfused S=4 (1/2) ..." in out and "unfused S=16 (2/2) ..." in out and "unfused S=16: 2/2 done" in out


def test_nothing_completes_for_a_while_a_still_running_line_with_elapsed() -> None:
    """A local trial can take minutes: the log shows the run is alive, with the time it has taken so far."""
    con, buf = _pipe()
    bar = RichProgress(con, every_s=0, heartbeat_s=0.2)
    task = bar.add("slow", total=5)
    bar.update(task, 1)
    deadline = time.monotonic() + 10
    while "still running" not in buf.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    bar.close()
    assert "slow: 1/5 done, still running, elapsed 0:00:0" in buf.getvalue(), buf.getvalue()


def test_a_terminal_keeps_the_bar() -> None:
    buf = io.StringIO()
    bar = RichProgress(Console(file=buf, force_terminal=True, width=100), heartbeat_s=0.1)
    task = bar.add("t", total=2)
    bar.update(task, 2, best=5.0)
    bar.close()
    out = buf.getvalue()
    assert "━" in out and "2/2" in out and "started," not in out and "done, best" not in out, out


def test_tune_prints_progress_lines_to_a_piped_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    r = CliRunner().invoke(app, ["tune", "--backend", "model", "--preset", "ndr-ibrc-h100x8", "--model", "qwen3-30b",
                                 "--tokens", "128", "--trials", "3"])
    assert r.exit_code == 0, r.output
    err = r.stderr
    assert re.search(r"qwen3-30b S=128: started, 0/3 done, elapsed \d:\d\d:\d\d", err), err
    assert re.search(r"qwen3-30b S=128: 3/3 done, best [\d.,]+ µs MODELLED, elapsed \d:\d\d:\d\d", err), err


def test_a_resumed_finished_studys_best_is_said_in_its_place() -> None:
    """A study resumed with its trials done: its "resumed, 3/3 done" line has no best yet (the bar is made before the
    study is read), and the best given after it was printed only when the progress closed, after the lines that
    followed it (`moetune profile`'s "→ report"). It is printed when it comes."""
    con, buf = _pipe()
    bar = RichProgress(con, every_s=60, heartbeat_s=0)
    task = bar.add("megakernel qwen3-30b S=16", total=3, done=3)
    bar.update(task, 3, best=300.0)
    con.print("→ report")
    bar.close()
    assert buf.getvalue().splitlines() == [
        "megakernel qwen3-30b S=16: resumed, 3/3 done, elapsed 0:00:00",
        "megakernel qwen3-30b S=16: 3/3 done, best 300.0 µs, elapsed 0:00:00",
        "→ report"], buf.getvalue()


def test_tune_json_keeps_its_progress_on_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--json` turned the progress off: a long tune printed nothing until its JSON. The lines go to stderr, and
    stdout holds the JSON alone."""
    import json

    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    r = CliRunner().invoke(app, ["tune", "--backend", "model", "--preset", "ndr-ibrc-h100x8", "--model", "qwen3-30b",
                                 "--tokens", "128", "--trials", "3",
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert [row["trials"] for row in json.loads(r.stdout)] == [3]
    assert re.search(r"qwen3-30b S=128: 3/3 done, best [\d.,]+ µs MODELLED, elapsed \d:\d\d:\d\d", r.stderr), r.stderr
