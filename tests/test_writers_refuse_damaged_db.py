"""A damaged database file (a page of profile rows overwritten, which opening it does not read): `moetune tune`,
`moetune profile` and `moetune serve` refuse it when they open it, before anything is measured or served (one clear
line naming the file and `moetune db check`, exit 2, not a byte written), as `profiles import` does. Before, tune and
profile measured and then wrote their rows into it, and the daemon served from it. A daemon's re-tune job on a file
damaged after the daemon started ends failed with that reason, nothing measured or written, and the worker lives."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_store_damaged_file import PAGE, damaged_copy, databases

from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, StoreDamaged

pytestmark = pytest.mark.timeout(120)
CAPTURES = Path(__file__).resolve().parent / "captures"


@pytest.fixture
def damaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, bytes]:
    """A damaged database (and its bytes), with no config but the test's."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MOETUNE_CONFIG", raising=False)
    good, _other = databases(tmp_path)
    bad = damaged_copy(good)
    with Store(bad, upgrade=False) as s:  # the damage is not where an open looks: only the scan finds it
        assert s.current_revision() is not None
        with pytest.raises(StoreDamaged):
            s.refuse_damaged()
    return bad, bad.read_bytes()


def _refused(r: Any, bad: Path, before: bytes) -> None:
    assert r.exit_code == 2, (r.exception, r.output)
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    text = " ".join(r.output.split())
    assert f"{bad} is damaged" in text and "db check" in text and "backup" in text, text
    assert bad.read_bytes() == before  # not a byte written


def test_tune_refuses_a_damaged_database_before_any_trial(damaged: tuple[Path, bytes],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.search import tune

    bad, before = damaged
    monkeypatch.setattr(tune, "tune_profiles_detailed", lambda *a, **kw: pytest.fail("the tune ran"))
    r = CliRunner().invoke(app, ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "2",
                                 "--tokens", "128", "--db", str(bad)])
    _refused(r, bad, before)


def test_profile_refuses_a_damaged_database_before_any_stage(damaged: tuple[Path, bytes],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow

    bad, before = damaged
    monkeypatch.setattr(flow.Bringup, "run", lambda self: pytest.fail("the bring-up ran"))
    r = CliRunner().invoke(app, ["profile", "--quick", "--capture", str(CAPTURES / "h200x1"), "--db", str(bad)])
    _refused(r, bad, before)


def test_serve_refuses_a_damaged_database_before_it_starts(damaged: tuple[Path, bytes], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.daemon import server

    bad, before = damaged
    monkeypatch.setattr(server, "Daemon", lambda **kw: pytest.fail("the daemon was made"))
    r = CliRunner().invoke(app, ["serve", "--db", str(bad), "--socket", f"ipc://{tmp_path}/run/d.sock"])
    _refused(r, bad, before)


def test_a_retune_job_on_a_file_damaged_later_fails_with_the_reason(tmp_path: Path) -> None:
    from moetune.tuner.daemon import jobs as J
    from moetune.tuner.daemon.server import TuneSettings

    good, _other = databases(tmp_path)
    store = Store(good, intact=True)  # the daemon's open: scanned, sound
    facts = F.FakeFacts({"gpu_count": 0})
    ran: list[Any] = []
    done: list[Any] = []
    jm = J.JobManager(store=store, facts_fn=lambda: facts, retune=lambda ctx: ran.append(ctx) or [],
                      on_done=lambda j, w: done.append(j), tune=TuneSettings(backend="model", trials=1))
    jm.submit(reason="fabric changed", old_fingerprint="old", keys=[])  # queued (its event written) while sound
    store.close()  # its pooled connections go (the WAL checkpointed): the job's reads see the file as it is now
    data = bytearray(good.read_bytes())
    n = len(data) // PAGE // 2  # a page of profile rows, as damaged_copy overwrites
    data[n * PAGE:(n + 1) * PAGE] = b"\xff" * PAGE
    good.write_bytes(bytes(data))  # damaged while the daemon runs
    before = good.read_bytes()
    jm.start()
    try:
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.02)
        assert done, "the job did not end"
        job = done[0]
        assert job.state == "failed" and f"{good} is damaged" in job.message and "db check" in job.message, job.message
        assert not ran  # nothing measured
        assert jm._thread.is_alive()  # the worker serves the next job
    finally:
        jm.stop()
        store.close()  # what a write left in the WAL goes into the file
    assert good.read_bytes() == before  # no run row, no job event written into it
