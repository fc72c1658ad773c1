"""CPU tests of the megakernel: its config, the Python model of its scheduler, its C ABI mirror and build.

The scheduler model (`runtime/megakernel/schedule.py`) shares its formulas with the CUDA scheduler; the
GPU tests compare the kernel's own task counts with `plan`. Here: task counts, dependency release order
(asserted on every task start inside `simulate`), empty experts, all tokens to one expert, the timeout path.
"""

from __future__ import annotations

import ctypes
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from moetune.runtime.megakernel import ConfigError, MegakernelConfig
from moetune.runtime.megakernel import schedule as sch

H, INTER = 256, 128  # N1 = 2, N2 = 2: small graphs that still have several n-blocks


def _routing(s: int, e: int, k: int, *, mode: str, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if mode == "one":  # every token's first slot to expert 0, the rest to 1..k-1
        return [list(range(k)) for _ in range(s)]
    weights = [1.0] * e if mode == "uniform" else [1.0 / (x + 1) ** 1.2 for x in range(e)]
    out = []
    for _ in range(s):
        sel: list[int] = []
        while len(sel) < k:
            x = rng.choices(range(e), weights)[0]
            if x not in sel:
                sel.append(x)
        out.append(sel)
    return out


# ---- config ---------------------------------------------------------------------------------------------
def test_config_defaults_and_parse():
    c = MegakernelConfig()
    assert c.bm == 0 and c.stages == 0
    assert c.pick_stages(16, 128, 8, 128) == 3 and c.pick_stages(16, 1, 8, 128) == 6
    assert c.pick_stages(64, 1024, 8, 128) == 4 and MegakernelConfig(stages=5).pick_stages(128, 1, 8, 128) == 5
    assert MegakernelConfig(core="mma").pick_stages(64, 1024, 8, 128) == 3
    p = MegakernelConfig.parse("bm=16, stages=3,timeout_ms=250")
    assert (p.bm, p.stages, p.timeout_ms) == (16, 3, 250.0)
    assert MegakernelConfig.parse("") == c
    assert MegakernelConfig.from_dict(p.to_dict()) == p


@pytest.mark.parametrize(
    ("text", "field"),
    [("bm=32", "bm"), ("stages=1", "stages"), ("stages=-1", "stages"), ("stages=13", "stages"), ("combine_tokens=-1", "combine_tokens"),
     ("timeout_ms=0", "timeout_ms"), ("ctas_per_sm=-1", "ctas_per_sm"), ("bogus=1", "bogus"), ("stages=x", "stages"),
     ("stages", "expected name=value")],
)
def test_config_errors_name_the_field(text, field):
    with pytest.raises(ConfigError, match=field):
        MegakernelConfig.parse(text)


def test_config_text_giving_a_field_twice_is_refused():
    """`parse` took the last of two values for one field without a word ("bm=16,stages=4,bm=64" ran bm=64 under a
    label that says 16), where Knobs.parse refuses a knob given twice: refused the same way now."""
    with pytest.raises(ConfigError, match=r"megakernel config: bm given twice in 'bm=16,stages=4, bm=64'"):
        MegakernelConfig.parse("bm=16,stages=4, bm=64")
    assert MegakernelConfig.parse("bm=16,stages=4,").bm == 16  # an empty item is still nothing


def test_config_vocabulary_is_the_knobs():
    """MegakernelConfig takes exactly the values the knobs take (runtime/knobs.py), at both ends of every range: a
    knob value the config refused would fail a tuned profile at layer construction, and a config value no knob
    reaches is a setting the tuner cannot search."""
    from moetune.runtime import knobs as K

    assert MegakernelConfig.CORES == K.MK_CORES
    for field, values in (("bm", K.MK_BMS), ("bn", K.MK_BNS)):
        for v in range(0, 513):
            extra = {"core": "wgmma", "bm": 128} if field == "bn" and v == 256 else {}
            try:
                MegakernelConfig(**{**extra, field: v})
            except ConfigError:
                assert v not in values, (field, v)
            else:
                assert v in values, (field, v)
    for field, knob, lo, hi in (("stages", "mk_stages", 0, K.MK_MAX_STAGES),
                                ("ctas_per_sm", "mk_ctas_per_sm", 0, K.MK_MAX_CTAS_PER_SM),
                                ("processor_ctas", "mk_processor_ctas", 0, K.MK_MAX_PROCESSOR_CTAS),
                                ("combine_tokens", "mk_combine_tokens", 0, K.MK_MAX_COMBINE_TOKENS),
                                ("split_k1", "mk_split_k", 1, K.MK_MAX_SPLIT_K),
                                ("split_k2", "mk_split_k", 1, K.MK_MAX_SPLIT_K)):
        assert getattr(MegakernelConfig.from_knobs(K.Knobs(engine="megakernel", **{knob: hi})), field) == hi
        with pytest.raises(ConfigError, match=field):
            MegakernelConfig(**{field: hi + 1})
        with pytest.raises(ConfigError, match=field):
            MegakernelConfig(**{field: lo - 1})


def test_config_type_errors():
    with pytest.raises(ConfigError, match="stages"):
        MegakernelConfig(stages=3.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="bm"):
        MegakernelConfig(bm=True)  # type: ignore[arg-type]


def test_pick_bm():
    c = MegakernelConfig()
    assert c.pick_bm(1, 8, 128) == 16
    assert c.pick_bm(128, 8, 128) == 16  # 8 rows per expert
    assert c.pick_bm(1024, 8, 128) == 64
    assert c.pick_bm(4096, 8, 128) == 64  # wgmma (the default core): bm=64 beat 128 at S=4096 in run 10
    assert MegakernelConfig(core="mma").pick_bm(4096, 8, 128) == 128
    assert MegakernelConfig(bm=64).pick_bm(1, 8, 128) == 64


def test_the_mk_bm_help_says_what_auto_picks():
    """The knob's help (and the settings doc, made from it) said "64/128 once the rows per expert reach 32/128"; the
    default core (wgmma) never picks 128 that way, and the auto wide tile (the Qwen3-30B shape's) runs 128 from 10
    rows per expert. Each rule it states now is pick_bm's (E=1, topk=1: S is the rows per expert)."""
    from moetune.runtime.knobs import KNOB_DOCS

    text = KNOB_DOCS["mk_bm"][1]
    c = MegakernelConfig()
    wide, narrow = c.resolve(2048, 768), c.resolve(2880, 2880)  # bn auto: 256, 128
    assert (wide.bn, narrow.bn) == (256, 128)
    assert f"16 below {c.wide_switch_rows} rows, else 128" in text
    assert [wide.pick_bm(r, 1, 1) for r in (c.wide_switch_rows - 1, c.wide_switch_rows, 4096)] == [16, 128, 128]
    assert f"16 below {c.bm_switch_rows} rows, else 64 (128 from {c.bm_large_rows} rows with mk_core=mma)" in text
    assert [narrow.pick_bm(r, 1, 1) for r in (c.bm_switch_rows - 1, c.bm_switch_rows, 4096)] == [16, 64, 64]
    mma = MegakernelConfig(core="mma").resolve(2048, 768)
    assert [mma.pick_bm(r, 1, 1) for r in (c.bm_large_rows - 1, c.bm_large_rows)] == [64, 128]
    settings = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    assert text in settings


# ---- the scheduler model ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bm", [16, 64, 128])
@pytest.mark.parametrize(("s", "mode"), [(1, "uniform"), (7, "zipf"), (100, "uniform"), (300, "zipf"), (50, "one")])
def test_plan_counts(s, mode, bm):
    e, k = 16, 4
    idx = _routing(s, e, k, mode=mode, seed=s)
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=16)
    counts = Counter(x for row in idx for x in row)
    tiles = sum(-(-counts[x] // bm) for x in range(e))
    assert p.n_tiles == tiles and p.n1 == 2 and p.n2 == 2
    assert p.n_ctiles == -(-s // 16)
    assert p.nc == 4  # H = 256: 32 chunks of 8 columns, 4 blocks
    assert p.total == tiles * 4 + p.n_ctiles * p.nc
    assert sum(len(r) for r in p.rows) == s * k
    assert sum(p.ctile_target) == s * k * p.n2
    assert len(p.gemm1_tasks()) == tiles * p.n1
    # empty experts own no tile
    for x in range(e):
        assert (p.tile_base[x + 1] - p.tile_base[x]) == -(-counts[x] // bm)


@pytest.mark.parametrize("procs", [1, 3, 40])
@pytest.mark.parametrize(("s", "mode"), [(1, "uniform"), (37, "zipf"), (200, "uniform"), (64, "one")])
def test_simulation_runs_every_task_once_in_dependency_order(s, mode, procs):
    e, k, bm, ct = 16, 4, 16, 8
    idx = _routing(s, e, k, mode=mode, seed=7 * s + procs)
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=ct)
    r = sch.simulate(p, processors=procs, bm=bm, topk=k, combine_tokens=ct, seed=procs)
    assert r.error == 0
    assert r.published == p.total
    assert len(r.executed) == p.total
    kinds = Counter(t.kind for t in r.executed)
    assert kinds == {sch.GEMM1: p.n_tiles * p.n1, sch.GEMM2: p.n_tiles * p.n2, sch.COMBINE: p.n_ctiles * p.nc}
    assert len(set(r.executed)) == p.total  # no task twice
    # release order: a tile's GEMM2s complete after all its GEMM1s; every token's combine comes last for it
    pos = {t: i for i, t in enumerate(r.executed)}
    for tile in range(p.n_tiles):
        g1 = [pos[t] for t in r.executed if t.kind == sch.GEMM1 and t.tile == tile]
        g2 = [pos[t] for t in r.executed if t.kind == sch.GEMM2 and t.tile == tile]
        assert max(g1) < min(g2)


def test_all_tokens_to_one_expert_many_tiles():
    e, k, bm = 16, 1, 16
    idx = [[3] for _ in range(100)]
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=16)
    assert p.n_tiles == 7 and p.tile_base[3] == 0 and p.tile_base[4] == 7 and p.tile_base[e] == 7
    assert {p.tile_expert(t) for t in range(7)} == {3}
    r = sch.simulate(p, processors=5, bm=bm, topk=k, combine_tokens=16)
    assert r.error == 0 and len(r.executed) == p.total


def test_stalled_tile_times_out_without_hanging():
    e, k, bm = 16, 4, 16
    idx = _routing(64, e, k, mode="uniform", seed=3)
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=16)
    r = sch.simulate(p, processors=6, bm=bm, topk=k, combine_tokens=16, stall_tile=2, timeout_steps=20)
    assert r.error in (sch.ERR_SCHED_TIMEOUT, sch.ERR_PROC_TIMEOUT)
    assert len(r.executed) < p.total
    assert not any(t.kind == sch.GEMM2 and t.tile == 2 for t in r.executed)
    assert r.steps < 10_000  # ended by the timeout, not by the step cap


@pytest.mark.parametrize("procs", [1, 3, 40, 300])
@pytest.mark.parametrize(("s", "mode", "sk"), [(1, "uniform", 2), (7, "zipf", 4), (200, "uniform", 1), (64, "one", 1)])
def test_publish_all_runs_every_task_once_in_dependency_order(s, mode, sk, procs):
    """publish_all: every task in the queue at launch, processors wait for inputs themselves. Whatever the number of
    processors (1 included: it must never hold a slot that waits on a later one), every task runs once, each
    after its inputs (asserted at each start), without a timeout."""
    e, k, bm, ct = 16, 4, 16, 8
    idx = _routing(s, e, k, mode=mode, seed=11 * s + procs)
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=ct, split_k1=sk, split_k2=sk,
                 split_max_tiles=16)
    order = p.all_tasks()
    assert len(order) == p.total
    kinds = [t.kind for t in order]
    assert kinds == sorted(kinds)  # GEMM1s, then GEMM2s, then COMBINEs: a task waits only on earlier slots
    r = sch.simulate(p, processors=procs, bm=bm, topk=k, combine_tokens=ct, seed=procs, publish_all=True)
    assert r.error == 0
    assert sorted(r.executed, key=order.index) == order


def test_publish_all_stalled_tile_reports_input_timeout():
    e, k, bm = 16, 4, 16
    idx = _routing(64, e, k, mode="uniform", seed=3)
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=16)
    r = sch.simulate(p, processors=6, bm=bm, topk=k, combine_tokens=16, stall_tile=2, timeout_steps=20,
                     publish_all=True)
    assert r.error == sch.ERR_INPUT_TIMEOUT and r.error_where == 2
    assert not any(t.kind == sch.GEMM2 and t.tile == 2 for t in r.executed)
    assert r.steps < 10_000


