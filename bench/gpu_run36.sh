#!/usr/bin/env bash
# Run 36 on the 2x H200 node (~6 min; every native host_staged case failed: cuStreamWriteValue64 refused the
# busy word's NO_MEMORY_BARRIER flag with CUDA_ERROR_INVALID_VALUE; rerun as run 37): run 35's code with two fixes: host_staged's work keeps the tensors its copies
# use until wait() (run 35's GPU test found the packed layout at pipeline_depth 4 wrong: a pipelined combine's
# expert rows were reused before the lane stream copied them), and the watchdog needs one busy word per lane
# (receive stream, written without a memory barrier) instead of two with barriers. (1) every GPU test, (2) two
# launches of Qwen3-30B S=4096 host-staged round trips, eager and replayed from a CUDA graph, each with the bf16
# unpipelined NCCL collective (dense) first and last: fp8 + pipelining (depth 4, 3), spin-kernel waits, and in
# launch a what fp8 alone and pipelining alone give.
#   source bench/device_env.sh; bash bench/gpu_run36.sh        -> $OUT/run36.tgz
set -uo pipefail
RUN=run36 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 200 tests -m gpu
N="dense|pipeline_depth=1|MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
C="$N;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=3;dense|$F,pipeline_depth=4|MOETUNE_HS_WAIT=kernel"
C="$C;dense|pipeline_depth=1;dense|pipeline_depth=4;dense|$F,pipeline_depth=1;$N"
hs_launch a 200 "$C" EP_ARGS=--cuda-graph
C2="$N;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=3;dense|$F,pipeline_depth=4|MOETUNE_HS_WAIT=kernel;$N"
hs_launch b 130 "$C2" EP_ARGS=--cuda-graph
finish
