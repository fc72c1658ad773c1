"""`moetune bench ep` (and the tuner's bench worker) rotates a few input sets over the timed iterations,
deterministic by seed, instead of timing the same x / routing every iteration."""

from __future__ import annotations

import pytest
import torch

from moetune.runtime.buffer.facade import EPBuffer
from moetune.runtime.shapes import get_model
from moetune.tuner.measure import ep

MODEL = "custom:64,32,8,2,float32"


def _sets(seed: int, rotate: int, routing: str = "uniform"):
    ep._INPUTS.clear()
    return ep._inputs(0, get_model(MODEL), torch.float32, 16, routing, seed, torch.device("cpu"), rotate)


def test_input_sets_are_distinct_and_deterministic() -> None:
    a, b = _sets(3, 4), _sets(3, 4)
    assert len(a) == 4
    for (x1, i1, w1), (x2, i2, w2) in zip(a, b, strict=True):  # the same seed gives the same sets
        assert torch.equal(x1, x2) and torch.equal(i1, i2) and torch.equal(w1, w2)
    for j in range(1, 4):  # the sets differ in activations and routing
        assert not torch.equal(a[0][0], a[j][0]) and not torch.equal(a[0][1], a[j][1])
    # another seed, other sets; set 0 is what a single-set run used
    assert not torch.equal(_sets(4, 4)[0][0], a[0][0])
    assert torch.equal(_sets(3, 1)[0][0], a[0][0])
    with pytest.raises(ValueError, match="rotate"):
        _sets(3, 0)


def _spy_dispatch(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """(sum of x, sum of the ids) of every EPBuffer.dispatch call from now on: which input set each call got."""
    seen: list[tuple[float, int]] = []
    orig = EPBuffer.dispatch

    def spy(self, x, idx, w, *a, **kw):
        seen.append((float(x.float().sum()), int(idx.sum())))
        return orig(self, x, idx, w, *a, **kw)

    monkeypatch.setattr(EPBuffer, "dispatch", spy)
    return seen


def test_the_timed_iterations_rotate_their_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy_dispatch(monkeypatch)
    cfg = {"model": MODEL, "tokens": 16, "knobs": "transport=collective", "iters": 6, "warmup": 2, "seed": 1,
           "layer": False, "backend": "gloo"}
    rep = ep.bench_case(0, 1, dict(cfg, rotate=3))
    assert rep is not None and rep["rotate"] == 3 and rep["roundtrip_rel_err"] < 1e-5
    loop = seen[: 2 * 8]  # per iteration: dispatch alone, then the round trip's dispatch
    per_iter = [loop[2 * i] for i in range(8)]
    assert all(loop[2 * i] == loop[2 * i + 1] for i in range(8))  # both phases of an iteration: one set
    assert len(set(per_iter)) == 3  # three sets ...
    assert all(per_iter[i] == per_iter[i % 3] for i in range(8))  # ... in turn
    # the default rotates too
    seen.clear()
    assert ep.bench_case(0, 1, cfg)["rotate"] == ep.DEFAULT_ROTATE
    assert len({seen[2 * i] for i in range(8)}) == ep.DEFAULT_ROTATE


def test_the_bench_worker_passes_rotate() -> None:
    from moetune.tuner.measure.worker import case_config

    case = {"model": MODEL, "tokens": 16, "knobs": "transport=collective"}
    assert "rotate" not in case_config(case, 2, "gloo")  # the bench's default
    assert case_config(dict(case, rotate=2), 2, "gloo")["rotate"] == 2
    for bad in (0, -1, "3", 2.5, True):
        with pytest.raises(ValueError, match="rotate"):
            case_config(dict(case, rotate=bad), 2, "gloo")


def test_no_input_set_has_its_first_call_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up below the rotation is raised to it (`moe.warmup_for`, the rule of the MoE layer's timings), so every
    set's first dispatch, round trip and layer call is untimed. The tuner asks for max(1, iters // 4) warm-up
    iterations (`LocalBackend.case`): `profile --quick` (iters 10) warmed 2 of the 4 sets up and timed the first calls
    of the other two among its 10 samples; `--warmup 0` timed even the first call of all, and a CUDA graph's first
    replay (its upload)."""
    seen = _spy_dispatch(monkeypatch)
    cfg = {"model": MODEL, "tokens": 16, "knobs": "transport=collective", "iters": 6, "seed": 1, "layer": False,
           "backend": "gloo", "rotate": 3}
    for asked in (0, 1, 2):
        seen.clear()
        rep = ep.bench_case(0, 1, dict(cfg, warmup=asked))
        assert rep is not None and rep["warmup"] == 3 and rep["roundtrip_rel_err"] < 1e-5
        assert f"--warmup {asked} is below --rotate 3" in rep["warmup_note"]
        warm = {seen[2 * i] for i in range(rep["warmup"])}  # per iteration: dispatch alone, then the round trip's
        assert len(warm) == 3  # every set called before the first timed iteration
    seen.clear()
    rep = ep.bench_case(0, 1, dict(cfg, warmup=4))  # at or above the rotation: as asked, no note
    assert rep is not None and rep["warmup"] == 4 and "warmup_note" not in rep
