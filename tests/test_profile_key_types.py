"""A ProfileKey is typed when it is built directly, as Knobs and ModelShape are: msgspec checks types only when it
decodes, and a key's hash (`profile_hash_of`, what ranks and the store compare) is the JSON of its fields, so a float
or a bool where an int belongs made another key that compared equal in Python (2048.0 == 2048, True == 1)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import ProfileKey, profile_hash_of

FIELDS: dict[str, Any] = dict(fingerprint="fp", software="sw", transport_family="nvlink", ep_size=2, nodes=1,
                              hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=16)


def test_an_int_field_that_is_no_int_is_refused_naming_the_field() -> None:
    good = ProfileKey(**FIELDS)
    for name, bad in (("hidden", 2048.0), ("token_bucket", 16.0), ("ep_size", True), ("nodes", True),
                      ("experts", "128"), ("topk", float("nan"))):
        with pytest.raises(TypeError, match=f"profile key: {name} must be an int"):
            ProfileKey(**{**FIELDS, name: bad})
    # what it would otherwise have been: the same key to ==, another hash
    assert profile_hash_of(good, Knobs()) == profile_hash_of(ProfileKey(**FIELDS), Knobs())


def test_a_text_field_that_is_no_str_is_refused_naming_the_field() -> None:
    for name in ("fingerprint", "software", "transport_family", "dtype"):
        for bad in (None, 5, b"fp"):
            with pytest.raises(TypeError, match=f"profile key: {name} must be a str"):
                ProfileKey(**{**FIELDS, name: bad})


def test_decoding_still_names_the_field_and_round_trips() -> None:
    key = ProfileKey(**FIELDS)
    assert msgspec.json.decode(msgspec.json.encode(key), type=ProfileKey) == key
    assert msgspec.convert(key.to_dict(), ProfileKey) == key
    with pytest.raises(msgspec.ValidationError, match="hidden"):
        msgspec.convert({**FIELDS, "hidden": 2048.5}, ProfileKey)
