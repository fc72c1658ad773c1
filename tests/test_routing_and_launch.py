"""One routing parser for the runtime and the fabric model; one process-group helper (init_dist)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import moetune.tuner.fabric_model.routing as model_routing
from moetune.runtime.routing import parse_routing
from moetune.runtime.shapes import get_model
from moetune.runtime.testing.launch import free_port, launch
from moetune.tuner.fabric_model.records import Workload


def test_fabric_model_has_no_parser_of_its_own() -> None:
    assert not hasattr(model_routing, "parse_routing")


def test_fabric_model_accepts_what_the_runtime_accepts() -> None:
    qwen = get_model("qwen3-30b")
    # spellings the runtime's generators accept; the model's old parser refused the first two
    for spec in ("zipf", " ZIPF:1.2 ", "zipf:6", "uniform"):
        parse_routing(spec)
        Workload(qwen, 256, 4, 4, routing=spec)
    with pytest.raises(ValueError, match="routing"):
        Workload(qwen, 256, 4, 4, routing="zipf:11")


@pytest.mark.parametrize("spec", ["zipfian", "zipf2", "zipf:", "zipf: ", "zipf:0_5", "zipf:\u0661"])
def test_a_routing_name_is_matched_whole(spec: str) -> None:
    """Any word starting 'zipf', and 'zipf:' with no exponent, were taken as zipf:1.0 (and echoed as typed); an
    exponent float() misreads ("0_5" as 5.0, other scripts' digits) is refused as the runtime's other numbers are."""
    with pytest.raises(ValueError, match="routing"):
        parse_routing(spec)


def test_parse_routing_stays_torch_free() -> None:
    code = ("import sys; from moetune.runtime.routing import parse_routing; "
            "import moetune.tuner.fabric_model.predict; parse_routing('zipf:1.1'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _group_facts(rank: int, world: int) -> tuple[int, int, str]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


def test_launch_joins_through_init_dist() -> None:
    assert launch(_group_facts, 2, timeout_s=60) == [(0, 2, "gloo"), (1, 2, "gloo")]


def test_init_dist_env_rendezvous_like_torchrun() -> None:
    code = ("import torch.distributed as dist; from moetune.runtime.testing.launch import init_dist; "
            "dev = init_dist(0, 1, backend='gloo', timeout_s=30); "
            "print(dev.type, dist.get_world_size()); dist.destroy_process_group()")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "1"]


def test_init_process_group_is_called_in_one_place() -> None:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sites = []
    for d in ("tuner", "runtime", "bench"):
        for path in sorted((root / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "init_process_group":
                    sites.append(str(path.relative_to(root)))
    assert sorted(set(sites)) == ["runtime/testing/launch.py"]


def test_free_port_never_hands_out_one_port_twice(monkeypatch) -> None:
    """The kernel may give two binds in a row one ephemeral port: free_port must not hand it out twice, or a
    daemon's socket and its publisher get the same endpoint and the daemon refuses to start."""
    import socket

    from moetune.runtime.testing import launch as L

    ports = iter([50001, 50001, 50002])

    class OnePortTwice:
        def __init__(self, *a: object) -> None:
            self.port = next(ports)

        def __enter__(self) -> OnePortTwice:
            return self

        def __exit__(self, *a: object) -> None:
            pass

        def bind(self, addr: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(L, "_handed_out", set())
    monkeypatch.setattr(socket, "socket", OnePortTwice)
    assert [L.free_port(), L.free_port()] == [50001, 50002]


def test_a_group_that_did_not_form_is_started_once_more(monkeypatch) -> None:
    """Every failed rank failing to form the group (a port race between concurrent launches under xdist: "Connection
    closed by peer" from Gloo), whether or not the others' fn returned, starts the ranks once more on fresh ports; a
    failure of fn, or a second rendezvous failure, is raised."""
    import pickle

    from moetune.runtime.testing import launch as L

    calls: list[int] = []
    rendezvous = {0: L.RENDEZVOUS + "RuntimeError: Gloo connectFullMesh failed", 1: L.RENDEZVOUS + "RuntimeError: x"}

    def once(*_a, **_k):
        calls.append(1)
        return ({}, dict(rendezvous)) if len(calls) == 1 else ({0: pickle.dumps("a"), 1: pickle.dumps("b")}, {})

    monkeypatch.setattr(L, "_launch_once", once)
    assert L.launch(_group_facts, 2) == ["a", "b"] and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(L, "_launch_once", lambda *_a, **_k: calls.append(1) or ({}, dict(rendezvous)))
    with pytest.raises(L.LaunchError):
        L.launch(_group_facts, 2)
    assert len(calls) == 2
    calls.clear()
    # one rank's group did not form while the other's fn (needing no peer) returned: started once more too
    monkeypatch.setattr(L, "_launch_once", lambda *_a, **_k: calls.append(1) or (
        ({1: pickle.dumps("b")}, {0: rendezvous[0]}) if len(calls) == 1 else ({0: pickle.dumps("a"), 1: pickle.dumps("b")}, {})))
    assert L.launch(_group_facts, 2) == ["a", "b"] and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(L, "_launch_once", lambda *_a, **_k: calls.append(1) or ({0: pickle.dumps(1)}, {1: "ValueError"}))
    with pytest.raises(L.LaunchError):
        L.launch(_group_facts, 2)
    assert len(calls) == 1  # fn ran and failed: not started again
