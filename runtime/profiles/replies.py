"""Checking the daemon's replies before the client uses them: the envelope, the typed result, and whether a
get_profile reply answers the request it was sent for.

A reply that does not validate (not JSON, wrong types, another protocol version, unknown fields: a newer daemon)
is `BadReply`, which the fallback chain treats like a silent daemon; so is one that does not answer the request
(`reply_problem`). `ProfileClient` and `TrackedProfile` make the same checks of the same reply.
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi

from moetune.runtime import wire
from moetune.runtime.knobs import KnobError
from moetune.runtime.options import data_path_problem
from moetune.runtime.profile_record import ENGINE_FAMILIES, nearest_bucket_within, profile_hash_of
from moetune.runtime.profiles.errors import BadReply
from moetune.runtime.profiles.perf_env import perf_env_problem
from moetune.runtime.shapes import ModelShape

__all__ = ["decode_reply", "decode_result", "reply_problem"]


def _unknown_fields(obj: Any, t: Any, path: str = "") -> list[str]:
    """Keys of `obj` (decoded JSON) that type `t` (msgspec.inspect) does not define, recursively."""
    if isinstance(t, mi.StructType) and isinstance(obj, dict):
        known = {f.encode_name: f for f in t.fields}
        out = [f"{path}{k}" for k in obj if k not in known]
        for k, f in known.items():
            if k in obj:
                out += _unknown_fields(obj[k], f.type, f"{path}{k}.")
        return out
    if isinstance(t, mi.ListType) and isinstance(obj, list):
        return [u for i, x in enumerate(obj) for u in _unknown_fields(x, t.item_type, f"{path}{i}.")]
    if isinstance(t, mi.UnionType):
        return [u for sub in t.types for u in _unknown_fields(obj, sub, path)]
    return []


_REPLY_INFO = mi.type_info(wire.RawReply)


def decode_reply(frame: bytes) -> wire.RawReply:
    """The reply envelope; BadReply when it is not JSON, has wrong types, unknown fields or another version."""
    try:
        rep = wire.reply_decoder.decode(frame)
        unknown = _unknown_fields(msgspec.json.decode(frame), _REPLY_INFO)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:  # RecursionError: nested too deep
        raise BadReply(f"reply does not validate: {e}") from None
    if rep.v != wire.PROTOCOL_VERSION:
        raise BadReply(f"reply of protocol version {rep.v}, this runtime speaks {wire.PROTOCOL_VERSION} "
                       "(version skew: upgrade the daemon and the runtime together)")
    if unknown:
        raise BadReply(f"reply has unknown fields {', '.join(unknown[:5])} (a newer daemon?)")
    return rep


def decode_result(op: str, raw: msgspec.Raw) -> Any:
    try:
        res = wire.decode_result(op, raw)
        unknown = _unknown_fields(msgspec.json.decode(raw), mi.type_info(wire.RESULT_TYPES[op]))
    except (msgspec.DecodeError, msgspec.ValidationError, KnobError, ValueError, TypeError, RecursionError) as e:
        raise BadReply(f"{op} result does not validate: {e}") from None
    if unknown:
        raise BadReply(f"{op} result has unknown fields {', '.join(unknown[:5])} (a newer daemon?)")
    return res


def _reply_mismatch(r: wire.ProfileResult, *, model: ModelShape | None, ep_size: int, tokens: int, nodes: int,
                    transport_family: str | None) -> str | None:
    """Why a get_profile reply does not answer the request sent (None when it does).

    Only what the daemon's lookup can legitimately return passes: the asked key, a current profile, a token
    bucket within one rung of the asked tokens (`nearest_bucket_within`, as the daemon picks), and an engine
    family only when one was asked for. `model` None: the shape is not compared (a tracked query whose model name
    this client cannot parse; the daemon answered it, so it knows the name)."""
    k = r.key
    # the names a request carries are at most NAME_MAX long, the key's are looked up by them: a longer one is not a
    # served profile's (and would be repeated whole in messages and the client's per-process identity memo)
    for name in ("fingerprint", "software", "transport_family", "dtype"):
        if len(getattr(k, name)) > wire.NAME_MAX:
            return f"key {name} is {len(getattr(k, name))} characters long, more than a request may name ({wire.NAME_MAX})"
    if r.status != "current":
        return f"profile status is {r.status!r}, not 'current'"
    want: dict[str, Any] = {"ep_size": ep_size, "nodes": nodes}
    if model is not None:
        want.update(hidden=model.hidden, intermediate=model.intermediate, experts=model.experts, topk=model.topk,
                    dtype=model.dtype)
    for name, value in want.items():
        if getattr(k, name) != value:
            return f"key {name} is {str(getattr(k, name))[:64]!r}, the request asked for {value!r}"
    if transport_family is not None and k.transport_family != transport_family:
        return f"transport family {k.transport_family[:64]!r}, the request asked for {transport_family!r}"
    if transport_family is None and k.transport_family in ENGINE_FAMILIES:
        return f"engine family {k.transport_family!r}, which is served only when asked for"
    if nearest_bucket_within(tokens, [k.token_bucket]) != k.token_bucket:
        return f"token bucket {k.token_bucket} is not one the daemon picks for {tokens} tokens"
    return None


def reply_problem(r: wire.ProfileResult, **request: Any) -> str | None:
    """Why a get_profile reply must not be used (None when it may): it does not answer the request
    (`_reply_mismatch`), its profile_hash is not the hash of its key and knobs (what the store keys a profile by;
    ranks and hosts compare it to agree on one profile), or its recorded perf_env holds more than performance
    variables (forged), or its recorded runtime_options are not data-path options as this moetune records them."""
    mismatch = _reply_mismatch(r, **request)
    if mismatch is not None:
        return f"reply does not answer the request: {mismatch}"
    want = profile_hash_of(r.key, r.knobs)
    if r.profile_hash != want:
        return (f"reply's profile_hash {r.profile_hash[:64]!r} is not the hash of its key and knobs ({want}): "
                "not a profile a daemon stores")
    bad_env = None if r.perf_env is msgspec.UNSET else perf_env_problem(dict(r.perf_env))
    if bad_env is not None:
        return f"reply's perf_env does not validate: {bad_env}"
    bad_opts = None if r.runtime_options is msgspec.UNSET else data_path_problem(dict(r.runtime_options))
    return None if bad_opts is None else f"reply's runtime_options do not validate: {bad_opts}"
