"""This node's identity and what a daemon's reply may make tuned (review of the runtime's trust rules):

- daemon.json names a node's identity only when a daemon of THIS host wrote it while running, and even then it
  alone never makes a profile tuned; the database fallback takes its identity from the database's facts checked
  against this node, never from daemon.json;
- a measured profile from the daemon is tuned only when the daemon's reported fabric facts are this node's and
  this process's software (a tcp:// daemon on another node reports that node's; a daemon in another Python
  environment, other package versions), daemon.json or not;
- a reply's profile_hash must be the hash of its key and knobs;
- one provenance rule (`effective_provenance`) for records, replies and `is_tuned_for`;
- the software facts read from Python distributions (NCCL, NVSHMEM, ...) are checked, as discovery reads them."""

from __future__ import annotations

import json
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, effective_provenance, profile_hash_of
from moetune.runtime.profiles import client, db_lookup, node_identity, replies
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonUnavailable, FallbackWarning
from moetune.runtime.profiles.policy_defaults import policy_default_knobs
from moetune.runtime.shapes import MODELS

QWEN = MODELS["qwen3-30b"]
HOST = socket.gethostname()
HERE = {"gpus": [{"uuid": "GPU-bbbb", "model": "H100"}], "software": {"driver": "none", "torch": "2.4.1", "moetune": "0.1.0"}}
ELSEWHERE = {"gpus": [{"uuid": "GPU-aaaa", "model": "H100"}], "software": {"driver": "none", "torch": "2.4.1", "moetune": "0.1.0"}}
FP_HERE, FP_A = "c" * 16, "a" * 16


def key(fp: str, sw: str, bucket: int = 64) -> ProfileKey:
    return ProfileKey(fingerprint=fp, software=sw, transport_family="nvlink", ep_size=2, nodes=1, hidden=QWEN.hidden,
                      intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype,
                      token_bucket=bucket)


def measured(k: ProfileKey, num_sms: int = 24) -> ProfileRecord:
    return ProfileRecord(key=k, knobs=default_knobs("nvlink").replace(num_sms=num_sms), latency_us=20.0, spread_us=0.1,
                         backend="local:nccl", provenance="measured")


def reply(rec: ProfileRecord, **over: Any) -> wire.ProfileResult:
    res = wire.ProfileResult.from_record(rec, env={})
    return msgspec.structs.replace(res, **over) if over else res


def seed(db: Path, fp: str, facts: dict, recs: list[ProfileRecord]) -> None:
    store = F.open_store(db)
    try:
        store.upsert_fingerprint(fp, facts, origin="local")
        for r in recs:
            ok, why = store.put_profile(r)
            assert ok, why
    finally:
        store.close()


def write_info(run: Path, **info: Any) -> None:
    run.mkdir(mode=0o700, parents=True, exist_ok=True)
    (run / "daemon.json").write_text(json.dumps(info))


def resolve(c: ProfileClient) -> tuple[client.Resolution, list[str]]:
    return F.resolve_warned(c)


# -- 1: daemon.json of another host, or of a stopped daemon -------------------------------------------------------
def test_another_hosts_daemon_json_does_not_make_its_profiles_tuned_here(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """MOETUNE_HOME on a shared file system: node A's daemon.json and database. A's identity must not become this
    node's: otherwise A's measured profile is applied here as tuned from the database."""
    F.pretend_node(monkeypatch, HERE, tmp_path / "proc")
    db = tmp_path / "moetune.db"
    sw_a = node_identity.software_hash(ELSEWHERE)
    seed(db, FP_A, ELSEWHERE, [measured(key(FP_A, sw_a))])
    run = tmp_path / "run"
    write_info(run, fingerprint=FP_A, software=sw_a, host="node-a", running=True, pid=1, endpoint=f"ipc://{run}/daemon.sock",
               db=str(db))
    res, warned = resolve(ProfileClient(f"ipc://{run}/daemon.sock", db_path=db, timeout_ms=200, env={}))
    assert res.source in ("policy", "default") and not res.tuned, res
    assert len(warned) == 1 and "identity is unknown" in warned[0] and "UUIDs differ" in warned[0], warned


@pytest.mark.parametrize("running", [True, False])  # True: a daemon killed with -9 leaves its file saying so
def test_a_daemon_json_from_before_an_upgrade_does_not_vouch_for_the_software_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, running: bool) -> None:
    """This host's daemon.json says FP/SW, recorded before torch was upgraded here; the daemon is down (the database
    fallback). The database's facts are checked against this node (torch differs), as they are without
    daemon.json: daemon.json's word alone would make the profile of the software it recorded tuned here."""
    old = {"gpus": HERE["gpus"], "software": {**HERE["software"], "torch": "2.3.0"}}
    F.pretend_node(monkeypatch, HERE, tmp_path / "proc")
    db = tmp_path / "moetune.db"
    sw_old = node_identity.software_hash(old)
    seed(db, FP_HERE, old, [measured(key(FP_HERE, sw_old))])
    run = tmp_path / "run"
    write_info(run, fingerprint=FP_HERE, software=sw_old, host=HOST, running=running, db=str(db))
    res, warned = resolve(ProfileClient(f"ipc://{run}/daemon.sock", db_path=db, timeout_ms=200, env={}))
    assert res.source in ("policy", "default") and not res.tuned, res
    assert "torch 2.4.1 here, 2.3.0 recorded" in warned[0], warned
    # the software here recorded (a re-run of `moetune fabric`/the daemon): its profile is tuned again
    sw_now = node_identity.software_hash(HERE)
    mine = measured(key(FP_HERE, sw_now), num_sms=32)
    seed(db, FP_HERE, HERE, [mine])
    res, warned = resolve(ProfileClient(f"ipc://{run}/daemon.sock", db_path=db, timeout_ms=200, env={}))
    assert res.source == "database" and res.tuned and res.profile_hash == mine.profile_hash, warned


