"""A refused start removes the socket folder it made (`remove_made_dirs`), but it took the daemon's mark out of it
first, whatever else was in it: a folder another daemon of this user had put its socket (or its lock) in since stayed,
unmarked, and the mark is what lets a later start tighten it (its daemon.group chown and chmod). The mark now goes only
where it is all the folder holds, the folder with it."""

from __future__ import annotations

from pathlib import Path

from moetune.tuner.daemon.runtime_dir import RUNTIME_MARK, missing_dirs, prepare_runtime_dir, remove_made_dirs


def test_a_folder_something_else_was_put_in_keeps_its_mark(tmp_path: Path) -> None:
    d = tmp_path / "run"
    made = missing_dirs(d)
    assert prepare_runtime_dir(d)
    (d / ".other.sock.moetune-lock").write_text("4242\n")  # another daemon of this user, started in it since
    remove_made_dirs(made, True)
    assert sorted(p.name for p in d.iterdir()) == sorted([RUNTIME_MARK, ".other.sock.moetune-lock"])


def test_a_folder_holding_only_the_mark_goes(tmp_path: Path) -> None:
    d = tmp_path / "run" / "a"
    made = missing_dirs(d)
    assert prepare_runtime_dir(d)
    remove_made_dirs(made, True)
    assert not (tmp_path / "run").exists()
