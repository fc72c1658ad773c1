"""Issue 17, deliverable 4 on CPU: the local backend measures the `megakernel` family through an injected
measurement, a tune stores a better knob set as measured, a not-better one keeps the policy default and says
why, and `moetune profile`'s bring-up on a one-H200 capture tunes the megakernel and says EP needs >= 2 GPUs."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import MODELS
from moetune.tuner.search.backends import TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend
from moetune.tuner.search.model_backend import ModelBackend

# their bring-ups inject the timings of a GPU node's capture: run as ON that node (conftest), the only place a
# measurement may be stored under its key
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"
QWEN = MODELS["qwen3-30b"]


def fast_bm16(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    """A GPU stand-in: bm=16 with 3 stages is 30% faster than anything else; eager 1% slower than graph."""
    base = 300.0 * (0.7 if (knobs.mk_bm, knobs.mk_stages) == (16, 3) else 1.0)
    return {"graph_us": [base, base + 1, base - 1], "eager_us": [base * 1.01] * 3}


def bm16_better(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    """A GPU stand-in for a search: 16-row tiles 30% faster whatever the other knobs (a one-point optimum is
    too rare in the megakernel's 1,080-setting space for a 40-trial test to rely on)."""
    base = 300.0 * (0.7 if knobs.mk_bm == 16 else 1.0)
    return {"graph_us": [base, base + 1, base - 1], "eager_us": [base * 1.01] * 3}


def flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    """Every setting the same within noise: nothing beats the default."""
    return {"graph_us": [300.0, 303.0, 297.0], "eager_us": [301.0] * 3}


def test_closing_the_backend_drops_the_trials_weights_and_reference() -> None:
    """measure_megakernel keeps one model's weights and reference for a study's trials (GBs on a GPU); the daemon's
    re-tune jobs run in its long-lived process, so closing the backend at the job's end must let them go."""
    from moetune.tuner.measure import moe as M

    M._weights[("model", "cuda:0", 0)] = (object(), object(), object())
    M._references[("model", "cuda:0", 16, 0)] = (object(), object(), object(), object())
    LocalBackend(world=1, family="megakernel", mk_measure=flat).close()
    assert M._weights == {} and M._references == {}


def test_backend_measures_the_megakernel_family() -> None:
    be = LocalBackend(world=1, family="megakernel", repeats=2, mk_measure=fast_bm16)
    wl = TuneWorkload(model=QWEN, tokens=128)
    m = be.evaluate(Knobs(engine="megakernel", mk_bm=16, mk_stages=3), wl)
    assert m.ok and m.median_us == pytest.approx(210.0) and len(m.samples) == 6 and m.details["timing"] == "graph"
    assert m.details["eager_us"] == pytest.approx(212.1)
    assert be.label == "local:megakernel"
    assert not be.evaluate(Knobs(), wl).ok  # engine unfused is not this family

    def too_big(knobs: Knobs, wl: TuneWorkload) -> Any:
        from moetune.runtime.megakernel.config import ConfigError

        raise ConfigError("megakernel config: ctas_per_sm=2 but only 1 fit per SM")

    m = LocalBackend(world=1, family="megakernel", mk_measure=too_big).evaluate(Knobs(engine="megakernel"), wl)
    assert not m.ok and m.infeasible and "ctas_per_sm" in m.error
    assert not ModelBackend(predictor=lambda k, w: 1.0, preset=SimpleNamespace(name="fake")).supports("megakernel")


def _facts(name: str) -> Any:
    from moetune.tuner.fabric.discovery import discover

    return discover(CAPTURES / name)


def test_tune_stores_a_better_setting_as_measured(tmp_path: Path) -> None:
    from moetune.tuner.search.tune import tune_profiles_detailed

    store = F.open_store(tmp_path / "m.db")
    facts = _facts("h200x1")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    be = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=bm16_better)
    res = tune_profiles_detailed(store, facts, models=[QWEN], tokens=[128], backend=be, trials=40, progress=False,
                                 storage=f"sqlite:///{tmp_path / 'opt.db'}", ep_size=1, nodes=1, families=["megakernel"])
    rec = res[0].record
    assert rec is not None and res[0].written
    assert rec.provenance == "measured" and rec.backend == "local:megakernel"
    assert rec.key.transport_family == "megakernel" and rec.key.ep_size == 1 and rec.key.nodes == 1
    assert (rec.knobs.mk_bm, rec.knobs.engine) == (16, "megakernel") and rec.latency_us == pytest.approx(210.0)
    with pytest.raises(ValueError, match="ep_size 1"):
        tune_profiles_detailed(store, facts, models=[QWEN], tokens=[128], backend=be, trials=2, progress=False,
                               storage=f"sqlite:///{tmp_path / 'opt.db'}", ep_size=2, families=["megakernel"])
    with pytest.raises(ValueError, match="no GPU"):
        tune_profiles_detailed(store, _facts("cpu-laptop"), models=[QWEN], tokens=[128], backend=be, trials=2,
                               progress=False, storage=f"sqlite:///{tmp_path / 'opt.db'}", ep_size=1,
                               families=["megakernel"])


def test_a_model_of_other_activations_than_bf16_is_not_tuned_as_the_megakernel(tmp_path: Path) -> None:
    """The megakernel runs bfloat16 activations only (the runtime refuses it for any other dtype), and a trial times
    bf16 weights whatever the model says: a float16 model's trials measured bf16 and stored them as a MEASURED profile
    of a float16 key, which no layer can run. Each trial now fails as infeasible, naming why; nothing is stored."""
    import msgspec

    from moetune.tuner.search.tune import tune_profiles_detailed

    fp16 = msgspec.structs.replace(QWEN, name="qwen-fp16", dtype="float16")
    m = LocalBackend(world=1, family="megakernel", mk_measure=flat).evaluate(Knobs(engine="megakernel"),
                                                                              TuneWorkload(model=fp16, tokens=128))
    assert not m.ok and m.infeasible and "bfloat16" in m.error
    store = F.open_store(tmp_path / "m.db")
    facts = _facts("h200x1")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    be = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=flat)
    res = tune_profiles_detailed(store, facts, models=[fp16], tokens=[128], backend=be, trials=3, progress=False,
                                 storage=f"sqlite:///{tmp_path / 'opt.db'}", ep_size=1, nodes=1, families=["megakernel"])
    assert [(r.written, r.record) for r in res] == [(False, None)]
    assert store.list_profiles() == []


