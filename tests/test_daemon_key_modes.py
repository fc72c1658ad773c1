"""A TCP daemon refuses CURVE key material that other local users could read or change: a secret key readable
or writable by group/other (or in a directory they may write), an allow-list or admin-list directory or key file
they may write, or any of them owned by another user. Nothing is chmod-ed. `moetune keys` makes files that pass
and refuses directories the daemon would refuse."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.testing.launch import free_port
from moetune.tuner.cli import app
from moetune.tuner.cli.keys import allow_everywhere, generate_keys
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)
ROOT = os.geteuid() == 0


def _setup(tmp: Path) -> tuple[Path, Path]:
    """A daemon key pair in tmp/keys, one client in clients/ and admins/: (secret key file, keys dir)."""
    keys = tmp / "keys"
    _, secret = generate_keys(keys)
    pub, _ = generate_keys(tmp / "alice", "alice")
    allow_everywhere(pub, keys, None, None, admin=True, force=False)
    return secret, keys


def _daemon(tmp: Path, secret: Path, endpoint: str | None = None) -> Daemon:
    facts = F.FakeFacts({"gpu_model": "H200"})
    pub = None if endpoint else f"tcp://127.0.0.1:{free_port()}"
    return Daemon(store=F.open_store(tmp / "moetune.db"), discover=lambda: facts, rediscover_interval_s=0,
                  endpoint=endpoint or f"tcp://127.0.0.1:{free_port()}", pub_endpoint=pub, curve_secret_key_file=str(secret))


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


# (what to loosen, relative to the keys dir; its new mode; what the error must say)
LOOSE = [
    ("moetune.key_secret", 0o644, "secret key file .*mode 644.* readable by group or others"),
    ("moetune.key_secret", 0o640, "secret key file .*mode 640.* readable by group or others"),
    ("moetune.key_secret", 0o622, "secret key file .*mode 622.* writable by group or others"),
    (".", 0o775, "directory of the CURVE secret key .*mode 775.* writable"),
    (".", 0o1777, "directory of the CURVE secret key .*mode 1777.* writable"),  # sticky is no excuse for the key
    ("clients", 0o777, "client allow-list directory .*clients.*mode 777.* writable"),
    ("clients", 0o770, "client allow-list directory .*clients.*mode 770.* writable"),
    ("clients/alice.key", 0o666, "key file in the CURVE client allow-list .*alice.key.*mode 666.* writable"),
    ("admins", 0o777, "admin list directory .*admins.*mode 777.* as an admin"),
    ("admins/alice.key", 0o646, "key file in the CURVE client admin list .*alice.key.*mode 646.* writable"),
]


@pytest.mark.parametrize(("rel", "mode", "match"), LOOSE, ids=[f"{r}-{m:o}" for r, m, _ in LOOSE])
def test_tcp_daemon_refuses_loose_key_modes(tmp_path: Path, rel: str, mode: int, match: str) -> None:
    secret, keys = _setup(tmp_path)
    target = keys / rel
    os.chmod(target, mode)
    d = _daemon(tmp_path, secret)
    with pytest.raises(DaemonConfigError, match=match):
        d.start()
    assert _mode(target) == mode  # refused, never chmod-ed


def test_an_allow_list_linked_into_a_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    """clients/ as a link into a group-writable folder: a member could rename the real clients/ and put one holding
    their own key in its place; the folder the link points into is checked as well as the link's own."""
    secret, keys = _setup(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    (keys / "clients").rename(shared / "clients")
    (keys / "clients").symlink_to(shared / "clients")
    os.chmod(shared, 0o775)
    d = _daemon(tmp_path, secret)
    with pytest.raises(DaemonConfigError, match=rf"directory holding the CURVE client allow-list {shared} .*mode 775"):
        d.start()
    assert _mode(shared) == 0o775


@pytest.mark.parametrize("admin", [False, True], ids=["allow-list", "admin-list"])
def test_a_listed_key_linked_into_a_folder_others_may_write_is_refused(tmp_path: Path, admin: bool) -> None:
    """clients/NAME.key (or admins/NAME.key) as a link into a folder others may write without the sticky bit: they
    could replace the key file there with one holding their own key; the folder the link points into is checked as
    for the list's own folder (a link into a folder of this user's only is fine)."""
    secret, keys = _setup(tmp_path)
    listed = keys / ("admins" if admin else "clients") / "alice.key"
    safe, shared = tmp_path / "safe", tmp_path / "shared"
    for folder in (safe, shared):
        folder.mkdir()
    listed.rename(safe / "alice.key")
    listed.symlink_to(safe / "alice.key")
    _daemon(tmp_path, secret).start(background=True).stop()  # a folder of this user's only: served
    (safe / "alice.key").rename(shared / "alice.key")
    listed.unlink()
    listed.symlink_to(shared / "alice.key")
    os.chmod(shared, 0o777)
    d = _daemon(tmp_path, secret)
    with pytest.raises(DaemonConfigError, match=rf"{shared} .*mode 777.* writable"):
        d.start()
    assert _mode(shared) == 0o777


def test_group_readable_public_keys_and_lists_are_fine(tmp_path: Path) -> None:
    """Public keys are public: only writing them matters. A fresh `keys generate` setup serves as it is."""
    secret, keys = _setup(tmp_path)
    for p in (keys / "clients", keys / "admins"):
        os.chmod(p, 0o755)
    for p in (keys / "clients" / "alice.key", keys / "admins" / "alice.key"):
        os.chmod(p, 0o644)
    d = _daemon(tmp_path, secret).start(background=True)
    d.stop()


def test_ipc_daemon_is_not_refused_for_a_configured_key_it_does_not_use(tmp_path: Path) -> None:
    secret, keys = _setup(tmp_path)
    os.chmod(keys / "clients", 0o777)
    os.chmod(secret, 0o644)
    d = _daemon(tmp_path, secret, endpoint=f"ipc://{tmp_path}/run/daemon.sock")
    d._check_transport_security()  # no error: the allow-list is read for TCP only


OWNED: list[tuple[str, str]] = [
    ("moetune.key_secret", "secret key file"),
    (".", "directory of the CURVE secret key"),
    ("clients", "client allow-list directory"),
    ("clients/alice.key", "key file in the CURVE client allow-list"),
    ("admins/alice.key", "key file in the CURVE client admin list"),
]


@pytest.mark.skipif(not ROOT, reason="needs root to give a file to another user")
@pytest.mark.parametrize(("rel", "what"), OWNED, ids=[r for r, _ in OWNED])
def test_tcp_daemon_refuses_key_material_of_another_user(tmp_path: Path, rel: str, what: str) -> None:
    secret, keys = _setup(tmp_path)
    os.chown(keys / rel, 65534, -1)
    d = _daemon(tmp_path, secret)
    with pytest.raises(DaemonConfigError, match=f"{what} .*owned by uid 65534, not by this daemon's user") as e:
        d.start()
    # what to do, as the mode refusals say their chmod (it said what was wrong only)
    assert f"chown {os.geteuid()} {keys / rel}" in str(e.value).replace("/./", "/"), e.value


def test_serve_names_the_file_and_mode_without_a_traceback(tmp_path: Path) -> None:
    secret, _ = _setup(tmp_path)
    os.chmod(secret, 0o644)
    cfg = tmp_path / "srv.toml"
    cfg.write_text(f'[daemon]\ncurve_secret_key_file = "{secret}"\n')
    # a process of its own: `serve` sets up the daemon's logging, which must not leak into the other tests
    r = subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "serve", "--config", str(cfg), "--create",
                        "--db", str(tmp_path / "moetune.db"), "--socket", f"tcp://127.0.0.1:{free_port()}",
                        "--rediscover-interval", "0"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, r.stderr
    assert f"{secret} (mode 644" in r.stderr and "readable by group or others" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert _mode(secret) == 0o644


def _with_umask(mask: int, fn: Callable[[], Any]) -> Any:
    old = os.umask(mask)
    try:
        return fn()
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o000])
def test_keys_cli_makes_a_setup_the_daemon_accepts(tmp_path: Path, mask: int) -> None:
    """`keys generate` + `keys client --admin` under a loose umask still make 0600 keys in 0700 directories."""
    keys = tmp_path / "keys"

    def make() -> None:
        for argv in (["keys", "generate", str(keys)], ["keys", "client", str(keys), "--name", "bob", "--admin"]):
            r = CliRunner().invoke(app, argv)
            assert r.exit_code == 0, r.output

    _with_umask(mask, make)
    assert _mode(keys) == 0o700 and _mode(keys / "clients") == 0o700 and _mode(keys / "admins") == 0o700
    assert _mode(keys / "moetune.key_secret") == 0o600 and _mode(keys / "clients" / "bob.key") == 0o600
    d = _daemon(tmp_path, keys / "moetune.key_secret").start(background=True)
    d.stop()


