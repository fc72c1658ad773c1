#!/usr/bin/env bash
# Run 22 on the 2x H200 node (~2 min): where host_staged's host time goes. bench/host_staged_micro.py with the
# library's per-call host timers (mt_hs_stats), then `moetune bench ep --profile` with the timeline exported
# (MOETUNE_PROFILE_TRACE) for dense bf16 unpipelined and dense fp8 in 2 chunks, Qwen3-30B S=4096.
#   source bench/device_env.sh; bash bench/gpu_run22.sh        -> $OUT/run22.tgz
set -uo pipefail
RUN=run22 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
stage micro 60 python3 bench/host_staged_micro.py --out "$R" --label default 2>> "$R/micro_err.txt" | cut -c1-700
for kn in "pipeline_depth=1" "compression=fp8_e4m3,pipeline_depth=2"; do
  tag=${kn//[=,]/_}
  stage "profile $kn" 60 env MOETUNE_PROFILE_TRACE="$R/trace_$tag" moetune bench ep --world 2 --backend nccl \
    --transport host_staged --model qwen3-30b --tokens 4096 --layout dense --knobs "$kn" --iters 10 --warmup 3 \
    --no-layer --profile --json > "$R/$tag.json" 2> "$R/$tag.err"
  python3 -c "import json,sys; r=json.loads([l for l in open(sys.argv[1]) if l.startswith('{')][-1]); print(sys.argv[2], {k: round(r[k]['median']) for k in ('dispatch_us','combine_us','roundtrip_us','dispatch_host_us','combine_host_us') if r.get(k)})" "$R/$tag.json" "$tag" || tail -3 "$R/$tag.err"
done
ls -la "$R"
finish
