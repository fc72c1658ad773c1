"""Build and load the megakernel's own shared library (csrc/megakernel/ -> libmoetune_moe.so).

Kept apart from `csrc_build`'s library so the two build and cache independently (this one needs the
sm_90a target for Hopper-only instructions; the transports' library builds for any arch). It reuses
`csrc_build`'s nvcc lookup, version probe, cache root and its cache (`csrc_build.build_cached`: content-hash
key, file lock, the refusal of a cache entry another user could have written): the key hashes the sources, the nvcc
version, the flags and the ABI version.

Environment:
  MOETUNE_MK_LIB   a prebuilt libmoetune_moe.so to load instead of building
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from ctypes import POINTER, Structure, c_char_p, c_int, c_int64, c_void_p
from pathlib import Path

from .. import csrc_build as _cb
from .decode import MAX_SLOTS as _DEC_MAX_SLOTS

ABI_VERSION = 19  # 19: err words 4..7 hold the record without the abort (mk_api.h MK_ERR_NOABORT)
COUNT_STRIDE = 32  # MK_COUNT_STRIDE: int32 words per expert counter in MkParams.counts
CTL_WORDS = 8  # MK_CTL_WORDS: int32 words of MkParams.ctl
ERR_NOABORT = 4  # MK_ERR_NOABORT: err[] word where the record of an error without the abort (code 8) starts
MAX_SPLITS = 16  # MK_MAX_SPLITS: split-K parts per GEMM task
CORES = {"mma": 0, "wgmma": 1}  # MK_CORE_*
DEC_CNT_WORDS = (_DEC_MAX_SLOTS + 1) * 32 + 4096  # the decode kernel's counters and logits (mk_decode.cuh: DEC_CNT_WORDS)
# the decode kernel's own abort flag, a word of its exit ticket's line (mk_decode.cuh: DEC_ABORT): its waits poll it
# instead of ctl[CTL_ABORT], and its last CTA zeroes it, so a decode launch never starts aborted by an earlier error
DEC_ABORT = _DEC_MAX_SLOTS * 32 + 16
SK_PART_FLOATS = 16 * 128  # fp32 per split-K part and slot: the bm=16 tile's 16 accumulators x 128 threads
LIB_NAME = "libmoetune_moe.so"
ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-O3", "-lineinfo", "-cudart=static", *ARCH_FLAGS)
_BUILD_TIMEOUT_S = 600


class MkParams(Structure):
    """Mirror of `MkParams` in csrc/megakernel/mk_api.h (every field 8 bytes: no padding)."""

    _fields_ = [
        *((n, c_void_p) for n in ("x", "wg", "w1", "w2", "out", "logits", "topk_idx", "topk_w", "counts", "lists",
                                  "h", "y", "ctl", "g1done", "comb", "rel", "tile_base", "q_task", "q_flag", "err")),
        *((n, c_int64) for n in ("S", "S_cap", "H", "I", "E", "K", "bm", "stages", "combine_tokens", "q_cap",
                                 "max_tiles", "max_ctiles", "grid", "timeout_ns", "stall_tile",
                                 "logit_splits_max", "core", "split_k1", "split_k2", "sk_max_tiles")),
        ("sk_part", c_void_p), ("sk_cnt", c_void_p),
        ("tma_b", c_int64),
        ("bn", c_int64),  # ABI 8: columns per GEMM task (128, or 256: the wide tile)
        ("overlap", c_int64),  # ABI 9: 1 = the wgmma tiles run the cross-task overlap kernel
        ("route_small_max", c_int64),  # ABI 10: S up to which k_topk_small runs (0: never)
        ("trace", c_void_p),  # ABI 11: null, or the task timeline's stamps (MK_TR_*)
        ("publish_all", c_int64),  # ABI 11: 1 = the mma-core tiles publish every task at launch
        ("pdl", c_int64),  # ABI 13: 1 = programmatic dependent launch of k_topk and the persistent kernel
        ("l2_evict_w", c_int64),  # ABI 14: 1 = TMA weight tiles with the L2 evict-first policy
        ("decode", c_int64),  # ABI 15: 1 / 2 = mk_experts runs the decode kernel (given picks / routing in it)
        ("dec_cnt", c_void_p),  # ABI 16: the decode kernel's counters (DEC_CNT_WORDS int32, zero between launches)
        ("tail_rows", c_int64),  # ABI 17: an expert's last rows (<= 16) ride in its last full m-tile (wide tile)
    ]


TR_HEAD, TR_SLOT = 8, 6  # MK_TR_HEAD, MK_TR_SLOT: scheduler words, words per queue slot


def source_dir() -> Path:
    return _cb.csrc_dir() / "megakernel"


def sources() -> list[Path]:
    return sorted(source_dir().glob("*.cu"))


def _inputs() -> list[Path]:
    d = source_dir()
    return sorted([*d.glob("*.cu"), *d.glob("*.h"), *d.glob("*.cuh")])


def build_key(nvcc_ver: str) -> str:
    h = hashlib.sha256()
    for p in _inputs():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(nvcc_ver.encode())
    h.update(" ".join(FLAGS).encode())
    h.update(_cb.nvcc_env().encode())
    h.update(str(ABI_VERSION).encode())
    return "mk-" + h.hexdigest()[:20]


def build_command(nvcc: str, out: Path) -> list[str]:
    return [nvcc, *FLAGS, "-o", str(out), *map(str, sources())]


def build(*, force: bool = False) -> Path:
    """Compile (or find in the cache) libmoetune_moe.so; raises csrc_build.BuildError with nvcc's output."""
    nvcc = _cb.find_nvcc()
    if nvcc is None:
        raise _cb.BuildError("nvcc not found (set MOETUNE_NVCC or CUDA_HOME, or MOETUNE_MK_LIB)")
    if not sources():
        raise _cb.BuildError(f"no megakernel sources in {source_dir()}")
    ver = _cb.nvcc_version(nvcc)
    return _cb.build_cached(_cb.cache_root() / build_key(ver), LIB_NAME, lambda tmp: build_command(nvcc, tmp), ver,
                            force=force, timeout_s=_BUILD_TIMEOUT_S).path


