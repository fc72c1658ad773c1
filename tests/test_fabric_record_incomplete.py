"""`moetune fabric show --record` stored an incomplete discovery (nvidia-smi past its 1.5 s default time-out, fields
withheld from this user) as this node's newest facts; the daemon's first start then compared its complete discovery
with them and recorded a fabric change that was none (the profiles stale, a re-tune queued). Such a discovery is
now refused (exit 1: the command line was fine, the work could not be done as asked), naming what was not read and
how to give discovery more time; nothing is written. `tune --backend local` and `profile` go on, but record no
incomplete facts either (`record_node_facts`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_daemon_change_since_bringup import _kinds, _profiled

from moetune.tuner.cli import app
from moetune.tuner.fabric import discovery

pytestmark = pytest.mark.timeout(60)

CAPTURES = Path(__file__).parent / "captures"
TIMED_OUT = "`nvidia-smi -q -x` timed out; facts it provides are missing"


def _incomplete(capture: str = "h200x1") -> Any:
    f = discovery.discover(CAPTURES / capture)
    f.warnings.append(TIMED_OUT)
    assert not f.complete
    return f


def _record(tmp_path: Path, *more: str) -> Any:
    return CliRunner().invoke(app, ["fabric", "show", "--record", "--db", str(tmp_path / "moetune.db"), *more],
                              env={"MOETUNE_HOME": str(tmp_path), "COLUMNS": "200"})


def test_an_incomplete_discovery_is_refused_and_nothing_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.cli import fabric as cli_fabric

    store, old, seeded = _profiled(tmp_path, "h200x2")  # this node's bring-up, complete
    monkeypatch.setattr(cli_fabric, "_discover", lambda d, t: _incomplete())
    r = _record(tmp_path, "--timeout", "2.5")
    out = " ".join(r.output.split())
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert TIMED_OUT in out and "--timeout SECONDS" in out and "this run: 2.5 s" in out, out
    assert [row["hash"] for row in store.list_fingerprints()] == [old.fingerprint]  # the bring-up's facts stay newest
    # the daemon's first start on the complete node finds no change
    d, ran, done = F.start_recording_daemon(store, tmp_path, discovery.discover(CAPTURES / "h200x2"))
    try:
        assert not done.wait(1.0), f"re-tuned at start: {ran}"
        assert _kinds(store) == ["fabric_seen"]
        assert len(store.list_profiles(status="current", fingerprint=old.fingerprint)) == len(seeded)
    finally:
        d.stop()


def test_without_record_an_incomplete_discovery_is_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.cli import fabric as cli_fabric

    monkeypatch.setattr(cli_fabric, "_discover", lambda d, t: _incomplete())
    r = CliRunner().invoke(app, ["fabric", "show", "--json"], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0 and TIMED_OUT in r.output


def test_a_complete_discovery_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.cli import fabric as cli_fabric

    here = discovery.discover(CAPTURES / "h200x1")
    monkeypatch.setattr(cli_fabric, "_discover", lambda d, t: here)
    assert _record(tmp_path, "--json").exit_code == 0
    with F.open_store(tmp_path / "moetune.db") as s:
        assert [row["hash"] for row in s.local_fingerprints()] == [here.fingerprint]


def test_a_writer_never_records_incomplete_facts_as_the_nodes(tmp_path: Path) -> None:
    """Even with nothing recorded yet (no base): they would be the base of the daemon's first start."""
    from moetune.tuner.fabric.change import record_node_facts

    store = F.open_store(tmp_path / "moetune.db")
    res = record_node_facts(store, _incomplete(), by="tune --backend local")
    assert res.kept == TIMED_OUT and "not recorded" in res.note()
    assert store.list_fingerprints() == []
