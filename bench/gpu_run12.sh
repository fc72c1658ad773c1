#!/usr/bin/env bash
# Run 12 on the 2x H200 node (one command, ~4 min): `moetune bench ep` (bench/onesided_bench_ep.py) at S=16384 for
# Qwen3-30B and DeepSeek-V3 over nvlink (gathering dispatch, strided combine, reduce kernel), the collective,
# plain NCCL and the proxy (decoupled + nic_ordered), eager and from CUDA graphs. Results in $OUT/run12.tgz.
#   source bench/device_env.sh; bash bench/gpu_run12.sh
set -uo pipefail
RUN=run12 ONESIDED_TIMEOUT_S=10; source "$(dirname "$0")/gpu_run_common.sh"
build_csrc
stage bench_ep 300 python3 bench/onesided_bench_ep.py --out "$R" --timeout 290 --iters 20 --warmup 5 --no-verify \
  --variants nvlink,nvlink_sms128,collective,plain,proxy_ordered --tokens 16384 > "$R/table.txt" 2>&1
tail -10 "$R/table.txt"
finish
