"""Time fabric discovery on this machine (live and from the test captures); one JSON line to stdout.

    python bench/fabric_discovery_cpu.py >> bench/results/fabric_discovery_cpu.jsonl
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CAPTURES = Path(__file__).resolve().parents[1] / "tests" / "captures"


def main() -> None:
    t = time.perf_counter()
    from moetune.tuner.fabric.discovery import discover

    imp = time.perf_counter() - t
    live = []
    f = None
    for _ in range(20):
        t = time.perf_counter()
        f = discover()
        live.append(time.perf_counter() - t)
    cli = []
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "fabric", "show", "--json"], capture_output=True,
                       check=False)
        cli.append(time.perf_counter() - t)
    caps = {}
    for name in ("dgx-h100", "aws-p5", "perlmutter"):
        one = []
        for _ in range(20):  # each call timed: the scenario stores this as a median, as the live case's is
            t = time.perf_counter()
            discover(CAPTURES / name)
            one.append(time.perf_counter() - t)
        caps[name] = round(statistics.median(one), 4)
    print(json.dumps({
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hardware": f"{os.cpu_count()} CPU cores, {platform.platform()}",
        "command": "python bench/fabric_discovery_cpu.py",
        "import_s": round(imp, 4),
        "live_discover_median_s": round(statistics.median(live), 4),
        "live_discover_max_s": round(max(live), 4),
        "cli_fabric_show_json_wall_median_s": round(statistics.median(cli), 3),
        "capture_discover_s": caps,
        "gpus": f.gpu_count if f else None,
        "tools": f.tools if f else None,
    }))


if __name__ == "__main__":
    main()
