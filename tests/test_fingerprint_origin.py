"""Fingerprints record where their facts came from (migration 0010): 'local' with the recording node's id (this
node's bring-up, a tune of it, its daemon, `fabric show --record` of it), 'import' (a profiles file), 'capture'
(a capture read). The daemon's first start compares the node only with this node's own (tests/
test_daemon_change_since_bringup.py); these are the store's rules, the writers' origins and the migration."""

from __future__ import annotations

import io
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app
from moetune.tuner.fabric import discovery
from moetune.tuner.store import _owner
from moetune.tuner.store.io import ExportedFingerprint
from moetune.tuner.store.store import Store, head_revision

CAPTURES = Path(__file__).resolve().parent / "captures"


def _origin(store: Store, fp: str) -> tuple[Any, Any]:
    row = store.get_fingerprint(fp)
    return row["origin"], row["node"]


# -- node id ---------------------------------------------------------------------------------------------------------
def test_the_node_id_is_the_machine_ids_hash_else_the_host_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mid = tmp_path / "machine-id"
    mid.write_text("0123456789abcdef0123456789abcdef\n")
    monkeypatch.setattr(_owner, "MACHINE_ID_FILES", (tmp_path / "absent", mid))
    a = _owner.node_id()
    assert a.startswith("m-") and "0123456789abcdef" not in a and a == _owner.node_id()
    mid.write_text("fedcba9876543210fedcba9876543210\n")
    assert _owner.node_id() != a  # another machine
    mid.write_text("uninitialized\n")  # systemd's first boot: no id yet
    monkeypatch.setattr(_owner.socket, "gethostname", lambda: "node17")
    h = _owner.node_id()
    assert h.startswith("h-") and "node17" not in h
    monkeypatch.setattr(_owner, "MACHINE_ID_FILES", ())
    assert _owner.node_id() == h


# -- the store's rules -----------------------------------------------------------------------------------------------
def test_an_upsert_records_its_origin_and_this_nodes_id(tmp_path: Path) -> None:
    with Store(tmp_path / "o.db") as s:
        s.upsert_fingerprint("fp-l", {"a": 1}, origin="local")
        s.upsert_fingerprint("fp-c", {"a": 2}, origin="capture")
        assert _origin(s, "fp-l") == ("local", _owner.node_id())
        assert _origin(s, "fp-c") == ("capture", None)
        assert [r["hash"] for r in s.local_fingerprints()] == ["fp-l"]
        assert s.local_fingerprints(node="another") == []
        with pytest.raises(ValueError, match="origin must be one of local, import, capture, not 'mine'"):
            s.upsert_fingerprint("fp-x", {}, origin="mine")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="records no node"):
            s.upsert_fingerprint("fp-x", {}, origin="capture", node="n1")
        assert s.get_fingerprint("fp-x") is None


def test_another_nodes_facts_never_replace_this_nodes_row(tmp_path: Path) -> None:
    """The same hash read from a capture stays this node's: its facts (this node's GPUs) and last_seen (the daemon's
    base is the newest of this node's) unchanged; this node's record over a capture's makes the row its own."""
    with Store(tmp_path / "o.db") as s:
        s.upsert_fingerprint("fp", {"gpus": "mine"}, origin="local")
        before = s.get_fingerprint("fp")
        time.sleep(0.01)
        s.upsert_fingerprint("fp", {"gpus": "theirs"}, origin="capture")
        assert s.get_fingerprint("fp") == before
        s.upsert_fingerprint("fp-c", {"gpus": "theirs"}, origin="capture")
        s.upsert_fingerprint("fp-c", {"gpus": "mine"}, origin="local")
        row = s.get_fingerprint("fp-c")
        assert (row["origin"], row["node"], row["facts"]) == ("local", _owner.node_id(), {"gpus": "mine"})
        s.upsert_fingerprint("fp-c", {"gpus": "mine"}, origin="local", node="other-node")  # a shared database
        assert _origin(s, "fp-c") == ("local", "other-node")


def test_an_import_is_import_and_leaves_this_nodes_rows_alone(tmp_path: Path) -> None:
    h1, h2 = discovery.discover(CAPTURES / "h200x1"), discovery.discover(CAPTURES / "h200x2")
    with Store(tmp_path / "src.db") as src:
        for f in (h1, h2):  # both the other node's own there
            src.upsert_fingerprint(f.fingerprint, f.to_dict(), origin="local", node="the-other-node")
            F.seed_profiles(src, f)
        data = src.dump_profiles()
    with Store(tmp_path / "dst.db") as s:
        s.upsert_fingerprint(h2.fingerprint, h2.to_dict(), origin="local")  # seen here too: this node's
        mine = s.get_fingerprint(h2.fingerprint)
        res = s.import_bytes(data)
        assert res.fingerprints == 1
        assert _origin(s, h1.fingerprint) == ("import", None)
        assert s.get_fingerprint(h2.fingerprint) == mine
        assert [r["hash"] for r in s.local_fingerprints()] == [h2.fingerprint]


