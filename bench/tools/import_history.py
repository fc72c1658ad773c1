"""One-off conversion of the 2026-11-30 lab notebook (bench/results/*) into summary.csv rows, source=imported.

    python bench/tools/import_history.py RESULTS_DIR   (RESULTS_DIR: the unpacked archive; appends to
                                                        bench/results/summary.csv, refused where a launch is in it)

Each row's git SHA is the commit that recorded its raw file's content (`added_sha`), except the host-staged
launches: those carry the commit whose code ran (`RUN_CODE`), or "unknown" with the reason in the note where no
commit can be shown to be it (the commit that added a run's raw files came after the run and often changed code).
Its date is the day of the run, its hardware the machine BENCHMARKS.md names. Only numbers the raw files hold are written; a failed case
becomes a row with an empty median and note FAILED. Kept so the conversion can be reviewed and re-run.

    python bench/tools/import_history.py --fix-quantiles RESULTS_DIR   (rewrites bench/results/summary.csv in place)

corrects the rows the first import wrote with other statistics in the p10 / p90 columns (`fix_quantile_rows`);

    python bench/tools/import_history.py --fix-run-commits   (rewrites bench/results/summary.csv in place)

restamps the host-staged launches the first import stamped with the commit that added their raw files
(`fix_run_commits`);

    python bench/tools/import_history.py --fix-content-commits RESULTS_DIR   (rewrites bench/results/summary.csv in place)

restamps the other imported rows whose commit was the first one to add a file of their raw file's name, not the
one that recorded the content they hold (`fix_content_commits`).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from moetune.tuner.measure import results as R
from moetune.tuner.measure.scenarios import definitions, records
from moetune.tuner.measure.scenarios.drivers import daemon as daemon_driver
from moetune.tuner.measure.scenarios.drivers import ep as ep_driver
from moetune.tuner.measure.scenarios.drivers import fabric as fabric_drivers
from moetune.tuner.measure.scenarios.drivers import proxy as proxy_drivers
from moetune.tuner.measure.scenarios.drivers import search as search_driver

ROOT = Path(__file__).resolve().parents[2]
H200 = {"gpu": "NVIDIA H200", "gpu_count": 2, "torch": "2.11.0+cu130", "nccl": "2.28.9", "cuda": "13.0",
        "hardware": "2x NVIDIA H200 (NV18 NVLink), driver 580.159.04", "fabric_fingerprint": "fb7949d8f6691bdd"}
CPU = {"gpu": "none", "gpu_count": 0, "hardware": "2 CPU cores (Intel Xeon VM), no GPU"}


@functools.cache
def added_sha(path: Path) -> str:
    """The commit that recorded the content of raw file `path` (as the archive holds it): the oldest commit that
    brought this exact blob into the history, under whatever name. Not the commit that first added a file of this
    name: 2026-11-30_daemon_load.json was rewritten by a re-run in 819748c (the first run's content renamed
    _busy.json there), 2026-11-30_fabric_model_cpu.json by 543667d's refreshed timings."""
    git = ["git", "-C", str(ROOT)]
    blob = subprocess.run([*git, "hash-object", str(path)], capture_output=True, text=True).stdout.strip()
    out = subprocess.run([*git, "log", "--format=%H", f"--find-object={blob}"],
                         capture_output=True, text=True).stdout.split() if blob else []
    return out[-1] if out else "unknown"


def rows_for(scenario: str, launch: str, per_case: list[tuple[str, dict[str, records.Stat], str]], src: Path,
             machine: dict[str, Any], command: str, world: int = 1, backend: str = "none") -> list[dict[str, Any]]:
    sha = added_sha(src)
    base = definitions.get(scenario).baseline.name
    out = []
    for pos, (case, metrics, note) in enumerate(per_case):
        common = {"scenario": scenario, "case": case, "baseline": case == base, "position": pos, "launch": launch,
                  "source": "imported", "date": "2026-11-30", "git_sha": sha, "git_dirty": False, "world": world,
                  "backend": backend, "command": command, **machine}
        if not metrics:
            out.append({**common, "metric": definitions.get(scenario).metrics[0], "note": f"FAILED: {note}"[:300]})
        for m, st in metrics.items():
            out.append({**common, "metric": m, "unit": st.unit, "median": st.median, "p10": st.p10, "p90": st.p90,
                        "n": st.n, "note": f"from {src.relative_to(ROOT / 'bench/results') if src.is_relative_to(ROOT / 'bench/results') else src.name}"})
    return out


