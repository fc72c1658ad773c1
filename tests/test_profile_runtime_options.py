"""Tuned profiles record the data-path runtime options they were measured under (hs_native, symm, fused_pack,
proxy_host_wait, ...: MOETUNE_* variables or the config's [runtime] table), the study digest includes them, and the
runtime applies a profile as tuned only under the options it was measured under: a profile tuned with one set of
data-path options is not tuned for a job running others, and a study does not resume across option changes."""

from __future__ import annotations

import json
import socket
import sqlite3
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import optuna
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_client_perf_env import FP, QWEN, db_client, qkey

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.options import (
    DATA_PATH_FAMILIES,
    DATA_PATH_KNOWN_FAMILIES,
    DATA_PATH_OPTIONS,
    NOT_DATA_PATH_OPTIONS,
    RuntimeOptions,
    data_path_digest,
    data_path_problem,
    options_acting_on,
)
from moetune.runtime.profile_record import ENGINE_FAMILIES, ProfileKey, ProfileRecord
from moetune.runtime.profiles import autoload, node_identity
from moetune.runtime.profiles.client import ProfileClient, Resolution
from moetune.runtime.profiles.db_lookup import query_db_profiles
from moetune.runtime.profiles.errors import FallbackWarning
from moetune.runtime.profiles.tuned_options import compare_options
from moetune.runtime.shapes import ModelShape
from moetune.runtime.transports.registry import registered_transports
from moetune.tuner.cli import app
from moetune.tuner.search.backends import TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend
from moetune.tuner.store.store import Store
from moetune.tuner.store.validate import FieldError

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.timeout(120)
DEFAULTS = RuntimeOptions().data_path()
OTHER = RuntimeOptions(fused_pack=False).data_path()
SMALL = ModelShape(name="custom:256,128,16,2", hidden=256, intermediate=128, experts=16, topk=2)
FAKE_BENCH = r'''
import json, sys
print(json.dumps({"dispatch_us": {"median": 10.0, "p10": 9.9, "p90": 10.1},
                  "combine_us": {"median": 10.0, "p10": 9.9, "p90": 10.1},
                  "layer_us": {"median": 30.0, "p10": 29.9, "p90": 30.1},
                  "world": int(sys.argv[sys.argv.index("--world") + 1]), "backend": "nccl"}))
'''


class _Fam:
    def __init__(self, name: str) -> None:
        self.name = name


def measured(key: ProfileKey, options: dict[str, Any] | None, num_sms: int = 40) -> ProfileRecord:
    return ProfileRecord(key=key, knobs=default_knobs("nvlink").replace(num_sms=num_sms), latency_us=20.0,
                         spread_us=0.1, backend="local:nccl", provenance="measured", perf_env={},
                         runtime_options=msgspec.UNSET if options is None else options)


@pytest.fixture
def node_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[list[ProfileRecord]], Path]]:
    """A database of this (pretended) node holding the given profiles; no daemon (as test_client_perf_env's)."""
    facts = {"gpus": [], "software": {"driver": "none", "torch": "2.4.1", "moetune": "0.1.0"}}
    F.pretend_node(monkeypatch, facts, tmp_path / "proc")
    sw = node_identity.software_hash(facts)
    autoload.clear_cache()

    def make(recs: list[ProfileRecord]) -> Path:
        db = tmp_path / "moetune.db"
        store = F.open_store(db)
        store.upsert_fingerprint(FP, facts, origin="local")
        for r in recs:
            ok, why = store.put_profile(msgspec.structs.replace(r, key=msgspec.structs.replace(r.key, software=sw)))
            assert ok, why
        store.close()
        return db

    yield make
    autoload.clear_cache()


def _resolve(c: ProfileClient, **kw: Any) -> tuple[Resolution, list[str]]:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = c.resolve(model=QWEN, ep_size=2, tokens=100, **kw)
    finally:
        c.close()
    return res, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


