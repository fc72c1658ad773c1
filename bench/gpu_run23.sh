#!/usr/bin/env bash
# Run 23 on the 2x H200 node (~6 min): host_staged with chunk_tokens as the staging message size (pieces
# double-buffered through the slot ring inside one library call). GPU tests; bench/host_staged_micro.py; then
# Qwen3-30B S=4096 round trips side by side in one launch: the bf16 unpipelined collective over NCCL's staging
# (MOETUNE_HS_NATIVE=0 = the collective with NCCL_P2P_DISABLE=1; packed and dense), host_staged store-and-forward
# and chunked, bf16 and fp8; the key cases again in a second launch.
#   source bench/device_env.sh; bash bench/gpu_run23.sh        -> $OUT/run23.tgz
set -uo pipefail
RUN=run23 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 150 tests/test_runtime_gpu.py
stage micro 60 python3 bench/host_staged_micro.py --out "$R" --label default --chunks 1,2 2>> "$R/micro_err.txt" | cut -c1-900
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|chunk_tokens=512"
C="$C;dense|$F;dense|$F,chunk_tokens=256;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=1024"
C="$C;dense|$F,chunk_tokens=512,pipeline_depth=2;packed|pipeline_depth=1;packed|$F,chunk_tokens=512"
C="$C;dense|$F,chunk_tokens=512|MOETUNE_HS_WAIT=memop"
hs_launch a 230 "$C"
C2="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=512,pipeline_depth=2"
hs_launch b 100 "$C2"
finish
