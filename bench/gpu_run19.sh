#!/usr/bin/env bash
# Run 19 on the 2x H200 node (~6 min): the host_staged transport through the copy engines
# (csrc/host_staged.cu) -- GPU tests (same bytes as the NCCL collective, pieces, timeout), then Qwen3-30B S=4096
# host-staged round trips side by side in one launch: NCCL's staging (MOETUNE_HS_NATIVE=0, i.e. the collective
# with NCCL_P2P_DISABLE=1) and the copy engines, bf16 unpipelined against fp8 + pipelining; the key cases twice.
#   source bench/device_env.sh; bash bench/gpu_run19.sh        -> $OUT/run19.tgz
set -uo pipefail
RUN=run19 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
nvidia-smi topo -m > "$R/topo.txt" 2>&1
build_csrc
gpu_tests 150 tests/test_runtime_gpu.py
N="MOETUNE_HS_NATIVE=0"
C="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;packed|pipeline_depth=1;dense|pipeline_depth=1"
C="$C;dense|compression=fp8_e4m3,pipeline_depth=1;dense|pipeline_depth=4"
C="$C;dense|compression=fp8_e4m3,pipeline_depth=2;dense|compression=fp8_e4m3,pipeline_depth=4"
C="$C;dense|compression=fp8_e4m3,pipeline_depth=8;dense|compression=fp8_e4m3,pipeline_depth=4,channels=2"
C="$C;packed|compression=fp8_e4m3,pipeline_depth=4;dense|compression=fp8_e4m3,pipeline_depth=2,channels=2|$N"
hs_launch a 220 "$C"
C2="packed|pipeline_depth=1|$N;dense|pipeline_depth=1|$N;dense|pipeline_depth=1;dense|compression=fp8_e4m3,pipeline_depth=4"
C2="$C2;dense|compression=fp8_e4m3,pipeline_depth=8;packed|pipeline_depth=1"
hs_launch b 100 "$C2"
finish
