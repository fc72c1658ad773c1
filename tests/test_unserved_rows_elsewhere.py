"""Rows no lookup serves (knobs or key contradicting their family: `key_knobs_problem`; beyond the runtime:
`runtime_refusal`) are not counted as served elsewhere: the daemon's re-tune planning (`moetune daemon retune`, a
fabric change's re-tune) and its status; and a row whose knobs contradict its family is no incumbent of the store's
gate, the tuner or the bring-up's compare stage (tests/test_serving_contradicting_rows.py has the lookups
themselves)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.daemon.handlers import retune_keys
from moetune.tuner.daemon.index import ProfileIndex

pytestmark = pytest.mark.timeout(120)

QWEN = (2048, 768, 128, 8)


def _key(fp: str, sw: str = "sw", *, family: str = "nvlink", ep: int = 2, nodes: int = 1,
         bucket: int = 64) -> ProfileKey:
    return ProfileKey(fingerprint=fp, software=sw, transport_family=family, ep_size=ep, nodes=nodes, hidden=QWEN[0],
                      intermediate=QWEN[1], experts=QWEN[2], topk=QWEN[3], dtype="bfloat16", token_bucket=bucket)


def _rec(k: ProfileKey, backend: str = "local:nccl", **knobs: object) -> ProfileRecord:
    prov = "measured" if backend.startswith("local:") else "node_model"
    return ProfileRecord(key=k, knobs=default_knobs(k.transport_family.split(":")[0]).replace(**knobs),
                         latency_us=5.0, spread_us=0.1, backend=backend, provenance=prov,  # type: ignore[arg-type]
                         measured_on=k.fingerprint)


def _contradict(db: Path, fingerprint: str, bucket: int) -> None:
    """Make the current row of `fingerprint` at `bucket` name engine=megakernel under its transport key, as an older
    moetune's import stored it (the store refuses to write one: `db check` names it)."""
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        row_id, raw = con.execute("SELECT id, knobs FROM profiles WHERE fingerprint = ? AND token_bucket = ? "
                                  "AND status = 'current'", (fingerprint, bucket)).fetchone()
        con.execute("UPDATE profiles SET knobs = ? WHERE id = ?",
                    (json.dumps({**json.loads(raw), "engine": "megakernel"}), row_id))


# -- 1. re-tune planning ---------------------------------------------------------------------------------------------
def test_retune_plans_a_stale_key_whose_current_row_is_not_served() -> None:
    """`moetune daemon retune`: a stale key whose only current row contradicts its family is planned (its lookups fall
    back); so is a current key no row of which is served, stale or not. A served row still stands for its key."""
    facts = SimpleNamespace(fingerprint="fp", software_hash="sw")
    odd = _rec(_key("fp", bucket=64), engine="megakernel")
    stale = _rec(_key("old", bucket=64))
    idx = ProfileIndex([odd], version=1, facts=facts, stale=[stale])
    assert retune_keys(idx, all_current=False) == [stale.key]
    idx = ProfileIndex([odd], version=1, facts=facts, stale=[])
    assert retune_keys(idx, all_current=False) == [odd.key]
    # what-if: proxy at EP 16 (beyond the runtime: autoload passes it over)
    what_if = _rec(_key("fp", family="proxy:ibrc", ep=16, nodes=2, bucket=64), backend="model:node:fp")
    idx = ProfileIndex([what_if], version=1, facts=facts, stale=[])
    assert retune_keys(idx, all_current=False) == [what_if.key]
    # a megakernel key at EP 2 holds no profile at all (the store refuses every one): a re-tune of it is no answer
    mk = ProfileRecord(key=_key("fp", family="megakernel", ep=2, bucket=64), knobs=default_knobs("collective").replace(
        engine="megakernel"), latency_us=5.0, spread_us=0.1, backend="local:megakernel", provenance="measured",
                       measured_on="fp")
    idx = ProfileIndex([mk], version=1, facts=facts, stale=[])
    assert retune_keys(idx, all_current=False) == []
    # a served row of the same tuning key (another family) stands for it
    sound = _rec(_key("fp", family="collective", bucket=64))
    idx = ProfileIndex([odd, sound], version=1, facts=facts, stale=[stale])
    assert retune_keys(idx, all_current=False) == []


