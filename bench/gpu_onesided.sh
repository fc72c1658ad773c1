#!/usr/bin/env bash
# One command for the GPU box (2x H200): build csrc/, run the GPU tests (exchange correctness, EPBuffer and
# the MoE layer vs the dense reference on nvlink/proxy, timeout, race), the proxy microbenchmark (Perseus
# Fig. 5 grid), the exchange-level EP benchmark vs NCCL, and `moetune bench ep` over nvlink / proxy /
# collective / plain for Qwen3-30B and DeepSeek-V3 at S in {128, 1024, 16384}. Every stage is guarded
# (a failing stage is logged and the next one runs). Results: $OUT/*.jsonl (default ./bench_out); the
# issue-6 target checks and compact tables are printed last. Budget: about 3-4 minutes.
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
export MOETUNE_CACHE="${MOETUNE_CACHE:-${TMPDIR:-/tmp}/moetune_cache}"  # outside $OUT: keep binaries out of the results
export MOETUNE_ONESIDED_TIMEOUT_S="${MOETUNE_ONESIDED_TIMEOUT_S:-5}"  # healthy waits are µs..ms; a failure costs one timeout
PY="${PYTHON:-python3}"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
QUICKARG=""
[ -n "${QUICK:-}" ] && QUICKARG="--quick"
# import moetune from this checkout even when it is not installed
if ! "$PY" -c "import moetune.runtime" 2>/dev/null; then
  SHIM="${TMPDIR:-/tmp}/moetune_pkgshim_$$"
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
  stage dry-bench-ep 60 "$PY" bench/onesided_bench_ep.py --dry-run --out "$OUT"
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

stage build 90 "$PY" -c "
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
  stage tests 200 "${TESTCMD[@]}"
else
stage tests 200 "$PY" -m pytest tests/test_gpu_onesided.py -q -rA -p no:cacheprovider $PT_TIMEOUT \
  --junitxml="$OUT/gpu_tests.xml"
fi

# diagnostic, not a test: the proxy exchange with run 1's asynchronous calls (MOETUNE_PROXY_HOST_WAIT=0
# semantics). If this stalls while the tests above pass, the host-completed calls are what fixed run 1.
stage proxy_async_diag 45 "$PY" -c "
import json, os
from moetune.runtime.testing.selftest import spawn_world, check_exchange_worker
v = ['fence_mode=proxy_drain,signalling=coupled,qps_per_pe=1|hostwait=0',
     'fence_mode=nic_ordered,signalling=decoupled,qps_per_pe=2,qp_mapping=peer_hash,chunk_tokens=16|hostwait=0']
res = spawn_world(check_exchange_worker, 2, dict(transport='proxy', variants=v, iters=10), timeout_s=40)
with open(os.path.join(os.environ['OUT'], 'proxy_async_diag.jsonl'), 'w') as f:
    for rank, part in enumerate(res):
        for rec in (part if isinstance(part, list) else [part]):
            rec = dict(rec, rank=rank, test='proxy_async_diag'); f.write(json.dumps(rec, default=str) + chr(10))
            err = str(rec.get('error') or '').strip().splitlines()
            print('rank', rank, rec.get('knobs'), 'iters', rec.get('iters'), 'mismatch', rec.get('mismatch_iters'), 'error:', err[-1][:300] if err else None)
"

stage micro 40 "$PY" bench/proxy_micro.py --out "$OUT" --iters 12 --race-trials 30 $QUICKARG

stage ep 70 "$PY" bench/onesided_ep.py --out "$OUT" --timeout 65 --iters 15 $QUICKARG

# `moetune bench ep` itself (the CLI), as the issue names it: nvlink and proxy with --verify
if command -v moetune >/dev/null 2>&1; then MT=(moetune); else MT=("$PY" -c "import sys; from moetune.tuner.cli import main; sys.argv[0] = 'moetune'; main()"); fi
stage cli 50 bash -c '
for t in nvlink proxy; do
  "$@" bench ep --world 2 --backend nccl --transport $t --model qwen3-30b --tokens 128 --verify --iters 10 --warmup 3 --json \
    > "$OUT/cli_bench_ep_$t.json" || echo "cli $t failed rc=$?"
  cat "$OUT/cli_bench_ep_$t.json"; echo
done' _ "${MT[@]}"

# the grid: the same bench_case as `moetune bench ep`, every case in one launch
stage bench_ep 90 "$PY" bench/onesided_bench_ep.py --out "$OUT" --timeout 85 --iters 10 --warmup 3

echo
echo "=== stages"; printf '  %s\n' "${STATUS[@]}"
"$PY" bench/onesided_report.py "$OUT" > "$OUT/report.md" 2>&1 || echo "report failed"
echo "=== EP exchange table (rank 0; µs; ok = equal to NCCL)"
"$PY" - <<'EOF'
import json, os, sys
sys.path.insert(0, "bench")
from onesided_ep import summarize
p = os.path.join(os.environ["OUT"], "onesided_ep.jsonl")
if os.path.exists(p):
    print("\n".join(summarize([json.loads(l) for l in open(p)])))
EOF
echo "=== moetune bench ep grid"
"$PY" - <<'EOF'
import json, os, sys
sys.path.insert(0, "bench")
from onesided_bench_ep import table
p = os.path.join(os.environ["OUT"], "bench_ep_onesided.jsonl")
if os.path.exists(p):
    print("\n".join(table([json.loads(l) for l in open(p) if l.strip()])))
EOF
echo "=== $OUT/report.md: GPU tests and issue-6 targets"
sed -n '/^## GPU tests/,/^## EP exchange/p' "$OUT/report.md" | grep -v '^## EP exchange' | head -30
sed -n '/^## Targets/,/^## Proxy micro/p' "$OUT/report.md" | grep -v '^## Proxy micro'
