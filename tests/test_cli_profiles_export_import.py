"""`moetune profiles export X` silently replaced a user's file, a read-only (0444) one included: an existing file is
refused now unless --force. `profiles import -` said "cannot read -" though `export -` writes stdout: it reads
stdin. `export` filters by --provenance as `list` does."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)


def run(*args: str, input: str | bytes | None = None):
    return CliRunner().invoke(app, list(args), input=input, env={"COLUMNS": "200"})


def fill(db: Path) -> None:
    with Store(db) as s:
        for b, prov, be in ((16, "measured", "local:nccl"), (128, "preset", "model:ndr-ibrc-h100x8")):
            key = ProfileKey(fingerprint="fp-cli", software="sw", transport_family="nvlink", ep_size=2, nodes=1,
                             hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=b)
            s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=float(b), spread_us=0.5,
                                        backend=be, provenance=prov))


@pytest.mark.parametrize("mode", [0o444, 0o644])
def test_export_refuses_an_existing_file_without_force(tmp_path: Path, mode: int) -> None:
    db = tmp_path / "m.db"
    fill(db)
    f = tmp_path / "mine.json"
    f.write_text("the user's own file\n")
    f.chmod(mode)
    r = run("profiles", "export", str(f), "--db", str(db))
    assert r.exit_code == 2, r.output
    assert f"{f} already exists" in r.stderr and "--force replaces it" in r.stderr, r.stderr
    assert ("(read-only)" in r.stderr) == (mode == 0o444), r.stderr
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1
    assert f.read_text() == "the user's own file\n" and stat.S_IMODE(f.stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir() if "mine" in p.name] == ["mine.json"]  # no temporary left
    r = run("profiles", "export", str(f), "--db", str(db), "--force")
    assert r.exit_code == 0 and "exported 2 profile(s)" in r.stdout, r.output
    assert json.loads(f.read_text())["format"] == "moetune-profiles"
    assert stat.S_IMODE(f.stat().st_mode) == mode  # replaced, permissions kept


def test_export_to_a_new_file_needs_no_force(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    fill(db)
    r = run("profiles", "export", str(tmp_path / "new.json"), "--db", str(db))
    assert r.exit_code == 0 and "exported 2 profile(s)" in r.stdout, r.output


def test_export_by_provenance(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    fill(db)
    for prov, buckets in (("measured", [16]), ("preset", [128]), ("node_model", [])):
        doc = json.loads(run("profiles", "export", "-", "--provenance", prov, "--db", str(db)).stdout)
        assert [p["key"]["token_bucket"] for p in doc["profiles"]] == buckets, prov
    f = tmp_path / "m.json"
    assert run("profiles", "export", str(f), "--provenance", "measured", "--db", str(db)).exit_code == 0
    assert [p["provenance"] for p in json.loads(f.read_text())["profiles"]] == ["measured"]
    r = run("profiles", "export", "-", "--provenance", "guessed", "--db", str(db))
    assert r.exit_code == 2 and "--provenance" in r.output and "measured, node_model, preset" in r.output


def test_export_help_lists_the_values() -> None:
    r = CliRunner().invoke(app, ["profiles", "export", "--help"], env={"COLUMNS": "400"})
    h = " ".join(r.output.split())
    assert "Only profiles with this status: current, stale or superseded." in h, h
    assert "measured, node_model or preset" in h and "--force" in h, h


def test_import_reads_stdin(tmp_path: Path) -> None:
    src, dst = tmp_path / "s.db", tmp_path / "d.db"
    fill(src)
    data = run("profiles", "export", "-", "--db", str(src)).stdout_bytes
    r = run("profiles", "import", "-", "--db", str(dst), input=data)
    assert r.exit_code == 0, r.output
    assert "imported 2 profile(s) from <stdin>" in r.stdout
    assert run("profiles", "export", "-", "--db", str(dst)).stdout_bytes == data


def test_import_of_bad_stdin_is_one_clear_line(tmp_path: Path) -> None:
    r = run("profiles", "import", "-", "--db", str(tmp_path / "d.db"), input="not json\n")
    assert r.exit_code == 2 and "<stdin>: not valid JSON" in r.stderr and "database unchanged" in r.stderr, r.output
    assert "Traceback" not in r.output and not (tmp_path / "d.db").exists()


def test_import_of_empty_or_closed_stdin_says_so(tmp_path: Path) -> None:
    import subprocess
    import sys

    db = tmp_path / "d.db"
    r = run("profiles", "import", "-", "--db", str(db), input=b"")
    assert r.exit_code == 2 and "stdin is empty" in r.stderr and "truncated" not in r.stderr, r.output
    empty = tmp_path / "e.json"
    empty.write_bytes(b"")
    r = run("profiles", "import", str(empty), "--db", str(db))
    assert r.exit_code == 2 and f"{empty} is empty" in r.stderr, r.output
    # stdin closed (`<&-`): Python's sys.stdin is None; this was a traceback
    code = "from moetune.tuner.cli import main; main()"
    p = subprocess.run(["bash", "-c", f'"$0" -c "{code}" profiles import - --db "$1" <&-', sys.executable, str(db)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no stdin" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not db.exists()


@pytest.mark.parametrize(("err", "code"), [("EACCES", 2), ("EPERM", 2), ("EROFS", 2), ("ENOSPC", 1), ("EDQUOT", 1),
                                           ("EIO", 1), ("ENOENT", 2), ("EISDIR", 2)])
def test_export_write_errors_exit_by_whose_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: str,
                                                  code: int) -> None:
    """1 when the write fails as it is made (no space, quota, an I/O error); 2 when the path cannot be written (no
    permission, a read-only file system, a missing folder, a directory), as for every command's output."""
    import errno
    import os

    from moetune.tuner.store import io as store_io

    def refuse(*_a: object, **_k: object) -> int:
        n = getattr(errno, err)
        raise OSError(n, os.strerror(n), "x")

    db = tmp_path / "s.db"
    fill(db)
    monkeypatch.setattr(store_io, "export_profiles", refuse)
    r = run("profiles", "export", str(tmp_path / "out.json"), "--db", str(db))
    assert r.exit_code == code and "cannot write" in r.stderr, r.output


