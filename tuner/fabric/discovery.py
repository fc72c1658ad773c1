"""Fabric discovery: what decides EP communication performance on this node (issue 3).

Everything discovery reads goes through a `Source`:

- `LiveSource` reads the real /sys and /proc and runs external commands (each with a timeout, found with
  `shutil.which` first: a missing tool is a fact, not an error);
- `CaptureSource` reads a capture directory (`moetune fabric capture DIR`): `sys/...` and `proc/...`
  mirror the real paths, `commands/<argv joined by _>` hold each command's stdout;
- `RecordingSource` wraps a live source and remembers every answer so that `moetune.tuner.fabric.capture` can
  write exactly what discovery read.

The parsing below is the same for all of them, so `fabric show --from DIR` analyses a capture exactly as
it would the live node. Garbled input raises `CaptureError` (a `DiscoveryError`) naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.runtime.transports._affinity import sysfs_pci_address  # nvidia-smi bus id -> sysfs name
from moetune.tuner.fabric.facts import (
    GPU,
    NIC,
    NONE,
    SOFTWARE_KEYS,
    ExcludedNIC,
    FabricFacts,
    GPUDirect,
    GPUNic,
    GPUPair,
    Libfabric,
    NICPort,
    NVLinkLink,
)

# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


class DiscoveryError(Exception):
    """Input discovery could not make sense of; `path` names the file (or command output)."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        self.path = str(path)
        self.message = message
        super().__init__(f"{self.path}: {message}")


class CaptureError(DiscoveryError):
    """A capture directory holds a truncated, garbled or missing-but-required file."""


# ------------------------------------------------------------------------------------------------
# commands discovery runs (their stdout is what a capture stores)
# ------------------------------------------------------------------------------------------------

SMI_XML = ("nvidia-smi", "-q", "-x")
SMI_TOPO = ("nvidia-smi", "topo", "-m")
SMI_P2P = ("nvidia-smi", "topo", "-p2p", "r")
SMI_NVLINK = ("nvidia-smi", "nvlink", "-s")
SMI_QUERY = ("nvidia-smi", "--query-gpu=index,pci.bus_id,compute_cap", "--format=csv,noheader")
FI_LIST = ("fi_info", "-l")
FI_VERSION = ("fi_info", "--version")
COMMANDS: tuple[tuple[str, ...], ...] = (SMI_XML, SMI_TOPO, SMI_P2P, SMI_NVLINK, SMI_QUERY, FI_LIST, FI_VERSION)

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

IB_ROOT = "/sys/class/infiniband"
PCI_DEVICES = "/sys/bus/pci/devices"
CXI_ROOT = "/sys/class/cxi"
PROC_MODULES = "/proc/modules"
PROC_NV_VERSION = "/proc/driver/nvidia/version"
PROC_OSRELEASE = "/proc/sys/kernel/osrelease"

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


# ------------------------------------------------------------------------------------------------
# sources
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# parsers (shared by every source)
# ------------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LEVEL_RE = re.compile(r"^(X|NV\d+|SYS|NODE|PHB|PXB|PIX|SOC|PSB|C2C|N/A)$")
_P2P_RE = re.compile(r"^(X|OK|CNS|GNS|TNS|NS|U|IOCNS|N/A)$")


def normalize_bus_id(bus: str) -> str:
    """'0000:18:00.0' / '00000000:18:00.0' -> '00000000:18:00.0' (upper-case hex)."""
    bus = bus.strip().upper()
    m = re.match(r"^([0-9A-F]+):([0-9A-F]{2}):([0-9A-F]{2})\.([0-9A-F])$", bus)
    if not m:
        return bus
    return f"{int(m.group(1), 16):08X}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


# What nvidia-smi prints for a field NVML refused this user (NVML_ERROR_NO_PERMISSION), in its spellings.
_DENIED = ("[insufficient permissions]", "insufficient permissions", "[no permission]", "no permission")


def denied(text: str | None) -> bool:
    """True when nvidia-smi says the field was withheld from this user (not that the GPU has no such value)."""
    return text is not None and text.strip().lower() in _DENIED


def _int_or_none(text: str | None, where: str, what: str, src: Source, suffix: str = "") -> int | None:
    if text is None:
        return None
    t = text.strip()
    if t in ("", "N/A", "[N/A]", "Unknown", "[Unknown Error]", "Not Available") or denied(t):
        return None
    if suffix and t.lower().endswith(suffix):
        t = t[: -len(suffix)].strip()
    try:
        return int(t)
    except ValueError:
        raise src.error(where, f"{what}: cannot read {text.strip()!r} as a number")


