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
gpu_tests 100 tests/test_runtime_gpu.py -k host_staged
for e in "" "CUDA_DEVICE_MAX_CONNECTIONS=32" "MOETUNE_HS_WAIT=memop" "CUDA_DEVICE_MAX_CONNECTIONS=32 MOETUNE_HS_WAIT=memop"; do
  stage "micro $e" 60 env $e python3 bench/host_staged_micro.py --out "$R" --label "${e:-default}" 2>> "$R/micro_err.txt" | cut -c1-400
done
C="dense|pipeline_depth=1;dense|compression=fp8_e4m3,pipeline_depth=2;dense|compression=fp8_e4m3,pipeline_depth=4;dense|pipeline_depth=4"
hs_launch . 90 "$C" CUDA_DEVICE_MAX_CONNECTIONS=32
finish
