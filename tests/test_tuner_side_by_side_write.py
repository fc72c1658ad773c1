"""What a local tune writes after measuring its winner beside the incumbent (tuner/search/tune.py _write_profile):
a winner that beat the incumbent side by side replaces it even when the incumbent's STORED number is faster (that
number may predate a change the fingerprint does not see); an incumbent that held its own gets its fresh number
(a re-measurement of the same knobs); every record says the routing it was measured under."""

from __future__ import annotations

from pathlib import Path

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.shapes import get_model
from moetune.tuner.search.backends import Measurement, TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend
from moetune.tuner.search.study import StudyResult
from moetune.tuner.search.tune import _write_profile
from moetune.tuner.store.store import Store

MODEL = get_model("qwen3-30b")
KEY = ProfileKey(fingerprint="c" * 64, software="d" * 64, transport_family="host_staged", ep_size=2, nodes=1,
                 hidden=MODEL.hidden, intermediate=MODEL.intermediate, experts=MODEL.experts, topk=MODEL.topk,
                 dtype=MODEL.dtype, token_bucket=1024)
OLD = Knobs(transport="host_staged", pipeline_depth=1, chunk_tokens=0)
NEW = Knobs(transport="host_staged", pipeline_depth=2, chunk_tokens=0)


class Facts:
    fingerprint, software_hash = "c" * 64, "d" * 64
    software: dict = {}  # noqa: RUF012


class SideBySide(LocalBackend):
    """compare() returns set numbers per knob set instead of running anything."""

    def __init__(self, us: dict[Knobs, float]) -> None:
        super().__init__(command=["true"], comm_backend="gloo", repeats=2)
        self.us = us

    def compare(self, cands, workload, rounds=2):  # type: ignore[override]
        return [Measurement(self.us[k], 1.0, [self.us[k]] * rounds, True) for k in cands]


def _store_incumbent(tmp_path: Path, latency_us: float) -> Store:
    store = Store(tmp_path / "p.db")
    ok, why = store.put_profile(ProfileRecord(
        key=KEY, knobs=OLD, latency_us=latency_us, spread_us=1.0, backend="local:gloo", status="current",
        software_versions={}, created="2026-12-01T00:00:00Z", updated="2026-12-01T00:00:00Z", provenance="measured",
        measured_on="c" * 64, routing="uniform"))
    assert ok, why
    return store


def _result(workload: TuneWorkload) -> StudyResult:
    return StudyResult(study_name="s", family="host_staged", workload=workload, best_knobs=NEW,
                       best=Measurement(90.0, 1.0, [90.0], True), trials=4, complete=4, failed=0, pruned=0)


def test_a_side_by_side_winner_replaces_a_stale_fast_number(tmp_path: Path) -> None:
    store = _store_incumbent(tmp_path, 50.0)  # stored long ago; today those knobs run at 120 µs
    _rec, written, reason = _write_profile(store, KEY, SideBySide({NEW: 90.0, OLD: 120.0}),
                                           _result(TuneWorkload(MODEL, 1024, gpus_per_node=2)), Facts())
    assert written, reason  # not "gain -40.000 us does not beat the noise" against the stored 50
    cur = store.get_current(KEY)
    assert cur is not None and cur.knobs == NEW and cur.latency_us == 90.0


def test_an_incumbent_that_holds_gets_its_fresh_number(tmp_path: Path) -> None:
    store = _store_incumbent(tmp_path, 50.0)
    _rec, written, reason = _write_profile(store, KEY, SideBySide({NEW: 99.5, OLD: 100.0}),
                                           _result(TuneWorkload(MODEL, 1024, gpus_per_node=2)), Facts())
    assert not written and "incumbent kept" in reason, reason
    cur = store.get_current(KEY)
    assert cur is not None and cur.knobs == OLD and cur.latency_us == 100.0  # not the stale 50.0
    assert any(e.kind == "remeasured" for e in store.list_events(kinds=("remeasured",)))


def test_the_record_says_its_routing(tmp_path: Path) -> None:
    store = Store(tmp_path / "p.db")
    rec, written, _ = _write_profile(store, KEY, SideBySide({NEW: 90.0}),
                                     _result(TuneWorkload(MODEL, 1024, gpus_per_node=2, routing="zipf:1.2")), Facts())
    assert written and rec is not None and rec.tuned_routing == "zipf:1.2"
    cur = store.get_current(KEY)
    assert cur is not None and cur.tuned_routing == "zipf:1.2"


class WinnerFails(SideBySide):
    """compare(): the winner's re-measurement fails (a run timed out), the others measure as set."""

    def compare(self, cands, workload, rounds=2):  # type: ignore[override]
        return [Measurement.failed("timed out after 120 s") if k == NEW else
                Measurement(self.us[k], 1.0, [self.us[k]] * rounds, True) for k in cands]


DEFAULT = Knobs(transport="host_staged")  # OLD's knobs
INC = Knobs(transport="host_staged", pipeline_depth=4, chunk_tokens=0)


def _store_other_incumbent(tmp_path: Path) -> Store:
    store = _store_incumbent(tmp_path, 50.0)
    ok, why = store.put_profile(ProfileRecord(
        key=KEY, knobs=INC, latency_us=50.0, spread_us=1.0, backend="local:gloo", status="current",
        software_versions={}, created="2026-12-02T00:00:00Z", updated="2026-12-02T00:00:00Z", provenance="measured",
        measured_on="c" * 64, routing="uniform"), force_reason="test")
    assert ok, why
    return store


def test_a_winner_that_fails_again_gives_way_to_the_default(tmp_path: Path) -> None:
    # the bring-up's compare stage stores the default measured beside a failed winner; the tune stored nothing, and
    # the stale incumbent (a re-tune's key) stayed current with its old number though the default beat it clearly
    store = _store_other_incumbent(tmp_path)
    rec, written, reason = _write_profile(store, KEY, WinnerFails({DEFAULT: 100.0, INC: 150.0}),
                                          _result(TuneWorkload(MODEL, 1024, gpus_per_node=2)), Facts(), default=DEFAULT)
    assert written and rec is not None and rec.knobs == DEFAULT, reason
    assert "failed when measured again" in reason and "100.0 µs" in reason, reason
    cur = store.get_current(KEY)
    assert cur is not None and cur.knobs == DEFAULT and cur.latency_us == 100.0


def test_a_winner_that_fails_again_leaves_an_incumbent_that_beats_the_default(tmp_path: Path) -> None:
    store = _store_other_incumbent(tmp_path)
    rec, written, reason = _write_profile(store, KEY, WinnerFails({DEFAULT: 100.0, INC: 60.0}),
                                          _result(TuneWorkload(MODEL, 1024, gpus_per_node=2)), Facts(), default=DEFAULT)
    assert rec is None and not written and "failed when measured again" in reason and "incumbent kept" in reason
    cur = store.get_current(KEY)
    assert cur is not None and cur.knobs == INC and cur.latency_us == 60.0  # its fresh number


def test_a_winner_that_fails_beside_a_failed_default_stores_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "p.db")

    class AllFail(SideBySide):
        def compare(self, cands, workload, rounds=2):  # type: ignore[override]
            return [Measurement.failed("timed out after 120 s") for _ in cands]

    rec, written, reason = _write_profile(store, KEY, AllFail({}), _result(TuneWorkload(MODEL, 1024, gpus_per_node=2)),
                                          Facts(), default=DEFAULT)
    assert rec is None and not written and reason.startswith("the winner failed when measured again")
