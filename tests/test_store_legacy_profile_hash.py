"""Rows stored before the knobs staging_slots, wait_mode and combine_lanes existed (commit ab0bc7bc) carry a
profile_hash computed without them: unlike the megakernel knobs, they are not left out of `Knobs.canonical()` at
their defaults, so today's code hashes the same key and knobs to another value. Stored hashes are never rewritten
(migrations and the downgrade events of migrations/_kept.py name rows by them); the readers that compare a stored
hash with a computed one accept both forms. Each test builds such an old row (its hash and knobs JSON as that moetune
wrote them) and checks one reader."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import msgspec
import pytest

from moetune.runtime.knobs import Knobs, default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, profile_hash_of, stored_profile_hashes
from moetune.tuner.store.store import Store

# the knobs ab0bc7bc added, hashed from then on even at their defaults
LATE = ("staging_slots", "wait_mode", "combine_lanes")


def key(fp: str = "fp", software: str = "sw", family: str = "nvlink") -> ProfileKey:
    return ProfileKey(fingerprint=fp, software=software, transport_family=family, ep_size=2, nodes=1, hidden=7168,
                      intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=128)


def old_hash(k: ProfileKey, knobs: Knobs) -> str:
    """The hash a moetune from before ab0bc7bc stored: today's canonical knobs less the three, at their defaults."""
    canon = knobs.canonical()
    defaults = Knobs().to_dict()
    assert all(canon[n] == defaults[n] for n in LATE), "no old row can hold these knobs away from their defaults"
    payload = {"key": k.to_dict(), "knobs": {n: v for n, v in canon.items() if n not in LATE}}
    return hashlib.sha256(msgspec.json.encode(payload, order="sorted")).hexdigest()[:16]


def make_old(db: Path, rec: ProfileRecord) -> int:
    """Store `rec`, then make its row what the old moetune wrote: the old hash, the knobs JSON without the three."""
    with Store(db) as s:
        assert s.put_profile(rec)[0]
        pid = max(i for i, _r in s.list_profiles())
    h = old_hash(rec.key, rec.knobs)
    assert h != profile_hash_of(rec.key, rec.knobs)  # the doubt itself: the two forms differ
    knobs = {n: v for n, v in rec.knobs.canonical().items() if n not in LATE}
    with sqlite3.connect(db) as con:
        con.execute("UPDATE profiles SET profile_hash = ?, knobs = ? WHERE id = ?", (h, json.dumps(knobs), pid))
    con.close()
    return pid


def stored_hashes(db: Path) -> list[str]:
    con = sqlite3.connect(db)
    try:
        return [h for (h,) in con.execute("SELECT profile_hash FROM profiles ORDER BY id")]
    finally:
        con.close()


def measured(lat: float, spread: float = 1.0, **kw) -> ProfileRecord:
    return ProfileRecord(key=key(**kw), knobs=default_knobs("nvlink"), latency_us=lat, spread_us=spread,
                         backend="local:nccl", provenance="measured", measured_on=kw.get("fp", "fp"))


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "old.db"


def test_old_row_reads_back_as_the_same_knobs(db):
    make_old(db, measured(100.0))
    with Store(db) as s:
        (_i, rec), = s.list_profiles()
    assert rec.knobs == default_knobs("nvlink")


def test_remeasurement_of_an_old_rows_knobs_replaces_its_number(db):
    """The gate (`_rows.decide`) tells the same knobs re-measured by the hash: an old row's slower re-measurement was
    taken for other knobs ("slower", kept), so the stale fast number stood for good."""
    old_id = make_old(db, measured(100.0))
    with Store(db) as s:
        ok, why = s.put_profile(measured(150.0, spread=2.0))
        assert ok, why
        assert "same knobs re-measured" in why
        assert s.get_current(key()).latency_us == 150.0
        ev = s.list_events(kinds=("remeasured",))
        assert len(ev) == 1 and ev[0].details["from"]["profile"] == old_id
        # the same numbers again: nothing written
        ok, why = s.put_profile(measured(150.0, spread=2.0))
        assert not ok and "same numbers" in why


def test_import_of_an_older_record_of_an_old_rows_knobs_keeps_the_stored_number(db):
    """An import of the same knobs measured before the stored (old) row: the stored number is the newer one, kept,
    even where the imported number is faster (it was compared as other knobs and replaced the newer one)."""
    make_old(db, measured(100.0, spread=1.0))
    earlier = msgspec.structs.replace(measured(50.0), created="2020-01-01T00:00:00+00:00",
                                      updated="2020-01-01T00:00:00+00:00")
    with Store(db) as s:
        doc = json.loads(s.dump_profiles()) | {"profiles": [msgspec.to_builtins(earlier)]}
        got = s.import_bytes(json.dumps(doc).encode())
        assert (got.inserted, got.replaced, got.kept_superseded) == (1, 0, 1), got
        assert s.get_current(key()).latency_us == 100.0