def test_tune_measures_only_the_default_where_the_decode_kernel_runs(tmp_path: Path) -> None:
    """S=1 of Qwen3-30B runs the decode kernel (the library says so on an H200; injected here), on which no tile
    knob acts: searching there would store noise between equal runs as a tuned choice (and bucket 1's knobs act
    on S=2-3, which run the task graph). The tune measures the policy default once and says why; S=128 searches."""
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.tune import tune_profiles_detailed

    measured: list[tuple[int, Knobs]] = []

    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        measured.append((wl.tokens, knobs))
        return bm16_better(knobs, wl)

    store = F.open_store(tmp_path / "m.db")
    facts = _facts("h200x1")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    be = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=measure, mk_decode=lambda wl: wl.tokens == 1)
    res = tune_profiles_detailed(store, facts, models=[QWEN], tokens=[1, 128], backend=be, trials=12, progress=False,
                                 storage=f"sqlite:///{tmp_path / 'opt.db'}", ep_size=1, nodes=1, families=["megakernel"])
    by = {r.record.key.token_bucket: r for r in res if r.record is not None}
    default = load_policy("megakernel").defaults
    assert {k for t, k in measured if t == 1} == {default} and by[1].study.trials == 1  # + the winner's re-measure
    assert by[1].record.knobs == default and by[1].record.provenance == "measured" and by[1].written
    assert "decode kernel" in by[1].reason and "only the policy default was measured" in by[1].reason
    assert by[128].study.trials == 12 and len({k for t, k in measured if t == 128}) > 1
    assert by[128].record.knobs.mk_bm == 16
    assert "decode kernel" not in by[128].reason


def test_a_re_tune_where_the_decode_kernel_runs_replaces_knobs_that_cannot_act(tmp_path: Path) -> None:
    """A key tuned before the decode-kernel rule (a search at S=1 stored 16-row tiles, a 'gain' its launches cannot
    have) tuned again, in the same Optuna storage: the search is not resumed (its best would come back), the
    default is measured and replaces the stored knobs whatever their number."""
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.tune import tune_profiles_detailed

    store = F.open_store(tmp_path / "m.db")
    facts = _facts("h200x1")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    kw: dict[str, Any] = dict(models=[QWEN], tokens=[1], trials=12, progress=False, ep_size=1, nodes=1,
                              storage=f"sqlite:///{tmp_path / 'opt.db'}", families=["megakernel"])
    old = tune_profiles_detailed(store, facts, backend=LocalBackend(
        world=1, family="megakernel", repeats=1, mk_measure=bm16_better, mk_decode=lambda wl: False), **kw)
    assert old[0].written and old[0].record.knobs.mk_bm == 16
    again = tune_profiles_detailed(store, facts, backend=LocalBackend(
        world=1, family="megakernel", repeats=1, mk_measure=bm16_better, mk_decode=lambda wl: True), **kw)
    assert again[0].study.trials == 1 and again[0].written, again[0].reason
    rec = store.get_current(again[0].record.key)
    assert rec is not None and rec.knobs == load_policy("megakernel").defaults
    assert "decode kernel" in again[0].reason


def _mk_tune(tmp_path: Path, store: Any, facts: Any, measure: Any, tokens: int, *, decode: bool = False,
             trials: int = 6) -> Any:
    from moetune.tuner.search.tune import tune_profiles_detailed

    be = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=measure, mk_decode=lambda wl: decode)
    return tune_profiles_detailed(store, facts, models=[QWEN], tokens=[tokens], backend=be, trials=trials,
                                  progress=False, storage=f"sqlite:///{tmp_path / 'opt.db'}", ep_size=1, nodes=1,
                                  families=["megakernel"])[0]


def _store_with(tmp_path: Path, knobs: Knobs, latency_us: float,
                backend: str = "local:megakernel") -> tuple[Any, Any, Any]:
    """A store holding one current megakernel profile of `knobs` at S=128: (store, facts, its key). `{fp}` in
    `backend` is the node's fingerprint (a node model is the key's own node's: the store refuses another's)."""
    from moetune.runtime.profile_record import ProfileKey, ProfileRecord, provenance_of_backend

    store = F.open_store(tmp_path / "m.db")
    facts = _facts("h200x1")
    backend = backend.format(fp=facts.fingerprint)
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="megakernel",
                     ep_size=1, nodes=1, hidden=QWEN.hidden, intermediate=QWEN.intermediate, experts=QWEN.experts,
                     topk=QWEN.topk, dtype=QWEN.dtype, token_bucket=128)
    ok, why = store.put_profile(ProfileRecord(key=key, knobs=knobs, latency_us=latency_us, spread_us=1.0,
                                              backend=backend, provenance=provenance_of_backend(backend)))
    assert ok, why
    return store, facts, key


def test_a_stored_setting_that_ties_the_default_is_replaced_by_the_default(tmp_path: Path) -> None:
    """Run 187 stored split-K 2 at S=128, a tie with the default. Every later tune re-measures the incumbent and the
    default side by side: an incumbent that does not beat the default beyond the noise gives way to it (before,
    the default was measured only where nothing was stored, so the tie stayed for good)."""
    from moetune.tuner.search.policy import load_policy

    default = load_policy("megakernel").defaults
    tie = default.replace(mk_split_k=2)

    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        base = 300.0 if knobs == default else 299.5 if knobs == tie else 330.0
        return {"graph_us": [base - 3, base, base + 3], "eager_us": [base] * 3}

    store, facts, key = _store_with(tmp_path, tie, 320.0)
    res = _mk_tune(tmp_path, store, facts, measure, 128)
    rec = store.get_current(key)
    assert rec is not None and rec.knobs == default and rec.provenance == "measured", res.reason


def test_a_modelled_incumbent_kept_on_a_tie_is_stored_as_measured(tmp_path: Path) -> None:
    """A tie with a MODELLED incumbent keeps its knobs, and the side-by-side measurement of them replaces the
    prediction (writing nothing would leave the prediction current beside a fresh measurement)."""
    kept = Knobs(engine="megakernel", mk_bm=16, mk_stages=3)

    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        base = 210.0 if knobs.mk_bm == 16 else 300.0
        return {"graph_us": [base - 3, base, base + 3], "eager_us": [base] * 3}

    store, facts, key = _store_with(tmp_path, kept, 250.0, backend="model:node:{fp}")
    res = _mk_tune(tmp_path, store, facts, measure, 128, trials=12)
    rec = store.get_current(key)
    assert rec is not None and rec.provenance == "measured", res.reason
    assert rec.knobs.mk_bm == 16 and rec.latency_us == pytest.approx(210.0)


