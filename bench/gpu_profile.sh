#!/usr/bin/env bash
# The bring-up flow on the GPU node, then a host-staged NCCL settings probe. One command:
#   source bench/device_env.sh; OUT=... bash bench/gpu_profile.sh
# PROFILE_TIMEOUT (s, default 360) bounds the bring-up. Writes $OUT/profile/{moetune.db,report/,profile.json,profile.log} and $OUT/host_staged.jsonl.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-./bench_out}; mkdir -p "$OUT/profile"
export MOETUNE_HOME="$OUT/profile"
# PLAN=bench/plans/h200x2.toml (the reduced plan, the default here) or PLAN= (empty: the default plan)
PLAN=${PLAN-bench/plans/h200x2.toml}
t0=$SECONDS
timeout "${PROFILE_TIMEOUT:-360}" moetune profile ${PLAN:+--plan "$PLAN"} --json > "$OUT/profile/profile.json" 2> "$OUT/profile/profile.log"
echo "profile rc=$? in $((SECONDS - t0)) s"
tail -5 "$OUT/profile/profile.log"
python3 - "$OUT/profile/profile.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no profile summary:", e); raise SystemExit(0)
print(f"{'family':12s} {'model':10s} {'S':>6s} {'default us':>11s} {'tuned us':>10s} {'speedup':>8s}  knobs")
for r in d["profiles"]:
    sp = r["default_us"] / r["tuned_us"] if r["tuned_us"] else float("nan")
    print(f"{r['family']:12s} {r['model']:10s} {r['tokens']:6d} {r['default_us']:11.0f} {r['tuned_us']:10.0f} {sp:8.2f}  {r['knobs']}")
print("calibration:", d.get("calibration"))
PY
# Host-staged: does NCCL's staging configuration change the fp8 + pipelining ratio? (information for the tuner)
[ -n "${SKIP_NCCL_ENV:-}" ] && exit 0
OUT="$OUT" ENVSETS=";NCCL_MIN_NCHANNELS=8;NCCL_BUFFSIZE=16777216;NCCL_MIN_NCHANNELS=8 NCCL_BUFFSIZE=16777216" \
  bash "$(dirname "$0")/gpu_host_staged.sh"