def parse_smi_xml(text: str, where: str, src: Source) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """`nvidia-smi -q -x` -> (GPU dicts sorted by PCI bus id, {"driver", "cuda"})."""
    if not text.strip():
        raise src.error(where, "empty file (expected the XML of `nvidia-smi -q -x`)")
    if "<!ENTITY" in text:
        raise src.error(where, "XML entity declarations are not accepted")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise src.error(where, f"not valid XML ({e}); truncated or garbled?")
    if root.tag != "nvidia_smi_log":
        raise src.error(where, f"root element is <{root.tag}>, expected <nvidia_smi_log>")
    gpus = []
    for g in root.findall("gpu"):
        bus = normalize_bus_id(g.get("id") or g.findtext("pci/pci_bus_id") or "")
        name = (g.findtext("product_name") or "").strip()
        if not name:
            raise src.error(where, f"GPU {bus or '?'} has no <product_name>")
        mem_text = g.findtext("fb_memory_usage/total")
        mem = _int_or_none(mem_text, where, f"GPU {bus} memory total", src, suffix="mib")
        link = "pci/pci_gpu_link_info/"
        # fingerprinted fields nvidia-smi withheld from this user: unknown here, and the facts incomplete (a
        # view that misses them is no evidence of a change; see `_discover_gpus`)
        fingerprinted = {
            "memory": "fb_memory_usage/total",
            "compute capability": "compute_cap",
            "PCIe max generation": link + "pcie_gen/max_link_gen",
            "PCIe max width": link + "link_widths/max_link_width",
            "PCIe width": link + "link_widths/current_link_width",
            "MIG mode": "mig_mode/current_mig",
            "NVSwitch fabric state": "fabric/state",
        }
        withheld = [what for what, path in fingerprinted.items() if denied(g.findtext(path))]
        fabric_state = (g.findtext("fabric/state") or "").strip()
        d: dict[str, Any] = {
            "pci_bus_id": bus,
            "name": name,
            "uuid": (g.findtext("uuid") or "").strip(),
            "serial": _serial(g.findtext("serial")),
            "memory_mib": mem or 0,
            "compute_capability": (g.findtext("compute_cap") or "").strip(),
            "pcie_gen_max": _int_or_none(g.findtext(link + "pcie_gen/max_link_gen"), where, f"GPU {bus} PCIe max gen", src),
            "pcie_gen_current": _int_or_none(
                g.findtext(link + "pcie_gen/current_link_gen"), where, f"GPU {bus} PCIe gen", src
            ),
            "pcie_width_max": _int_or_none(
                g.findtext(link + "link_widths/max_link_width"), where, f"GPU {bus} PCIe max width", src, suffix="x"
            ),
            "pcie_width_current": _int_or_none(
                g.findtext(link + "link_widths/current_link_width"), where, f"GPU {bus} PCIe width", src, suffix="x"
            ),
            "mig": (g.findtext("mig_mode/current_mig") or "").strip().lower() == "enabled",
            "fabric_state": "" if denied(fabric_state) else fabric_state,
            "withheld": withheld,
        }
        if not re.match(r"^(\d+\.\d+)?$", d["compute_capability"]):
            d["compute_capability"] = ""
        gpus.append(d)
    seen = set()
    for d in gpus:
        if d["pci_bus_id"] in seen:
            raise src.error(where, f"GPU PCI bus id {d['pci_bus_id']} listed twice")
        seen.add(d["pci_bus_id"])
    gpus.sort(key=lambda d: d["pci_bus_id"])
    versions = {
        "driver": (root.findtext("driver_version") or "").strip(),
        "cuda": (root.findtext("cuda_version") or "").strip(),
    }
    return gpus, versions


def _split_row(line: str) -> list[str]:
    if "\t" in line:
        return [t.strip() for t in line.split("\t") if t.strip()]
    return line.split()


