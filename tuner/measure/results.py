"""The benchmark results table: `bench/results/summary.csv`, one row per (scenario, case, machine, launch, metric).

Fixed columns (`COLUMNS`), so a row written today and one written next year line up. A row says what was
measured (scenario, case, metric, its median / p10 / p90 over `n` samples), where (hardware, GPU, fabric
fingerprint, world, backend), on which code (git SHA + dirty flag, moetune / torch / NCCL / CUDA versions),
when, and by which exact command. `source` says how the row was made: `measured` (by `moetune bench run`),
`modelled` (by `moetune bench run` too, but the number is a prediction of the fabric model or of a modelled
search, not a measurement; its `unit` carries `MODELLED` as well: `x MODELLED`, `% MODELLED`), `smoke` (a
plumbing check on tiny sizes: not a measurement) or `imported` (a number recorded before this table existed; its
SHA is the commit whose code ran where that is established (the host-staged runs: bench/tools/import_history.py
RUN_CODE), `unknown` with the reason in the note where it is not, else the commit that added the raw result file;
an imported prediction's unit carries `MODELLED`).

Two `moetune bench run`s may append to one table at once: every append (with its restore on failure) holds an
exclusive flock on the table itself, every read a shared one (`_flocked`), so rows never interleave, a restore
never cuts another process's rows, and no reader sees a batch half written. No lock file: nothing new lands beside
the table (a stray file in bench/results/ would stamp the next run's rows dirty). A process killed mid-append can
leave its last row cut short at the end (`whole_length`): reads leave it out, the next append cuts it off.

Stdlib only: the CLI, the scenario runner and the tests share it.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import errno
import fcntl
import io
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from moetune.runtime.paths import sync_folder

COLUMNS: tuple[str, ...] = (
    "scenario", "case", "baseline", "position", "launch", "metric", "unit", "median", "p10", "p90", "n",
    "source", "date", "git_sha", "git_dirty", "moetune", "torch", "nccl", "cuda", "gpu", "gpu_count",
    "fabric_fingerprint", "hardware", "world", "backend", "command", "note",
)


def is_modelled(row: dict[str, Any]) -> bool:
    """Whether a row holds a prediction (its unit carries MODELLED), whoever made it."""
    return "MODELLED" in str(row.get("unit") or "")


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


class RowsNotSaved(ResultsError):
    """Rows that could not be appended to the results table (a read-only or full disk, the file replaced): they are
    kept in `kept`, a results CSV of their own (beside the table, else in the system's temporary folder), or, where
    no file could be written at all, only in `text` (the CSV, header first) for the caller to print."""

    def __init__(self, path: Path, reason: str, n: int, text: str, kept: Path | None, errno: int | None = None) -> None:
        self.path, self.reason, self.n, self.text, self.kept = path, reason, n, text, kept
        self.errno = errno  # the OSError's, where one stopped the write (a full disk: the CLI's exit status 1)
        where = (f"they are kept in {kept} (a results CSV, header first: append its rows to {path} once it can "
                 "be written)" if kept is not None else "no file could be written either: they are printed on stdout "
                 "as CSV")
        super().__init__(f"{path}: cannot write the {n} result row(s) ({reason}); {where}")


def _check_columns(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        extra = set(r) - set(COLUMNS)
        if extra:
            raise ResultsError(f"unknown result column(s) {sorted(extra)}; the columns are {', '.join(COLUMNS)}")


def _csv_text(rows: list[dict[str, Any]], header: bool) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if header:
        w.writerow(COLUMNS)
    for r in rows:
        w.writerow([_cell(r.get(c)) for c in COLUMNS])
    return buf.getvalue()


def write_problem(path: Path) -> str | None:
    """Why a file could not be written at `path` (an existing regular file appended to, or a new one created with
    its missing folders), or None. Probed without changing anything (an existing file is opened for appending and
    closed; a new one is probed by an unnamed temporary file in the nearest folder that exists), so an output that
    cannot be written is refused before the work that makes it."""
    try:
        if path.is_file():
            with path.open("a", encoding="utf-8"):
                pass
            return None
        if path.exists():  # a device (/dev/null) or a pipe: its own write decides, probing could block
            return None
        above = path.parent
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            return f"{above} is not a directory"
        with tempfile.TemporaryFile(dir=above):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def keep_rows(path: Path, rows: list[dict[str, Any]]) -> Path | None:
    """Write rows that could not go to the table at `path` to a new results CSV of their own (header first): beside
    `path` where its folder takes one, else in the system's temporary folder. Returns the file, or None where
    neither could be written."""
    _check_columns(rows)
    text = _csv_text(rows, header=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    for folder in (path.parent, Path(tempfile.gettempdir())):
        try:
            fd, name = tempfile.mkstemp(prefix=f"{path.stem}.unsaved-{stamp}-", suffix=".csv", dir=folder)
        except OSError:
            continue
        try:
            with open(fd, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        except OSError:
            Path(name).unlink(missing_ok=True)
            continue
        return Path(name)
    return None


def append_or_keep(path: Path, rows: Iterable[dict[str, Any]], *, fresh_launch: bool = False,
                   skip_if: Callable[[list[dict[str, str]]], bool] | None = None) -> int:
    """`append_rows` (`fresh_launch` and `skip_if` as there), and where the rows cannot be appended (an OSError, or the file became something this module
    does not append to), RowsNotSaved after keeping them (`keep_rows`): rows measured are never lost."""
    rows = list(rows)
    _check_columns(rows)
    try:
        return append_rows(path, rows, fresh_launch=fresh_launch, skip_if=skip_if)
    except (OSError, ResultsError) as e:
        reason = (getattr(e, "strerror", None) or str(e)) if isinstance(e, OSError) else str(e)
        raise RowsNotSaved(path, reason, len(rows), _csv_text(rows, header=True), keep_rows(path, rows),
                           getattr(e, "errno", None)) from None


def append_rows(path: Path, rows: Iterable[dict[str, Any]], *, fresh_launch: bool = False,
                skip_if: Callable[[list[dict[str, str]]], bool] | None = None) -> int:
    """Append rows (dicts keyed by COLUMNS; unknown keys are an error) to the CSV, writing the header first
    when the file is new. Returns how many rows were written. Holds the table's exclusive flock from before its
    length is read until the append (or its restore) is done: see the module's docstring.

    `fresh_launch`: the rows are a launch just run (`moetune bench run`), whose id the table must not hold yet: a
    launch id the table holds already (another run started in the same second: the ids have one-second resolution)
    is replaced, in the rows given too, by the next free number (`_free_launch_id`), decided under the lock.

    `skip_if`: called under the lock with the table's rows; where it is true nothing is appended and 0 returned (a
    check such as "this launch is in the table already" that two processes could both pass if made before the lock)."""
    rows = list(rows)
    _check_columns(rows)
    check_table(path)  # before anything is created: a folder or a foreign file is refused, never appended to
    path.parent.mkdir(parents=True, exist_ok=True)
    # a descriptor of its own for the lock: the write's file object is closed (its buffer flushed) before a restore,
    # which must still happen under the lock
    lock_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        with _flocked(lock_fd, fcntl.LOCK_EX):
            # decided under the lock: another process may have created the table or appended since `check_table`
            size = os.fstat(lock_fd).st_size
            # the table as this append finds it, read once: without the shared lock, which a second flock of this
            # process (on another descriptor) would wait for forever while it holds the exclusive one
            data = b""
            if size:
                with path.open("rb") as f:
                    data = f.read()
                whole = whole_length(data)
                if whole < size:  # the row a killed append cut short (no live writer holds the lock): cut off, else
                    os.truncate(path, whole)  # it refused the table, or read this append's rows into its open quote
                    size, data = whole, data[:whole]
            if skip_if is not None and skip_if(_rows_of(path, data) if size else []):
                return 0
            if fresh_launch and size:
                taken = _launch_ids(data)
                for launch in {str(r.get("launch", "")) for r in rows} & taken:
                    free = _free_launch_id(launch, taken)
                    taken.add(free)
                    for r in rows:
                        if str(r.get("launch", "")) == launch:
                            r["launch"] = free
            text = _csv_text(rows, header=size == 0)
            if size and not data.endswith(b"\n"):  # a last row without its newline (a hand edit): not glued onto it
                text = "\n" + text
            try:
                with path.open("a", encoding="utf-8", newline="") as f:
                    f.write(text)
                    if stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a device (/dev/null) takes no fsync
                        f.flush()
                        os.fsync(f.fileno())  # the rows `bench run` says are saved survive a power loss
                        if size == 0:  # the header's append: the file may be new, its directory entry not yet
                            sync_folder(path.parent)  # on disk (the file's own fsync does not write it)
            except BaseException:
                # a write cut short (a full disk, Ctrl-C) leaves no partial row behind (the next append would glue
                # onto it): on an OSError the caller keeps every row elsewhere. Under the lock, nothing past `size`
                # is another process's
                with contextlib.suppress(OSError):
                    if path.is_file() and path.stat().st_size > size:
                        os.truncate(path, size)
                raise
    finally:
        os.close(lock_fd)
    return len(rows)


def _launch_ids(data: bytes) -> set[str]:
    """The launch ids a results table's bytes `data` hold."""
    with io.StringIO(data.decode("utf-8"), newline="") as f:
        return {r.get("launch") or "" for r in csv.DictReader(f)}


