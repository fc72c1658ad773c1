#!/usr/bin/env bash
# Run 37 on the 2x H200 node (~3 min): run 36 again with the busy word written like every flag (run 36:
# cuStreamWriteValue64 refused CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER there, so every native case failed). Code: the
# work keeps the tensors its copies use until wait() (run 35's GPU test found the packed layout at pipeline_depth 4
# wrong), and the watchdog needs one busy word per lane (receive stream). (1) every GPU test, (2) one launch of
# Qwen3-30B S=4096 host-staged round trips, eager and replayed from a CUDA graph, the bf16 unpipelined NCCL collective
# (dense) first and last: fp8 + pipelining (depth 4, 3), spin-kernel waits, fp8 alone, bf16 on the copy engines.
#   source bench/device_env.sh; bash bench/gpu_run37.sh        -> $OUT/run37.tgz
set -uo pipefail
RUN=run37 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 150 tests -m gpu
N="dense|pipeline_depth=1|MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
C="$N;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=3;dense|$F,pipeline_depth=4|MOETUNE_HS_WAIT=kernel"
C="$C;dense|pipeline_depth=1;dense|$F,pipeline_depth=1;dense|$F,pipeline_depth=4;$N"
hs_launch a 190 "$C" EP_ARGS=--cuda-graph
finish
