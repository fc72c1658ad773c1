"""Issue 17, deliverables 2-3 on CPU: the megakernel's knobs in the one vocabulary (validated, digested, in the
policy), MegakernelConfig as a view of the knobs and options, the layer's engine choice and fallback, and the
auto-load of a `megakernel` profile from a daemon and from the read-only database."""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_trust_client import FP, SW, FakeDaemon, _local_facts, _seed_db, ok_reply

from moetune.runtime import wire
from moetune.runtime.knobs import MK_KNOBS, KnobError, Knobs
from moetune.runtime.megakernel import MegakernelConfig
from moetune.runtime.megakernel import engine as E
from moetune.runtime.moe_layer import MoELayer
from moetune.runtime.options import RuntimeOptionError, RuntimeOptions
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles import autoload, node_identity
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.shapes import MODELS, ModelShape

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("autoload_off")]
QWEN = MODELS["qwen3-30b"]
TINY = ModelShape(name="tiny", hidden=128, intermediate=64, experts=4, topk=2, dtype="bfloat16")


# -- knobs ----------------------------------------------------------------------------------------------------
def test_megakernel_knobs_validated_with_the_knob_named() -> None:
    k = Knobs(engine="megakernel", mk_bm=64, mk_stages=3, mk_ctas_per_sm=2, mk_combine_tokens=32)
    assert Knobs.parse("engine=megakernel,mk_bm=64,mk_stages=3,mk_ctas_per_sm=2,mk_combine_tokens=32") == k
    assert Knobs.from_dict(k.to_dict()) == k
    for bad, name in ((dict(mk_bm=32), "mk_bm"), (dict(mk_stages=1), "mk_stages"), (dict(mk_stages=13), "mk_stages"),
                      (dict(mk_ctas_per_sm=-1), "mk_ctas_per_sm"), (dict(mk_combine_tokens=-1), "mk_combine_tokens"),
                      (dict(mk_processor_ctas=1 << 17), "mk_processor_ctas")):
        with pytest.raises(KnobError) as e:
            Knobs(engine="megakernel", **bad)
        assert name in e.value.knobs
    with pytest.raises(KnobError, match="only apply with engine=megakernel") as e:
        Knobs(mk_bm=16)
    assert e.value.knobs == ("mk_bm", "engine")
    with pytest.raises(KnobError):
        Knobs.parse("engine=fused")


def test_digest_covers_megakernel_knobs_and_keeps_old_hashes() -> None:
    old = Knobs()
    legacy = {k: v for k, v in old.to_dict().items() if k not in MK_KNOBS}  # the knob set before issue 17
    assert old.digest() == hashlib.sha256(msgspec.json.encode(legacy, order="sorted")).hexdigest()[:16]
    mk = Knobs(engine="megakernel")
    digests = {old.digest(), mk.digest(), mk.replace(mk_bm=16).digest(), mk.replace(mk_stages=3).digest(),
               mk.replace(mk_ctas_per_sm=1).digest(), mk.replace(mk_processor_ctas=66).digest(),
               mk.replace(mk_combine_tokens=2).digest()}
    assert len(digests) == 7
    key = ProfileKey(fingerprint=FP, software=SW, transport_family="megakernel", ep_size=1, nodes=1, hidden=128,
                     intermediate=64, experts=4, topk=2, dtype="bfloat16", token_bucket=16)
    a = ProfileRecord(key=key, knobs=mk, latency_us=1.0, spread_us=0.0, backend="local:megakernel", provenance="measured")
    b = ProfileRecord(key=key, knobs=mk.replace(mk_bm=16), latency_us=1.0, spread_us=0.0, backend="local:megakernel",
                      provenance="measured")
    assert a.profile_hash != b.profile_hash


def test_config_is_a_view_of_knobs_and_options() -> None:
    k = Knobs(engine="megakernel", mk_bm=128, mk_stages=3, mk_ctas_per_sm=2, mk_processor_ctas=100, mk_combine_tokens=2)
    cfg = MegakernelConfig.from_knobs(k, RuntimeOptions(megakernel_timeout_s=0.25))
    assert (cfg.bm, cfg.stages, cfg.ctas_per_sm, cfg.processor_ctas, cfg.combine_tokens) == (128, 3, 2, 100, 2)
    assert cfg.timeout_ms == 250.0
    auto = MegakernelConfig.from_knobs(Knobs())  # the defaults are today's auto behaviour
    assert auto == MegakernelConfig()


