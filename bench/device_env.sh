# Sourced at the start of every device command: installs the carried wheels (.whl/) and moetune
# itself into /tmp/site and keeps NVLink multicast off everywhere (the box's GPUs are shared).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1 || { echo "moetune install failed"; exit 1; }
python3 -c "import moetune.runtime, moetune.tuner, optuna, zmq, msgspec, sqlalchemy" || exit 1
