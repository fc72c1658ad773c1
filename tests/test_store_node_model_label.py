"""A `node_model` label is this node's calibrated model's, never a shipped preset's nor another node's model's. The
store refuses a false `node_model` as it refuses a false `measured`: a `node_model` row on a preset backend
(`model:dgx-h100`) or another node's model (`model:node:<other fp>`), stored by put_profile or an import, would
replace a faster real preset by the rank rule (node_model outranks preset), be served as this node's model, and pass
`db check`. A `local:*` backend may still be labelled node_model: an unlabelled import of a measurement becomes
node_model by design."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.io import ProfileImportError
from moetune.tuner.store.store import Store
from moetune.tuner.store.validate import FieldError

KEY = ProfileKey(fingerprint="fpA", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=2048,
                 intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=256)
KNOBS = default_knobs("nvlink")


def _preset(s: Store) -> None:
    """A real preset prediction, 50 µs: what a false node_model of 90 µs must not displace."""
    ok, why = s.put_profile(ProfileRecord(key=KEY, knobs=KNOBS.replace(num_sms=24), latency_us=50, spread_us=1,
                                          backend="model:dgx-h100", provenance="preset"))
    assert ok, why


def _doc(**rec: object) -> bytes:
    return json.dumps({
        "format": "moetune-profiles", "version": 1,
        "fingerprints": [{"hash": "fpA", "facts": {}, "first_seen": "2026-01-01T00:00:00+00:00",
                          "last_seen": "2026-01-01T00:00:00+00:00"}],
        "profiles": [{"key": KEY.to_dict(), "knobs": KNOBS.replace(num_sms=16).to_dict(), "latency_us": 90.0,
                      "spread_us": 1.0, **rec}]}).encode()


def _current(s: Store) -> list[tuple[str, str, float]]:
    return [(str(r.provenance), r.backend, r.latency_us) for _i, r in s.list_profiles(status="current")]


@pytest.mark.parametrize("backend", ["model:dgx-h100", "model:node:fpOTHER"])
def test_put_profile_refuses_node_model_for_a_number_that_is_not_this_nodes_model(tmp_path: Path, backend: str) -> None:
    with Store(tmp_path / "m.db") as s:
        _preset(s)
        with pytest.raises(FieldError, match="provenance: node_model, but backend"):
            s.put_profile(ProfileRecord(key=KEY, knobs=KNOBS.replace(num_sms=16), latency_us=90, spread_us=1,
                                        backend=backend, provenance="node_model"))
        assert _current(s) == [("preset", "model:dgx-h100", 50.0)]
        assert s.check()["ok"]


@pytest.mark.parametrize("backend", ["model:dgx-h100", "model:node:fpOTHER"])
def test_an_import_refuses_node_model_for_a_preset_or_another_nodes_model(tmp_path: Path, backend: str) -> None:
    with Store(tmp_path / "m.db") as s:
        _preset(s)
        with pytest.raises(ProfileImportError, match="node_model, but backend"):
            s.import_bytes(_doc(backend=backend, provenance="node_model", measured_on=""))
        assert _current(s) == [("preset", "model:dgx-h100", 50.0)]
        assert s.check()["ok"]


def test_this_nodes_model_and_a_local_backend_may_still_be_labelled_node_model(tmp_path: Path) -> None:
    with Store(tmp_path / "m.db") as s:
        _preset(s)
        ok, why = s.put_profile(ProfileRecord(key=KEY, knobs=KNOBS.replace(num_sms=16), latency_us=90, spread_us=1,
                                              backend="model:node:fpA", provenance="node_model"))
        assert ok, why  # this node's model outranks a preset
        # an unlabelled measurement (nothing says where it was measured) is imported as node_model
        s.import_bytes(_doc(backend="local:nccl", latency_us=80.0))
        assert ("node_model", "local:nccl") in {(str(r.provenance), r.backend) for _i, r in s.list_profiles()}
        assert s.check()["ok"]


def test_an_unlabelled_record_of_another_nodes_model_is_a_preset(tmp_path: Path) -> None:
    rec = ProfileRecord(key=KEY, knobs=KNOBS, latency_us=9, spread_us=1, backend="model:node:fpOTHER")
    assert rec.provenance == rec.effective_provenance == "preset"
    with Store(tmp_path / "m.db") as s:
        s.import_bytes(_doc(backend="model:node:fpOTHER"))
        assert _current(s) == [("preset", "model:node:fpOTHER", 90.0)]


@pytest.mark.parametrize("backend", ["model:dgx-h100", "model:node:fpOTHER"])
def test_a_stored_false_node_model_ranks_as_a_preset_and_db_check_names_it(tmp_path: Path, backend: str) -> None:
    """A row an older moetune imported, or a hand edit: taken as the preset it is everywhere, and named by check."""
    path = tmp_path / "m.db"
    with Store(path) as s:
        ok, why = s.put_profile(ProfileRecord(key=KEY, knobs=KNOBS.replace(num_sms=16), latency_us=90, spread_us=1,
                                              backend=backend, provenance="preset"))
        assert ok, why
    with sqlite3.connect(path) as c:
        c.execute("UPDATE profiles SET provenance = 'node_model', measured_on = ''")
    with Store(path) as s:
        ((i, rec),) = s.list_profiles()
        assert rec.effective_provenance == "preset" and s.provenance_of(KEY)[0] == "preset"
        info = s.check()
        assert not info["ok"] and info["mislabelled_profiles"] == [{"id": i, "backend": backend,
                                                                    "provenance": "node_model"}]
    r = CliRunner().invoke(app, ["db", "check", "--db", str(path)], env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and f"profile {i}: labelled node_model, but its backend" in text, r.output
    r = CliRunner().invoke(app, ["profiles", "show", str(i), "--db", str(path)], env={"COLUMNS": "200"})
    assert "stored as node_model, but its backend is not this node's model" in " ".join(r.output.split()), r.output
    with Store(path) as s:
        # a real preset 40 µs faster replaces it (as a node_model it outranked every preset)
        _preset(s)
        assert _current(s) == [("preset", "model:dgx-h100", 50.0)]


OTHER_FP = "0123456789abcdef"  # another node's fingerprint: 16 hex digits, as a preset's content digest is


@pytest.mark.parametrize("label", ["preset", "node_model"])  # stored as what it is; a false label, taken as a preset
def test_another_nodes_model_taken_as_a_preset_is_not_shown_as_a_preset_file(tmp_path: Path, label: str) -> None:
    """Its measured_on reads preset:node:<other fp>, which presets.preset_origin took for a preset file named "node"
    with that fingerprint as its content digest: `query` and `profiles show` printed "a preset file named node ...,
    content digest <fp>". They now say it is another node's fabric model taken as a preset."""
    from types import SimpleNamespace

    from moetune.tuner.cli import query as Q

    path = tmp_path / "m.db"
    backend = f"model:node:{OTHER_FP}"
    with Store(path) as s:
        ok, why = s.put_profile(ProfileRecord(key=KEY, knobs=KNOBS, latency_us=90, spread_us=1, backend=backend,
                                              provenance="preset"))
        assert ok, why
    if label == "node_model":  # a row an older moetune imported, or a hand edit
        with sqlite3.connect(path) as c:
            c.execute("UPDATE profiles SET provenance = 'node_model', measured_on = ''")
    with Store(path) as s:
        ((i, rec),) = s.list_profiles()
    res = SimpleNamespace(key=KEY, profile_hash=rec.profile_hash, provenance="preset", tuned=False, source="daemon")
    prov, measured_on, got_backend = Q.provenance_of(res, path)  # what `query` prints from
    assert (prov, measured_on, got_backend) == ("preset", f"preset:node:{OTHER_FP}", backend)
    shipped, note = Q.preset_note(prov, measured_on, got_backend)
    assert shipped is False and "another node's fabric model taken as a preset" in note and OTHER_FP in note, note
    assert "a preset file named" not in note and "content digest" not in note
    r = CliRunner().invoke(app, ["profiles", "show", str(i), "--db", str(path)], env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "another node's fabric model taken as a preset" in text, r.output
    assert "a preset file named node" not in text, r.output
    # a preset file's row is still told by its digest
    assert Q.preset_note("preset", "preset:my-fabric:0123456789abcdef", "model:my-fabric")[1].startswith(
        "a preset file named my-fabric")
    assert Q.preset_note("node_model", f"preset:node:{OTHER_FP}", backend) == (None, "")


PRESET_KEY = ProfileKey(fingerprint="preset:dgx-h100:0123456789abcdef", software="modelled", transport_family="nvlink",
                        ep_size=2, nodes=1, hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16",
                        token_bucket=256)


def test_no_node_model_under_a_what_if_presets_key(tmp_path: Path) -> None:
    """`preset:NAME:DIGEST` names a modelled fabric, no node: `model:node:<that key>` is no node's calibrated model
    (no writer labels one so: `node_model_refusal` asks a calibration on a node's fingerprint). Labelled node_model it
    was stored, passed `db check`, and outranked the preset's own prediction of the key."""
    backend = f"model:node:{PRESET_KEY.fingerprint}"
    with Store(tmp_path / "m.db") as s:
        with pytest.raises(FieldError, match="provenance: node_model, but the key's fingerprint"):
            s.put_profile(ProfileRecord(key=PRESET_KEY, knobs=KNOBS.replace(num_sms=16), latency_us=90, spread_us=1,
                                        backend=backend, provenance="node_model"))
        assert s.list_profiles() == []
    # a row stored before (a hand edit, another tool): taken as a preset, named by check, and the preset's own
    # prediction, faster, replaces it
    path = tmp_path / "old.db"
    with Store(path) as s:
        ok, why = s.put_profile(ProfileRecord(key=PRESET_KEY, knobs=KNOBS.replace(num_sms=16), latency_us=90,
                                              spread_us=1, backend=backend, provenance="preset",
                                              measured_on=PRESET_KEY.fingerprint))
        assert ok, why
    with sqlite3.connect(path) as c:
        c.execute("UPDATE profiles SET provenance = 'node_model'")
    with Store(path) as s:
        ((i, rec),) = s.list_profiles()
        assert rec.effective_provenance == "preset"
        assert rec.as_effective().measured_on == PRESET_KEY.fingerprint
        info = s.check()
        assert not info["ok"] and info["mislabelled_profiles"] == [{"id": i, "backend": backend,
                                                                    "provenance": "node_model"}]
        ok, why = s.put_profile(ProfileRecord(key=PRESET_KEY, knobs=KNOBS.replace(num_sms=24), latency_us=50,
                                              spread_us=1, backend="model:dgx-h100", provenance="preset",
                                              measured_on=PRESET_KEY.fingerprint))
        assert ok, why
        assert _current(s) == [("preset", "model:dgx-h100", 50.0)]