def parse_matrix(text: str, where: str, src: Source, what: str, value_re: re.Pattern[str]) -> dict[str, Any]:
    """A `nvidia-smi topo` matrix -> {"cols": [...], "rows": {label: [values]}, "legend": {NIC0: name}}."""
    if not text.strip():
        raise src.error(where, f"empty file (expected the matrix of {what})")
    lines = _ANSI.sub("", text).splitlines()  # some nvidia-smi versions underline the header
    header_i = None
    for i, line in enumerate(lines):
        toks = _split_row(line)
        if toks and toks[0] == "GPU0":
            header_i = i
            break
        if "GPU0" in toks and not line.lstrip().startswith("GPU0"):
            header_i = i
            break
    if header_i is None:
        raise src.error(where, f"no header row with GPU0 found (expected the matrix of {what})")
    cols: list[str] = []
    for tok in _split_row(lines[header_i]):
        if tok.startswith(("CPU", "NUMA", "GPU NUMA", "Affinity")):
            break
        cols.append(tok)
    rows: dict[str, list[str]] = {}
    legend: dict[str, str] = {}
    in_legend = False
    for line in lines[header_i + 1 :]:
        s = line.strip()
        if not s:
            continue
        if s.startswith("Legend") or s.startswith("NIC Legend"):
            in_legend = True
            continue
        if in_legend:
            m = re.match(r"^(NIC\d+)\s*:\s*(\S+)$", s)
            if m:
                legend[m.group(1)] = m.group(2)
            continue
        toks = _split_row(line)
        if not toks or toks[0] not in cols:
            raise src.error(where, f"unexpected line in {what}: {s[:60]!r}")
        vals = toks[1 : 1 + len(cols)]
        if len(vals) < len(cols):
            raise src.error(where, f"row {toks[0]} has {len(vals)} entries, expected {len(cols)} (truncated?)")
        for v in vals:
            if not value_re.match(v):
                raise src.error(where, f"row {toks[0]}: unknown entry {v!r}")
        rows[toks[0]] = vals
    return {"cols": cols, "rows": rows, "legend": legend}


_GT_S = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*GT/s")
_GEN_BY_GT = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}


def _sysfs_int(src: Source, path: str, what: str) -> int | None:
    text = src.read_text(path)
    if text is None or not text.strip():
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise src.error(src.where(path), f"cannot read {what} {text.strip()[:40]!r} as a number")


def pci_link(src: Source, dev: str) -> dict[str, int | None]:
    """PCIe link and NUMA node of the PCI device directory `dev` (…/device of a NIC, /sys/bus/pci/devices/<addr>):
    pcie_gen_max (from max_link_speed), pcie_width_max, pcie_width_current, numa_node. These sysfs attributes are
    world-readable (0444; numa_node 0644), so every user reads the same; one that is not there (a container
    without the PCI tree, a capture by an older moetune, a virtual device) is None, unknown. The current link
    speed is left out: it drops with link power management."""
    speed = src.read_text(f"{dev}/max_link_speed")
    gen = None
    if speed is not None and speed.strip() and speed.strip().lower() != "unknown":
        m = _GT_S.match(speed)
        if not m:
            raise src.error(src.where(f"{dev}/max_link_speed"), f"cannot read PCIe speed {speed.strip()[:40]!r} (expected e.g. '32.0 GT/s PCIe')")
        gen = _GEN_BY_GT.get(float(m.group(1)))
    return {
        "pcie_gen_max": gen,
        "pcie_width_max": _sysfs_int(src, f"{dev}/max_link_width", "PCIe max width"),
        "pcie_width_current": _sysfs_int(src, f"{dev}/current_link_width", "PCIe width"),
        "numa_node": _sysfs_int(src, f"{dev}/numa_node", "NUMA node"),
    }


def _serial(text: Any) -> str:
    """A board serial, or "" where the tool says it has none."""
    v = str(text or "").strip()
    return "" if v.upper() in ("N/A", "NOT SUPPORTED", "[N/A]", "0") else v


_GPU_HDR = re.compile(r"^GPU\s+(\d+)\s*:\s*(.*?)\s*(?:\(UUID:\s*([^)\s]+)\s*\))?\s*$")
_LINK = re.compile(r"^Link\s+(\d+)\s*:\s*(.*?)\s*$", re.I)


def parse_nvlink(text: str, where: str, src: Source) -> list[dict[str, Any]]:
    """`nvidia-smi nvlink -s` -> [{"index", "uuid", "links": [NVLinkLink]}]."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        m = _GPU_HDR.match(s)
        if m:
            cur = {"index": int(m.group(1)), "uuid": m.group(3) or "", "links": []}
            out.append(cur)
            continue
        m = _LINK.match(s)
        if m:
            if cur is None:
                raise src.error(where, f"link line before any GPU line: {s[:60]!r}")
            val = m.group(2)
            low = val.lower()
            if re.search(r"\b(inactive|down|disabled|not active)\b", low):
                cur["links"].append(NVLinkLink(link=int(m.group(1)), active=False))
                continue
            sm = re.search(r"(\d+(?:\.\d+)?)\s*GB/s", val)
            if sm:
                speed = round(float(sm.group(1)), 3)
            elif re.search(r"\b(active|up)\b", low):
                speed = 0.0
            else:
                raise src.error(where, f"NVLink {m.group(1)} of GPU {cur['index']}: cannot read {val!r}")
            cur["links"].append(NVLinkLink(link=int(m.group(1)), active=True, speed_gbs=speed))
        # anything else (NVML notices such as "all links are inactive") is informational
    return out


def parse_query_cc(text: str) -> dict[str, str]:
    """`nvidia-smi --query-gpu=index,pci.bus_id,compute_cap` -> {bus id: "9.0"} (tolerant)."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and re.match(r"^\d+\.\d+$", parts[2]):
            out[normalize_bus_id(parts[1])] = parts[2]
    return out


