#!/usr/bin/env bash
# Run 5 on the 2x H200 node (one command, ~8 min): GPU tests of the one-sided transports (EPBuffer's
# device-resident layout, CUDA-graph replays), `moetune bench ep` with --cuda-graph over nvlink and the
# collective, the default bring-up plan (report with the proxy's signalled-vs-put-only panels), and the
# host-staged fp8 + pipelining comparison under NCCL's defaults. Results in $OUT/run5.tgz.
#   source bench/device_env.sh; bash bench/gpu_run5.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOETUNE_ONESIDED_TIMEOUT_S=5
OUT=${OUT:-./bench_out}; R="$OUT/run5"; mkdir -p "$R"
t0=$SECONDS
stage() { local n=$1 t=$2; shift 2; echo "=== [$n] $(date -u +%T)"; timeout --kill-after=10 "$t" "$@"; echo "=== [$n] rc=$? at $((SECONDS - t0)) s"; }
PT=""; python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout=150"
stage tests 200 python3 -m pytest tests/test_gpu_onesided.py -q -rA -p no:cacheprovider $PT --junitxml="$R/gpu_tests.xml" > "$R/gpu_tests.log" 2>&1
tail -12 "$R/gpu_tests.log"
stage bench_ep 150 python3 bench/onesided_bench_ep.py --out "$R" --timeout 140 --iters 20 --warmup 5 --no-verify \
  --variants nvlink,collective,plain --tokens 128,1024,4096
PLAN= PROFILE_TIMEOUT=300 SKIP_NCCL_ENV=1 OUT="$R" stage profile 320 bash bench/gpu_profile.sh
ENVSETS="" OUT="$R" stage host_staged 120 bash bench/gpu_host_staged.sh
tar czf "$OUT/run5.tgz" -C "$OUT" run5 && rm -rf "$R"
echo "total $((SECONDS - t0)) s"
