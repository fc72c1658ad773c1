"""At lookup (runtime/profiles/client.py, autoload): a tuned profile's recorded performance environment (NCCL_*,
NVSHMEM_*, FI_*, ...) is compared with the job's. Where they differ the profile is still served, the resolution
says so and one warning names the variables; `client.env_mismatch = "refuse"` falls back instead; a daemon's reply
can never make the job set a recorded variable. Such a profile must not be served as if it applied."""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.config import ConfigError, load_config
from moetune.runtime.knobs import default_knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles import autoload, node_identity
from moetune.runtime.profiles.client import ProfileClient, Resolution
from moetune.runtime.profiles.errors import EnvMismatchWarning, FallbackWarning
from moetune.runtime.profiles.perf_env import is_performance_variable
from moetune.runtime.shapes import MODELS

pytestmark = pytest.mark.timeout(90)

# -- from the database: the client compares, warns once, refuses on request ------------------------------------
QWEN = MODELS["qwen3-30b"]
FP = "c" * 16
TUNED = {"NCCL_ALGO": "Ring", "NCCL_P2P_DISABLE": "1"}


def qkey(fp: str = FP, sw: str = "5" * 16, bucket: int = 64) -> ProfileKey:
    return ProfileKey(fingerprint=fp, software=sw, transport_family="nvlink", ep_size=2, nodes=1, hidden=QWEN.hidden,
                      intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype,
                      token_bucket=bucket)


def measured(key: ProfileKey, perf_env: dict[str, str] | None, num_sms: int = 40) -> ProfileRecord:
    """A measurement by this moetune (its runtime options recorded: the defaults, which these jobs run), or with
    `perf_env` None an older moetune's (neither recorded)."""
    return ProfileRecord(key=key, knobs=default_knobs("nvlink").replace(num_sms=num_sms), latency_us=20.0,
                         spread_us=0.1, backend="local:nccl", provenance="measured",
                         perf_env=msgspec.UNSET if perf_env is None else perf_env,
                         runtime_options=msgspec.UNSET if perf_env is None else RuntimeOptions().data_path())