def discovery_2026_11_30(d: dict[str, Any]) -> dict[str, dict[str, records.Stat]]:
    """`fabric_drivers.discovery_metrics` of a line bench/fabric_discovery_cpu.py wrote before 9dc4891: its capture times are
    total / 20 calls (a mean, one timer around the 20 calls), not a median of timed calls, so they are metric
    `discover_mean_s`, never `discover_s` beside the live case's median (the ratio divided a median by a mean)."""
    out = fabric_drivers.discovery_metrics(d)
    for case, m in out.items():
        if case.startswith("capture-"):
            out[case] = {"discover_mean_s": m.pop("discover_s"), **m}
    return out


CAPTURE_MEAN_NOTE = "a mean of 20 calls (total / 20: bench/fabric_discovery_cpu.py before 9dc4891), not a median"
HOST_COST_FILE = "2026-11-30_cpu_runtime_host_cost.txt"
HOST_COST_MEAN_NOTE = "a mean of all calls (bench/runtime_host_cost.py before 9709558), not a median"


def host_cost_runs(f: Path) -> list[dict[str, dict[str, records.Stat]]]:
    """The launches of bench/runtime_host_cost.py in `f` (a case seen again starts the next), each case's number
    as `host_mean_us_per_roundtrip`: the script then printed the mean of all its calls, never a median, so the
    number is no `host_us_per_roundtrip` (the median of batch means today's script prints)."""
    runs: list[dict[str, dict[str, records.Stat]]] = [{}]
    for ln in f.read_text().splitlines():
        m = re.match(r"^(\w+)\s+([\d.]+) us/roundtrip", ln)
        if m:
            case = m.group(1).replace("_", "-")
            if case in runs[-1]:
                runs.append({})
            runs[-1][case] = {"host_mean_us_per_roundtrip": records.Stat(float(m.group(2)), unit="us")}
    return runs
# the metrics a stored row's p10 / p90 columns held other statistics of (the first import, before 536074c): what
# the raw file holds beside the row's own number is a metric of its own, after that row
_SPLIT_OFF = {"p99_us": ("p50_us", "max_us"), "autoload_ms": ("autoload_max_ms",), "predict_ms": ("predict_max_ms",),
              "discover_s": ("discover_max_s",)}
_FIXED_SOURCES = {"daemon-load": ("2026-11-30_daemon_load.json", "2026-11-30_daemon_load_tcp.json",
                                  "2026-11-30_daemon_load_busy.json"),
                  "fabric-discovery": ("fabric_discovery_cpu.jsonl",), "fabric-model": ("2026-11-30_fabric_model_cpu.json",),
                  "runtime-host-cost": (HOST_COST_FILE,)}


def _source_metrics(scenario: str, case: str, launch: str, raw: Path) -> dict[str, records.Stat]:
    """What today's drivers make of the raw file of an imported row (the metrics of its case)."""
    if scenario == "daemon-load":
        return daemon_driver.daemon_metrics(json.loads(raw.read_text()))
    if scenario == "fabric-model":
        return fabric_drivers.model_metrics(json.loads(raw.read_text()))
    i = int(launch.removeprefix("cpu-")) - 1  # fabric-discovery and runtime-host-cost: launch cpu-N is the Nth
    if scenario == "runtime-host-cost":
        return host_cost_runs(raw)[i][case]
    return discovery_2026_11_30(json.loads(raw.read_text().splitlines()[i]))[case]


