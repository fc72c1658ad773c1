"""`moetune query`'s table names where a profile's numbers come from under a label that says what they are: a
MODELLED profile's row read "measured on 943cc5ad0d0417d8" (the node whose calibrated model predicted it) or
"measured on preset:NAME:DIGEST" (a preset predicts; nothing was measured), beside "provenance MODELLED". Only a
measured profile's row says "measured on"; the JSON keeps its `measured_on` field."""

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


def _key(fp: str) -> ProfileKey:
    return ProfileKey(fingerprint=fp, software="modelled" if fp.startswith("preset:") else "d" * 16,
                      transport_family="collective", ep_size=2, nodes=1, hidden=M.hidden, intermediate=M.intermediate,
                      experts=M.experts, topk=M.topk, dtype=M.dtype, token_bucket=128)


def _stored(db: Path, key: ProfileKey, provenance: str, backend: str) -> tuple[int, ProfileRecord]:
    """The one profile of `key` stored in a new database `db` with that provenance and backend: (its id, the row)."""
    with Store(db) as s:
        ok, why = s.put_profile(ProfileRecord(key=key, knobs=default_knobs("collective"), latency_us=5.0, spread_us=0.1,
                                              backend=backend, provenance=provenance,
                                              # as the tuner stores a node model's: the node it was calibrated on
                                              measured_on=key.fingerprint if provenance == "node_model" else ""))
        assert ok, why
        ((pid, row),) = s.list_profiles()
    return pid, row



@pytest.mark.parametrize(("provenance", "fp", "backend", "label"), [
    ("measured", FP, "local:gloo", "measured on"),
    ("node_model", FP, f"model:node:{FP}", "modelled by the node model of"),
    ("preset", "preset:nvlink-h200x2:0123456789abcdef", "model:nvlink-h200x2", "predicted by"),
])
def test_only_a_measured_profile_is_said_measured_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, provenance: str,
                                                      fp: str, backend: str, label: str) -> None:
    from moetune.runtime.profiles import client

    db = tmp_path / "q.db"
    k = _key(fp)
    _id, row = _stored(db, k, provenance, backend)
    res = client.Resolution(knobs=row.knobs, source="database", profile_hash=row.profile_hash, status="current",
                            key=k, family="collective", provenance=provenance, tuned=provenance == "measured")
    monkeypatch.setattr(client.ProfileClient, "resolve", lambda self, **kw: res)
    args = ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--db", str(db), "--socket",
            f"ipc://{tmp_path}/none.sock", "--timeout-ms", "100"]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    table = re.sub(r"[ │]+", " ", r.stdout)
    assert f" {label} {row.measured_on} " in table, table
    assert (" measured on " in table) is (provenance == "measured"), table
    r = CliRunner().invoke(app, [*args, "--json"], env={"COLUMNS": "200"})
    assert json.loads(r.stdout.strip().splitlines()[-1])["measured_on"] == row.measured_on


@pytest.mark.parametrize("source", ["daemon", "database"])
def test_a_modelled_profile_used_with_a_warning_says_where_it_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                          source: str) -> None:
    """A MODELLED profile applied because allow_modelled is set comes with the client's warning. Served by the daemon,
    the table's note read "not from the daemon: daemon served a MODELLED profile ...", beside "source daemon"."""
    import warnings

    from moetune.runtime.profiles import client

    k = _key(FP)
    msg = f"daemon served a MODELLED profile (node_model, fingerprint {FP}); used because allow_modelled is set"
    res = client.Resolution(knobs=default_knobs("collective"), source=source, profile_hash="ab" * 8, status="current",
                            key=k, family="collective", provenance="node_model", tuned=False, message=msg)

    def resolve(self: object, **kw: object) -> client.Resolution:
        warnings.warn(f"moetune: using a MODELLED profile, not a tuned one ({msg})", stacklevel=2)
        return res

    monkeypatch.setattr(client.ProfileClient, "resolve", resolve)
    Store(tmp_path / "q.db").close()  # --db must exist; the lookup itself is the stand-in above
    r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--db",
                                 str(tmp_path / "q.db"), "--socket", f"ipc://{tmp_path}/none.sock", "--timeout-ms",
                                 "100"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    said = " ".join(r.stdout.split())
    assert "MODELLED (node model)" in said and msg in said, said
    assert ("not from the daemon" in said) is (source != "daemon"), said
    assert ("from the daemon, with a warning: " in said) is (source == "daemon"), said


@pytest.mark.parametrize(("provenance", "fp", "backend", "label"), [
    ("measured", FP, "local:gloo", "measured_on"),
    ("node_model", FP, f"model:node:{FP}", "modelled by the node model of"),
    ("preset", "preset:nvlink-h200x2:0123456789abcdef", "model:nvlink-h200x2", "predicted by"),
])
def test_only_a_measured_profile_shows_measured_on(tmp_path: Path, provenance: str, fp: str, backend: str,
                                                   label: str) -> None:
    """`profiles show` labels the origin row as `query` does: a MODELLED profile's read "measured_on 943cc5ad0d0417d8"
    (the node whose calibrated model predicted it) or "measured_on preset:NAME:DIGEST" under "provenance PRESET
    (MODELLED)", though nothing was measured; --json keeps the `measured_on` field."""
    db = tmp_path / "s.db"
    pid, row = _stored(db, _key(fp), provenance, backend)
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
