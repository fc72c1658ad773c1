"""MoELayer / MegakernelMoE on CPU: argument checks that name the argument, the megakernel's limits at
construction, row-major math on k-tiled parameters, rebinding replaced parameters, and routing-id checks.

The megakernel itself needs an sm_90 GPU: where a test needs it built, a fake stands in (as in
test_megakernel_engine.py), or `_lib.load` and the CUDA-device check are replaced so that `MegakernelMoE` builds its
buffers on the CPU and its argument checks run (nothing is launched)."""

from __future__ import annotations

import ctypes
import re
import types
import warnings
from typing import Any, ClassVar

import pytest
import torch

from moetune.runtime.buffer.facade import EPBuffer
from moetune.runtime.csrc_build import CsrcError
from moetune.runtime.knobs import Knobs
from moetune.runtime.megakernel import MegakernelConfig, _lib
from moetune.runtime.megakernel import engine as E
from moetune.runtime.megakernel import layer as mk_layer
from moetune.runtime.megakernel.weights import from_tiled, to_tiled
from moetune.runtime.moe_layer import MoELayer, dense_reference, grouped_mm_usable, route
from moetune.runtime.options import RuntimeOptionError, RuntimeOptions
from moetune.runtime.shapes import ModelShape

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("autoload_off")]
TINY = ModelShape(name="tiny", hidden=128, intermediate=64, experts=4, topk=2, dtype="bfloat16")
BF = torch.bfloat16


def _unfused(model: ModelShape = TINY, **kw: Any) -> MoELayer:
    return MoELayer(model, None, Knobs(), max_tokens=kw.pop("max_tokens", 16), device="cpu", dtype=BF,
                    engine="unfused", **kw)


def _x(s: int, h: int = TINY.hidden, seed: int = 0) -> torch.Tensor:
    return torch.randn(s, h, generator=torch.Generator().manual_seed(seed)).to(BF)


def _picks(s: int) -> torch.Tensor:
    """Given routing for s tokens: each token to experts 0..topk-1 (distinct, as the megakernel requires)."""
    return torch.arange(TINY.topk).repeat(s, 1)


class FakeMegakernel:
    """Stands in for MegakernelMoE: each call computes with the unfused math on the row-major form of the k-tiled
    tensors it holds NOW (so a stale pointer after a parameter swap would show), and supports `rebind` / `check`."""

    built: ClassVar[list[FakeMegakernel]] = []

    def __init__(self, model: Any, **kw: Any):
        assert kw["tiled"] is True
        self.model, self.kw, self.device = model, kw, kw["device"]
        self.w1t, self.w2t, self.gate = kw["w_gate_up"], kw["w_down"], kw["gate"]
        self.rebinds = self.checks = 0
        self.ref = _unfused(model, max_tokens=kw["max_tokens"], seed=kw["seed"])
        FakeMegakernel.built.append(self)

    def rebind(self, w1: torch.Tensor, w2: torch.Tensor, gate: torch.Tensor) -> None:
        self.w1t, self.w2t, self.gate = w1, w2, gate
        self.rebinds += 1

    def check(self) -> None:
        self.checks += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = route(x, self.gate, self.model.topk)
        return self.forward_routed(x, idx, w)

    def forward_routed(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, **_: Any) -> torch.Tensor:
        self.ref.w_gate_up.data.copy_(from_tiled(self.w1t))
        self.ref.w_down.data.copy_(from_tiled(self.w2t))
        return self.ref.local_forward(x, idx.long(), w)


@pytest.fixture
def fake_mk(monkeypatch: pytest.MonkeyPatch) -> type[FakeMegakernel]:
    FakeMegakernel.built = []
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    monkeypatch.setattr(E, "build_megakernel", FakeMegakernel)
    return FakeMegakernel


def _mk_layer(knobs: Knobs | None = None, **kw: Any) -> MoELayer:
    return MoELayer(TINY, None, knobs or Knobs(engine="megakernel"), max_tokens=kw.pop("max_tokens", 16),
                    device="cpu", dtype=BF, **kw)


@pytest.fixture
def cpu_lib(monkeypatch: pytest.MonkeyPatch) -> None:
    """MegakernelMoE builds on the CPU (its checks run; nothing may launch)."""
    monkeypatch.setattr(_lib, "load", lambda: object())
    monkeypatch.setattr(mk_layer, "_device_problem", lambda device: None)


def _cpu_mk(**kw: Any) -> mk_layer.MegakernelMoE:
    return mk_layer.MegakernelMoE(TINY, max_tokens=kw.pop("max_tokens", 8), device="cpu", **kw)


# -- 1: experts() / local_forward() on k-tiled parameters ---------------------------------------------------------
def test_tiled_layout_round_trips() -> None:
    w = torch.randn(3, 10, 128).to(BF)
    assert torch.equal(from_tiled(to_tiled(w)), w) and not torch.equal(to_tiled(w), w)


@pytest.mark.parametrize("grouped", [False, True])
def test_tiled_layer_methods_compute_on_row_major_weights(fake_mk, grouped: bool) -> None:
    if grouped and not grouped_mm_usable("cpu", None, BF, TINY.hidden, TINY.intermediate):
        pytest.skip("torch._grouped_mm does not run here")
    layer = _mk_layer(use_grouped_mm=grouped)
    ref = _unfused(use_grouped_mm=grouped)
    assert layer.engine == "megakernel" and layer.weights_tiled
    assert not torch.equal(layer.w_gate_up, ref.w_gate_up)  # the parameters hold the tiled layout
    x = _x(9)
    idx, w = ref.route(x)
    assert torch.equal(layer.local_forward(x, idx, w), ref.local_forward(x, idx, w))
    recv_x, meta, _handle = ref.buffer.dispatch(x, idx, w)
    assert torch.equal(layer.experts(recv_x, meta), ref.experts(recv_x, meta))
    assert torch.equal(layer(x), ref(x))


# -- 2: max_tokens -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("bad", "exc"), [(True, TypeError), (1.5, TypeError), ("8", TypeError), (None, TypeError),
                                          (0, ValueError), (-3, ValueError)])
def test_max_tokens_must_be_a_positive_int(bad: Any, exc: type, cpu_lib) -> None:
    with pytest.raises(exc, match="max_tokens"):
        MoELayer(TINY, None, Knobs(), max_tokens=bad, device="cpu")
    with pytest.raises(exc, match="max_tokens"):
        mk_layer.MegakernelMoE(TINY, max_tokens=bad, device="cpu")


def test_more_tokens_than_max_tokens_raise_the_same_error_on_every_engine(fake_mk) -> None:
    un, mk = _unfused(max_tokens=4), _mk_layer(max_tokens=4)
    assert (un.engine, mk.engine) == ("unfused", "megakernel")
    x = _x(5)
    idx, w = un.route(x)
    for layer in (un, mk):
        for call in (lambda: layer(x), lambda: layer.forward_routed(x, idx, w)):  # noqa: B023
            with pytest.raises(ValueError, match=r"x has 5 tokens, more than max_tokens=4"):
                call()
    assert un(x[:4]).shape == (4, TINY.hidden) and mk(x[:4]).shape == (4, TINY.hidden)


# -- 3: the library's limits, at construction -----------------------------------------------------------------------
def _shape(**kw: Any) -> ModelShape:
    return ModelShape(**{"name": "t", "hidden": 128, "intermediate": 64, "experts": 4, "topk": 2, **kw})


@pytest.mark.parametrize(("model", "max_tokens", "cfg", "match"), [
    (_shape(hidden=96), None, None, "hidden % 128"),
    (_shape(experts=1024), None, None, r"1\.\.512 experts"),
    (_shape(experts=32, topk=17), None, None, r"topk in 1\.\.min\(16, experts\)"),
    (_shape(), None, MegakernelConfig(split_k2=2), "split-K parts must be multiples of 64"),
    (_shape(hidden=256), None, MegakernelConfig(split_k1=8), "split-K parts must be multiples of 64"),
    (_shape(hidden=384), None, MegakernelConfig(bn=256), r"bn=256 \(the knob mk_bn\) needs"),
    (_shape(), 1 << 22, None, "too many tiles for max_tokens"),
    (_shape(experts=16, topk=16), (1 << 26) + 1, MegakernelConfig(bm=128), r"max_tokens x topk must be <= 2\^30"),
    # the task word's 16-bit m-tile field: an expert's list holds max_tokens rows, 2^20 + 1 of them 65537 m-tiles of 16
    (_shape(topk=1), (1 << 20) + 1, MegakernelConfig(combine_tokens=32),
     r"too many m-tiles for one expert .* 1048577 rows make up to 65537 m-tiles of bm=16, more than the 65536 a "
     r"task word's 16-bit m-tile field numbers; lower max_tokens or raise bm"),
    (_shape(topk=1), (1 << 22) + 1, MegakernelConfig(bm=64, combine_tokens=128), r"65537 m-tiles of bm=64"),
    (_shape(topk=1), (1 << 23) + 1, MegakernelConfig(bm=128, combine_tokens=256), r"65537 m-tiles of bm=128, .*; lower max_tokens$"),
])
def test_limits_problem_mirrors_the_library(model: ModelShape, max_tokens: int | None, cfg: Any, match: str) -> None:
    why = E.limits_problem(model, max_tokens, cfg)
    assert why is not None and re.search(match, why), why


def test_limits_within_range_pass() -> None:
    from moetune.runtime.shapes import MODELS

    assert E.limits_problem(MODELS["qwen3-30b"], 4096, MegakernelConfig(split_k1=4, split_k2=2)) is None
    assert E.limits_problem(_shape(experts=512, topk=16), 1 << 16, MegakernelConfig()) is None
    # one expert's m-tiles count its own list (max_tokens rows), not max_tokens x topk: 8192 m-tiles of 16 here
    assert E.limits_problem(_shape(experts=512, topk=16), 131072, None) is None
    for bm, ct in ((16, 32), (64, 128), (128, 256)):  # 65536 m-tiles: fits
        assert E.limits_problem(_shape(topk=1), (1 << 16) * bm, MegakernelConfig(bm=bm, combine_tokens=ct)) is None


