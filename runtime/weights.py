"""The MoE layer's weights, generated deterministically from a seed (one generator per expert, on the device).

Every rank builds only its own experts, `dense_reference` rebuilds any expert for verification, and the
megakernel (runtime/megakernel/layer.py) builds the same tensors; `moe_layer` re-exports these names.
Imports only torch.
"""

from __future__ import annotations

import torch

from moetune.runtime.shapes import ModelShape

# The seeds whose generator seeds (seed * 1_000_003 plus an offset below 2**24: 7 * expert + 1 up to ~2.4M experts,
# or 999_983) are within what torch.Generator.manual_seed takes, [-2**63, 2**64); outside, it failed with "Overflow
# when unpacking long long", naming no argument (past that many experts `_generator` wraps modulo 2**64)
SEED_MIN = -((2**63 - 2**24) // 1_000_003)
SEED_MAX = (2**64 - 2**24) // 1_000_003


def check_seed(seed: object, who: str = "") -> None:
    """TypeError / ValueError naming `seed` when it is not an int in [SEED_MIN, SEED_MAX]."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{who}seed must be an int, got {type(seed).__name__}")
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"{who}seed must be in [{SEED_MIN}, {SEED_MAX}] (the weights' generators take 64-bit seeds "
                         f"derived from it), got {seed}")


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    # modulo 2**64: manual_seed's own reading of a negative seed (the same stream), and what keeps a model of more than
    # ~2.4M experts (7 * expert + 1 past 2**24) inside its range at SEED_MAX instead of failing "Overflow when
    # unpacking long long"
    g.manual_seed(seed % 2**64)
    return g


def expert_weights(
    model: ModelShape, expert: int, *, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_gate_up [2I, H], W_down [H, I]) of global expert `expert` (0 <= expert < model.experts), deterministic in
    (seed, expert, device type)."""
    check_seed(seed)
    if not 0 <= expert < model.experts:  # the generator seed exists for any int: a made-up expert would be built
        raise ValueError(f"expert {expert} is not an expert of model {model.name!r}: ids are in [0, {model.experts})")
    device = torch.device(device)
    h, i = model.hidden, model.intermediate
    g = _generator(device, seed * 1_000_003 + 7 * expert + 1)
    w1 = torch.randn(2 * i, h, generator=g, device=device, dtype=torch.float32) * (h**-0.5)
    w2 = torch.randn(h, i, generator=g, device=device, dtype=torch.float32) * (i**-0.5)
    return w1.to(dtype), w2.to(dtype)


def gate_weight(model: ModelShape, *, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    check_seed(seed)
    device = torch.device(device)
    g = _generator(device, seed * 1_000_003 + 999_983)
    return (torch.randn(model.experts, model.hidden, generator=g, device=device, dtype=torch.float32) * (model.hidden**-0.5)).to(dtype)
