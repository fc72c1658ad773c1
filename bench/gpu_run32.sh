#!/usr/bin/env bash
# Run 32 (prepared, not yet run) on the 2x H200 node (~1 min): the timeline of host_staged's round trip on the
# final code, to see what a piece costs on the device. `moetune bench ep --profile` with the timeline exported (MOETUNE_PROFILE_TRACE) for
# dense fp8 with chunk_tokens=512, Qwen3-30B S=4096, with the spin-kernel waits and with cuStreamWaitValue64.
#   source bench/device_env.sh; bash bench/gpu_run32.sh        -> $OUT/run32.tgz
set -uo pipefail
RUN=run32 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
export NCCL_P2P_DISABLE=1
build_csrc
for wait in kernel memop; do
  stage "profile $wait" 60 env MOETUNE_HS_WAIT=$wait MOETUNE_PROFILE_TRACE="$R/trace_$wait" moetune bench ep --world 2 \
    --backend nccl --transport host_staged --model qwen3-30b --tokens 4096 --layout dense \
    --knobs compression=fp8_e4m3,chunk_tokens=512 --iters 10 --warmup 3 --no-layer --profile --json > "$R/$wait.json" 2> "$R/$wait.err"
  python3 -c "import json,sys; r=json.loads([l for l in open(sys.argv[1]) if l.startswith('{')][-1]); print(sys.argv[2], {k: round(r[k]['median']) for k in ('dispatch_us','combine_us','roundtrip_us','roundtrip_host_us') if r.get(k)})" "$R/$wait.json" "$wait" || tail -3 "$R/$wait.err"
done
for f in "$R"/trace_*.json; do gzip "$f"; done
finish
