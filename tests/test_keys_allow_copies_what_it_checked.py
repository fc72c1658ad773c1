"""`moetune keys allow FILE` checked FILE by path, parsed it by path (zmq.auth), then read its bytes by path a third time
to copy them into the allow-list: a file replaced in between was copied unchecked, and the daemon's next start refused
the allow-list entry (or any extra lines the given file carried went in with it). Now the file is opened once, read
once through that descriptor, and what goes into the allow-list is the validated key in the canonical form
`moetune keys generate` writes: exactly the public key line the daemon reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq.auth

from moetune.tuner.cli import keys
from moetune.tuner.daemon.auth import load_client_keys

pytestmark = pytest.mark.timeout(30)


def _canonical(public: bytes) -> bytes:
    return f'metadata\ncurve\n    public-key = "{public.decode()}"\n'.encode()


def test_a_file_replaced_after_its_check_is_not_what_gets_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = tmp_path / "srv"
    keys.generate_keys(server)
    pub_file, _ = keys.generate_keys(tmp_path / "alice", "alice")
    public, _ = zmq.auth.load_certificate(str(pub_file))
    real = zmq.auth.load_certificate
    swapped: list[str] = []

    def parse_then_swap(path: str) -> tuple[bytes, bytes | None]:
        got = real(path)
        if not swapped:  # the first read is the check of the given file: replace it right after
            junk = tmp_path / "junk"
            junk.write_text("not a key file at all\n")
            os.replace(junk, pub_file)
            swapped.append(path)
        return got

    monkeypatch.setattr(zmq.auth, "load_certificate", parse_then_swap)
    (dest,) = keys.allow_everywhere(pub_file, server, None, None, admin=False, force=False)
    monkeypatch.setattr(zmq.auth, "load_certificate", real)
    assert swapped, "the given file was never parsed"
    assert dest.read_bytes() == _canonical(public), dest.read_bytes()
    assert load_client_keys(server / "clients") == [public]  # the daemon's next start reads it


def test_what_goes_into_the_allow_list_is_the_public_key_line_only(tmp_path: Path) -> None:
    server = tmp_path / "srv"
    keys.generate_keys(server)
    pub_file, _ = keys.generate_keys(tmp_path / "bob", "bob")
    public, _ = zmq.auth.load_certificate(str(pub_file))
    given = tmp_path / "bob-edited.key"
    given.write_text(f'#  bob\'s key, mailed in\nmetadata\n    name = "bob"\ncurve\n    public-key = "{public.decode()}"\n'
                     "# trailing words\n")
    (dest,) = keys.allow_everywhere(given, server, None, None, admin=False, force=False)
    assert dest.read_bytes() == _canonical(public), dest.read_bytes()
    assert os.stat(dest).st_mode & 0o777 == 0o600


def test_a_secret_key_file_given_by_mistake_is_refused_saying_which_file_to_give(tmp_path: Path) -> None:
    """A client's NAME.key_secret given to `keys allow` was taken silently (its public half allowed): the secret key,
    which never needs to leave its client, had been copied to the daemon's operator without a word. Refused, naming
    the public key file to give instead; nothing is written."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    server = tmp_path / "srv"
    keys.generate_keys(server)
    _pub, secret = keys.generate_keys(tmp_path / "carol", "carol")
    r = CliRunner().invoke(app, ["keys", "allow", str(secret), str(server)], env={"COLUMNS": "200"})
    said = " ".join(r.output.split())
    assert r.exit_code == 2, said
    assert "holds a secret key" in said and "carol.key" in said, said
    assert not (server / "clients").exists() or not list((server / "clients").iterdir())
