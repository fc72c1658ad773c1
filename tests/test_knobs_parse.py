"""Knobs.parse: the text form of the knobs (`--knobs`, bench cases, self-test specs) refuses what it cannot read,
naming the knob and the value, instead of an AttributeError or a value silently read as another one."""

from __future__ import annotations

import pytest

from moetune.runtime.knobs import KnobError, Knobs, default_knobs


@pytest.mark.parametrize("text", [None, 3, b"num_sms=4", ["num_sms=4"]])
def test_parse_refuses_what_is_not_text(text: object) -> None:
    with pytest.raises(KnobError, match=f"string of name=value pairs, got {type(text).__name__}"):
        Knobs.parse(text)  # type: ignore[arg-type]


def test_parse_refuses_a_base_that_is_not_knobs() -> None:
    # {} must not be read as "no base" (falsy), nor a non-empty mapping raise AttributeError
    for base in ({}, {"transport": "nvlink"}, "transport=nvlink"):
        with pytest.raises(KnobError, match="base must be a Knobs"):
            Knobs.parse("num_sms=4", base=base)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["1_0", "1_6", "٣", "0x10", "1e1", "2.0", "", "ten", "--4"])
def test_an_integer_knob_takes_digits_only(value: str) -> None:
    # int() reads "1_0" as 10 and Arabic-Indic digits as numbers: a typo must not become another setting
    with pytest.raises(KnobError, match="expected an integer") as e:
        Knobs.parse(f"num_sms={value}")
    assert e.value.knobs == ("num_sms",) and repr(value) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_integers_and_choices_still_parse() -> None:
    k = Knobs.parse(" num_sms = 16 , channels=+2,pipeline_depth=02,compression=fp8_e4m3", base=default_knobs("nvlink"))
    assert (k.num_sms, k.channels, k.pipeline_depth, k.compression, k.transport) == (16, 2, 2, "fp8_e4m3", "nvlink")
    assert Knobs.parse("") == Knobs()
    with pytest.raises(KnobError, match=r"must be in 1\.\.264, got -3"):  # a sign is read, the range check refuses it
        Knobs.parse("num_sms=-3")


def test_a_choice_knob_names_itself_and_the_value() -> None:
    with pytest.raises(KnobError, match=r"must be one of nvlink, .*got 'NVLink'") as e:
        Knobs.parse("transport=NVLink")
    assert e.value.knobs == ("transport",)


def test_every_knob_has_a_text_form() -> None:
    # parse types each value by the knob's kind: every field is an int or a choice of strings
    from moetune.runtime import knobs as K

    assert set(K._INTS) | set(K._CHOICES) == set(Knobs.__struct_fields__)
    d = Knobs().to_dict()
    assert Knobs.parse(",".join(f"{n}={v}" for n, v in d.items())) == Knobs()


def test_megakernel_config_text_refuses_what_int_would_stretch() -> None:
    """MegakernelConfig.parse types its integers as Knobs.parse does: "1_6" is not 16."""
    from moetune.runtime.megakernel.config import ConfigError, MegakernelConfig

    assert MegakernelConfig.parse("bm=16, stages=3").bm == 16
    for bad in ("bm=1_6", "bm= 16x", "stages=٣"):
        with pytest.raises(ConfigError, match="must be int"):
            MegakernelConfig.parse(bad)


def test_a_knob_given_twice_is_refused() -> None:
    """`channels=2,channels=3` silently took 3: which one was meant cannot be told."""
    with pytest.raises(KnobError, match=r"knob channels: given twice in 'channels=2,channels=3'") as e:
        Knobs.parse("channels=2,channels=3")
    assert e.value.knobs == ("channels",)
