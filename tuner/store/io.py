"""Export and import of profiles: a deterministic JSON document, imported all or nothing.

An import is validated completely before anything is written (`parse_export`), then written in one
transaction; a rejected import leaves the database file byte-identical. `skip_invalid` is the one exception the
caller asks for: profile records invalid on their own are left out (and listed), the rest imported.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import msgspec
from sqlalchemy import String, bindparam, select, type_coerce, update
from sqlalchemy.exc import IntegrityError

from moetune.runtime.knobs import KnobError, stored_form
from moetune.runtime.profile_record import (
    ProfileKey,
    ProfileRecord,
    is_preset_fingerprint,
    stored_profile_hashes,
)
from moetune.tuner.store._rows import (
    decide,
    is_newer,
    now,
    replacement_event,
    row_from_record,
)
from moetune.tuner.store._schema import StoreError, is_sqlite_file
from moetune.tuner.store.atomic_files import follow_own_links, write_atomic
from moetune.tuner.store.models import PROFILE_KEY_COLUMNS, Event, Fingerprint, Profile
from moetune.tuner.store.validate import (
    FieldError,
    canonical_routing,
    check_fingerprint_text,
    check_import_record,
    check_import_time,
    check_no_control,
    printable,
    utc_text,
)

if TYPE_CHECKING:
    from moetune.tuner.store.store import Store

# (fingerprint hash, its facts) -> why they cannot be stored as that fingerprint's, '' when they can. The store may not
# import the fabric layer (tests/test_import_rules.py), so the caller hands it: `fabric.facts.facts_problem`.
FactsCheck = Callable[[str, dict[str, Any]], str]

EXPORT_FORMAT = "moetune-profiles"
EXPORT_VERSION = 1


class ProfileImportError(ValueError):
    """An import file is corrupt or invalid; nothing was written. The message quotes the file: its control
    characters are written as escapes (lines stay lines), so printing it sends no escape sequence to a terminal."""

    def __init__(self, message: str) -> None:
        super().__init__("\n".join(printable(line) for line in message.split("\n")))


class ImportResult(msgspec.Struct, kw_only=True):
    """What an import did."""

    inserted: int = 0  # profile rows written
    current: int = 0  # of which now current
    replaced: int = 0  # existing current profiles superseded by an imported one
    kept_superseded: int = 0  # imported current profiles that did not replace the stored one (kept as history)
    skipped: int = 0  # already in the database (`_already_stored`), nothing to add
    # already in the database, but the row had lost a field the record carries (a schema downgrade and upgrade
    # dropped its routing / perf_env / runtime_options): the field was filled in (`_fill_in`), nothing else of the
    # row changed
    completed: int = 0
    # already in the database with another routing / perf_env / runtime_options than the record's: kept as stored
    differing: list[str] = []
    fingerprints: int = 0  # fingerprint rows added
    invalid: list[str] = []  # with skip_invalid: the records left out, "profiles[i] (key): why"


class ExportedFingerprint(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A fingerprint and its facts as exported. Not where they came from (`fingerprints.origin`, `node`): to the store
    that imports them they are another node's (origin 'import'), whatever they were to the one that exported them."""

    hash: str
    facts: dict[str, Any]
    first_seen: str
    last_seen: str


class ProfilesFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The export file (JSON)."""

    format: str
    version: int
    moetune_version: str = ""
    fingerprints: list[ExportedFingerprint] = []
    profiles: list[ProfileRecord] = []


def _moetune_version() -> str:
    from moetune.tuner import __version__

    return __version__


def dump_profiles(store: Store, *, status: str | None = None, fingerprint: str | None = None,
                  provenance: str | None = None) -> bytes:
    """The export document (JSON bytes, deterministic: same database → same bytes)."""
    # as every reader takes them: a hand-edited "measured" label on a modelling backend is exported as modelled
    profiles = [rec.as_effective() for _id, rec in store.list_profiles(status=status, fingerprint=fingerprint,
                                                                       provenance=provenance)]
    hashes = sorted({r.key.fingerprint for r in profiles})
    with store._read() as s:  # in batches: more fingerprints than one IN (...) holds on older SQLite builds
        fps = {fp.hash: fp for i in range(0, len(hashes), _IN_BATCH)
               for fp in s.scalars(select(Fingerprint).where(Fingerprint.hash.in_(hashes[i:i + _IN_BATCH])))}
    doc = ProfilesFile(
        format=EXPORT_FORMAT,
        version=EXPORT_VERSION,
        moetune_version=_moetune_version(),
        fingerprints=[
            ExportedFingerprint(hash=h, facts=dict(fps[h].facts), first_seen=fps[h].first_seen, last_seen=fps[h].last_seen)
            for h in hashes
            if h in fps
        ],
        profiles=profiles,
    )
    return msgspec.json.format(msgspec.json.encode(doc, order="deterministic"), indent=2) + b"\n"


def _is_own_file(store: Store, path: Path) -> bool:
    """Whether `path` is the store's database or its -wal/-shm/-journal (through links, `..` or a hard link). Told
    from names and stat() alone: opening one of them and closing it again would drop every POSIX lock this process
    holds on that file, SQLite's for the store's open connections included."""
    if store.memory:
        return False
    db = store.path
    try:
        target = path.resolve()
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13) is no file: its read says so
        return False
    for own in (db, *(db.with_name(db.name + suffix) for suffix in ("-wal", "-shm", "-journal"))):
        if target == own.resolve():
            return True
        with contextlib.suppress(OSError):  # a hard link to the database is the database too
            if os.path.samefile(target, own):
                return True
    return False


def _check_export_target(store: Store, target: Path) -> None:
    """Refuse a target whose replacement would lose data: the store's own database (or its -wal/-shm/
    -journal, which hold committed rows), any other SQLite database, anything not a regular file."""
    if _is_own_file(store, target):
        raise StoreError(f"refusing to export onto {target}: it is (a file of) the database {store.path}")
    if target.exists():
        if not target.is_file():
            raise StoreError(f"refusing to export onto {target}: not a regular file")
        if is_sqlite_file(target):
            raise StoreError(f"refusing to export onto {target}: it is a SQLite database")


def export_profiles(store: Store, path: str | Path, *, status: str | None = None, fingerprint: str | None = None,
                    provenance: str | None = None, replace: bool = True) -> int:
    """Write the profiles (with their fingerprints' facts) to a JSON file atomically (a temporary file in
    the same directory, then os.replace: a failed export leaves an existing file as it was); returns how
    many. A StoreError refuses a target that is a database or not a regular file; with `replace=False` a
    FileExistsError refuses any existing file (`moetune profiles export` without --force)."""
    # Write through a symlink: the link stays, the file it names gets the export (another user's link: refused).
    written = follow_own_links(Path(path).expanduser())
    target = written.resolve()  # for the checks only: the folders on the way are the kernel's to follow
    _check_export_target(store, target)
    if not replace and target.exists():
        raise FileExistsError(errno.EEXIST, "file exists", str(target))
    # the Store method: its read is retried when the file changes under it
    data = store.dump_profiles(status=status, fingerprint=fingerprint, provenance=provenance)
    n = len(msgspec.json.decode(data)["profiles"])
    write_atomic(written, data, replace=replace)
    return n


def _key_text(key: ProfileKey) -> str:
    # a file's text, in a message printed to a terminal: control characters as escapes
    return printable(
        f"{key.fingerprint[:12]} {key.transport_family[:64]} ep{key.ep_size}x{key.nodes} "
        f"h{key.hidden}/i{key.intermediate}/e{key.experts}/k{key.topk} {key.dtype[:64]} t{key.token_bucket}"
    )


def _short(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 32 else text[:32] + "..."


def parse_export(data: bytes, *, source: str = "<data>", skip_invalid: bool = False,
                 check_facts: FactsCheck | None = None) -> ProfilesFile:
    """Decode and validate an export document completely; ProfileImportError names every invalid profile record
    (index, key, field). `skip_invalid`: such records are left out of the document instead (`_parse` lists them);
    a problem of the file itself (format, fingerprints, two current records for one key) is refused either way.
    `check_facts`: each fingerprint's non-empty facts must pass it (see FactsCheck)."""
    return _parse(data, source, skip_invalid, check_facts)[0]


