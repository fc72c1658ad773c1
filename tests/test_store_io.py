"""Export/import of profiles: identical round trip, all-or-nothing, database untouched on errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import pytest

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store import io as io_mod
from moetune.tuner.store.store import ProfileImportError, Store


def key(fp: str = "fp-a", bucket: int = 128, family: str = "nvlink") -> ProfileKey:
    return ProfileKey(
        fingerprint=fp, software="sw", transport_family=family, ep_size=2, nodes=1, hidden=7168,
        intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=bucket,
    )


def rec(lat: float, spread: float = 1.0, **kw) -> ProfileRecord:
    return ProfileRecord(
        key=key(**kw), knobs=default_knobs(kw.get("family", "nvlink")).replace(num_sms=20), latency_us=lat, spread_us=spread,
        backend="local:nccl", software_versions={"nccl": "2.28", "torch": "2.13.0"},
    )


def populate(s: Store) -> None:
    s.upsert_fingerprint("fp-a", {"gpus": [{"model": "H200"}] * 2, "nvlink": True}, origin="local")
    s.upsert_fingerprint("fp-b", {"gpus": 8}, origin="local")
    for b in (16, 128, 1024):
        s.put_profile(rec(10.0 * b, bucket=b))
    s.put_profile(rec(5.0, bucket=16))  # supersedes the first
    s.put_profile(rec(7.0, fp="fp-b"))
    s.mark_stale(fingerprint="fp-b", reason="driver changed")
    s.put_profile(rec(8.25, fp="fp-b"))
    s.put_profile(rec(1.5, spread=0.25, fp="fp-c", family="collective"))  # no facts: placeholder fingerprint


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def strip_ids(rows):
    return [r for _i, r in rows]


@pytest.fixture
def src(tmp_path):
    s = Store(tmp_path / "src.db")
    populate(s)
    yield s
    s.close()


def test_round_trip_is_identical(src, tmp_path):
    f1, f2 = tmp_path / "a.json", tmp_path / "b.json"
    assert src.export_profiles(f1) == 7
    doc = json.loads(f1.read_text())
    assert doc["format"] == "moetune-profiles" and doc["version"] == 1
    assert {p["status"] for p in doc["profiles"]} == {"current", "superseded", "stale"}
    with Store(tmp_path / "dst.db") as dst:
        res = dst.import_profiles(f1)
        assert (res.inserted, res.current, res.skipped, res.replaced) == (7, 5, 0, 0)
        dst.export_profiles(f2)
        assert f1.read_bytes() == f2.read_bytes()
        assert strip_ids(dst.list_profiles()) == strip_ids(src.list_profiles())
        assert dst.get_fingerprint("fp-a").facts == src.get_fingerprint("fp-a").facts
        # Importing the same file again changes nothing.
        again = dst.import_profiles(f1)
        assert again.skipped == 7 and again.inserted == 0
        dst.export_profiles(f2)
        assert f1.read_bytes() == f2.read_bytes()
    # Filters.
    assert src.export_profiles(tmp_path / "c.json", status="current") == 5
    assert src.export_profiles(tmp_path / "d.json", fingerprint="fp-b") == 2


def test_import_never_makes_two_current(src, tmp_path):
    f = tmp_path / "a.json"
    src.export_profiles(f, status="current")
    with Store(tmp_path / "dst.db") as dst:
        # Other knobs than the file's (the same knobs: the newer measurement would win, whatever its number).
        other = default_knobs("nvlink").replace(num_sms=24)
        dst.put_profile(msgspec.structs.replace(rec(2000.0, bucket=128), knobs=other))  # much slower than the file's 1280: replaced
        dst.put_profile(msgspec.structs.replace(rec(5.5, bucket=16), knobs=other))  # within noise of the file's 5.0: kept
        res = dst.import_profiles(f)
        assert res.replaced == 1 and res.kept_superseded == 1
        cur = {r.key: r for _i, r in dst.list_profiles(status="current")}
        assert len(cur) == 5
        assert cur[key(bucket=128)].latency_us == 1280.0
        assert cur[key(bucket=16)].latency_us == 5.5
        with dst.engine.connect() as c:
            assert c.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"


def valid_doc(src: Store) -> dict:
    return json.loads(src.dump_profiles())


def _mutations():
    def unknown_top(d):
        d["extra"] = 1

    def unknown_profile(d):
        d["profiles"][0]["colour"] = "red"

    def unknown_knob(d):
        d["profiles"][2]["knobs"]["turbo"] = True

    def unknown_key(d):
        d["profiles"][1]["key"]["gpu"] = "H200"

    def wrong_type_latency(d):
        d["profiles"][3]["latency_us"] = "fast"

    def wrong_type_ep(d):
        d["profiles"][0]["key"]["ep_size"] = "2"

    def wrong_type_knob(d):
        d["profiles"][0]["knobs"]["num_sms"] = 1.5

    def bad_knob_combo(d):
        d["profiles"][4]["knobs"]["fence_mode"] = "proxy_drain"

    def bad_status(d):
        d["profiles"][0]["status"] = "best"

    def negative_latency(d):
        d["profiles"][5]["latency_us"] = -3.0

    def zero_ep(d):
        d["profiles"][5]["key"]["ep_size"] = 0

    def missing_field(d):
        del d["profiles"][6]["backend"]

    def two_current(d):
        p = json.loads(json.dumps(d["profiles"][-1]))
        p["latency_us"] = 0.5
        d["profiles"].append(p)

    def wrong_version(d):
        d["version"] = 2

    def wrong_format(d):
        d["format"] = "something-else"

    def dup_fingerprint(d):
        d["fingerprints"].append(d["fingerprints"][0])

    return {
        "unknown_top": (unknown_top, "unknown field `extra`"),
        "unknown_profile": (unknown_profile, "unknown field `colour`"),
        "unknown_knob": (unknown_knob, "unknown field `turbo`"),
        "unknown_key": (unknown_key, "unknown field `gpu`"),
        "wrong_type_latency": (wrong_type_latency, "Expected `float`, got `str` - at `$.profiles[3].latency_us`"),
        "wrong_type_ep": (wrong_type_ep, "Expected `int`, got `str` - at `$.profiles[0].key.ep_size`"),
        "wrong_type_knob": (wrong_type_knob, "Expected `int`, got `float`"),
        "bad_knob_combo": (bad_knob_combo, "fence_mode"),
        "bad_status": (bad_status, "status"),
        "negative_latency": (negative_latency, "profiles[5].latency_us"),
        "zero_ep": (zero_ep, "ep_size must be > 0"),
        "missing_field": (missing_field, "missing required field `backend`"),
        "two_current": (two_current, "both current for the same key"),
        "wrong_version": (wrong_version, "unsupported format version 2"),
        "wrong_format": (wrong_format, "not a moetune profiles file"),
        "dup_fingerprint": (dup_fingerprint, "appears twice"),
    }


MUTATIONS = _mutations()


def _assert_import_fails_unchanged(db: Path, payload: bytes, tmp_path: Path, match: str) -> None:
    f = tmp_path / "bad.json"
    f.write_bytes(payload)
    before = sha(db)
    with Store(db) as s, pytest.raises(ProfileImportError) as ei:
        s.import_profiles(f)
    assert match in str(ei.value), str(ei.value)
    assert str(f) in str(ei.value)
    assert sha(db) == before
    assert not Path(str(db) + "-wal").exists() or Path(str(db) + "-wal").stat().st_size == 0


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_invalid_file_fails_and_database_is_byte_identical(src, tmp_path, name):
    mutate, match = MUTATIONS[name]
    d = valid_doc(src)
    mutate(d)
    db = tmp_path / "target.db"
    with Store(db) as t:
        t.put_profile(rec(3.0, fp="fp-z"))
    _assert_import_fails_unchanged(db, json.dumps(d).encode(), tmp_path, match)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b'{"format": "moetune-profiles", "version": 1, "profiles": [', "not valid JSON"),
        (b"\x00\xff\xfe garbage", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
    ],
)
def test_corrupt_file_fails_and_database_is_byte_identical(tmp_path, payload, match):
    db = tmp_path / "target.db"
    with Store(db) as t:
        t.put_profile(rec(3.0))
    _assert_import_fails_unchanged(db, payload, tmp_path, match)


def test_truncated_export_fails(src, tmp_path):
    data = src.dump_profiles()
    db = tmp_path / "target.db"
    Store(db).close()
    _assert_import_fails_unchanged(db, data[: len(data) // 2], tmp_path, "not valid JSON")


def test_failure_while_writing_rolls_everything_back(src, tmp_path, monkeypatch):
    f = tmp_path / "a.json"
    src.export_profiles(f)
    db = tmp_path / "target.db"
    with Store(db) as t:
        t.put_profile(rec(3.0, fp="fp-z"))
    before = sha(db)
    real = io_mod.row_from_record
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("disk on fire")
        return real(*a, **kw)

    monkeypatch.setattr(io_mod, "row_from_record", flaky)
    with Store(db) as t:
        with pytest.raises(RuntimeError, match="disk on fire"):
            t.import_profiles(f)
        assert len(t.list_profiles()) == 1
        assert t.get_fingerprint("fp-a") is None
    assert sha(db) == before


def test_missing_file(tmp_path):
    with Store(tmp_path / "t.db") as t, pytest.raises(ProfileImportError, match="cannot read"):
        t.import_profiles(tmp_path / "nope.json")


def test_import_fills_placeholder_fingerprint_facts(src, tmp_path):
    f = tmp_path / "a.json"
    src.export_profiles(f)
    with Store(tmp_path / "dst.db") as dst:
        dst.add_measurement(fingerprint="fp-a", kind="k", transport="t", size_bytes=None, value=1, spread=0, unit="u")
        assert dst.get_fingerprint("fp-a").facts == {}
        res = dst.import_profiles(f)
        assert dst.get_fingerprint("fp-a").facts == src.get_fingerprint("fp-a").facts
        assert res.fingerprints == 2  # fp-b and fp-c are new; fp-a existed



# Another process asks for the byte range SQLite locks (an exclusive fcntl lock, not waiting): "held" while any
# connection of this process keeps its lock there. The database file: SHARED_FIRST (0x40000002, 510 bytes), which a
# WAL-mode connection holds shared for its whole life (the last one to close gets it exclusive and deletes the -wal and
# -shm). The -shm: its DMS byte (128), which every connection holds shared (the first to get it exclusive resets the
# wal-index).
_PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, int(sys.argv[3]), int(sys.argv[2]))
    print("took")
except OSError:
    print("held")
"""
_LOCKED = {"": (0x40000002, 510), "-shm": (128, 1)}


