"""`moetune db`: The profile database: migrations, checks, where it is."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from moetune.tuner.cli._args import path_option
from moetune.tuner.store.lock_files import lock_holder

app = typer.Typer(help="The profile database: migrations, checks, where it is.", no_args_is_help=True)

# Help text is Rich markup: escape() keeps "[store]" from being read as a tag and vanishing.
# a config's `db = ""` is the documented default (docs/settings.md: a later file resets an earlier one's value), not
# "no database" as `--db ""` would be (refused): the help says both
DB_HELP = escape("Database file (default: [store] db from the config, else $MOETUNE_HOME/moetune.db, else the XDG data "
                 "dir; a config's db = \"\" means this default too, while --db \"\" is refused).")
CONFIG_HELP = ("Extra config file, read after /etc/moetune/moetune.toml and ~/.config/moetune/moetune.toml "
               "($XDG_CONFIG_HOME/moetune/moetune.toml where that is set).")

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a red error (no traceback) and return the Exit to raise. The message is plain text: paths and
    names from the user (`[/x].json`, "[gpu]") are escaped, never read as Rich markup."""
    err.print(f"[red]error:[/red] {escape(message)}", markup=True, soft_wrap=True)
    return typer.Exit(code)


def abort(message: str, code: int = 2) -> NoReturn:
    """`raise fail(message)` as a call, for helpers whose callers read on as if it returned nothing."""
    raise fail(message, code)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def db_path(db: Path | None, config: Path | None) -> Path:
    """The database a command opens: --db, else the configured one. A --config that is given is read (its errors
    reported, exit 2) even where --db makes it unneeded: `db current --db X --config <garbage>` ignored the file and
    exited 0, while without --db the same file is refused, as by the commands that read other settings from it."""
    from moetune.runtime.config import ConfigError, load_config, resolve_db_path

    try:
        if db is not None and config is not None:
            load_config(config)
        return resolve_db_path(db, config)
    except ConfigError as e:
        raise fail(str(e)) from None


# How a command opens the database:
#   read     an existing moetune database at head, read-only: never created, migrated nor re-upgraded
#            (a `db downgrade` stays done until `db upgrade`);
#   write    an existing moetune database, upgraded to head;
#   create   as write, and a missing path or an empty file becomes a new database;
#   inspect  an existing file at any revision, read-only, schema not checked (`db current`, `db check`);
#   migrate  an existing moetune database, schema not checked (`db downgrade`);
#   init     any path, schema not checked (`db upgrade` creates and migrates it explicitly).
# Only init and migrate may touch another program's SQLite file, and migrate refuses to. The writing modes (write,
# create, init, migrate) scan an existing file first (`intact`): a damaged one is refused (StoreDamaged: the file,
# `moetune db check`, a backup or `sqlite3 .recover`) before anything, a migration step included, writes to it.
OpenMode = Literal["read", "write", "create", "inspect", "migrate", "init"]


def _open(path: Path, mode: OpenMode) -> Any:
    from moetune.tuner.store.db_file import probe_database
    from moetune.tuner.store.store import Store

    if mode == "read":
        return Store.open_existing(path)
    if mode in ("write", "create"):
        return Store.open_existing(path, write=True, create=mode == "create")
    if mode == "init":  # intact: a migration step writes (and copies tables) like any other write
        return Store(path, upgrade=False, intact=True)
    kind, _rev = probe_database(path)
    if kind == "missing":
        raise fail(f"no database at {path}")
    if mode == "inspect":
        return Store(path, readonly=True, check_schema=False)
    if kind != "moetune":  # a downgrade would add moetune's version table to it
        raise fail(f"{path} is not a moetune database")
    return Store(path, upgrade=False, intact=True)  # migrate: a downgrade writes, as an upgrade does


def say_upgraded(store: Any) -> None:
    """On stderr, where opening `store` upgraded an older database (an older moetune sharing it cannot open it now);
    nothing for a new database."""
    up = getattr(store, "upgraded", None)
    if up is not None and up.from_revision not in (None, "base"):
        err.print(escape(f"upgraded {store.path} from schema revision {up.from_revision} to {up.to_revision} (an "
                         "older moetune sharing this file cannot open it any more)"))


# A read command (profiles list/show/export, report, query, fabric diff) scans the file it reads with SQLite's
# quick_check and warns where it fails: a writer refuses a damaged file, a reader reads on (what a damaged page still
# gives), but never silently. The scan costs ~1 ms a MB on a warm cache (0.5 ms for a small database, 60 ms for 60 MB):
# past this size it is left to `moetune db check`.
READ_CHECK_MAX_BYTES = 256 * 1024 * 1024


