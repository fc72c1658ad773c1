#!/usr/bin/env bash
# Run 27 on the 2x H200 node (~5 min): what the device time of host_staged's round trip is made of, now that it
# replays from a CUDA graph (run 26: graph replays were only ~10 % faster than eager, so the host is not the
# main cost). The transport's GPU test (a ring of 3 slots too), then Qwen3-30B S=4096 host-staged round trips,
# eager and replayed (--cuda-graph), side by side: (a) pipelined over two chunks on two lanes (dispatch of chunk
# 1 overlapping the combine of chunk 0), (b) the same with 4 staging slots per ring (MOETUNE_HS_SLOTS=4: the
# sender runs further ahead of its receiver), (c) with cuStreamWaitValue64 waits (MOETUNE_HS_WAIT=memop).
#   source bench/device_env.sh; bash bench/gpu_run27.sh        -> $OUT/run27.tgz
set -uo pipefail
RUN=run27 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 90 tests/test_runtime_gpu.py -k host_staged
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"; P="pipeline_depth=2,channels=2"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512"
C="$C;dense|$F,$P,chunk_tokens=1024;dense|$F,$P,chunk_tokens=512;dense|$F,$P,chunk_tokens=2048"
hs_launch a 130 "$C" EP_ARGS=--cuda-graph
C2="dense|pipeline_depth=1|$N;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=256"
C2="$C2;dense|$F,$P,chunk_tokens=1024;dense|$F,$P,chunk_tokens=512"
hs_launch b 100 "$C2" EP_ARGS=--cuda-graph MOETUNE_HS_SLOTS=4
C3="dense|pipeline_depth=1|$N;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512;dense|$F,$P,chunk_tokens=1024"
hs_launch c 80 "$C3" EP_ARGS=--cuda-graph MOETUNE_HS_WAIT=memop
finish
