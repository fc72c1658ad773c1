# Sourced by bench/gpu_run*.sh after setting RUN (the results folder's name) and ONESIDED_TIMEOUT_S:
# the node's settings, $R (this run's folder under $OUT), `stage NAME TIMEOUT_S CMD...` (bounded, its
# progress lines on stderr so stdout stays for results), `build_csrc` and `finish` (one $OUT/$RUN.tgz).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOETUNE_ONESIDED_TIMEOUT_S=${ONESIDED_TIMEOUT_S:-5}
OUT=${OUT:-./bench_out}; R="$OUT/$RUN"; mkdir -p "$R"
t0=$SECONDS
stage() { local n=$1 t=$2; shift 2; echo "=== [$n] $(date -u +%T)" >&2; timeout --kill-after=10 "$t" "$@"; echo "=== [$n] rc=$? at $((SECONDS - t0)) s" >&2; }
build_csrc() {
  stage build 120 python3 -c "from moetune.runtime import csrc_build as b; i = b.build(); print(i.path, 'built' if i.built else 'cached')" >&2
}
finish() { tar czf "$OUT/$RUN.tgz" -C "$OUT" "$RUN" && rm -rf "$R"; echo "total $((SECONDS - t0)) s"; }
# gpu_tests LIMIT_S PYTEST_ARGS...: the GPU tests into $R/$GPU_LOG.log (default gpu_tests), the summary lines
# printed; settings for the tests go before the call (e.g. `MOETUNE_HS_SLOTS=8 GPU_LOG=x gpu_tests ...`)
gpu_tests() { local t=$1 log="$R/${GPU_LOG:-gpu_tests}.log"; shift
  stage "tests ${GPU_LOG:-}" "$t" python3 -m pytest "$@" -q -rA -p no:cacheprovider > "$log" 2>&1
  grep -E "FAILED|ERROR|passed|failed|Error" "$log" | tail -12; }
# hs_launch DIR LIMIT_S CASES [VAR=value...]: one launch of bench/gpu_host_staged.sh (its CASES, the extra env)
# into $R/DIR ("." = $R itself), its table printed
hs_launch() { local d=$1 t=$2 c=$3; shift 3; mkdir -p "$R/$d"
  stage "host_staged $d" "$t" env "$@" OUT="$R/$d" ENVSETS= CASES="$c" bash bench/gpu_host_staged.sh > "$R/$d/table.txt" 2>&1
  cat "$R/$d/table.txt"; }