# Launch shapes check_params takes that the simulations above leave out: bm 64 / 128 on 128 columns, top-k = E (16)
# and E = 1, combine tiles of 1 token, of a count that does not divide S and of more tokens than S, S = 0, split-K and
# tail rows next to a stalled m-tile. (experts, topk, S, bm, bn, tail, combine_tokens, split_k: 1 or (k1, k2) within
# check_params' multiples of 64, hidden, intermediate)
_EDGE_SHAPES = [
    (16, 4, 90, 64, 128, 0, 8, 1, H, INTER),
    (16, 4, 300, 128, 128, 0, 16, 1, H, INTER),
    (16, 16, 21, 16, 128, 0, 4, 1, H, INTER),
    (1, 1, 40, 16, 128, 0, 3, 1, H, INTER),
    (8, 2, 33, 64, 128, 0, 1, 1, 384, 192),
    (8, 2, 33, 16, 128, 0, 512, (2, 2), H, INTER),
    (4, 2, 0, 16, 128, 0, 8, 1, H, INTER),
    (16, 4, 3, 16, 128, 0, 2, (4, 2), H, INTER),
    (4, 2, 140, 128, 256, 16, 8, 1, 512, 256),  # (tail shapes: every token to experts 0..K-1) 12 rows ride along
    (4, 3, 135, 128, 256, 5, 16, 1, 512, 256),  # 7 rows past 128, more than the tail: an m-tile of their own
]


@pytest.mark.parametrize(("shape", "publish_all", "stall"),
                         [(x, pa, st) for x in _EDGE_SHAPES for pa in (False, True) for st in (-1, 0)
                          if not (pa and x[4] == 256) and not (st >= 0 and x[2] == 0)])
def test_simulation_edge_shapes(shape, publish_all, stall):
    """Every shape above, both queue disciplines (publish_all: the mma-core tiles only, so not the wide tile), 1, 3
    and 300 processors: without a stall every task runs once, each after its inputs (asserted at each start), and the
    launch ends without an error; with m-tile 0 stalled (where S > 0) the launch ends by its timeout, with the error
    the kernel reports for that discipline, and no GEMM2 of the stalled m-tile runs."""
    e, k, s, bm, bn, tail, ct, sk, hid, inter = shape
    idx = _routing(s, e, k, mode="one" if tail or k == e else "uniform", seed=s + e)
    sk1, sk2 = sk if isinstance(sk, tuple) else (sk, sk)
    assert hid % (64 * sk1) == 0 and inter % (64 * sk2) == 0  # what check_params takes
    p = sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=bm, combine_tokens=ct, split_k1=sk1, split_k2=sk2,
                 split_max_tiles=64, bn=bn, tail=tail)
    assert (p.ks1, p.ks2) == (sk1, sk2)  # the launch splits as asked (bm = 16, m-tiles within the buffer)
    assert not tail or p.n_tiles == (k if s % bm <= tail else 2 * k)
    for procs in (1, 3, 300):
        r = sch.simulate(p, processors=procs, bm=bm, topk=k, combine_tokens=ct, seed=procs, stall_tile=stall,
                         timeout_steps=30, publish_all=publish_all)
        if stall < 0:
            assert r.error == 0, (procs, r.error, r.error_where)
            assert len(r.executed) == len(set(r.executed)) == p.total and r.published == p.total
        else:
            want = (sch.ERR_INPUT_TIMEOUT,) if publish_all else (sch.ERR_SCHED_TIMEOUT, sch.ERR_PROC_TIMEOUT)
            assert r.error in want and r.steps < 10_000, (procs, r.error)
            assert not any(t.kind == sch.GEMM2 and t.tile == stall for t in r.executed)


def test_kernel_source_mirrors_scheduler_rules():
    """The rules `simulate` runs are the kernel's, line for line: no CPU test compiles scheduler() or wait_slot (the
    host simulator in csrc/sim/ is the proxy engine's), so a kernel edit the model does not follow would leave every
    simulation test passing on rules the GPU no longer runs. Pinned here: the task kinds and error codes, the release
    thresholds (v == N1 outside the stalled tile; a combine tile at ntok x K x N2), the progress rule of the
    scheduler's timeout (any released entry or any change of the unreleased counters' sum), the processors' exit
    (TOTAL = total + 1, slot >= total) and their timeout from the claim, publish_all's mma-only queue."""
    from moetune.runtime.megakernel import _lib

    hdr = _header()
    for name, value in (("MK_TASK_GEMM1", sch.GEMM1), ("MK_TASK_GEMM2", sch.GEMM2), ("MK_TASK_COMBINE", sch.COMBINE),
                        ("MK_ERR_SCHED_TIMEOUT", sch.ERR_SCHED_TIMEOUT), ("MK_ERR_PROC_TIMEOUT", sch.ERR_PROC_TIMEOUT),
                        ("MK_ERR_INPUT_TIMEOUT", sch.ERR_INPUT_TIMEOUT)):
        assert re.search(rf"\b{name} = (\d+)", hdr).group(1) == str(value), name
    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    sched = src[src.index("__device__ void scheduler("):src.index("// ---- the persistent kernel")]
    for line in ("st_release(&p.ctl[MK_CTL_TOTAL], (int)total + 1);",
                 "const bool all_now = p.publish_all && !T::WG;",
                 "rd[u] = un[u] && v[u] == N1 && tile != (int)p.stall_tile;",
                 "const int ntok = min((int)p.S, (ct + 1) * CT) - ct * CT;",
                 "rd[u] = un[u] && v[u] == ntok * K * N2;",
                 "if (got || sum != seen) {",
                 "report(p, MK_ERR_SCHED_TIMEOUT, released, need, (int64_t)waited);"):
        assert line in sched, line
    # the sum of a sweep is the unreleased entries' counters only (released ones load as 0)
    lb = src[src.index("void load_batch("):]
    lb = lb[:lb.index("\n}\n")]
    assert "un[u] = i < n && rel[i] != epoch;" in lb and "v[u] = un[u] ? ld_relaxed(" in lb
    ws = src[src.index("uint64_t wait_slot("):]
    ws = ws[:ws.index("\n}\n")]
    # the timer starts at the claim (not at the last progress), the published word is taken before the total is read
    assert ws.index("const uint64_t since = gtime();") < ws.index("for (unsigned n = 0;; ++n)")
    assert ws.index("ld_acquire(&p.q_flag[i]) == epoch") < ws.index("if (tot > 0 && i >= tot - 1) break;")
    assert "report(p, MK_ERR_PROC_TIMEOUT, i, tot - 1, (int64_t)waited);" in ws


def test_simulation_checks_dependencies():
    """The model's own assertion fires if a GEMM2 were released early (so the order test can fail)."""
    idx = _routing(20, 16, 4, mode="uniform", seed=1)
    p = sch.plan(idx, experts=16, hidden=H, intermediate=INTER, bm=16, combine_tokens=16)
    bad = sch.Plan(p.n1 - 1, *list(vars(p).values())[1:])  # claims one GEMM1 n-block fewer than published
    with pytest.raises(AssertionError, match="GEMM2"):
        sch._check_ready(bad, sch.Task(sch.GEMM2, 0, 0, 0, 0), [p.n1 - 2] * p.n_tiles, set(), 4, 16, 16)


# ---- the C ABI mirror and the build command -----------------------------------------------------------------
def _header() -> str:
    from moetune.runtime.megakernel import _lib

    return (_lib.source_dir() / "mk_api.h").read_text()