# -- which options are recorded ---------------------------------------------------------------------------------
def test_every_option_is_decided_data_path_or_not() -> None:
    """A new option must be put on one side (the record or the reasons it is left out), never forgotten."""
    fields = set(RuntimeOptions.__struct_fields__)
    assert set(DATA_PATH_OPTIONS) | set(NOT_DATA_PATH_OPTIONS) == fields
    assert not set(DATA_PATH_OPTIONS) & set(NOT_DATA_PATH_OPTIONS)
    assert {"hs_native", "symm", "fused_pack", "proxy_host_wait"} <= set(DATA_PATH_OPTIONS)
    assert {"proxy_cpu", "onesided_timeout_s", "megakernel_timeout_s"} == set(NOT_DATA_PATH_OPTIONS)
    assert list(DEFAULTS) == list(DATA_PATH_OPTIONS) and json.loads(json.dumps(DEFAULTS)) == DEFAULTS
    assert data_path_problem(DEFAULTS) is None and data_path_problem({"fused_pack": False}) is None
    for bad in ({"proxy_cpu": "numa"}, {"fused_pack": 1}, {"plan_mode": 9}, {"chunk_weights": [1, 2]}, ["symm"]):
        assert data_path_problem(bad) is not None, bad


def test_the_comparison_names_each_option_and_never_takes_unknown_for_same() -> None:
    assert compare_options(DEFAULTS, DEFAULTS, "nvlink").status == "same"
    cmp = compare_options(DEFAULTS, OTHER, "nvlink")
    assert cmp.status == "differs" and cmp.differences == ("fused_pack: tuned with true, job has false",)
    assert compare_options(None, DEFAULTS, "nvlink").status == "unknown"
    assert compare_options(DEFAULTS, None, "nvlink").status == "unknown"
    older = {k: v for k, v in DEFAULTS.items() if k != "fused_fp8"}  # a moetune that knew fewer options
    assert compare_options(older, DEFAULTS, "nvlink").status == "unknown"
    assert compare_options(older, OTHER, "nvlink").status == "differs"
    # the megakernel reads none of them: nothing to doubt
    assert compare_options(None, OTHER, "megakernel").status == "same"
    assert compare_options(DEFAULTS, OTHER, "megakernel").status == "same"


def test_each_option_is_compared_only_for_the_families_it_acts_on() -> None:
    """An option is compared only for the families it acts on: recorded defaults against a job with symm=ipc,
    proxy_batch=4, hs_native=False must not "differ" for collective, nvlink and host_staged alike."""
    assert set(DATA_PATH_FAMILIES) == set(DATA_PATH_OPTIONS)
    assert set(registered_transports()) | ENGINE_FAMILIES == DATA_PATH_KNOWN_FAMILIES
    assert all(fams <= DATA_PATH_KNOWN_FAMILIES - ENGINE_FAMILIES for fams in DATA_PATH_FAMILIES.values())
    job = RuntimeOptions(symm="ipc", proxy_batch=4, hs_native=False).data_path()

    def names(family: str) -> set[str]:
        cmp = compare_options(DEFAULTS, job, family)
        return {d.split(":")[0] for d in cmp.differences} if cmp.status == "differs" else set()

    assert compare_options(DEFAULTS, job, "collective").status == "same"
    assert names("host_staged") == {"hs_native"}
    assert names("nvlink") == {"symm"}
    assert names("proxy") == {"symm", "proxy_batch"}
    # a family the table does not know (a transport registered later): every option may act on it
    assert names("custom") == {"symm", "proxy_batch", "hs_native"}
    assert set(options_acting_on(None)) == set(DATA_PATH_OPTIONS) and options_acting_on("megakernel") == ()
    # an older record missing an option that does not act here is not "unknown"
    older = {k: v for k, v in DEFAULTS.items() if k != "proxy_batch"}
    assert compare_options(older, DEFAULTS, "collective").status == "same"
    assert compare_options(older, DEFAULTS, "proxy").status == "unknown"


