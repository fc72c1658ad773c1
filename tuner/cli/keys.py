"""`moetune keys`: CURVE keys for a daemon listening on TCP.

The daemon authenticates clients too: it lets in only the client public keys found in its allow-list
directory, `clients/` beside its secret key (or `serve --clients-dir`, alias `--curve-clients-dir`). `moetune keys client` makes a
client key pair and puts its public key there; `moetune keys allow` adds a public key made elsewhere.
With `--admin` the key also goes into `admins/` (daemon.curve_admins_dir): only those clients may queue
or cancel a re-tune over TCP; the others read profiles.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from pathlib import Path

import typer

from moetune.runtime.profiles.curve_keys import is_curve_key, read_key_file_as_opened
from moetune.tuner.cli._args import path_arg, path_option, write_error_code

app = typer.Typer(help="CURVE keys for a daemon listening on TCP.", no_args_is_help=True)

# a key's file stem: one plain file name (no '/' or '..' to leave the directory, no leading '.' to hide it)
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}")


def check_name(name: str) -> str:
    """`name` if it is a safe file stem for a key pair, else a ValueError naming --name and the rule."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"--name {name!r}: a key name is 1-100 of A-Z a-z 0-9 _ . - and does not start with '.'")
    return name


def server_dir(server_keys: Path) -> Path:
    """`server_keys` if it is a directory holding the daemon's key pair (a NAME.key_secret, as `moetune keys
    generate` writes it), else a ValueError: an allow-list where no server key is would let nobody in."""
    if not server_keys.is_dir():
        raise ValueError(f"SERVER_KEYS {server_keys}: {'not a directory' if server_keys.exists() else 'no such directory'}"
                         " (make the daemon's key pair first: `moetune keys generate DIR`)")
    if not any(p.is_file() for p in server_keys.glob("*.key_secret")):
        raise ValueError(f"SERVER_KEYS {server_keys} holds no daemon key pair (no *.key_secret file): not the "
                         "directory of the daemon's keys (`moetune keys generate DIR` makes one)")
    return server_keys


def _check_key_dir(directory: Path, what: str, risk: str) -> None:
    """Refuse (never chmod) an existing directory that `moetune serve` would refuse to take keys from:
    writable by group or others, or owned by another user than this one or root."""
    from moetune.tuner.daemon.auth import check_key_path

    check_key_path(directory, what, forbid=0o022, risk=risk)


class _WriteError(ValueError):
    """A key file or folder that could not be written, named; `errno` the OSError's (exit 1 for a full disk, else 2:
    `_args.write_error_code`)."""

    def __init__(self, message: str, errno: int | None) -> None:
        super().__init__(message)
        self.errno = errno