def test_ctypes_struct_matches_header():
    from moetune.runtime.megakernel import _lib

    body = re.search(r"typedef struct MkParams \{(.*?)\} MkParams;", _header(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names: list[str] = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        first, *rest = decl.split(",")
        names += [re.findall(r"\w+", first)[-1], *(r.strip() for r in rest)]
    assert names == [f[0] for f in _lib.MkParams._fields_]
    assert re.search(r"#define MK_ABI_VERSION (\d+)", _header()).group(1) == str(_lib.ABI_VERSION)


def test_ctypes_signatures_match_header():
    """Every exported function's argument count and 64-bit integer positions match mk_api.h (mk_occupancy
    gained `tma` in ABI 7: a stale mirror would pass the per_sm pointer as tma)."""
    from ctypes import c_int64

    from moetune.runtime.megakernel import _lib

    hdr = re.sub(r"//[^\n]*", "", _header())
    for name, (_res, args) in _lib.SIGNATURES.items():
        m = re.search(rf"\b{name}\(([^)]*)\);", hdr)
        assert m, name
        params = [a.strip() for a in m.group(1).split(",") if a.strip() and a.strip() != "void"]
        assert len(params) == len(args), name
        for decl, ct in zip(params, args, strict=True):
            assert (decl.startswith("int64_t") and "*" not in decl) == (ct is c_int64), f"{name}: {decl}"


def test_build_command_shape(tmp_path):
    from moetune.runtime.megakernel import _lib

    cmd = _lib.build_command("/x/nvcc", tmp_path / "lib.so")
    assert cmd[0] == "/x/nvcc"
    for flag in ("-gencode=arch=compute_90a,code=sm_90a", "-shared", "-O3", "-std=c++17", "-cudart=static"):
        assert flag in cmd
    assert [Path(c).name for c in cmd if c.endswith(".cu")] == ["mk_moe.cu"]
    k1 = _lib.build_key("nvcc 13.0")
    assert k1 == _lib.build_key("nvcc 13.0") != _lib.build_key("nvcc 12.9")


@pytest.fixture(scope="module")
def fresh_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """libmoetune_moe.so built once for this module from an empty cache (MOETUNE_CACHE in a new folder): the two tests
    that need the real library each built it (51-70 s of nvcc apiece on the 2-core CI machine)."""
    from moetune.runtime import csrc_build as cb
    from moetune.runtime.megakernel import _lib

    if cb.find_nvcc() is None:
        pytest.skip("no nvcc")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOETUNE_CACHE", str(tmp_path_factory.mktemp("mk-cache")))
        return _lib.build()


@pytest.mark.slow
def test_library_compiles(fresh_library: Path) -> None:
    assert fresh_library.exists() and fresh_library.stat().st_size > 0


# ---- one expert's m-tiles: the task word's 16-bit m-tile field, bounded by check_params and limits_problem -------
def _expert_tile_model(bm: int):
    from moetune.runtime.shapes import ModelShape

    # combine tiles of 2 x bm tokens: no other limit binds before one expert's m-tiles do. topk 2: a bound that
    # counted max_tokens x topk rows on one expert (as limits_problem did) would refuse half the S_cap the library takes
    return (ModelShape(name="t", hidden=128, intermediate=64, experts=4, topk=2),
            MegakernelConfig(bm=bm, combine_tokens=2 * bm))


def test_expert_tile_bound_source_mirrors_limits_problem():
    """limits_problem's one-expert bound is check_params': the same limit (mk_index.h MAX_EXPERT_TILES = the m-tile
    field's range, round-tripped by test_index_math_host_compiled) on the same count, ceil(rows of a list / bm)."""
    from moetune.runtime.megakernel import _lib
    from moetune.runtime.megakernel import config as mk_config

    idx = (_lib.source_dir() / "mk_index.h").read_text()
    m = re.search(r"constexpr int64_t MAX_EXPERT_TILES = 1 << (\d+);", idx)
    assert m and 1 << int(m.group(1)) == mk_config.MAX_EXPERT_TILES
    assert "MK_HD int t_mtile(uint64_t w) { return (int)((w >> 32) & 0xffff); }" in idx  # 16 bits
    assert "MK_HD int64_t expert_tiles_max(int64_t s_cap, int64_t bm) { return (s_cap + bm - 1) / bm; }" in idx
    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    body = re.search(r"\nint check_params\(const MkParams\* p\) \{(.*?)\n\}", src, re.S).group(1)
    assert "if (!p->decode && mkidx::expert_tiles_max(p->S_cap, p->bm) > mkidx::MAX_EXPERT_TILES)" in body
    for bm in (16, 64, 128):  # S_cap = max_tokens: the last that fits, and one more
        model, cfg = _expert_tile_model(bm)
        assert mk_config.limits_problem(model, mk_config.MAX_EXPERT_TILES * bm, cfg) is None
        why = mk_config.limits_problem(model, mk_config.MAX_EXPERT_TILES * bm + 1, cfg)
        assert why is not None and f"{mk_config.MAX_EXPERT_TILES + 1} m-tiles of bm={bm}" in why, why


@pytest.mark.slow
def test_expert_tile_bound_library_agrees_with_limits_problem(fresh_library: Path) -> None:
    """The built library's check_params refuses exactly the launches limits_problem refuses: S_cap = 65536 x bm
    passes, one row more does not (its message names the limit), at each bm; a decode launch forms no m-tiles and
    passes. No GPU needed: check_params runs first, and a launch of S = 0 returns before any CUDA call."""
    from moetune.runtime.megakernel import _lib
    from moetune.runtime.megakernel import config as mk_config

    lib = _lib.open_library(fresh_library)
    dec_cnt = (ctypes.c_int32 * _lib.DEC_CNT_WORDS)()
    for bm in (16, 64, 128):
        model, cfg = _expert_tile_model(bm)
        for s_cap in (mk_config.MAX_EXPERT_TILES * bm, mk_config.MAX_EXPERT_TILES * bm + 1):
            why = mk_config.limits_problem(model, s_cap, cfg)
            for decode in (0, 1):
                p = _lib.MkParams(S=0, S_cap=s_cap, H=model.hidden, I=model.intermediate, E=model.experts,
                                  K=model.topk, bm=bm, stages=4, combine_tokens=cfg.combine_tokens, q_cap=1,
                                  max_tiles=1, max_ctiles=1, grid=2, timeout_ns=10**9, logit_splits_max=1, split_k1=1,
                                  split_k2=1, bn=128, decode=decode, dec_cnt=ctypes.addressof(dec_cnt))
                rc = lib.mk_experts(ctypes.byref(p), None)
                err = lib.mk_last_error().decode()
                if decode or why is None:
                    assert rc == 0, (bm, s_cap, decode, err)
                else:
                    assert rc == 1 and (f"S_cap = {s_cap} rows make up to {mk_config.MAX_EXPERT_TILES + 1} m-tiles "
                                        f"of bm = {bm}") in err and f"S_cap <= {mk_config.MAX_EXPERT_TILES} x bm" in err, err


# ---- the wgmma core and decode split-K (index math on the CPU; the kernels themselves need a GPU) --------------
def test_config_core_and_split_fields():
    c = MegakernelConfig()
    assert (c.core, c.split_k1, c.split_k2) == ("wgmma", 1, 1)  # run 10: wgmma; run 40: no decode split-K
    w = MegakernelConfig.parse("core=mma,split_k1=4,split_k2=1,split_max_tiles=8")
    assert (w.core, w.split_k1, w.split_k2, w.split_max_tiles) == ("mma", 4, 1, 8)
    assert c.tma == 1 and MegakernelConfig.parse("tma=0").tma == 0  # run 11: TMA weight tiles by default
    t = MegakernelConfig.parse("core=wgmma,tma=1")
    assert (t.core, t.tma) == ("wgmma", 1) and MegakernelConfig.from_dict(t.to_dict()) == t
    assert MegakernelConfig.from_dict(w.to_dict()) == w
    assert c.pick_stages(128, 4096, 8, 128) == 4 and w.pick_stages(128, 4096, 8, 128) == 3
    assert w.pick_stages(16, 1, 8, 128) == 6  # bm=16 always runs the mma core


@pytest.mark.parametrize(("text", "field"), [("core=tma", "core"), ("split_k1=0", "split_k1"), ("tma=2", "tma"),
                                             ("tma=-1", "tma"), ("tma=yes", "tma"),
                                             ("split_k2=17", "split_k2"), ("split_max_tiles=0", "split_max_tiles")])
def test_config_core_split_errors(text, field):
    with pytest.raises(ConfigError, match=field):
        MegakernelConfig.parse(text)
    with pytest.raises(ConfigError, match="core"):
        MegakernelConfig(core=1)  # type: ignore[arg-type]


def test_index_math_host_compiled(tmp_path):
    """mk_index.h compiled for the host: the stage tiles are Hopper's 128-byte swizzle, every wgmma descriptor
    (per stage, consumer, k16 slice) addresses exactly what the producer stored, the accumulator fragment
    covers the 64 x 128 tile once in (gate, up) pairs, task words round-trip, split-K parts never overlap; the wide
    tile (bn=256): its four TMA boxes and 256-row B descriptors, and the m64n256 fragment covering 64 x 256 once with
    (gate, up) in registers i and i + 64 of one thread."""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    import subprocess

    from moetune.runtime.megakernel import _lib

    src = Path(__file__).parent / "megakernel" / "index_check.cpp"
    exe = tmp_path / "index_check"
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{_lib.source_dir()}", str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("ok "), res.stdout + res.stderr


def _f32_bits(v: list[float]) -> bytes:
    import struct

    return struct.pack(f"{len(v)}f", *v)


def _fold_f32(parts: list[list[float]]) -> bytes:
    """parts[0] + parts[1] + ... left to right, every add rounded to fp32 (numpy: independent of reduce_parts)."""
    import numpy as np

    acc = np.asarray(parts[0], dtype=np.float32)
    for p in parts[1:]:
        acc = acc + np.asarray(p, dtype=np.float32)
    return acc.tobytes()


def test_split_reduction_is_fixed_order():
    """A split-K slot's parts finish in any order (the scheduler model's own arrival orders, and every permutation);
    the part counting last sums the stored parts in part order 0, 1, .. (mk_moe.cu run_gemm). So the bits are the
    same for every arrival order and are the part-order sum. The partials are chosen so that the order of fp32
    adds shows in the bits: a reduction in arrival order, or in any other fixed order (reversed), would fail here."""
    import itertools

    rng = random.Random(5)
    n = 4
    parts = [[rng.uniform(-1, 1) * 10 ** rng.randint(-3, 3) for _ in range(64)] for _ in range(n)]
    want = _fold_f32(parts)
    # the data are order-sensitive: summed in arrival order the bits would differ between orders, reversed too
    assert len({_fold_f32([parts[i] for i in perm]) for perm in itertools.permutations(range(n))}) > 1
    assert _fold_f32(parts[::-1]) != want
    # arrival orders as the scheduler model runs split tasks (random finish times per seed)
    e, k, bm = 16, 4, 16
    idx = _routing(1, e, k, mode="uniform", seed=1)
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=8, split_k1=n, split_k2=2,
                 split_max_tiles=32)
    orders = set()
    for seed in range(12):
        r = sch.simulate(p, processors=40, bm=bm, topk=k, combine_tokens=8, seed=seed)
        assert r.error == 0
        slots: dict[tuple[int, int, int], list[int]] = {}
        for t in r.executed:
            if t.kind == sch.GEMM1:
                slots.setdefault((t.kind, t.tile, t.nblock), []).append(t.part)
        orders.update(map(tuple, slots.values()))
    assert len(orders) > 1 and all(sorted(o) == list(range(n)) for o in orders)
    for order in orders | set(itertools.permutations(range(n))):
        got = sch.split_slot(((i, parts[i]) for i in order), n)
        assert _f32_bits(got) == want, f"arrival order {order}"
    with pytest.raises(ValueError, match="3 of 4 parts arrived"):
        sch.split_slot(((i, parts[i]) for i in range(3)), n)


@pytest.mark.parametrize(("bm", "tiles_cap", "want"), [(16, 32, (4, 2)), (64, 32, (1, 1)), (16, 2, (1, 1))])
def test_plan_with_split_k(bm, tiles_cap, want):
    e, k = 16, 4
    idx = _routing(3, e, k, mode="uniform", seed=9)  # 12 rows: <= 12 m-tiles
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=16, split_k1=4, split_k2=2,
                 split_max_tiles=tiles_cap)
    assert (p.ks1, p.ks2) == want
    assert p.total == p.n_tiles * (p.n1 * p.ks1 + p.n2 * p.ks2) + p.n_ctiles * p.nc
    g1 = p.gemm1_tasks()
    assert len(g1) == p.n_tiles * p.n1 * p.ks1
    assert len({(t.tile, t.nblock, t.part) for t in g1}) == len(g1)
    assert all(t.parts == p.ks1 and 0 <= t.part < p.ks1 for t in g1)


@pytest.mark.parametrize("procs", [1, 5, 60])
@pytest.mark.parametrize(("s", "mode"), [(1, "uniform"), (5, "zipf"), (4, "one")])
def test_simulation_with_split_k(s, mode, procs):
    e, k, bm, ct = 16, 4, 16, 8
    idx = _routing(s, e, k, mode=mode, seed=11 * s + procs)
    p = sch.plan(idx, experts=e, hidden=H, intermediate=INTER, bm=bm, combine_tokens=ct, split_k1=4, split_k2=2,
                 split_max_tiles=32)
    assert (p.ks1, p.ks2) == (4, 2)
    r = sch.simulate(p, processors=procs, bm=bm, topk=k, combine_tokens=ct, seed=procs)
    assert r.error == 0 and r.published == p.total and len(r.executed) == p.total
    assert len(set(r.executed)) == p.total
    kinds = Counter(t.kind for t in r.executed)
    assert kinds == {sch.GEMM1: p.n_tiles * p.n1 * 4, sch.GEMM2: p.n_tiles * p.n2 * 2, sch.COMBINE: p.n_ctiles * p.nc}
    pos = {t: i for i, t in enumerate(r.executed)}
    for tile in range(p.n_tiles):  # every part of every GEMM1 n-block before any GEMM2 part of the tile
        g1 = [pos[t] for t in r.executed if t.kind == sch.GEMM1 and t.tile == tile]
        g2 = [pos[t] for t in r.executed if t.kind == sch.GEMM2 and t.tile == tile]
        assert len(g1) == p.n1 * 4 and max(g1) < min(g2)


def test_kernel_source_mirrors_split_rule():
    """sk_splits in mk_moe.cu is the rule schedule.splits models (bm = 16, m-tiles within the buffer)."""
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    assert "want > 1 && bm == 16 && n_tiles <= p.sk_max_tiles" in src
    assert "fence.proxy.async.shared::cta" in src and "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in src
    hdr = _header()
    assert re.search(r"#define MK_MAX_SPLITS (\d+)", hdr).group(1) == str(_lib.MAX_SPLITS)
    # every expert counter on its own 128-byte line, and no kernel indexes the packed layout any more
    assert re.search(r"#define MK_COUNT_STRIDE (\d+)", hdr).group(1) == str(_lib.COUNT_STRIDE) == "32"
    # (every append goes through append_row: k_lists and append_pick share its one site; five in all)
    uses = re.findall(r"p\.counts\s*(?:\[|\+)([^\];]*)", src)
    assert len(uses) >= 5 and all(u.strip().endswith("* MK_COUNT_STRIDE") for u in uses), uses
    assert "p.counts[e]" not in src and "&p.counts[" not in src
    assert "MK_CORE_MMA = 0, MK_CORE_WGMMA = 1" in hdr and _lib.CORES == {"mma": 0, "wgmma": 1}


