"""The bring-up's compare stage stores by the rules of `moetune tune`'s side-by-side write: the current stored profile
is measured beside the tuned setting and the policy default (a faster one is not replaced unmeasured), a profile of
another routing is never replaced, the record says its routing, a gain is called only on enough samples (and beyond
each run's own spread), and the tune stage stores nothing before that check. A local tune whose time budget is spent
does not re-measure after it."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.shapes import ModelShape, get_model
from moetune.tuner.search.backends import CallableBackend, Measurement, TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend
from moetune.tuner.search.policy import load_policy

# their bring-ups inject the timings of a GPU node's capture: run as ON that node (conftest), the only place a
# measurement may be stored under its key
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"
DEFAULT = load_policy("megakernel").defaults
COLLECTIVE = load_policy("collective").defaults
X = DEFAULT.replace(mk_bm=64, mk_stages=3, mk_combine_tokens=32, mk_ctas_per_sm=2)  # the stored profile's knobs


def timed(x_us: float, other_us: float, samples: int = 3) -> Any:
    """The megakernel's timing: the policy default 300 µs, X `x_us`, any other setting `other_us`."""
    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        base = 300.0 if knobs == DEFAULT else x_us if knobs == X else other_us
        return {"graph_us": [base, base + 1, base - 1][:samples], "eager_us": [base] * samples}
    return measure


def _bringup(tmp_path: Path, measure: Any, **plan_kw: Any) -> Any:
    from moetune.tuner.bringup.flow import Bringup, Plan

    plan = Plan(**{"models": ["qwen3-30b"], "tokens": [16], "trials": 3, "repeats": 1, "iters": 5,
                   "compare_rounds": 2, **plan_kw})
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                console=Console(file=io.StringIO(), width=200), capture=CAPTURES / "h200x1",
                storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=measure)
    b.state.mark("discover", b.stage_discover())
    b.state.mark("microbench", [])
    b.state.mark("calibrate", {"skipped": "test"})
    return b


def _key(b: Any) -> ProfileKey:
    m = get_model("qwen3-30b")
    return ProfileKey(fingerprint=b.facts.fingerprint, software=b.facts.software_hash, transport_family="megakernel",
                      ep_size=1, nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts,
                      topk=m.topk, dtype=m.dtype, token_bucket=16)


def _store_x(b: Any, routing: str) -> None:
    ok, why = b.store.put_profile(ProfileRecord(
        key=_key(b), knobs=X, latency_us=150.0, spread_us=1.0, backend="local:megakernel",
        software_versions=dict(b.facts.software), provenance="measured", routing=routing))
    assert ok, why


def _tune_and_compare(b: Any) -> dict:
    b.state.mark("tune", b.stage_tune())
    b.state.mark("compare", b.stage_compare())
    (row,) = b.state.result("compare")
    return row


# -- defect 1: the current profile is a rival, and its routing is respected ------------------------------------------
def test_a_faster_current_profile_is_measured_and_kept(tmp_path: Path) -> None:
    b = _bringup(tmp_path, timed(x_us=150.0, other_us=210.0))
    _store_x(b, "uniform")
    row = _tune_and_compare(b)
    cur = b.store.get_current(_key(b))
    # the 210 µs winner must not replace the 150 µs profile (compared with the default only, stored by force)
    assert cur is not None and cur.knobs == X, row
    assert row["stored"] == "current profile" and "incumbent kept" in row["reason"], row
    assert row["current_us"] == 150.0


def test_a_profile_of_another_routing_is_not_replaced(tmp_path: Path) -> None:
    b = _bringup(tmp_path, timed(x_us=150.0, other_us=100.0))
    _store_x(b, "zipf:1.2")
    row = _tune_and_compare(b)
    cur = b.store.get_current(_key(b))
    # not replaced by a record without routing (UNSET), which would skip the store's routing guard
    assert cur is not None and cur.knobs == X and cur.tuned_routing == "zipf:1.2", row
    assert not row["written"] and "routing zipf:1.2" in row["reason"], row
    history = [r for _, r in b.store.list_profiles(status="superseded")]
    assert any(r.tuned_routing == "uniform" and r.knobs != X for r in history)  # the uniform result is kept as history


