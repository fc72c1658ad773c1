"""Rules the fabric model shares with the runtime instead of copying them.

* The EP size the experts must divide: Workload calls ModelShape.check_ep (runtime/shapes.py), the runtime's one
  wording, with the nodes x GPUs it came from.
* MAX_COMM_CHANNELS and the equal pipeline chunks live in runtime/buffer/layout_choice.py (torch-free); the EP
  buffer (facade.py, _packed.py `_plan_packed`, _dense.py `_dense_bounds`) and the model (phases/layouts.py payload_calls) call
  them: neither predict.py nor facade.py keeps a copy of the constant or writes the chunk rule out again."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from moetune.runtime.buffer import layout_choice
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.phases import collective as fm
from moetune.tuner.fabric_model.phases.layouts import payload_calls
from moetune.tuner.fabric_model.records import Workload

ROOT = Path(__file__).resolve().parents[1]


def test_workload_uses_the_runtimes_ep_rule() -> None:
    with pytest.raises(ValueError, match=r"^qwen3-30b: 128 experts do not divide evenly over an EP group of 6 "
                                         r"\(2 nodes x 3 GPUs\)$"):
        Workload(get_model("qwen3-30b"), 128, 2, 3)


def test_equal_chunk_bounds() -> None:
    assert layout_choice.equal_chunk_bounds(4096, 4) == [0, 1024, 2048, 3072, 4096]
    assert layout_choice.equal_chunk_bounds(10, 4) == [0, 3, 6, 9, 10]
    assert layout_choice.equal_chunk_bounds(5, 4) == [0, 2, 4, 5, 5]
    assert layout_choice.equal_chunk_bounds(0, 3) == [0, 0, 0, 0]
    assert layout_choice.equal_chunk_size(0, 3) == 1


def test_dense_bounds_are_the_equal_chunks() -> None:
    from moetune.runtime.buffer._dense import _dense_bounds

    for cap in (0, 1, 2, 5, 10, 127, 4096):
        for n in range(1, 9):
            assert _dense_bounds(cap, n) == layout_choice.equal_chunk_bounds(cap, n), (cap, n)


def test_packed_plan_chunks_are_the_equal_chunks() -> None:
    """The packed layout's plan on one CPU rank (no process group): its chunks' token ranges are the helper's."""
    import torch

    from moetune.runtime.buffer.facade import EPBuffer
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.shapes import ModelShape

    m = ModelShape(name="tiny", hidden=16, intermediate=8, experts=4, topk=2, dtype="float32")
    for s, depth in ((10, 4), (5, 4), (7, 3), (8, 1)):
        buf = EPBuffer(None, Knobs(transport="collective", pipeline_depth=depth), model=m, max_tokens=16,
                       device="cpu", dtype=torch.float32, dense=False)
        x = torch.randn(s, 16)
        idx = torch.stack([torch.arange(s) % 4, (torch.arange(s) + 1) % 4], dim=1)
        h = buf.plan(x, idx, torch.full((s, 2), 0.5))
        b = layout_choice.equal_chunk_bounds(s, depth)
        assert [(c.t0, c.t1) for c in h.chunks] == list(itertools.pairwise(b)), (s, depth)
        buf.close()


def test_model_chunks_and_channels_come_from_the_runtime_module() -> None:
    assert fm.MAX_COMM_CHANNELS is layout_choice.MAX_COMM_CHANNELS
    from moetune.runtime.buffer import facade

    assert facade.MAX_COMM_CHANNELS is layout_choice.MAX_COMM_CHANNELS
    for s in (0, 1, 5, 10, 4096):
        for d in range(1, 9):
            b = layout_choice.equal_chunk_bounds(s, d)
            assert payload_calls(s, d, dense=False) == [hi - lo for lo, hi in itertools.pairwise(b)]
    # nobody else assigns the constant
    for rel in ("tuner/fabric_model/predict.py", "tuner/fabric_model/phases/collective.py",
                "tuner/fabric_model/phases/layouts.py", "runtime/buffer/facade.py"):
        tree = ast.parse((ROOT / rel).read_text())
        names = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
        assert "MAX_COMM_CHANNELS" not in names, rel