# ---- the COMBINE's L2 discard of y lines (combine_items<8>, MK_Y_L2 bit 2), modelled line by line -------------
def _combine_lines(hidden: int, topk: int, s: int, combine_tokens: int, rule):
    """Every COMBINE task (combine tile ct, column block cb) of a launch of S tokens, as run_combine_part / combine_items
    split it: item i = (token t0 + i // chunks, chunk c0 + i % chunks), read by lane i % 32 of the warp round that
    starts at i - i % 32 (any warp: `first` is a multiple of 32 plus the lane and `stride` a multiple of 32, in
    k_experts and in the overlap kernel's consumer threads alike). Item (t, c) reads 16 bytes of y row t * K + j for
    every slot j. Returns (readers, discards): the 128-byte lines of y (byte address // 128, y 128-byte aligned) ->
    the set of (task, round) that read them, and -> the list of (task, round) whose lane discards them under `rule`."""
    nb = sch.combine_blocks(hidden)
    chunks = hidden // 8 // nb
    readers: dict[int, set] = {}
    discards: dict[int, list] = {}
    for ct in range(-(-s // combine_tokens)):
        t0 = ct * combine_tokens
        t1 = min(s, t0 + combine_tokens)
        for cb in range(nb):
            c0, n = cb * chunks, (t1 - t0) * chunks
            for i0 in range(0, n, 32):
                who = (ct, cb, i0)
                for lane in range(min(32, n - i0)):
                    i = i0 + lane
                    t, c = t0 + i // chunks, c0 + i % chunks
                    disc = rule(topk, c, c0, chunks, lane)
                    for j in range(topk):
                        line = ((t * topk + j) * hidden + c * 8) * 2 // 128
                        readers.setdefault(line, set()).add(who)
                        if disc:
                            discards.setdefault(line, []).append(who)
    return readers, discards


def _old_discard_rule(topk: int, c: int, c0: int, chunks: int, lane: int) -> bool:  # before the fix
    return topk == 8 and c % 8 == 0


@pytest.mark.parametrize("topk", [1, 6, 8, 16])
def test_combine_discards_only_lines_no_one_else_reads(topk):
    """The discard predicate the kernel uses (schedule.combine_discards): over every hidden size the library takes up
    to 4096 (hidden % 128 == 0), combine tiles of 1, 3, 8 and 16 tokens with a partial last tile, a discarded y line
    is read by no task or round but the one that discards it (discard leaves its bytes undefined), each line is
    discarded at most once, and every line one round reads whole is discarded (top-k 8; other top-k discard nothing)."""
    for hidden in range(128, 4097, 128):
        for ct in (1, 3, 8, 16):
            s = ct + ct // 2 + 1
            readers, discards = _combine_lines(hidden, topk, s, ct, sch.combine_discards)
            for line, by in discards.items():
                assert len(by) == 1 and readers[line] == {by[0]}, (hidden, ct, line, by, readers[line])
            if topk != 8:
                assert not discards
            else:
                assert set(discards) == {line for line, r in readers.items() if len(r) == 1}, (hidden, ct)
                if hidden % 256 == 0:  # every line: the y write-back saving stays whole
                    assert set(discards) == set(readers), (hidden, ct)


def test_combine_old_discard_rule_hit_lines_others_read():
    """The rule before the fix (every lane with c % 8 == 0 of a top-k 8 combine) discarded lines that another column
    block's task or the same warp's next round still had to read, for hidden % 256 == 128 (384, 1152, ..: chunks =
    hidden / 32 not a multiple of 8), and none for hidden % 256 == 0, where the fixed rule discards the same lines."""
    for hidden in range(128, 4097, 128):
        readers, old = _combine_lines(hidden, 8, 13, 8, _old_discard_rule)
        bad = [line for line, by in old.items() if readers[line] != {by[0]}]
        if hidden % 256:
            assert bad, hidden
        else:
            assert not bad, hidden
            assert set(old) == set(_combine_lines(hidden, 8, 13, 8, sch.combine_discards)[1]), hidden


def test_kernel_source_mirrors_combine_discard():
    """mk_moe.cu's combine discards under schedule.combine_discards' predicate (top-k 8 = combine_items<8>), and that
    is the only discard in csrc/megakernel."""
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    assert "if (on && (c & 7) == 0 && c - c0 + 8 <= chunks && lane <= 24)" in src
    assert src.count("discard.global") == 1 and "discard.global" not in (_lib.source_dir() / "mk_decode.cuh").read_text()


def test_kernel_source_split_k_acquires_on_thread_0():
    """Split-K's last part acquires on thread 0 right after its count (relaxed atomic + fence), before the barrier
    that hands the other threads the other parts' partials: wait_inputs' order (thread 0's acquire, __syncthreads).
    A fence by every thread after the barrier is no acquire of a read thread 0 made."""
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    k = src.index("atomicAdd(&p.sk_cnt[slot], 1)")
    block = src[k:src.index("sk_index(slot, 0, q,", k)]
    assert block.index("if (last) __threadfence();") < block.index("__syncthreads();")
    assert block.count("__threadfence()") == 1  # none after the barrier


# ---- the wgmma core's stage pipeline (full/empty mbarriers), modelled step by step ----------------------------
def _run_actors(actors: list[list[tuple]], ready, apply, policy: str | int) -> str | None:
    """Step actors (lists of ops) until all are done: 'deadlock at ...' when none can move, an apply() error, or
    None. `policy`: 'first' / 'last' movable actor, or a random seed."""
    pos = [0] * len(actors)
    rng = random.Random(policy) if isinstance(policy, int) else None
    while any(pos[a] < len(actors[a]) for a in range(len(actors))):
        movable = [a for a in range(len(actors)) if pos[a] < len(actors[a]) and ready(a, actors[a][pos[a]])]
        if not movable:
            where = ", ".join(str(actors[a][pos[a]]) if pos[a] < len(actors[a]) else "done" for a in range(len(actors)))
            return f"deadlock at {where}"
        a = rng.choice(movable) if rng else (movable[0] if policy == "first" else movable[-1])
        bad = apply(a, actors[a][pos[a]])
        if bad:
            return bad
        pos[a] += 1
    return None


def _stage_pipeline(stages: int, kts: list[int], *, producer: str = "async", early_release: bool = False,
                    policy: str | int = "first") -> str:
    """Run the producer and one consumer warpgroup of run_gemm_wg over tasks of `kts` k-stages each, as the kernel
    orders their barrier operations; 'ok', or 'deadlock at ...' when nothing can move.

    Producer, per stage g: `async` (the kernel since run 41): wait for slot g to be empty, issue the copies; the
    copies land by themselves (a third actor lands issued stages in order: cp.async.mbarrier.arrive.noinc and the
    TMA bytes). `publish_first` (runs 10-40): publish stage g - lag after its copies landed (the producer waits for
    them), then wait for slot g, then copy; the last min(KT, lag) stages after the loop. `first_cut`: wait, copy,
    then publish g - lag. Consumer, per stage: wait full[g], issue the wgmmas, release stage g - 1 (wgmma.wait_group
    1) and the last after the loop; with `early_release` (two consumer warpgroups since run 41) release g itself
    (wait_group 0). Slot g is empty once stage g - stages was released (or g < stages); full once published."""
    lag = stages - 1
    prod: list[tuple] = []
    cons: list[tuple] = []
    land: list[tuple] = []
    it = 0
    for kt_n in kts:
        for kt in range(kt_n):
            g = it + kt
            if producer == "publish_first" and kt >= lag:
                prod.append(("publish", g - lag))
            prod.append(("wait_empty", g))
            if producer == "first_cut" and kt >= lag:
                prod.append(("publish", g - lag))
            if producer == "async":
                prod.append(("issue", g))
                land.append(("land", g))
            cons.append(("wait_full", g))
            if early_release:
                cons.append(("release", g))
            elif kt > 0:
                cons.append(("release", g - 1))
        if producer != "async":
            prod += [("publish", it + kt) for kt in range(max(kt_n - lag, 0), kt_n)]
        if kt_n and not early_release:
            cons.append(("release", it + kt_n - 1))
        for side in (prod, cons):  # the task's closing __syncthreads (after the consumers' last wait)
            side += [("sync_arrive", it), ("sync_wait", it)]
        it += kt_n
    published: set[int] = set()
    issued: set[int] = set()
    released: set[int] = set()
    synced: Counter = Counter()

    def ready(a: int, op: tuple) -> bool:
        kind, g = op
        if kind == "wait_empty":
            return g < stages or g - stages in released
        if kind == "wait_full":
            return g in published
        if kind == "land":
            return g in issued
        if kind == "sync_wait":  # both sides arrived
            return synced[g] == 2
        return True

    def apply(a: int, op: tuple) -> None:
        kind, g = op
        if kind == "publish" or kind == "land":
            published.add(g)
        elif kind == "issue":
            issued.add(g)
        elif kind == "release":
            released.add(g)
        elif kind == "sync_arrive":
            synced[g] += 1

    bad = _run_actors([prod, cons, land], ready, apply, policy)
    if bad:
        return bad
    assert published == released == set(range(it))
    return "ok"


@pytest.mark.parametrize("stages", [2, 3, 4, 6, 9])
def test_wgmma_stage_pipeline_never_deadlocks(stages: int) -> None:
    """Tasks of 1..40 k-stages back to back (GEMM1 of Qwen3-30B has 32, GEMM2 12): every one completes, with one
    consumer warpgroup (release one stage late) and two (release at once), under several interleavings."""
    for kts in ([1], [stages - 1], [stages], [stages + 1], [32], [12], [32, 12, 1, 32], list(range(1, 41))):
        for early in (False, True):
            for policy in ("first", "last", 1, 2):
                assert _stage_pipeline(stages, kts, early_release=early, policy=policy) == "ok", (stages, kts, early)


def test_wgmma_stage_pipeline_model_catches_the_first_cut() -> None:
    """The order the first wgmma cut had (publish after the slot wait) deadlocks once a task has more k-stages
    than `stages`: what hung the first GPU run of the wgmma core; the model sees it. Runs 10-40 published each stage
    before the slot wait (correct); since run 41 the copies arrive by themselves and the kernel has that order."""
    from moetune.runtime.megakernel import _lib

    assert _stage_pipeline(4, [4], producer="first_cut") == "ok"
    assert _stage_pipeline(4, [5], producer="first_cut").startswith("deadlock")
    assert _stage_pipeline(3, [32], producer="first_cut").startswith("deadlock")
    assert _stage_pipeline(3, [32, 12], producer="publish_first") == "ok"
    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    body = src[src.index("void wg_produce("):src.index("void wg_consume(")]  # run_gemm_wg's and the overlap kernel's
    loop = body[body.index("for (int kt = 0; kt < KT; ++kt)"):]
    assert loop.index("mbar_wait(p, bars.empty") < loop.index("cp_async16(") < loop.index("cp_arrive_noinc(bars.full")
    assert "cp_wait(" not in body and "mbar_arrive(bars.full" not in body, "the producer never waits for its copies"
    assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in src
    cons = src[src.index("void wg_consume("):]
    cons = cons[:cons.index("\n}\n")]
    early = cons[cons.index("if constexpr (T::CONSUMERS >= 2) {"):]
    assert early.index("wg_wait<0>();") < early.index("mbar_arrive(bars.empty + 8 * slot);") < early.index("} else {")
    assert cons.index("mbar_wait(p, bars.full") < cons.index("fence_proxy_async();") < cons.index("wgmma_tile(d,")
    assert "report(p, MK_ERR_PIPE_TIMEOUT" in src and "MK_ERR_PIPE_TIMEOUT = 5" in _header()


# ---- the wide tile (bn=256: 128 x 256 per task, wgmma core, bm=128) ---------------------------------------------
def test_config_wide_tile():
    c = MegakernelConfig.parse("core=wgmma,bm=128,bn=256,tma=1")
    assert (c.core, c.bm, c.bn, c.tma) == ("wgmma", 128, 256, 1) and MegakernelConfig.from_dict(c.to_dict()) == c
    d = MegakernelConfig()
    assert d.bn == 0 and d.pick_bn(128) == 128  # auto, not yet resolved against a shape
    r = d.resolve(2048, 768)  # run 12: the wide tile is the default where the shape allows
    assert r.bn == 256 and r.pick_bn(128) == 256 and r.pick_bm(4096, 8, 128) == 128 and r.pick_bm(1, 8, 128) == 16
    assert d.resolve(2880, 2880).bn == 128  # hidden not a multiple of 256
    assert MegakernelConfig(core="mma").resolve(2048, 768).bn == 128
    assert MegakernelConfig(bm=64).resolve(2048, 768).bn == 128 and MegakernelConfig(stages=6).resolve(2048, 768).bn == 128
    assert r.resolve(1, 1) is r  # a decided bn stays
    assert c.pick_bn(128) == 256 and c.pick_stages(128, 4096, 8, 128) == 4  # run 26: 4 stages of 48 KB
    auto = MegakernelConfig.parse("bn=256")
    assert auto.bm == 0 and auto.core == "wgmma"
    # bm=0 with bn=256: the wide tile wherever auto picks a prefill tile, bm=16 (128 columns) for decode sizes
    assert auto.pick_bm(4096, 8, 128) == 128 and auto.pick_bm(1000, 8, 128) == 128
    assert auto.pick_bm(1, 8, 128) == 16 and auto.pick_bn(16) == 128 and auto.pick_bn(128) == 256
    # the wide tile from 10 rows per expert (run 44: S=160 324.1 vs 330.1 us on the decode tile, S=128 a tie)
    assert auto.pick_bm(160, 8, 128) == 128 and auto.pick_bm(159, 8, 128) == 16 and auto.pick_bm(128, 8, 128) == 16
    assert MegakernelConfig(bn=128).pick_bm(256, 8, 128) == 16  # the 128-column tiles keep bm_switch_rows (32)
    assert MegakernelConfig.parse("bm=128,bn=256,stages=2").stages == 2


@pytest.mark.parametrize("text", ["bn=64", "bn=192", "bn=512", "bn=256,core=mma", "bn=256,bm=64", "bn=256,bm=16",
                                  "bn=256,bm=128,stages=5", "bn=x"])
def test_config_wide_tile_errors(text):
    with pytest.raises(ConfigError, match=r"bn|stages"):
        MegakernelConfig.parse(text)


def test_plan_wide_tile_counts_qwen_shape():
    """Qwen3-30B shape: 2I/256 = 6 GEMM1 and H/256 = 8 GEMM2 tasks per m-tile (half the 128-column tile's),
    each on an even n-block; thresholds stay in 128-column n-blocks (N1 = 12, N2 = 16)."""
    e, k, hid, inter = 128, 8, 2048, 768
    idx = _routing(512, e, k, mode="zipf", seed=2)
    narrow = sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=128, combine_tokens=8)
    wide = sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=128, combine_tokens=8, bn=256)
    assert (wide.n1, wide.n2, wide.nblk) == (12, 16, 2) and wide.n_tiles == narrow.n_tiles
    assert wide.ctile_target == narrow.ctile_target
    assert wide.total == wide.n_tiles * (6 + 8) + wide.n_ctiles * wide.nc
    assert narrow.total - wide.total == wide.n_tiles * (6 + 8)
    g1 = wide.gemm1_tasks()
    assert len(g1) == wide.n_tiles * 6 and all(t.nblock % 2 == 0 and t.part == 0 for t in g1)
    assert {(t.tile, t.nblock + q) for t in g1 for q in (0, 1)} == {(t, nb) for t in range(wide.n_tiles) for nb in range(12)}
    g2 = wide.gemm2_tasks(0)
    assert [t.nblock for t in g2] == list(range(0, 16, 2))
    with pytest.raises(ValueError, match="bn=256"):
        sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=64, combine_tokens=8, bn=256)
    with pytest.raises(ValueError, match="bn=256"):
        sch.plan(idx, experts=e, hidden=2048 + 128, intermediate=inter, bm=128, combine_tokens=8, bn=256)
    with pytest.raises(ValueError, match="bn"):
        sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=128, combine_tokens=8, bn=192)


