"""`moetune status` prints the daemon's text as given and whole at 80 columns; a reply that does not validate is one
line (or `{"ok": false}` with --json), never a traceback."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from moetune.runtime import wire
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import BadReply
from moetune.tuner.cli import app

DB = "/home/a-rather-long-user-name/.local/share/moetune/moetune.db"
ENDPOINT = "ipc:///run/user/1000/moetune/daemon.sock"


def _status(reason: str) -> wire.StatusResult:
    job = wire.JobInfo(id=3, state="done", reason=reason, message="wrote [bold]2[/bold] profiles")
    return wire.StatusResult(
        epoch="e", daemon_version="1", pid=42, uptime_s=3.0, db=DB, endpoint=ENDPOINT,
        pub_endpoint="ipc:///run/user/1000/moetune/events.sock", version=7, fingerprint="f" * 16,
        last_discovery="2026-12-05T09:00:00Z", last_discovery_ok=True, last_discovery_message="ok [/]",
        profiles_current=3, profiles_stale=0, requests=5,
        jobs=wire.JobsInfo(queued=[], running=None, recent=[job], capacity=4))


def _run(monkeypatch: pytest.MonkeyPatch, answer: Any, *args: str):
    def request(self: ProfileClient, op: str, **fields: Any) -> Any:
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ProfileClient, "request", request)
    r = CliRunner().invoke(app, list(args), env={"MOETUNE_CONFIG": "", "COLUMNS": "80"}, terminal_width=80)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


def test_status_prints_reasons_as_given_and_paths_whole(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A job reason holding '[/]' ended every `moetune status` in a Rich MarkupError traceback; '[bold]' restyled
    the line; the endpoint and database were cut with '…' at 80 columns."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    r = _run(monkeypatch, _status("fix the [/] rail"), "status")
    assert r.exit_code == 0, r.output
    assert "…" not in r.output
    text = " ".join(r.output.replace("│", " ").split())  # the cells' words in order (the table has two columns)
    assert "done: fix the [/] rail (wrote [bold]2[/bold] profiles)" in text and "ok [/]" in text, r.output
    assert ENDPOINT in text and DB in text.replace("/ ", "/"), r.output  # folded at a '/', never cut
    assert max(len(line) for line in r.output.splitlines()) <= 80


def test_status_lists_the_running_and_queued_jobs_with_their_reasons(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Only the finished jobs were listed, and the running and queued ones as counts: a job waiting for busy GPUs
    (its message "deferred: ...") and the reason a job was asked for (`retune --reason`, said to be listed by
    `status`) showed only with --json."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    st = _status("done earlier")
    run = wire.JobInfo(id=4, state="running", reason="fabric changed")
    wait = wire.JobInfo(id=5, state="queued", reason="operator test 42", message="deferred: other processes run")
    st = msgspec.structs.replace(st, jobs=msgspec.structs.replace(st.jobs, running=run, queued=[wait]))
    r = _run(monkeypatch, st, "status")
    text = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 0 and "running: 4, queued: 1/4" in text, r.output
    assert "job 4 running: fabric changed" in text and "job 5 queued: operator test 42 (deferred: other" in text
    assert text.index("job 4") < text.index("job 5") < text.index("job 3")


@pytest.mark.parametrize("json_out", [False, True])
@pytest.mark.parametrize("cmd", [["status"], ["retune", "--all"]])
def test_a_reply_that_does_not_validate_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path, cmd: list[str],
                                                    json_out: bool) -> None:
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    bad = BadReply("status result has unknown fields gpu_health (a newer daemon?)")
    r = _run(monkeypatch, bad, *cmd, *(["--json"] if json_out else []))
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    if json_out:
        d = json.loads(r.stdout)
        assert d["ok"] is False and "gpu_health" in d["error"]
    else:
        assert "not one this moetune reads: status result has unknown fields gpu_health" in " ".join(r.output.split())
