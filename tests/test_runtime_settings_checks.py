"""The runtime's settings and constructors refuse what cannot run: check_inputs in the buffer's cross-rank agreement,
RuntimeOptions type checks on direct construction, retired variables with explicit options, max_tokens bounds,
a given buffer's expected_tokens and knobs, KnobError.knobs through the conversions, and the megakernel's scratch
config for per token bucket profiles (its combine tile, its launch shapes, what is reported as running)."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moetune.runtime.buffer.facade import EPBuffer
from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.megakernel.layer import MegakernelMoE
from moetune.runtime.moe_layer import MoELayer
from moetune.runtime.options import RuntimeOptionError, RuntimeOptions
from moetune.runtime.profiles import autoload
from moetune.runtime.profiles.client import Resolution
from moetune.runtime.shapes import ModelShape
from moetune.runtime.testing.launch import launch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the cases by name
from megakernel_fakes import use_fake_megakernel

cases = importlib.import_module("runtime_settings_ranks")

TINY = ModelShape(name="tiny", hidden=128, intermediate=64, experts=4, topk=2, dtype="bfloat16")
BF16 = ModelShape(name="t", hidden=128, intermediate=64, experts=8, topk=2, dtype="bfloat16")
BF = torch.bfloat16
pytestmark = pytest.mark.usefixtures("autoload_on")


# -- 1: check_inputs is part of the buffer's cross-rank agreement ----------------------------------------------
@pytest.mark.timeout(60)
def test_ranks_with_different_check_inputs_refuse_to_build() -> None:
    res = launch(cases.case_check_inputs_mismatch, 2, timeout_s=10, join_timeout_s=50)
    for msg in res:
        assert "differ from rank 0 in check_inputs" in msg, msg


# -- 2: RuntimeOptions(...) checks types as from_dict does -----------------------------------------------------
@pytest.mark.parametrize("kw", [dict(symm="nccl"), dict(hs_native="no"), dict(plan_mode=1.5), dict(proxy_batch=2.7),
                                dict(fused_pack=0), dict(megakernel_timeout_s="2"), dict(chunk_weights=("1",)),
                                dict(proxy_batch=True)])
def test_direct_options_are_type_checked(kw: dict) -> None:
    (name, _), = kw.items()
    with pytest.raises(RuntimeOptionError, match=rf"runtime option {name} \(MOETUNE_"):
        RuntimeOptions(**kw)
    with pytest.raises(RuntimeOptionError, match=name):
        RuntimeOptions.from_dict(kw)


def test_direct_options_hash_as_converted_ones() -> None:
    # an int for a float option: the same digest (ranks compare it) whichever way the options were built
    direct = RuntimeOptions(onesided_timeout_s=3, chunk_weights=[1, 2])
    assert direct == RuntimeOptions.from_dict({"onesided_timeout_s": 3, "chunk_weights": [1, 2]})
    assert direct.digest() == RuntimeOptions.from_dict({"onesided_timeout_s": 3.0, "chunk_weights": (1.0, 2.0)}).digest()


def test_post_init_errors_through_from_dict_name_the_option() -> None:
    with pytest.raises(RuntimeOptionError, match=r"^runtime option plan_mode \(MOETUNE_PLAN_MODE\) = 5: .* \(from x\)$"):
        RuntimeOptions.from_dict({"plan_mode": 5}, where="x")


# -- 6: a retired variable is an error with explicit options too ----------------------------------------------
def test_retired_variable_is_refused_when_options_are_passed() -> None:
    opts = RuntimeOptions()
    with pytest.raises(RuntimeOptionError, match="MOETUNE_HS_SLOTS is no longer read"):
        RuntimeOptions.resolve(opts, env={"MOETUNE_HS_SLOTS": "8"})
    assert RuntimeOptions.resolve(opts, env={}) is opts


@pytest.mark.parametrize("opts", [None, RuntimeOptions()])
def test_an_option_set_under_the_config_rules_name_is_refused(opts: RuntimeOptions | None) -> None:
    """MOETUNE_RUNTIME_HS_NATIVE is what the config's MOETUNE_<SECTION>_<KEY> rule names; it was ignored."""
    with pytest.raises(RuntimeOptionError, match=r"MOETUNE_RUNTIME_HS_NATIVE='0' is not read: the variable of the "
                                                 r"runtime option hs_native .* is MOETUNE_HS_NATIVE"):
        RuntimeOptions.resolve(opts, env={"MOETUNE_RUNTIME_HS_NATIVE": "0"})
    assert RuntimeOptions.resolve(None, env={"MOETUNE_RUNTIME_HS_NATIVE": ""}).hs_native is True  # empty: unset