def test_nothing_to_re_tune_does_not_call_a_current_row_no_re_tune_can_answer_served() -> None:
    """A megakernel key at EP 2 holds no profile a re-tune could store (`key_holds_a_profile`), so its current row is
    not planned; "nothing to re-tune" then said that every current profile is served, of one no lookup serves."""
    from moetune.runtime import wire
    from moetune.tuner.daemon.handlers import run_retune

    facts = SimpleNamespace(fingerprint="fp", software_hash="sw")
    mk = ProfileRecord(key=_key("fp", family="megakernel", ep=2, bucket=64), knobs=default_knobs("collective").replace(
        engine="megakernel"), latency_us=5.0, spread_us=0.1, backend="local:megakernel", provenance="measured",
                       measured_on="fp")
    d = SimpleNamespace(index=ProfileIndex([mk], version=1, facts=facts, stale=[]))
    ok, res = run_retune(d, wire.Retune(v=wire.PROTOCOL_VERSION, id=1))  # type: ignore[arg-type]
    assert ok and res.job is None and res.message.startswith("nothing to re-tune"), res
    assert "no re-tune can answer" in res.message, res.message  # not "every current one is served" alone


def test_a_fabric_change_finished_at_start_re_tunes_a_key_whose_current_row_is_not_served(tmp_path: Path) -> None:
    """The start's finish of an unqueued fabric change (`retune_keys` of watch.py): a key of the new fingerprint whose
    only current row contradicts its family is no key the new fabric has a profile for."""

    db = tmp_path / "moetune.db"
    store, old, new, seeded = F.unqueued_fabric_change(db)
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    k = seeded[0].key
    mine = ProfileKey(**{**k.to_dict(), "fingerprint": new.fingerprint, "software": new.software_hash})
    store.put_profile(F.make_record(mine))
    _contradict(db, new.fingerprint, k.token_bucket)
    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        assert done.wait(10), "no re-tune queued for the change"
        assert sorted(x.token_bucket for x in ran[0]) == sorted(r.key.token_bucket for r in seeded)
    finally:
        d.stop()