# An import is read whole into memory and validated there: a file past this is not read (an export of ~35,000
# profiles fits; a bigger database is exported in parts, `profiles export --fingerprint/--status`).
MAX_IMPORT_BYTES = 64 * 1024 * 1024


def too_big_message(source: str, size: int | None = None) -> str:
    what = f"{size} bytes" if size is not None else "more"
    return (f"{source}: {what}, over the import limit of {MAX_IMPORT_BYTES} bytes ({MAX_IMPORT_BYTES >> 20} MiB); "
            "export in parts (`moetune profiles export --fingerprint FP` or `--status`) and import each")


def read_import(path: Path) -> bytes:
    """The bytes of an import file, at most MAX_IMPORT_BYTES + 1 read (ProfileImportError past the limit)."""
    with open(path, "rb") as f:
        data = f.read(MAX_IMPORT_BYTES + 1)
    if len(data) > MAX_IMPORT_BYTES:
        raise ProfileImportError(too_big_message(str(path)))
    return data


# An export nests a few levels (fingerprint facts the deepest); a file nested deeper is no export, and a value nested
# near Python's recursion limit would be stored but fail every later read of it.
MAX_JSON_DEPTH = 64


def _too_deep(obj: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    stack = [(obj, 1)]
    while stack:  # not recursive: the depth is the file's to choose
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((item, depth + 1) for item in (v.values() if isinstance(v, dict) else v))
    return False


def _parse(data: bytes, source: str, skip_invalid: bool,
           check_facts: FactsCheck | None = None) -> tuple[ProfilesFile, list[str]]:
    """parse_export, and the records it left out ("profiles[i] (key): why")."""
    if len(data) > MAX_IMPORT_BYTES:
        raise ProfileImportError(too_big_message(source, len(data)))
    deep = (f"{source}: not valid JSON for an import: more than {MAX_JSON_DEPTH} levels of arrays/objects "
            "(nested too deeply)")
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise ProfileImportError(f"{source}: not valid JSON: {e}") from None
    except RecursionError:  # msgspec's decoder at Python's recursion limit (some 1000 levels of `[`)
        raise ProfileImportError(deep) from None
    if _too_deep(raw):
        raise ProfileImportError(deep)
    if not isinstance(raw, dict):
        raise ProfileImportError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != EXPORT_FORMAT:
        raise ProfileImportError(f"{source}: not a moetune profiles file (format {str(raw.get('format'))[:64]!r}, expected {EXPORT_FORMAT!r})")
    version = raw.get("version")
    if type(version) is not int:  # bool is an int subclass; "1" is not a version either
        raise ProfileImportError(
            f"{source}: format version must be an integer, got {_short(version) if 'version' in raw else 'none'} (this moetune reads {EXPORT_VERSION})"
        )
    if version != EXPORT_VERSION:
        raise ProfileImportError(
            f"{source}: unsupported format version {str(version)[:32]} (this moetune reads {EXPORT_VERSION})"
        )
    if not isinstance(raw.get("profiles"), list):  # an empty list is fine (an empty database's export)
        raise ProfileImportError(f"no `profiles` list in {source}")
    raw_profiles = raw["profiles"]
    try:  # the records one by one below: one invalid record must be named with the others, or skipped
        doc = msgspec.convert({**raw, "profiles": []}, ProfilesFile)
    except (msgspec.ValidationError, KnobError, ValueError, TypeError) as e:
        raise ProfileImportError(f"{source}: invalid: {e}") from None
    try:  # every text of the file is stored or shown: none may carry a terminal escape sequence
        check_no_control(doc.moetune_version, "moetune_version")
        for i, fp in enumerate(doc.fingerprints):
            check_no_control(msgspec.to_builtins(fp), f"fingerprints[{i}]")
    except FieldError as e:
        raise ProfileImportError(f"{source}: {e}") from None
    now = _dt.datetime.now(_dt.UTC)
    seen_fp: set[str] = set()
    for i, fp in enumerate(doc.fingerprints):
        if not fp.hash:
            raise ProfileImportError(f"{source}: fingerprints[{i}].hash is empty")
        if fp.hash in seen_fp:
            raise ProfileImportError(f"{source}: fingerprints[{i}]: fingerprint {fp.hash[:64]} appears twice")
        seen_fp.add(fp.hash)
        try:  # SQLite does not hold a text to its column's length: said here, before anything is stored
            check_fingerprint_text(f"fingerprints[{i}]", fp.hash, fp.facts)
        except FieldError as e:
            raise ProfileImportError(f"{source}: {e}") from None
        # a preset's key names a modelled fabric, no node: facts under it would be some node's, read as the preset's
        if fp.facts and is_preset_fingerprint(fp.hash):
            raise ProfileImportError(f"{source}: fingerprints[{i}] (fingerprint {fp.hash[:64]}): a what-if preset's "
                                     "fingerprint names a modelled fabric and has no facts; this one has some")
        # empty facts are a placeholder (a preset's key, a fingerprint recorded before its facts); any other facts are
        # read later as this fingerprint's (`fabric diff`, the daemon): facts that do not decode, or describe another
        # fabric, would be stored as this one's
        why = check_facts(fp.hash, fp.facts) if check_facts is not None and fp.facts else ""
        if why:
            raise ProfileImportError(f"{source}: fingerprints[{i}] (fingerprint {fp.hash[:64]}): {why}")
        for name in ("first_seen", "last_seen"):
            try:  # as a profile's dates: a future last_seen would make it the newest fingerprint for good
                check_import_time(name, getattr(fp, name), now)
            except FieldError as e:
                raise ProfileImportError(f"{source}: fingerprints[{i}].{e}") from None
            setattr(fp, name, utc_text(getattr(fp, name)))  # stored as the store writes its own: compared as text
    valid: list[tuple[int, ProfileRecord]] = []
    invalid: list[str] = []
    for i, raw_rec in enumerate(raw_profiles):
        try:
            valid.append((i, _profile_record(raw_rec, i, seen_fp, now)))
        except ProfileImportError as e:
            invalid.append(str(e))
    # every record invalid is refused with --skip-invalid too: it imported nothing, exit 0, and created the database
    if invalid and (not skip_invalid or not valid):
        raise ProfileImportError(_invalid_message(source, invalid, len(raw_profiles))
                                 + _newer_hint(doc.moetune_version, invalid))
    current: dict[ProfileKey, int] = {}
    for i, rec in valid:
        if rec.status == "current":  # a conflict between two records, neither invalid alone: never skipped
            if rec.key in current:
                raise ProfileImportError(
                    f"{source}: profiles[{current[rec.key]}] and profiles[{i}] are both current for the same key "
                    f"({_key_text(rec.key)})"
                )
            current[rec.key] = i
    doc.profiles = [rec for _i, rec in valid]
    return doc, invalid


def _profile_record(raw: Any, i: int, seen_fp: set[str], now: _dt.datetime) -> ProfileRecord:
    """profiles[i] of a file, decoded and checked; ProfileImportError names its index, its key and what is wrong."""
    try:
        if isinstance(raw, dict) and isinstance(raw.get("knobs"), dict):  # an earlier moetune's export (stored_form)
            raw = {**raw, "knobs": stored_form(raw["knobs"])}
        rec = msgspec.convert(raw, ProfileRecord)
    except (msgspec.ValidationError, KnobError, ValueError, TypeError) as e:
        # msgspec's path starts at the record: say where it is in the file, as a whole-file decode did
        why = str(e).replace("- at `$", f"- at `$.profiles[{i}]")
        raise ProfileImportError(f"profiles[{i}]{_raw_key_text(raw)}: invalid: {why}") from None
    try:
        check_import_record(rec, now)
    except FieldError as e:
        raise ProfileImportError(f"profiles[{i}].{e} ({_key_text(rec.key)})") from None
    for name in ("created", "updated"):  # UTC as the store writes its own: `updated` is compared as text too
        if getattr(rec, name):
            setattr(rec, name, utc_text(getattr(rec, name)))
    if rec.key.fingerprint not in seen_fp:  # else it would be stored with empty facts, seen "now"
        raise ProfileImportError(
            f"profiles[{i}].key.fingerprint {rec.key.fingerprint[:64]} is not in the file's fingerprints "
            f"({_key_text(rec.key)})"
        )
    return rec


def _raw_key_text(raw: Any) -> str:
    """" (key)" of a record that did not decode, from what its key holds ("?" where a field is missing), else ""."""
    key = raw.get("key") if isinstance(raw, dict) else None
    if not isinstance(key, dict):
        return ""
    f = {str(k): printable(str(v)[:64]) for k, v in key.items()}
    return (
        f" ({f.get('fingerprint', '?')[:12]} {f.get('transport_family', '?')} ep{f.get('ep_size', '?')}x{f.get('nodes', '?')} "
        f"h{f.get('hidden', '?')}/i{f.get('intermediate', '?')}/e{f.get('experts', '?')}/k{f.get('topk', '?')} "
        f"{f.get('dtype', '?')} t{f.get('token_bucket', '?')})"
    )


MAX_LISTED = 20  # invalid records listed with their reasons; past that, by index only


def _index_ranges(labels: list[str]) -> str:
    """"profiles[3], profiles[4], profiles[5], profiles[9]" as "profiles[3-5], profiles[9]" (labels in file order; one
    that is not NAME[INDEX] is kept as it is)."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (name, first, last)
    for label in labels:
        name, _, idx = label[:-1].partition("[")
        if not idx.isdigit():
            if run:
                out.append(_run_label(run))
                run = None
            out.append(label)
            continue
        i = int(idx)
        if run and run[0] == name and i == run[2] + 1:
            run = (name, run[1], i)
            continue
        if run:
            out.append(_run_label(run))
        run = (name, i, i)
    if run:
        out.append(_run_label(run))
    return ", ".join(out)


def _run_label(run: tuple[str, int, int]) -> str:
    name, first, last = run
    return f"{name}[{first}]" if first == last else f"{name}[{first}-{last}]"


def _newer_hint(written_by: str, invalid: list[str]) -> str:
    """Where records carry fields this moetune does not know and another moetune wrote the file: say so."""
    mine = _moetune_version()
    if not written_by or written_by == mine or not any("unknown field" in line for line in invalid):
        return ""
    return (f"\n(the file was written by moetune {written_by[:32]}, this is {mine}: a newer moetune's records "
            "may carry fields this one does not know; import it with that moetune, or upgrade this one)")


def _invalid_message(source: str, invalid: list[str], total: int) -> str:
    listed = "\n  ".join(invalid[:MAX_LISTED])
    rest = invalid[MAX_LISTED:]
    if rest:  # each still named, by its index; runs of neighbours as one range (a whole file of them was thousands)
        listed += f"\n  and {len(rest)} more: " + _index_ranges([line.split("]", 1)[0] + "]" for line in rest])
    others = total - len(invalid)
    how = (
        f"to import the other {others} and list the ones left out, pass --skip-invalid "
        f"(`moetune profiles import --skip-invalid`; skip_invalid=True from Python)"
        if others else "no record of the file is valid: there is nothing to import"
    )
    return f"{source}: {len(invalid)} of {total} profile record(s) invalid, nothing imported:\n  {listed}\n{how}"


def import_bytes(store: Store, data: bytes, *, source: str = "<data>", skip_invalid: bool = False,
                 check_facts: FactsCheck | None = None) -> ImportResult:
    """Import an export document: validated first, then one transaction. Never two current profiles for
    one key: an imported current profile replaces a stored one only through the replacement gate
    (`_rows.decide`: modelled never displaces measured; another routing never replaces; the same knobs replace
    when measured later than the stored number; other knobs beat the noise), else it is kept as `superseded`.
    Records already present are skipped. An invalid record refuses the whole file, unless `skip_invalid`: then it
    is left out and named in `ImportResult.invalid`."""

    doc, invalid = _parse(data, source, skip_invalid, check_facts)
    result = ImportResult(invalid=invalid)
    ts = now()
    store.refuse_damaged()  # a bulk write: never into a file that fails SQLite's quick check
    try:
        with store._write() as s:
            for fp in doc.fingerprints:
                have = s.scalar(select(Fingerprint).where(Fingerprint.hash == fp.hash))
                # another node's facts, whatever origin the exporting store gave them: 'import' here (the file
                # carries no origin). A row this node recorded as its own is left as it is: the same hash seen here
                # is this node's, and its facts name this node's GPUs
                if have is None:
                    s.add(Fingerprint(hash=fp.hash, facts=fp.facts, first_seen=fp.first_seen, last_seen=fp.last_seen,
                                      origin="import"))
                    result.fingerprints += 1
                elif not have.facts and fp.facts and have.origin != "local":  # a placeholder learns its facts
                    have.facts = fp.facts
                    have.origin = "import"
            s.flush()
            wanted = sorted({rec.key.fingerprint for rec in doc.profiles})
            known = {h for i in range(0, len(wanted), _IN_BATCH) for h in
                     s.scalars(select(Fingerprint.hash).where(Fingerprint.hash.in_(wanted[i:i + _IN_BATCH])))}
            stored = _StoredRows(s, known)
            completed: dict[str, dict[str, Any]] = {}
            for rec in doc.profiles:
                if rec.key.fingerprint not in known:
                    store._ensure_fingerprint(s, rec.key.fingerprint, ts, "import")
                    known.add(rec.key.fingerprint)
                    result.fingerprints += 1
                rows = stored.of(rec.key)
                # hashed once a record, not once a row; a row stored before knobs.HASHED_LATE_KNOBS holds the older form
                hashes = stored_profile_hashes(rec.key, rec.knobs)
                same = _already_stored([r for r in rows if r.profile_hash in hashes], rec)
                if same is not None:
                    filled, differs = _fill_in(s, same, rec)
                    if filled:
                        completed[str(same.id)] = filled
                        result.completed += 1
                    else:
                        result.skipped += 1
                    if differs:
                        result.differing.append(f"profile {same.id} ({_key_text(rec.key)}): {differs}; kept as stored")
                    continue
                row = row_from_record(rec, ts, keep_times=True)
                old, decision = None, None
                if rec.status == "current":
                    old = next((r for r in rows if r.status == "current"), None)
                    if old is not None:
                        decision = decide(old, rec, newer=is_newer(rec, old.updated))
                        if decision.replace:
                            s.execute(update(Profile).where(Profile.id == old.id).values(status="superseded", updated=ts))
                            old.status = "superseded"
                            result.replaced += 1
                        else:
                            row.status = "superseded"
                            result.kept_superseded += 1
                s.add(row)
                s.flush()
                stored.add(s, rec.key, row.id)
                if old is not None and decision is not None:
                    ev = replacement_event(old, rec, row.id, decision, ts)
                    if ev is not None:
                        s.add(ev)
                result.inserted += 1
                result.current += row.status == "current"
            if completed:  # what was written into rows that existed, and from where
                s.add(Event(created=ts, kind="import_completed", details={"source": source, "profiles": completed},
                            reason=f"import of {source} filled in the routing / performance environment / "
                                   f"runtime options of "
                                   f"{len(completed)} stored profile(s) that had lost it (the same measurement: "
                                   "key, knobs, creation date, numbers, backend and label all equal)"))
    except IntegrityError as e:
        raise ProfileImportError(f"{source}: rejected by the database, nothing imported: {e.orig}") from None
    return result


def _instant(text: str) -> _dt.datetime | str:
    """A stored or imported date as the instant it names (`...+00:00` and `...Z` alike); unparsable: the text."""
    try:
        return _dt.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return text


def _json_text(text: str | None) -> Any:
    try:
        return msgspec.json.decode(text) if text is not None else None
    except msgspec.DecodeError:
        return text  # a corrupt stored column: equal to nothing an import brings


_IN_BATCH = 500  # values in one IN (...): SQLite builds limited to 999 bound parameters exist

# what an import compares a record with: the gate's view of a row (`current_of`'s columns) and the columns
# `_already_stored` matches on, JSON ones as the text stored
_STORED_COLUMNS = (Profile.id, Profile.status, Profile.profile_hash, Profile.created, Profile.latency_us,
                   Profile.spread_us, Profile.backend, Profile.provenance, Profile.measured_on, Profile.routing,
                   Profile.updated, type_coerce(Profile.knobs, String).label("knobs"),
                   type_coerce(Profile.perf_env, String).label("perf_env"),
                   type_coerce(Profile.runtime_options, String).label("runtime_options"),
                   Profile.runtime_options_digest,
                   type_coerce(Profile.software_versions, String).label("software_versions"))


class _StoredRows:
    """The rows of the import's fingerprints, read once, and the rows the import adds, by key: two queries a record
    (already stored? the current one?) took ~5 ms each, mostly building their twelve-column filters (4,000 records:
    ~50 s, holding the write lock)."""

    def __init__(self, s: Any, fingerprints: set[str]) -> None:
        self._by_key: dict[tuple, list[Any]] = {}
        key_cols = [getattr(Profile, c) for c in PROFILE_KEY_COLUMNS]
        names = sorted(fingerprints)
        for i in range(0, len(names), _IN_BATCH):
            for row in s.execute(select(*key_cols, *_STORED_COLUMNS).where(
                    Profile.fingerprint.in_(names[i:i + _IN_BATCH]))):
                d = row._asdict()
                self._by_key.setdefault(tuple(d.pop(c) for c in PROFILE_KEY_COLUMNS), []).append(_Row(**d))
        self._one = select(*_STORED_COLUMNS).where(Profile.id == bindparam("pid"))

    def of(self, key: ProfileKey) -> list[Any]:
        return self._by_key.setdefault(tuple(getattr(key, c) for c in PROFILE_KEY_COLUMNS), [])

    def add(self, s: Any, key: ProfileKey, row_id: int) -> None:
        """A row just inserted (flushed), as the database returns it (its JSON as stored)."""
        self.of(key).append(_Row(**s.execute(self._one, {"pid": row_id}).one()._asdict()))


class _Row(SimpleNamespace):
    """One stored row's compared columns; `status` follows the import's own replacements."""


def _already_stored(rows: list[Any], rec: ProfileRecord) -> Any:
    """The row of the database that holds `rec` already, else None (`rows`: the stored rows of its key and knobs): the same key and
    knobs created at the same instant (spelled as the file spells it or not) with the same numbers (a tune stamped
    to the second stored a re-measurement of the same knobs in the same second as the row it replaced: the two
    differ in their numbers only). A record without `created` (the format allows leaving it out) was stamped with
    the time of the import that stored it, so it is matched on everything else it says: numbers, backend,
    provenance, measured_on, routing, performance environment, runtime options and software versions (not its status,
    which the replacement gate decided)."""
    if rec.created:
        when, nums = _instant(rec.created), (float(rec.latency_us), float(rec.spread_us))
        return next((row for row in rows if _instant(row.created) == when and (row.latency_us, row.spread_us) == nums),
                    None)
    says = (float(rec.latency_us), float(rec.spread_us), rec.backend, str(rec.provenance), rec.measured_on,
            canonical_routing(rec.tuned_routing), rec.tuned_perf_env, rec.tuned_runtime_options,
            dict(rec.software_versions))
    return next((
        row for row in rows
        if (row.latency_us, row.spread_us, row.backend, row.provenance, row.measured_on, row.routing or "",
            _json_text(row.perf_env), _json_text(row.runtime_options), _json_text(row.software_versions)) == says
    ), None)


def _fill_in(s: Any, row: Any, rec: ProfileRecord) -> tuple[dict[str, Any], str]:
    """For `rec` already stored as `row`: write into the row the routing / perf_env / runtime options the record
    carries and the row lacks (a downgrade below 0005/0006/0009 and back dropped them); returns (the fields written,
    what differs).

    Only into an empty column, and only where the row is the record's measurement beyond `_already_stored`'s match
    (backend, provenance and measured_on equal too): a row measured later has another creation date or other
    numbers and is never matched, and a value a row records is never replaced (a different one is said, not
    written). The row's `updated` stays: it dates the numbers, which did not change."""
    if (row.backend, row.provenance, row.measured_on) != (rec.backend, str(rec.provenance), rec.measured_on):
        return {}, ""
    filled: dict[str, Any] = {}
    differs: list[str] = []
    routing = canonical_routing(rec.tuned_routing)
    if routing and not row.routing:
        filled["routing"] = routing
    elif routing and row.routing != routing:
        differs.append(f"routing {row.routing!r} stored, {routing!r} in the file")
    env, have = rec.tuned_perf_env, _json_text(row.perf_env)
    if env is not None and have is None and row.provenance == "measured":
        filled["perf_env"] = env
    elif env is not None and have is not None and have != env:
        differs.append("another performance environment stored than the file's")
    opts, stored = rec.tuned_runtime_options, _json_text(row.runtime_options)
    if opts is not None and stored is None and row.provenance == "measured":
        filled["runtime_options"] = opts
        filled["runtime_options_digest"] = rec.runtime_options_digest
    elif opts is not None and stored is not None and stored != opts:
        differs.append("other runtime options stored than the file's")
    if filled:
        done = s.execute(update(Profile).where(Profile.id == row.id, *_empty(filled)).values(**filled))
        if done.rowcount != 1:  # changed under us: nothing said as filled that was not
            return {}, "; ".join(differs)
        row.routing = filled.get("routing", row.routing)
        if "perf_env" in filled:
            row.perf_env = msgspec.json.encode(env).decode()
        if "runtime_options" in filled:
            row.runtime_options = msgspec.json.encode(opts).decode()
            row.runtime_options_digest = filled["runtime_options_digest"]
    return filled, "; ".join(differs)


def _empty(fields: dict[str, Any]) -> list[Any]:
    """The conditions that the columns `fields` names are still empty (never overwrite a recorded value)."""
    return [Profile.routing == "" if f == "routing" else getattr(Profile, f).is_(None) for f in fields]


def import_profiles(store: Store, path: str | Path, *, skip_invalid: bool = False,
                    check_facts: FactsCheck | None = None) -> ImportResult:
    path = Path(path)
    if _is_own_file(store, path):  # refused unopened: closing a file of it would drop the store's SQLite locks
        raise ProfileImportError(f"refusing to import {path}: it is (a file of) the database {store.path}, not a "
                                 "file written by `moetune profiles export`")
    try:
        data = read_import(path)
    except OSError as e:
        raise ProfileImportError(f"cannot read {path}: {e.strerror or e}") from None
    return import_bytes(store, data, source=str(path), skip_invalid=skip_invalid, check_facts=check_facts)
