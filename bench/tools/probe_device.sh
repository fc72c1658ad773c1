#!/usr/bin/env bash
# One-shot probe of the GPU box: what the one-sided transports and discovery can rely on.
# Usage (on the device): bash bench/tools/probe_device.sh  (writes $OUT/probe.txt)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-./bench_out}; mkdir -p "$OUT"
exec > >(tee "$OUT/probe.txt") 2>&1
set -x
date -u; uname -a; nproc
nvidia-smi; nvidia-smi topo -m; nvidia-smi nvlink -s | head -40; nvidia-smi -q | head -60
which nvcc fi_info ibstat; nvcc --version
ls /sys/class/infiniband 2>&1; grep -E 'nvidia|peermem' /proc/modules
python3 -c "import torch,sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.device_count(), torch.cuda.get_device_name(0))"
python3 -m pip list 2>/dev/null | grep -iE 'nvshmem|cuda|nccl|cupy|numba|optuna|zmq|msgspec|sqlalchemy|typer|rich|alembic|prometheus|matplotlib|ml-py'
ls /usr/local/cuda/lib64 | grep -iE 'cudart|cuda\.so' | head; ls /usr/lib/x86_64-linux-gnu | grep -E '^libcuda' | head
python3 - <<'PY'
import torch.distributed._symmetric_memory as sm, inspect
print([n for n in dir(sm) if not n.startswith('__')])
print(inspect.signature(sm.empty)); print(inspect.signature(sm.rendezvous))
PY
cat > /tmp/symm.py <<'PY'
import os, torch, torch.distributed as dist
import torch.distributed._symmetric_memory as sm
rank=int(os.environ["RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
t = sm.empty(1024, dtype=torch.float32, device="cuda")
h = sm.rendezvous(t, dist.group.WORLD)
print(rank, type(h), [a for a in dir(h) if not a.startswith('_')])
print(rank, "buffer_ptrs", [hex(p) for p in h.buffer_ptrs], "signal_pad_ptrs", [hex(p) for p in h.signal_pad_ptrs], "signal_pad_size", getattr(h, "signal_pad_size", None), "buffer_size", getattr(h,"buffer_size",None))
peer = h.get_buffer(1-rank, (1024,), torch.float32)
peer.fill_(rank+1.0); torch.cuda.synchronize(); h.barrier(); print(rank, "got", t[:4].tolist())
dist.destroy_process_group()
PY
torchrun --nproc_per_node 2 /tmp/symm.py
cat > /tmp/w.cu <<'CU'
#include <cuda.h>
#include <cstdio>
__global__ void k(unsigned long long* p){ p[threadIdx.x]=threadIdx.x; }
int main(){ CUdevice d; cuInit(0); cuDeviceGet(&d,0); int a=0,b=0;
 cuDeviceGetAttribute(&a, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, d);
 cuDeviceGetAttribute(&b, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, d);
 int can=0; cudaDeviceCanAccessPeer(&can,0,1);
 printf("64bit stream mem ops %d, wait nor %d, peer access %d\n",a,b,can);
 unsigned long long* p; cudaMalloc(&p, 1024); k<<<1,32>>>(p); CUstream s; cuStreamCreate(&s,0);
 CUresult r = cuStreamWriteValue64(s, (CUdeviceptr)p, 42, 0); cuStreamSynchronize(s);
 unsigned long long h=0; cudaMemcpy(&h,p,8,cudaMemcpyDeviceToHost); printf("writeValue64 r=%d val=%llu\n", r, h); }
CU
nvcc -arch=sm_90 -o /tmp/w /tmp/w.cu -lcuda && /tmp/w