def fix_quantile_rows(rows: list[dict[str, str]], res: Path) -> tuple[list[dict[str, str]], list[str]]:
    """The rows (summary.csv's, as read_rows gives them) with the 2026-11-30 imports of daemon-load, fabric-discovery,
    fabric-model and runtime-host-cost corrected from their raw files in `res`, and what was changed. The first import put the p50 of a
    p99_us row in its p10 column and the max in its p90 column, and the max of autoload_ms, predict_ms and live
    discover_s in the p90 column: those columns are emptied (the raw files hold no p10 / p90 of these numbers) and
    the p50 / max become rows of their own (p50_us, max_us, autoload_max_ms, predict_max_ms, discover_max_s) right
    after, stamped as the row is. A capture-* discover_s row (a mean) becomes discover_mean_s, a runtime-host-cost
    host_us_per_roundtrip row (a mean) host_mean_us_per_roundtrip. Every median is
    checked against the raw file first. Idempotent: corrected rows are left as they are."""
    out: list[dict[str, str]] = []
    log: list[str] = []
    have = {(r["scenario"], r["case"], r["launch"], r["metric"]) for r in rows}
    for r in rows:
        src = r["note"].removeprefix("from ").split(";")[0]
        if r["source"] != "imported" or src not in _FIXED_SOURCES.get(r["scenario"], ()):
            out.append(r)
            continue
        fresh = _source_metrics(r["scenario"], r["case"], r["launch"], res / src)
        r = dict(r)
        where = f"{r['scenario']} {r['case']} {r['launch']} {r['metric']}"
        if r["case"].startswith("capture-") and r["metric"] == "discover_s":
            r["metric"], r["note"] = "discover_mean_s", f"{r['note']}; {CAPTURE_MEAN_NOTE}"
            log.append(f"{where}: metric renamed discover_mean_s (the raw number is a mean)")
        if r["scenario"] == "runtime-host-cost" and r["metric"] == "host_us_per_roundtrip":
            r["metric"], r["note"] = "host_mean_us_per_roundtrip", f"{r['note']}; {HOST_COST_MEAN_NOTE}"
            log.append(f"{where}: metric renamed host_mean_us_per_roundtrip (the raw number is a mean)")
        st = fresh.get(r["metric"])
        if st is None:
            raise SystemExit(f"{where}: not in {src} as today's driver reads it")
        if R._cell(st.median) != r["median"]:
            raise SystemExit(f"{where}: median {r['median']} but {src} holds {st.median}")
        p10, p90 = R._cell(st.p10), R._cell(st.p90)
        if (r["p10"], r["p90"]) != (p10, p90):
            log.append(f"{where}: p10 {r['p10'] or '-'} -> {p10 or '-'}, p90 {r['p90'] or '-'} -> {p90 or '-'}")
            r["p10"], r["p90"] = p10, p90
        out.append(r)
        base, sep, key = r["metric"].partition("[")
        for name in _SPLIT_OFF.get(base, ()):
            metric = f"{name}{sep}{key}"
            if metric not in fresh or (r["scenario"], r["case"], r["launch"], metric) in have:
                continue
            extra = fresh[metric]
            out.append({**r, "metric": metric, "unit": extra.unit, "median": R._cell(extra.median), "p10": "",
                        "p90": "", "n": R._cell(extra.n)})
            log.append(f"{r['scenario']} {r['case']} {r['launch']} {metric} = {R._cell(extra.median)}: new row")
    return out, log


