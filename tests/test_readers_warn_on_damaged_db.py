"""A damaged database (a page overwritten) was refused by every writer, yet `profiles list`, `report` and `query` read
it with exit 0 and said nothing (and `profiles export` refused or not, depending on which page): the one rule now is
that a reader reads on, as the store does, but says on stderr that the file failed SQLite's integrity check, naming
`moetune db check`; a sound file gets no warning. (The scan is SQLite's quick_check: ~1 ms a MB.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_writers_refuse_damaged_db import _damaged_table

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def dbs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(sound, damaged): the same profiles, the damaged copy's `events` table overwritten (no reader here reads it)."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MOETUNE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)  # report writes beside the working folder
    good = tmp_path / "good.db"
    with Store(good) as s:
        for i in range(40):
            key = ProfileKey(fingerprint="fp", software=f"sw-{i:03d}" + "v" * 80, transport_family="nvlink", ep_size=2,
                             nodes=1, hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16",
                             token_bucket=128)
            s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5,
                                        backend="model:x"))
            s.add_event(kind="routing", reason="x" * 300, details={"i": i})
    bad, _ = _damaged_table(good, "events")
    return good, bad


READS = {
    "profiles list": ["profiles", "list"],
    "profiles export": ["profiles", "export", "{tmp}/out-{name}.json"],
    "report": ["report", "--out", "{tmp}/rep-{name}"],
    "query": ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--socket", "ipc://{tmp}/none.sock",
              "--format", "json"],
}


@pytest.mark.parametrize("cmd", list(READS))
def test_a_read_of_a_damaged_database_warns_and_of_a_sound_one_does_not(dbs: tuple[Path, Path], tmp_path: Path,
                                                                      cmd: str) -> None:
    for db in dbs:
        args = [a.format(tmp=tmp_path, name=db.stem) for a in READS[cmd]]
        r = CliRunner().invoke(app, [*args, "--db", str(db)], env={"COLUMNS": "200"})
        assert r.exit_code == 0, (db, r.output)
        text = " ".join(r.stderr.split())
        if db.name == "good.db":
            assert "integrity check" not in text, text
        else:
            assert f"warning: {db} failed SQLite's integrity check" in text, text
            assert f"moetune db check --db {db}" in text and "Traceback" not in r.output, text
            assert "\n" not in r.stderr.strip()  # one line, not SQLite's multi-line answer
