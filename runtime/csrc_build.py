"""Build and load moetune's CUDA/C++ sources (csrc/) on first use.

The sources are compiled with nvcc into one shared library, cached under
`$MOETUNE_CACHE/build/<key>/` (else `~/.cache/moetune/build/<key>/`), where the key hashes the
sources, the nvcc version, the target architecture and the flags; a file lock makes concurrent ranks
build once. A cached library, or a build folder, that another user owns or can write is refused (the key is
predictable: `build_cached`). The library exposes a plain C ABI and is loaded with ctypes (raw pointers from
`tensor.data_ptr()`, stream handles from `torch.cuda.current_stream().cuda_stream`, ints), so no torch
C++ extension is involved. On a machine without CUDA or nvcc nothing fails at import: `availability()`
says why the library cannot be had.

Environment:
  MOETUNE_CACHE        cache root (the library lands in $MOETUNE_CACHE/build/<key>/)
  MOETUNE_NVCC         nvcc to use (else $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc)
  MOETUNE_CUDA_ARCH    e.g. 90 or sm_90 (else the current GPU's compute capability, else 90)
  MOETUNE_CSRC_LIB     a prebuilt library to load instead of building
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable
from ctypes import POINTER, c_char_p, c_double, c_int, c_int64, c_uint64, c_void_p
from pathlib import Path
from typing import NamedTuple

from moetune.runtime.paths import foreign_link_reason, loose_key_path, sync_folder

# csrc/mt_common.cu mt_abi_version: 21 = mt_pxy_exchange takes send_rows (send counts checked); 22 = the nvlink
# exchanges take the rows their counts address (send_rows / src_rows / x_rows + tok_rows) and refuse counts outside
# them, a refused call marks its count-matrix row and its peers report MT_ERR_PEER_REFUSED at once, and a refusal can
# be cleared (mt_pxy_clear_error, mt_nvl_clear_error); 23 = mt_proxy_create, mt_ipc_malloc and mt_device_malloc take
# the caller's timeout_s (a double before their out-pointers) as the bound of their set-up waits, no longer a fixed 20 s
ABI_VERSION = 23
LIB_NAME = "libmoetune_csrc.so"
_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-O3", "-lineinfo")
_BUILD_TIMEOUT_S = 600


class BuildError(RuntimeError):
    """The sources could not be compiled or the library could not be loaded."""


class CsrcError(RuntimeError):
    """A call into the compiled library failed (the message comes from the library)."""


class BuildInfo(NamedTuple):
    path: Path
    built: bool  # False: found in the cache
    log: str


def csrc_dir() -> Path:
    """Where the sources live (the installed `moetune.csrc` package, i.e. the repository's csrc/)."""
    try:
        from moetune import csrc as _csrc  # the package that ships the .cu/.cpp files

        return Path(_csrc.__file__).resolve().parent
    except ImportError:  # pragma: no cover - running from a bare checkout
        return Path(__file__).resolve().parents[1] / "csrc"


def sources() -> list[Path]:
    d = csrc_dir()
    return sorted([*d.glob("*.cu"), *d.glob("*.cpp")])


def _all_inputs() -> list[Path]:
    d = csrc_dir()
    return sorted([*d.glob("*.cu"), *d.glob("*.cpp"), *d.glob("*.h"), *d.glob("*.cuh")])


def find_nvcc() -> str | None:
    cands = [os.environ.get("MOETUNE_NVCC")]
    if os.environ.get("CUDA_HOME"):
        cands.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"))
    cands += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"cannot run {nvcc} --version: {e}") from None
    if out.returncode != 0:
        raise BuildError(f"{nvcc} --version failed: {out.stderr.strip()}")
    lines = [ln for ln in out.stdout.splitlines() if "release" in ln or "Build" in ln]
    return " | ".join(lines) or out.stdout.strip()


def cuda_arch() -> str:
    """Target architecture as 'sm_XX'."""
    env = os.environ.get("MOETUNE_CUDA_ARCH", "").strip()
    if env:
        return env if env.startswith("sm_") else f"sm_{env}"
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except (ImportError, RuntimeError):  # no torch, or CUDA unusable: build for the default arch
        pass
    return "sm_90"