@pytest.mark.parametrize("bad", [{"MOETUNE_TUNE_TRIALS": "many"}, {"MOETUNE_DAEMON_METRICS_PORT": "99999"},
                                 {"file": "[tune]\ntrials = 0\n"}, {"file": "[bogus]\nx = 1\n"}])
def test_a_bad_setting_the_runtime_does_not_read_does_not_stop_a_buffer(
        bad: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MOETUNE_TUNE_TRIALS=many (a tuner setting) made every EPBuffer and MoELayer raise, explicit knobs or not, while
    the profile client only names such a setting: the data path's options loaded the whole config strictly."""
    from moetune.runtime import _once

    _once.reset()
    monkeypatch.setenv("MOETUNE_AUTOLOAD", "0")
    env = dict(bad)
    if "file" in env:
        cfg = tmp_path / "moetune.toml"
        cfg.write_text(env.pop("file") + "[runtime]\nplan_mode = 2\n")
        env["MOETUNE_CONFIG"] = str(cfg)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.warns(RuntimeWarning, match="the runtime ignores settings it does not read that are wrong"):
        buf = EPBuffer(None, Knobs(), model=TINY, max_tokens=8, device="cpu")
    assert buf.options.plan_mode == (2 if "MOETUNE_CONFIG" in env else 0)  # the [runtime] table still applies
    layer = MoELayer(TINY, max_tokens=8, device="cpu", engine="unfused")
    assert layer(torch.zeros(2, TINY.hidden, dtype=layer.dtype)).shape == (2, TINY.hidden)


@pytest.mark.parametrize(("text", "match"), [("[runtime]\nsymm = 'x'\n", "runtime.symm"),
                                             ("runtime = 5\n", "expected a table"),
                                             ("[client]\ntimeout_ms = 0\n", "client.timeout_ms"),
                                             ("[client\n", "not valid TOML")])
def test_what_the_runtime_reads_is_still_refused(text: str, match: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "moetune.toml"
    cfg.write_text(text)
    monkeypatch.setenv("MOETUNE_CONFIG", str(cfg))
    with pytest.raises(ValueError, match=match):
        EPBuffer(None, Knobs(), model=TINY, max_tokens=8, device="cpu")


# -- 7: max_tokens has an upper bound ----------------------------------------------------------------------------
def test_absurd_max_tokens_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"max_tokens=10000000000000 is too large: .* over the limit of .*at most "
                                         r"max_tokens=\d+"):
        EPBuffer(None, Knobs(), model=TINY, max_tokens=10**13, device="cpu")
    assert EPBuffer(None, Knobs(), model=TINY, max_tokens=1 << 20, device="cpu").max_tokens == 1 << 20


def test_absurd_max_tokens_is_refused_before_any_profile_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without knobs the buffer asked the daemon (and the database) for a profile and warned "NO tuned profile"
    before refusing the max_tokens no knob set can hold: the user saw a fallback warning for a buffer never built."""
    asked: list[Any] = []
    monkeypatch.setattr(autoload, "autoload_group_profile", lambda **kw: asked.append(kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(ValueError, match=r"max_tokens=10000000000000 is too large: .* rows of at least 256 bytes"
                                             r".*at most max_tokens=\d+ for this model, dtype and world, fewer with"):
            EPBuffer(None, None, model=TINY, max_tokens=10**13, device="cpu")
    assert asked == []


# -- 8: KnobError.knobs survives the conversions ---------------------------------------------------------------
@pytest.mark.parametrize("build", [lambda: Knobs.from_dict({"mk_bm": 3}), lambda: Knobs.parse("mk_bm=3"),
                                   lambda: Knobs().replace(mk_bm=3)], ids=["from_dict", "parse", "replace"])
def test_knob_error_keeps_the_knob_names(build: Any) -> None:
    with pytest.raises(KnobError) as e:
        build()
    assert e.value.knobs == ("mk_bm",) and str(e.value).startswith("knob mk_bm: must be")


# -- 4: a given buffer: expected_tokens validated and defaulted, knobs compared ------------------------------------
def test_layer_on_a_buffer_checks_expected_tokens() -> None:
    buf = EPBuffer(None, Knobs(), model=TINY, max_tokens=16, device="cpu", dtype=BF, expected_tokens=4)
    assert MoELayer(TINY, max_tokens=16, buffer=buf, engine="unfused").expected_tokens == 4  # the buffer's
    assert MoELayer(TINY, max_tokens=16, buffer=buf, engine="unfused", expected_tokens=8).expected_tokens == 8
    for bad, err, match in ((-3, ValueError, "expected_tokens must be >= 1"),
                            ("16", TypeError, "expected_tokens must be an int"),
                            (17, ValueError, "expected_tokens=17 is more than max_tokens=16")):
        with pytest.raises(err, match=match):
            MoELayer(TINY, max_tokens=16, buffer=buf, engine="unfused", expected_tokens=bad)


def test_layer_on_a_buffer_refuses_other_knobs() -> None:
    buf = EPBuffer(None, Knobs(), model=TINY, max_tokens=16, device="cpu", dtype=BF)
    MoELayer(TINY, None, Knobs(), max_tokens=16, buffer=buf, engine="unfused")  # the same knobs: fine
    with pytest.raises(ValueError, match=r"buffer disagrees.*knobs channels=2 vs the buffer's 1"):
        MoELayer(TINY, None, Knobs(channels=2), max_tokens=16, buffer=buf, engine="unfused")
    # the megakernel's knobs are the layer's own (the buffer never reads them): a shared buffer takes them
    MoELayer(TINY, None, Knobs(engine="megakernel", mk_bm=64), max_tokens=16, buffer=buf)


# -- 3 and 5: the megakernel's scratch config with per token bucket profiles -------------------------------------
def _profiled_layer(monkeypatch: pytest.MonkeyPatch, profile: Knobs, refuse: Any = None) -> tuple[MoELayer, list[str]]:
    """A layer of max_tokens 4096 whose stored megakernel profile (every bucket) is `profile`; the warnings."""
    use_fake_megakernel(monkeypatch, refuse)

    def fake_resolve(**kw: Any) -> Resolution:
        knobs = profile if kw["transport_family"] == "megakernel" else Knobs()
        return Resolution(knobs=knobs, source="daemon", profile_hash=f"h:{knobs.digest()}", status="current",
                          family=kw["transport_family"] or "collective", tuned=True)

    monkeypatch.setattr(autoload, "_resolve", fake_resolve)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = MoELayer(BF16, None, None, max_tokens=4096, device="cpu", dtype=BF)
    assert layer.engine == "megakernel"
    return layer, [str(w.message) for w in caught if "is not applied" in str(w.message)]


def test_profile_with_a_one_token_combine_tile_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """mk_combine_tokens=1 is a valid knob: the scratch is sized for it, so the profile runs as reported."""
    profile = Knobs(engine="megakernel", mk_bm=64, mk_combine_tokens=1)
    layer, warned = _profiled_layer(monkeypatch, profile)
    assert warned == [] and layer.engine_knobs == profile and layer.engine_buckets == {4096: profile}
    layer(torch.randn(4096, BF16.hidden).to(BF))
    ran = layer.megakernel.launched[-1]
    assert (ran.bm, ran.combine_tokens) == (64, 1)


def test_profile_that_cannot_run_is_not_reported_as_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """The construction profile refused (and so its fallback): the layer reports the config that does run."""
    profile = Knobs(engine="megakernel", mk_bm=64, mk_stages=5)
    layer, warned = _profiled_layer(monkeypatch, profile, refuse=lambda cfg: "stages 5" if cfg.stages == 5 else None)
    runs = Knobs(engine="megakernel")  # the scratch's: tiles chosen per launch
    assert layer.engine_knobs == runs and layer.engine_buckets == {4096: runs}
    assert len(warned) == 1 and "the config the scratch buffers were sized by" in warned[0]
    layer(torch.randn(4096, BF16.hidden).to(BF))
    assert layer.megakernel.launched[-1] is layer.megakernel.launch.base


def test_decode_profile_keeps_every_scratch_launch_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode profile (bm 16, 12 stages): the scratch config picks the m-tile per launch, so its stages and CTAs
    must be auto too; 64-row tiles at 12 stages are refused by the library (at most 9)."""
    profile = Knobs(engine="megakernel", mk_bm=16, mk_stages=12, mk_ctas_per_sm=2, mk_processor_ctas=100)
    layer, warned = _profiled_layer(monkeypatch, profile)
    assert warned == [] and layer.engine_knobs == profile
    cfg = layer.megakernel.kw["config"].resolve(BF16.hidden, BF16.intermediate)
    assert (cfg.bm, cfg.stages, cfg.ctas_per_sm, cfg.processor_ctas) == (0, 0, 0, 0)
    mk = SimpleNamespace(model=BF16, max_tokens=4096, config=cfg)
    shapes = MegakernelMoE.launch_shapes(mk, cfg)  # type: ignore[arg-type]
    assert {bm for bm, _ in shapes} >= {16, 64}
    assert all(st <= 6 for bm, st in shapes if bm > 16), shapes
