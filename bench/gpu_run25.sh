#!/usr/bin/env bash
# Run 25 on the 2x H200 node (~2 min): the final cutting (full slots, as in run 23) after run 24's tapered pieces
# were slower. The host_staged GPU test, then four Qwen3-30B S=4096 host-staged round trips side by side.
#   source bench/device_env.sh; bash bench/gpu_run25.sh        -> $OUT/run25.tgz
set -uo pipefail
RUN=run25 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 60 tests/test_runtime_gpu.py -k host_staged
N="MOETUNE_HS_NATIVE=0"; F="compression=fp8_e4m3"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|$F,chunk_tokens=1024"
hs_launch . 75 "$C"
finish
