"""The `tuning_runs` history of a study run again: a study that finished, tuned again with the same settings (`moetune
tune` or `moetune profile` run a second time), runs no trial; it recorded a second `done` row of the same work. The
first row stands for it: nothing new is recorded, unless the run adds trials or ends otherwise (failed, interrupted).
A row's `trials` are the trials that run finished: not the study's, which a resumed study's earlier runs and the other
workers of a shared one ran too (the rows of a study summed counted them again).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.runtime.shapes import get_model
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(180)


def _tune(store: Store, tmp_path: Path, trials: int, **kw: Any) -> Any:
    from moetune.tuner.search.tune import tune_profiles_detailed

    return tune_profiles_detailed(store, None, models=[get_model("qwen3-30b")], tokens=[128], backend="model",
                                  preset="nvlink-h200x2", trials=trials, storage=f"sqlite:///{tmp_path / 'st.db'}",
                                  families=["nvlink"], **kw)


def test_a_finished_study_tuned_again_records_no_second_done_row(tmp_path: Path) -> None:
    with Store(tmp_path / "m.db") as s:
        _tune(s, tmp_path, 4)
        [first] = s.list_runs()
        assert (first["status"], first["trials"]) == ("done", 4)
        again = _tune(s, tmp_path, 4)
        assert again[0].study.trials == 4 and again[0].record is not None  # the result is given as before
        assert [dict(r) for r in s.list_runs()] == [dict(first)]  # the first row, as it was
        _tune(s, tmp_path, 6)  # more trials asked: the study runs again, a run of its own (2 trials: 6 in the study)
        runs = s.list_runs()
        assert [(r["status"], r["trials"]) for r in runs] == [("done", 2), ("done", 4)]


def test_a_finished_study_whose_rerun_fails_records_the_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.search import tune

    with Store(tmp_path / "m.db") as s:
        _tune(s, tmp_path, 3)

        def broken(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("disk gone")

        monkeypatch.setattr(tune, "_write_profile", broken)
        with pytest.raises(RuntimeError, match="disk gone"):
            _tune(s, tmp_path, 3)
        runs = s.list_runs()
        assert [(r["status"], r["trials"]) for r in runs] == [("failed", 0), ("done", 3)]  # the rerun ran none
        assert runs[0]["started"] <= runs[0]["ended"]


def test_tune_run_twice_keeps_one_done_row(tmp_path: Path) -> None:
    from moetune.tuner.cli import app

    db = tmp_path / "m.db"
    args = ["tune", "--model", "qwen3-30b", "--tokens", "128", "--backend", "model", "--preset", "nvlink-h200x2",
            "--trials", "3", "--db", str(db), "--json"]
    for _ in range(2):
        r = CliRunner().invoke(app, args, env={"MOETUNE_HOME": str(tmp_path)})
        assert r.exit_code == 0, r.output
    with Store(db) as s:
        assert [(r["status"], r["trials"]) for r in s.list_runs()] == [("done", 3)]


def test_a_finished_study_whose_rerun_writes_a_profile_records_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # a repeat still runs the profile's write: one that replaced the current profile was hidden from the history
    from moetune.tuner.search import tune

    with Store(tmp_path / "m.db") as s:
        _tune(s, tmp_path, 3)
        real = tune._write_profile

        def wrote(*a: Any, **k: Any) -> Any:
            rec, _written, _why = real(*a, **k)
            return rec, True, "replaced the current profile"

        monkeypatch.setattr(tune, "_write_profile", wrote)
        _tune(s, tmp_path, 3)
        assert [(r["status"], r["trials"]) for r in s.list_runs()] == [("done", 0), ("done", 3)]


def test_a_finished_study_whose_rerun_remeasures_records_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a backend that re-measures (the local one: the side-by-side check, minutes on GPUs) measured on the repeat
    # even where the incumbent held its own and nothing was reported written
    from moetune.tuner.search import model_backend, tune

    with Store(tmp_path / "m.db") as s:
        _tune(s, tmp_path, 3)
        calls: list[int] = []

        def held(*_a: Any, **_k: Any) -> Any:
            calls.append(1)
            return None, False, "the incumbent held its own"

        monkeypatch.setattr(model_backend.ModelBackend, "remeasures", True)
        monkeypatch.setattr(tune, "_write_profile", held)
        _tune(s, tmp_path, 3)
        assert calls == [1]
        assert [(r["status"], r["trials"]) for r in s.list_runs()] == [("done", 0), ("done", 3)]


def test_a_shared_studys_run_counts_its_own_trials_only(tmp_path: Path) -> None:
    """Another worker of the study (another node on a shared storage) finishes a trial while this run goes on: the
    study reaches its budget with it, and this run's row counts the trials this run finished, not that one."""
    import optuna

    added: list[int] = []

    def other_worker(name: str, study: Any, _t: Any) -> None:
        if not added:  # once, after this run's first trial: a trial this process never asked for
            other = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'st.db'}")
            t = study.trials[0]
            other.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions,
                                                      value=t.value, user_attrs={"worker": "elsewhere:1:x"}))
            added.append(1)

    with Store(tmp_path / "m.db") as s:
        [res] = _tune(s, tmp_path, 4, on_trial=other_worker)
        assert added and res.study.trials == 4  # the study's: the other worker's trial counts toward the budget
        assert [(r["status"], r["trials"]) for r in s.list_runs()] == [("done", 3)]
