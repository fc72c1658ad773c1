"""Policies: the packaged files validate, the runtime reader agrees, bad files give errors naming file and key."""

from __future__ import annotations

import re
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profiles.policy_defaults import policy_default_knobs, policy_file_candidates
from moetune.tuner.search.policy import PolicyError, load_policy, load_policy_file, packaged_families

FAMILIES = ["nvlink", "host_staged", "collective", "proxy:ibrc", "proxy:libfabric/cxi", "proxy:libfabric/efa", "ibgda"]
EXPECTED_FILES = {"nvlink", "host_staged", "collective", "proxy_ibrc", "proxy_libfabric", "ibgda", "megakernel"}


def _packaged_text(stem: str) -> str:
    return (resources.files("moetune.policies") / f"{stem}.toml").read_text()


def test_every_family_has_a_packaged_policy() -> None:
    stems = {r.name[:-5] for r in resources.files("moetune.policies").iterdir() if r.name.endswith(".toml")}
    assert stems >= EXPECTED_FILES
    assert set(packaged_families()) >= {"nvlink", "host_staged", "collective", "proxy:ibrc", "proxy:libfabric", "ibgda"}


@pytest.mark.parametrize("family", FAMILIES)
def test_packaged_policy_validates_and_runtime_reader_agrees(family: str) -> None:
    pol = load_policy(family, override=None)
    assert pol.defaults == policy_default_knobs(family)
    assert pol.transport == pol.defaults.transport
    # Naive ecosystem defaults: no compression, no pipelining; proxies drain, coupled signals.
    assert pol.defaults.compression == "none" and pol.defaults.pipeline_depth == 1
    if pol.transport == "proxy":
        assert pol.defaults.fence_mode == "proxy_drain" and pol.defaults.signalling == "coupled"
    assert 0 < pol.error_budget < 1
    assert all(v <= pol.error_budget for v in pol.expected_error.values())


def test_family_file_candidates() -> None:
    assert policy_file_candidates("proxy:libfabric/cxi") == ["proxy_libfabric_cxi", "proxy_libfabric", "proxy"]
    assert policy_file_candidates("nvlink") == ["nvlink"]
    pol = load_policy("proxy:libfabric/cxi")
    assert pol.family == "proxy:libfabric/cxi" and pol.sources == ("moetune.policies/proxy_libfabric.toml",)


def test_runtime_reader_unknown_family() -> None:
    with pytest.raises(KnobError, match="no policy file"):
        policy_default_knobs("warp_drive")


def _write_variant(tmp_path: Path, stem: str, edit) -> Path:
    data = _packaged_text(stem)
    p = tmp_path / f"{stem}.toml"
    p.write_text(edit(data))
    return p


@pytest.mark.parametrize(
    ("edit", "key", "words"),
    [
        (lambda t: t.replace('qps_per_pe = [1, 2, 4]', 'qps_per_pe = [1, 2, 100]'), "knobs.qps_per_pe", "not integers"),
        (lambda t: t.replace('fence_mode = ["proxy_drain", "nic_ordered"]', 'fence_mode = ["proxy_drain", "telepathy"]'),
         "knobs.fence_mode", "unknown value"),
        (lambda t: t + '\n[knobs.bogus_knob]\n', "knobs.bogus_knob", "unknown knob"),
        (lambda t: t.replace('qps_per_pe = [1, 2, 4]', 'qps_per_pe = [2, 4]'), "defaults.qps_per_pe", "not among the allowed"),
        (lambda t: t.replace('error_budget = 0.05', 'error_budget = 2.0'), "compression.error_budget", "[0, 1)"),
        (lambda t: t.replace('"fp8_e4m3/per_128" = 0.045', ''), 'compression.expected_error."fp8_e4m3/per_128"', "no error bound"),
        (lambda t: t.replace('signalling = "coupled"\n', 'signalling = "sometimes"\n', 1), "defaults", "signalling"),
        (lambda t: t.replace('transport = "proxy"\ndescription', 'transport = "pigeon"\ndescription'), "policy.transport", "must be one of"),
        (lambda t: t.replace('[priors]', '[priors]\nwarp_factor = 9'), "priors.warp_factor", "unknown prior"),
        (lambda t: t.replace('qp_gbps = 12.5', 'qp_gbps = -1'), "priors.qp_gbps", "positive"),
        (lambda t: t + '\n[extras]\nx = 1\n', "[extras]", "unknown table"),
        (lambda t: t.replace('qps_per_pe = [1, 2, 4]', 'qps_per_pe = { min = 1, max = 99 }'), "knobs.qps_per_pe", "min <= max"),
    ],
)
def test_bad_policy_errors_name_file_and_key(tmp_path: Path, edit, key: str, words: str) -> None:
    p = _write_variant(tmp_path, "proxy_ibrc", edit)
    with pytest.raises(PolicyError) as ei:
        load_policy_file(p)
    msg = str(ei.value)
    assert str(p) in msg, msg
    assert key in msg, msg
    assert words in msg, msg