def test_only_a_setting_that_existed_then_has_the_old_form():
    """The old form exists only where the three knobs sit at their defaults (their only values then), and it is
    never today's hash of other knobs."""
    k, knobs = key(), default_knobs("nvlink")
    assert stored_profile_hashes(k, knobs) == (profile_hash_of(k, knobs), old_hash(k, knobs))
    hs = default_knobs("host_staged")
    assert len(stored_profile_hashes(key(family="host_staged"), hs.replace(staging_slots=8))) == 1
    assert len(stored_profile_hashes(key(family="host_staged"), hs.replace(wait_mode="kernel"))) == 1
    assert len(stored_profile_hashes(key(family="collective"), default_knobs("collective").replace(combine_lanes="own"))) == 1


def test_export_import_round_trip_of_an_old_row_stores_nothing(db):
    """Importing a database's own export skips what it holds: an old row was not recognised (its stored hash is
    not today's), so the round trip stored a copy as superseded history every time."""
    make_old(db, measured(100.0))
    with Store(db) as s:
        data = s.dump_profiles()
        for _ in range(2):
            got = s.import_bytes(data)
            assert (got.inserted, got.kept_superseded, got.skipped) == (0, 0, 1), got
        assert len(s.list_profiles()) == 1
    assert len(stored_hashes(db)) == 1


def test_stored_hashes_are_left_as_written(db):
    """The readers are tolerant; nothing rewrites an old row's hash (downgrade events name rows by it)."""
    make_old(db, measured(100.0))
    before = stored_hashes(db)
    with Store(db) as s:
        s.import_bytes(s.dump_profiles())
    assert stored_hashes(db) == before


def test_query_reads_an_old_rows_measured_on_and_backend(db, tmp_path):
    """`query` reads measured_on and backend from the database row of the served key and hash
    (`Store.provenance_of`): an old row was not found by today's hash, so `query` printed no measured_on and could
    not tell whether a preset was the shipped one."""
    from typer.testing import CliRunner

    from moetune.runtime.shapes import get_model
    from moetune.tuner.cli import app

    m = get_model("qwen3-30b")
    k = ProfileKey(fingerprint="preset:nvlink-h200x2", software="modelled", transport_family="collective", ep_size=2,
                   nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts, topk=m.topk, dtype=m.dtype,
                   token_bucket=128)
    make_old(db, ProfileRecord(key=k, knobs=default_knobs("collective"), latency_us=5.0, spread_us=0.1,
                               backend="model:nvlink-h200x2"))
    with Store(db, readonly=True) as s:
        rec = s.get_current(k)
        want = ("preset", "preset:nvlink-h200x2", "model:nvlink-h200x2")
        assert s.provenance_of(k, rec.profile_hash) == want
        assert s.provenance_of(k, "0123456789abcdef") is None  # another hash is still no row of it
    cfg = tmp_path / "client.toml"
    cfg.write_text("[client]\nallow_modelled = true\n")
    r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--db", str(db),
                                 "--socket", f"ipc://{tmp_path}/none.sock", "--timeout-ms", "100", "--json",
                                 "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    # stdout alone, and all of it: one JSON document (Result.output also holds stderr, where a log line is allowed)
    out = json.loads(r.stdout)
    assert (out["source"], out["provenance"], out["measured_on"]) == ("database", "preset", "preset:nvlink-h200x2")
    assert out["profile_hash"] == rec.profile_hash


def test_provenance_of_a_row_with_unreadable_knobs_goes_by_its_stored_hash(db):
    rec = measured(100.0)
    pid = make_old(db, rec)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE profiles SET knobs = '{not json' WHERE id = ?", (pid,))
    con.close()
    with Store(db, readonly=True) as s:
        assert s.provenance_of(key(), old_hash(rec.key, rec.knobs)) == ("measured", "fp", "local:nccl")
        assert s.provenance_of(key(), rec.profile_hash) is None
        assert s.provenance_of(key()) == ("measured", "fp", "local:nccl")


def test_daemon_reply_and_database_fallback_never_read_the_stored_hash(db):
    """Not affected, kept so: a daemon's reply carries the hash of the record it read (`wire.ProfileResult.from_record`:
    `ProfileRecord.profile_hash`, computed from key and knobs), which is what the client checks it against
    (`replies.reply_problem`); the runtime's read-only fallback does not select the column at all."""
    from moetune.runtime import wire
    from moetune.runtime.profiles.db_lookup import query_db_profiles
    from moetune.runtime.profiles.replies import reply_problem

    rec = measured(100.0)
    make_old(db, rec)
    with Store(db, readonly=True) as s:
        got = s.get_current(key())
    reply = wire.ProfileResult.from_record(got, env={})
    assert reply.profile_hash == rec.profile_hash != stored_hashes(db)[0]
    assert reply_problem(reply, model=None, ep_size=2, tokens=128, nodes=1, transport_family="nvlink") is None
    k = key()
    (fallback,) = query_db_profiles(db, ep_size=2, nodes=1, hidden=k.hidden, intermediate=k.intermediate,
                                    experts=k.experts, topk=k.topk, dtype=k.dtype)
    assert fallback.knobs == rec.knobs and fallback.profile_hash == rec.profile_hash