def _make_dir(directory: Path, what: str) -> None:
    """Create `directory` (0700) unless it is one; a ValueError naming it when a file is in the way or it cannot be
    made (mkdir said "[Errno 17] File exists" of a file given as the directory)."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{what} {directory} is a file, not a directory: give a directory (it is created when "
                         "missing), or move the file away")
    # mkdir's mode is the last folder's alone: the parents it makes followed the umask (0777 under UMask=0000), and
    # the daemon then refused a key folder others could rename away; every folder made here is this user's only
    old = os.umask(0o077)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:  # a file in the way further up, or a dangling link
        raise ValueError(f"cannot create the {what} {directory}: a file (or a dangling link) is in the way") from None
    except NotADirectoryError:
        raise ValueError(f"cannot create the {what} {directory}: a folder above it is a file") from None
    except OSError as e:
        raise _WriteError(f"cannot create the {what} {directory}: {e.strerror or e}", e.errno) from None
    finally:
        os.umask(old)


def check_public_file(public_file: Path) -> None:
    """A ValueError unless `public_file` is a file (zmq answered a missing one with "Invalid certificate file")."""
    if public_file.is_dir():
        raise ValueError(f"{public_file} is a directory, not a client's public key file (NAME.key)")
    if not public_file.exists():
        raise ValueError(f"{public_file}: no such file (the client's public key, NAME.key, as `moetune keys "
                         "generate` writes it on the client)")
    if not public_file.is_file():  # a FIFO's open waits for a writer for ever: the command hung
        raise ValueError(f"{public_file} is not a regular file (a FIFO or a device), not a client's public key file")


def _cert_text(public: bytes, secret: bytes | None = None) -> str:
    """A CURVE certificate as zmq.auth reads it (`load_certificate`): the public key, and with `secret` the secret one
    (a key pair's NAME.key_secret)."""
    head = ("#   ZeroMQ CURVE **Secret** Certificate (moetune keys generate)\n"
            "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n" if secret is not None else "")
    keys = f'    public-key = "{public.decode()}"\n' + (f'    secret-key = "{secret.decode()}"\n' if secret is not None else "")
    return f"{head}metadata\ncurve\n{keys}"


KEY_MODE = 0o600  # every key file, from its creation: never readable by others, not even for a moment


def generate_keys(directory: Path, name: str = "moetune", *, force: bool = False) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (public + secret), mode 0600, in a 0700 dir. Both are written
    whole to temporary names beside them (`atomic_files.write_temp`, the atomic writer's first half), then renamed into place:
    a full disk or an I/O error leaves no partial key file behind, and with `force` the old pair as it was."""
    import zmq

    from moetune.runtime.paths import sync_folder
    from moetune.tuner.store.atomic_files import write_temp

    check_name(name)  # before anything is created: the name must not reach outside `directory`
    _make_dir(directory, "key directory")
    _check_key_dir(directory, "key directory", "others could replace the keys written there")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not force and (public.exists() or secret.exists()):
        raise FileExistsError(f"{public} or {secret} exists (use --force to overwrite)")
    what = f"cannot write the key pair {public.name}, {secret.name} in {directory}"
    for p in (public, secret):  # a folder there would be met only at the second rename, after the first replaced a key
        if p.is_dir() and not p.is_symlink():
            raise _WriteError(f"{what}: {p.name} is a directory", errno.EISDIR)
    pub_key, sec_key = zmq.curve_keypair()
    temp: dict[Path, Path] = {}
    made: list[Path] = []  # the temporary files this call created and has not renamed: the only ones it removes
    try:
        for final, text in ((secret, _cert_text(pub_key, sec_key)), (public, _cert_text(pub_key))):
            temp[final] = write_temp(final, text.encode("ascii"), mode=KEY_MODE)
            made.append(temp[final])
        # the secret file first: it holds the public key too, so should the second rename fail, the daemon's file is
        # still a matching pair
        for final in (secret, public):
            os.replace(temp[final], final)
            made.remove(temp[final])
    except OSError as e:  # a full disk said "[Errno 28] No space left on device", naming no file
        raise _WriteError(f"{what}: {e.strerror or e}", e.errno) from None
    finally:  # Ctrl-C included: what this call made and did not put in place goes; nothing else is touched
        for tmp in made:
            with contextlib.suppress(OSError):
                tmp.unlink()
    sync_folder(directory)
    return public, secret


@app.command("generate")
def generate(
    directory: Path = typer.Argument(..., parser=path_arg, help="Where to write the key pair."),
    name: str = typer.Option("moetune", "--name", help="File name stem."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing keys."),
    json_out: bool = typer.Option(False, "--json", help="Print the paths as JSON."),
) -> None:
    # help paragraphs on one line each: Rich prints a docstring's own line breaks as they are
    """Generate a CURVE key pair (files 0600). Point daemon.curve_secret_key_file at NAME.key_secret; give clients NAME.key (the server's public key)."""
    try:
        public, secret = generate_keys(directory, name, force=force)
    except (OSError, ValueError) as e:
        typer.secho(f"moetune keys generate: {e}", fg="red", err=True)
        raise typer.Exit(write_error_code(e)) from None
    if json_out:
        typer.echo(json.dumps({"public": str(public), "secret": str(secret)}))
    else:
        typer.echo(f"public key: {public}\nsecret key: {secret}  (set daemon.curve_secret_key_file to this)")


def allow_client(public_file: Path, clients_dir: Path, *, force: bool = False) -> Path:
    """Put the public key of a client's key file into the daemon's allow-list directory (created 0700), as
    `moetune keys generate` writes a public key file. The file is opened once and read once; what is written is the
    key validated from those bytes, never the file read again by path (a file replaced in between was copied
    unchecked, and the daemon refused it at its next start)."""
    check_public_file(public_file)  # its plain errors first (no such file, a directory); the read below re-checks
    try:
        public, secret, _st = read_key_file_as_opened(public_file)
    except ValueError as e:  # "does not exist", "is not a regular file (...)", "cannot be read (...)", ...
        raise ValueError(f"{public_file} {e}") from None
    if not public:
        raise ValueError(f"{public_file} holds no public key")
    if secret:  # taken silently before: a client's secret key, which the daemon never needs, had left its client
        raise ValueError(f"{public_file} holds a secret key: give the client's public key file "
                         f"({public_file.stem}.key, as `moetune keys generate` writes it) instead; a secret key "
                         "file never needs to leave its client (one that did is best replaced by a new pair)")
    if not is_curve_key(public):  # the daemon would load it and never match a client: an allow-list entry for nobody
        raise ValueError(f"{public_file}: its public key {public[:60]!r} is not a CURVE key (40 Z85 characters)")
    _make_dir(clients_dir, "allow-list directory")
    _check_key_dir(clients_dir, "allow-list directory", "others could add their own keys to it")
    dest = clients_dir / (public_file.name if public_file.suffix == ".key" else f"{public_file.stem}.key")
    if not force and _holds_public_key(dest, public):
        # already allowed: `allow --admin` of a key on the allow-list (or `allow` again) only adds what is missing
        return dest
    if os.path.lexists(dest) and not force:
        raise FileExistsError(f"{dest} exists (use --force to overwrite): it is not a file holding this key")
    from moetune.tuner.store.atomic_files import write_atomic

    # the canonical public key file of the key validated above
    data = _cert_text(public).encode("ascii")
    try:
        # mode 0600 from creation; a link at `dest` is replaced, never written through; without --force a file that
        # appeared since the check is not replaced either
        write_atomic(dest, data, replace=force, mode=KEY_MODE, follow_links=False)
    except FileExistsError:
        raise FileExistsError(f"{dest} exists (use --force to overwrite)") from None
    except OSError as e:
        raise _WriteError(f"cannot write {dest}: {e.strerror or e}", e.errno) from None
    return dest


def _holds_public_key(dest: Path, public: bytes) -> bool:
    """Whether `dest` is a regular file (not a link: what it points at is not ours to vouch for) holding exactly the
    public key `public`. Read only; anything unreadable or not a key is "no" (the caller then wants --force)."""
    import zmq.auth

    try:
        if not stat.S_ISREG(os.lstat(dest).st_mode):
            return False
        there, _ = zmq.auth.load_certificate(str(dest))
    except (OSError, ValueError):
        return False
    return there == public


def refuse_server_pair(out: Path | None, server_keys: Path, name: str) -> None:
    """A ValueError where the client pair would be written over a key pair in SERVER_KEYS (--out SERVER_KEYS, NAME
    a pair there, the daemon's as far as can be told): with --force, `keys client DIR --name moetune --out DIR`
    replaced the daemon's own secret key by the new client's, and every client holding its public key was locked
    out."""
    if out is None or not out.is_dir() or not (server_keys / f"{name}.key_secret").exists():
        return
    if os.path.samefile(out, server_keys):
        raise ValueError(f"--out {out} is SERVER_KEYS, whose {name}.key_secret may be the daemon's secret key: a "
                         "client's key pair is never written over a key pair there; give the client another --name "
                         "or --out")


def check_admin_options(admin: bool, admins_dir: Path | None) -> None:
    if admins_dir is not None and not admin:
        raise ValueError("--admins-dir is where --admin puts the key: give --admin too")


def allow_everywhere(public_file: Path, server_keys: Path, clients_dir: Path | None, admins_dir: Path | None,
                     *, admin: bool, force: bool) -> list[Path]:
    """Put a client's public key in the allow-list, and with `admin` in the admin list too."""
    check_admin_options(admin, admins_dir)
    dirs = [clients_dir or server_keys / "clients"]
    if admin:
        dirs.append(admins_dir or server_keys / "admins")
    return [allow_client(public_file, d, force=force) for d in dirs]


def _allowed_text(paths: list[Path]) -> str:
    text = f"allowed: {paths[0]}"
    if len(paths) > 1:
        text += f"\nadmin (may queue and cancel re-tunes): {paths[1]}"
    return text + " (restart the daemon to apply)"


def _allowed_json(paths: list[Path]) -> dict[str, str | None]:
    """What _allowed_text says, for scripts: the allow-list copy and, with --admin, the admin-list copy."""
    return {"allowed": str(paths[0]), "admin": str(paths[1]) if len(paths) > 1 else None}


_ADMIN_HELP = "Also list the key as an admin (SERVER_KEYS/admins): it may queue and cancel re-tunes."
_ADMINS_DIR_HELP = ("The daemon's admin list (default: SERVER_KEYS/admins, where the daemon looks by default). "
                    "This command reads no config: for a daemon whose daemon.curve_admins_dir names another "
                    "folder, give that folder.")


@app.command("client")
def client(
    server_keys: Path = typer.Argument(..., parser=path_arg, help="The directory of the daemon's key pair (its allow-list is clients/ there)."),
    name: str = typer.Option(..., "--name", help="The client's name (file stem)."),
    out: Path = path_option(None, "--out", help="Where the client's key pair goes (default: SERVER_KEYS/client-NAME)."),
    clients_dir: Path = path_option(None, "--clients-dir", help="The daemon's allow-list (default: SERVER_KEYS/clients)."),
    admin: bool = typer.Option(False, "--admin", help=_ADMIN_HELP),
    admins_dir: Path = path_option(None, "--admins-dir", help=_ADMINS_DIR_HELP),
    force: bool = typer.Option(False, "--force", help="Overwrite existing keys."),
    json_out: bool = typer.Option(False, "--json", help="Print the paths as JSON."),
) -> None:
    """Generate a client key pair and add its public key to the daemon's allow-list."""
    try:
        check_name(name)
        server_dir(server_keys)
        check_admin_options(admin, admins_dir)  # before any key is written
        refuse_server_pair(out, server_keys, name)
        public, secret = generate_keys(out or server_keys / f"client-{name}", name, force=force)
        allowed = allow_everywhere(public, server_keys, clients_dir, admins_dir, admin=admin, force=force)
    except (OSError, ValueError) as e:
        typer.secho(f"moetune keys client: {e}", fg="red", err=True)
        raise typer.Exit(write_error_code(e)) from None
    if json_out:
        typer.echo(json.dumps({"public": str(public), "secret": str(secret), **_allowed_json(allowed)}))
    else:
        typer.echo(f"client key pair: {public}, {secret}\n{_allowed_text(allowed)}")


@app.command("allow")
def allow(
    public_file: Path = typer.Argument(..., parser=path_arg, help="A client's public key file (NAME.key)."),
    server_keys: Path = typer.Argument(..., parser=path_arg, help="The directory of the daemon's key pair."),
    clients_dir: Path = path_option(None, "--clients-dir", help="The daemon's allow-list (default: SERVER_KEYS/clients)."),
    admin: bool = typer.Option(False, "--admin", help=_ADMIN_HELP),
    admins_dir: Path = path_option(None, "--admins-dir", help=_ADMINS_DIR_HELP),
    force: bool = typer.Option(False, "--force", help="Overwrite an allowed key of the same name."),
    json_out: bool = typer.Option(False, "--json", help="Print the paths as JSON."),
) -> None:
    """Add a client's public key to the daemon's allow-list (and with --admin to its admin list)."""
    try:
        check_public_file(public_file)  # the first argument first
        server_dir(server_keys)
        allowed = allow_everywhere(public_file, server_keys, clients_dir, admins_dir, admin=admin, force=force)
    except (OSError, ValueError) as e:
        typer.secho(f"moetune keys allow: {e}", fg="red", err=True)
        raise typer.Exit(write_error_code(e)) from None
    if json_out:
        typer.echo(json.dumps(_allowed_json(allowed)))
    else:
        typer.echo(_allowed_text(allowed))
