"""A local (measuring) tune stores only the EP group it measured: `world` ranks on this one node.

`moetune tune --backend local --world 2 --ep-size 8 --nodes 2` (and the library) must not store a MEASURED
`local:gloo` profile for EP 8 over 2 nodes: the backend always launches --world ranks on this host."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from typer.testing import CliRunner

from moetune.runtime.shapes import ModelShape
from moetune.tuner.cli import app
from moetune.tuner.search.local_backend import LocalBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

optuna.logging.set_verbosity(optuna.logging.ERROR)
CAPTURES = Path(__file__).parent / "captures"
SMALL = ModelShape(name="custom:256,128,16,2", hidden=256, intermediate=128, experts=16, topk=2)

# a stand-in for `moetune bench ep --json`: says which world it was launched with
FAKE_BENCH = r'''
import json, sys
args = sys.argv[1:]
world = int(args[args.index("--world") + 1])
print(json.dumps({"dispatch_us": {"median": 10.0, "p10": 9.9, "p90": 10.1},
                  "combine_us": {"median": 10.0, "p10": 9.9, "p90": 10.1},
                  "layer_us": {"median": 30.0, "p10": 29.9, "p90": 30.1}, "world": world}))
'''


class _Fam:
    def __init__(self, name: str) -> None:
        self.name = name


class Facts:
    fingerprint, software_hash, gpu_count = "c" * 64, "d" * 64, 8
    software: dict = {}  # noqa: RUF012
    link_rates: dict = {}  # noqa: RUF012
    transports = (_Fam("collective"),)


def _store(path: Path) -> Any:
    from moetune.tuner.store.store import Store

    return Store(path)


def _backend(tmp_path: Path, world: int) -> LocalBackend:
    p = tmp_path / "fake_bench.py"
    p.write_text(FAKE_BENCH)
    return LocalBackend(world=world, command=[sys.executable, str(p)], comm_backend="gloo", repeats=1, timeout_s=20)


@pytest.mark.parametrize(("ep_size", "nodes"), [(8, 2), (8, 1), (2, 2)])
def test_library_refuses_a_key_the_local_backend_did_not_measure(tmp_path: Path, ep_size: int, nodes: int) -> None:
    from moetune.tuner.search.tune import tune_profiles_detailed

    store = _store(tmp_path / "p.db")
    with pytest.raises(ValueError, match="never measured") as e:
        tune_profiles_detailed(store, Facts(), models=[SMALL], tokens=[64], backend=_backend(tmp_path, 2), trials=2,
                               ep_size=ep_size, nodes=nodes, families=["collective"],
                               storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert f"EP size {ep_size} over {nodes} node(s)" in str(e.value) and "2 rank(s)" in str(e.value)
    assert store.list_profiles() == []


class CpuFacts(Facts):
    """A node without GPUs: what gloo (CPU processes) measures is this node's exchange."""

    gpu_count = 0