@pytest.mark.parametrize("procs", [1, 7, 300])
@pytest.mark.parametrize(("s", "mode"), [(1, "uniform"), (40, "zipf"), (300, "uniform"), (64, "one")])
def test_simulation_wide_tile(s, mode, procs):
    """Dependency-order simulation with two n-blocks per task: every GEMM2 starts after its m-tile's GEMM1 n-blocks
    are all counted (asserted inside `simulate` at each start), every combine after its rows' GEMM2 n-blocks."""
    e, k, ct, hid, inter = 16, 4, 8, 512, 256  # N1 = N2 = 4 -> 2 wide tasks each
    idx = _routing(s, e, k, mode=mode, seed=13 * s + procs)
    p = sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=128, combine_tokens=ct, bn=256)
    r = sch.simulate(p, processors=procs, bm=128, topk=k, combine_tokens=ct, seed=procs)
    assert r.error == 0 and r.published == p.total and len(r.executed) == p.total
    assert len(set(r.executed)) == p.total
    kinds = Counter(t.kind for t in r.executed)
    assert kinds == {sch.GEMM1: p.n_tiles * 2, sch.GEMM2: p.n_tiles * 2, sch.COMBINE: p.n_ctiles * p.nc}
    pos = {t: i for i, t in enumerate(r.executed)}
    for tile in range(p.n_tiles):
        g1 = [pos[t] for t in r.executed if t.kind == sch.GEMM1 and t.tile == tile]
        g2 = [pos[t] for t in r.executed if t.kind == sch.GEMM2 and t.tile == tile]
        assert len(g1) == 2 and len(g2) == 2 and max(g1) < min(g2)


@pytest.mark.parametrize("ring_fits", [False, True])
@pytest.mark.parametrize("procs", [1, 2, 5, 40])
@pytest.mark.parametrize(("s", "bm", "bn", "tail", "mode"), [(200, 128, 256, 0, "uniform"), (300, 128, 256, 16, "one"),
                                                              (90, 64, 128, 0, "zipf"), (1, 64, 128, 0, "uniform")])
def test_simulation_overlap_claims_ahead(s, bm, bn, tail, mode, procs, ring_fits):
    """The overlap kernel's queue discipline (k_experts_ov, the wgmma tiles' default and the only one with tail rows):
    a CTA's producer claims the next slot as soon as it has issued the current GEMM's stages (at once after a COMBINE
    word, whose slot its consumers free when they read it), while the consumers still run the task, so a CTA holds up
    to three slots (a COMBINE running, the next word ready, one more claimed). `ring_fits`: the GEMMs' k-stages fit
    the stage ring, so the producer is done issuing before the consumers start. No deadlock, every task once, each
    after its inputs (asserted at each start); k_experts' discipline holds one slot at a time."""
    e, k, ct = 16, 4, 8
    hid, inter = (512, 256) if bn == 256 else (H, INTER)
    idx = _routing(s, e, k, mode=mode, seed=17 * s + procs)
    p = sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=bm, combine_tokens=ct, bn=bn, tail=tail)
    r = sch.simulate(p, processors=procs, bm=bm, topk=k, combine_tokens=ct, seed=procs, overlap=True,
                     ring_fits=ring_fits)
    assert r.error == 0 and r.published == p.total
    assert len(r.executed) == len(set(r.executed)) == p.total
    assert r.held_max <= 3 and (r.held_max >= 2 or p.total <= procs)
    plain = sch.simulate(p, processors=procs, bm=bm, topk=k, combine_tokens=ct, seed=procs)
    assert plain.error == 0 and plain.held_max == 1


def test_simulation_overlap_claims_ahead_reaches_three_slots_and_times_out():
    """A CTA does hold three slots (a COMBINE running, the next word, one more claimed) in some launch; a stalled
    m-tile ends the launch by the timeout (the producer's claim or the scheduler), never its GEMM2; publish_all is the
    mma core's, which has no overlap kernel."""
    e, k, ct = 16, 4, 8
    held = 0
    for seed in range(6):
        idx = _routing(120, e, k, mode="uniform", seed=seed)
        p = sch.plan(idx, experts=e, hidden=512, intermediate=256, bm=128, combine_tokens=ct, bn=256)
        for procs in (1, 2, 3):
            r = sch.simulate(p, processors=procs, bm=128, topk=k, combine_tokens=ct, seed=seed, overlap=True,
                             ring_fits=True)
            assert r.error == 0 and len(r.executed) == p.total
            held = max(held, r.held_max)
    assert held == 3
    r = sch.simulate(p, processors=5, bm=128, topk=k, combine_tokens=ct, stall_tile=1, timeout_steps=20, overlap=True)
    assert r.error in (sch.ERR_SCHED_TIMEOUT, sch.ERR_PROC_TIMEOUT) and r.steps < 10_000
    assert not any(t.kind == sch.GEMM2 and t.tile == 1 for t in r.executed)
    with pytest.raises(ValueError, match="publish_all"):
        sch.simulate(p, processors=5, bm=128, topk=k, combine_tokens=ct, overlap=True, publish_all=True)


def test_tail_rows_rule():
    """An expert's last r = count % 128 rows (1 <= r <= tail) ride in its last full m-tile: 129 and 144 rows are one
    m-tile, 145 two; one m-tile's worth or less never changes; the m-tiles cover the rows once, in order."""
    assert [sch.expert_tiles(c, 128, 16) for c in (0, 1, 16, 127, 128, 129, 144, 145, 256, 257, 272, 273)] == \
        [0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert [sch.expert_tiles(c, 128, 0) for c in (129, 144, 145)] == [2, 2, 2]
    assert sch.expert_tiles(129, 128, 1) == 1 and sch.expert_tiles(130, 128, 1) == 2
    for tail in (0, 1, 16):
        for c in range(0, 600):
            n = sch.expert_tiles(c, 128, tail)
            ends = [sch.tile_end(c, mt, 128, tail) for mt in range(n)]
            assert ends == [128 * (mt + 1) for mt in range(n - 1)] + ([c] if n else [])
            assert all(1 <= e - 128 * mt <= 128 + tail for mt, e in enumerate(ends))


@pytest.mark.parametrize("procs", [1, 7, 300])
def test_simulation_tail_rows(procs):
    """The wide tile with tail rows: experts of 129, 144, 145 and 272 rows own 1, 1, 2 and 2 m-tiles, every task runs
    once in dependency order (simulate asserts each start) and the combine tiles see every row (ctile_target)."""
    e, k, ct, hid, inter = 16, 1, 8, 512, 256
    idx = [[0]] * 129 + [[1]] * 144 + [[2]] * 145 + [[3]] * 272 + [[4 + x % 12] for x in range(40)]
    p = sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=128, combine_tokens=ct, bn=256, tail=16)
    plain = sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=128, combine_tokens=ct, bn=256)
    counts = Counter(x for row in idx for x in row)
    assert [p.tile_base[x + 1] - p.tile_base[x] for x in range(4)] == [1, 1, 2, 2]
    assert plain.n_tiles - p.n_tiles == 3  # experts 0, 1 and 3 lose their last m-tile
    assert [len(p.tile_rows(x, mt)) for x in range(4) for mt in range(p.tile_base[x + 1] - p.tile_base[x])] == \
        [129, 144, 128, 17, 128, 144]
    for x in range(e):
        tiles = [p.tile_rows(x, mt) for mt in range(p.tile_base[x + 1] - p.tile_base[x])]
        assert sum(tiles, ()) == p.rows[x] and len(p.rows[x]) == counts[x]
    r = sch.simulate(p, processors=procs, bm=128, topk=k, combine_tokens=ct, seed=procs)
    assert r.error == 0 and len(r.executed) == p.total and len(set(r.executed)) == p.total
    with pytest.raises(ValueError, match="tail"):
        sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=128, combine_tokens=ct, tail=16)  # bn=128
    with pytest.raises(ValueError, match="tail"):
        sch.plan(idx, experts=e, hidden=hid, intermediate=inter, bm=128, combine_tokens=ct, bn=256, tail=17)


def test_config_tail_rows():
    """tail_rows applies to the wide tile by TMA on the overlap kernel only (the library zeroes it elsewhere)."""
    c = MegakernelConfig()
    assert c.tail_rows == 16 and c.tail(128, 256) == 16
    assert c.tail(128, 128) == 0 and c.tail(16, 128) == 0 and c.tail(64, 128) == 0
    assert MegakernelConfig.parse("tma=0").tail(128, 256) == 0
    assert MegakernelConfig.parse("overlap=0").tail(128, 256) == 0
    assert MegakernelConfig.parse("tail_rows=0").tail(128, 256) == 0
    assert MegakernelConfig.parse("tail_rows=4").tail(128, 256) == 4
    with pytest.raises(ConfigError, match="tail_rows"):
        MegakernelConfig.parse("tail_rows=17")
    src = (Path(__file__).parents[1] / "csrc" / "megakernel" / "mk_moe.cu").read_text()
    assert "if (!(T::XR > 0 && p->overlap)) q.tail_rows = 0;" in src
    assert "static constexpr int XR = MK_TAIL_RING && NBLK == 2 && TMA_ ? 16 : 0;" in src


def test_wide_tile_stalled_tile_times_out():
    idx = _routing(200, 16, 4, mode="uniform", seed=4)
    p = sch.plan(idx, experts=16, hidden=512, intermediate=256, bm=128, combine_tokens=8, bn=256)
    r = sch.simulate(p, processors=9, bm=128, topk=4, combine_tokens=8, stall_tile=1, timeout_steps=20)
    assert r.error in (sch.ERR_SCHED_TIMEOUT, sch.ERR_PROC_TIMEOUT) and len(r.executed) < p.total


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_wide_tile_stage_pipeline(stages):
    """The wide tile runs the same producer / consumer barrier protocol at 2..4 stages (48 KB each; 5 do not fit):
    GEMM1 tasks of 2048/64 = 32 k-stages and GEMM2 tasks of 768/64 = 12, back to back, in any mix."""
    rng = random.Random(stages)
    mix = [rng.choice((32, 12)) for _ in range(40)]
    for kts in ([32] * 6 + [12] * 8, mix, [1, 2, 3, 4, 5, 32, 12]):
        for early in (False, True):
            assert _stage_pipeline(stages, kts, early_release=early) == "ok", (stages, kts, early)
    stage, meta, align = 128 * 128 + 256 * 128, 128 * 8 + 256 * 8 + 128 * 4 + 16 + 2 * 8 * 16, 1024
    smem_max = 227 * 1024 - 1024  # SMEM_MAX in mk_moe.cu
    assert stage * 4 + meta + align <= smem_max < stage * 5 + meta + align


def test_kernel_source_wide_tile():
    """The kernel has the wide tile's pieces the CPU checks model: m64n256k16 consumers, two n-blocks counted per
    task, the scheduler's half task count, the bn checks; the ABI mirror carries bn."""
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in src
    assert "red_add(&p.g1done[tile], T::NBLK)" in src and "T::NBLK);" in src
    assert "q.G1 = (int)(2 * p.I / BN) / T::NBLK * q.KS1;" in src and "nf * W" in src
    assert "using WgWideTma = WgTile<128, true, 256>;" in src and "mkidx::wide_box_row" in src
    assert "bn = 256 needs hidden and 2 x intermediate to be multiples of 256" in src
    assert "bn" in [f[0] for f in _lib.MkParams._fields_] and _lib.ABI_VERSION >= 8


# ---- the overlap kernel (overlap=1): task slots + stage slots, modelled step by step -----------------------------
END = None  # the end marker (task word 0)


