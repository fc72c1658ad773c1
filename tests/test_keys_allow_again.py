"""`moetune keys allow KEY SERVER --admin` of a key already on the allow-list failed "clients/c1.key exists (use
--force to overwrite)" though that file holds the same key: making an allowed client an admin (or allowing it again)
needed --force. An identical key in place is left as it is; a different key (or a link) at that name still needs
--force."""

from __future__ import annotations

import os
from pathlib import Path

from typer.testing import CliRunner

from moetune.tuner.cli import keys


def test_an_allowed_key_is_made_admin_without_force(tmp_path: Path) -> None:
    server = tmp_path / "tk"
    keys.generate_keys(server)
    r = CliRunner().invoke(keys.app, ["client", str(server), "--name", "c1"])
    assert r.exit_code == 0, r.output
    pub = server / "client-c1" / "c1.key"
    allowed = server / "clients" / "c1.key"
    before = allowed.read_bytes(), os.stat(allowed).st_ino
    r = CliRunner().invoke(keys.app, ["allow", str(pub), str(server), "--admin"])
    assert r.exit_code == 0, r.output
    assert (server / "admins" / "c1.key").is_file() and "may queue and cancel re-tunes" in r.output
    assert (allowed.read_bytes(), os.stat(allowed).st_ino) == before  # left as it was, not rewritten
    assert (os.stat(server / "admins" / "c1.key").st_mode & 0o777) == 0o600
    r = CliRunner().invoke(keys.app, ["allow", str(pub), str(server), "--admin"])  # again: nothing to do
    assert r.exit_code == 0, r.output


def test_another_key_of_the_same_name_still_needs_force(tmp_path: Path) -> None:
    server = tmp_path / "tk"
    keys.generate_keys(server)
    first, _ = keys.generate_keys(tmp_path / "a", "c1")
    other, _ = keys.generate_keys(tmp_path / "b", "c1")
    assert CliRunner().invoke(keys.app, ["allow", str(first), str(server)]).exit_code == 0
    r = CliRunner().invoke(keys.app, ["allow", str(other), str(server), "--admin"])
    assert r.exit_code != 0 and "use --force" in r.output, r.output
    assert (server / "clients" / "c1.key").read_bytes() == first.read_bytes()
    assert not (server / "admins" / "c1.key").exists()  # refused before the admin copy
    r = CliRunner().invoke(keys.app, ["allow", str(other), str(server), "--admin", "--force"])
    assert r.exit_code == 0, r.output
    assert (server / "clients" / "c1.key").read_bytes() == other.read_bytes()