def warn_if_damaged(store: Any) -> bool:
    """On stderr, where the database `store` reads fails SQLite's quick check; True when it does."""
    from moetune.tuner.store.store import StoreError

    path = Path(store.path)
    try:
        if getattr(store, "memory", False) or not path.is_file() or path.stat().st_size > READ_CHECK_MAX_BYTES:
            return False
        found = store.quick_check()
    except StoreError as e:  # a check SQLite cannot finish on a damaged page says so itself
        found = [str(e)]
    except OSError:  # gone or unreadable: the read itself says so
        return False
    if found == ["ok"]:
        return False
    # one line: SQLite's answer spans lines ("*** in database main ***", then a line a problem)
    why = "; ".join(ln.strip() for f in found for ln in str(f).splitlines() if ln.strip() and not ln.startswith("***"))
    why = why if len(why) <= 200 else why[:199] + "…"
    err.print(escape(f"warning: {path} failed SQLite's integrity check ({why}): what this command "
                     f"reads of it may be incomplete; `moetune db check{db_flag(path)}` names the damage; restore the "
                     f"file from a backup (or recover its rows with `sqlite3 {path} .recover`)"))
    return True


def warn_if_damaged_path(path: Path) -> bool:
    """`warn_if_damaged` for a database a command read by path (`query`'s fallback read); nothing for a file that is
    missing or not a moetune database (the command says that itself)."""
    from moetune.tuner.store.store import Store, StoreError

    if not path.is_file():
        return False
    try:
        with Store(path, readonly=True, check_schema=False) as store:
            return warn_if_damaged(store)
    except (StoreError, OSError):
        return False


def _open_daemon_lock(path: str | Path) -> tuple[Path, int | None, OSError | None]:
    """(the lock a daemon serving `path` holds, an fd of it opened read-only (flock needs no write access; a link is
    not followed) or None, why it could not be opened: None where there is none, so none served yet)."""
    from moetune.tuner.store.db_file import daemon_lock_path

    lock = daemon_lock_path(path)
    try:
        return lock, os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), None
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: its folder is a file (no daemon there either)
        return lock, None, None
    except OSError as e:  # another user's, or a planted link: a daemon would refuse it too
        return lock, None, e


def serving_daemon(path: str | Path) -> int | None:
    """The pid of a daemon serving the database `path` now: its lock (`daemon_lock_path`) held and its pid written in
    it; None when none serves, or that cannot be told. A daemon reads the profiles into memory when it starts and when
    one of its re-tune jobs ends (there is no reload request): a command that changes them under it says so."""
    import fcntl

    _lock, fd, _why = _open_daemon_lock(path)  # not ours to read: no_daemon_serving warns of it
    if fd is None:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released at once (close): only a probe
        except OSError:
            return lock_holder(fd)
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def no_daemon_serving(path: Path, hint: str = "") -> Iterator[None]:
    """Hold the lock a daemon serving `path` holds (taken without waiting) while a migration runs: a daemon kept
    querying the old schema ("no such column") and never rebuilt its index. Exit 1 when one holds it (`hint` ends the
    message). The lock file is not created here: one of ours would keep another user's daemon from taking it; none
    there, none served yet."""
    import fcntl

    lock, fd, why = _open_daemon_lock(path)
    if why is not None:
        err.print(escape(f"warning: cannot tell whether a daemon serves {path}: cannot open its lock {lock}: "
                         f"{'it is a symbolic link' if os.path.islink(lock) else why.strerror or why}"))
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = lock_holder(fd)
            if pid is not None:
                raise fail(f"daemon pid {pid} is serving this database ({path}); stop it first{hint}", 1) from None
            raise fail(f"another moetune process holds {lock} (a daemon starting, a migration of {path}, or a "
                       "`profiles import` or `delete` into it); try again when it has ended", 1) from None
        yield
    finally:
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def open_store(db: Path | None, config: Path | None, *, mode: OpenMode,
               own: tuple[type[Exception], ...] = (), no_daemon: str | None = None) -> Iterator[Any]:
    """Open the store for a command (see OpenMode); errors become a red message and the error's exit status (2: the
    database or the input is wrong; 1: another process holds it, or this user may not write it). `own`: errors the
    command reports itself, raised as they are. The migrating modes (init, migrate), and any mode given `no_daemon`
    (the end of the refusal: what else the user may do), refuse a database a daemon serves and keep one from starting
    on it until the command ends."""
    path = db_path(db, config)
    guarded = mode in ("init", "migrate") or no_daemon is not None
    with (no_daemon_serving(path, no_daemon or "") if guarded else contextlib.nullcontext(),
          _open_store(path, mode, own) as store):
        yield store