def test_export_to_a_bad_path_exits_2(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    fill(db)
    for target in (tmp_path / "no" / "out.json", tmp_path):  # a missing folder; a directory
        r = run("profiles", "export", str(target), "--force", "--db", str(db))
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("links", [True, False], ids=["hard-link", "no-hard-links"])
def test_export_without_force_never_replaces_a_file_made_after_its_check(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         links: bool) -> None:
    """The target is checked, the export is built, then a file appears there (another process): without --force it
    is refused, not replaced (an os.replace would go over it). On a filesystem without hard links the rename is checked
    again just before."""
    import errno
    import os

    from moetune.tuner.store import io

    db = tmp_path / "m.db"
    fill(db)
    target = tmp_path / "out.json"
    dump = io.dump_profiles

    def dump_then_someone_writes(*a: object, **k: object) -> bytes:
        data = dump(*a, **k)
        target.write_text("written meanwhile\n")
        return data

    monkeypatch.setattr(io, "dump_profiles", dump_then_someone_writes)
    if not links:
        def no_links(*_a: object) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_links)
    r = run("profiles", "export", str(target), "--db", str(db))
    assert r.exit_code == 2 and f"{target} already exists" in r.stderr, r.output
    assert target.read_text() == "written meanwhile\n"
    assert [p.name for p in tmp_path.iterdir() if "out" in p.name] == ["out.json"]  # no temporary left
    target.unlink()
    monkeypatch.setattr(io, "dump_profiles", dump)
    r = run("profiles", "export", str(target), "--db", str(db))
    assert r.exit_code == 0 and json.loads(target.read_text())["format"] == "moetune-profiles", r.output


def test_fingerprint_filter_takes_the_start_list_shows(tmp_path: Path) -> None:
    """`list` shows a fingerprint's first 10 characters; `--fingerprint` given them matched nothing, silently
    ("0 profile(s)", "exported 0 profile(s)"). A unique start names it; none or several is an error."""
    db = tmp_path / "m.db"
    fill(db)
    with Store(db) as s:
        s.upsert_fingerprint("fp-other", {}, origin="local")
    r = run("profiles", "list", "--db", str(db), "--fingerprint", "fp-c", "--json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)) == 2, r.output
    r = run("profiles", "export", "-", "--db", str(db), "--fingerprint", "fp-c")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["profiles"]) == 2, r.output
    r = run("profiles", "list", "--db", str(db), "--fingerprint", "fp-")
    assert r.exit_code == 2 and "is the start of 2 fingerprints" in r.output, r.output
    r = run("profiles", "export", str(tmp_path / "x.json"), "--db", str(db), "--fingerprint", "nope")
    assert r.exit_code == 2 and "no stored fingerprint is or starts with it" in r.output, r.output
    assert not (tmp_path / "x.json").exists()


