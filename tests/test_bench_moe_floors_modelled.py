"""`moetune bench moe` prints the floors (tuner/measure/moe.py `floors`: arithmetic at a GPU model's rates, never
timed) beside the timed figures. The table's title called every µs column "median of N" and the floors' rates "as
measured", and the JSON had no word that they are computed: a modelled number shown as one of the timings. Both say
MODELLED now, as every other computed number of moetune does."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(300)

ARGS = ("bench", "moe", "--engine", "unfused", "--model", "custom:128,64,8,2", "--tokens", "4", "--iters", "1",
        "--warmup", "0")


def test_bench_moe_labels_its_floors_modelled() -> None:
    r = CliRunner().invoke(app, [*ARGS, "--json"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["floor_rates"]["label"] == "MODELLED", rep["floor_rates"]
    assert any("weight_floor_us" in c for c in rep["cases"])  # the rows the label is for
    r = CliRunner().invoke(app, list(ARGS), env={"COLUMNS": "200"})
    flat = " ".join(r.output.split())
    assert r.exit_code == 0 and "floors MODELLED (computed, not timed)" in flat, r.output