def _launch_number(launch: str) -> tuple[str, int] | None:
    """(start, n) of a launch id `<start>-<n>` (`20261207T045017Z-1`); None for an id of another form."""
    start, sep, n = launch.rpartition("-")
    return (start, int(n)) if sep and n.isdigit() else None


def launch_order(launch: str) -> tuple[str, int]:
    """A sort key of a launch id (`<start>-<n>`) that orders its number as a number: `...Z-10` after `...Z-9`, which
    as text sorts before it (an id of another form keys as itself with n 0)."""
    return _launch_number(launch) or (launch, 0)


def _free_launch_id(launch: str, taken: set[str]) -> str:
    """`launch` (`<start>-<n>`: `20261207T045017Z-1`) with the next number after n that `taken` does not hold (an id
    of another form gets `-2`, `-3`, ... appended)."""
    base, k = _launch_number(launch) or (launch, 1)
    while f"{base}-{k + 1}" in taken:
        k += 1
    return f"{base}-{k + 1}"


@contextlib.contextmanager
def _flocked(fd: int, how: int) -> Iterator[None]:
    """Hold flock `how` (LOCK_EX to append, LOCK_SH to read) on `fd` for the block. Where the file system takes no
    flock (EINVAL, ENOLCK, EOPNOTSUPP: some network mounts) the block runs unlocked, as before: rows are never refused
    for want of a lock. The kernel drops the lock when the process dies, kill -9 included."""
    try:
        fcntl.flock(fd, how)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
            raise
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def whole_length(data: bytes) -> int:
    """How many bytes of a results table's `data` are whole records: all of them, unless its last record was cut short
    by a process killed mid-append (the kernel stops copying a write at a SIGKILL; a power loss cuts one too): a
    record at the very end without its newline and without a results row's columns, or one whose quoted value is
    still open at the end (a FAILED note quoting a multi-line error, cut after one of its lines). Read under the
    table's lock no live append is half written: such a tail is a dead process's. Bounded, so that a hand edit is
    never cut away: a last row without its newline that has the columns is whole (`append_rows` adds the newline),
    and a record after whose first line a line reads as a whole row (an unclosed quote in the middle of the table)
    is not a cut tail: `read_rows` refuses it, naming its line, as before."""
    ends: list[int] = []  # the byte offset after each line handed to the CSV reader, which reads no line ahead

    def lines() -> Iterator[str]:
        begin = 0
        while begin < len(data):
            nl = data.find(b"\n", begin)
            end = len(data) if nl < 0 else nl + 1
            ends.append(end)
            yield data[begin:end].decode("utf-8", "replace")  # a cut may split a character
            begin = end

    def cut_at(start: int) -> int:
        if start == 0 and not _csv_text([], header=True).encode().startswith(data):
            return len(data)  # the table's first record is its header: anything else is another file, never cut
        return len(data) if _rows_after_first_line(data, start) else start

    start = 0  # where the record being read begins
    try:
        for rec in csv.reader(lines(), strict=True):
            if ends[-1] == len(data) and not data.endswith(b"\n") and len(rec) != len(COLUMNS):
                return cut_at(start)
            start = ends[-1]
    except csv.Error as e:
        if ends and ends[-1] == len(data) and "end of data" in str(e):  # a quote still open at the end
            return cut_at(start)
    return len(data)


