"""Where a source checkout keeps the benchmark scenarios, summary.csv and BENCHMARKS.md (none when installed)."""

from __future__ import annotations

from pathlib import Path

# this file is tuner/measure/scenarios/checkout.py: three folders up is the checkout (or site-packages/moetune)
ROOT = Path(__file__).resolve().parents[3]
# The scenarios, their driver scripts (bench/*.py), summary.csv and BENCHMARKS.md belong to a source checkout: ROOT
# is one when moetune runs from it (editable install, PYTHONPATH). Installed from a wheel, ROOT is
# site-packages/moetune, which holds none of them and must never be written into.
IN_CHECKOUT = (ROOT / "pyproject.toml").is_file()
SCENARIO_DIR = ROOT / "bench" / "scenarios"
SUMMARY_CSV = ROOT / "bench" / "results" / "summary.csv"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
NOT_A_CHECKOUT = (
    "named benchmark scenarios (moetune bench list/run/summarize) need a moetune source checkout: its "
    "bench/scenarios, bench/*.py drivers, bench/results/summary.csv and BENCHMARKS.md; this moetune is installed "
    f"at {ROOT}, not run from a checkout. Clone the repository, `pip install -e .` in it and run from there "
    "(`moetune bench ep`, `bench moe` and `bench knobs` work anywhere)")