def test_skip_invalid_with_every_record_invalid_is_refused_and_names_a_newer_writer(tmp_path: Path) -> None:
    """--skip-invalid over a file whose every record was invalid imported nothing, exited 0 and created the
    database; a newer moetune's records (a field this one does not know) were refused as "unknown field" only."""
    fill(tmp_path / "src.db")
    out = tmp_path / "e.json"
    assert run("profiles", "export", str(out), "--db", str(tmp_path / "src.db")).exit_code == 0
    doc = json.loads(out.read_text())
    doc["moetune_version"] = "9.9.9"
    for rec in doc["profiles"]:
        rec["confidence"] = 0.9
    out.write_text(json.dumps(doc))
    dst = tmp_path / "dst.db"
    r = run("profiles", "import", str(out), "--skip-invalid", "--db", str(dst))
    text = " ".join(r.output.split())
    assert r.exit_code != 0 and "no record of the file is valid" in text, r.output
    assert "written by moetune 9.9.9" in text and "Traceback" not in r.output
    assert not dst.exists()


def test_a_row_labelled_measured_by_a_backend_that_does_not_measure_reads_as_modelled(tmp_path: Path) -> None:
    """Such a row (a hand edit: no writer of moetune stores one) was listed, shown and exported as measured (the
    export then refused by import) and `db check` said ok; the runtime already took it as modelled."""
    import sqlite3

    db = tmp_path / "m.db"
    fill(db)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE profiles SET provenance = 'measured', measured_on = 'fp-cli' WHERE token_bucket = 128")
    with Store(db) as s:
        assert [r.effective_provenance for _i, r in s.list_profiles()] == ["measured", "preset"]
        assert s.check()["mislabelled_profiles"] == [{"id": 2, "backend": "model:ndr-ibrc-h100x8",
                                                        "provenance": "measured"}]
    r = run("profiles", "show", "2", "--db", str(db))
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "PRESET" in text and "stored as measured, but its backend does not measure" in text
    r = run("profiles", "list", "--db", str(db))
    assert r.exit_code == 0 and r.output.count("PRESET") == 1, r.output
    # --json as the table: the effective labels, the stored ones beside them (it said "measured")
    for args in (("profiles", "show", "2", "--json"), ("profiles", "list", "--json")):
        r = run(*args, "--db", str(db))
        rec = json.loads(r.stdout)
        rec = rec if isinstance(rec, dict) else next(x for x in rec if x["id"] == 2)
        assert (rec["provenance"], rec["stored_provenance"]) == ("preset", "measured"), rec
        assert rec["measured_on"] != "fp-cli" and rec["stored_measured_on"] == "fp-cli", rec
    r = run("db", "check", "--db", str(db))
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "profile 2: labelled measured, but its backend" in text, r.output
    out = tmp_path / "e.json"
    assert run("profiles", "export", str(out), "--db", str(db)).exit_code == 0
    r = run("profiles", "import", str(out), "--db", str(tmp_path / "dst.db"))
    assert r.exit_code == 0, r.output  # the export says preset: importable


def test_a_mislabelled_row_ranks_as_modelled_in_filters_lookups_and_the_gate(tmp_path: Path) -> None:
    """The --provenance filter, the store's lookup tiers, the replacement gate and the daemon's status counts went by
    the stored label: a hand-edited "measured" row on a modelling backend was listed as measured, found by a
    measured-only lookup and kept a real measurement of its key out as superseded."""
    import sqlite3

    from moetune.tuner.daemon.index import ProfileIndex

    db = tmp_path / "m.db"
    fill(db)
    with sqlite3.connect(db) as c:  # the preset row at 128 (latency 128) labelled measured
        c.execute("UPDATE profiles SET provenance = 'measured', measured_on = 'fp-cli' WHERE token_bucket = 128")
    with Store(db) as s:
        assert [i for i, _r in s.list_profiles(provenance="measured")] == [1]
        assert [i for i, _r in s.list_profiles(provenance="preset")] == [2]
        args = dict(fingerprint="fp-cli", software="sw", ep_size=2, nodes=1, hidden=7168, intermediate=2048,
                    experts=256, topk=8, dtype="bfloat16", transport_family="nvlink")
        assert s.find_profile(**args, tokens=128, measured_only=True, max_bucket_steps=0) is None
        assert s.provenance_of(s.get_profile(2).key)[:2] == ("preset", "preset:ndr-ibrc-h100x8")  # as `query` reads it
        found = s.find_profile(**args, tokens=128, max_bucket_steps=0)
        assert found is not None and found.effective_provenance == "preset" and found.key.token_bucket == 128
        idx = ProfileIndex([r for _i, r in s.list_profiles(status="current")], version=1, facts=None, stale=[])
        idx.fingerprint = "fp-cli"
        assert idx.provenance_counts() == {"measured": 1, "node_model": 0, "preset": 1}
        key = s.get_profile(2).key
        slower = ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=500.0, spread_us=0.5,
                               backend="local:nccl", provenance="measured")
        written, why = s.put_profile(slower)
        assert written and "a measured profile replaces a preset one" in why, why
        assert s.get_current(key).latency_us == 500.0


