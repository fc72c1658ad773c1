"""Where fabric discovery's raw inputs come from: the live node, a capture directory, or a recording of either.

Everything discovery reads goes through a `Source`:

- `LiveSource` reads the real /sys and /proc and runs external commands (each with a timeout, found with
  `shutil.which` first: a missing tool is a fact, not an error);
- `CaptureSource` reads a capture directory (`moetune fabric capture DIR`): `sys/...` and `proc/...`
  mirror the real paths, `commands/<argv joined by _>` hold each command's stdout;
- `RecordingSource` wraps a live source and remembers every answer so that `moetune.tuner.fabric.capture` can
  write exactly what discovery read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.tuner.fabric.errors import CaptureError, DiscoveryError

# Python distributions whose versions are software facts (looked up through importlib.metadata).
PACKAGES: tuple[str, ...] = (
    "torch",
    "nvidia-nccl-cu13",
    "nvidia-nccl-cu12",
    "nvidia-nccl-cu11",
    "nvidia-nvshmem-cu13",
    "nvidia-nvshmem-cu12",
    "nvshmem4py-cu13",
    "nvshmem4py-cu12",
    "nvidia-cuda-runtime-cu13",
    "nvidia-cuda-runtime-cu12",
    "nvidia-cuda-runtime",
    "moetune",
)

PACKAGES_FILE = "python/packages.json"
GPU_API_FILE = "gpu_api.json"
MANIFEST_FILE = "manifest.json"
CAPTURE_FORMAT = "moetune-capture/1"


def command_key(argv: Sequence[str]) -> str:
    """File name of a command's stdout in a capture: argv joined by '_'."""
    return "_".join(argv)


@dataclass
class CommandResult:
    argv: tuple[str, ...]
    status: str  # ok | missing | timeout | failed
    stdout: str = ""
    rc: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def describe(self) -> str:
        if self.status == "failed":
            return f"failed (rc {self.rc})"
        return self.status



class Source(ABC):
    """Where discovery's raw inputs come from. Paths are absolute node paths ("/sys/class/...")."""

    name = "source"
    error_class: type[DiscoveryError] = DiscoveryError

    @abstractmethod
    def read_bytes(self, path: str) -> bytes | None:
        """Contents of a file, or None when it does not exist or cannot be read."""

    @abstractmethod
    def listdir(self, path: str) -> list[str] | None:
        """Sorted entries of a directory, or None when it does not exist."""

    @abstractmethod
    def run(self, argv: Sequence[str]) -> CommandResult:
        """Run (or look up) one external command."""

    def prefetch(self, commands: Iterable[Sequence[str]]) -> None:
        """Start commands early (live sources run them in parallel)."""

    @abstractmethod
    def packages(self) -> dict[str, str | None]:
        """Versions of the Python distributions in PACKAGES (None: not installed)."""

    @abstractmethod
    def gpu_api(self) -> dict[str, Any] | None:
        """GPU facts from NVML (or an already-imported torch) when nvidia-smi is absent; else None."""

    def where(self, path: str) -> str:
        return path

    def where_command(self, argv: Sequence[str]) -> str:
        return "`" + " ".join(argv) + "`"

    def read_text(self, path: str) -> str | None:
        data = self.read_bytes(path)
        return None if data is None else data.decode("utf-8", errors="replace")

    def error(self, where: str, message: str) -> DiscoveryError:
        return self.error_class(where, message)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        try:
            proc.kill()
        except OSError:
            pass


