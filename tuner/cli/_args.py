"""Parsing of the CLI's list options, with errors that name the option."""

from __future__ import annotations


def int_list(text: str, option: str) -> list[int]:
    """The integers of a comma-separated option value ("1,16, 128"; empty items skipped); a ValueError naming the
    option where an item is not an integer."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r}") from None