# -- 2: this node's identity unknown (no daemon.json: a tcp:// endpoint) --------------------------------------------
def _faked(tmp_path: Path, answer: wire.ProfileResult, fabric: wire.FabricResult | Exception) -> tuple[ProfileClient, list]:
    """A client with no daemon.json anywhere, whose daemon answers `answer` and reports `fabric`."""
    c = ProfileClient(f"ipc://{tmp_path}/nowhere/daemon.sock", db_path=tmp_path / "none.db", timeout_ms=200,
                      env={"HOME": str(tmp_path)})
    asked: list[int] = []

    def fab(**kw: Any) -> wire.FabricResult:
        asked.append(1)
        if isinstance(fabric, Exception):
            raise fabric
        return fabric

    c.get_profile = lambda **kw: answer  # type: ignore[method-assign]
    c.fabric = fab  # type: ignore[method-assign]
    return c, asked


def _fabric(fp: str, facts: dict, software: str | None = None) -> wire.FabricResult:
    return wire.FabricResult(fingerprint=fp, software=software or node_identity.software_hash(facts),
                             transports=["nvlink"], facts=facts, discovered_at="", ok=True)


def test_with_this_nodes_identity_unknown_a_measured_profile_is_not_tuned(tmp_path: Path) -> None:
    """With no identity of this node, `foreign` must not be False: otherwise any 'measured' profile a daemon sends
    is tuned."""
    r = reply(measured(key("9" * 16, "8" * 16)))
    c, _ = _faked(tmp_path, r, DaemonUnavailable("no reply from the daemon"))
    res, warned = resolve(c)
    assert res.source in ("policy", "default") and not res.tuned, res
    assert "identity is unknown" in warned[0] and "no reply from the daemon" in warned[0], warned


