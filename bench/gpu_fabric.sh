#!/usr/bin/env bash
# Fabric discovery on the GPU node (issue 3): capture the node, show its facts, time live discovery.
#
#   OUT=/some/dir bash bench/gpu_fabric.sh          (default OUT=./bench_out)
#
# Writes:
#   $OUT/h200x2-capture.tgz   the capture (`moetune fabric capture`), tarred because only two folder
#                             levels come back; commit it as tests/captures/h200x2/ :
#                             mkdir -p tests/captures/h200x2 && tar -xzf h200x2-capture.tgz -C tests/captures/h200x2 --strip-components=1
#   $OUT/fabric_h200.json     `moetune fabric show --json`
#   $OUT/gpu_fabric.jsonl     one JSON line per timing / check
# and prints a short table last. Exit status 1 when a check fails.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/bench_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

# Use the installed `moetune` when there is one; otherwise import the source tree through a tiny shim
# (moetune is a namespace package whose subpackages are this repository's folders).
if ! "$PY" -c "import moetune.tuner.fabric.discovery" 2>/dev/null; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/moetune"
  for d in tuner runtime policies migrations csrc; do ln -s "$ROOT/$d" "$SHIM/moetune/$d"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('msgspec', 'typer', 'rich') if u.find_spec(m) is None))")
if [ -n "$missing" ]; then
  echo "gpu_fabric: python modules missing on this node: $missing (pip install them, or the project)" >&2
  exit 2
fi
moetune() { "$PY" -c "import sys; from moetune.tuner.cli import main; sys.argv[0] = 'moetune'; main()" "$@"; }

rm -rf "$OUT/h200x2-capture" "$OUT/h200x2-capture.tgz"
t0=$(date +%s.%N)
moetune fabric capture "$OUT/h200x2-capture" --json > "$OUT/capture.json"; rc_capture=$?
t1=$(date +%s.%N)
moetune fabric show --json > "$OUT/fabric_h200.json"; rc_show=$?
t2=$(date +%s.%N)
if [ -d "$OUT/h200x2-capture" ]; then
  tar -C "$OUT" -czf "$OUT/h200x2-capture.tgz" h200x2-capture && rm -rf "$OUT/h200x2-capture"
fi

"$PY" - "$OUT" "$rc_capture" "$rc_show" "$t0" "$t1" "$t2" <<'EOF'
import json, statistics, subprocess, sys, time
out, rc_capture, rc_show, t0, t1, t2 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(float, sys.argv[4:])
rows = []

def put(**kw):
    kw.setdefault("date", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    rows.append(kw)

put(check="cli fabric capture (wall, incl. python start)", seconds=round(t1 - t0, 3), ok=rc_capture == 0)
put(check="cli fabric show --json (wall, incl. python start)", seconds=round(t2 - t1, 3), ok=rc_show == 0)

t = time.perf_counter()
from moetune.tuner.fabric.discovery import discover  # noqa: E402
imp = time.perf_counter() - t
put(check="import moetune.tuner.fabric.discovery", seconds=round(imp, 3), ok=True)
times, f = [], None
for _ in range(5):
    t = time.perf_counter()
    f = discover()
    times.append(time.perf_counter() - t)
put(check="live discovery (5 runs)", seconds=round(statistics.median(times), 3), max_s=round(max(times), 3),
    ok=max(times) < 2.0, tools=f.tools)
fams = sorted(f.transport_names)
put(check="transport families", families=fams, ok=fams == sorted(["nvlink", "host_staged", "collective"]),
    reasons={t.name: t.reason for t in f.transports})
put(check="facts", gpus=f.gpu_count, model=f.gpu_model, fingerprint=f.fingerprint,
    nvlinks=[len(g.active_links) for g in f.gpus], software=f.software, ok=f.gpu_count >= 1)
try:
    import tarfile, tempfile, pathlib
    with tempfile.TemporaryDirectory() as d:
        with tarfile.open(f"{out}/h200x2-capture.tgz") as tf:
            tf.extractall(d, filter="data")
        g = discover(pathlib.Path(d) / "h200x2-capture")
        put(check="capture reads back to the live fingerprint", capture=g.fingerprint, live=f.fingerprint,
            ok=g.fingerprint == f.fingerprint)
except Exception as e:  # report, never hide
    put(check="capture reads back", ok=False, error=repr(e))
try:
    smi = subprocess.run(["nvidia-smi", "nvlink", "-s"], capture_output=True, text=True, timeout=10).stdout
    put(check="nvidia-smi nvlink -s (first lines)", ok=True, text=smi.splitlines()[:4])
except Exception as e:
    put(check="nvidia-smi nvlink -s", ok=False, error=repr(e))

with open(f"{out}/gpu_fabric.jsonl", "w") as fh:
    for r in rows:
        fh.write(json.dumps(r) + "\n")
print()
print(f"{'check':55s} {'ok':4s} value")
for r in rows:
    val = r.get("seconds", r.get("families", r.get("fingerprint", r.get("error", ""))))
    extra = f" (max {r['max_s']} s)" if "max_s" in r else ""
    print(f"{r['check'][:55]:55s} {'yes' if r['ok'] else 'NO':4s} {val}{extra}")
sys.exit(0 if all(r["ok"] for r in rows) else 1)
EOF
