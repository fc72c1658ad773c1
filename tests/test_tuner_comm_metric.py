"""Metric "comm" minimises the round trip (pipelined when pipeline_depth > 1), not dispatch + combine each
timed alone: a pipeline depth that overlaps a chunk's combine with later dispatches must be able to win."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import ModelShape
from moetune.tuner.search.backends import TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend

WL = TuneWorkload(model=ModelShape(name="custom", hidden=1024, intermediate=512, experts=32, topk=4), tokens=2048, nodes=1, gpus_per_node=2)

# Medians of `moetune bench ep` on CPU (gloo, world 2, custom:1024,512,32,4, S=2048, 10 iters, collective),
# depth 1 and 4: dispatch + combine ranks depth 4 worse, the round trip (and the layer) better.
FAKE = r'''
import json, sys
args = sys.argv[1:]
knobs = dict(kv.split("=", 1) for kv in args[args.index("--knobs") + 1].split(","))
d, c, rt, layer = {"1": (12264.0, 17229.0, 35235.0, 431485.0), "4": (21825.0, 19923.0, 28068.0, 355416.0)}[knobs["pipeline_depth"]]
q = lambda v: {"median": v, "p10": v * 0.98, "p90": v * 1.02}
print(json.dumps({"dispatch_us": q(d), "combine_us": q(c), "roundtrip_us": q(rt), "layer_us": None if "--no-layer" in args else q(layer)}))
'''


@pytest.fixture
def fake(tmp_path: Path) -> list[str]:
    p = tmp_path / "fake_bench.py"
    p.write_text(FAKE)
    return [sys.executable, str(p)]


def test_comm_ranks_pipelining_by_the_round_trip(fake: list[str]) -> None:
    be = LocalBackend(command=fake, repeats=1, metric="comm", timeout_s=20)
    one = be.evaluate(Knobs(pipeline_depth=1), WL)
    four = be.evaluate(Knobs(pipeline_depth=4), WL)
    assert one.ok and four.ok, (one.error, four.error)
    assert one.median_us == pytest.approx(35235.0) and four.median_us == pytest.approx(28068.0)
    assert four.median_us < one.median_us  # dispatch_us + combine_us would say 41748 > 29493
    # the within-run spread is the round trip's (p10..p90 / 2), and the details keep every figure
    assert four.spread_us == pytest.approx(28068.0 * 0.02)
    assert four.details["roundtrip_us"]["median"] == 28068.0 and four.details["dispatch_us"]["median"] == 21825.0
    assert "--no-layer" in be.argv(Knobs(), WL)  # no expert weights: the round trip uses identity experts


def test_comm_needs_the_round_trip(tmp_path: Path) -> None:
    p = tmp_path / "old_bench.py"
    p.write_text('import json; print(json.dumps({"dispatch_us": {"median": 1.0}, "combine_us": {"median": 2.0}}))')
    m = LocalBackend(command=[sys.executable, str(p)], repeats=1, metric="comm", timeout_s=20).evaluate(Knobs(), WL)
    assert not m.ok and "roundtrip_us" in (m.error or "")  # never silently dispatch + combine


def test_comm_studies_are_not_resumed_across_the_change() -> None:
    # a study whose trials minimised dispatch + combine must not be resumed by one minimising the round trip
    assert LocalBackend(metric="comm").settings()["comm_figure"] == "roundtrip_us"
    assert "comm_figure" not in LocalBackend(metric="layer").settings()


@pytest.mark.parametrize("layer", ["null", "{\"median\": 0.0}", "{\"median\": -5.0}", "{\"median\": NaN}"])
def test_layer_needs_the_whole_layer(tmp_path: Path, layer: str) -> None:
    # metric layer scored a result without layer_us (or with a median that is no timing) by dispatch_us + combine_us
    # (here 3 µs, no expert work) or by that median: the fastest trial of the study, not a failed one
    p = tmp_path / "no_layer_bench.py"
    line = ('{"dispatch_us": {"median": 1.0}, "combine_us": {"median": 2.0}, "roundtrip_us": {"median": 4.0}, '
            f'"layer_us": {layer}}}')
    p.write_text(f"print({line!r})")
    m = LocalBackend(command=[sys.executable, str(p)], repeats=1, timeout_s=20).evaluate(Knobs(), WL)
    assert not m.ok and "layer_us" in (m.error or "") and m.samples == []
