"""`profiles show` of a row stored as measured whose backend does not measure (a hand edit: the row is taken as the
modelled profile it is, PRESET in the same output) said of its performance environment and runtime options "not
recorded: measured by an older moetune": a prediction described as a measurement. They follow the effective
provenance, as the provenance row beside them does."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)


def test_a_mislabelled_modelled_row_is_never_said_to_be_measured(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    key = ProfileKey(fingerprint="fp-cli", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                     intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=128)
    with Store(db) as s:
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=12.0, spread_us=0.5,
                                    backend="model:ndr-ibrc-h100x8", provenance="preset"))
    with sqlite3.connect(db) as c:  # the hand edit no writer of moetune makes
        c.execute("UPDATE profiles SET provenance = 'measured', measured_on = 'fp-cli'")
    r = CliRunner().invoke(app, ["profiles", "show", "1", "--db", str(db)], env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "PRESET" in text, r.output
    assert "measured by an older moetune" not in text, r.output
    assert "unknown (not recorded: a prediction, measured in no process)" in text, r.output
    assert "unknown (not recorded: a prediction, run under no options)" in text, r.output