def _rows_after_first_line(data: bytes, start: int) -> bool:
    """Whether a line after the first one of the record at `start` reads, on its own, as a whole results row."""
    nl = data.find(b"\n", start)
    if nl < 0:
        return False
    for line in data[nl + 1:].split(b"\n"):
        if len(next(csv.reader([line.decode("utf-8", "replace")]), [])) == len(COLUMNS):
            return True
    return False


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
        with path.open("rb") as f, _flocked(f.fileno(), fcntl.LOCK_SH):
            data = f.read()
        whole = whole_length(data)
        if whole == 0:  # nothing but a first append a kill cut short: a new table, as an empty file
            return
        text = data[:whole].decode("utf-8")  # the whole records (a cut tail may split a character): a binary file fails
        header = next(csv.reader([text.split("\n", 1)[0]]), [])
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise _unreadable(path, e) from None
    if tuple(header) != COLUMNS:
        raise ResultsError(f"{path}: its header is not this version's columns ({', '.join(COLUMNS)}); "
                           "rows are not appended to a table of another layout")
    _rows_of(path, data)  # every row whole: rows appended after a broken one (an unclosed quote) would be read into it


def read_rows(path: Path) -> list[dict[str, str]]:
    """Every row of the CSV as a dict of strings (empty list when the file does not exist or is empty: a new table,
    as `check_table` takes it); a ResultsError naming the file where it is not a readable results table."""
    if not path.exists() or (path.is_file() and path.stat().st_size == 0):
        return []
    try:
        with path.open("rb") as raw, _flocked(raw.fileno(), fcntl.LOCK_SH):
            data = raw.read()
        return _rows_of(path, data)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise _unreadable(path, e) from None


