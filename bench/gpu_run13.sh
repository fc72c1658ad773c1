#!/usr/bin/env bash
# Run 13 on the 2x H200 node (one command, ~5 min): the grid plan kernel (csrc/ep_pack.cu) against the one-CTA plan
# and the torch path (tests), the EP buffer's kernels timed from CUDA graphs (bench/ep_kernels.py), the one-sided
# GPU tests, and `moetune bench ep` over nvlink and the collective at S=128/1024/16384, plus nvlink at S=16384 with
# the one-CTA plan forced (MOETUNE_PLAN_MODE=1) side by side. Results in $OUT/run13.tgz.
#   source bench/device_env.sh; bash bench/gpu_run13.sh
set -uo pipefail
RUN=run13 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
build_csrc
PT=""; python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout=150"
stage tests 240 python3 -m pytest tests/test_gpu_pack.py tests/test_gpu_onesided.py -q -rA -p no:cacheprovider $PT \
  --junitxml="$R/gpu_tests.xml" > "$R/gpu_tests.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$R/gpu_tests.log" | tail -8
stage kernels 120 python3 bench/ep_kernels.py --out "$R" > "$R/ep_kernels.txt" 2>&1
cat "$R/ep_kernels.txt"
mkdir -p "$R/auto" "$R/one_cta"
stage bench_ep 200 python3 bench/onesided_bench_ep.py --out "$R/auto" --timeout 190 --iters 20 --warmup 5 --no-verify \
  --variants nvlink,collective --tokens 128,1024,16384 > "$R/auto/table.txt" 2>&1
tail -13 "$R/auto/table.txt"
MOETUNE_PLAN_MODE=1 stage bench_ep_one_cta 100 python3 bench/onesided_bench_ep.py --out "$R/one_cta" --timeout 90 \
  --iters 20 --warmup 5 --no-verify --variants nvlink --tokens 16384 > "$R/one_cta/table.txt" 2>&1
tail -3 "$R/one_cta/table.txt"
finish
