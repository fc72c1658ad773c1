"""An append to a results CSV (`bench run --results`, summary.csv) cut short by Ctrl-C: the rows appended so far
stay whole and no partial row is left behind (a full disk's OSError was handled so; an interrupt was not)."""

from __future__ import annotations

import pathlib
from pathlib import Path

import pytest

from moetune.tuner.measure import results as R


def _row(launch: str, median: str) -> dict[str, str]:
    return {c: "" for c in R.COLUMNS} | {"scenario": "gpu-rates", "case": "read-sum", "baseline": "1", "position": "0",
                                         "launch": launch, "metric": "read_tbps", "unit": "TB/s", "median": median,
                                         "source": "measured", "date": "2026-12-05T00:00:00Z", "git_sha": "a" * 40}


def test_an_append_interrupted_mid_write_leaves_no_partial_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "r.csv"
    R.append_rows(f, [_row("L1", "2.5")])
    before = f.read_bytes()
    real_open = pathlib.Path.open

    class Cut:  # half the text reaches the file, then Ctrl-C
        def __init__(self, fh):  # type: ignore[no-untyped-def]
            self.fh = fh

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            self.fh.close()

        def write(self, text: str) -> int:
            self.fh.write(text[: len(text) // 2])
            self.fh.flush()
            raise KeyboardInterrupt

    def cut_open(self, mode="r", *a, **k):  # type: ignore[no-untyped-def]
        fh = real_open(self, mode, *a, **k)
        return Cut(fh) if mode == "a" and self == f else fh

    monkeypatch.setattr(pathlib.Path, "open", cut_open)
    with pytest.raises(KeyboardInterrupt):
        R.append_rows(f, [_row("L2", "2.6"), _row("L3", "2.7")])
    monkeypatch.undo()
    assert f.read_bytes() == before
    R.append_rows(f, [_row("L4", "2.8")])  # the next append is a row of its own
    assert [(r["launch"], r["median"]) for r in R.read_rows(f)] == [("L1", "2.5"), ("L4", "2.8")]
