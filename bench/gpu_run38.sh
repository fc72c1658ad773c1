#!/usr/bin/env bash
# Run 38 on the 2x H200 node (~2 min, the session's last device time): the watchdog without the busy word where an
# exchange also sends to every peer it receives from (a lost peer shows as a full slot), plus a heartbeat per rank
# for a peer that dies mid-exchange. (1) the host_staged GPU test (now also a peer whose heartbeat stops), (2) one
# launch of Qwen3-30B S=4096 host-staged round trips replayed from a CUDA graph: the bf16 unpipelined NCCL collective
# (dense) first and last, fp8 + pipeline_depth 4 twice between.
#   source bench/device_env.sh; bash bench/gpu_run38.sh        -> $OUT/run38.tgz
set -uo pipefail
RUN=run38 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 80 tests/test_runtime_gpu.py -k host_staged
N="dense|pipeline_depth=1|MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
hs_launch a 80 "$N;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=4;$N" EP_ARGS=--cuda-graph
finish
