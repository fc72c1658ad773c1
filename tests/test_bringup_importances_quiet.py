"""The bring-up's report stage computes each study's parameter importances (`Bringup._importances`). Optuna's
evaluator warns (a UserWarning printed with its own file and source line) where a conditional knob, e.g.
`channels_of_1_2`, which the collective search asks only at some pipeline depths, was asked in fewer than 2 trials:
`moetune profile --quick` on a CPU node printed

    .../optuna/importance/_ped_anova/evaluator.py:353: UserWarning: Some regimes for parameter `channels_of_1_2` ...
      optuna_warn(

in the middle of its output on every run (stderr of --json too). `tune show` already computes them quietly."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import optuna
from optuna.distributions import CategoricalDistribution as C

optuna.logging.set_verbosity(optuna.logging.ERROR)


def _study(url: str, name: str) -> None:
    s = optuna.create_study(study_name=name, storage=url)
    depth = {"pipeline_depth": C([1, 2, 4])}
    for params, dist, v in [({"pipeline_depth": 1}, depth, 5.0),
                            ({"pipeline_depth": 2, "channels_of_1_2": 2}, {**depth, "channels_of_1_2": C([1, 2])}, 4.0),
                            ({"pipeline_depth": 4}, depth, 3.0),
                            ({"pipeline_depth": 1}, depth, 6.0)]:
        s.add_trial(optuna.trial.create_trial(params=params, distributions=dist, value=v))


def test_importances_print_no_optuna_warning(tmp_path: Path) -> None:
    from moetune.tuner.bringup.flow import Bringup

    url = f"sqlite:///{tmp_path / 'opt.db'}"
    name = "moetune/collective/qwen3-30b/S128/ep2n1/local:gloo:comm/abc"
    _study(url, name)
    me = SimpleNamespace(measures=True, storage=url, store=SimpleNamespace(path=str(tmp_path / "p.db")),
                         state=SimpleNamespace(result=lambda stage: [{"study": name}]),
                         facts=SimpleNamespace(fingerprint="f" * 64), console=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = Bringup._importances(me)  # type: ignore[arg-type]
    assert [str(w.message) for w in seen] == []
    (imp,) = out.values()  # still computed
    assert set(imp) == {"pipeline_depth", "channels_of_1_2"}
