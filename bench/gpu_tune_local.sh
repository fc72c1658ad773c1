#!/usr/bin/env bash
# The tuner's local backend on the H200 node (2 GPUs), host-staged fabric (NCCL_P2P_DISABLE=1):
#   1. tune qwen3-30b at S=1024 (6 trials) then S=4096 (12 trials, stopped at 120 s); every trial is a subprocess
#      `moetune bench ep --world 2 --backend nccl ... --json` with the knobs' environment;
#   2. measure the tuned setting and the policy default side by side in ONE run (same processes,
#      interleaved rounds) for each bucket, and print the ratio.
# Writes $OUT/tune_local.jsonl (one line per study, one per side-by-side) plus the raw tune JSON and the
# studies database. Budget: < 6 minutes on the node.
#
#   OUT=/tmp/out bash bench/gpu_tune_local.sh
set -uo pipefail
# The lead's device preamble (carried wheels + moetune into /tmp/site), when present.
if [ -f bench/device_env.sh ]; then source bench/device_env.sh || exit 1; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_P2P_DISABLE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-./bench_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WORK=$(mktemp -d -t moetune-gpu-tune.XXXXXX) || exit 1
trap 'rm -rf "$WORK"' EXIT  # scratch databases and logs; what matters is written to $OUT
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
moetune() { "$PY" -c "from moetune.tuner.cli import main; main()" "$@"; }

missing=$("$PY" - <<'EOF'
import importlib.util
need = ["optuna", "sqlalchemy", "alembic", "msgspec", "typer", "rich", "moetune.tuner.search.study", "moetune.tuner.fabric.discovery",
        "moetune.tuner.store.store", "moetune.runtime"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "missing Python modules: $missing (bring wheels: optuna alembic sqlalchemy greenlet colorlog mako msgspec; install moetune with pip -e .)"
  exit 2
fi
nvidia-smi -L || true
"$PY" -c "import torch; assert torch.cuda.device_count() >= 2, 'need 2 GPUs'" || exit 2

# Probe: one bench run (how long a trial takes; fails fast if the runtime is broken).
t=$(date +%s)
if ! moetune bench ep --world 2 --backend nccl --model qwen3-30b --tokens 4096 --json > "$WORK/probe.json" 2> "$WORK/probe.err"; then
  echo "probe bench run failed:"; tail -20 "$WORK/probe.err"; exit 1
fi
echo "probe: one bench ep run took $(( $(date +%s) - t )) s"

# bench/policies/host_staged_h200.toml: a user policy that fixes the knobs the collective runtime ignores.
common=(--model qwen3-30b --backend local --family host_staged --policy bench/policies/host_staged_h200.toml
        --repeats 1 --trial-timeout 60 --world 2 --comm nccl
        --db "$WORK/moetune.db" --storage "sqlite:///$WORK/studies.db" --json --seed 0)
# The smaller bucket first: its study (same storage) warm-starts S=4096 and prunes what it found bad.
moetune tune "${common[@]}" --tokens 1024 --trials 6 --timeout 60 > "$OUT/tune_1024.json" 2> "$WORK/tune_1024.err" \
  || { echo "tune S=1024 failed"; tail -30 "$WORK/tune_1024.err"; }
echo "tuned S=1024 at $(elapsed) s"
moetune tune "${common[@]}" --tokens 4096 --trials 12 --timeout 120 > "$OUT/tune_4096.json" 2> "$WORK/tune_4096.err" \
  || { echo "tune S=4096 failed"; tail -30 "$WORK/tune_4096.err"; }
echo "tuned S=4096 at $(elapsed) s"

"$PY" - "$OUT" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
with (out / "tune_local.jsonl").open("a") as f:
    for name in ("tune_4096.json", "tune_1024.json"):
        p = out / name
        try:
            rows = json.loads(p.read_text())
        except Exception as e:
            f.write(json.dumps({"kind": "tune", "file": name, "error": str(e)}) + "\n")
            continue
        for r in rows:
            f.write(json.dumps(dict(r, kind="tune")) + "\n")
EOF

for S in 4096 1024; do
  if [ "$(elapsed)" -gt 290 ]; then echo "skipping side-by-side S=$S: time budget"; continue; fi
  "$PY" bench/tune_side_by_side.py --tuned-json "$OUT/tune_$S.json" --model qwen3-30b --tokens "$S" \
    --family host_staged --world 2 --rounds 10 --iters 10 --out "$OUT/tune_local.jsonl" 2> "$WORK/sbs_$S.err" \
    || { echo "side-by-side S=$S failed"; tail -20 "$WORK/sbs_$S.err"; }
done

moetune tune show --storage "sqlite:///$WORK/studies.db" --json > "$OUT/studies.json" 2>/dev/null || true
"$PY" - "$OUT" <<'EOF'
import json, sys, pathlib
rows = [json.loads(l) for l in (pathlib.Path(sys.argv[1]) / "tune_local.jsonl").read_text().splitlines() if l.strip()]
print("\n| S | trials ok/fail | tune: default µs | tune: best µs | side by side: default µs | tuned µs | ratio | method |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    if r.get("kind") != "tune" or "error" in r:
        continue
    s = next((x for x in rows if x.get("kind") == "side_by_side" and x["tokens"] == r["tokens"]), {})
    f = lambda v: "-" if v is None else f"{v:,.1f}"
    print(f"| {r['tokens']} | {r['complete']}/{r['failed']} | {f(r.get('default_us'))} | {f(r.get('best_us'))} | "
          f"{f(s.get('default_us'))} | {f(s.get('tuned_us'))} | {s.get('speedup', float('nan')):.2f}× | {s.get('method', '-')} |")
EOF
echo "total $(elapsed) s"
