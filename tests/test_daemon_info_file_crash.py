"""daemon.json and its owner record are synced before their rename (and the folder after it): after a power loss the
rename can be on disk and the bytes not (a 0-byte daemon.json is what ext4 or XFS leave then). An empty daemon.json
that this daemon's owner record names (the very file it wrote) is taken as the daemon's own, torn by a crash. Taken
for another program's ("moetune did not write it (it is not a JSON object)"), it would leave the daemon serving
without daemon.json for good, every run, until someone removed it by hand: the runtime would lose the daemon's
database path (its fallback reading the default database instead) and could not tell a killed daemon's socket."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

pytestmark = pytest.mark.timeout(60)


def _run(tmp: Path) -> Path:
    run = tmp / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    return run


def test_an_empty_daemon_json_our_record_names_is_written_again(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    run = _run(tmp_path)
    F.in_process_daemon(tmp_path).start(background=True).stop()
    info = run / "daemon.json"
    os.truncate(info, 0)  # the same file (the record names it), its bytes lost in the crash
    with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
        d = F.in_process_daemon(tmp_path).start(background=True)
        try:
            data = json.loads(info.read_text())
            assert data["running"] is True and data["epoch"] == d.epoch
        finally:
            d.stop()
    assert not any("not writing" in r.getMessage() for r in caplog.records), caplog.text
    # an empty file of the same name that is not the one the record names is still left alone
    (run / "other").write_text("")  # made while the daemon's file still holds its inode: another file
    os.replace(run / "other", info)
    F.in_process_daemon(tmp_path).start(background=True).stop()
    assert info.read_text() == ""


def test_daemon_json_and_its_record_are_synced_before_they_are_renamed(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path)
    synced: set[tuple[int, int]] = set()
    real_fsync, real_replace = os.fsync, os.replace
    renamed: list[tuple[str, bool]] = []

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real_fsync(fd)

    def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        st = os.stat(src)
        if Path(dst).name in ("daemon.json", ".daemon.json.moetune-owner"):
            renamed.append((Path(dst).name, (st.st_dev, st.st_ino) in synced))
        real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    F.in_process_daemon(tmp_path).start(background=True).stop()
    assert {name for name, _ in renamed} == {"daemon.json", ".daemon.json.moetune-owner"}
    assert all(ok for _, ok in renamed), renamed
