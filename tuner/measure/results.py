"""The benchmark results table: `bench/results/summary.csv`, one row per (scenario, case, machine, launch, metric).

Fixed columns (`COLUMNS`), so a row written today and one written next year line up. A row says what was
measured (scenario, case, metric, its median / p10 / p90 over `n` samples), where (hardware, GPU, fabric
fingerprint, world, backend), on which code (git SHA + dirty flag, moetune / torch / NCCL / CUDA versions),
when, and by which exact command. `source` says how the row was made: `measured` (by `moetune bench run`),
`smoke` (a plumbing check on tiny sizes: not a measurement) or `imported` (a number recorded before this table
existed; its SHA is the commit that added the raw result file).

Stdlib only: the CLI, the scenario runner and the tests share it.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

COLUMNS: tuple[str, ...] = (
    "scenario", "case", "baseline", "position", "launch", "metric", "unit", "median", "p10", "p90", "n",
    "source", "date", "git_sha", "git_dirty", "moetune", "torch", "nccl", "cuda", "gpu", "gpu_count",
    "fabric_fingerprint", "hardware", "world", "backend", "command", "note",
)


class ResultsError(ValueError):
    """A results file that is not the table this module writes."""


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def append_rows(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Append rows (dicts keyed by COLUMNS; unknown keys are an error) to the CSV, writing the header first
    when the file is new. Returns how many rows were written."""
    rows = list(rows)
    for r in rows:
        extra = set(r) - set(COLUMNS)
        if extra:
            raise ResultsError(f"unknown result column(s) {sorted(extra)}; the columns are {', '.join(COLUMNS)}")
    check_table(path)  # before anything is created: a folder or a foreign file is refused, never appended to
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if new:
        w.writerow(COLUMNS)
    for r in rows:
        w.writerow([_cell(r.get(c)) for c in COLUMNS])
    with path.open("a", encoding="utf-8", newline="") as f:
        f.write(buf.getvalue())
    return len(rows)


def _unreadable(path: Path, e: Exception) -> ResultsError:
    """The ResultsError for a file that cannot be read as the results CSV (binary, a folder, no permission)."""
    if isinstance(e, UnicodeDecodeError):
        return ResultsError(f"{path}: not a UTF-8 text file, so not a results CSV")
    if isinstance(e, csv.Error):
        return ResultsError(f"{path}: not a readable CSV file ({e})")
    if isinstance(e, IsADirectoryError):
        return ResultsError(f"{path} is a directory, not a results CSV file")
    return ResultsError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})")


def check_table(path: Path) -> None:
    """ResultsError unless `path` is absent, empty or a results table of this layout (a UTF-8 CSV with COLUMNS):
    checked before a benchmark runs, so its rows are not lost to a file they cannot be appended to."""
    if path.is_dir():
        raise ResultsError(f"{path} is a directory, not a results CSV file")
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        with path.open(encoding="utf-8", newline="") as f:
            header = next(csv.reader([f.readline()]), [])
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise _unreadable(path, e) from None
    if tuple(header) != COLUMNS:
        raise ResultsError(f"{path}: its header is not this version's columns ({', '.join(COLUMNS)}); "
                           "rows are not appended to a table of another layout")


def read_rows(path: Path) -> list[dict[str, str]]:
    """Every row of the CSV as a dict of strings (empty list when the file does not exist); a ResultsError naming
    the file where it is not a readable results table."""
    if not path.exists():
        return []
    try:
        with path.open(encoding="utf-8", newline="") as f:
            rd = csv.DictReader(f)
            if tuple(rd.fieldnames or ()) != COLUMNS:
                raise ResultsError(f"{path}: header {rd.fieldnames} is not the results table's columns {list(COLUMNS)}")
            return list(rd)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise _unreadable(path, e) from None


def fnum(s: str) -> float | None:
    """A numeric cell, or None when empty / not a number."""
    try:
        return float(s) if s not in ("", None) else None
    except ValueError:
        return None
