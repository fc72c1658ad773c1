#!/usr/bin/env bash
# Run 24 on the 2x H200 node (~6 min): the final code. Every GPU test (-m gpu), then Qwen3-30B S=4096 host-staged
# round trips side by side in one launch, and the key cases again in a second launch: the bf16 unpipelined
# collective over NCCL's staging (MOETUNE_HS_NATIVE=0 = the collective with NCCL_P2P_DISABLE=1; packed and dense),
# host_staged through the copy engines store-and-forward (chunk_tokens=0) and staged in pieces, bf16 and fp8.
#   source bench/device_env.sh; bash bench/gpu_run24.sh        -> $OUT/run24.tgz
set -uo pipefail
RUN=run24 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 150 tests -m gpu
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|chunk_tokens=1024"
C="$C;dense|$F;dense|$F,chunk_tokens=512;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=2048;dense|$F,chunk_tokens=1024,pipeline_depth=2"
hs_launch a 160 "$C"
C2="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|$F,chunk_tokens=1024;dense|$F,chunk_tokens=512"
hs_launch b 90 "$C2"
finish
