"""`moetune keys`: CURVE keys for a daemon listening on TCP."""

from __future__ import annotations

import os
from pathlib import Path

import typer

app = typer.Typer(help="CURVE keys for a daemon listening on TCP.", no_args_is_help=True)


def generate_keys(directory: Path, name: str = "moetune", *, force: bool = False) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (public + secret) with zmq.auth, mode 0600, in a 0700 dir."""
    import zmq.auth

    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not force and (public.exists() or secret.exists()):
        raise FileExistsError(f"{public} or {secret} exists (use --force to overwrite)")
    old = os.umask(0o177)
    try:
        for p in (public, secret):
            p.unlink(missing_ok=True)
        pub_file, sec_file = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old)
    for p in (pub_file, sec_file):
        os.chmod(p, 0o600)
    return Path(pub_file), Path(sec_file)


@app.command("generate")
def generate(
    directory: Path = typer.Argument(..., help="Where to write the key pair."),
    name: str = typer.Option("moetune", "--name", help="File name stem."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing keys."),
    json_out: bool = typer.Option(False, "--json", help="Print the paths as JSON."),
) -> None:
    """Generate a CURVE key pair (files 0600). Point daemon.curve_secret_key_file at NAME.key_secret; give
    clients NAME.key (the server's public key)."""
    try:
        public, secret = generate_keys(directory, name, force=force)
    except (OSError, FileExistsError) as e:
        typer.secho(f"moetune keys generate: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    if json_out:
        import json

        typer.echo(json.dumps({"public": str(public), "secret": str(secret)}))
    else:
        typer.echo(f"public key: {public}\nsecret key: {secret}  (set daemon.curve_secret_key_file to this)")
