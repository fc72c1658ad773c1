"""Fixtures several test files share: the runtime's per-process state (profiles auto-loaded, availability
answers, warnings said once) emptied around a test, with auto-loading either on or off."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# pytest-xdist's workers run with COLUMNS=80 (and LINES) in their environment: a Rich Console made at import
# (tuner/cli/db.py's) fixes its width there, and the tests that give the CLI another COLUMNS saw 80 columns. Dropped
# before any test module imports the CLI, as in a single pytest process.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

from moetune.runtime import _once, paths
from moetune.runtime.profiles import autoload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logging_kept import moetune_logging_kept


def _reset() -> None:
    _once.reset()
    autoload.clear_cache()


@pytest.fixture
def autoload_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fresh caches; MOETUNE_AUTOLOAD unset, so layers and buffers ask for profiles (tests fake the answers)."""
    _reset()
    monkeypatch.delenv("MOETUNE_AUTOLOAD", raising=False)
    yield
    _reset()


@pytest.fixture
def clean_autoload_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """No config of the user's or the system's (HOME, XDG_CONFIG_HOME, MOETUNE_HOME under tmp_path), autoload's
    variables unset, fresh caches; yields the variables set."""
    e = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "MOETUNE_HOME": str(tmp_path / "mh")}
    for k, v in e.items():
        monkeypatch.setenv(k, v)
    for k in ("MOETUNE_AUTOLOAD", "MOETUNE_CONFIG", "MOETUNE_CLIENT_FALLBACK_RETRY_S"):
        monkeypatch.delenv(k, raising=False)
    autoload.clear_cache()
    yield e
    autoload.clear_cache()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback TCP port something else listens on (a refused bind: the daemon's TCP or metrics port in use); it
    never accepts nor answers, while the kernel completes a few connections (its backlog)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


@pytest.fixture
def autoload_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fresh caches; MOETUNE_AUTOLOAD=0: no daemon or database is asked unless a test sets one up."""
    _reset()
    monkeypatch.setattr(autoload, "_availability", {})
    monkeypatch.setenv("MOETUNE_AUTOLOAD", "0")
    yield
    _reset()


@pytest.fixture
def on_captured_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate running ON the node a capture describes: live discovery (`discovery.live_facts`) answers the facts
    of the capture read last. A bring-up or local tune of a capture measures only when the capture is this node
    (`capture_not_this_node`); tests that inject the timings of a GPU node's capture on this CPU machine use this,
    so what they store is what that node would store, and no real timing of this machine is stored as that node's."""
    from moetune.tuner.fabric import discovery

    real = discovery.discover
    seen: list = []

    def discover(capture=None, **kw):  # type: ignore[no-untyped-def]
        facts = real(capture, **kw)
        if capture is not None:
            seen.append(facts)
        return facts

    def live_facts(timeout_s: float = 1.5):  # type: ignore[no-untyped-def]
        return seen[-1] if seen else real(None, timeout_s=timeout_s)

    monkeypatch.setattr(discovery, "discover", discover)
    monkeypatch.setattr(discovery, "live_facts", live_facts)


@pytest.fixture(autouse=True)
def _moetune_logging_restored() -> Iterator[None]:
    with moetune_logging_kept():
        yield


@pytest.fixture(autouse=True)
def _config_chain_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A measuring command run in-process with --config joins the process's chain as $MOETUNE_CONFIG
    (`options.load_config_checked`, for its ranks): restored after every test, so that it leaks into none after."""
    monkeypatch.setenv("MOETUNE_CONFIG", os.environ.get("MOETUNE_CONFIG", ""))
    if not os.environ["MOETUNE_CONFIG"]:
        monkeypatch.delenv("MOETUNE_CONFIG")
    yield


@pytest.fixture(autouse=True)
def _nothing_of_this_machines_user(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every config load reads /etc/moetune/moetune.toml and the user's ~/.config/moetune/moetune.toml, and without
    MOETUNE_HOME the default database is the user's ~/.local/share/moetune/moetune.db: no test reads any of them (a
    test of those files sets its own after this). A node deployed with moetune has the first, pointing clients at
    that node's real daemon and database; a developer may have the others: outcomes depended on the machine, and a
    profile lookup could read (a command write) the user's own database. The user's files move through XDG_CONFIG_HOME
    and XDG_DATA_HOME (a fresh folder per test), so the CLI children a test starts with its environment skip them too;
    the system file moves through MOETUNE_SYSTEM_CONFIG (children follow it, `child_env` passes it on) as well as
    `paths.SYSTEM_CONFIG` (the in-process loads given an environment of their own).

    Likewise the daemon a client finds without an endpoint: the runtime directories it searches ($XDG_RUNTIME_DIR/
    moetune, /run/moetune, /tmp/moetune-<uid>) may hold this machine's real daemon, or, under pytest-xdist, one
    another worker's test started there. XDG_RUNTIME_DIR becomes a fresh folder per test (children follow it) and
    the other two a path that does not exist."""
    nowhere = tmp_path_factory.getbasetemp() / "no-config-of-this-machine"  # never made: nothing there
    monkeypatch.setattr(paths, "SYSTEM_CONFIG", nowhere / "etc" / "moetune.toml")
    monkeypatch.setenv("MOETUNE_SYSTEM_CONFIG", str(nowhere / "etc" / "moetune.toml"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(nowhere / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", nowhere / "run-moetune")
    monkeypatch.setattr(paths, "TMP_DIR", nowhere / "tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("xdg-run")))


@pytest.fixture(autouse=True)
def _nothing_left_owned_by_another_uid(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests run as root give files and links to a made-up uid (os.chown, os.lchown) to play another user. pytest
    keeps the last runs' tmp_path folders under /tmp, so those entries outlived the test, owned by a uid nobody on
    this machine has. After each test that used tmp_path, whatever in it is owned by another uid is given back to
    this user (no-op when not root: only root can give a file away)."""
    # asked before the test: torn down (and its value gone) only after this fixture's own teardown
    root = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if os.geteuid() != 0 or root is None:
        return
    uid, gid = os.geteuid(), os.getegid()
    for folder, dirs, files in os.walk(root):  # links are not followed: only what lies in tmp_path is touched
        for name in [*dirs, *files]:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if st.st_uid != uid or st.st_gid != gid:
                    os.lchown(path, uid, gid)
