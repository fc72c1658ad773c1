"""Issue 19, the daemon side: the automatic re-tune never stands another machine's preset in for this node,
the IPC socket never deletes or chmods what the daemon did not create, CURVE clients are authorised by an
allow-list, bad config is a clear error, list requests do not stall get_profile, one bad row does not stop
the daemon, a replaced GPU is a hardware change, and `status` shows provenance."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import stat
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonError, DaemonUnavailable
from moetune.runtime.testing.launch import free_port
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon, TuneSettings

pytestmark = pytest.mark.timeout(120)




def _daemon(tmp: Path, store, **kw) -> Daemon:
    kw.setdefault("endpoint", f"ipc://{tmp}/run/daemon.sock")
    return Daemon(store=store, **kw).start(background=True)


# -- point 1: the re-tune never takes a preset as this node's profile --------------------------------------
def test_retune_without_calibrated_model_says_so_and_writes_no_preset(tmp_path: Path) -> None:
    from moetune.tuner.fabric.discovery import discover

    cap = tmp_path / "capture"
    facts = F.make_capture(cap, "dgx-h100")
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts, ep_size=8, buckets=(64, 1024))
    d = _daemon(tmp_path, store, discover=lambda: discover(cap), rediscover_interval_s=0.1,
                tune=TuneSettings(backend="model", trials=3, timeout_s=60))
    try:
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        new = F.set_port_state(cap, "1: DOWN")  # no node-<new>.toml: `moetune profile` never ran on this fabric
        job = F.until(lambda: next((j for j in c.status().jobs.recent if j.state in ("done", "failed")), None), timeout=30.0)
        assert job.state == "failed" and "no calibrated model of this node" in job.message, job
        st = c.status()
        assert "moetune profile" in st.tune_notice and st.fingerprint == new.fingerprint
        # nothing modelled on other hardware became current; the old profiles are stale, not served
        assert store.list_profiles(status="current", fingerprint=new.fingerprint) == []
        assert [r.status for _, r in store.list_profiles()] == ["stale", "stale"]  # only the seeded ones exist
        with pytest.raises(DaemonError) as e:
            c.get_profile(ep_size=8, tokens=1000, model="qwen3-30b")
        assert e.value.code == wire.E_NOT_FOUND
        log_ok = d.jobs.info()[2][-1].message  # the job says it; the log says it (warning, no traceback)
        assert "run `moetune profile`" in log_ok
        c.close()
    finally:
        d.stop()


def test_a_users_retune_that_could_only_fail_is_refused_not_queued(tmp_path: Path) -> None:
    """After a bring-up whose calibration was refused (no node-<fp>.toml), `retune --all` with [tune] backend =
    "model" is refused up front with the reason, and the advice names what writes a model (`moetune profile
    --restart`) or measures (backend "local"): not a queued job (exit 0) failing with "run `moetune profile` on this
    node", which would only resume the finished bring-up and write no model again. With the node model there, the
    same request is queued."""
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts, ep_size=2, buckets=(64,))
    d = _daemon(tmp_path, store, discover=lambda: facts, tune=TuneSettings(backend="model", trials=2, timeout_s=60))
    try:
        c = ProfileClient(d.endpoint, timeout_ms=5000)
        F.until(lambda: c.status().fingerprint == facts.fingerprint)
        with pytest.raises(DaemonError) as e:
            c.retune(all=True, reason="operator")
        msg = str(e.value)
        assert e.value.code == wire.E_NOT_FOUND and "not queued" in msg and "no calibrated model of this node" in msg
        assert "`moetune profile --restart`" in msg and '[tune] backend = "local"' in msg, msg
        jobs = c.status().jobs
        assert jobs.running is None and not jobs.queued and not jobs.recent, jobs
        assert not store.list_events(kinds=("job_queued",))
        F.write_node_model(tmp_path, facts.fingerprint)  # `moetune profile --restart` calibrated one
        job = c.retune(all=True, reason="operator").job
        assert job is not None and job.state in ("queued", "running", "done"), job
        c.close()
    finally:
        d.stop()


def test_tune_backend_validated(tmp_path: Path) -> None:
    from moetune.runtime.config import ConfigError, load_config

    with pytest.raises(DaemonConfigError, match=r"tune\.backend"):
        TuneSettings(backend="preset")
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[tune]\nbackend = "presets"\n')
    with pytest.raises(ConfigError, match=r"tune\.backend in .*bad\.toml"):
        load_config(cfg, env={})


# -- point 8: status shows provenance counts ------------------------------------------------------------------
def test_status_shows_provenance_counts(tmp_path: Path) -> None:
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    m = (2048, 768, 128, 8)
    for b, backend in ((64, "local:nccl"), (1024, "local:nccl"), (4096, f"model:node:{facts.fingerprint}")):
        key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                         ep_size=2, nodes=1, hidden=m[0], intermediate=m[1], experts=m[2], topk=m[3], dtype="bfloat16",
                         token_bucket=b)
        store.put_profile(F.make_record(key, backend=backend))
    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="collective",
                     ep_size=2, nodes=1, hidden=m[0], intermediate=m[1], experts=m[2], topk=m[3], dtype="bfloat16",
                     token_bucket=64)
    store.put_profile(F.make_record(key, backend="model:nvlink-h200x2"))
    d = _daemon(tmp_path, store, discover=lambda: facts, rediscover_interval_s=0)
    try:
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        assert c.status().provenance == {"measured": 2, "node_model": 1, "preset": 1}
        got = {p.backend: p.provenance for p in c.list_profiles().profiles}
        assert got["model:nvlink-h200x2"] == "preset" and got["local:nccl"] == "measured"
        c.close()
        from typer.testing import CliRunner

        from moetune.tuner.cli import app

        r = CliRunner().invoke(app, ["status", "--socket", d.endpoint], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert "measured: 2, node_model: 1, preset: 1" in r.output
    finally:
        d.stop()


# -- point 4: IPC never deletes or chmods what it did not create -------------------------------------------------
def test_ipc_refuses_a_regular_file_at_the_socket_path(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    victim = run / "daemon.sock"
    victim.write_text("precious")
    with pytest.raises(DaemonConfigError, match="not a socket"):
        Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint=f"ipc://{victim}").start(background=True)
    assert victim.read_text() == "precious"
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o755  # not our directory: not tightened


def test_ipc_in_a_shared_sticky_directory_leaves_it_alone(tmp_path: Path) -> None:
    fake_tmp = tmp_path / "tmp"
    fake_tmp.mkdir()
    os.chmod(fake_tmp, 0o1777)
    other = fake_tmp / "someone-elses-file"
    other.write_text("x")
    facts = F.FakeFacts({"gpu_model": "H200"})
    d = _daemon(tmp_path, F.open_store(tmp_path / "moetune.db"), endpoint=f"ipc://{fake_tmp}/moetune.sock",
                discover=lambda: facts, rediscover_interval_s=0)
    try:
        assert stat.S_IMODE(os.stat(fake_tmp).st_mode) == 0o1777
        assert stat.S_IMODE(os.stat(fake_tmp / "moetune.sock").st_mode) == 0o600
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        assert c.hello().protocol == wire.PROTOCOL_VERSION
        c.close()
    finally:
        d.stop()
    assert stat.S_IMODE(os.stat(fake_tmp).st_mode) == 0o1777
    assert not (fake_tmp / "moetune.sock").exists() and other.read_text() == "x"


def test_ipc_dead_socket_not_ours_is_refused_and_kept(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = run / "daemon.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # a dead socket some other program left: no record says we made it
    with pytest.raises(DaemonConfigError, match="no record"):
        Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint=f"ipc://{path}").start(background=True)
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_ipc_stale_socket_of_our_own_killed_daemon_is_replaced(tmp_path: Path) -> None:
    with F.seeded_daemon(tmp_path, interval=0) as (d, _facts):
        d.proc.kill()
        d.proc.wait(10)
    assert (d.run_dir / "daemon.sock").exists()  # left behind by kill -9, with our owner record
    d2 = F.DaemonProc(tmp_path, interval=0)
    try:
        assert d2.wait_ready().protocol == wire.PROTOCOL_VERSION
    finally:
        d2.kill()


# -- point 5: CURVE clients authorised by an allow-list --------------------------------------------------------------
def test_curve_unknown_client_gets_nothing_not_even_a_retune(tmp_path: Path) -> None:
    import zmq.auth

    from moetune.tuner.cli.keys import allow_client, generate_keys

    _, server_secret = generate_keys(tmp_path / "keys")
    spub, _ = zmq.auth.load_certificate(str(server_secret))
    cpub_file, csec_file = generate_keys(tmp_path / "alice", "alice")
    allow_client(cpub_file, tmp_path / "keys" / "clients")
    apub, asec = zmq.auth.load_certificate(str(csec_file))
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts)
    port, pub_port = free_port(), free_port()
    d = _daemon(tmp_path, store, endpoint=f"tcp://127.0.0.1:{port}", pub_endpoint=f"tcp://127.0.0.1:{pub_port}",
                curve_secret_key_file=str(server_secret), discover=lambda: facts, rediscover_interval_s=0,
                retune_job=F.fake_retune)
    try:
        alice = ProfileClient(d.endpoint, timeout_ms=2000, curve_server_key=spub, curve_public_key=apub, curve_secret_key=asec)
        assert alice.get_profile(ep_size=2, tokens=100, model="qwen3-30b").key.token_bucket == 64
        mallory_pub, mallory_sec = zmq.curve_keypair()  # knows the server key, not on the allow-list
        mallory = ProfileClient(d.endpoint, timeout_ms=400, retries=0, curve_server_key=spub,
                                curve_public_key=mallory_pub, curve_secret_key=mallory_sec)
        with pytest.raises(DaemonUnavailable):
            mallory.hello()
        with pytest.raises(DaemonUnavailable):
            mallory.retune(all=True, reason="mallory")
        mallory.close()
        time.sleep(0.3)
        assert d.jobs.info() == ([], None, [])  # no job was queued by the unknown client
        assert alice.hello().protocol == wire.PROTOCOL_VERSION
        alice.close()
    finally:
        d.stop()


def test_curve_client_key_pair_from_the_config(tmp_path: Path) -> None:
    """A real client (not a test passing keys) gets in with the key files named in its [client] config."""
    from moetune.tuner.cli.keys import allow_client, generate_keys

    server_pub, server_secret = generate_keys(tmp_path / "keys")
    cpub_file, csec_file = generate_keys(tmp_path / "bob", "bob")
    allow_client(cpub_file, tmp_path / "keys" / "clients")
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts)
    port, pub_port = free_port(), free_port()
    d = _daemon(tmp_path, store, endpoint=f"tcp://127.0.0.1:{port}", pub_endpoint=f"tcp://127.0.0.1:{pub_port}",
                curve_secret_key_file=str(server_secret), discover=lambda: facts, rediscover_interval_s=0)
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[client]\ncurve_server_key_file = "{server_pub}"\ncurve_secret_key_file = "{csec_file}"\n')
    env = {"MOETUNE_CONFIG": str(cfg), "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    try:
        bob = ProfileClient(d.endpoint, timeout_ms=2000, env=env)
        assert bob.hello().protocol == wire.PROTOCOL_VERSION
        bob.close()
        cfg.write_text(f'[client]\ncurve_server_key_file = "{server_pub}"\n')  # no own key: a throwaway pair
        eve = ProfileClient(d.endpoint, timeout_ms=400, retries=0, env=env)
        with pytest.raises(DaemonUnavailable):
            eve.hello()
        eve.close()
    finally:
        d.stop()


# -- point 10: bad config is a clear error, never a traceback -----------------------------------------------------
def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MOETUNE_HOME=str(tmp_path / "home"))
    return subprocess.run([sys.executable, "-c", "import sys; from moetune.tuner.cli import main; sys.exit(main())", "serve", "--db", str(tmp_path / "m.db"), *args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(("toml", "args", "needle"), [
    ("", ["--socket", "tcp://127.0.0.1:65536", "--allow-insecure-tcp"], "65535"),
    ("", ["--socket", "tcp://127.0.0.1:65535", "--allow-insecure-tcp"], "over 65535"),
    ("[daemon]\nmax_request_bytes = 1099511627776\n", [], "daemon.max_request_bytes"),
    ("[daemon]\nmetrics_port = \"9100\"\n", [], "daemon.metrics_port"),
    ("[tune]\ntrials = 1.5\n", [], "tune.trials"),
    ("[tune]\nbackend = \"nvlink-h200x2\"\n", [], "tune.backend"),
    ("[daemon]\nrediscover_interval_s = -1\n", [], "rediscover_interval_s"),
])
def test_serve_bad_config_is_a_clear_error(tmp_path: Path, toml: str, args: list[str], needle: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    r = _serve(tmp_path, "--config", str(cfg), *args)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert needle in out and "Traceback" not in out, out


def test_tune_and_profile_do_not_ignore_bad_config(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    cfg = tmp_path / "c.toml"
    cfg.write_text("[tune]\ntrials = \"many\"\n")
    runner = CliRunner()
    for argv in (["tune", "--model", "qwen3-30b", "--config", str(cfg), "--db", str(tmp_path / "m.db")],
                 ["report", "--config", str(cfg)],
                 ["fabric", "diff", "--config", str(cfg), "--from", str(F.CAPTURES / "dgx-h100")]):
        r = runner.invoke(app, argv, env={"MOETUNE_HOME": str(tmp_path / "home")})
        out = r.output + (r.stderr if r.stderr_bytes is not None else "")
        assert r.exit_code == 2, (argv, out, r.exception)
        assert "tune.trials" in out and not isinstance(r.exception, (ValueError, RuntimeError)), (argv, out)


# -- point 11: list requests do not stall get_profile; one bad row does not stop the daemon ----------------------
def _add_history(db: Path, n: int) -> None:
    con = sqlite3.connect(db)
    cols = [r[1] for r in con.execute("PRAGMA table_info(profiles)") if r[1] not in ("id", "status")]
    sel = ", ".join(cols)
    con.execute(f"""WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < {n})
                    INSERT INTO profiles ({sel}, status) SELECT {sel}, 'superseded' FROM profiles, k
                    WHERE profiles.id = (SELECT min(id) FROM profiles)""")
    con.commit()
    con.close()


def test_list_requests_do_not_stall_get_profile(tmp_path: Path) -> None:
    facts = F.FakeFacts({"gpu_model": "H200"})
    db = tmp_path / "moetune.db"
    store = F.open_store(db)
    F.seed_profiles(store, facts)
    _add_history(db, 5000)
    d = _daemon(tmp_path, F.open_store(db), discover=lambda: facts, rediscover_interval_s=0)
    stop = threading.Event()
    # a hammer's unexpected answers, asserted once the threads end: an assert inside a thread fails no test (pytest
    # only warns of the thread's exception), so a list answered with another error than busy went unnoticed
    unexpected: list[str] = []

    def hammer(seed: int) -> None:
        c = ProfileClient(d.endpoint, timeout_ms=30000)
        n = 0
        while not stop.is_set():
            n += 1
            try:  # every request a new limit: never cached
                c.list_profiles(status="all", limit=1 + (seed * 997 + n) % 5000)
            except DaemonError as e:
                if e.code != wire.E_BUSY:  # the bounded queue pushes back; it never blocks serving
                    unexpected.append(f"{e.code}: {e}")
                    break
            except DaemonUnavailable:
                pass
        c.close()

    threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        lat = []
        for _ in range(40):
            t0 = time.perf_counter()
            c.get_profile(ep_size=2, tokens=100, model="qwen3-30b")
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)
        c.close()
        lst = ProfileClient(d.endpoint, timeout_ms=30000)
        page = lst.list_profiles(status="all", limit=10000)
        lst.close()
    finally:
        stop.set()
        for t in threads:
            t.join(40)
        d.stop()
    assert not unexpected, unexpected
    # the 90th percentile, not the maximum: on a loaded 2-core machine one sample in 40 took 204-282 ms with the
    # daemon unchanged (the OS's scheduling, not a stall behind a list, which holds most samples back)
    p90 = sorted(lat)[int(0.9 * len(lat))]
    assert p90 < 0.2, (f"get_profile's 90th percentile {p90 * 1000:.0f} ms (max {max(lat) * 1000:.0f}, median "
                       f"{statistics.median(lat) * 1000:.1f})")
    assert len(page.profiles) == 1000  # a bounded page, whatever the limit asks


def test_one_unreadable_row_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    facts = F.FakeFacts({"gpu_model": "H200"})
    db = tmp_path / "moetune.db"
    F.seed_profiles(F.open_store(db), facts)
    con = sqlite3.connect(db)
    bad = con.execute("SELECT id FROM profiles WHERE token_bucket = 64").fetchone()[0]
    con.execute("UPDATE profiles SET knobs = ? WHERE id = ?", ('{"num_sms": "lots", "no_such_knob": 1}', bad))
    con.commit()
    con.close()
    caplog.set_level("WARNING", logger="moetune.daemon")
    d = _daemon(tmp_path, F.open_store(db), discover=lambda: facts, rediscover_interval_s=0)
    try:
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        assert c.status().profiles_current == 2
        assert c.get_profile(ep_size=2, tokens=3000, model="qwen3-30b").key.token_bucket == 4096
        c.close()
    finally:
        d.stop()
    assert any(f"profile row {bad}" in r.getMessage() or f"profile {bad}" in r.getMessage() for r in caplog.records)


# -- point 12: a replaced GPU is a hardware change ------------------------------------------------------------------
def _replace_gpu(capture: Path, n: int = 1) -> None:
    """GPU n swapped for another of the same model in the same slot: new serial and UUID."""
    f = capture / "commands" / "nvidia-smi_-q_-x"
    text = f.read_text()
    gpus = text.split("<gpu id=")
    g = gpus[n + 1]
    import re

    old_serial = re.search(r"<serial>(.*?)</serial>", g).group(1)
    old_uuid = re.search(r"<uuid>(.*?)</uuid>", g).group(1)
    g = g.replace(old_serial, "1659999999999").replace(old_uuid, "GPU-00000000-1111-2222-3333-444444444444")
    gpus[n + 1] = g
    new = "<gpu id=".join(gpus)
    for other in capture.rglob("*"):  # the UUID also appears in other tools' output (nvlink -s)
        if other.is_file() and other != f:
            try:
                t = other.read_text()
            except UnicodeDecodeError:
                continue
            if old_uuid in t:
                other.write_text(t.replace(old_uuid, "GPU-00000000-1111-2222-3333-444444444444"))
    f.write_text(new)


def test_replaced_gpu_changes_identity_and_diff(tmp_path: Path) -> None:
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.fabric.fingerprint import diff_facts

    cap = tmp_path / "capture"
    shutil.copytree(F.CAPTURES / "dgx-h100", cap)
    old = discover(cap)
    serial = old.gpus[1].serial
    assert serial and old.gpus[1].uuid
    _replace_gpu(cap, 1)
    new = discover(cap)
    assert new.gpus[1].pci_bus_id == old.gpus[1].pci_bus_id and new.gpus[1].model == old.gpus[1].model
    assert new.identity_hash != old.identity_hash
    assert f"GPU 1 replaced: serial {serial} → 1659999999999" in diff_facts(old.to_dict(), new.to_dict())


def test_replaced_gpu_marks_profiles_stale_and_retunes(tmp_path: Path) -> None:
    from moetune.tuner.fabric.discovery import discover

    cap = tmp_path / "capture"
    facts = F.make_capture(cap, "dgx-h100")
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts)
    d = _daemon(tmp_path, store, discover=lambda: discover(cap), rediscover_interval_s=0.1, retune_job=F.fake_retune)
    try:
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        before = c.get_profile(ep_size=2, tokens=3000, model="qwen3-30b")
        _replace_gpu(cap, 1)
        job = F.until(lambda: next((j for j in c.status().jobs.recent if j.state == "done"), None), timeout=30.0)
        assert job.written == 3 and "GPU 1 replaced: serial" in job.reason
        after = c.get_profile(ep_size=2, tokens=3000, model="qwen3-30b")
        assert after.profile_hash != before.profile_hash and after.latency_us == 8.0  # re-measured
        assert len(store.list_profiles(status="stale")) == 3
        c.close()
    finally:
        d.stop()
    ev = [e for e in store.list_events(limit=50) if e["kind"] == "fabric_changed"]
    assert ev and "GPU 1 replaced" in ev[0]["reason"]


# -- the index serves this node's software, and a measurement before a prediction ------------------------------------
def _index(*recs: ProfileRecord, software: str = "sw-new") -> Any:
    from types import SimpleNamespace

    from moetune.tuner.daemon.index import ProfileIndex

    return ProfileIndex(list(recs), version=1, facts=SimpleNamespace(fingerprint="fp", software_hash=software), stale=[])


def _idx_rec(software: str, bucket: int, latency_us: float, backend: str, fp: str = "fp") -> ProfileRecord:
    from moetune.runtime.shapes import MODELS

    m = MODELS["qwen3-30b"]
    key = ProfileKey(fingerprint=fp, software=software, transport_family="nvlink", ep_size=2, nodes=1, hidden=m.hidden,
                     intermediate=m.intermediate, experts=m.experts, topk=m.topk, dtype=m.dtype, token_bucket=bucket)
    return F.make_record(key, latency_us=latency_us, backend=backend)


def _served(idx: Any, tokens: int, **kw: Any) -> wire.ProfileResult:
    ok, raw = idx.lookup(wire.GetProfile(v=wire.PROTOCOL_VERSION, id=1, ep_size=2, tokens=tokens, model="qwen3-30b", **kw))
    assert ok, raw
    return wire.decode_result("get_profile", raw)


def test_index_serves_only_the_daemons_software_by_default() -> None:
    """After a software upgrade the old software's (faster) profiles stay current under their own key; a request
    that names no software gets this node's, as one naming no fingerprint gets this node's fingerprint."""
    idx = _index(_idx_rec("sw-old", 64, 5.0, "local:nccl"), _idx_rec("sw-new", 64, 9.0, "local:nccl"))
    assert _served(idx, 64).key.software == "sw-new"
    assert _served(idx, 64, software="sw-old").key.software == "sw-old"  # asked for by name
    other = _idx_rec("sw-other", 64, 7.0, "local:nccl", fp="fp-other")
    assert _served(_index(other), 64, fingerprint="fp-other").key.software == "sw-other"  # another node's, by name
    ok, (code, msg) = _index(_idx_rec("sw-old", 64, 5.0, "local:nccl")).lookup(
        wire.GetProfile(v=wire.PROTOCOL_VERSION, id=1, ep_size=2, tokens=64, model="qwen3-30b"))
    assert not ok and code == wire.E_NOT_FOUND and "sw-new" in msg


def test_index_prefers_a_measurement_within_reach_over_a_nearer_prediction() -> None:
    """A node-model profile at the asked bucket must not displace a measured one a rung away (the store's
    find_profile and the client's database fallback pick the measurement too)."""
    node = _idx_rec("sw-new", 64, 5.0, "model:node:fp")
    measured = _idx_rec("sw-new", 128, 60.0, "local:nccl")
    got = _served(_index(node, measured), 64)
    assert got.provenance == "measured" and got.key.token_bucket == 128
    got = _served(_index(node, _idx_rec("sw-new", 4096, 60.0, "local:nccl")), 64)  # measured out of reach
    assert got.provenance == "node_model" and got.key.token_bucket == 64


def test_read_profiles_reports_a_store_error_as_is(tmp_path: Path) -> None:
    """A locked or broken database is a StoreError for the caller, as it is, not turned into another error by a
    row-by-row retry (unreadable rows are skipped by list_profiles itself)."""
    from moetune.tuner.daemon.index import read_profiles
    from moetune.tuner.store.store import StoreError

    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, F.FakeFacts({"fingerprint": "fp"}))
    assert len(read_profiles(store, status="current")) == 3

    def locked(**kw: Any) -> list:
        raise StoreError(f"{tmp_path / 'moetune.db'}: database is locked")

    store.list_profiles = locked
    with pytest.raises(StoreError, match="locked"):
        read_profiles(store, status="current")


