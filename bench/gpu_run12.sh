#!/usr/bin/env bash
# Run 12 on the 2x H200 node (one command, ~4 min): `moetune bench ep` (bench/onesided_bench_ep.py) at S=16384 for
# Qwen3-30B and DeepSeek-V3 over nvlink (gathering dispatch, strided combine, reduce kernel), the collective,
# plain NCCL and the proxy (decoupled + nic_ordered), eager and from CUDA graphs. Results in $OUT/run12.tgz.
#   source bench/device_env.sh; bash bench/gpu_run12.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOETUNE_ONESIDED_TIMEOUT_S=10
OUT=${OUT:-./bench_out}; R="$OUT/run12"; mkdir -p "$R"
t0=$SECONDS
stage() { local n=$1 t=$2; shift 2; echo "=== [$n] $(date -u +%T)" >&2; timeout --kill-after=10 "$t" "$@"; echo "=== [$n] rc=$? at $((SECONDS - t0)) s" >&2; }
stage build 120 python3 -c "from moetune.runtime import csrc_build as b; i = b.build(); print(i.path, 'built' if i.built else 'cached')" >&2
stage bench_ep 300 python3 bench/onesided_bench_ep.py --out "$R" --timeout 290 --iters 20 --warmup 5 --no-verify \
  --variants nvlink,nvlink_sms128,collective,plain,proxy_ordered --tokens 16384 > "$R/table.txt" 2>&1
tail -10 "$R/table.txt"
tar czf "$OUT/run12.tgz" -C "$OUT" run12 && rm -rf "$R"
echo "total $((SECONDS - t0)) s"
