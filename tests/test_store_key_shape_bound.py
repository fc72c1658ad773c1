"""A profile key's shape (hidden, intermediate, experts, top-k) is one a ModelShape can be (at most
runtime.shapes.MAX_DIMENSION, what a daemon's get_profile takes). The store took any 64-bit integer there: an imported
key with hidden 2**40 was stored current, no request could ever be answered with it, and the daemon's re-tune of it
(`retune._shape_of`) failed the whole job. Refused with the field named, as every other impossible key is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.shapes import MAX_DIMENSION
from moetune.tuner.store.store import ProfileImportError, Store
from moetune.tuner.store.validate import FieldError


def _rec(hidden: int, experts: int = 8) -> ProfileRecord:
    key = ProfileKey(fingerprint="fp", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=hidden,
                     intermediate=8, experts=experts, topk=2, dtype="bfloat16", token_bucket=16)
    return ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5, backend="model:t")


@pytest.mark.parametrize(("hidden", "experts"), [(1 << 40, 8), (8, 1 << 32)])
def test_put_refuses_a_shape_past_the_bound(tmp_path: Path, hidden: int, experts: int) -> None:
    with Store(tmp_path / "m.db") as s:
        with pytest.raises(FieldError, match=f"at most {MAX_DIMENSION}"):
            s.put_profile(_rec(hidden, experts))
        assert s.put_profile(_rec(MAX_DIMENSION))[0]  # the largest a request carries is still a key
        assert s.count_profiles() == 1


def test_import_refuses_it_naming_the_field(tmp_path: Path) -> None:
    with Store(tmp_path / "src.db") as s:
        s.put_profile(_rec(64))
        doc = json.loads(s.dump_profiles())
    doc["profiles"][0]["key"]["hidden"] = 1 << 40
    with Store(tmp_path / "dst.db") as s:
        with pytest.raises(ProfileImportError, match=r"key\.hidden"):
            s.import_bytes(json.dumps(doc).encode())
        assert s.count_profiles() == 0
