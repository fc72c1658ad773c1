"""`moetune profiles list --json` / `show --json`: every row has the same keys. A record's routing left unrecorded
(an older moetune's, or a prediction) is UNSET, which msgspec leaves out: those rows had no "routing" key at all while
the others had one (perf_env and runtime_options were already given as null there); now it is null, "not recorded"."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store


def _fill(db: Path) -> None:
    with Store(db) as s:
        for b, routing in ((16, {"routing": "uniform"}), (128, {})):
            key = ProfileKey(fingerprint="fp-keys", software="sw", transport_family="nvlink", ep_size=2, nodes=1,
                             hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=b)
            s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=float(b), spread_us=0.5,
                                        backend="local:nccl", provenance="measured", **routing))


def test_every_row_has_the_routing_key(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    _fill(db)
    r = CliRunner().invoke(app, ["profiles", "list", "--json", "--db", str(db)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [set(x) for x in rows[1:]] == [set(rows[0])] * (len(rows) - 1)
    assert [x["routing"] for x in rows] == ["uniform", None]
    r = CliRunner().invoke(app, ["profiles", "show", "2", "--json", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["routing"] is None