def test_megakernel_timeout_option() -> None:
    assert RuntimeOptions.from_env({"MOETUNE_MK_TIMEOUT_S": "0.5"}).megakernel_timeout_s == 0.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(RuntimeOptionError, match=r"MOETUNE_MK_TIMEOUT_S|megakernel_timeout_s"):
            RuntimeOptions.from_env({"MOETUNE_MK_TIMEOUT_S": bad})


def test_policy_and_space_of_the_megakernel_family(tmp_path: Path) -> None:
    from moetune.tuner.search.policy import PolicyError, load_policy, transport_of_family
    from moetune.tuner.search.space import SearchSpace

    pol = load_policy("megakernel")
    assert pol.defaults.engine == "megakernel" and transport_of_family("megakernel") == "collective"
    space = SearchSpace(pol, experts=QWEN.experts, ep_size=1)
    seen = list(space.enumerate())
    assert seen and all(k.engine == "megakernel" for k in seen)
    assert {k.mk_bm for k in seen} == {0, 16, 64, 128} and {k.mk_stages for k in seen} >= {0, 3, 6}
    bad = tmp_path / "megakernel.toml"
    bad.write_text('[policy]\nfamily = "megakernel"\n\n[knobs]\nmk_bm = [0, 32]\n')
    with pytest.raises(PolicyError, match=r"knobs\.mk_bm"):
        load_policy("megakernel", bad)


# -- the layer's engine -----------------------------------------------------------------------------------------


def _layer(**kw: Any) -> MoELayer:
    return MoELayer(TINY, None, kw.pop("knobs", None), max_tokens=16, device="cpu", dtype=torch.bfloat16, **kw)


def _engine_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, E.EngineFallbackWarning)]


def test_engine_requested_where_it_cannot_run_raises() -> None:
    with pytest.raises(E.MegakernelUnavailable, match="no CUDA device"):
        _layer(engine="megakernel")
    with pytest.raises(ValueError, match="engine must be one of"):
        _layer(engine="fused")


def test_engine_from_knobs_falls_back_with_one_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = _layer(knobs=Knobs(engine="megakernel"))
        b = _layer(knobs=Knobs(engine="megakernel"))
    assert a.engine == b.engine == "unfused" and "no CUDA device" in a.engine_note
    msgs = _engine_warnings(caught)
    assert len(msgs) == 1 and "UNFUSED" in msgs[0] and "no CUDA device" in msgs[0]
    x = torch.randn(5, TINY.hidden).to(torch.bfloat16)
    assert a(x).shape == (5, TINY.hidden)  # the unfused engine runs


def test_auto_engine_on_cpu_is_unfused_silently() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = _layer()
    assert layer.engine == "unfused" and not _engine_warnings(caught) and layer.engine_resolution is None


class FakeMegakernel:
    """Stands in for MegakernelMoE on CPU: records what it was built with; forward is the unfused math on the
    row-major form of the k-tiled weights it was handed (`layer`: an unfused layer holding those)."""

    built: ClassVar[list[FakeMegakernel]] = []

    def __init__(self, model: Any, **kw: Any):
        from moetune.runtime.megakernel.config import LaunchConfigs
        from moetune.runtime.megakernel.weights import from_tiled

        self.model, self.kw, self.calls = model, kw, 0
        self.launch = LaunchConfigs(kw["config"])
        self.launched: list[Any] = []  # the config each forward ran (per token bucket, as MegakernelMoE._run picks)
        self.layer = MoELayer(model, None, Knobs(), max_tokens=kw["max_tokens"], device=kw["device"],
                              dtype=kw["w_gate_up"].dtype, seed=kw["seed"], engine="unfused")
        assert kw["tiled"] is True  # MoELayer hands its parameters over k-tiled
        self.layer.w_gate_up.data.copy_(from_tiled(kw["w_gate_up"]))
        self.layer.w_down.data.copy_(from_tiled(kw["w_down"]))
        FakeMegakernel.built.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from moetune.runtime.moe_layer import route

        idx, w = route(x, self.kw["gate"], self.model.topk)
        return self.forward_routed(x, idx, w)

    def set_bucket_config(self, bucket: int, config: Any) -> str | None:
        why = self.launch.problem(config)
        if why is None:
            self.launch.install(bucket, config)
        return why

    def forward_routed(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, **_: Any) -> torch.Tensor:
        self.calls += 1
        self.launched.append(self.launch.for_tokens(x.shape[0]))
        return self.layer.local_forward(x, idx.long(), w)


