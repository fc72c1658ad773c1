"""`moetune serve` run in-process (CliRunner) sets up the daemon's logging for the rest of the process, on a stderr
CliRunner closes when the invoke returns: every later moetune.* record then printed '--- Logging error ---' and a
traceback into the next CliRunner's output (test_daemon_client's `--json` checks failed to decode it, only when
pytest-xdist's order under load put such a test first). conftest's autouse fixture puts the logger back after each
test; this checks the helper it uses."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logging_kept import moetune_logging_kept

from moetune.tuner.cli import app


class Stop(Exception):
    pass


def test_serve_in_process_leaves_no_logging_on_a_closed_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.daemon import server

    def no_daemon(**kw: Any) -> Any:
        raise Stop  # past setup_logging: nothing is served

    monkeypatch.setattr(server, "Daemon", no_daemon)
    lg = logging.getLogger("moetune")
    before = (list(lg.handlers), lg.level, lg.propagate)
    with moetune_logging_kept():
        r = CliRunner().invoke(app, ["serve", "--db", str(tmp_path / "m.db"), "--create",
                                     "--socket", f"ipc://{tmp_path}/run/d.sock"])
        assert isinstance(r.exception, Stop), r.output
        # the condition this guards against was made: the daemon's handler, on CliRunner's (now closed) stderr
        assert lg.handlers != before[0] and not lg.propagate
    assert (list(lg.handlers), lg.level, lg.propagate) == before
    # a client record after it, as a later command's lookup logs one: no logging error on the stderr of that moment
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        logging.getLogger("moetune.client").info("moetune: tuned profile %s: %s", "abc", "probe")
    assert "Logging error" not in err.getvalue(), err.getvalue()


def test_serve_in_process_leaves_the_optuna_logger_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """setup_logging also rewires the "optuna" logger (the daemon's JSON handler on CliRunner's stderr, INFO, no
    propagation, Optuna's own handler taken off): left so, a later test's studies logged every trial into a closed
    stream, whatever verbosity that test set. The helper puts back the handlers, level and propagation it found,
    whatever they were: here a state of the test's own, not Optuna's default."""
    pytest.importorskip("optuna")
    from moetune.tuner.daemon import server

    def no_daemon(**kw: Any) -> Any:
        raise Stop  # past setup_logging: nothing is served

    monkeypatch.setattr(server, "Daemon", no_daemon)
    lg = logging.getLogger("optuna")
    outer = (list(lg.handlers), lg.level, lg.propagate)
    mine = logging.NullHandler()
    try:
        lg.handlers[:], lg.propagate = [mine], True
        lg.setLevel(logging.ERROR)
        with moetune_logging_kept():
            r = CliRunner().invoke(app, ["serve", "--db", str(tmp_path / "m.db"), "--create",
                                         "--socket", f"ipc://{tmp_path}/run/d.sock"])
            assert isinstance(r.exception, Stop), r.output
            # the condition this guards against was made: the daemon's handler in place of ours, at INFO
            assert lg.handlers != [mine] and lg.level == logging.INFO and not lg.propagate
        assert lg.handlers == [mine] and lg.handlers[0] is mine
        assert (lg.level, lg.propagate) == (logging.ERROR, True)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            logging.getLogger("optuna.study").warning("probe after serve")
        assert "Logging error" not in err.getvalue(), err.getvalue()
    finally:  # the state this test set up, undone whether or not the helper did its part
        lg.handlers[:], lg.propagate = outer[0], outer[2]
        lg.setLevel(outer[1])