def cache_root() -> Path:
    env = os.environ.get("MOETUNE_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "moetune"
    return base / "build"


# What nvcc adds to every command line from its environment (conda-forge sets them to pick the host compiler): part
# of both build keys, so a build made with, say, NVCC_APPEND_FLAGS=-G or a measurement -D switch is never loaded
# under the plain build's key
NVCC_ENV_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")


def nvcc_env() -> str:
    """The NVCC_ENV_VARS set in this process, as NAME=value lines (empty when none is)."""
    return "".join(f"{n}={os.environ[n]}\n" for n in NVCC_ENV_VARS if n in os.environ)


def build_key(nvcc_ver: str, arch: str) -> str:
    h = hashlib.sha256()
    for p in _all_inputs():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(nvcc_ver.encode())
    h.update(arch.encode())
    h.update(" ".join(_FLAGS).encode())
    h.update(nvcc_env().encode())
    h.update(str(ABI_VERSION).encode())
    return h.hexdigest()[:20]


def untrusted_cache_path_reason(p: Path) -> str | None:
    """Why `p` (a build folder under the cache root, or a cached library) must not be trusted (None: it may): a
    folder or library another user owns or can write could hold a library they planted, and the key that names the
    folder is a predictable hash. `paths.loose_key_path`'s rule (owned by this user or root, not group- or
    world-writable), and no other user's symbolic link (it could be repointed after the check)."""
    try:
        why = foreign_link_reason(p, os.lstat(p), os.geteuid())
        loose = loose_key_path(p, forbid=0o022)
    except OSError as e:
        return f"cannot stat {p}: {e.strerror or e}"
    if why is not None:
        return why
    if loose is None:
        return None
    return (f"{p} is owned by uid {loose.uid} with mode {loose.mode:o} (this user is uid {os.geteuid()}): "
            + ("another user owns it" if loose.foreign_owner else "it is group- or world-writable"))


def _refuse_untrusted(p: Path, out_dir: Path) -> None:
    why = untrusted_cache_path_reason(p)
    if why is not None:
        raise BuildError(
            f"refusing to use the build cache: {why}; another user could plant the library moetune would load. "
            f"If the cache is yours, `chmod go-w` it (or remove {out_dir} to rebuild), else point MOETUNE_CACHE at a "
            "folder only you can write")


def _own_dir(d: Path) -> None:
    """Make folder `d` if absent: 0755 whatever the umask lets parents get (a group-writable umask would have
    the folder refused by the cache's own check)."""
    try:
        os.mkdir(d, 0o755)
    except FileExistsError:
        return
    os.chmod(d, 0o755)  # this process just made it: mkdir's mode went through the umask


# fsync's answers on a file system that does not support it: nothing to wait for there, not a failed write
_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def _fsync_file(path: Path) -> None:
    """fsync the file at `path`. nvcc's output renamed unsynced could be an empty or partial file under the cache's
    name after a power loss: found there by every later run (`lib.exists()`), never rebuilt, failing to load until
    the cache was removed by hand. A file system that does not support fsync (EINVAL, ENOTSUP: as the results table
    proceeds without flock) is no failed write; another error (EIO) fails the build."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def build_cached(out_dir: Path, lib_name: str, command: Callable[[Path], list[str]], header: str, *,
                 force: bool = False, verbose: bool = False, timeout_s: float | None = None) -> BuildInfo:
    """The cache both libraries share (this module's and the megakernel's): `out_dir` = <cache root>/<key>, the
    library `lib_name` in it, built by running `command(tmp)` under the folder's file lock unless it is there
    (or `force`). The cache root, `out_dir` and a cached library are refused unless this user or root owns them
    and nobody else can write them; a failed or timed-out build removes the temporary file it made."""
    timeout_s = _BUILD_TIMEOUT_S if timeout_s is None else timeout_s
    root = out_dir.parent
    root.parent.mkdir(parents=True, exist_ok=True)  # $MOETUNE_CACHE (or ~/.cache/moetune): not ours to check
    for d in (root, out_dir):
        _own_dir(d)
        _refuse_untrusted(d, out_dir)
    lib = out_dir / lib_name
    with open(out_dir / ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)  # concurrent ranks: the first builds, the others wait
        try:
            if lib.exists() and not force:
                _refuse_untrusted(lib, out_dir)
                log = (out_dir / "build.log").read_text() if (out_dir / "build.log").exists() else ""
                return BuildInfo(lib, False, log)
            # a name no other build uses: whatever is there after nvcc ran is this build's to remove
            tmp = out_dir / f".{lib_name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
            cmd = command(tmp)
            try:
                try:
                    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    raise BuildError(f"nvcc timed out after {timeout_s:g} s: {' '.join(cmd)}") from None
                log = f"$ {' '.join(cmd)}\n{nvcc_env()}{header}\n{res.stdout}{res.stderr}"
                (out_dir / "build.log").write_text(log)
                if verbose:
                    print(log, flush=True)
                if res.returncode != 0 or not tmp.exists():
                    raise BuildError(f"nvcc failed (exit {res.returncode}):\n{log}")
                os.chmod(tmp, 0o755)  # made by this build: not group-writable whatever the umask (the cache check)
                _fsync_file(tmp)  # on disk before its name is: `lib.exists()` is never rebuilt
                os.replace(tmp, lib)
                sync_folder(out_dir)  # the rename itself survives a power loss
            except BaseException:
                tmp.unlink(missing_ok=True)  # a half-written output of this build, never loaded
                raise
            return BuildInfo(lib, True, log)
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)


def build(*, force: bool = False, verbose: bool = False) -> BuildInfo:
    """Compile (or find in the cache) the shared library. Raises BuildError with nvcc's output."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set MOETUNE_NVCC or CUDA_HOME, or put nvcc on PATH)")
    srcs = sources()
    if not srcs:
        raise BuildError(f"no CUDA/C++ sources in {csrc_dir()}")
    ver = nvcc_version(nvcc)
    arch = cuda_arch()
    return build_cached(cache_root() / build_key(ver, arch), LIB_NAME,
                        lambda tmp: [nvcc, *_FLAGS, f"-arch={arch}", "-o", str(tmp), *map(str, srcs)], ver,
                        force=force, verbose=verbose)


# --- loading -------------------------------------------------------------------------------------------

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None

_P64 = POINTER(c_uint64)
_PI = POINTER(c_int)
_PP = POINTER(c_void_p)

# name -> (restype, argtypes). Every function returns int (0 = ok) except mt_last_error.
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "mt_last_error": (c_char_p, []),
    "mt_abi_version": (c_int, []),
    "mt_ctrl_bytes": (c_int, [_P64]),
    "mt_device_count": (c_int, [_PI]),
    "mt_runtime_versions": (c_int, [_PI, _PI]),
    "mt_can_access_peer": (c_int, [c_int, c_int, _PI]),
    "mt_enable_peer_access": (c_int, [c_int, c_int]),
    "mt_host_alloc_mapped": (c_int, [c_int, c_uint64, _PP, _PP]),
    "mt_host_free": (c_int, [c_void_p]),
    "mt_ipc_malloc": (c_int, [c_int, c_uint64, c_double, _PP, c_char_p]),  # device, bytes, timeout_s, ...
    "mt_ipc_open": (c_int, [c_int, c_char_p, _PP]),
    "mt_ipc_close": (c_int, [c_int, c_void_p]),
    "mt_device_malloc": (c_int, [c_int, c_uint64, c_double, _PP]),  # device, bytes, timeout_s, ptr
    "mt_device_free": (c_int, [c_int, c_void_p]),
    # nvlink
    "mt_nvl_create": (c_int, [c_int, c_int, c_int, _P64, c_int, c_double, _PP]),
    "mt_nvl_set_data": (c_int, [c_void_p, _P64, c_uint64]),
    "mt_nvl_ctas_per_peer": (c_int, [c_void_p, _PI]),
    "mt_nvl_counts": (c_int, [c_void_p, c_void_p, c_void_p, c_uint64]),
    "mt_nvl_exchange": (  # h, send, send_rows, row_bytes, send_counts, recv_counts, recv_out, coupled, group, stream
        c_int, [c_void_p, c_void_p, c_uint64, c_uint64, c_void_p, c_void_p, c_void_p, c_int, c_int, c_uint64]
    ),
    "mt_nvl_exchange_strided": (  # h, src, src_rows, src_stride, row_bytes, send_counts, recv_counts, recv_out, ...
        c_int, [c_void_p, c_void_p, c_uint64, c_uint64, c_uint64, c_void_p, c_void_p, c_void_p, c_int, c_int, c_uint64]
    ),
    "mt_nvl_exchange_gather": (  # h, x, x_rows, x_stride, payload_bytes, tok, tok_rows, idx, w, k, row_bytes, ...
        c_int, [c_void_p, c_void_p, c_uint64, c_uint64, c_uint64, c_void_p, c_uint64, c_void_p, c_void_p, c_int,
                c_uint64, c_uint64, c_uint64, c_void_p, c_void_p, c_int, c_int, c_uint64]
    ),
    "mt_nvl_err_ptr": (c_int, [c_void_p, _PP]),
    "mt_nvl_error": (c_int, [c_void_p, _PI]),
    "mt_nvl_clear_error": (c_int, [c_void_p]),
    "mt_nvl_destroy": (c_int, [c_void_p]),
    # ep_pack.cu: the EP buffer's packing (device-resident layout)
    "mt_pack_plan": (
        c_int, [c_void_p, c_int64, c_int, c_int64, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_uint64]
    ),
    "mt_pack_plan_scratch": (c_int64, [c_int64, c_int]),
    "mt_pack_rows": (
        c_int, [c_void_p, c_uint64, c_void_p, c_void_p, c_int64, c_int, c_int64, c_void_p, c_void_p, c_uint64, c_uint64,
                c_uint64, c_uint64]
    ),
    "mt_combine_reduce": (c_int, [c_void_p, c_uint64, c_void_p, c_int64, c_int, c_int, c_int, c_void_p, c_uint64]),
    # ep_fp8.cu: fp8 dispatch compression of the wire rows
    "mt_fp8_quant_rows": (
        c_int, [c_void_p, c_int, c_int64, c_int, c_int, c_void_p, c_void_p, c_int, c_void_p, c_uint64, c_uint64,
                c_uint64, c_uint64, c_uint64]
    ),
    "mt_fp8_dequant_rows": (c_int, [c_void_p, c_uint64, c_int64, c_int, c_int, c_uint64, c_int, c_void_p, c_uint64]),
    # host_staged.cu: staging through shared pinned host memory (host_staged transport)
    "mt_hs_create": (c_int, [c_int, c_int, c_void_p, c_uint64, c_double, c_int, c_int, _PP]),
    "mt_hs_post": (c_int, [c_void_p, c_int, c_uint64, c_int, _P64, c_int, _P64, c_void_p, c_void_p, c_uint64, _PI]),
    "mt_hs_wait": (c_int, [c_void_p, c_int, c_int, c_uint64]),
    "mt_hs_stats": (c_int, [c_void_p, _P64]),
    "mt_hs_error": (c_int, [c_void_p, _PI]),
    "mt_hs_destroy": (c_int, [c_void_p]),
    # proxy engine
    "mt_proxy_create": (  # device, npeers, peer_data/_ctrl/_sig, qps, qp_mapping, fence_mode, fifo_slots, cpus, ncpus,
        c_int, [c_int, c_int, _P64, _P64, _P64, c_int, c_int, c_int, c_int, _PI, c_int, c_double, _PP]  # timeout_s, out
    ),
    "mt_proxy_cpu": (c_int, [c_void_p, _PI, c_int]),
    "mt_proxy_cpu_list": (c_int, [c_void_p, _PI, c_int]),
    "mt_proxy_mem": (c_int, [c_void_p, _PI, c_int, c_char_p, c_int]),
    "mt_proxy_numa_node": (c_int, [_PI, c_int, c_char_p, _PI]),
    "mt_proxy_set_peer_data": (c_int, [c_void_p, _P64, c_int]),
    "mt_proxy_set_batch": (c_int, [c_void_p, c_int]),
    "mt_proxy_set_timeout": (c_int, [c_void_p, c_double]),
    "mt_proxy_error": (c_int, [c_void_p, c_char_p, c_int]),
    "mt_proxy_diag": (c_int, [c_void_p, c_char_p, c_int]),
    "mt_proxy_stats": (c_int, [c_void_p, _P64, c_int]),
    "mt_proxy_reset_stats": (c_int, [c_void_p]),
    "mt_proxy_enqueue": (c_int, [c_void_p, c_void_p, c_int, c_double]),
    "mt_proxy_quiesce": (c_int, [c_void_p, c_double]),
    "mt_proxy_bench": (c_int, [c_void_p, c_void_p, c_int, c_int, c_uint64, c_uint64, c_double, POINTER(c_double)]),
    "mt_proxy_destroy": (c_int, [c_void_p]),
    # proxy transport (GPU producer)
    "mt_pxy_create": (c_int, [c_void_p, c_int, c_int, c_int, c_uint64, c_double, _PP]),
    "mt_pxy_set_data": (c_int, [c_void_p, c_uint64]),
    "mt_pxy_set_host_wait": (c_int, [c_void_p, c_int]),
    "mt_pxy_counts": (c_int, [c_void_p, c_void_p, c_void_p, c_uint64, c_uint64]),
    "mt_pxy_exchange": (
        c_int,
        [c_void_p, c_void_p, c_uint64, c_uint64, c_void_p, c_void_p, c_int, c_int, c_int, c_uint64, c_uint64],
    ),
    "mt_pxy_error": (c_int, [c_void_p, _PI]),
    "mt_pxy_clear_error": (c_int, [c_void_p]),
    "mt_pxy_err_ptr": (c_int, [c_void_p, _PP]),
    "mt_pxy_destroy": (c_int, [c_void_p]),
    "mt_race_check_launch": (
        c_int,
        [c_int, c_uint64, c_void_p, c_uint64, c_void_p, c_uint64, c_uint64, c_uint64, c_int, c_int, c_uint64,
         c_double, c_void_p],
    ),
}