# -- 2. the daemon's status ------------------------------------------------------------------------------------------
def test_status_counts_current_rows_no_lookup_serves_apart(tmp_path: Path) -> None:
    """`profiles_current` counts every current row, as `list_profiles` lists them (the database's status: `db check`
    names the contradicting ones); those no lookup serves are counted apart (`profiles_not_served`), and the
    provenance counts (what lookups take) leave them out."""
    from typer.testing import CliRunner

    from moetune.runtime.profiles.client import ProfileClient
    from moetune.tuner.cli import app
    from moetune.tuner.daemon.server import Daemon

    facts = F.FakeFacts({"gpu_model": "H200"})
    db = tmp_path / "moetune.db"
    store = F.open_store(db)
    for b in (64, 1024, 4096):
        store.put_profile(F.make_record(_key(facts.fingerprint, facts.software_hash, bucket=b), backend="local:nccl"))
    _contradict(db, facts.fingerprint, 4096)
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=lambda: facts,
               rediscover_interval_s=0).start(background=True)
    try:
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        st = c.status()
        assert len(c.list_profiles().profiles) == st.profiles_current == 3
        assert st.profiles_not_served == 1
        assert st.provenance == {"measured": 2, "node_model": 0, "preset": 0}
        c.close()
        r = CliRunner().invoke(app, ["status", "--socket", d.endpoint], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert "not served: 1" in r.output and "db check" in r.output, r.output
    finally:
        d.stop()


# -- 3. the incumbent: the store's gate and the tuner ---------------------------------------------------------------
def _contradicting_current(tmp_path: Path, k: ProfileKey, latency_us: float = 50.0) -> Any:
    """A store whose current profile of `k` is measured and fast, its knobs naming engine=megakernel under the
    transport key (an older moetune's import: no lookup serves it, `db check` names it)."""
    from moetune.tuner.store.store import Store

    db = tmp_path / "p.db"
    store = Store(db)
    ok, why = store.put_profile(ProfileRecord(key=k, knobs=default_knobs("host_staged"), latency_us=latency_us,
                                              spread_us=1.0, backend="local:gloo", provenance="measured",
                                              measured_on=k.fingerprint, routing="uniform"))
    assert ok, why
    _contradict(db, k.fingerprint, k.token_bucket)
    assert store.contradicting_profiles()
    return store


@pytest.mark.parametrize("backend", ["local:gloo", "model:nvlink-h200x2"])
def test_the_store_replaces_a_current_row_no_lookup_serves(tmp_path: Path, backend: str) -> None:
    """`put_profile`'s gate: a current row whose knobs contradict its family stands for nothing, so a sound profile
    replaces it whatever the numbers or the provenance (a slower measurement; a preset's prediction), saying why. It
    kept the row: "does not beat the stored number", or "a preset profile never displaces" a measured one."""
    k = _key("c" * 16, family="host_staged", bucket=1024)
    store = _contradicting_current(tmp_path, k)
    new = ProfileRecord(key=k, knobs=default_knobs("host_staged").replace(pipeline_depth=2), latency_us=90.0,
                        spread_us=1.0, backend=backend,
                        provenance="measured" if backend.startswith("local:") else "preset",
                        measured_on=k.fingerprint if backend.startswith("local:") else "preset:nvlink-h200x2",
                        routing="uniform")
    written, why = store.put_profile(new)
    assert written and "contradict its family" in why, why
    cur = store.get_current(k)
    assert cur is not None and cur.knobs == new.knobs
    current = {i for i, _ in store.list_profiles(status="current")}
    assert not current & {i for i, _ in store.contradicting_profiles()}  # kept as superseded history


def test_a_local_tune_never_keeps_an_incumbent_no_lookup_serves(tmp_path: Path) -> None:
    """`_write_profile`: an incumbent whose knobs contradict its family is not compared as the incumbent (it held its
    own side by side, was "kept", and its fresh number was handed to put_profile, which refuses such a record): the
    search's best is stored in its place, the reason saying why."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.backends import Measurement, TuneWorkload
    from moetune.tuner.search.local_backend import LocalBackend
    from moetune.tuner.search.study import StudyResult
    from moetune.tuner.search.tune import _write_profile

    k = _key("c" * 16, family="host_staged", bucket=1024)
    store = _contradicting_current(tmp_path, k)
    odd = store.get_current(k).knobs
    best = default_knobs("host_staged").replace(pipeline_depth=2)

    class SideBySide(LocalBackend):
        def __init__(self) -> None:
            super().__init__(command=["true"], comm_backend="gloo", repeats=2)

        def compare(self, cands, workload, rounds=2):  # type: ignore[override]
            us = {best: 100.0, odd: 99.0}  # the contradicting incumbent "holds its own"
            return [Measurement(us[c], 1.0, [us[c]] * rounds, True) for c in cands]

    class Facts:
        fingerprint, software_hash, software = k.fingerprint, k.software, {}

    wl = TuneWorkload(get_model("qwen3-30b"), 1024, gpus_per_node=2)
    result = StudyResult(study_name="s", family="host_staged", workload=wl, best_knobs=best,
                         best=Measurement(100.0, 1.0, [100.0], True), trials=4, complete=4, failed=0, pruned=0)
    _rec, written, reason = _write_profile(store, k, SideBySide(), result, Facts())
    assert written and "contradict its family" in reason, reason
    cur = store.get_current(k)
    assert cur is not None and cur.knobs == best


def test_a_tune_with_no_result_does_not_call_an_unserved_current_profile_kept(tmp_path: Path) -> None:
    """`TuneResult.kept` ("the current profile stored before stands for the key") is not said of a row no lookup
    serves: nothing stands for the key, its stored cell is "none"."""
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.backends import CallableBackend
    from moetune.tuner.search.tune import tune_profiles_detailed

    class Facts:
        fingerprint, software_hash = "c" * 16, "sw"
        software: dict = {}  # noqa: RUF012
        gpu_count, nodes, link_rates = 2, 1, {}

        @property
        def transports(self) -> list[Any]:
            from moetune.tuner.search.tune import _Fam

            return [_Fam("host_staged")]

    k = _key("c" * 16, family="host_staged", bucket=1024)
    store = _contradicting_current(tmp_path, k)

    def fails(_k: object, _w: object) -> float:
        raise RuntimeError("no run")

    res = tune_profiles_detailed(store, Facts(), models=[MODELS["qwen3-30b"]], tokens=[1024], ep_size=2, nodes=1,
                                 backend=CallableBackend(fails), trials=2, families=["host_staged"],
                                 storage=f"sqlite:///{tmp_path / 'studies.db'}")
    assert len(res) == 1 and res[0].record is None and res[0].study.best_knobs is None
    assert res[0].record is None and not res[0].kept and res[0].stored == "none", res[0]


@pytest.mark.usefixtures("on_captured_node")
def test_the_bring_up_compare_stage_never_keeps_a_current_profile_no_lookup_serves(tmp_path: Path) -> None:
    """`moetune profile`'s compare stage: a current profile whose knobs contradict its family (engine=unfused under
    the megakernel key, faster by its stored number) does not keep out the tuned setting that beats the default:
    it is not measured beside it (`served_incumbent`, as `moetune tune`), and the store's gate replaces it (before
    64878ee2 it kept the row as "the new best is slower")."""
    from test_bringup_compare_rules import _bringup, _key, _store_x, _tune_and_compare, timed

    from moetune.runtime.knobs import Knobs

    b = _bringup(tmp_path, timed(x_us=150.0, other_us=210.0))
    _store_x(b, "uniform")
    with contextlib.closing(sqlite3.connect(tmp_path / "b.db")) as con, con:
        con.execute("UPDATE profiles SET knobs = ? WHERE status = 'current'", (json.dumps(Knobs().to_dict()),))
    assert b.store.contradicting_profiles()
    row = _tune_and_compare(b)
    cur = b.store.get_current(_key(b))
    assert cur is not None and cur.knobs.engine == "megakernel" and cur.latency_us == 210.0, row
    assert row["stored"] == "tuned" and row["written"] and "contradict its family" in row["reason"], row
    assert "current_us" not in row  # not a rival: not measured beside the tuned setting (`served_incumbent`)


@pytest.mark.usefixtures("on_captured_node")
def test_the_bring_up_compare_stage_never_keeps_a_contradicting_transport_profile_that_holds_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`moetune profile`'s compare stage on an EP key: a current profile naming engine=megakernel under a transport
    key (no lookup serves it) that the backend measures and finds as fast as the tuned setting was "kept" as the
    current profile, its fresh number handed to put_profile, which refuses such a record (FieldError knobs.engine):
    the stage failed. As `moetune tune` (`served_incumbent`), it is no rival: the tuned setting is stored."""
    import io

    from rich.console import Console

    from moetune.runtime.shapes import get_model
    from moetune.tuner.bringup import flow
    from moetune.tuner.search.backends import Measurement
    from moetune.tuner.search.local_backend import LocalBackend
    from moetune.tuner.search.policy import load_policy

    default = load_policy("collective").defaults
    tuned = default.replace(pipeline_depth=2)

    class SideBySide(LocalBackend):
        def compare(self, cands, workload, rounds=2):  # type: ignore[override]
            # the contradicting row holds its own beside the tuned setting; the default is slower than both
            us = {tuned: 100.0, default: 200.0}
            return [Measurement(us.get(c, 99.0), 1.0, [us.get(c, 99.0)] * rounds, True) for c in cands]

    monkeypatch.setattr(flow.Bringup, "_backend", lambda self, world: SideBySide(
        world=world, command=["true"], comm_backend="gloo", repeats=2, metric="comm"))
    plan = flow.Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=5, compare_rounds=2)
    b = flow.Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                     console=Console(file=io.StringIO(), width=200), capture=Path(__file__).resolve().parent
                     / "captures" / "dgx-h100", storage=f"sqlite:///{tmp_path / 'opt.db'}")
    b.state.mark("discover", b.stage_discover())
    m = get_model("qwen3-30b")
    k = ProfileKey(fingerprint=b.facts.fingerprint, software=b.facts.software_hash, transport_family="collective",
                   ep_size=8, nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts, topk=m.topk,
                   dtype=m.dtype, token_bucket=16)
    label = b._backend(8).label
    ok, why = b.store.put_profile(ProfileRecord(key=k, knobs=default.replace(pipeline_depth=3), latency_us=90.0,
                                                spread_us=1.0, backend=label, provenance="measured",
                                                measured_on=k.fingerprint, routing="uniform",
                                                software_versions=dict(b.facts.software)))
    assert ok, why
    _contradict(tmp_path / "b.db", k.fingerprint, 16)
    assert b.store.contradicting_profiles()
    b.state.mark("tune", [{"family": "collective", "tokens": 16, "ep_size": 8, "key": k.to_dict(),
                           "software_versions": dict(b.facts.software), "knobs": tuned.to_dict(), "latency_us": 100.0,
                           "spread_us": 1.0, "written": False, "reason": "", "study": "s", "routing": "uniform",
                           "model": "qwen3-30b"}])
    (row,) = b.stage_compare()
    cur = b.store.get_current(k)
    assert cur is not None and cur.knobs == tuned, row
    assert row["stored"] == "tuned" and row["written"] and "contradict its family" in row["reason"], row
