#!/usr/bin/env bash
# Run 29 on the 2x H200 node (~4 min): host_staged receiving on SMs (MOETUNE_HS_RECV_SMS=N: one kernel per piece
# waits for the slot, copies it from host memory and hands it back) against the copy engine (wait kernel, then
# a copy-engine copy: run 22's timeline shows ~10 us between the two, per piece). The transport's GPU test both
# ways, then Qwen3-30B S=4096 host-staged round trips, eager and replayed from a CUDA graph, in two launches.
# Measured at commit "host_staged: MOETUNE_HS_RECV_SMS=N ..."; removed in the commit after its results (slower).
#   source bench/device_env.sh; bash bench/gpu_run29.sh        -> $OUT/run29.tgz
set -uo pipefail
RUN=run29 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 90 tests/test_runtime_gpu.py -k host_staged
MOETUNE_HS_RECV_SMS=32 GPU_LOG=gpu_tests_sm_recv gpu_tests 90 tests/test_runtime_gpu.py -k host_staged
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"; SM="MOETUNE_HS_RECV_SMS=32"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512"
C="$C;dense|$F,chunk_tokens=1024|$SM;dense|$F,chunk_tokens=512|$SM;dense|$F,chunk_tokens=256|$SM;dense|$F,chunk_tokens=128|$SM"
C="$C;dense|pipeline_depth=1|$SM;dense|$F,chunk_tokens=256|$SM MOETUNE_HS_WAIT=memop"
hs_launch a 150 "$C" EP_ARGS=--cuda-graph
SM64="MOETUNE_HS_RECV_SMS=64"
C2="dense|pipeline_depth=1|$N;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=512|$SM64;dense|$F,chunk_tokens=256|$SM64"
C2="$C2;dense|$F,chunk_tokens=256|MOETUNE_HS_RECV_SMS=16"
hs_launch b 90 "$C2" EP_ARGS=--cuda-graph
finish
