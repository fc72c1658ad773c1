#!/usr/bin/env bash
# Run 33 on the 2x H200 node (~6 min): (1) every GPU test on the final code of the last session's review pass
# (its Python edits touched CUDA-only paths), (2) the timeline of fp8 chunk_tokens=512 host_staged round trip (run 32's
# first half), (3) Qwen3-30B S=4096 host-staged round trips replayed from a CUDA graph with the EP buffer's
# pipeline_depth (4 and 8 chunks, one lane per direction set: channels=1) so that the combine of chunk i travels
# while later dispatch chunks do, with combine on its own lane (default) and sharing the dispatch lane
# (MOETUNE_EP_COMBINE_LANES=shared: each copy stream carries d0..dN then c0..cN back to back); (4) the same with
# cuStreamWaitValue64 waits.
#   source bench/device_env.sh; bash bench/gpu_run33.sh        -> $OUT/run33.tgz
set -uo pipefail
RUN=run33 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 170 tests -m gpu
stage "profile kernel" 60 env MOETUNE_PROFILE_TRACE="$R/trace_kernel" moetune bench ep --world 2 \
  --backend nccl --transport host_staged --model qwen3-30b --tokens 4096 --layout dense \
  --knobs compression=fp8_e4m3,chunk_tokens=512 --iters 10 --warmup 3 --no-layer --profile --json > "$R/kernel.json" 2> "$R/kernel.err"
for f in "$R"/trace_*.json; do [ -f "$f" ] && gzip "$f"; done
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"; S="MOETUNE_EP_COMBINE_LANES=shared"
C="dense|pipeline_depth=1|$N;dense|$F,chunk_tokens=1024;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=4,chunk_tokens=512"
C="$C;dense|$F,pipeline_depth=8;dense|$F,pipeline_depth=4|$S;dense|$F,pipeline_depth=8|$S;dense|$F,pipeline_depth=4,chunk_tokens=512|$S"
hs_launch a 150 "$C" EP_ARGS=--cuda-graph
C2="dense|pipeline_depth=1|$N;dense|$F,chunk_tokens=1024;dense|$F,pipeline_depth=4;dense|$F,pipeline_depth=4|$S;dense|$F,pipeline_depth=8|$S"
hs_launch b 100 "$C2" EP_ARGS=--cuda-graph MOETUNE_HS_WAIT=memop
finish
