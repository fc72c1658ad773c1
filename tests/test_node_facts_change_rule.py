"""A GPU swapped while no daemon runs: `fabric show --record`, a local tune and `profile` recorded the new GPUs' facts
over the old ones under the same fingerprint, leaving the old parts' profiles current (the runtime's database
fallback served them as tuned), and the daemon's next start took the swap for a change then, making stale what had
been measured on the new GPUs meanwhile. Every writer of this node's facts now applies the daemon's change rule
(`fabric.change.record_node_facts`): the old parts' profiles are stale when the new facts are recorded, in the same
transaction, and the daemon's start finds the recorded fabric unchanged (it re-tunes only the keys not measured
since)."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_daemon_change_since_bringup import _profiled

from moetune.tuner.cli import app
from moetune.tuner.fabric import discovery
from moetune.tuner.fabric.change import identity
from moetune.tuner.fabric.facts import read_facts

pytestmark = pytest.mark.timeout(60)

CAPTURES = Path(__file__).parent / "captures"


def _swapped(tmp_path: Path, capture: str = "h200x2") -> tuple[Path, Any]:
    """`capture` with GPU 0 replaced by another part of the same model (another serial and UUID)."""
    dest = tmp_path / f"{capture}-swapped"
    shutil.copytree(CAPTURES / capture, dest)
    for p in dest.rglob("*"):
        if p.is_file():
            t = p.read_text(errors="surrogateescape")
            new = t.replace("1652826069623", "1652826099999").replace("GPU-0269f2ef-", "GPU-0269ffff-")
            if new != t:
                p.write_text(new, errors="surrogateescape")
    return dest, discovery.discover(dest)


def _fabric_changed(store: Any) -> list[Any]:
    return store.list_events(limit=20, kinds=("fabric_changed",))


def test_the_swap_fixture_is_the_same_fingerprint_on_other_gpus(tmp_path: Path) -> None:
    old = discovery.discover(CAPTURES / "h200x2")
    _cap, new = _swapped(tmp_path)
    assert new.fingerprint == old.fingerprint and identity(new) != identity(old) and new.complete


def test_fabric_show_record_of_a_swap_makes_the_old_parts_profiles_stale_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.cli import fabric as cli_fabric

    store, old, seeded = _profiled(tmp_path, "h200x2")  # `moetune profile` on the old GPUs, no daemon event
    _cap, new = _swapped(tmp_path)
    monkeypatch.setattr(cli_fabric, "_discover", lambda d, t: new)
    r = CliRunner().invoke(app, ["fabric", "show", "--record", "--db", str(tmp_path / "moetune.db"), "--json"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "marked stale" in " ".join(r.output.split())
    assert not store.list_profiles(status="current", fingerprint=old.fingerprint)  # the fallback serves none of them
    assert len(store.list_profiles(status="stale", fingerprint=old.fingerprint)) == len(seeded)
    (ev,) = _fabric_changed(store)
    d = ev["details"]
    assert (d["old_fingerprint"], d["fingerprint"], d["identity"]) == (old.fingerprint, new.fingerprint, identity(new))
    assert sorted(d["profiles"]) == sorted(i for i, _ in store.list_profiles(fingerprint=old.fingerprint))
    assert "replaced" in ev["reason"] and d["recorded_by"] == "fabric show --record"
    # recorded again on the same GPUs: no second change
    r = CliRunner().invoke(app, ["fabric", "show", "--record", "--db", str(tmp_path / "moetune.db"), "--json"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0 and "marked stale" not in r.output and len(_fabric_changed(store)) == 1


def test_the_daemons_start_after_a_swap_profile_recorded_keeps_what_was_measured_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon ran on the old GPUs (its fabric_seen event), `moetune profile` ran on the new ones while it was down
    and measured one key; the start re-tunes the other keys, and the key measured on the new GPUs stays current."""
    from moetune.tuner.bringup.flow import Bringup, Plan

    store, old, seeded = _profiled(tmp_path, "h200x2")
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": old.fingerprint, "identity": identity(old), "facts": old.to_dict()})
    cap, new = _swapped(tmp_path)
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: new, raising=False)
    out = io.StringIO()
    b = Bringup(store=store, plan=Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=5),
                state_dir=tmp_path / "state", console=Console(file=out, width=300), capture=cap,
                storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert b.measures
    b.stage_discover()
    assert "marked stale" in out.getvalue()
    assert not store.list_profiles(status="current", fingerprint=old.fingerprint)
    (measured,) = F.seed_profiles(store, new, buckets=(1024,))  # measured on the new GPUs
    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        assert done.wait(10), "the keys not measured on the new GPUs were not re-tuned"
        assert sorted(k.token_bucket for k in ran[0]) == [64, 4096]
        (cur,) = [r for _, r in store.list_profiles(status="current", fingerprint=new.fingerprint)]
        assert cur.profile_hash == measured.profile_hash  # not made stale by the start
        assert len(_fabric_changed(store)) == 1  # the start found no change of its own
    finally:
        d.stop()
    assert len(seeded) == 3


