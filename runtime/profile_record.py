"""The profile record: what a tuned profile is keyed by and what it holds (DESIGN §4).

Shared by the store (tuner side), the daemon's wire messages and the runtime client.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from moetune.runtime.knobs import Knobs

ProfileStatus = Literal["current", "stale", "superseded"]
# How a profile's numbers were obtained: measured on `measured_on` (a fingerprint), predicted by the
# node's own calibrated fabric model, or predicted by a shipped preset of other hardware.
Provenance = Literal["measured", "node_model", "preset"]

TOKEN_BUCKETS: tuple[int, ...] = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def nearest_bucket(tokens: int, buckets: tuple[int, ...] | list[int] = TOKEN_BUCKETS) -> int:
    """The bucket closest to `tokens` on a log scale (ties go to the larger bucket)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if not buckets:
        raise ValueError("no token buckets to choose from")
    import math

    t = max(tokens, 1)
    return min(sorted(buckets), key=lambda b: (abs(math.log(b) - math.log(t)), -b))


class ProfileKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a tuned result is valid for. A profile is never used outside its key."""

    fingerprint: str  # fabric fingerprint hash (moetune.tuner.fabric)
    software: str  # hash of the software versions (driver, CUDA, NCCL, NVSHMEM, torch, moetune)
    transport_family: str  # e.g. nvlink, proxy:ibrc, proxy:libfabric/cxi, ibgda, host_staged, collective
    ep_size: int
    nodes: int
    hidden: int
    intermediate: int
    experts: int
    topk: int
    dtype: str
    token_bucket: int

    def __post_init__(self) -> None:
        for f in ("ep_size", "nodes", "hidden", "intermediate", "experts", "topk", "token_bucket"):
            if getattr(self, f) <= 0:
                raise ValueError(f"profile key: {f} must be > 0, got {getattr(self, f)}")
        if self.ep_size % self.nodes:
            raise ValueError(f"profile key: ep_size {self.ep_size} not divisible by nodes {self.nodes}")

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class ProfileRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tuned profile: its key, the knobs, and how well they measured."""

    key: ProfileKey
    knobs: Knobs
    latency_us: float
    spread_us: float
    backend: str  # which benchmark backend measured it: model:<preset>, local:nccl, local:gloo, ...
    status: ProfileStatus = "current"
    software_versions: dict[str, str] = {}
    created: str = ""
    updated: str = ""
    provenance: Provenance = "measured"
    measured_on: str = ""  # fingerprint it was measured/calibrated on, or preset:<name>

    def __post_init__(self) -> None:
        # Records from before provenance existed: infer it from the backend label.
        if self.provenance == "measured" and not self.measured_on:
            b = self.backend or ""
            if b.startswith("node-model:"):
                self.provenance = "node_model"
            elif b.startswith("model:"):
                self.provenance = "preset"
        if not self.measured_on:
            self.measured_on = (f"preset:{self.backend.split(':', 1)[1]}" if self.provenance == "preset"
                                else self.key.fingerprint)

    def is_tuned_for(self, fingerprint: str, software: str) -> bool:
        """Measured on exactly this fabric and software: the only profile the runtime applies as tuned."""
        return (self.provenance == "measured" and self.measured_on == fingerprint
                and self.key.fingerprint == fingerprint and self.key.software == software)

    @property
    def profile_hash(self) -> str:
        """Hash of key + knobs: what all ranks compare to be sure they hold the same profile."""
        payload = {"key": self.key.to_dict(), "knobs": self.knobs.to_dict()}
        return hashlib.sha256(msgspec.json.encode(payload, order="sorted")).hexdigest()[:16]