# -- the tuner: recorded with every measured profile, part of the study digest ---------------------------------
def test_other_data_path_options_are_another_study_and_other_options_are_not() -> None:
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.study import study_config

    space = SearchSpace(load_policy("collective"), experts=16, ep_size=2, tokens=64, topk=2)
    wl = TuneWorkload(model=SMALL, tokens=64)

    def config(env: dict[str, str], **kw: Any) -> str:
        return study_config(space, LocalBackend(world=2, command=["x"], env={"HOME": "/nonexistent", **env}, **kw), wl)

    base = config({})
    assert config({"MOETUNE_FUSED_PACK": "0"}) != base != config({"MOETUNE_SYMM": "ipc"})  # no family: all act
    assert config({"MOETUNE_HS_NATIVE": "0"}) != base
    # a timeout or the proxy thread's CPUs change no data path: the same study
    assert config({"MOETUNE_ONESIDED_TIMEOUT_S": "5", "MOETUNE_PROXY_CPU": "none"}) == base
    # the same options from the config's [runtime] table as from their variables
    assert "runtime_options" in LocalBackend(world=2, command=["x"], env={"HOME": "/nonexistent"}).settings()
    # the megakernel reads none of them
    assert "runtime_options" not in LocalBackend(world=1, family="megakernel", env={"HOME": "/nonexistent"}).settings()
    # options that do not resolve: said, naming the option (every run would fail on it)
    with pytest.raises(ValueError, match="MOETUNE_FUSED_PACK"):
        LocalBackend(world=2, command=["x"], env={"MOETUNE_FUSED_PACK": "maybe"}).settings()


def test_an_option_changes_only_the_studies_of_the_families_it_acts_on() -> None:
    """A data-path option is in the study names of the families it acts on only: a collective study must not be
    started anew for symm=ipc or proxy_batch=4, which its trials never read."""
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.study import study_config

    space = SearchSpace(load_policy("collective"), experts=16, ep_size=2, tokens=64, topk=2)
    wl = TuneWorkload(model=SMALL, tokens=64)

    def config(family: str, env: dict[str, str]) -> str:
        be = LocalBackend(world=2, command=["x"], env={"HOME": "/nonexistent", **env}, family=family)
        return study_config(space, be, wl)

    others = {"MOETUNE_SYMM": "ipc", "MOETUNE_PROXY_BATCH": "4", "MOETUNE_NVL_GATHER": "0",
              "MOETUNE_FUSED_PACK": "0", "MOETUNE_PLAN_MODE": "1"}
    assert config("collective", others) == config("collective", {})
    assert config("collective", {"MOETUNE_HS_NATIVE": "0"}) == config("collective", {})
    assert config("host_staged", {"MOETUNE_HS_NATIVE": "0"}) != config("host_staged", {})
    assert config("collective", {"MOETUNE_EP_CHUNK_WEIGHTS": "1,2"}) != config("collective", {})
    assert config("collective", {"MOETUNE_FUSED_FP8": "0"}) != config("collective", {})
    assert config("nvlink", {"MOETUNE_SYMM": "ipc"}) != config("nvlink", {})
    assert config("nvlink", {"MOETUNE_PROXY_BATCH": "4", "MOETUNE_HS_NATIVE": "0"}) == config("nvlink", {})
    assert config("proxy", {"MOETUNE_PROXY_BATCH": "4"}) != config("proxy", {})


def test_the_config_runtime_table_is_what_the_ranks_run(tmp_path: Path) -> None:
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[runtime]\nsymm = \"ipc\"\n")
    be = LocalBackend(world=2, command=["x"], env={"HOME": str(tmp_path), "MOETUNE_CONFIG": str(cfg)})
    assert be.runtime_options().symm == "ipc"