def test_fence_mode_impossible_on_transport(tmp_path: Path) -> None:
    p = _write_variant(tmp_path, "nvlink", lambda t: t.replace('[knobs]\n', '[knobs]\nfence_mode = ["none", "proxy_drain"]\n'))
    with pytest.raises(PolicyError, match=r"knobs.fence_mode.*not possible on transport 'nvlink'"):
        load_policy_file(p)


def test_qps_on_unqueued_transport(tmp_path: Path) -> None:
    p = _write_variant(tmp_path, "host_staged", lambda t: t.replace('[knobs]\n', '[knobs]\nqps_per_pe = [1, 2]\n'))
    with pytest.raises(PolicyError, match=r"knobs.qps_per_pe.*queue pairs only exist"):
        load_policy_file(p)


def test_invalid_toml_and_missing_defaults(tmp_path: Path) -> None:
    p = tmp_path / "broken.toml"
    p.write_text("[policy\nfamily = 'x'")
    with pytest.raises(PolicyError, match=r"broken\.toml: not valid TOML"):
        load_policy_file(p)
    text = _packaged_text("collective")
    head, _, rest = text.partition("[defaults]")
    p2 = tmp_path / "nodefaults.toml"
    p2.write_text(head + rest.split("[knobs]", 1)[0].split("\n", 1)[0] + "\n[knobs]" + rest.split("[knobs]", 1)[1])
    with pytest.raises(PolicyError, match=r"nodefaults.toml: \[defaults\]: missing table"):
        load_policy_file(p2)


def test_user_override_file_merges_and_is_validated(tmp_path: Path) -> None:
    over = tmp_path / "mine.toml"
    over.write_text('[policy]\nfamily = "proxy:ibrc"\n[knobs]\nqps_per_pe = [1, 8]\n[compression]\nerror_budget = 0.01\n')
    pol = load_policy("proxy:ibrc", over)
    assert pol.knobs["qps_per_pe"].values() == (1, 8)
    assert pol.error_budget == 0.01
    assert pol.knobs["chunk_tokens"].values() == (0, 256)  # untouched keys come from the packaged file
    assert any("mine.toml" in s for s in pol.sources)
    # The override names another family: not applied here.
    assert load_policy("nvlink", over).error_budget == 0.05
    # A family-less override applies everywhere.
    glob = tmp_path / "all.toml"
    glob.write_text("[compression]\nerror_budget = 0.02\n")
    assert load_policy("nvlink", glob).error_budget == 0.02
    assert load_policy("host_staged", glob).error_budget == 0.02
    # A bad override is reported with the override's name and the key.
    bad = tmp_path / "bad.toml"
    bad.write_text('[policy]\nfamily = "proxy:ibrc"\n[knobs]\nqps_per_pe = ["many"]\n')
    with pytest.raises(PolicyError, match=r"bad.toml.*knobs.qps_per_pe"):
        load_policy("proxy:ibrc", bad)


def test_user_override_directory(tmp_path: Path) -> None:
    (tmp_path / "proxy_libfabric.toml").write_text('[defaults]\nnum_sms = 16\n')
    pol = load_policy("proxy:libfabric/cxi", tmp_path)
    assert pol.defaults.num_sms == 16
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy("nvlink", tmp_path / "nope")


def test_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    over = tmp_path / "env.toml"
    over.write_text("[compression]\nerror_budget = 0.03\n")
    monkeypatch.setenv("MOETUNE_POLICY", str(over))
    assert load_policy("collective").error_budget == 0.03


def test_defaults_are_plain_knob_sets() -> None:
    for stem in EXPECTED_FILES:
        data = tomllib.loads(_packaged_text(stem))
        assert set(data["defaults"]) == set(Knobs.__struct_fields__), stem