# The code each host-staged run measured: the commit whose message names the run's script as added / the run as
# prepared, the last commit before the run's first case (the times in its host_staged.jsonl) with the next commit
# after its first case (the tree was copied to the GPU machine before its first case). Checked against `git log`
# (commit times, UTC) and the raw files' case times in bench/results/archive/2026-11-30.tar.xz. The copied tree's
# state was not recorded: uncommitted changes cannot be ruled out, and none of these runs says it had any.
RUN_CODE: dict[int, tuple[str, str]] = {
    11: ("7a0ec53d4d18f4ec25d22ff338c0727068dd687a", "'bench: run-11 script' 08:50:58; run 08:52:57-08:54:54; next commit 08:59:54"),
    16: ("d0b7eacd933033a43e7b2ed19e78f826f0f4dd26", "'...; run-16 script' 09:23:44; run 09:25:10-09:26:12; next commit 09:29:01"),
    19: ("72495a15d98840c04eb0dc066b002a23d5e106e8", "'...; run 19 script' 10:02:05; run 10:03:42-10:07:05; next commit 10:09:25"),
    20: ("bc55469cff503bcf52e85b34a2aa1352f77758e2", "'... and run 20 script' 10:09:25; run 10:11:30-10:12:04; next commit 10:13:25"),
    21: ("c83c5937c190fdf399541f6ebd18a971c7e0e89c", "'..., run 21 script' 10:13:25; run 10:15:14-10:18:18; next commit 10:19:00"),
    23: ("a489883c4578656776a1700d2057b88e5cc018b8", "'...; run 23 script' 10:23:19; run 10:25:01-10:27:47; next commit 10:29:29"),
    24: ("b4b03b35cfc4d8c9b276ba3bcef5c871d0cb2570", "'...; run 24 script' 10:29:29; run 10:31:59-10:34:27; next commit 10:34:51"),
    25: ("5a9b48f8ab3fe580b5ea4450edf147cd4f33f94b", "'...; run 25 script' 10:34:51; run 10:35:33-10:36:05; next commit 10:36:31"),
    29: ("2a219c317160f990144fd502308a48fcaf654efd", "'...; run 29 script' 11:25:54; run 11:27:34-11:30:27; next commit 11:30:41"),
    30: ("b084a7f6f42f460d7a205a27aedaa64d41d20680", "'bench: run 30 script' 11:31:19; run 11:34:20-11:36:55; next commit 11:37:07"),
    31: ("6b5022af314c4659f63e3c03061a42b1deb7987e", "branch hs-ring-wait '...; run 31 script' 11:45:13 (merge 70d6024: "
                                                       "run 31's code); run 11:57:05-11:58:15; next commit 11:59:07"),
    33: ("a98bd21821ee6813a1f8a616be87752d8554f516", "'bench: run 33 prepared' 12:20:04; run 12:22:25-12:24:29; next commit 12:26:02"),
    34: ("5fc3b968885a08c1f461a7d1446a7b8e8e9f1420", "'...; bench: run 34 prepared' 12:26:02; run 12:27:06-12:29:20; next commit 12:32:54"),
    35: ("b6ac6422ed949c16a4cb3f6cacd0cfce001cd39c", "'... Run 35 prepared' 12:32:54; run 12:35:34-12:38:07; next commit 12:39:56"),
    36: ("b5f112deff9ceaf437dbc7df0475a96acc052fa3", "'... Run 36 prepared' 12:39:56; run 12:42:11-12:44:33; next commit 12:45:08"),
    37: ("99b5e587f6c4bdd7f1ac727295d6d71fe4964768", "'...; run 37 prepared' 12:45:08 (run37/README.md: the commit that adds "
                                                       "bench/gpu_run37.sh); run 12:47:10-12:51:23; next commit 12:52:42"),
}
CODE_NOTE = "code: {sha} ({why})"
NO_CODE_NOTE = ("code commit not established: no commit names run {n} as prepared before it ran (its raw files were "
                "added in {added}, after the run)")


def _run_number(launch: str) -> int:
    return int(re.match(r"run(\d+)", launch).group(1))  # type: ignore[union-attr]


def run_stamp(launch: str, added: str) -> tuple[str, str]:
    """(git_sha, note text) of a host-staged launch ("run33a", ...): `RUN_CODE`'s commit and its evidence, or
    "unknown" and why (`added`: the commit that added its raw files)."""
    n = _run_number(launch)
    if n in RUN_CODE:
        sha, why = RUN_CODE[n]
        return sha, CODE_NOTE.format(sha=sha[:7], why=why)
    return "unknown", NO_CODE_NOTE.format(n=n, added=added[:7])


