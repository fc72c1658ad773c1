"""What a study's trials count as: finished, complete or cut short (a cut-short one's point runs again)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import optuna
from optuna.trial import TrialState

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
INTERRUPTED = "interrupted"  # user attr of a FAIL trial whose run was cut short: not a finished trial


def requeue_warm_start(study: optuna.Study, trial_id: int) -> bool:
    """Enqueue again the warm-start point an interrupted trial carried (`skip_if_exists` would find the
    failed trial and skip it: the policy default would never be measured)."""
    t = study._storage.get_trial(trial_id)
    fixed = t.system_attrs.get("fixed_params")
    if "warm_start" not in t.user_attrs or not fixed:
        return False
    study.enqueue_trial(dict(fixed), user_attrs={"warm_start": t.user_attrs["warm_start"]})
    return True


def interrupted_ids(study: optuna.Study) -> set[int]:
    """Trial ids the study records as cut short (those failed by the heartbeat check)."""
    return _interrupted_ids(study._storage, study._study_id)


def _interrupted_ids(storage: optuna.storages.BaseStorage, study_id: int) -> set[int]:
    return {int(k.split(":", 1)[1]) for k in storage.get_study_system_attrs(study_id)
            if k.startswith(INTERRUPTED + ":")}


def is_interrupted(t: optuna.trial.FrozenTrial, ids: set[int] | frozenset[int] = frozenset()) -> bool:
    """A FAIL trial cut short, not a failed measurement: tagged `interrupted`, recorded in the study (`ids`), or
    failed with no `error`. The objective writes a failed measurement's `error` before it returns (before Optuna's
    FAIL); its interrupt handler's tag can be missed (a second Ctrl-C before it is written, an error raised out of the
    objective), and Optuna then fails the trial with neither: such a trial measured nothing."""
    return t.state == TrialState.FAIL and (INTERRUPTED in t.user_attrs or t._trial_id in ids
                                           or "error" not in t.user_attrs)


def finished_trials(study: optuna.Study) -> int:
    """Finished trials of the budget: an interrupted one is not (its point was never measured)."""
    return finished_in(study._storage, study._study_id)


def finished_in(storage: optuna.storages.BaseStorage, study_id: int) -> int:
    return len(finished_ids(storage, study_id))


def finished_ids(storage: optuna.storages.BaseStorage, study_id: int) -> set[int]:
    """The ids of the study's finished trials (as `finished_trials` counts them)."""
    ids = _interrupted_ids(storage, study_id)
    return {t._trial_id for t in storage.get_all_trials(study_id, deepcopy=False, states=FINISHED)
            if not is_interrupted(t, ids)}


def failed_before(study: optuna.Study) -> int:
    """The finished trials that do not count toward a run's budget: all of them while the study holds no COMPLETE
    trial (every trial failed: timed out, a bad interface), so a rerun tries the study again with its whole budget
    instead of taking it as finished; 0 once a trial completed (a resumed search counts what it ran)."""
    return 0 if completed(study) else finished_trials(study)


def first_error(trials: Sequence[optuna.trial.FrozenTrial], cut: set[int]) -> str:
    """The error of the first failed trial (what a user needs to fix), or "" where none is recorded. A trial cut short
    (its process died, Ctrl-C: its id in `cut`) says nothing of the setting: a real failure's error comes first.
    Where no trial failed, the first infeasible (pruned) trial's reason: a study whose every setting the backend
    refused (nvlink beyond 8 ranks) said only 'no successful trial'."""
    failed = [t for t in trials if t.state == TrialState.FAIL and t.user_attrs.get("error")]
    first = next((t for t in failed if not is_interrupted(t, cut)), failed[0] if failed else None)
    if first is not None:
        return str(first.user_attrs["error"])
    refused = next((t for t in trials if t.state == TrialState.PRUNED and t.user_attrs.get("infeasible")), None)
    return f"infeasible: {refused.user_attrs['infeasible']}" if refused is not None else ""


def completed(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None and math.isfinite(t.value)]
