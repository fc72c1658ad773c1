"""The runtime's database fallback reads what it needs, with the same answers.

This node's identity (`db_lookup.node_identity_from_db`) is the newest recorded fingerprint whose facts match the node,
but the fallback read every fingerprint row's facts (~24 KB each) first: 14 ms of the lookup's 200 ms budget with
100 older fingerprints, 63 ms with 500 (measured alternately in one process on a 2-core machine). It now orders the
rows by their small columns and reads the facts one row at a time, up to the first that matches (about 4 and 13 ms:
SQLite still walks the rows to order them). The profiles of one transport family, when one is asked for, are selected
in SQL instead of parsed and then dropped. Same identity, same reasons, same records.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import PRESET_PREFIX, ProfileKey, ProfileRecord
from moetune.runtime.profiles import db_lookup, node_identity, sqlite_open
from moetune.runtime.shapes import MODELS

HERE = {"gpus": [], "software": {"driver": "none", "torch": "2.4.1", "moetune": "0.1.0"}}
QWEN = MODELS["qwen3-30b"]
# one query of every row, facts included, sorted: the reading the fallback must not need
ALL_ROWS = ("SELECT hash, facts, last_seen FROM fingerprints WHERE hash NOT LIKE ? AND facts IS NOT NULL AND "
            "trim(facts) NOT IN ('', '{}', 'null') ORDER BY last_seen DESC, rowid DESC")


def _other(i: int) -> dict:
    return {"gpus": [], "software": {**HERE["software"], "torch": f"0.{i}"},
            "nics": [{"name": f"mlx5_{j}", "guid": "x" * 200} for j in range(20)]}


def _seed(db: Path, rows: list[tuple[str, Any, str]]) -> None:
    """Fingerprint rows (hash, facts, last_seen) written as the store writes them, then their last_seen set."""
    store = F.open_store(db)
    for fp, facts, _seen in rows:
        store.upsert_fingerprint(fp, facts if isinstance(facts, dict) else {}, origin="local")
    store.close()
    con = sqlite3.connect(db)
    for fp, facts, seen in rows:
        con.execute("UPDATE fingerprints SET last_seen = ? WHERE hash = ?", (seen, fp))
        if not isinstance(facts, dict):  # a raw value (unreadable JSON, an empty text) as a hand edit leaves it
            con.execute("UPDATE fingerprints SET facts = ? WHERE hash = ?", (facts, fp))
    con.commit()
    con.close()


@pytest.fixture
def facts_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fingerprint hashes whose facts the fallback fetched from SQLite (each row a query hands over with a facts
    column)."""
    fetched: list[str] = []
    real = sqlite_open.read

    class Counting:
        def __init__(self, con: Any) -> None:
            self.con = con

        def execute(self, sql: str, args: Any = ()) -> Any:
            cur = self.con.execute(sql, args)
            if "facts" not in sql.split("FROM")[0]:
                return cur
            rows = cur.fetchall()
            fetched.extend(str(r[0]) for r in rows)

            class Rows(list):
                def fetchall(self) -> list:
                    return list(self)

            return Rows(rows)

    monkeypatch.setattr(sqlite_open, "read",
                        lambda path, fn, **kw: real(path, lambda con: fn(Counting(con)), **kw))
    return fetched


def test_only_the_facts_up_to_the_newest_match_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        facts_read: list[str]) -> None:
    F.pretend_node(monkeypatch, HERE, tmp_path / "proc")
    db = tmp_path / "m.db"
    older = [(f"old{i:03d}", _other(i), f"2024-01-01T00:{i // 60:02d}:{i % 60:02d}") for i in range(40)]
    _seed(db, [*older, ("here", HERE, "2025-01-01T00:00:00"), ("newer", _other(99), "2025-06-01T00:00:00")])
    ident, why = db_lookup.node_identity_from_db(db)
    assert ident is not None and ident.fingerprint == "here", why
    assert facts_read == ["newer", "here"]  # not the 40 older ones (nor all 42)


LAYOUTS: dict[str, list[tuple[str, Any, str]]] = {
    "this node newest": [("a", _other(1), "2024-01-01"), ("here", HERE, "2024-02-01")],
    "behind newer other nodes": [("here", HERE, "2024-01-01"), *((f"o{i}", _other(i), f"2024-03-{i + 1:02d}")
                                                                  for i in range(5))],
    "a tie on last_seen (rowid decides)": [("here", HERE, "2024-01-01"), ("same", HERE, "2024-01-01"),
                                           ("b", _other(2), "2024-01-01")],
    "no match": [(f"o{i}", _other(i), f"2024-01-0{i + 1}") for i in range(5)],
    "unreadable, empty and factless rows": [("here", HERE, "2024-01-01"), ("bad", "{not json", "2024-05-01"),
                                            ("empty", "", "2024-04-01"), ("nul", "null", "2024-03-01"),
                                            ("none", {}, "2024-02-01"), ("shape", {"gpus": 8}, "2024-06-01")],
    "a preset newest": [("here", HERE, "2024-01-01"), (f"{PRESET_PREFIX}x:0000", {}, "2025-01-01")],
    "nothing recorded": [],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_identity_and_its_reasons_are_those_of_reading_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     layout: str) -> None:
    F.pretend_node(monkeypatch, HERE, tmp_path / "proc")
    db = tmp_path / "m.db"
    _seed(db, LAYOUTS[layout])
    before = node_identity.from_fingerprint_rows(db_lookup.db_read(db, ALL_ROWS, (PRESET_PREFIX + "%",)))
    assert db_lookup.node_identity_from_db(db) == before


def test_a_family_asked_for_is_selected_in_sql_with_the_same_records(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    store = F.open_store(db)
    for fam in ("nvlink", "collective", "host_staged"):
        for b in (16, 64, 1024):
            k = ProfileKey(fingerprint="f" * 16, software="s" * 16, transport_family=fam, ep_size=2, nodes=1,
                           hidden=QWEN.hidden, intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk,
                           dtype=QWEN.dtype, token_bucket=b)
            ok, why = store.put_profile(ProfileRecord(key=k, knobs=default_knobs(fam), latency_us=float(b),
                                                      spread_us=0.0, backend="local:nccl"))
            assert ok, why
    store.close()
    shape = dict(ep_size=2, nodes=1, hidden=QWEN.hidden, intermediate=QWEN.intermediate, experts=QWEN.experts,
                 topk=QWEN.topk, dtype=QWEN.dtype)
    every = db_lookup.query_db_profiles(db, **shape)
    assert len(every) == 9
    for fam in ("nvlink", "collective", "proxy:ibrc"):
        assert db_lookup.query_db_profiles(db, **shape, transport_family=fam) == [
            r for r in every if r.key.transport_family == fam]
