"""Issue 19 on the runtime side: the client applies as tuned only profiles measured on this node, exports
only what launcher_env produces, trusts only its own runtime directory, falls back (never raises) on any
reply that does not validate or any transport it lacks, counts nodes from the process group, and warns
once per fallback naming every source and reason. Issue 20: one path module, no import cycle."""

from __future__ import annotations

import ast
import datetime as dt
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import paths, wire
from moetune.runtime.knobs import TRANSPORTS, default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, provenance_of_backend
from moetune.runtime.profiles import autoload, client, daemon_info, db_lookup, launcher_env, node_identity
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonUnavailable, FallbackWarning
from moetune.runtime.shapes import MODELS

pytestmark = pytest.mark.timeout(90)
QWEN = MODELS["qwen3-30b"]
RUNTIME = Path(client.__file__).resolve().parents[1]
# this node: the fingerprint daemon.json names and the `fabric` op reports, with the software hash of this machine's
# and this process's facts (what the client checks the reported facts against: F.this_node_facts)
FP, SW = "f" * 16, F.this_node_software()
HERE = {"host": socket.gethostname(), "running": True, "epoch": "e1"}  # a running daemon of this host: the replies' epoch


def key(fp: str = FP, sw: str = SW, family: str = "nvlink", bucket: int = 64, nodes: int = 1) -> ProfileKey:
    return ProfileKey(fingerprint=fp, software=sw, transport_family=family, ep_size=2, nodes=nodes, hidden=QWEN.hidden,
                      intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype,
                      token_bucket=bucket)


def result(k: ProfileKey | None = None, *, backend: str = "local:nccl", knobs: Any = None, env: dict | None = None) -> dict:
    k = k or key()
    kn = knobs or default_knobs("nvlink").replace(num_sms=40)
    rec = ProfileRecord(key=k, knobs=kn, latency_us=20.0, spread_us=0.1, backend=backend,
                        provenance=provenance_of_backend(backend))
    res = wire.ProfileResult.from_record(rec, env=env if env is not None else {"NVSHMEM_REMOTE_TRANSPORT": "none"})
    return msgspec.to_builtins(res)


def ok_reply(rid: Any, res: Any, **extra: Any) -> bytes:
    return json.dumps({"v": 1, "id": rid, "ok": True, "epoch": "e1", "result": res, **extra}).encode()


class FakeDaemon(F.ReplyRouter):
    """A ROUTER on ipc://<dir>/daemon.sock (a 0700 directory, with daemon.json when `info` is given: a running
    daemon's of this host unless `info` says otherwise). It answers the `fabric` op with `fabric` (default: this
    node's facts under FP, what a daemon of this node in this Python environment reports; None: `answer` answers it
    too), every other request with `answer`."""

    def __init__(self, run: Path, answer: Callable[[dict], bytes | None], info: dict | None = None,
                 fabric: dict | str | None = "this node"):
        run.mkdir(parents=True, exist_ok=True)
        os.chmod(run, 0o700)
        fab = F.this_node_fabric(FP) if fabric == "this node" else fabric

        def route(req: dict) -> bytes:
            if req.get("op") == "fabric" and isinstance(fab, dict):
                return ok_reply(req["id"], fab)
            return answer(req)

        super().__init__(f"ipc://{run / 'daemon.sock'}", route)
        if info is not None:
            (run / "daemon.json").write_text(json.dumps({**HERE, **info}))


@pytest.fixture
def fake(tmp_path: Path):
    made: list[FakeDaemon] = []

    def make(answer: Callable[[dict], bytes | None], info: dict | None = None, run: Path | None = None,
             fabric: dict | str | None = "this node") -> FakeDaemon:
        d = FakeDaemon(run or tmp_path / "run", answer, {"fingerprint": FP, "software": SW, "transports": ["nvlink"],
                                                          "db": str(tmp_path / "none.db")} if info is None else info,
                       fabric=fabric)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def resolve(endpoint: str, tmp_path: Path, **kw: Any) -> tuple[client.Resolution, list[str]]:
    allow = kw.pop("allow_modelled", None)
    db = kw.pop("db_path", tmp_path / "none.db")
    timeout_ms = kw.pop("timeout_ms", 200)
    return F.resolve_warned(ProfileClient(endpoint, db_path=db, timeout_ms=timeout_ms, allow_modelled=allow, env={}),
                            **kw)


# -- issue 20: one path module, no cycle, torch-free client ---------------------------------------------
def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_no_import_cycle_and_one_path_module() -> None:
    assert "moetune.runtime.profiles.autoload" not in _imports(RUNTIME / "profiles" / "client.py")
    assert "moetune.runtime.profiles.autoload" not in _imports(RUNTIME / "profiles" / "launcher_env.py")
    assert autoload.launcher_env is launcher_env.launcher_env  # re-exported for the daemon
    # the client keeps no path logic of its own
    src = ast.parse((RUNTIME / "profiles" / "client.py").read_text())
    defined = {n.name for n in src.body if isinstance(n, ast.FunctionDef)}
    assert not defined & {"runtime_dir_candidates", "default_endpoint", "default_db_path", "_ipc_path"}
    assert client.default_endpoint is paths.default_endpoint


def test_client_and_config_agree_on_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the daemon listens by default (config) is where the client looks first (they had drifted). With a socket
    present in another candidate runtime directory (a daemon started in another environment), the config's
    client.socket, `default_endpoint`, a ProfileClient and `read_daemon_info` all name that one: the client used
    client.socket (always the first directory) while read_daemon_info searched every directory and
    default_endpoint's search ran only with a broken config."""
    from moetune.runtime.config import load_config

    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", tmp_path / "system-run")  # not this machine's /run/moetune
    # nor its /tmp/moetune-<uid>: a daemon that ran here leaves its daemon.json there, which the search takes
    monkeypatch.setattr(paths, "TMP_DIR", tmp_path / "tmp")
    for env in ({"MOETUNE_HOME": str(tmp_path / "h"), "HOME": str(tmp_path)},
                {"XDG_RUNTIME_DIR": str(tmp_path / "x"), "HOME": str(tmp_path)}, {"HOME": str(tmp_path)}):
        cfg = load_config(env=env)
        assert paths.default_endpoint(env) == cfg.client.socket == cfg.daemon.socket
        assert paths.client_db_path(None, env) == cfg.db_path
    # a daemon's socket in the second candidate directory, a stale daemon.json in the first (another daemon's)
    env = {"MOETUNE_HOME": str(tmp_path / "h"), "XDG_RUNTIME_DIR": str(tmp_path / "x"), "HOME": str(tmp_path)}
    first, there = paths.runtime_dir_candidates(env)[:2]
    assert (first, there) == (tmp_path / "h" / "run", tmp_path / "x" / "moetune")
    for d, db in ((first, "stale.db"), (there, "served.db")):
        d.mkdir(parents=True, mode=0o700)
        (d / paths.INFO_NAME).write_text(json.dumps({"db": str(tmp_path / db)}))
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(there / paths.SOCKET_NAME))
    try:
        want = f"ipc://{there / paths.SOCKET_NAME}"
        cfg = load_config(env=env)
        assert cfg.daemon.socket == f"ipc://{first / paths.SOCKET_NAME}"  # where a daemon of this env would bind
        c = ProfileClient(env=env)
        try:
            assert paths.default_endpoint(env) == cfg.client.socket == c.endpoint == want
            assert (daemon_info.read_daemon_info(c.endpoint, env) or {}).get("_dir") == str(there)
            assert (daemon_info.read_daemon_info(None, env) or {}).get("_dir") == str(there)
            assert c.fallback_db() == tmp_path / "served.db"
        finally:
            c.close()
    finally:
        s.close()
    # no socket anywhere: a stopped daemon's daemon.json (naming its database) is where the client looks
    (there / paths.SOCKET_NAME).unlink()
    (first / paths.INFO_NAME).unlink()
    c = ProfileClient(env=env)
    assert c.endpoint == paths.default_endpoint(env) == f"ipc://{there / paths.SOCKET_NAME}"
    assert c.fallback_db() == tmp_path / "served.db"
    c.close()


