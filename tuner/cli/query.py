"""Top-level `moetune query`: the tuned profile for a model, EP size and token count.

Asks the daemon; when it does not answer, reads the database read-only (the same fallback chain the
runtime uses: daemon -> read-only database -> policy defaults) and says where the answer came from.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import typer

from moetune.runtime.config import MAX_CLIENT_TIMEOUT_MS
from moetune.tuner.cli._args import path_option, text_option
from moetune.tuner.cli._help import examples

if TYPE_CHECKING:
    from moetune.runtime.config import Config
    from moetune.runtime.profiles.client import Resolution


# a client's --socket "" (query, status, retune) was taken for the configured endpoint (`socket or cfg.client.socket`)
SOCKET_EMPTY = "an empty endpoint names no daemon (leave the option out for the configured one)"


def _config(config: Path | None) -> Config:
    from moetune.tuner.daemon.server import _load_config

    try:
        return _load_config(config)
    except ValueError as e:
        typer.secho(f"moetune: {e}", fg="red", err=True)
        raise typer.Exit(2) from None


def check_socket(endpoint: str, where: str, *, bind: bool = False) -> None:
    """Exit 2 naming `where` (the option or config key) unless `endpoint` is ipc:///absolute/path or
    tcp://HOST:PORT (`paths.endpoint_problem`: a client's, or with `bind` a daemon's): ZeroMQ would answer anything
    else with a bare "Invalid argument" traceback."""
    from moetune.runtime.paths import endpoint_problem
    from moetune.tuner.cli.db import fail
    from moetune.tuner.daemon.endpoints import long_socket_hint

    # inproc:// is left out for `serve` too: no daemon of another process is reachable there
    if not endpoint.startswith(("ipc://", "tcp://")):
        raise fail(f"invalid {where} {endpoint!r}: expected ipc:///absolute/path or tcp://HOST:PORT")
    why = endpoint_problem(endpoint, bind=bind)  # a relative path, a bad port, too long a path; tcp://* for a client
    if why is not None:
        raise fail(f"invalid {where} {endpoint!r}: {why}{long_socket_hint(endpoint, where)}")


def check_timeout_ms(timeout_ms: int | None) -> None:
    """Exit 2 unless the --timeout-ms given is positive (0 or less used to be coerced silently)."""
    from moetune.tuner.cli.db import fail

    if timeout_ms is not None and not 1 <= timeout_ms <= MAX_CLIENT_TIMEOUT_MS:  # zmq's poll takes a C int
        raise fail(f"--timeout-ms must be 1 to {MAX_CLIENT_TIMEOUT_MS} (milliseconds: up to a day), got {timeout_ms}")


def check_db_given(db: Path) -> None:
    """Exit 2 when the --db given is a file but no moetune database (empty, an Optuna studies file, another program's
    SQLite file, not SQLite): the read-only fallback said "no such table: fingerprints" and answered the defaults.
    A --db that does not exist is refused too (a typo in the path answered the policy defaults, exit 0), and so is
    one a newer moetune wrote (an unknown schema revision: the fallback read nothing and answered the defaults, exit
    0, where every other command exits 2 on it); only with no --db is a missing database left to the fallback (the
    defaults, saying there is no database). A busy one is left to the fallback. One this client does not trust (others
    can write it or its folder, or it is another user's: `paths.untrusted_file_reason`, the fallback database's rule)
    is refused before SQLite opens it: the probe below would parse pages whoever may write it controls."""
    from moetune.runtime.paths import untrusted_file_reason
    from moetune.tuner.cli.db import fail
    from moetune.tuner.store._schema import db_option
    from moetune.tuner.store.db_file import probe_database, without_moetune
    from moetune.tuner.store.store import StoreError

    if not db.exists():
        raise fail(f"--db {db} does not exist (give a moetune database: `moetune db path` prints the configured one; "
                   "without --db the lookup falls back to the policy defaults when there is no database)")
    if (untrusted := untrusted_file_reason(db)) is not None:
        raise fail(f"--db {db} is a database this client does not trust ({untrusted}): not opened; give one only "
                   "you (or root) can write, in a folder others cannot write")
    try:
        kind, rev = probe_database(db)
    except StoreError as e:
        if e.exit_code != 2:  # busy, changed under the read: nothing wrong with what was given
            return
        raise fail(f"--db {e} (give a moetune database: `moetune db path` prints the configured one)") from None
    if kind == "empty":
        raise fail(f"--db {db} is not a moetune database ({without_moetune(db) or 'it is empty'}): "
                   f"`moetune db upgrade{db_option(db)}` makes it one, `moetune tune` fills it; "
                   "`moetune db path` prints the configured database")
    if kind == "foreign":
        raise fail(f"--db {db} is not a moetune database (another program's SQLite file): give moetune's, as "
                   "`moetune db path` prints it")
    from moetune.tuner.store._schema import head_revision, known_revisions

    if kind == "moetune" and rev is not None and rev not in known_revisions():
        raise fail(f"--db {db} is at schema revision {rev}, written by a newer moetune (this one knows up to "
                   f"{head_revision()}): upgrade moetune on this node, or give a database this moetune can read")


def check_family(family: str, ep: int, nodes: int) -> None:
    """Exit 2 unless `family` is one moetune names (as a stored key's: `proxy:libfabric/PROVIDER` for any provider)
    and, for the megakernel, the EP size and nodes are its one GPU's."""
    from moetune.runtime.profile_record import MEGAKERNEL_FAMILY
    from moetune.tuner.store.validate import KNOWN_FAMILIES, is_known_family, printable

    if not is_known_family(family):
        raise typer.BadParameter(f"unknown family {printable(family[:64])!r} (known: {', '.join(sorted(KNOWN_FAMILIES))}, "
                                 "proxy:libfabric/PROVIDER)", param_hint="--family")
    if family == MEGAKERNEL_FAMILY and (ep, nodes) != (1, 1):
        raise typer.BadParameter(f"megakernel profiles are for one GPU (--ep 1, --nodes 1), got --ep {ep} --nodes "
                                 f"{nodes}", param_hint="--family")


def _client_socket_origin(cfg: Any) -> str:
    """Where the client's endpoint came from, as an error names it: client.socket where a file or variable set it;
    else the daemon's socket it inherits (`status` named `client.socket (config)` for a MOETUNE_DAEMON_SOCKET the
    user set, a key the user never touched)."""
    if cfg.configured("client", "socket"):
        return f"client.socket ({cfg.origin_of('client', 'socket')})"
    if cfg.configured("daemon", "socket"):
        return f"daemon.socket ({cfg.origin_of('daemon', 'socket')}; the client's socket while client.socket is unset)"
    return "the default daemon socket (client.socket and daemon.socket unset)"


def make_client(socket: str | None, config: Path | None, timeout_ms: int | None, db: Path | None = None,
                falls_back: bool = False) -> Any:
    """The CLI's profile client. `falls_back` (query): a configured or default endpoint no client can connect to
    is left to the client, which says why and falls back to the database as the runtime does (a deep
    $MOETUNE_HOME's socket path too long for a unix socket made `query` exit 2 where the runtime read the
    database); a --socket given is checked either way."""
    from moetune.runtime.profiles.client import ProfileClient
    from moetune.runtime.profiles.client import log as client_log
    from moetune.tuner.cli.db import fail

    check_timeout_ms(timeout_ms)
    cfg = _config(config)
    endpoint = socket if socket is not None else cfg.client.socket
    where = "--socket" if socket is not None else _client_socket_origin(cfg)
    if socket is not None or not falls_back:
        check_socket(endpoint, where)
    server_key = None
    # the client reads its [client] keys (curve_server_key_file, its own key pair, allow_modelled) from the config
    # chain itself: --config joins that chain as $MOETUNE_CONFIG would, or its [client] section went unread
    env = dict(os.environ, MOETUNE_CONFIG=str(config)) if config is not None else os.environ
    key_file = "" if cfg.client.curve_server_key_file else cfg.daemon.curve_public_key_file  # on the daemon's host
    if endpoint.startswith("tcp://") and key_file:
        from moetune.runtime.profiles.curve_keys import read_curve_key_file

        try:
            server_key, _ = read_curve_key_file(key_file)
        except ValueError as e:  # says "does not exist" of a missing file (zmq: "Invalid certificate file")
            raise fail(f"daemon.curve_public_key_file {key_file} {e}") from None
    # the client logs why it will not connect (a tcp:// endpoint without the daemon's key) and raises the same
    # reason on use, where every command says it: once is enough for a CLI user. Only that record is dropped:
    # the client's other warnings (its own secret key readable by others) must still reach the user.
    client_log.addFilter(_drop_connect_refusal)
    try:
        return ProfileClient(endpoint, timeout_ms=timeout_ms or cfg.client.timeout_ms,
                             curve_server_key=server_key, db_path=db, env=env)  # no --db: the runtime's own rule
    finally:
        client_log.removeFilter(_drop_connect_refusal)


def _drop_connect_refusal(record: logging.LogRecord) -> bool:
    """False for the client's "not connecting to ENDPOINT: why" record (the command reports the same reason)."""
    return not record.getMessage().startswith("moetune: not connecting to ")


def _nothing_at(endpoint: str) -> bool:
    """Whether nothing is at the IPC endpoint's path (no daemon started there); False for TCP and for a path that is
    there or cannot be looked at (another user's folder: starting a daemon would not be the answer)."""
    from moetune.runtime.paths import ipc_path

    p = ipc_path(endpoint)
    if p is None:
        return False
    try:
        os.lstat(p)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def daemon_call(op: str, *, socket: str | None, config: Path | None, timeout_ms: int, json_out: bool = False,
                on_timeout: str = "", **fields: Any) -> Any:
    """The daemon's answer to `op`, else exit 1 saying why: on stderr, or with `json_out` as the one JSON object
    on stdout, {"ok": false, "error": ...} (as `query --json` says in its JSON why the daemon did not answer).
    `on_timeout` is added when the request was sent and no reply came in time, or one came this moetune cannot read
    (a newer daemon's): either way the daemon may have acted (what it may have done).
    Errors in the options given stay usage errors (exit 2), as for every command."""
    from moetune.runtime.profiles.errors import BadReply, DaemonError, DaemonTimeout, DaemonUnavailable

    client = make_client(socket, config, timeout_ms)
    try:
        return client.request(op, **fields)
    except (DaemonUnavailable, DaemonError, BadReply) as e:  # BadReply: a reply that does not validate (a newer daemon?)
        why = (f"the daemon said {e}" if isinstance(e, DaemonError)
               else f"the daemon's reply is not one this moetune reads: {e}" if isinstance(e, BadReply) else str(e))
        # a reply that does not validate still means the daemon received the request (a retune queued first)
        if isinstance(e, (DaemonTimeout, BadReply)) and on_timeout:
            why = f"{why}: {on_timeout}"
        elif isinstance(e, DaemonUnavailable) and _nothing_at(client.endpoint):
            # what is wrong was said, not what to do: a first `moetune status` before any `moetune serve`
            why = (f"{why}; no daemon runs there: start one with `moetune serve` (one serving elsewhere: --socket, "
                   "or [client] socket in the config)")
        if json_out:
            print_json({"ok": False, "error": why})
        else:
            from moetune.tuner.cli._tables import visible

            # the daemon's message: a terminal escape in it is shown, not obeyed
            typer.secho(f"moetune {op}: {visible(why)}", fg="red", err=True)
        raise typer.Exit(1) from None
    finally:
        client.close()


def provenance_of(res: Resolution, db: Path) -> tuple[str, str, str]:
    """(provenance, measured_on, backend) of a resolution: from the reply when it says, else from `db` (the database
    the lookup read: `ProfileClient.fallback_db`); a policy or built-in default is its own kind; "unknown" when
    nothing says. measured_on and backend are the database's row's ("" where it has none that agrees). A database
    the client does not trust (`paths.untrusted_file_reason`: others can write it) is not read: it says nothing."""
    if res.key is None:
        return res.provenance or str(res.source), "", ""
    from moetune.runtime.paths import untrusted_file_reason
    from moetune.tuner.store.store import Store, StoreError

    got = None
    if untrusted_file_reason(Path(db)) is None:  # (when the lookup went there, its fallback warning said why)
        try:
            with Store(db, readonly=True) as store:
                got = store.provenance_of(res.key, res.profile_hash)
        except (StoreError, OSError):
            got = None
    if res.provenance:  # the reply's own measured_on is not taken: from the database, when it agrees, or
        if got is not None and got[0] == res.provenance:
            return got
        # a profile the client applied as tuned: measured on its key's fingerprint, which the client found to be this
        # node's (from the database's facts, or the facts the daemon reported checked against what it reads here)
        return res.provenance, res.key.fingerprint if res.tuned and res.provenance == "measured" else "", ""
    return got if got is not None else ("unknown", "", "")


def preset_note(provenance: str, measured_on: str, backend: str) -> tuple[bool | None, str]:
    """(whether it is the shipped preset's content, a note saying which) for a preset profile: `query` and `profiles
    show`. A preset file's row (`measured_on` preset:NAME[:DIGEST]): `presets.preset_origin`. Another node's calibrated
    model taken as a preset (`model:node:<other fp>`): said so, (False, ...); its measured_on, preset:node:<fp>, names
    no preset file (read as one, NAME "node" and that fingerprint as a content digest). (None, "") for any other
    provenance, or a measured_on that names no preset."""
    from moetune.runtime.profile_record import NODE_MODEL_BACKEND, is_preset_fingerprint

    if provenance != "preset" or not measured_on:
        return None, ""
    if backend.startswith(NODE_MODEL_BACKEND):
        other = backend.removeprefix(NODE_MODEL_BACKEND)
        return False, (f"another node's fabric model taken as a preset: the model calibrated on fingerprint {other}, "
                       "not a preset file, nor this node's model")
    if not is_preset_fingerprint(measured_on):
        return None, ""
    from moetune.tuner.fabric_model.presets import preset_origin

    return preset_origin(measured_on)


PROVENANCE_LABEL = {"measured": "[green]measured[/]", "node_model": "[yellow]MODELLED[/] (node model)",
                    "preset": "[red]PRESET[/] (MODELLED: another machine's model)", "unknown": "[red]UNKNOWN[/]"}
# the table's label of `measured_on`, by provenance: where the numbers come from, said as what they are
MEASURED_ON_LABEL = {"measured": "measured on", "node_model": "modelled by the node model of", "preset": "predicted by"}
# `--format env`: every profile that is not a measurement (defaults are labelled by their source alone).
ENV_LABEL = {"node_model": "MODELLED profile (node model)", "preset": "MODELLED profile (preset, another machine's model)",
             "unknown": "profile of UNKNOWN provenance"}


def shell_comment(text: str) -> str:
    """`text` as one shell comment line: a newline (or any other unprintable character) in it is escaped, as `repr`
    writes it, since a newline would end the comment and make the rest a command of whoever evals the output."""
    return "# " + (text if text.isprintable() else repr(text)[1:-1])


def env_notes(res: Resolution) -> list[str]:
    """What `--format env` says (as shell comments) about the tuned profile's NCCL/NVSHMEM/FI environment and runtime
    options."""
    notes: list[str] = []
    if res.env_status == "differs":
        notes += ["tuned in another NCCL/NVSHMEM/FI environment than this one (not exported, only compared):",
                  *[f"  {d}" for d in res.env_diff]]
    elif res.env_status == "unknown":
        notes.append("the NCCL/NVSHMEM/FI environment this profile was tuned in was not recorded")
    if res.options_status == "unknown":
        notes.append("the runtime options this profile was tuned under were not recorded")
    return notes


def lookup_tokens(tokens: int, family: str | None) -> int:
    """The token count the runtime looks `family`'s profile up for, serving `tokens`: the megakernel layer installs
    one profile per token bucket, looked up for the bucket (MegakernelEngine.resolve, choose_engine), and `tokens`
    may be nearer another stored bucket than its bucket is; an EP buffer looks up its max_tokens itself."""
    from moetune.runtime.profile_record import MEGAKERNEL_FAMILY, nearest_bucket

    return nearest_bucket(tokens) if family == MEGAKERNEL_FAMILY else tokens


def print_json(obj: Any) -> None:
    typer.echo(msgspec.json.encode(obj).decode())


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""

    @app.command("query", epilog=examples(("query",)))
    def query(
        model: str = typer.Option(..., "--model", help="Model name (qwen3-30b, ...) or custom:H,I,E,K[,dtype]."),
        ep: int = typer.Option(..., "--ep", min=1, help="EP size (ranks)."),
        tokens: int = typer.Option(..., "--tokens", help="Tokens per rank (1 to 4194304); the nearest bucket is used."),
        nodes: int = typer.Option(1, "--nodes", min=1, help="Nodes."),
        family: str = typer.Option(None, "--family", help="Only this family's profile: a transport family (collective, nvlink, host_staged, proxy:ibrc, ...) or megakernel (the one-GPU layer's engine, as MoELayer at world 1 looks it up; --ep 1). Default: the transport families, as EPBuffer looks them up."),
        fmt: str = typer.Option(None, "--format", show_default=False, help="table (the default: the knobs, where they came from and why), json (one object) or env (the shell `export` lines a launcher sources: the knobs' variables and MOETUNE_PROFILE_HASH)"),
        json_out: bool = typer.Option(False, "--json", help="Same as --format json (not with another --format)."),
        socket: str = text_option(None, "--socket", empty=SOCKET_EMPTY, help="Daemon endpoint (default: \\[client] socket, else the daemon's \\[daemon] socket: ipc:// daemon.sock in the runtime directory)."),
        db: Path = path_option(None, "--db", help="Database to read when the daemon does not answer (default: the runtime's: $MOETUNE_STORE_DB, else \\[store] db where a config file sets it, else the daemon's database as daemon.json names it, else $MOETUNE_HOME, XDG data dir)."),
        config: Path = path_option(None, "--config", help="TOML config file."),
        timeout_ms: int = typer.Option(None, "--timeout-ms", help=f"Time budget for the whole lookup, in milliseconds, 1 to {MAX_CLIENT_TIMEOUT_MS} (default: \\[client] timeout_ms, 200)."),
    ) -> None:
        """The tuned knobs for a model, EP size and token count (daemon, else the database, else defaults)."""
        from moetune.runtime.shapes import get_model, tokens_per_gpu_problem

        # the token counts `tune` and `model predict` take (0 and 10**20 answered a profile, exit 0)
        bad_tokens = tokens_per_gpu_problem(tokens)
        if bad_tokens:
            raise typer.BadParameter(bad_tokens, param_hint="--tokens")
        if fmt is not None and fmt not in ("table", "json", "env"):
            raise typer.BadParameter("expected table, json or env", param_hint="--format")
        if json_out and fmt not in (None, "json"):  # one output: which one was meant cannot be guessed
            from moetune.tuner.cli.db import fail

            raise fail(f"--json and --format {fmt} conflict (--json is --format json): give one of them")
        fmt = "json" if json_out else fmt or "table"
        try:
            shape = get_model(model)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--model") from None
        if ep % nodes:
            raise typer.BadParameter(f"EP size {ep} is not divisible by {nodes} nodes", param_hint="--ep")
        try:  # `tune` refuses such an EP size: no profile can exist for it, only a meaningless default
            shape.check_ep(ep)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--ep") from None
        if family is not None:
            check_family(family, ep, nodes)
        if db is not None:
            check_db_given(db)
        client = make_client(socket, config, timeout_ms, db, falls_back=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # the client also logs each fallback warning to stderr: the table and JSON say it (`message`), so that
            # copy (one line, hundreds of columns) is dropped there; the env lines do not say it: kept for them
            from moetune.runtime.profiles.client import log as client_log

            said = None if fmt == "env" else \
                (lambda r: r.getMessage() not in {str(w.message) for w in caught})
            if said is not None:
                client_log.addFilter(said)
            try:
                res = client.resolve(model=shape, ep_size=ep, tokens=lookup_tokens(tokens, family), nodes=nodes,
                                     transport_family=family)
            finally:
                if said is not None:
                    client_log.removeFilter(said)
        read = client.fallback_db()  # the database the lookup read (or would have): --db, else the runtime's rule
        client.close()
        if res.source != "daemon":  # the database was read (or meant to be): a damaged one is said, as by every reader
            from rich.markup import escape

            from moetune.runtime.paths import untrusted_file_reason
            from moetune.tuner.cli.db import err, warn_if_damaged_path

            # one the client does not trust was not read, and is not opened to be scanned either: SQLite would parse
            # pages (and a -wal, a shared -shm, locks) whoever may write it controls, read-only or not
            if (untrusted := untrusted_file_reason(Path(read))) is not None:
                err.print(escape(f"warning: {read} is a database this client does not trust ({untrusted}): not "
                                 "read, nor opened to check it for damage"))
            else:
                warn_if_damaged_path(Path(read))
        provenance, measured_on, backend = provenance_of(res, read)
        if fmt == "env":
            from moetune.runtime.profiles.launcher_env import allowed_env

            # the lines are eval'd: every value shell-quoted, every comment one line (its text escaped), and only the
            # variables moetune sets (resolve filters them on every path; checked again here, where it is eval'd)
            if provenance in ENV_LABEL:  # the exports are eval'd or saved: the label goes with them (a shell comment)
                typer.echo(shell_comment(f"moetune: {ENV_LABEL[provenance]}, not measured on this node"))
            for line in env_notes(res):  # the recorded variables are said, never exported
                typer.echo(shell_comment(f"moetune: {line}"))
            env, refused = allowed_env(res.env)
            for why in refused:
                typer.echo(shell_comment(f"moetune: not exporting {why}"))
            for k, v in sorted(env.items()):
                typer.echo(f"export {k}={shlex.quote(v)}")
            typer.echo(f"export MOETUNE_PROFILE_HASH={shlex.quote(res.profile_hash)}")
            return
        # a preset's measured_on names its content's digest: whether that is the shipped preset's or an edited copy's
        shipped, origin = preset_note(provenance, measured_on, backend)
        out = {"source": res.source, "profile_hash": res.profile_hash, "status": res.status,
               "provenance": provenance, "measured_on": measured_on, "preset_shipped": shipped,
               "knobs": res.knobs.to_dict(), "env": res.env, "key": res.key.to_dict() if res.key else None,
               "family": res.family, "message": res.message, "env_status": res.env_status, "env_diff": res.env_diff,
               "options_status": res.options_status}
        if fmt == "json":
            typer.echo(json.dumps(out))
            return
        from rich.console import Console
        from rich.table import Table

        # the daemon's strings: brackets text, control characters shown (\\xNN), not obeyed by the terminal
        from moetune.tuner.cli._tables import visible_markup as escape

        con = Console()
        t = Table(title=f"{shape.name} ep={ep} nodes={nodes} tokens={tokens}", show_header=False)
        # strings a daemon sent are escaped: "[...]" would be Rich markup (a link, a style) in this table
        t.add_row("source", res.source)
        t.add_row("profile", escape(res.profile_hash))
        t.add_row("status", escape(res.status))
        t.add_row("provenance", PROVENANCE_LABEL.get(provenance, escape(provenance)))
        if measured_on:
            # "measured on" only where it was: a node model's row names the node whose calibrated model predicted
            # it, a preset's the preset (it read "measured on preset:NAME:DIGEST" beside "MODELLED")
            t.add_row(MEASURED_ON_LABEL.get(provenance, "measured on (as recorded)"), escape(measured_on))
        if origin:
            t.add_row("preset", escape(origin) if shipped else f"[red]{escape(origin)}[/]")
        if res.key:
            t.add_row("fingerprint", escape(res.key.fingerprint))
            t.add_row("family", escape(res.key.transport_family))
            t.add_row("token bucket", str(res.key.token_bucket))
        for k, v in res.knobs.to_dict().items():
            t.add_row(k, escape(str(v)))
        for k, v in res.env.items():
            t.add_row(escape(f"env {k}"), escape(v))
        if res.env_status:
            t.add_row("tuned environment", {"same": "the same as here", "unknown": "unknown (not recorded)"}.get(
                res.env_status, "[yellow]differs[/yellow]: " + escape("; ".join(res.env_diff))))
        if res.options_status:  # a profile tuned under other options is never served as tuned: same or unknown
            t.add_row("tuned runtime options", {"same": "the same as here"}.get(
                res.options_status, "[yellow]unknown (not recorded)[/yellow]"))
        con.print(t)
        if caught or res.source != "daemon":
            # the message names paths (--db, the socket) and quotes the daemon: text, never Rich markup (a folder
            # `a[/b]` ended the command in a MarkupError, `[x]` was dropped from the path). A daemon reply used with a
            # warning (a MODELLED profile applied because allow_modelled is set) did come from the daemon: "not from
            # the daemon" contradicted the table's source row
            lead = "from the daemon, with a warning" if res.source == "daemon" else "not from the daemon"
            con.print(f"[yellow]{lead}: {escape(res.message)}[/yellow]")