def test_a_remote_daemons_profile_is_tuned_only_when_its_facts_are_this_nodes(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    F.pretend_node(monkeypatch, HERE, tmp_path / "proc")
    sw_a = node_identity.software_hash(ELSEWHERE)
    # a daemon on node A (its GPUs): never tuned here
    c, _ = _faked(tmp_path, reply(measured(key(FP_A, sw_a))), _fabric(FP_A, ELSEWHERE))
    res, warned = resolve(c)
    assert not res.tuned and res.source in ("policy", "default"), res
    assert "is not this node's" in warned[0] and "UUIDs differ" in warned[0], warned
    # a software hash that is not its facts': not checked facts, so not tuned
    c, _ = _faked(tmp_path, reply(measured(key(FP_HERE, "7" * 16))), _fabric(FP_HERE, HERE, software="7" * 16))
    res, warned = resolve(c)
    assert not res.tuned and "is not its facts'" in warned[0], warned
    # this node's own daemon reached over TCP: its facts are this node's, its profile is tuned; asked once
    sw = node_identity.software_hash(HERE)
    mine = measured(key(FP_HERE, sw))
    c, asked = _faked(tmp_path, reply(mine), _fabric(FP_HERE, HERE))
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = c.resolve(model=QWEN, ep_size=2, tokens=100)
        assert res.source == "daemon" and res.tuned and res.profile_hash == mine.profile_hash
        assert not [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(asked) == 1  # remembered per daemon start and key fingerprint/software
    c.close()


def test_a_daemons_facts_that_did_not_match_are_checked_again_later(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What the check reads can come back (a NIC port down, then up again): a mismatch is remembered for
    FABRIC_RETRY_S, as a daemon that did not answer, not for the process's life (its profiles refused for good)."""
    nic = {"name": "mlx5_0", "kind": "mlx5", "ports": [{"port": 1, "state": "ACTIVE", "rate_gbps": 400.0}]}
    here = {**HERE, "nics": [nic]}
    F.pretend_node(monkeypatch, here, tmp_path / "proc")
    port = tmp_path / "proc-sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    monkeypatch.setattr(client, "FABRIC_RETRY_S", 0.0)
    mine = measured(key(FP_HERE, node_identity.software_hash(here)))
    c, asked = _faked(tmp_path, reply(mine), _fabric(FP_HERE, here))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = c.resolve(model=QWEN, ep_size=2, tokens=100)
        assert not res.tuned and any("port 1: down here" in str(w.message) for w in caught), res
        (port / "state").write_text("4: ACTIVE\n")  # the port is back
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            res = c.resolve(model=QWEN, ep_size=2, tokens=100)
        assert res.source == "daemon" and res.tuned and len(asked) == 2, (res, asked)
    finally:
        c.close()


# -- 3: the reply's profile_hash ----------------------------------------------------------------------------------
def test_a_reply_whose_hash_is_not_its_key_and_knobs_is_a_bad_reply(tmp_path: Path) -> None:
    sw_here = F.this_node_software()  # this machine's and this process's software: what the daemon reports below
    k = key(FP_HERE, sw_here)
    real, other = measured(k, num_sms=24), measured(k, num_sms=40)
    forged = reply(real, profile_hash=other.profile_hash)
    why = replies.reply_problem(forged, model=QWEN, ep_size=2, tokens=100, nodes=1, transport_family=None)
    assert why is not None and "profile_hash" in why and real.profile_hash in why
    assert replies.reply_problem(reply(real), model=QWEN, ep_size=2, tokens=100, nodes=1, transport_family=None) is None
    assert profile_hash_of(k, real.knobs) == real.profile_hash
    run = tmp_path / "run"
    write_info(run, fingerprint=FP_HERE, software=sw_here, host=HOST, running=True)
    this_node = wire.FabricResult(**F.this_node_fabric(FP_HERE))  # the daemon's facts are this node's
    c = ProfileClient(f"ipc://{run}/daemon.sock", db_path=tmp_path / "none.db", timeout_ms=200, env={})
    c.get_profile = lambda **kw: forged  # type: ignore[method-assign]
    c.fabric = lambda **kw: this_node  # type: ignore[method-assign]
    res, warned = resolve(c)
    assert res.source in ("policy", "default") and res.profile_hash != other.profile_hash
    assert "is not the hash of its key and knobs" in warned[0], warned
    c = ProfileClient(f"ipc://{run}/daemon.sock", db_path=tmp_path / "none.db", timeout_ms=200, env={})
    c.get_profile = lambda **kw: reply(real)  # type: ignore[method-assign]
    c.fabric = lambda **kw: this_node  # type: ignore[method-assign]
    res, _ = resolve(c)
    assert res.source == "daemon" and res.tuned and res.profile_hash == real.profile_hash


# -- 5: one provenance rule ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("backend", "label", "want"), [
    ("local:nccl", "measured", "measured"),
    ("model:h100-dgx", "measured", "preset"),
    (f"model:node:{FP_HERE}", "measured", "node_model"),
    ("model:node:ffff", "measured", "preset"),  # another node's model: a preset to this key
    ("something-else", "measured", "node_model"),
    ("model:h100-dgx", "preset", "preset"),
    ("model:h100-dgx", "node_model", "preset"),  # the label does not make a preset's number this node's model
    ("model:node:ffff", "node_model", "preset"),
    (f"model:node:{FP_HERE}", "node_model", "node_model"),
    ("local:nccl", "node_model", "node_model"),  # an unlabelled import of a measurement (by design)
])
def test_is_tuned_for_and_the_client_follow_one_provenance_rule(backend: str, label: str, want: str) -> None:
    """is_tuned_for and the client apply the same rule, not the label alone: a preset labelled 'measured' is not
    tuned, and a node_model label on a preset's backend or another node's model is not taken as this node's model
    (which would outrank preset)."""
    rec = ProfileRecord(key=key(FP_HERE, "5" * 16), knobs=default_knobs("nvlink"), latency_us=27, spread_us=0,
                        backend=backend, provenance=label)
    assert rec.effective_provenance == want == db_lookup.provenance_of(rec) == effective_provenance(label, backend, FP_HERE)
    assert reply(rec).provenance == want  # the daemon labels a reply as what its numbers are
    # a reply labelled by its stored label (an older daemon's) is taken for what it is all the same
    assert db_lookup.provenance_of(reply(rec, provenance=label, measured_on=rec.measured_on)) == want
    assert rec.is_tuned_for(FP_HERE, "5" * 16) is (want == "measured")


# -- also: the software facts read from Python distributions -----------------------------------------------------
def test_the_package_facts_are_read_as_discovery_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.fabric.discovery import _software
    from moetune.tuner.fabric.sources import PACKAGES

    assert {d for names in node_identity.PACKAGE_FACTS.values() for d in names} == set(PACKAGES)
    for installed in ({}, {n: f"1.{i}" for i, n in enumerate(PACKAGES)},
                      {"nvidia-nccl-cu12": "2.21.5", "nvidia-nvshmem-cu12": "3.2.5", "torch": "2.6.0"}):
        monkeypatch.setattr(node_identity, "_dist_version", installed.get)
        sw = _software(dict(installed), {"driver": "", "cuda": ""}, "")
        assert {f: node_identity.local_package_fact(f) for f in node_identity.PACKAGE_FACTS} == \
            {f: sw[f] for f in node_identity.PACKAGE_FACTS}


def test_nccl_and_nvshmem_versions_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """NCCL and NVSHMEM versions are compared (the software hash covers them), not only driver, torch and
    moetune."""
    monkeypatch.setattr(node_identity, "PROC_ROOT", tmp_path)  # no NVIDIA driver: GPU-less facts only
    installed = {"torch": "2.4.1", "nvidia-nccl-cu12": "2.21.5"}
    monkeypatch.setattr(node_identity, "_dist_version", installed.get)
    facts = {"gpus": [], "software": {"torch": "2.4.1", "nccl": "2.21.5", "nvshmem": "none"}}
    assert node_identity.mismatch(facts) == (None, ("nccl", "nvshmem", "torch"))
    why, _ = node_identity.mismatch({**facts, "software": {**facts["software"], "nccl": "2.20.3"}})
    assert why == "nccl 2.21.5 here, 2.20.3 recorded"
    installed["nvidia-nvshmem-cu12"] = "3.2.5"  # installed since the facts were recorded
    why, _ = node_identity.mismatch(facts)
    assert why == "nvshmem 3.2.5 here, none recorded"


def test_a_daemon_json_speaks_only_for_the_daemon_that_wrote_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon killed with -9 leaves daemon.json saying running: its fingerprint and software then stood for
    whichever daemon answered (another folder's, a tcp:// one), and that daemon's reported facts were never asked.
    The file speaks for the daemon that answered only when its epoch is that daemon's; another folder's file is not
    read at all (only the one beside the socket the client talks to)."""
    F.pretend_node(monkeypatch, HERE, tmp_path / "proc")
    sw_a = node_identity.software_hash(ELSEWHERE)
    home = tmp_path / "home"
    run = home / "run"
    run.mkdir(parents=True, mode=0o700)
    (run / "daemon.json").write_text(json.dumps({"written_by": "moetune-daemon", "fingerprint": FP_A,
                                                 "software": sw_a, "host": socket.gethostname(), "running": True,
                                                 "pid": 999999999, "endpoint": f"ipc://{run}/daemon.sock",
                                                 "epoch": "dead"}))
    env = {"HOME": str(tmp_path), "MOETUNE_HOME": str(home)}
    for where, said in ((run, "is another daemon's (epoch 'dead'"),  # beside the socket, a new daemon answering
                        (tmp_path / "other", "no daemon.json beside the daemon's socket")):  # another folder's file
        c = ProfileClient(f"ipc://{where}/daemon.sock", db_path=tmp_path / "none.db", timeout_ms=200, env=env)
        asked: list[int] = []
        c.get_profile = lambda **kw: reply(measured(key(FP_A, sw_a)))  # type: ignore[method-assign]
        c.fabric = lambda asked=asked, **kw: (asked.append(1), _fabric(FP_A, ELSEWHERE))[1]  # type: ignore[method-assign]
        res, warned = resolve(c)
        assert not res.tuned and asked == [1], (res, warned)
        assert any(said in w for w in warned), warned


def test_a_node_without_gpus_checks_the_recorded_nics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no GPU recorded and none here, only package versions were compared: a shared database's fingerprint of
    another node (an InfiniBand NIC this one lacks, the same torch and moetune) passed as this node's, and its
    measured profiles were applied as tuned."""
    other = {"gpus": [], "nics": [{"name": "mlx5_0", "kind": "mlx5"}], "software": {"torch": "2.4.1"}}
    monkeypatch.setattr(node_identity, "PROC_ROOT", tmp_path / "proc")
    monkeypatch.setattr(node_identity, "local_package_fact", lambda fact: "2.4.1" if fact == "torch" else "none")
    monkeypatch.setattr(node_identity, "SYS_ROOT", tmp_path / "sys")
    why, _ = node_identity.mismatch(other)
    assert why == "NIC(s) mlx5_0 recorded, not on this node", why
    (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)  # the node that recorded it
    why, checked = node_identity.mismatch(other)
    assert why is None and "NICs" in checked, why


@pytest.mark.parametrize("gpus", [[], [{"uuid": "GPU-bbbb", "model": "H100"}]], ids=["no GPU", "GPUs"])
def test_a_recorded_nic_of_another_card_or_firmware_here_is_not_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                          gpus: list) -> None:
    """A NIC of the recorded name whose firmware, board or HCA type is not the recorded one is another fingerprint
    (the fingerprint hashes them): a firmware upgrade, or another card in its place, while the daemon was down left
    the database fallback applying the profiles measured with the old one as tuned (with GPUs, no NIC was looked at;
    without, only its name). A recorded NIC absent here, or an attribute unread here, is not compared (a container
    sees only the NICs given to it)."""
    nic = {"name": "mlx5_0", "kind": "mlx5", "hca_type": "MT4129", "fw_ver": "28.39.1002", "board_id": "MT_0000000838"}
    recorded = {"gpus": gpus, "nics": [nic], "software": {"driver": "none", "torch": "2.4.1"}}
    F.pretend_node(monkeypatch, recorded, tmp_path / "proc")
    sysfs = tmp_path / "proc-sys" / "class" / "infiniband" / "mlx5_0"
    for attr in ("hca_type", "fw_ver", "board_id"):
        (sysfs / attr).write_text(nic[attr] + "\n")
    why, checked = node_identity.mismatch(recorded)
    assert why is None and "NIC firmware" in checked, why
    (sysfs / "fw_ver").write_text("28.41.1000\n")  # upgraded since
    why, _ = node_identity.mismatch(recorded)
    assert why == "NIC mlx5_0: firmware 28.41.1000 here, 28.39.1002 recorded", why
    (sysfs / "fw_ver").write_text(nic["fw_ver"] + "\n")
    (sysfs / "board_id").write_text("MT_0000000970\n")  # another card under the same name
    why, _ = node_identity.mismatch(recorded)
    assert why == "NIC mlx5_0: board MT_0000000970 here, MT_0000000838 recorded", why
    for attr in ("hca_type", "fw_ver", "board_id"):  # unread here: not compared
        (sysfs / attr).unlink()
    assert node_identity.mismatch(recorded)[0] is None


@pytest.mark.parametrize("gpus", [[], [{"uuid": "GPU-bbbb", "model": "H100"}]], ids=["no GPU", "GPUs"])
def test_a_recorded_nic_port_down_or_at_another_rate_here_is_not_this_node(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           gpus: list) -> None:
    """An ACTIVE port (with its rate) or a port down is in the fingerprint (a port down is a fabric change to the
    daemon): a port that went down, or came up at another rate, while the daemon was down left the database fallback
    applying the profiles measured over the old link as tuned. A port whose state is unread here is not compared."""
    nic = {"name": "mlx5_0", "kind": "mlx5",
           "ports": [{"port": 1, "state": "ACTIVE", "rate_gbps": 400.0, "link_layer": "InfiniBand"}]}
    recorded = {"gpus": gpus, "nics": [nic], "software": {"driver": "none", "torch": "2.4.1"}}
    F.pretend_node(monkeypatch, recorded, tmp_path / "proc")
    port = tmp_path / "proc-sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    why, checked = node_identity.mismatch(recorded)
    assert why is None and "NIC ports" in checked, why
    (port / "state").write_text("1: DOWN\n")
    why, _ = node_identity.mismatch(recorded)
    assert why == "NIC mlx5_0 port 1: down here, ACTIVE recorded", why
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    why, _ = node_identity.mismatch(recorded)
    assert why == "NIC mlx5_0 port 1: ACTIVE at 200 Gb/s here, 400 Gb/s recorded", why
    (port / "state").unlink()  # unread here: not compared
    assert node_identity.mismatch(recorded)[0] is None
    # the runtime reads the port files as discovery does (it may not import it)
    from moetune.tuner.fabric import parsers

    assert node_identity._PORT_STATE.pattern == parsers.STATE_RE.pattern
    assert node_identity._PORT_RATE.pattern == parsers._RATE_RE.pattern


@pytest.mark.parametrize("recorded_loaded", [True, False])
def test_nvidia_peermem_loaded_or_not_since_is_not_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             recorded_loaded: bool) -> None:
    """Whether nvidia_peermem is loaded (GPUDirect RDMA for the NIC transports) is in the fingerprint: the module
    loaded or unloaded since, with the daemon down, left the database fallback applying the profiles measured the
    other way as tuned. /proc/modules unread here: not compared."""
    recorded = {**HERE, "gpudirect": {"nvidia_peermem": recorded_loaded, "dmabuf": False}}
    F.pretend_node(monkeypatch, recorded, tmp_path / "proc")
    assert node_identity.mismatch(recorded)[0] is None  # unread: not compared
    modules = tmp_path / "proc" / "modules"
    same = "nvidia_peermem 16384 0 - Live 0x0000000000000000\n" if recorded_loaded else ""
    modules.write_text(same + "nvidia 56717312 1 nvidia_peermem, Live 0x0000000000000000 (POE)\n")
    why, checked = node_identity.mismatch(recorded)
    assert why is None and "nvidia_peermem" in checked, why
    other = "" if recorded_loaded else "nv_peer_mem 16384 0 - Live 0x0000000000000000\n"
    modules.write_text(other + "nvidia 56717312 1 - Live 0x0000000000000000 (POE)\n")
    why, _ = node_identity.mismatch(recorded)
    now, was = ("not loaded", "loaded") if recorded_loaded else ("loaded", "not loaded")
    assert why == f"nvidia_peermem {now} here, {was} recorded", why


