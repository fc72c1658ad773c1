"""One knob table (runtime/knobs.py KNOB_VALUES): the knob checks, the settings doc's values column and the tuner's
policy limits all come from it, so none can drift from the others."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from moetune.runtime import knobs as K
from moetune.runtime.knobs import KNOB_DOCS, KNOB_VALUES, KnobError, Knobs
from moetune.tuner.search import policy as P


def test_the_table_covers_every_knob_and_its_literal() -> None:
    assert list(KNOB_VALUES) == list(Knobs.__struct_fields__)
    for name, tp in typing.get_type_hints(Knobs).items():
        if typing.get_origin(tp) is typing.Literal:
            assert KNOB_VALUES[name].choices == typing.get_args(tp), name
    assert K.SCALE_GRANULARITIES == ("per_token", "per_128")


@pytest.mark.parametrize("name", [n for n, v in KNOB_VALUES.items() if v.is_int])
def test_validate_takes_exactly_the_table(name: str) -> None:
    """At and just past each limit: what the table allows constructs, what it refuses is a KnobError naming the
    knob and saying what it must be."""
    values = KNOB_VALUES[name]
    lo, hi = values.limits
    # a base where the knob may differ from its default (queue pairs: proxy; staging slots: host_staged)
    base = {"qps_per_pe": K.default_knobs("proxy"), "staging_slots": K.default_knobs("host_staged")}.get(
        name, Knobs(engine="megakernel") if name in K.MK_KNOBS else Knobs())
    for v in sorted({lo - 1, lo, lo + 1, hi - 1, hi, hi + 1}):
        if values.allows(v):
            try:
                base.replace(**{name: v})
            except KnobError as e:  # only a combination rule (naming other knobs too) may refuse it
                assert len(e.knobs) > 1, (v, e)
        else:
            with pytest.raises(KnobError, match=re.escape(f"must be {values.requirement()}, got {v}")) as e:
                base.replace(**{name: v})
            assert e.value.knobs == (name,)


def test_docs_values_come_from_the_table() -> None:
    for name, (values, _meaning) in KNOB_DOCS.items():
        assert values == KNOB_VALUES[name].doc()
    assert KNOB_DOCS["group_size"][0] == f"int 0..{K.MAX_GROUP_SIZE}"
    assert KNOB_DOCS["mk_stages"][0] == f"`0` or int 2..{K.MK_MAX_STAGES}"
    assert str(K.MAX_SLOTS) in KNOB_DOCS["chunk_tokens"][1]
    assert f"at most {K.MAX_COMM_CHANNELS} used" in KNOB_DOCS["channels"][1]


def test_policy_limits_are_the_tables() -> None:
    assert set(P.INTEGER) | set(P.CATEGORICAL) | {"transport"} == set(KNOB_VALUES)
    assert P.INTEGER["mk_stages"] == (0, K.MK_MAX_STAGES)
    assert P.CATEGORICAL["scale_granularity"] == K.SCALE_GRANULARITIES
    for fam in P.packaged_families():  # every packaged search space lies inside the table
        pol = P.load_policy(fam)
        for name, spec in pol.knobs.items():
            assert all(KNOB_VALUES[name].allows(v) for v in spec.values()), (fam, name)


def _policy_with(tmp_path: Path, line: str) -> Path:
    """The packaged megakernel policy with its [knobs] line for the same knob replaced by `line`."""
    from importlib import resources

    text = (resources.files("moetune.policies") / "megakernel.toml").read_text(encoding="utf-8")
    head, knobs = text.split("[knobs]\n", 1)
    name = line.split("=", 1)[0].strip()
    knobs = "\n".join(line if ln.split("=", 1)[0].strip() == name else ln for ln in knobs.splitlines())
    p = tmp_path / "megakernel.toml"
    p.write_text(f"{head}[knobs]\n{knobs}\n")
    return p


def test_a_policy_range_over_a_gap_in_the_table_is_refused(tmp_path: Path) -> None:
    """mk_stages takes 0 or 2..12: a policy range 0..6 would offer 1, which no Knobs takes."""
    with pytest.raises(P.PolicyError, match=r"knobs\.mk_stages: the range takes 1, which the knob refuses"):
        P.load_policy_file(_policy_with(tmp_path, "mk_stages = { min = 0, max = 6 }"))
    with pytest.raises(P.PolicyError, match=r"knobs\.mk_bm: value\(s\) \[32\] are not integers the knob takes"):
        P.load_policy_file(_policy_with(tmp_path, "mk_bm = [0, 32]"))


def test_range_refusals_are_cheap_and_exact() -> None:
    assert KNOB_VALUES["mk_stages"].refused_in(0, 12) == [1]
    assert KNOB_VALUES["mk_stages"].refused_in(0, 12, 2) == []
    assert KNOB_VALUES["group_size"].refused_in(0, K.MAX_GROUP_SIZE) == []
    assert KNOB_VALUES["qps_per_pe"].refused_in(0, 99) == [0, 65]
    assert KNOB_VALUES["mk_bm"].refused_in(0, 128, 64) == []
    assert KNOB_VALUES["mk_bm"].refused_in(0, 128, 32) == [32, 96]
