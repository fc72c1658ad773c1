"""daemon.json beside the IPC socket: the daemon replaces only a daemon.json it wrote (marked `written_by` and
named by its owner record), leaves anyone else's file alone (the user's own included) and serves without one,
and a start-up that fails leaves no daemon.json behind (and never touches one of an earlier run)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon import server
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)
INFO_MARK = "moetune-daemon"  # what the daemon writes in "written_by"
USER_FILE = '{"mine": true}\n'


_daemon = F.in_process_daemon


def _run(tmp: Path) -> Path:
    run = tmp / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    return run


def _info(run: Path) -> dict[str, Any]:
    return json.loads((run / "daemon.json").read_text())


def test_a_users_daemon_json_is_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = _run(tmp_path)
    mine = run / "daemon.json"
    mine.write_text(USER_FILE)
    os.chmod(mine, 0o644)
    with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
        d = _daemon(tmp_path).start(background=True)
        try:
            assert mine.read_text() == USER_FILE  # served without replacing it
        finally:
            d.stop()
    assert mine.read_text() == USER_FILE and stat.S_IMODE(os.stat(mine).st_mode) == 0o644  # nor at exit
    assert not (run / ".daemon.json.moetune-owner").exists()
    assert any(f"not writing {mine}: moetune did not write it" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", ["daemon.json", ".daemon.sock.moetune-owner", ".daemon.json.moetune-owner"])
def test_a_deeply_nested_json_file_in_the_runtime_dir_is_not_ours(tmp_path: Path, name: str) -> None:
    """A daemon.json (or an owner record) of this user's nested too deeply for json.loads: its RecursionError, caught
    nowhere, ended the daemon's start; such a file is one moetune did not write (left alone, served without)."""
    run = _run(tmp_path)
    nested = "[" * 200_000 + "]" * 200_000
    (run / name).write_text(nested)
    # daemon.json's record is read only to tell whether a daemon.json marked as ours is ours: without such a file
    # beside it, the record was never parsed and this case passed with the RecursionError uncaught
    marked = json.dumps({"written_by": INFO_MARK}) + "\n"
    if name == ".daemon.json.moetune-owner":
        (run / "daemon.json").write_text(marked)
    d = _daemon(tmp_path).start(background=True)
    d.stop()
    if name == "daemon.json":
        assert (run / name).read_text() == nested
    elif name == ".daemon.json.moetune-owner":  # no readable record names it: not ours, left alone
        assert (run / "daemon.json").read_text() == marked


def test_a_deeply_nested_owner_record_of_a_dead_socket_proves_nothing(tmp_path: Path) -> None:
    """The socket's record is parsed to tell whether a dead socket left at the socket name is ours (to remove it):
    the case above has no socket there, so that read was never made. Nested too deeply, it proves nothing: the
    socket is refused as one no record shows ours, not a RecursionError out of the start."""
    import socket

    run = _run(tmp_path)
    with socket.socket(socket.AF_UNIX) as s:  # a dead socket: bound, then closed, its file left behind
        s.bind(str(run / "daemon.sock"))
    (run / ".daemon.sock.moetune-owner").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(DaemonConfigError, match="dead socket that no record shows this daemon created"):
        _daemon(tmp_path).start(background=True)


def test_our_daemon_json_is_replaced_and_kept_at_a_clean_exit(tmp_path: Path) -> None:
    run = _run(tmp_path)
    for _ in range(2):  # the second daemon replaces the first one's file
        d = _daemon(tmp_path).start(background=True)
        try:
            info = _info(run)
            assert info["written_by"] == INFO_MARK and info["running"] is True and info["epoch"] == d.epoch
        finally:
            d.stop()
        info = _info(run)  # kept for the runtime (last fingerprint, database), saying the daemon is down
        assert info["running"] is False and info["epoch"] == d.epoch and info["fingerprint"]


def test_a_copy_of_our_daemon_json_is_not_ours(tmp_path: Path) -> None:
    """The mark alone is not enough: the owner record must name the very file (a copy is another file)."""
    run = _run(tmp_path)
    _daemon(tmp_path).start(background=True).stop()
    info = run / "daemon.json"
    shutil.copyfile(info, run / "copy")
    os.replace(run / "copy", info)
    before = info.read_text()
    d = _daemon(tmp_path).start(background=True)
    d.stop()
    assert info.read_text() == before


def test_the_record_forgets_the_replaced_file_once_the_rename_is_done(tmp_path: Path) -> None:
    """The replaced daemon.json's inode is free after the rename, and the filesystem may give it to the next file
    made there (a user's copy put over daemon.json would pass for ours). Once the rename is done the record names
    the new file alone."""
    run = _run(tmp_path)
    _daemon(tmp_path).start(background=True).stop()  # start wrote daemon.json, stop replaced it
    record = json.loads((run / ".daemon.json.moetune-owner").read_text())
    st = os.stat(run / "daemon.json")
    assert (record["dev"], record["ino"]) == (st.st_dev, st.st_ino) and record["prev"] is None