def test_the_client_finds_the_daemon_serve_started_in_another_environment(tmp_path: Path) -> None:
    """`moetune serve` with no socket configured binds in its own environment's runtime directory (here
    $XDG_RUNTIME_DIR/moetune); a job whose environment also sets MOETUNE_HOME (a first candidate of its own) finds
    that daemon by the config's client.socket and talks to it, and reads the daemon.json beside that socket."""
    from moetune.runtime.config import load_config

    F.make_capture(tmp_path / "capture")
    x, h = tmp_path / "x", tmp_path / "h"
    x.mkdir(mode=0o700)
    # the suite's MOETUNE_SYSTEM_CONFIG is kept: without it `serve` read this machine's /etc/moetune/moetune.toml
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("MOETUNE_", "XDG_")) or k == "MOETUNE_SYSTEM_CONFIG"}
    serve_env = {**base, "HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(x),
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(F.TESTS_DIR), os.environ.get("PYTHONPATH", "")]))}
    served = load_config(env=serve_env).daemon.socket  # where run_daemon binds: `socket or cfg.daemon.socket`
    assert served == f"ipc://{x / 'moetune' / 'daemon.sock'}"
    log = open(tmp_path / "daemon.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "moetune.tuner.daemon.server", "--db", str(tmp_path / "moetune.db"),
                             "--capture", str(tmp_path / "capture"), "--rediscover-interval", "60",
                             "--retune-hook", "daemon_fakes:fake_retune"], stdout=log, stderr=log, env=serve_env)
    try:
        job_env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(x), "MOETUNE_HOME": str(h)}
        deadline = time.monotonic() + 30
        while True:
            c = ProfileClient(env=job_env, timeout_ms=300)
            try:
                hello = c.hello()
                break
            except DaemonUnavailable:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
                time.sleep(0.1)
            finally:
                c.close()
        assert c.endpoint == served == paths.default_endpoint(job_env) == load_config(env=job_env).client.socket
        info = daemon_info.read_daemon_info(c.endpoint, job_env) or {}
        assert info.get("_dir") == str(x / "moetune") and info.get("epoch") == c.epoch and hello is not None
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def test_client_import_leaves_torch_out() -> None:
    code = "import sys, moetune.runtime.profiles.client, moetune.runtime.profiles.autoload; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# -- point 3: only profiles measured on this node, in every path ---------------------------------------------
def test_daemon_modelled_profile_is_not_tuned(fake, tmp_path: Path) -> None:
    d = fake(lambda req: ok_reply(req["id"], result(backend="model:nvlink-h200x2")))
    res, warned = resolve(d.endpoint, tmp_path)
    assert res.source in ("policy", "default") and not res.tuned
    assert len(warned) == 1 and "MODELLED" in warned[0] and "nvlink-h200x2" not in res.profile_hash
    # explicit opt-in: used, and labelled
    res, warned = resolve(d.endpoint, tmp_path, allow_modelled=True)
    assert res.source == "daemon" and res.provenance == "preset" and not res.tuned
    assert len(warned) == 1 and "MODELLED" in warned[0]


OTHER_TORCH = "2.12.0+cpu" if node_identity.local_package_fact("torch") != "2.12.0+cpu" else "2.11.0+cpu"


def test_a_daemon_of_other_software_does_not_make_its_profile_tuned_here(fake, tmp_path: Path) -> None:
    """A daemon in another Python environment than this job's (or serving a capture): this node's GPUs and driver,
    another torch. daemon.json (a running daemon of this host) names its fingerprint and software, and it serves a
    profile it measured with them. The daemon's reported facts are checked against this process's packages:
    daemon.json's word alone would make the profile tuned here, with this process's other torch."""
    theirs = F.this_node_facts(torch=OTHER_TORCH)
    sw = node_identity.software_hash(theirs)
    d = fake(lambda req: ok_reply(req["id"], result(key(sw=sw))),
             info={"fingerprint": FP, "software": sw, "transports": ["nvlink"], "db": str(tmp_path / "none.db")},
             fabric=F.this_node_fabric(FP, theirs))
    res, warned = resolve(d.endpoint, tmp_path)
    assert res.source in ("policy", "default") and not res.tuned, res
    here = node_identity.local_package_fact("torch")
    assert len(warned) == 1 and "identity is unknown" in warned[0], warned
    assert f"torch {here} here, {OTHER_TORCH} recorded" in warned[0], warned
    # said as what it is: this node, another environment (not "not this node's"), and what to do
    text = " ".join(warned[0].split())
    assert "this process's Python packages are not those of the daemon" in text and "daemon's environment" in text
    # modelled profiles allowed: still not applied (its node's identity is what is unknown, not its provenance)
    res, _ = resolve(d.endpoint, tmp_path, allow_modelled=True)
    assert res.source in ("policy", "default") and not res.tuned, res


@pytest.mark.parametrize("fabric", ["silent", "unknown_op"])
def test_daemon_json_alone_does_not_make_a_profile_tuned(fake, tmp_path: Path, fabric: str) -> None:
    """daemon.json of a running daemon of this host names this node's fingerprint and software (this process's), but
    the daemon does not answer `fabric` (it hangs on it, or does not know the op): nothing checks its word against
    this node, so its measured profile is not tuned (daemon.json alone vouches for nothing), and the warning says
    why."""
    def answer(req: dict) -> bytes | None:
        if req.get("op") != "fabric":
            return ok_reply(req["id"], result())
        if fabric == "silent":
            return None
        return json.dumps({"v": 1, "id": req["id"], "ok": False, "epoch": "e1",
                           "error": {"code": wire.E_UNKNOWN_OP, "message": "unknown op 'fabric'"}}).encode()

    d = fake(answer, fabric=None)
    t0 = time.monotonic()
    # a budget of 1 s, not 200 ms: budget + 0.5 s leaves room for a loaded CI box (2 pytest-xdist workers on 2
    # cores) and still fails a fabric request whose retry gets a budget of its own (2 s)
    res, warned = resolve(d.endpoint, tmp_path, timeout_ms=1000)
    assert time.monotonic() - t0 < 1.5  # within the client's budget, silent daemon or not
    assert res.source in ("policy", "default") and not res.tuned, res
    assert any(r.get("op") == "fabric" for r in d.requests)
    assert len(warned) == 1 and "identity is unknown" in warned[0] and "the daemon's fabric facts" in warned[0], warned
    assert ("no time left" in warned[0] or "no reply" in warned[0]) if fabric == "silent" else "unknown op" in warned[0]


def test_daemon_profile_of_another_node_is_refused(fake, tmp_path: Path) -> None:
    d = fake(lambda req: ok_reply(req["id"], result(key(sw="6" * 16))))
    res, warned = resolve(d.endpoint, tmp_path, allow_modelled=True)
    assert res.source in ("policy", "default") and "another node or software" in warned[0]
    d2 = fake(lambda req: ok_reply(req["id"], result()), run=tmp_path / "run2")
    res, warned = resolve(d2.endpoint, tmp_path)
    assert res.source == "daemon" and res.tuned and res.provenance == "measured" and not warned


@pytest.mark.parametrize("field", ["fp", "sw"])
def test_a_profile_key_with_a_megabyte_fingerprint_is_a_bad_reply(fake, tmp_path: Path, field: str) -> None:
    """A request names a fingerprint or software of at most 256 characters (wire.Name): a key with a 1 MB one (its
    profile_hash computed to match) is not what a daemon serves. It must not reach the warning whole, nor key the
    per-process identity memo."""
    k = key(**{field: "6" * 1_000_000})
    d = fake(lambda req: ok_reply(req["id"], result(k)))
    res, warned = resolve(d.endpoint, tmp_path)
    assert res.source in ("policy", "default") and d.requests
    assert len(warned) == 1 and len(warned[0]) < 8192
    assert all(len(m[2]) + len(m[3]) < 1024 for m in client._REPORTED)


@pytest.mark.parametrize("field", ["fingerprint", "software"])
def test_a_fabric_reply_with_a_megabyte_fingerprint_or_software_is_a_bad_reply(fake, tmp_path: Path,
                                                                                field: str) -> None:
    """A daemon's fingerprint and software are hashes: a `fabric` reply naming a 1 MB one is not a daemon's, and must
    not reach the fallback warning whole (it said "reports software <1 MB> that is not its facts'")."""
    d = fake(lambda req: ok_reply(req["id"], result()), fabric={**F.this_node_fabric(FP), field: "9" * 1_000_000})
    res, warned = resolve(d.endpoint, tmp_path)
    assert res.source in ("policy", "default") and d.requests
    assert len(warned) == 1 and len(warned[0]) < 8192


def _seed_db(db: Path, facts: dict, records: list[ProfileRecord]) -> None:
    store = F.open_store(db)
    fps = {facts["_fp"]} | {r.key.fingerprint for r in records}
    for fp in fps:
        store.upsert_fingerprint(fp, facts["facts"] if fp == facts["_fp"] else {"gpus": [{"uuid": "GPU-elsewhere"}]}, origin="local")
    for r in records:
        ok, why = store.put_profile(r)
        assert ok, why


def _local_facts() -> dict:
    """Facts of a node like this one, GPU-less (no /proc/driver/nvidia in the test's fake proc)."""
    sw = {"driver": "none", "torch": "2.4.1", "moetune": "0.1.0"}
    return {"gpus": [], "software": sw}


