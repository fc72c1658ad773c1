#!/usr/bin/env bash
# One command for the GPU box (2x H200): build csrc/, run the GPU tests, the proxy microbenchmark and
# the EP benchmark. Every stage is guarded (a failing stage is logged and the next one runs).
# Results: $OUT/*.jsonl (default ./bench_out), a compact table printed last. Budget: < 7 minutes.
#
#   bash bench/gpu_onesided.sh            # full run
#   bash bench/gpu_onesided.sh --dry-run  # no CUDA: parse/import/plan only
#   QUICK=1 bash bench/gpu_onesided.sh    # fewer points
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-./bench_out}"
mkdir -p "$OUT"
export OUT
export MOETUNE_CACHE="${MOETUNE_CACHE:-$OUT/.cache}"
export MOETUNE_ONESIDED_TIMEOUT_S="${MOETUNE_ONESIDED_TIMEOUT_S:-10}"
PY="${PYTHON:-python3}"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
QUICKARG=""
[ -n "${QUICK:-}" ] && QUICKARG="--quick"
# import moetune from this checkout even when it is not installed
if ! "$PY" -c "import moetune.runtime" 2>/dev/null; then
  SHIM="$OUT/.pkgshim"
  mkdir -p "$SHIM/moetune"
  for d in runtime tuner csrc policies migrations; do ln -sfn "$PWD/$d" "$SHIM/moetune/$d"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
STATUS=()
stage() {  # stage NAME TIMEOUT_S CMD...
  local name="$1" t="$2"; shift 2
  echo "=== [$name] $(date -u +%H:%M:%S) $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$t" "$@"
  local rc=$?
  echo "=== [$name] rc=$rc in $((SECONDS - t0)) s"
  STATUS+=("$name rc=$rc $((SECONDS - t0))s")
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$OUT/stages.jsonl"
}
: > "$OUT/stages.jsonl"

if [ "$DRY" = 1 ]; then
  stage dry-import 60 "$PY" -c "import moetune.runtime.transports.onesided as o, moetune.runtime.csrc_build as b; print({k: tuple(v.availability()) for k, v in o.ONESIDED_TRANSPORTS.items()})"
  stage dry-micro 60 "$PY" bench/proxy_micro.py --dry-run --out "$OUT"
  stage dry-ep 60 "$PY" bench/onesided_ep.py --dry-run --out "$OUT"
  printf '%s\n' "${STATUS[@]}"
  exit 0
fi

{
  echo "date: $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>&1 | head -5; "$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  nvcc --version | tail -2
} | tee "$OUT/env.txt"

stage preflight 30 "$PY" -c "
import importlib
for m in ('torch', 'msgspec', 'numpy', 'pytest', 'pytest_timeout', 'moetune.runtime'):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, '__version__', 'ok'))
    except Exception as e:
        print(m, 'MISSING:', e)
"
PT_TIMEOUT=""
"$PY" -c "import pytest_timeout" 2>/dev/null && PT_TIMEOUT="--timeout=140"
if ! "$PY" -c "import pytest" 2>/dev/null; then
  TESTCMD=("$PY" tests/test_gpu_onesided.py)   # standalone runner (pytest absent)
else
  TESTCMD=()
fi

stage build 60 "$PY" -c "
import json, os, time
from moetune.runtime import csrc_build as b
t = time.time()
try:
    info = b.build(verbose=True)
    print('library:', info.path, 'built' if info.built else 'cached', f'{time.time() - t:.1f} s')
    ok, why = b.availability()
    print('availability:', ok, why)
    rec = dict(stage='build', path=str(info.path), built=info.built, seconds=time.time() - t, ok=ok, why=why, log=info.log[-4000:])
except Exception as e:
    print('BUILD FAILED:', e); rec = dict(stage='build', ok=False, error=str(e)[-6000:])
open(os.path.join(os.environ['OUT'], 'build.jsonl'), 'w').write(json.dumps(rec) + '\n')
raise SystemExit(0 if rec.get('ok') else 1)
"

if [ ${#TESTCMD[@]} -gt 0 ]; then
  stage tests 150 "${TESTCMD[@]}"
else
stage tests 150 "$PY" -m pytest tests/test_gpu_onesided.py -q -rA -p no:cacheprovider $PT_TIMEOUT \
  --junitxml="$OUT/gpu_tests.xml"
fi

stage micro 60 "$PY" bench/proxy_micro.py --out "$OUT" $QUICKARG

stage ep 140 "$PY" bench/onesided_ep.py --out "$OUT" --timeout 130 $QUICKARG

echo
echo "=== stages"; printf '  %s\n' "${STATUS[@]}"
echo "=== gpu test results (from $OUT/gpu_onesided_tests.jsonl)"
"$PY" - <<'EOF'
import json, os
p = os.path.join(os.environ["OUT"], "gpu_onesided_tests.jsonl")
if os.path.exists(p):
    for line in open(p):
        r = json.loads(line)
        keys = ("test", "transport", "knobs", "iters", "mismatch_iters", "poison_overwritten_iters", "qp_mapping",
                "stale_transfers", "trials", "raised", "seconds", "error")
        print("  " + " ".join(f"{k}={str(r[k])[:90]!s}" for k in keys if k in r and r[k] is not None))
for name in ("proxy_micro.jsonl", "onesided_ep.jsonl"):
    print(f"=== {name}: {sum(1 for _ in open(os.path.join(os.environ['OUT'], name))) if os.path.exists(os.path.join(os.environ['OUT'], name)) else 0} rows")
p = os.path.join(os.environ["OUT"], "onesided_ep.jsonl")
if os.path.exists(p):
    import sys
    sys.path.insert(0, "bench")
    from onesided_ep import summarize
    print("\n".join(summarize([json.loads(l) for l in open(p)])))
p = os.path.join(os.environ["OUT"], "proxy_micro.jsonl")
if os.path.exists(p):
    print("proxy micro @ 96 x 16 KB:")
    for l in open(p):
        r = json.loads(l)
        if r.get("bench") == "proxy_micro" and r["concurrency"] == 96 and r["size"] == 16384:
            print(f"  {r['mode']:18s} {r['us_median']:9.1f} us ratio {r.get('ratio_vs_put_only', 0):.2f} issue {r['issue_us_per_op']:.2f} us/op")
        if r.get("bench") == "proxy_race":
            print(f"  race {r['qp_mapping']:12s} {r['size'] >> 10} KB: stale transfers {r['stale_transfers']} in {r['trials_with_stale']}/{r['trials']} trials")
EOF
