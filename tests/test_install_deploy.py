"""The deploy files that ship in the package (tuner/daemon/deploy/) name what an installed moetune has and agree with
each other: the systemd unit, and the /etc/moetune/moetune.toml it requires."""

from __future__ import annotations

import configparser
import shlex
import sys
import tomllib
import types
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime import paths
from moetune.runtime.config import load_config
from moetune.tuner.cli import app

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = resources.files("moetune.tuner.daemon") / "deploy"
# where clients look for a system daemon, read at import: tests/conftest.py moves it during each test (a node's real
# /run/moetune must not answer a test)
SYSTEM_RUNTIME_DIR = paths.SYSTEM_RUNTIME_DIR


def _unit() -> configparser.SectionProxy:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # keep the case of systemd keys
    cp.read_string((DEPLOY / "moetune.service").read_text())
    return cp["Service"]


def _all(key: str) -> list[str]:
    """Every value of a key systemd lets repeat (configparser keeps the last one only)."""
    text = (DEPLOY / "moetune.service").read_text()
    return [ln.split("=", 1)[1].strip() for ln in text.splitlines() if ln.startswith(f"{key}=")]


def test_unit_command_exists_in_the_package() -> None:
    argv = shlex.split(_unit()["ExecStart"])
    assert argv[:2] == ["/usr/bin/env", "moetune"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "moetune" in scripts  # the console script pip puts on PATH
    r = CliRunner().invoke(app, [*argv[2:3], "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for opt in argv[3:]:
        if opt.startswith("--"):
            assert opt in r.output, f"ExecStart passes {opt}, which `moetune {argv[2]}` does not take"
    config = argv[argv.index("--config") + 1]
    assert config == "/etc/moetune/moetune.toml", "the unit's config file is the one the example is installed as"


def test_example_config_matches_the_unit() -> None:
    """The shipped moetune.toml loads, and puts the database and sockets where the unit lets the daemon write and
    where clients look for a system daemon; its group is one the runtime directory lets in."""
    svc = _unit()
    with resources.as_file(DEPLOY / "moetune.toml") as f:
        cfg = load_config(f, env={})
    state = Path("/var/lib") / svc["StateDirectory"]
    run = Path("/run") / svc["RuntimeDirectory"]
    writable = {Path(p) for p in svc["ReadWritePaths"].split()}
    assert Path(cfg.store.db).parent == state and state in writable
    for endpoint in (cfg.daemon.socket, cfg.daemon.pub_socket):
        sock = paths.ipc_path(endpoint)
        assert sock is not None and sock.parent == run == SYSTEM_RUNTIME_DIR and run in writable
    # systemd makes /run/<RuntimeDirectory> owned by User:Group with RuntimeDirectoryMode and the daemon never
    # chmods a directory it did not create: group members can reach the 0660 sockets only through a group that
    # may enter it (before, the unit said group moetune-clients while the directory was 0750 moetune:moetune).
    mode = int(svc["RuntimeDirectoryMode"], 8)
    assert mode & 0o001 or (cfg.daemon.group == svc["Group"] and mode & 0o010), (cfg.daemon.group, svc["Group"], oct(mode))
    for group in _all("SupplementaryGroups"):  # each must exist, or the unit does not start (216/GROUP)
        assert group in (cfg.daemon.group, svc["Group"]), f"SupplementaryGroups={group}: a group nothing else names"


def test_unit_cache_is_writable() -> None:
    """A `local` re-tune compiles csrc/ into $MOETUNE_CACHE (else ~/.cache/moetune, hidden by ProtectHome=yes)."""
    svc = _unit()
    env = dict(e.split("=", 1) for e in _all("Environment"))
    assert svc["ProtectHome"] == "yes" and svc["ProtectSystem"] == "strict"
    assert env.get("MOETUNE_CACHE") == f"/var/cache/{svc['CacheDirectory']}"
    assert env["MOETUNE_CACHE"] in svc["ReadWritePaths"].split()


def test_unit_lets_a_local_retune_use_the_rdma_nics(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `local` re-tune's ranks run NCCL on the GPUs (LocalBackend's comm backend), which opens the HCAs read-write
    through libibverbs and registers memory with them (locked pages). `DeviceAllow=char-infiniband_verbs r` without
    LimitMEMLOCK let it open none: the daemon measured another NCCL path than the node's jobs take."""
    from moetune.tuner.daemon.retune import TUNE_BACKENDS
    from moetune.tuner.search import local_backend

    assert "local" in TUNE_BACKENDS  # the daemon may measure on this node
    gpus = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8))
    monkeypatch.setitem(sys.modules, "torch", gpus)
    assert local_backend._default_comm_backend(8) == "nccl"  # ...its ranks over NCCL on a node with GPUs
    verbs = [v.split() for v in _all("DeviceAllow") if v.startswith("char-infiniband_verbs")]
    assert verbs and all(set(mode) >= {"r", "w"} for _dev, mode in verbs), verbs
    assert _all("LimitMEMLOCK") == ["infinity"]