def test_database_without_daemon_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    facts = _local_facts()
    F.pretend_node(monkeypatch, facts, tmp_path / "proc")
    mine_sw = node_identity.software_hash(facts)
    db = tmp_path / "moetune.db"
    preset = ProfileRecord(key=key("preset:nvlink-h200x2", "0" * 16, bucket=64), knobs=default_knobs("nvlink").replace(num_sms=8),
                           latency_us=1.0, spread_us=0.0, backend="model:nvlink-h200x2")
    foreign = ProfileRecord(key=key("a" * 16, "b" * 16, bucket=64), knobs=default_knobs("nvlink").replace(num_sms=16),
                            latency_us=2.0, spread_us=0.0, backend="local:nccl", provenance="measured")
    _seed_db(db, {"_fp": "c" * 16, "facts": facts}, [preset, foreign])
    nowhere = f"ipc://{tmp_path}/nowhere/daemon.sock"
    # no profile measured on this node: nothing from the database, and the warning says why
    res, warned = resolve(nowhere, tmp_path, db_path=db)
    assert res.source in ("policy", "default") and len(warned) == 1
    assert "MODELLED" in warned[0] and "another node" in warned[0]
    # opt-in: the preset, labelled
    res, warned = resolve(nowhere, tmp_path, db_path=db, allow_modelled=True)
    assert res.source == "database" and res.provenance == "preset" and "MODELLED" in warned[0]
    # measured here: the database fallback serves it as tuned (same fingerprint, other software: not)
    mine = ProfileRecord(key=key("c" * 16, mine_sw, bucket=64), knobs=default_knobs("nvlink").replace(num_sms=24),
                         latency_us=50.0, spread_us=0.0, backend="local:nccl", provenance="measured")
    other_sw = ProfileRecord(key=key("c" * 16, "9" * 16, bucket=1024), knobs=default_knobs("nvlink").replace(num_sms=32),
                             latency_us=5.0, spread_us=0.0, backend="local:nccl", provenance="measured")
    _seed_db(db, {"_fp": "c" * 16, "facts": facts}, [mine, other_sw])
    res, warned = resolve(nowhere, tmp_path, db_path=db)
    assert res.source == "database" and res.tuned and res.profile_hash == mine.profile_hash
    assert len(warned) == 1 and "read-only database" in warned[0]


def test_database_identity_refused_on_another_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database recorded on another node (GPU UUIDs, torch version differ) gives no identity: refused."""
    recorded = {"gpus": [{"uuid": "GPU-aaaa", "model": "H100"}], "software": {"torch": "2.4.1", "moetune": "0.1.0"}}
    here = {"gpus": [{"uuid": "GPU-bbbb", "model": "H100"}], "software": {"torch": "2.4.1", "moetune": "0.1.0"}}
    F.pretend_node(monkeypatch, here, tmp_path / "proc")
    db = tmp_path / "moetune.db"
    rec = ProfileRecord(key=key("c" * 16, node_identity.software_hash(recorded)), knobs=default_knobs("nvlink"),
                        latency_us=5.0, spread_us=0.0, backend="local:nccl", provenance="measured")
    _seed_db(db, {"_fp": "c" * 16, "facts": recorded}, [rec])
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db)
    assert res.source in ("policy", "default")
    assert "identity is unknown" in warned[0] and "UUIDs differ" in warned[0]


# Facts not shaped as discovery records them (a hand edit, another program's row, a daemon's odd reply): iterating
# {"gpus": 8} or calling .get on a list of software raised TypeError/AttributeError out of resolve (and autoload served
# the built-in default, skipping the rest of the database and the policy default).
BAD_FACTS = [{"gpus": 8}, {"gpus": ["GPU-x"], "software": {"torch": "2.4.1"}}, {"nics": 3, "software": {"torch": "x"}},
             {"excluded_nics": {"name": "mlx5_0"}, "software": {"torch": "x"}}, {"gpus": [], "software": ["torch"]}]


def _this_node_with_a_measured_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, ProfileRecord]:
    """A database whose fingerprint "c"*16 is this (pretended) node, with one measured profile of it; a fingerprint
    recorded after it is newer."""
    facts = _local_facts()
    F.pretend_node(monkeypatch, facts, tmp_path / "proc")
    db = tmp_path / "moetune.db"
    mine = ProfileRecord(key=key("c" * 16, node_identity.software_hash(facts), bucket=64),
                         knobs=default_knobs("nvlink").replace(num_sms=24), latency_us=50.0, spread_us=0.0,
                         backend="local:nccl", provenance="measured")
    _seed_db(db, {"_fp": "c" * 16, "facts": facts}, [mine])
    time.sleep(0.01)
    return db, mine


@pytest.mark.parametrize("bad", BAD_FACTS)
def test_badly_shaped_database_facts_are_unreadable_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 bad: dict) -> None:
    """The newest recorded fingerprint's facts are badly shaped: it is passed over as unreadable (never this node)
    and the lookup goes on to the older fingerprint of this node, whose measured profile serves as tuned."""
    db, mine = _this_node_with_a_measured_profile(tmp_path, monkeypatch)
    store = F.open_store(db)
    store.upsert_fingerprint("d" * 16, bad, origin="local")  # newest: read first
    store.close()
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db)
    assert res.source == "database" and res.tuned and res.profile_hash == mine.profile_hash, warned
    # alone: no identity, said as unreadable facts; the chain ends at the policy default, never raising
    db2 = tmp_path / "only-bad.db"
    store = F.open_store(db2)
    store.upsert_fingerprint("d" * 16, bad, origin="local")
    store.close()
    ident, why = db_lookup.node_identity_from_db(db2)
    assert ident is None and "unreadable facts" in why, why
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db2)
    assert res.source in ("policy", "default") and len(warned) == 1 and "unreadable facts" in warned[0], warned


@pytest.mark.parametrize("bad", BAD_FACTS)
def test_a_daemons_badly_shaped_fabric_facts_are_unreadable_not_a_crash(fake, tmp_path: Path, bad: dict) -> None:
    """A daemon's `fabric` reply with badly shaped facts (and their software hash, where one can be computed): this
    node's identity is unknown, so its measured profile is not tuned; resolve falls back with a warning, never raises."""
    sw = bad.get("software")
    soft = node_identity.software_hash({"software": sw}) if isinstance(sw, dict) else SW
    fab = {**F.this_node_fabric(FP), "facts": bad, "software": soft}
    d = fake(lambda req: ok_reply(req["id"], result(key(sw=soft))), fabric=fab)
    res, warned = resolve(d.endpoint, tmp_path)
    assert res.source in ("policy", "default") and not res.tuned, res
    assert len(warned) == 1 and "unreadable fabric facts" in warned[0], warned


