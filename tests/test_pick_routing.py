"""A pick by latency among transport families at one bucket (the daemon's lookup, the runtime's database fallback,
`Store.find_profile`) compared a number measured under zipf routing with one measured under uniform routing: two
workloads, never compared anywhere else (the store keeps a profile of another routing as history, README "latencies
of two different routings are never compared"). The database fallback did not even read the routing column."""

from __future__ import annotations

from pathlib import Path

import msgspec

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles.db_lookup import pick_profile, query_db_profiles
from moetune.tuner.daemon.index import ProfileIndex
from moetune.tuner.store.store import Store

SHAPE = dict(ep_size=2, nodes=1, hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16")


def rec(family: str, lat: float, routing: str, bucket: int = 128) -> ProfileRecord:
    key = ProfileKey(fingerprint="fp", software="sw", transport_family=family, token_bucket=bucket, **SHAPE)
    kw = {} if not routing else {"routing": routing}
    return ProfileRecord(key=key, knobs=default_knobs(family), latency_us=lat, spread_us=1.0, backend="local:nccl",
                         provenance="measured", **kw)


def test_one_routing_keeps_one_routing_and_the_unrecorded() -> None:
    from moetune.runtime.profile_record import one_routing

    u, z, old = rec("nvlink", 250.0, "uniform"), rec("host_staged", 200.0, "zipf:1.2"), rec("collective", 300.0, "")
    assert one_routing([u, z, old]) == [u, old]  # uniform, where it is there; "" (not recorded) compares with any
    z2 = rec("collective", 10.0, "zipf:2")
    assert one_routing([z, z2]) == [z]  # else the first by name
    assert one_routing([z, old]) == [z, old]  # one recorded routing: nothing left out


def test_the_pick_among_families_never_compares_two_routings() -> None:
    uniform = rec("nvlink", 250.0, "uniform")
    zipf = rec("host_staged", 200.0, "zipf:1.2")  # lower, but a number of another workload
    assert pick_profile([zipf, uniform], 128) is uniform
    assert pick_profile([zipf], 128) is zipf  # alone, it is the profile there is
    assert pick_profile([zipf, uniform], 128, transport_family="host_staged") is zipf  # asked for by name


def test_the_daemons_lookup_never_compares_two_routings() -> None:
    idx = ProfileIndex([rec("host_staged", 200.0, "zipf:1.2"), rec("nvlink", 250.0, "uniform")], version=1,
                       facts=None, stale=[])
    idx.fingerprint, idx.software = "fp", "sw"
    ok, raw = idx.lookup(wire.GetProfile(v=wire.PROTOCOL_VERSION, id=1, tokens=128, **SHAPE))
    assert ok
    got = msgspec.json.decode(bytes(raw), type=wire.ProfileResult)
    assert got.key.transport_family == "nvlink", got.key


def test_the_store_and_the_database_fallback_never_compare_two_routings(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    with Store(db) as s:
        for r in (rec("host_staged", 200.0, "zipf:1.2"), rec("nvlink", 250.0, "uniform")):
            assert s.put_profile(r)[0]
        found = s.find_profile(fingerprint="fp", software="sw", tokens=128, **SHAPE)
        assert found is not None and found.key.transport_family == "nvlink", found
    recs = query_db_profiles(db, **SHAPE)
    assert sorted(r.tuned_routing for r in recs) == ["uniform", "zipf:1.2"]  # read, not left out
    picked = pick_profile(recs, 128)
    assert picked is not None and picked.key.transport_family == "nvlink"
