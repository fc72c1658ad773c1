#!/usr/bin/env bash
# Run 14 on the 2x H200 node (~2 min): where host-staged Qwen3-30B S=4096 spends its time. `moetune bench ep
# --transport host_staged --profile` (torch.profiler over 5 round trips, top kernels by device time) for the packed
# bf16 baseline, dense bf16, dense fp8 unpipelined and dense fp8 with 2 chunks. Results in $OUT/run14.tgz.
#   source bench/device_env.sh; bash bench/gpu_run14.sh
set -uo pipefail
RUN=run14 ONESIDED_TIMEOUT_S=5; source "$(dirname "$0")/gpu_run_common.sh"
for case in "packed|pipeline_depth=1" "dense|pipeline_depth=1" "dense|compression=fp8_e4m3,pipeline_depth=1" \
            "dense|compression=fp8_e4m3,pipeline_depth=2,channels=2"; do
  layout=${case%%|*}; kn=${case#*|}; tag="${layout}_${kn//[=,]/_}"
  timeout 60 moetune bench ep --world 2 --backend nccl --transport host_staged --model qwen3-30b --tokens 4096 \
    --layout "$layout" --knobs "$kn" --iters 20 --warmup 5 --no-layer --profile --json > "$R/$tag.json" 2> "$R/$tag.err"
  python3 -c "import json,sys; r=json.loads([l for l in open(sys.argv[1]) if l.startswith('{')][-1]); print(sys.argv[2], {k: round(r[k]['median']) for k in ('dispatch_us','combine_us','roundtrip_us','dispatch_host_us','combine_host_us') if r.get(k)})" "$R/$tag.json" "$tag" || tail -3 "$R/$tag.err"
done
finish