def test_a_tuned_setting_that_beats_both_replaces_and_says_its_routing(tmp_path: Path) -> None:
    b = _bringup(tmp_path, timed(x_us=150.0, other_us=100.0))
    _store_x(b, "uniform")
    row = _tune_and_compare(b)
    cur = b.store.get_current(_key(b))
    assert cur is not None and cur.knobs not in (X, DEFAULT) and cur.latency_us == 100.0, row
    assert cur.tuned_routing == "uniform"  # not UNSET
    assert row["stored"] == "tuned" and "beat the incumbent side by side" in row["reason"], row


# -- defect 2: no gain called inside a run's own noise, nor on one sample ---------------------------------------------
def test_compare_keeps_each_runs_own_spread() -> None:
    wl = TuneWorkload(get_model("qwen3-30b"), 128)
    be = CallableBackend(lambda k, w: Measurement(100.0, 20.0, [100.0], True))
    (m,) = be.compare([Knobs()], wl, rounds=1)
    assert m.spread_us == 20.0  # not 0 (the pooled medians of one run)
    (m,) = be.compare([Knobs()], wl, rounds=2)
    assert m.spread_us == 20.0  # two equal medians: still the runs' spread


def test_one_sample_each_keeps_the_default_and_says_why(tmp_path: Path) -> None:
    from moetune.tuner.bringup.flow import Plan

    b = _bringup(tmp_path, timed(x_us=200.0, other_us=200.0, samples=1), compare_rounds=1)
    row = _tune_and_compare(b)
    cur = b.store.get_current(_key(b))
    # 200 vs 300 µs, each one sample of spread 0, must not store the tuned setting
    assert cur is not None and cur.knobs == DEFAULT, row
    assert row["stored"] == "policy default" and "sample(s)" in row["why_default"], row
    from moetune.tuner.search.backends import MIN_COMPARE_SAMPLES

    quick = Plan.quick()  # --quick still measures enough to call a gain
    assert quick.repeats * quick.compare_rounds >= MIN_COMPARE_SAMPLES


# -- defect 3: the compare stage is the only writer --------------------------------------------------------------------
def test_the_tune_stage_stores_nothing_and_an_interrupted_bringup_serves_nothing_unchecked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = _bringup(tmp_path, timed(x_us=296.0, other_us=296.0))
    F.interrupt_before_compare(b, monkeypatch)
    assert b.state.result("tune")[0]["knobs"]  # the candidate waits in the state file
    assert b.store.list_profiles() == []  # the unchecked winner is not current (served)
    again = _bringup(tmp_path, timed(x_us=296.0, other_us=296.0))
    again.run()
    cur = again.store.get_current(_key(again))
    assert cur is not None and cur.tuned_routing == "uniform"


# -- defect 4: a spent time budget runs no side-by-side re-measurement ------------------------------------------------
class _Facts:
    fingerprint, software_hash, gpu_count = "c" * 64, "d" * 64, 0
    software: dict = {}  # noqa: RUF012
    link_rates: dict = {}  # noqa: RUF012
    transports = (type("F", (), {"name": "collective"})(),)


class _Counting(LocalBackend):
    def __init__(self) -> None:
        super().__init__(world=2, comm_backend="gloo", repeats=2, metric="comm", persistent=False, command=["true"])
        self.runs = 0

    def run_once(self, knobs: Knobs, wl: TuneWorkload) -> tuple[float, dict, None]:
        self.runs += 1
        v = 100.0 + knobs.num_sms % 7
        return v, {"roundtrip_us": {"median": v, "p10": v - 1, "p90": v + 1}, "seconds": 0.0}, None


SMALL = ModelShape(name="custom:256,128,16,2", hidden=256, intermediate=128, experts=16, topk=2)
SMALL_KEY = ProfileKey(fingerprint=_Facts.fingerprint, software=_Facts.software_hash, transport_family="collective",
                       ep_size=2, nodes=1, hidden=256, intermediate=128, experts=16, topk=2, dtype=SMALL.dtype,
                       token_bucket=64)


def _tune_small(tmp_path: Path, store: Any, backend: Any, **kw: Any) -> Any:
    """tune_profiles_detailed of the collective family for SMALL at S=64 (3 trials unless `kw` says), Optuna quiet;
    its one TuneResult."""
    import optuna

    from moetune.tuner.search.tune import tune_profiles_detailed

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    kw = {"trials": 3, **kw}
    (res,) = tune_profiles_detailed(store, _Facts(), backend=backend, models=[SMALL], tokens=[64],
                                    families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}", **kw)
    return res


