"""Migration 0007: 0003 backfilled `model:node:<fpB>` under key fingerprint fpA as node_model with measured_on fpA
(its SQL knew the backend only), 0004 relabelled only rows stored as measured (by the backend alone too), so
`moetune db check` failed right after a clean upgrade ("labelled node_model, but its backend ... is not this node's
model"). 0007 relabels such rows with the runtime's rule: preset, measured_on preset:node:<fpB>, one event per row.
`profiles show` prints the effective measured_on."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, head_revision

T = "2026-01-01T00:00:00+00:00"
# (backend, token bucket, status, stored label at 0002: none, or measured for a row 0004 relabels by backend alone)
ROWS = [
    ("model:node:fpB", 16, "current"),  # another node's model: preset
    ("model:node:fpB", 16, "superseded"),  # history too
    ("model:node:fpA", 128, "current"),  # this node's model: stays node_model
    ("local:nccl", 1024, "current"),  # a measurement: stays measured
]


def database_at_0002(path: Path) -> None:
    with Store(path) as s:
        s.downgrade("0002")
    con = sqlite3.connect(path)
    con.execute("INSERT INTO fingerprints(hash, facts, first_seen, last_seen) VALUES ('fpA', '{}', ?, ?)", (T, T))
    knobs = json.dumps(default_knobs("nvlink").to_dict())
    for backend, bucket, status in ROWS:
        con.execute(
            "INSERT INTO profiles(fingerprint, software, transport_family, ep_size, nodes, hidden, intermediate,"
            " experts, topk, dtype, token_bucket, knobs, latency_us, spread_us, backend, status, software_versions,"
            " profile_hash, created, updated) VALUES ('fpA', 'sw', 'nvlink', 2, 1, 4096, 1024, 64, 6, 'bfloat16',"
            " ?, ?, 10.0, 1.0, ?, ?, '{}', 'h', ?, ?)",
            (bucket, knobs, backend, status, T, T),
        )
    con.commit()
    con.close()


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_a_row_of_another_nodes_model_is_a_preset_after_a_clean_upgrade(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    database_at_0002(path)
    r = run("db", "upgrade", "--db", str(path))
    assert r.exit_code == 0, r.output
    r = run("db", "check", "--db", str(path))
    assert r.exit_code == 0 and "ok" in r.output, r.output
    with Store(path) as s:
        assert s.current_revision() == head_revision() == "0011"
        info = s.check()
        assert info["ok"] and info["mislabelled_profiles"] == [], info
        got = {(r.backend, r.status): (r.provenance, r.measured_on) for _i, r in s.list_profiles()}
        assert got == {
            ("model:node:fpB", "current"): ("preset", "preset:node:fpB"),
            ("model:node:fpB", "superseded"): ("preset", "preset:node:fpB"),
            ("model:node:fpA", "current"): ("node_model", "fpA"),
            ("local:nccl", "current"): ("measured", "fpA"),
        }
        events = [e for e in s.list_events() if e.kind == "relabelled"]
        assert len(events) == 2
        for e in events:
            assert e.details["provenance"] == {"from": "node_model", "to": "preset"}
            assert e.details["measured_on"] == {"from": "fpA", "to": "preset:node:fpB"}
        assert {e.details["status"] for e in events} == {"current", "superseded"}
        pid = next(i for i, r in s.list_profiles() if r.backend == "model:node:fpB" and r.status == "current")
        # importable: an export of the upgraded database passes the import checks (the superseded row, the same
        # key and knobs as the current one, is skipped as present)
        with Store(tmp_path / "copy.db") as copy:
            res = copy.import_bytes(s.dump_profiles())
            assert res.invalid == [] and (res.inserted, res.skipped) == (len(ROWS) - 1, 1), res
    text = run("profiles", "show", str(pid), "--db", str(path)).output
    assert "PRESET" in text and "preset:node:fpB" in text and "(stored as" not in text, text
    # a downgrade keeps the relabelling, and the upgrade after it finds nothing to relabel
    with Store(path) as s:
        s.downgrade("0006")
        s.upgrade()
        assert len([e for e in s.list_events() if e.kind == "relabelled"]) == 2
        assert s.check()["ok"]


def test_profiles_show_prints_the_effective_measured_on_of_a_mislabelled_row(tmp_path: Path) -> None:
    """A row mislabelled at head (a hand edit, another tool): shown as a preset, with the preset's measured_on (the
    stored one beside it), never the key's fingerprint as where a preset was measured."""
    path = tmp_path / "m.db"
    database_at_0002(path)
    with Store(path) as s:
        pass  # upgraded to head
    con = sqlite3.connect(path)
    con.execute("UPDATE profiles SET provenance = 'node_model', measured_on = 'fpA' WHERE backend = 'model:node:fpB'")
    con.commit()
    con.close()
    with Store(path) as s:
        pid = next(i for i, r in s.list_profiles() if r.backend == "model:node:fpB" and r.status == "current")
    r = run("profiles", "show", str(pid), "--db", str(path))
    assert r.exit_code == 0, r.output
    # shown as a preset's: its origin row says "predicted by", not "measured_on" (nothing was measured)
    line = next(x for x in r.output.splitlines() if "predicted by" in x)
    assert "preset:node:fpB" in line and "(stored as fpA)" in line, r.output
    assert "measured_on" not in r.output, r.output