def test_retune_refuses_a_node_model_the_calibration_checks_refused(tmp_path: Path) -> None:
    """A node-<fp>.toml written by `moetune model calibrate --force` (its [calibration] warning says the checks refused
    the fit) is never the basis of the automatic re-tune, unlike an accepted model: RetuneImpossible naming the file
    and the way out. An accepted one is used, and the file is read as it is at each re-tune: a daemon that read the
    accepted model sees it replaced by a forced one (and the reverse) without a restart."""
    from types import SimpleNamespace

    from moetune.tuner.daemon.retune import RetuneImpossible, _backend_for
    from moetune.tuner.search.model_backend import ModelBackend

    facts = F.FakeFacts({"gpu_model": "H200"})
    ctx = SimpleNamespace(store=F.open_store(tmp_path / "moetune.db"), facts=facts, tune=TuneSettings(backend="model"))
    accepted = F.write_node_model(tmp_path, facts.fingerprint)
    be, path = _backend_for(ctx)
    assert isinstance(be, ModelBackend) and path == str(accepted) and not be.forced_fit

    F.write_forced_preset(accepted)  # `model calibrate --force --out node-<fp>.toml` over it
    with pytest.raises(RetuneImpossible) as e:
        _backend_for(ctx)
    msg = str(e.value)
    assert str(accepted) in msg and "refused" in msg and "too few rows" in msg
    assert "`moetune profile`" in msg and "`moetune model calibrate` without --force" in msg

    F.write_node_model(tmp_path, facts.fingerprint)  # re-calibrated: accepted again
    be, path = _backend_for(ctx)
    assert isinstance(be, ModelBackend) and path == str(accepted) and not be.forced_fit


def test_a_forced_node_model_fails_the_daemons_retune_and_status_says_why(tmp_path: Path) -> None:
    """End to end: the daemon's re-tune job on a forced node model fails as impossible, status says why, and
    nothing modelled on it becomes current."""
    from moetune.tuner.fabric.discovery import discover

    cap = tmp_path / "capture"
    facts = F.make_capture(cap, "dgx-h100")
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts, ep_size=8, buckets=(64,))
    new = F.facts_after_port_change(cap)
    F.write_forced_preset(tmp_path / f"node-{new.fingerprint}.toml")
    d = _daemon(tmp_path, store, discover=lambda: discover(cap), rediscover_interval_s=0.1,
                tune=TuneSettings(backend="model", trials=3, timeout_s=60))
    try:
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        F.set_port_state(cap, "1: DOWN")
        job = F.until(lambda: next((j for j in c.status().jobs.recent if j.state in ("done", "failed")), None), timeout=30.0)
        assert job.state == "failed" and "refused" in job.message and f"node-{new.fingerprint}.toml" in job.message, job
        assert "without --force" in c.status().tune_notice
        assert store.list_profiles(status="current", fingerprint=new.fingerprint) == []
        c.close()
    finally:
        d.stop()
