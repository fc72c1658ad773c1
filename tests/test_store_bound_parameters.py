"""SQLite builds before 3.32 (RHEL 8's 3.26, ...) take at most 999 bound parameters in one statement; the store
batches every id list it puts in one IN (...) for them (import, the job recovery's events). `mark_stale` and
`restore_stale` took their `ids` whole, and the export its fingerprints: a daemon whose fabric changed under more
than 999 current profiles (models x EP sizes x buckets x families) got "too many SQL variables" from mark_stale,
kept its old facts and retried every round, for ever, serving the old fabric's profiles; an export of a database
with more than 999 fingerprints failed the same way. The limit is set on the store's connections here, as such a
build has it."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import TOKEN_BUCKETS, ProfileKey, ProfileRecord
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)
OLD_SQLITE_LIMIT = 999


def _old_sqlite(store: Store) -> None:
    """The store's connections from now on take at most 999 bound parameters, as SQLite < 3.32 does."""

    @event.listens_for(store.engine, "connect")
    def limit(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, OLD_SQLITE_LIMIT)

    store.engine.dispose()


def _key(fp: str, hidden: int, bucket: int) -> ProfileKey:
    return ProfileKey(fingerprint=fp, software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=hidden,
                      intermediate=8, experts=8, topk=2, dtype="bfloat16", token_bucket=bucket)


def _record(key: ProfileKey) -> ProfileRecord:
    return ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5, backend="model:t")


@pytest.fixture
def many(tmp_path: Path) -> Store:
    """A store of 1300 current profiles of one fingerprint (100 shapes x 13 buckets)."""
    s = Store(tmp_path / "m.db")
    with s.atomic():
        for h in range(1, 101):
            for b in TOKEN_BUCKETS:
                s.put_profile(_record(_key("F", h, b)))
    _old_sqlite(s)
    yield s
    s.close()


def test_the_limit_is_in_force(many: Store) -> None:
    with many.engine.connect() as conn, pytest.raises(Exception, match="too many SQL variables"):
        conn.exec_driver_sql(f"SELECT 1 WHERE 1 IN ({','.join('?' * 1000)})", tuple(range(1000)))


def test_mark_stale_and_restore_stale_take_more_ids_than_one_statement_holds(many: Store) -> None:
    ids = [i for i, _ in many.list_profiles(status="current", fingerprint="F")]
    assert len(ids) == 1300
    assert many.mark_stale(fingerprint="F", reason="fabric changed", ids=ids) == 1300
    assert many.count_profiles("current") == 0
    [ev] = many.list_events(kinds=("stale",))
    assert ev["details"]["profiles"] == 1300  # one event for the change, not one per batch
    assert many.restore_stale(fingerprint="F", reason="back", ids=ids) == 1300
    assert many.count_profiles("current") == 1300
    # only the rows named: ids past the first batch are not taken for others
    assert many.mark_stale(fingerprint="F", reason="some", ids=ids[600:]) == 700
    assert {i for i, _ in many.list_profiles(status="stale")} == set(ids[600:])


def test_an_export_of_more_fingerprints_than_one_statement_holds(tmp_path: Path) -> None:
    s = Store(tmp_path / "f.db")
    with s.atomic():
        for n in range(1001):
            s.upsert_fingerprint(f"fp{n:04d}", {}, origin="import")
            s.put_profile(_record(_key(f"fp{n:04d}", 1, 16)))
    _old_sqlite(s)
    doc = json.loads(s.dump_profiles())
    assert len(doc["profiles"]) == 1001 and len(doc["fingerprints"]) == 1001
    s.close()
