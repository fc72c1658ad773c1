"""MegakernelConfig: the megakernel's tunable settings, typed and validated (stdlib only).

A view: the tunable fields are the knobs `mk_bm`, `mk_stages`, `mk_ctas_per_sm`, `mk_processor_ctas`,
`mk_combine_tokens`, `mk_core`, `mk_split_k` (both GEMMs' split-K), `mk_bn` and `mk_overlap` (runtime/knobs.py,
the one vocabulary the tuner searches and profiles store) and the timeout is the runtime option
`megakernel_timeout_s`: build it with `MegakernelConfig.from_knobs(knobs, options)`. `bm_switch_rows`,
`bm_large_rows` and `wide_switch_rows` (the auto tile's thresholds) stay here: no knob for them (`mk_bm` sets the
tile outright). `parse("bm=16,stages=4")`, `from_dict`
and `to_dict` remain for benchmarks and tests; every error names the field. 0 in `bm`, `bn`, `ctas_per_sm` and
`processor_ctas` means "pick from the shape / the occupancy query" (`resolve` decides `bn` for a layer's shape).
Settings that are not knobs: `tma` (TMA loads of the weight tiles: 2-3.5% everywhere in run 11, under the 5% that
makes a knob), `route_small_max` (where routing switches top-k kernels: since run 30 the one-warp-per-token kernel
wins at every measured S, so the default is 0; the block-per-token kernel stays selectable for shapes not measured)
and `publish_all` (up to 7% at S=1, but 0 was never faster at any S in runs 15-19: nothing for a search to find);
`l2_evict_weights` follows a rule from the launch's rows per expert (run 58), nothing to search either; `decode`
(the decode kernel where a launch fits it: S=1 35.9 vs 55.3 µs in run 76) was never the slower one where it runs,
and where it runs the tile knobs do not apply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from moetune.runtime.knobs import (
    MK_BMS,
    MK_BNS,
    MK_CORES,
    MK_MAX_COMBINE_TOKENS,
    MK_MAX_CTAS_PER_SM,
    MK_MAX_PROCESSOR_CTAS,
    MK_MAX_SPLIT_K,
    MK_MAX_STAGES,
    float_of_text,
    int_of_text,
)

# bytes: the kernels read x, the gate and the expert weights and write out with 16-byte accesses (uint4 loads and
# stores, cp.async, TMA), which fault or read the wrong bytes at an address that is not a multiple of this
ALIGN = 16

if TYPE_CHECKING:
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.options import RuntimeOptions


class ConfigError(ValueError):
    """A megakernel setting is out of range or unknown; the message names the field."""


@dataclass(frozen=True)
class MegakernelConfig:
    bm: int = 0               # rows per m-tile: 16 (decode), 64 or 128 (prefill); 0 = by rows per expert
    bm_switch_rows: int = 32  # bm=0: use 64 once the average rows per expert (S*topk/E) reaches this
    bm_large_rows: int = 128  # bm=0, core mma: use 128 once the average rows per expert reaches this (wgmma: 64)
    # bm=0 with the wide tile (bn 256, or auto resolving to it): run it once the average rows per expert reaches
    # this, the bm=16 decode tile below. Runs 43-44 (one process each, graph µs, decode tile / wide tile): 8 rows per
    # expert (S=128) 322.6, 322.0 / 321.3 (run 43: 321.8 / 323.6), 10 (S=160) 330.1 / 324.1, 12 (S=192) 338.5 /
    # 325.1, 16 (S=256) 373.8 / 328.6, 24 (S=384) 445.2 / 336.3. It was bm_switch_rows (32) until then, which the
    # 128-column bm=64 tile keeps (run 43, S=256: 375.7 against the decode tile's 370.1).
    wide_switch_rows: int = 10
    stages: int = 0           # cp.async pipeline depth (2..12; shared memory caps bm=64 at 8 or 9, bm=128 at 6): weight
                              # tiles in flight per CTA; 0 = pick_stages
    ctas_per_sm: int = 0      # resident CTAs per SM (0 = as many as fit)
    processor_ctas: int = 0   # processor CTAs (0 = every resident CTA but the scheduler's)
    # Tokens per combine tile (each tile runs as 4 column-block tasks); 0 = auto (`combine_tile`): 2 on the bm = 16
    # decode tile, 4 on the wide tile while the average rows per expert fit half an m-tile, 8 otherwise. Runs 145 and
    # 147 (one process each, 20-forward chains, 4 minus 8, µs a forward): S=1024 -1.2 (p90 +1.7) and -1.6 (p10 -3.3,
    # p90 0.0), where the combines run as a 13 µs tail after the last GEMM2 (run 148) and half-size tasks spread it
    # better; S=4096 +9.9 (single replays +5.8).
    # Run 149 (auto, 8 minus auto): S=1024 +1.7 (p10 +0.6, p90 +2.8), 512 +0.7, 256 0.0. Run 151 (the decode tile,
    # then 8; chains, minus 8): 2 tokens S=16 -2.8 (p10 -3.2, p90 -2.0), S=128 -3.2 (-3.9, -2.5); 4 tokens -1.6 / -0.9:
    # its COMBINEs wait inside for their rows (publish_all), so smaller ones finish sooner after the last GEMM2.
    combine_tokens: int = 0
    timeout_ms: float = 2000.0  # (RuntimeOptions.megakernel_timeout_s) a wait without progress longer than this is an error, not a hang
    # GEMM core of the bm=64/128 tasks: "mma" (mma.sync m16n8k16 + ldmatrix) or "wgmma" (sm_90a warpgroup MMA
    # m64n128k16 from 128-byte-swizzled shared memory, producer warpgroup + mbarriers). Run 10 (H200): wgmma
    # 17% faster at S=1024 (578 vs 693 us), and with bm=64 14% faster at S=4096 (1754 vs 2037). bm=16
    # (decode) always runs the mma core.
    core: str = "wgmma"
    # Decode split-K: each GEMM1 (GEMM2) task of a bm=16 launch runs as split_k1 (split_k2) parts over K, and
    # the CTA finishing a task's last part adds the parts' fp32 partials in part order (bit-identical run to
    # run; the bits differ from split 1, which sums K in one pass). Only while the launch's m-tiles fit the
    # partial buffer (split_max_tiles); 1 = off. Run 10 at S=1 (8 m-tiles, 96 GEMM1 tasks of 512 KB for ~263
    # CTAs): 2 + 2 parts 73.9 us, 4 + 2 81.9, 8 + 4 88.4, none 86.5. Run 40 (the TMA decode tile, publish_all; one
    # process, graph us, none / 2 + 2 / none): S=1 55.7 / 59.6 / 55.6, S=2 63.9 / 77.3 / 62.8, S=4 and 8 within 1%
    # (no split applies there): off by default since then; `moetune profile` had stored no split at S=1 twice.
    split_k1: int = 1
    split_k2: int = 1
    split_max_tiles: int = 16  # m-tiles the split-K partial buffer holds (8 KB per part and (m-tile, n-block))
    # 1: the expert GEMMs load their weight tiles by TMA (one tensor copy of two 64-row boxes per stage,
    # completing on an mbarrier) instead of every thread's cp.async: the wgmma core (bm=64/128) and the bm=16
    # decode tile; bm=64/128 on the mma core ignore it. Run 11 (H200): correct, and 2-3.5% faster at every S
    # (S=1 72.0 vs 74.6 us, 1024 569 vs 582, 4096 1728 vs 1755): the default, but under the 5% that makes a knob.
    tma: int = 1
    # Columns per GEMM task: 0 = auto, 128, or 256 = the wide tile (wgmma core, bm = 128: two consumer warpgroups
    # of m64n256k16, 48 KB stages so stages <= 4), twice the FLOP per L2 byte of a 128 x 128 tile. With bn = 256
    # (or auto resolving to it) and bm = 0 the wide tile runs from `wide_switch_rows` rows per expert, and the bm = 16
    # decode tile (always 128 columns) below that: a 128 x 256 tile for a handful of rows per expert would
    # compute 8x the rows it has. Auto (`resolve`) is 256 where the core is wgmma, bm is 0 or 128, stages <= 4
    # and hidden and 2 x intermediate are multiples of 256, else 128. Run 12 (H200): with the overlap below,
    # S=4096 1331 us vs 1614 (bn=128, bm=64), S=1024 526 vs 542; decode sizes unchanged (bm=16).
    bn: int = 0
    # 1: the wgmma tiles (bm = 64 / 128, either bn) run the cross-task overlap kernel: the producer warpgroup claims
    # the next task itself, prepares its metadata into one of two task slots and starts loading its stages while
    # the consumer warpgroups still run the current task's last stages and epilogue (they synchronise on a named
    # barrier, never the whole CTA, and signal completion exactly as before); COMBINE tasks run on the consumer
    # warpgroups while the producer goes on. Same products in the same order: the same bits as overlap = 0
    # (checked on the GPU). Run 12: 6% faster at S=4096 (1614 vs 1722 us, bm=64), 5% at 1024. The mma core and
    # the bm = 16 decode tile ignore it.
    overlap: int = 1
    # Routing's top-k for launches of S <= route_small_max tokens: one 128-thread block per token (every thread
    # ranks its experts against all E probabilities at once) instead of one warp per token walking K rounds of
    # shuffles. Same bits either way; 0 = always one warp per token. Run 14 (routing µs, graph replay): S=1 16.6
    # vs 20.9, S=16 17.6 vs 22.7, S=128 20.2 vs 24.0, but S=1024 35.8 vs 31.2 and 4096 80.1 vs 55.1. Run 29 rewrote
    # k_topk (experts per lane a template bound, 64 registers); run 30, the whole layer side by side in one process,
    # graph µs, route_small_max 0 vs 256: S=1 59.2 vs 63.7, S=16 223.0 vs 225.3, S=128 320.1 vs 323.8. So 0: the
    # block-per-token kernel no longer wins on the Qwen3-30B shape (E=128); it stays for shapes not measured.
    route_small_max: int = 0
    # 1: launches on the mma-core tiles (the bm = 16 decode tile, and bm 64/128 with core = mma) publish every task
    # at launch (GEMM1s, then GEMM2s tile-major, then COMBINEs), and a processor that claims a GEMM2 starts its first
    # weight stages (TMA) before it waits for the m-tile's GEMM1s itself; a COMBINE waits for its rows. The weights
    # of the down projection then stream while the up projection still runs, and no task waits for a subscriber's
    # sweep. 0: the subscriber publishes GEMM2 / COMBINE tasks as they become ready (the wgmma tiles always do).
    # Runs 15, 16, 17, 19 (H200, side by side, 1 vs 0): S=1 65.6 / 70.7, 66.0 / 68.6, 66.2 / 71.4, 66.5 / 69.4 us;
    # S=16 1% faster, S=128 within 1%: the default (a setting: 0 was never the faster one).
    publish_all: int = 1
    # 1: programmatic dependent launch. k_topk and the persistent kernel are launched with the programmatic
    # stream-serialization attribute: each starts while the kernel before it still runs (the persistent kernel's CTAs
    # on the SMs routing leaves free, its prologue done) and waits for it (griddepcontrol) before reading anything it
    # wrote (never through the non-coherent path: run 50). Same bits (GPU tests). Runs 48-51 (H200, side by side in one
    # process, graph µs, pdl 0 vs 1, two or three rounds each): S=1 55.9 vs 54.4 (run 48), 55.5 vs 54.3 (run 51);
    # S=16 218.4 vs 216.5 (49), 213.0 vs 210.6 (51); S=128 323.7 vs 321.5 (49), 320.8 vs 319.7 (51); S=1024 365.1 vs
    # 363.0 (48), 364.4 vs 361.8 (51); S=4096 within its power-cap spread. The default (a setting: under the 5% that
    # makes a knob). Run 48 also let the early CTAs load the first MB of W_gate_up into the L2 while routing ran:
    # routing's own reads queued behind them (k_logits 4.5 -> 12.4 µs for 40 MB) and the layer got 2-8 µs slower
    # with 16-40 MB, so that was dropped.
    pdl: int = 1
    # L2 policy of the weight tiles (TMA loads): 1 evict-first, 0 the default policy, 2 (auto) evict-first for launches
    # whose average rows per expert fill at most 3/4 of an m-tile (4 x tokens x topk <= 3 x experts x bm: each expert's
    # weights are read about once, and evict-first keeps x, h, y and the gate in the L2 instead). Runs 145-146 (one
    # process each, 20-forward chains, 0 minus 1, µs a forward, wide tile): S=1024 (64 rows per expert) +9.7, 1280 (80)
    # +3.2, 1536 (96) +0.8 (p10 -5.1, p90 +3.9), 1792 (112) -3.0, 2048 (128) -8.6 (p10 -10.3, p90 -6.8): once the
    # average nears a full m-tile, more experts spill into a second one and read their weights twice, which the
    # default policy serves from the L2 (run 148, ncu at S=2048: evict-first reads 1.37 GB from DRAM, the default 1.34).
    # The bound was a whole m-tile (S=2048 on) until then. Run 58 (always-on build vs off, each in its own process, two
    # rounds, graph µs): S=16 212.9 / 213.4 vs 217.0 / 216.4; S=128 313.4 / 313.7 vs 321.3 / 320.7
    # (experts kernel 300.5 vs 310.9, the plain read 297.9); S=1024 354.7 / 355.5 vs 357.4 / 357.1; but S=4096
    # (four m-tiles per expert share their weights through the L2) experts kernel 732.5 vs 692.5-692.7.
    l2_evict_weights: int = 2
    # 1: launches whose routed rows (S x topk) fit the decode kernel (csrc/megakernel/mk_decode.cuh: one CTA per SM,
    # each CTA's rows of W_down for every row in its shared memory; on the Qwen3-30B shape S = 1) run it instead of
    # routing + the task graph: ONE launch that routes from the gate, computes the up projection as row-pair GEMVs on
    # every SM while the down projection's rows load, so both weights stream at once. 0: always the task graph.
    decode: int = 1
    # Launches on the wide tile by TMA with the overlap kernel (bm = 128, bn = 256, tma = 1, overlap = 1): an expert's
    # last r rows past a multiple of 128, 1 <= r <= tail_rows, ride in its last full m-tile (128 + r rows; the consumer
    # warps run them on mma.sync beside their wgmmas, A from a 2 KB ring per stage) instead of an m-tile of their own,
    # whose tasks would stream the expert's whole weight tile again for them (run 119's timeline: m-tiles of 1-16 rows
    # took 41.5 + 25.7 us of each CTA's time at S=4096, 71.6 + 34.6 at 2048). 0 = off; other launches ignore it.
    # Runs 123-125 (one process, replay by replay, the same source without the ring minus this build, median): S=4096
    # +63.2 us, 2048 +74.6, 1024 +1.4 (no tails there); within the build tail_rows=0 is 34.0 slower at 4096; the same
    # bits either way (mma.sync adds each k16 step as wgmma does). A setting, not a knob: never the slower one.
    tail_rows: int = 16

    # the fields that are knobs take the knobs' ranges (runtime/knobs.py: one vocabulary for the tuner, the profiles
    # and this config)
    _RANGES: ClassVar[dict[str, tuple[float, float]]] = {
        "bm_switch_rows": (1, 1 << 20),
        "bm_large_rows": (1, 1 << 20),
        "wide_switch_rows": (1, 1 << 20),
        "stages": (0, MK_MAX_STAGES),
        "ctas_per_sm": (0, MK_MAX_CTAS_PER_SM),
        "processor_ctas": (0, MK_MAX_PROCESSOR_CTAS),
        "combine_tokens": (0, MK_MAX_COMBINE_TOKENS),
        "timeout_ms": (1e-3, 3.6e6),
        "split_k1": (1, MK_MAX_SPLIT_K),
        "split_k2": (1, MK_MAX_SPLIT_K),
        "split_max_tiles": (1, 4096),
        "tma": (0, 1),
        "overlap": (0, 1),
        "route_small_max": (0, 1 << 20),
        "publish_all": (0, 1),
        "pdl": (0, 1),
        "l2_evict_weights": (0, 2),
        "decode": (0, 1),
        "tail_rows": (0, 16),
    }
    CORES: ClassVar[tuple[str, ...]] = MK_CORES
    AUTO_COMBINE: ClassVar[tuple[int, int, int]] = (2, 4, 8)  # combine_tokens = 0: decode, small wide, the rest

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("str", str):
                if not isinstance(v, str):
                    raise ConfigError(f"megakernel config: {f.name} must be str, got {v!r}")
                continue
            want = float if f.type in ("float", float) else int
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not isinstance(v, int)):
                raise ConfigError(f"megakernel config: {f.name} must be {want.__name__}, got {v!r}")
        if self.bm not in MK_BMS:
            raise ConfigError(f"megakernel config: bm must be 0 (auto) or one of {_listed(MK_BMS)}, got {self.bm}")
        if self.core not in self.CORES:
            raise ConfigError(f"megakernel config: core must be one of {', '.join(self.CORES)}, got {self.core!r}")
        if self.bn not in MK_BNS:
            raise ConfigError(f"megakernel config: bn must be 0 (auto) or one of {_listed(MK_BNS)}, got {self.bn}")
        if self.bn == 256 and (self.core != "wgmma" or self.bm not in (0, 128)):
            raise ConfigError(f"megakernel config: bn=256 (the wide tile) needs core=wgmma and bm=128 (or bm=0), "
                              f"got core={self.core}, bm={self.bm}")
        if self.bn == 256 and self.stages > 4:
            raise ConfigError(f"megakernel config: stages must be <= 4 with bn=256 (48 KB per stage), got {self.stages}")
        if self.stages == 1:
            raise ConfigError(f"megakernel config: stages must be 0 (auto) or in [2, {MK_MAX_STAGES}], got 1")
        for name, (lo, hi) in self._RANGES.items():
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ConfigError(f"megakernel config: {name} must be in [{lo:g}, {hi:g}], got {v}")

    @classmethod
    def from_knobs(cls, knobs: Knobs, options: RuntimeOptions | None = None) -> MegakernelConfig:
        """The megakernel's settings as the knobs and runtime options say (options None: their defaults)."""
        from moetune.runtime.options import RuntimeOptions

        opts = options if options is not None else RuntimeOptions()
        return cls(bm=knobs.mk_bm, stages=knobs.mk_stages, ctas_per_sm=knobs.mk_ctas_per_sm,
                   processor_ctas=knobs.mk_processor_ctas, combine_tokens=knobs.mk_combine_tokens,
                   core=knobs.mk_core, split_k1=knobs.mk_split_k, split_k2=knobs.mk_split_k, bn=knobs.mk_bn,
                   overlap=knobs.mk_overlap,
                   timeout_ms=float(opts.megakernel_timeout_s) * 1000.0)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MegakernelConfig:
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ConfigError(f"megakernel config: unknown field(s) {', '.join(unknown)}; known: {', '.join(names)}")
        return cls(**d)

    @classmethod
    def parse(cls, text: str) -> MegakernelConfig:
        """`"bm=16,stages=3,timeout_ms=500"` (empty string: defaults; a field given twice: ConfigError)."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            key = key.strip()
            if not sep:
                raise ConfigError(f"megakernel config: expected name=value, got {part!r}")
            if key not in names:
                raise ConfigError(f"megakernel config: unknown field {key!r}; known: {', '.join(names)}")
            if key in out:  # not the last value silently (a benchmark labelled bm=16 running bm=64), as Knobs.parse
                raise ConfigError(f"megakernel config: {key} given twice in {text!r}")
            ftype = names[key].type
            typ = float if ftype in ("float", float) else str if ftype in ("str", str) else int
            val = val.strip()
            try:
                # not int() / float(): they take "1_0" as 10
                out[key] = int_of_text(val) if typ is int else float_of_text(val) if typ is float else val
                if out[key] is None:
                    raise ValueError(val)
            except ValueError:
                raise ConfigError(f"megakernel config: {key} must be {typ.__name__}, got {val!r}") from None
        return cls.from_dict(out)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolve(self, hidden: int, intermediate: int) -> MegakernelConfig:
        """This config with `bn` = 0 (auto) decided for a layer of this shape (see `bn`)."""
        if self.bn:
            return self
        wide = (self.core == "wgmma" and self.bm in (0, 128) and self.stages <= 4 and hidden % 256 == 0
                and (2 * intermediate) % 256 == 0)
        return dataclasses.replace(self, bn=256 if wide else 128)

    def pick_stages(self, bm: int, tokens: int, topk: int, experts: int) -> int:
        """Pipeline depth when `stages` is 0, from runs 2-3 (H200, Qwen3-30B shape): bm 64/128 at 3 stages
        (2 CTAs/SM) 17% (S=1024) to 35% (S=4096) faster than at 4; fewer rows than experts (S=1) 10% faster
        at 6 than at 4 (more weight bytes in flight per CTA; run 8: 8 or 12 stages, one CTA per SM, within 4%);
        bm=16 with as many rows as experts (S=16..128) at 3: run 8, 3-4% faster than 4, 6+ up to 2x slower."""
        if self.stages:
            return self.stages
        if bm == 128 and self.bn == 256 and self.core == "wgmma":
            # run 12, wide tile: 3 stages (S=4096 1331 us vs 1357 at 4). Run 26, after the epilogue fixes, in three
            # builds: 4 stages 1.6-2.2% faster at S=1024 (v3: 398.5 vs 405.0 us) and 0.4-1.5% at S=4096
            return 4
        if bm >= 64:
            # wgmma core: one producer warpgroup streams stages-1 tiles ahead per CTA; 4 stages = 128 KB
            # (bm=128, 1 CTA/SM) / 96 KB (bm=64, 2 CTAs/SM). Run 10 at S=1024: 4 stages 578 us, 3 587, 6 920.
            return 4 if self.core == "wgmma" else 3
        return 6 if tokens * topk < experts else 3

    def pick_bm(self, tokens: int, topk: int, experts: int) -> int:
        """The m-tile rows for S = `tokens`: host-side arithmetic only, so CUDA-graph capture is unaffected."""
        if self.bm:
            return self.bm
        rows = tokens * topk
        if self.bn == 256:  # the wide tile is bm=128; decode sizes keep the bm=16 tile (see `bn`)
            return 128 if rows >= self.wide_switch_rows * experts else 16
        if rows >= self.bm_large_rows * experts:
            return 128 if self.core == "mma" else 64  # run 10, S=4096: wgmma bm=64 1754 us, bm=128 2233
        return 64 if rows >= self.bm_switch_rows * experts else 16

    def evict_weights(self, bm: int, tokens: int, topk: int, experts: int) -> int:
        """MkParams.l2_evict_w for a launch of `tokens` with m-tile `bm` (see `l2_evict_weights`)."""
        if self.l2_evict_weights != 2:
            return self.l2_evict_weights
        return 1 if 4 * tokens * topk <= 3 * experts * bm else 0

    def combine_tile(self, bm: int, bn: int, tokens: int, topk: int, experts: int) -> int:
        """MkParams.combine_tokens for a launch of `tokens` with m-tile `bm` and `bn` columns (see `combine_tokens`)."""
        if self.combine_tokens:
            return self.combine_tokens
        decode, small, rest = self.AUTO_COMBINE
        if bm == 16:
            return decode
        return small if bm == 128 and bn == 256 and tokens * topk * 2 <= experts * bm else rest

    def combine_tile_min(self) -> int:
        """The smallest combine tile any launch of this config runs (what the combine counters are sized for)."""
        return self.combine_tokens or min(self.AUTO_COMBINE)

    def tail(self, bm: int, bn: int) -> int:
        """MkParams.tail_rows in effect for a launch of m-tile `bm` and `bn` columns (see `tail_rows`; the library
        zeroes it for every other launch, so plans and timelines use this)."""
        wide = bm == 128 and bn == 256 and self.core == "wgmma" and self.tma == 1 and self.overlap == 1
        return self.tail_rows if wide else 0

    def pick_bn(self, bm: int) -> int:
        """Columns per GEMM task for a launch with m-tile `bm`: `bn` where the wide tile exists (wgmma, bm=128),
        else 128 (bn=256 with bm=0 still runs bm=16 decode launches, on 128 columns)."""
        return (self.bn or 128) if bm == 128 and self.core == "wgmma" else 128  # bn 0: not resolved (`resolve`)


def _listed(values: tuple[int, ...]) -> str:
    """The non-zero (not auto) values, as "16, 64 or 128"."""
    v = [str(x) for x in values if x]
    return f"{', '.join(v[:-1])} or {v[-1]}" if len(v) > 1 else "".join(v)


class LaunchConfigs:
    """Which `MegakernelConfig` a launch of S tokens runs: the one installed for S's token bucket (the profile
    ladder's `nearest_bucket`), else `base` (the config the scratch buffers were sized by). A layer whose knobs came
    from stored profiles installs each bucket's profile (`install`), so a decode launch runs the decode bucket's
    tiles, not the tiles tuned for max_tokens. Host-side dict lookups only: CUDA-graph capture is unaffected.

    A bucket's config must fit the base's allocations (`problem`): an m-tile no smaller than the base's smallest
    and a combine tile no smaller than the base's smallest. Split-K's partial buffers are not checked here: the
    layer grows them for any bucket's split (`MegakernelMoE.set_bucket_config`, `split_room`)."""

    def __init__(self, base: MegakernelConfig):
        self.base = base
        self._by_bucket: dict[int, MegakernelConfig] = {}
        self._by_s: dict[int, MegakernelConfig] = {}

    def problem(self, cfg: MegakernelConfig) -> str | None:
        """Why `cfg` cannot run on scratch sized by the base config (None: it can)."""
        b = self.base
        if (cfg.bm or 16) < (b.bm or 16):
            return f"its m-tile bm={cfg.bm or 'auto'} is below the bm={b.bm} the scratch buffers were sized for"
        if cfg.combine_tile_min() < b.combine_tile_min():
            return (f"its combine tile ({cfg.combine_tile_min()} tokens) is below the {b.combine_tile_min()} the "
                    "scratch buffers were sized for")
        return None

    def install(self, bucket: int, cfg: MegakernelConfig) -> None:
        self._by_bucket[bucket] = cfg
        self._by_s.clear()

    def for_tokens(self, s: int) -> MegakernelConfig:
        cfg = self._by_s.get(s)
        if cfg is None:
            if self._by_bucket:
                from moetune.runtime.profile_record import nearest_bucket

                cfg = self._by_bucket.get(nearest_bucket(s), self.base)
            else:
                cfg = self.base
            self._by_s[s] = cfg
        return cfg


