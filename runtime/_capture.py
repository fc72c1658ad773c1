"""Is a CUDA graph being captured on a given device's current stream?

`torch.cuda.is_current_stream_capturing()` takes no device: it asks about the current stream of the *current*
device. A layer, buffer or tensor on cuda:1 while cuda:0 is current is captured on cuda:1's stream, which that
call does not see; code that skips a profile lookup or a host sync during a capture then ran it inside the
capture and broke it. `capturing(device)` makes `device` current around the query (what MegakernelMoE's
`_order_streams` already did), so it asks about the stream the object's work is queued on.

torch is imported inside the function: `routing.py` uses this, and its spec parser is imported by the fabric
model and the CLI, which must not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["capturing"]


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `device` (False for a non-CUDA device)."""
    import torch

    if device.type != "cuda":
        return False
    with torch.cuda.device(device):  # the query has no device argument: it reads the current device's stream
        return bool(torch.cuda.is_current_stream_capturing())