_STATE_RE = re.compile(r"^\s*(\d+)\s*:\s*([A-Za-z_]+)\s*$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")


def parse_port_state(text: str | None, where: str, src: Source) -> str:
    if text is None:
        raise src.error(where, "missing")
    m = _STATE_RE.match(text)
    if not m:
        raise src.error(where, f"cannot read port state {text.strip()[:40]!r} (expected e.g. '4: ACTIVE')")
    return m.group(2).upper()


def parse_rate(text: str | None, where: str, src: Source) -> float:
    if text is None:  # the kernel refuses the read (EINVAL) when the port has no valid width/speed
        return 0.0
    m = _RATE_RE.match(text)
    if not m:
        raise src.error(where, f"cannot read link rate {text.strip()[:40]!r} (expected e.g. '400 Gb/sec (4X NDR)')")
    return float(m.group(1))


def parse_link_layer(text: str | None, where: str, src: Source) -> str:
    if text is None:
        raise src.error(where, "missing")
    s = text.strip()
    if not re.match(r"^[A-Za-z][A-Za-z0-9 ]{0,31}$", s):
        raise src.error(where, f"cannot read link layer {s[:40]!r} (expected InfiniBand or Ethernet)")
    return s


def parse_uevent(text: str | None) -> dict[str, str]:
    out = {}
    for line in (text or "").splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def parse_fi_list(text: str, where: str, src: Source) -> list[str]:
    names = []
    other = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^([A-Za-z0-9_;.\-]+):\s*$", line)
        if m:
            names.append(m.group(1))
        elif re.match(r"^\s+version:\s*\S+", line):
            continue
        else:
            other += 1
    if other and not names:
        raise src.error(where, "no libfabric provider recognised in `fi_info -l` output")
    return sorted(set(names))


def parse_fi_version(text: str) -> str:
    m = re.search(r"^libfabric:\s*(\S+)", text, re.M)
    return m.group(1) if m else ""


def parse_modules(text: str | None, where: str, src: Source) -> set[str]:
    if text is None:
        return set()
    if not text.strip():
        raise src.error(where, "empty file (expected the lines of /proc/modules)")
    mods = set()
    for line in text.splitlines():
        toks = line.split()
        if not toks:
            continue
        if not re.match(r"^[A-Za-z0-9_]+$", toks[0]):
            raise src.error(where, f"cannot read module line {line[:60]!r}")
        mods.add(toks[0])
    return mods


def _kernel_at_least(release: str, major: int, minor: int) -> bool:
    m = re.match(r"^(\d+)\.(\d+)", release.strip())
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (major, minor)


# Compute capability when neither nvidia-smi nor NVML reports it (longest match first).
_CC_BY_MODEL = (
    ("GB200", "10.0"), ("B200", "10.0"), ("B100", "10.0"), ("GH200", "9.0"), ("H200", "9.0"),
    ("H100", "9.0"), ("H800", "9.0"), ("H20", "9.0"), ("A100", "8.0"), ("A800", "8.0"), ("A30", "8.0"),
    ("RTX 5090", "12.0"), ("RTX 4090", "8.9"), ("L40", "8.9"), ("L4", "8.9"), ("RTX 3090", "8.6"),
    ("A40", "8.6"), ("A10", "8.6"), ("V100", "7.0"),
)  # fmt: skip


def cc_from_model(model: str) -> str:
    for key, cc in _CC_BY_MODEL:
        if key in model:
            return cc
    return ""


# ------------------------------------------------------------------------------------------------
# discovery
# ------------------------------------------------------------------------------------------------


