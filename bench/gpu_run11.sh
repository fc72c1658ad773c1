#!/usr/bin/env bash
# Run 11 on the 2x H200 node (one command, ~7 min): repeats run 10's EPBuffer nvlink-vs-collective CUDA-graph
# grid with more iterations; the raw nvlink exchange at S=16384 with a busy-GPU prelude over more SM counts;
# the warm NCCL baseline re-measured with more iterations (fabric-model calibration); the host-staged
# fp8 + pipelining comparison twice (NCCL defaults). Results in $OUT/run11.tgz.
#   source bench/device_env.sh; bash bench/gpu_run11.sh
set -uo pipefail
RUN=run11 ONESIDED_TIMEOUT_S=5; source "$(dirname "$0")/gpu_run_common.sh"
build_csrc
mkdir -p "$R/bench_ep"
stage bench_ep 120 python3 bench/onesided_bench_ep.py --out "$R/bench_ep" --timeout 110 --iters 50 --warmup 10 --no-verify \
  --variants nvlink,collective --tokens 128,1024 > "$R/bench_ep/table.txt" 2>&1
tail -8 "$R/bench_ep/table.txt"
V="nvlink:signalling=coupled,num_sms=32|fused;nvlink:signalling=coupled,num_sms=64|fused;nvlink:signalling=coupled,num_sms=128|fused"
V="$V;nvlink:signalling=decoupled,num_sms=64|fused;nvlink:signalling=decoupled,num_sms=128|fused"
mkdir -p "$R/raw"
stage raw 120 python3 bench/onesided_ep.py --out "$R/raw" --timeout 110 --iters 50 --warmup 5 \
  --models qwen3-30b,deepseek-v3 --tokens 16384 --transports nvlink --no-graphs --variants "$V" --busy-us 400 \
  > "$R/raw/table.txt" 2>&1
tail -14 "$R/raw/table.txt"
stage baseline 150 env OUT="$R" python3 bench/gpu_model_baseline.py --warmup 30 --iters 150 > "$R/baseline.txt" 2>&1
tail -3 "$R/baseline.txt"
for n in 1 2; do
  mkdir -p "$R/hs$n"
  stage "host_staged$n" 100 env OUT="$R/hs$n" ENVSETS= bash bench/gpu_host_staged.sh > "$R/hs$n/table.txt" 2>&1
  cat "$R/hs$n/table.txt"
done
finish
