"""Top-level `moetune serve`, `moetune status` and `moetune retune` (the daemon and talking to it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import typer

from moetune.runtime.config import MAX_CLIENT_TIMEOUT_MS
from moetune.tuner.cli._args import path_option, text_option
from moetune.tuner.cli._help import examples
from moetune.tuner.cli.query import SOCKET_EMPTY


def _check_capture(capture: Path, *, read: bool) -> None:
    """Exit 2 unless --capture is a capture directory (and, with `read`, one discovery can read): the daemon
    would otherwise serve on and only log each failed discovery. The rule is discovery's own
    (read_capture_manifest: a directory holding a capture's manifest.json), as for every --capture."""
    from moetune.tuner.cli.db import fail
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.fabric.errors import DiscoveryError
    from moetune.tuner.fabric.sources import read_capture_manifest

    try:
        read_capture_manifest(capture)
    except DiscoveryError as e:
        raise fail(f"--capture {e}") from None
    if read:
        try:
            discover(capture)
        except DiscoveryError as e:
            raise fail(f"--capture {capture}: not a readable fabric capture: {e}") from None


# a script reads `ok` (and `error`) of the one object printed, whether or not the daemon answered
# `moetune retune`'s default wait. The daemon answers a retune only once its job_queued / job_cancelled is committed,
# and that write waits up to the store's busy timeout (moetune.tuner.store.BUSY_TIMEOUT_S, 30 s) while another
# process holds the database's write lock (an import, a tune): a shorter wait reported failure for a job the daemon
# then queued, and a retry queued it twice. A retune is never retried, so the one wait must outlast the store's.
RETUNE_TIMEOUT_MS = 40_000
JSON_HELP = ('Print one JSON object: the answer with "ok": true, or {"ok": false, "error": "..."} (exit 1) when '
             "the daemon cannot be reached or refuses.")


def _job_state(job: Any) -> str:
    """A job's state as `status` shows it: "running, cancelling (ends after its current trial)" once a cancel was
    asked for a running job (its state stays "running" until the trial ends)."""
    if job.state == "running" and getattr(job, "cancelling", False):
        return "running, cancelling (ends after its current trial)"
    return str(job.state)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""

    @app.command("serve", epilog=examples(("serve",)))
    def serve(
        socket: str = typer.Option(None, "--socket", help="ROUTER endpoint (default: ipc:// in the runtime directory)."),
        pub_socket: str = typer.Option(None, "--pub-socket", help="PUB endpoint (default: next to --socket)."),
        db: Path = path_option(None, "--db", help="Database (default: \\[store] db, $MOETUNE_HOME, XDG data dir). "
                               "It must exist unless --create: a mistyped --db is refused, not served empty."),
        create: bool = typer.Option(False, "--create", help="Create the --db database when it does not exist (the "
                                    "default database is created without it)."),
        config: Path = path_option(None, "--config", help="TOML config file."),
        metrics_port: int = typer.Option(None, "--metrics-port", help="Prometheus /metrics on 127.0.0.1:PORT (0 = off; default: config daemon.metrics_port, 0)."),
        rediscover_interval: float = typer.Option(None, "--rediscover-interval", help="Seconds between fabric discoveries (0 = never; default: config daemon.rediscover_interval_s, 60)."),
        capture: Path = path_option(None, "--capture", help="Discover from this capture directory instead of the live node."),
        allow_insecure_tcp: bool = typer.Option(None, "--allow-insecure-tcp/--no-allow-insecure-tcp", help="Allow tcp:// without CURVE (trusted loopback tests only; default: config daemon.allow_insecure_tcp, false)."),
        log_level: str = typer.Option(None, "--log-level", help="Log level of the daemon's JSON log lines on stderr: debug, info, warning, error or critical (default: config daemon.log_level, info)."),
        curve_clients_dir: Path = path_option(None, "--curve-clients-dir", "--clients-dir", help="Allow-list of client public keys for tcp:// with CURVE (default: clients/ beside the server's secret key; --clients-dir, as for `moetune keys client/allow`)."),
        store_hook: str = typer.Option(None, "--store-hook", hidden=True),
        discover_hook: str = typer.Option(None, "--discover-hook", hidden=True),
        retune_hook: str = typer.Option(None, "--retune-hook", hidden=True),
    ) -> None:
        """Run the node daemon: serve tuned profiles over ZeroMQ; rediscover the fabric and re-tune when it changes."""
        import zmq

        from moetune.tuner.cli.db import fail
        from moetune.tuner.cli.query import check_socket
        from moetune.tuner.daemon.errors import DaemonConfigError
        from moetune.tuner.daemon.server import check_rediscover_interval, run_daemon

        # the options as given are checked first, so an error names the option (not a config key it fell to)
        for opt, endpoint in (("--socket", socket), ("--pub-socket", pub_socket)):
            if endpoint is not None:
                check_socket(endpoint, opt, bind=True)
        if rediscover_interval is not None:  # inf and nan were taken (discovery then died, or never ran)
            try:
                check_rediscover_interval(rediscover_interval, "--rediscover-interval")
            except DaemonConfigError as e:
                raise fail(str(e)) from None
        if log_level is not None:
            from moetune.runtime.config import LOG_LEVELS

            if log_level.strip().lower() not in LOG_LEVELS:  # the daemon's logging said "Unknown level: 'BOGUS'"
                raise fail(f"--log-level must be one of {', '.join(LOG_LEVELS)} (any case), got {log_level!r}")
            log_level = log_level.strip().lower()
        if capture is not None:
            _check_capture(capture, read=not discover_hook)
        try:
            code = run_daemon(socket=socket, pub_socket=pub_socket, db=str(db) if db else None, config=config,
                              metrics_port=metrics_port, rediscover_interval=rediscover_interval, capture=capture,
                              allow_insecure_tcp=allow_insecure_tcp, store_hook=store_hook, discover_hook=discover_hook,
                              retune_hook=retune_hook, log_level=log_level, curve_clients_dir=curve_clients_dir,
                              create_db=create or db is None)
        except (DaemonConfigError, ValueError, OverflowError) as e:
            typer.secho(f"moetune serve: {e}", fg="red", err=True)
            # 2: the configuration is wrong; a store error says its own (1: held by another process, not writable)
            raise typer.Exit(getattr(e, "exit_code", 2)) from None
        except (OSError, RuntimeError, zmq.ZMQError) as e:
            typer.secho(f"moetune serve: {e}", fg="red", err=True)
            # not refused as a configuration: 1 unless the error says its own, so the systemd unit restarts it (its
            # RestartPreventExitStatus=2 is for settings a restart cannot mend; an OSError here may be passing)
            raise typer.Exit(getattr(e, "exit_code", 1)) from None
        raise typer.Exit(code)

    @app.command("status")
    def status(
        socket: str = text_option(None, "--socket", empty=SOCKET_EMPTY, help="Daemon endpoint (default: the configured one)."),
        config: Path = path_option(None, "--config", help="TOML config file."),
        timeout_ms: int = typer.Option(1000, "--timeout-ms", help=f"Milliseconds to wait for the daemon's answer, 1 to {MAX_CLIENT_TIMEOUT_MS}."),
        json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Ask the daemon how it is doing (uptime, database, last discovery, jobs)."""
        from moetune.tuner.cli.query import daemon_call, print_json

        st = daemon_call("status", socket=socket, config=config, timeout_ms=timeout_ms, json_out=json_out)
        if json_out:
            print_json({"ok": True, **msgspec.structs.asdict(st)})
            return
        from rich.console import Console
        from rich.markup import escape

        from moetune.tuner.cli._tables import Col, print_table

        # every value is the daemon's text, printed as given ('[/]' in a job's reason is no markup), and folded
        # whole at 80 columns (an endpoint or database path was cut with '…'); a field name wraps between words
        rows: list[tuple[str, str]] = [(k, escape(str(getattr(st, k)))) for k in (
            "endpoint", "pub_endpoint", "db", "epoch", "pid", "daemon_version", "fingerprint", "version")]
        if st.store_damaged:  # nothing is written to it any more: said before anything else the daemon reports
            rows.insert(3, ("db DAMAGED", f"[red]{escape(st.store_damaged)}; the daemon writes nothing more to it "
                                          "(restart it once the file is restored)[/]"))
        # the counts cover every fingerprint in the database (presets and other nodes too), the provenance
        # row only this node's: say so, or 3 current profiles beside "measured: 0, ..., preset: 0" reads as a bug
        # the rows no lookup serves are listed as current (`profiles list`, the database's status): said apart
        current = str(st.profiles_current) + (
            f" (not served: {st.profiles_not_served}: knobs contradicting their family, named by `moetune db check`, "
            "or what-if profiles no run of this runtime can take)" if st.profiles_not_served else "")
        rows += [("profiles_current (all fingerprints)", current),
                 ("profiles_stale (all fingerprints)", str(st.profiles_stale))]
        rows += [(k, escape(str(getattr(st, k))))
                 for k in ("requests", "last_discovery", "last_discovery_ok", "last_discovery_message")]
        rows.append(("uptime_s", f"{st.uptime_s:.1f}"))
        prov = st.provenance
        if prov:  # how the current profiles of this node's fingerprint were obtained
            rows.append(("provenance (this fingerprint)", escape(", ".join(f"{k}: {v}" for k, v in prov.items()))))
        if st.tune_notice:
            rows.append(("re-tune", f"[yellow]{escape(st.tune_notice)}[/]"))
        j = st.jobs
        running = f"{j.running.id} (cancelling)" if j.running and j.running.cancelling else (
            j.running.id if j.running else "-")
        rows.append(("jobs", f"running: {running}, queued: {len(j.queued)}/{j.capacity}"))
        # the running and queued jobs with their reasons (and why one waits: "deferred: ..."), then the last done;
        # a cancelled running job says so until its current trial ends (it looked as if the cancel was lost)
        # and what the `retune` that queued a job left out of it (only its reply named those keys before)
        rows += [(f"job {r.id}", escape(_job_state(r) + f": {r.reason}" + (f" ({r.message})" if r.message else "")
                                        + (f"; left out of it: {'; '.join(r.left_out)}" if r.left_out else "")))
                 for r in [*([j.running] if j.running else []), *j.queued, *j.recent[-5:]]]
        # the last `retune`s that queued no job for the keys they left out (--json names each group's keys too)
        rows += [(f"retune at {x.at}", f"[yellow]{escape(f'{x.reason}: {x.message}')}[/]") for x in st.retune_refusals]
        print_table(Console(), (Col("field", "word"), Col("value")), rows, title="moetune daemon", show_header=False)

    @app.command("retune")
    def retune(
        all_: bool = typer.Option(False, "--all", help="Re-tune every current profile of this fabric, not only stale ones."),
        cancel: int = typer.Option(None, "--cancel", help="Cancel this job id."),
        reason: str = typer.Option("requested from the command line", "--reason",
                                   help="Why: recorded with the job (`moetune status` lists it)."),
        socket: str = text_option(None, "--socket", empty=SOCKET_EMPTY, help="Daemon endpoint (default: the configured one)."),
        config: Path = path_option(None, "--config", help="TOML config file."),
        timeout_ms: int = typer.Option(RETUNE_TIMEOUT_MS, "--timeout-ms",
                                       help=f"Milliseconds to wait for the daemon's answer, 1 to {MAX_CLIENT_TIMEOUT_MS} (it "
                                            "answers once the job is recorded in the database, which may wait for "
                                            "another writer)."),
        json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        # help paragraphs on one line each: Rich prints a docstring's own line breaks as they are
        """Queue a re-tune of stale profiles in the daemon, and of keys whose current profile no lookup serves (or cancel a job); admins only.

        Keys the daemon's \\[tune] backend cannot answer here are left out and named (with "local": a group over several nodes or more ranks than GPUs, or any key where the daemon serves another node's capture; a megakernel key it cannot measure); `moetune status` still lists them. All left out: nothing queued, exit 1 if a stale key (any, with --all) is among them.

        Admins: the daemon's own user on its IPC socket (or its group, with daemon.group_may_retune), a CURVE client listed with `moetune keys allow --admin` on TCP."""
        from moetune.runtime import wire
        from moetune.tuner.cli.db import fail
        from moetune.tuner.cli.query import daemon_call, print_json

        # refused here, before anything is sent: a job id is >= 1 (the daemon answered 0 with invalid_field), and a
        # cancel queues nothing, so --all with it has no meaning
        if cancel is not None and not 1 <= cancel <= wire.POS_INT_MAX:
            raise fail(f"--cancel must be a job id (1 to {wire.POS_INT_MAX}, as `moetune status` lists them), got {cancel}")
        if len(reason) > wire.REASON_MAX or not reason.strip():
            got = f"{len(reason)} characters" if reason.strip() else "a blank one"
            raise fail(f"--reason must say why in 1 to {wire.REASON_MAX} characters (it is recorded with the job), "
                       f"got {got}")
        if cancel is not None and all_:
            raise fail("--all and --cancel conflict: --cancel stops one job, --all queues a re-tune; give one of them")
        what = f"job {cancel} may still have been cancelled" if cancel is not None else "the job may still have been queued"
        # the request reached the daemon, which may be waiting on a busy database: a blind retry could queue it twice
        hint = (f"{what} (the daemon answers once the database has it, and another writer may hold it); "
                "`moetune status` lists the queued and running jobs: check there before retrying")
        res = daemon_call("retune", socket=socket, config=config, timeout_ms=timeout_ms, json_out=json_out,
                          on_timeout=hint, all=all_ or None, cancel=cancel, reason=reason)
        if json_out:
            print_json({"ok": True, **msgspec.structs.asdict(res)})
        else:
            from moetune.tuner.cli._tables import visible

            # the daemon's text (a job's reason, quoted back): a terminal escape in it is shown, not obeyed (as by status)
            typer.echo(visible(res.message))