@pytest.mark.parametrize("gpus", [[], [{"uuid": "GPU-bbbb", "model": "H100"}]], ids=["no GPU", "GPUs"])
def test_a_pcie_link_narrower_since_is_not_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     gpus: list) -> None:
    """The current PCIe link width of each GPU and NIC is in the fingerprint: a card that dropped from x16 to x8
    (reseated, a riser failing) while the daemon was down left the database fallback applying the profiles measured
    at x16 as tuned. Read from the sysfs file discovery reads; unread or unreadable here: not compared, never
    raised."""
    nic = {"name": "mlx5_0", "kind": "mlx5", "pcie_width_current": 16}
    recorded = {"gpus": [{**g, "pcie_width_current": 16} for g in gpus], "nics": [nic],
                "software": {"driver": "none", "torch": "2.4.1"}}
    F.pretend_node(monkeypatch, recorded, tmp_path / "proc")
    sys_root = tmp_path / "proc-sys"
    nic_width = sys_root / "class" / "infiniband" / "mlx5_0" / "device" / "current_link_width"
    nic_width.parent.mkdir(parents=True)
    nic_width.write_text("16\n")
    gpu_width = sys_root / "bus" / "pci" / "devices" / "0000:00:00.0" / "current_link_width"  # pretend_node's GPU 0
    gpu_width.parent.mkdir(parents=True)
    gpu_width.write_text("16\n")
    why, checked = node_identity.mismatch(recorded)
    assert why is None and "NIC firmware" in checked and ("GPU PCIe links" in checked) == bool(gpus), (why, checked)
    nic_width.write_text("8\n")
    why, _ = node_identity.mismatch(recorded)
    assert why == "PCIe link of NIC mlx5_0 is x8, recorded x16", why
    nic_width.write_text("16\n")
    gpu_width.write_text("8\n")
    why, _ = node_identity.mismatch(recorded)
    assert why == ("PCIe link of GPU 0000:00:00.0 is x8, recorded x16" if gpus else None), why
    # no width a link trains to: 63 (the field all ones, read while the device sleeps in D3cold), 0 (link down): not
    # compared, never "x63 here, recorded x16" (a sleeping GPU would have made every tuned profile fall back)
    for text in ("63\n", "0\n"):
        for f in (gpu_width, nic_width):
            f.write_text(text)
        why, checked = node_identity.mismatch(recorded)
        assert why is None and "GPU PCIe links" not in checked, (why, checked)
    for text in ("unknown\n", None):  # not a number, or no such file (a container): not compared
        for f in (gpu_width, nic_width):
            if text is None:
                f.unlink()
            else:
                f.write_text(text)
        why, checked = node_identity.mismatch(recorded)
        assert why is None and "GPU PCIe links" not in checked, (why, checked)