def test_a_default_only_study_whose_run_failed_runs_again(tmp_path: Path) -> None:
    """Where no knob acts, each tune measures the default afresh: a failed run (GPU busy) is not the study's
    last word (a resumed one-trial study had no trial left to run)."""
    calls: list[int] = []

    def flaky(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        calls.append(wl.tokens)
        if len(calls) == 1:
            raise RuntimeError("the GPU is busy (test)")
        return {"graph_us": [36.0, 36.5, 35.5], "eager_us": [60.0] * 3}

    store = F.open_store(tmp_path / "m.db")
    facts = _facts("h200x1")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    first = _mk_tune(tmp_path, store, facts, flaky, 1, decode=True)
    assert first.record is None or not first.written
    again = _mk_tune(tmp_path, store, facts, flaky, 1, decode=True)
    assert again.written and again.record is not None and again.record.latency_us == pytest.approx(36.0)


def test_a_winner_within_noise_of_the_default_is_not_stored_as_tuned(tmp_path: Path) -> None:
    """Without an incumbent the study's winner is measured again beside the policy default; a gain within the noise
    stores the default (measured side by side) with that reason. Run 187 on the H200: `moetune tune` at S=128
    stored split-K 2 (inert there: S=128 runs no split launch) at 293.0 µs against the default's 293.0."""
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.tune import tune_profiles_detailed

    def almost_flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        base = 300.0 if knobs == load_policy("megakernel").defaults else 299.5  # 0.5 us: well within +- 3
        return {"graph_us": [base - 3, base, base + 3], "eager_us": [base] * 3}

    store = F.open_store(tmp_path / "m.db")
    facts = _facts("h200x1")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    be = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=almost_flat, mk_decode=lambda wl: False)
    res = tune_profiles_detailed(store, facts, models=[QWEN], tokens=[128], backend=be, trials=6, progress=False,
                                 storage=f"sqlite:///{tmp_path / 'opt.db'}", ep_size=1, nodes=1, families=["megakernel"])
    assert res[0].study.best_knobs != load_policy("megakernel").defaults  # the study's winner: a 0.5 us tie
    rec = res[0].record
    assert rec is not None and res[0].written and rec.knobs == load_policy("megakernel").defaults
    assert rec.latency_us == pytest.approx(300.0) and rec.provenance == "measured"
    assert "the default stored" in res[0].reason


# -- a trial's output is checked against the fp32 reference (tuner/measure/moe.py megakernel_output_problem) --------

SMALL = "custom:128,64,8,2"  # hidden, intermediate, experts, topk: the reference is quick on a CPU


def test_output_problem_decides_from_two_tensors() -> None:
    """The verdict every megakernel trial gets, as a pure function of the output and the reference: the GPU tests'
    bound (max |out - ref| / max |ref| <= 1e-2), and a row left poisoned (NaN) or another shape is wrong."""
    import torch

    from moetune.tuner.measure.moe import MK_REL_ERR_BOUND, output_problem

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(16, 32, generator=g)
    assert MK_REL_ERR_BOUND == 1e-2
    assert output_problem(ref.to(torch.bfloat16), ref, MK_REL_ERR_BOUND, "x") is None  # bf16 rounding passes
    assert output_problem(ref * 1.005, ref, MK_REL_ERR_BOUND, "x") is None
    assert "exceeds its bound 0.01" in (output_problem(ref * 1.03, ref, MK_REL_ERR_BOUND, "x") or "")
    assert "relative error 1 exceeds" in (output_problem(torch.zeros_like(ref), ref, MK_REL_ERR_BOUND, "x") or "")
    poisoned = ref.clone()
    poisoned[3:5] = float("nan")
    assert "2 of 16 rows hold non-finite values" in (output_problem(poisoned, ref, MK_REL_ERR_BOUND, "x") or "")
    assert "shape (8, 32)" in (output_problem(ref[:8], ref, MK_REL_ERR_BOUND, "x") or "")


class _FakeMegakernel:
    """Stands in for MegakernelMoE on the CPU: the fp32 reference layer of `seed`'s weights (what a right kernel
    computes), with the routing it is given or torch's route from the gate; subclasses break one path."""

    def __init__(self, model: Any, seed: int = 0) -> None:
        import torch

        from moetune.runtime.moe_layer import gate_weight

        self.model, self.seed, self.device = model, seed, torch.device("cpu")
        self.gate = gate_weight(model, seed=0, device=self.device, dtype=torch.bfloat16)
        self.idx: Any = None

    def _compute(self, x: Any, idx: Any, w: Any, out: Any) -> Any:
        import torch

        from moetune.runtime.moe_layer import dense_reference

        self.idx = idx
        y = dense_reference(x, self.model, seed=self.seed, topk_idx=idx, topk_weights=w, weight_dtype=torch.bfloat16)
        return out.copy_(y.to(out.dtype))

    def forward_routed(self, x: Any, idx: Any, w: Any, out: Any) -> Any:
        return self._compute(x, idx, w, out)

    def forward(self, x: Any, out: Any) -> Any:
        from moetune.runtime.moe_layer import route

        return self._compute(x, *route(x, self.gate, self.model.topk), out)

    def routing(self, s: int) -> tuple[Any, Any]:
        return self.idx, None


