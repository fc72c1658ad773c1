"""`moetune tune --backend model --preset nvlink-h200x2 --family collective ...` was refused (exit 2) by the search
after the CLI had made the profile database, the studies file and its lock: the refusal is now asked of the search
(`check_tune`, the same rule) before any file is made. Its message listed a Python list ("transport families
['collective'] were not found"): it names the families in words, and who asked for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(120)

TUNE = ["tune", "--backend", "model", "--preset", "nvlink-h200x2", "--model", "qwen3-30b", "--tokens", "128",
        "--trials", "2"]


def run(tmp_path: Path, *args: str):
    return CliRunner().invoke(app, list(args), env={"MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "",
                                                    "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "COLUMNS": "200"})


@pytest.mark.parametrize("families,said", [
    (["collective"], "transport family collective was not found on this fabric (--family; found: nvlink)"),
    (["collective", "proxy:ibrc"],
     "transport families collective, proxy:ibrc were not found on this fabric (--family; found: nvlink)"),
])
def test_a_family_not_on_the_fabric_is_refused_before_any_file_is_made(tmp_path: Path, families: list[str],
                                                                       said: str) -> None:
    d = tmp_path / "dbt"
    d.mkdir()
    r = run(tmp_path, *TUNE, *[a for f in families for a in ("--family", f)], "--db", str(d / "fam.db"))
    assert r.exit_code == 2, r.output
    assert said in " ".join(r.stderr.split()) and "[" not in r.stderr and "Traceback" not in r.output, r.stderr
    assert list(d.iterdir()) == []  # no fam.db, fam-studies.db nor its .lock
    assert not (tmp_path / "home").exists()


def test_an_existing_database_is_left_as_it_was(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    assert run(tmp_path, *TUNE, "--db", str(db)).exit_code == 0
    import gc

    # the first tune's studies storage engine is finalised when collected, and its WAL checkpoint rewrites the files:
    # collected here, before the snapshot, not at a random point between it and the second run (order-dependent)
    gc.collect()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    r = run(tmp_path, *TUNE, "--family", "collective", "--db", str(db))
    assert r.exit_code == 2, r.output
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_tune_the_check_passes_still_runs(tmp_path: Path) -> None:
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.tune import check_tune

    check_tune(None, models=[MODELS["qwen3-30b"]], backend="model", preset="nvlink-h200x2")  # no error
    with pytest.raises(ValueError, match="transport family collective was not found"):
        check_tune(None, models=[MODELS["qwen3-30b"]], backend="model", preset="nvlink-h200x2",
                   families=["collective"])
    r = run(tmp_path, *TUNE, "--family", "nvlink", "--db", str(tmp_path / "m.db"))
    assert r.exit_code == 0, r.output
