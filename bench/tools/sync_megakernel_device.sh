#!/bin/bash
# Stage a GPU run of this checkout in one folder (default: .mk/ in this checkout, git-ignored), built here with nvcc
# (no GPU needed): src/ (a copy of the tree: the tracked files and the untracked ones git does not ignore, with this
# checkout's changes), lib/libmoetune_moe.so (the megakernel library), SHA and SHA_FULL (the commit, "-dirty" when
# the tree copied is not exactly HEAD). Carry the folder to the GPU machine; there, from src/:
#   source bench/tools/device_env.sh
#   export MOETUNE_MK_LIB=$PWD/../lib/libmoetune_moe.so MOETUNE_GIT_SHA=$(cat ../SHA_FULL)
# then the GPU tests (pytest), `moetune bench run NAME` / `bench moe` (rows stamped with MOETUNE_GIT_SHA: no .git
# travels) and bench/tools/megakernel_profile.py (traces, timelines, ncu). Wheels the GPU machine lacks (msgspec for
# the runtime's schemas, ...), if downloaded beforehand into $WHEELS, go to src/.whl/, where device_env.sh installs
# them from.
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${1:-$WT/.mk}
mkdir -p "$DEST/lib"
rm -rf "$DEST/src"; mkdir -p "$DEST/src/.whl"
git -C "$WT" ls-files -z --cached --others --exclude-standard | (cd "$WT" && xargs -0 tar -cf - --ignore-failed-read) \
  | tar -xf - -C "$DEST/src"
git -C "$WT" rev-parse --short HEAD > "$DEST/SHA"
# dirty: code changed, not the results the bench commands write (as tuner/measure/scenarios/stamp.py _RESULTS)
RESULTS=(':(exclude)bench/results/summary.csv' ':(exclude,glob)bench/results/summary.unsaved-*.csv' ':(exclude)BENCHMARKS.md')
echo "$(git -C "$WT" rev-parse HEAD)$([ -n "$(git -C "$WT" status --porcelain -- . "${RESULTS[@]}")" ] && echo -dirty)" > "$DEST/SHA_FULL"
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -shared -Xcompiler -fPIC,-O3 -lineinfo -cudart=static \
  -o "$DEST/lib/libmoetune_moe.so" "$WT"/csrc/megakernel/*.cu
cp "${WHEELS:-/nonexistent}"/*.whl "$DEST/src/.whl/" 2>/dev/null || true
du -sh "$DEST"
