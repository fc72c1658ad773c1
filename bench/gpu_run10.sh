#!/usr/bin/env bash
# Run 10 on the 2x H200 node (one command, ~8 min): the packing/reduce kernels against the torch path, the
# one-sided GPU tests (gathering dispatch, strided combine, reduce kernel), EPBuffer dispatch + combine from a
# CUDA graph over nvlink with the gathering dispatch on and off (MOETUNE_NVL_GATHER) against the collective,
# and the raw nvlink exchange at S=16384 with and without a busy-GPU prelude (bench/onesided_ep.py --busy-us).
# Results in $OUT/run10.tgz.
#   source bench/device_env.sh; bash bench/gpu_run10.sh
set -uo pipefail
RUN=run10 ONESIDED_TIMEOUT_S=5; source "$(dirname "$0")/gpu_run_common.sh"
build_csrc
PT=""; python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout=150"
stage tests 200 python3 -m pytest tests/test_gpu_pack.py tests/test_gpu_onesided.py -q -rA -p no:cacheprovider $PT \
  --junitxml="$R/gpu_tests.xml" > "$R/gpu_tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$R/gpu_tests.log" | tail -40
for g in 1 0; do
  mkdir -p "$R/gather$g"
  MOETUNE_NVL_GATHER=$g stage "bench_ep_gather$g" 110 python3 bench/onesided_bench_ep.py --out "$R/gather$g" --timeout 100 \
    --iters 30 --warmup 5 --no-verify --variants nvlink,collective --tokens 128,1024 > "$R/gather$g/table.txt" 2>&1
  tail -8 "$R/gather$g/table.txt"
done
V="nvlink:signalling=decoupled,num_sms=32|fused;nvlink:signalling=decoupled,num_sms=64|fused;nvlink:signalling=coupled,num_sms=64|fused"
for b in 400 0; do
  mkdir -p "$R/busy$b"
  stage "raw_busy$b" 100 python3 bench/onesided_ep.py --out "$R/busy$b" --timeout 90 --iters 30 --warmup 5 \
    --models qwen3-30b,deepseek-v3 --tokens 16384 --transports nvlink --no-graphs --variants "$V" --busy-us $b \
    > "$R/busy$b/table.txt" 2>&1
  tail -12 "$R/busy$b/table.txt"
done
finish
