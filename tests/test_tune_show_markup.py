"""`moetune tune show -s NAME`: the study's name and backend label are stored text (a preset's `name` from its TOML
file is in both, `model:NAME`), shown as written: the one-study header read them as Rich markup ("[/]" ended the
command in a MarkupError traceback, "[bold]" vanished), where the study list escapes them."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.search import storage as storage_mod

runner = CliRunner()


def test_tune_show_study_header_shows_brackets_as_text(tmp_path: Path) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    storage = storage_mod.make_storage(url)
    name = "moetune/nvlink/qwen3-30b/S64/ep8n1/model:lab[bold]x[/]/abc"
    study = optuna.create_study(study_name=name, storage=storage)
    study.set_user_attr("backend", "model:lab[bold]x[/]")
    study.set_user_attr("modelled", True)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    storage.engine.dispose()
    r = runner.invoke(app, ["tune", "show", "--storage", url, "-s", name])
    assert r.exit_code == 0, (r.output, r.exception)
    shown = " ".join(r.output.split())  # Rich wraps at 80 columns
    assert name in shown
    assert "backend model:lab[bold]x[/] (modelled)" in shown