def resolve(c: ProfileClient) -> tuple[Resolution, list[str], list[str]]:
    """(resolution, FallbackWarnings, EnvMismatchWarnings) of one lookup (Qwen3-30B, EP 2, 100 tokens)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = c.resolve(model=QWEN, ep_size=2, tokens=100)
    finally:
        c.close()
    return (res, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)],
            [str(w.message) for w in caught if issubclass(w.category, EnvMismatchWarning)])


@pytest.fixture
def node_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[list[ProfileRecord]], Path]:
    """A database of this (pretended) node holding the given profiles; no daemon."""
    facts = {"gpus": [], "software": {"driver": "none", "torch": "2.4.1", "moetune": "0.1.0"}}
    F.pretend_node(monkeypatch, facts, tmp_path / "proc")
    sw = node_identity.software_hash(facts)
    autoload.clear_cache()  # forgets the environments already warned about, too

    def make(recs: list[ProfileRecord]) -> Path:
        db = tmp_path / "moetune.db"
        store = F.open_store(db)
        store.upsert_fingerprint(FP, facts, origin="local")
        for r in recs:
            r = msgspec.structs.replace(r, key=msgspec.structs.replace(r.key, software=sw))
            ok, why = store.put_profile(r)
            assert ok, why
        store.close()
        return db

    yield make
    autoload.clear_cache()


def db_client(tmp_path: Path, db: Path, job_env: dict[str, str], **kw: Any) -> ProfileClient:
    return ProfileClient(f"ipc://{tmp_path}/nowhere/daemon.sock", db_path=db, timeout_ms=200, env=job_env, **kw)


def test_database_lookup_says_where_the_environment_differs_and_warns_once(node_db, tmp_path: Path) -> None:
    db = node_db([measured(qkey(), TUNED)])
    res, fell, env_warned = resolve(db_client(tmp_path, db, {"NCCL_ALGO": "Tree", "NCCL_DEBUG": "INFO"}))
    assert res.source == "database" and res.tuned  # still served by default
    assert res.env_status == "differs"
    assert res.env_diff == ["NCCL_ALGO: tuned with Ring, job has Tree", "NCCL_P2P_DISABLE: tuned with 1, job has it unset"]
    assert "NCCL_ALGO: tuned with Ring, job has Tree" in res.message
    assert len(env_warned) == 1 and "NCCL_ALGO: tuned with Ring, job has Tree" in env_warned[0]
    assert "NCCL_P2P_DISABLE" in env_warned[0] and "NCCL_DEBUG" not in env_warned[0]
    assert len(fell) == 1 and "read-only database" in fell[0]  # the database fallback's own warning, as before
    # once per process: the same profile and differences again say it in the resolution, not in a new warning
    res, _, env_warned = resolve(db_client(tmp_path, db, {"NCCL_ALGO": "Tree"}))
    assert res.env_status == "differs" and env_warned == []
    # the job's environment as measured: no warning, "same"
    res, _, env_warned = resolve(db_client(tmp_path, db, {**TUNED, "NCCL_DEBUG": "WARN"}))
    assert res.env_status == "same" and res.env_diff == [] and env_warned == []


def test_a_megakernel_profile_is_not_doubted_for_the_jobs_nccl_settings(node_db, tmp_path: Path) -> None:
    """The megakernel's profile (one GPU, no NCCL call) served under `refuse` to a job with other NCCL settings:
    the comparison is on the variables that act on one GPU (perf_env.relevant_to)."""
    key = msgspec.structs.replace(qkey(), transport_family="megakernel", ep_size=1)
    rec = ProfileRecord(key=key, knobs=default_knobs("collective").replace(engine="megakernel", mk_bm=16),
                        latency_us=290.0, spread_us=1.0, backend="local:megakernel", provenance="measured",
                        perf_env=TUNED)
    db = node_db([rec])
    c = db_client(tmp_path, db, {"NCCL_ALGO": "Tree"}, env_mismatch="refuse")
    try:
        res = c.resolve(model=QWEN, ep_size=1, tokens=100, transport_family="megakernel")
    finally:
        c.close()
    assert res.source == "database" and res.tuned and res.knobs.mk_bm == 16 and res.env_status == "same"


def test_refuse_falls_back_to_the_policy_default_and_ignore_serves_silently(node_db, tmp_path: Path) -> None:
    db = node_db([measured(qkey(), TUNED)])
    job = {"NCCL_ALGO": "Tree", "NCCL_P2P_DISABLE": "1"}
    res, fell, env_warned = resolve(db_client(tmp_path, db, job, env_mismatch="refuse"))
    assert res.source in ("policy", "default") and res.status == "default" and not res.tuned
    assert res.env_status == "" and env_warned == []
    assert len(fell) == 1 and "NCCL_ALGO: tuned with Ring, job has Tree" in fell[0] and "env_mismatch = refuse" in fell[0]
    # the same job environment as tuned: refuse serves it
    res, _, _ = resolve(db_client(tmp_path, db, dict(TUNED), env_mismatch="refuse"))
    assert res.source == "database" and res.env_status == "same"
    # ignore: served, no warning, the resolution still says so
    res, _, env_warned = resolve(db_client(tmp_path, db, job, env_mismatch="ignore"))
    assert res.source == "database" and res.env_status == "differs" and env_warned == []
    # the setting from the config's variable
    res, fell, _ = resolve(db_client(tmp_path, db, {**job, "MOETUNE_CLIENT_ENV_MISMATCH": "refuse"}))
    assert res.source in ("policy", "default") and "env_mismatch = refuse" in fell[0]


def test_an_unrecorded_environment_is_unknown_never_same(node_db, tmp_path: Path) -> None:
    db = node_db([measured(qkey(), None)])  # an older moetune's measurement
    res, _, env_warned = resolve(db_client(tmp_path, db, {}))
    assert res.source == "database" and res.env_status == "unknown" and env_warned == []
    res, fell, _ = resolve(db_client(tmp_path, db, {}, env_mismatch="refuse"))
    assert res.source in ("policy", "default") and "was not recorded" in fell[0]


def test_refuse_takes_a_profile_measured_in_this_environment_over_one_that_was_not(node_db, tmp_path: Path) -> None:
    """Passed over like a profile of another node: the next trusted one within reach is used."""
    db = node_db([measured(qkey(bucket=64), TUNED), measured(qkey(bucket=128), {"NCCL_ALGO": "Tree"}, 24)])
    res, _, _ = resolve(db_client(tmp_path, db, {"NCCL_ALGO": "Tree"}, env_mismatch="refuse"))
    assert res.source == "database" and res.key.token_bucket == 128 and res.env_status == "same"


@pytest.mark.parametrize("swap", [False, True])
def test_the_database_resolution_reports_the_environment_of_the_profile_it_picked(node_db, tmp_path: Path,
                                                                                   swap: bool) -> None:
    """Several trusted profiles are judged (each compared with the job's environment); the resolution's status and
    warning are those of the one picked, whichever it is (both assignments of the two environments are run, so
    a comparison taken from the other record fails one of them)."""
    envs = {64: dict(TUNED), 128: {"NCCL_ALGO": "Tree"}}
    if swap:
        envs = {64: envs[128], 128: envs[64]}
    job = {"NCCL_ALGO": "Tree"}
    db = node_db([measured(qkey(bucket=b), e) for b, e in envs.items()])
    res, _, env_warned = resolve(db_client(tmp_path, db, job))
    assert res.source == "database" and res.tuned
    picked_same = envs[res.key.token_bucket] == job
    assert res.env_status == ("same" if picked_same else "differs")
    assert len(env_warned) == (not picked_same) and (res.env_diff == []) == picked_same


def test_bad_env_mismatch_settings_are_named() -> None:
    with pytest.raises(ConfigError, match=r"client\.env_mismatch"):
        load_config(env={"MOETUNE_CLIENT_ENV_MISMATCH": "refuze", "HOME": "/nonexistent"})
    assert load_config(env={"MOETUNE_CLIENT_ENV_MISMATCH": " Refuse", "HOME": "/nonexistent"}).client.env_mismatch == "refuse"
    with pytest.raises(ValueError, match="env_mismatch"):
        ProfileClient("ipc:///nowhere/daemon.sock", env={}, env_mismatch="strict")


@pytest.mark.parametrize("bad", [{"MOETUNE_DAEMON_METRICS_PORT": "99999"}, {"MOETUNE_TUNE_TRIALS": "many"},
                                 {"MOETUNE_DAEMON_LOG_LEVEL": "loud"}])
def test_a_bad_setting_the_client_does_not_read_keeps_its_own_section(tmp_path: Path, bad: dict[str, str],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A bad value in another section's variable made load_config raise, and the client dropped its whole [client]
    section: env_mismatch = "refuse" silently became "warn", its CURVE key files and socket were lost (only a log
    line). The client's own settings hold now, and the log names what was ignored."""
    import zmq.auth

    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    server_pub, _ = zmq.auth.create_certificates(str(keys), "server")
    _, own_secret = zmq.auth.create_certificates(str(keys), "client")
    cfg = tmp_path / "moetune.toml"
    cfg.write_text(f'[client]\nenv_mismatch = "refuse"\nsocket = "tcp://127.0.0.1:9"\ntimeout_ms = 77\n'
                   f'curve_server_key_file = "{server_pub}"\ncurve_secret_key_file = "{own_secret}"\n')
    env = {"HOME": str(tmp_path), "MOETUNE_CONFIG": str(cfg), **bad}
    with caplog.at_level("WARNING", logger="moetune.client"):
        c = ProfileClient(env=env)
    try:
        assert (c.env_mismatch, c.endpoint, c.timeout_ms) == ("refuse", "tcp://127.0.0.1:9", 77)
        assert c._curve is not None and not c._ephemeral_key and c._refusal is None  # its own key pair, read
    finally:
        c.close()
    (var,) = bad
    said = " ".join(r.getMessage() for r in caplog.records)
    assert var in said and "ignores" in said, said
    # a bad value of the client's own still drops the section, saying so (nothing of it can be trusted)
    caplog.clear()
    with caplog.at_level("WARNING", logger="moetune.client"):
        c = ProfileClient(env={**env, "MOETUNE_CLIENT_TIMEOUT_MS": "soon"})
    c.close()
    assert "ignoring the config" in caplog.text and "MOETUNE_CLIENT_TIMEOUT_MS" in caplog.text


# -- from a daemon: the reply's recorded variables are compared, never exported --------------------------------
DAEMON_FP = "f" * 16  # the fake daemon's node: this one, with this process's software (F.this_node_facts)


def _ok(rid: Any, res: Any) -> bytes:
    return json.dumps({"v": 1, "id": rid, "ok": True, "epoch": "e1", "result": res}).encode()


def _reply(rid: Any, perf_env: Any, fp: str = DAEMON_FP, sw: str | None = None) -> bytes:
    sw = sw or F.this_node_software()
    res = msgspec.to_builtins(wire.ProfileResult.from_record(measured(qkey(fp, sw), None),
                                                             env={"NVSHMEM_REMOTE_TRANSPORT": "none"}))
    if perf_env is not None:
        res["perf_env"] = perf_env
    return _ok(rid, res)


@pytest.fixture
def fake_daemon(tmp_path: Path):
    made: list[F.ReplyRouter] = []

    def make(perf_env: Any) -> F.ReplyRouter:
        run = tmp_path / f"run{len(made)}"
        run.mkdir(mode=0o700)
        (run / "daemon.json").write_text(json.dumps({"fingerprint": DAEMON_FP, "software": F.this_node_software(),
                                                     "transports": ["nvlink"], "db": str(tmp_path / "none.db"),
                                                     "host": socket.gethostname(), "running": True,
                                                     "epoch": "e1"}))
        # it reports this node's fabric facts (the client checks them against this process), serves the profile
        d = F.ReplyRouter(f"ipc://{run / 'daemon.sock'}",
                          lambda req: _ok(req["id"], F.this_node_fabric(DAEMON_FP)) if req.get("op") == "fabric"
                          else _reply(req["id"], perf_env))
        made.append(d)
        return d

    autoload.clear_cache()
    yield make
    autoload.clear_cache()
    for d in made:
        d.close()


def test_a_daemon_reply_cannot_make_the_job_set_its_recorded_environment(fake_daemon, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = {"NCCL_ALGO": "Tree", "NCCL_NET_PLUGIN": "libevil.so", "NCCL_P2P_DISABLE": "1"}
    # this process's own performance variables (other tests' modules set NCCL_NVLS_ENABLE=0, ...) left out
    job = [name for name in os.environ if is_performance_variable(name)]
    for name in (*job, *recorded, "NVSHMEM_REMOTE_TRANSPORT", "LD_PRELOAD", "MOETUNE_CLIENT_ENV_MISMATCH"):
        monkeypatch.setenv(name, "")  # recorded, so that what autoload exports is undone after the test
        monkeypatch.delenv(name)
    d = fake_daemon(recorded)
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", d.endpoint)
    with pytest.warns(EnvMismatchWarning, match="NCCL_NET_PLUGIN: tuned with libevil.so, job has it unset"):
        res = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=100)
    assert res.source == "daemon" and res.env_status == "differs" and len(res.env_diff) == 3
    assert res.env == {"NVSHMEM_REMOTE_TRANSPORT": "none"}  # launcher_env of the knobs, nothing recorded
    assert not {"NCCL_ALGO", "NCCL_NET_PLUGIN", "NCCL_P2P_DISABLE"} & set(os.environ)
    assert os.environ.get("NVSHMEM_REMOTE_TRANSPORT") == "none"


@pytest.mark.parametrize("forged", [{"LD_PRELOAD": "/tmp/x.so"}, {"NVSHMEM_REMOTE_TRANSPORT": "../lib"},
                                    {"NCCL_DEBUG_FILE": "/etc/passwd"}, {"NCCL_ALGO": ""}, ["NCCL_ALGO"],
                                    {"NCCL_ALGO": "Ring\nexport LD_PRELOAD=/tmp/x.so #"}])
def test_a_reply_recording_anything_but_performance_variables_is_a_bad_reply(
        fake_daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forged: Any) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    d = fake_daemon(forged)
    res, fell, env_warned = resolve(ProfileClient(d.endpoint, db_path=tmp_path / "none.db", timeout_ms=200, env={}))
    assert res.source in ("policy", "default") and env_warned == [] and d.requests
    assert len(fell) == 1 and "daemon:" in fell[0] and ("perf_env" in fell[0] or "validate" in fell[0])
    assert "LD_PRELOAD" not in os.environ


def test_a_daemon_profile_without_a_recorded_environment_is_unknown(fake_daemon, tmp_path: Path) -> None:
    d = fake_daemon(None)  # an older daemon, or an older measurement
    res, fell, env_warned = resolve(ProfileClient(d.endpoint, db_path=tmp_path / "none.db", timeout_ms=200, env={}))
    assert res.source == "daemon" and res.env_status == "unknown" and fell == [] and env_warned == []


def test_store_to_daemon_to_job_round_trip(tmp_path: Path) -> None:
    """A real daemon serving a profile stored with its environment: the job sees the comparison. The daemon serves a
    capture of THIS node (its profile is tuned here only if its reported facts are this node's and software)."""
    facts = F.capture_this_node(tmp_path / "capture")
    store = F.open_store(tmp_path / "moetune.db")
    key = ProfileKey(**{**qkey().to_dict(), "fingerprint": facts.fingerprint, "software": facts.software_hash})
    assert store.put_profile(measured(key, TUNED))[0]
    store.close()
    d = F.DaemonProc(tmp_path)
    try:
        d.wait_ready()
        autoload.clear_cache()
        for job, status in (({"NCCL_ALGO": "Tree", "NCCL_P2P_DISABLE": "1"}, "differs"), (dict(TUNED), "same")):
            res, fell, env_warned = resolve(ProfileClient(d.endpoint, db_path=d.db, timeout_ms=2000, env=job))
            assert res.source == "daemon" and res.tuned and res.env_status == status and fell == []
            assert len(env_warned) == (status == "differs")
        assert res.env_diff == [] and env_warned == []
        # refuse: the daemon's profile and the database's (the same one) are passed over
        res, fell, _ = resolve(ProfileClient(d.endpoint, db_path=d.db, timeout_ms=2000, env={},
                                             env_mismatch="refuse"))
        assert res.source in ("policy", "default") and "daemon served profile" in fell[0]
    finally:
        d.kill()
        autoload.clear_cache()


def test_query_says_how_the_tuned_environment_compares_and_exports_none_of_it(
        node_db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    db = node_db([measured(qkey(), TUNED)])
    for name in ("NCCL_P2P_DISABLE", "MOETUNE_CLIENT_ENV_MISMATCH", "MOETUNE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    args = ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "100", "--db", str(db),
            "--socket", f"ipc://{tmp_path}/nowhere/daemon.sock"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["source"] == "database" and got["env_status"] == "differs"
    assert "NCCL_ALGO: tuned with Ring, job has Tree" in got["env_diff"]
    r = CliRunner().invoke(app, [*args, "--format", "env"])
    assert r.exit_code == 0, r.output
    assert "# moetune:   NCCL_ALGO: tuned with Ring, job has Tree" in r.stdout
    assert "export NCCL_ALGO" not in r.stdout and "export NCCL_P2P_DISABLE" not in r.stdout


def test_a_database_whose_buckets_are_all_too_far_says_so(node_db, tmp_path: Path) -> None:
    """The fallback said "no profile measured on this node for this shape/EP size/nodes" where the shape's profiles
    were stored, only at buckets more than one step from the request's."""
    db = node_db([measured(qkey(bucket=1024), TUNED)])
    res, fell, _ = resolve(db_client(tmp_path, db, {}))  # 100 tokens: bucket 128, three steps from 1024
    assert not res.tuned and len(fell) == 1
    assert "has profiles at token buckets 1024, none within one step of the bucket of 100 tokens" in fell[0], fell[0]
    assert "no profile measured on this node" not in fell[0]
