"""A profile whose knobs or key contradict its family: a megakernel key (ep_size 1, nodes 1, bf16) whose knobs name
engine=unfused, a megakernel key at ep_size >= 2 or of a dtype the megakernel does not run (it times bf16 only), or a
transport key whose knobs name engine=megakernel. An auto layer runs the engine the row names, so the store refuses
them at put_profile (import, tune and the daemon all write through it), and `db check` names rows already stored."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store
from moetune.tuner.store.validate import FieldError


def _rec(family: str = "megakernel", ep_size: int = 1, dtype: str = "bfloat16", **knobs: object) -> ProfileRecord:
    base = default_knobs("collective").replace(engine="megakernel") if family == "megakernel" else default_knobs(family)
    key = ProfileKey(fingerprint="fp", software="sw", transport_family=family, ep_size=ep_size, nodes=1, hidden=2048,
                     intermediate=768, experts=128, topk=8, dtype=dtype, token_bucket=128)
    return ProfileRecord(key=key, knobs=base.replace(**knobs), latency_us=100.0, spread_us=1.0,
                         backend="local:nccl", provenance="measured", measured_on="fp")


def test_a_legitimate_megakernel_and_transport_row_are_stored(tmp_path: Path) -> None:
    with Store(tmp_path / "m.db") as s:
        assert s.put_profile(_rec(mk_bm=64))[0]
        assert s.put_profile(_rec("collective", ep_size=2))[0]
        assert s.check()["contradicting_profiles"] == []


@pytest.mark.parametrize(("rec", "field"), [
    (_rec(engine="unfused"), "knobs.engine"),
    (_rec(ep_size=2), "key.ep_size"),
    (_rec(dtype="float16"), "key.dtype"),
    (_rec(dtype="float32"), "key.dtype"),
    (_rec("collective", ep_size=2, engine="megakernel"), "knobs.engine"),
    (_rec("nvlink", ep_size=8, engine="megakernel", mk_bm=64), "knobs.engine"),
])
def test_a_row_contradicting_its_key_is_refused(tmp_path: Path, rec: ProfileRecord, field: str) -> None:
    with Store(tmp_path / "m.db") as s, pytest.raises(FieldError) as e:
        s.put_profile(rec)
    assert e.value.field == field


def test_db_check_names_a_stored_contradicting_row(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with Store(db) as s:
        s.put_profile(_rec())
    con = sqlite3.connect(db)
    with con:  # as an older moetune's import stored it
        knobs = json.loads(con.execute("SELECT knobs FROM profiles").fetchone()[0])
        con.execute("UPDATE profiles SET knobs = ?", (json.dumps({**knobs, "engine": "unfused"}),))
        pid = con.execute("SELECT id FROM profiles").fetchone()[0]
    con.close()
    with Store(db) as s:
        info = s.check()
    assert not info["ok"]
    assert [r["id"] for r in info["contradicting_profiles"]] == [pid]
    assert "knobs.engine" in info["contradicting_profiles"][0]["error"]
    r = CliRunner().invoke(app, ["db", "check", "--db", str(db)], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    assert f"profile {pid}: its knobs or key contradict its family (knobs.engine:" in r.output