def test_megakernel_limits_fall_back_or_raise_at_construction(fake_mk) -> None:
    bad = Knobs(engine="megakernel", mk_split_k=2)  # intermediate 64 cannot split into parts of 64
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = _mk_layer(bad)
    assert layer.engine == "unfused" and "split-K" in layer.engine_note and not layer.weights_tiled
    assert any("split-K" in str(w.message) for w in caught if issubclass(w.category, E.EngineFallbackWarning))
    assert not fake_mk.built
    with pytest.raises(E.MegakernelUnavailable, match="split-K"):
        _mk_layer(bad, engine="megakernel")
    with pytest.raises(E.MegakernelUnavailable, match="too many tiles"):
        MoELayer(_shape(experts=8), None, Knobs(engine="megakernel"), max_tokens=1 << 21, device="cpu", dtype=BF,
                 engine="megakernel")


def test_megakernel_moe_checks_limits_before_building(cpu_lib) -> None:
    with pytest.raises(ValueError, match="split-K parts"):
        _cpu_mk(config=MegakernelConfig(split_k1=1, split_k2=2))
    with pytest.raises(ValueError, match="too many tiles"):
        mk_layer.MegakernelMoE(_shape(experts=8), max_tokens=1 << 21, device="cpu")


def test_launch_shapes_cover_every_bm_and_stages() -> None:
    mk = object.__new__(mk_layer.MegakernelMoE)  # only the attributes launch_shapes reads
    from moetune.runtime.shapes import MODELS

    mk.model, mk.max_tokens = MODELS["qwen3-30b"], 4096
    mk.config = MegakernelConfig().resolve(mk.model.hidden, mk.model.intermediate)
    want = set()
    for s in range(1, 4097):
        bm = mk.config.pick_bm(s, mk.model.topk, mk.model.experts)
        st = mk.config.pick_stages(bm, s, mk.model.topk, mk.model.experts)
        want.add((bm, st))
    assert want <= mk.launch_shapes() and (16, 4) in mk.launch_shapes()


def test_a_bucket_config_is_checked_against_its_own_launches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bucket 16's config runs launches of S = 4..31 only (bm 16 on qwen3-30b); a launch shape it never runs (the wide
    bm=128 tile of S = 4096) that cannot take it must not refuse it, while bucket 4096's config, which runs there, is
    refused. (The tuner measures a bucket with max_tokens = S: a layer with a larger max_tokens must still take it.)"""
    from moetune.runtime.megakernel.config import LaunchConfigs, bucket_tokens
    from moetune.runtime.shapes import MODELS

    mk = object.__new__(mk_layer.MegakernelMoE)  # only the attributes set_bucket_config reads
    mk.model, mk.max_tokens, mk.device = MODELS["qwen3-30b"], 4096, torch.device("cuda", 0)
    mk.config = MegakernelConfig().resolve(mk.model.hidden, mk.model.intermediate)
    mk.launch = LaunchConfigs(mk.config)
    asked: list[tuple[int, int]] = []

    def grid(bm: int, stages: int, config: Any = None) -> int:
        asked.append((bm, stages))
        if bm == 128:
            raise mk_layer.ConfigError("ctas_per_sm=2 but only 1 fit per SM (bm=128)")
        return 132

    monkeypatch.setattr(mk, "grid", grid, raising=False)
    monkeypatch.setattr(mk, "_reserve_split", lambda cfg: None, raising=False)
    cfg = MegakernelConfig.parse("ctas_per_sm=2")
    assert bucket_tokens(16, 4096) == (4, 31)
    assert mk.set_bucket_config(16, cfg) is None and asked and {bm for bm, _ in asked} == {16}, asked
    assert mk.launch.for_tokens(16).ctas_per_sm == 2
    asked.clear()
    why = mk.set_bucket_config(4096, cfg)
    assert why is not None and "bm=128" in why and (128, mk.config.pick_stages(128, 4096, 8, 128)) in asked, why
    assert mk.launch.for_tokens(4096).ctas_per_sm != 2  # refused: nothing installed for it


@pytest.mark.parametrize(("bucket", "config", "exc", "match"), [
    (100, MegakernelConfig(), ValueError, r"bucket 100 is not a token bucket of the profile ladder \(1, 16, 64, "),
    (0, MegakernelConfig(), ValueError, r"bucket 0 is not a token bucket .*, 65536\)"),
    (16, "bm=16", TypeError, "config must be a MegakernelConfig, got str"),
    (16, None, TypeError, "config must be a MegakernelConfig, got NoneType"),
    (16.0, MegakernelConfig(), TypeError, "bucket must be an int"),
])
def test_a_bucket_config_off_the_ladder_or_of_the_wrong_type_is_refused(bucket: Any, config: Any, exc: type,
                                                                        match: str) -> None:
    """Before: a bucket that is not on the profile ladder (TOKEN_BUCKETS) was installed and None returned, though
    launches look their config up by their S's ladder bucket, so no S ever ran it; a config that is no
    MegakernelConfig raised dataclasses.replace's TypeError, which names no argument. Now a ValueError naming the
    ladder's buckets and a TypeError naming `config` (or `bucket`), and nothing is installed."""
    from moetune.runtime.megakernel.config import LaunchConfigs
    from moetune.runtime.shapes import MODELS

    mk = object.__new__(mk_layer.MegakernelMoE)  # only the attributes set_bucket_config reads
    mk.model, mk.max_tokens, mk.device = MODELS["qwen3-30b"], 4096, torch.device("cpu")
    mk.config = MegakernelConfig().resolve(mk.model.hidden, mk.model.intermediate)
    mk.launch = LaunchConfigs(mk.config)
    mk._reserve_split = lambda cfg: None  # type: ignore[method-assign]
    with pytest.raises(exc, match=match):
        mk.set_bucket_config(bucket, config)
    assert mk.launch._by_bucket == {}
    assert mk.set_bucket_config(16, MegakernelConfig()) is None and set(mk.launch._by_bucket) == {16}


# -- 4: parameters replaced after construction ---------------------------------------------------------------------
def test_assigned_state_dict_is_handed_to_the_megakernel(fake_mk) -> None:
    layer, ref = _mk_layer(), _unfused()
    mk = fake_mk.built[-1]
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    new = {k: (v * 2 if k in ("w_gate_up", "w_down") else v) for k, v in sd.items()}
    layer.load_state_dict(new, assign=True)
    assert mk.rebinds == 1 and mk.w1t.data_ptr() == layer.w_gate_up.data_ptr()
    ref.load_state_dict(new)
    x = _x(7, seed=3)
    assert torch.equal(layer(x), ref(x))
    assert torch.equal(layer.state_dict()["w_gate_up"], new["w_gate_up"])  # still row-major outside
    layer.load_state_dict(sd)  # in place: the same storage, nothing to hand over
    assert mk.rebinds == 1


def test_dtype_or_storage_changes_are_caught_before_a_launch(fake_mk) -> None:
    layer = _mk_layer()
    mk = fake_mk.built[-1]
    x = _x(3)
    layer.w_gate_up = torch.nn.Parameter(layer.w_gate_up.detach().clone(), requires_grad=False)
    out = layer(x)  # a parameter assigned anew: handed over at the next forward
    assert mk.rebinds == 1 and mk.w1t.data_ptr() == layer.w_gate_up.data_ptr()
    assert torch.equal(out, _unfused()(x))
    layer.float()
    with pytest.raises(ValueError, match=r"bfloat16 .* w_gate_up is now torch.float32"):
        layer(x)  # the layer still takes bf16 x; its weights are fp32 now, which the megakernel cannot read
    with pytest.raises(ValueError, match=r"is now torch.float32"):
        _mk_layer().load_state_dict({k: v.float() for k, v in layer.state_dict().items()}, assign=True)


def test_the_unfused_engine_names_parameters_of_another_dtype_device_or_shape() -> None:
    """Parameters of another dtype, device or shape (after .float() / .half(), or an fp32 checkpoint loaded with
    assign=True) are named by the call (and the load), as the megakernel engine does: otherwise the first matmul
    fails with torch's "expected m1 and m2 to have the same dtype", naming no parameter."""
    x = _x(3)
    want = _unfused()(x)
    for change in (lambda m: m.float(), lambda m: m.half()):
        layer = _unfused()
        change(layer)
        with pytest.raises(ValueError, match=r"w_gate_up is now torch.float(32|16) .* build a new layer"):
            layer(x)
        with pytest.raises(ValueError, match="w_gate_up is now"):
            layer.forward_routed(x, _picks(3), torch.full((3, TINY.topk), 0.5))
        # x converted along with the layer (the natural next step): the parameters are still what is named, not x
        # ("x must be torch.bfloat16", which sent the caller back to bf16 inputs, refused then for the weights)
        xt = x.to(layer.w_gate_up.dtype)
        with pytest.raises(ValueError, match=r"w_gate_up is now torch.float(32|16) .* build a new layer"):
            layer(xt)
        with pytest.raises(ValueError, match="w_gate_up is now"):
            layer.forward_routed(xt, _picks(3), torch.full((3, TINY.topk), 0.5))
    layer = _unfused()
    with pytest.raises(ValueError, match=r"x must be torch.bfloat16 on cpu, got torch.float32"):  # the layer as built
        layer(x.float())
    sd = layer.state_dict()
    with pytest.raises(ValueError, match=r"w_gate_up is now torch.float32"):
        layer.load_state_dict({k: v.float() for k, v in sd.items()}, assign=True)
    layer = _unfused()
    layer.gate = torch.nn.Parameter(layer.gate.detach()[:, :64].clone(), requires_grad=False)
    with pytest.raises(ValueError, match=r"gate is now torch.bfloat16 \(4, 64\)"):
        layer(x)
    layer = _unfused()
    layer.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)  # its own dtype: runs as before
    assert torch.equal(layer(x), want)


def test_megakernel_moe_rebind_checks_and_updates_templates(cpu_lib) -> None:
    mk = _cpu_mk()
    mk._params[(16, 3)] = p = _lib.MkParams()
    w1, w2, g = mk.w1t.clone(), mk.w2t.clone(), mk.gate.clone()
    mk.rebind(w1, w2, g)
    assert (p.w1, p.w2, p.wg) == (w1.data_ptr(), w2.data_ptr(), g.data_ptr()) and mk.w1t is w1
    with pytest.raises(ValueError, match="w_down must be bf16"):
        mk.rebind(w1, w2.float(), g)
    with pytest.raises(ValueError, match="contiguous"):
        mk.rebind(w1, w2, torch.empty(TINY.hidden, TINY.experts, dtype=BF).t())