def _gpu_api_rows(api: dict[str, Any]) -> list[dict[str, Any]]:
    raw = []
    for g in api.get("gpus", []):
        if not isinstance(g, dict) or not g.get("name"):
            continue
        raw.append(
            {
                "pci_bus_id": normalize_bus_id(str(g.get("pci_bus_id", ""))),
                "name": str(g["name"]),
                "uuid": str(g.get("uuid", "")),
                "serial": _serial(g.get("serial")),
                "memory_mib": int(g.get("memory_mib") or 0),
                "compute_capability": str(g.get("compute_capability", "")),
                "pcie_gen_max": None if g.get("pcie_gen_max") is None else int(g["pcie_gen_max"]),
                "pcie_gen_current": None,
                "pcie_width_max": None if g.get("pcie_width_max") is None else int(g["pcie_width_max"]),
                "pcie_width_current": None if g.get("pcie_width_current") is None else int(g["pcie_width_current"]),
                "mig": False,
                "fabric_state": "",
                "nvlinks": [NVLinkLink(link=int(x["link"]), active=bool(x["active"])) for x in g.get("nvlinks", [])],
                "withheld": [str(w) for w in g.get("withheld", [])],
            }
        )
    raw.sort(key=lambda d: d["pci_bus_id"])
    return raw


def _discover_gpus(src: Source, facts: FabricFacts, tools: dict[str, str]) -> dict[str, str]:
    """Fills facts.gpus from `nvidia-smi -q -x` (+ nvlink -s, compute_cap query) or the NVML fallback;
    returns the driver/CUDA versions it read."""
    versions: dict[str, str] = {}
    xml = src.run(SMI_XML)
    tools[" ".join(SMI_XML)] = xml.describe
    raw: list[dict[str, Any]] = []
    if xml.ok:
        raw, versions = parse_smi_xml(xml.stdout, src.where_command(SMI_XML), src)
    api = src.gpu_api() if not raw else None
    if api:
        try:
            raw = _gpu_api_rows(api)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            where = src.where("/" + GPU_API_FILE) if isinstance(src, CaptureSource) else "NVML"
            raise src.error(where, f"unexpected GPU entry ({type(e).__name__}: {e})")
        versions = {"driver": str(api.get("driver", "")), "cuda": str(api.get("cuda", ""))}
        tools["gpu api"] = str(api.get("api", "?")) + (f" ({api['status']})" if api.get("status") else "")
    if not raw:
        return versions

    cc_by_bus: dict[str, str] = {}
    if any(not d["compute_capability"] for d in raw) and xml.ok:
        q = src.run(SMI_QUERY)
        tools[" ".join(SMI_QUERY)] = q.describe
        if q.ok:
            cc_by_bus = parse_query_cc(q.stdout)

    links_by_uuid: dict[str, list[NVLinkLink]] = {}
    links_by_index: dict[int, list[NVLinkLink]] = {}
    if xml.ok:
        nv = src.run(SMI_NVLINK)
        tools[" ".join(SMI_NVLINK)] = nv.describe
        if nv.ok:
            for entry in parse_nvlink(nv.stdout, src.where_command(SMI_NVLINK), src):
                if entry["uuid"]:
                    links_by_uuid[entry["uuid"]] = entry["links"]
                links_by_index[entry["index"]] = entry["links"]

    withheld = [f"GPU {d['pci_bus_id'] or i} {', '.join(d['withheld'])}" for i, d in enumerate(raw) if d.get("withheld")]
    if withheld:
        # Unknown is not "different": such facts are incomplete, so the daemon keeps the fabric it knows
        # instead of taking one user's narrower view for a hardware change (and the profiles for stale).
        facts.warnings.append(
            f"the GPU driver withheld {'; '.join(withheld)} from this user (insufficient permissions); facts are incomplete"
        )
    for i, d in enumerate(raw):
        cc = d["compute_capability"] or cc_by_bus.get(d["pci_bus_id"], "") or cc_from_model(d["name"])
        addr = sysfs_pci_address(d["pci_bus_id"])
        if "nvlinks" in d:
            links = d["nvlinks"]
        elif d["uuid"] and links_by_uuid:
            links = links_by_uuid.get(d["uuid"], [])
        else:
            links = links_by_index.get(i, [])
        facts.gpus.append(
            GPU(
                index=i,
                model=d["name"],
                uuid=d["uuid"],
                serial=d.get("serial", ""),
                pci_bus_id=d["pci_bus_id"],
                memory_mib=d["memory_mib"],
                compute_capability=cc,
                pcie_gen_max=d["pcie_gen_max"],
                pcie_gen_current=d["pcie_gen_current"],
                pcie_width_max=d["pcie_width_max"],
                pcie_width_current=d["pcie_width_current"],
                mig=d["mig"],
                numa_node=_sysfs_int(src, f"{PCI_DEVICES}/{addr}/numa_node", "NUMA node") if addr else None,
                fabric_state=d["fabric_state"],
                nvlinks=sorted(links, key=lambda lk: lk.link),
            )
        )
    return versions