class _StaleRows(_FakeMegakernel):
    def forward_routed(self, x: Any, idx: Any, w: Any, out: Any) -> Any:  # writes half the rows, leaves the rest
        super().forward_routed(x[: x.shape[0] // 2], idx[: x.shape[0] // 2], w[: x.shape[0] // 2],
                               out[: x.shape[0] // 2])
        return out


class _WrongOnItsOwnRouting(_FakeMegakernel):
    def forward(self, x: Any, out: Any) -> Any:  # right with given routing, zeros when it routes from the gate
        super().forward(x, out)
        return out.zero_()


def test_megakernel_output_check_catches_what_a_wrong_setting_computes() -> None:
    """The check measure_megakernel runs after a trial's timed replays, on fake layers: the right layer passes; one
    built from other weights, one that leaves rows unwritten (the NaN poison survives) and one that is right only
    with the routing it is given all fail. The reference is computed once per (model, device, tokens, seed)."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    model = get_model(SMALL)
    good = _FakeMegakernel(model)
    assert M.megakernel_output_problem(good, model, 24, 0, good.gate) is None
    (key,) = M._references
    ref = M._references[key][3]
    assert M.megakernel_output_problem(_FakeMegakernel(model), model, 24, 0, good.gate) is None
    assert M._references[key][3] is ref  # not computed again for the next knob set
    other = M.megakernel_output_problem(_FakeMegakernel(model, seed=1), model, 24, 0, good.gate)
    assert other is not None and "wrong output: the layer with the reference's routing" in other
    assert "exceeds its bound 0.01" in other
    stale = M.megakernel_output_problem(_StaleRows(model), model, 24, 0, good.gate)
    assert stale is not None and "12 of 24 rows hold non-finite values" in stale
    own = M.megakernel_output_problem(_WrongOnItsOwnRouting(model), model, 24, 0, good.gate)
    assert own is not None and "the layer routing from its gate" in own


def test_a_trial_whose_output_is_wrong_is_infeasible_and_never_wins(tmp_path: Path) -> None:
    """A setting 30 % faster whose output is wrong is infeasible: its timing must never be stored as the tuned
    setting."""
    from moetune.tuner.measure.outputs import WrongOutput
    from moetune.tuner.search.tune import tune_profiles_detailed

    def wrong_bm16(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        if knobs.mk_bm == 16:
            raise WrongOutput("wrong output: the layer with the reference's routing: relative error 1 exceeds its "
                              "bound 0.01 (S=128)")
        return bm16_better(knobs, wl)

    m = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=wrong_bm16).evaluate(
        Knobs(engine="megakernel", mk_bm=16), TuneWorkload(model=QWEN, tokens=128))
    assert not m.ok and m.infeasible and not m.samples and "relative error 1 exceeds its bound 0.01" in (m.error or "")
    store = F.open_store(tmp_path / "m.db")
    facts = _facts("h200x1")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    be = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=wrong_bm16, mk_decode=lambda wl: False)
    res = tune_profiles_detailed(store, facts, models=[QWEN], tokens=[128], backend=be, trials=40, progress=False,
                                 storage=f"sqlite:///{tmp_path / 'opt.db'}", ep_size=1, nodes=1, families=["megakernel"])
    assert res[0].study.pruned > 0  # bm=16 was sampled, and recorded infeasible
    assert res[0].record is None or res[0].record.knobs.mk_bm != 16


def _fake_megakernel_measure(monkeypatch: pytest.MonkeyPatch, layer: type, inputs: Any, time_calls: Any,
                             graphs_of: Any, output_problem: Any) -> Any:
    """measure_megakernel's CUDA parts replaced by fakes (the layer class, weights, inputs, timing, graphs and the
    output check): returns the measure module."""
    import torch

    from moetune.runtime import moe_layer
    from moetune.runtime.megakernel import layer as L
    from moetune.runtime.megakernel import weights as W
    from moetune.tuner.measure import moe as M

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "MegakernelMoE", layer)
    monkeypatch.setattr(W, "tile_", lambda t: t)
    monkeypatch.setattr(moe_layer, "expert_weights", lambda model, e, **kw: (torch.zeros(1), torch.zeros(1)))
    monkeypatch.setattr(moe_layer, "gate_weight", lambda model, **kw: torch.zeros(1))
    monkeypatch.setattr(M, "_weights", {})
    monkeypatch.setattr(M, "layer_inputs", inputs)
    monkeypatch.setattr(M, "time_calls", time_calls)
    monkeypatch.setattr(M, "graphs_of", graphs_of)
    monkeypatch.setattr(M, "megakernel_output_problem", output_problem)
    return M


def test_a_trial_times_only_the_graph_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_megakernel times only the graph replays, and the output check comes after them: an eager block timed
    right before the replays (rest 0) would, on a GPU at its power limit, clock the replays, the trial's value, down
    by its heat (S=4096: 743 µs a replay after eager calls of 689 µs). The CUDA parts are fakes here (the layer
    records its calls)."""
    events: list[str] = []

    class Layer:
        def __init__(self, model: Any, **kw: Any) -> None:
            pass

        def forward(self, x: Any) -> None:
            events.append(f"forward {x}")

        def check(self) -> None:
            events.append("check")

    def time_calls(fns: Any, *, warmup: int, iters: int, cuda: bool) -> list[float]:
        events.append("timed block")
        for j in range(warmup + iters):
            fns[j % len(fns)]()
        return [100.0] * iters

    def graphs_of(fn: Any, xs: Any) -> list[Any]:
        return [lambda x=x: events.append(f"replay {x}") for x in xs]

    M = _fake_megakernel_measure(monkeypatch, Layer,
                                 lambda model, tokens, rotate, dev, dtype, seed: [f"x{i}" for i in range(rotate)],
                                 time_calls, graphs_of, lambda *a: events.append("output check"))
    got = M.measure_megakernel(Knobs(engine="megakernel"), QWEN, 128, iters=4, warmup=2, rotate=2)
    assert got == {"graph_us": [100.0] * 4}
    assert events.count("timed block") == 1 and not any(e.startswith("forward") for e in events)
    assert events.index("output check") > max(i for i, e in enumerate(events) if e.startswith("replay"))


@pytest.mark.gpu
def test_gpu_trial_output_is_checked_against_the_fp32_reference() -> None:
    """On a GPU: a trial of the default setting passes the check and gives graph samples; the real layer built from
    other weights than the reference's fails it (what a setting that computes the wrong layer would do)."""
    # imported here: megakernel_fakes imports torch, which the CPU tests of this file never load
    import torch
    from megakernel_fakes import need_megakernel_gpu

    need_megakernel_gpu()
    from moetune.runtime.megakernel import MegakernelMoE
    from moetune.tuner.measure import moe as M

    for s in (1, 128):
        got = M.measure_megakernel(Knobs(engine="megakernel"), QWEN, s, iters=5, warmup=2, rotate=2)
        assert len(got["graph_us"]) == 5 and all(v > 0 for v in got["graph_us"])
    gate = next(iter(M._weights.values()))[2]
    dev = torch.device("cuda", torch.cuda.current_device())
    right = MegakernelMoE(QWEN, max_tokens=128, device=dev, seed=0)
    assert M.megakernel_output_problem(right, QWEN, 128, 0, gate) is None
    other = MegakernelMoE(QWEN, max_tokens=128, device=dev, seed=1)
    why = M.megakernel_output_problem(other, QWEN, 128, 0, gate)
    assert why is not None and "exceeds its bound 0.01" in why


def _bringup(tmp_path: Path, capture: str, measure: Any) -> Any:
    from moetune.tuner.bringup.flow import Bringup, Plan

    plan = Plan(models=["qwen3-30b"], tokens=[16], trials=12, repeats=1, iters=5, compare_rounds=2)
    console = Console(file=io.StringIO(), width=200)
    store = F.open_store(tmp_path / "b.db")
    b = Bringup(store=store, plan=plan, state_dir=tmp_path / "state", console=console, capture=CAPTURES / capture,
                storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=measure)
    b.state.mark("discover", b.stage_discover())
    b.state.mark("microbench", [])
    b.state.mark("calibrate", {"skipped": "test"})
    for stage in ("tune", "compare"):
        b.state.mark(stage, getattr(b, f"stage_{stage}")())
    return b, store


def test_profile_on_a_one_gpu_node_tunes_the_megakernel(tmp_path: Path) -> None:
    b, store = _bringup(tmp_path, "h200x1", bm16_better)
    tuned = b.state.result("tune")
    assert [t["family"] for t in tuned] == ["megakernel"]  # no EP transport on one GPU
    cmp = b.state.result("compare")
    assert cmp[0]["stored"] == "tuned" and cmp[0]["tuned_us"] < cmp[0]["default_us"]
    from moetune.runtime.profile_record import ProfileKey

    rec = store.get_current(ProfileKey(**tuned[0]["key"]))
    assert rec is not None and rec.provenance == "measured" and rec.knobs.mk_bm == 16
    report = Path(b.stage_report()).read_text()
    assert "EP transports need >= 2 GPUs" in report and "megakernel" in report
    # S=16 (128 routed rows) runs the task graph; the report says the decode kernel has no tile knobs
    assert "qwen3-30b S=16) run the task graph" in report and "decode kernel, which has no tile knobs" in report


def test_a_bucket_where_no_knob_acts_says_so_in_the_compare_row(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no knob acts at the compare stage (the decode kernel) only the default runs, and the row's tuned column
    shows that same run: its reason is why only the default was measured, not "tuned 300.0 ± 1.0 µs did not beat the
    default 300.0 ± 1.0 µs", of a setting never run."""
    from moetune.tuner.bringup.flow import Bringup, Plan

    plan = Plan(models=["qwen3-30b"], tokens=[16], trials=12, repeats=1, iters=5, compare_rounds=2)
    store = F.open_store(tmp_path / "b.db")
    b = Bringup(store=store, plan=plan, state_dir=tmp_path / "state", console=Console(file=io.StringIO(), width=200),
                capture=CAPTURES / "h200x1", storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=bm16_better)
    b.state.mark("discover", b.stage_discover())
    b.state.mark("microbench", [])
    b.state.mark("calibrate", {"skipped": "test"})
    b.state.mark("tune", b.stage_tune())
    assert b.state.result("tune")[0]["knobs"]["mk_bm"] == 16  # the search's winner differs from the default
    why = "S=16 runs a kernel on which no tile knob acts: only the policy default was measured"
    monkeypatch.setattr(LocalBackend, "inert_reason", lambda self, family, wl: why if family == "megakernel" else "")
    [row] = b.stage_compare()
    assert row["stored"] == "policy default" and row["why_default"] == why, row
    assert row["tuned_us"] == row["default_us"]  # the one run measured


def test_profile_compares_the_searchs_winner_with_the_default_once(tmp_path: Path) -> None:
    """The bring-up's compare stage measures the search's winner beside the default (rounds, spread) and stores
    what wins; the tune stage does not make that comparison too (a tie re-measured there beside the default would
    store the default, and the report say 'the tuned setting is the default', hiding the winner)."""
    from moetune.tuner.search.policy import load_policy

    default = load_policy("megakernel").defaults

    def almost_flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        base = 300.0 if knobs == default else 299.5
        return {"graph_us": [base - 3, base, base + 3], "eager_us": [base] * 3}

    b, store = _bringup(tmp_path, "h200x1", almost_flat)
    cmp = b.state.result("compare")
    assert cmp[0]["stored"] == "policy default" and cmp[0]["knobs"], cmp[0]  # the winner's knobs are reported
    assert "did not beat the default" in cmp[0]["why_default"]
    from moetune.runtime.profile_record import ProfileKey

    rec = store.get_current(ProfileKey(**b.state.result("tune")[0]["key"]))
    assert rec is not None and rec.knobs == default


def test_report_names_tuned_sizes_that_may_run_the_decode_kernel() -> None:
    from moetune.tuner.bringup.flow import _decode_notes

    rows = [{"family": "megakernel", "model": "qwen3-30b", "tokens": s} for s in (1, 128)]
    notes = _decode_notes([*rows, {"family": "nvlink", "model": "qwen3-30b", "tokens": 4}])
    assert len(notes) == 1 and notes[0].startswith("megakernel qwen3-30b S=1: 8 routed rows may run the decode kernel")
    assert _decode_notes([{"family": "nvlink", "model": "qwen3-30b", "tokens": 1}]) == []


def test_profile_keeps_the_default_when_the_tuned_setting_is_not_better(tmp_path: Path) -> None:
    b, store = _bringup(tmp_path, "h200x1", flat)
    cmp = b.state.result("compare")[0]
    assert cmp["stored"] == "policy default"
    from moetune.runtime.profile_record import ProfileKey

    rec = store.get_current(ProfileKey(**b.state.result("tune")[0]["key"]))
    assert rec is not None and rec.knobs == Knobs(engine="megakernel") and rec.provenance == "measured"
    report = Path(b.stage_report()).read_text()
    assert "the policy default was kept" in report
    # the terminal says why too, under the table (run 194 on an H100 printed "policy default" and no reason)
    from moetune.tuner.cli.profile import kept_lines

    said = kept_lines(b.state.result("compare"))
    assert len(said) == 1 and said[0].startswith("megakernel qwen3-30b S=16: the policy default chosen: "), said
    assert cmp["why_default"] in said[0] and "not stored" not in said[0]
    assert kept_lines([{**cmp, "stored": "tuned", "why_default": None}]) == []
    refused = kept_lines([{**cmp, "written": False, "reason": "kept the current profile 3: another routing"}])
    assert refused[0].endswith("not stored (kept the current profile 3: another routing), the key keeps what it had")


def test_profile_on_a_two_gpu_node_plans_both(tmp_path: Path) -> None:
    from moetune.tuner.bringup.flow import Bringup, Plan

    b = Bringup(store=F.open_store(tmp_path / "c.db"), plan=Plan(), state_dir=tmp_path / "s",
                console=Console(file=io.StringIO()), capture=CAPTURES / "h200x2")
    assert b.tune_ep and b.mk_ok
    c = Bringup(store=F.open_store(tmp_path / "d.db"), plan=Plan(), state_dir=tmp_path / "s2",
                console=Console(file=io.StringIO()), capture=CAPTURES / "rtx4090x4")
    assert c.tune_ep and not c.mk_ok and "sm_90" in c.mk_why


# -- the benchmark: `moetune bench moe` and the scenario -------------------------------------------------------
def test_bench_moe_cli_and_scenario_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import torch

    # the CPU path, also where a GPU is (the device runs time the GPU path with `moetune bench moe` itself)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    from typer.testing import CliRunner

    from moetune.tuner.cli import app
    from moetune.tuner.measure.scenarios import definitions, records, runner
    from moetune.tuner.measure.scenarios.drivers import registry

    r = CliRunner().invoke(app, ["bench", "moe", "--model", "custom:128,64,8,2", "--tokens", "4,16", "--iters", "2",
                                 "--warmup", "0", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    skipped = [c for c in rep["cases"] if "skipped" in c]
    assert skipped and skipped[0]["engine"] == "megakernel" and "no CUDA device" in skipped[0]["skipped"]
    unf = [c for c in rep["cases"] if c.get("engine") == "unfused"]
    assert [c["S"] for c in unf] == [4, 16] and all(c["eager_us"]["median"] > 0 and "weight_floor_us" in c for c in unf)
    assert all(c["plain_read_us"]["median"] > 0 for c in unf)  # measured here, beside the arithmetic floors
    meta = rep["meta"]  # the JSON is a result file: which code, where, when, by which command
    assert meta["git_sha"] and "no GPU" in meta["hardware"] and meta["date"].endswith("Z")
    assert "moetune bench moe --engine megakernel,unfused,torch --model custom:128,64,8,2 --tokens 4,16" in meta["command"]
    bad = CliRunner().invoke(app, ["bench", "moe", "--engine", "fused"])
    assert bad.exit_code == 2 and "engines must be among" in bad.output and "Traceback" not in bad.output
    bad = CliRunner().invoke(app, ["bench", "moe", "--rest", "-1"])
    assert bad.exit_code == 2 and "--rest must be in 0..60 seconds, got -1" in bad.output and "Traceback" not in bad.output
    # --rest idles before every timed block: two S x (plain read + the engine's eager block) = 4 rests here
    import time

    t0 = time.monotonic()
    r = CliRunner().invoke(app, ["bench", "moe", "--engine", "unfused", "--model", "custom:128,64,8,2", "--tokens",
                                 "4,16", "--iters", "2", "--warmup", "0", "--rest", "0.25", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["rest_s"] == 0.25 and rep["meta"]["command"].endswith("--rest 0.25") and time.monotonic() - t0 >= 1.0

    s = definitions.get("moe-megakernel-vs-unfused")
    assert s.driver == "moe" and [c.name for c in s.cases] == ["unfused", "megakernel", "torch"]
    rows = runner.run(s, smoke=True, results=tmp_path / "summary.csv", gpus=0)
    assert {r["case"] for r in rows} == {"unfused"} and all(r["source"] == "smoke" for r in rows)
    assert {r["metric"] for r in rows} == {"layer_us[S=4]", "layer_us[S=16]", "plain_read_us[S=4]", "plain_read_us[S=16]"}
    assert all(r["git_sha"] and r["hardware"] and "moetune bench moe" in r["command"] for r in rows)
    # outside smoke mode on CPU, the megakernel case is a row naming why it was skipped
    seq = [*runner.plan(s, None, smoke=True), records.Resolved("megakernel", {**s.smoke_args, "engine": "megakernel"}, {})]
    out = registry.DRIVERS["moe"](seq, records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path))
    mk = next(c for c in out if c.case == "megakernel")
    assert not mk.metrics and mk.error.startswith("SKIPPED") and "no CUDA device" in mk.error


def test_bench_moe_reports_progress_per_engine_and_s() -> None:
    """bench_moe takes a progress sink (measure imports no rich): one task of every (engine, S) case that runs, each
    named as it starts and counted as it ends; a skipped engine is no case."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    calls: list[tuple] = []

    class Sink:
        def add(self, description: str, total: int, done: int = 0) -> str:
            calls.append(("add", total, done))
            return "task"

        def update(self, task: Any, done: int, best: float | None = None, description: str | None = None) -> None:
            calls.append(("update", task, done, description))

        def close(self) -> None:
            calls.append(("close",))

    rep = M.bench_moe(get_model("custom:128,64,8,2"), [4, 16], ["megakernel", "unfused"], iters=1, warmup=0,
                      device="cpu", progress=Sink())
    assert any(c.get("skipped") for c in rep["cases"])  # the megakernel on a CPU device: no case to count
    assert calls == [("add", 2, 0),
                     ("update", "task", 0, "unfused S=4"), ("update", "task", 1, None),
                     ("update", "task", 1, "unfused S=16"), ("update", "task", 2, None)]  # the caller closes it


def test_paired_differences_and_variant_parsing() -> None:
    from moetune.runtime.knobs import KnobError, Knobs
    from moetune.tuner.measure import moe_compare as MC

    # per-round differences: a variant 2 µs slower in every round is +2 whatever the drift between rounds
    base = [100.0 + 10 * i for i in range(10)]
    d = MC.paired({"base": base, "slow": [b + 2.0 for b in base], "same": base}, "base")
    assert d["slow"] == {"median": 2.0, "p10": 2.0, "p90": 2.0} and d["same"]["median"] == 0.0 and "base" not in d
    mk = Knobs(engine="megakernel")
    v = MC.parse_variants("ct8=mk_combine_tokens=8; narrow=mk_bn=128,mk_stages=3", mk)
    assert v["ct8"] == mk.replace(mk_combine_tokens=8) and (v["narrow"].mk_bn, v["narrow"].mk_stages) == (128, 3)
    assert MC.changed_knobs(v["narrow"]) == "engine=megakernel,mk_stages=3,mk_bn=128"
    # a knob where the variant's name goes said the knob parser's "expected name=value, got 'fp8_e4m3'"
    for bad, msg in (("ct8", "a variant is NAME=KNOBS"), ("a=mk_bm=16;a=mk_bm=64", "given twice"),
                     ("compression=fp8_e4m3", re.escape("'compression' is a knob: name the variant first (e.g. "
                                                        "v1=compression=fp8_e4m3)")),
                     ("fast=mk_bm", "a variant is NAME=KNOBS"),
                     ("base=mk_bm=16", "given twice"), ("", "at least one variant"),
                     # `a=` was the base's knobs again, measured as a second variant: refused, naming it
                     ("a=", "variant 'a' sets no knob"), ("ok=mk_bm=16; b=  ", "variant 'b' sets no knob"),
                     # an empty item beside others is a lost variant
                     ("a=mk_bm=16;;b=mk_bm=64", "an empty item"), ("a=mk_bm=16;", "an empty item")):
        with pytest.raises(ValueError, match=msg):
            MC.parse_variants(bad, mk)
    with pytest.raises(KnobError, match="unknown knob"):
        MC.parse_variants("x=mk_nope=1", mk)


def test_bench_knobs_cli_and_scenario_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, as above

    from typer.testing import CliRunner

    from moetune.tuner.cli import app
    from moetune.tuner.measure.scenarios import definitions, records, runner
    from moetune.tuner.measure.scenarios.drivers import registry

    small = ["--model", "custom:128,64,8,2", "--tokens", "4,16", "--iters", "3", "--warmup", "0", "--chain", "2", "--json"]
    # the base against itself, on purpose: a knob of the base's own (an empty `again=` is refused, below)
    r = CliRunner().invoke(app, ["bench", "knobs", "--knobs", "engine=unfused", "--vs", "again=engine=unfused", *small])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["base"] == "base" and rep["variants"] == {"base": "", "again": ""} and not rep["graph"]
    assert [(c["variant"], c["S"]) for c in rep["cases"]] == [("base", 4), ("again", 4), ("base", 16), ("again", 16)]
    again = [c for c in rep["cases"] if c["variant"] == "again"]
    # the same seed builds the same weights: the two variants' outputs are the same numbers
    assert all(c["rel_err_vs_base"] == 0.0 and len(c["minus_base_us"]) == 3 and c["chain_us"]["median"] > 0 for c in again)
    assert rep["meta"]["git_sha"] and ("moetune bench knobs --vs 'again=engine=unfused' --knobs engine=unfused"
                                       in rep["meta"]["command"])
    # the megakernel where no sm_90 GPU is: every variant skipped, with the reason (the report is still printed);
    # nothing was measured, so the exit status is 1
    r = CliRunner().invoke(app, ["bench", "knobs", "--vs", "ct8=mk_combine_tokens=8", *small])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert [c["variant"] for c in rep["cases"]] == ["base", "ct8"] and all("no CUDA device" in c["skipped"] for c in rep["cases"])
    assert "every requested case was skipped" in r.stderr
    for vs, msg in (("ct8", "a variant is NAME=KNOBS"), ("x=mk_nope=1", "unknown knob"),
                    ("compression=fp8_e4m3", "(e.g. narrow=mk_bn=128)"), ("", "give at least one variant"),
                    ("again=", "variant 'again' sets no knob")):
        bad = CliRunner().invoke(app, ["bench", "knobs", "--vs", vs], env={"COLUMNS": "400"})
        assert bad.exit_code == 2 and msg in bad.output and "Traceback" not in bad.output, bad.output
        assert "--vs: " in bad.output, bad.output  # the option named
        assert "expected name=value" not in bad.output

    s = definitions.get("moe-megakernel-knobs")
    assert s.driver == "moe-knobs" and s.cases[0].name == "defaults"
    rows = runner.run(s, smoke=True, results=tmp_path / "summary.csv", gpus=0)
    got = {(r["case"], r["metric"]) for r in rows}
    assert {("defaults", "layer_us[S=4]"), ("defaults", "chain_us[S=16]"), ("combine-8", "minus_base_us[S=16]"),
            ("combine-8", "chain_minus_base_us[S=4]")} <= got
    assert not any(m.startswith("minus_base") for c, m in got if c == "defaults")
    assert all("moetune bench knobs --knobs engine=unfused --vs combine-8=" in r["command"] for r in rows)
    # outside smoke mode on CPU: the megakernel cases are rows naming why they were skipped
    seq = [records.Resolved(c.name, {**c.args, "model": "custom:128,64,8,2", "tokens": [4]}, {}) for c in runner.plan(s, None, smoke=False)]
    out = registry.DRIVERS["moe-knobs"](seq[:2], records.Ctx(world=1, backend="none", smoke=False, tmp=tmp_path))
    assert [c.case for c in out] == ["defaults", "combine-8"]
    assert all(not c.metrics and c.error.startswith("SKIPPED") and "no CUDA device" in c.error for c in out)


def test_imported_megakernel_rows_are_in_the_summary() -> None:
    from moetune.tuner.measure import results as R
    from moetune.tuner.measure.scenarios import checkout

    rows = [r for r in R.read_rows(checkout.SUMMARY_CSV) if r["scenario"] == "moe-megakernel-vs-unfused"]
    imported = [r for r in rows if r["source"] == "imported"]
    # runs 5 and 8 (bench/tools/import_megakernel.py), runs 160 and 163, 177, 178, 179, 181, 184, 186 and 188
    # (`bench run --from-report`)
    assert {r["git_sha"][:7] for r in imported} == {"610d837", "711d9d4", "afe36cb", "bd3e980", "ad3607d", "2bffafd",
                                                     "ea0d939", "64c2f2d", "950ab6c", "54fc1b9", "06e9eca"}
    got = {(r["git_sha"][:7], r["case"], r["metric"]): float(r["median"]) for r in imported}
    assert got[("711d9d4", "megakernel", "graph_us[S=128]")] == pytest.approx(351.9, abs=0.1)
    assert got[("610d837", "unfused", "layer_us[S=4096]")] == pytest.approx(2008.7, abs=0.1)
    assert got[("bd3e980", "megakernel", "graph_us[S=128]")] == pytest.approx(289.3, abs=0.1)  # the README's table
    assert got[("ad3607d", "megakernel", "graph_us[S=128]")] == pytest.approx(287.8, abs=0.1)  # run 177, the note
    assert got[("06e9eca", "megakernel", "graph_us[S=1]")] == pytest.approx(35.7, abs=0.1)  # run 188, the README


@pytest.mark.parametrize("where", ["variable", "config"])
def test_a_trial_runs_under_the_users_megakernel_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         where: str) -> None:
    """A tuning trial's layer is built with the runtime options the backend resolves (its `env`, the config's
    [runtime] table), as a served layer is: before, `MegakernelConfig.from_knobs(knobs)` took the defaults, so a trial
    that hung waited the default 2 s, not the user's megakernel_timeout_s. The CUDA parts are fakes (the layer
    records the config it is given)."""
    configs: list[Any] = []

    class Layer:
        def __init__(self, model: Any, *, config: Any, **kw: Any) -> None:
            configs.append(config)

        def forward(self, x: Any) -> None:
            pass

        def check(self) -> None:
            pass

    _fake_megakernel_measure(monkeypatch, Layer, lambda model, tokens, rotate, dev, dtype, seed: ["x0"],
                             lambda fns, *, warmup, iters, cuda: [100.0] * iters, lambda fn, xs: [lambda: None],
                             lambda *a: None)
    if where == "variable":
        env = {"MOETUNE_MK_TIMEOUT_S": "7.5"}
    else:
        cfg = tmp_path / "moetune.toml"
        cfg.write_text("[runtime]\nmegakernel_timeout_s = 7.5\n")
        env = {"MOETUNE_CONFIG": str(cfg)}
    be = LocalBackend(world=1, family="megakernel", repeats=1, iters=4, env=env, mk_decode=lambda wl: False)
    m = be.evaluate(Knobs(engine="megakernel"), TuneWorkload(model=QWEN, tokens=128))
    assert m.ok, m
    assert [c.timeout_ms for c in configs] == [7500.0]


def test_a_trial_under_options_that_do_not_resolve_fails_and_is_not_called_infeasible() -> None:
    """Runtime options that do not resolve fail every trial with the option named: not a setting that does not fit
    (infeasible), which the ValueError would have been taken for inside the measurement's try."""
    be = LocalBackend(world=1, family="megakernel", repeats=1, env={"MOETUNE_MK_TIMEOUT_S": "-1"},
                      mk_decode=lambda wl: False)
    m = be.evaluate(Knobs(engine="megakernel"), TuneWorkload(model=QWEN, tokens=128))
    assert not m.ok and not m.infeasible
    assert "megakernel_timeout_s" in str(m.error) or "MOETUNE_MK_TIMEOUT_S" in str(m.error), m.error


def test_a_model_shape_the_megakernel_cannot_run_is_said_as_the_models() -> None:
    """hidden 100 (not a multiple of 128) failed every trial as "setting does not fit: k-tiled weights need K to be a
    multiple of 64, got 100", after building the model's weights: the shape is refused first, naming the model."""
    from moetune.runtime import get_model

    called: list[Knobs] = []

    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        called.append(knobs)
        return flat(knobs, wl)

    be = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=measure)
    m = be.evaluate(Knobs(engine="megakernel"), TuneWorkload(model=get_model("custom:100,64,8,2"), tokens=16))
    assert not m.ok and m.infeasible and not called
    assert "cannot run model custom:100,64,8,2" in m.error and "hidden % 128 == 0" in m.error, m.error


def test_bringup_leaves_a_model_the_megakernel_cannot_run_out_of_its_stage(tmp_path: Path) -> None:
    """A planned model the megakernel cannot run (hidden 100: not a multiple of 128) had a study planned and every
    trial run, each refused, and its bucket failed the tune stage ("every trial failed"). It is now left out of the
    megakernel stage up front, by the trials' own rule, said in the progress output and the report; the other model
    is still tuned."""
    from moetune.tuner.bringup.flow import Bringup, Plan

    measured: set[str] = set()

    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        measured.add(wl.model.name)
        return bm16_better(knobs, wl)

    plan = Plan(models=["custom:100,64,8,2", "qwen3-30b"], tokens=[16], trials=4, repeats=1, iters=5, compare_rounds=2)
    out = io.StringIO()
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                console=Console(file=out, width=300), capture=CAPTURES / "h200x1",
                storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=measure)
    b.state.mark("discover", b.stage_discover())
    b.state.mark("microbench", [])
    b.state.mark("calibrate", {"skipped": "test"})
    b.state.mark("tune", b.stage_tune(), failed=b.failed)
    assert b.failed == [] and b.state.done("tune"), b.failed  # the left-out model's bucket is not a failure
    assert [(t["model"], t["family"]) for t in b.state.result("tune")] == [("qwen3-30b", "megakernel")]
    assert measured == {"qwen3-30b"}
    said = " ".join(out.getvalue().split())  # rich wraps long lines
    assert "megakernel: custom:100,64,8,2 left out: the megakernel cannot run it: it needs hidden % 128 == 0" in said
    b.state.mark("compare", b.stage_compare())
    report = " ".join(Path(b.stage_report()).read_text().split())
    assert "megakernel: custom:100,64,8,2 left out: the megakernel cannot run it: it needs hidden % 128 == 0" in report
    assert "qwen3-30b S=16" in report


def test_bringup_leaves_out_no_model_the_megakernel_runs() -> None:
    from moetune.tuner.bringup.flow import megakernel_left_out

    assert megakernel_left_out(["qwen3-30b", "custom:128,64,8,2"]) == {}
    left = megakernel_left_out(["custom:128,64,8,2,float16", "custom:128,64,1024,2"])
    assert "bfloat16" in left["custom:128,64,8,2,float16"] and "1..512 experts" in left["custom:128,64,1024,2"], left
