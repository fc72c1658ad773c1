"""A stored setting holds every knob, and two megakernel knobs changed their defaults after settings were stored with
them: mk_combine_tokens 8 until 579f2ce (2026-12-04), mk_split_k 2 from 7100c28 to 8035abb (2026-12-02). A transport
profile stored then holds the old default, which the runtime never read for it and which today's validation refuses
on a setting that is not the megakernel's ("megakernel settings only apply with engine=megakernel"): the row read as
invalid and was skipped by every lookup, list and export, and by the runtime's read of the database; an export file
of that time was refused on import. Such a value is read as today's default (`knobs.stored_form`), and the profile's
hash is the one stored then (the old default was left out of the hash then, today's default is left out now)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import msgspec
import pytest

from moetune.runtime.knobs import MK_KNOBS, Knobs, default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, profile_hash_of
from moetune.runtime.profiles.db_lookup import query_db_profiles
from moetune.tuner.store import io
from moetune.tuner.store.store import Store

OLD = {"mk_combine_tokens": 8, "mk_split_k": 2}  # the defaults between 7100c28 and 8035abb


def _key() -> ProfileKey:
    return ProfileKey(fingerprint="fp", software="sw", transport_family="collective", ep_size=2, nodes=1, hidden=7168,
                      intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=128)


def _old_hash(key: ProfileKey, knobs: dict) -> str:
    """The hash that moetune stored: every knob, less the megakernel's at ITS defaults."""
    then = {**Knobs().to_dict(), **OLD}
    canon = {n: v for n, v in knobs.items() if not (n in MK_KNOBS and v == then[n])}
    return hashlib.sha256(msgspec.json.encode({"key": key.to_dict(), "knobs": canon}, order="sorted")).hexdigest()[:16]


@pytest.fixture
def old_db(tmp_path: Path) -> tuple[Path, dict]:
    """A database whose one profile is a collective setting as that moetune wrote it."""
    db = tmp_path / "m.db"
    rec = ProfileRecord(key=_key(), knobs=default_knobs("collective"), latency_us=100.0, spread_us=1.0,
                        backend="local:nccl", provenance="measured", measured_on="fp")
    with Store(db) as s:
        assert s.put_profile(rec)[0]
    knobs = {**rec.knobs.to_dict(), **OLD}
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE profiles SET knobs = ?, profile_hash = ?", (json.dumps(knobs), _old_hash(rec.key, knobs)))
    con.close()
    return db, knobs


def test_a_transport_row_holding_a_former_megakernel_default_reads_back(old_db) -> None:
    db, knobs = old_db
    with Store(db) as s:
        assert s.unreadable_profiles() == []
        rec = s.get_current(_key())
        assert rec is not None and rec.knobs == default_knobs("collective")
        assert profile_hash_of(rec.key, rec.knobs) == _old_hash(rec.key, knobs)  # the stored hash stands
        assert len(s.list_profiles()) == 1


def test_the_runtimes_read_of_the_database_takes_it(old_db) -> None:
    db, _ = old_db
    got = query_db_profiles(db, ep_size=2, nodes=1, hidden=7168, intermediate=2048, experts=256, topk=8,
                            dtype="bfloat16", fingerprint="fp", transport_family="collective")
    assert [r.latency_us for r in got] == [100.0]


def test_an_export_file_of_that_time_imports(old_db, tmp_path: Path) -> None:
    db, knobs = old_db
    with Store(db) as s:
        doc = json.loads(io.dump_profiles(s))
    doc["profiles"][0]["knobs"] = knobs  # as that moetune exported it: every knob, the old defaults among them
    parsed = io.parse_export(json.dumps(doc).encode())
    assert [p.knobs for p in parsed.profiles] == [default_knobs("collective")]


def test_a_megakernel_setting_keeps_what_it_holds(tmp_path: Path) -> None:
    """On the megakernel's own setting the value is the one it ran with (8 tokens a combine tile is still 8)."""
    from moetune.runtime.knobs import stored_form

    mk = {**default_knobs("collective").to_dict(), "engine": "megakernel", **OLD}
    assert stored_form(mk) == mk
    assert Knobs.from_stored(mk).mk_combine_tokens == 8


