"""The lock a measuring run (`moetune profile`, `moetune tune`) holds on its database for as long as it runs.

Two such runs on one database at once both ran every stage: the microbenchmarks were stored twice, each study got
the trials of both runs, and both measured while competing for the same cores and GPUs. An exclusive flock on a
file beside the database (`lock_files.run_lock_path`; its holder's pid written in it) makes the second refuse at
once (exit 1). The kernel drops a flock when its process dies, kill -9 included: no stale lock is left to clear by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# the lock itself lives in the store layer (tuner/store/lock_files.py), where the daemon may take it too
from moetune.tuner.store.lock_files import RunBusy, release_run_lock, take_run_lock


def refuse_serving_daemon(db_path: str | Path) -> None:
    """Exit 1 when a daemon serves the database `db_path`: it is the single writer of its database (README), and a
    measuring run (`profile`, `tune`) writes facts, measurements and profiles behind its back (the daemon keeps
    serving what it loaded) while measuring on the GPUs its own re-tune jobs measure on. Checked before the database
    is opened: nothing written, no schema upgraded under the daemon."""
    from moetune.tuner.cli.db import abort, serving_daemon

    pid = serving_daemon(db_path)
    if pid is not None:
        abort(f"daemon pid {pid} is serving this database ({db_path}); stop it first (then start it again after this "
              "run), or let it re-tune with `moetune retune`", 1)


def hold_run_lock(db_path: str | Path, ctx: Any) -> None:
    """Take the run lock of `db_path` for the rest of the running command: released when its Typer context `ctx`
    closes (the command returned or failed; a CliRunner test runs the next one in the same process), else when the
    process ends. Exit 1 with the holder's pid when another run holds it."""
    from moetune.tuner.cli.db import abort
    from moetune.tuner.store.store import StoreError

    try:
        fd = take_run_lock(db_path)
    except RunBusy as e:
        refuse_serving_daemon(db_path)  # the holder is a daemon started since the first check (it holds this lock too)
        abort(str(e), e.exit_code)
    except StoreError as e:  # a missing folder that is not moetune's: the store's own refusal, said here
        abort(str(e), e.exit_code)
    if fd is not None:
        ctx.call_on_close(lambda: release_run_lock(db_path, fd))


def close_orphaned_runs(store: Any) -> None:
    """Under the run lock, once the store is open: the tuning runs a killed run left `running` (its owner gone) are
    marked `interrupted` (`Store.close_orphaned_runs`); a store that cannot be written says so (exit 1 where busy)."""
    from moetune.tuner.cli.db import abort
    from moetune.tuner.store.store import StoreError

    try:
        store.close_orphaned_runs()
    except StoreError as e:
        abort(str(e), e.exit_code)
