#!/usr/bin/env bash
# Run 28 on the 2x H200 node (~5 min): host_staged with two copy streams per direction (consecutive slots
# alternate, so one piece's wait and flag overlap the next piece's copy); MOETUNE_HS_STREAMS=1 is the one-stream
# path of runs 26-27, for comparison in the same launch. The transport's GPU test, then Qwen3-30B S=4096
# host-staged round trips, eager and replayed from a CUDA graph (--cuda-graph), in two launches.
# Measured at commit "host_staged: two copy streams per direction"; the next commit removed them (slower).
#   source bench/device_env.sh; bash bench/gpu_run28.sh        -> $OUT/run28.tgz
set -uo pipefail
RUN=run28 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 90 tests/test_runtime_gpu.py -k host_staged
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"; S1="MOETUNE_HS_STREAMS=1"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|$F,chunk_tokens=1024|$S1"
C="$C;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=256;dense|$F,chunk_tokens=128"
C="$C;dense|$F,pipeline_depth=2,channels=2,chunk_tokens=512;dense|chunk_tokens=512"
hs_launch a 150 "$C" EP_ARGS=--cuda-graph
C2="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|$F,chunk_tokens=512|$S1;dense|$F,chunk_tokens=512"
C2="$C2;dense|$F,chunk_tokens=256;dense|$F,chunk_tokens=1024"
hs_launch b 100 "$C2" EP_ARGS=--cuda-graph
finish
