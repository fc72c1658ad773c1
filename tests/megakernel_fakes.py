"""A stand-in for the megakernel on CPU: MegakernelMoE's per token bucket bookkeeping (LaunchConfigs) without the
library, for tests of how a layer picks, installs and launches bucket configs; and `need_megakernel_gpu`, the skip of
the tests that run the real one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from moetune.runtime.megakernel import engine as E
from moetune.runtime.megakernel.config import LaunchConfigs, MegakernelConfig


class FakeMegakernel:
    """Records every instance built and the config each forward launched; `refuse(config)` stands for the library
    refusing a config's launches (a reason, else None)."""

    built: ClassVar[list[FakeMegakernel]] = []
    refuse: ClassVar[Callable[[MegakernelConfig], str | None]] = staticmethod(lambda cfg: None)

    def __init__(self, model: Any, **kw: Any):
        self.kw = kw
        self.launch = LaunchConfigs(kw["config"])
        self.launched: list[MegakernelConfig] = []
        FakeMegakernel.built.append(self)

    def set_bucket_config(self, bucket: int, config: MegakernelConfig) -> str | None:
        why = self.launch.problem(config) or FakeMegakernel.refuse(config)
        if why is None:
            self.launch.install(bucket, config)
        return why

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.launched.append(self.launch.for_tokens(x.shape[0]))
        return torch.zeros_like(x)


def use_fake_megakernel(monkeypatch: pytest.MonkeyPatch,
                        refuse: Callable[[MegakernelConfig], str | None] | None = None) -> None:
    """Layers built after this call run FakeMegakernel (the GPU check passes) with `refuse` as the library's."""
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    monkeypatch.setattr(E, "build_megakernel", FakeMegakernel)
    monkeypatch.setattr(FakeMegakernel, "built", [])
    monkeypatch.setattr(FakeMegakernel, "refuse", staticmethod(refuse or (lambda cfg: None)))


def need_megakernel_gpu() -> None:
    """Skip the calling test, saying why, unless the real megakernel runs here: a Hopper GPU and its library built."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the megakernel library is built for sm_90a (Hopper)")
    from moetune.runtime import csrc_build
    from moetune.runtime.megakernel import _lib

    try:
        _lib.load()
    except csrc_build.BuildError as e:
        pytest.skip(f"megakernel library unavailable: {str(e)[:500]}")