def test_a_local_tune_records_a_swap_as_a_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, old, seeded = _profiled(tmp_path, "h200x2")
    _cap, new = _swapped(tmp_path)
    real = discovery.discover
    monkeypatch.setattr(discovery, "discover", lambda d=None, **kw: new if d is None else real(d, **kw))
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: new, raising=False)
    F.fake_local_backend(monkeypatch, "local:nccl")
    import moetune.tuner.search.local_backend as local_backend

    monkeypatch.setattr(local_backend, "cuda_gpus", lambda: 2)  # the swapped node's two GPUs (no rank is launched)
    r = CliRunner().invoke(app, ["tune", "--backend", "local", "--model", "custom:256,128,8,2", "--tokens", "16",
                                 "--trials", "2", "--world", "2", "--family", "nvlink",
                                 "--db", str(tmp_path / "moetune.db"), "--json"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert len(store.list_profiles(status="stale", fingerprint=old.fingerprint)) == len(seeded)
    assert _fabric_changed(store)[0]["details"]["recorded_by"] == "tune --backend local"
    # what the tune measured on the new GPUs is current
    assert [r.key.token_bucket for _, r in store.list_profiles(status="current", fingerprint=new.fingerprint)] == [16]


def test_incomplete_facts_of_another_fabric_are_not_recorded(tmp_path: Path) -> None:
    from moetune.tuner.fabric.change import record_node_facts

    store, old, seeded = _profiled(tmp_path, "h200x2")
    _cap, new = _swapped(tmp_path)
    new.warnings.append("`nvidia-smi -q -x` timed out; facts it provides are missing")
    res = record_node_facts(store, new, by="test")
    assert res.kept and not res.changed and "timed out" in res.note()
    assert len(store.list_profiles(status="current", fingerprint=old.fingerprint)) == len(seeded)
    assert not _fabric_changed(store)
    assert identity(read_facts(store.get_fingerprint(old.fingerprint)["facts"])) == identity(old)


def test_the_marks_and_the_facts_are_one_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the facts were written leaves neither them nor any mark: the next writer sees the change."""
    from moetune.tuner.fabric.change import record_node_facts

    store, old, seeded = _profiled(tmp_path, "h200x2")
    _cap, new = _swapped(tmp_path)

    def boom(**kw: Any) -> int:
        raise OSError("disk gone")

    monkeypatch.setattr(store, "mark_stale", boom)
    with pytest.raises(OSError):
        record_node_facts(store, new, by="test")
    monkeypatch.undo()
    assert len(store.list_profiles(status="current", fingerprint=old.fingerprint)) == len(seeded)
    assert not _fabric_changed(store)
    assert record_node_facts(store, new, by="test").stale == len(seeded)


def test_a_resumed_profile_records_a_swap_since_its_earlier_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state file is keyed by the fingerprint, which a swap keeps: the resumed run skipped `discover` and so
    recorded nothing, measuring on the new GPUs beside the old parts' current profiles."""
    from moetune.tuner.bringup.flow import STAGES, Bringup, Plan

    store, old, seeded = _profiled(tmp_path, "h200x2")
    plan = Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=5)

    def bringup(capture: Path, facts: Any) -> Any:
        monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: facts, raising=False)
        return Bringup(store=store, plan=plan, state_dir=tmp_path / "state", console=Console(file=io.StringIO(), width=300),
                       capture=capture, storage=f"sqlite:///{tmp_path / 'opt.db'}")

    first = bringup(CAPTURES / "h200x2", old)
    first.state.mark("discover", first.stage_discover())  # interrupted after its first stage
    cap, new = _swapped(tmp_path)
    again = bringup(cap, new)
    assert again.state.done("discover")
    for stage in STAGES[1:]:  # the measuring stages are another test's business
        monkeypatch.setattr(again, f"stage_{stage}", lambda: {})
    again.run()
    assert not store.list_profiles(status="current", fingerprint=old.fingerprint)
    assert len(store.list_profiles(status="stale", fingerprint=old.fingerprint)) == len(seeded)
    assert _fabric_changed(store)[0]["details"]["recorded_by"] == "profile"


def test_another_nodes_fabric_event_in_a_shared_database_is_no_base(tmp_path: Path) -> None:
    """Identical nodes share a fingerprint and its profiles: the other node's daemon's event names its own GPUs, which
    are no replaced parts of this node's (comparing with it made the shared profiles stale)."""
    from moetune.tuner.fabric.change import record_node_facts

    store, old, seeded = _profiled(tmp_path, "h200x2")
    _cap, twin = _swapped(tmp_path)  # the other node: same model of GPUs, other serials
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": twin.fingerprint, "identity": identity(twin), "facts": twin.to_dict(),
                             "node": "the-other-node"})
    assert store.node != "the-other-node"
    res = record_node_facts(store, old, by="test")
    assert not res.changed and not _fabric_changed(store)
    assert len(store.list_profiles(status="current", fingerprint=old.fingerprint)) == len(seeded)
    d, ran, done = F.start_recording_daemon(store, tmp_path, old)  # nor is it the daemon's base at its first start here
    try:
        assert not done.wait(1.0), f"re-tuned at start: {ran}"
        assert not _fabric_changed(store)
        assert len(store.list_profiles(status="current", fingerprint=old.fingerprint)) == len(seeded)
    finally:
        d.stop()


def test_this_nodes_last_fabric_is_found_behind_other_nodes_newer_events(tmp_path: Path) -> None:
    """A database shared by more nodes than the window of 20: once 20 other nodes had recorded a fabric event after
    this node's, its last fabric read as never recorded (the window held none of its events), and its daemon took
    the bring-up facts for the base. Its own events are found however many others came after them."""
    from moetune.tuner.fabric.change import last_fabric_event, node_fabric_events

    store, old, _seeded = _profiled(tmp_path, "h200x2")
    mine = {"fingerprint": old.fingerprint, "identity": identity(old), "facts": old.to_dict(), "node": store.node}
    store.add_event(kind="fabric_seen", reason="first discovery", details=mine)
    for n in range(25):
        store.add_event(kind="fabric_seen", reason="first discovery",
                        details={"fingerprint": f"{n:016x}", "identity": "x", "facts": {}, "node": f"node-{n}"})
    assert [e["details"]["node"] for e in node_fabric_events(store)] == [store.node]
    last = last_fabric_event(store)
    assert last is not None and last["fingerprint"] == old.fingerprint and last["node"] == store.node