def _matrix_cells(mat: dict[str, Any], n: int, where: str, src: Source):
    """(gpu row i, column label, peer GPU index or None for a non-GPU column, value) of GPU rows 0..n-1."""
    for i in range(n):
        row = mat["rows"].get(f"GPU{i}")
        if row is None:
            raise src.error(where, f"no row for GPU{i}")
        for j, col in enumerate(mat["cols"]):
            m = re.match(r"^GPU(\d+)$", col)
            yield i, col, (int(m.group(1)) if m else None), row[j]


def _discover_topology(src: Source, facts: FabricFacts, tools: dict[str, str]) -> list[tuple[int, str, str]]:
    """Pairs from `topo -m` + `topo -p2p r`; returns (gpu, nic name, level) for NIC columns."""
    n = len(facts.gpus)
    levels: dict[tuple[int, int], str] = {}
    p2p: dict[tuple[int, int], str] = {}
    gpu_nic: list[tuple[int, str, str]] = []
    if n == 0 or tools.get(" ".join(SMI_XML)) != "ok":
        return gpu_nic
    topo = src.run(SMI_TOPO)
    tools[" ".join(SMI_TOPO)] = topo.describe
    if topo.ok:
        where = src.where_command(SMI_TOPO)
        mat = parse_matrix(topo.stdout, where, src, "`nvidia-smi topo -m`", _LEVEL_RE)
        gpu_rows = [c for c in mat["cols"] if re.match(r"^GPU\d+$", c)]
        if len(gpu_rows) != n:
            raise src.error(where, f"lists {len(gpu_rows)} GPUs, `nvidia-smi -q -x` lists {n} (truncated, or from another node?)")
        for i, col, peer, value in _matrix_cells(mat, n, where, src):
            if peer is None:
                gpu_nic.append((i, mat["legend"].get(col, col), value))
            elif peer != i:
                levels[(i, peer)] = value
    if n > 1:
        pr = src.run(SMI_P2P)
        tools[" ".join(SMI_P2P)] = pr.describe
        if pr.ok:
            where = src.where_command(SMI_P2P)
            mat = parse_matrix(pr.stdout, where, src, "`nvidia-smi topo -p2p r`", _P2P_RE)
            for i, _col, peer, value in _matrix_cells(mat, n, where, src):
                if peer is not None and peer != i:
                    p2p[(i, peer)] = value
    for i in range(n):
        for j in range(i + 1, n):
            facts.pairs.append(
                GPUPair(a=i, b=j, level=levels.get((i, j), levels.get((j, i), "?")), p2p=p2p.get((i, j), "?"))
            )
    return gpu_nic


def _discover_ib(src: Source, facts: FabricFacts) -> None:
    names = src.listdir(IB_ROOT) or []
    no_vpd = 0
    for name in names:
        base = f"{IB_ROOT}/{name}"
        uevent = parse_uevent(src.read_text(f"{base}/device/uevent"))
        driver = uevent.get("DRIVER", "")
        if driver.startswith("mlx5") or name.startswith("mlx5"):
            kind = "mlx5"
        elif driver == "efa" or name.startswith(("efa", "rdmap")):
            kind = "efa"
        else:
            kind = driver or "other"
        ports = []
        for pn in src.listdir(f"{base}/ports") or []:
            if not pn.isdigit():
                continue
            pb = f"{base}/ports/{pn}"
            state = parse_port_state(src.read_text(f"{pb}/state"), src.where(f"{pb}/state"), src)
            phys = src.read_text(f"{pb}/phys_state")
            pm = _STATE_RE.match(phys or "")
            rate = parse_rate(src.read_text(f"{pb}/rate"), src.where(f"{pb}/rate"), src)
            ll = parse_link_layer(src.read_text(f"{pb}/link_layer"), src.where(f"{pb}/link_layer"), src)
            ports.append(
                NICPort(port=int(pn), state=state, phys_state=pm.group(2) if pm else "", rate_gbps=rate, link_layer=ll)
            )
        netdevs = src.listdir(f"{base}/device/net") or []
        nic = NIC(
            name=name,
            kind=kind,
            driver=driver,
            hca_type=(src.read_text(f"{base}/hca_type") or "").strip(),
            fw_ver=(src.read_text(f"{base}/fw_ver") or "").strip(),
            board_id=(src.read_text(f"{base}/board_id") or "").strip(),
            pci_id=uevent.get("PCI_ID", ""),
            netdev=netdevs[0] if netdevs else "",
            ports=sorted(ports, key=lambda p: p.port),
            **pci_link(src, f"{base}/device"),
        )
        # The VPD (mode 0400/0600: root only) is what tells an NVSwitch management LPF from a NIC (Fabric
        # Manager guide). Only the transports depend on it: the device stays in the fingerprint either way
        # (ExcludedNIC.nic), so root and an ordinary user compute the same one.
        vpd = src.read_bytes(f"{base}/device/vpd")
        if vpd is not None and b"SW_MNG" in vpd:
            facts.excluded_nics.append(
                ExcludedNIC(name=name, reason="NVSwitch management port (CX7 bridge LPF, VPD SMDL=SW_MNG)", nic=nic)
            )
            continue
        no_vpd += kind == "mlx5" and vpd is None
        facts.nics.append(nic)
    if no_vpd:
        facts.tools["vpd"] = f"unreadable on {no_vpd} mlx5 device(s): NVSwitch management ports not identifiable"


