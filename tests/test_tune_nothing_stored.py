"""A local tune whose winner fails when measured again ("the winner failed when measured again: timed out after
120 s") stores nothing. Its stored column says "none" where the key has no profile (not "kept"; "kept" where an
earlier one stands), and a tune that left no key with a profile exits 1 with "nothing stored" and the reasons, not 0
with an empty profile database."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, nearest_bucket
from moetune.runtime.shapes import get_model
from moetune.tuner.cli import app
from moetune.tuner.fabric.discovery import discover
from moetune.tuner.search.backends import Measurement
from moetune.tuner.search.local_backend import LocalBackend
from moetune.tuner.store.store import Store

# local tunes of the cpu-laptop capture (timings injected): run as on that node, whatever machine runs the suite (a
# local tune of another node's capture is refused; on a CPU node of this image it is this node anyway)
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).parent / "captures"
TIMED_OUT = "timed out after 120 s (process group killed)"


class RemeasureFails(LocalBackend):
    """Every trial succeeds; the side-by-side re-measurement of the winner times out (no ranks launched)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(command=["true"], comm_backend="gloo", repeats=1, world=kw.get("world", 2))

    def evaluate(self, knobs: Knobs, workload: Any, *, report: Any = None) -> Measurement:
        return Measurement(100.0 + knobs.pipeline_depth, 1.0, [100.0], True)

    def compare(self, candidates: Any, workload: Any, *, rounds: int = 3) -> list[Measurement]:
        return [Measurement.failed(TIMED_OUT) for _ in candidates]


@pytest.fixture(autouse=True)
def _fake_local(monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.tuner.search.tune as search

    monkeypatch.setattr(search, "make_backend", lambda backend, preset=None, **kw: RemeasureFails(**kw))


def _tune(tmp_path: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, ["tune", "-m", "qwen3-30b", "--backend", "local", "--world", "2", "--family",
                                    "collective", "--from", str(CAPTURES / "cpu-laptop"), "--trials", "2", "--tokens",
                                    "128", "--repeats", "1", "--db", str(tmp_path / "m.db"), *extra],
                              env={"MOETUNE_HOME": str(tmp_path), "COLUMNS": "200"})


def test_no_profile_before_and_none_stored_says_none_and_exits_1(tmp_path: Path) -> None:
    r = _tune(tmp_path)
    assert r.exit_code == 1, r.output
    row = next(line for line in r.stdout.splitlines() if line.lstrip().startswith("collective"))
    assert row.split()[-1] == "none", row  # not "kept"
    assert "nothing stored" in r.stderr and TIMED_OUT in r.stderr, r.stderr
    assert "Traceback" not in r.output
    with Store(tmp_path / "m.db") as store:
        assert store.list_profiles() == []


def test_json_says_none_and_exits_1(tmp_path: Path) -> None:
    r = _tune(tmp_path, "--json")
    assert r.exit_code == 1, r.output
    (row,) = json.loads(r.stdout)
    assert row["stored"] == "none" and not row["written"] and TIMED_OUT in row["reason"]
    assert "nothing stored" in r.stderr


def test_an_earlier_profile_is_kept_and_the_exit_is_0(tmp_path: Path) -> None:
    r = _tune(tmp_path, "--json")  # learn the key the tune uses
    key = json.loads(r.stdout)[0]
    facts = discover(CAPTURES / "cpu-laptop")
    m = get_model("qwen3-30b")
    pk = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="collective",
                    ep_size=2, nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts, topk=m.topk,
                    dtype=m.dtype, token_bucket=nearest_bucket(key["tokens"]))
    with Store(tmp_path / "m.db") as store:
        ok, why = store.put_profile(ProfileRecord(
            key=pk, knobs=Knobs(transport="collective"), latency_us=500.0, spread_us=1.0, backend="local:gloo",
            status="current", software_versions={}, created="2026-01-01T00:00:00Z", updated="2026-01-01T00:00:00Z",
            provenance="measured", measured_on=facts.fingerprint, routing="uniform"))
        assert ok, why
    r = _tune(tmp_path, "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)
    assert row["stored"] == "kept" and TIMED_OUT in row["reason"]
    assert "nothing stored" not in r.stderr
    r = _tune(tmp_path)
    assert r.exit_code == 0, r.output
    row_line = next(line for line in r.stdout.splitlines() if line.lstrip().startswith("collective"))
    assert row_line.split()[-1] == "kept"
    # a local tune's table shows no default / best ratio: the best is the side-by-side check's number, the default a
    # search trial measured alone (the "×" column divided the two)
    assert "×" not in r.stdout and "best µs: as stored (measured side by side)" in " ".join(r.stdout.split())
