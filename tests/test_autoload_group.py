"""The auto-loaded profile of an EP group: resolved on rank 0 and broadcast (one slow rank, or a second node that
resolves another profile, never makes the ranks disagree), keyed by the buffer's activation dtype and the
expected token count; the megakernel's stored profiles applied per token bucket."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from moetune.runtime.buffer.facade import EPBuffer
from moetune.runtime.knobs import Knobs
from moetune.runtime.megakernel.config import LaunchConfigs, MegakernelConfig
from moetune.runtime.moe_layer import MoELayer
from moetune.runtime.profiles import autoload
from moetune.runtime.profiles.client import Resolution
from moetune.runtime.shapes import ModelShape
from moetune.runtime.testing.launch import launch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the cases by name
from megakernel_fakes import use_fake_megakernel

cases = importlib.import_module("autoload_cases")

BF16 = ModelShape(name="t", hidden=128, intermediate=64, experts=8, topk=2, dtype="bfloat16")
pytestmark = pytest.mark.usefixtures("autoload_on")


def _spy(monkeypatch: pytest.MonkeyPatch, answer: Any = None) -> list[dict]:
    calls: list[dict] = []

    def fake_resolve(**kw: Any) -> Resolution:
        calls.append({"dtype": kw["model"].dtype, "tokens": kw["max_tokens"], "family": kw["transport_family"]})
        knobs = answer(kw) if callable(answer) else Knobs()
        return Resolution(knobs=knobs, source="daemon", profile_hash=f"h:{knobs.digest()}", status="current",
                          family=kw["transport_family"] or "collective", tuned=True)

    monkeypatch.setattr(autoload, "_resolve", fake_resolve)
    return calls


# -- the lookup key: the buffer's dtype and token count ----------------------------------------------------------
def test_lookup_uses_the_buffers_dtype_not_the_models(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    EPBuffer(None, None, model=BF16, max_tokens=64, dtype=torch.float32, device="cpu")
    assert calls[-1]["dtype"] == "float32"
    EPBuffer(None, None, model=BF16, max_tokens=64, device="cpu")
    assert calls[-1]["dtype"] == "bfloat16"  # a new lookup: the dtype is part of the cache key
    autoload.autoload_knobs(model=BF16, ep_size=1, nodes=1, max_tokens=8, dtype=torch.float16)
    assert calls[-1]["dtype"] == "float16"


def test_expected_tokens_picks_the_construction_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    buf = EPBuffer(None, None, model=BF16, max_tokens=4096, device="cpu", expected_tokens=16)
    assert calls[-1]["tokens"] == 16 and buf.expected_tokens == 16 and buf.resolution is not None
    EPBuffer(None, None, model=BF16, max_tokens=4096, device="cpu")
    assert calls[-1]["tokens"] == 4096  # default: max_tokens, as before
    with pytest.raises(ValueError, match="expected_tokens"):
        EPBuffer(None, None, model=BF16, max_tokens=64, device="cpu", expected_tokens=65)


# -- one profile per group ------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_slow_rank_gets_rank0s_profile_instead_of_crashing() -> None:
    """Rank 1's lookup times out (policy default) while rank 0's finds the tuned profile: rank 1 does not look up
    and runs rank 0's, as ranks with different knobs would make EPBuffer._agree raise on every rank."""
    res = launch(cases.case_group_profile, 2, args=({0: (cases.TUNED_A, "A"), 1: "slow"}, None), timeout_s=20,
                 join_timeout_s=55)
    for r in res:
        assert r["knobs"] == cases.TUNED_A.to_dict() and r["hash"] == "tuned-A" and r["source"] == "daemon"
        assert r["env"] == "2"  # the profile's env exported on every rank
    assert len(res[0]["calls"]) == 1 and res[0]["calls"][0]["dtype"] == "float32"
    assert res[1]["calls"] == []  # same host as rank 0: no lookup at all


