#!/usr/bin/env bash
# Run 34 on the 2x H200 node (~5 min): run 33 found pipeline_depth=4 replayed from a CUDA graph at 829-880 us against
# 1499-1513 us for the dense NCCL collective. This run repeats it, each launch with the baseline first and last, and
# varies what may still cost: staging slots per ring (MOETUNE_HS_SLOTS=4: d0..d3 without waiting for the peer's
# drain), combine on its own lane or sharing the dispatch lane (MOETUNE_EP_COMBINE_LANES=shared), uneven chunks
# (MOETUNE_EP_CHUNK_WEIGHTS: small first and last chunks, shorter pipeline fill and drain), spin-kernel (a) and
# cuStreamWaitValue64 (b) waits. Qwen3-30B S=4096 host-staged, all with --cuda-graph.
#   source bench/device_env.sh; bash bench/gpu_run34.sh        -> $OUT/run34.tgz
set -uo pipefail
RUN=run34 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
N="dense|pipeline_depth=1|MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"; S="MOETUNE_EP_COMBINE_LANES=shared"
C="$N;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=4|MOETUNE_HS_SLOTS=4;dense|$F,pipeline_depth=4|$S MOETUNE_HS_SLOTS=4"
C="$C;dense|$F,pipeline_depth=4|MOETUNE_EP_CHUNK_WEIGHTS=1,2,2,1;dense|$F,pipeline_depth=5|MOETUNE_EP_CHUNK_WEIGHTS=1,2,2,2,1"
C="$C;dense|$F,pipeline_depth=6|MOETUNE_EP_CHUNK_WEIGHTS=1,2,2,2,2,1;$N"
hs_launch a 170 "$C" EP_ARGS=--cuda-graph
C2="$N;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=4|$S;dense|$F,pipeline_depth=4|MOETUNE_HS_SLOTS=4"
C2="$C2;dense|$F,pipeline_depth=4|$S MOETUNE_HS_SLOTS=4;dense|$F,pipeline_depth=5|$S MOETUNE_EP_CHUNK_WEIGHTS=1,2,2,2,1;$N"
hs_launch b 150 "$C2" EP_ARGS=--cuda-graph MOETUNE_HS_WAIT=memop
finish