def test_a_placeholder_learns_an_imports_facts_as_imported(tmp_path: Path) -> None:
    """A profile stored under a key without facts leaves a placeholder of no origin; an import's facts make it
    'import'. An imported profile whose fingerprint the file has no facts of is an 'import' placeholder."""
    facts = discovery.discover(CAPTURES / "h200x1")
    with Store(tmp_path / "src.db") as src:
        src.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
        F.seed_profiles(src, facts)
        data = src.dump_profiles()
    with Store(tmp_path / "dst.db") as s:
        F.seed_profiles(s, facts, buckets=(16,))
        assert _origin(s, facts.fingerprint) == (None, None) and s.get_fingerprint(facts.fingerprint)["facts"] == {}
        s.import_bytes(data)
        assert _origin(s, facts.fingerprint) == ("import", None)
        assert s.get_fingerprint(facts.fingerprint)["facts"] == facts.to_dict()
        doc = json.loads(data)
        doc["fingerprints"] = [dict(doc["fingerprints"][0], hash="f" * 16, facts={})]  # a key without facts
        doc["profiles"] = [dict(p, key=dict(p["key"], fingerprint="f" * 16), measured_on="f" * 16) for p in doc["profiles"]]
        s.import_bytes(json.dumps(doc).encode())
        assert _origin(s, "f" * 16) == ("import", None) and s.local_fingerprints() == []


def test_an_export_carries_no_origin_and_older_files_import(tmp_path: Path) -> None:
    """Where facts came from is the exporting store's business: the file's fingerprint entries are as before (an
    older moetune, whose ExportedFingerprint forbids unknown fields, reads them), and a file written before imports."""
    assert set(ExportedFingerprint.__struct_fields__) == {"hash", "facts", "first_seen", "last_seen"}
    facts = discovery.discover(CAPTURES / "h200x1")
    with Store(tmp_path / "src.db") as src:
        src.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
        F.seed_profiles(src, facts)
        doc = json.loads(src.dump_profiles())
    assert [set(fp) for fp in doc["fingerprints"]] == [{"hash", "facts", "first_seen", "last_seen"}]
    with Store(tmp_path / "dst.db") as s:
        assert s.import_bytes(json.dumps(doc).encode()).inserted == 3
        assert _origin(s, facts.fingerprint) == ("import", None)


# -- the writers -----------------------------------------------------------------------------------------------------
def test_fabric_show_record_is_local_for_this_node_and_capture_for_a_capture(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.cli import fabric as cli_fabric

    here = discovery.discover(CAPTURES / "h200x2")
    real = cli_fabric._discover
    monkeypatch.setattr(cli_fabric, "_discover", lambda d, t: here if d is None else real(d, t))
    db = tmp_path / "r.db"
    runner = CliRunner()
    env = {"MOETUNE_HOME": str(tmp_path)}
    for args in ([], ["--capture", str(CAPTURES / "h200x1")], ["--capture", str(CAPTURES / "h200x2")]):
        r = runner.invoke(app, ["fabric", "show", "--record", "--db", str(db), "--json", *args], env=env)
        assert r.exit_code == 0, r.output
    other = discovery.discover(CAPTURES / "h200x1").fingerprint
    with Store(db) as s:
        assert _origin(s, here.fingerprint) == ("local", _owner.node_id())  # this node's capture too: still its own
        assert _origin(s, other) == ("capture", None)


def test_a_bring_up_records_this_nodes_facts_as_local_and_another_nodes_capture_not_at_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup.flow import Bringup, Plan

    live = discovery.discover(CAPTURES / "cpu-laptop")
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: live, raising=False)
    store = F.open_store(tmp_path / "b.db")
    for cap in ("cpu-laptop", "dgx-h100"):  # this node's capture, another node's
        b = Bringup(store=store, plan=Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=5),
                    state_dir=tmp_path / "state", console=Console(file=io.StringIO(), width=300),
                    capture=CAPTURES / cap, storage=f"sqlite:///{tmp_path / 'opt.db'}")
        b.stage_discover()
    assert [(r["hash"], r["origin"], r["node"]) for r in store.list_fingerprints()] == [
        (live.fingerprint, "local", _owner.node_id())]


def test_a_daemon_refuses_an_unknown_fabric_origin(tmp_path: Path) -> None:
    from moetune.tuner.daemon.errors import DaemonConfigError
    from moetune.tuner.daemon.server import Daemon

    with pytest.raises(DaemonConfigError, match="fabric_origin must be 'local' or 'capture', not 'import'"):
        Daemon(store=F.open_store(tmp_path / "d.db"), endpoint=f"ipc://{tmp_path}/d.sock",
               fabric_origin="import")  # type: ignore[arg-type]


# -- migration 0010 --------------------------------------------------------------------------------------------------
def test_upgrade_from_0009_keeps_every_fingerprint_of_unknown_origin(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with Store(db) as s:
        s.upsert_fingerprint("fp-a", {"gpus": 2}, origin="local")
        s.upsert_fingerprint("fp-b", {}, origin="capture")
        before = [(r["hash"], r["facts"], r["first_seen"], r["last_seen"]) for r in s.list_fingerprints()]
        s.downgrade("0009")
        assert s.current_revision() == "0009"
        con = sqlite3.connect(db)
        assert {"origin", "node"}.isdisjoint(r[1] for r in con.execute("PRAGMA table_info(fingerprints)"))
        # a row an 0009 moetune writes (its own columns only)
        con.execute("INSERT INTO fingerprints(hash, facts, first_seen, last_seen) VALUES ('fp-c', '{}', 'x', 'x')")
        con.commit()
        con.close()
        s.upgrade()
        assert s.current_revision() == head_revision() == "0011"
        assert s.check()["ok"]
        rows = s.list_fingerprints()
        assert [(r["hash"], r["facts"], r["first_seen"], r["last_seen"]) for r in rows if r["hash"] != "fp-c"] == before
        assert {r["hash"]: (r["origin"], r["node"]) for r in rows} == {h: (None, None) for h in ("fp-a", "fp-b", "fp-c")}
        assert s.local_fingerprints() == []  # unknown origin: never this node's
    con = sqlite3.connect(db)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
            con.execute("UPDATE fingerprints SET origin = 'somewhere' WHERE hash = 'fp-a'")
    finally:
        con.close()