def test_mig_switched_on_since_is_not_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MIG mode is in the fingerprint: a GPU switched to MIG (and partitioned) while the daemon was down left the
    database fallback applying the profiles measured on the whole GPU as tuned. Its GPU instances show under
    /proc/driver/nvidia/capabilities/gpu<minor>/mig (the information file names its minor, not the mode); that
    folder unread here, or MIG recorded on, is not compared."""
    recorded = {**HERE, "gpus": [{**HERE["gpus"][0], "mig": False}], "tools": {"nvidia-smi -q -x": "ok"}}
    F.pretend_node(monkeypatch, recorded, tmp_path / "proc")
    info = tmp_path / "proc" / "driver" / "nvidia" / "gpus" / "0000:00:00.0" / "information"
    info.write_text(info.read_text() + "Device Minor: \t 3\n")
    why, checked = node_identity.mismatch(recorded)
    assert why is None and "GPU MIG mode" not in checked, (why, checked)  # no capabilities folder: not compared
    mig = tmp_path / "proc" / "driver" / "nvidia" / "capabilities" / "gpu3" / "mig"
    mig.mkdir(parents=True)  # as the driver shows it with MIG off
    why, checked = node_identity.mismatch(recorded)
    assert why is None and "GPU MIG mode" in checked, (why, checked)
    (mig / "gi1" / "ci0").mkdir(parents=True)  # MIG on, a GPU instance made
    why, _ = node_identity.mismatch(recorded)
    assert why == "MIG mode of GPU 0000:00:00.0 is on (GPU instances here), recorded off", why
    # another GPU's minor: not this one's instances
    info.write_text(info.read_text().replace("Device Minor: \t 3", "Device Minor: \t 0"))
    assert node_identity.mismatch(recorded)[0] is None
    info.write_text(info.read_text().replace("Device Minor: \t 0", "Device Minor: \t 3"))
    assert node_identity.mismatch({**HERE, "gpus": [{**HERE["gpus"][0], "mig": True}]})[0] is None


@pytest.mark.parametrize("tools", [{"nvidia-smi -q -x": "missing", "gpu api": "nvml"}, {}],
                         ids=["NVML fallback", "no tools recorded"])
def test_mig_recorded_off_by_a_discovery_that_never_read_it_is_not_compared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tools: dict) -> None:
    """Discovery reads the MIG mode from nvidia-smi's XML only; its fallbacks (NVML, torch) record every GPU with MIG
    off without reading it. A node partitioned into MIG instances and discovered so was refused as "MIG on, recorded
    off" by its own facts: MIG is compared only where the facts say nvidia-smi's XML was read."""
    from moetune.tuner.fabric.discovery import SMI_XML

    assert " ".join(SMI_XML) == node_identity.SMI_XML_TOOL  # the runtime may not import discovery: the same key
    recorded = {**HERE, "gpus": [{**HERE["gpus"][0], "mig": False}], "tools": tools}
    F.pretend_node(monkeypatch, recorded, tmp_path / "proc")
    info = tmp_path / "proc" / "driver" / "nvidia" / "gpus" / "0000:00:00.0" / "information"
    info.write_text(info.read_text() + "Device Minor: \t 3\n")
    (tmp_path / "proc" / "driver" / "nvidia" / "capabilities" / "gpu3" / "mig" / "gi1" / "ci0").mkdir(parents=True)
    why, checked = node_identity.mismatch(recorded)
    assert why is None and "GPU MIG mode" not in checked, (why, checked)
    recorded["tools"] = {"nvidia-smi -q -x": "ok"}  # read: the same node is compared, and differs
    assert node_identity.mismatch(recorded)[0] == "MIG mode of GPU 0000:00:00.0 is on (GPU instances here), recorded off"