def _tune_over(tmp_path: Path, backend: Any, *, stored_us: float, stored_backend: str) -> tuple[Any, Any]:
    """A tune of SMALL over a current measured profile of the collective default (`stored_us` by
    `stored_backend`): its TuneResult and the current profile after it."""
    from moetune.tuner.store.store import Store

    store = Store(tmp_path / "p.db")
    store.put_profile(ProfileRecord(key=SMALL_KEY, knobs=COLLECTIVE, latency_us=stored_us, spread_us=1.0,
                                    backend=stored_backend, provenance="measured", routing="uniform"))
    res = _tune_small(tmp_path, store, backend)
    return res, store.get_current(SMALL_KEY)


def test_a_spent_time_budget_skips_the_recheck(tmp_path: Path) -> None:
    from moetune.tuner.store.store import Store

    store = Store(tmp_path / "p.db")
    done = _tune_small(tmp_path, store, _Counting())
    assert done.study.trials == 3 and not done.budget_ended
    be = _Counting()
    res = _tune_small(tmp_path, store, be, timeout_s=1e-9)  # the study resumes, done
    assert be.runs == 0, "re-measured after the time budget was spent"  # not 2 rounds x 2 repeats per setting
    assert res.budget_ended and not res.written
    assert res.reason == "time budget spent before the side-by-side check; rerun to finish"


def test_a_stop_before_the_side_by_side_check_measures_and_stores_nothing_more(tmp_path: Path) -> None:
    """A daemon job's cancel (`stop`) is seen before the side-by-side check, which re-measures every candidate
    (a minute a key on a CPU node): a resumed study runs no trial, so the per-trial check never saw it."""
    from moetune.tuner.store.store import Store

    store = Store(tmp_path / "p.db")
    _tune_small(tmp_path, store, _Counting())
    be, asked = _Counting(), []
    res = _tune_small(tmp_path, store, be, stop=lambda: asked.append(1) or len(asked) > 1)  # before the check: stop
    assert be.runs == 0 and res.stopped and not res.written and res.record is None
    assert res.reason == "stopped before the side-by-side check" and len(asked) == 2
    from moetune.tuner.search.tune import tune_profiles_detailed

    assert tune_profiles_detailed(store, _Facts(), backend=_Counting(), models=[SMALL], tokens=[64],
                                  families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}",
                                  stop=lambda: True) == []  # asked before the first study: nothing runs


def test_a_search_the_budget_cut_midway_is_still_checked_and_stored(tmp_path: Path) -> None:
    """Only a study whose trials were all done before is skipped: one the budget cut midway (`--timeout 12` with 40
    trials asked) skipped its check too and stored nothing, run after run."""
    import time

    from moetune.tuner.store.store import Store

    class Slow(_Counting):
        def run_once(self, knobs: Knobs, wl: TuneWorkload) -> tuple[float, dict, None]:
            time.sleep(0.05)
            return super().run_once(knobs, wl)

    store = Store(tmp_path / "p.db")
    res = _tune_small(tmp_path, store, Slow(), trials=200, timeout_s=0.5)
    assert res.budget_ended and 0 < res.study.trials < 200, res
    assert res.written and store.list_profiles() != [], res.reason


def test_recheck_false_stores_nothing_where_no_knob_acts_either(tmp_path: Path) -> None:
    from moetune.tuner.search.study import StudyResult
    from moetune.tuner.search.tune import _write_profile
    from moetune.tuner.store.store import Store

    m = get_model("qwen3-30b")
    key = ProfileKey(fingerprint="c" * 64, software="d" * 64, transport_family="megakernel", ep_size=1, nodes=1,
                     hidden=m.hidden, intermediate=m.intermediate, experts=m.experts, topk=m.topk, dtype=m.dtype,
                     token_bucket=1)
    res = StudyResult(study_name="s", family="megakernel", workload=TuneWorkload(m, 1), best_knobs=DEFAULT,
                      best=Measurement(90.0, 1.0, [90.0], True), trials=1, complete=1, failed=0, pruned=0)
    store = Store(tmp_path / "p.db")
    be = LocalBackend(world=1, comm_backend="nccl", repeats=1, family="megakernel", command=["true"])
    rec, written, reason = _write_profile(store, key, be, res, _Facts(), default=DEFAULT,
                                          inert="the decode kernel: no knob acts", recheck=False)
    assert rec is not None and not written and "not stored yet" in reason
    assert store.list_profiles() == []  # the tune stage stores no default unchecked


