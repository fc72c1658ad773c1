"""The wire schemas: every bad request maps to a precise error code; replies and changes round-trip."""

from __future__ import annotations

import msgspec
import pytest

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord


@pytest.mark.parametrize(
    ("frame", "code", "rid"),
    [
        (b'{"v":1,"id":3,"op":"get_profile","ep_size":2}', wire.E_MISSING_FIELD, 3),
        (b'{"v":1,"id":"a","op":"get_profile","ep_size":"x","tokens":3}', wire.E_INVALID_FIELD, "a"),
        (b'{"v":1,"id":3,"op":"get_profile","ep_size":0,"tokens":3}', wire.E_INVALID_FIELD, 3),
        (b'{"v":1,"id":3,"op":"nope"}', wire.E_UNKNOWN_OP, 3),
        (b'{"v":2,"id":3,"op":"hello"}', wire.E_UNSUPPORTED_VERSION, 3),
        (b'{"id":3,"op":"hello"}', wire.E_MISSING_FIELD, 3),
        (b'{"v":1,"id":3}', wire.E_MISSING_FIELD, 3),
        (b'{"v":1,"id":3,"op":7}', wire.E_INVALID_FIELD, 3),
        (b'{"v":1,"id":3,"op":"hello","x":1}', wire.E_UNKNOWN_FIELD, 3),
        (b"[1,2]", wire.E_BAD_REQUEST, None),
        (b'"hello"', wire.E_BAD_REQUEST, None),
        (b'{"v":1', wire.E_BAD_JSON, None),
        (b"\xff\xfe\x00", wire.E_BAD_JSON, None),
        (b"", wire.E_BAD_JSON, None),
        (b'{"v":1,"id":true,"op":"hello"}', wire.E_INVALID_FIELD, None),
    ],
)
def test_bad_requests_get_codes(frame: bytes, code: str, rid: object) -> None:
    with pytest.raises(wire.WireError) as ei:
        wire.decode_request(frame)
    assert ei.value.code == code, ei.value.message
    assert ei.value.req_id == rid


def test_size_cap() -> None:
    frame = wire.encode_request("hello", 1, client="x" * 100)
    assert isinstance(wire.decode_request(frame, 1000), wire.Hello)
    with pytest.raises(wire.WireError) as ei:
        wire.decode_request(frame, 50)
    assert ei.value.code == wire.E_TOO_LARGE


def test_requests_and_replies_round_trip() -> None:
    req = wire.decode_request(wire.encode_request("get_profile", 9, ep_size=16, tokens=3000, model="qwen3-30b", nodes=2))
    assert isinstance(req, wire.GetProfile) and (req.ep_size, req.tokens, req.nodes, req.model) == (16, 3000, 2, "qwen3-30b")
    key = ProfileKey(fingerprint="f", software="s", transport_family="nvlink", ep_size=2, nodes=1, hidden=8,
                     intermediate=8, experts=4, topk=2, dtype="bfloat16", token_bucket=64)
    rec = ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.1, backend="model:x")
    res = wire.ProfileResult.from_record(rec, env={"NVSHMEM_REMOTE_TRANSPORT": "none"}, version=4)
    frame = wire.encode_ok(9, "ep0", res)
    rep = wire.reply_decoder.decode(frame)
    assert rep.ok and rep.id == 9 and rep.epoch == "ep0" and rep.error is None
    back = wire.decode_result("get_profile", rep.result)
    assert back.profile_hash == rec.profile_hash and back.knobs == rec.knobs and back.version == 4
    err = wire.reply_decoder.decode(wire.encode_error(None, "ep0", wire.E_BAD_JSON, "x"))
    assert not err.ok and err.error.code == wire.E_BAD_JSON
    # the reply shape on the wire: result XOR error
    assert set(msgspec.json.decode(frame)) == {"v", "id", "ok", "epoch", "result"}


def test_change_messages() -> None:
    ch = wire.Change(version=3, epoch="e", kind="profile_stale", fingerprint="f", profiles=["h"])
    frames = wire.encode_change(ch)
    assert frames[0] == b"profile_stale"
    assert wire.decode_change(frames) == ch
    with pytest.raises(msgspec.ValidationError):
        wire.change_decoder.decode(b'{"version":1,"epoch":"e","kind":"bogus"}')
