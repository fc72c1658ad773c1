#!/usr/bin/env bash
# Run 20 on the 2x H200 node (~4 min): why run 19's pipelined host_staged cases were slower than unpipelined.
# The GPU test of the transport; bench/host_staged_micro.py (copy-engine bandwidth, then the transport's
# gather cut into 1/2/4/8 chunks) under the default hardware queues, CUDA_DEVICE_MAX_CONNECTIONS=32 and the
# driver's stream waits (MOETUNE_HS_WAIT=memop); then four round-trip cases with 32 connections.
#   source bench/device_env.sh; bash bench/gpu_run20.sh        -> $OUT/run20.tgz
set -uo pipefail
RUN=run20 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
stage tests 100 python3 -m pytest tests/test_runtime_gpu.py -k host_staged -q -rA -p no:cacheprovider > "$R/gpu_tests.log" 2>&1
grep -E "FAILED|ERROR|passed|failed|Error" "$R/gpu_tests.log" | tail -12
for e in "" "CUDA_DEVICE_MAX_CONNECTIONS=32" "MOETUNE_HS_WAIT=memop" "CUDA_DEVICE_MAX_CONNECTIONS=32 MOETUNE_HS_WAIT=memop"; do
  stage "micro $e" 60 env $e python3 bench/host_staged_micro.py --out "$R" --label "${e:-default}" 2>> "$R/micro_err.txt" | cut -c1-400
done
C="dense|pipeline_depth=1;dense|compression=fp8_e4m3,pipeline_depth=2;dense|compression=fp8_e4m3,pipeline_depth=4;dense|pipeline_depth=4"
stage host_staged 90 env CUDA_DEVICE_MAX_CONNECTIONS=32 OUT="$R" ENVSETS= CASES="$C" bash bench/gpu_host_staged.sh > "$R/table.txt" 2>&1
cat "$R/table.txt"
finish