def test_a_local_tune_records_its_options_and_a_modelled_one_none(tmp_path: Path) -> None:
    from moetune.tuner.search.tune import tune_profiles_detailed

    class Facts:
        fingerprint, software_hash, gpu_count = "c" * 64, "d" * 64, 2
        software: dict = {}  # noqa: RUF012
        link_rates: dict = {}  # noqa: RUF012
        transports = (_Fam("collective"),)

    bench = tmp_path / "fake_bench.py"
    bench.write_text(FAKE_BENCH)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "MOETUNE_FUSED_PACK": "0", "MOETUNE_PROXY_CPU": "none"}
    be = LocalBackend(world=2, command=[sys.executable, str(bench)], comm_backend="nccl", repeats=1, timeout_s=20,
                      env=env)
    store = F.open_store(tmp_path / "m.db")
    res = tune_profiles_detailed(store, Facts(), models=[SMALL], tokens=[64], backend=be, trials=2,
                                 families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert res[0].written, res[0].reason
    assert res[0].record.tuned_runtime_options == OTHER
    [(pid, stored)] = store.list_profiles()
    assert stored.tuned_runtime_options == OTHER and stored.runtime_options_digest == data_path_digest(OTHER)
    store.close()
    con = sqlite3.connect(tmp_path / "m.db")  # the readable copy and its digest, as a plain sqlite3 reader sees them
    copy, digest = con.execute("SELECT runtime_options, runtime_options_digest FROM profiles WHERE id = ?",
                               (pid,)).fetchone()
    con.close()
    assert json.loads(copy) == OTHER and digest == data_path_digest(OTHER)
    # `profiles show` says them; its JSON carries them and their digest
    r = CliRunner().invoke(app, ["profiles", "show", str(pid), "--db", str(tmp_path / "m.db"), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["runtime_options"] == OTHER and d["runtime_options_digest"] == data_path_digest(OTHER)
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["profiles", "show", str(pid), "--db", str(tmp_path / "m.db")])
    assert r.exit_code == 0 and "runtime_options.fused_pack" in r.output and "false" in r.output


def test_the_store_refuses_options_on_a_modelled_profile_and_ones_it_would_not_record(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    pred = ProfileRecord(key=qkey(), knobs=default_knobs("nvlink"), latency_us=20.0, spread_us=0.0,
                         backend="model:nvlink-h200x2", provenance="preset", runtime_options=DEFAULTS)
    with pytest.raises(FieldError, match="runtime_options"):
        store.put_profile(pred)
    with pytest.raises(FieldError, match="runtime_options"):
        store.put_profile(measured(qkey(), {"proxy_cpu": "numa"}))
    store.close()


def test_rows_without_the_field_stay_readable_as_unknown(tmp_path: Path) -> None:
    """A row from before 0009 (NULL) is read as not recorded, by the store and by the runtime's sqlite reader; a
    database still at 0008 (no column) is read by the runtime as before."""
    path = tmp_path / "m.db"
    with Store(path) as s:
        assert s.put_profile(measured(qkey(), None))[0]
        assert s.put_profile(measured(qkey(bucket=128), DEFAULTS))[0]
        got = {r.key.token_bucket: r.tuned_runtime_options for _i, r in s.list_profiles()}
        assert got == {64: None, 128: DEFAULTS}
        s.downgrade("0008")
    recs = query_db_profiles(path, ep_size=2, nodes=1, hidden=QWEN.hidden, intermediate=QWEN.intermediate,
                             experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype)
    assert sorted(r.key.token_bucket for r in recs) == [64, 128]
    assert all(r.tuned_runtime_options is None for r in recs)
    with Store(path) as s:  # the upgrade gives the recorded options back to their row, with the digest
        s.upgrade()
        got = {r.key.token_bucket: (r.tuned_runtime_options, r.runtime_options_digest) for _i, r in s.list_profiles()}
        assert got == {64: (None, None), 128: (DEFAULTS, data_path_digest(DEFAULTS))}
        assert "runtime_options_restored" in {e.kind for e in s.list_events()}


def test_the_upgrade_gives_back_only_options_it_would_record(tmp_path: Path) -> None:
    """0009's upgrade restored any dict a downgrade's event kept: one that fails data_path_problem (an event edited,
    or written by another program) made a good measured row unreadable. It stays NULL (unknown) now."""
    path = tmp_path / "m.db"
    with Store(path) as s:
        assert s.put_profile(measured(qkey(), DEFAULTS))[0]
        assert s.put_profile(measured(qkey(bucket=128), OTHER))[0]
        s.downgrade("0008")
    con = sqlite3.connect(path)
    (eid, details), = con.execute("SELECT id, details FROM events WHERE kind = 'runtime_options_dropped'").fetchall()
    kept = json.loads(details)
    for entry in kept["profiles"].values():
        if entry["runtime_options"] == DEFAULTS:
            entry["runtime_options"] = {**DEFAULTS, "plan_mode": 9}
    con.execute("UPDATE events SET details = ? WHERE id = ?", (json.dumps(kept), eid))
    con.commit()
    con.close()
    with Store(path) as s:
        s.upgrade()
        got = {r.key.token_bucket: r.tuned_runtime_options for _i, r in s.list_profiles()}
        assert got == {64: None, 128: OTHER}  # both rows readable; the bad value not restored


def test_0009s_frozen_check_agrees_with_data_path_problem_today() -> None:
    """The migration's copy of the check (it may not import the runtime) is today's data_path_problem."""
    import importlib.util

    f = Path(__file__).resolve().parents[1] / "migrations" / "versions" / "0009_profile_runtime_options.py"
    spec = importlib.util.spec_from_file_location("m0009", f)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert tuple(mod._OPTION_NAMES) == DATA_PATH_OPTIONS
    samples: list[Any] = [DEFAULTS, OTHER, {}, {"fused_pack": False}, {"symm": "ipc"}, {"symm": "nvshmem"},
                          {"proxy_batch": 4}, {"proxy_batch": 0}, {"proxy_batch": True}, {"proxy_batch": 2.0},
                          {"plan_mode": 2}, {"plan_mode": 3}, {"plan_mode": -1}, {"chunk_weights": [1.0, 2.5]},
                          {"chunk_weights": [1, 2]}, {"chunk_weights": [0.0]}, {"chunk_weights": [float("inf")]},
                          {"chunk_weights": [float("nan")]}, {"chunk_weights": []}, {"chunk_weights": "1,2"},
                          {"hs_native": 1}, {"nvl_gather": "no"}, {"proxy_cpu": "numa"}, ["symm"], None]
    for v in samples:
        assert mod._valid_options(v) == (data_path_problem(v) is None), v


def test_a_row_whose_digest_is_not_its_copys_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with Store(path) as s:
        assert s.put_profile(measured(qkey(), DEFAULTS))[0]
    con = sqlite3.connect(path)
    con.execute("UPDATE profiles SET runtime_options_digest = 'ffffffffffffffff'")
    con.commit()
    con.close()
    recs = query_db_profiles(path, ep_size=2, nodes=1, hidden=QWEN.hidden, intermediate=QWEN.intermediate,
                             experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype)
    assert recs == []


def test_export_and_import_carry_the_options(tmp_path: Path) -> None:
    with Store(tmp_path / "a.db") as a:
        assert a.put_profile(measured(qkey(), OTHER))[0]
        doc = a.dump_profiles()
    assert json.loads(doc)["profiles"][0]["runtime_options"] == OTHER
    with Store(tmp_path / "b.db") as b:
        assert b.import_bytes(doc).inserted == 1
        [(_, rec)] = b.list_profiles()
        assert rec.tuned_runtime_options == OTHER and rec.runtime_options_digest == data_path_digest(OTHER)


def test_an_import_of_an_earlier_export_fills_in_options_a_row_lost(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with Store(path) as s:
        assert s.put_profile(measured(qkey(), OTHER))[0]
        data = s.dump_profiles()
    con = sqlite3.connect(path)  # as a downgrade below 0009 and back without its event left it
    con.execute("UPDATE profiles SET runtime_options = NULL, runtime_options_digest = NULL")
    con.commit()
    con.close()
    with Store(path) as s:
        res = s.import_bytes(data)
        assert (res.inserted, res.skipped, res.completed, res.differing) == (0, 0, 1, [])
        [(_, rec)] = s.list_profiles()
        assert rec.tuned_runtime_options == OTHER and rec.runtime_options_digest == data_path_digest(OTHER)
        assert s.import_bytes(data).skipped == 1  # now it is all there
    # another copy than the stored one: said, never written over
    other = json.loads(data)
    other["profiles"][0]["runtime_options"] = DEFAULTS
    with Store(path) as s:
        res = s.import_bytes(json.dumps(other).encode())
        assert res.completed == 0 and res.differing and "runtime options" in res.differing[0]
        [(_, rec)] = s.list_profiles()
        assert rec.tuned_runtime_options == OTHER


# -- the runtime: applied as tuned only under the options it was measured under --------------------------------
def test_a_profile_tuned_under_other_options_is_not_applied_as_tuned(node_db, tmp_path: Path) -> None:
    db = node_db([measured(qkey(), DEFAULTS)])
    res, fell = _resolve(db_client(tmp_path, db, {"MOETUNE_FUSED_PACK": "0", "HOME": "/nonexistent"}))
    assert res.source in ("policy", "default") and not res.tuned and res.status == "default"
    assert len(fell) == 1 and "fused_pack: tuned with true, job has false" in fell[0], fell
    assert "not applied as tuned" in fell[0]
    # under the options it was measured under: tuned, and the resolution says they are the same
    res, _ = _resolve(db_client(tmp_path, db, {"HOME": "/nonexistent"}))
    assert res.source == "database" and res.tuned and res.options_status == "same" and res.options_diff == []
    # an option that is no part of the data path changes nothing
    res, _ = _resolve(db_client(tmp_path, db, {"MOETUNE_PROXY_CPU": "none", "HOME": "/nonexistent"}))
    assert res.tuned and res.options_status == "same"
    # the EP buffer's own options (passed by autoload) win over the variables
    res, _ = _resolve(db_client(tmp_path, db, {"MOETUNE_FUSED_PACK": "0", "HOME": "/nonexistent"}),
                      options=RuntimeOptions())
    assert res.tuned and res.options_status == "same"
    res, fell = _resolve(db_client(tmp_path, db, {"HOME": "/nonexistent"}), options=RuntimeOptions(symm="ipc"))
    assert not res.tuned and 'symm: tuned with "torch", job has "ipc"' in fell[0]
    with pytest.raises(TypeError, match="options must be a RuntimeOptions or None, got dict"):  # not an AttributeError
        _resolve(db_client(tmp_path, db, {"HOME": "/nonexistent"}), options={"symm": "ipc"})
    # options that do not act on nvlink (host_staged's, the proxy's): still tuned, the same
    res, fell = _resolve(db_client(tmp_path, db, {"HOME": "/nonexistent"}),
                         options=RuntimeOptions(hs_native=False, proxy_batch=4, proxy_host_wait=False))
    assert res.tuned and res.options_status == "same" and not any("runtime options" in w for w in fell), fell


def test_a_profile_without_recorded_options_is_unknown_as_an_unrecorded_environment_is(node_db,
                                                                                     tmp_path: Path) -> None:
    db = node_db([measured(qkey(), None)])  # an older moetune's measurement
    res, _ = _resolve(db_client(tmp_path, db, {"HOME": "/nonexistent"}))
    assert res.source == "database" and res.tuned and res.options_status == "unknown"
    res, fell = _resolve(db_client(tmp_path, db, {"HOME": "/nonexistent"}, env_mismatch="refuse"))
    assert res.source in ("policy", "default") and "runtime options are unknown" in fell[0]


def test_autoload_passes_the_buffers_options_and_caches_per_options(node_db, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    db = node_db([measured(qkey(), DEFAULTS)])
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", f"ipc://{tmp_path}/nowhere/daemon.sock")
    monkeypatch.setenv("MOETUNE_STORE_DB", str(db))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=100, options=RuntimeOptions(),
                                         export_env=False)
        other = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=100,
                                          options=RuntimeOptions(fused_pack=False), export_env=False)
    assert same.tuned and same.source == "database"
    assert not other.tuned and "fused_pack: tuned with true, job has false" in other.message


# -- over the wire ---------------------------------------------------------------------------------------------
def test_the_wire_carries_the_options_and_an_old_peers_reply_still_decodes() -> None:
    rec = measured(qkey(), OTHER)
    res = wire.ProfileResult.from_record(rec, env={})
    raw = msgspec.json.encode(res)
    back = msgspec.json.decode(raw, type=wire.ProfileResult)
    assert back.runtime_options == OTHER
    old = msgspec.to_builtins(res)
    del old["runtime_options"]  # an older daemon's reply: not recorded
    assert msgspec.convert(old, wire.ProfileResult).runtime_options is msgspec.UNSET
    # a modelled profile's reply carries none (as_effective drops them with perf_env)
    pred = msgspec.structs.replace(rec, backend="model:x", provenance="measured")
    assert wire.ProfileResult.from_record(pred, env={}).runtime_options is msgspec.UNSET


DAEMON_FP = "f" * 16


def _ok(rid: Any, res: Any) -> bytes:
    return json.dumps({"v": 1, "id": rid, "ok": True, "epoch": "e1", "result": res}).encode()


@pytest.fixture
def options_daemon(tmp_path: Path):
    made: list[F.ReplyRouter] = []

    def make(options: Any) -> F.ReplyRouter:
        run = tmp_path / f"run{len(made)}"
        run.mkdir(mode=0o700)
        (run / "daemon.json").write_text(json.dumps({"fingerprint": DAEMON_FP, "software": F.this_node_software(),
                                                     "transports": ["nvlink"], "db": str(tmp_path / "none.db"),
                                                     "host": socket.gethostname(), "running": True,
                                                     "epoch": "e1"}))
        rec = measured(qkey(DAEMON_FP, F.this_node_software()), None)
        reply = msgspec.to_builtins(wire.ProfileResult.from_record(rec, env={"NVSHMEM_REMOTE_TRANSPORT": "none"}))
        if options is not None:
            reply["runtime_options"] = options
        d = F.ReplyRouter(f"ipc://{run / 'daemon.sock'}",
                          lambda req: _ok(req["id"], F.this_node_fabric(DAEMON_FP)) if req.get("op") == "fabric"
                          else _ok(req["id"], reply))
        made.append(d)
        return d

    autoload.clear_cache()
    yield make
    autoload.clear_cache()
    for d in made:
        d.close()


def test_a_daemons_profile_is_judged_by_its_options(options_daemon, tmp_path: Path) -> None:
    def ask(options: Any, job: dict[str, str]) -> tuple[Resolution, list[str]]:
        d = options_daemon(options)
        return _resolve(ProfileClient(d.endpoint, db_path=tmp_path / "none.db", timeout_ms=500,
                                      env={"HOME": "/nonexistent", **job}))

    res, fell = ask(DEFAULTS, {})
    assert res.source == "daemon" and res.tuned and res.options_status == "same" and fell == []
    res, fell = ask(DEFAULTS, {"MOETUNE_FUSED_PACK": "0"})
    assert res.source in ("policy", "default") and "fused_pack: tuned with true, job has false" in fell[0]
    res, fell = ask(None, {})  # an older daemon or measurement: unknown, served under the default policy
    assert res.source == "daemon" and res.tuned and res.options_status == "unknown"
    res, fell = ask({"proxy_cpu": "numa"}, {})  # not what a daemon of this moetune sends: a bad reply
    assert res.source in ("policy", "default") and "runtime_options" in fell[0]


@pytest.mark.usefixtures("autoload_on")
def test_an_ep_buffer_looks_up_under_its_own_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.buffer.facade import EPBuffer

    seen: list[Any] = []

    def fake_resolve(**kw: Any) -> Resolution:
        seen.append(kw["options"])
        knobs = default_knobs("collective")
        return Resolution(knobs=knobs, source="policy", profile_hash=f"policy:{knobs.digest()}", status="default",
                          family="collective")

    monkeypatch.setattr(autoload, "_resolve", fake_resolve)
    autoload.clear_cache()
    model = ModelShape(name="t", hidden=128, intermediate=64, experts=8, topk=2, dtype="bfloat16")
    try:
        EPBuffer(None, None, model=model, max_tokens=64, device="cpu", options={"fused_pack": False}).close()
        EPBuffer(None, None, model=model, max_tokens=64, device="cpu").close()  # other options: not the cached one
    finally:
        autoload.clear_cache()
    assert [o.fused_pack for o in seen] == [False, True]


def test_autoload_knobs_forwards_the_callers_options(node_db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """autoload_knobs looks up under the options its caller passes, not always under the config's and variables'."""
    tuned = measured(qkey(), DEFAULTS)
    db = node_db([tuned])
    monkeypatch.setenv("MOETUNE_CLIENT_SOCKET", f"ipc://{tmp_path}/nowhere/daemon.sock")
    monkeypatch.setenv("MOETUNE_STORE_DB", str(db))
    monkeypatch.setenv("MOETUNE_FUSED_PACK", "0")  # the job's own options override it
    kw: dict[str, Any] = {"model": QWEN, "ep_size": 2, "nodes": 1, "max_tokens": 100}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert autoload.autoload_knobs(**kw, options=RuntimeOptions()) == tuned.knobs
        assert autoload.last_resolution().tuned  # type: ignore[union-attr]
        assert autoload.autoload_knobs(**kw, options=RuntimeOptions(symm="ipc")) != tuned.knobs
        assert autoload.autoload_knobs(**kw) != tuned.knobs  # None: the variables, as before
    # a group of several ranks goes through autoload_group_profile, with the same options
    seen: list[Any] = []

    def group_profile(**kw: Any) -> Resolution:
        seen.append(kw["options"])
        return Resolution(knobs=tuned.knobs, source="daemon", profile_hash="h", status="current")

    monkeypatch.setattr(autoload, "_dist_on", lambda group=None: True)
    monkeypatch.setattr(autoload, "autoload_group_profile", group_profile)
    mine = RuntimeOptions(fused_pack=False)
    assert autoload.autoload_knobs(model=QWEN, ep_size=2, max_tokens=100, options=mine) == tuned.knobs
    assert seen == [mine]


def test_whether_a_profiles_transport_runs_is_asked_under_the_callers_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup asks a transport's availability under the options of the EP buffer that looks up (which its own
    knobs are checked under), not the config's and variables': host_staged's depends on hs_native on a GPU, and there
    an unreadable MOETUNE_* variable would make it 'availability check failed' and pass its profile over."""
    from moetune.runtime.transports.base import Availability
    from moetune.runtime.transports.host_staged import HostStagedTransport

    asked: list[Any] = []

    def availability(cls: Any, device: Any = None, options: Any = None) -> Availability:
        asked.append(options)
        return Availability(options is None or options.hs_native, "test")

    monkeypatch.setattr(HostStagedTransport, "availability", classmethod(availability))
    monkeypatch.setattr(autoload, "_availability", {})
    mine = RuntimeOptions(hs_native=False)

    class Client:
        def resolve(self, *, transport_ok: Callable[[str], str | None], **kw: Any) -> Resolution:
            assert kw["options"] is mine
            knobs = default_knobs("collective")
            return Resolution(knobs=knobs, source="policy", profile_hash=f"policy:{knobs.digest()}", status="default",
                              message=str(transport_ok("host_staged")))

        def close(self) -> None:
            pass

    monkeypatch.setattr(autoload, "ProfileClient", Client)
    monkeypatch.setattr(autoload, "client_autoload", lambda: (True, "test"))
    autoload.clear_cache()
    try:
        res = autoload.autoload_profile(model=QWEN, ep_size=2, nodes=1, max_tokens=100, device="cpu", options=mine,
                                        export_env=False)
    finally:
        autoload.clear_cache()
    assert asked == [mine] and res.message == "test"
    # cached per options: other options are asked again, the same ones are not
    assert autoload.runtime_transport_problem("host_staged", "cpu", RuntimeOptions()) is None
    assert autoload.runtime_transport_problem("host_staged", "cpu", mine) == "test"
    assert asked == [mine, RuntimeOptions()]
    # the group's fallback (hosts that resolved different profiles) checks rank 0's default under them too
    hs = Resolution(knobs=default_knobs("host_staged"), source="daemon", profile_hash="h", status="current",
                    family="host_staged")
    # (nodes=1: host_staged serves one host's ranks, so with more it is replaced before availability is asked)
    assert autoload._group_default(hs, 1, "cpu", "test", mine, ep_size=2).family == "collective"
    assert autoload._group_default(hs, 1, "cpu", "test", RuntimeOptions(), ep_size=2).family == "host_staged"


def test_chunk_weights_are_at_most_one_per_pipeline_chunk_so_a_recorded_set_fits_a_reply() -> None:
    """chunk_weights took any number of weights (ignored with one chunk or the packed layout), so a measurement under
    MOETUNE_EP_CHUNK_WEIGHTS of 65 weights was recorded and stored, and the daemon served it in a reply every client
    refused (wire.OptionsMap holds at most 64): the profile was never served. One weight per pipeline chunk, at most
    pipeline_depth's largest value, is what the option now takes, and such a record decodes."""
    from moetune.runtime.knobs import KNOB_VALUES
    from moetune.runtime.options import RuntimeOptionError
    from moetune.runtime.profiles.replies import decode_result

    most = KNOB_VALUES["pipeline_depth"].high
    for n in (most + 1, 65):
        with pytest.raises(RuntimeOptionError, match="chunk_weights"):
            RuntimeOptions(chunk_weights=(1.0,) * n)
        with pytest.raises(RuntimeOptionError, match="MOETUNE_EP_CHUNK_WEIGHTS"):
            RuntimeOptions.from_env({"MOETUNE_EP_CHUNK_WEIGHTS": ",".join(["1"] * n)})
        assert data_path_problem({"chunk_weights": [1.0] * n}) is not None  # nor stored, nor taken from a reply
    opts = RuntimeOptions(chunk_weights=(1.0,) * most).data_path()
    raw = msgspec.json.encode(wire.ProfileResult.from_record(measured(qkey(), opts), env={}))
    assert decode_result("get_profile", msgspec.Raw(raw)).runtime_options == opts