def test_tune_show_says_the_stored_profile_of_a_mislabelled_row_is_what_its_backend_says(tmp_path: Path) -> None:
    """`tune show` (`stored_for_key`: what the database holds for a study's key, the number a speed-up is read from)
    printed the stored label: a hand-edited "measured" row on a modelling backend was shown as measured, where
    list/show/export, `query` and the runtime take it as the preset it is."""
    import sqlite3

    from moetune.tuner.search.readback import stored_for_key

    db = tmp_path / "m.db"
    fill(db)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE profiles SET provenance = 'measured', measured_on = 'fp-cli' WHERE token_bucket = 128")
    with Store(db) as s:
        key = s.get_profile(2).key
        got = stored_for_key(s, key.to_dict(), None)
        assert got is not None and got["provenance"] == "preset", got
        measured = stored_for_key(s, s.get_profile(1).key.to_dict(), None)
        assert measured is not None and measured["provenance"] == "measured", measured


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_output_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """`export - >/dev/full`, `list --json >/dev/full`, `export - >&-` and `delete ID <&-` ended in tracebacks."""
    import os
    import subprocess
    import sys

    fill(tmp_path / "m.db")
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path), "MOETUNE_CONFIG": "", "COLUMNS": "120"}
    cmd = [sys.executable, "-c", "from moetune.tuner.cli import main; main()"]
    db = ["--db", str(tmp_path / "m.db")]
    for args in (["profiles", "export", "-"], ["profiles", "list", "--json"], ["profiles", "list"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run([*cmd, *args, *db], stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=60)
        assert r.returncode == 1 and "cannot write the output (No space left on device)" in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
    r = subprocess.run([*cmd, "profiles", "export", "-", *db], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, env=env, timeout=60, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and "stdout is closed" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([*cmd, "profiles", "delete", "1", *db], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, env=env, timeout=60, preexec_fn=lambda: os.close(0))
    assert r.returncode == 2 and "pass --yes" in r.stderr and "Traceback" not in r.stderr, r.stderr
    with Store(tmp_path / "m.db") as s:
        assert len(s.list_profiles()) == 2  # nothing deleted


def test_a_mislabelled_row_with_a_recorded_environment_exports_importably(tmp_path: Path) -> None:
    """Exported as modelled, a hand-edited row kept its perf_env, which a modelled record may not carry: the import
    refused the whole file."""
    import sqlite3

    db = tmp_path / "m.db"
    fill(db)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE profiles SET backend = 'model:node:fp-cli', perf_env = '{}', measured_on = 'fp-cli' "
                  "WHERE token_bucket = 16")
    out = tmp_path / "e.json"
    assert run("profiles", "export", str(out), "--db", str(db)).exit_code == 0
    rec = next(r for r in json.loads(out.read_text())["profiles"] if r["key"]["token_bucket"] == 16)
    assert rec["provenance"] == "node_model" and rec["measured_on"] == "fp-cli" and "perf_env" not in rec
    r = run("profiles", "import", str(out), "--db", str(tmp_path / "dst.db"))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("cmd", [["profiles", "export", ""], ["profiles", "import", ""]])
def test_an_empty_path_is_refused_by_name(tmp_path: Path, cmd: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`profiles import ""` said "cannot read .: Is a directory", `profiles export ""` reported on "." (read as a
    Path, "" is the current folder): refused as an empty path, naming the argument, before any database is made."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, cmd, env={"COLUMNS": "200", "MOETUNE_HOME": str(tmp_path / "home")})
    said = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and "Invalid value for 'path': an empty path names no file or folder" in said, said
    assert "Is a directory" not in said and not (tmp_path / "home").exists()


@pytest.mark.parametrize("cmd", ["list", "export"])
def test_fingerprint_help_says_where_the_fingerprint_is_shown(tmp_path: Path, cmd: str) -> None:
    """`--fingerprint` said "as `list` shows it", but the 80-column table leaves the fingerprint column out: the help
    names where it is always shown (`list --json`, `profiles show`), and both do show it."""
    import re

    h = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", CliRunner().invoke(app, ["profiles", cmd, "--help"],
                                                                          env={"COLUMNS": "400"}).output))
    cell = h[h.index("--fingerprint <"):][:400]
    assert "`profiles list --json`" in cell and "`profiles show ID`" in cell and "as `list` shows it" not in cell, cell
    db = tmp_path / "m.db"
    fill(db)
    narrow = CliRunner().invoke(app, ["profiles", "list", "--db", str(db)], env={"COLUMNS": "80"}).output
    assert "fp-cli" not in narrow and "fingerprint" in narrow  # the column left out, the caption says so
    assert json.loads(run("profiles", "list", "--json", "--db", str(db)).stdout)[0]["key"]["fingerprint"] == "fp-cli"
    assert "fp-cli" in run("profiles", "show", "1", "--db", str(db)).output
