"""Knob settings the runtime refuses for a workload are refused by the fabric model too (a KnobError naming the knob),
never predicted: a MODELLED number for a setting no run can take would be stored by `tune --backend model` and
served to a runtime that refuses it.

* fp8 scales per 128 channels need hidden % 128 == 0 (runtime/fp8.py `num_scale_groups`, EPBuffer's check_knobs
  refuses the knobs otherwise); the model rounded the groups up and predicted.
* proxy / ibgda: a chunk_tokens that cuts max_tokens (= S, as the tuner builds the buffer) rows for one peer into
  more than MAX_SLOTS PUTs (runtime/transports/proxy.py `check_chunk_tokens`, from EPBuffer; the search space's
  `chunk_fits`); the model let the chunks grow as the kernel would (csrc/proxy_xchg.h `chunking`) and predicted.
"""

from __future__ import annotations

import sys

import pytest

from moetune.runtime.knobs import MAX_SLOTS, KnobError, Knobs, chunk_tokens_fit, num_scale_groups
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.records import Workload

ODD = "custom:200,768,128,8"  # hidden 200: not a multiple of 128


@pytest.mark.parametrize(("preset", "transport", "nodes", "gpn"), [
    ("nvlink-h200x2", "collective", 1, 2), ("nvlink-h200x2", "nvlink", 1, 2),
    ("pcie4-consumer-4090x4", "host_staged", 1, 4), ("ndr-ibrc-h100x8", "proxy", 2, 8),
    ("ndr-ibgda-h100x8", "ibgda", 2, 8)])
def test_per_128_scales_on_a_hidden_not_divisible_by_128_are_refused(preset: str, transport: str, nodes: int,
                                                                      gpn: int) -> None:
    fence = {"proxy": "proxy_drain", "ibgda": "nic_ordered"}.get(transport, "none")
    k = Knobs(transport=transport, fence_mode=fence, compression="fp8_e4m3", scale_granularity="per_128")
    w = Workload(ODD, 256, nodes, gpn)
    with pytest.raises(KnobError, match="divisible by 128") as e:
        predict(preset, w, k)
    assert e.value.knobs == ("scale_granularity",)
    # per token is fine on that model, and per 128 on a hidden that is a multiple of 128
    assert predict(preset, w, k.replace(scale_granularity="per_token")).latency_us > 0
    assert predict(preset, Workload("qwen3-30b", 256, nodes, gpn), k).latency_us > 0


def test_the_scale_group_rule_is_the_runtimes_and_torch_free() -> None:
    assert num_scale_groups(2048, "per_128") == 16 and num_scale_groups(200, "per_token") == 1
    with pytest.raises(ValueError, match="divisible by 128"):
        num_scale_groups(200, "per_128")
    if "torch" not in sys.modules:  # the model's import of the rule pulls no torch in
        import moetune.tuner.fabric_model.predict  # noqa: F401

        assert "torch" not in sys.modules


@pytest.mark.parametrize(("preset", "transport", "fence"), [("ndr-ibrc-h100x8", "proxy", "proxy_drain"),
                                                            ("nvlink-h200x2", "proxy", "proxy_drain"),
                                                            ("ndr-ibgda-h100x8", "ibgda", "nic_ordered")])
def test_chunk_tokens_over_the_signal_slots_is_refused(preset: str, transport: str, fence: str) -> None:
    nodes = 1 if preset == "nvlink-h200x2" else 2
    gpn = 2 if nodes == 1 else 8
    w = Workload("qwen3-30b", 4096, nodes, gpn)
    k = Knobs(transport=transport, fence_mode=fence, chunk_tokens=2)  # 4096 rows / 2 = 2048 PUTs > 1024
    assert not chunk_tokens_fit(2, 4096)
    with pytest.raises(KnobError, match=f"more than the {MAX_SLOTS} signal slots") as e:
        predict(preset, w, k)
    assert e.value.knobs == ("chunk_tokens",)
    # the smallest chunk the runtime takes at S = 4096 (exactly MAX_SLOTS PUTs at most), and fewer tokens
    assert predict(preset, w, k.replace(chunk_tokens=4)).latency_us > 0
    assert predict(preset, Workload("qwen3-30b", 2048, nodes, gpn), k).latency_us > 0
    # the per-expert tile layout reads chunk_tokens as NIC messages per tile, not the runtime's PUTs: not refused
    if preset != "nvlink-h200x2":
        assert predict(preset, Workload("qwen3-30b", 4096, nodes, gpn, tile=8), k.replace(chunk_tokens=1),
                       layout="expert_tiles").latency_us > 0


def test_nvlink_beyond_the_one_sided_world_limit_is_refused() -> None:
    """The runtime's nvlink transport serves at most MT_MAX_WORLD (8) ranks (runtime/transports/_onesided.py
    `check_world`, from EPBuffer's checks; csrc/mt_common.h sizes its control block so): the model predicted
    `-g 16 -k transport=nvlink` anyway, and `tune --backend model --ep-size 16` stored nvlink profiles no run can take."""
    from moetune.runtime.knobs import MAX_WORLD

    assert MAX_WORLD == 8
    k = Knobs(transport="nvlink")
    with pytest.raises(KnobError, match="at most 8 ranks") as e:
        predict("nvlink-h200x2", Workload("qwen3-30b", 256, 1, 16), k)
    assert e.value.knobs == ("transport",)
    assert predict("nvlink-h200x2", Workload("qwen3-30b", 256, 1, 8), k).latency_us > 0