@contextlib.contextmanager
def _open_store(path: Path, mode: OpenMode, own: tuple[type[Exception], ...]) -> Iterator[Any]:
    from moetune.tuner.store.store import StoreError

    try:
        store = _open(path, mode)
    except own:
        raise
    except StoreError as e:
        raise fail(str(e), e.exit_code) from None
    say_upgraded(store)
    if mode == "read":  # writers refused a damaged file when they opened it (intact); a reader warns
        warn_if_damaged(store)
    try:
        yield store
    except own:
        raise
    except StoreError as e:
        raise fail(str(e), e.exit_code) from None
    finally:
        store.close()


def db_flag(path: Path) -> str:
    """` --db PATH` (shell-quoted) for a suggested command, so that it acts on this database; empty when PATH is the
    database a plain command uses (no --db, no --config). Named whenever that cannot be told: a --config naming
    another database would otherwise send the suggestion to the default one."""
    from moetune.runtime.config import ConfigError, resolve_db_path
    from moetune.tuner.store._schema import db_option

    try:
        default = resolve_db_path(None, None)
        if default.expanduser().resolve() == Path(path).expanduser().resolve():
            return ""
    except (ConfigError, OSError, RuntimeError):
        pass
    return db_option(path)


def _older_than(current: str, target: str) -> bool:
    """Whether revision `target` ("base" or a revision id) is below `current`, the database's (an ancestor of it):
    an upgrade to it is a downgrade, which Alembic's upgrade silently skips."""
    from alembic.script import ScriptDirectory

    from moetune.tuner.store._schema import alembic_config, known_revisions

    if current not in known_revisions():
        return False  # a newer moetune's revision: the migration refuses it with its own message
    if target == "base":
        return True
    script = ScriptDirectory.from_config(alembic_config())
    try:
        below = {sc.revision for sc in script.iterate_revisions(current, "base")} - {current}
        rev = script.get_revision(target)
    except Exception:  # an unknown or relative revision: the upgrade itself says what is wrong
        return False
    return rev is not None and rev.revision in below


def _check_revision(revision: str, what: str, also: tuple[str, ...]) -> None:
    """Exit 2 unless `revision` is a revision id this moetune knows or one of `also` ("base", "head"): Alembic said
    "Can't locate revision identified by 'nope'" and named none of the valid ones."""
    from moetune.tuner.store._schema import known_revisions

    ids = sorted(known_revisions())
    if revision in ids or revision in also:
        return
    choices = [*ids, *also]
    raise fail(f"{what} {revision!r} is not a schema revision of this moetune: give one of "
               f"{', '.join(choices[:-1])} or {choices[-1]} (`moetune db current` shows the database's revision and "
               "the newest)")


