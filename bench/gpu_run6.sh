#!/usr/bin/env bash
# Run 6 on the 2x H200 node (one command, ~5 min): the packing kernels (csrc/ep_pack.cu) against the torch
# path, the one-sided GPU tests, `moetune bench ep --cuda-graph` over nvlink and the collective, and nvlink
# Qwen3-30B S=128 with the packing kernels on and off (MOETUNE_FUSED_PACK). Results in $OUT/run6.tgz.
#   source bench/device_env.sh; bash bench/gpu_run6.sh
set -uo pipefail
RUN=run6 ONESIDED_TIMEOUT_S=5; source "$(dirname "$0")/gpu_run_common.sh"
build_csrc
PT=""; python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout=150"
stage tests 200 python3 -m pytest tests/test_gpu_pack.py tests/test_gpu_onesided.py -q -rA -p no:cacheprovider $PT \
  --junitxml="$R/gpu_tests.xml" > "$R/gpu_tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$R/gpu_tests.log" | tail -16
stage bench_ep 120 python3 bench/onesided_bench_ep.py --out "$R" --timeout 110 --iters 20 --warmup 5 --no-verify \
  --variants nvlink,collective --tokens 128,1024,4096
for f in 0 1; do
  MOETUNE_FUSED_PACK=$f stage "pack$f" 60 moetune bench ep --world 2 --backend nccl --transport nvlink --model qwen3-30b \
    --tokens 128 --no-layer --iters 30 --warmup 5 --cuda-graph --json > "$R/nvlink_s128_fused$f.json"
  python3 -c "import json,sys; r=json.loads([l for l in open(sys.argv[1]) if l.startswith('{')][-1]); print({k: round(r[k]['median'],1) for k in ('dispatch_us','combine_us','roundtrip_us','graph_roundtrip_us','dispatch_host_us') if r.get(k)})" "$R/nvlink_s128_fused$f.json"
done
finish