def test_the_node_proxy_beyond_the_one_sided_world_limit_is_refused() -> None:
    """nvlink-h200x2's proxy serves the node's own peers (proxy.serves_intra_node): it models the runtime's proxy
    transport, which refuses more than MAX_WORLD ranks as nvlink does (`_onesided.check_world`). 668bd35b refused
    nvlink at `-g 16` and left `-k transport=proxy` on the same node predicting a run no runtime takes. A NIC
    preset's proxy (serves_intra_node false: the Perseus IBRC model across nodes) is not this transport."""
    k = Knobs(transport="proxy", fence_mode="proxy_drain")
    with pytest.raises(KnobError, match="at most 8 ranks") as e:
        predict("nvlink-h200x2", Workload("qwen3-30b", 256, 1, 16), k)
    assert e.value.knobs == ("transport",)
    assert predict("nvlink-h200x2", Workload("qwen3-30b", 256, 1, 8), k).latency_us > 0
    assert predict("ndr-ibrc-h100x8", Workload("qwen3-30b", 256, 4, 8), k).latency_us > 0


def test_a_model_tune_of_nvlink_beyond_the_world_limit_is_refused_before_any_trial(tmp_path) -> None:
    """Since 668bd35b every nvlink trial at EP 16 is infeasible (the model refuses what the runtime refuses), yet
    `tune --backend model -p nvlink-h200x2 --ep-size 16` ran its study of failing trials, kept the study and exited 1.
    The bound is asked before the first study (`ModelBackend.group_problem`, the rule the phases raise): refused
    (exit 2) naming the EP size, the family considered and its bound; no profile database, no studies file."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    d = tmp_path / "out"
    d.mkdir()
    for family in ([], ["--family", "nvlink"]):
        r = CliRunner().invoke(app, ["tune", "-m", "qwen3-30b", "-t", "256", "--backend", "model", "-p",
                                     "nvlink-h200x2", "--ep-size", "16", "-n", "2", "--db", str(d / "p.db"),
                                     "--storage", f"sqlite:///{d / 's.db'}", *family],
                               env={"COLUMNS": "300", "MOETUNE_HOME": str(tmp_path / "home")})
        said = " ".join(r.output.split())
        assert r.exit_code == 2, r.output
        assert "EP size 16 on 1 node(s): no transport family considered (nvlink) can serve it" in said, said
        assert "nvlink: transport=nvlink serves at most 8 ranks on one node" in said and "Traceback" not in said, said
        assert "trial" not in said, said  # no study ran
        assert list(d.iterdir()) == []  # no p.db, s.db nor a lock


def test_the_group_bound_leaves_out_only_the_families_it_bounds() -> None:
    """On a node with several families (a DGX H100 capture) a local tune at EP 16 leaves out nvlink and the node's
    proxy (the runtime's one-sided transports, at most 8 ranks) and tunes the rest; asked for nvlink alone it is
    refused naming the bound. The model's bound is its phases' (a NIC preset's proxy across nodes has none)."""
    from pathlib import Path

    from moetune.runtime.shapes import MODELS
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.search.local_backend import LocalBackend
    from moetune.tuner.search.model_backend import ModelBackend
    from moetune.tuner.search.tune import check_tune

    facts = discover(Path(__file__).resolve().parent / "captures" / "dgx-h100")
    be = LocalBackend(world=16, comm_backend="nccl", command=["true"])
    plan = check_tune(facts, models=[MODELS["qwen3-30b"]], backend=be, ep_size=16)
    fams = {t.name for t in facts.transports}
    assert "nvlink" in fams and "collective" in plan.policies, (fams, plan.policies)
    assert not any(f == "nvlink" or f.startswith("proxy") for f in plan.policies), plan.policies
    with pytest.raises(ValueError, match=r"EP size 16 on 1 node\(s\): no transport family considered \(nvlink\) can "
                                         r"serve it: nvlink: transport=nvlink serves at most 8 ranks"):
        check_tune(facts, models=[MODELS["qwen3-30b"]], backend=be, ep_size=16, families=["nvlink"])
    eight = LocalBackend(world=8, comm_backend="nccl", command=["true"])
    assert check_tune(facts, models=[MODELS["qwen3-30b"]], backend=eight, ep_size=8, families=["nvlink"]).policies
    nic = ModelBackend("ndr-ibrc-h100x8")
    assert nic.group_problem("proxy:ibrc", ep_size=32, nodes=4) == ""
    assert "serves the ranks of one node" in nic.group_problem("nvlink", ep_size=8, nodes=2)
    node = ModelBackend("nvlink-h200x2")
    assert "at most 8 ranks" in node.group_problem("proxy", ep_size=16, nodes=1)
    assert node.group_problem("collective", ep_size=16, nodes=1) == ""