def fix_run_commits(rows: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[str]]:
    """The rows with the imported host-staged launches restamped (`run_stamp`): the first import gave every row the
    commit that added its raw files (runs 33-37 all dbac03e, though 5fc3b96, b6ac642, b5f112d and 99b5e58 changed
    code between them, and dbac03e itself changed code after run 37). Only git_sha and the note change; idempotent."""
    out, log, seen = [], [], set()
    for r in rows:
        if r["scenario"] != "host-staged-fp8-pipelined" or r["source"] != "imported" or "; code" in r["note"]:
            out.append(r)
            continue
        sha, why = run_stamp(r["launch"], r["git_sha"])
        if r["launch"] not in seen:
            seen.add(r["launch"])
            log.append(f"{r['launch']}: git_sha {r['git_sha'][:10]} -> {sha[:10]}")
        out.append({**r, "git_sha": sha, "note": f"{r['note']}; {why}"})
    return out, log


def host_staged(res: Path) -> list[dict[str, Any]]:
    scn = definitions.get("host-staged-fp8-pipelined")
    named = {(c.args.get("layout"), c.args.get("knobs"), " ".join(f"{k}={v}" for k, v in c.env.items())): c.name
             for c in scn.cases}
    rows = []
    for f in sorted(res.glob("*/**/host_staged.jsonl")):
        run = re.search(r"run(\d+\w*)", str(f.relative_to(res))).group(0)
        sub = f.parent.name if f.parent.name != f"2026-11-30_h200x2_{run}" else ""
        launch = f"{run}{sub}"
        per, date = [], "2026-11-30"
        for ln in f.read_text().splitlines():
            if not ln.strip():
                continue
            r = json.loads(ln)
            env = r.get("env", "").strip()
            case = named.get((r["layout"], r["knobs"], env)) or f"{r['layout']}|{r['knobs']}" + (f"|{env}" if env else "")
            rep = r.get("result") or {}
            per.append((case, ep_driver._from_report(rep) if rep else {}, (r.get("stderr_tail") or "no result")[:200]))
            date = rep.get("date") or date
        cmd = f"bench/gpu_host_staged.sh (launch {launch}; CASES in that run's script)"
        for r in rows_for(scn.name, launch, per, f, H200, cmd, world=2, backend="nccl"):
            sha, why = run_stamp(launch, r["git_sha"])
            rows.append({**r, "date": date[:19] + "Z", "git_sha": sha, "note": f"{r['note']}; {why}"})
    return rows


CONTENT_NOTE = "git_sha: the commit that recorded this content (first stamped {old}, which added a file of this name)"


def fix_content_commits(rows: list[dict[str, str]], res: Path) -> tuple[list[dict[str, str]], list[str]]:
    """The rows with the imported launches of `_FIXED_SOURCES`' scenarios (proxy-fences, runtime-host-cost and
    search-efficiency too) restamped with `added_sha` of their raw file in `res`, where the first import's stamp (the
    first commit to add a file of that name) differs: the daemon-load ipc rows held 819748c's re-run but said
    24bde24, the _busy rows 24bde24's first run but said 819748c, the fabric-model rows 543667d's timings but said
    70c0afc. Only git_sha and the note change; idempotent."""
    scenarios = {*_FIXED_SOURCES, "proxy-fences", "runtime-host-cost", "search-efficiency"}
    out, log, seen = [], [], set()
    for r in rows:
        if r["source"] != "imported" or r["scenario"] not in scenarios:
            out.append(r)
            continue
        src = r["note"].removeprefix("from ").split(";")[0]
        sha = added_sha(res / src)  # cached: one history walk a file
        if sha == "unknown":
            raise SystemExit(f"{r['scenario']} {r['launch']}: {r['note']}: no commit holds that raw file")
        if sha != r["git_sha"]:
            key = (r["scenario"], r["launch"])
            if key not in seen:
                seen.add(key)
                log.append(f"{r['scenario']} {r['launch']}: git_sha {r['git_sha'][:10]} -> {sha[:10]}")
            r = {**r, "git_sha": sha, "note": f"{r['note']}; {CONTENT_NOTE.format(old=r['git_sha'][:7])}"}
        out.append(r)
    return out, log