@app.command("path")
def path_cmd(
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Print the database path moetune uses."""
    typer.echo(str(db_path(db, config)))


def _upgrade_to_base_of_nothing(path: Path) -> None:
    """`db upgrade --revision base` where there is no database or no moetune table: already there, exit 0. Opening
    it would create the file (or add moetune's version table to an empty one) to say so."""
    from moetune.tuner.store.db_file import probe_database
    from moetune.tuner.store.store import StoreError

    try:
        kind, rev = probe_database(path)
    except StoreError as e:
        raise fail(str(e), e.exit_code) from None
    if kind == "missing":
        out.print(escape(f"{path}: no database there: nothing to do for revision base (no moetune tables); "
                         "nothing created"))
        raise typer.Exit(0)
    if kind == "empty" or (kind == "moetune" and rev is None):
        out.print(escape(f"{path}: already at revision base (no moetune tables): nothing to do"))
        raise typer.Exit(0)


@app.command()
def upgrade(
    revision: str = typer.Option("head", "--revision", help="Target revision."),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Create the database or migrate it to the newest schema (or up to --revision)."""
    from moetune.tuner.store.db_file import ONLY_OPTUNA, without_moetune
    from moetune.tuner.store.store import StoreError

    _check_revision(revision, "--revision", ("head", "base"))
    if revision == "base":
        _upgrade_to_base_of_nothing(db_path(db, config))

    optuna = without_moetune(db_path(db, config)) == ONLY_OPTUNA
    with open_store(db, config, mode="init") as store:
        before = store.current_revision()
        if before is not None and revision != "head" and _older_than(before, revision):
            raise fail(f"{store.path} is at revision {before}, newer than {revision}: an upgrade does not go down; "
                       f"to roll back run `moetune db downgrade {revision} --yes{db_flag(store.path)}`")
        try:
            store.upgrade(revision)
        except StoreError:
            raise  # says what is wrong itself (e.g. a newer moetune's database); open_store prints it
        except Exception as e:  # alembic raises several kinds for a bad revision
            raise fail(f"upgrade of {store.path} to {revision} failed: {e}") from None
        after = store.current_revision()
        if before == after:
            out.print(escape(f"{store.path}: already at revision {after or 'base'}"))
        elif before is None and optuna:  # a studies file moetune tune --storage made: Optuna's tables are kept
            out.print(escape(f"{store.path}: added moetune's tables (revision {after}) to this Optuna studies file; "
                             "its studies are untouched"))
        else:
            out.print(escape(f"{store.path}: upgraded {before or 'empty'} -> {after}"))


@app.command()
def downgrade(
    revision: str = typer.Argument(..., help='Target revision: a revision id, 0001 up to the newest (`moetune db '
                                  'current` shows the database\'s and the newest one), or "base" (drops every moetune '
                                  'table).'),
    yes: bool = typer.Option(False, "--yes", help="Do it (a downgrade can drop data)."),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Migrate the schema down (for rolling back a moetune upgrade)."""
    _check_revision(revision, "revision", ("base",))
    if not yes:
        raise fail("a downgrade can drop data: pass --yes to do it")
    from moetune.tuner.store._schema import known_revisions
    from moetune.tuner.store.store import StoreError

    with open_store(db, config, mode="migrate") as store:
        now = store.current_revision()
        if now == revision or (now is None and revision == "base"):
            out.print(escape(f"{store.path}: already at revision {now or 'base'}: nothing to do"))
            return
        if revision != "base" and (now is None or now in known_revisions()) and not _older_than(now or "", revision):
            # Alembic: "Destination 0006 is not a valid downgrade target from current head(s)"
            raise fail(f"{store.path} is at revision {now or 'base (no moetune tables)'}; {revision} is above it: a "
                       f"downgrade only goes down; `moetune db upgrade --revision {revision}{db_flag(store.path)}` "
                       "goes up")
        try:
            store.downgrade(revision)
        except StoreError:
            raise  # says what is wrong itself; open_store prints it
        except Exception as e:  # broad: the CLI's boundary; Alembic and the database fail in many types
            raise fail(f"downgrade of {store.path} to {revision} failed: {e}") from None
        out.print(escape(f"{store.path}: at revision {store.current_revision() or 'base'}"))


@app.command()
def current(
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Show the database's schema revision and the newest one this moetune knows."""
    from moetune.tuner.store.db_file import without_moetune
    from moetune.tuner.store.store import head_revision

    with open_store(db, config, mode="inspect") as store:
        rev, head = store.current_revision(), head_revision()
        store.schema.refuse_newer(rev)  # "needs `moetune db upgrade`" would be wrong: this moetune cannot
        info = {"path": str(store.path), "revision": rev, "head": head, "at_head": rev == head}
    if json_out:
        print_json(info)
    else:
        state = "up to date" if rev == head else "needs `moetune db upgrade`"
        if rev is None:  # no moetune tables: as `profiles list` and `db check` say it
            what = without_moetune(Path(info["path"]))
            state = f"no moetune tables{f' ({what})' if what else ''}: {state}"
        out.print(escape(f"{info['path']}: revision {rev or 'none'} (head {head}): {state}"))


@app.command()
def check(
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Check revision, schema drift, SQLite integrity, foreign keys, profile rows this moetune cannot read and rows labelled measured whose backend does not measure or that no run of this runtime can take (listed by id); exit 1 when anything is off, 2 on a newer moetune's database."""
    from moetune.tuner.store.db_file import without_moetune

    path = db_path(db, config)
    what = without_moetune(path)
    if what is not None:  # said as `profiles list` says it, not as "NOT OK ... revision none"
        from moetune.tuner.store.store import head_revision

        why = (f"not a moetune database ({what}): no moetune tables yet; `moetune db upgrade"
               f"{db_flag(path)}` adds them")
        if json_out:
            print_json({"path": str(path), "revision": None, "head": head_revision(), "at_head": False,
                        "moetune_tables": False, "ok": False, "problem": why})
        else:
            out.print(f"{escape(str(path))}: [red]NOT OK[/red]")
            out.print(escape(f"  {why}"))
        raise typer.Exit(1)
    from moetune.tuner.store.store import StoreDamaged, StoreNotDatabase

    try:  # a file SQLite cannot read as a database is "off" as a damaged one is: NOT OK, exit 1 (it exited 2)
        with open_store(db, config, mode="inspect", own=(StoreDamaged, StoreNotDatabase)) as store:
            store.schema.refuse_newer(store.current_revision())  # not "NOT OK": a newer moetune's schema is not drift
            info = store.check()
    except (StoreDamaged, StoreNotDatabase) as e:  # SQLite could not even read what the check starts from: that is the check's answer
        info = {"path": str(path), "revision": None, "head": None, "at_head": False, "integrity": [str(e)],
                "foreign_key_errors": 0, "schema_diff": [], "unreadable_profiles": None,
                "mislabelled_profiles": None, "contradicting_profiles": None,
                "unrunnable_measured_profiles": None, "ok": False}
        if json_out:
            print_json(info)
        else:
            out.print(f"{escape(str(path))}: [red]NOT OK[/red]")
            out.print(escape(f"  integrity: {e}"))
        raise typer.Exit(1) from None
    if json_out:
        print_json(info)
    else:
        mark = "[green]ok[/green]" if info["ok"] else "[red]NOT OK[/red]"
        out.print(f"{escape(info['path'])}: {mark}")
        out.print(escape(f"  revision {info['revision'] or 'none'} (head {info['head']})"
                         + ("" if info["revision"] else ": no moetune tables (`moetune db downgrade base` dropped "
                            f"them?); `moetune db upgrade{db_flag(Path(info['path']))}` makes them")))
        out.print(escape(f"  integrity: {', '.join(info['integrity'])}"))
        if info["integrity"] != ["ok"]:
            # every command that writes the store scans it when it opens it (Store(intact=True)) and refuses it
            out.print(escape(f"  the file is damaged: the commands that write it refuse it (tune, profile, serve, "
                             f"profiles import/delete, fabric show --record, db upgrade/downgrade), the commands that "
                             f"read it warn (profiles list/show/export, report, query, fabric diff); restore it from "
                             f"a backup (or recover its rows with `sqlite3 {info['path']} .recover`)"))
        out.print(f"  foreign key errors: {info['foreign_key_errors']}")
        for d in info["schema_diff"]:
            out.print(escape(f"  schema differs: {d}"))
        bad = info["unreadable_profiles"]
        if bad:  # every read skips them; kept until removed on purpose
            out.print(escape(f"  unreadable profile rows: {len(bad)} (skipped by every read; `moetune profiles delete "
                             f"ID{db_flag(Path(info['path']))}` removes one)"))
            for row in bad:
                out.print(escape(f"    profile {row['id']}: {row['error']}"))
        for row in info["mislabelled_profiles"] or []:  # the runtime, lookups, the gate, list/show/export take it as modelled
            if row.get("provenance") == "node_model":  # a preset's or another node's model: taken as a preset
                out.print(escape(f"  profile {row['id']}: labelled node_model, but its backend {row['backend']!r} is "
                                 "not this node's model: moetune takes it as a PRESET (a hand edit, or an import by an "
                                 "older moetune?)"))
                continue
            if str(row.get("backend", "")).startswith("local:"):  # a measuring backend: its key is a preset's
                out.print(escape(f"  profile {row['id']}: labelled measured, but its key's fingerprint is a what-if "
                                 "preset's (a modelled fabric, on which nothing is measured): moetune takes it as a "
                                 "PRESET (an import by an older moetune?)"))
                continue
            out.print(escape(f"  profile {row['id']}: labelled measured, but its backend {row['backend']!r} does not "
                             "measure: moetune takes it as MODELLED (a hand edit?)"))
        for row in info.get("contradicting_profiles") or []:  # an auto layer runs the engine it names, under this key
            out.print(escape(f"  profile {row['id']}: its knobs or key contradict its family ({row['error']}): today's "
                             f"store refuses such a row (an import by an older moetune?); `moetune profiles delete "
                             f"{row['id']}{db_flag(Path(info['path']))}` removes it"))
        for row in info.get("unrunnable_measured_profiles") or []:  # nothing can have measured it; autoload passes over
            out.print(escape(f"  profile {row['id']}: labelled measured, but no run of this runtime can take it "
                             f"({row['error']}): today's store refuses such a row (an import by an older moetune?); "
                             f"`moetune profiles delete {row['id']}{db_flag(Path(info['path']))}` removes it"))
    if not info["ok"]:
        raise typer.Exit(1)
