#!/usr/bin/env bash
# Run 31 on the 2x H200 node (~2.5 min): a sender waits once per ring (every slot empty) before a block's first
# piece, then fills up to a ring of pieces back to back (MOETUNE_HS_SENDER_WAIT=piece: a wait per piece, as in
# runs 26-30), with rings of 2 and 8 slots (MOETUNE_HS_SLOTS). The transport's GPU test with both ring sizes, then
# Qwen3-30B S=4096 host-staged round trips, eager and replayed from a CUDA graph, side by side in one launch.
# Measured at commit 6b5022a (branch hs-ring-wait); the code was reverted after its results (wrong with 2 slots).
#   source bench/device_env.sh; bash bench/gpu_run31.sh        -> $OUT/run31.tgz
set -uo pipefail
RUN=run31 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 60 tests/test_runtime_gpu.py -k host_staged
MOETUNE_HS_SLOTS=8 GPU_LOG=gpu_tests_8_slots gpu_tests 60 tests/test_runtime_gpu.py -k host_staged
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"; S8="MOETUNE_HS_SLOTS=8"
C="dense|pipeline_depth=1|$N;dense|$F,chunk_tokens=1024|MOETUNE_HS_SENDER_WAIT=piece;dense|$F,chunk_tokens=1024"
C="$C;dense|$F,chunk_tokens=1024|$S8;dense|$F,chunk_tokens=512|$S8;dense|$F,chunk_tokens=256|$S8"
C="$C;dense|$F,chunk_tokens=256|MOETUNE_HS_SLOTS=16 MOETUNE_HS_WAIT=memop"
hs_launch a 110 "$C" EP_ARGS=--cuda-graph
finish
