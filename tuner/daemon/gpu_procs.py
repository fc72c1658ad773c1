"""Whether other processes run on this node's GPUs (NVML, else nvidia-smi): a measuring re-tune waits for them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

# (busy: True / False / None when it cannot be told, what was seen): are other processes on this node's GPUs?
GpuProbe = Callable[[], tuple[bool | None, str]]


def _nvml_pids() -> list[str]:
    """`index:pid` of every compute process on this node's GPUs, by NVML (ImportError without pynvml)."""
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            out += [f"GPU {i}: pid {p.pid}" for p in pynvml.nvmlDeviceGetComputeProcesses(handle)]
        return out
    finally:
        pynvml.nvmlShutdown()


def gpu_processes(*, timeout_s: float = 15.0) -> tuple[bool | None, str]:
    """Whether other processes run on this node's GPUs: NVML's compute processes (pynvml), else `nvidia-smi
    --query-compute-apps=pid`. (None, why) when neither can tell: no pynvml and no nvidia-smi, a failure, a time-out.
    A process nvidia-smi lists without a readable pid (a container's `[Not Found]`) counts as a process."""
    me = os.getpid()
    why_not_nvml = ""
    try:
        pids = [p for p in _nvml_pids() if not p.endswith(f"pid {me}")]
        return bool(pids), (", ".join(pids[:8]) + (" ..." if len(pids) > 8 else "")) if pids else "NVML: no compute process"
    except ImportError:
        why_not_nvml = "pynvml not installed"
    except Exception as e:  # broad: pynvml raises its own NVMLError kinds (no driver, not supported, ...)
        why_not_nvml = f"NVML failed: {e}"
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=timeout_s)
    except FileNotFoundError:
        return None, f"{why_not_nvml} and nvidia-smi not found"
    except subprocess.TimeoutExpired:
        return None, f"{why_not_nvml}; nvidia-smi --query-compute-apps timed out after {timeout_s:g} s"
    except OSError as e:
        return None, f"{why_not_nvml}; nvidia-smi could not run: {e}"
    if r.returncode != 0:
        return None, f"{why_not_nvml}; nvidia-smi --query-compute-apps exited {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}"
    seen = [line.strip() for line in r.stdout.splitlines() if line.strip() and line.strip() != str(me)]
    if not seen:
        return False, "nvidia-smi: no compute process"
    return True, "nvidia-smi: pid " + ", ".join(seen[:8]) + (" ..." if len(seen) > 8 else "")
