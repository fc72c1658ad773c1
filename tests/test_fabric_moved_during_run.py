"""`moetune tune --backend local` and `moetune profile` discovered the fabric once, at their start: a fabric change
during a run of hours stored numbers measured on the changed fabric under the old fingerprint, labelled measured.
Now the node is discovered again before each store write (the daemon's rule: another fingerprint, or other GPUs,
is a change; a failed or incomplete discovery is none) and on a change nothing more is stored under the old
fingerprint: one clear message, exit 1."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from rich.console import Console
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs
from moetune.tuner.cli import app
from moetune.tuner.fabric import discovery
from moetune.tuner.fabric.errors import DiscoveryError
from moetune.tuner.fabric.moved import FabricMovedOn
from moetune.tuner.search.backends import TuneWorkload

pytestmark = pytest.mark.timeout(240)
optuna.logging.set_verbosity(optuna.logging.ERROR)
CAPTURES = Path(__file__).resolve().parent / "captures"


def _torch_bumped(tmp_path: Path, name: str = "cpu-laptop") -> Path:
    """The capture with another torch: the same hardware, another fingerprint (a package upgraded meanwhile)."""
    cap = tmp_path / f"{name}-bumped"
    shutil.copytree(CAPTURES / name, cap)
    pk = cap / "python" / "packages.json"
    pkgs = json.loads(pk.read_text())
    pkgs["torch"] = "2.12.0+cpu"
    pk.write_text(json.dumps(pkgs))
    return cap


class Node:
    """Live discovery answers `before` until `move()`, then `after` (facts, or an exception to raise)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, before: Any, after: Any) -> None:
        self.before, self.after, self.moved, self.asked = before, after, False, 0
        monkeypatch.setattr(discovery, "live_facts", self)

    def move(self) -> None:
        self.moved = True

    def __call__(self, timeout_s: float = 1.5) -> Any:
        self.asked += 1
        if not self.moved:
            return self.before
        if isinstance(self.after, BaseException):
            raise self.after
        return self.after


# -- moetune tune --backend local ------------------------------------------------------------------------------------
def _fake_backend_moving(monkeypatch: pytest.MonkeyPatch, node: Node, after_trials: int) -> None:
    """The CLI's local backend replaced by a fake (no ranks launched) whose trial `after_trials` + 1 runs on the
    changed fabric: the node moves then."""
    import moetune.tuner.search.tune as search
    n = [0]

    def measure(k: Knobs, w: TuneWorkload) -> float:
        n[0] += 1
        if n[0] > after_trials:
            node.move()
        return 10.0 + k.pipeline_depth

    monkeypatch.setattr(search, "make_backend",
                        lambda backend, preset=None, **kw: F.measuring_fake(measure, name="local:gloo"))


def _tune(tmp_path: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, ["tune", "--backend", "local", "--capture", str(CAPTURES / "cpu-laptop"), "--model",
                                    "custom:256,128,8,2", "--tokens", "16,128", "--trials", "2", "--world", "2",
                                    "--comm", "gloo", "--family", "collective", "--db", str(tmp_path / "p.db"), *extra],
                              env={"MOETUNE_HOME": str(tmp_path), "COLUMNS": "200"})


def test_tune_stores_nothing_under_the_old_fingerprint_once_the_fabric_changed(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    before = discovery.discover(CAPTURES / "cpu-laptop")
    after = discovery.discover(_torch_bumped(tmp_path))
    assert after.fingerprint != before.fingerprint
    node = Node(monkeypatch, before, after)
    _fake_backend_moving(monkeypatch, node, after_trials=2)  # the first bucket's study measured before the change
    r = _tune(tmp_path)
    text = " ".join(r.output.split())
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit), repr(r.exception)
    assert f"the fabric changed during this run: it started on fingerprint {before.fingerprint}" in text, text
    assert f"this node is now {after.fingerprint}" in text and "torch" in text, text
    assert f"is not stored under {before.fingerprint}" in text and "Run the tune again" in text, text
    store = F.open_store(tmp_path / "p.db")
    # the bucket measured before the change is stored; the one measured after it is not, under any fingerprint
    assert [(rec.key.fingerprint, rec.key.token_bucket) for _, rec in store.list_profiles()] == [(before.fingerprint, 16)]


@pytest.mark.parametrize("after", ["failed", "incomplete", "same"])
def test_tune_stores_when_discovery_cannot_tell_or_nothing_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   after: str) -> None:
    before = discovery.discover(CAPTURES / "cpu-laptop")
    if after == "failed":
        then: Any = DiscoveryError("nvidia-smi", "timed out")
    elif after == "incomplete":
        then = discovery.discover(_torch_bumped(tmp_path))
        then.warnings = ["nvidia-smi timed out"]  # facts not read whole: no evidence of a change
    else:
        then = discovery.discover(CAPTURES / "cpu-laptop")
    node = Node(monkeypatch, before, then)
    _fake_backend_moving(monkeypatch, node, after_trials=0)
    r = _tune(tmp_path, "--json")
    assert r.exit_code == 0, r.output
    assert node.asked >= 2  # checked before each of the two profiles
    store = F.open_store(tmp_path / "p.db")
    assert sorted(rec.key.token_bucket for _, rec in store.list_profiles()) == [16, 128]


def test_a_model_tune_is_not_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prediction is of the facts it was given: stored under their fingerprint, nothing discovered again."""
    node = Node(monkeypatch, None, None)
    r = CliRunner().invoke(app, ["tune", "--backend", "model", "--preset", "nvlink-h200x2", "--model", "qwen3-30b",
                                 "--tokens", "16", "--trials", "2", "--db", str(tmp_path / "p.db"), "--json"],
                           env={"MOETUNE_HOME": str(tmp_path), "COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert node.asked == 0


# -- moetune profile (the bring-up) ----------------------------------------------------------------------------------
def flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    return {"graph_us": [300.0, 303.0, 297.0], "eager_us": [301.0] * 3}


def _bringup(tmp_path: Path, capture: Path) -> Any:
    from moetune.tuner.bringup.flow import Bringup, Plan

    plan = Plan(models=["qwen3-30b"], tokens=[16], trials=4, repeats=1, iters=5, compare_rounds=2)
    return Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                   console=Console(file=io.StringIO(), width=200), capture=capture,
                   storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=flat)


@pytest.mark.parametrize("moves_in", ["tune", "compare"])
def test_the_bringup_stores_nothing_under_the_old_fingerprint_once_the_fabric_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moves_in: str) -> None:
    from moetune.tuner.bringup import flow

    capture = CAPTURES / "h200x1"  # one GPU: the megakernel family, its timing injected
    before = discovery.discover(capture)
    after = discovery.discover(_torch_bumped(tmp_path, "h200x1"))
    assert after.fingerprint != before.fingerprint
    node = Node(monkeypatch, before, after)  # as on the captured node until it moves
    real = getattr(flow.Bringup, f"stage_{moves_in}")

    def stage(self: Any) -> Any:
        node.move()  # during the stage's measurements
        return real(self)

    monkeypatch.setattr(flow.Bringup, f"stage_{moves_in}", stage)
    b = _bringup(tmp_path, capture)
    assert b.measures
    with pytest.raises(FabricMovedOn, match=f"it started on fingerprint {before.fingerprint}") as e:
        b.run()
    assert "Run `moetune profile` again" in str(e.value)
    assert b.store.list_profiles() == []  # nothing stored under the old fingerprint (nor any other)
    assert not b.state.done(moves_in) and not b.state.done("compare")  # not kept as this fingerprint's results
    assert b.state.done("microbench")  # measured before the change: kept
