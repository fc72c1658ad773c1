"""Fabric presets: shipped as package data, every parameter with a source, round-trip through TOML."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.runtime.knobs import TRANSPORTS
from moetune.tuner.fabric_model.presets import PresetError, list_presets, load_preset

EXPECTED = {
    "slingshot11-libfabric-a100x4": "proxy:libfabric/cxi",
    "ndr-ibrc-h100x8": "proxy:ibrc",
    "ndr-ibgda-h100x8": "ibgda",
    "pcie4-consumer-4090x4": "host_staged",
    "nvlink-h200x2": "nvlink",
}


def test_all_presets_ship() -> None:
    assert set(EXPECTED) <= set(list_presets())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_has_family_transports_and_sources(name: str) -> None:
    p = load_preset(name)
    assert p.family == EXPECTED[name]
    assert p.transports and set(p.transports) <= set(TRANSPORTS)
    numeric = p.numeric()
    assert numeric
    for key in numeric:
        assert p.sources.get(key, "").strip(), f"{name}: {key} has no source"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_round_trips(name: str, tmp_path: Path) -> None:
    p = load_preset(name)
    f = tmp_path / f"{name}.toml"
    f.write_text(p.to_toml())
    q = load_preset(str(f))
    assert q.numeric() == pytest.approx(p.numeric(), rel=1e-5)
    assert (q.family, q.transports, q.gpus_per_node) == (p.family, p.transports, p.gpus_per_node)


def test_parameters_are_physically_plausible() -> None:
    assert load_preset("slingshot11-libfabric-a100x4").get("nic.gbps") <= 25.0  # 200 Gb/s
    assert load_preset("ndr-ibrc-h100x8").get("nic.gbps") <= 50.0  # 400 Gb/s
    for name in EXPECTED:
        p = load_preset(name)
        assert p.get("pcie.d2h_gbps") <= 63.0 and p.get("pcie.h2d_gbps") <= 63.0
        if p.has("nic") and name != "nvlink-h200x2":
            assert 1.0 <= p.get("nic.rtt_us") <= 20.0
        if p.has("proxy"):
            assert 0.05 <= p.get("proxy.put_us") <= 5.0


def test_missing_source_is_refused(tmp_path: Path) -> None:
    text = load_preset("ndr-ibrc-h100x8").to_toml()
    lines = [ln for ln in text.splitlines() if not ln.startswith('"nic.rtt_us"')]
    f = tmp_path / "bad.toml"
    f.write_text("\n".join(lines))
    with pytest.raises(PresetError, match=r"nic\.rtt_us has no entry in \[sources\]"):
        load_preset(str(f))


def test_bad_presets_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="unknown preset"):
        load_preset("nope")
    with pytest.raises(PresetError, match="does not exist"):
        load_preset(str(tmp_path / "missing.toml"))
    f = tmp_path / "broken.toml"
    f.write_text("name = [")
    with pytest.raises(PresetError, match="not valid TOML"):
        load_preset(str(f))


def test_nvlink_h200x2_is_calibrated() -> None:
    p = load_preset("nvlink-h200x2")
    assert p.calibration["points"] > 0
    assert p.sources["collective.alpha_us"].startswith("calibrated:")


@pytest.mark.parametrize(("edit", "named"), [
    # a misspelled section: its numbers were dropped and the preset predicted with no NVLink at all (3.7x slower)
    (lambda t: t.replace("[nvlink]", "[nvlnk]"), r"\[nvlnk\]"),
    # a misspelled top-level key: max_nodes stayed 0 (no limit) and a one-box preset predicted 4 nodes
    (lambda t: t.replace("max_nodes = 1", "max_node = 1"), "max_node"),
    # a misspelled parameter (with its source): read by nothing, the model kept the parameter's absence unnoticed
    (lambda t: t.replace("[nvlink]\n", '[nvlink]\nlatncy_us = 9.0\n').replace(
        "[sources]\n", '[sources]\n"nvlink.latncy_us" = "x"\n'), r"nvlink\.latncy_us"),
])
def test_unknown_keys_and_sections_are_refused(tmp_path: Path, edit, named: str) -> None:
    """A key or section the model never reads is refused naming it, not silently dropped from the prediction."""
    text = load_preset("nvlink-h200x2").to_toml()
    f = tmp_path / "typo.toml"
    f.write_text(edit(text))
    assert f.read_text() != text
    with pytest.raises(PresetError, match=named):
        load_preset(str(f))


def test_queued_transport_without_nic_is_refused_even_when_the_proxy_serves_the_node(tmp_path: Path) -> None:
    """The queue model (proxy, ibgda) reads the [nic] section for every request, a proxy serving this node's peers
    included (nvlink-h200x2's copy-engine streams are its QPs): without it such a preset loaded, and
    `model predict -k transport=proxy` failed with AttributeError: 'Params' object has no attribute 'rtt'."""
    text = load_preset("nvlink-h200x2").to_toml()
    assert "serves_intra_node = true" in text
    kept, skip = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skip = line == "[nic]"
        if not skip and not line.startswith('"nic.'):
            kept.append(line)
    f = tmp_path / "no-nic.toml"
    f.write_text("\n".join(kept) + "\n")
    with pytest.raises(PresetError, match=r"proxy/ibgda transports need a \[nic\] section"):
        load_preset(str(f))


@pytest.mark.parametrize("key", ["gemm_efficiency", "nic_efficiency"])
def test_an_efficiency_above_one_is_refused(tmp_path: Path, key: str) -> None:
    """An efficiency is a fraction of a rate: `gemm_efficiency = 45` (a percentage) made the expert GEMMs 100x faster
    than the GPU's peak, `nic_efficiency = 8` the collective's NIC 8x its line rate, without a word."""
    text = load_preset("nvlink-h200x2").to_toml()
    bad = text.replace(f"{key} = 0.45", f"{key} = 45").replace(f"{key} = 0.8", f"{key} = 8")
    assert bad != text
    f = tmp_path / "pct.toml"
    f.write_text(bad)
    with pytest.raises(PresetError, match=rf"{key} must be a fraction.*at most 1"):
        load_preset(str(f))


def test_a_fit_keeps_an_efficiency_at_most_one() -> None:
    """The fit's ceiling for an efficiency is 1, so a calibrated preset stays one the loader takes."""
    from moetune.tuner.fabric_model.calibration import PHYSICAL_MAX

    assert PHYSICAL_MAX["gpu.gemm_efficiency"] == PHYSICAL_MAX["collective.nic_efficiency"] == 1.0


@pytest.mark.parametrize(("edit", "field", "allowed"), [
    # a typo: loaded without a word, and what reads the family later (tune, model calibrate) named no file
    (lambda t: t.replace('family = "nvlink"', 'family = "nvlnk"'), "family", "collective"),
    (lambda t: t.replace('family = "nvlink"', 'family = "megakernel"'), "family", "host_staged"),  # an engine, no fabric
    (lambda t: t.replace('family = "nvlink"', 'family = "proxy:libfabric/CXI!"'), "family", "proxy:libfabric/PROVIDER"),
    # a family whose transport the preset does not list: every prediction for it was refused at predict time
    (lambda t: t.replace('family = "nvlink"', 'family = "ibgda"'), "transports", "nvlink, collective, host_staged, proxy"),
])
def test_a_family_that_is_unknown_or_not_in_transports_is_refused(tmp_path: Path, edit, field: str, allowed: str) -> None:
    text = load_preset("nvlink-h200x2").to_toml()
    f = tmp_path / "fam.toml"
    f.write_text(edit(text))
    assert f.read_text() != text
    with pytest.raises(PresetError) as e:
        load_preset(str(f))
    msg = str(e.value)
    assert str(f) in msg and f"{field} " in msg and allowed in msg, msg


def test_a_family_without_its_transports_section_is_refused(tmp_path: Path) -> None:
    """A proxy family needs [proxy] (the CPU proxy's costs), an ibgda family [ibgda], an nvlink family [nvlink]."""
    text = load_preset("ndr-ibrc-h100x8").to_toml()
    kept, skip = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skip = line == "[proxy]"
        if not skip and not line.startswith('"proxy.'):
            kept.append(line)
    f = tmp_path / "no-proxy.toml"
    f.write_text("\n".join(kept) + "\n")
    with pytest.raises(PresetError) as e:
        load_preset(str(f))
    msg = str(e.value)
    assert str(f) in msg and "family 'proxy:ibrc'" in msg and "[proxy]" in msg, msg


@pytest.mark.parametrize("family", ["collective", "host_staged", "proxy:ucx", "proxy:libfabric/efa"])
def test_every_transport_family_fits_a_preset_that_has_its_transport(tmp_path: Path, family: str) -> None:
    text = load_preset("nvlink-h200x2").to_toml().replace('family = "nvlink"', f'family = "{family}"')
    f = tmp_path / "ok.toml"
    f.write_text(text)
    assert load_preset(str(f)).family == family