def test_keys_generate_and_allow_refuse_a_directory_others_may_write(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    r = CliRunner().invoke(app, ["keys", "generate", str(open_dir)])
    assert r.exit_code == 2 and f"{open_dir} (mode 777" in r.output and "Traceback" not in r.output
    assert list(open_dir.iterdir()) == [] and _mode(open_dir) == 0o777  # nothing written, nothing chmod-ed

    generate_keys(tmp_path / "keys")
    pub, _ = generate_keys(tmp_path / "carol", "carol")
    clients = tmp_path / "keys" / "clients"
    clients.mkdir()
    os.chmod(clients, 0o770)
    r = CliRunner().invoke(app, ["keys", "allow", str(pub), str(tmp_path / "keys")])
    assert r.exit_code == 2 and f"{clients} (mode 770" in r.output and "Traceback" not in r.output
    assert list(clients.iterdir()) == [] and _mode(clients) == 0o770


def test_folders_made_above_a_key_folder_are_this_users_only_whatever_the_umask(tmp_path: Path) -> None:
    """mkdir(parents=True, mode=0o700) gives the mode to the last folder alone: under umask 0 the parents came out
    0777, so anyone could rename the key folder away and put their own in its place."""
    old = os.umask(0)
    try:
        r = CliRunner().invoke(app, ["keys", "generate", str(tmp_path / "a" / "b" / "keys")])
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "keys"):
        assert _mode(p) == 0o700, (p, oct(_mode(p)))
    assert os.umask(old) == old  # the process's umask is given back