def _overlap_pipeline(stages: int, tasks: list[int], *, consumers: int = 1, deps: dict[int, int] | None = None,
                      policy: str | int = "first", defer_signal: bool = False, flush_before_wait: bool = True,
                      free_slot_after_signal: bool = True) -> str:
    """k_experts_ov's protocol for one CTA: 'ok', 'deadlock at ...' when no actor can move, or 'slot ...' when a task
    slot was overwritten while consumers still read it.

    `tasks`: k-stages per task in claim order, 0 = a COMBINE task (the end marker follows the last). `deps[j] = i`:
    queue slot j is published only once task i signalled (a GEMM2 waiting for a GEMM1 this CTA runs). Actors: the
    producer warpgroup, the copies landing by themselves (cp.async.mbarrier.arrive.noinc, TMA bytes) and `consumers`
    consumer warpgroups; `policy` picks among the actors that can move ('first', 'last' or a random seed). Producer
    per task j: wait tempty (slot j & 1 free: task j - 2 signalled), claim (waits until slot j is published), write
    the slot, arrive tfull; a GEMM task's stages: wait for slot g to be empty, issue its copies. Consumers per task:
    wait tfull, the vote of the word, read it; end -> exit; COMBINE -> free the slot, combine; GEMM -> stages (wait
    full; release the previous stage with one consumer warpgroup, the stage itself with two), the epilogue reads the
    slot's row ids, named barrier, the signal: consumer 0 reads the row ids and counts the task done, every consumer
    frees the slot (with free_slot_after_signal off: right after the word is read, the wrong order).
    `defer_signal` (tried in run 42, slower, not in the kernel): a GEMM task's signal is held and sent at the next
    GEMM task's second stage, before a COMBINE or the end, and (`flush_before_wait`) before waiting for a word that
    is not there yet, decided by a vote (named barrier, AND) of the consumers."""
    deps = deps or {}
    n = len(tasks)
    prod: list[tuple] = []
    land: list[tuple] = []
    it = 0
    for j, kt_n in enumerate([*tasks, END]):
        prod += [("wait_tempty", j), ("claim", j), ("arrive_tfull", j)]
        if kt_n is END:
            break
        for kt in range(kt_n):
            prod += [("wait_empty", it + kt), ("issue", it + kt)]
            land.append(("land", it + kt))
        it += kt_n
    total_stages = it
    cons: list[list[tuple]] = []
    for _ in range(consumers):
        ops: list[tuple] = []
        it, nbar, pend = 0, 0, False
        for j, kt_n in enumerate([*tasks, END]):
            if pend and defer_signal and flush_before_wait:
                ops += [("vote", (nbar, j)), ("vote_wait", nbar), ("flush_unless", nbar)]
                nbar += 1
            ops += [("wait_tfull", j), ("bar_arrive", nbar), ("bar_wait", nbar), ("read_word", j)]
            nbar += 1
            if kt_n is END:
                ops.append(("flush", None))
                break
            if kt_n == 0:
                ops += [("flush", None), ("arrive_tempty", j), ("combine", j)]
                pend = False
                continue
            if not free_slot_after_signal:
                ops.append(("arrive_tempty", j))
            hook_at = 1 if kt_n > 1 else 0
            for kt in range(kt_n):
                g = it + kt
                ops.append(("wait_full", g))
                if kt == hook_at and defer_signal:
                    ops.append(("flush", None))
                if consumers >= 2:
                    ops.append(("release", g))
                elif kt > 0:
                    ops.append(("release", g - 1))
            if consumers < 2:
                ops.append(("release", it + kt_n - 1))
            ops += [("read_slot", j), ("bar_arrive", nbar), ("bar_wait", nbar), ("set_pending", j)]
            nbar += 1
            if defer_signal:
                pend = True
            else:
                ops.append(("flush", None))  # the signal right away
            it += kt_n
        cons.append(ops)
    actors = [prod, land, *cons]
    published: Counter = Counter()
    issued: set[int] = set()
    released: Counter = Counter()
    tfull: set[int] = set()
    tempty: Counter = Counter()
    bars: Counter = Counter()
    votes: dict[int, list[bool]] = {}
    slot: dict[int, int] = {}
    done: set[int] = set()
    claimed: Counter = Counter()
    combined: Counter = Counter()
    words: Counter = Counter()
    pending: dict[int, int | None] = {}

    def ready(a: int, op: tuple) -> bool:
        kind, x = op
        if kind == "wait_tempty":
            return x < 2 or tempty[x - 2] == consumers
        if kind == "claim":
            return x >= n or x not in deps or deps[x] in done
        if kind == "wait_empty":
            return x < stages or released[x - stages] == consumers
        if kind == "land":
            return x in issued
        if kind == "wait_tfull":
            return x in tfull
        if kind == "wait_full":
            return published[x] > 0
        if kind == "bar_wait":
            return bars[x] == consumers
        if kind == "vote_wait":
            return len(votes.get(x, [])) == consumers
        return True

    def send(a: int) -> str | None:
        j = pending.get(a)
        if j is None:
            return None
        if a == 2:  # consumer 0 counts the task done; its signal reads the row ids
            if slot.get(j & 1) != j:
                return f"slot {j & 1} holds task {slot.get(j & 1)} while consumer 0 signals task {j}"
            done.add(j)
        if free_slot_after_signal:
            tempty[j] += 1
        pending[a] = None
        return None

    def apply(a: int, op: tuple) -> str | None:
        kind, x = op
        if kind == "claim":
            claimed[x] += 1
            slot[x & 1] = x
        elif kind == "arrive_tfull":
            tfull.add(x)
        elif kind == "issue":
            issued.add(x)
        elif kind == "land":
            published[x] += 1
        elif kind == "release":
            released[x] += 1
        elif kind == "arrive_tempty":
            tempty[x] += 1
        elif kind == "bar_arrive":
            bars[x] += 1
        elif kind == "vote":
            votes.setdefault(x[0], []).append(x[1] in tfull)
        elif kind == "flush_unless":
            if not all(votes[x]):
                return send(a)
        elif kind == "flush":
            return send(a)
        elif kind == "set_pending":
            pending[a] = x
        elif kind in ("read_word", "read_slot"):
            if slot.get(x & 1) != x:
                return f"slot {x & 1} holds task {slot.get(x & 1)} while consumer {a - 2} reads task {x} ({kind})"
            if kind == "read_word" and a == 2:
                words[x] += 1
        elif kind == "combine" and a == 2:
            combined[x] += 1
        return None

    bad = _run_actors(actors, ready, apply, policy)
    if bad:
        return bad
    gemm = [j for j, k in enumerate(tasks) if k]
    assert all(published[g] == 1 for g in range(total_stages)) and len(published) == total_stages
    assert all(released[g] == consumers for g in range(total_stages)) and len(released) == total_stages
    assert claimed == Counter(range(n + 1)) and words == Counter(range(n + 1))  # every task + the end, once
    assert done == set(gemm) and combined == Counter(j for j, k in enumerate(tasks) if not k)
    assert all(tempty[j] == consumers for j in range(n))
    return "ok"


_OV_MIXES = [[32], [12], [0], [], [32, 12], [12, 32, 0, 0, 12], [32, 32, 12, 0, 32, 0, 0, 0, 12, 12, 32],
             [1, 2, 3, 0, 5, 1], [0, 0, 0, 32, 0]]
_OV_POLICIES = ["first", "last", *range(6)]


@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("consumers", [1, 2])
def test_overlap_pipeline_never_deadlocks(stages: int, consumers: int) -> None:
    """Mixes of GEMM1 (32 k-stages), GEMM2 (12), COMBINE (0) tasks and the end, with and without a next task that
    waits for the current one, under several interleavings: every stage and task consumed exactly once."""
    for tasks in _OV_MIXES:
        chains = [{}, {j + 1: j for j, k in enumerate(tasks[:-1]) if k}]  # each task after a GEMM waits for it
        for deps in chains:
            for policy in _OV_POLICIES:
                for defer in (False, True):
                    got = _overlap_pipeline(stages, tasks, consumers=consumers, deps=deps, policy=policy,
                                            defer_signal=defer)
                    assert got == "ok", (stages, consumers, tasks, deps, policy, defer, got)


def test_overlap_pipeline_model_catches_wrong_orders() -> None:
    """Two plausible wrong cuts the model rejects: (1) holding a task's signal back (run 42's deferral) while waiting
    for the next task word deadlocks when the next queue slot waits for that task (a GEMM2 after this CTA's GEMM1);
    run 42 sent it before such a wait, which the model accepts; (2) freeing the task slot when the word is read, not
    after the signal, lets the producer overwrite the row ids the epilogue and the signal still read. Then the kernel
    source has the order the model assumes (the signal right after the task, as since run 12)."""
    from moetune.runtime.megakernel import _lib

    assert _overlap_pipeline(4, [32, 12], deps={1: 0}) == "ok"
    for consumers in (1, 2):
        assert _overlap_pipeline(4, [32, 12, 0, 12], deps={1: 0, 3: 1}, consumers=consumers, defer_signal=True) == "ok"
    assert _overlap_pipeline(4, [32, 12], defer_signal=True, flush_before_wait=False) == "ok"  # no dependency
    assert _overlap_pipeline(4, [32, 12], deps={1: 0}, defer_signal=True, flush_before_wait=False).startswith("deadlock")
    assert _overlap_pipeline(3, [12, 32], deps={1: 0}, consumers=2, defer_signal=True,
                             flush_before_wait=False).startswith("deadlock")
    assert _overlap_pipeline(4, [32, 0, 12, 32], free_slot_after_signal=False).startswith("slot")
    assert _overlap_pipeline(4, [32, 0, 12, 32], consumers=2, free_slot_after_signal=False).startswith("slot")

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    kern = src[src.index("k_experts_ov(const MkParams p"):src.index("// ---- routing")]
    loop = kern[kern.index("for (uint32_t j = 0;; ++j)"):]
    assert "__syncthreads" not in loop, "no CTA barrier inside the overlap loop"
    p_part, c_part = loop[:loop.index("// ---- consumer warpgroups")], loop[loop.index("// ---- consumer warpgroups"):]
    order = ["mbar_wait_ok(p, tempty", "claim_wg<T>(p, epoch, s_base, qs, g1_local, &sl.qi)", "named_sync(1, 128)",
             "fill_meta_part<T>(", "mbar_arrive(tfull", "if (task == 0) return;", "wg_produce<T>("]
    idx = [p_part.index(x) for x in order]
    assert idx == sorted(idx) and p_part.count("claim_wg<T>(") == 1 and p_part.count("wg_produce<T>(") == 1
    # claim_wg: GEMM1 slots computed as the scheduler writes them (queue_word), every later slot waited for
    cw = src[src.index("uint64_t claim_wg("):]
    cw = cw[:cw.index("\n}\n")]
    assert cw.index("if (i >= g1_local) return wait_slot(p, epoch, i, slot);") < cw.index("local_word<T>(p, base, q, i)")
    lw = src[src.index("uint64_t local_word("):]
    assert "mkidx::queue_word(i, base" in lw[:lw.index("\n}\n")]
    assert "if (qs.fits) g1_local = qs.n_tiles * qs.G1;" in kern
    order = ["mbar_wait_ok(p, tfull", "named_sync_and(2, NCONS, ok)", "if (task == 0) {  // end of work",
             "MK_TASK_COMBINE", "mbar_arrive(tempty", "run_combine_part(", "wg_consume<T, (T::XR > 0)>(", "named_sync(2, NCONS)",
             "signal_rows<T>(", "mbar_arrive(tempty"]
    pos = 0
    for x in order:
        pos = c_part.index(x, pos) + 1
    assert c_part.count("mbar_arrive(tempty") == 2  # the COMBINE path's early free and the GEMM path's after the signal
    assert "mbar_init(tfull + 8 * s, 128);" in kern and "mbar_init(tempty + 8 * s, NCONS);" in kern
    assert "2 * p.timeout_ns" in c_part  # the producer's claim timeout reports first (MK_ERR_PROC_TIMEOUT)
    # signal_done (a synchronised CTA) is signal_rows over all its threads: one place counts readiness, and every
    # counting thread fences before its first red (release after the barrier)
    sr = src[src.index("void signal_rows("):]
    sr = sr[:sr.index("\n}\n")]
    for line in ("red_add(&p.g1done[tile], T::NBLK);", "red_add(&p.comb[v / rows_per_ct], T::NBLK);"):
        assert line in sr and sr.rindex("__threadfence();", 0, sr.index(line)) >= 0
    assert "(int)p.K * (int)p.combine_tokens" in sr  # (v / K) / combine_tokens == v / (K * combine_tokens)
    sd = src[src.index("void signal_done("):]
    assert "signal_rows<T>(p, md, kind, tile, threadIdx.x, blockDim.x);" in sd[:sd.index("\n}\n")]


def test_config_overlap():
    c = MegakernelConfig.parse("overlap=1")
    assert c.overlap == 1 and c.core == "wgmma" and MegakernelConfig().overlap == 1  # the default since run 12
    assert MegakernelConfig.from_dict(c.to_dict()) == c
    for text in ("overlap=1,bm=128", "overlap=1,tma=0", "overlap=1,bm=128,bn=256", "overlap=1,stages=3"):
        assert MegakernelConfig.parse(text).overlap == 1
    for text in ("overlap=2", "overlap=-1"):
        with pytest.raises(ConfigError, match="overlap"):
            MegakernelConfig.parse(text)
    for text in ("overlap=1,core=mma", "overlap=1,bm=16"):  # tiles without the wgmma core ignore it (the C side too)
        assert MegakernelConfig.parse(text).overlap == 1
    from moetune.runtime.megakernel import _lib

    assert "overlap" in [f[0] for f in _lib.MkParams._fields_] and _lib.ABI_VERSION >= 9
    assert len(_lib.SIGNATURES["mk_occupancy"][1]) == 8


def test_small_topk_setting_and_source():
    """route_small_max (ABI 10): S up to it runs k_topk_small; the launch picks by S on the host (capturable)."""
    from moetune.runtime.megakernel import _lib

    assert MegakernelConfig().route_small_max == 0 and MegakernelConfig.parse("route_small_max=0").route_small_max == 0
    with pytest.raises(ConfigError, match="route_small_max"):
        MegakernelConfig.parse("route_small_max=-1")
    assert "route_small_max" in [f[0] for f in _lib.MkParams._fields_] and _lib.ABI_VERSION >= 10
    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    assert "p->S <= p->route_small_max" in src and "launch_k(k_topk_small, dim3((unsigned)p->S), SMALL_THREADS" in src


def test_publish_all_and_trace_fields() -> None:
    """ABI 11: the task timeline's buffer and publish_all travel in MkParams; publish_all is a validated 0/1 setting;
    the stall hook and the input wait use the same error path as every other wait."""
    from moetune.runtime.megakernel import ConfigError, MegakernelConfig, _lib

    names = [f[0] for f in _lib.MkParams._fields_]
    assert names[names.index("trace") + 1] == "publish_all" and _lib.ABI_VERSION >= 11
    assert MegakernelConfig.parse("publish_all=1").publish_all == 1
    with pytest.raises(ConfigError, match="publish_all"):
        MegakernelConfig.parse("publish_all=2")
    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    wait = src[src.index("void wait_count("):]
    wait = wait[:wait.index("\n}\n")]
    assert "MK_ERR_INPUT_TIMEOUT" in wait and "p.timeout_ns" in wait and "abort_flag(p, abort)" in wait
    flag = src[src.index("int32_t* abort_flag("):]
    assert "return abort ? abort : &p.ctl[MK_CTL_ABORT];" in flag[:flag.index("\n}\n")]  # null: the task graph's
    # the GEMM2's weight stages start before the wait, the A rows (its inputs) only after it
    tma = src[src.index("void gemm_tile_tma("):src.index("// ---- task encoding")]
    assert tma.index("issue_b(s);\n    wait_inputs(") < tma.index("issue_a(s);")