def test_the_runtime_reads_the_pcie_width_discovery_records(tmp_path: Path) -> None:
    """The runtime compares the recorded width with the sysfs file discovery reads it from (it may not import
    discovery): the same file name, the same number."""
    from moetune.tuner.fabric.discovery import pci_link

    dev = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:18:00.0"
    dev.mkdir(parents=True)
    (dev / "current_link_width").write_text("8\n")

    class Src:  # a source reading under tmp_path, as discovery's read /sys
        def read_text(self, path: str) -> str | None:
            f = tmp_path / path.lstrip("/")
            return f.read_text() if f.is_file() else None

    assert pci_link(Src(), "/sys/bus/pci/devices/0000:18:00.0")["pcie_width_current"] == \
        node_identity._link_width((dev / "current_link_width").read_text()) == 8  # type: ignore[arg-type]


def _write_nic(sys_root: Path, nic: dict[str, Any]) -> None:
    """`nic`'s sysfs folder as the kernel shows it: its attributes and its ports' state and rate."""
    folder = sys_root / "class" / "infiniband" / nic["name"]
    for attr in ("hca_type", "fw_ver", "board_id"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / attr).write_text(nic[attr] + "\n")
    for p in nic["ports"]:
        (folder / "ports" / str(p["port"])).mkdir(parents=True, exist_ok=True)
        code = {"ACTIVE": 4, "DOWN": 1}[p["state"]]
        (folder / "ports" / str(p["port"]) / "state").write_text(f"{code}: {p['state']}\n")
        (folder / "ports" / str(p["port"]) / "rate").write_text(f"{p['rate_gbps']:g} Gb/sec (4X NDR)\n")