_P = POINTER(MkParams)
_PI = POINTER(c_int)
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "mk_abi_version": (c_int, []),
    "mk_last_error": (c_char_p, []),
    # bm, stages, core, tma, bn, overlap
    "mk_occupancy": (c_int, [c_int64, c_int64, c_int64, c_int64, c_int64, c_int64, _PI, _PI]),
    "mk_route": (c_int, [_P, c_void_p]),
    "mk_route_given": (c_int, [_P, c_void_p]),
    "mk_experts": (c_int, [_P, c_void_p]),
    # S, H, I, K, E -> grid, rows
    "mk_decode_grid": (c_int, [c_int64, c_int64, c_int64, c_int64, c_int64, _PI, _PI]),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def load() -> ctypes.CDLL:
    """Build once (cached) and load the library; raises csrc_build.BuildError with the reason. A failure is
    remembered for the process, as csrc_build.load does: every layer of a model asks (MoELayer's auto engine), and
    each retry would be another full nvcc run of up to its timeout under the cache lock."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise _cb.BuildError(_lib_error)
        pre = os.environ.get("MOETUNE_MK_LIB")
        try:
            _lib = open_library(Path(pre) if pre else build())
        except _cb.BuildError as e:
            _lib_error = str(e)
            raise
        return _lib


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library at `path` with the entry points' signatures, checking its ABI (benchmarks also open
    measurement builds this way, to time them side by side with the layer's own in one process)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise _cb.BuildError(f"cannot load {path}: {e}") from None
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise _cb.BuildError(f"{path} lacks {name}: stale build?")
        fn.restype = res
        fn.argtypes = args
    if lib.mk_abi_version() != ABI_VERSION:
        raise _cb.BuildError(f"{path}: ABI {lib.mk_abi_version()}, expected {ABI_VERSION}")
    return lib


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        msg = lib.mk_last_error()
        raise _cb.CsrcError(f"{what} failed: {msg.decode(errors='replace') if msg else rc}")