def _rows_of(path: Path, data: bytes) -> list[dict[str, str]]:
    """The rows of a results table's bytes `data` (read from `path`, which errors name), as `read_rows` returns them."""
    try:
        # a last row a killed append cut short is no row: left out (the next append cuts it off)
        whole = whole_length(data)
        if not whole:  # nothing but a first append cut short (part of the header): a new table
            return []
        with io.StringIO(data[:whole].decode("utf-8"), newline="") as f:
            rd = csv.DictReader(f)
            if not rd.fieldnames:
                raise ResultsError(f"{path}: no header row (its first line is blank), so not a results CSV; a "
                                   f"results CSV starts with the line {','.join(COLUMNS)}")
            if tuple(rd.fieldnames) != COLUMNS:
                raise ResultsError(f"{path}: header {rd.fieldnames} is not the results table's columns {list(COLUMNS)}")
            rows = []
            for row in rd:
                # csv fills a short row with None and files a long row's rest under None
                if None in row or any(v is None for v in row.values()):
                    raise ResultsError(f"{path}: the row ending on line {rd.line_num} does not have the "
                                       f"{len(COLUMNS)} columns of a results row (a hand edit? an unclosed quote?)")
                rows.append(row)
            return rows
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise _unreadable(path, e) from None


def row_problems(rows: list[dict[str, str]], scenarios: Any, limit: int = 5) -> tuple[int, list[str]]:
    """(how many rows a summary cannot show, the first `limit` of them by CSV line): a median that is no finite
    number on a row that is not a FAILED one (a hand edit: the summary dropped it and switched metric without a
    word), a scenario no file defines."""
    bad: list[str] = []
    n = 0
    line = 2  # the header is line 1
    for r in rows:
        why = ""
        if r.get("scenario") not in scenarios:
            why = f"scenario {r.get('scenario', '')[:60]!r} is defined by no bench/scenarios file"
        elif not r.get("note", "").startswith("FAILED"):
            v = fnum(r.get("median", ""))
            if v is None or not math.isfinite(v):
                why = f"median {r.get('median', '')[:30]!r} of {r.get('metric', '')[:40]} is not a finite number"
        if why:
            n += 1
            if len(bad) < limit:
                bad.append(f"line {line}: {why}")
        # the next row's line: a quoted value with newlines in it (a FAILED note quoting an error) spans lines
        line += 1 + sum(str(v).count("\n") for v in r.values() if v)
    return n, bad


def fnum(s: str) -> float | None:
    """A numeric cell, or None when empty / not a number."""
    try:
        return float(s) if s not in ("", None) else None
    except ValueError:
        return None