class LiveSource(Source):
    """The real node. Commands run with a timeout each and never hang discovery."""

    name = "live"

    def __init__(self, timeout_s: float = 1.5) -> None:
        self.timeout_s = timeout_s
        self._results: dict[tuple[str, ...], CommandResult] = {}
        self._pending: dict[tuple[str, ...], Any] = {}
        self._pool: ThreadPoolExecutor | None = None

    def read_bytes(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError):
            return None
        except OSError:  # sysfs attributes may refuse reads (EINVAL, EIO): treat as absent
            return None

    def listdir(self, path: str) -> list[str] | None:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return None
        except OSError:
            return None

    def _execute(self, argv: tuple[str, ...]) -> CommandResult:
        t0 = time.perf_counter()
        exe = shutil.which(argv[0])
        if exe is None:
            return CommandResult(argv, "missing")
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        try:
            proc = subprocess.Popen(
                [exe, *argv[1:]],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError:
            return CommandResult(argv, "missing", seconds=time.perf_counter() - t0)
        try:
            out, _ = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            try:  # a process stuck in the kernel may not die: do not wait for it
                proc.communicate(timeout=0.2)
            except (subprocess.TimeoutExpired, OSError):
                pass
            return CommandResult(argv, "timeout", seconds=time.perf_counter() - t0)
        text = out.decode("utf-8", errors="replace")
        status = "ok" if proc.returncode == 0 else "failed"
        return CommandResult(argv, status, text, proc.returncode, time.perf_counter() - t0)

    def prefetch(self, commands: Iterable[Sequence[str]]) -> None:
        todo = [tuple(c) for c in commands if tuple(c) not in self._results and tuple(c) not in self._pending]
        if not todo:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="moetune-discovery")
        for argv in todo:
            self._pending[argv] = self._pool.submit(self._execute, argv)

    def run(self, argv: Sequence[str]) -> CommandResult:
        key = tuple(argv)
        if key in self._results:
            return self._results[key]
        fut = self._pending.pop(key, None)
        res = fut.result() if fut is not None else self._execute(key)
        self._results[key] = res
        return res

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def packages(self) -> dict[str, str | None]:
        from importlib.metadata import PackageNotFoundError, version

        out: dict[str, str | None] = {}
        for name in PACKAGES:
            try:
                out[name] = version(name)
            except PackageNotFoundError:
                out[name] = None
            except Exception:  # a broken dist-info must not break discovery
                out[name] = None
        # Not the NCCL version torch reports: only known once torch is imported, so the same node would get
        # two software hashes (the daemon imports torch for its first local re-tune).
        return out

    def gpu_api(self) -> dict[str, Any] | None:
        # Only a fallback: the nvidia-smi outputs (which captures keep) are the primary GPU source.
        if shutil.which("nvidia-smi") is not None:
            return None
        # NVML runs in-process: bound it like a command (a daemon thread is abandoned if NVML hangs)
        box: list[dict[str, Any] | None] = []
        th = threading.Thread(target=lambda: box.append(_nvml_facts()), name="moetune-nvml", daemon=True)
        th.start()
        th.join(self.timeout_s)
        if th.is_alive() or not box:
            return {"api": "nvml", "gpus": [], "status": "timeout"}
        return box[0] or _torch_facts()


def _nvml_facts() -> dict[str, Any] | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None

    def s(x: Any) -> str:
        return x.decode() if isinstance(x, bytes) else str(x)

    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            g: dict[str, Any] = {
                "index": i,
                "name": s(pynvml.nvmlDeviceGetName(h)),
                "uuid": s(pynvml.nvmlDeviceGetUUID(h)),
                "pci_bus_id": s(pynvml.nvmlDeviceGetPciInfo(h).busId),
                "memory_mib": int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024),
            }
            try:
                g["serial"] = s(pynvml.nvmlDeviceGetSerial(h))
            except pynvml.NVMLError:  # not every board reports one (consumer GPUs): the UUID still identifies it
                g["serial"] = ""
            for key, fn in (
                ("compute_capability", pynvml.nvmlDeviceGetCudaComputeCapability),
                ("pcie_gen_max", pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                ("pcie_width_max", pynvml.nvmlDeviceGetMaxPcieLinkWidth),
                ("pcie_width_current", pynvml.nvmlDeviceGetCurrPcieLinkWidth),
            ):
                try:
                    v = fn(h)
                    g[key] = f"{v[0]}.{v[1]}" if isinstance(v, tuple) else int(v)
                except pynvml.NVMLError as e:
                    if getattr(e, "value", None) == getattr(pynvml, "NVML_ERROR_NO_PERMISSION", 4):
                        g.setdefault("withheld", []).append(key)  # refused to this user: facts incomplete
            links = []
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    active = pynvml.nvmlDeviceGetNvLinkState(h, link) == 1
                except pynvml.NVMLError:
                    break
                links.append({"link": link, "active": active})
            g["nvlinks"] = links
            gpus.append(g)
        out = {"api": "nvml", "gpus": gpus}
        try:
            out["driver"] = s(pynvml.nvmlSystemGetDriverVersion())
            v = pynvml.nvmlSystemGetCudaDriverVersion()
            out["cuda"] = f"{v // 1000}.{(v % 1000) // 10}"
        except pynvml.NVMLError:
            pass
        return out
    except Exception:  # broad: this runs in a thread with no caller to raise to; any failure falls back to torch
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _torch_facts() -> dict[str, Any] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        gpus = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": p.name,
                    "uuid": str(getattr(p, "uuid", "")),
                    "memory_mib": int(p.total_memory) // (1024 * 1024),
                    "compute_capability": f"{p.major}.{p.minor}",
                }
            )
        return {"api": "torch", "gpus": gpus}
    except Exception:  # broad: the last-resort GPU source; a broken CUDA setup means no GPUs, not a crash
        return None


