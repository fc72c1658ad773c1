#!/usr/bin/env bash
# Host-staged (NCCL_P2P_DISABLE=1) Qwen3-30B S=4096 round trip on the 2x H200 node: the issue-5 comparison
# (fp8 + pipelining against the bf16 unpipelined collective) for both wire layouts, under NCCL's default
# SHM staging and with the SHM copies done by copy engines (NCCL_SHM_USE_CUDA_MEMCPY=1, sender- or
# both-side). Every case of one env setting runs back to back; the ratios are formed within one setting.
#   source bench/device_env.sh; bash bench/gpu_host_staged.sh      -> $OUT/host_staged.jsonl + a table
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-./bench_out}; mkdir -p "$OUT"
: > "$OUT/host_staged.jsonl"
# ENVSETS="...;..." overrides the NCCL settings tried (';'-separated, an empty item = NCCL's defaults)
IFS=';' read -r -a ENVS <<< "${ENVSETS-;NCCL_SHM_USE_CUDA_MEMCPY=1;NCCL_SHM_USE_CUDA_MEMCPY=1 NCCL_SHM_MEMCPY_MODE=3}"
[ ${#ENVS[@]} -eq 0 ] && ENVS=("")
# CASES="layout|knobs[|env];..." overrides the cases; the optional env applies to that case alone (e.g.
# MOETUNE_HS_NATIVE=0: host_staged through NCCL's own staging, the collective with NCCL_P2P_DISABLE=1).
# EP_ARGS adds arguments to every `moetune bench ep` (e.g. --cuda-graph: the "graph rt" column).
DEFAULT_CASES="packed|pipeline_depth=1;dense|pipeline_depth=1;dense|compression=fp8_e4m3,pipeline_depth=2,channels=2"
DEFAULT_CASES="$DEFAULT_CASES;packed|compression=fp8_e4m3,pipeline_depth=2,channels=2;packed|compression=fp8_e4m3,pipeline_depth=4,channels=4"
DEFAULT_CASES="$DEFAULT_CASES;dense|compression=fp8_e4m3,pipeline_depth=4,channels=4"
IFS=';' read -r -a CASE_LIST <<< "${CASES:-$DEFAULT_CASES}"
for envset in "${ENVS[@]}"; do
  for case in "${CASE_LIST[@]}"; do
    layout=${case%%|*}; kn=${case#*|}; cenv=""
    if [[ $kn == *"|"* ]]; then cenv=${kn#*|}; kn=${kn%%|*}; fi
    r=$(env $envset $cenv timeout 40 moetune bench ep --world 2 --backend nccl --transport host_staged --model qwen3-30b \
        --tokens 4096 --layout "$layout" --knobs "$kn" --iters 30 --warmup 5 --no-layer ${EP_ARGS:-} --json 2>"$OUT/hs_err.txt" | tail -1)
    e=""; [ -z "$r" ] && e=$(tail -c 300 "$OUT/hs_err.txt" | tr -d '"\\' | tr '\n' ' ')  # why it failed
    echo "{\"env\": \"$envset${cenv:+ $cenv}\", \"layout\": \"$layout\", \"knobs\": \"$kn\", \"result\": ${r:-null}, \"stderr_tail\": \"$e\"}" >> "$OUT/host_staged.jsonl"
  done
done
python3 - "$OUT/host_staged.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'env':50s} {'layout':7s} {'knobs':50s} {'dispatch':>9s} {'combine':>9s} {'roundtrip':>10s} {'rt host':>8s} {'graph rt':>9s}")
for r in rows:
    res = r["result"] or {}
    m = lambda k: (res.get(k) or {}).get("median")
    f = lambda v: f"{v:9.0f}" if v is not None else f"{'FAIL':>9s}"
    g = f(m('graph_roundtrip_us')) if res.get('graph_roundtrip_us') or not res.get('graph_error') else f"{'n/a':>9s}"
    print(f"{r['env'] or '(default)':50s} {r['layout']:7s} {r['knobs']:50s} {f(m('dispatch_us'))} {f(m('combine_us'))} {f(m('roundtrip_us')):>10s} {f(m('roundtrip_host_us')):>8s} {g}")
    if res.get('graph_error'):
        print(f"   graph: {res['graph_error']}")
PY