def bucket_tokens(bucket: int, max_tokens: int) -> tuple[int, int] | None:
    """The token counts S in 1..max_tokens whose launches `LaunchConfigs.for_tokens` gives `bucket`'s config, as
    (first, last): S whose ladder `nearest_bucket` is `bucket` (an interval: nearest_bucket never decreases with S).
    None where no S of the layer gets it (a bucket off the ladder, or all its S above max_tokens)."""
    from moetune.runtime.profile_record import TOKEN_BUCKETS, nearest_bucket

    if bucket not in TOKEN_BUCKETS or max_tokens < 1:
        return None
    rung = TOKEN_BUCKETS.index(bucket)

    def first_at_or_past(i: int) -> int:  # the least S in 1..max_tokens + 1 whose rung is >= i
        lo, hi = 1, max_tokens + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if TOKEN_BUCKETS.index(nearest_bucket(mid)) >= i:
                hi = mid
            else:
                lo = mid + 1
        return lo

    first, past = first_at_or_past(rung), first_at_or_past(rung + 1)
    return (first, past - 1) if first < past else None


def split_room(cfg: MegakernelConfig, max_tiles: int) -> tuple[int, int]:
    """(m-tiles, parts per slot) of the split-K partial buffer that launches of `cfg` use on a layer of `max_tiles`
    m-tiles: MkParams.sk_max_tiles and the kernel's slot stride, max(split_k1, split_k2) (csrc/megakernel/mk_moe.cu,
    the split-K task). (0, 1) where its launches never split: split-K runs in bm=16 launches only. A buffer of
    t m-tiles x p parts holds any launch whose room is within both, since the kernel takes both per launch."""
    if (cfg.split_k1 == 1 and cfg.split_k2 == 1) or (cfg.bm or 16) != 16:
        return 0, 1
    return min(cfg.split_max_tiles, max_tiles), max(cfg.split_k1, cfg.split_k2)