def _rewrite_summary(fix: Any, what: str) -> int:
    """Apply `fix` (rows -> (rows, log)) to bench/results/summary.csv in place; print its log and how many `what`."""
    from moetune.tuner.store.atomic_files import write_atomic

    csv_path = ROOT / "bench/results/summary.csv"
    rows, log = fix(R.read_rows(csv_path))
    # whole or not at all: written in place, a full disk or a crash mid-write truncated every committed result
    write_atomic(csv_path, R._csv_text(rows, header=True))
    print("\n".join(log))
    print(f"{len(log)} {what}")
    return 0


def main() -> int:
    fixes = {"--fix-content-commits": (fix_content_commits, "launch(es) restamped", True),
             "--fix-run-commits": (fix_run_commits, "launch(es) restamped", False),
             "--fix-quantiles": (fix_quantile_rows, "change(s)", True)}
    if sys.argv[1] in fixes:
        fix, what, needs_raw = fixes[sys.argv[1]]
        res = Path(sys.argv[2]).resolve() if needs_raw else None  # the unpacked archive of the raw files
        return _rewrite_summary(lambda rows: fix(rows, res) if needs_raw else fix(rows), what)
    res = Path(sys.argv[1]).resolve()
    rows = host_staged(res)
    for i, ln in enumerate((res / "fabric_discovery_cpu.jsonl").read_text().splitlines()):
        d = json.loads(ln)
        per = discovery_2026_11_30(d)
        rows += rows_for("fabric-discovery", f"cpu-{i + 1}", [(c, m, "") for c, m in per.items()],
                         res / "fabric_discovery_cpu.jsonl", CPU, d.get("command", ""))
    for name, case in (("2026-11-30_daemon_load.json", "ipc"), ("2026-11-30_daemon_load_tcp.json", "tcp"),
                       ("2026-11-30_daemon_load_busy.json", "ipc")):
        d = json.loads((res / name).read_text())
        rows += rows_for("daemon-load", name.removesuffix(".json"), [(case, daemon_driver.daemon_metrics(d), "")], res / name, CPU,
                         d.get("command", ""))
    d = json.loads((res / "search_efficiency.json").read_text())
    per = search_driver.search_metrics(d)
    rows += rows_for("search-efficiency", "cpu-1", [(c, per[c], "") for c in ("random", "tpe", "cold-tpe")],
                     res / "search_efficiency.json", CPU, d["meta"]["command"])
    d = json.loads((res / "2026-11-30_fabric_model_cpu.json").read_text())
    rows += rows_for("fabric-model", "cpu-1", [("presets", fabric_drivers.model_metrics(d), "")], res / "2026-11-30_fabric_model_cpu.json",
                     CPU, "python bench/model_reproduce.py --out bench/results/2026-11-30_fabric_model_cpu.json")
    f = res / HOST_COST_FILE
    for i, per in enumerate(host_cost_runs(f)):
        rows += rows_for("runtime-host-cost", f"cpu-{i + 1}", list((c, m, "") for c, m in per.items()), f, CPU,
                         "python bench/runtime_host_cost.py")
    for r in rows:
        if r["scenario"] == "runtime-host-cost":
            r["note"] = f"{r['note']}; {HOST_COST_MEAN_NOTE}"
    f = res / "2026-11-30_h200x2_run1" / "proxy_micro.jsonl"
    per_mode = proxy_drivers.proxy_metrics([json.loads(x) for x in f.read_text().splitlines() if x.strip()])
    rows += rows_for("proxy-fences", "run1", list((c, m, "") for c, m in per_mode.items()), f, H200,
                     "python bench/proxy_micro.py", world=1)
    table = ROOT / "bench/results/summary.csv"
    # run again it appended every row a second time, with the first import's stamps and quantiles (those the
    # --fix-* rewrites corrected): a launch already in the table is refused, nothing appended
    there = {(r["scenario"], r["launch"]) for r in R.read_rows(table)}
    again = sorted({(r["scenario"], r["launch"]) for r in rows} & there)
    if again:
        print(f"{len(again)} launch(es) already in {table} (e.g. {again[0][0]} {again[0][1]}): nothing imported",
              file=sys.stderr)
        return 1
    R.append_rows(table, rows)
    print(f"{len(rows)} rows imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
