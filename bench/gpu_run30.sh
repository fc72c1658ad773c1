#!/usr/bin/env bash
# Run 30 on the 2x H200 node (~5 min): the final code of this series (one copy stream per direction, copy-engine
# receive, full/empty flags: capturable). Every GPU test (-m gpu), then the issue-5 comparison -- Qwen3-30B S=4096
# host-staged round trips, eager and replayed from a CUDA graph (--cuda-graph) -- in two launches.
#   source bench/device_env.sh; bash bench/gpu_run30.sh        -> $OUT/run30.tgz
set -uo pipefail
RUN=run30 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 200 tests -m gpu
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|$F"
C="$C;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=1024|MOETUNE_HS_WAIT=memop"
hs_launch a 130 "$C" EP_ARGS=--cuda-graph
C2="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512"
hs_launch b 100 "$C2" EP_ARGS=--cuda-graph
finish
