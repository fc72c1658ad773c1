"""The compiled library as the one-sided transports call it, answered on CPU (tests of their Python side)."""

from __future__ import annotations

from typing import Any


class FakeMtLib:
    """mt_nvl_* / mt_pxy_* / mt_proxy_* go to `call(name, args)`: 0, and a `_create` gets a new handle through its
    out pointer. Subclasses record or fail calls by overriding `call`."""

    handles = 0

    def mt_last_error(self) -> bytes:
        return b""

    def mt_ctrl_bytes(self, out: Any) -> int:
        out._obj.value = 4096
        return 0

    def mt_enable_peer_access(self, dev: int, other: int) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        if not name.startswith(("mt_nvl_", "mt_pxy_", "mt_proxy_")):
            raise AttributeError(name)
        return lambda *args: self.call(name, args)

    def call(self, name: str, args: tuple) -> int:
        if name.endswith("_create"):
            self.handles += 1
            args[-1]._obj.value = 0x5000 + self.handles  # the new context/engine, through its out pointer
        return 0
