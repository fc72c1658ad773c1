"""MegakernelMoE: the whole MoE layer on one GPU as routing (two small kernels) + ONE persistent kernel.

Launches with a handful of routed rows (S x topk that fit `decode_grid`; S = 1 on the Qwen3-30B shape) run the
decode kernel instead (`MegakernelConfig.decode`): ONE launch for the whole layer, routing included.

Same weights and outputs as `MoELayer` / `dense_reference` (built from `expert_weights` / `gate_weight`
with the same seed, or passed in). `forward(x)` issues three launches (decode: one) on the current stream and never
synchronises with the host, so it can be captured in a CUDA graph. Errors inside the kernel (a wait that
timed out) land in a device-side record: `check()` reads it (a host sync) and raises `MegakernelError`.

Imports torch, the standard library and a few runtime modules (never the tuner or optuna). It does not import
msgspec itself, but importing it loads the `moetune.runtime` package, whose `__init__` does (knobs, profile records).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .._args import check_device, check_flag, check_int, grad_problem, indexed_device
from ..csrc_build import CsrcError
from ..routing import expert_ids_problem, routed_inputs_problem, strided_problem
from . import _lib
from .config import (
    ALIGN,
    BN,
    ConfigError,
    LaunchConfigs,
    MegakernelConfig,
    bucket_tokens,
    limits_problem,
    split_room,
)
from .schedule import tile_end
from .weights import from_tiled, to_tiled

ERR_NAMES = {1: "scheduler timed out waiting for a task's inputs", 2: "processor timed out waiting for a queue slot",
             3: "task queue too small",
             4: "routing names an expert out of range (the row dropped, the launch aborted: none of its output rows "
                "is valid)",
             5: "a wgmma stage barrier (shared-memory pipeline) timed out",
             6: "a task timed out waiting for its inputs (publish_all)",
             7: "an expert got more than max_tokens rows: a token's given picks repeat an expert (the rows past "
                "max_tokens dropped, the launch aborted: none of its output rows is valid)",
             8: "non-finite gate logits (NaN/inf in x or the gate weights): token row `where` has a NaN or +inf "
                "logit, or only -inf ones, so its softmax is NaN (detail = its lowest expert whose logit is not "
                "finite); it still picked topk distinct experts (0..topk-1, NaN weights) and its output row is NaN; "
                "the other rows were computed (-inf logits among finite ones are no error)"}
CTL_TOTAL, CTL_ABORT, CTL_EPOCH, CTL_TILES, CTL_PUBLISHED = 1, 2, 3, 5, 4


class MegakernelError(RuntimeError):
    """The kernels reported an error (timeout, queue overflow, routing out of range, non-finite gate logits)."""


def decode_launch(model: Any, tokens: int, device: torch.device, lib: Any = None) -> tuple[int, int] | None:
    """(CTAs, output rows per CTA) of the decode kernel for `tokens` tokens of `model` on `device`, or None where
    the library says a launch of that size does not fit it (S x topk <= 64 routed rows, each CTA's rows of W_down in
    its shared memory). Such launches run the decode kernel instead of the task graph wherever `config.decode` is on
    (the default, which no knob changes): no tile knob acts on them."""
    grid, rows = ctypes.c_int(0), ctypes.c_int(0)
    lib = lib if lib is not None else _lib.load()
    with torch.cuda.device(device):
        ok = lib.mk_decode_grid(tokens, model.hidden, model.intermediate, model.topk, model.experts,
                                ctypes.byref(grid), ctypes.byref(rows)) == 0
    return (grid.value, rows.value) if ok else None


class MegakernelMoE:
    """A forward-only bf16 SwiGLU MoE layer (softmax top-k routing, renormalised) on one GPU.

    Args:
        model: anything with `hidden`, `intermediate`, `experts`, `topk` (a `ModelShape`).
        max_tokens: the largest S that `forward` takes (sizes the scratch buffers): an int >= 1.
        device: a CUDA device (None or "cuda" without an index: the current one).
        config: tile sizes, pipeline depth, CTAs, timeout (`MegakernelConfig`).
        w_gate_up [E, 2I, H], w_down [E, H, I], gate [E, H]: bf16 weights; all three built from `seed` when all are
            omitted (some given and some not is an error).
            The layer holds the expert weights k-tiled (`weights.py`): row-major ones are copied into that layout
            (the caller's tensors stay as they are); with `tiled=True` they are already k-tiled and used as they
            are (shared, not copied: what `MoELayer` does with its own parameters; `rebind` points it at new ones).
            The gate is always read in place (shared, never copied), so an in-place change of it (a training step,
            load_state_dict into it) is seen by the next launch: it must be contiguous and 16-byte aligned
            (ValueError otherwise; `gate.clone(memory_format=torch.contiguous_format)` is a copy of the layer's
            own that is both: `gate.contiguous()` returns a misaligned contiguous view itself, not a copy).

    Settings the library would refuse (experts, topk, split-K, tiles for max_tokens, pipeline depth against shared
    memory, CTAs per SM) raise ValueError / ConfigError here, not at the first forward.

    Not thread-safe: one instance must not run `forward` from two threads at once (its launch templates and scratch
    buffers are shared by every call); use one instance per thread (or a lock). Streams: a call made on another CUDA
    stream than the previous call's (the first call: than the one the layer was built on, which zeroed its scratch)
    first waits for that stream's queued work (no host wait), so switching streams serialises the calls instead of
    racing on the scratch; graph replays are ordered by the stream they run on.
    """

    _last_stream: Any = None  # the CUDA stream of the latest call that used the scratch (`_order_streams`)

    def __init__(self, model: Any, *, max_tokens: int, device: torch.device | str | None = None, seed: int = 0,
                 config: MegakernelConfig | None = None, w_gate_up: torch.Tensor | None = None,
                 w_down: torch.Tensor | None = None, gate: torch.Tensor | None = None, tiled: bool = False):
        check_int("max_tokens", max_tokens, 1, "megakernel: ")
        check_flag("tiled", tiled, "megakernel: ")  # tiled="no" would take row-major weights as k-tiled
        if any(not hasattr(model, f) for f in ("hidden", "intermediate", "experts", "topk")):
            # named here, not as an AttributeError out of the config's resolve ('str' object has no attribute ...)
            hint = f"; for a model name use moetune.runtime.get_model({model!r})" if isinstance(model, str) else ""
            raise TypeError(f"megakernel: model must be a ModelShape (anything with hidden, intermediate, experts and "
                            f"topk), got {type(model).__name__}{hint}")
        for f in ("hidden", "intermediate", "experts", "topk"):
            # as ModelShape checks its own: 0 or -128 pass the library's "multiple of 128" and fail deep in the
            # weight generator, a float in torch.zeros
            check_int(f"model.{f}", getattr(model, f), 1, "megakernel: ")
        if config is not None and not isinstance(config, MegakernelConfig):
            raise TypeError(f"megakernel: config must be a MegakernelConfig or None, got {type(config).__name__}")
        given = {"w_gate_up": w_gate_up, "w_down": w_down, "gate": gate}
        if any(v is None for v in given.values()) and any(v is not None for v in given.values()):
            # building the missing ones from `seed` would pair the caller's weights with unrelated ones
            raise ValueError(f"megakernel: pass all of w_gate_up, w_down and gate or none of them (None: built from "
                             f"seed); got {', '.join(n for n, v in given.items() if v is not None)} without "
                             f"{', '.join(n for n, v in given.items() if v is None)}")
        self.model = model
        self.config = (config or MegakernelConfig()).resolve(model.hidden, model.intermediate)  # bn auto -> 128/256
        # per token bucket configs (`set_bucket_config`); self.config sized the scratch and runs the other launches
        self.launch = LaunchConfigs(self.config)
        check_device(device, "megakernel: ")  # as MoELayer and EPBuffer: TypeError naming it, not torch's own
        try:
            dev = torch.device(device if device is not None else "cuda")
        except RuntimeError as e:  # "Invalid device string: 'cuda:x'", naming no argument
            raise ValueError(f"megakernel: device={device!r}: {e}") from None
        why = _device_problem(dev)
        if why is not None:  # now, not at the first buffer or launch with torch's "Expected a cuda device"
            raise ValueError(f"megakernel: {why}")
        self.device = _device(device)
        h, i, e, k = model.hidden, model.intermediate, model.experts, model.topk
        why = limits_problem(model, max_tokens, self.config)
        if why is not None:
            raise ValueError(f"megakernel: {why}")
        self.max_tokens = max_tokens
        if _has_streams(self.device):
            # the weights below and the scratch (zeroed: the counters and error words the first launch reads) are
            # written on this stream: a first call on another stream must wait for it like any later one
            self._last_stream = torch.cuda.current_stream(self.device)
        bf = torch.bfloat16
        if w_gate_up is None or w_down is None or gate is None:
            from ..weights import expert_weights, gate_weight  # torch + the generators only

            w1s, w2s = zip(*(expert_weights(model, x, seed=seed, device=self.device, dtype=bf) for x in range(e)),
                           strict=True)
            w_gate_up = torch.stack(w1s)
            w_down = torch.stack(w2s)
            gate = gate_weight(model, seed=seed, device=self.device, dtype=bf)
            tiled = False
        self._check_weights(w_gate_up, w_down, gate, tiled=tiled)
        # the expert weights as the kernels read them: k-tiled, shapes unchanged
        self.w1t = w_gate_up if tiled else to_tiled(w_gate_up)
        self.w2t = w_down if tiled else to_tiled(w_down)
        self.gate = gate  # read in place (_check_weights): never a copy, so changes to it are seen
        cfg = self.config
        self.lib = _lib.load()

        bm_min = cfg.bm or 16
        self.max_tiles = e + -(-max_tokens * k // bm_min)  # sum_e ceil(c_e / bm) <= S*K/bm + E
        self.max_ctiles = -(-max_tokens // cfg.combine_tile_min())
        self.n1, self.n2 = 2 * i // BN, h // BN
        dev, i32 = self.device, torch.int32
        z = torch.zeros
        # the gate GEMM splits H into up to this many partial planes (more CTAs for few tokens), capped at 64 MB
        self.logit_splits = max(1, min(16, (64 << 20) // (max_tokens * e * 4)))
        self.logits = z(self.logit_splits * max_tokens * e, dtype=torch.float32, device=dev)
        self.topk_idx = z(max_tokens, k, dtype=i32, device=dev)
        self.topk_w = z(max_tokens, k, dtype=torch.float32, device=dev)
        self.counts = z(e * _lib.COUNT_STRIDE, dtype=i32, device=dev)  # one 128-byte line per expert
        self.lists = z(e, max_tokens, dtype=i32, device=dev)
        self.h = z(max_tokens * k, i, dtype=bf, device=dev)
        self.y = z(max_tokens * k, h, dtype=bf, device=dev)
        self.ctl = z(_lib.CTL_WORDS, dtype=i32, device=dev)
        self.dec_cnt = z(_lib.DEC_CNT_WORDS, dtype=i32, device=dev)  # the decode kernel's (zero between launches)
        self.g1done = z(self.max_tiles, dtype=i32, device=dev)
        self.comb = z(self.max_ctiles, dtype=i32, device=dev)
        self.rel = z(self.max_tiles + self.max_ctiles, dtype=i32, device=dev)
        self.tile_base = z(e + 1, dtype=i32, device=dev)
        self.err = z(8, dtype=torch.int64, device=dev)
        # the task queue and decode split-K's partial buffers: sized for the base config here, grown by
        # set_bucket_config for a bucket whose split asks more (`_reserve_split`)
        self.sk_room = (-1, -1)  # (m-tiles, parts per slot) the partial buffer holds
        self._retired: list[torch.Tensor] = []  # grown-out buffers a captured CUDA graph may still launch with
        self._reserve_split(cfg)
        self.stall_tile = -1  # test hook: this m-tile's GEMM2 (decode kernel: this slot's down projection) never starts
        self._trace: torch.Tensor | None = None  # task_timeline's stamps while it runs
        self._params: dict[tuple[MegakernelConfig, int, int], _lib.MkParams] = {}
        self._grids: dict[tuple[MegakernelConfig, int, int], int] = {}
        self._decode: dict[int, tuple[int, int] | None] = {}
        if self.device.type == "cuda":
            # the occupancy query (shared memory per pipeline depth, CTAs per SM) needs the library and the GPU:
            # ask it now for every launch shape a forward can take, so a config that cannot launch fails here
            for bm, stages in sorted(self.launch_shapes()):
                try:
                    self.grid(bm, stages)
                except CsrcError as e:  # the library refused the shape (e.g. stages too deep for bm's shared memory)
                    raise ConfigError(f"megakernel config: launches of bm={bm}, stages={stages} cannot run on "
                                      f"{self.device}: {e}") from e

    def _reserve_split(self, cfg: MegakernelConfig) -> None:
        """Size the task queue and split-K's partial buffers (`sk_part`, `sk_cnt`) so launches of `cfg` fit too:
        decode split-K runs bm=16 launches of <= split_max_tiles m-tiles as split_k1 / split_k2 parts per task, each
        part in its own place of `sk_part`. Growing replaces the tensors and drops the launch templates (they hold
        the old pointers); the old tensors are kept, since a CUDA graph captured before still launches with them."""
        from .schedule import combine_blocks

        tiles, parts = split_room(cfg, self.max_tiles)
        have_t, have_p = self.sk_room
        if tiles <= have_t and parts <= have_p:
            return
        tiles, parts = max(tiles, have_t), max(parts, have_p)
        # the new buffers are zeroed on the current stream (set_bucket_config, resolve_buckets: maybe not the
        # stream of the calls): order it after the previous call's and the next call on another stream after it
        self._order_streams()
        slots = tiles * (self.n1 + self.n2)
        q_cap = max(self.max_tiles * (self.n1 + self.n2), slots * parts) + self.max_ctiles * \
            combine_blocks(self.model.hidden)
        dev = self.device
        # all four allocated before any is taken: one that fails (out of memory) leaves the layer as it was, not a
        # larger q_cap over the old queue (the kernels would index past it) or new buffers beside old ones
        q_task = torch.zeros(q_cap, dtype=torch.int64, device=dev)
        q_flag = torch.zeros(q_cap, dtype=torch.int32, device=dev)
        sk_part = torch.zeros(max(1, slots * parts * _lib.SK_PART_FLOATS), dtype=torch.float32, device=dev)
        sk_cnt = torch.zeros(max(1, slots), dtype=torch.int32, device=dev)
        if have_t >= 0:
            self._retired += [self.q_task, self.q_flag, self.sk_part, self.sk_cnt]
            self._params.clear()
        self.q_cap = q_cap
        self.q_task, self.q_flag, self.sk_part, self.sk_cnt = q_task, q_flag, sk_part, sk_cnt
        self.sk_room = (tiles, parts)

    def _check_weights(self, w_gate_up: Any, w_down: Any, gate: Any, *, tiled: bool) -> None:
        h, i, e = self.model.hidden, self.model.intermediate, self.model.experts
        for name, t, shape in (("w_gate_up", w_gate_up, (e, 2 * i, h)), ("w_down", w_down, (e, h, i)),
                               ("gate", gate, (e, h))):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"megakernel: {name} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape or t.dtype != torch.bfloat16 or t.device != self.device:
                raise ValueError(f"megakernel: {name} must be bf16 {shape} on {self.device}, got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if tiled:  # shared, not copied: the kernels read them in place
            if not (w_gate_up.is_contiguous() and w_down.is_contiguous()):
                raise ValueError("megakernel: k-tiled weights (tiled=True) must be contiguous")
            _check_aligned("w_gate_up", w_gate_up, "k-tiled weights are read in place")
            _check_aligned("w_down", w_down, "k-tiled weights are read in place")
        # the gate is read in place in every mode: a copy made here would not see the caller's later in-place
        # changes, which a contiguous gate's launches do see
        if not gate.is_contiguous():
            raise ValueError("megakernel: gate must be contiguous (it is read in place, so that later in-place "
                             "changes to it are seen); pass gate.contiguous() for a copy of the layer's own")
        _check_aligned("gate", gate, "it is read in place")

    def rebind(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor) -> None:
        """Read the weights from these tensors from now on: k-tiled expert weights and the gate, all contiguous bf16
        on this layer's device, shared (not copied). For an owner whose parameters were replaced (MoELayer after
        `load_state_dict(assign=True)` or `.to()`). The launch templates take the new pointers; a CUDA graph captured
        before still reads the old tensors' addresses, which this layer no longer keeps alive: capture it again, and
        never replay it (once their owner drops them it would read freed memory)."""
        self._check_weights(w_gate_up, w_down, gate, tiled=True)
        self.w1t, self.w2t, self.gate = w_gate_up, w_down, gate
        for p in self._params.values():
            p.wg, p.w1, p.w2 = gate.data_ptr(), w_gate_up.data_ptr(), w_down.data_ptr()

    def set_bucket_config(self, bucket: int, config: MegakernelConfig) -> str | None:
        """Run launches whose S is nearest token bucket `bucket` with `config` (its timeout: this layer's; its
        `decode` decides whether those that fit the decode kernel run it). Returns
        why not (and installs nothing) where it does not fit the scratch buffers (`LaunchConfigs.problem`) or the
        library refuses one of the launch shapes of the S that get it (`bucket_tokens`); None when installed.
        TypeError where `config` is no MegakernelConfig or `bucket` no int; ValueError where `bucket` is not on the
        profile ladder (TOKEN_BUCKETS): launches look their config up by their S's ladder bucket, so no S would
        ever run one installed under another number."""
        import dataclasses

        from moetune.runtime.profile_record import TOKEN_BUCKETS

        if not isinstance(config, MegakernelConfig):  # else an unnamed TypeError from dataclasses.replace
            raise TypeError(f"megakernel: config must be a MegakernelConfig, got {type(config).__name__}")
        if isinstance(bucket, bool) or not isinstance(bucket, int):
            raise TypeError(f"megakernel: bucket must be an int (a token bucket), got {type(bucket).__name__} "
                            f"{bucket!r}")
        if bucket not in TOKEN_BUCKETS:
            raise ValueError(f"megakernel: bucket {bucket} is not a token bucket of the profile ladder "
                             f"({', '.join(map(str, TOKEN_BUCKETS))}): no S would run its config")
        cfg = dataclasses.replace(config, timeout_ms=self.config.timeout_ms).resolve(self.model.hidden,
                                                                                    self.model.intermediate)
        why = self.launch.problem(cfg) or limits_problem(self.model, self.max_tokens, cfg)
        span = bucket_tokens(bucket, self.max_tokens)  # only the launches that get this config need to fit it
        if why is None and self.device.type == "cuda" and span is not None:
            for bm, stages in sorted(self.launch_shapes(cfg, span)):
                try:
                    self.grid(bm, stages, cfg)
                except CsrcError as e:
                    why = f"launches of bm={bm}, stages={stages} cannot run on {self.device}: {e}"
                    break
                except ConfigError as e:
                    why = str(e)
                    break
        if why is None:
            self._reserve_split(cfg)
            self.launch.install(bucket, cfg)
        return why

    def launch_shapes(self, config: MegakernelConfig | None = None,
                      tokens: tuple[int, int] | None = None) -> set[tuple[int, int]]:
        """Every (bm, stages) a forward of `tokens` = (first, last) tokens (default 1..max_tokens) can launch with.
        `pick_bm` and `pick_stages` are step functions of S, so their values at both ends and either side of each
        threshold inside cover them all."""
        m, cfg = self.model, config or self.config
        k, e = m.topk, m.experts
        lo, hi = tokens or (1, self.max_tokens)
        cuts = {lo, hi}
        for rows in (cfg.bm_switch_rows * e, cfg.bm_large_rows * e, cfg.wide_switch_rows * e, e):
            first = -(-rows // k)  # the first S with S x topk >= rows
            cuts.update((first - 1, first))
        shapes: set[tuple[int, int]] = set()
        for s in cuts:
            if lo <= s <= hi:
                bm = cfg.pick_bm(s, k, e)
                st = cfg.pick_stages(bm, s, k, e)
                shapes.add((bm, st))
                if not cfg.stages and bm == 16 and st == 6:
                    shapes.add((16, 4))  # stages_for's one-wave rule may run 4 instead
        return shapes

    # ---- launch plumbing ---------------------------------------------------------------------------
    def grid(self, bm: int, stages: int, config: MegakernelConfig | None = None) -> int:
        """CTAs of the persistent launch for (bm, stages): 1 scheduler + processors, all resident."""
        c = config or self.config
        if (c, bm, stages) not in self._grids:
            per_sm, sms = ctypes.c_int(0), ctypes.c_int(0)
            with torch.cuda.device(self.device):
                _lib.check(self.lib, self.lib.mk_occupancy(bm, stages, _lib.CORES[c.core], c.tma,
                                                           c.pick_bn(bm), c.overlap,
                                                           ctypes.byref(per_sm),
                                                           ctypes.byref(sms)), "mk_occupancy")
            if per_sm.value < 1:
                # the knobs named beside the fields: a layer built from knobs says what its user set
                raise ConfigError(f"megakernel config: stages={stages} (the knob mk_stages) leaves no resident CTA "
                                  f"(bm={bm})")
            per = c.ctas_per_sm or per_sm.value
            if per > per_sm.value:
                raise ConfigError(f"megakernel config: ctas_per_sm={per} (the knob mk_ctas_per_sm) but only "
                                  f"{per_sm.value} fit per SM "
                                  f"(bm={bm}, stages={stages})")
            resident = per * sms.value
            procs = c.processor_ctas or resident - 1
            if procs + 1 > resident:
                raise ConfigError(f"megakernel config: processor_ctas={procs} (the knob mk_processor_ctas) + 1 "
                                  f"scheduler exceeds the {resident} "
                                  "resident CTAs")
            self._grids[(c, bm, stages)] = procs + 1
        return self._grids[(c, bm, stages)]

    def decode_grid(self, tokens: int) -> tuple[int, int] | None:
        """(CTAs, output rows per CTA) of the decode kernel for `tokens` tokens where `decode` is on in the config
        that launches of `tokens` run (their token bucket's, `set_bucket_config`, else the layer's) and the launch
        fits it (S x topk <= 64 routed rows, each CTA's rows of W_down in its shared memory), else None."""
        if not self.launch.for_tokens(tokens).decode:  # the bucket's own: its profile may turn the decode kernel off
            return None
        if tokens not in self._decode:
            self._decode[tokens] = decode_launch(self.model, tokens, self.device, self.lib)
        return self._decode[tokens]

    def stages_for(self, bm: int, tokens: int, config: MegakernelConfig | None = None) -> int:
        """`config.pick_stages`, except that a decode launch (bm=16, fewer rows than experts) whose split GEMM1 parts
        outnumber the processors of the 6-stage pipeline (2 CTAs/SM) runs 4 stages (3 CTAs/SM), so the parts run in
        one wave (run 21, S=2: 384 parts for 263 processors, 86.1 us at 4 stages vs 93.2 at 6; S=1, 192 parts:
        66.3 at 6 vs 67.2 at 4)."""
        m, cfg = self.model, config or self.config
        st = cfg.pick_stages(bm, tokens, m.topk, m.experts)
        if cfg.stages or bm != 16 or st != 6:
            return st
        rows = tokens * m.topk  # <= experts here: at most one m-tile per row
        parts = rows * self.n1 * (cfg.split_k1 if rows <= split_room(cfg, self.max_tiles)[0] else 1)
        return st if parts <= self.grid(bm, st, cfg) - 1 else 4

    def _template(self, bm: int, tokens: int, config: MegakernelConfig | None = None) -> _lib.MkParams:
        cfg = config or self.config
        stages = self.stages_for(bm, tokens, cfg)
        p = self._params.get((cfg, bm, stages))
        if p is None:
            m = self.model
            p = _lib.MkParams()
            for name in ("logits", "topk_idx", "topk_w", "counts", "lists", "h", "y", "ctl", "g1done", "comb", "rel",
                         "tile_base", "q_task", "q_flag", "err", "sk_part", "sk_cnt", "dec_cnt"):
                setattr(p, name, getattr(self, name).data_ptr())
            p.wg, p.w1, p.w2 = self.gate.data_ptr(), self.w1t.data_ptr(), self.w2t.data_ptr()
            p.S_cap, p.H, p.I, p.E, p.K = self.max_tokens, m.hidden, m.intermediate, m.experts, m.topk
            p.bm, p.stages = bm, stages
            p.q_cap, p.max_tiles, p.max_ctiles = self.q_cap, self.max_tiles, self.max_ctiles
            p.grid = self.grid(bm, stages, cfg)
            p.timeout_ns = int(cfg.timeout_ms * 1e6)
            p.logit_splits_max = self.logit_splits
            p.core = _lib.CORES[cfg.core]
            p.split_k1, p.split_k2 = cfg.split_k1, cfg.split_k2
            p.sk_max_tiles = split_room(cfg, self.max_tiles)[0]  # <= sk_room's: the slots index by it
            p.tma_b = cfg.tma
            p.bn = cfg.pick_bn(bm)  # 256: the wide tile (two 128-column n-blocks per task)
            p.tail_rows = cfg.tail(bm, p.bn)  # an expert's last rows (<= 16) ride in its last full m-tile
            p.overlap = cfg.overlap  # 1: the wgmma tiles' cross-task overlap kernel (other tiles ignore it)
            p.route_small_max = cfg.route_small_max  # S up to which top-k runs one block per token
            p.publish_all = cfg.publish_all  # 1: mma-core tiles publish every task at launch
            p.pdl = cfg.pdl  # 1: k_topk and the persistent kernel start while the kernel before them runs
            self._params[(cfg, bm, stages)] = p
        return p

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [S, H] bf16 on the layer's device -> [S, H] bf16 (into `out` when given: bf16 [S, H] on the layer's
        device, contiguous, 16-byte aligned, not sharing x's storage). x that is not contiguous or not 16-byte aligned is
        copied first; an x that requires grad in grad mode raises ValueError (no backward). No host sync
        (graph-capturable)."""
        s = self._check_x(x)
        _refuse_grad(x=x)
        self._check_out(out, s, x)
        with torch.no_grad():
            if s:
                self._order_streams()
            return self._run(x, s, out, given=False)

    __call__ = forward

    def forward_routed(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       out: torch.Tensor | None = None, *, check_ids: bool = True) -> torch.Tensor:
        """The layer with given routing ([S, K] expert ids and weights; tests and benchmarks inject routing here).

        With `check_ids` the ids are checked on the host (one sync) except while a CUDA graph is being captured: each
        in range, and a token's ids distinct experts (an expert's row list holds max_tokens rows, one per token). An
        id that gets through unchecked is caught by the kernel, which drops the row, records it (`check()` raises
        it) and aborts the launch, so none of that forward's output rows is valid: code 4 out of range, code 7 a
        repeat that gave an expert more than max_tokens rows (nothing is written past the lists). `check_ids=False`:
        the caller has checked them (MoELayer). An x or topk_weights that requires grad in grad mode raises ValueError
        (no backward)."""
        s = self._check_x(x)
        why = routed_inputs_problem(s, self.model.topk, self.device, topk_idx, topk_weights)
        if why is None and check_ids:
            why = expert_ids_problem(topk_idx, self.model.experts, distinct=True)
        if why is not None:
            raise ValueError(f"megakernel: {why}")
        _refuse_grad(x=x, topk_weights=topk_weights)
        self._check_out(out, s, x)
        with torch.no_grad():
            if s:
                self._order_streams()  # before the picks are copied into the scratch
            if topk_idx.dtype != torch.int32:
                # narrowing would wrap an unchecked 2**32 + 3 into expert 3: keep it invalid. Clamped as int64, not in
                # its own dtype: uint8 takes the bound -1 as 255 (every id became `experts`, out of range), int8
                # cannot hold 128 experts, and torch has no clamp for uint16 / uint32
                topk_idx = topk_idx.to(torch.int64).clamp(-1, self.model.experts)
            self.topk_idx[:s].copy_(topk_idx)
            self.topk_w[:s].copy_(topk_weights)
            return self._run(x, s, out, given=True)

    def _order_streams(self) -> None:
        """Order this call after everything queued so far on the stream of the previous call, where that was another
        stream: every call reuses the same scratch (and `check` / `clear_error` read and reset its error and control
        words), so a launch on stream B must not start while stream A's may still use it. One event, no host wait.
        Not while a CUDA graph is captured (a wait on work outside the capture is not allowed there; the stream a
        graph is replayed on is the caller's to order), as EPBuffer's calls."""
        if not _has_streams(self.device):
            return
        stream = torch.cuda.current_stream(self.device)
        last = self._last_stream
        if last is not None and last != stream:  # the device context and capture query only here: an eager call's cost
            with torch.cuda.device(self.device):
                if not torch.cuda.is_current_stream_capturing():
                    stream.wait_stream(last)
        self._last_stream = stream

    def let_go(self) -> None:
        """Before the owner drops its last reference (MoELayer.close): mark every device tensor of the layer as used
        by the latest call's stream (`record_stream`, no host wait), so that the caching allocator does not hand its
        memory out again while that launch may still run. Freed blocks return to the stream they were allocated on;
        a launch on another stream (`_order_streams`) is not ordered before that stream's next allocation."""
        last = self._last_stream
        if last is None or not _has_streams(self.device):
            return
        for t in [*vars(self).values(), *self._retired]:
            if isinstance(t, torch.Tensor) and t.device == self.device:  # the allocator's (no host tensors)
                t.record_stream(last)

    def _check_x(self, x: Any) -> int:
        """S of a valid x (bf16 [S, H] on the layer's device, S <= max_tokens), else ValueError."""
        h = self.model.hidden
        if (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h or x.dtype != torch.bfloat16
                or x.device != self.device):
            got = f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"megakernel: x must be bf16 [S, {h}] on {self.device}, got {got}")
        why = strided_problem("x", x)
        if why is not None:
            raise ValueError(f"megakernel: {why}")
        s = x.shape[0]
        if s > self.max_tokens:
            raise ValueError(f"megakernel: x has {s} tokens, more than max_tokens={self.max_tokens}")
        return s

    def _check_out(self, out: Any, s: int, x: torch.Tensor) -> None:
        """`out` is written through its data pointer: it must be exactly the tensor the kernel assumes (the caller
        owns it, so it is refused rather than copied)."""
        if out is None:
            return
        h = self.model.hidden
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != (s, h) or out.dtype != torch.bfloat16
                or out.device != self.device):
            got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"megakernel: out must be bf16 [{s}, {h}] on {self.device}, got {got}")
        if not out.is_contiguous():
            raise ValueError("megakernel: out must be contiguous (the kernel writes rows of H elements back to back)")
        if s:
            _check_aligned("out", out, "the kernels write it with 16-byte stores")
        if s and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            # the kernels read x while they write out, in no order that keeps a row's input until its output lands
            raise ValueError("megakernel: out must not share storage with x")

    def _run(self, x: torch.Tensor, s: int, out: torch.Tensor | None, *, given: bool) -> torch.Tensor:
        """One forward of S = `s` tokens; the callers have checked x and out."""
        x = _launchable(x)  # kept referenced until the launches are queued; the stream orders any reuse after them
        if out is None:
            out = torch.empty(s, self.model.hidden, dtype=torch.bfloat16, device=self.device)
        if s == 0:
            return out
        p = self._launch_params(x, s, out, given=given)
        ref = ctypes.byref(p)
        # the launches go to the layer's device whichever GPU is current (as grid() and decode_launch do): the
        # library launches on the current device. Host-side only, so capturable.
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device).cuda_stream
            if given and not p.decode:
                _lib.check(self.lib, self.lib.mk_route_given(ref, stream), "mk_route_given")
            elif not p.decode:
                _lib.check(self.lib, self.lib.mk_route(ref, stream), "mk_route")
            _lib.check(self.lib, self.lib.mk_experts(ref, stream), "mk_experts")
        return out

    def _launch_params(self, x: torch.Tensor, s: int, out: torch.Tensor, *, given: bool) -> _lib.MkParams:
        """The launch template of S = `s` >= 1 tokens (its token bucket's config) with this launch's own fields set:
        what `_run` passes to the library, and what benchmarks that time its entry points one by one take
        (bench/tools/megakernel_profile.py phase_times). x and out: contiguous, 16-byte aligned, on the layer's device."""
        cfg = self.launch.for_tokens(s)  # this S's token bucket's config (set_bucket_config), else self.config
        bm = cfg.pick_bm(s, self.model.topk, self.model.experts)
        p = self._template(bm, s, cfg)
        p.x, p.out, p.S, p.stall_tile = x.data_ptr(), out.data_ptr(), s, self.stall_tile
        p.l2_evict_w = cfg.evict_weights(bm, s, self.model.topk, self.model.experts)
        p.combine_tokens = cfg.combine_tile(bm, p.bn, s, self.model.topk, self.model.experts)
        # the decode kernel routes from the gate itself (2) or reads the given picks (1): nothing launches before it
        p.decode = 0 if self.decode_grid(s) is None else 1 if given else 2
        p.trace = self._trace.data_ptr() if self._trace is not None else None
        return p

    # ---- inspection ----------------------------------------------------------------------------------
    @torch.no_grad()
    def task_timeline(self, x: torch.Tensor) -> dict[str, Any]:
        """One forward with the persistent kernel stamping every task (globaltimer, ns; profiling the schedule).

        Returns times in µs from the first CTA's start: `tasks` (one dict per executed queue slot: kind, expert,
        m-tile, n-field, parts, cta, published, claimed, mainloop_done (GEMMs: epilogue next), stores_issued (wgmma
        tiles: signal next), done; GEMMs also `rows`: the m-tile's routed rows, at most bm + the tail rows), `ctas`
        ([start, end] per processor CTA) and the scheduler's stamps. Syncs; the stamps cost a few stores per task, so
        absolute times run slightly long.
        """
        s = self._check_x(x)  # first: the launch shape below is looked up for this S (and x may be no tensor)
        if s < 1:
            raise ValueError("megakernel: task_timeline needs at least one token")
        if self.decode_grid(s) is not None:
            raise ValueError(f"megakernel: S={s} runs the decode kernel, which has no task timeline (a layer with "
                             "config decode=0 runs the task graph at every S)")
        cfg = self.launch.for_tokens(s)  # the config the forward of S tokens runs
        bm = cfg.pick_bm(s, self.model.topk, self.model.experts)
        tail = cfg.tail(bm, cfg.pick_bn(bm))
        grid = self.grid(bm, self.stages_for(bm, s, cfg), cfg)
        n = _lib.TR_HEAD + _lib.TR_SLOT * self.q_cap + 2 * grid
        self._trace = torch.zeros(n, dtype=torch.int64, device=self.device)
        try:
            self.forward(x)
            torch.cuda.synchronize(self.device)
            self.check()
            raw, words = self._trace.tolist(), self.q_task.tolist()
            counts = self.counts[::_lib.COUNT_STRIDE].tolist()  # this launch's rows per expert (reset by the next)
        finally:
            self._trace = None
            for q in self._params.values():  # no launch template keeps the freed buffer
                q.trace = None
        cta_raw = raw[_lib.TR_HEAD + _lib.TR_SLOT * self.q_cap:]
        starts = [cta_raw[2 * b] for b in range(1, grid) if cta_raw[2 * b]]
        t0 = min(starts) if starts else 0

        def us(v: int) -> float | None:
            return (v - t0) / 1e3 if v else None

        kinds = {1: "gemm1", 2: "gemm2", 3: "combine"}
        tasks = []
        for i in range(self.counters()["total"]):
            pub, claim, done, cta, main, epi = raw[_lib.TR_HEAD + _lib.TR_SLOT * i:_lib.TR_HEAD + _lib.TR_SLOT * (i + 1)]
            w = words[i] & ((1 << 64) - 1)  # the task word's fields (mk_index.h: enc)
            tasks.append({"slot": i, "kind": kinds.get(w >> 61, "?"), "expert": (w >> 48) & 0x1FF,
                          "mtile": (w >> 32) & 0xFFFF, "nfield": (w >> 20) & 0xFFF, "tile": w & 0xFFFFF,
                          "parts": ((w >> 57) & 0xF) + 1, "cta": cta, "published": us(pub), "claimed": us(claim),
                          "mainloop_done": us(main), "stores_issued": us(epi),
                          "done": us(done)})
            if tasks[-1]["kind"] in ("gemm1", "gemm2"):
                cnt, mt = counts[tasks[-1]["expert"]], tasks[-1]["mtile"]
                tasks[-1]["rows"] = tile_end(cnt, mt, bm, tail) - bm * mt
        return {"tokens": s, "bm": bm, "grid": grid, "config": cfg.to_dict(),
                "sched": {"start": us(raw[0]), "gemm1_published": us(raw[1]), "end": us(raw[2])},
                "ctas": [[us(cta_raw[2 * b]), us(cta_raw[2 * b + 1])] for b in range(1, grid)], "tasks": tasks}

    # mk_decode.cuh DEC_TR_*: per CTA, DECODE_WORDS words
    DECODE_STAMPS = ("start", "routed", "phase1", "signalled", "w_down", "ready", "h_loaded", "summed", "end", "logits")
    DECODE_WORDS = 10

    @torch.no_grad()
    def decode_timeline(self, x: torch.Tensor) -> dict[str, Any]:
        """One forward of a decode launch with every CTA stamping its phases (globaltimer; profiling): per CTA, µs from
        the first CTA's start to `logits` (every gate logit written: decode=2), `routed` (the picks known), `phase1`
        (thread 0 done issuing the W_down copies), `signalled` (its pairs done and counted), `w_down` (its
        down-projection rows landed, or warp 0's own pairs done if later), `ready` (every slot complete), `h_loaded`
        (stamped with `ready` since run 167: each lane loads its own h chunks in the sums), `summed` (thread 0's share
        of the sums done) and `end`; None where a CTA has no such step (no output rows). Syncs."""
        s = self._check_x(x)  # first: S past max_tokens is named as such, not as "does not run the decode kernel"
        dg = self.decode_grid(s)
        if dg is None:
            raise ValueError(f"megakernel: S={s} does not run the decode kernel (task_timeline traces the task graph)")
        words = self.DECODE_WORDS
        self._trace = torch.zeros(_lib.TR_HEAD + words * dg[0], dtype=torch.int64, device=self.device)
        try:
            self.forward(x)
            torch.cuda.synchronize(self.device)
            self.check()
            raw = self._trace.tolist()[_lib.TR_HEAD:]
        finally:
            self._trace = None
            for q in self._params.values():
                q.trace = None
        t0 = min(raw[words * c] for c in range(dg[0]))
        ctas = [{n: (raw[words * c + f] - t0) / 1e3 if raw[words * c + f] else None
                 for f, n in enumerate(self.DECODE_STAMPS)} for c in range(dg[0])]
        return {"tokens": s, "grid": dg[0], "rows": dg[1], "config": self.launch.for_tokens(s).to_dict(), "ctas": ctas}

    def routing(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last forward's routing for its S tokens: (expert ids int64 [S, K], weights fp32 [S, K]), read on the
        current stream after the last forward's (no host wait). S: an int in 0..max_tokens (the scratch's rows)."""
        check_int("s", s, 0, "megakernel: routing: ")
        if s > self.max_tokens:  # a slice would hand back max_tokens rows for it, some of no forward of these S
            raise ValueError(f"megakernel: routing: s={s} is more than max_tokens={self.max_tokens}")
        self._order_streams()  # the picks the latest launch writes, whichever stream it ran on
        return self.topk_idx[:s].long(), self.topk_w[:s]

    def error(self) -> tuple[int, str, list[int]] | None:
        """(code, text, record = [code, where, detail, waited ns]) of the first error since the last `clear_error`
        that aborted a launch, else of the first one recorded without the abort (code 8, non-finite gate logits: the
        kernels keep it in words of its own, so that it never hides a later abort, whose launch's outputs are all
        invalid), else None. Syncs."""
        self._order_streams()  # the record the latest launch writes, whichever stream it ran on
        words = self.err.tolist()
        for rec in (words[:4], words[_lib.ERR_NOABORT:_lib.ERR_NOABORT + 4]):
            if rec[0] != 0:
                return rec[0], ERR_NAMES.get(rec[0], "unknown error"), rec
        return None

    @property
    def w_gate_up(self) -> torch.Tensor:
        """The gate/up weights [E, 2I, H] row-major: a new tensor each call (the layer holds them k-tiled)."""
        return from_tiled(self.w1t)

    @property
    def w_down(self) -> torch.Tensor:
        """The down weights [E, H, I] row-major: a new tensor each call (the layer holds them k-tiled)."""
        return from_tiled(self.w2t)

    def check(self) -> None:
        """Raise MegakernelError if the kernel reported an error (a host sync)."""
        e = self.error()
        if e is not None:
            code, text, rec = e
            raise MegakernelError(f"megakernel error {code}: {text} (where={rec[1]}, detail={rec[2]}, "
                                  f"waited={rec[3] / 1e6:.1f} ms)")

    def clear_error(self) -> None:
        """Forget the error records (sticky until this: `check()` raises one after any number of later forwards), lift
        the abort flag and zero the decode kernel's counter words. Neither flag carries over to a later launch without
        this: the task graph's routing lifts ctl's every launch, and the decode kernel (no reset kernel before it)
        polls its own flag in its counter words (`_lib.DEC_ABORT`), which its last CTA zeroes with its counters."""
        self._order_streams()  # not under a launch still running on another stream
        self.err.zero_()
        self.ctl[CTL_ABORT] = 0
        self.dec_cnt.zero_()

    def counters(self) -> dict[str, int]:
        """The last launch's task total, m-tiles and published tasks as the kernel counted them. Syncs."""
        self._order_streams()
        c = self.ctl.tolist()
        return {"total": c[CTL_TOTAL] - 1, "tiles": c[CTL_TILES], "published": c[CTL_PUBLISHED]}


