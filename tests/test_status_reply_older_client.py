"""A client refuses a reply with a field it does not know (`replies.decode_result`: "unknown fields ... (a newer
daemon?)"), so a field added to a result is left out of the wire while it holds its default (JobInfo's
`cancelling`, ProfileResult's UNSET fields): a client one version older then still reads a daemon's reply that says
nothing new. StatusResult's `profiles_not_served` (d5a2bfc) was sent always, 0 included: every `moetune status` of
a client one version older failed against a newer daemon ("status result has unknown fields profiles_not_served")."""

from __future__ import annotations

import msgspec
import pytest

from moetune.runtime import wire
from moetune.runtime.profiles.errors import BadReply
from moetune.runtime.profiles.replies import decode_reply, decode_result


def _status(**kw: object) -> wire.StatusResult:
    return wire.StatusResult(
        epoch="e", daemon_version="1", pid=42, uptime_s=3.0, db="/x/moetune.db", endpoint="ipc:///x/d.sock",
        pub_endpoint="ipc:///x/e.sock", version=7, fingerprint="f" * 16, last_discovery="t", last_discovery_ok=True,
        last_discovery_message="", profiles_current=3, profiles_stale=0, requests=5,
        jobs=wire.JobsInfo(queued=[], running=None, recent=[], capacity=4),
        provenance={"measured": 3, "node_model": 0, "preset": 0}, **kw)  # type: ignore[arg-type]


def _older_status_type() -> type:
    """StatusResult as the client before d5a2bfc defines it: without `profiles_not_served`."""
    fields = []
    for f in msgspec.structs.fields(wire.StatusResult):
        if f.name == "profiles_not_served":
            continue
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct("StatusResult", fields, kw_only=True)


def _as_read_by(frame: bytes) -> wire.StatusResult:
    return decode_result("status", decode_reply(frame).result)


def test_a_client_one_version_older_reads_a_status_with_nothing_unserved(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = wire.encode_ok(1, "e", _status(profiles_not_served=0))
    monkeypatch.setitem(wire.RESULT_TYPES, "status", _older_status_type())
    st = _as_read_by(frame)
    assert st.profiles_current == 3 and st.provenance == {"measured": 3, "node_model": 0, "preset": 0}
    # where there is something it cannot show, it says so (a newer daemon), as for every such field
    with pytest.raises(BadReply, match="unknown fields profiles_not_served"):
        _as_read_by(wire.encode_ok(1, "e", _status(profiles_not_served=2)))


def test_this_client_reads_the_count_and_an_older_daemon_s_reply_without_it() -> None:
    assert _as_read_by(wire.encode_ok(1, "e", _status(profiles_not_served=2))).profiles_not_served == 2
    older = msgspec.json.decode(wire.encode_ok(1, "e", _status()))
    older["result"].pop("profiles_not_served", None)  # a daemon from before d5a2bfc
    assert _as_read_by(msgspec.json.encode(older)).profiles_not_served == 0
