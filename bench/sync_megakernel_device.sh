#!/bin/bash
# Build libmoetune_moe.so on this machine (nvcc only, no GPU needed) and stage everything a GPU run of the
# megakernel needs in one self-contained folder (default: .mk/ in this checkout, git-ignored). Copy that folder
# to the GPU machine and run `bash run.sh all` in it (tests, then the benchmark; see bench/megakernel_device.sh).
set -eu
WT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$WT/.mk}
mkdir -p "$DEST/lib" "$DEST/whl" "$DEST/tests" "$DEST/bench"
rm -rf "$DEST/runtime" "$DEST/csrc"; cp -r "$WT/runtime" "$DEST/runtime"
cp -r "$WT/csrc" "$DEST/csrc"; find "$DEST" -name __pycache__ -prune -exec rm -rf {} +
cp "$WT/tests/test_megakernel_gpu.py" "$DEST/tests/"
cp "$WT/bench/megakernel_bench.py" "$WT/bench/megakernel_profile.py" "$DEST/bench/"
cp "$WT/bench/megakernel_device.sh" "$DEST/run.sh"
printf '[pytest]\nmarkers =\n    gpu: needs CUDA\n    slow: long\naddopts = --import-mode=importlib\n' > "$DEST/pytest.ini"
git -C "$WT" rev-parse --short HEAD > "$DEST/SHA"
# stamps results there (MOETUNE_GIT_SHA): no .git travels; "-dirty" when the tree copied is not exactly HEAD
echo "$(git -C "$WT" rev-parse HEAD)$([ -n "$(git -C "$WT" status --porcelain)" ] && echo -dirty)" > "$DEST/SHA_FULL"
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -shared -Xcompiler -fPIC,-O3 -lineinfo -cudart=static \
  -o "$DEST/lib/libmoetune_moe.so" "$WT"/csrc/megakernel/*.cu
# wheels the GPU machine lacks (msgspec for the runtime's schemas), if downloaded beforehand into $WHEELS
cp "${WHEELS:-/nonexistent}"/*.whl "$DEST/whl/" 2>/dev/null || true
du -sh "$DEST"
