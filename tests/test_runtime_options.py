"""RuntimeOptions: typed, validated, parsed once from arguments > variables > the config's [runtime] section."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetune.runtime.config import ConfigError, load_config
from moetune.runtime.options import OPTION_DOCS, RuntimeOptionError, RuntimeOptions


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment with no system/user config of its own."""
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}


def test_every_option_has_one_doc_row_and_a_config_key() -> None:
    fields = RuntimeOptions.__struct_fields__
    assert [d.name for d in OPTION_DOCS] == list(fields)
    assert len({d.env for d in OPTION_DOCS}) == len(fields)
    # the config's [runtime] keys are the options themselves (no mirror of them to keep in step)
    from moetune.runtime.options import CONFIG_TYPES

    assert list(CONFIG_TYPES) == list(fields)
    assert RuntimeOptions.from_config(load_config(env={"HOME": "/nonexistent"})) == RuntimeOptions()


def test_variables_parse_and_bad_values_name_the_setting() -> None:
    o = RuntimeOptions.from_env({"MOETUNE_HS_NATIVE": "0", "MOETUNE_SYMM": "IPC", "MOETUNE_ONESIDED_TIMEOUT_S": "3",
                                 "MOETUNE_PROXY_BATCH": "16", "MOETUNE_EP_CHUNK_WEIGHTS": "1,2", "MOETUNE_PLAN_MODE": ""})
    assert (o.hs_native, o.symm, o.onesided_timeout_s, o.proxy_batch, o.chunk_weights, o.plan_mode) == (
        False, "ipc", 3.0, 16, (1.0, 2.0), 0)
    for var, bad, option in (("MOETUNE_HS_NATIVE", "maybe", "hs_native"), ("MOETUNE_SYMM", "nvshmem", "symm"),
                             ("MOETUNE_ONESIDED_TIMEOUT_S", "-1", "onesided_timeout_s"),
                             # "never time out" meant as a huge number: 0 ns in the C side's 64-bit nanoseconds
                             ("MOETUNE_ONESIDED_TIMEOUT_S", "100000000000", "onesided_timeout_s"),
                             ("MOETUNE_PROXY_BATCH", "0", "proxy_batch"), ("MOETUNE_PLAN_MODE", "7", "plan_mode"),
                             ("MOETUNE_PROXY_BATCH", "lots", "proxy_batch"),
                             ("MOETUNE_PROXY_BATCH", "1_6", "proxy_batch")):  # int() would read 16
        with pytest.raises(RuntimeOptionError) as e:
            RuntimeOptions.from_env({var: bad})
        assert option in str(e.value) and var in str(e.value) and bad in str(e.value), str(e.value)
    with pytest.raises(RuntimeOptionError, match="unknown runtime option"):
        RuntimeOptions.from_dict({"hs_natve": False})
    with pytest.raises(RuntimeOptionError, match="plan_mode"):
        RuntimeOptions(plan_mode=3)