def test_library_stores_the_measured_group(tmp_path: Path) -> None:
    """world == ep_size on one node is stored; without ep_size a local tune stores its world (not GPUs per node)."""
    from moetune.tuner.search.tune import tune_profiles_detailed

    store = _store(tmp_path / "p.db")
    res = tune_profiles_detailed(store, CpuFacts(), models=[SMALL], tokens=[64], backend=_backend(tmp_path, 4), trials=2,
                                 families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert res[0].written, res[0].reason
    (key,) = [r.key for _, r in store.list_profiles()]
    assert (key.ep_size, key.nodes) == (4, 1)
    assert res[0].record.provenance == "measured"


def test_library_refuses_gloo_on_a_gpu_node(tmp_path: Path) -> None:
    """gloo runs CPU processes: on a GPU node its number would be stored as the node's measured profile and served to
    its NCCL/GPU jobs as tuned (an h200x2 node, say). Refused before any studies file or profile is made."""
    from moetune.tuner.search.tune import tune_profiles_detailed

    store = _store(tmp_path / "p.db")
    with pytest.raises(ValueError, match="gloo measures CPU processes") as e:
        tune_profiles_detailed(store, Facts(), models=[SMALL], tokens=[64], backend=_backend(tmp_path, 8), trials=2,
                               families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert "8 GPU(s)" in str(e.value) and "nccl" in str(e.value)
    assert store.list_profiles() == [] and not (tmp_path / "opt.db").exists()


@pytest.mark.usefixtures("on_captured_node")  # as on the captured node: its own refusals, not "another node"
def test_cli_refuses_gloo_on_a_gpu_capture_before_any_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake_local(monkeypatch)
    r = CliRunner().invoke(app, ["tune", "--backend", "local", "--comm", "gloo", "-m", "custom:256,128,16,2", "-t", "64",
                                 "-n", "2", "--family", "collective", "--from", str(CAPTURES / "h200x2"),
                                 "--db", str(tmp_path / "p.db")], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 2, r.output
    assert "gloo measures CPU processes" in r.output and "2 GPU(s)" in r.output, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert len(seen) == 1 and list(tmp_path.glob("*.db")) == []  # refused by check_tune: no trial, no database


def _fake_local(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The CLI's local backend replaced by a fake (no ranks launched); returns the options it was built with."""
    return F.fake_local_backend(monkeypatch, "local:fake")


def _tune(tmp_path: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, ["tune", "--backend", "local", "-m", "custom:256,128,16,2", "-t", "64", "-n", "2",
                                    "--family", "collective", "--from", str(CAPTURES / "cpu-laptop"),
                                    "--db", str(tmp_path / "p.db"), *extra], env={"MOETUNE_HOME": str(tmp_path)})


@pytest.mark.parametrize("args", [["--world", "2", "--ep-size", "8", "--nodes", "2"],
                                  ["--world", "2", "--ep-size", "8"],
                                  ["--world", "2", "--nodes", "2"]])
@pytest.mark.usefixtures("on_captured_node")  # as on the captured node: its own refusals, not "another node"
def test_cli_refuses_an_unmeasured_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    seen = _fake_local(monkeypatch)
    r = _tune(tmp_path, *args)
    assert r.exit_code == 2, r.output
    assert "never measured" in r.output and "--world 2" in r.output, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert len(seen) == 1  # refused by check_tune's backend, before any trial
    if (tmp_path / "p.db").exists():
        assert _store(tmp_path / "p.db").list_profiles() == []


@pytest.mark.usefixtures("on_captured_node")  # as on the captured node: its own refusals, not "another node"
def test_cli_ep_size_alone_launches_that_many_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # 4 gloo ranks fit (on 2 CPUs they are refused up front)
    seen = _fake_local(monkeypatch)
    r = _tune(tmp_path, "--ep-size", "4", "--json")
    assert r.exit_code == 0, r.output
    assert seen and seen[0]["world"] == 4
    assert json.loads(r.stdout)[0]["written"]
    (key,) = [rec.key for _, rec in _store(tmp_path / "p.db").list_profiles()]
    assert (key.ep_size, key.nodes) == (4, 1)


def test_library_refuses_one_rank_for_a_transport_family(tmp_path: Path) -> None:
    """EP size 1: one rank exchanges nothing. The bring-up refuses world = 1 / ep_sizes = [1] for that reason, but a
    local tune of world 1 measured a collective "exchange" of one rank and stored it as this node's MEASURED profile
    (found with `moetune tune --backend local --world 1` on a CPU node: it ran collective trials at EP 1)."""
    from moetune.tuner.search.tune import tune_profiles_detailed

    store = _store(tmp_path / "p.db")
    with pytest.raises(ValueError, match="one rank exchanges nothing") as e:
        tune_profiles_detailed(store, CpuFacts(), models=[SMALL], tokens=[64], backend=_backend(tmp_path, 1), trials=2,
                               families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert "collective" in str(e.value) and "--family megakernel" in str(e.value)
    assert store.list_profiles() == [] and not (tmp_path / "opt.db").exists()


@pytest.mark.parametrize("args", [["--world", "1"], ["--ep-size", "1"]])
@pytest.mark.usefixtures("on_captured_node")  # as on the captured node: its own refusals, not "another node"
def test_cli_refuses_one_rank_before_any_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    seen = _fake_local(monkeypatch)
    r = _tune(tmp_path, *args)
    assert r.exit_code == 2, r.output
    assert "one rank exchanges nothing" in r.output, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert len(seen) == 1 and not (tmp_path / "p.db").exists()  # refused by check_tune: no trial, no database