@pytest.mark.timeout(60)
def test_two_hosts_agreeing_use_rank0s_profile() -> None:
    res = launch(cases.case_group_profile, 2, args=({0: (cases.TUNED_A, "A"), 1: (cases.TUNED_A, "A")},
                                                    ["node-a", "node-b"]), timeout_s=20, join_timeout_s=55)
    for r in res:
        assert r["hash"] == "tuned-A" and r["knobs"] == cases.TUNED_A.to_dict()
        assert len(r["calls"]) == 1 and r["calls"][0]["nodes"] == 2  # each host's first rank asks its own node


@pytest.mark.timeout(60)
def test_a_node_is_told_by_its_boot_id_not_its_host_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers of one host may each have a host name yet share the node (and its NVLink); hosts may share a
    name. The kernel's boot id tells nodes apart; the host name only where it cannot be read."""
    boot = tmp_path / "boot_id"
    boot.write_text("e0ec2882-a100-4979-a256-56129669cc35\n")
    from moetune.runtime import hosts  # where autoload's host_identity lives (host_staged asks it too)

    monkeypatch.setattr(hosts, "_BOOT_ID", str(boot))
    monkeypatch.setattr(hosts.socket, "gethostname", lambda: "pod-1")
    first = autoload.host_identity()
    monkeypatch.setattr(hosts.socket, "gethostname", lambda: "pod-2")
    assert autoload.host_identity() == first == "boot:e0ec2882-a100-4979-a256-56129669cc35"
    monkeypatch.setattr(hosts, "_BOOT_ID", str(tmp_path / "absent"))
    assert autoload.host_identity() == "host:pod-2"