# -- 5: routing ids ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("ids", "match"), [
    (lambda idx: idx.clone().fill_(TINY.experts), r"out of range \[0, 4\)"),
    (lambda idx: torch.where(idx == idx[0, 0], -1, idx), "out of range"),
    (lambda idx: idx.float(), "integer tensor"),
    (lambda idx: idx.bool(), "integer tensor"),
    (lambda idx: idx[:, :1], r"topk_idx must have shape \[S, topk\]"),
    (lambda idx: idx.to("meta"), "topk_idx must be on cpu"),
])
def test_routing_ids_are_checked(fake_mk, cpu_lib, ids: Any, match: str) -> None:
    x = _x(6)
    idx, w = _unfused().route(x)
    for layer in (_unfused(), _mk_layer(), _cpu_mk(max_tokens=8)):
        with pytest.raises(ValueError, match=match):
            layer.forward_routed(x, ids(idx), w)
    with pytest.raises(ValueError, match="topk_weights must be a floating-point"):
        _unfused().forward_routed(x, idx, idx)


def test_unchecked_wide_ids_stay_invalid_when_narrowed(cpu_lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unchecked int64 ids (check_ids=False, or during capture) go to the kernel's int32 scratch: one past 2**32 must
    reach it out of range (the kernel then drops the row and reports it), never wrapped into a valid expert."""
    mk = _cpu_mk(max_tokens=8)
    seen: list[list[list[int]]] = []
    monkeypatch.setattr(mk, "_run", lambda x, s, out, given: seen.append(mk.topk_idx[:s].tolist()) or x)
    x = _x(3)
    idx = torch.tensor([[2**32 + 3, 1], [-(2**32) + 2, 0], [2, 3]], dtype=torch.int64)
    mk.forward_routed(x, idx, torch.full((3, 2), 0.5), check_ids=False)
    (got,) = seen
    assert got[2] == [2, 3] and got[0][1] == 1 and got[1][1] == 0  # ids in range as given
    assert not 0 <= got[0][0] < TINY.experts and not 0 <= got[1][0] < TINY.experts, got


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32])
def test_narrow_integer_ids_reach_the_kernel_as_given(cpu_lib, monkeypatch: pytest.MonkeyPatch,
                                                      dtype: torch.dtype) -> None:
    """Ids of another integer dtype than int32 reach the int32 scratch as given. A clamp to [-1, experts] in their
    own dtype would be wrong for each: uint8 takes -1 as 255, so every id becomes `experts` (out of range: the launch
    aborts, error 4); int8 overflows with 128 experts; uint16 / uint32 would get no clamp."""
    model = ModelShape(name="e128", hidden=128, intermediate=64, experts=128, topk=2, dtype="bfloat16")
    mk = mk_layer.MegakernelMoE(model, max_tokens=8, device="cpu")
    seen: list[list[list[int]]] = []
    monkeypatch.setattr(mk, "_run", lambda x, s, out, given: seen.append(mk.topk_idx[:s].tolist()) or x)
    picks = [[0, 1], [3, 2], [127, 5]]
    mk.forward_routed(_x(3), torch.tensor(picks, dtype=torch.int64).to(dtype), torch.full((3, 2), 0.5),
                      check_ids=False)
    assert seen == [picks]


def test_the_layer_clears_the_megakernels_sticky_error(cpu_lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """check() raises a recorded device error after any number of later forwards; MoELayer.clear_error() forgets it
    (a serving loop that handled one timeout is not stuck raising it), and is a no-op on the unfused engine."""
    layer = _unfused()
    layer.check()
    layer.clear_error()  # unfused: nothing to clear
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    layer = _mk_layer(engine="megakernel", max_tokens=8)  # a MegakernelMoE built on the CPU (cpu_lib)
    mk = layer.megakernel
    assert isinstance(mk, mk_layer.MegakernelMoE)
    mk.err[0], mk.err[1] = 1, 3  # a scheduler timeout recorded by some launch
    with pytest.raises(mk_layer.MegakernelError, match="megakernel error 1"):
        layer.check()
    with pytest.raises(mk_layer.MegakernelError):
        layer.check()  # sticky
    layer.clear_error()
    layer.check()


def test_unchecked_buffer_skips_the_id_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = EPBuffer(None, Knobs(), model=TINY, max_tokens=16, device="cpu", dtype=BF, check_inputs=False)
    layer = MoELayer(TINY, max_tokens=16, buffer=buf, engine="unfused")
    calls = []
    monkeypatch.setattr("moetune.runtime.moe_layer.expert_ids_problem", lambda *a: calls.append(a))
    x = _x(4)
    layer.forward_routed(x, *layer.route(x))
    assert not calls


def _repeating(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused layer's routing of x with token rows 2 and 4 picking their first expert in both slots."""
    idx, w = _unfused().route(x)
    idx = idx.clone()
    idx[2, 1], idx[4, 1] = idx[2, 0], idx[4, 0]
    return idx, w


def test_a_token_repeating_an_expert_is_refused_where_the_megakernel_runs(fake_mk, cpu_lib) -> None:
    """The megakernel's per-expert row lists hold max_tokens rows (one per token), so picks that repeat an expert
    could give one expert S * topk rows and k_lists would write past them: refused on the host, naming the first
    such token. The torch engines add a repeated expert's rows like any others and still take it."""
    x = _x(6)
    idx, w = _repeating(x)
    e = int(idx[2, 0])
    for layer in (_mk_layer(), _cpu_mk(max_tokens=8)):  # (MoELayer's own check: the fake megakernel takes repeats)
        with pytest.raises(ValueError, match=rf"topk_idx row 2 picks expert {e} more than once \(\[{e}, {e}\]\) "
                                             r"\(and 1 more tokens\): a token's picks must be distinct experts"):
            layer.forward_routed(x, idx, w)
    un = _unfused()
    assert torch.equal(un.forward_routed(x, idx, w), un.local_forward(x, idx, w))
    bad = idx.clone()
    bad[5, 0] = TINY.experts  # out of range and repeating: the range is what is reported
    with pytest.raises(ValueError, match=r"out of range \[0, 4\): 1 bad ids"):
        _cpu_mk(max_tokens=8).forward_routed(x, bad, w)


def test_unchecked_repeats_reach_the_kernel(fake_launch) -> None:
    """check_ids=False (MoELayer's own check ran, or a CUDA graph is being captured): the repeating picks are not
    refused on the host, both launches (mk_route_given, mk_experts) are issued, and check() names a code-7 record and
    its where / detail. The record is written here by the test (no kernel runs on the CPU); that the kernel drops the
    rows past an expert's list, records code 7 and aborts is tests/test_megakernel_gpu.py
    test_repeated_expert_rows_past_the_list_are_dropped_and_reported."""
    mk = _cpu_mk()
    x = _x(6)
    idx, w = _repeating(x)
    mk.forward_routed(x, idx, w, check_ids=False)
    assert [c["name"] for c in fake_launch.launches][-2:] == ["mk_route_given", "mk_experts"]
    mk.err[:4] = torch.tensor([7, 5, 0, 0])
    with pytest.raises(mk_layer.MegakernelError, match=r"megakernel error 7: an expert got more than max_tokens rows: "
                                                       r"a token's given picks repeat an expert .*where=5, detail=0"):
        mk.check()


def test_an_aborting_error_is_named_over_a_nonfinite_record(cpu_lib) -> None:
    """The kernels keep code 8 (recorded without the abort: the other rows were computed) in err words 4..7 and the
    first aborting error in 0..3 (mk_moe.cu record_noabort / report). error() and check() name the aborting one
    whenever there is one, whichever came first: with one slot, a code 8 first hid a later timeout, and check() said
    the other rows were computed for a launch whose rows were all invalid. Code 8 alone is still named, with its own
    where / detail; clear_error forgets both."""
    mk = _cpu_mk()
    assert mk.error() is None and _lib.ERR_NOABORT == 4 and mk.err.numel() == 8
    mk.err[4:] = torch.tensor([8, 3, 0, 0])
    assert mk.error() == (8, mk_layer.ERR_NAMES[8], [8, 3, 0, 0])
    with pytest.raises(mk_layer.MegakernelError, match=r"megakernel error 8: non-finite gate logits .*where=3, detail=0"):
        mk.check()
    mk.err[:4] = torch.tensor([6, 2, 16, 250_000_000])
    assert mk.error() == (6, mk_layer.ERR_NAMES[6], [6, 2, 16, 250_000_000])
    with pytest.raises(mk_layer.MegakernelError, match=r"megakernel error 6: .*where=2, detail=16, waited=250.0 ms"):
        mk.check()
    mk.clear_error()
    assert mk.error() is None


def test_expert_ids_problem_reads_both_checks_in_one_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The distinct check rides in the range check's one copy to the host (no second sync on the accepted path)."""
    from moetune.runtime.routing import expert_ids_problem

    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    for name in ("item", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, lambda t, name=name: pytest.fail(f"Tensor.{name}: another sync"))
    good = torch.tensor([[0, 3], [3, 0], [1, 2]], dtype=torch.int32)
    assert expert_ids_problem(good, 4, distinct=True) is None and reads == [(3,)]
    assert expert_ids_problem(good[:, :1], 4, distinct=True) is None  # topk 1: nothing can repeat
    assert expert_ids_problem(good[:0], 4, distinct=True) is None
    monkeypatch.undo()
    rep = torch.tensor([[0, 3, 1], [2, 1, 2], [1, 1, 1]])
    assert expert_ids_problem(rep, 4) is None  # without distinct: the range only (the EP buffer's check)
    assert expert_ids_problem(rep, 4, distinct=True) == (
        "topk_idx row 1 picks expert 2 more than once ([2, 1, 2]) (and 1 more tokens): a token's picks must be "
        "distinct experts (an expert takes at most one row per token)")


def test_layer_check_delegates_to_the_megakernel(fake_mk) -> None:
    _unfused().check()  # nothing to read: no error
    layer = _mk_layer()
    layer.check()
    assert fake_mk.built[-1].checks == 1


# -- 6-9: MegakernelMoE arguments ------------------------------------------------------------------------------------
def test_cuda_device_without_index_is_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert mk_layer._device("cuda") == torch.device("cuda", 3) == mk_layer._device(None)
    assert mk_layer._device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert mk_layer._device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("cpu")])
