"""The imported rows of bench/results/summary.csv carry the commit that recorded their raw file's content
(bench/tools/import_history.py `added_sha`), checked against the archived raw files and the git history."""

from __future__ import annotations

import csv
import importlib.util
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT / "bench/results/archive/2026-11-30.tar.xz"
FIRST_RUN, RE_RUN = "24bde24aef2361315543af8dd577b5c1d6796040", "819748cfc7"


def _history() -> None:
    """Skip where the checkout has no git history holding the 2026-11-30 commits (an sdist, a shallow clone)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("no git checkout: the stamps are checked against the history")
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{FIRST_RUN}^{{commit}}"],
                      capture_output=True).returncode:
        pytest.skip("a shallow clone: the 2026-11-30 commits are not in it")


@pytest.fixture(scope="module")
def ih():
    spec = importlib.util.spec_from_file_location("import_history", ROOT / "bench/tools/import_history.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """The archived raw files of the imported CPU and proxy launches."""
    out = tmp_path_factory.mktemp("raw")
    with tarfile.open(ARCHIVE) as t:
        members = [m for m in t.getmembers() if m.isfile() and (
            "daemon_load" in m.name or m.name.endswith(("fabric_model_cpu.json", "fabric_discovery_cpu.jsonl",
                                                        "search_efficiency.json", "runtime_host_cost.txt",
                                                        "h200x2_run1/proxy_micro.jsonl")))]
        t.extractall(out, members=members, filter="data")
    return out


def test_a_renamed_file_keeps_the_commit_of_its_run(ih, tmp_path):
    # 819748c renamed the first ipc run's file _busy.json and wrote a re-run under the old name: a file's first
    # commit under a name is not the run's
    _history()
    first = subprocess.run(["git", "-C", str(ROOT), "show", f"{FIRST_RUN}:bench/results/2026-11-30_daemon_load.json"],
                           capture_output=True, check=True).stdout
    (tmp_path / "2026-11-30_daemon_load_busy.json").write_bytes(first)
    assert ih.added_sha(tmp_path / "2026-11-30_daemon_load_busy.json") == FIRST_RUN
    (tmp_path / "never.json").write_text('{"not": "in the history"}\n')
    assert ih.added_sha(tmp_path / "never.json") == "unknown"


def test_the_imported_rows_name_the_commit_of_their_content(ih, raw):
    _history()
    rows = list(csv.DictReader((ROOT / "bench/results/summary.csv").open(encoding="utf-8")))
    _, log = ih.fix_content_commits(rows, raw)
    assert log == [], log  # every stored stamp is already the content's commit
    checked = {(r["scenario"], r["launch"]): r["git_sha"] for r in rows if r["source"] == "imported"
               and r["scenario"] in {"daemon-load", "fabric-model"}}
    assert checked[("daemon-load", "2026-11-30_daemon_load")].startswith(RE_RUN)
    assert checked[("daemon-load", "2026-11-30_daemon_load_busy")] == FIRST_RUN
    assert checked[("fabric-model", "cpu-1")].startswith("543667d")


def test_a_row_stamped_with_the_name_commit_is_restamped_once(ih, raw):
    _history()
    row = {"scenario": "daemon-load", "case": "ipc", "launch": "2026-11-30_daemon_load_busy", "metric": "p99_us[c1-closed]",
           "source": "imported", "git_sha": "819748cfc7e0", "note": "from 2026-11-30_daemon_load_busy.json"}
    other = {**row, "source": "measured"}
    out, log = ih.fix_content_commits([row, other], raw)
    assert out[0]["git_sha"] == FIRST_RUN and "first stamped 819748c" in out[0]["note"]
    assert out[1] == other and len(log) == 1
    again, log2 = ih.fix_content_commits(out, raw)
    assert again == out and log2 == []


def test_a_rewrite_cut_short_leaves_the_results_table_whole(tmp_path):
    """`--fix-*` rewrote bench/results/summary.csv in place (Path.write_text truncates first): a full disk or a crash
    mid-write left every committed result truncated. It is replaced whole or not at all: the write cut short here by
    a file-size limit (as a full disk would) leaves the table as it was."""
    import sys
    import textwrap

    table = tmp_path / "bench/results/summary.csv"
    table.parent.mkdir(parents=True)
    head = ("scenario,case,baseline,position,launch,metric,unit,median,p10,p90,n,source,date,git_sha,git_dirty,"
            "moetune,torch,nccl,cuda,gpu,gpu_count,fabric_fingerprint,hardware,world,backend,command,note\n")
    table.write_text(head + "fabric-model,presets,1,0,cpu-1,speedup[16nodes],x MODELLED,1.5,,,1,imported,2026-11-30,"
                     + "a" * 40 + ",0,,,,,none,0,,2 CPU cores,1,none,python bench/model_reproduce.py,note\n")
    before = table.read_bytes()
    code = textwrap.dedent(f"""
        import importlib.util, resource, signal, sys
        from pathlib import Path
        spec = importlib.util.spec_from_file_location("ih", {str(ROOT / "bench/tools/import_history.py")!r})
        ih = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ih)
        ih.ROOT = Path({str(tmp_path)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            ih._rewrite_summary(lambda rows: (rows * 100, ["grown"]), "change(s)")
        except OSError as e:
            sys.exit(f"cut short: {{e}}")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode != 0 and "cut short" in p.stderr, (p.returncode, p.stderr)
    assert table.read_bytes() == before
    assert [f.name for f in table.parent.iterdir()] == ["summary.csv"]  # no temporary file left beside it


def test_running_the_import_again_appends_no_second_copy(ih, tmp_path, monkeypatch, capsys):
    """`import_history.py RESULTS_DIR` appends its rows to bench/results/summary.csv (its docstring said it printed
    them, `> rows.csv`), and run again it appended all 2,000 a second time, with the first import's stamps and
    quantiles the --fix-* rewrites had corrected: the summary's latest batch could be the stale copy. A launch
    already in the table is refused, nothing appended."""
    import sys

    raw = tmp_path / "raw"
    raw.mkdir()
    with tarfile.open(ARCHIVE) as t:
        t.extractall(raw, filter="data")
    root = tmp_path / "root"
    (root / "bench/results").mkdir(parents=True)
    table = root / "bench/results/summary.csv"
    shutil.copyfile(ROOT / "bench/results/summary.csv", table)
    before = table.read_bytes()
    monkeypatch.setattr(ih, "ROOT", root)
    monkeypatch.setattr(sys, "argv", ["import_history.py", str(raw)])
    assert ih.main() == 1
    assert "already in" in capsys.readouterr().err
    assert table.read_bytes() == before
    assert "> rows.csv" not in ih.__doc__
