"""A stored row whose knobs or key contradict its family (what `db check` names: `key_knobs_problem`) is never
served: the daemon's index passes over it as over a missing row and its not-found reason says why; the runtime's
read-only database lookup passes over it too (a daemon reply carrying one likewise) and falls back, its warning
naming it; so does the tuner's `Store.find_profile`. `db check` still reports it
(tests/test_store_key_knobs_contradiction.py)."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_trust_client import _local_facts, _seed_db, fake, key, ok_reply, resolve, result  # noqa: F401 (fixture)

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileRecord
from moetune.runtime.profiles import node_identity
from moetune.tuner.daemon.index import ProfileIndex

pytestmark = pytest.mark.timeout(120)


def _measured(k: object, **knobs: object) -> ProfileRecord:
    return ProfileRecord(key=k, knobs=default_knobs("nvlink").replace(**knobs), latency_us=5.0, spread_us=0.1,
                         backend="local:nccl", provenance="measured", measured_on=k.fingerprint)  # type: ignore[attr-defined]


def _lookup(idx: ProfileIndex, tokens: int) -> tuple[bool, object]:
    return idx.lookup(wire.GetProfile(v=wire.PROTOCOL_VERSION, id=1, ep_size=2, tokens=tokens, model="qwen3-30b",
                                      fingerprint="fp", software="sw"))


def test_daemon_index_passes_over_a_contradicting_row() -> None:
    odd = _measured(key("fp", "sw", bucket=64), engine="megakernel")  # a transport key naming the megakernel engine
    idx = ProfileIndex([odd], version=1, facts=SimpleNamespace(fingerprint="fp", software_hash="sw"), stale=[])
    ok, (code, msg) = _lookup(idx, 64)  # type: ignore[misc]
    assert not ok and code == wire.E_NOT_FOUND
    assert odd.profile_hash in msg and "contradict its family" in msg and "knobs.engine" in msg
    # a sound row a bucket away is served instead, as for a missing row
    sound = _measured(key("fp", "sw", bucket=128), num_sms=32)
    idx = ProfileIndex([odd, sound], version=1, facts=SimpleNamespace(fingerprint="fp", software_hash="sw"), stale=[])
    ok, raw = _lookup(idx, 64)
    assert ok, raw
    assert wire.decode_result("get_profile", raw).profile_hash == sound.profile_hash  # type: ignore[arg-type]


def test_daemon_index_passes_over_a_what_if_row_for_a_runnable_one() -> None:
    """A what-if row (proxy at EP 16 over 2 nodes: no run of this runtime takes it) modelled faster than a runnable
    collective row of the same group is not what the daemon hands out (the client would refuse it and leave the daemon
    for its database); with nothing else, the not-found reply says why it was passed over."""
    facts = SimpleNamespace(fingerprint="fp", software_hash="sw")

    def rec(family: str, latency: float) -> ProfileRecord:
        k = key("fp", "sw", family=family, bucket=64, nodes=2)
        k = k.__class__(**{**{f: getattr(k, f) for f in k.__struct_fields__}, "ep_size": 16})
        return ProfileRecord(key=k, knobs=default_knobs(family.split(":")[0]), latency_us=latency, spread_us=0.1,
                             backend="model:node:fp", provenance="node_model", measured_on="fp")

    what_if, runnable = rec("proxy:ibrc", 1.0), rec("collective", 9.0)
    req = wire.GetProfile(v=wire.PROTOCOL_VERSION, id=1, ep_size=16, nodes=2, tokens=64, model="qwen3-30b",
                          fingerprint="fp", software="sw")
    ok, raw = ProfileIndex([what_if, runnable], version=1, facts=facts, stale=[]).lookup(req)
    assert ok, raw
    assert wire.decode_result("get_profile", raw).profile_hash == runnable.profile_hash  # type: ignore[arg-type]
    ok, (code, msg) = ProfileIndex([what_if], version=1, facts=facts, stale=[]).lookup(req)  # type: ignore[misc]
    assert not ok and code == wire.E_NOT_FOUND
    assert what_if.profile_hash in msg and "what-if only" in msg


def test_database_lookup_passes_over_a_contradicting_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    facts = _local_facts()
    F.pretend_node(monkeypatch, facts, tmp_path / "proc")
    sw, fp = node_identity.software_hash(facts), "c" * 16
    db = tmp_path / "moetune.db"
    _seed_db(db, {"_fp": fp, "facts": facts}, [_measured(key(fp, sw, bucket=64), num_sms=32)])
    nowhere = f"ipc://{tmp_path}/nowhere/daemon.sock"
    res, _ = resolve(nowhere, tmp_path, db_path=db)
    assert res.source == "database" and res.tuned  # the sound row is served
    con = sqlite3.connect(db)
    with con:  # as an older moetune's import stored it: `db check` names it
        knobs = json.loads(con.execute("SELECT knobs FROM profiles").fetchone()[0])
        con.execute("UPDATE profiles SET knobs = ?", (json.dumps({**knobs, "engine": "megakernel"}),))
    con.close()
    res, warned = resolve(nowhere, tmp_path, db_path=db)
    assert res.source in ("policy", "default") and not res.tuned, res
    assert len(warned) == 1 and "contradict its family" in warned[0] and "knobs.engine" in warned[0], warned


def test_a_daemon_reply_carrying_a_contradicting_profile_is_passed_over(fake, tmp_path: Path) -> None:  # noqa: F811
    """A daemon of an older moetune (or another tool) may still serve such a row: the client passes it over."""
    sound = result(knobs=default_knobs("nvlink").replace(num_sms=40))
    res, _ = resolve(fake(lambda req: ok_reply(req["id"], sound)).endpoint, tmp_path)
    assert res.source == "daemon" and res.tuned  # the same reply, sound, is applied
    odd = result(knobs=default_knobs("nvlink").replace(engine="megakernel"))
    res, warned = resolve(fake(lambda req: ok_reply(req["id"], odd), run=tmp_path / "run2").endpoint, tmp_path)
    assert res.source in ("policy", "default") and not res.tuned, res
    assert any("contradict its family" in w and "knobs.engine" in w for w in warned), warned


def test_store_find_profile_passes_over_a_contradicting_row(tmp_path: Path) -> None:
    """`Store.find_profile`, the lookup the README gives for Python (and that the daemon's index and the client's
    database fallback pick as), passes over such a row as they do: the sound row a bucket away is the answer, and
    with none, nothing is (the caller falls back). It returned the contradicting row."""
    from moetune.tuner.store.store import Store

    facts = _local_facts()
    fp, sw = "c" * 16, "s" * 16
    db = tmp_path / "moetune.db"
    _seed_db(db, {"_fp": fp, "facts": facts}, [_measured(key(fp, sw, bucket=64), num_sms=32),
                                                _measured(key(fp, sw, bucket=128), num_sms=24)])
    con = sqlite3.connect(db)
    with con:  # as an older moetune's import stored it: `db check` names it
        row_id, raw = con.execute("SELECT id, knobs FROM profiles WHERE token_bucket = 64").fetchone()
        con.execute("UPDATE profiles SET knobs = ? WHERE id = ?", (json.dumps({**json.loads(raw), "engine": "megakernel"}),
                                                                  row_id))
    con.close()
    k = key(fp, sw)
    args = dict(fingerprint=fp, software=sw, ep_size=k.ep_size, nodes=k.nodes, hidden=k.hidden,
                intermediate=k.intermediate, experts=k.experts, topk=k.topk, dtype=k.dtype)
    with Store(db) as s:
        for family in ("nvlink", None):
            got = s.find_profile(**args, tokens=64, transport_family=family)
            assert got is not None and got.key.token_bucket == 128 and got.knobs.engine != "megakernel", (family, got)
        assert s.find_profile(**args, tokens=64, max_bucket_steps=0) is None
