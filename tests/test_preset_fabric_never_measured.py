"""A what-if preset's fingerprint (`preset:NAME[:DIGEST]`) names a modelled fabric, never a node: nothing was measured
on it. A record labelled `measured` under such a key (a `local:*` backend, measured_on the key's fingerprint) was
stored and imported, listed as measured, and displaced the preset's own prediction by the rank rule."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.io import ProfileImportError
from moetune.tuner.store.store import Store
from moetune.tuner.store.validate import FieldError

PRESET_FP = "preset:ndr-ibrc-h100x8:0123456789abcdef"


def key(bucket: int = 128) -> ProfileKey:
    return ProfileKey(fingerprint=PRESET_FP, software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                      intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=bucket)


def measured() -> ProfileRecord:
    return ProfileRecord(key=key(), knobs=default_knobs("nvlink"), latency_us=50.0, spread_us=0.1,
                         backend="local:nccl", provenance="measured")


def test_a_measured_label_under_a_preset_key_is_refused_by_the_store(tmp_path: Path) -> None:
    with Store(tmp_path / "p.db") as s:
        s.put_profile(ProfileRecord(key=key(), knobs=default_knobs("nvlink"), latency_us=5.0, spread_us=0.1,
                                    backend="model:ndr-ibrc-h100x8", provenance="preset", measured_on=PRESET_FP))
        with pytest.raises(FieldError, match="preset"):
            s.put_profile(measured())
        # the preset's prediction stays the current profile of its key, labelled as what it is
        assert [(r.status, r.effective_provenance) for _i, r in s.list_profiles()] == [("current", "preset")]


def test_an_import_claiming_a_measurement_on_a_preset_fabric_is_refused(tmp_path: Path) -> None:
    rec = {**msgspec.to_builtins(measured()), "created": "2026-11-01T00:00:00+00:00",
           "updated": "2026-11-01T00:00:00+00:00"}
    assert rec["measured_on"] == PRESET_FP  # the key's fingerprint: what import asks of a measurement
    doc = {"format": "moetune-profiles", "version": 1, "moetune_version": "0", "profiles": [rec],
           "fingerprints": [{"hash": PRESET_FP, "facts": {}, "first_seen": "2026-11-01T00:00:00+00:00",
                             "last_seen": "2026-11-01T00:00:00+00:00"}]}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(doc))
    with Store(tmp_path / "dst.db") as s:
        with pytest.raises(ProfileImportError, match="preset"):
            s.import_profiles(path)
        assert s.list_profiles() == []


def _stored_before_the_refusal(tmp_path: Path) -> Path:
    """A database holding a `measured` row under a preset's key, as an import before 75dd592 stored one (here by a
    hand edit: no writer of today's moetune can)."""
    path = tmp_path / "old.db"
    with Store(path) as s:
        ok, why = s.put_profile(ProfileRecord(key=key(), knobs=default_knobs("nvlink"), latency_us=50.0, spread_us=0.1,
                                              backend="local:nccl", provenance="preset", measured_on=PRESET_FP))
        assert ok, why
    import sqlite3

    with sqlite3.connect(path) as c:
        c.execute("UPDATE profiles SET provenance = 'measured'")
    return path


def test_a_measured_row_stored_under_a_preset_key_before_the_refusal_is_taken_as_the_preset_and_named(
        tmp_path: Path) -> None:
    """Such a row was listed and exported as measured (an export no import takes back: it refuses the label), ranked
    above the preset's own prediction, and `db check` said ok."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    path = _stored_before_the_refusal(tmp_path)
    with Store(path) as s:
        ((i, rec),) = s.list_profiles()
        assert str(rec.provenance) == "measured"  # the stored label, kept as it is
        assert rec.effective_provenance == "preset" and not rec.is_tuned_for(PRESET_FP, "sw")
        assert s.list_profiles(provenance="measured") == []
        eff = rec.as_effective()
        # the preset it stands for is the key's (`preset:NAME:DIGEST`), not a name made of its backend
        assert (eff.provenance, eff.measured_on) == ("preset", PRESET_FP)
        assert s.provenance_of(key()) == ("preset", PRESET_FP, "local:nccl")
        info = s.check()
        assert not info["ok"] and info["mislabelled_profiles"] == [{"id": i, "backend": "local:nccl",
                                                                    "provenance": "measured"}]
        # an export of it is one an import takes
        s.export_profiles(tmp_path / "out.json")
    doc = json.loads((tmp_path / "out.json").read_text())
    assert [(p["provenance"], p["measured_on"]) for p in doc["profiles"]] == [("preset", PRESET_FP)]
    with Store(tmp_path / "again.db") as s:
        s.import_profiles(tmp_path / "out.json")
        assert [str(r.provenance) for _i, r in s.list_profiles()] == ["preset"]
    r = CliRunner().invoke(app, ["db", "check", "--db", str(path)], env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and f"profile {i}: labelled measured, but its key's fingerprint" in text, r.output
    r = CliRunner().invoke(app, ["profiles", "show", str(i), "--db", str(path)], env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "PRESET" in text and "does not measure" not in text, r.output
    assert "stored as measured, but its key is a what-if preset's" in text, r.output


def test_put_profile_refuses_a_measurement_whose_measured_on_names_another_fingerprint(tmp_path: Path) -> None:
    """Import refused it (`check_import_record`); put_profile stored it, listed as measured under this key, and the
    client applied it as tuned: numbers measured on another node served as this one's."""
    k = msgspec.structs.replace(key(), fingerprint="fpA")
    with Store(tmp_path / "p.db") as s:
        with pytest.raises(FieldError, match="measured_on: a measured profile is measured on its key's fingerprint"):
            s.put_profile(ProfileRecord(key=k, knobs=default_knobs("nvlink"), latency_us=50.0, spread_us=0.1,
                                        backend="local:nccl", provenance="measured", measured_on="fpB"))
        assert s.list_profiles() == []
        ok, why = s.put_profile(ProfileRecord(key=k, knobs=default_knobs("nvlink"), latency_us=50.0, spread_us=0.1,
                                              backend="local:nccl", provenance="measured"))
        assert ok, why  # measured_on defaults to the key's fingerprint