def _refuse_grad(**tensors: torch.Tensor) -> None:
    """ValueError where grad mode is on and an input requires grad: the kernels have no backward, so the output would
    come back detached (the gradient silently stopping here)."""
    why = grad_problem("MegakernelMoE", **tensors)
    if why is not None:
        raise ValueError(f"megakernel: {why}")


def _check_aligned(name: str, t: torch.Tensor, why: str) -> None:
    """ValueError unless t's data starts at a multiple of ALIGN bytes (for tensors the layer must not copy)."""
    if t.data_ptr() % ALIGN:
        raise ValueError(f"megakernel: {name} must start at a {ALIGN}-byte aligned address ({why}), got data_ptr "
                         f"{t.data_ptr():#x} (a view at an element offset that is not a multiple of "
                         f"{ALIGN // t.element_size()}?); pass a tensor of its own or an aligned view")


def _launchable(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and 16-byte aligned: t itself where it is, else a copy (a view at an odd offset into a larger
    buffer is contiguous but not aligned; the kernels' 16-byte loads would read the wrong bytes or fault)."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def _device_problem(device: torch.device) -> str | None:
    """Why the layer cannot live on `device` (None: it can). A function of its own so that CPU tests can stand in a
    permissive one and build the layer's buffers and run its argument checks without a GPU."""
    if device.type != "cuda":
        return f"device must be a CUDA device (the kernels run on an sm_90 GPU), got {device}"
    if not torch.cuda.is_available():
        return f"device {device}: CUDA is not available to torch"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx >= torch.cuda.device_count():
        return f"device {device}: this process sees {torch.cuda.device_count()} CUDA device(s)"
    major, minor = torch.cuda.get_device_capability(idx)
    if (major, minor) != (9, 0):  # the library is built for sm_90a only: its launches would fail on any other GPU
        return f"the kernels run on an sm_90 (Hopper) GPU; {torch.cuda.get_device_name(idx)} is sm_{major}{minor}"
    return None


def _has_streams(device: torch.device) -> bool:
    """Whether calls on `device` run on CUDA streams to order (`_order_streams`). A function of its own, as
    `_device_problem`: CPU tests build the layer on the CPU and stand in CUDA's streams."""
    return device.type == "cuda"


def _device(device: torch.device | str | None) -> torch.device:
    """The layer's device: None is "cuda", and "cuda" without an index the current CUDA device (`indexed_device`)."""
    return indexed_device(device if device is not None else "cuda")