def test_a_device_that_is_not_cuda_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch, device: Any) -> None:
    """A device that is not CUDA is refused when the layer is built, not at its first launch with torch's
    "Expected a cuda device"."""
    monkeypatch.setattr(_lib, "load", lambda: pytest.fail("the library is loaded before the device is checked"))
    with pytest.raises(ValueError, match=r"megakernel: device must be a CUDA device .*got (cpu|meta)"):
        mk_layer.MegakernelMoE(TINY, max_tokens=8, device=device)


@pytest.mark.parametrize(("device", "gpus", "cap", "match"), [
    (None, 0, (9, 0), "device cuda: CUDA is not available to torch"),
    ("cuda", 0, (9, 0), "device cuda: CUDA is not available to torch"),
    ("cuda:2", 1, (9, 0), "device cuda:2: this process sees 1 CUDA device"),
    ("cuda:0", 1, (8, 0), r"sm_90 \(Hopper\) GPU; Fake A100 is sm_80"),
])
def test_a_cuda_device_the_kernels_cannot_use_is_named(monkeypatch: pytest.MonkeyPatch, device: Any, gpus: int,
                                                       cap: tuple[int, int], match: str) -> None:
    """No CUDA, an index past the devices, a GPU other than sm_90: a ValueError naming the device (it was torch's
    AssertionError from indexing "cuda" without CUDA, or a ConfigError blaming the settings from the library's
    occupancy query on a non-Hopper GPU)."""
    monkeypatch.setattr(_lib, "load", lambda: pytest.fail("the library is loaded before the device is checked"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake A100")
    with pytest.raises(ValueError, match=match):
        mk_layer.MegakernelMoE(TINY, max_tokens=8, device=device)


def test_forward_routed_checks_before_copying(cpu_lib) -> None:
    mk = _cpu_mk(max_tokens=4)
    x = _x(6)
    idx = torch.zeros(6, TINY.topk, dtype=torch.int64)
    w = torch.full((6, TINY.topk), 0.5)
    with pytest.raises(ValueError, match="x has 6 tokens, more than max_tokens=4"):
        mk.forward_routed(x, idx, w)
    with pytest.raises(ValueError, match=r"x must be bf16 \[S, 128\]"):
        mk.forward_routed(x[:4].float(), idx[:4], w[:4])
    with pytest.raises(ValueError, match="topk_weights must be a floating-point"):
        mk.forward_routed(x[:4], idx[:4], idx[:4])


def test_weights_all_or_none(cpu_lib) -> None:
    cls = mk_layer.MegakernelMoE  # builds all three from seed when none is given
    full = _cpu_mk()
    with pytest.raises(ValueError, match=r"all of w_gate_up, w_down and gate or none.*got w_gate_up without w_down, gate"):
        cls(TINY, max_tokens=8, device="cpu", w_gate_up=full.w_gate_up)
    with pytest.raises(ValueError, match="got w_gate_up, gate without w_down"):
        cls(TINY, max_tokens=8, device="cpu", w_gate_up=full.w_gate_up, gate=full.gate)
    again = cls(TINY, max_tokens=8, device="cpu", w_gate_up=full.w_gate_up, w_down=full.w_down, gate=full.gate)
    assert torch.equal(again.w1t, full.w1t)


@pytest.mark.parametrize(("out", "match"), [
    (lambda s: torch.empty(s + 1, TINY.hidden, dtype=BF), r"out must be bf16 \[3, 128\]"),
    (lambda s: torch.empty(s, TINY.hidden), r"out must be bf16"),
    (lambda s: torch.empty(TINY.hidden, s, dtype=BF).t(), "out must be contiguous"),
    (lambda s: "out", "out must be bf16"),
])
def test_out_is_validated(cpu_lib, out: Any, match: str) -> None:
    mk = _cpu_mk()
    x = _x(3)
    with pytest.raises(ValueError, match=match):
        mk.forward(x, out=out(3))
    idx = _picks(3)
    with pytest.raises(ValueError, match=match):
        mk.forward_routed(x, idx, torch.ones(3, TINY.topk), out=out(3))


def test_out_must_not_alias_x(cpu_lib) -> None:
    mk = _cpu_mk()
    x = _x(3)
    with pytest.raises(ValueError, match="out must not share storage with x"):
        mk.forward(x, out=x)
    with pytest.raises(TypeError, match="config must be a MegakernelConfig"):
        _cpu_mk(config="bm=16")


# -- 10: a given buffer must agree ----------------------------------------------------------------------------------
def test_buffer_must_agree_with_the_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = EPBuffer(None, Knobs(), model=TINY, max_tokens=16, device="cpu", dtype=BF)
    # cuda:0 as a device this process could use (the layer checks that first), so the disagreement is what is refused
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    MoELayer(TINY, max_tokens=16, buffer=buf, device="cpu", dtype=BF, engine="unfused")  # agrees
    other = ModelShape(name="other", hidden=128, intermediate=64, experts=8, topk=2)
    for kw, match in ((dict(model=other), "model"), (dict(max_tokens=8), "max_tokens 8 vs the buffer's 16"),
                      (dict(dtype=torch.float32), "dtype"), (dict(device="cuda:0"), "device cuda:0"),
                      (dict(options={"megakernel_timeout_s": 5.0}), "options")):
        args = {"model": TINY, "max_tokens": 16, **kw}
        with pytest.raises(ValueError, match=f"buffer disagrees.*{match}"):
            MoELayer(args.pop("model"), buffer=buf, engine="unfused", **args)


# -- 11: megakernel_timeout_s ---------------------------------------------------------------------------------------
def test_megakernel_timeout_has_one_range() -> None:
    assert MegakernelConfig.from_knobs(Knobs(), RuntimeOptions(megakernel_timeout_s=3600)).timeout_ms == 3.6e6
    for bad in (3601.0, 0.0, 1e-9, float("nan")):
        with pytest.raises(RuntimeOptionError, match="megakernel_timeout_s"):
            RuntimeOptions(megakernel_timeout_s=bad)
    with pytest.raises(RuntimeOptionError, match="MOETUNE_MK_TIMEOUT_S"):
        RuntimeOptions.from_env({"MOETUNE_MK_TIMEOUT_S": "7200"})


# -- 12: argument types ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "match"), [
    (dict(model="qwen3-30b"), r"model must be a ModelShape, got str; for a model name use .*get_model\('qwen3-30b'\)"),
    (dict(knobs={"engine": "unfused"}), r"knobs must be a Knobs or None, got dict; build one with Knobs.from_dict"),
    (dict(options="megakernel_timeout_s=5"), "options must be a RuntimeOptions"),
    (dict(dtype="bfloat16"), "dtype must be a torch.dtype"),
    (dict(device=0.5), "device must be"),
    (dict(seed="1"), "seed must be an int"),
    (dict(buffer="buf"), "buffer must be an EPBuffer"),
])
def test_wrong_argument_types_name_the_argument(kw: dict, match: str) -> None:
    args = {"model": TINY, "knobs": Knobs(), "max_tokens": 8, **kw}
    with pytest.raises(TypeError, match=match):
        MoELayer(args.pop("model"), None, args.pop("knobs"), **args)


@pytest.mark.parametrize("seed", [2**45, 2**60, -(2**44)])
def test_a_seed_out_of_the_generators_range_is_named(seed: int) -> None:
    """A seed out of the generator's range is refused naming the argument and the range (dense_reference's too),
    not left to manual_seed's "Overflow when unpacking long long", which names no argument."""
    from moetune.runtime.weights import SEED_MAX, SEED_MIN

    with pytest.raises(ValueError, match=r"MoELayer: seed must be in \[-9223344366804, 18446688733626\]"):
        MoELayer(TINY, None, Knobs(), max_tokens=8, device="cpu", seed=seed)
    with pytest.raises(ValueError, match="seed must be in"):
        dense_reference(torch.zeros(1, TINY.hidden), TINY, seed=seed)
    for ok in (SEED_MIN, SEED_MAX, 1_733_400_000_000):  # the ends, and a millisecond timestamp, build
        MoELayer(TINY, None, Knobs(), max_tokens=8, device="cpu", seed=ok)



def test_the_weights_of_any_expert_build_at_the_seed_range_ends() -> None:
    """The last expert of a model of 3M experts at SEED_MAX (its generator seed past 2**64) builds, and negative seeds
    give the streams they gave before (the generator seed taken modulo 2**64, as manual_seed reads a negative)."""
    from moetune.runtime.shapes import ModelShape
    from moetune.runtime.weights import SEED_MAX, SEED_MIN, expert_weights

    huge = ModelShape(name="huge", hidden=1, intermediate=1, experts=3_000_000, topk=1)
    for seed in (SEED_MIN, SEED_MAX):
        w1, w2 = expert_weights(huge, huge.experts - 1, seed=seed)
        assert w1.shape == (2, 1) and w2.shape == (1, 1)
    g = torch.Generator()
    g.manual_seed(-3 * 1_000_003 + 7 * 3 + 1)  # seed -3, expert 3, as manual_seed takes it directly
    want = torch.randn(2 * TINY.intermediate, TINY.hidden, generator=g) * TINY.hidden**-0.5
    assert torch.equal(expert_weights(TINY, 3, seed=-3)[0], want)

def test_epbuffer_options_type() -> None:
    with pytest.raises(TypeError, match="options must be"):
        EPBuffer(None, Knobs(), model=TINY, max_tokens=8, device="cpu", options="megakernel_timeout_s=5")


def test_options_reach_the_buffer() -> None:
    layer = MoELayer(TINY, None, Knobs(), max_tokens=8, device="cpu", options={"megakernel_timeout_s": 7.0})
    assert layer.buffer.options.megakernel_timeout_s == 7.0


# -- 13-14: documentation -------------------------------------------------------------------------------------------
def test_docs_say_one_thread_per_instance_and_what_is_imported() -> None:
    assert "thread" in (MoELayer.__doc__ or "") and "thread" in (mk_layer.MegakernelMoE.__doc__ or "")
    assert "no msgspec" not in (mk_layer.__doc__ or "")


