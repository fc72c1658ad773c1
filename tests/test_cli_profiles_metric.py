"""`moetune profiles show` says which figure its latency is. A bring-up stores the exchange's round trip (backend
`local:<comm>:comm`), `moetune tune --backend local` the whole MoE layer (`local:<comm>`), a model backend a
prediction: after a tune replaced a bring-up's profile, the list showed 113480.9 µs current beside 4745.1 µs
superseded for one key, with nothing saying the two numbers time different things."""

from __future__ import annotations

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


@pytest.mark.parametrize(("backend", "provenance", "says"), [
    ("local:gloo:comm", "measured", "the dispatch → combine round trip"),
    ("local:gloo", "measured", "the whole MoE layer"),
    ("model:nvlink-h200x2", "preset", "a prediction of the fabric model"),
])
def test_show_says_which_figure_the_latency_is(tmp_path: Path, backend: str, provenance: str, says: str) -> None:
    fp = "preset:nvlink-h200x2" if provenance == "preset" else "c" * 16
    key = ProfileKey(fingerprint=fp, software="d" * 16, transport_family="collective", ep_size=2, nodes=1,
                     hidden=M.hidden, intermediate=M.intermediate, experts=M.experts, topk=M.topk, dtype=M.dtype,
                     token_bucket=128)
    db = tmp_path / "p.db"
    with Store(db) as s:
        ok, why = s.put_profile(ProfileRecord(key=key, knobs=default_knobs("collective"), latency_us=5.0,
                                              spread_us=0.1, backend=backend, provenance=provenance))
        assert ok, why
    r = CliRunner().invoke(app, ["profiles", "show", "1", "--db", str(db)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    row = next(ln for ln in r.output.splitlines() if "latency_us" in ln)
    assert says in re.sub(r"\s+", " ", row), row
