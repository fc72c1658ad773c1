"""The one-sided transports this branch ships, for the registry to pick up.

`moetune.runtime.transports.registry` (runtime branch) can wire them with
`from .onesided import ONESIDED_TRANSPORTS` and merge the mapping into its table.
Importing this module never touches CUDA; `availability()` says whether each can run here.
"""

from __future__ import annotations

from moetune.runtime.transports.base import EPTransport
from moetune.runtime.transports.nvlink import NvlinkTransport
from moetune.runtime.transports.proxy import ProxyTransport

ONESIDED_TRANSPORTS: dict[str, type[EPTransport]] = {
    NvlinkTransport.name: NvlinkTransport,
    ProxyTransport.name: ProxyTransport,
}

__all__ = ["ONESIDED_TRANSPORTS", "NvlinkTransport", "ProxyTransport"]