def test_two_hosts_disagreeing_fall_back_to_the_policy_default_everywhere() -> None:
    """A second node that resolves another profile (another fingerprint, or its lookup timed out): the whole
    group runs rank 0's policy default with a warning, never an error."""
    for other in ((cases.TUNED_B, "B"), "slow"):
        res = launch(cases.case_group_profile, 2, args=({0: (cases.TUNED_A, "A"), 1: other}, ["node-a", "node-b"]),
                     timeout_s=20, join_timeout_s=55)
        assert res[0]["knobs"] == res[1]["knobs"] and res[0]["hash"] == res[1]["hash"]
        assert res[0]["source"] in ("policy", "default") and res[0]["hash"] != "tuned-A"
        assert res[0]["env"] is None and res[1]["env"] is None  # the rejected profile's env was never exported
        assert any("hosts of this EP group resolved different profiles" in w for w in res[0]["warnings"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lagging", [0, 1])
def test_hosts_whose_fallbacks_expire_apart_retry_together(lagging: int) -> None:
    """Each host's first rank cached its fallback at its own time (one waited out the client timeout): a layer built
    between the two expiries saw one host retry and find the tuned profile while the other served its cached
    fallback, so the group ran its default ("resolved different profiles"). Rank 0 now decides for the group when
    its fallback is looked up again, and every host follows."""
    # fallback_retry_s = 10: 1005 lies before both hosts' expiries, 1010.1 between them
    at = [1000.0, 1005.0, 1010.1, 1010.3, 1020.0]
    res = launch(cases.case_group_fallback_retry, 2, args=(["node-a", "node-b"], lagging, at),
                 env={"MOETUNE_CLIENT_FALLBACK_RETRY_S": "10"}, timeout_s=20, join_timeout_s=55)
    for step in range(len(at)):
        got = [r["steps"][step] for r in res]
        assert got[0]["hash"] == got[1]["hash"], (step, got)
        assert not any("resolved different profiles" in w for g in got for w in g["warnings"]), (step, got)
        assert got[0]["calls"] == got[1]["calls"], (step, got)  # every host retried at the same construction
    assert res[0]["steps"][0]["source"] == "policy"  # the daemon did not answer either host
    # before any expiry the group serves its cached fallback: no host looks up again (not a retry at every layer)
    assert [r["steps"][1]["calls"] for r in res] == [["down"], ["down"]], res
    assert res[0]["steps"][1]["source"] == "policy", res
    assert res[0]["steps"][-1]["hash"] == "tuned-A"  # and the group took the tuned profile once it answered


@pytest.mark.timeout(60)
def test_a_group_default_after_a_kept_profile_is_retried() -> None:
    """Rank 0 kept no retry time for a group that had resolved a profile (None), and set one only on a retry or a
    first lookup: a default that came later (one host's lookup key changed and its daemon was briefly down) was
    never retried, that host serving its cached fallback past its expiry and the group its default for good."""
    at = [1000.0, 1001.0, 1020.0]  # fallback_retry_s = 10: 1020 is past the default's expiry
    res = launch(cases.case_group_default_after_a_kept_profile, 2, args=(["node-a", "node-b"], at),
                 env={"MOETUNE_CLIENT_FALLBACK_RETRY_S": "10"}, timeout_s=20, join_timeout_s=55)
    assert [r["steps"][0]["hash"] for r in res] == ["tuned-A"] * 2, res
    assert res[0]["steps"][1]["source"] in ("policy", "default"), res  # the hosts disagreed
    assert [r["steps"][2]["hash"] for r in res] == ["tuned-A"] * 2, res  # retried once past its expiry
    assert res[1]["steps"][2]["calls"] == ["tuned", "down", "tuned"], res


# -- the megakernel: per token bucket ---------------------------------------------------------------------------
def _mk_layer(monkeypatch: pytest.MonkeyPatch, per_bucket: dict[int, Knobs]) -> tuple[MoELayer, list[dict]]:
    use_fake_megakernel(monkeypatch)
    from moetune.runtime.profile_record import nearest_bucket

    def answer(kw: dict) -> Knobs:
        if kw["transport_family"] != "megakernel":
            return Knobs()
        return per_bucket.get(nearest_bucket(kw["max_tokens"]), Knobs(engine="megakernel"))

    calls = _spy(monkeypatch, answer)
    layer = MoELayer(BF16, None, None, max_tokens=4096, device="cpu", dtype=torch.bfloat16)
    assert layer.engine == "megakernel"
    return layer, calls


def test_megakernel_decode_call_runs_the_decode_buckets_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer sized for 4096 tokens whose 4096-bucket profile picked bm=64: a 1-token call runs the 1-token
    bucket's profile (bm=16), not the 4096 one; one lookup per bucket."""
    prefill = Knobs(engine="megakernel", mk_bm=64, mk_stages=4)
    decode = Knobs(engine="megakernel", mk_bm=16, mk_stages=6)
    layer, calls = _mk_layer(monkeypatch, {4096: prefill, 1: decode, 16: decode})
    mk = layer.megakernel
    assert mk.kw["config"].bm == 0  # scratch sized for any bucket's m-tile
    x1 = torch.randn(1, BF16.hidden).to(torch.bfloat16)
    layer(x1)
    layer(x1)
    layer(torch.randn(4096, BF16.hidden).to(torch.bfloat16))
    assert [(c.bm, c.stages) for c in mk.launched] == [(16, 6), (16, 6), (64, 4)]
    mk_calls = [c for c in calls if c["family"] == "megakernel"]
    assert [c["tokens"] for c in mk_calls] == [4096, 1]  # construction bucket, then S=1's bucket once
    assert layer.engine_buckets == {4096: prefill, 1: decode}
    # before capturing CUDA graphs: every bucket of 1..max_tokens resolved now, none on the hot path later
    assert set(layer.resolve_buckets()) == {1, 16, 64, 128, 256, 512, 1024, 2048, 4096}
    assert layer.engine_buckets[64] == Knobs(engine="megakernel")


def _decode_calls(monkeypatch: pytest.MonkeyPatch, prefill: Knobs, decode: Knobs, calls: int) -> tuple[MoELayer, list[str]]:
    """A layer of the 4096 bucket's `prefill` profile called `calls` times with 1 token (bucket 1's profile:
    `decode`); the warnings that bucket 1's profile was not applied."""
    layer, _ = _mk_layer(monkeypatch, {4096: prefill, 1: decode})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            layer(torch.randn(1, BF16.hidden).to(torch.bfloat16))
    return layer, [str(w.message) for w in caught if "token bucket 1 is not applied" in str(w.message)]


def test_megakernel_bucket_that_does_not_fit_keeps_the_construction_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket whose profile needs other scratch (a combine tile of 1 token: more combine counters than the
    scratch's smallest auto tile, 2, sized) keeps the construction profile, with one warning."""
    prefill = Knobs(engine="megakernel", mk_bm=64)
    layer, got = _decode_calls(monkeypatch, prefill, Knobs(engine="megakernel", mk_bm=16, mk_combine_tokens=1), 2)
    assert len(got) == 1 and "combine tile" in got[0]
    assert layer.megakernel.launched[-1].bm == 64 and layer.engine_buckets[1] == prefill


@pytest.mark.parametrize("asked", [None, "megakernel"])
def test_a_construction_profile_past_the_kernels_limits_runs_the_defaults(monkeypatch: pytest.MonkeyPatch,
                                                                            asked: str | None) -> None:
    """A stored construction-bucket profile the kernel refuses for this shape (split-K 4 needs hidden % 256 == 0; a
    profile from before a kernel upgrade) is not applied, as another bucket's is not: that bucket runs the defaults,
    with one warning. It refused the whole engine (MegakernelUnavailable 'cannot run here' with engine='megakernel',
    the unfused engine without) though the megakernel runs here."""
    from moetune.runtime.megakernel.config import limits_problem

    use_fake_megakernel(monkeypatch, refuse=lambda cfg: limits_problem(BF16, None, cfg))  # as the library checks
    bad = Knobs(engine="megakernel", mk_split_k=4)
    _spy(monkeypatch, lambda kw: bad if kw["transport_family"] == "megakernel" else Knobs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = MoELayer(BF16, None, None, max_tokens=4096, device="cpu", dtype=torch.bfloat16, engine=asked)
    got = [str(w.message) for w in caught if "token bucket 4096 is not applied" in str(w.message)]
    assert layer.engine == "megakernel" and len(got) == 1 and "mk_split_k" in got[0], [str(w.message) for w in caught]
    assert layer.engine_buckets == {4096: Knobs(engine="megakernel")}
    layer(torch.randn(4096, BF16.hidden).to(torch.bfloat16))
    assert layer.megakernel.launched[-1].split_k1 == 1


@pytest.mark.parametrize("asked", [None, "megakernel"])
def test_a_construction_profile_out_of_range_runs_the_defaults(monkeypatch: pytest.MonkeyPatch,
                                                              asked: str | None) -> None:
    """A stored construction-bucket profile whose setting the megakernel's config refuses as out of range
    (ConfigError; here split-K 2 where this kernel's config takes 1 only, a profile from before its range narrowed)
    is a served profile that does not fit: passed over with a reason, as one past the kernel's limits is and as
    another bucket's out-of-range profile is (`install`), so that bucket runs the defaults, with one warning. It
    refused the whole engine (MegakernelUnavailable with engine='megakernel', the unfused engine without). The same
    setting passed by the caller is the caller's error and still refuses the engine, naming it."""
    use_fake_megakernel(monkeypatch)
    monkeypatch.setitem(MegakernelConfig._RANGES, "split_k1", (1, 1))
    bad = Knobs(engine="megakernel", mk_split_k=2)
    _spy(monkeypatch, lambda kw: bad if kw["transport_family"] == "megakernel" else Knobs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = MoELayer(BF16, None, None, max_tokens=4096, device="cpu", dtype=torch.bfloat16, engine=asked)
    got = [str(w.message) for w in caught if "token bucket 4096 is not applied" in str(w.message)]
    assert layer.engine == "megakernel", [str(w.message) for w in caught]
    assert len(got) == 1 and "ConfigError: megakernel config: split_k1 must be in [1, 1], got 2" in got[0], got
    assert layer.engine_buckets == {4096: Knobs(engine="megakernel")}
    layer(torch.randn(4096, BF16.hidden).to(torch.bfloat16))
    assert layer.megakernel.launched[-1].split_k1 == 1
    from moetune.runtime.megakernel.engine import MegakernelUnavailable

    with pytest.raises(MegakernelUnavailable, match=r"split_k1 must be in \[1, 1\], got 2"):
        MoELayer(BF16, None, bad, max_tokens=4096, device="cpu", dtype=torch.bfloat16, engine="megakernel")


def test_a_megakernel_lookup_that_fails_falls_back_to_the_megakernels_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup of the megakernel's profile that raises (a bug, an environment not foreseen) ends in that family's
    policy default, as a lookup that finds no profile does: the auto layer still runs the megakernel. It ended in
    the built-in collective default (engine unfused), so the layer silently ran the unfused engine."""
    from moetune.runtime.profiles import client as C

    use_fake_megakernel(monkeypatch)

    def boom(self: Any, **kw: Any) -> Resolution:
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(C.ProfileClient, "resolve", boom)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = MoELayer(BF16, None, None, max_tokens=64, device="cpu", dtype=torch.bfloat16)
    said = [str(w.message) for w in caught if "unforeseen" in str(w.message)]
    assert layer.engine == "megakernel", said
    assert any("default for megakernel" in m for m in said), said
    res = autoload.autoload_profile(model=BF16, ep_size=1, nodes=1, max_tokens=64, transport_family="megakernel")
    assert (res.knobs.engine, res.source, res.family) == ("megakernel", "policy", "megakernel")
    res = autoload.autoload_profile(model=BF16, ep_size=1, nodes=1, max_tokens=64)  # an EP lookup: as before
    assert (res.knobs, res.source, res.family) == (Knobs(), "default", "collective")


def test_the_construction_buckets_profile_is_the_buckets_whatever_expected_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiles stored at 128, 1024 and 4096 tokens (`moetune profile`'s default sizes). A layer whose expected_tokens
    is 1500 (token bucket 2048) installs bucket 2048's profile, the one every other layer resolves for that bucket
    (4096's: 2048 is as far from 1024 as from 4096, and ties go to the larger). It looked the profile up for 1500
    exactly, got 1024's and ran it for S of bucket 2048, so S=2048 ran another setting than on a layer built for 4096."""
    from moetune.runtime.profile_record import nearest_bucket

    use_fake_megakernel(monkeypatch)
    stored = {128: Knobs(engine="megakernel", mk_bm=16), 1024: Knobs(engine="megakernel", mk_bm=64),
              4096: Knobs(engine="megakernel", mk_bm=128)}
    _spy(monkeypatch, lambda kw: stored[nearest_bucket(kw["max_tokens"], list(stored))]
         if kw["transport_family"] == "megakernel" else Knobs())
    x = torch.randn(2048, BF16.hidden).to(torch.bfloat16)
    ran = []
    for expected in (1500, 4096):
        layer = MoELayer(BF16, None, None, max_tokens=4096, device="cpu", dtype=torch.bfloat16,
                         expected_tokens=expected)
        layer(x)
        ran.append((layer.engine_buckets[2048], layer.megakernel.launched[-1].bm))
    assert ran[0] == ran[1] == (stored[4096], 128), ran


def test_megakernel_decode_bucket_split_k_applies_on_a_prefill_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode bucket's split-K (mk_split_k) applies on a layer whose construction profile has none: the layer
    grows its partial buffers for it (MegakernelMoE._reserve_split; run 185 had it refused and warned)."""
    split = Knobs(engine="megakernel", mk_bm=16, mk_split_k=2)
    layer, got = _decode_calls(monkeypatch, Knobs(engine="megakernel", mk_bm=64), split, 1)
    assert got == []
    ran = layer.megakernel.launched[-1]
    assert (ran.bm, ran.split_k1, ran.split_k2) == (16, 2, 2) and layer.engine_buckets[1] == split


def test_explicit_megakernel_knobs_hold_for_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_megakernel(monkeypatch)
    layer = MoELayer(BF16, None, Knobs(engine="megakernel", mk_bm=64), max_tokens=4096, device="cpu",
                     dtype=torch.bfloat16)
    layer(torch.randn(1, BF16.hidden).to(torch.bfloat16))
    assert layer.engine_buckets is None and layer.megakernel.launched[-1].bm == 64


def test_launch_configs_pick_by_bucket() -> None:
    base = MegakernelConfig()
    lc = LaunchConfigs(base)
    assert lc.for_tokens(7) is base
    small = MegakernelConfig(bm=16)
    lc.install(16, small)
    assert lc.for_tokens(16) is small and lc.for_tokens(12) is small and lc.for_tokens(4096) is base
    assert LaunchConfigs(MegakernelConfig(bm=64)).problem(small) is not None  # scratch sized for bm=64 only
    # split-K's partial buffers are the layer's to grow (MegakernelMoE._reserve_split), not a reason to refuse
    assert lc.problem(MegakernelConfig(bm=16, split_k1=4, split_k2=2)) is None
    assert lc.problem(MegakernelConfig(combine_tokens=8)) is None


def test_split_room_is_what_a_launch_indexes() -> None:
    """(m-tiles, parts per slot) a config's launches use in the partial buffer: the kernel indexes slots by
    sk_max_tiles and strides them by max(split_k1, split_k2); no room where the launch never splits."""
    from moetune.runtime.megakernel.config import split_room

    assert split_room(MegakernelConfig(), 500) == (0, 1)  # split-K 1
    assert split_room(MegakernelConfig(split_k1=4, split_k2=2), 500) == (16, 4)  # bm auto: decode launches split
    assert split_room(MegakernelConfig(bm=16, split_k1=2, split_k2=2, split_max_tiles=8), 500) == (8, 2)
    assert split_room(MegakernelConfig(bm=16, split_k1=2, split_k2=2), 10) == (10, 2)  # no more than the layer's
    assert split_room(MegakernelConfig(bm=64, split_k1=2, split_k2=2), 500) == (0, 1)  # bm=16 launches only


def test_a_layer_built_with_options_looks_up_every_profile_under_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The megakernel's lookups (construction and per token bucket) take the layer's options, as the EP buffer's
    does, not the config's and variables': otherwise one layer resolves under two sets of options."""
    from moetune.runtime.options import RuntimeOptions

    use_fake_megakernel(monkeypatch)
    seen: list[tuple[str, Any]] = []

    def fake_resolve(**kw: Any) -> Resolution:
        seen.append((kw["transport_family"] or "ep", kw["options"]))
        knobs = Knobs(engine="megakernel") if kw["transport_family"] == "megakernel" else Knobs()
        return Resolution(knobs=knobs, source="daemon", profile_hash=f"h:{knobs.digest()}", status="current",
                          family=kw["transport_family"] or "collective", tuned=True)

    monkeypatch.setattr(autoload, "_resolve", fake_resolve)
    mine = RuntimeOptions(fused_pack=False, megakernel_timeout_s=5.0)
    layer = MoELayer(BF16, None, None, max_tokens=4096, device="cpu", dtype=torch.bfloat16, options=mine)
    assert layer.engine == "megakernel" and layer.buffer.options == mine
    layer(torch.randn(1, BF16.hidden).to(torch.bfloat16))  # bucket 1's profile, looked up on its first call
    # no "ep" lookup: a world-1 layer's buffer looks no EP profile up (test_a_one_gpu_layer_looks_up_no_ep_profile)
    assert [family for family, _ in seen] == ["megakernel", "megakernel"]
    assert all(o == mine for _, o in seen), seen
    EPBuffer(None, None, model=BF16, max_tokens=64, device="cpu", options=mine)  # a buffer of its own still does
    assert seen[-1] == ("ep", mine)


# -- one GPU: no EP profile ---------------------------------------------------------------------------------------
def _lookup_warnings(build: Any) -> list[str]:
    """The autoload fallback warnings `build()` gives (its exception, if any, is the caller's to expect)."""
    from moetune.runtime.profiles.errors import FallbackWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


@pytest.mark.usefixtures("clean_autoload_env")
def test_a_one_gpu_layer_looks_up_no_ep_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A world-1 MoELayer never exchanges (local_forward, the megakernel): no knob of the EP profile acts on it. Its
    buffer looked that profile up all the same, so a new user without a daemon got "NO tuned profile ... collective"
    before anything else, and before engine="megakernel"'s refusal on a CPU tensor (choice.py: "before any profile
    lookup"). Autoload on, no daemon, no database: the real lookup path, nothing faked."""
    from moetune.runtime.megakernel.engine import MegakernelUnavailable

    for var in ("MOETUNE_DAEMON_SOCKET", "MOETUNE_CLIENT_SOCKET"):
        monkeypatch.delenv(var, raising=False)
    asked: list[Any] = []
    real = autoload.autoload_profile
    monkeypatch.setattr(autoload, "autoload_profile", lambda **kw: asked.append(kw["transport_family"]) or real(**kw))

    def refused() -> None:
        with pytest.raises(MegakernelUnavailable, match=r"no CUDA device \(the layer is on cpu\)"):
            MoELayer(BF16, None, None, max_tokens=64, device="cpu", dtype=torch.bfloat16, engine="megakernel")

    assert _lookup_warnings(refused) == [] and asked == []  # the refusal first, and alone
    layers: list[MoELayer] = []
    assert _lookup_warnings(lambda: layers.append(MoELayer(BF16, None, None, max_tokens=64, device="cpu",
                                                           dtype=torch.bfloat16))) == []
    layer = layers[0]
    assert asked == [] and layer.buffer.resolution is None and layer.engine == "unfused"
    assert layer.buffer.knobs == Knobs()  # the built-in collective default: dispatch/combine still work
    x = torch.randn(8, BF16.hidden).to(torch.bfloat16)
    assert torch.isfinite(layer(x)).all()
    # the same environment warns for a buffer that does exchange (the warning above could have come)
    said = _lookup_warnings(lambda: EPBuffer(None, None, model=BF16, max_tokens=64, device="cpu"))
    assert asked == [None] and any("NO tuned profile" in m and "collective" in m for m in said), said
    with pytest.raises(TypeError, match="autoload_at_world1 must be a bool"):
        EPBuffer(None, None, model=BF16, max_tokens=64, device="cpu", autoload_at_world1="no")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_the_group_fallback_warning_names_the_default_it_applies() -> None:
    """Hosts that disagree fall back to rank 0's family's policy default, else the built-in default; the warning said
    "using the policy default" whichever of the two every rank then ran."""
    res = launch(cases.case_group_default_named, 2, args=(["node-a", "node-b"],), timeout_s=20, join_timeout_s=55)
    assert res[0]["source"] == res[1]["source"] == "default" and res[0]["hash"] == res[1]["hash"]
    said = [w for w in res[0]["warnings"] if "hosts of this EP group resolved different profiles" in w]
    assert len(said) == 1 and "using the built-in default on every rank" in said[0], said


GROUP_TIMEOUT_S = 10  # the process group's: a rank left waiting in a collective raises only after it


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("where", "rank", "kind"), [
    ("group_default", 0, "GroupLookupError"),  # rank 0, after the hash gather, before the final broadcast
    ("retry_clock", 0, "GroupLookupError"),  # rank 0, before the retry flag's broadcast
    ("leader_lookup", 1, "GroupLookupError"),  # another host's first rank, in its own lookup
    ("config_on_rank_1", 1, "ConfigError"),  # a bad [client] autoload on one rank, before the first collective
])
def test_a_rank_that_raises_in_the_group_lookup_makes_every_rank_raise_at_once(where: str, rank: int,
                                                                              kind: str) -> None:
    """A rank whose part of the group lookup raised left the others waiting in the next collective until the process
    group's timeout (minutes), each then failing with a timeout that does not say why (rank 0's group default raised
    before the final broadcast). Every rank now raises the failed rank's error, with the same words, at once."""
    res = launch(cases.case_group_lookup_raises, 2, args=(where,), timeout_s=GROUP_TIMEOUT_S, join_timeout_s=60)
    assert [r["kind"] for r in res] == [kind, kind], res
    assert res[0]["message"] == res[1]["message"], res
    assert f"failed on rank {rank}: " in res[0]["message"], res
    assert f"{where} broke" in res[0]["message"] or "MOETUNE_AUTOLOAD" in res[0]["message"], res
    assert all(r["elapsed"] < GROUP_TIMEOUT_S / 2 for r in res), res  # not after a wait for the timeout