def test_a_newer_preset_or_factless_fingerprint_does_not_become_this_node(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`moetune tune --preset X` records the preset's fingerprint with no facts and a newer last_seen: on a node whose
    GPUs cannot be read, nothing in it disagreed with the node, so the daemon-down lookup took it as this node's
    identity and passed over the profiles measured here. Neither it nor any fingerprint without facts is this node."""
    db, mine = _this_node_with_a_measured_profile(tmp_path, monkeypatch)
    store = F.open_store(db)
    store.upsert_fingerprint("preset:pcie4-consumer-4090x4:b0a1b0a1b0a1b0a1", {}, origin="local")  # newest: as tune --preset writes it
    for i in range(20):  # placeholders, as the store adds for a profile's key: more than the lookup's old window of 16
        store.upsert_fingerprint(f"{i:016x}", {}, origin="local")
    store.close()
    ident, why = db_lookup.node_identity_from_db(db)
    assert ident is not None and ident.fingerprint == "c" * 16, why
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db)
    assert res.source == "database" and res.tuned and res.profile_hash == mine.profile_hash, warned


def test_with_no_identity_only_a_presets_profile_serves_and_only_when_modelled_is_allowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No fingerprint of this node recorded (only a preset's): a preset's profile is for no node in particular, so
    with allow_modelled it serves, labelled MODELLED; a profile measured on some node never does, and without
    allow_modelled the database is not used."""
    F.pretend_node(monkeypatch, _local_facts(), tmp_path / "proc")
    db = tmp_path / "moetune.db"
    preset = ProfileRecord(key=key("preset:nvlink-h200x2", "0" * 16, bucket=64),
                           knobs=default_knobs("nvlink").replace(num_sms=8), latency_us=1.0, spread_us=0.0,
                           backend="model:nvlink-h200x2")
    measured = ProfileRecord(key=key("a" * 16, "b" * 16, bucket=64), knobs=default_knobs("nvlink").replace(num_sms=16),
                             latency_us=0.5, spread_us=0.0, backend="local:nccl", provenance="measured")
    _seed_db(db, {"_fp": "preset:nvlink-h200x2", "facts": {}}, [preset, measured])
    nowhere = f"ipc://{tmp_path}/nowhere/daemon.sock"
    res, warned = resolve(nowhere, tmp_path, db_path=db)
    assert res.source in ("policy", "default") and "identity is unknown" in warned[0]
    res, warned = resolve(nowhere, tmp_path, db_path=db, allow_modelled=True)
    assert res.source == "database" and not res.tuned and res.profile_hash == preset.profile_hash
    assert "only a preset's MODELLED profiles are considered" in warned[0] and "MODELLED" in warned[0]


def test_runtime_software_hash_is_the_tuner_one() -> None:
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.fabric.fingerprint import software_hash

    for cap in ("dgx-h100", "aws-p5", "cpu-laptop"):
        d = discover(F.CAPTURES / cap).to_dict()
        assert node_identity.software_hash(d) == software_hash(d)


# -- point 6: the environment allow-list; the runtime directory ---------------------------------------------
def test_env_allow_list_is_launcher_env() -> None:
    produced: dict[str, set[str]] = {}
    families = ["nvlink", "collective", "host_staged", "ibgda", "proxy:ibrc", "proxy:ucx", "proxy:libfabric",
                "proxy:libfabric/cxi", "proxy:libfabric/efa", "proxy:libfabric/verbs"]
    for t in TRANSPORTS:
        for fam in families:
            for n in (1, 2):
                for v in (1, 2, 4, 16):
                    k = default_knobs(t)
                    k = k.replace(channels=v) if t in ("collective", "host_staged") else k
                    k = k.replace(qps_per_pe=v) if t == "ibgda" else k
                    for name, val in launcher_env.launcher_env(k, fam, n).items():
                        assert launcher_env.env_refusal(name, val) is None, (name, val)
                        produced.setdefault(name, set()).add(val)
    assert set(produced) == set(launcher_env.ENV_RULES)
    for name, val in [("NCCL_NET_PLUGIN", "libevil.so"), ("LD_PRELOAD", "/x.so"), ("NCCL_MIN_NCHANNELS", "4; rm"),
                      ("NVSHMEM_REMOTE_TRANSPORT", "../lib"), ("NVSHMEM_LIBFABRIC_PROVIDER", "cxi/../../x"),
                      ("NCCL_MAX_NCHANNELS", "0"), ("NCCL_DEBUG_FILE", "/etc/passwd")]:
        assert launcher_env.env_refusal(name, val) is not None, name


def test_the_group_default_exports_only_what_launcher_env_may_produce() -> None:
    """The policy default a multi-host group falls back to (`autoload._group_default`) built its env from rank 0's
    family unfiltered, while every other path keeps only what launcher_env may produce: a database row's family
    `proxy:libfabric/BAD VALUE` put NVSHMEM_LIBFABRIC_PROVIDER='BAD VALUE' in the resolution every rank received.
    A proxy family's default (transport=proxy) serves one node's ranks only, so a group across hosts now falls back
    to collective and exports nothing of that family; the filter is checked where the proxy default stays (one node)."""
    from moetune.runtime.profiles.client import Resolution

    for family in ("proxy:libfabric/BAD VALUE", "proxy:libfabric/cxi/../../x"):
        res = Resolution(knobs=default_knobs("proxy"), source="database", profile_hash="h", status="current",
                         family=family)
        got = autoload._group_default(res, 1, None, "hosts disagree", ep_size=2)
        assert all(launcher_env.env_refusal(k, v) is None for k, v in got.env.items()), got.env
        assert got.env == {"NVSHMEM_IB_ENABLE_IBGDA": "0", "NVSHMEM_REMOTE_TRANSPORT": "libfabric"}
        assert got.message.startswith("hosts disagree; transport family ") and "not exporting" in got.message
        across = autoload._group_default(res, 2, None, "hosts disagree", ep_size=2)
        assert (across.family, across.knobs.transport, across.env) == ("collective", "collective", {}), across
    good = Resolution(knobs=default_knobs("proxy"), source="database", profile_hash="h", status="current",
                      family="proxy:libfabric/cxi")
    got = autoload._group_default(good, 1, None, "hosts disagree", ep_size=2)
    assert got.env == launcher_env.launcher_env(got.knobs, "proxy:libfabric/cxi", 1) and got.message == "hosts disagree"


def test_reply_env_filtered_before_export(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = {"NCCL_NET_PLUGIN": "libevil.so", "LD_PRELOAD": "/tmp/x.so", "NVSHMEM_REMOTE_TRANSPORT": "none",
           "NCCL_MIN_NCHANNELS": "a"}
    d = fake(lambda req: ok_reply(req["id"], result(env=bad)))
    for var in bad:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", d.endpoint)
    autoload.clear_cache()
    with pytest.warns(FallbackWarning, match="NCCL_NET_PLUGIN"):
        res = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=100)
    autoload.clear_cache()
    assert res.source == "daemon" and res.env == {"NVSHMEM_REMOTE_TRANSPORT": "none"}
    assert "NCCL_NET_PLUGIN" not in os.environ and "LD_PRELOAD" not in os.environ and "NCCL_MIN_NCHANNELS" not in os.environ
    assert os.environ.get("NVSHMEM_REMOTE_TRANSPORT") == "none"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another user")
def test_runtime_dir_of_another_user_is_refused(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = tmp_path / "tmp"  # like /tmp: world-writable, sticky
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    run = tmp / f"moetune-{os.getuid()}"
    d = fake(lambda req: ok_reply(req["id"], result()), run=run)
    os.chown(run, 65534, 65534)
    assert "owned by uid 65534" in (paths.untrusted_dir_reason(run) or "")
    res, warned = resolve(d.endpoint, tmp_path)
    assert res.source in ("policy", "default") and not d.requests
    assert "owned by uid 65534" in warned[0]
    assert daemon_info.read_daemon_info(d.endpoint, {}) is None
    # ours again, but group-writable: refused too
    os.chown(run, os.getuid(), os.getgid())
    os.chmod(run, 0o770)
    assert "group- or world-writable" in (paths.untrusted_dir_reason(run) or "")
    os.chmod(run, 0o700)
    assert paths.untrusted_dir_reason(run) is None
    # this user's own when this user is not root (as root, "ours" is root's, trusted whatever the rule says of
    # this user's): uid 65534's directory, seen by a process of uid 65534
    os.chown(run, 65534, 65534)
    monkeypatch.setattr(os, "getuid", lambda: 65534)
    assert paths.untrusted_dir_reason(run) is None


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a symbolic link owned by another user (os.lchown)")
def test_a_runtime_dir_that_is_another_users_link_is_refused(fake, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """In a sticky world-writable folder (like /tmp), `moetune-<uid>` is a symbolic link owned by another user to a
    directory that passes every check (root's, 0700). os.stat followed the link and only the target was checked, so
    it was trusted: its owner can repoint it at any time. Refused now, the socket in it too; this user's own link to
    the same directory is still trusted."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    target = tmp_path / "safe" / "run"
    d = fake(lambda req: ok_reply(req["id"], result()), run=target)
    link = tmp / f"moetune-{os.getuid()}"
    link.symlink_to(target, target_is_directory=True)
    os.lchown(link, 65534, 65534)
    assert paths.untrusted_dir_reason(target) is None  # the directory itself is fine
    assert "symbolic link owned by uid 65534" in (paths.untrusted_dir_reason(link) or "")
    assert "symbolic link owned by uid 65534" in (paths.untrusted_socket_reason(link / "daemon.sock") or "")
    res, warned = resolve(f"ipc://{link / 'daemon.sock'}", tmp_path)
    assert res.source in ("policy", "default") and not d.requests
    assert "symbolic link owned by uid 65534" in warned[0]
    assert daemon_info.read_daemon_info(f"ipc://{link / 'daemon.sock'}", {}) is None
    # this user's own link: its target is what is checked, as before
    os.lchown(link, os.getuid(), os.getgid())
    assert paths.untrusted_dir_reason(link) is None
    assert paths.untrusted_socket_reason(link / "daemon.sock") is None
    # ... also when this user is not root (as root, "this user's" link is root's, trusted whatever the rule says of
    # this user's): uid 65534's link, seen by a process of uid 65534
    os.lchown(link, 65534, 65534)
    monkeypatch.setattr(os, "getuid", lambda: 65534)
    assert paths.untrusted_dir_reason(link) is None
    assert paths.untrusted_socket_reason(link / "daemon.sock") is None


def test_root_made_dir_for_a_service_user_is_trusted(tmp_path: Path) -> None:
    """/run/moetune as systemd makes it (owned by the service user, mode 0750, in root's 0755 /run)."""
    parent = tmp_path / "run"
    parent.mkdir(mode=0o755)
    d = parent / "moetune"
    d.mkdir(mode=0o750)
    if os.getuid() == 0:
        os.chown(d, 65534, 65534)
    assert paths.untrusted_dir_reason(d) is None


# -- point 7: replies that do not validate fall back, never raise -------------------------------------------
def _garbage(kind: str) -> Callable[[dict], bytes]:
    def answer(req: dict) -> bytes:
        rid = req["id"]
        if kind == "not_json":
            return b"\x93\xa3abc not json"
        if kind == "wrong_types":
            r = result()
            r["key"]["ep_size"] = "two"
            return ok_reply(rid, r)
        if kind == "bad_knobs":
            r = result()
            r["knobs"]["num_sms"] = -3
            return ok_reply(rid, r)
        if kind == "newer_version":
            return json.dumps({"v": 2, "id": rid, "ok": True, "epoch": "e", "result": result()}).encode()
        if kind == "unknown_envelope_field":
            return ok_reply(rid, result(), signature="x")
        if kind == "unknown_result_field":
            return ok_reply(rid, {**result(), "plugin": "libevil.so"})
        if kind == "result_not_object":
            return ok_reply(rid, [1, 2, 3])
        raise AssertionError(kind)

    return answer


GARBAGE = ["not_json", "wrong_types", "bad_knobs", "newer_version", "unknown_envelope_field", "unknown_result_field",
           "result_not_object"]


def test_an_oversized_error_reply_is_a_bad_reply_not_a_megabyte_warning(fake, tmp_path: Path) -> None:
    """A daemon caps an error's message at 1024 characters (wire.encode_error) and its codes are short words: an
    ok=false reply with a 2 MB message or code is not a daemon's, and its text must not reach the warning whole."""
    def answer(req: dict) -> bytes:
        return json.dumps({"v": 1, "id": req["id"], "ok": False, "epoch": "e1",
                           "error": {"code": "c" * 100_000, "message": "m" * 2_000_000}}).encode()

    d = fake(answer)
    res, warned = resolve(d.endpoint, tmp_path)
    assert res.source in ("policy", "default") and d.requests
    assert len(warned) == 1 and "validate" in warned[0]
    assert len(warned[0]) < 8192 and len(res.message) < 8192


def test_an_oversized_epoch_is_a_bad_reply(fake, tmp_path: Path) -> None:
    """A daemon's epoch is 16 hex digits: a reply with a 100 KB one is not a daemon's. It must not become the
    client's epoch (kept in the resolution, in the per-process identity memo's keys, in messages)."""
    d = fake(lambda req: json.dumps({"v": 1, "id": req["id"], "ok": True, "epoch": "e" * 100_000,
                                     "result": result()}).encode(), fabric=None)
    res, warned = resolve(d.endpoint, tmp_path)
    assert res.source in ("policy", "default") and d.requests
    assert res.epoch is None or len(res.epoch) <= 64
    assert len(warned) == 1 and "validate" in warned[0] and len(warned[0]) < 8192


@pytest.mark.parametrize("kind", GARBAGE)
def test_bad_reply_falls_back_once_within_budget(fake, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    d = fake(_garbage(kind))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="moetune.client"):
        # a budget of 1 s, not 200 ms: budget + 0.5 s leaves room for a loaded CI box (2 pytest-xdist workers on
        # 2 cores), where 50 ms over it is within scheduling noise
        res, warned = resolve(d.endpoint, tmp_path, timeout_ms=1000)
    assert time.monotonic() - t0 < 1.5
    assert res.source in ("policy", "default") and d.requests
    # once, loudly, with every source and its reason
    assert len(warned) == 1 and len([r for r in caplog.records if r.name == "moetune.client"]) == 1
    assert "daemon:" in warned[0] and "database" in warned[0] and "using the" in warned[0]
    assert "validate" in warned[0] or "version" in warned[0] or "unknown fields" in warned[0]


def test_epbuffer_survives_a_garbage_daemon(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.buffer import EPBuffer
    from moetune.runtime.testing.launch import destroy_group_quietly, free_port, init_dist

    init_dist(0, 1, backend="gloo", port=free_port(), timeout_s=30)
    try:
        for kind in GARBAGE:
            d = fake(_garbage(kind), run=Path(os.environ.get("TMPDIR", "/tmp")) / f"mt-{os.getpid()}-{kind}")
            monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", d.endpoint)
            monkeypatch.setenv("MOETUNE_STORE_DB", "/nonexistent/moetune.db")
            autoload.clear_cache()
            with pytest.warns(FallbackWarning):
                buf = EPBuffer(None, model=QWEN, max_tokens=64, device="cpu")
            assert buf.knobs.transport == "collective" and d.requests, kind
    finally:
        autoload.clear_cache()
        destroy_group_quietly()


# -- point 8: transports the runtime lacks; nodes from the process group ------------------------------------
def test_served_ibgda_profile_falls_back(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ib = result(key(family="ibgda"), knobs=default_knobs("ibgda"), env={"NVSHMEM_IB_ENABLE_IBGDA": "1"})
    d = fake(lambda req: ok_reply(req["id"], ib), info={"fingerprint": FP, "software": SW, "transports": ["ibgda"]})
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", d.endpoint)
    monkeypatch.setenv("MOETUNE_STORE_DB", str(tmp_path / "none.db"))
    monkeypatch.delenv("NVSHMEM_IB_ENABLE_IBGDA", raising=False)
    autoload.clear_cache()
    with pytest.warns(FallbackWarning, match="transport 'ibgda' is not available"):
        res = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=100)
    autoload.clear_cache()
    assert res.source in ("policy", "default") and res.knobs.transport == "collective" and res.family == "collective"
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in os.environ


def test_nodes_from_process_group() -> None:
    from autoload_cases import case_group_nodes  # a light module: each spawned rank imports it, not this file

    from moetune.runtime.testing.launch import launch

    assert autoload.group_nodes(None) == 1  # no process group
    assert launch(case_group_nodes, 2, backend="gloo", args=(["a", "a"],), timeout_s=60) == [1, 1]
    assert launch(case_group_nodes, 4, backend="gloo", args=(["a", "a", "b", "b"],), timeout_s=60) == [2, 2, 2, 2]


def test_autoload_asks_for_the_group_nodes(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a collective profile: what a group across hosts can run (an nvlink one at nodes 2 is passed over, as the
    # runtime cannot run it: test_what_if_beyond_the_runtime.py)
    d = fake(lambda req: ok_reply(req["id"], result(key(family="collective", nodes=req.get("nodes", 1)),
                                                    knobs=default_knobs("collective"))))
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", d.endpoint)
    monkeypatch.setattr(autoload, "group_nodes", lambda group=None: 2)
    autoload.clear_cache()
    res = autoload.autoload_profile(model=QWEN, ep_size=2, max_tokens=100)
    autoload.clear_cache()
    asked = [r for r in d.requests if r.get("op") == "get_profile"]  # the fabric op (this node's identity) follows it
    assert asked and asked[-1]["nodes"] == 2 and res.key is not None and res.key.nodes == 2


def test_pick_profile_prefers_measured_and_limits_the_bucket_distance() -> None:
    """Point 1: a modelled 27 µs must not win over a measured 60 µs; a profile far from the asked tokens is none."""
    from moetune.runtime.knobs import default_knobs
    from moetune.runtime.profile_record import ProfileKey, ProfileRecord
    from moetune.runtime.profiles.db_lookup import pick_profile

    def rec(family: str, bucket: int, lat: float, backend: str, prov: str) -> ProfileRecord:
        key = ProfileKey(fingerprint="f" * 16, software="s" * 16, transport_family=family, ep_size=2, nodes=1,
                         hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=bucket)
        return ProfileRecord(key=key, knobs=default_knobs(family), latency_us=lat, spread_us=1.0, backend=backend,
                             provenance=prov)

    measured = rec("collective", 4096, 60.0, "local:nccl", "measured")
    preset = rec("nvlink", 4096, 27.0, "model:nvlink-h200x2", "preset")
    node = rec("host_staged", 4096, 20.0, "model:node:ffff", "node_model")
    assert pick_profile([preset, measured, node], 3000) is measured
    assert pick_profile([preset, node], 3000) is node
    assert pick_profile([measured], 16) is None  # 4096 is many rungs from 16 tokens
    assert pick_profile([measured], 2048) is measured  # one rung away


def test_socket_in_a_sticky_shared_dir_is_trusted_only_when_ours(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import socket as _socket

    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    sock = shared / "moetune.sock"
    s = _socket.socket(_socket.AF_UNIX)
    s.bind(str(sock))
    try:
        assert paths.untrusted_socket_reason(sock) is None  # ours, and the sticky bit keeps others from swapping it
        os.chmod(shared, 0o777)  # not sticky: anyone could have replaced it
        assert "world-writable" in (paths.untrusted_socket_reason(sock) or "")
        os.chmod(shared, 0o1777)
        if os.getuid() == 0:
            os.chown(shared, 65534, 65534)  # our socket in another user's sticky folder: its owner may swap it
            assert "world-writable" in (paths.untrusted_socket_reason(sock) or "")
            os.chown(shared, 0, 0)
            os.chown(sock, 65534, 65534)  # someone else's socket squatting the name
            assert paths.untrusted_socket_reason(sock) is not None
            # ours when we are not root (as root, "ours" is root's, trusted whatever the rule says of this user's):
            # the folder and the socket of uid 65534, checked by a process of uid 65534
            os.chown(shared, 65534, 65534)
            monkeypatch.setattr(os, "getuid", lambda: 65534)
            assert paths.untrusted_socket_reason(sock) is None
    finally:
        s.close()


def test_autoload_cache_never_hands_one_token_count_another_counts_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 and 300 tokens fall in one rung (256), but with buckets 128 and 512 stored the nearest is 128 for one and
    512 for the other: the cache must not give the second call the first call's profile."""
    recs = [ProfileRecord(key=key(bucket=b), knobs=default_knobs("nvlink").replace(num_sms=b // 8), latency_us=20.0,
                          spread_us=0.1, backend="local:nccl", provenance="measured") for b in (128, 512)]

    def resolve(**kw: Any) -> client.Resolution:
        rec = db_lookup.pick_profile(recs, kw["max_tokens"])
        assert rec is not None
        return client.Resolution(knobs=rec.knobs, source="daemon", profile_hash=rec.profile_hash, status="current",
                                 key=rec.key, family="nvlink", provenance="measured", tuned=True)

    monkeypatch.setattr(autoload, "_resolve", resolve)
    autoload.clear_cache()
    try:
        got = [autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=t).key.token_bucket for t in (200, 300)]
        assert got == [128, 512]
        assert autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=200).key.token_bucket == 128
    finally:
        autoload.clear_cache()


def _collective_policy() -> client.Resolution:
    """The resolution of a lookup that fell back to the collective policy default."""
    knobs = default_knobs("collective")
    return client.Resolution(knobs=knobs, source="policy", profile_hash=f"policy:{knobs.digest()}", status="default",
                             family="collective")


def test_autoload_cache_never_hands_one_devices_resolution_to_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which transports can run depends on the device (nvlink on a CUDA device, not on the CPU), but the cache key
    left the device out: a CPU layer made after a CUDA one in the same process got the CUDA layer's nvlink
    profile, which it cannot run."""
    nv = ProfileRecord(key=key(bucket=128), knobs=default_knobs("nvlink"), latency_us=20.0, spread_us=0.1,
                       backend="local:nccl", provenance="measured")

    asked: list[int] = []

    class Client:  # the daemon's answer, passed through the runtime's own availability check
        def resolve(self, *, transport_ok: Callable[[str], str | None], **kw: Any) -> client.Resolution:
            asked.append(kw["tokens"])
            if transport_ok("nvlink") is None:
                return client.Resolution(knobs=nv.knobs, source="daemon", profile_hash=nv.profile_hash,
                                         status="current", key=nv.key, family="nvlink", tuned=True)
            return _collective_policy()

        def close(self) -> None:
            pass

    monkeypatch.setattr(autoload, "ProfileClient", Client)
    monkeypatch.setattr(autoload, "_availability", {("nvlink", "cuda:0", None): None, ("nvlink", "cpu", None): "needs CUDA"})
    autoload.clear_cache()
    try:
        on = {d: autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=128, device=d).knobs.transport
              for d in ("cuda:0", "cpu")}
        assert on == {"cuda:0": "nvlink", "cpu": "collective"}
        # still one lookup per device: the cache serves the same device again
        assert autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=128, device="cuda:0").source == "daemon"
        assert len(asked) == 2
    finally:
        autoload.clear_cache()


def test_autoload_passes_over_a_one_sided_profile_beyond_its_world_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvlink and proxy serve at most MAX_WORLD (8) ranks (transports/_onesided.py check_world). A model tune before
    668bd35b stored nvlink profiles at EP 16 (the model predicted them); served with allow_modelled, autoload handed
    EPBuffer(knobs=None) an nvlink profile its loaded-knob check then refused with a KnobError, instead of passing it
    over as it passes over a transport this runtime cannot run (the policy default, with a warning)."""
    nv = ProfileRecord(key=key(bucket=128), knobs=default_knobs("nvlink"), latency_us=20.0, spread_us=0.1,
                       backend="model:nvlink-h200x2")
    why: dict[int, str | None] = {}

    class Client:  # the stored profile, passed through the runtime's own check, as the database path does
        def resolve(self, *, transport_ok: Callable[[str], str | None], **kw: Any) -> client.Resolution:
            why[kw["ep_size"]] = problem = transport_ok("nvlink")
            if problem is None:
                return client.Resolution(knobs=nv.knobs, source="database", profile_hash=nv.profile_hash,
                                         status="current", key=nv.key, family="nvlink", provenance="preset")
            return _collective_policy()

        def close(self) -> None:
            pass

    monkeypatch.setattr(autoload, "ProfileClient", Client)
    autoload.clear_cache()
    try:
        got = {ep: autoload.autoload_profile(model=QWEN, ep_size=ep, nodes=1, max_tokens=128).knobs.transport
               for ep in (8, 16)}
        assert got == {8: "nvlink", 16: "collective"}, why
        assert why[8] is None and "at most 8 ranks" in str(why[16])
    finally:
        autoload.clear_cache()


def test_own_node_model_beats_a_newer_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With allow_modelled, this node's calibrated model is the prediction to use; a preset (another machine's
    model) only where the node has none. pick_profile alone took the most recently updated fingerprint, so a
    preset stored after the node model won."""
    facts = _local_facts()
    F.pretend_node(monkeypatch, facts, tmp_path / "proc")
    mine_sw = node_identity.software_hash(facts)
    db = tmp_path / "moetune.db"
    own = ProfileRecord(key=key("c" * 16, mine_sw, bucket=64), knobs=default_knobs("nvlink").replace(num_sms=24),
                        latency_us=30.0, spread_us=0.0, backend="model:node:" + "c" * 16, provenance="node_model")
    _seed_db(db, {"_fp": "c" * 16, "facts": facts}, [own])
    time.sleep(0.01)  # the preset is the newer row
    preset = ProfileRecord(key=key("preset:nvlink-h200x2", "0" * 16, bucket=64), knobs=default_knobs("nvlink").replace(num_sms=8),
                           latency_us=1.0, spread_us=0.0, backend="model:nvlink-h200x2")
    _seed_db(db, {"_fp": "c" * 16, "facts": facts}, [preset])
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db, allow_modelled=True)
    assert res.source == "database" and res.profile_hash == own.profile_hash and res.provenance == "node_model", warned


def test_an_empty_database_file_is_said_to_be_no_moetune_database(tmp_path: Path) -> None:
    """The read-only fallback said only SQLite's "no such table: fingerprints" of an empty (or foreign) file."""
    import sqlite3

    db = tmp_path / "moetune.db"
    db.touch()
    with pytest.raises(sqlite3.OperationalError, match=r"not a moetune profile database .*`moetune db upgrade --db"):
        db_lookup.db_read(db, "SELECT hash FROM fingerprints")


def test_the_daemons_fabric_is_asked_once_per_process_not_per_autoload(fake, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """autoload makes a client per resolution, so the identity memo is the process's, not the client's: one fabric
    request per daemon start for the process, not get_profile AND fabric (a ~24 KB reply) for every resolution."""
    d = fake(lambda req: ok_reply(req["id"], result()))
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", d.endpoint)
    autoload.clear_cache()
    for tokens in (60, 61, 62, 63):  # four resolutions (other max_tokens: not autoload's own cache)
        res = autoload.autoload_profile(model=QWEN, ep_size=2, max_tokens=tokens)
        assert res.source == "daemon" and res.tuned, res.message
    ops = [r.get("op") for r in d.requests]
    assert ops.count("get_profile") == 4 and ops.count("fabric") == 1, ops
    autoload.clear_cache()  # forgets it: asked again
    autoload.autoload_profile(model=QWEN, ep_size=2, max_tokens=64)
    assert [r.get("op") for r in d.requests].count("fabric") == 2


@pytest.mark.parametrize("how", ["import", "shared database"])
def test_this_nodes_fingerprint_behind_many_newer_foreign_ones_is_still_found(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             how: str) -> None:
    """The daemon-down lookup read only the 16 most recently seen fingerprints: 16 other nodes' rows newer than this
    node's own (an import keeps the file's last_seen; other daemons on a shared database) hid it, and no profile
    of this node applied. Every row is read now, newest first."""
    db, mine = _this_node_with_a_measured_profile(tmp_path, monkeypatch)
    others = [(f"{i:016x}", {"gpus": [{"uuid": f"GPU-other-{i}", "model": "H100"}],
                              "software": {"driver": "550.54.15", "torch": "2.5.0", "moetune": "0.1.0"}})
              for i in range(20)]
    store = F.open_store(db)
    if how == "import":
        # an export of other nodes, seen (on their databases) after this node's row was last written here
        t0 = dt.datetime.fromisoformat(db_lookup.db_read(db, "SELECT max(last_seen) FROM fingerprints")[0][0])
        doc = {"format": "moetune-profiles", "version": 1, "profiles": [],
               "fingerprints": [{"hash": h, "facts": f, "first_seen": (t0 + dt.timedelta(seconds=1)).isoformat(),
                                 "last_seen": (t0 + dt.timedelta(seconds=1 + n / 1000)).isoformat()}
                                for n, (h, f) in enumerate(others)]}
        assert store.import_bytes(json.dumps(doc).encode()).fingerprints == len(others)
    else:
        for h, f in others:  # as other nodes' daemons record theirs
            store.upsert_fingerprint(h, f, origin="local")
    store.close()
    rows = db_lookup.db_read(db, "SELECT hash FROM fingerprints ORDER BY last_seen DESC LIMIT 16")
    assert "c" * 16 not in {h for (h,) in rows}  # this node's row is past the old window
    ident, why = db_lookup.node_identity_from_db(db)
    assert ident is not None and ident.fingerprint == "c" * 16, why
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db)
    assert res.source == "database" and res.tuned and res.profile_hash == mine.profile_hash, warned


def test_autoload_cache_never_serves_a_modelled_profile_once_allow_modelled_is_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key left out the settings the lookup judged under: a preset's MODELLED profile, resolved while
    MOETUNE_CLIENT_ALLOW_MODELLED=1, was served again from the cache after the variable was unset (a modelled
    number applied without allow_modelled). Likewise MOETUNE_AUTOLOAD=0 must not be answered from the cache."""
    F.pretend_node(monkeypatch, _local_facts(), tmp_path / "proc")
    db = tmp_path / "moetune.db"
    preset = ProfileRecord(key=key("preset:nvlink-h200x2", "0" * 16, bucket=64),
                           knobs=default_knobs("nvlink").replace(num_sms=8), latency_us=1.0, spread_us=0.0,
                           backend="model:nvlink-h200x2")
    _seed_db(db, {"_fp": "preset:nvlink-h200x2", "facts": {}}, [preset])
    for var in [k for k in os.environ if k.startswith("MOETUNE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", f"ipc://{tmp_path}/nowhere/daemon.sock")
    monkeypatch.setenv("MOETUNE_STORE_DB", str(db))
    monkeypatch.setenv("MOETUNE_CLIENT_ALLOW_MODELLED", "1")
    autoload.clear_cache()
    try:
        with pytest.warns(FallbackWarning):
            res = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=64)
        assert res.source == "database" and res.profile_hash == preset.profile_hash and not res.tuned
        monkeypatch.delenv("MOETUNE_CLIENT_ALLOW_MODELLED")
        with pytest.warns(FallbackWarning):
            res = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=64)
        assert res.source in ("policy", "default") and res.profile_hash != preset.profile_hash, res
        monkeypatch.setenv("MOETUNE_CLIENT_ALLOW_MODELLED", "1")
        monkeypatch.setenv("MOETUNE_AUTOLOAD", "0")
        res = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=64)
        assert res.source in ("policy", "default") and "client.autoload is false" in res.message, res
    finally:
        autoload.clear_cache()


def test_autoload_cache_follows_an_edit_of_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config file may set client.autoload (and allow_modelled, env_mismatch): a resolution judged before the
    file said `autoload = false` must not be served after it does."""
    for var in [k for k in os.environ if k.startswith("MOETUNE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", f"ipc://{tmp_path}/nowhere/daemon.sock")
    monkeypatch.setenv("MOETUNE_STORE_DB", str(tmp_path / "none.db"))
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[client]\nautoload = true\n")
    monkeypatch.setenv("MOETUNE_CONFIG", str(cfg))
    autoload.clear_cache()
    try:
        with pytest.warns(FallbackWarning):
            first = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=64)
        assert "client.autoload is false" not in first.message, first
        cfg.write_text("[client]\nautoload = false\n")
        res = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=64)
        assert "client.autoload is false" in res.message, res
    finally:
        autoload.clear_cache()


def test_a_kept_user_value_of_a_profile_variable_is_warned_not_only_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """launcher_env's variables are left out of the performance environment compared with a profile's (they follow
    from its knobs), so a job that set NVSHMEM_REMOTE_TRANSPORT=ucx itself ran a proxy:ibrc profile under ucx with
    env_status "same" and only an INFO line saying the user's value was kept: it must be a warning (once)."""
    from moetune.runtime import _once

    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "ucx")
    _once.reset("launcher_env.kept")
    try:
        with caplog.at_level(logging.INFO, logger="moetune.autoload"):
            for _ in range(2):  # every layer's cache hit applies it again: said once
                assert launcher_env.apply_env({"NVSHMEM_REMOTE_TRANSPORT": "ibrc"}) == {}
        assert os.environ["NVSHMEM_REMOTE_TRANSPORT"] == "ucx"
        said = [r for r in caplog.records if r.levelno >= logging.WARNING and "NVSHMEM_REMOTE_TRANSPORT" in r.getMessage()]
        assert len(said) == 1 and "ibrc" in said[0].getMessage() and "ucx" in said[0].getMessage(), caplog.records
    finally:
        _once.reset("launcher_env.kept")


def test_recorded_gpu_uuids_are_checked_where_only_some_gpus_have_one(tmp_path: Path) -> None:
    """Discovery records "" for a GPU whose UUID it could not read; the UUID check ran only where every recorded GPU
    had one, so another node's facts with one UUID missing matched any node with as many GPUs (count only)."""
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    for i, uuid in enumerate(("GPU-here-0", "GPU-here-1")):
        (gpus / f"0000:{i:02x}:00.0").mkdir(parents=True)
        (gpus / f"0000:{i:02x}:00.0" / "information").write_text(f"Model: \t H100\nGPU UUID: \t {uuid}\n")
    proc = tmp_path / "proc"
    why, _ = node_identity.mismatch({"gpus": [{"uuid": "GPU-elsewhere"}, {"uuid": ""}]}, proc)
    assert why is not None and "UUID" in why
    # this node's own facts with one UUID unread still match (what was recorded is here), as before
    assert node_identity.mismatch({"gpus": [{"uuid": "GPU-here-1"}, {"uuid": ""}]}, proc)[0] is None
    assert node_identity.mismatch({"gpus": [{"uuid": ""}, {"uuid": ""}]}, proc)[0] is None  # count only: nothing read
    assert node_identity.mismatch({"gpus": [{"uuid": "GPU-here-0"}, {"uuid": "GPU-here-1"}]}, proc)[0] is None


def test_gpus_recorded_without_a_uuid_are_checked_by_model(tmp_path: Path) -> None:
    """Where discovery recorded no UUID, only the GPU count was compared: another node's facts (two H100s, UUIDs
    unread) matched a node of two H200s with the same driver and packages, and its profiles were applied as tuned
    on hardware they were not measured on. The model /proc reports for each unrecorded GPU is compared instead."""
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    for i, uuid in enumerate(("GPU-here-0", "GPU-here-1")):
        (gpus / f"0000:{i:02x}:00.0").mkdir(parents=True)
        (gpus / f"0000:{i:02x}:00.0" / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ: \t\t 16\nGPU UUID: \t {uuid}\n")
    proc = tmp_path / "proc"
    h100 = {"model": "NVIDIA H100 80GB HBM3", "uuid": ""}
    why, _ = node_identity.mismatch({"gpus": [h100, h100]}, proc)
    assert why is not None and "NVIDIA H100 80GB HBM3" in why and "NVIDIA H200" in why, why
    # one UUID recorded (here), the other GPU unread and of another model: refused too
    why, _ = node_identity.mismatch({"gpus": [{"model": "NVIDIA H200", "uuid": "GPU-here-0"}, h100]}, proc)
    assert why is not None and "model" in why, why
    # this node's own facts with the UUIDs unread still match (the models are its own)
    h200 = {"model": "NVIDIA H200", "uuid": ""}
    why, checked = node_identity.mismatch({"gpus": [h200, h200]}, proc)
    assert why is None and "GPU models" in checked, why
    assert node_identity.mismatch({"gpus": [{"model": "NVIDIA H200", "uuid": "GPU-here-1"}, h200]}, proc)[0] is None
    # no model recorded (older facts): nothing to compare, as before
    assert node_identity.mismatch({"gpus": [{"uuid": ""}, {"uuid": ""}]}, proc)[0] is None


def _client_of_node_with(tmp_path: Path, transports: list[str]) -> ProfileClient:
    """A client of a node whose daemon.json lists `transports` (its preferred family first), no daemon answering and
    no database: every lookup ends in the policy-default step."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "daemon.json").write_text(json.dumps({"fingerprint": FP, "software": SW, "transports": transports,
                                                 "db": str(tmp_path / "none.db")}))
    return ProfileClient(f"ipc://{run}/daemon.sock", db_path=tmp_path / "none.db", env={"HOME": "/nonexistent"})


@pytest.mark.parametrize("transports", [["host_staged", "collective"], ["nvlink", "host_staged", "collective"]])
def test_a_multi_host_fallback_never_picks_a_one_host_family(tmp_path: Path, transports: list[str]) -> None:
    """The policy-default step picks the node's preferred family from daemon.json, leaving NVLink out where the group
    spans hosts, but not host_staged, whose staging memory is one host's /dev/shm file: a two-node group of PCIe
    boxes (nvlink absent or skipped) got host_staged's default knobs, and every GPU rank failed building its buffer."""
    c = _client_of_node_with(tmp_path, transports)
    with pytest.warns(FallbackWarning, match="NO tuned profile"):
        res = c.resolve(model=QWEN, ep_size=4, tokens=100, nodes=2)
    assert res.family == "collective" and res.knobs.transport == "collective", res
    with pytest.warns(FallbackWarning, match="NO tuned profile"):  # one host: the node's preferred family, as before
        res = c.resolve(model=QWEN, ep_size=4, tokens=100, nodes=1)
    assert res.family == transports[0], res
    # the group default a multi-host group falls back to when its hosts disagree keeps to it too
    one_host = client.Resolution(knobs=default_knobs("host_staged"), source="policy", profile_hash="x",
                                 status="default", family="host_staged")
    assert autoload._group_default(one_host, 2, None, "hosts disagree", ep_size=4).family == "collective"


@pytest.mark.parametrize(("transports", "ep", "nodes"), [
    (["proxy:ibrc", "collective"], 4, 2),  # the runtime's proxy serves one node's ranks (`group_world_problem`)
    (["nvlink", "proxy:ibrc", "host_staged", "collective"], 8, 2),
    (["nvlink", "collective"], 16, 1),  # one host, beyond MAX_WORLD: nvlink cannot serve it either
])
def test_the_fallback_family_is_one_the_group_world_rule_lets_serve_the_group(
        tmp_path: Path, transports: list[str], ep: int, nodes: int) -> None:
    """The policy-default step's family is asked the one world rule (`knobs.group_world_problem`), not a list of its
    own: that list (nvlink, host_staged) left proxy out, so a two-node lookup on an InfiniBand node (daemon.json:
    proxy:ibrc first) answered proxy's policy default, which the runtime refuses for a group across nodes
    (`moetune query --nodes 2` printed it; autoload then said proxy was "not available in this runtime")."""
    c = _client_of_node_with(tmp_path, transports)
    with pytest.warns(FallbackWarning, match="NO tuned profile"):
        res = c.resolve(model=QWEN, ep_size=ep, tokens=100, nodes=nodes)
    assert res.family == "collective" and res.knobs.transport == "collective", res
    assert client.one_host_family("proxy:ibrc") and not client.one_host_family("collective")
    # the group default of a multi-host group whose hosts disagree keeps to it too
    proxy = client.Resolution(knobs=default_knobs("proxy"), source="policy", profile_hash="x", status="default",
                              family="proxy:ibrc")
    agreed = autoload._group_default(proxy, 2, None, "hosts disagree", ep_size=4)
    assert agreed.family == "collective" and "the policy default of proxy:ibrc: " in agreed.message, agreed
    assert "spans 2 nodes" in agreed.message, agreed.message


def test_a_measurement_whose_measured_on_names_another_node_is_not_tuned(fake, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A record labelled measured under this node's key whose `measured_on` names another fingerprint says it was
    measured elsewhere (an import refuses it; a hand edit or another tool's write may hold it): its numbers are that
    node's, so it is not applied as tuned, from the daemon nor from the database; one measured here still is."""
    elsewhere = "a" * 16
    claim = {**result(), "measured_on": elsewhere}
    d = fake(lambda req: ok_reply(req["id"], claim))
    res, warned = resolve(d.endpoint, tmp_path, allow_modelled=True)
    assert res.source in ("policy", "default") and not res.tuned, res
    assert any(f"measured on fingerprint {elsewhere}" in w for w in warned), warned
    # the database fallback: the row as a hand edit leaves it
    db, mine = _this_node_with_a_measured_profile(tmp_path, monkeypatch)
    nowhere = f"ipc://{tmp_path}/nowhere/daemon.sock"
    res, _ = resolve(nowhere, tmp_path, db_path=db)
    assert res.source == "database" and res.tuned and res.profile_hash == mine.profile_hash  # measured here: tuned
    import sqlite3

    with sqlite3.connect(db) as c:
        c.execute("UPDATE profiles SET measured_on = ?", (elsewhere,))
    res, warned = resolve(nowhere, tmp_path, db_path=db, allow_modelled=True)
    assert res.source in ("policy", "default") and not res.tuned, res
    assert any(f"measured on fingerprint {elsewhere}" in " ".join(w.split()) for w in warned), warned
    assert not msgspec.structs.replace(mine, measured_on=elsewhere).is_tuned_for(mine.key.fingerprint, mine.key.software)


# -- a fallback database other users can write is not read: it could feed the job profiles -----------------------
@pytest.mark.parametrize("what", ["file", "folder", "owner"])
def test_a_database_others_can_write_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    db, mine = _this_node_with_a_measured_profile(shared, monkeypatch)  # its -wal beside it: made there
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db)
    assert res.source == "database" and res.profile_hash == mine.profile_hash, warned  # trusted: read as before
    if what == "file":
        os.chmod(db, 0o664)
        why = "group- or world-writable (mode 664)"
    elif what == "folder":
        os.chmod(shared, 0o770)  # no sticky bit: a member of its group could put another file at the path
        why = f"{shared} is group- or world-writable (mode 770)"
    else:
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(db, 54321, -1)  # neither this user, nor root, nor its folder's owner
        why = "owned by uid 54321"
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db)
    assert res.source in ("policy", "default"), warned  # as for a missing database: the defaults
    assert len(warned) == 1 and f"database {db}: not used" in warned[0] and why in warned[0], warned


def test_a_service_database_in_its_state_folder_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The system unit's layout: /var/lib/moetune (0750, the service user's) under a root folder, the database 0640 of
    the service user, read by a member of its group: trusted (its folder's owner wrote it)."""
    if os.getuid() != 0:
        pytest.skip("giving files to another user needs root")
    state = tmp_path / "state"
    state.mkdir(mode=0o750)
    db, _mine = _this_node_with_a_measured_profile(state, monkeypatch)
    os.chmod(db, 0o640)
    os.chown(state, 54321, -1)
    os.chown(db, 54321, -1)
    assert paths.untrusted_file_reason(db) is None
    monkeypatch.setattr(os, "getuid", lambda: 12345)  # a job of another user (root's folder above stays trusted)
    assert paths.untrusted_file_reason(db) is None
    os.chown(db, 54322, -1)  # a third user's file in the service's folder: refused
    assert "owned by uid 54322" in (paths.untrusted_file_reason(db) or "")


@pytest.mark.parametrize("what", ["mode", "owner"])
@pytest.mark.parametrize("side", ["-wal", "-shm", "-journal"])
def test_a_database_side_file_others_can_write_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str,
                                                           side: str) -> None:
    """SQLite reads a database's -wal (through its -shm index) and a hot -journal as part of the database: in a sticky
    folder such as /tmp, where the database itself is safe (only its owner may replace it), another user may still
    create the side files beside it (a -wal of their pages is read as the database's latest content). Each side file
    there is judged as the database file is."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # this user's sticky folder, world-writable: as /tmp is root's
    db, mine = _this_node_with_a_measured_profile(sticky, monkeypatch)
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db)
    assert res.source == "database" and res.profile_hash == mine.profile_hash, warned  # trusted: read as before
    other = sticky / (db.name + side)
    if not other.exists():  # the store's own -wal/-shm may be there: then that one is changed
        other.write_bytes(b"")
    if what == "mode":
        os.chmod(other, 0o666)
        why = f"{other} is group- or world-writable (mode 666)"
    else:
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chmod(other, 0o644)
        os.chown(other, 54321, -1)  # another user's, made before this job looked
        why = f"{other} is owned by uid 54321"
    assert why in (paths.untrusted_file_reason(db) or ""), paths.untrusted_file_reason(db)
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=db)
    assert res.source in ("policy", "default"), warned
    assert len(warned) == 1 and f"database {db}: not used" in warned[0] and why in warned[0], warned


def test_query_labels_nothing_from_a_database_the_client_does_not_trust(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`moetune query` labels a served profile (provenance, measured on, backend) from the fallback database: one other
    users can write is not read there either (the client's rule), or they would choose what the label says."""
    from types import SimpleNamespace

    from moetune.tuner.cli import query as Q

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    db, mine = _this_node_with_a_measured_profile(shared, monkeypatch)
    res = SimpleNamespace(key=mine.key, profile_hash=mine.profile_hash, provenance="", tuned=False, source="daemon")
    assert Q.provenance_of(res, db) == ("measured", "c" * 16, "local:nccl")  # trusted: read as before
    os.chmod(db, 0o666)
    assert paths.untrusted_file_reason(db) is not None
    assert Q.provenance_of(res, db) == ("unknown", "", "")
    told = SimpleNamespace(key=mine.key, profile_hash=mine.profile_hash, provenance="measured", tuned=False,
                           source="daemon")
    assert Q.provenance_of(told, db) == ("measured", "", "")  # the reply's word alone, none of the file's


def test_another_users_link_to_a_trusted_database_in_a_sticky_folder_is_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a sticky folder such as /tmp, the database's path may be a link another user made, aimed at this user's own
    database: its target and both folders pass, yet the link's owner can repoint it at a database of theirs between
    this check and SQLite's open (with fs.protected_symlinks off). The link is judged as a socket's folder link is
    (`foreign_link_reason`): another user's is refused; this user's own link there is read as before."""
    if os.getuid() != 0:
        pytest.skip("a symbolic link owned by another user needs root (os.lchown)")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    db, mine = _this_node_with_a_measured_profile(private, monkeypatch)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # this user's sticky folder, world-writable: as /tmp is root's
    link = sticky / "profiles.db"
    link.symlink_to(db)
    assert paths.untrusted_file_reason(link) is None  # this user's own link: trusted
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=link)
    assert res.source == "database" and res.profile_hash == mine.profile_hash, warned
    os.lchown(link, 54321, 54321)
    why = f"{link} is a symbolic link owned by uid 54321"
    assert why in (paths.untrusted_file_reason(link) or ""), paths.untrusted_file_reason(link)
    res, warned = resolve(f"ipc://{tmp_path}/nowhere/daemon.sock", tmp_path, db_path=link)
    assert res.source in ("policy", "default"), warned
    assert len(warned) == 1 and f"database {link}: not used" in warned[0] and why in warned[0], warned