def _bind(lib: ctypes.CDLL) -> None:
    for name, (res, args) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise BuildError(f"library lacks symbol {name}: stale build?") from None
        fn.restype = res
        fn.argtypes = args


def load(*, verbose: bool = False) -> ctypes.CDLL:
    """Build (once, cached) and load the library. Raises BuildError with the reason."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise BuildError(_lib_error)
        try:
            pre = os.environ.get("MOETUNE_CSRC_LIB")
            path = Path(pre) if pre else build(verbose=verbose).path
            lib = ctypes.CDLL(str(path))
            _bind(lib)
            abi = lib.mt_abi_version()  # before any other call: an older library's signatures differ
            if abi != ABI_VERSION:
                raise BuildError(
                    f"{path}: ABI {abi}, expected {ABI_VERSION}: the library was built from other sources than this "
                    "moetune's (a stale MOETUNE_CSRC_LIB?) and would be called with the wrong arguments; rebuild it "
                    "from this checkout's csrc/ (or unset MOETUNE_CSRC_LIB to build into the cache)")
            _lib = lib
            return lib
        except BuildError as e:
            _lib_error = str(e)
            raise
        except OSError as e:
            _lib_error = f"cannot load the compiled library: {e}"
            raise BuildError(_lib_error) from None


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    """Raise CsrcError with the library's message when `rc` is nonzero."""
    if rc != 0:
        msg = lib.mt_last_error()
        raise CsrcError(f"{what} failed (code {rc}): {msg.decode(errors='replace') if msg else ''}")


def availability() -> tuple[bool, str]:
    """Whether the compiled library can be used here (CUDA device, nvcc or prebuilt lib, loads)."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        return False, f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return False, f"no CUDA device visible to torch {torch.__version__} (CPU build or no driver)"
    if not os.environ.get("MOETUNE_CSRC_LIB") and find_nvcc() is None:
        return False, "nvcc not found: cannot build csrc/ (set MOETUNE_NVCC/CUDA_HOME or MOETUNE_CSRC_LIB)"
    try:
        lib = load()
    except BuildError as e:
        return False, f"csrc build/load failed: {str(e)[:2000]}"
    n = c_int(0)
    rc = lib.mt_device_count(ctypes.byref(n))
    if rc != 0 or n.value < 1:
        return False, f"the compiled library sees no CUDA device: {lib.mt_last_error().decode(errors='replace')}"
    return True, "ok"
