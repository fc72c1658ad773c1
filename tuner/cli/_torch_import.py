"""Ctrl-C and SIGTERM held back while `import torch` runs, handed to the CLI's handlers once it is done.

torch's compiled module imports NumPy from its C++ initialisation and drops whatever error that import raises. A
Ctrl-C landing there (0.2-0.3 s into a command that loads torch, on a 2-core machine: about one start in three) was
lost: the command ran on to the end and exited 0. Landing elsewhere in that initialisation, it could end the process
with "terminate called after throwing ... KeyboardInterrupt" (SIGABRT). Light (no Typer, no typing) so the entry
point installs it before anything else loads."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

TYPE_CHECKING = False  # not `typing`'s: the entry point stays light
if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType, ModuleType
    from typing import Any

_HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """In the main thread: a SIGINT or SIGTERM whose handler is a Python function (Python's own KeyboardInterrupt,
    the CLI's `signals_interrupt`) is only recorded in the body; after it the handlers are put back and each signal
    recorded is handed to its handler, in arrival order (over the body's own error, if it raised one). The same
    signal arriving a second time is handed over at once: the user insists. An ignored or default disposition is
    left alone (the default SIGTERM still ends the process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    handlers: dict[int, Any] = {}

    def hold(signum: int, frame: FrameType | None) -> None:
        if signum in came:
            handlers[signum](signum, frame)
        else:
            came.append(signum)

    for signum in _HELD:
        handler = signal.getsignal(signum)
        if callable(handler):
            handlers[signum] = handler
            signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for signum in came:
            handlers[signum](signum, None)


class _TorchImportHold:
    """A meta-path finder that finds nothing itself: asked for `torch`, it takes the spec the finders after it give
    and runs the module's code under `signals_held`. It leaves `sys.meta_path` on that first request, as torch's
    module code runs once a process."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != "torch":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)  # a finder of the old protocol has none
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not callable(getattr(loader, "exec_module", None)):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            with signals_held():
                run(module)

        loader.exec_module = exec_module  # this spec's loader only: created for this one module
        return spec


def hold_signals_while_torch_imports() -> None:
    """Install the hold, once, unless torch is already imported."""
    if "torch" in sys.modules or any(isinstance(f, _TorchImportHold) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchImportHold())
