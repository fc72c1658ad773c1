"""A what-if preset's fingerprint (`preset:NAME`) names a modelled fabric, no node: a model tune records it without
facts. An imported file that gave it facts stored them as that fingerprint's, and `fabric diff` (a capture compared
with the newest stored facts) or `fabric diff --against preset:...` then read some node's facts as the preset's
fabric. The import refuses facts under a preset's fingerprint; the empty placeholder a model tune exports imports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.io import ProfileImportError
from moetune.tuner.store.store import Store

FP = "preset:ndr-ibrc-h100x8"


def _export(tmp_path: Path) -> dict:
    key = ProfileKey(fingerprint=FP, software="sw", transport_family="nvlink", ep_size=8, nodes=1, hidden=7168,
                     intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=128)
    with Store(tmp_path / "src.db") as s:
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=50.0, spread_us=0.5,
                                    backend="model:ndr-ibrc-h100x8", provenance="preset"))
        return json.loads(s.dump_profiles())


def test_a_preset_fingerprint_without_facts_imports(tmp_path: Path) -> None:
    doc = _export(tmp_path)
    assert [f["facts"] for f in doc["fingerprints"]] == [{}]
    with Store(tmp_path / "dst.db") as s:
        assert s.import_bytes(json.dumps(doc).encode()).inserted == 1


def test_facts_under_a_preset_fingerprint_are_refused(tmp_path: Path) -> None:
    doc = _export(tmp_path)
    doc["fingerprints"][0]["facts"] = {"gpu": "H100", "n": 8}
    with Store(tmp_path / "dst.db") as s:
        with pytest.raises(ProfileImportError, match=r"fingerprints\[0\].*preset"):
            s.import_bytes(json.dumps(doc).encode())
        assert s.get_fingerprint(FP) is None
