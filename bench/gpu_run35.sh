#!/usr/bin/env bash
# Run 35 on the 2x H200 node (~6 min): the new defaults of host_staged (cuStreamWaitValue64 waits timed by the
# library's watchdog, 4 staging slots per ring, pipelined combine on the dispatch lane), chosen from runs 33-34.
# (1) every GPU test (the transport's test now times out a missing peer under both wait modes), (2) two launches
# of Qwen3-30B S=4096 host-staged round trips, eager and replayed from a CUDA graph, each with the bf16
# unpipelined NCCL collective (dense) first and last: fp8 + pipeline_depth 4 against it, plus bf16 pipelined
# (pipelining without fp8), fp8 unpipelined (fp8 without pipelining), spin-kernel waits, the packed collective.
#   source bench/device_env.sh; bash bench/gpu_run35.sh        -> $OUT/run35.tgz
set -uo pipefail
RUN=run35 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 200 tests -m gpu
N="dense|pipeline_depth=1|MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
C="$N;packed|pipeline_depth=1|MOETUNE_HS_NATIVE=0;dense|pipeline_depth=1;dense|$F,pipeline_depth=4;dense|pipeline_depth=4"
C="$C;dense|$F,pipeline_depth=1;dense|$F,chunk_tokens=1024;dense|$F,pipeline_depth=4|MOETUNE_HS_WAIT=kernel;$N"
hs_launch a 220 "$C" EP_ARGS=--cuda-graph
C2="$N;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=3;dense|$F,pipeline_depth=6;dense|$F,pipeline_depth=4,channels=2;$N"
hs_launch b 170 "$C2" EP_ARGS=--cuda-graph
finish