def test_a_daemon_killed_between_the_record_and_the_rename_still_owns_the_old_file(tmp_path: Path) -> None:
    """A record written for a new file whose rename never happened: the old daemon.json it names as replaced is
    still ours, and the next daemon replaces it."""
    run = _run(tmp_path)
    _daemon(tmp_path).start(background=True).stop()
    info, rec = run / "daemon.json", run / ".daemon.json.moetune-owner"
    st = os.stat(info)
    rec.write_text(json.dumps({"dev": st.st_dev, "ino": st.st_ino + 10**9, "prev": [st.st_dev, st.st_ino],
                               "pid": None}))
    d = _daemon(tmp_path).start(background=True)
    try:
        assert _info(run)["epoch"] == d.epoch
    finally:
        d.stop()


def test_a_daemon_json_written_before_the_mark_is_replaced(tmp_path: Path) -> None:
    """After an upgrade: the old daemon's file (exactly its keys, this endpoint, no record) is ours."""
    run = _run(tmp_path)
    endpoint = f"ipc://{run}/daemon.sock"
    old = {"endpoint": endpoint, "pub_endpoint": f"ipc://{run}/events.sock", "db": "x.db", "epoch": "e", "pid": None,
           "running": False, "updated": "", "fingerprint": None, "software": None, "transports": []}
    (run / "daemon.json").write_text(json.dumps(old))
    d = _daemon(tmp_path).start(background=True)
    d.stop()
    assert _info(run)["written_by"] == INFO_MARK
    # the same keys naming another endpoint are not this daemon's
    (run / "daemon.json").unlink()
    (run / ".daemon.json.moetune-owner").unlink()
    (run / "daemon.json").write_text(json.dumps({**old, "endpoint": "ipc:///elsewhere/daemon.sock"}))
    _daemon(tmp_path).start(background=True).stop()
    assert "written_by" not in _info(run)


def test_a_failed_start_up_writes_no_daemon_json(tmp_path: Path) -> None:
    """A PUB socket already bound (here by a live daemon in another directory): nothing left behind."""
    other = tmp_path / "other"
    live = _daemon(other.parent, endpoint=f"ipc://{other}/daemon.sock", db_path="").start(background=True)
    try:
        run = _run(tmp_path)
        d = Daemon(store=F.open_store(tmp_path / "second.db"), endpoint=f"ipc://{run}/daemon.sock",
                   pub_endpoint=live.pub_endpoint, rediscover_interval_s=0)
        with pytest.raises(DaemonConfigError, match=r"another daemon is listening on .*events\.sock"):
            d.start()
        assert list(run.iterdir()) == []  # the socket it bound is gone too; no daemon.json, no record
        assert _info(other)["running"] is True and _info(other)["epoch"] == live.epoch  # the live one's untouched
    finally:
        live.stop()


def test_a_start_up_failing_late_keeps_the_previous_daemon_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart that fails late in start-up (a taken --metrics-port) leaves the previous run's daemon.json (the
    runtime's fallback cache: database and fingerprint) and its owner record as they were; no socket stays."""
    run = _run(tmp_path)
    _daemon(tmp_path).start(background=True).stop()  # an earlier clean run: daemon.json says running false
    info, record = run / "daemon.json", run / ".daemon.json.moetune-owner"
    before, before_record = info.read_bytes(), record.read_bytes()

    def no_port(*_a: Any, **_k: Any) -> Any:
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(server, "start_metrics_server", no_port)
    d = _daemon(tmp_path, metrics_port=9)
    with pytest.raises(DaemonConfigError, match="in use"):
        d.start()
    assert sorted(p.name for p in run.iterdir()) == sorted([info.name, record.name])  # no socket left
    assert info.read_bytes() == before and record.read_bytes() == before_record
    assert _info(run)["running"] is False and _info(run)["db"] == str(tmp_path / "moetune.db")
    # and the next clean start replaces it as its own
    monkeypatch.undo()
    d = _daemon(tmp_path).start(background=True)
    try:
        assert _info(run)["running"] is True and _info(run)["epoch"] == d.epoch
    finally:
        d.stop()


def test_daemon_process_keeps_the_users_file(tmp_path: Path) -> None:
    """End to end: a daemon process serving beside the user's daemon.json, then SIGTERM, leaves the file as it was."""
    run = _run(tmp_path)
    (run / "daemon.json").write_text(USER_FILE)
    with F.seeded_daemon(tmp_path, interval=0) as (d, _facts):
        assert (run / "daemon.json").read_text() == USER_FILE
        d.kill(signal.SIGTERM)
        assert d.proc.returncode == 143  # SIGTERM
    assert d.run_dir == run  # the fixture's runtime directory is the one holding the user's file
    assert (run / "daemon.json").read_text() == USER_FILE
    assert "not writing" in d.read_log()
