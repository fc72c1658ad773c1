"""`moetune profile`: the bring-up flow an engineer runs when a node comes up.

discovery → microbenchmarks of each transport present → calibration of this node's fabric model →
tuning of the planned shapes and token buckets → profiles stored → summary and report.

Each stage records its completion in a state file beside the database, keyed by the fabric
fingerprint, so Ctrl-C and a rerun continue where it stopped (tuning itself resumes through Optuna's
RDB storage). A changed fingerprint starts over.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moetune.runtime.shapes import get_model

STAGES = ("discover", "microbench", "calibrate", "tune", "compare", "report")


@dataclass
class Plan:
    """What to tune at bring-up. `--plan FILE` (TOML) sets these fields; unknown keys are errors."""

    models: list[str] = field(default_factory=lambda: ["qwen3-30b"])
    tokens: list[int] = field(default_factory=lambda: [128, 1024, 4096])
    backend: str = "auto"  # auto: local on GPUs, local gloo on CPU
    trials: int = 16
    repeats: int = 5
    trial_timeout_s: float = 120.0
    microbench_sizes: list[int] = field(default_factory=list)  # empty: the default sweep
    world: int = 2

    @classmethod
    def quick(cls) -> Plan:
        return cls(models=["qwen3-30b"], tokens=[128, 1024], trials=6, repeats=3, trial_timeout_s=60.0)

    @classmethod
    def from_file(cls, path: Path, base: Plan) -> Plan:
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"plan file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"plan file {path}: not valid TOML: {e}") from None
        data = raw.get("plan", raw)
        known = {f for f in asdict(base)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"plan file {path}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        merged = {**asdict(base), **data}
        for key, value in merged.items():
            want = type(asdict(base)[key])
            if want is float and isinstance(value, int):
                merged[key] = float(value)
            elif not isinstance(merged[key], want):
                raise ValueError(f"plan file {path}: key {key!r} must be {want.__name__}, got {type(value).__name__}")
        plan = cls(**merged)
        plan.validate(str(path))
        return plan

    def validate(self, where: str = "plan") -> None:
        if not self.models:
            raise ValueError(f"{where}: no models to tune")
        for m in self.models:
            try:
                get_model(m)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        if not self.tokens or any(t <= 0 for t in self.tokens):
            raise ValueError(f"{where}: tokens must be positive integers, got {self.tokens}")
        if self.trials < 1:
            raise ValueError(f"{where}: trials must be >= 1, got {self.trials}")
        if self.backend not in ("auto", "local", "model"):
            raise ValueError(f"{where}: backend must be auto, local or model, got {self.backend!r}")


class BringupState:
    """Completed stages and their results, persisted atomically after each stage."""

    def __init__(self, path: Path, fingerprint: str, plan: Plan):
        self.path = path
        self.data: dict[str, Any] = {"fingerprint": fingerprint, "plan": asdict(plan), "done": {}}
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                old = {}
            # Resume only the same node and the same plan; anything else starts over.
            if old.get("fingerprint") == fingerprint and old.get("plan") == asdict(plan):
                self.data = old

    def done(self, stage: str) -> bool:
        return stage in self.data["done"]

    def result(self, stage: str) -> Any:
        return self.data["done"].get(stage)

    def mark(self, stage: str, result: Any) -> None:
        self.data["done"][stage] = result
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


StageFn = Callable[[], Any]
