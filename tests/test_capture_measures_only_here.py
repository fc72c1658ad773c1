"""A number measured on this machine is stored only under this machine's identity. With --capture, a measuring run
(`tune --backend local`, `profile`) measures only when the capture describes THIS node (live discovery's fingerprint
and software hash): `tune --backend local --capture` of another node is refused up front, `profile --capture` of
another node runs its discovery, plan and report but no measurement. Live discovery is simulated (`live_facts`) so
that these tests read the same on any machine."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app
from moetune.tuner.fabric import discovery
from moetune.tuner.fabric.errors import DiscoveryError

pytestmark = pytest.mark.timeout(120)
CAPTURES = Path(__file__).resolve().parent / "captures"


def _live_is(monkeypatch: pytest.MonkeyPatch, capture: Path) -> Any:
    """Run as on the node `capture` describes: live discovery answers its facts."""
    facts = discovery.discover(capture)
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: facts, raising=False)
    return facts


def _torch_bumped(tmp_path: Path) -> Path:
    """The cpu-laptop capture with another torch: the same hardware, other software (another node's key)."""
    cap = tmp_path / "cap2"
    shutil.copytree(CAPTURES / "cpu-laptop", cap)
    pk = cap / "python" / "packages.json"
    pkgs = json.loads(pk.read_text())
    pkgs["torch"] = "2.12.0+cpu"
    pk.write_text(json.dumps(pkgs))
    return cap


def _fake_local(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The CLI's local backend replaced by a fake (no ranks launched); returns the options it was built with."""
    return F.fake_local_backend(monkeypatch, "local:gloo")


def _local_tune(tmp_path: Path, capture: Path) -> Any:
    return CliRunner().invoke(app, ["tune", "--backend", "local", "--capture", str(capture), "--model",
                                    "custom:256,128,8,2", "--tokens", "16", "--trials", "2", "--world", "2", "--comm",
                                    "gloo", "--family", "collective", "--db", str(tmp_path / "home" / "p.db"), "--json"],
                              env={"MOETUNE_HOME": str(tmp_path / "home")})


def test_a_local_tune_of_another_nodes_capture_is_refused_before_any_database(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    live = _live_is(monkeypatch, CAPTURES / "cpu-laptop")
    cap = _torch_bumped(tmp_path)
    other = discovery.discover(cap)
    seen = _fake_local(monkeypatch)
    r = _local_tune(tmp_path, cap)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    out = " ".join(r.output.split())  # Rich wraps the line
    # one line naming both identities and what differs
    assert other.fingerprint in out and live.fingerprint in out and "torch 2.13.0+cpu → 2.12.0+cpu" in out, out
    assert "--backend model" in out
    assert seen == [] and not (tmp_path / "home").exists()  # no backend built, no database created


def test_a_local_tune_of_this_nodes_capture_measures_and_stores_under_its_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.store.store import Store

    live = _live_is(monkeypatch, CAPTURES / "cpu-laptop")
    seen = _fake_local(monkeypatch)
    r = _local_tune(tmp_path, CAPTURES / "cpu-laptop")
    assert r.exit_code == 0, r.output
    assert seen
    with Store(tmp_path / "home" / "p.db", readonly=True) as st:
        recs = [rec for _i, rec in st.list_profiles()]
    assert recs and all(rec.key.fingerprint == live.fingerprint and rec.provenance == "measured" for rec in recs)


def test_a_failed_live_discovery_cannot_confirm_the_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(timeout_s: float = 1.5) -> Any:
        raise DiscoveryError("nvidia-smi -q -x", "unparsable")

    monkeypatch.setattr(discovery, "live_facts", fails)
    why = discovery.capture_not_this_node(discovery.discover(CAPTURES / "cpu-laptop"), CAPTURES / "cpu-laptop")
    assert "cannot be checked against this node" in why and "unparsable" in why


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every measurement a bring-up could start, recorded (and none run): microbenchmarks, tune/compare backends."""
    from moetune.tuner.bringup import flow
    from moetune.tuner.measure import micro

    ran: list[str] = []

    class Bench:
        transport, runner = "collective", "a2a"

        def run(self, sizes: Any, iters: int = 5) -> list:
            ran.append("microbench")
            return []

    monkeypatch.setattr(micro, "plan", lambda *a, **k: [(Bench(), True, "")])
    monkeypatch.setattr(flow.Bringup, "_backend", lambda self, world: ran.append(f"ep{world}") or object())
    monkeypatch.setattr(flow.Bringup, "_mk_backend", lambda self: ran.append("megakernel") or object())
    return ran


@pytest.mark.parametrize("capture", ["h200x1", "h200x2"])  # the megakernel alone; EP groups and the megakernel
def test_a_bring_up_of_another_nodes_capture_measures_and_stores_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capture: str) -> None:
    from moetune.tuner.bringup.flow import Bringup, Plan

    _live_is(monkeypatch, CAPTURES / "cpu-laptop")
    ran = _count_runs(monkeypatch)
    out = io.StringIO()
    store = F.open_store(tmp_path / "b.db")
    b = Bringup(store=store, plan=Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=5),
                state_dir=tmp_path / "state", console=Console(file=out, width=300), capture=CAPTURES / capture,
                storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=lambda k, w: {"graph_us": [1.0] * 3})
    done = b.run()
    assert ran == []
    assert store.list_profiles() == [] and store.list_measurements() == []
    assert not list((tmp_path / "state").glob("node-*.toml"))  # no node model
    assert not list((tmp_path / "state").glob("*bringup-*.json"))  # nothing a bring-up on that node would resume
    assert done["tune"] == [] and done["compare"] == [] and "skipped" in done["calibrate"]
    assert "microbenchmarks skipped" in out.getvalue() and "tuning skipped" in out.getvalue()
    report = Path(done["report"]).read_text()
    assert "nothing measured: the capture" in report and "describes another node" in report


def test_the_same_bring_up_on_that_node_measures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counterpart: live discovery is the capture's node, so the stages run (here into the recording fakes)."""
    from moetune.tuner.bringup.flow import Bringup, Plan

    _live_is(monkeypatch, CAPTURES / "h200x2")
    ran = _count_runs(monkeypatch)
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=Plan(models=["qwen3-30b"], tokens=[16], trials=2),
                state_dir=tmp_path / "state", console=Console(file=io.StringIO()), capture=CAPTURES / "h200x2")
    assert b.measures and not b.not_measured
    b.stage_microbench()
    assert ran == ["microbench"]


def test_profile_cli_of_another_nodes_capture_says_why_nothing_was_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dgx-h100 on a machine without its 8 CUDA GPUs: not refused for the GPUs it would need (nothing is launched);
    its plan and report, and the reason, with exit 0."""
    from moetune.tuner.store.store import Store

    live = _live_is(monkeypatch, CAPTURES / "cpu-laptop")
    _count_runs(monkeypatch)
    cap = CAPTURES / "dgx-h100"
    r = CliRunner().invoke(app, ["profile", "--quick", "--capture", str(cap), "--db", str(tmp_path / "p.db"), "--json"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    why = summary["not_measured"]
    assert why and discovery.discover(cap).fingerprint in why and live.fingerprint in why, why
    assert summary["profiles"] == [] and summary["ep_sizes"] == [8]  # the plan: what a bring-up there would tune
    # nothing was tuned, and not on this node: said so (it said "EP size tuned: 8 (every GPU of this node)")
    note = summary["ep_note"]
    assert note.startswith("no EP size tuned: the capture is of another node (8 × ") and "this node" not in note, note
    assert "would tune EP size 8" in note
    report = Path(summary["report"]).read_text()
    assert "EP size tuned: 8" not in report and note in report
    # nothing is written for another node's capture: no database made (an empty p.db was)
    assert summary["db"] is None and not (tmp_path / "p.db").exists()
    r = CliRunner().invoke(app, ["profile", "--quick", "--capture", str(cap), "--db", str(tmp_path / "p.db")],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0 and "EP size tuned: 8" not in r.output and "every GPU of this node" not in r.output, r.output
    assert "not opened (nothing is written for a capture of another node)" in " ".join(r.output.split())
    assert not (tmp_path / "p.db").exists()
    F = Store  # an existing database is left as it was (not opened)
    F(tmp_path / "p.db").close()
    before = (tmp_path / "p.db").read_bytes()
    r = CliRunner().invoke(app, ["profile", "--quick", "--capture", str(cap), "--db", str(tmp_path / "p.db"), "--json"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0 and (tmp_path / "p.db").read_bytes() == before, r.output


def test_a_daemon_serving_a_capture_of_another_node_does_not_measure_for_it(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --capture` with `[tune] backend = "local"`: the re-tune measured on this machine and stored the numbers
    under the capture's fingerprint and software. Refused before any key (the job fails saying why), megakernel
    keys included (a first fix checked only the EP keys' backend); a capture of this node still measures."""
    from types import SimpleNamespace

    from moetune.runtime.profile_record import ProfileKey
    from moetune.tuner.daemon import TuneSettings
    from moetune.tuner.daemon.jobs import JobContext
    from moetune.tuner.daemon.retune import RetuneImpossible, _capture_elsewhere, tuner_retune

    cpu = CAPTURES / "cpu-laptop"
    _live_is(monkeypatch, cpu)
    other = discovery.discover(_torch_bumped(tmp_path))
    mk = ProfileKey(fingerprint=other.fingerprint, software=other.software_hash, transport_family="megakernel",
                    ep_size=1, nodes=1, hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16",
                    token_bucket=16)
    ep = msgspec.structs.replace(mk, transport_family="collective", ep_size=2)
    for keys in ([mk], [ep], [mk, ep]):
        job = SimpleNamespace(id=1, keys=keys, cancel=None, refused=[])
        ctx = JobContext(store=None, facts=other, job=job, tune=TuneSettings(backend="local"))  # type: ignore[arg-type]
        with pytest.raises(RetuneImpossible, match=r"describes another node than this one.*torch"):
            tuner_retune(ctx)
    assert _capture_elsewhere(discovery.discover(cpu)) == ""  # this node's own capture measures
    assert _capture_elsewhere(discovery.live_facts()) == ""  # live discovery: no capture


def test_a_bring_up_of_another_nodes_capture_leaves_this_nodes_seen_fingerprint_and_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`profile --capture` of another node records no fingerprint (as seen in this node's database, `fabric diff`
    would report "GPU 0 missing ..." on an unchanged node), and its report goes to report-<its fingerprint>/ beside
    the database, not over this node's report/ (an explicit --report-dir is still used as given)."""
    live = _live_is(monkeypatch, CAPTURES / "cpu-laptop")
    _count_runs(monkeypatch)
    db = tmp_path / "p.db"
    runner = CliRunner()
    env = {"MOETUNE_HOME": str(tmp_path)}
    r = runner.invoke(app, ["fabric", "show", "--record", "--capture", str(CAPTURES / "cpu-laptop"), "--db", str(db)],
                      env=env)
    assert r.exit_code == 0, r.output
    mine = tmp_path / "report"
    mine.mkdir()
    (mine / "report.md").write_text("# moetune bring-up report\n\nthis node's\n")
    cap = CAPTURES / "dgx-h100"
    other = discovery.discover(cap).fingerprint
    r = runner.invoke(app, ["profile", "--quick", "--capture", str(cap), "--db", str(db), "--json"], env=env)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["report"] == str(tmp_path / f"report-{other}" / "report.md")
    assert (mine / "report.md").read_text().endswith("this node's\n")
    r = runner.invoke(app, ["fabric", "diff", "--capture", str(CAPTURES / "cpu-laptop"), "--db", str(db), "--json"],
                      env=env)
    assert r.exit_code == 0 and json.loads(r.stdout)["old"] == live.fingerprint, r.output
    mine2 = tmp_path / "mine"
    r = runner.invoke(app, ["profile", "--quick", "--capture", str(cap), "--db", str(db), "--report-dir", str(mine2),
                            "--json"], env=env)
    assert r.exit_code == 0 and json.loads(r.stdout)["report"] == str(mine2 / "report.md"), r.output


def test_a_report_of_another_nodes_capture_leaves_this_nodes_report(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`moetune report --capture` of another node leaves this node's report/ beside the database alone: it follows
    `profile`'s rule, report-<its fingerprint>/; a capture of this node still writes report/, and an explicit --out
    is used as given."""
    _live_is(monkeypatch, CAPTURES / "cpu-laptop")
    db = tmp_path / "p.db"
    F.open_store(db).close()
    mine = tmp_path / "report"
    mine.mkdir()
    (mine / "report.md").write_text("# moetune bring-up report\n\nthis node's\n")
    cap = CAPTURES / "dgx-h100"
    other = discovery.discover(cap).fingerprint
    env = {"MOETUNE_HOME": str(tmp_path), "COLUMNS": "400"}
    r = CliRunner().invoke(app, ["report", "--db", str(db), "--capture", str(cap)], env=env)
    assert r.exit_code == 0, r.output
    assert f"report: {tmp_path / f'report-{other}' / 'report.md'}" in r.output, r.output
    assert (mine / "report.md").read_text().endswith("this node's\n")
    assert other in (tmp_path / f"report-{other}" / "report.md").read_text()
    r = CliRunner().invoke(app, ["report", "--db", str(db), "--capture", str(CAPTURES / "cpu-laptop")], env=env)
    assert r.exit_code == 0 and f"report: {mine / 'report.md'}" in r.output, r.output
    assert not (mine / "report.md").read_text().endswith("this node's\n")
    out = tmp_path / "given"
    r = CliRunner().invoke(app, ["report", "--db", str(db), "--capture", str(cap), "--out", str(out)], env=env)
    assert r.exit_code == 0 and (out / "report.md").is_file(), r.output