def test_keys_client_never_writes_over_the_daemons_key_pair(tmp_path: Path) -> None:
    """`keys client DIR --name moetune --out DIR --force` replaced the daemon's own secret key (DIR/moetune.key_secret)
    by the new client's: every client holding the daemon's public key was locked out. Refused, nothing written."""
    keys = tmp_path / "server"
    public, secret = generate_keys(keys)
    before = (public.read_bytes(), secret.read_bytes())
    r = CliRunner().invoke(app, ["keys", "client", str(keys), "--name", "moetune", "--out", str(keys), "--force"])
    assert r.exit_code == 2, r.output
    assert "--out" in r.output and "the daemon's secret key" in " ".join(r.output.split()), r.output
    assert (public.read_bytes(), secret.read_bytes()) == before
    assert not (keys / "clients").exists()


@pytest.mark.parametrize("which", ["socket", "pub_socket"])
def test_a_tcp_port_in_use_names_the_endpoint_and_what_to_do(tmp_path: Path, which: str) -> None:
    """A second `moetune serve` on a TCP port another daemon (or program) holds said only zmq's "Address already in
    use (addr='tcp://...')": it now names the setting and what to do, as a metrics port in use does."""
    import socket

    secret, _ = _setup(tmp_path)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    try:
        facts = F.FakeFacts({"gpu_model": "H200"})
        free = f"tcp://127.0.0.1:{free_port()}"
        d = Daemon(store=F.open_store(tmp_path / "moetune.db"), discover=lambda: facts, rediscover_interval_s=0,
                   endpoint=taken if which == "socket" else free, pub_endpoint=taken if which == "pub_socket" else None,
                   curve_secret_key_file=str(secret))
        with pytest.raises(DaemonConfigError) as e:
            d.start()
    finally:
        holder.close()
    msg = str(e.value)
    assert f"daemon.{which}" in msg and taken in msg and "in use" in msg and "another port" in msg, msg