@pytest.fixture
def fake_mk(monkeypatch: pytest.MonkeyPatch):
    FakeMegakernel.built = []
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    monkeypatch.setattr(E, "build_megakernel", FakeMegakernel)
    return FakeMegakernel


def test_megakernel_engine_runs_the_same_weights(fake_mk) -> None:
    knobs = Knobs(engine="megakernel", mk_bm=16, mk_stages=3)
    layer = MoELayer(TINY, None, knobs, max_tokens=16, device="cpu", dtype=torch.bfloat16,
                     buffer=None)
    assert layer.engine == "megakernel" and layer.engine_knobs == knobs
    mk = fake_mk.built[-1]
    cfg = mk.kw["config"]
    assert (cfg.bm, cfg.stages, cfg.timeout_ms) == (16, 3, layer.buffer.options.megakernel_timeout_s * 1000)
    assert mk.kw["w_gate_up"].data_ptr() == layer.w_gate_up.data_ptr()  # shared, not copied
    assert mk.kw["w_down"].data_ptr() == layer.w_down.data_ptr() and mk.kw["gate"].data_ptr() == layer.gate.data_ptr()
    x = torch.randn(7, TINY.hidden).to(torch.bfloat16)
    out = layer(x)
    assert mk.calls == 1
    ref = MoELayer(TINY, None, Knobs(), max_tokens=16, device="cpu", dtype=torch.bfloat16)
    assert ref.engine == "unfused"
    assert torch.equal(out, ref(x))
    idx, w = layer.route(x)
    layer.forward_routed(x, idx, w)
    assert mk.calls == 2
    # the parameters hold the megakernel's k-tiled layout; state_dict and load_state_dict speak row-major
    assert layer.weights_tiled and not torch.equal(layer.w_gate_up, ref.w_gate_up)
    sd = layer.state_dict()
    assert torch.equal(sd["w_gate_up"], ref.w_gate_up) and torch.equal(sd["w_down"], ref.w_down)
    assert torch.equal(ref.state_dict()["w_gate_up"], ref.w_gate_up)  # an unfused layer's stays as it is
    new = {k: (v * 2 if k in ("w_gate_up", "w_down") else v) for k, v in sd.items()}
    layer.load_state_dict(new)
    assert torch.equal(layer.state_dict()["w_gate_up"], ref.w_gate_up * 2)
    assert torch.equal(layer.w_gate_up.data, mk.kw["w_gate_up"])  # the same storage the megakernel reads


def test_engine_unfused_argument_wins(fake_mk) -> None:
    layer = _layer(knobs=Knobs(engine="megakernel"), engine="unfused")
    assert layer.engine == "unfused" and not fake_mk.built


def test_build_failure_falls_back_or_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.csrc_build import BuildError

    def broken(model: Any, **kw: Any) -> Any:
        raise BuildError("nvcc failed (exit 1)")

    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    monkeypatch.setattr(E, "build_megakernel", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = _layer(knobs=Knobs(engine="megakernel"))
    assert layer.engine == "unfused" and "nvcc failed" in _engine_warnings(caught)[0]
    with pytest.raises(E.MegakernelUnavailable, match="nvcc failed"):
        _layer(engine="megakernel")


def test_auto_engine_uses_the_megakernel_policy_default(fake_mk) -> None:
    layer = _layer()  # no knobs, no engine, MOETUNE_AUTOLOAD=0: the megakernel policy's defaults
    assert layer.engine == "megakernel" and layer.engine_resolution.family == "megakernel"
    assert layer.engine_knobs == Knobs(engine="megakernel")


# -- auto-load of a megakernel profile -------------------------------------------------------------------------
def mk_key(fp: str = FP, sw: str = SW, bucket: int = 16) -> ProfileKey:
    return ProfileKey(fingerprint=fp, software=sw, transport_family="megakernel", ep_size=1, nodes=1,
                      hidden=QWEN.hidden, intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk,
                      dtype=QWEN.dtype, token_bucket=bucket)


def mk_record(knobs: Knobs, *, backend: str = "local:megakernel", provenance: str = "measured", **kw: Any) -> ProfileRecord:
    return ProfileRecord(key=mk_key(**kw), knobs=knobs, latency_us=240.0, spread_us=2.0, backend=backend,
                         provenance=provenance)


def _autoload(endpoint: str, db: Path) -> tuple[Any, list[str]]:
    c = ProfileClient(endpoint, db_path=db, timeout_ms=300, env={})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = autoload.autoload_profile(model=QWEN, ep_size=1, nodes=1, max_tokens=16, device="cuda:0", client=c,
                                            transport_family="megakernel")
    finally:
        c.close()
    return res, [str(w.message) for w in caught]


def _autoload_from_daemon(run: Path, rec: ProfileRecord, db: Path) -> tuple[list[dict], Any, list[str]]:
    """`_autoload` from a fake daemon (in `run`) that answers every lookup with `rec`: its requests, the result and the
    warnings."""
    d = FakeDaemon(run, lambda req: ok_reply(req["id"], msgspec.to_builtins(wire.ProfileResult.from_record(rec, env={}))),
                   {"fingerprint": FP, "software": SW, "transports": ["collective"], "db": str(db)})
    try:
        res, warned = _autoload(d.endpoint, db)
    finally:
        d.close()
    return d.requests, res, warned


def test_autoload_megakernel_profile_from_a_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOETUNE_AUTOLOAD")
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)  # a GPU that can run it
    tuned = Knobs(engine="megakernel", mk_bm=64, mk_stages=3)
    requests, res, warned = _autoload_from_daemon(tmp_path / "run", mk_record(tuned), tmp_path / "none.db")
    assert requests[0]["transport_family"] == "megakernel" and requests[0]["ep_size"] == 1
    assert res.source == "daemon" and res.tuned and res.knobs == tuned and not warned