# -- 15: what reaches the library (a fake one, on the CPU) ----------------------------------------------------------
class FakeLaunchLib:
    """Stands in for the library's entry points: the occupancy query answers 2 CTAs on each of 4 SMs, no launch fits
    the decode kernel, and every launch is recorded with the bytes at its x pointer (read while the launch's x is
    alive, as the kernel would) and the device guards entered at that moment."""

    def __init__(self) -> None:
        self.launches: list[dict[str, Any]] = []
        self.guards: list[torch.device] = []  # the torch.cuda.device guards entered now (innermost last)
        self.fail = ""  # an entry point that refuses its launch (returns 1; mk_last_error says why)

    def mk_occupancy(self, *args: Any) -> int:
        args[-2]._obj.value, args[-1]._obj.value = 2, 4
        return 0

    decode_rows = 0  # routed rows (S x topk) up to which a launch fits the decode kernel (0: none does)

    def mk_decode_grid(self, s: int, h: int, i: int, k: int, e: int, grid: Any, rows: Any) -> int:
        if s * k > self.decode_rows:
            return 1
        grid._obj.value, rows._obj.value = 4, -(-h // 4)
        return 0

    def _launch(self, name: str, ref: Any) -> int:
        p = ref._obj
        n = p.S * TINY.hidden * 2
        self.launches.append({"name": name, "x": p.x, "out": p.out, "wg": p.wg, "x_bytes": ctypes.string_at(p.x, n),
                              "combine_tokens": p.combine_tokens, "l2_evict_w": p.l2_evict_w, "decode": p.decode,
                              "guards": list(self.guards)})
        return int(name == self.fail)

    def mk_route(self, ref: Any, stream: Any) -> int:
        return self._launch("mk_route", ref)

    def mk_route_given(self, ref: Any, stream: Any) -> int:
        return self._launch("mk_route_given", ref)

    def mk_experts(self, ref: Any, stream: Any) -> int:
        return self._launch("mk_experts", ref)

    def mk_last_error(self) -> bytes:
        return b"fake error"


@pytest.fixture
def fake_launch(monkeypatch: pytest.MonkeyPatch) -> FakeLaunchLib:
    """MegakernelMoE builds on the CPU and its forwards reach FakeLaunchLib (torch.cuda's device guard and stream
    stand-ins: no GPU here)."""
    lib = FakeLaunchLib()
    monkeypatch.setattr(_lib, "load", lambda: lib)
    monkeypatch.setattr(mk_layer, "_device_problem", lambda device: None)

    class Guard:
        def __init__(self, device: Any) -> None:
            self.device = device

        def __enter__(self) -> None:
            lib.guards.append(self.device)

        def __exit__(self, *exc: Any) -> None:
            lib.guards.pop()

    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    return lib


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int16).numpy().tobytes()


def _misaligned(s: int, h: int = TINY.hidden) -> torch.Tensor:
    """A contiguous [s, h] bf16 view 2 bytes into a buffer: contiguous, but its data not 16-byte aligned."""
    buf = _x(s * h + 8, h=1).view(-1)
    v = buf[1:1 + s * h].view(s, h)
    assert v.is_contiguous() and v.data_ptr() % 16 == 2
    return v


@pytest.mark.parametrize("s", [1, 3])
def test_misaligned_x_reaches_the_kernels_as_an_aligned_copy(fake_launch: FakeLaunchLib, s: int) -> None:
    """A contiguous view at an odd offset is copied, as a non-contiguous x is: the kernels' 16-byte loads would read
    the wrong bytes from it (or fault at S=1)."""
    mk = _cpu_mk()
    x = _misaligned(s)
    idx = _picks(s)
    mk.forward(x)
    mk.forward_routed(x, idx, torch.full((s, TINY.topk), 0.5))
    assert [c["name"] for c in fake_launch.launches] == ["mk_route", "mk_experts", "mk_route_given", "mk_experts"]
    for c in fake_launch.launches:
        assert c["x"] % 16 == 0 and c["x_bytes"] == _bytes(x)
    aligned = _x(s)  # an aligned x goes as it is, no copy
    mk.forward(aligned)
    assert fake_launch.launches[-1]["x"] == aligned.data_ptr()


def test_misaligned_out_is_refused(fake_launch: FakeLaunchLib) -> None:
    """The caller owns out, so it is not swapped for a copy: refused, naming the requirement, before any launch."""
    mk = _cpu_mk()
    x = _x(3)
    for call in (lambda o: mk.forward(x, out=o),
                 lambda o: mk.forward_routed(x, _picks(3), torch.ones(3, TINY.topk),
                                             out=o)):
        with pytest.raises(ValueError, match=r"out must start at a 16-byte aligned address \(the kernels write it"):
            call(_misaligned(3))
    assert not fake_launch.launches
    out = torch.empty(3, TINY.hidden, dtype=BF)
    assert mk.forward(x, out=out) is out and fake_launch.launches[-1]["out"] == out.data_ptr()


def test_misaligned_weights_read_in_place_are_refused(cpu_lib) -> None:
    """k-tiled weights (tiled=True, rebind) and the gate (construction and rebind) are read in place: a misaligned one
    is refused."""
    full = _cpu_mk()
    w1, w2, g = full.w1t, full.w2t, full.gate

    def shifted(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.numel() + 8, dtype=t.dtype)[1:1 + t.numel()].view(t.shape).copy_(t)

    for name, args in (("w_gate_up", (shifted(w1), w2, g)), ("w_down", (w1, shifted(w2), g))):
        with pytest.raises(ValueError, match=f"{name} must start at a 16-byte aligned address"):
            mk_layer.MegakernelMoE(TINY, max_tokens=8, device="cpu", w_gate_up=args[0], w_down=args[1], gate=args[2],
                                   tiled=True)
        with pytest.raises(ValueError, match=f"{name} must start at a 16-byte aligned address"):
            full.rebind(*args)
    with pytest.raises(ValueError, match="gate must start at a 16-byte aligned address"):
        full.rebind(w1, w2, shifted(g))
    with pytest.raises(ValueError, match="gate must start at a 16-byte aligned address"):
        mk_layer.MegakernelMoE(TINY, max_tokens=8, device="cpu", w_gate_up=w1, w_down=w2, gate=shifted(g), tiled=True)
    # row-major weights are copied into the k-tiled layout anyway: an odd offset is fine there
    mk = mk_layer.MegakernelMoE(TINY, max_tokens=8, device="cpu", w_gate_up=shifted(full.w_gate_up),
                                w_down=shifted(full.w_down), gate=g)
    assert torch.equal(mk.w1t, w1) and mk.w1t.data_ptr() % 16 == 0


@pytest.mark.parametrize("tiled", [False, True])
def test_the_gate_given_at_construction_is_read_in_place_or_refused(fake_launch: FakeLaunchLib, tiled: bool) -> None:
    """The gate is read in place whatever `tiled`: a contiguous, aligned gate given at construction is the tensor the
    launches read, so an in-place change of it (a training step, load_state_dict into it) is seen, as after rebind.
    Before, a gate that was not contiguous (or not 16-byte aligned) was copied once here, so such a change was
    silently not seen while a contiguous gate's was; it is refused now, as rebind refuses it, naming the fix."""
    full = _cpu_mk()
    w1, w2 = (full.w1t, full.w2t) if tiled else (full.w_gate_up, full.w_down)
    gate = full.gate.clone()
    mk = mk_layer.MegakernelMoE(TINY, max_tokens=8, device="cpu", w_gate_up=w1, w_down=w2, gate=gate, tiled=tiled)
    mk.forward(_x(3))
    assert mk.gate is gate and fake_launch.launches[-1]["wg"] == gate.data_ptr()
    strided = gate.t().contiguous().t()  # the same values, column-major
    misaligned = torch.empty(gate.numel() + 8, dtype=BF)[1:1 + gate.numel()].view(gate.shape).copy_(gate)
    for bad, match in ((strided, r"gate must be contiguous \(it is read in place"),
                       (misaligned, "gate must start at a 16-byte aligned address")):
        with pytest.raises(ValueError, match=match):
            mk_layer.MegakernelMoE(TINY, max_tokens=8, device="cpu", w_gate_up=w1, w_down=w2, gate=bad, tiled=tiled)


def test_launches_run_under_the_layers_device_guard(fake_launch: FakeLaunchLib) -> None:
    """`_run` launches under the layer's device, not whichever GPU is current: the library launches on the current
    device, so a layer on another GPU than the current one would launch on the wrong one."""
    mk = _cpu_mk()
    mk.forward(_x(3))
    mk.forward_routed(_x(2), _picks(2), torch.ones(2, TINY.topk))
    assert len(fake_launch.launches) == 4
    assert all(c["guards"] and c["guards"][-1] == mk.device for c in fake_launch.launches)


