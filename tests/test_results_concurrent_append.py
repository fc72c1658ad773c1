"""Two `moetune bench run`s appending to one results table at once (summary.csv): an append cut short restores the
file's old length, which also cut the rows another process appended meanwhile, and a reader (another run's
`check_table`) could read a batch half written. Every append, restore and read of the table holds its flock."""

from __future__ import annotations

import pathlib
import threading
from pathlib import Path

import pytest

from moetune.tuner.measure import results as R


def _row(launch: str, median: str) -> dict[str, str]:
    return {c: "" for c in R.COLUMNS} | {"scenario": "gpu-rates", "case": "read-sum", "baseline": "1", "position": "0",
                                         "launch": launch, "metric": "read_tbps", "unit": "TB/s", "median": median,
                                         "source": "measured", "date": "2026-12-07T00:00:00Z", "git_sha": "a" * 40}


def test_a_restore_never_cuts_the_rows_another_append_wrote_meanwhile(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first append's text reaches the file, then Ctrl-C: before its restore (the file cut back to its old
    length) a second append (another process: a thread here, its own fd) runs. Its rows must survive the restore."""
    f = tmp_path / "r.csv"
    R.append_rows(f, [_row("L1", "2.5")])
    real_open = pathlib.Path.open
    other: list[BaseException] = []
    armed = [True]

    def second() -> None:
        try:
            R.append_rows(f, [_row("B1", "3.1"), _row("B2", "3.2")])
        except BaseException as e:  # reported by the test below
            other.append(e)

    class Cut:  # the whole text written and flushed, the second append given its chance, then Ctrl-C
        def __init__(self, fh):  # type: ignore[no-untyped-def]
            self.fh = fh

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            self.fh.close()

        def write(self, text: str) -> int:
            self.fh.write(text)
            self.fh.flush()
            t = threading.Thread(target=second)
            t.start()
            t.join(1.0)  # unlocked, it is done by now; locked out, it waits for this append's restore
            threads.append(t)
            raise KeyboardInterrupt

    threads: list[threading.Thread] = []

    def cut_open(self, mode="r", *a, **k):  # type: ignore[no-untyped-def]
        fh = real_open(self, mode, *a, **k)
        if mode == "a" and self == f and armed[0]:
            armed[0] = False
            return Cut(fh)
        return fh

    monkeypatch.setattr(pathlib.Path, "open", cut_open)
    with pytest.raises(KeyboardInterrupt):
        R.append_rows(f, [_row("A1", "2.6"), _row("A2", "2.7")])
    for t in threads:
        t.join(30)
    monkeypatch.undo()
    assert not other, other
    assert [r["launch"] for r in R.read_rows(f)] == ["L1", "B1", "B2"]


def test_appends_from_threads_at_once_keep_every_row_whole(tmp_path: Path) -> None:
    """Appenders started together on a new table: one header (each decided `new` on its own before), every row."""
    f = tmp_path / "r.csv"
    go = threading.Barrier(4)

    def work(i: int) -> None:
        go.wait()
        for j in range(25):
            R.append_rows(f, [_row(f"T{i}-{j}", str(j)), _row(f"T{i}-{j}", str(j + 0.5))])

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    rows = R.read_rows(f)
    assert len(rows) == 4 * 25 * 2
    assert f.read_text().count("scenario,case") == 1
