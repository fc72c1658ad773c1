"""`moetune tune --json`: every row says what its numbers are (`provenance`, `modelled`), a row with nothing stored
too. Only the table's title said MODELLED: a script reading the JSON could not tell a prediction from a
measurement."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app

CAPTURES = Path(__file__).parent / "captures"
pytestmark = pytest.mark.timeout(180)


def test_model_rows_say_preset_and_modelled(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["tune", "--model", "qwen3-30b", "--tokens", "128,4096", "--backend", "model",
                                 "--preset", "nvlink-h200x2", "--trials", "1", "--db", str(tmp_path / "m.db"),
                                 "--storage", f"sqlite:///{tmp_path / 'st.db'}", "--json"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert rows and all((row["provenance"], row["modelled"]) == ("preset", True) for row in rows), rows


def _local(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fail: bool) -> list[dict]:
    import moetune.tuner.search.tune as search

    def run(k, w):  # type: ignore[no-untyped-def]
        if fail:
            raise RuntimeError("process group init failed: no CUDA device")
        return 10.0 + k.pipeline_depth

    monkeypatch.setattr(search, "make_backend", lambda *a, **k: F.measuring_fake(run, name="local:fake"))
    r = CliRunner().invoke(app, ["tune", "-m", "qwen3-30b", "--backend", "local", "--from",
                                 str(CAPTURES / "cpu-laptop"), "--trials", "2", "--tokens", "128", "--db",
                                 str(tmp_path / "m.db"), "--json"], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == (1 if fail else 0), r.output
    return json.loads(r.stdout)


@pytest.mark.usefixtures("on_captured_node")  # a local tune of a capture measures only on its node
def test_measured_rows_say_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _local(monkeypatch, tmp_path, fail=False)
    assert rows and all(row["written"] for row in rows)
    assert all((row["provenance"], row["modelled"]) == ("measured", False) for row in rows), rows


@pytest.mark.usefixtures("on_captured_node")
def test_a_row_with_nothing_stored_still_says_what_the_backend_measures(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _local(monkeypatch, tmp_path, fail=True)
    assert rows and all(row["backend"] is None and row["stored"] == "none" for row in rows)
    assert all((row["provenance"], row["modelled"]) == ("measured", False) for row in rows), rows