_WRITE_ONE = "a fabric capture is a directory `moetune fabric capture DIR` writes"


def read_capture_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The one rule for a capture directory (every command taking --capture/--from uses it, through
    CaptureSource or directly): it exists, is a directory and holds the manifest.json `moetune fabric capture`
    writes (a JSON object of format moetune-capture/1). Else a CaptureError naming the path and what is missing:
    an empty or unrelated folder read as a capture described a node with no GPU and no NIC."""
    root = Path(root)
    if not root.is_dir():
        raise CaptureError(root, f"{'not a directory' if root.exists() else 'no such directory'} ({_WRITE_ONE})")
    mpath = root / MANIFEST_FILE
    if not mpath.is_file():
        try:
            what = "is empty" if not any(root.iterdir()) else f"holds no {MANIFEST_FILE}"
        except OSError as e:
            raise CaptureError(root, f"cannot read the directory: {e.strerror or e}")
        raise CaptureError(root, f"not a fabric capture: the directory {what} ({_WRITE_ONE}, with "
                                 f"{MANIFEST_FILE}, proc/, commands/ and, on a GPU node, sys/)")
    try:
        m = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CaptureError(mpath, f"manifest is not valid JSON: {e}")
    except OSError as e:
        raise CaptureError(mpath, f"cannot read: {e.strerror or e}")
    if not isinstance(m, dict):
        raise CaptureError(mpath, "manifest must be a JSON object")
    if m.get("format") != CAPTURE_FORMAT:
        raise CaptureError(mpath, f"not a fabric capture manifest: format {m.get('format')!r}, expected "
                                  f"{CAPTURE_FORMAT!r} ({_WRITE_ONE})")
    return m


class CaptureSource(Source):
    """A capture directory written by `moetune fabric capture` (or by hand, for tests)."""

    name = "capture"
    error_class = CaptureError

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.unread: list[str] = []  # what discovery could not read from it (warnings of its facts)
        self.manifest: dict[str, Any] = read_capture_manifest(self.root)
        self._sizes: dict[str, int] = {}
        files = self.manifest.get("files", {})
        if isinstance(files, dict):
            self._sizes = {k: v for k, v in files.items() if isinstance(v, int)}
        cmds = self.manifest.get("commands", {})
        self._cmd_meta: dict[str, dict[str, Any]] = cmds if isinstance(cmds, dict) else {}

    def _local(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def where(self, path: str) -> str:
        return str(self._local(path))

    def where_command(self, argv: Sequence[str]) -> str:
        return str(self.root / "commands" / command_key(argv))

    def _check_size(self, rel: str, data: bytes, where: str) -> None:
        want = self._sizes.get(rel)
        if want is not None and len(data) != want:
            raise CaptureError(where, f"truncated or modified: {len(data)} bytes, the manifest recorded {want}")

    def read_bytes(self, path: str) -> bytes | None:
        p = self._local(path)
        try:
            data = p.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            want = self._sizes.get(path.lstrip("/"))
            if want is not None:  # a file the capture wrote, lost since: not "absent on the node" (as `run` says)
                raise CaptureError(p, f"missing: the manifest records this file ({want} bytes), but it is not in the "
                                      "capture (copy the capture again)") from None
            return None
        except OSError as e:
            raise CaptureError(p, f"cannot read: {e.strerror or e}")
        self._check_size(path.lstrip("/"), data, str(p))
        return data

    def listdir(self, path: str) -> list[str] | None:
        p = self._local(path)
        try:
            return sorted(os.listdir(p))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def run(self, argv: Sequence[str]) -> CommandResult:
        key = command_key(argv)
        p = self.root / "commands" / key
        meta = self._cmd_meta.get(key, {})
        meta = meta if isinstance(meta, dict) else {}
        status = meta.get("status")
        rc = meta.get("rc")
        if not p.exists():
            if status in ("timeout", "failed", "missing"):
                return CommandResult(tuple(argv), status, "", rc)
            if status == "ok":
                # the command ran and its output was written: a file lost since is no "tool missing" (that read as a
                # GPU-less node of another fingerprint)
                raise CaptureError(p, "missing: the manifest records this command's output (status ok), but the "
                                      "file is not in the capture (copy the capture again)")
            return CommandResult(tuple(argv), "missing")
        try:
            data = p.read_bytes()
        except OSError as e:
            raise CaptureError(p, f"cannot read: {e.strerror or e}")
        self._check_size("commands/" + key, data, str(p))
        if status not in ("ok", "failed", "timeout"):
            status = "ok"
        return CommandResult(tuple(argv), status, data.decode("utf-8", errors="replace"), rc)

    def packages(self) -> dict[str, str | None]:
        p = self.root / PACKAGES_FILE
        if not p.exists():
            if "files" in self.manifest:  # `moetune fabric capture` always writes it: lost since
                raise CaptureError(p, "missing: `moetune fabric capture` writes the Python package versions here, "
                                      "but the file is not in the capture (copy the capture again)")
            # a hand-made capture without it: every version unknown ("none"), said, not a node without torch in silence
            self.unread.append(f"{p} was not read (missing): the Python package versions (torch, NCCL, NVSHMEM, "
                               "moetune) are unknown; facts are incomplete")
            return {}
        try:
            d = json.loads(p.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CaptureError(p, f"not valid JSON: {e}")
        if not isinstance(d, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in d.items()
        ):
            raise CaptureError(p, "must be a JSON object of distribution name -> version string or null")
        return d

    def gpu_api(self) -> dict[str, Any] | None:
        p = self.root / GPU_API_FILE
        if not p.exists():
            return None
        try:
            d = json.loads(p.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CaptureError(p, f"not valid JSON: {e}")
        if not isinstance(d, dict) or not isinstance(d.get("gpus", []), list):
            raise CaptureError(p, "must be a JSON object with a 'gpus' list")
        return d


class RecordingSource(Source):
    """Wraps a source and remembers every answer (what `capture` writes)."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.name = inner.name
        self.error_class = inner.error_class
        self.files: dict[str, bytes] = {}
        self.dirs: dict[str, list[str]] = {}
        self.commands: dict[tuple[str, ...], CommandResult] = {}
        self.package_versions: dict[str, str | None] | None = None
        self.gpu_api_data: dict[str, Any] | None = None

    def read_bytes(self, path: str) -> bytes | None:
        data = self.inner.read_bytes(path)
        if data is not None:
            self.files[path] = data
        return data

    def listdir(self, path: str) -> list[str] | None:
        entries = self.inner.listdir(path)
        if entries is not None:
            self.dirs[path] = entries
        return entries

    def prefetch(self, commands: Iterable[Sequence[str]]) -> None:
        self.inner.prefetch(commands)

    def run(self, argv: Sequence[str]) -> CommandResult:
        res = self.inner.run(argv)
        self.commands[tuple(argv)] = res
        return res

    def packages(self) -> dict[str, str | None]:
        self.package_versions = self.inner.packages()
        return self.package_versions

    def gpu_api(self) -> dict[str, Any] | None:
        self.gpu_api_data = self.inner.gpu_api()
        return self.gpu_api_data

    def where(self, path: str) -> str:
        return self.inner.where(path)

    def where_command(self, argv: Sequence[str]) -> str:
        return self.inner.where_command(argv)

