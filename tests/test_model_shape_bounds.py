"""A custom model shape's dimensions are held to what a profile key can carry: at most 2**31 (wire.POS_INT_MAX, the
most a daemon's get_profile takes). `custom:99999999999999999999999,1,1,1` was taken as a shape: `moetune query`
then ended in a traceback (OverflowError: Python int too large to convert to SQLite INTEGER) from the runtime's
database fallback, `ProfileClient.resolve` raised it to its caller, and `moetune tune` crashed the same way when it
stored its study run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.shapes import MAX_DIMENSION, ModelShape, get_model

HUGE = "custom:99999999999999999999999,1,1,1"


def test_the_bound_is_what_a_daemon_takes() -> None:
    assert MAX_DIMENSION == wire.POS_INT_MAX
    get_model(f"custom:{MAX_DIMENSION},8,8,2")  # the largest a request carries is still a shape


@pytest.mark.parametrize("spec", [HUGE, f"custom:8,{MAX_DIMENSION + 1},8,2", f"custom:8,8,{1 << 70},2"])
def test_a_dimension_past_the_bound_is_a_value_error(spec: str) -> None:
    with pytest.raises(ValueError, match="at most 2147483648"):
        get_model(spec)
    with pytest.raises(ValueError, match="at most"):
        ModelShape(name="x", hidden=1 << 40, intermediate=8, experts=8, topk=2)


def test_query_of_a_huge_custom_shape_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    from moetune.tuner.cli import app
    from moetune.tuner.store.store import Store

    db = tmp_path / "m.db"
    with Store(db) as s:  # this node's identity is known: the fallback reads the profiles table with the shape
        s.upsert_fingerprint("fp", F.this_node_facts(), origin="local")
    r = CliRunner().invoke(app, ["query", "--model", HUGE, "--ep", "1", "--tokens", "1", "--db", str(db),
                                 "--socket", f"ipc://{tmp_path}/none.sock"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and not isinstance(r.exception, OverflowError)
    assert "at most 2147483648" in r.output


def test_client_resolve_never_meets_an_unstorable_shape(tmp_path: Path) -> None:
    """The shape resolve gets is a ModelShape: one past the bound cannot be made, so the database read that raised
    OverflowError out of resolve is never reached."""
    with pytest.raises(ValueError):
        ModelShape(name=HUGE, hidden=99999999999999999999999, intermediate=1, experts=1, topk=1)


@pytest.mark.parametrize("field", ["1_28", "\uff11\uff12\uff18", "128.0", "0x80"])
def test_a_custom_dimension_is_ascii_digits(field: str) -> None:
    """`custom:1_28,64,4,2` was taken as hidden 128 (and full-width digits too): int() reads underscores and any
    Unicode digits, which every other runtime parser of typed text refuses (knobs.int_of_text). The same shape then
    went by another name (`ModelShape.name` is the spec) than the one it is usually written as."""
    with pytest.raises(ValueError, match="must be integers"):
        get_model(f"custom:{field},64,4,2")
    # blanks around a field and a sign were taken before and still are (a sign of - is refused as <= 0)
    assert get_model("custom: 128,+64,4 ,2").hidden == 128


@pytest.mark.parametrize(("spec", "name"), [("custom: 128,+64,4 ,2", "custom:128,64,4,2"),
                                            ("custom:128, 64, 4, 2, float32", "custom:128,64,4,2,float32")])
def test_a_custom_shape_has_one_name_however_it_is_spelt(spec: str, name: str) -> None:
    """The blanks and signs get_model takes stayed in `ModelShape.name`, and a ModelShape compares by its name too:
    the same shape spelt two ways was two models (a MoELayer refused an EPBuffer of its own shape)."""
    import torch

    from moetune.runtime.buffer.facade import EPBuffer
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.moe_layer import MoELayer

    model = get_model(spec)
    assert model.name == name and model == get_model(name)
    buf = EPBuffer(None, Knobs(), model=model, max_tokens=4, device="cpu")
    layer = MoELayer(get_model(name), max_tokens=4, buffer=buf, engine="unfused")
    assert layer(torch.zeros(2, 128, dtype=layer.dtype)).shape == (2, 128)


@pytest.mark.parametrize("dtype", [["bfloat16"], {"bfloat16": 2}, None, 2])
def test_a_dtype_that_is_no_str_is_refused_naming_the_field(dtype: object) -> None:
    """ModelShape(dtype=[...]) raised "unhashable type: 'list'" from the DTYPES lookup, naming neither the field nor
    the shape; every other field's wrong type is named."""
    with pytest.raises(TypeError, match="model shape 'x': dtype must be a str"):
        ModelShape(name="x", hidden=8, intermediate=8, experts=8, topk=2, dtype=dtype)  # type: ignore[arg-type]