def test_pdl_setting_and_source() -> None:
    """pdl (ABI 13): a validated 0/1 setting, on by default; every kernel launched early waits for the one before it
    before it reads what that one wrote."""
    from moetune.runtime.megakernel import _lib

    assert MegakernelConfig().pdl == 1 and MegakernelConfig.parse("pdl=0").pdl == 0
    with pytest.raises(ConfigError, match="pdl"):
        MegakernelConfig.parse("pdl=2")
    names = [f[0] for f in _lib.MkParams._fields_]
    assert names[names.index("publish_all") + 1] == "pdl" and _lib.ABI_VERSION >= 13
    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    # both persistent kernels wait before the launch epoch, the first routing result they read
    for name in ("k_experts(const MkParams p", "k_experts_ov(const MkParams p"):
        body = src[src.index(name):]
        assert body.index("pdl_enter(p);") < body.index("p.ctl[MK_CTL_EPOCH]")
    enter = src[src.index("void pdl_enter("):]
    assert enter[:enter.index("\n}\n")].strip().endswith("if (p.pdl) griddep_wait();")
    # the top-k kernels let the persistent kernel start, then wait for the logits before reading any
    for name in ("k_topk(const MkParams p, int splits)", "k_topk_small(const MkParams p, int splits)"):
        body = src[src.index(name):]
        assert body.index("griddep_launch();") < body.index("griddep_wait();") < body.index("p.logits")
    code = re.sub(r"//[^\n]*", "", src)  # nothing a pdl predecessor wrote is read through the non-coherent path
    assert "__ldg(" not in code and "ld.global.nc" not in code
    kl = src[src.index("k_logits(const MkParams p)"):]
    assert kl.index("gemm_tile<T>(") < kl.index("if (p.pdl) griddep_launch();") < kl.index("p.logits +")
    # k_logits keeps plain stream order (it follows the previous layer's kernels); the others launch under pdl
    assert "k_logits<T><<<" in src
    assert src.count("p->pdl != 0") == 5  # k_topk_small, k_topk, both persistent kernels, the decode kernel
    # the decode kernel waits before it reads the picks; its only non-coherent loads are the expert weights
    dk = (_lib.source_dir() / "mk_decode.cuh").read_text()
    body = dk[dk.index("k_decode(const MkParams p"):]
    assert body.index("pdl_enter(p);") < body.index("p.topk_idx")
    dcode = re.sub(r"//[^\n]*", "", dk)
    # definition + 4 uses (the gate row's first chunk before pdl_enter, the gate rows, phase 2's two); 2 variants
    assert dcode.count("ld_weights(") == 5 and dcode.count("ld.global.nc") == 2
    # the only loads before pdl_enter are gate weights (no kernel before writes them)
    assert "p.x" not in body[:body.index("pdl_enter(p);")] and "ld_weights(g + v" in body[:body.index("pdl_enter(p);")]
    assert all(any(f"ld_weights({w} + {i}" in ln for w in "gu" for i in ("v", "i * plane")) or "uint4 ld_weights(" in ln
               for ln in dcode.splitlines() if "ld_weights(" in ln)


def test_combine_tokens_auto_rule() -> None:
    """combine_tokens 0 (auto, the default of the knob and the config): 2-token combine tiles on the 16-row decode tile,
    4 on the wide tile while the average rows per expert fit half an m-tile, 8 elsewhere; an explicit value wins;
    negative values are refused."""
    from moetune.runtime.knobs import KnobError, Knobs

    auto = MegakernelConfig()
    assert auto.combine_tokens == 0 and Knobs().mk_combine_tokens == 0
    assert MegakernelConfig.from_knobs(Knobs(engine="megakernel")).combine_tokens == 0
    # Qwen3-30B (E=128, top-8): the wide tile from S=160 (10 rows per expert); S=1024 -> 64 rows: 4; 1025 up: 8
    assert [auto.combine_tile(128, 256, s, 8, 128) for s in (160, 512, 1024, 1025, 2048, 4096)] == [4, 4, 4, 8, 8, 8]
    # the decode tile: 2; the 128-column tiles: 8 (not measured with fewer)
    assert [auto.combine_tile(bm, bn, s, 8, 128) for bm, bn, s in ((16, 128, 16), (16, 128, 128), (128, 128, 1024),
                                                                   (64, 128, 512))] == [2, 2, 8, 8]
    assert MegakernelConfig.parse("combine_tokens=16").combine_tile(128, 256, 1024, 8, 128) == 16
    with pytest.raises(ConfigError, match="combine_tokens"):
        MegakernelConfig.parse("combine_tokens=-1")
    with pytest.raises(KnobError, match="mk_combine_tokens"):
        Knobs(engine="megakernel", mk_combine_tokens=-1).validate()


def test_l2_evict_weights_setting_rule_and_source() -> None:
    """l2_evict_weights (ABI 14: MkParams.l2_evict_w): validated; auto = evict-first while the launch's average rows per
    expert fill at most 3/4 of an m-tile; the kernel passes the flag to every TMA weight load and rejects other values."""
    from moetune.runtime.megakernel import _lib

    auto = MegakernelConfig()
    assert auto.l2_evict_weights == 2
    # Qwen3-30B (E=128, top-8): decode tile S=128 -> 8 rows per expert (bm 16): on; the wide tile at S=1024 -> 64
    # rows per expert (bm 128): on, up to S=1536 (96 = 3/4 of an m-tile); S=1792 (112), 2048 (128), 4096 (256): off
    assert [auto.evict_weights(bm, s, 8, 128) for bm, s in ((16, 1), (16, 128), (128, 1024), (128, 1536), (128, 1537),
                                                             (128, 2048), (128, 4096))] == [1, 1, 1, 1, 0, 0, 0]
    assert MegakernelConfig.parse("l2_evict_weights=0").evict_weights(16, 1, 8, 128) == 0
    assert MegakernelConfig.parse("l2_evict_weights=1").evict_weights(128, 4096, 8, 128) == 1
    with pytest.raises(ConfigError, match="l2_evict_weights"):
        MegakernelConfig.parse("l2_evict_weights=3")
    names = [f[0] for f in _lib.MkParams._fields_]
    assert names[names.index("pdl") + 1] == "l2_evict_w" and _lib.ABI_VERSION >= 14
    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    # every call site passes the launch's setting (the probe build of run 172 overrides it), plus the definition
    assert src.count("tma_load_2d(") == src.count("p.l2_evict_w != 0,") + src.count("p.l2_evict_w != 0 && !(MK_PROBE & 16),") + 1
    assert 'if (p->l2_evict_w != 0 && p->l2_evict_w != 1) return fail_msg("mk: l2_evict_w must be 0 or 1");' in src