# The library's host-side limits (csrc/megakernel/mk_moe.cu, check_params), mirrored so that a layer that cannot
# run is refused (or falls back) when it is built, not at its first forward.
MAX_EXPERTS = 512  # 32 lanes x MAXE_PER_LANE
MAX_TOPK = 16  # MAXK
BK, BN = 64, 128  # k elements per weight plane / columns per n-block
MAX_NFIELD = 4095  # a task word's n-field: n-blocks x split-K parts
MAX_TILES = 1 << 20  # m-tiles (exclusive)
MAX_CTILES = 1 << 16  # combine tiles (inclusive)
MAX_EXPERT_TILES = 1 << 16  # one expert's m-tiles (inclusive): a task word's 16-bit m-tile field (mk_index.h)
MAX_ROWS = 1 << 30  # S_cap x topk


def limits_problem(model: Any, max_tokens: int | None = None, config: MegakernelConfig | None = None) -> str | None:
    """Why the megakernel library would refuse a layer of `model`'s shape (with `max_tokens` and a
    `MegakernelConfig`, where given), or None. Host arithmetic only: no torch, no library. The pipeline depth
    against shared memory (`stages too deep`) needs the library; `MegakernelMoE` asks it when it is built."""
    h, i, e, k = model.hidden, model.intermediate, model.experts, model.topk
    if h % BN or i % BK:
        return f"it needs hidden % 128 == 0 and intermediate % 64 == 0, got hidden {h}, intermediate {i}"
    if not 1 <= e <= MAX_EXPERTS:
        return f"it takes 1..{MAX_EXPERTS} experts, the model has {e}"
    if not 1 <= k <= min(MAX_TOPK, e):
        return f"it takes topk in 1..min({MAX_TOPK}, experts) = 1..{min(MAX_TOPK, e)}, the model has topk {k}"
    cfg = config.resolve(h, i) if config is not None else None
    if cfg is not None:
        if h % (BK * cfg.split_k1) or i % (BK * cfg.split_k2):
            return (f"split-K parts must be multiples of 64 (hidden % (64 x split_k1) and intermediate % "
                    f"(64 x split_k2) == 0), got hidden {h} with split_k1 {cfg.split_k1}, intermediate {i} with "
                    f"split_k2 {cfg.split_k2} (the knob mk_split_k)")
        if 2 * i // BN * cfg.split_k1 > MAX_NFIELD or h // BN * cfg.split_k2 > MAX_NFIELD:
            return (f"n-blocks x split-K parts must be <= {MAX_NFIELD}, got {2 * i // BN} x {cfg.split_k1} (GEMM1) "
                    f"and {h // BN} x {cfg.split_k2} (GEMM2) (the knob mk_split_k)")
        if cfg.bn == 256 and (h % 256 or (2 * i) % 256):
            return f"bn=256 (the knob mk_bn) needs hidden and 2 x intermediate to be multiples of 256, got {h}, {2 * i}"
    if max_tokens is not None:
        if max_tokens * k > MAX_ROWS:
            return f"max_tokens x topk must be <= 2^30, got {max_tokens} x {k}"
        # the scratch sizes MegakernelMoE derives (sum_e ceil(c_e / bm) <= S*K/bm + E with the smallest m-tile)
        c = cfg if cfg is not None else MegakernelConfig()
        tiles = e + -(-max_tokens * k // (c.bm or 16))
        ctiles = -(-max_tokens // c.combine_tile_min())
        if tiles >= MAX_TILES or ctiles > MAX_CTILES:
            return (f"too many tiles for max_tokens={max_tokens}: {tiles} m-tiles (limit {MAX_TILES - 1}) and "
                    f"{ctiles} combine tiles (limit {MAX_CTILES}); lower max_tokens")
        # a task word numbers an m-tile within its expert in 16 bits; more would spill into the expert's bits. An
        # expert's row list holds max_tokens rows (lists [E, max_tokens]; the routing kernels pick distinct experts
        # per token): the library's bound (mk_index.h: expert_tiles_max, checked in check_params), not max_tokens x
        # topk, since given routing that repeats an expert within a token is refused on the host (forward_routed's
        # check) and its rows past the list are dropped by k_lists (error 7), so no expert holds more.
        one = -(-max_tokens // (c.bm or 16))
        if one > MAX_EXPERT_TILES:
            return (f"too many m-tiles for one expert with max_tokens={max_tokens}: an expert's {max_tokens} rows "
                    f"make up to {one} m-tiles of bm={c.bm or 16}, more than the {MAX_EXPERT_TILES} a task word's "
                    f"16-bit m-tile field numbers; lower max_tokens{' or raise bm' if (c.bm or 16) < 128 else ''}")
    return None


def model_problem(model: Any) -> str | None:
    """Why the megakernel can run no layer of `model` whatever its setting (its dtype, its shape: `limits_problem`
    without max_tokens or a config), or None. The one rule a megakernel trial refuses a model by and the bring-up
    leaves a model out of its megakernel stage by (it ran every trial of such a model to fail)."""
    if model.dtype != "bfloat16":
        # a trial times bf16 weights whatever the model says, and the runtime runs the megakernel for bf16 layers only
        return f"it runs bfloat16 activations, the model's are {model.dtype}"
    return limits_problem(model)
