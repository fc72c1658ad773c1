"""A database with one profile in it, for the tests that hold it busy or take its write permission away."""

from __future__ import annotations

from pathlib import Path

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.store import Store


def put_one_profile(db: Path) -> None:
    """Store one modelled nvlink profile (id 1 in a new database) in `db`."""
    key = ProfileKey(fingerprint="fp", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                     intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=128)
    with Store(db) as s:
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5,
                                    backend="model:t"))