def _profile_tool():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "tools" / "megakernel_profile.py"
    spec = importlib.util.spec_from_file_location("_mk_profile", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_vs_lib_rotates_which_build_is_timed_first():
    """megakernel_profile --vs-lib times the builds in an order rotated each round (run 116: a fixed order favoured the
    first build by ~5 us at S=1024): over as many rounds as builds, each build is first once and every round times
    each build exactly once."""
    from moetune.runtime.testing.timing import interleave_order

    names = ["this", "base", "probe"]
    orders = [interleave_order(names, r) for r in range(len(names))]
    assert [o[0] for o in orders] == names
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders[1] == ["base", "probe", "this"]
    assert interleave_order([], 2) == []


def test_time_interleaved_calls_each_entry_once_per_round_rotated():
    """time_interleaved (the side-by-side tool's replay-by-replay mode): after the warm-up rounds, every round calls
    each entry once, in the order rotated by the round, each entry's inputs in turn, and returns per entry one sample
    per round."""
    from moetune.runtime.testing.timing import time_interleaved

    calls: list[str] = []
    fns = {"a": [lambda: calls.append("a0"), lambda: calls.append("a1")], "b": [lambda: calls.append("b0")]}
    out = time_interleaved(fns, warmup=1, iters=3, cuda=False)
    assert calls == ["a0", "b0", "a0", "b0", "b0", "a1", "a0", "b0"]  # warm-up round, then rounds 0, 1 (rotated), 2
    assert set(out) == {"a", "b"} and all(len(v) == 3 and min(v) >= 0 for v in out.values())


def test_no_timed_sample_is_a_graphs_first_replay(monkeypatch):
    """A CUDA graph's first launch uploads it (work on its stream before the graph's own). graphs_of returned graphs
    never replayed, so where the warm-up calls did not reach every input -- the tuner's megakernel trials at iters 10
    (`profile --quick`): warmup max(3, 10 // 5) = 3 over rotate 4 graphs -- graph 3's upload was timed as sample 3 of
    the layer. Faked torch.cuda: every graph is launched once before the first timed event is recorded."""
    import contextlib

    import torch

    from moetune.runtime.testing.timing import graphs_of, time_calls

    log: list[str] = []

    class Graph:
        def __init__(self) -> None:
            self.name = f"g{sum(e == 'capture' for e in log)}"

        def replay(self) -> None:
            log.append(self.name)

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self) -> None:
            log.append("record")

        def elapsed_time(self, other: object) -> float:
            return 1.0

    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    @contextlib.contextmanager
    def ctx(*a: object, **k: object):  # type: ignore[no-untyped-def]
        yield

    @contextlib.contextmanager
    def capture(g: object, *a: object, **k: object):  # type: ignore[no-untyped-def]
        yield
        log.append("capture")

    for name, value in (("CUDAGraph", Graph), ("Event", Event), ("Stream", lambda *a, **k: Stream()),
                        ("current_stream", lambda *a, **k: Stream()), ("stream", ctx), ("graph", capture),
                        ("synchronize", lambda *a: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    graphs = graphs_of(lambda x: None, [0, 1, 2, 3])
    out = time_calls(graphs, warmup=3, iters=10, cuda=True)  # measure_megakernel's call at iters 10
    assert len(out) == 10
    first_timed = log.index("record")
    assert all(f"g{i}" in log[:first_timed] for i in range(4)), log


def test_paired_lines_difference_per_round():
    mod = _profile_tool()
    lines = mod.paired_lines({"this": [350.0, 360.0, 370.0], "same": [351.0, 359.0, 372.0]})
    assert lines[0] == "  this         median    360.0 us"
    assert lines[1].startswith("  same         median    359.0 us, minus this per round: median   +1.0")


def test_timeline_combine_tail():
    """megakernel_profile's timeline summary says how long after the last GEMM2 the COMBINEs were published and done."""
    mod = _profile_tool()
    tasks = [{"kind": "gemm2", "done": 100.0, "published": 50.0}, {"kind": "gemm2", "done": 120.0, "published": 60.0},
             {"kind": "combine", "done": 118.0, "published": 110.0}, {"kind": "combine", "done": 135.5, "published": 124.0},
             {"kind": "combine", "done": None, "published": 125.0}]
    assert mod.combine_tail(tasks) == ("  combine tail: last gemm2 done 120.0 us; combines published until +4.0, done "
                                       "until +15.5 us after it (1 of 2 published after it)")
    assert mod.combine_tail(tasks[:2]) == ""


def test_timeline_costs_by_m_tile_rows():
    """megakernel_profile's timeline summary charges each GEMM task the time since the previous task on its CTA ended
    and sums it by how many routed rows its m-tile holds (run 117's nearly empty m-tiles)."""
    mod = _profile_tool()

    def task(slot, cta, done, kind="gemm1", rows=128):
        return {"slot": slot, "cta": cta, "done": done, "kind": kind, "rows": rows}

    tasks = [task(0, 1, 10.0), task(1, 1, 38.0), task(2, 1, 61.0, rows=13), task(3, 2, 9.0),
             task(4, 2, 37.5, rows=70), task(5, 2, 50.0, kind="gemm2"), task(6, 2, 53.0, kind="combine", rows=None)]
    steady = mod.steady_of(tasks)
    assert steady == {1: 28.0, 2: 23.0, 4: 28.5, 5: 12.5, 6: 3.0}  # first task of each CTA: none
    lines = mod.fill_lines({"grid": 3, "bm": 128, "tasks": tasks}, steady)
    assert len(lines) == 2 and lines[0].startswith("  gemm1") and lines[1].startswith("  gemm2")
    assert "1-16 rows: 1 p50 23.0 us, 11.5 us/CTA (29%)" in lines[0]
    assert "65-127 rows: 1 p50 28.5 us" in lines[0] and "full: 1 p50 28.0 us, 14.0 us/CTA (35%)" in lines[0]
    assert "17-64" not in lines[0] and lines[1].endswith("full: 1 p50 12.5 us, 6.2 us/CTA (100%)")
    # bm=64: the 65-127 bucket does not exist and a 64-row m-tile is full
    small = [task(0, 1, 1.0, rows=64), task(1, 1, 5.0, rows=64), task(2, 1, 8.0, rows=20)]
    out = mod.fill_lines({"grid": 2, "bm": 64, "tasks": small}, mod.steady_of(small))
    assert out == ["  gemm1    by m-tile rows: 17-63 rows: 1 p50 3.0 us, 3.0 us/CTA (43%); full: 1 p50 4.0 us, 4.0 us/CTA (57%)"]


# ---- the k-tiled weight layout (runtime/megakernel/weights.py; mk_api.h ABI 18) ------------------------------
def test_k_tiled_weights_layout_round_trip_and_in_place():
    import torch

    from moetune.runtime.megakernel.weights import from_tiled, tile_, to_tiled, untile_

    e, n, k = 3, 10, 192  # rows = 30, three k planes
    w = torch.arange(e * n * k, dtype=torch.float32).view(e, n, k)
    t = to_tiled(w)
    assert t.shape == w.shape and t.is_contiguous() and not torch.equal(t, w)
    flat, rows = t.view(-1), e * n
    for row, kk in ((0, 0), (7, 63), (13, 64), (29, 191), (17, 130)):
        # the kernels' addressing: element (row, k) at ((k / 64) * rows + row) * 64 + k % 64; a 16-byte chunk v (8
        # bf16) of row R at ((v / 8) * rows + R) * 8 + v % 8 in chunks (the decode kernel's W_gate_up loads)
        assert flat[((kk // 64) * rows + row) * 64 + kk % 64] == w.view(rows, k)[row, kk]
        v = kk // 8
        assert flat[(((v >> 3) * rows + row) * 8 + (v & 7)) * 8 + kk % 8] == w.view(rows, k)[row, kk]
    # a 64 x 64 box (rows r0.. of plane p) is contiguous: what one TMA box / one bulk copy reads
    box = flat[(1 * rows + 4) * 64:(1 * rows + 4 + 16) * 64].view(16, 64)
    assert torch.equal(box, w.view(rows, k)[4:20, 64:128])
    assert torch.equal(from_tiled(t), w)
    u = w.clone()
    assert tile_(u) is u and torch.equal(u, t) and torch.equal(untile_(u), w)
    with pytest.raises(ValueError, match="multiple of 64"):
        to_tiled(torch.zeros(2, 4, 100))
    with pytest.raises(ValueError, match="contiguous"):
        tile_(torch.zeros(4, 128).t())
    one = torch.arange(2 * 3 * 64, dtype=torch.float32).view(2, 3, 64)  # one k plane: tiled == row-major
    for f in (to_tiled, from_tiled):  # still a new tensor (MegakernelMoE's tiled=False copies, never shares)
        c = f(one)
        assert torch.equal(c, one) and c.data_ptr() != one.data_ptr()


def test_megakernel_tiled_must_be_a_bool():
    """tiled="no" is truthy: it would take row-major weights as k-tiled (scrambled products, no error)."""
    from moetune.runtime.megakernel import MegakernelMoE
    from moetune.runtime.shapes import get_model

    with pytest.raises(TypeError, match="tiled must be a bool, got str 'no'"):
        MegakernelMoE(get_model("qwen3-30b"), max_tokens=1, device="cpu", tiled="no")


# ---- the error records (mk_moe.cu: record / record_noabort / report) ---------------------------------------------
def test_the_record_without_the_abort_has_words_of_its_own():
    """Code 8 (non-finite logits) is recorded without the abort and says the other rows were computed. In err[0..3]
    with the first-error-wins CAS it kept a later aborting error (a timeout, an expert out of range, a full list: every
    output row of that launch invalid) out of the record, so check() named code 8 over invalid outputs. It has words
    of its own now (MK_ERR_NOABORT..+3, ABI 19), written only by record_noabort, whose only caller is code 8; report
    keeps err[0..3], and its body is main's (the persistent kernels inline it at every bounded wait: a spin and a second
    CAS there let an abort replace code 8 in one slot, and ptxas gave two wide wgmma kernels 16 and 32 more bytes of stack
    frame). The layer reads words 0..3 first (tests/test_layer_inputs.py)."""
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    hdr = _header()
    assert f"#define MK_ERR_NOABORT {_lib.ERR_NOABORT}" in hdr and "MK_ERR_WORDS = 8 " in hdr
    assert _lib.ERR_NOABORT + 4 <= 8
    rec = src[src.index("__device__ void record("):src.index("__device__ void record_noabort(")]
    assert "atomicCAS((unsigned long long*)p.err, 0ull, (unsigned long long)code) == 0ull" in rec
    noab = src[src.index("__device__ void record_noabort("):src.index("__device__ __forceinline__ int32_t* abort_flag(")]
    assert "int64_t* const r = p.err + MK_ERR_NOABORT;" in noab and "atomicCAS((unsigned long long*)r, 0ull," in noab
    assert "p.err" not in noab.replace("p.err + MK_ERR_NOABORT", "")  # nothing of words 0..3
    rep = src[src.index("__device__ void report("):src.index("__device__ __forceinline__ bool mbar_try(")]
    body = rep[rep.index("{") + 1:rep.index("\n}")]
    assert [ln.strip() for ln in body.strip().splitlines()] == ["record(p, code, where, detail, waited);",
                                                                "atomicExch(abort_flag(p, abort), 1);"]
    assert re.findall(r"\brecord_noabort\(p, (MK_ERR_\w+)", src) == ["MK_ERR_NONFINITE_LOGITS"]
    assert re.findall(r"\brecord\(p, ", src) == ["record(p, "]  # report's only: every other error aborts
    dec = (_lib.source_dir() / "mk_decode.cuh").read_text()
    assert not re.search(r"\brecord(_noabort)?\(", dec)  # the decode kernel records through note_nonfinite / report


def test_dropped_rows_say_the_launch_aborts():
    """Codes 4 and 7 come from report(), which raises the abort flag: the rest of the launch gives up its waits and
    none of its output rows is valid. Their texts said only that the row was dropped (7: "more rows than tokens",
    where the bound is max_tokens, the lists' S_cap)."""
    from moetune.runtime.megakernel import _lib
    from moetune.runtime.megakernel.layer import ERR_NAMES, MegakernelMoE

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    append = src[src.index("void append_row("):src.index("__global__ void k_lists(")]
    assert "report(p, MK_ERR_BAD_EXPERT, row, e, 0);" in append and "report(p, MK_ERR_EXPERT_FULL, row, e, 0);" in append
    for code in (4, 7):
        assert "the launch aborted: none of its output rows is valid" in ERR_NAMES[code]
    assert ERR_NAMES[7].startswith("an expert got more than max_tokens rows")
    hdr = re.sub(r"\s*//\s*", " ", _header())
    assert "the row is dropped and the launch aborted" in hdr and "dropped and the launch aborted" in \
        hdr[hdr.index("MK_ERR_EXPERT_FULL = 7"):hdr.index("MK_ERR_NONFINITE_LOGITS = 8")]
    readme = " ".join((_lib.source_dir() / "README.md").read_text().split())
    assert "records `MK_ERR_EXPERT_FULL` and aborts the launch" in readme
    doc = " ".join((MegakernelMoE.forward_routed.__doc__ or "").split())
    assert "aborts the launch, so none of that forward's output rows is valid" in doc
    assert "more than max_tokens rows" in doc


@pytest.mark.parametrize(("knobs", "cap"), [
    (dict(mk_bm=128), 6), (dict(mk_bm=128, mk_core="mma"), 6), (dict(mk_bm=128, mk_overlap=0), 6),
    (dict(mk_bm=64), 8), (dict(mk_bm=64, mk_core="mma"), 9), (dict(mk_bm=64, mk_overlap=0), 9)])
def test_stages_past_the_tiles_shared_memory_are_refused_naming_the_knobs(knobs: dict, cap: int) -> None:
    """mk_bm=128 with mk_stages=8 passed the knob check (2..12) and could never launch: on a GPU the layer said only
    that `stages=8 leaves no resident CTA` (as the megakernel "cannot run here"). The caps are the library's shared
    memory limit (mk_moe.cu: SMEM_MAX against smem_for / smem_for_ov of each tile); the deepest allowed still passes."""
    from moetune.runtime.knobs import KnobError, Knobs, mk_stage_cap

    assert mk_stage_cap(knobs["mk_bm"], knobs.get("mk_core", "wgmma"), knobs.get("mk_overlap", 1)) == cap
    Knobs(engine="megakernel", mk_stages=cap, **knobs)
    with pytest.raises(KnobError, match=f"mk_bm={knobs['mk_bm']} holds at most {cap} stages") as e:
        Knobs(engine="megakernel", mk_stages=cap + 1, **knobs)
    assert e.value.knobs[:2] == ("mk_stages", "mk_bm")
    # the decode tile and auto (whose tile depends on S: the GPU layer checks its launch shapes) take the whole range
    Knobs(engine="megakernel", mk_bm=16, mk_stages=12)
    Knobs(engine="megakernel", mk_bm=0, mk_stages=12)


def test_the_library_s_stage_refusal_says_the_caps_the_knob_check_holds() -> None:
    """check_params' "stages too deep" refusal (and mk_api.h's stages comment) said bm=64 holds 8 stages on the mma
    core, where its own arithmetic (smem_for against SMEM_MAX) and the knob check (`mk_stage_cap`) allow 9, and did not
    say the wgmma overlap kernel's 8: the numbers a user reads must be the ones the check enforces."""
    from moetune.runtime.knobs import mk_stage_cap
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    start = src.index('fail_msg("mk: stages too deep for bm (shared memory > 226 KB')
    # the message's adjacent C string literals, joined
    msg = "".join(re.findall(r'"([^"]*)"', src[start:src.index(");", start)]))
    said = (f"bm=16 <= {mk_stage_cap(16, 'mma', 0)}, 64 <= {mk_stage_cap(64, 'mma', 0)}, "
            f"128 <= {mk_stage_cap(128, 'mma', 0)}; wgmma 64 <= {mk_stage_cap(64, 'wgmma', 0)} "
            f"({mk_stage_cap(64, 'wgmma', 1)} with overlap), 128 <= {mk_stage_cap(128, 'wgmma', 1)}, 128 with bn=256 <= 4")
    assert said in msg, msg
    api = (_lib.source_dir() / "mk_api.h").read_text()
    assert f"64 <= {mk_stage_cap(64, 'mma', 0)}, {mk_stage_cap(64, 'wgmma', 1)} on wgmma with overlap" in api


def test_the_wide_tile_on_a_shape_it_cannot_run_names_the_knob() -> None:
    """`--knobs mk_bn=256` on a shape whose hidden is no multiple of 256 was refused as "bn=256 needs ...", a name the
    user never typed (the split-K refusal beside it names mk_split_k)."""
    from moetune.runtime import get_model
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.megakernel.config import limits_problem

    model = get_model("custom:384,192,8,2")
    why = limits_problem(model, 16, MegakernelConfig.from_knobs(Knobs(engine="megakernel", mk_bn=256)))
    assert why is not None and "the knob mk_bn" in why and "384" in why, why
    assert limits_problem(model, 16, MegakernelConfig.from_knobs(Knobs(engine="megakernel"))) is None  # auto: 128
    # too many split-K parts for the task word's n-field: the knob named too
    wide = get_model("custom:1024,32768,8,2")
    why = limits_problem(wide, 16, MegakernelConfig.from_knobs(Knobs(engine="megakernel", mk_split_k=16)))
    assert why is not None and "<= 4095" in why and "the knob mk_split_k" in why, why


@pytest.mark.parametrize(("config", "per_sm", "words"), [
    (MegakernelConfig(), 0, "stages=6 (the knob mk_stages) leaves no resident CTA (bm=16)"),
    (MegakernelConfig(ctas_per_sm=3), 2, "ctas_per_sm=3 (the knob mk_ctas_per_sm) but only 2 fit per SM"),
    (MegakernelConfig(processor_ctas=300), 2, "processor_ctas=300 (the knob mk_processor_ctas) + 1 scheduler exceeds")])
def test_launch_refusals_name_the_knob(config: MegakernelConfig, per_sm: int, words: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer built from `--knobs mk_ctas_per_sm=3` was refused as "ctas_per_sm=3 but only 2 fit per SM", naming a
    config field its user never typed (GPU-only in use; here the occupancy query is a stand-in of 132 SMs)."""
    import contextlib
    from typing import Any

    import torch

    from moetune.runtime.megakernel.layer import MegakernelMoE

    class Lib:
        def mk_occupancy(self, bm: int, stages: int, core: int, tma: int, bn: int, overlap: int, per: Any,
                         sms: Any) -> int:
            per._obj.value, sms._obj.value = per_sm, 132
            return 0

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    mk = object.__new__(MegakernelMoE)
    mk.config, mk.lib, mk._grids, mk.device = config, Lib(), {}, torch.device("cpu")
    with pytest.raises(ConfigError, match=re.escape(words)):
        mk.grid(16, 6)
