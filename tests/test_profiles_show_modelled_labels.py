"""`moetune profiles show`'s table labels where a MODELLED profile's numbers come from as `query` does: its row read
"measured_on 943cc5ad0d0417d8" (the node whose calibrated model predicted it) or "measured_on preset:NAME:DIGEST"
under "provenance PRESET (MODELLED)", though nothing was measured. Only a measured profile's row says measured_on;
the --json output keeps the `measured_on` field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.shapes import get_model
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store

M = get_model("qwen3-30b")
FP = "c" * 16


@pytest.mark.parametrize(("provenance", "fp", "backend", "label"), [
    ("measured", FP, "local:gloo", "measured_on"),
    ("node_model", FP, f"model:node:{FP}", "modelled by the node model of"),
    ("preset", "preset:nvlink-h200x2:0123456789abcdef", "model:nvlink-h200x2", "predicted by"),
])
def test_only_a_measured_profile_shows_measured_on(tmp_path: Path, provenance: str, fp: str, backend: str,
                                                   label: str) -> None:
    db = tmp_path / "s.db"
    key = ProfileKey(fingerprint=fp, software="modelled" if fp.startswith("preset:") else "d" * 16,
                     transport_family="collective", ep_size=2, nodes=1, hidden=M.hidden, intermediate=M.intermediate,
                     experts=M.experts, topk=M.topk, dtype=M.dtype, token_bucket=128)
    with Store(db) as s:
        ok, why = s.put_profile(ProfileRecord(key=key, knobs=default_knobs("collective"), latency_us=5.0, spread_us=0.1,
                                              backend=backend, provenance=provenance,
                                              measured_on=fp if provenance == "node_model" else ""))
        assert ok, why
        ((pid, row),) = s.list_profiles()
    r = CliRunner().invoke(app, ["profiles", "show", str(pid), "--db", str(db)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    table = re.sub(r"[ │]+", " ", r.stdout)
    assert f" {label} {row.measured_on} " in table, table
    assert (" measured_on " in table) is (provenance == "measured"), table
    r = CliRunner().invoke(app, ["profiles", "show", str(pid), "--db", str(db), "--json"])
    shown = json.loads(r.stdout)
    assert shown["measured_on"] == row.measured_on
    # the JSON says what latency_us is, as `tune --json` does: "modelled" in every row
    assert shown["modelled"] is (provenance != "measured"), shown
    r = CliRunner().invoke(app, ["profiles", "list", "--db", str(db), "--json"])
    assert [x["modelled"] for x in json.loads(r.stdout)] == [provenance != "measured"]