def _discover_cxi(src: Source, facts: FabricFacts) -> None:
    """HPE Slingshot (Cassini) NICs: /sys/class/cxi/cxiN, link state/speed from their hsn netdev."""
    for name in src.listdir(CXI_ROOT) or []:
        base = f"{CXI_ROOT}/{name}"
        uevent = parse_uevent(src.read_text(f"{base}/device/uevent"))
        netdevs = src.listdir(f"{base}/device/net") or []
        ports = []
        if netdevs:
            nb = f"{base}/device/net/{netdevs[0]}"
            oper = (src.read_text(f"{nb}/operstate") or "").strip().lower()
            speed_text = src.read_text(f"{nb}/speed")
            rate = 0.0
            if speed_text is not None and speed_text.strip() not in ("", "-1"):
                try:
                    rate = int(speed_text.strip()) / 1000.0
                except ValueError:
                    raise src.error(src.where(f"{nb}/speed"), f"cannot read link speed {speed_text.strip()[:40]!r} (Mb/s)")
            ports.append(
                NICPort(port=1, state="ACTIVE" if oper == "up" else "DOWN", phys_state=oper, rate_gbps=rate, link_layer="Ethernet")
            )
        facts.nics.append(
            NIC(
                name=name,
                kind="cxi",
                driver=uevent.get("DRIVER", ""),
                pci_id=uevent.get("PCI_ID", ""),
                netdev=netdevs[0] if netdevs else "",
                ports=ports,
                **pci_link(src, f"{base}/device"),
            )
        )


