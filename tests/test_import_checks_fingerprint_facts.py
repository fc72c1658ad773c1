"""`profiles import` stored a fingerprint's facts unchecked: facts that do not decode as FabricFacts (`gpus: "string"`,
a GPU without its index, `nics: "x"`) were stored, and `fabric diff` then ended in a KeyError traceback. An import now
decodes every non-empty facts and recomputes their fingerprint, refusing the file (database untouched) otherwise; and
`fabric diff` says so, exit 2, of facts already stored that it cannot read."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.fabric.discovery import discover
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)

CAPTURE = Path(__file__).parent / "captures" / "h200x2"


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def _record(fp: str) -> ProfileRecord:
    key = ProfileKey(fingerprint=fp, software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                     intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=16)
    return ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=16.0, spread_us=0.5,
                         backend="local:nccl", provenance="measured", measured_on=fp)


@pytest.fixture
def export(tmp_path: Path) -> dict[str, Any]:
    """An export of one measured profile on the h200x2 capture's fingerprint, with its facts."""
    facts = discover(CAPTURE)
    with Store(tmp_path / "src.db") as s:
        s.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
        s.put_profile(_record(facts.fingerprint))
        return json.loads(s.dump_profiles())


def _write(tmp_path: Path, doc: dict[str, Any], name: str = "in.json") -> Path:
    f = tmp_path / name
    f.write_text(json.dumps(doc))
    return f


def test_real_facts_import_and_diff(tmp_path: Path, export: dict[str, Any]) -> None:
    db = tmp_path / "dst.db"
    r = run("profiles", "import", str(_write(tmp_path, export)), "--db", str(db))
    assert r.exit_code == 0, r.output
    r = run("fabric", "diff", "--db", str(db), "--capture", str(CAPTURE))
    assert r.exit_code == 0 and "fingerprint unchanged" in r.stdout, r.output


EDITS = {
    "gpu without index": lambda f: f.__setitem__("gpus", [{"model": "fake"}]),
    "gpus a string": lambda f: f.__setitem__("gpus", "string"),
    "nics and software wrong types": lambda f: (f.__setitem__("nics", "x"), f.__setitem__("software", 5)),
}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("existing", [False, True])
def test_facts_that_do_not_decode_are_refused(tmp_path: Path, export: dict[str, Any], edit: str,
                                              existing: bool) -> None:
    doc = copy.deepcopy(export)
    EDITS[edit](doc["fingerprints"][0]["facts"])
    f = _write(tmp_path, doc)
    db = tmp_path / "dst.db"
    if existing:
        with Store(db) as s:
            s.put_profile(_record("fp-other"))
    before = hashlib.sha256(db.read_bytes()).hexdigest() if existing else None
    r = run("profiles", "import", str(f), "--db", str(db))
    assert r.exit_code == 2, r.output
    fp = export["fingerprints"][0]["hash"]
    assert str(f) in r.stderr and f"fingerprint {fp[:8]}" in r.stderr and "moetune can read" in r.stderr, r.stderr
    assert "(database unchanged)" in r.stderr and "Traceback" not in r.output
    if existing:
        assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    else:
        assert not db.exists()


def test_facts_that_hash_otherwise_today_still_import(tmp_path: Path, export: dict[str, Any]) -> None:
    """Facts that decode but hash to another fingerprint than the one recorded with them import: the fingerprint's rule
    changed on 2026-12-04 without a new version, so an export of a database profiled before then has such facts
    (refusing them refused every such export, review). Decoding is what `fabric diff` and the daemon need."""
    doc = copy.deepcopy(export)
    doc["fingerprints"][0]["facts"]["gpus"][0]["memory_mib"] += 1024
    r = run("profiles", "import", str(_write(tmp_path, doc)), "--db", str(tmp_path / "dst.db"))
    assert r.exit_code == 0, r.output


def test_a_placeholder_without_facts_still_imports(tmp_path: Path) -> None:
    """A model tune's `preset:...` key has no facts: nothing to check, imported as before."""
    with Store(tmp_path / "src.db") as s:
        s.put_profile(ProfileRecord(key=_record("preset:nvlink-h200x2:0123").key, knobs=default_knobs("nvlink"),
                                    latency_us=16.0, spread_us=0.5, backend="model:nvlink-h200x2", provenance="preset"))
        doc = json.loads(s.dump_profiles())
    assert doc["fingerprints"][0]["facts"] == {}
    r = run("profiles", "import", str(_write(tmp_path, doc)), "--db", str(tmp_path / "dst.db"))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("edit", list(EDITS))
def test_fabric_diff_on_unreadable_stored_facts_fails_cleanly(tmp_path: Path, export: dict[str, Any],
                                                              edit: str) -> None:
    facts = copy.deepcopy(export["fingerprints"][0]["facts"])
    EDITS[edit](facts)
    db = tmp_path / "m.db"
    with Store(db) as s:  # the store's own API does not check (only the import does): as rows stored before it did
        s.upsert_fingerprint("fp-bad", facts, origin="local")
    r = run("fabric", "diff", "--db", str(db), "--capture", str(CAPTURE))
    assert r.exit_code == 2, r.output
    assert "stored facts of fingerprint fp-bad" in r.stderr and "cannot be read" in r.stderr, r.stderr
    assert ("Traceback" not in r.output and r.exception is None) or isinstance(r.exception, SystemExit)