def test_an_override_of_no_known_family_is_refused(tmp_path: Path) -> None:
    """`[policy] family = "ibgdaa"` matches no family: refused, the valid families named, rather than an override
    applied to nothing and a tune run without a word; a prefix (proxy) and a provider's family still apply."""
    typo = tmp_path / "typo.toml"
    typo.write_text('[policy]\nfamily = "ibgdaa"\n[knobs]\nnum_sms = [1]\n')
    for fam in ("ibgda", "nvlink"):  # whichever family is loaded
        with pytest.raises(PolicyError, match=r"typo\.toml: policy\.family: 'ibgdaa' .*known: .*ibgda, .*proxy:ibrc"):
            load_policy(fam, typo)
    num = tmp_path / "num.toml"
    num.write_text("[policy]\nfamily = 3\n")
    with pytest.raises(PolicyError, match=r"num\.toml: policy\.family: must be a string"):
        load_policy("ibgda", num)
    prefix = tmp_path / "proxy.toml"
    prefix.write_text('[policy]\nfamily = "proxy"\n[compression]\nerror_budget = 0.02\n')
    assert load_policy("proxy:ibrc", prefix).error_budget == 0.02
    provider = tmp_path / "cxi.toml"
    provider.write_text('[policy]\nfamily = "proxy:libfabric/cxi"\n[compression]\nerror_budget = 0.02\n')
    assert load_policy("proxy:libfabric/cxi", provider).error_budget == 0.02
    assert load_policy("proxy:libfabric/efa", provider).error_budget == 0.05  # another provider: not applied
    # a directory: a file named for no family is refused too (not ignored)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "proxy_libfabric_cxi.toml").write_text("[compression]\nerror_budget = 0.02\n")
    assert load_policy("proxy:libfabric/cxi", d).error_budget == 0.02
    (d / "ibgdaa.toml").write_text("[knobs]\nnum_sms = [1]\n")
    with pytest.raises(PolicyError, match=r"ibgdaa\.toml: the file name names no transport family"):
        load_policy("ibgda", d)


def test_an_override_that_is_not_utf8_or_unreadable_names_the_file(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Latin-1 override raised UnicodeDecodeError (a traceback from `tune --policy`, a message naming no file
    from $MOETUNE_POLICY); an unreadable one an OSError. Both are a PolicyError naming the file."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[policy]\nfamily = "ibgda"\n# caf\xe9\n')
    with pytest.raises(PolicyError, match=r"latin1\.toml: not UTF-8 text \(byte 0xe9 at offset 31\)"):
        load_policy("ibgda", bad)
    with pytest.raises(PolicyError, match=r"latin1\.toml: not UTF-8 text"):
        load_policy_file(bad)
    monkeypatch.setenv("MOETUNE_POLICY", str(bad))
    with pytest.raises(PolicyError, match=r"latin1\.toml: not UTF-8 text"):
        load_policy("ibgda")
    d = tmp_path / "dir"
    d.mkdir()
    (d / "ibgda.toml").write_bytes(b"# \xff\n")
    with pytest.raises(PolicyError, match=r"dir/ibgda\.toml: not UTF-8 text"):
        load_policy("ibgda", d)
    monkeypatch.delenv("MOETUNE_POLICY")
    unreadable = tmp_path / "unreadable.toml"
    unreadable.write_text("[compression]\nerror_budget = 0.02\n")
    monkeypatch.setattr(Path, "read_bytes", lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(PolicyError, match=r"unreadable\.toml: cannot be read \(Permission denied\)"):
        load_policy("ibgda", unreadable)


@pytest.mark.parametrize(("edit", "words"), [
    ("mk_stages = [0, 2, 3, 4, 6, 8]", "[8] with mk_bm 128"),
    # 9 stages of bm=64 fit the mma core, not the wgmma core's overlap kernel, which the policy also lists
    ("mk_stages = [0, 9]", "[9] with mk_bm 64, mk_core wgmma, mk_overlap 1: that tile holds at most 8 stages")])
def test_a_megakernel_policy_whose_stages_outgrow_a_listed_tile_is_refused(tmp_path: Path, edit: str, words: str) -> None:
    """mk_stages = [.., 8] beside mk_bm = [.., 128] loaded, and a study that sampled (128, 8) stopped on the knob check's
    refusal (mk_bm=128 holds at most 6 stages) instead of going on with its next trial."""
    p = _write_variant(tmp_path, "megakernel", lambda t: t.replace("mk_stages = [0, 2, 3, 4, 6]", edit))
    with pytest.raises(PolicyError, match=re.escape(words)) as ei:
        load_policy_file(p)
    assert "knobs.mk_stages" in str(ei.value)
    load_policy_file(_write_variant(tmp_path, "megakernel", lambda t: t))  # the packaged lists pass
