#!/usr/bin/env bash
# Run 26 on the 2x H200 node (~6 min): host_staged with full/empty slot flags (constant values: capturable in a
# CUDA graph). Every GPU test (-m gpu; the transport's test now also replays captured round trips), then
# Qwen3-30B S=4096 host-staged round trips, eager and replayed from a CUDA graph (--cuda-graph), side by side in
# one launch, and the key cases again in a second launch.
#   source bench/device_env.sh; bash bench/gpu_run26.sh        -> $OUT/run26.tgz
set -uo pipefail
RUN=run26 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 200 tests -m gpu
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|chunk_tokens=512;dense|$F"
C="$C;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=256;dense|$F,chunk_tokens=128"
hs_launch a 150 "$C" EP_ARGS=--cuda-graph
C2="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=256"
hs_launch b 90 "$C2" EP_ARGS=--cuda-graph
finish
