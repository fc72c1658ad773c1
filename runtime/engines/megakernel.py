"""The megakernel engine: routing + one persistent kernel (`runtime/megakernel`) on the layer's own weights.

World 1 only, on an sm_90 GPU with bf16 activations (`megakernel_problem`). Building it turns the layer's expert
parameters into the megakernel's k-tiled layout in place (no second copy of the weights; the layer's state_dict
hooks convert), and hands it the parameters' storage; a forward first hands them again where their storage
changed (`rebind`: three data pointers compared per call).

Per token bucket profiles: where the knobs come from stored profiles (not from the caller), the scratch is sized
for any bucket's tiles (`_scratch_knobs`), the construction bucket's profile is installed at build, and every
other bucket's on the first eager call of an S that falls in it (`resolve`: one lookup per bucket, none while a
CUDA graph is captured). A bucket's profile that does not fit falls back to the construction bucket's, else to
the config the scratch was sized by, with one warning; a construction bucket's profile out of range (ConfigError)
or refused by the kernel for the layer's shape gives way to the megakernel's defaults, with one warning (the engine
is not refused for it). Knobs the caller passed are not passed over: out of range, they refuse the engine, named.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moetune.runtime._capture import capturing
from moetune.runtime.engines.base import MoEEngine
from moetune.runtime.knobs import Knobs
from moetune.runtime.megakernel import engine as _mk
from moetune.runtime.megakernel.config import ALIGN, MegakernelConfig

if TYPE_CHECKING:
    from moetune.runtime.moe_layer import MoELayer
    from moetune.runtime.options import RuntimeOptions

_PARAMS = ("w_gate_up", "w_down", "gate")  # the layer's parameters the megakernel reads in place
_DEFAULT_KNOBS = Knobs(engine="megakernel")  # what a bucket whose stored profile cannot run at all runs


class MegakernelEngine(MoEEngine):
    name: ClassVar[str] = "megakernel"
    distinct_expert_ids: ClassVar[bool] = True  # its per-expert row lists hold one row per token
    tiled_weights: ClassVar[bool] = True

    def __init__(self, megakernel: Any, knobs: Knobs, *, model: Any, device: torch.device, dtype: torch.dtype,
                 options: RuntimeOptions, expected_tokens: int, ptrs: tuple[int, int, int]):
        self.megakernel = megakernel
        self.knobs = knobs  # the knob set the megakernel runs with
        # {bucket: knobs} when the knobs come from stored profiles (None with explicit knobs, which hold for every
        # S); buckets are resolved on the first eager call of each S
        self.buckets: dict[int, Knobs] | None = None
        self.model = model
        self.device = device
        self.dtype = dtype
        self.options = options
        self.expected_tokens = expected_tokens  # the construction bucket's token count
        self._seen: set[int] = set()  # token counts whose bucket is resolved (the hot path's one set lookup)
        self._base: MegakernelConfig | None = None  # the construction bucket's config once it runs (others' fallback)
        self._ptrs = ptrs  # the parameters' data pointers the megakernel reads

    @classmethod
    def problem(cls, device: Any, dtype: Any, model: Any, world: int) -> str | None:
        if world != 1:
            return f"it runs the layer on one GPU (world 1); this group has {world} ranks"
        return _mk.megakernel_problem(device, dtype, model)

    @classmethod
    def build(cls, layer: MoELayer, knobs: Knobs, max_tokens: int, *,
              profiled: bool) -> tuple[MegakernelEngine | None, str | None]:
        """The engine for `layer` running `knobs` (with `profiled`, the construction bucket's stored profile), or why
        it cannot: a setting out of range or past the library's limits for this shape and `max_tokens` (a fallback
        or `MegakernelUnavailable` now, not an error at the first forward), or the build failing. Returns (engine,
        None) or (None, reason); the layer's expert parameters are k-tiled only when an engine is returned."""
        options = layer.buffer.options
        config: Any = None
        base: MegakernelConfig | None = None
        why: str | None
        try:
            config = MegakernelConfig.from_knobs(knobs, options)
            why = _mk.limits_problem(layer.model, max_tokens, config)
        except ValueError as e:  # ConfigError: a setting out of range
            why = f"{type(e).__name__}: {e}"
        try:
            if why is not None and profiled and knobs != _DEFAULT_KNOBS:
                # a stored profile out of range or refused by the kernel for this shape (one from before a kernel
                # upgrade) is not applied, as another bucket's is not (`install`): its bucket runs the defaults, the
                # engine stays (where the defaults are refused too, the layer's shape, max_tokens or options are:
                # the profile's reason stands). Knobs the caller passed are the caller's error: refused, named.
                default = MegakernelConfig.from_knobs(_DEFAULT_KNOBS, options)
                if _mk.limits_problem(layer.model, max_tokens, default) is None:
                    warnings.warn(f"moetune: the megakernel profile for token bucket "
                                  f"{_bucket_of(layer.expected_tokens)} is not applied ({why}); launches of that "
                                  "bucket run the megakernel's defaults", RuntimeWarning, stacklevel=4)
                    knobs, config, why = _DEFAULT_KNOBS, default, None
            if why is None and profiled:
                # scratch sized for any bucket's tiles (_scratch_knobs); the construction bucket's own config is
                # installed for its bucket below, the others on their first call
                base = config
                config = MegakernelConfig.from_knobs(_scratch_knobs(knobs), options)
                why = _mk.limits_problem(layer.model, max_tokens, config)
        except ValueError as e:  # ConfigError of the defaults (the profile's reason stands) or of the scratch's config
            why = why or f"{type(e).__name__}: {e}"
        if why is not None:
            return None, why
        from moetune.runtime.megakernel.weights import tile_, untile_

        # the megakernel reads the expert weights k-tiled: the layer's parameters become that layout in place (no
        # second copy of the weights); state_dict / load_state_dict convert (the layer's hooks)
        tile_(layer.w_gate_up.data)
        tile_(layer.w_down.data)
        try:
            mk = _mk.build_megakernel(
                layer.model, max_tokens=max_tokens, device=layer.device, seed=layer.seed, config=config,
                w_gate_up=layer.w_gate_up.data, w_down=layer.w_down.data, gate=layer.gate.data, tiled=True)
            ptrs = _param_ptrs(layer)
        except (RuntimeError, ValueError, OSError) as e:  # build/load errors, a setting that does not fit
            why = f"{type(e).__name__}: {e}"
            untile_(layer.w_gate_up.data)  # the unfused engine reads them row-major
            untile_(layer.w_down.data)
            return None, why
        engine = cls(mk, knobs, model=layer.model, device=layer.device, dtype=layer.dtype, options=options,
                     expected_tokens=layer.expected_tokens, ptrs=ptrs)
        if profiled:
            engine.buckets = {}
            # the construction profile is the other buckets' fallback only once it runs; until then (or if it
            # cannot) what runs is the config the scratch was sized by
            engine.knobs = _scratch_knobs(knobs)
            if engine.install(_bucket_of(engine.expected_tokens), knobs):
                engine._base, engine.knobs = base, knobs
        return engine, None

    # -- a call ------------------------------------------------------------------------------------------------
    def forward(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        self.rebind(layer)
        if self.buckets is not None:
            self.resolve(x.shape[0])
        return self.megakernel.forward(x)

    def forward_routed(self, layer: MoELayer, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
        self.rebind(layer)
        if self.buckets is not None:
            self.resolve(x.shape[0])
        return self.megakernel.forward_routed(x, topk_idx, topk_weights, check_ids=False)  # the layer checked them

    def rebind(self, layer: MoELayer) -> None:
        """Hand the megakernel `layer`'s parameters again where their storage changed since it was given them
        (`load_state_dict(assign=True)`, `.to()`, `.float()`, a parameter assigned anew): three data pointers
        compared per call, so a stale pointer is never launched."""
        if self.megakernel is None or _param_ptrs(layer) == self._ptrs:  # closed: nothing reads them any more
            return
        mk = self.megakernel
        for name in _PARAMS:
            t = getattr(layer, name)
            if t.dtype != torch.bfloat16 or t.device != mk.device:
                raise ValueError(f"MoELayer: the megakernel engine runs bfloat16 weights on {mk.device}, but {name} "
                                 f"is now {t.dtype} on {t.device} (after .to(), .float(), .half() or "
                                 f"load_state_dict(assign=True)?); build a new layer with the dtype and device wanted "
                                 f"(engine='unfused' for other dtypes)")
            # the kernels read the storage in place with 16-byte loads; the layer owns its parameters: a copy where
            # they are not contiguous, or start at an address that is not a multiple of 16 bytes (a view into a flat
            # checkpoint buffer), which MegakernelMoE.rebind refuses
            if not t.is_contiguous() or t.data_ptr() % ALIGN:
                t.data = t.data.clone(memory_format=torch.contiguous_format)
        mk.rebind(layer.w_gate_up.data, layer.w_down.data, layer.gate.data)
        self._ptrs = _param_ptrs(layer)

    def close(self) -> None:
        # the MegakernelMoE holds the scratch (gate logits, routing lists, h, y, queue, error words: hundreds of MB
        # at max_tokens=4096); this was its one reference, so it is freed once collected: not reused by the allocator
        # before the latest launch (on another stream than the scratch's, maybe) completed (let_go)
        if self.megakernel is not None:
            self.megakernel.let_go()
        self.megakernel = None

    def check(self) -> None:
        self.megakernel.check()

    def clear_error(self) -> None:
        self.megakernel.clear_error()

    # -- the per token bucket profiles -------------------------------------------------------------------------
    def install(self, bucket: int, knobs: Knobs) -> bool:
        """Run S of `bucket` with `knobs`' tiles, or (where they do not fit the scratch, or cannot launch) with the
        construction bucket's, else with the config the scratch was sized by, warning once. Returns whether `knobs`
        were installed; `buckets[bucket]` records the knobs that run."""
        why: str | None
        try:
            why = self.megakernel.set_bucket_config(bucket, MegakernelConfig.from_knobs(knobs, self.options))
        except ValueError as e:  # ConfigError: a stored setting out of range
            why = f"{type(e).__name__}: {e}"
        assert self.buckets is not None and self.knobs is not None
        if why is None:
            self.buckets[bucket] = knobs
            return True
        # nothing installed where the fallback fails too: the bucket's launches run LaunchConfigs.base
        if self._base is not None and self.megakernel.set_bucket_config(bucket, self._base) is None:
            ran, what = self.knobs, f"the construction profile (bucket {_bucket_of(self.expected_tokens)})"
        else:
            ran, what = _scratch_knobs(self.knobs), "the config the scratch buffers were sized by"
        # once per layer and bucket: a bucket is installed once (resolve skips resolved ones)
        warnings.warn(f"moetune: the megakernel profile for token bucket {bucket} is not applied ({why}); launches of "
                      f"that bucket run {what}", RuntimeWarning, stacklevel=3)
        self.buckets[bucket] = ran
        return False

    def resolve(self, tokens: int) -> None:
        """Resolve the token bucket of `tokens`' megakernel profile on its first eager call (one lookup per bucket,
        cached). While a CUDA graph is captured nothing is looked up (no I/O in a capture): the launch runs the
        scratch's base config (auto tiles) and the bucket is resolved at its next eager call;
        `MoELayer.resolve_buckets()` before capturing avoids that."""
        if tokens in self._seen or tokens < 1:
            return
        assert self.buckets is not None
        bucket = _bucket_of(tokens)
        if bucket not in self.buckets:
            if capturing(self.device):  # the layer's device: it need not be the current one
                return
            from moetune.runtime.profiles.autoload import autoload_profile

            res = autoload_profile(model=self.model, ep_size=1, nodes=1, max_tokens=bucket, device=self.device,
                                   transport_family=_mk.ENGINE_FAMILY, dtype=self.dtype, options=self.options)
            knobs = res.knobs if res.knobs.engine == "megakernel" else res.knobs.replace(engine="megakernel")
            self.install(bucket, knobs)
        self._seen.add(tokens)

    def resolve_buckets(self, max_tokens: int) -> dict[int, Knobs]:
        if self.buckets is None:
            return {}
        from moetune.runtime.profile_record import TOKEN_BUCKETS

        firsts = sorted({1, max_tokens} | {b for b in TOKEN_BUCKETS if b <= max_tokens})
        for s in firsts:  # every bucket an S of 1..max_tokens falls in (nearest_bucket rises with S)
            self.resolve(s)
        return dict(self.buckets)


def _param_ptrs(layer: MoELayer) -> tuple[int, int, int]:
    return layer.w_gate_up.data_ptr(), layer.w_down.data_ptr(), layer.gate.data_ptr()


def _scratch_knobs(knobs: Knobs) -> Knobs:
    """The megakernel knobs a layer with per token bucket profiles sizes its scratch by, and runs where no bucket's
    profile is installed: the m-tile chosen per launch (auto; its smallest, 16, sizes the scratch), so the settings
    that hold for one tile only are auto too (a decode profile's 12 stages cannot launch the 64-row tile, which
    csrc/megakernel/mk_moe.cu check_params caps at 9; its CTAs per SM may not fit it), and the combine tile the
    smallest auto one, or the profile's own where that is smaller (mk_combine_tokens=1), so the profile fits."""
    smallest = min(MegakernelConfig.AUTO_COMBINE)
    combine = knobs.mk_combine_tokens if knobs.mk_combine_tokens < smallest else 0
    return knobs.replace(mk_bm=0, mk_stages=0, mk_ctas_per_sm=0, mk_processor_ctas=0, mk_combine_tokens=combine)


@functools.lru_cache(maxsize=4096)
def _bucket_of(tokens: int) -> int:
    """The profile ladder's token bucket of `tokens` (TOKEN_BUCKETS, nearest on a log scale)."""
    from moetune.runtime.profile_record import nearest_bucket

    return nearest_bucket(max(1, tokens))
