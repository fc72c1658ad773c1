# Sourced at the start of every device command, from the tree's root (`source bench/tools/device_env.sh`):
# installs the carried wheels (.whl/) into /tmp/site, makes this checkout importable as `moetune` (and puts a
# `moetune` command on PATH), and keeps NVLink multicast off everywhere. OUT defaults to ./bench_out.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
  || echo "device_env: wheel install failed"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
# moetune is a namespace package whose subpackages are this repository's folders: link them.
mkdir -p /tmp/moetune-shim/moetune
for d in tuner runtime policies migrations csrc; do ln -sfn "$PWD/$d" "/tmp/moetune-shim/moetune/$d"; done
export PYTHONPATH=/tmp/moetune-shim:$PYTHONPATH
mkdir -p /tmp/site/bin
printf '#!/bin/sh\nexec python3 -c "import sys; from moetune.tuner.cli import main; sys.argv[0]=\\"moetune\\"; main()" "$@"\n' > /tmp/site/bin/moetune
chmod +x /tmp/site/bin/moetune
python3 -c "import moetune.runtime, moetune.tuner, optuna, zmq, msgspec, sqlalchemy; print('device_env ok')" || echo "device_env: imports failed"