def _probe(path: Path, suffix: str) -> str:
    import subprocess
    import sys

    start, length = _LOCKED[suffix]
    r = subprocess.run([sys.executable, "-c", _PROBE, f"{path}{suffix}", str(start), str(length)],
                       capture_output=True, text=True, timeout=60, check=True)
    return r.stdout.strip()


def test_importing_a_link_loop_is_a_profile_import_error(tmp_path):
    """f1de61f's own-file check resolves the path before reading it: Path.resolve raises RuntimeError on a link loop
    (Python before 3.13), which left import_profiles where read_import's OSError was ProfileImportError, "cannot
    read ... Too many levels of symbolic links". The check passes such a path on to that read."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with Store(tmp_path / "t.db") as t:
        with pytest.raises(ProfileImportError, match="cannot read"):
            t.import_profiles(loop)
        with pytest.raises(OSError, match="symbolic links"):  # export: the write's own error, as before
            t.export_profiles(loop)


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm"])
def test_importing_the_stores_own_file_keeps_its_sqlite_locks(tmp_path, suffix):
    """`import_profiles` read its file with open()/close(): given the store's own database (or its -shm), the close
    dropped every POSIX lock this process held on that file, those of the store's open connections included. Another
    process then took locks it must not: the last connection's (which checkpoints and deletes the -wal and -shm when
    it closes), or the -shm's first opener's (which resets the wal-index under the open connections). The database's
    files are refused before any is opened (none holds an export)."""
    db = tmp_path / "t.db"
    with Store(db) as t:  # its pooled connection stays open, holding SQLite's locks
        assert t.list_profiles() == []
        assert _probe(db, "") == "held" and _probe(db, "-shm") == "held"
        with pytest.raises(ProfileImportError, match=r"is \(a file of\) the database"):
            t.import_profiles(Path(f"{db}{suffix}"))
        assert _probe(db, "") == "held"  # was "took" for the database
        assert _probe(db, "-shm") == "held"  # was "took" for the -shm
        assert t.list_profiles() == []


def test_exporting_onto_another_open_database_keeps_its_sqlite_locks(tmp_path):
    """An export target's SQLite check (`is_sqlite_file`) read its header with open()/close(): onto a database this
    process has open (another store, a studies storage), the close dropped the locks of those connections. SQLite
    is asked instead (its close of a file keeps this process's locks on it)."""
    from moetune.tuner.store import StoreError, is_sqlite_file

    with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        assert a.list_profiles() == []
        with pytest.raises(StoreError, match="it is a SQLite database"):
            b.export_profiles(a.path)
        assert _probe(a.path, "") == "held"  # was "took"
        assert _probe(a.path, "-shm") == "held"
        assert is_sqlite_file(a.path) and _probe(a.path, "") == "held"


@pytest.mark.parametrize("content, expected", [
    (b"", False), (b"SQLite format 3\x00", True), (b"SQLite format 3\x00" + b"\xff" * 5000, True),
    (b"SQLite format", False), (b"{}\n", False), (b"x" * 4096, False),
])
def test_is_sqlite_file_answers_as_the_header_does(tmp_path, content, expected):
    """Asked of SQLite now, `is_sqlite_file` still answers for the first 16 bytes: a file SQLite refuses (a damaged
    header after the magic) is still one, an empty file is not."""
    from moetune.tuner.store import is_sqlite_file

    f = tmp_path / "f"
    f.write_bytes(content)
    assert is_sqlite_file(f) is expected
    assert not is_sqlite_file(tmp_path / "missing") and not is_sqlite_file(tmp_path)
    assert not list(tmp_path.glob("f-*"))  # nothing created beside it
