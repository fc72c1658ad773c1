#!/usr/bin/env bash
# Run 16 on the 2x H200 node (~4 min): the fp8 kernels (csrc/ep_fp8.cu) against the torch path (tests), the MoE layer
# with fp8 dispatch against the dense reference (`moetune bench ep --verify`), and host-staged Qwen3-30B S=4096 with
# the fp8 kernels on and off (MOETUNE_FUSED_FP8) side by side. Results in $OUT/run16.tgz.
#   source bench/device_env.sh; bash bench/gpu_run16.sh
set -uo pipefail
RUN=run16 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
build_csrc
stage tests 120 python3 -m pytest tests/test_gpu_pack.py -q -rA -p no:cacheprovider > "$R/gpu_tests.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$R/gpu_tests.log" | tail -8
for t in collective nvlink; do
  stage "verify_$t" 60 moetune bench ep --world 2 --backend nccl --transport $t --model qwen3-30b --tokens 256 \
    --knobs compression=fp8_e4m3 --verify --iters 5 --warmup 2 --json > "$R/verify_fp8_$t.json" 2> "$R/verify_fp8_$t.err"
  python3 -c "import json,sys; r=json.loads([l for l in open(sys.argv[1]) if l.startswith('{')][-1]); print(sys.argv[2], 'max_rel_err', r.get('max_rel_err'), 'bound', r.get('verify_bound'), 'roundtrip_rel_err', r.get('roundtrip_rel_err'))" "$R/verify_fp8_$t.json" $t || tail -3 "$R/verify_fp8_$t.err"
done
C="packed|pipeline_depth=1;dense|pipeline_depth=1;dense|compression=fp8_e4m3,pipeline_depth=1;dense|compression=fp8_e4m3,pipeline_depth=2,channels=2"
for f in 1 0; do
  mkdir -p "$R/fused$f"
  stage "host_staged_fused$f" 110 env MOETUNE_FUSED_FP8=$f OUT="$R/fused$f" ENVSETS= CASES="$C" bash bench/gpu_host_staged.sh \
    > "$R/fused$f/table.txt" 2>&1
  cat "$R/fused$f/table.txt"
done
finish