def _software(pk: dict[str, str | None], versions: dict[str, str], libfabric: str) -> dict[str, str]:
    def first(*names: str) -> str:
        for n in names:
            v = pk.get(n)
            if v:
                return v
        return ""

    sw = {
        "driver": versions.get("driver", ""),
        "cuda": versions.get("cuda", ""),
        "cuda_runtime": first("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime"),
        "nccl": first("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"),
        "nvshmem": first("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
        "torch": first("torch"),
        "nvshmem4py": first("nvshmem4py-cu13", "nvshmem4py-cu12"),
        "libfabric": libfabric,
        "moetune": first("moetune"),
    }
    return {k: (sw.get(k) or NONE) for k in SOFTWARE_KEYS}


def discover_from(src: Source) -> FabricFacts:
    """Discover through any source. Raises DiscoveryError/CaptureError on garbled input."""
    from moetune.tuner.fabric.families import classify

    t0 = time.perf_counter()
    src.prefetch(COMMANDS)
    facts = FabricFacts(source=src.name if not isinstance(src, CaptureSource) else f"capture:{src.root}")
    tools: dict[str, str] = {}

    versions = _discover_gpus(src, facts, tools)
    gpu_nic_raw = _discover_topology(src, facts, tools)
    _discover_ib(src, facts)
    _discover_cxi(src, facts)
    # GPU-NIC levels only for devices discovery read (not absent ones). NVSwitch management ports keep theirs:
    # whether one is recognised as such depends on reading its VPD (root only), and the fingerprint may not.
    known = {n.name for n in facts.nics} | {e.name for e in facts.excluded_nics}
    facts.gpu_nic = sorted(
        (GPUNic(gpu=g, nic=nic, level=lvl) for g, nic, lvl in gpu_nic_raw if nic in known),
        key=lambda x: (x.gpu, x.nic),
    )

    # GPUDirect RDMA
    mods_text = src.read_text(PROC_MODULES)
    mods = parse_modules(mods_text, src.where(PROC_MODULES), src)
    nvver_text, kernel_text = src.read_text(PROC_NV_VERSION), src.read_text(PROC_OSRELEASE)
    if facts.gpus:
        # unread is not "no module loaded", "no open kernel module" or "an old kernel": GPUDirect RDMA is unknown, and
        # the NIC transports that need it were classified unavailable (another fingerprint) without a word (a capture
        # copied without its proc/ folder)
        for path, text, what in ((PROC_MODULES, mods_text, "whether nvidia_peermem is loaded"),
                                 (PROC_NV_VERSION, nvver_text, "the kernel module's flavour (open or proprietary)"),
                                 (PROC_OSRELEASE, kernel_text, "the kernel release")):
            if text is None:
                facts.warnings.append(f"{src.where(path)} was not read (missing): {what} is unknown, so GPUDirect "
                                      "RDMA that depends on it is taken as absent; facts are incomplete")
    nvver = nvver_text or ""
    kernel = (kernel_text or "").strip()
    open_km = "Open Kernel Module" in nvver
    if not versions.get("driver"):
        m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", nvver)
        if m:
            versions["driver"] = m.group(1)
    drv_major = int(m.group(1)) if (m := re.match(r"^(\d+)", versions.get("driver", ""))) else 0
    facts.gpudirect = GPUDirect(
        nvidia_peermem=bool({"nvidia_peermem", "nv_peer_mem"} & mods),
        dmabuf=bool(facts.gpus) and open_km and drv_major >= 515 and _kernel_at_least(kernel, 5, 12),
        open_kernel_module=open_km,
        kernel=kernel,
    )

    # libfabric
    fl = src.run(FI_LIST)
    tools[" ".join(FI_LIST)] = fl.describe
    providers = parse_fi_list(fl.stdout, src.where_command(FI_LIST), src) if fl.ok else []
    fv = src.run(FI_VERSION)
    tools[" ".join(FI_VERSION)] = fv.describe
    facts.libfabric = Libfabric(providers=providers, version=parse_fi_version(fv.stdout) if fv.ok else "")

    facts.software = _software(src.packages(), versions, facts.libfabric.version)
    facts.warnings += getattr(src, "unread", [])
    facts.tools = {**tools, **facts.tools}
    if nvver and not facts.gpus:
        xml_state = tools.get(" ".join(SMI_XML), "missing")
        facts.warnings.append(
            f"the NVIDIA driver is loaded but no GPU was read (`nvidia-smi -q -x`: {xml_state}); facts are incomplete"
        )
    for key, state in tools.items():
        if state.endswith("timeout") or state.endswith("(timeout)"):
            facts.warnings.append(f"`{key}` timed out; facts it provides are missing")
    facts.transports, facts.unavailable = classify(facts)
    facts.seconds = round(time.perf_counter() - t0, 4)
    return facts


def discover(capture: Path | str | None = None, *, timeout_s: float = 1.5) -> FabricFacts:
    """The facts of the live node (capture None) or of a capture directory."""
    if capture is not None:
        return discover_from(CaptureSource(capture))
    src = LiveSource(timeout_s=timeout_s)
    try:
        return discover_from(src)
    finally:
        src.close()


def live_facts(timeout_s: float = 1.5) -> FabricFacts:
    """The live node's facts: what `capture_not_this_node` compares a capture with. Its own name so that a test
    can simulate being on a captured node (monkeypatch this) without touching how the capture itself is read."""
    return discover(None, timeout_s=timeout_s)


def capture_not_this_node(facts: FabricFacts, capture: Path | str) -> str:
    """'' when `facts` (read from `capture`) describe THIS node, else why not, naming both identities.

    A number measured here may only be stored under this node's key: a measurement run with --capture is allowed
    only when the capture's fingerprint and software hash are those of live discovery. A failed live discovery
    cannot confirm it, so it counts as another node."""
    try:
        live = live_facts()
    except (DiscoveryError, OSError) as e:
        return f"the capture {capture} cannot be checked against this node: live discovery failed ({e})"
    if live.fingerprint == facts.fingerprint and live.software_hash == facts.software_hash:
        return ""
    from moetune.tuner.fabric.fingerprint import diff_facts

    what = diff_facts(live.to_dict(), facts.to_dict())
    shown = "; ".join(what[:4]) + (f"; and {len(what) - 4} more" if len(what) > 4 else "")
    return (f"the capture {capture} describes another node than this one (the capture: fingerprint "
            f"{facts.fingerprint}, software {facts.software_hash}; this node: fingerprint {live.fingerprint}, "
            f"software {live.software_hash}" + (f"; from this node to the capture: {shown}" if shown else "") + ")")
