#!/usr/bin/env bash
# Run 21 on the 2x H200 node (~6 min): host_staged with one library call per exchange (mt_hs_post: streams and
# events owned by csrc). The transport's GPU test; bench/host_staged_micro.py under the default hardware queues
# and CUDA_DEVICE_MAX_CONNECTIONS=32; then Qwen3-30B S=4096 round trips side by side in one launch: NCCL's
# staging (MOETUNE_HS_NATIVE=0 = the collective with NCCL_P2P_DISABLE=1) and the copy engines, bf16 unpipelined
# against fp8 + pipelining; the key cases again with 32 hardware queues.
#   source bench/device_env.sh; bash bench/gpu_run21.sh        -> $OUT/run21.tgz
set -uo pipefail
RUN=run21 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
gpu_tests 100 tests/test_runtime_gpu.py -k host_staged
for e in "" "CUDA_DEVICE_MAX_CONNECTIONS=32"; do
  stage "micro $e" 60 env $e python3 bench/host_staged_micro.py --out "$R" --label "${e:-default}" 2>> "$R/micro_err.txt" | cut -c1-330
done
N="MOETUNE_HS_NATIVE=0"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;packed|pipeline_depth=1"
C="$C;dense|compression=fp8_e4m3,pipeline_depth=1;dense|compression=fp8_e4m3,pipeline_depth=2;dense|compression=fp8_e4m3,pipeline_depth=4"
C="$C;dense|pipeline_depth=2;dense|pipeline_depth=4;packed|compression=fp8_e4m3,pipeline_depth=2;dense|compression=fp8_e4m3,pipeline_depth=2,channels=2|$N"
hs_launch a 200 "$C"
C2="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|compression=fp8_e4m3,pipeline_depth=2;dense|compression=fp8_e4m3,pipeline_depth=4"
hs_launch b 100 "$C2" CUDA_DEVICE_MAX_CONNECTIONS=32
finish
