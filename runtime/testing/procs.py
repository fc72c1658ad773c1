"""Process helpers of the launchers (runtime/testing/launch.py's ranks, the tuner's bench worker's ranks); torch-free,
so a rank calls them before anything heavy is imported."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent (the thread that started it) ends: PR_SET_PDEATHSIG,
    Linux only (elsewhere nothing). `parent`: the pid this process was started by; already gone (it ended before
    the call): exit at once."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # no libc prctl: the caller's own watch still ends the process
            pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)