def test_moe_layer_hands_a_misaligned_x_to_the_megakernel_as_an_aligned_copy(fake_launch: FakeLaunchLib,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    layer = _mk_layer(engine="megakernel")
    assert isinstance(layer.megakernel, mk_layer.MegakernelMoE)
    x = _misaligned(3)
    layer(x)
    layer.forward_routed(x, _picks(3), torch.ones(3, TINY.topk))
    assert len(fake_launch.launches) == 4
    assert all(c["x"] % 16 == 0 and c["x_bytes"] == _bytes(x) for c in fake_launch.launches)


def test_replaced_parameters_at_an_odd_offset_reach_the_megakernel_as_aligned_copies(
        fake_launch: FakeLaunchLib, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the megakernel engine copied a replaced parameter that was not contiguous, but handed one at an address
    that is not a multiple of 16 bytes (a view into a flat checkpoint buffer loaded with assign=True) to
    MegakernelMoE.rebind as it was, which refuses it: the load raised, and every later forward too, where the
    unfused engine runs the same checkpoint. Now such a parameter is copied as a non-contiguous one is."""
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    layer = _mk_layer(engine="megakernel")
    sd = {k: v.clone() for k, v in layer.state_dict().items()}

    def shifted(t: torch.Tensor) -> torch.Tensor:
        v = torch.empty(t.numel() + 8, dtype=t.dtype)[1:1 + t.numel()].view(t.shape).copy_(t)
        assert v.is_contiguous() and v.data_ptr() % 16
        return v

    layer.load_state_dict({**sd, "gate": shifted(sd["gate"])}, assign=True)
    layer.w_down = torch.nn.Parameter(shifted(layer.w_down.detach()), requires_grad=False)
    layer(_x(3))  # the replaced w_down is handed over here
    mk = layer.megakernel
    for name, held in (("gate", mk.gate), ("w_down", mk.w2t)):
        p = getattr(layer, name)
        assert p.data_ptr() % 16 == 0 and held.data_ptr() == p.data_ptr(), name
    assert torch.equal(layer.gate, sd["gate"]) and torch.equal(layer.state_dict()["w_down"], sd["w_down"])
    assert len(fake_launch.launches) == 2


def _bench_tool(monkeypatch: pytest.MonkeyPatch) -> Any:
    """bench/tools/megakernel_profile.py (phase_times) as a module, with CUDA events and synchronize stood in for (no GPU
    here)."""
    import importlib.util
    from pathlib import Path

    class Event:
        def __init__(self, **_: Any) -> None:
            pass

        def record(self) -> None:
            pass

        def elapsed_time(self, other: Any) -> float:
            return 0.001

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    path = Path(__file__).resolve().parents[1] / "bench" / "tools" / "megakernel_profile.py"
    spec = importlib.util.spec_from_file_location("_mk_bench", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_bench_phase_times_sets_each_launchs_fields_and_checks_return_codes(fake_launch: FakeLaunchLib,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """phase_times sets combine_tokens / l2_evict_w itself rather than rely on the cached template, which only a
    forward fills (megakernel_profile's route_splits clears the templates first, so every launch would be refused
    with "combine_tokens must be >= 1"), and checks the return codes, so no numbers are printed for launches that
    never ran."""
    bench = _bench_tool(monkeypatch)
    mk = _cpu_mk()
    x = _x(3)
    mk.forward(x)
    want = fake_launch.launches[-1]
    fake_launch.launches.clear()
    mk._params.clear()  # as route_splits does: fresh templates, no forward since
    assert set(bench.phase_times(mk, [x], 1, 2)) == {"mk_route_us", "mk_experts_us"}
    assert [c["name"] for c in fake_launch.launches] == ["mk_route", "mk_experts"] * 3
    for c in fake_launch.launches:
        assert (c["combine_tokens"], c["l2_evict_w"], c["x"]) == (want["combine_tokens"], want["l2_evict_w"],
                                                                  x.data_ptr())
        assert c["combine_tokens"] >= 1 and c["guards"][-1] == mk.device
    for entry in ("mk_route", "mk_experts"):
        fake_launch.fail = entry
        with pytest.raises(CsrcError, match=f"{entry} failed: fake error"):
            bench.phase_times(mk, [x], 1, 2)


@pytest.mark.parametrize(("base", "bucket"), [(1, 0), (0, 1)])
def test_a_bucket_configs_decode_setting_decides_its_launches(fake_launch: FakeLaunchLib, base: int,
                                                             bucket: int) -> None:
    """decode_grid reads the bucket's config, not the layer's: otherwise a bucket profile's decode setting is
    silently ignored."""
    fake_launch.decode_rows = 16  # S <= 8 fits the decode kernel (topk 2)
    mk = _cpu_mk(config=MegakernelConfig(decode=base), max_tokens=16)
    assert mk.set_bucket_config(1, MegakernelConfig(decode=bucket)) is None

    def launched(s: int) -> list[tuple[str, int]]:
        fake_launch.launches.clear()
        mk.forward(_x(s))
        return [(c["name"], c["decode"]) for c in fake_launch.launches]

    decode, graph = [("mk_experts", 2)], [("mk_route", 0), ("mk_experts", 0)]
    for s in (1, 2):  # token bucket 1: its config
        assert launched(s) == (decode if bucket else graph)
        assert (mk.decode_grid(s) is not None) == bool(bucket)
    assert launched(4) == (decode if base else graph)  # bucket 16: none installed, the layer's config
    assert launched(12) == graph  # too many rows for the decode kernel either way


class FakeStream:
    """A CUDA stream stand-in: records the streams it was made to wait for."""

    def __init__(self, name: str) -> None:
        self.name, self.cuda_stream, self.waited = name, 0, []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other.name)


def test_a_call_on_another_stream_waits_for_the_previous_calls_stream(fake_launch: FakeLaunchLib,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward reuses the layer's scratch (logits, routing, row lists, h, y, the control and error words) on
    whatever stream is current, so a call (and a read or reset of the error record) on another stream than the
    previous call's first waits for that stream's queued work, as EPBuffer's calls do; nothing while a CUDA graph is
    captured. Without it a call on stream B races one still running on stream A on the scratch (wrong outputs, or a
    persistent kernel waiting on counters the other reset)."""
    a, b = FakeStream("a"), FakeStream("b")
    current, capturing = [a], [False]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(mk_layer, "_has_streams", lambda device: True, raising=False)
    mk = _cpu_mk()
    x = _x(3)
    mk.forward(x)
    mk.forward(x)
    assert a.waited == [] and b.waited == []  # one stream: nothing to wait for
    current[0] = b
    mk.forward_routed(x, _picks(3), torch.full((3, TINY.topk), 0.5))
    assert b.waited == ["a"]
    current[0] = a
    mk.clear_error()  # writes the error and control words the launch on b uses
    assert a.waited == ["b"]
    current[0], capturing[0] = b, True  # a capture may not wait for work outside it
    mk.forward(x)
    assert b.waited == ["a"]


def test_the_first_call_on_another_stream_waits_for_the_stream_the_layer_was_built_on(
        fake_launch: FakeLaunchLib, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the layer remembered no stream until its first call, so a first call on another stream than the one it
    was built on waited for nothing, while the kernels that zeroed its scratch there (the control, counter and error
    words its launches read first; with MoELayer also the tiling of the weights) could still be queued: the launch
    raced on them. Split-K buffers grown on a third stream (`set_bucket_config`, `resolve_buckets`) were not waited
    for either. Now the first call waits for the construction stream, and a stream that grew the buffers is ordered
    after the previous call's and before the next call's."""
    built, a, b, c = FakeStream("built"), FakeStream("a"), FakeStream("b"), FakeStream("c")
    current = [built]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(mk_layer, "_has_streams", lambda device: True, raising=False)
    mk = _cpu_mk()
    assert built.waited == []
    current[0] = a
    mk.forward(_x(3))
    assert a.waited == ["built"]
    current[0] = c
    assert mk.set_bucket_config(1, MegakernelConfig(split_k1=2)) is None and mk.sk_room[1] == 2  # grew
    assert c.waited == ["a"]  # not while a's launch may still use the scratch
    current[0] = b
    mk.forward(_x(3))
    assert b.waited == ["c"]  # nor before c's zeroing of the new buffers


def test_routing_is_read_after_the_launch_that_wrote_it(fake_launch: FakeLaunchLib,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `routing(s)` read the picks and weights on the current stream with nothing ordering it after the
    latest launch, which writes them, where that ran on another stream (as `check`, `counters` and `clear_error` are
    ordered): it could read the previous forward's routing, or half of this one's. Now it waits for that stream."""
    a, b = FakeStream("a"), FakeStream("b")
    current = [a]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(mk_layer, "_has_streams", lambda device: True, raising=False)
    mk = _cpu_mk()
    current[0] = b
    mk.forward_routed(_x(3), _picks(3), torch.full((3, TINY.topk), 0.5))
    current[0] = a
    idx, w = mk.routing(3)
    assert a.waited == ["b"]
    assert torch.equal(idx, _picks(3)) and torch.equal(w, torch.full((3, TINY.topk), 0.5))


@pytest.mark.parametrize(("s", "exc", "match"), [(9, ValueError, "s=9 is more than max_tokens=8"),
                                                 (-1, ValueError, "s must be >= 0"),
                                                 (2.0, TypeError, "s must be an int")])
def test_routing_of_more_rows_than_the_scratch_holds_is_refused(cpu_lib, s: Any, exc: type, match: str) -> None:
    """Before: routing(s) sliced the scratch's [max_tokens, K] picks with s as given: more than max_tokens handed back
    max_tokens rows (shaped unlike [S, K], some of them no forward's of these S), a negative s all but the last rows,
    a float a TypeError from the slice. Now s is checked: an int in 0..max_tokens."""
    mk = _cpu_mk(max_tokens=8)
    with pytest.raises(exc, match=match):
        mk.routing(s)
    assert [tuple(t.shape) for t in mk.routing(8)] == [(8, TINY.topk)] * 2 and mk.routing(0)[0].shape == (0, TINY.topk)


def test_the_timelines_check_x_before_they_look_up_its_launch(fake_launch: FakeLaunchLib) -> None:
    """Before: task_timeline and decode_timeline took x.shape[0] and looked up that S's launch before any check of x:
    an x that is no tensor raised AttributeError, and decode_timeline of more tokens than max_tokens said the S "does
    not run the decode kernel" (or, on the GPU, the occupancy query of a launch shape the layer never checked could
    refuse first). Now x is checked first, as forward checks it: ValueError naming x or max_tokens."""
    mk = _cpu_mk(max_tokens=2)
    for timeline in (mk.task_timeline, mk.decode_timeline):
        with pytest.raises(ValueError, match=r"x must be bf16 \[S, 128\]"):
            timeline([[1.0] * TINY.hidden])
        with pytest.raises(ValueError, match="x has 3 tokens, more than max_tokens=2"):
            timeline(_x(3))
    assert not fake_launch.launches


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_growing_the_split_buffers_keeps_the_old_ones_whole_when_an_allocation_fails(
        cpu_lib, monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    """`_reserve_split` allocates all the new queue and split-K buffers before the layer takes any of them (with the
    new capacity): a failed allocation (out of memory) leaves the layer as it was. Setting the larger capacity first
    and allocating one by one would leave it with the old, smaller queue (or some buffers new and some old), and the
    next launch template would tell the kernels to use more queue slots than the queue holds."""
    mk = _cpu_mk()
    before = (mk.q_cap, mk.sk_room, mk.q_task, mk.q_flag, mk.sk_part, mk.sk_cnt)
    zeros, calls = torch.zeros, [0]

    def failing_zeros(*a: Any, **kw: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == fail_at:
            raise torch.cuda.OutOfMemoryError("stand-in: out of memory")
        return zeros(*a, **kw)

    monkeypatch.setattr(torch, "zeros", failing_zeros)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        mk._reserve_split(MegakernelConfig(split_k1=2))
    monkeypatch.setattr(torch, "zeros", zeros)
    after = (mk.q_cap, mk.sk_room, mk.q_task, mk.q_flag, mk.sk_part, mk.sk_cnt)
    assert after[:2] == before[:2] and all(a is b for a, b in zip(after[2:], before[2:], strict=True))
    assert mk.q_task.numel() >= mk.q_cap and mk.q_flag.numel() >= mk.q_cap
    mk._reserve_split(MegakernelConfig(split_k1=2))  # the retry grows them
    assert mk.sk_room[1] == 2 and mk.q_task.numel() == mk.q_flag.numel() == mk.q_cap > before[0]


@pytest.mark.parametrize("bad", [-1, TINY.experts, TINY.experts + 3])
def test_weights_of_an_expert_the_model_does_not_have_are_refused(bad: int) -> None:
    """`expert_weights` refuses an id out of the model's range, naming it and the range, although its generator seed
    is defined for every integer: otherwise `dense_reference` given such routing computes a 'reference' through
    experts the model does not have, where the layer refuses the same routing."""
    from moetune.runtime.weights import expert_weights

    with pytest.raises(ValueError, match=rf"expert {bad} .*\[0, {TINY.experts}\)"):
        expert_weights(TINY, bad)
    idx = _picks(3)
    idx[1, 0] = bad
    with pytest.raises(ValueError, match=rf"expert {bad} "):
        dense_reference(_x(3), TINY, topk_idx=idx, topk_weights=torch.full((3, TINY.topk), 0.5))
    assert expert_weights(TINY, TINY.experts - 1)[0].shape == (2 * TINY.intermediate, TINY.hidden)


def test_a_close_its_buffer_refused_can_be_called_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """MoELayer.close() marks the layer closed only once its buffer is. Where the buffer refuses (another thread
    inside a call of it: EPBuffer.close raises RuntimeError), a layer marked closed first would keep its buffer open
    and the retry after that call returns would do nothing, leaving the buffer's transport (its proxy thread, its
    memory) to the garbage collector."""
    layer = _unfused()
    buf = layer.buffer
    real, calls = EPBuffer.close, []

    def close(self: EPBuffer) -> None:
        calls.append(self)
        if len(calls) == 1:
            raise RuntimeError("EPBuffer.close: another thread is inside a call of this buffer")
        real(self)

    monkeypatch.setattr(EPBuffer, "close", close)
    with pytest.raises(RuntimeError, match="another thread"):
        layer.close()
    assert layer(_x(2)).shape == (2, TINY.hidden)  # still open: the other thread's call goes on
    layer.close()
    assert calls == [buf, buf] and buf._closed
    with pytest.raises(RuntimeError, match="MoELayer: closed"):
        layer(_x(2))
    layer.close()  # a third call does nothing
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_ids_of_the_wider_unsigned_dtypes_are_checked_not_crashed_on(cpu_lib, monkeypatch: pytest.MonkeyPatch,
                                                                     dtype: torch.dtype) -> None:
    """topk_idx of uint16 / uint32 / uint64 is range-checked as int64 ids (torch has no range kernels for them): in
    MoELayer.forward_routed at world 1 and MegakernelMoE.forward_routed (check_ids=True) in-range ids run as int64
    ids do, out-of-range ones are the usual ValueError naming topk_idx."""
    from moetune.runtime.routing import expert_ids_problem

    picks = torch.tensor([[0, 1], [3, 2], [1, 0]])
    assert expert_ids_problem(picks.to(dtype), TINY.experts, distinct=True) is None
    bad = picks.clone()
    bad[1, 0] = TINY.experts + 2
    assert "out of range" in str(expert_ids_problem(bad.to(dtype), TINY.experts))
    assert "picks expert 1 more than once" in str(expert_ids_problem(torch.tensor([[1, 1]]).to(dtype), 4,
                                                                     distinct=True))
    layer = _unfused()
    x, w = _x(3), torch.full((3, TINY.topk), 0.5)
    assert torch.equal(layer.forward_routed(x, picks.to(dtype), w), layer.forward_routed(x, picks, w))
    with pytest.raises(ValueError, match="topk_idx holds expert ids out of range"):
        layer.forward_routed(x, bad.to(dtype), w)
    mk = _cpu_mk()
    seen: list[list[list[int]]] = []
    monkeypatch.setattr(mk, "_run", lambda x, s, out, given: seen.append(mk.topk_idx[:s].tolist()) or x)
    mk.forward_routed(x, picks.to(dtype), w)
    assert seen == [picks.tolist()]
    with pytest.raises(ValueError, match="megakernel: topk_idx holds expert ids out of range"):
        mk.forward_routed(x, bad.to(dtype), w)


def test_an_out_of_memory_probe_is_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """grouped_mm_usable caches its answer per (device, dtype, shape), but an out-of-memory probe answers False for
    that call only and the next layer probes again: cached like a torch without the op, it would silently send every
    later layer of that shape in the process to the per-expert loop (host syncs, not capturable in a CUDA graph)."""
    if not grouped_mm_usable("cpu", None, BF, TINY.hidden, TINY.intermediate):
        pytest.skip("torch._grouped_mm does not run here")
    randn = torch.randn

    def oom(*a: Any, **kw: Any) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("stand-in: out of memory")

    shape = (TINY.hidden, 3 * 64)  # a shape no other test probes: not cached yet
    monkeypatch.setattr(torch, "randn", oom)
    assert grouped_mm_usable("cpu", None, BF, *shape) is False
    monkeypatch.setattr(torch, "randn", randn)
    assert grouped_mm_usable("cpu", None, BF, *shape) is True


@pytest.mark.parametrize(("out", "ref"), [((1, 4), (3, 4)), ((3, 1), (3, 4)), ((4,), (3, 4)), ((2, 4), (0, 4))])
def test_an_output_of_another_shape_is_as_wrong_as_can_be(out: tuple[int, ...], ref: tuple[int, ...]) -> None:
    """max_rel_err of an output of another shape is inf (as tuner/measure/moe.py's wrapper says for the layer's own
    check). Broadcasting out against ref would measure 0.0 for an output of one row (or one column) equal to the
    reference's first, and for any output against an empty reference: a layer or transport returning the wrong shape
    would pass the correctness checks of the EP benchmark."""
    from moetune.runtime.moe_layer import max_rel_err

    assert max_rel_err(torch.ones(out), torch.ones(ref)) == float("inf")
    assert max_rel_err(torch.ones(ref), torch.ones(ref)) == 0.0


@pytest.mark.parametrize(("device", "exc", "match"), [(1.5, TypeError, "megakernel: device must be a torch.device"),
                                                      (0, TypeError, "megakernel: device must be a torch.device"),
                                                      ("gpu", ValueError, "megakernel: device='gpu': "),
                                                      ("cuda:x", ValueError, "megakernel: device='cuda:x': ")])
def test_megakernel_names_a_device_argument_it_cannot_take(device: Any, exc: type, match: str) -> None:
    """Before: MegakernelMoE handed `device` straight to torch.device, so a wrong one raised torch's own TypeError or
    RuntimeError naming no argument (or, for an int, was taken where MoELayer and EPBuffer refuse it). Now it is
    checked as theirs is (runtime/_args.py): TypeError / ValueError naming the argument."""
    with pytest.raises(exc, match=re.escape(match)):
        mk_layer.MegakernelMoE(TINY, max_tokens=8, device=device)


@pytest.mark.parametrize("model", ["qwen3-30b", None, {"hidden": 128}])
def test_megakernel_names_a_model_that_is_no_shape(cpu_lib, model: Any) -> None:
    """MegakernelMoE names the argument when given a model name (or anything without the shape's fields), as
    EPBuffer and MoELayer do, rather than fail with AttributeError ('str' object has no attribute 'hidden') from
    inside the config's resolve; it still takes anything with hidden, intermediate, experts and topk."""
    with pytest.raises(TypeError, match=r"megakernel: model must be a ModelShape"):
        mk_layer.MegakernelMoE(model, max_tokens=8, device="cpu")
    shape = types.SimpleNamespace(**{f: getattr(TINY, f) for f in ("hidden", "intermediate", "experts", "topk")})
    assert mk_layer.MegakernelMoE(shape, max_tokens=8, device="cpu", w_gate_up=_cpu_mk().w_gate_up,
                                  w_down=_cpu_mk().w_down, gate=_cpu_mk().gate).max_tokens == 8


@pytest.mark.parametrize(("field", "value", "exc"), [("hidden", 0, ValueError), ("hidden", -128, ValueError),
                                                     ("intermediate", 0, ValueError), ("hidden", 128.0, TypeError),
                                                     ("topk", 2.0, TypeError), ("experts", True, TypeError)])
def test_megakernel_names_a_shape_field_that_is_no_positive_int(cpu_lib, field: str, value: Any, exc: type) -> None:
    """A model taken by its fields whose hidden or intermediate is 0 or negative passed the library's limits (0 and
    -128 are multiples of 128) and failed deep in the weight generator (ZeroDivisionError, a negative dimension); a
    float field in torch.zeros or randn. Named now, as ModelShape names its own."""
    fields = {f: getattr(TINY, f) for f in ("hidden", "intermediate", "experts", "topk")}
    shape = types.SimpleNamespace(**{**fields, field: value})
    with pytest.raises(exc, match=rf"megakernel: model.{field} must be (an int )?>= 1, got"):
        mk_layer.MegakernelMoE(shape, max_tokens=8, device="cpu")


def test_close_lets_the_megakernels_scratch_go(fake_launch: FakeLaunchLib, monkeypatch: pytest.MonkeyPatch) -> None:
    """MoELayer.close() lets its MegakernelMoE go (nothing in the layer refers to it after): its scratch (gate logits,
    routing lists, h, y, queue, error words: a few hundred MB per layer at max_tokens=4096) must not live as long as
    the closed layer. A forward still raises the "closed" error, and the layer's state_dict still speaks row-major
    (its parameters stay k-tiled)."""
    import gc
    import weakref

    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    layer = _mk_layer(engine="megakernel")
    assert isinstance(layer.megakernel, mk_layer.MegakernelMoE)
    x = _x(3)
    layer(x)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    mk = weakref.ref(layer.megakernel)
    layer.close()
    gc.collect()
    assert mk() is None and layer.megakernel is None
    assert layer.engine == "megakernel" and layer.weights_tiled  # what ran, and the parameters' layout, still show
    for call in (lambda: layer(x), lambda: layer.forward_routed(x, _picks(3), torch.ones(3, TINY.topk)), layer.check,
                 layer.resolve_buckets):
        with pytest.raises(RuntimeError, match="MoELayer: closed"):
            call()
    after = layer.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    layer.load_state_dict(before)  # the parameters take it k-tiled; nothing to hand to a megakernel any more
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    layer.close()  # a second call does nothing


def test_close_keeps_the_scratch_from_reuse_under_a_launch_on_another_stream(
        fake_launch: FakeLaunchLib, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() drops the MegakernelMoE: its scratch goes back to the allocator's pool of the stream it was allocated
    on. The latest launch may have run on another stream (calls on any stream are ordered by `_order_streams`) and
    still be running: without the scratch marked as used by that stream (record_stream), the allocation stream's
    next tensors could take its memory under it."""
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    b = FakeStream("b")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: b)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(mk_layer, "_has_streams", lambda device: True, raising=False)
    recorded: list[tuple[int, str]] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append((id(t), s.name)), raising=False)
    layer = _mk_layer(engine="megakernel")
    layer(_x(3))  # launched on stream b
    mk = layer.megakernel
    scratch = {id(t): name for name, t in (("h", mk.h), ("y", mk.y), ("err", mk.err), ("q_task", mk.q_task))}
    layer.close()
    assert {scratch[i] for i, s in recorded if i in scratch and s == "b"} == set(scratch.values()), recorded


@pytest.mark.parametrize(("x", "idx", "w", "match"), [
    (_x(3), _picks(3)[:, :1], torch.full((3, TINY.topk), 0.5), r"topk_idx must have shape \[S, topk\] = \[3, 2\]"),
    (_x(3), _picks(3), torch.full((2, TINY.topk), 0.5), r"topk_weights must have shape \[S, topk\] = \[3, 2\]"),
    (_x(3), _picks(3).float(), torch.full((3, TINY.topk), 0.5), "topk_idx must be an integer tensor"),
    (_x(3, h=100), None, None, r"x must be a \[S, 128\] tensor, got \(3, 100\)"),
    (_x(3)[0], None, None, r"x must be a \[S, 128\] tensor, got \(128,\)"),
])
def test_dense_reference_names_inputs_of_the_wrong_shape(x: torch.Tensor, idx: Any, w: Any, match: str) -> None:
    """dense_reference checks x and given routing as the layer does: routing of another width than the model's topk
    was taken without a word (ids [S, 1] with weights [S, 2]: a 'reference' of one expert per token), weights of fewer
    rows failed on an IndexError in its loop and an x of another width on a matmul's shapes."""
    with pytest.raises(ValueError, match=rf"dense_reference: {match}"):
        dense_reference(x, TINY, topk_idx=idx, topk_weights=w)


# -- autograd: the layers are forward-only ------------------------------------------------------------------------
def test_inputs_that_want_a_gradient_are_refused(fake_mk) -> None:
    """The layer has no backward. Called in grad mode with an x or topk_weights that requires grad, its output came
    back detached (requires_grad False): a training step's backward then raised far from here ("does not require
    grad") or, with other paths into the loss, ran on without this layer's share of the gradient. Named at the call
    now; under no_grad / inference_mode (an autograd.Function's forward included) or with detached inputs it runs."""
    idx, w = _picks(3), torch.full((3, TINY.topk), 0.5)
    for layer in (_unfused(), _mk_layer()):
        x = _x(3).requires_grad_()
        with pytest.raises(ValueError, match=r"MoELayer: x requires grad, but MoELayer is forward-only"):
            layer(x)
        with pytest.raises(ValueError, match=r"MoELayer: x and topk_weights require grad"):
            layer.forward_routed(x, idx, w.clone().requires_grad_())
        with pytest.raises(ValueError, match=r"MoELayer: topk_weights requires grad"):
            layer.forward_routed(x.detach(), idx, w.clone().requires_grad_())
        with torch.no_grad():
            assert layer(x).shape == x.shape
        with torch.inference_mode():
            assert layer.forward_routed(x, idx, w).shape == x.shape
        assert layer(x.detach()).shape == x.shape


def test_megakernel_moe_refuses_inputs_that_want_a_gradient(fake_launch: FakeLaunchLib) -> None:
    """MegakernelMoE alike, before anything is copied into its scratch or launched."""
    mk = _cpu_mk()
    x = _x(3).requires_grad_()
    idx, w = _picks(3), torch.full((3, TINY.topk), 0.5)
    with pytest.raises(ValueError, match=r"megakernel: x requires grad, but MegakernelMoE is forward-only"):
        mk.forward(x)
    with pytest.raises(ValueError, match=r"megakernel: topk_weights requires grad"):
        mk.forward_routed(x.detach(), idx, w.requires_grad_())
    assert fake_launch.launches == []
    with torch.no_grad():
        mk.forward(x)
    assert [launch["name"] for launch in fake_launch.launches] == ["mk_route", "mk_experts"]


# -- layouts: dense (strided) tensors only --------------------------------------------------------------------------
def _sparse_cases() -> list[tuple[str, Any]]:
    return [("coo", lambda t: t.to_sparse()), ("csr", lambda t: t.float().to_sparse_csr().to(t.dtype))]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize(("layout", "make"), _sparse_cases())
def test_a_sparse_input_is_named_not_failed_on_deep_inside(fake_mk, fake_launch: FakeLaunchLib, layout: str,
                                                            make: Any) -> None:
    """x, topk_idx or topk_weights in a sparse layout failed deep inside (index_select, aminmax, reshape or copy_
    "not implemented" for the sparse backend, in the layer, the EP buffer and the megakernel alike): named now."""
    idx, w = _picks(3), torch.full((3, TINY.topk), 0.5)
    x = _x(3)
    buf = EPBuffer(None, Knobs(), model=TINY, max_tokens=8, device="cpu", dtype=BF)
    calls = []
    for layer in (_unfused(), _mk_layer()):
        calls += [(layer, (make(x),), "x"), (layer.forward_routed, (x, make(idx), w), "topk_idx"),
                  (layer.forward_routed, (x, idx, make(w)), "topk_weights")]
    mk = _cpu_mk()
    calls += [(mk.forward, (make(x),), "x"), (mk.forward_routed, (x, idx, make(w)), "topk_weights"),
              (buf.dispatch, (make(x), idx, w), "x"), (buf.dispatch, (x, make(idx), w), "topk_idx"),
              (dense_reference, (make(x), TINY), "x")]
    for f, args, name in calls:
        with pytest.raises(ValueError, match=rf"{name} must be a dense \(strided\) tensor, got layout torch.sparse"):
            f(*args)
    assert fake_launch.launches == []


# -- use_grouped_mm=True where the grouped GEMM does not run --------------------------------------------------------
def test_grouped_mm_forced_where_it_does_not_run_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """use_grouped_mm=True was taken as given: where torch._grouped_mm does not run for the layer's device and dtype
    (no such op in this torch, fp32 on a GPU whose kernel takes bf16 only), the first forward failed deep inside
    local_forward / experts. The probe None runs is asked now, and a no is a ValueError naming the argument at
    construction (tests/test_runtime_gpu.py asks a real GPU in fp32)."""
    from moetune.runtime import moe_layer

    monkeypatch.setattr(moe_layer, "_grouped_mm_probe", lambda *a: False)
    with pytest.raises(ValueError, match=r"MoELayer: use_grouped_mm=True, but torch._grouped_mm does not run .*"
                                         r"torch.bfloat16 on cpu"):
        _unfused(use_grouped_mm=True)
    assert not _unfused().use_grouped_mm and not _unfused(use_grouped_mm=False).use_grouped_mm


def test_grouped_mm_forced_is_kept_when_the_probe_runs_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """An out-of-memory probe says nothing of the op (grouped_mm_usable answers False for that call only): with
    use_grouped_mm=True it was read as "does not run in this torch build" and the layer refused, where before the
    probe was asked the caller's True was taken (a GPU near full when the first layer is built: the probe's operands
    are 3 x 2I x H: about 0.7 GB at its peak in fp32 for H 7168, I 2048). The caller's word stands where the probe cannot tell."""
    from moetune.runtime import moe_layer

    def oom(*a: Any) -> bool:
        raise torch.cuda.OutOfMemoryError("stand-in: out of memory")

    monkeypatch.setattr(moe_layer, "_grouped_mm_probe", oom)
    assert _unfused(use_grouped_mm=True).use_grouped_mm is True
    assert _unfused().use_grouped_mm is False  # None: the loop, as before (and the next layer probes again)


def test_parameters_that_want_a_gradient_are_refused(fake_mk) -> None:
    """`layer.requires_grad_()` (or a training loop setting requires_grad on w_gate_up, w_down, gate) in grad mode:
    the output came back detached, the parameters' gradient silently None. Named at the call now; grad mode off or
    the parameters back to requires_grad=False runs."""
    idx, w = _picks(3), torch.full((3, TINY.topk), 0.5)
    for layer in (_unfused(), _mk_layer()):
        x = _x(3)
        layer.requires_grad_()
        with pytest.raises(ValueError, match=r"MoELayer: parameters w_gate_up, w_down and gate require grad, but "
                                             r"MoELayer is forward-only .*requires_grad_\(False\)"):
            layer(x)
        layer.gate.requires_grad_(False)
        with pytest.raises(ValueError, match=r"MoELayer: parameters w_gate_up and w_down require grad"):
            layer.forward_routed(x, idx, w)
        with torch.no_grad():
            assert layer(x).shape == x.shape
        with torch.inference_mode():
            assert layer.forward_routed(x, idx, w).shape == x.shape
        layer.requires_grad_(False)
        assert layer(x).shape == x.shape