def test_a_slower_search_best_is_not_called_a_gain_within_noise() -> None:
    """The report said "the winner's gain is within noise" of a tuned setting 7x slower than the default."""
    from moetune.tuner.search.tune import side_by_side

    best, default = Knobs(channels=2), Knobs()
    samples = [1.0] * 8
    slow = side_by_side(best, None, default, {best: Measurement(39040.9, 10.0, samples, True),
                                              default: Measurement(5527.8, 10.0, samples, True)})
    assert slow.knobs == default and "the search's best is no faster, the default stored" in slow.why, slow.why
    near = side_by_side(best, None, default, {best: Measurement(5520.0, 10.0, samples, True),
                                              default: Measurement(5527.8, 10.0, samples, True)})
    assert near.knobs == default and "the winner's gain is within noise" in near.why, near.why


def test_a_side_by_side_replaces_a_profile_of_the_other_metric(tmp_path: Path) -> None:
    """A whole-layer tune whose side-by-side check chose the knobs a bring-up stored as a round trip was filed as
    superseded history ('only a side-by-side re-measurement in the layer metric replaces it': the one just run),
    run after run; the old round-trip row stayed current."""

    class Layer(LocalBackend):
        def __init__(self) -> None:
            super().__init__(world=2, comm_backend="gloo", repeats=2, metric="layer", persistent=False,
                             command=["true"])

        def run_once(self, knobs: Knobs, wl: TuneWorkload) -> tuple[float, dict, None]:
            v = 100.0 if knobs == COLLECTIVE else 500.0  # the default, stored by the bring-up, is fastest
            return v, {"layer_us": {"median": v, "p10": v - 1, "p90": v + 1}, "seconds": 0.0}, None

    res, cur = _tune_over(tmp_path, Layer(), stored_us=60.0, stored_backend="local:gloo:comm")
    assert res.written and cur is not None and cur.backend == "local:gloo" and cur.latency_us == 100.0, res.reason


def test_a_round_trip_never_displaces_a_whole_layer(tmp_path: Path) -> None:
    """The reverse of the case above: a bring-up (round trips) over a tuned whole-layer profile replaced it with
    a round-trip number of the same knobs, and the pick among families then compared that family no more."""
    res, cur = _tune_over(tmp_path, _Counting(), stored_us=900.0, stored_backend="local:gloo")
    assert cur is not None and cur.backend == "local:gloo" and cur.latency_us == 900.0, (res.reason, cur)


def test_a_time_budget_is_shared_over_the_studies_so_a_later_bucket_starts(tmp_path: Path) -> None:
    """One --timeout over several studies (buckets): each study gets the time left divided by the studies left, and
    says what it got. Given all the time left, a first study that cannot finish its trials would take the whole
    budget on every rerun and the later buckets never start."""
    import time

    import optuna

    from moetune.tuner.search.tune import tune_profiles_detailed
    from moetune.tuner.store.store import Store

    class Slow(_Counting):
        def run_once(self, knobs: Knobs, wl: TuneWorkload) -> tuple[float, dict, None]:
            time.sleep(0.05)
            return super().run_once(knobs, wl)

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    store = Store(tmp_path / "p.db")
    t0 = time.monotonic()
    first, second = tune_profiles_detailed(store, _Facts(), backend=Slow(), models=[SMALL], tokens=[64, 512],
                                           families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}",
                                           trials=500, timeout_s=3.0)
    assert first.study.workload.tokens < second.study.workload.tokens
    assert first.budget_ended and 0 < first.study.trials < 500
    assert second.study.trials > 0, "the second bucket never started: the first study took the whole budget"
    assert first.budget_s is not None and 1.4 <= first.budget_s <= 1.5, first.budget_s  # half of the 3 s
    # the second gets what the first left: the time left at its start, all of it (the last study)
    assert second.budget_s is not None and 0 < second.budget_s <= 3.0 - first.used_s + 0.1
    assert first.used_s is not None and second.used_s is not None
    assert time.monotonic() - t0 < 8