def test_order_arguments_over_variables_over_config(env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "moetune.toml"
    cfg.write_text('[runtime]\nsymm = "ipc"\nonesided_timeout_s = 5\nproxy_batch = 4\nchunk_weights = "1,3"\n')
    e = {**env, "MOETUNE_CONFIG": str(cfg)}
    o = RuntimeOptions.resolve(env=e)
    assert (o.symm, o.onesided_timeout_s, o.proxy_batch, o.chunk_weights) == ("ipc", 5.0, 4, (1.0, 3.0))
    o = RuntimeOptions.resolve(env={**e, "MOETUNE_PROXY_BATCH": "8"})
    assert (o.symm, o.proxy_batch) == ("ipc", 8)
    o = RuntimeOptions.resolve({"proxy_batch": 2}, env={**e, "MOETUNE_PROXY_BATCH": "8"})
    assert o.proxy_batch == 2
    given = RuntimeOptions(fused_fp8=False)
    assert RuntimeOptions.resolve(given, env=e) is given


def test_a_bad_config_value_names_the_key_and_the_file(env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "moetune.toml"
    # checked against RuntimeOptions when the options are resolved; the error is a ConfigError (as any other
    # section's) and a RuntimeOptionError, and says the key, the file and what is wrong
    for text, words in (('symm = "nvshmem"', "runtime.symm in {cfg}: 'nvshmem': expected one of torch, ipc"),
                        ('proxy_batch = "four"', "runtime.proxy_batch in {cfg}: expected an integer, got str 'four'"),
                        ("no_such_switch = 1", "unknown key runtime.no_such_switch in {cfg} (known: hs_native,"),
                        ('chunk_weights = "1,-2"', "runtime.chunk_weights in {cfg}: '1,-2': expected positive numbers"),
                        ('chunk_weights = "1,x"', "runtime.chunk_weights in {cfg}: '1,x': expected comma-separated"),
                        ("plan_mode = 7", "runtime.plan_mode in {cfg}: 7: expected an integer from 0 to 2")):
        cfg.write_text(f"[runtime]\n{text}\n")
        with pytest.raises(ConfigError) as e:
            RuntimeOptions.resolve(env={**env, "MOETUNE_CONFIG": str(cfg)})
        assert isinstance(e.value, RuntimeOptionError) and str(e.value).startswith(words.format(cfg=cfg)), str(e.value)
        load_config(env={**env, "MOETUNE_CONFIG": str(cfg)})  # the table as given: read by the options alone


def test_nothing_is_read_at_import_time() -> None:
    import importlib

    import moetune.runtime.buffer._resident as resident
    import moetune.runtime.buffer.facade as facade

    for mod in (facade, resident):
        importlib.reload(mod)
        assert not hasattr(mod, "_PLAN_MODE")


def test_the_buffer_takes_its_options_from_the_config(env: dict[str, str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.buffer import EPBuffer
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.moe_layer import MoELayer
    from moetune.runtime.shapes import get_model

    for k in list(__import__("os").environ):
        if k.startswith("MOETUNE_"):
            monkeypatch.delenv(k)
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[runtime]\nfused_fp8 = false\nonesided_timeout_s = 7.5\n")
    monkeypatch.setenv("MOETUNE_CONFIG", str(cfg))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    m = get_model("custom:64,32,8,2,float32")
    buf = EPBuffer(None, Knobs(), model=m, max_tokens=8, device="cpu")
    assert (buf.options.fused_fp8, buf.options.onesided_timeout_s) == (False, 7.5)
    assert buf.transport.options is buf.options  # the transport gets the buffer's options, not the environment
    layer = MoELayer(m, knobs=Knobs(), max_tokens=8, device="cpu")
    assert layer.buffer.options.onesided_timeout_s == 7.5
    monkeypatch.setenv("MOETUNE_ONESIDED_TIMEOUT_S", "9")
    assert EPBuffer(None, Knobs(), model=m, max_tokens=8, device="cpu").options.onesided_timeout_s == 9.0
    explicit = EPBuffer(None, Knobs(), model=m, max_tokens=8, device="cpu", options={"onesided_timeout_s": 1.0})
    assert explicit.options.onesided_timeout_s == 1.0 and explicit.options.fused_fp8 is False
    x = torch.randn(4, m.hidden)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    recv, _meta, h = explicit.dispatch(x, idx, torch.ones(4, 2))
    assert torch.allclose(explicit.combine(recv.contiguous(), h), x)


def test_ranks_compare_the_options_digest() -> None:
    a, b = RuntimeOptions(), RuntimeOptions(symm="ipc")
    assert a.digest() == RuntimeOptions().digest() and a.digest() != b.digest()


def test_a_bool_variable_is_read_by_config_parse_bool_and_named_when_bad() -> None:
    """A bool option's variable takes config.parse_bool's words (one reading of a bool variable); a bad one is a
    RuntimeOptionError naming the option and its variable."""
    from moetune.runtime.options import OPTION_DOCS, RuntimeOptionError, RuntimeOptions

    doc = next(d for d in OPTION_DOCS if RuntimeOptions.__annotations__[d.name] == "bool")
    assert getattr(RuntimeOptions.from_env({doc.env: " On "}), doc.name) is True
    assert getattr(RuntimeOptions.from_env({doc.env: "no"}), doc.name) is False
    with pytest.raises(RuntimeOptionError, match=f"{doc.name} \\({doc.env}='maybe'\\).*expected true or false"):
        RuntimeOptions.from_env({doc.env: "maybe"})


def test_proxy_batch_is_refused_past_what_the_proxy_engine_takes() -> None:
    """The proxy engine takes a batch of 1..4096 (csrc/proxy_engine.cpp mt_proxy_set_batch); past it the value passed
    validation and failed later, at the EP buffer's construction, or (past 2**31) was cut by ctypes' c_int into
    another number the engine took silently (2**32 + 1 became 1)."""
    MAX_PROXY_BATCH = 4096
    assert RuntimeOptions(proxy_batch=MAX_PROXY_BATCH).proxy_batch == MAX_PROXY_BATCH
    for bad in (MAX_PROXY_BATCH + 1, (1 << 32) + 1):
        with pytest.raises(RuntimeOptionError, match=r"proxy_batch.*4096"):
            RuntimeOptions(proxy_batch=bad)
        with pytest.raises(RuntimeOptionError, match="MOETUNE_PROXY_BATCH"):
            RuntimeOptions.from_env({"MOETUNE_PROXY_BATCH": str(bad)})
    # the settings doc says the same range
    assert next(d for d in OPTION_DOCS if d.name == "proxy_batch").type == "int 1..4096"


def test_the_documented_timeout_ranges_are_the_checked_ones() -> None:
    """docs/settings.md's type column is written by hand (OPTION_DOCS): megakernel_timeout_s said "float > 0" while
    the option takes 1e-06..3600 only (MegakernelConfig.timeout_ms' range), so a documented value such as 7200 was
    refused."""
    from moetune.runtime.options import MK_TIMEOUT_MAX_S, MK_TIMEOUT_MIN_S, ONESIDED_TIMEOUT_MAX_S

    docs = {d.name: d.type for d in OPTION_DOCS}
    assert docs["megakernel_timeout_s"] == f"float in [{MK_TIMEOUT_MIN_S:g}, {MK_TIMEOUT_MAX_S:g}]"
    assert docs["onesided_timeout_s"] == f"float in (0, {ONESIDED_TIMEOUT_MAX_S:g}]"
    for name, low, high in (("megakernel_timeout_s", MK_TIMEOUT_MIN_S, MK_TIMEOUT_MAX_S),
                            ("onesided_timeout_s", 1e-9, ONESIDED_TIMEOUT_MAX_S)):
        RuntimeOptions(**{name: low})
        RuntimeOptions(**{name: high})
        with pytest.raises(RuntimeOptionError, match=name):
            RuntimeOptions(**{name: high * 1.5})


def test_a_chunk_weight_past_what_a_float_holds_is_refused_naming_the_option() -> None:
    """RuntimeOptions(chunk_weights=(10**400,)) raised a bare OverflowError ("int too large to convert to float") out
    of the range check, where every other bad value is a RuntimeOptionError naming the option."""
    for weights in ((10**400,), (1, -(10**400))):
        with pytest.raises(RuntimeOptionError, match="chunk_weights"):
            RuntimeOptions(chunk_weights=weights)
        with pytest.raises(RuntimeOptionError, match="chunk_weights"):
            RuntimeOptions.from_dict({"chunk_weights": weights})
    assert RuntimeOptions(chunk_weights=(1, 10**300)).chunk_weights == (1.0, 1e300)  # an int a float holds is taken


def test_a_number_in_a_variable_is_ascii_without_digit_separators() -> None:
    """int_of_text keeps "1_0" from being read as 10 by every integer parser; the float parsers used float(), which
    also reads "1_0" as 10.0 and Arabic-Indic digits as a number: MOETUNE_ONESIDED_TIMEOUT_S=2_0 was 20 seconds."""
    for var, bad, option in (("MOETUNE_ONESIDED_TIMEOUT_S", "2_0", "onesided_timeout_s"),
                             ("MOETUNE_MK_TIMEOUT_S", "\u0661", "megakernel_timeout_s"),
                             ("MOETUNE_EP_CHUNK_WEIGHTS", "1_0,2", "chunk_weights")):
        with pytest.raises(RuntimeOptionError) as e:
            RuntimeOptions.from_env({var: bad})
        assert option in str(e.value) and var in str(e.value), str(e.value)
    o = RuntimeOptions.from_env({"MOETUNE_ONESIDED_TIMEOUT_S": " 2.5e1 ", "MOETUNE_EP_CHUNK_WEIGHTS": "1, .5,2E0"})
    assert (o.onesided_timeout_s, o.chunk_weights) == (25.0, (1.0, 0.5, 2.0))
