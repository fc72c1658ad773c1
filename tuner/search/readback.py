"""Reading studies back (`moetune tune show`): list them, describe one, what the store holds for its key."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import optuna
from optuna.trial import TrialState

from moetune.runtime.profile_record import ProfileKey
from moetune.tuner.search.storage import open_readonly_storage
from moetune.tuner.search.study import STUDY_PREFIX, WARM_LOCK_SUFFIX
from moetune.tuner.search.trials import (
    completed,
    finished_in,
    finished_trials,
    interrupted_ids,
    is_interrupted,
)
from moetune.tuner.search.workers import exception_chain

T = TypeVar("T")


def changed_while_read(e: BaseException) -> bool:
    """Whether a read failed because a writer changed the SQLite file under it (`sqlite_open.DatabaseChanged`, also
    where Optuna wrapped it: StorageInternalError "...invalid data in the commit...")."""
    from moetune.runtime.profiles import sqlite_open

    return any(isinstance(x, sqlite_open.DatabaseChanged) for x in exception_chain(e))


def _read_again(fn: Callable[[], T]) -> T:
    """fn() run again (a fresh read-only storage each time) while the file changed under it, as `sqlite_open.read`
    does: up to sqlite_open.READ_ATTEMPTS times, then its error."""
    from moetune.runtime.profiles import sqlite_open

    return sqlite_open.retry_changed(fn, changed_while_read)


def list_studies(storage: str) -> list[dict[str, Any]]:
    """Every moetune study in the storage (read only; read again while a writer changed the file under the read)."""
    return _read_again(lambda: _list_studies(storage))


def _list_studies(storage: str) -> list[dict[str, Any]]:
    st = open_readonly_storage(storage)
    out = []
    for s in optuna.get_all_study_summaries(st, include_best_trial=True):
        if not s.study_name.startswith(STUDY_PREFIX) or s.study_name.endswith(WARM_LOCK_SUFFIX):
            continue
        best = s.best_trial
        # the trials the tune counts (finished, not cut short): n_trials also counted the warm-start points still
        # WAITING and the interrupted ones (`tune --trials 1` said 1 trial, `tune show` 3)
        out.append({"study": s.study_name, "trials": finished_in(st, s._study_id),
                    "best_us": best.value if best is not None else None,
                    "family": s.user_attrs.get("family"), "backend": s.user_attrs.get("backend"),
                    "modelled": s.user_attrs.get("modelled")})
    return out


class NotAMoetuneStudy(ValueError):
    """A study `describe_study` will not describe: not moetune's (another program's values are not latencies)."""


# What the study's numbers are: each trial ran alone, at its own time, so two of them differ by the noise between runs
# too; a ratio of them is no measured speed-up (the side-by-side check decides what is stored).
SEARCH_TRIALS_NOTE = ("search trials, each measured alone (not side by side): their difference includes the noise "
                      "between runs, so no speed-up is read from them")
# A model study's trials were never measured: each is the fabric model's (deterministic) prediction.
MODELLED_TRIALS_NOTE = ("search trials, each a MODELLED prediction of the fabric model (not measured): their "
                        "difference is the model's, so no measured speed-up is read from them")


def describe_study(storage: str, name: str, store: Any = None) -> dict[str, Any]:
    """One moetune study's summary (KeyError: no such study; NotAMoetuneStudy: a study without moetune's prefix);
    read again while a writer changed the file under the read. `store` (a profile Store, or None): what it holds for
    the study's key is added as `stored` (None: nothing), the number a speed-up is read from where one was stored."""
    d = _read_again(lambda: _describe_study(storage, name))
    if store is not None:
        d["stored"] = stored_for_key(store, d.get("key"), d.get("best_knobs"))
    return d


def stored_for_key(store: Any, key: dict[str, Any] | None, best_knobs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The current profile `store` holds for a study's `key` (a dict): its knobs, number, source and provenance (its
    effective one, as the runtime takes it), and whether its knobs are the study's best; None when it holds none (or the study recorded no key)."""
    if not key:
        return None
    rec = store.get_current(ProfileKey(**key))
    if rec is None:
        return None
    return {"knobs": rec.knobs.to_dict(), "latency_us": rec.latency_us, "spread_us": rec.spread_us,
            # what the numbers are, as list/show/query and the runtime take them (a hand-edited "measured" label on a
            # modelling backend is modelled)
            "backend": rec.backend, "provenance": str(rec.effective_provenance), "updated": rec.updated,
            "is_study_best": best_knobs is not None and rec.knobs.to_dict() == dict(best_knobs)}


def _describe_study(storage: str, name: str) -> dict[str, Any]:
    st = open_readonly_storage(storage)
    study = optuna.load_study(study_name=name, storage=st)
    if not name.startswith(STUDY_PREFIX):
        raise NotAMoetuneStudy(f"study {name!r} is not a moetune study (its name does not start with "
                               f"{STUDY_PREFIX!r}): its objective values are not moetune's latencies, so `tune show` "
                               "does not describe it; read it with Optuna (or optuna-dashboard)")
    trials = study.get_trials(deepcopy=False)
    states = {s.name.lower(): sum(1 for t in trials if t.state == s) for s in TrialState}
    cut = interrupted_ids(study)
    done = completed(study)
    best = min(done, key=lambda t: t.value) if done else None  # type: ignore[arg-type, return-value]
    default = next((t for t in done if t.user_attrs.get("warm_start") == "policy_default"), None)
    importances: dict[str, float] = {}
    importance_note = ""
    try:
        if len(done) >= 2:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importances = {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
        else:
            importance_note = "needs at least 2 complete trials"
    except Exception as e:  # broad: importances are a nicety of the summary, never its failure
        importance_note = f"unavailable: {e}"
    return {
        "study": name,
        "family": study.user_attrs.get("family"),
        "backend": study.user_attrs.get("backend"),
        "modelled": study.user_attrs.get("modelled"),
        "workload": study.user_attrs.get("workload"),
        "key": study.user_attrs.get("key"),
        "trials": finished_trials(study),  # as the tune counts them (`states` has every trial, waiting too)
        "states": states,
        # of the `fail` ones, those cut short (Ctrl-C, a process that died): no failed measurement, not counted
        "interrupted": sum(1 for t in trials if is_interrupted(t, cut)),
        "best_us": best.value if best else None,
        "best_spread_us": best.user_attrs.get("spread_us") if best else None,
        "best_knobs": best.user_attrs.get("knobs") if best else None,
        "best_trial": best.number if best else None,
        "default_us": default.value if default else None,
        # no ratio of best_us and default_us: separate trials (SEARCH_TRIALS_NOTE) or predictions, never a measured speed-up
        "trials_note": MODELLED_TRIALS_NOTE if study.user_attrs.get("modelled") else SEARCH_TRIALS_NOTE,
        "importances": importances,
        "importance_note": importance_note,
        # an interrupted trial (SIGTERM, Ctrl-C) has no `error` of its own: "interrupted", never null (shown "None")
        "failed": [{"trial": t.number, "interrupted": is_interrupted(t, cut),
                    "error": str(t.user_attrs.get("error") or ("interrupted" if is_interrupted(t, cut) else
                                                                "no reason recorded"))}
                   for t in trials if t.state == TrialState.FAIL][:20],
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