def test_a_megakernel_rows_re_measurement_is_the_same_knobs(tmp_path: Path) -> None:
    """A megakernel profile stored while 8 was mk_combine_tokens' default (until 579f2ce) holds 8, which its hash left
    out then (a megakernel knob at its default) and today's hash covers: the store took a re-measurement of those very
    knobs for other knobs (`_rows.decide` compares the stored hash with `stored_profile_hashes`), so a slower re-tune of
    the same setting was 'kept' and the stale fast number stood. Every form such a row may carry is accepted now."""
    from moetune.runtime.profile_record import stored_profile_hashes

    key = msgspec.structs.replace(_key(), transport_family="megakernel", ep_size=1)
    knobs = Knobs(engine="megakernel", mk_bm=16, mk_combine_tokens=8)

    def measured(lat: float) -> ProfileRecord:
        return ProfileRecord(key=key, knobs=knobs, latency_us=lat, spread_us=1.0, backend="local:megakernel",
                             provenance="measured", measured_on="fp")

    db = tmp_path / "m.db"
    with Store(db) as s:
        assert s.put_profile(measured(100.0))[0]
    then = {**Knobs().to_dict(), "mk_combine_tokens": 8}  # the defaults of that time (mk_split_k 1 since 8035abb)
    canon = {n: v for n, v in knobs.to_dict().items() if not (n in MK_KNOBS and v == then[n])}
    old = hashlib.sha256(msgspec.json.encode({"key": key.to_dict(), "knobs": canon}, order="sorted")).hexdigest()[:16]
    assert old != profile_hash_of(key, knobs)  # the doubt itself
    assert old in stored_profile_hashes(key, knobs)
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE profiles SET profile_hash = ?", (old,))
    con.close()
    with Store(db) as s:
        ok, why = s.put_profile(measured(150.0))
        assert ok and "same knobs re-measured" in why, why
        assert s.get_current(key).latency_us == 150.0
    # today's and the pre-HASHED_LATE_KNOBS form, each with and without the former default; none for another value
    assert len(stored_profile_hashes(key, knobs)) == 4
    assert len(stored_profile_hashes(key, knobs.replace(mk_combine_tokens=2))) == 2


@pytest.mark.parametrize("former", sorted(OLD))
def test_a_former_default_form_is_not_another_rows_todays_hash(tmp_path: Path, former: str) -> None:
    """The form of a megakernel setting without its former default (mk_combine_tokens 8, mk_split_k 2) is today's hash
    of the setting at today's default of that knob: another setting. A stored row of today's default and a new best
    that holds the former value (a re-tune choosing mk_combine_tokens 8) are other knobs, compared by their numbers:
    a slower new best keeps the stored row out of being replaced as 'the same knobs re-measured'."""
    key = msgspec.structs.replace(_key(), transport_family="megakernel", ep_size=1)
    today = Knobs(engine="megakernel", mk_bm=16)
    other = today.replace(**{former: OLD[former]})

    def measured(knobs: Knobs, lat: float) -> ProfileRecord:
        return ProfileRecord(key=key, knobs=knobs, latency_us=lat, spread_us=1.0, backend="local:megakernel",
                             provenance="measured", measured_on="fp")

    with Store(tmp_path / "m.db") as s:
        assert s.put_profile(measured(today, 100.0))[0]
        ok, why = s.put_profile(measured(other, 150.0))
        assert not ok and "same knobs" not in why, why
        assert s.get_current(key).knobs == today


def test_a_hash_names_its_own_row_not_one_holding_a_former_default(tmp_path: Path) -> None:
    """`provenance_of(key, hash)` (what `moetune query` labels a served profile with) finds the row of that hash: a row
    holding mk_combine_tokens 8 stored today carries today's hash with 8, and the form without it is another setting's
    (mk_combine_tokens 0) today's hash, which named the row of 8 where it came first."""
    key = msgspec.structs.replace(_key(), transport_family="megakernel", ep_size=1)
    today = Knobs(engine="megakernel", mk_bm=16)
    other = today.replace(mk_combine_tokens=8)
    with Store(tmp_path / "m.db") as s:
        # the setting of today's default, modelled (superseded), then the one of 8, measured (current)
        assert s.put_profile(ProfileRecord(key=key, knobs=today, latency_us=100.0, spread_us=1.0,
                                           backend="model:node:fp", provenance="node_model", measured_on="fp"))[0]
        assert s.put_profile(ProfileRecord(key=key, knobs=other, latency_us=150.0, spread_us=1.0,
                                           backend="local:megakernel", provenance="measured", measured_on="fp"))[0]
        assert s.provenance_of(key, profile_hash_of(key, other))[0] == "measured"
        assert s.provenance_of(key, profile_hash_of(key, today))[0] == "node_model"