def test_autoload_megakernel_modelled_or_unrunnable_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOETUNE_AUTOLOAD")
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    modelled = mk_record(Knobs(engine="megakernel", mk_bm=16), backend=f"model:node:{FP}", provenance="node_model")
    _, res, warned = _autoload_from_daemon(tmp_path / "run", modelled, tmp_path / "none.db")
    assert res.source == "policy" and not res.tuned and res.knobs == Knobs(engine="megakernel")
    assert len(warned) == 1 and "MODELLED" in warned[0]
    # a node where the megakernel cannot run: the daemon's profile is passed over, never raised
    monkeypatch.setattr(autoload, "_availability", {})
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: "sm_80")
    _, res, warned = _autoload_from_daemon(tmp_path / "run3", mk_record(Knobs(engine="megakernel")), tmp_path / "none.db")
    assert res.source != "daemon" and any("sm_80" in w for w in warned)


def test_autoload_megakernel_profile_from_the_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOETUNE_AUTOLOAD")
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    facts = _local_facts()
    F.pretend_node(monkeypatch, facts, tmp_path / "proc")
    sw = node_identity.software_hash(facts)
    db = tmp_path / "moetune.db"
    fp = "c" * 16
    tuned = Knobs(engine="megakernel", mk_bm=16, mk_stages=3)
    coll = ProfileRecord(key=msgspec.structs.replace(mk_key(fp, sw), transport_family="collective"),
                         knobs=Knobs(channels=2), latency_us=5.0, spread_us=0.0, backend="local:nccl",
                         provenance="measured")
    _seed_db(db, {"_fp": fp, "facts": facts}, [mk_record(tuned, fp=fp, sw=sw), coll])
    res, warned = _autoload(f"ipc://{tmp_path}/nowhere/daemon.sock", db)
    assert res.source == "database" and res.tuned and res.knobs == tuned and res.family == "megakernel"
    assert len(warned) == 1 and "read-only database" in warned[0]
    # the EP buffer's own lookup (no family) never gets the engine's profile, although it is "faster"
    c = ProfileClient(f"ipc://{tmp_path}/nowhere/daemon.sock", db_path=db, timeout_ms=300, env={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = c.resolve(model=QWEN, ep_size=1, tokens=16, nodes=1)
    c.close()
    assert plain.family == "collective" and plain.knobs.engine == "unfused"
    store = F.open_store(db)
    got = store.find_profile(fingerprint=fp, software=sw, ep_size=1, nodes=1, hidden=QWEN.hidden,
                            intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype,
                            tokens=16)
    assert got is not None and got.key.transport_family == "collective"
    json.dumps(res.knobs.to_dict())


def _eager_and_replayed(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the eager output, the output of a CUDA graph of the same call, zeroed after capture and then replayed)."""
    want = layer(x).clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = layer(x)
    got.zero_()
    g.replay()
    torch.cuda.synchronize()
    return want, got


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (the megakernel is built for sm_90a)")
def test_gpu_layer_engines_agree_and_capture() -> None:
    model = QWEN
    mk = MoELayer(model, None, Knobs(engine="megakernel"), max_tokens=256, device="cuda", engine="megakernel")
    un = MoELayer(model, None, Knobs(), max_tokens=256, device="cuda", engine="unfused")
    assert mk.engine == "megakernel" and un.engine == "unfused"
    from moetune.runtime.moe_layer import max_rel_err
    from moetune.tuner.measure.moe import PAIR_REL_ERR_BOUND

    torch.manual_seed(0)
    for s in (1, 7, 128):
        x = torch.randn(s, model.hidden, device="cuda").to(torch.bfloat16)
        # two bf16 engines, each within 1e-2 of the fp32 reference (tests/test_megakernel_gpu.py checks that): they
        # may differ by twice that (run 203: 1.33e-2 at one unseeded input; 1e-2 here was the wrong bound)
        assert max_rel_err(mk(x), un(x)) <= PAIR_REL_ERR_BOUND
    # the megakernel layer holds its expert weights k-tiled in place; its state_dict is the unfused layer's
    sd, ref = mk.state_dict(), un.state_dict()
    assert mk.weights_tiled and not un.weights_tiled
    assert all(torch.equal(sd[k], ref[k]) for k in ("w_gate_up", "w_down", "gate"))
    x = torch.randn(128, model.hidden, device="cuda").to(torch.bfloat16)
    want = mk(x).clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = mk(x)
    g.replay()
    torch.cuda.synchronize()
    mk.megakernel.check()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch._grouped_mm and graph capture)")
def test_gpu_unfused_layer_captures_and_matches_the_reference() -> None:
    """The unfused engine at world 1 (item 6 of the megakernel issue): within 1e-2 of the fp32 reference, the same
    bits run to run, and a CUDA graph of it replays to the eager output without a host sync inside."""
    from moetune.runtime.moe_layer import dense_reference, max_rel_err

    model = QWEN
    un = MoELayer(model, None, Knobs(), max_tokens=1024, device="cuda", engine="unfused")
    assert un.engine == "unfused" and un.use_grouped_mm
    for s in (1, 7, 128, 1000):
        x = torch.randn(s, model.hidden, device="cuda").to(torch.bfloat16)
        out = un(x)
        assert torch.equal(out, un(x))
        assert max_rel_err(out, dense_reference(x, model)) <= 1e-2, s
    want, got = _eager_and_replayed(un, torch.randn(128, model.hidden, device="cuda").to(torch.bfloat16))
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (the megakernel is built for sm_90a)")
def test_gpu_megakernel_device_without_index_and_unlaunchable_configs() -> None:
    """"cuda" means the current device; a config the library cannot launch fails at construction, not at the first
    forward (MegakernelMoE: ConfigError; MoELayer asking for the megakernel: MegakernelUnavailable)."""
    from moetune.runtime.megakernel import ConfigError, MegakernelMoE

    mk = MegakernelMoE(QWEN, max_tokens=16, device="cuda")
    assert mk.device == torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(3, QWEN.hidden, device="cuda").to(torch.bfloat16)
    assert mk(x).shape == (3, QWEN.hidden)
    mk.check()
    w = dict(w_gate_up=mk.w_gate_up, w_down=mk.w_down, gate=mk.gate)
    for cfg, match in ((MegakernelConfig(bm=128, core="mma", stages=8), "bm=128, stages=8"),
                       (MegakernelConfig(ctas_per_sm=32), "ctas_per_sm=32")):
        with pytest.raises(ConfigError, match=match):
            MegakernelMoE(QWEN, max_tokens=16, device="cuda", config=cfg, **w)
    # (mk_bm=128, mk_stages=8 never gets this far: the knob check refuses it, test_knobs.py)
    with pytest.raises(E.MegakernelUnavailable, match="ctas_per_sm"):
        MoELayer(QWEN, None, Knobs(engine="megakernel", mk_ctas_per_sm=32), max_tokens=16,
                 device="cuda", engine="megakernel")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (the megakernel is built for sm_90a)")
def test_gpu_layer_reloaded_weights_row_major_paths_and_bad_ids() -> None:
    """load_state_dict(assign=True) hands the new parameters to the megakernel; local_forward on the k-tiled layer
    equals the unfused layer's; out-of-range ids raise eagerly and, inside a graph capture (no host check), end in
    the kernel's error record, which MoELayer.check() raises."""
    from moetune.runtime.megakernel import MegakernelError
    from moetune.runtime.moe_layer import max_rel_err

    mk = MoELayer(QWEN, None, Knobs(engine="megakernel"), max_tokens=16, device="cuda", engine="megakernel")
    un = MoELayer(QWEN, None, Knobs(), max_tokens=16, device="cuda", engine="unfused")
    new = {k: (v * 0.5 if k in ("w_gate_up", "w_down") else v) for k, v in un.state_dict().items()}
    mk.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
    un.load_state_dict(new)
    x = torch.randn(16, QWEN.hidden, device="cuda").to(torch.bfloat16)
    assert max_rel_err(mk(x), un(x)) <= 1e-2
    idx, w = un.route(x)
    assert max_rel_err(mk.local_forward(x, idx, w), un.local_forward(x, idx, w)) <= 1e-3
    mk.check()
    bad = idx.clone()
    bad[3, 1] = QWEN.experts
    with pytest.raises(ValueError, match="out of range"):
        mk.forward_routed(x, bad, w)
    mk.forward_routed(x, idx, w)  # warm the launch caches before capturing
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mk.forward_routed(x, bad, w)
    g.replay()
    torch.cuda.synchronize()
    with pytest.raises(MegakernelError, match="out of range"):
        mk.check()
    mk.megakernel.clear_error()


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (the megakernel is built for sm_90a)")
def test_gpu_per_bucket_profiles_match_the_reference_and_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real megakernel with stored profiles per token bucket (2e14d49): a layer sized for 1024 tokens whose
    1024-bucket profile picked 64-row tiles runs the 16-token bucket with its own 16-row tiles; the 1-token bucket's
    profile asks split-K 2, for which the layer grows its partial buffers (run 185 on an H200, before that: the
    bucket ran the construction profile with a warning; every size matched the fp32 reference within 1e-2). S=1
    runs the decode kernel on this shape, which ignores split-K; S=2 and 3 (nearest bucket 1 too) run the task graph
    on 16-row tiles, so they are what runs that profile's split-K (each matches the reference and repeats its bits).
    After resolve_buckets() a CUDA graph of each size replays to the eager output."""
    from moetune.runtime.moe_layer import dense_reference, max_rel_err
    from moetune.runtime.profile_record import nearest_bucket
    from moetune.runtime.profiles.client import Resolution

    prefill = Knobs(engine="megakernel", mk_bm=64)
    decode = Knobs(engine="megakernel", mk_bm=16)
    split = Knobs(engine="megakernel", mk_bm=16, mk_split_k=2)
    per_bucket = {1024: prefill, 512: prefill, 1: split, 16: decode}
    asked: list[int] = []

    def fake_resolve(**kw: Any) -> Resolution:
        if kw["transport_family"] != "megakernel":  # an EP lookup (a world-1 layer makes none; kept for safety)
            knobs = Knobs()
        else:
            asked.append(kw["max_tokens"])
            knobs = per_bucket.get(nearest_bucket(kw["max_tokens"]), Knobs(engine="megakernel"))
        return Resolution(knobs=knobs, source="daemon", profile_hash=f"h:{knobs.digest()}", status="current",
                          family=kw["transport_family"] or "collective", tuned=True)

    monkeypatch.setattr(autoload, "_resolve", fake_resolve)
    monkeypatch.delenv("MOETUNE_AUTOLOAD")  # this file's autouse fixture turns autoload off (no daemon, no database)
    autoload.clear_cache()
    layer = MoELayer(QWEN, None, None, max_tokens=1024, device="cuda", engine="megakernel")
    assert layer.engine == "megakernel" and layer.engine_buckets == {1024: prefill}
    assert nearest_bucket(2) == nearest_bucket(3) == 1
    for s in (1, 2, 3, 7, 16, 128, 1000):
        x = torch.randn(s, QWEN.hidden, device="cuda").to(torch.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = layer(x)
        assert torch.equal(out, layer(x)), s
        assert max_rel_err(out, dense_reference(x, QWEN)) <= 1e-2, s
        assert not [str(w.message) for w in caught if "not applied" in str(w.message)], s
    assert layer.engine_buckets[16] == decode and layer.engine_buckets[1] == split
    assert layer.megakernel.sk_room == (16, 2)  # grown for bucket 1's split-K
    assert layer.megakernel.decode_grid(1) is not None and layer.megakernel.decode_grid(2) is None  # see above
    buckets = layer.resolve_buckets()
    assert buckets[1024] == prefill and buckets[16] == decode
    n_asked = len(asked)
    for s in (1, 16, 512):
        want, got = _eager_and_replayed(layer, torch.randn(s, QWEN.hidden, device="cuda").to(torch.bfloat16))
        layer.megakernel.check()
        assert torch.equal(got, want), s
    assert len(asked) == n_asked  # no lookup once the buckets are resolved
