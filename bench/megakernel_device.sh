#!/bin/bash
# Device-side driver for the megakernel (run from the folder sync_megakernel_device.sh fills):
# import shim, prebuilt library (else build there), GPU tests, benchmark. Logs under $OUT.
#   bash run.sh [tests|bench|all|trace|timeline|ncu] [extra pytest -k expression]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site whl/*.whl >/dev/null 2>&1 \
  || echo "wheel install failed"
mkdir -p /tmp/shim/moetune
for d in runtime csrc; do ln -sfn "$PWD/$d" "/tmp/shim/moetune/$d"; done
export PYTHONPATH=/tmp/shim:/tmp/site
export MOETUNE_MK_LIB=$PWD/lib/libmoetune_moe.so
# the commit this folder was staged from: the stamp of every result (a stale .git on the device must not name it)
[ -f SHA_FULL ] && export MOETUNE_GIT_SHA=$(cat SHA_FULL)
if ! python3 -c "from moetune.runtime.megakernel import _lib; _lib.load()"; then
  echo "carried library does not load: building here"; unset MOETUNE_MK_LIB; export MOETUNE_CACHE=/tmp/mkcache
  python3 -c "from moetune.runtime.megakernel import _lib; print(_lib.build())"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
what=${1:-all}; kexpr=${2:-}
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfEs ${kexpr:+-k "$kexpr"} \
    tests/test_megakernel_gpu.py ${PYTEST_EXTRA:-} 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 bench/megakernel_bench.py --sha "$(cat SHA)" --out "$OUT/bench.json" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log" | tail -${BENCH_TAIL:-12}
fi
if [ "$what" = trace ]; then
  # per-kernel device time and the gaps between kernels inside one CUDA-graph replay (torch.profiler)
  for s in ${TRACE_TOKENS:-1 1024 4096}; do
    timeout ${TRACE_TIMEOUT:-60} python3 bench/megakernel_profile.py --tokens "$s" --trace --calls 20 \
      ${TRACE_CONFIG:+--config "$TRACE_CONFIG"} 2>&1 | grep -E "^trace|^  kernel|^  gap|Error|error" | tee -a "$OUT/trace.log"
  done
fi
if [ "$what" = timeline ]; then
  # every task's publish / claim / done stamps of one launch per S and config (TL_CONFIGS: ';'-separated)
  IFS=';' read -ra cfgs <<< "${TL_CONFIGS:-}"; [ ${#cfgs[@]} -eq 0 ] && cfgs=("")
  for c in "${cfgs[@]}"; do for s in ${TL_TOKENS:-1 16 128 1024 4096}; do
    timeout ${TL_TIMEOUT:-60} python3 bench/megakernel_profile.py --tokens "$s" --calls 3 ${c:+--config "$c"} \
      --timeline "$OUT/timeline.jsonl" 2>&1 | grep -vE "^\s*$" | tail -8 | tee -a "$OUT/timeline.log"
  done; done
fi
if [ "$what" = ncu ] || [ "$what" = all-ncu ]; then
  # a few counters of the routing kernels and the persistent kernel, per S (NCU_TOKENS), clocks left alone
  for s in ${NCU_TOKENS:-1 4096}; do
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --kernel-name regex:'k_experts|k_logits|k_topk' \
      --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section LaunchStats --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      python3 bench/megakernel_profile.py --tokens "$s" ${NCU_CONFIG:+--config "$NCU_CONFIG"} > "$OUT/ncu_S$s.txt" 2>&1
    echo "ncu S=$s rc=$?"; grep -E "^  k_|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|hmma|dram__bytes|lts__t_bytes|Stall|Warp Cycles Per Issued" "$OUT/ncu_S$s.txt" | head -60
  done
fi