def test_the_recorded_nics_under_other_names_are_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel names RDMA devices (mlx5_N) in the order they come up, which a reboot may change (VFs hot-added in
    another order, a device reloaded); names are no part of the fingerprint, so the same NICs under other names are
    the same node. Compared by name alone, an InfiniBand HCA and an Ethernet NIC that traded names read as another
    card with other firmware and ports, and the database fallback refused this node's profiles. A NIC changed under
    whichever name is still another node."""
    from moetune.tuner.fabric.fingerprint import fingerprint

    ib = {"name": "mlx5_0", "kind": "mlx5", "hca_type": "MT4129", "fw_ver": "28.39.1002", "board_id": "MT_0000000838",
          "ports": [{"port": 1, "state": "ACTIVE", "rate_gbps": 400.0, "link_layer": "InfiniBand"}]}
    eth = {"name": "mlx5_1", "kind": "mlx5", "hca_type": "MT4125", "fw_ver": "22.36.1010", "board_id": "MT_0000000359",
           "ports": [{"port": 1, "state": "ACTIVE", "rate_gbps": 100.0, "link_layer": "Ethernet"},
                     {"port": 2, "state": "DOWN", "rate_gbps": 0.0, "link_layer": "Ethernet"}]}
    recorded = {**HERE, "nics": [ib, eth]}
    renamed = {**HERE, "nics": [{**ib, "name": "mlx5_1"}, {**eth, "name": "mlx5_0"}]}
    assert fingerprint(renamed) == fingerprint(recorded)  # the same node, as the daemon sees it
    F.pretend_node(monkeypatch, recorded, tmp_path / "proc")
    sys_root = tmp_path / "proc-sys"
    for nic in renamed["nics"]:
        _write_nic(sys_root, nic)
    why, checked = node_identity.mismatch(recorded)
    assert why is None and "NIC firmware" in checked and "NIC ports" in checked, why
    _write_nic(sys_root, {**ib, "name": "mlx5_1", "fw_ver": "28.41.1000"})  # and the IB HCA's firmware upgraded
    why, _ = node_identity.mismatch(recorded)
    assert why is not None and why.startswith("NIC mlx5_0: "), why  # said by name: no pairing explains them


# -- 2, with nothing faked: this node's own daemon over tcp:// ----------------------------------------------------
def test_this_nodes_own_daemon_over_curve_tcp_serves_its_measured_profile_as_tuned(tmp_path: Path) -> None:
    """The live node's discovery, a daemon on loopback tcp:// with CURVE and an allow-list, a client with no
    daemon.json: the daemon's reported facts must check out against what the runtime reads of this node (on a GPU
    node its GPUs' UUIDs and driver from /proc, the installed packages; without GPUs the packages and NICs), so the
    node's measured profile is applied as tuned. The other tests fake one side or the other."""
    import zmq.auth

    from moetune.runtime.testing.launch import free_port
    from moetune.tuner.cli.keys import allow_client, generate_keys
    from moetune.tuner.daemon.server import Daemon
    from moetune.tuner.daemon.watch import make_discover

    discover = make_discover(None)
    facts = discover()
    mine = measured(key(facts.fingerprint, facts.software_hash))
    mk_key = ProfileKey(**{**key(facts.fingerprint, facts.software_hash, bucket=16).to_dict(),
                           "transport_family": "megakernel", "ep_size": 1})
    mk = ProfileRecord(key=mk_key, knobs=policy_default_knobs("megakernel"), latency_us=199.0,
                       spread_us=1.0, backend="local:megakernel", provenance="measured")
    seed(tmp_path / "moetune.db", facts.fingerprint, facts.to_dict(), [mine, mk])
    _, server_secret = generate_keys(tmp_path / "keys")
    spub, _ = zmq.auth.load_certificate(str(server_secret))
    cpub_file, csec_file = generate_keys(tmp_path / "alice", "alice")
    allow_client(cpub_file, tmp_path / "keys" / "clients")
    apub, asec = zmq.auth.load_certificate(str(csec_file))
    store = F.open_store(tmp_path / "moetune.db")
    d = Daemon(store=store, endpoint=f"tcp://127.0.0.1:{free_port()}", pub_endpoint=f"tcp://127.0.0.1:{free_port()}",
               curve_secret_key_file=str(server_secret), discover=discover, rediscover_interval_s=0).start(background=True)
    try:
        c = ProfileClient(d.endpoint, db_path=tmp_path / "none.db", timeout_ms=5000, env={"HOME": str(tmp_path)},
                          curve_server_key=spub, curve_public_key=apub, curve_secret_key=asec)
        res, warned = resolve(c)
        assert res.source == "daemon" and res.tuned and res.profile_hash == mine.profile_hash, (res, warned)
        assert not warned, warned
        # the same through `moetune query` (its [client] keys from a config), for the one-GPU layer's megakernel
        # profile (--family: without it a query at --ep 1 looked up the transport families only)
        from typer.testing import CliRunner

        from moetune.tuner.cli import app

        cfg = tmp_path / "client.toml"
        cfg.write_text(f'[client]\ncurve_server_key_file = "{tmp_path / "keys" / "moetune.key"}"\n'
                       f'curve_secret_key_file = "{csec_file}"\n')
        env = {"MOETUNE_HOME": str(tmp_path / "client-home"), "XDG_RUNTIME_DIR": str(tmp_path / "client-home"),
               "MOETUNE_CONFIG": "", "HOME": str(tmp_path)}
        args = ["query", "--model", "qwen3-30b", "--ep", "1", "--tokens", "16", "--socket", d.endpoint, "--config",
                str(cfg), "--timeout-ms", "5000", "--json"]
        r = CliRunner().invoke(app, [*args, "--family", "megakernel"], env=env)
        got = json.loads(r.stdout)
        assert r.exit_code == 0 and got["source"] == "daemon" and got["provenance"] == "measured", r.output
        assert got["profile_hash"] == mk.profile_hash and got["family"] == "megakernel", got
        # no database in the client's home: where it was measured is the key's fingerprint the client checked is
        # this node's (it was "" in run 192's flow on a GPU node)
        assert got["measured_on"] == facts.fingerprint, got
        r = CliRunner().invoke(app, args, env=env)
        assert r.exit_code == 0 and json.loads(r.stdout)["family"] != "megakernel", r.output
    finally:
        d.stop()


@pytest.mark.parametrize(("args", "said"), [
    (["--family", "no-such"], "unknown family 'no-such' (known: collective,"),
    (["--family", "megakernel", "--ep", "2"], "megakernel profiles are for one GPU (--ep 1, --nodes 1)"),
])
def test_query_family_is_checked(tmp_path: Path, args: list[str], said: str) -> None:
    """A family moetune names is taken whether or not it ships a policy (proxy:ucx: stored keys may have it)."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    base = {"--model": "qwen3-30b", "--ep": "1", "--tokens": "16"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    env = {"MOETUNE_HOME": str(tmp_path), "HOME": str(tmp_path), "COLUMNS": "300"}
    r = CliRunner().invoke(app, ["query", *[x for kv in base.items() for x in kv], "--timeout-ms", "50"], env=env)
    assert r.exit_code == 2 and said in " ".join(r.output.split()), r.output
    for family in ("proxy:ucx", "proxy:libfabric/cxi"):
        r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16", "--family", family,
                                     "--timeout-ms", "50", "--json"], env=env)
        assert r.exit_code == 0, (family, r.output)
