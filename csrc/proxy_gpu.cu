// moetune csrc: the GPU side of the proxy transport. A single GPU thread produces requests into the
// proxy engine's FIFO (pinned host memory) -- the count-matrix words, the PUTs, their signals -- then
// the kernel waits for the signals of what the other ranks sent (and for the ACK of its own
// transfers). Also: the race checker used by the unsafe-mode test.
#include <string.h>

#include "proxy_engine.h"

namespace {

using mt::WaitCtx;

__host__ __device__ inline uint64_t tag_of(uint64_t n) { return ((n - 1) % 0xFFFFFEull) + 1; }

struct PxCtx {
  void* engine = nullptr;
  MtGpuView v;
  int device = 0, rank = 0, world = 1;
  uint64_t ctrl_local = 0;  // my control region (local pointer)
  uint64_t data_bytes = 0;  // one parity area
  int* err_host = nullptr;
  int* err_dev = nullptr;
  int* abort_flag = nullptr;
  uint64_t timeout_ns = 10ull * 1000 * 1000 * 1000;
};

struct PxParams {
  MtGpuView v;
  uint64_t ctrl_local;
  uint64_t data_bytes;
  const char* send;
  uint64_t row_bytes;
  const int64_t* send_counts;
  const int64_t* recv_counts;  // may be null
  int64_t* recv_out;           // exchange_counts output
  int rank, world, coupled, group, chunk_rows;
  uint64_t epoch;
  WaitCtx w;
};

__device__ void chunking(long long cnt, int chunk_rows, long long* crow, int* nchunks) {
  if (cnt <= 0) {
    *crow = 1;
    *nchunks = 0;
    return;
  }
  long long c = chunk_rows > 0 ? chunk_rows : cnt;
  long long n = (cnt + c - 1) / c;
  if (n > MT_MAX_SLOTS) {
    c = (cnt + MT_MAX_SLOTS - 1) / MT_MAX_SLOTS;
    n = (cnt + c - 1) / c;
  }
  *crow = c;
  *nchunks = (int)n;
}

__device__ __forceinline__ int ngroups(int nchunks, int g) {
  if (nchunks <= 0) return 0;
  if (g <= 0) return 1;
  return (nchunks + g - 1) / g;
}

struct Producer {
  const PxParams* p;
  uint64_t cached_tail;
  bool ok;

  __device__ void push(uint32_t op, uint32_t peer, uint32_t flags, uint32_t sig_idx, uint64_t src, uint64_t dst_off,
                       uint64_t bytes, uint64_t value) {
    if (!ok) return;
    const MtGpuView& v = p->v;
    uint64_t slot = atomicAdd(v.head_dev, 1ull);
    if (slot - cached_tail >= v.nslots) {
      uint64_t t0 = mt::now_ns();
      for (;;) {
        cached_tail = mt::ld_volatile(v.tail_dev);
        if (slot - cached_tail < v.nslots) break;
        if (mt::now_ns() - t0 > p->w.timeout_ns || *(volatile int*)p->w.abort_flag) {
          mt::report(p->w, MT_ERR_FIFO_FULL, (int)peer, (int)(slot % v.nslots), p->epoch, cached_tail, slot);
          ok = false;
          return;
        }
      }
    }
    volatile uint64_t* d = reinterpret_cast<volatile uint64_t*>(v.fifo_dev + (slot % v.nslots));
    d[0] = (uint64_t)op | ((uint64_t)peer << 32);
    d[1] = (uint64_t)flags | ((uint64_t)sig_idx << 32);
    d[2] = src;
    d[3] = dst_off;
    d[4] = bytes;
    d[5] = value;
    d[6] = 0;
    __threadfence_system();
    d[7] = slot + 1;  // ready flag last
  }
};

__global__ void pxy_exchange_kernel(PxParams p) {
  const int par = (int)(p.epoch & 1);
  const uint64_t tag = tag_of(p.epoch);
  const uint64_t* mat = reinterpret_cast<const uint64_t*>(p.ctrl_local + MT_OFF_MAT);
  if (threadIdx.x == 0) {
    Producer pr{&p, 0, true};
    // my count-matrix row to every rank (immediate 8-byte writes through the proxy)
    for (int q = 0; q < p.world; ++q)
      for (int col = 0; col < p.world; ++col)
        pr.push(MT_OP_WRITE64, q, 0, 0, 0, MT_OFF_MAT + 8ull * ((size_t)(par * MT_MAX_WORLD + p.rank) * MT_MAX_WORLD + col),
                0, mt::tagged(tag, (uint64_t)p.send_counts[col]));
    long long src_off = 0;
    for (int d = 0; d < p.world && pr.ok; ++d) {
      const long long cnt = p.send_counts[d];
      long long dst_rows = 0;
      bool ok = true;
      for (int s = 0; s < p.rank && ok; ++s) {
        uint64_t v = mt::wait_word(p.w, mat + ((size_t)(par * MT_MAX_WORLD + s) * MT_MAX_WORLD + d), tag, false,
                                   MT_ERR_TIMEOUT_COUNTS, s, d, &ok);
        dst_rows += (long long)(v & MT_COUNT_MASK);
      }
      // d has entered this call: its readers of the area we write (output of call epoch-2) are done
      if (ok && d >= p.rank)
        mt::wait_word(p.w, mat + ((size_t)(par * MT_MAX_WORLD + d) * MT_MAX_WORLD), tag, false, MT_ERR_TIMEOUT_COUNTS,
                      d, -3, &ok);
      if (!ok) {
        pr.ok = false;
        break;
      }
      bool fits = (uint64_t)(dst_rows + cnt) * p.row_bytes <= p.data_bytes;
      if (!fits) mt::report(p.w, MT_ERR_CAPACITY, d, (int)cnt, p.epoch, (uint64_t)(dst_rows + cnt), p.data_bytes / p.row_bytes);
      long long crow;
      int nch;
      chunking(cnt, p.chunk_rows, &crow, &nch);
      const int g = p.group <= 0 ? nch : p.group;
      for (int c = 0; c < nch; ++c) {
        const long long r0 = (long long)c * crow;
        const long long rows = (cnt - r0) < crow ? (cnt - r0) : crow;
        pr.push(MT_OP_PUT, d, p.coupled ? MT_F_SIGNAL : 0, c, (uint64_t)(p.send + (uint64_t)(src_off + r0) * p.row_bytes),
                (uint64_t)par * p.data_bytes + (uint64_t)(dst_rows + r0) * p.row_bytes,
                fits ? (uint64_t)rows * p.row_bytes : 0, p.epoch);
        if (!p.coupled && ((c + 1) % g == 0 || c == nch - 1)) pr.push(MT_OP_SIGNAL, d, 0, c / g, 0, 0, 0, p.epoch);
      }
      src_off += cnt;
    }
    pr.push(MT_OP_ACK, 0, 0, 0, 0, 0, 0, p.epoch);
  }
  __syncthreads();
  const int t = threadIdx.x;
  if (t < p.world) {
    // what source t sends me: its count (from the matrix), then its signals
    bool ok = true;
    uint64_t v = mt::wait_word(p.w, mat + ((size_t)(par * MT_MAX_WORLD + t) * MT_MAX_WORLD + p.rank), tag, false,
                               MT_ERR_TIMEOUT_COUNTS, t, -1, &ok);
    if (!ok) return;
    const long long cnt = (long long)(v & MT_COUNT_MASK);
    if (p.recv_counts != nullptr && cnt != p.recv_counts[t])
      mt::report(p.w, MT_ERR_COUNT_MISMATCH, t, 0, p.epoch, (uint64_t)cnt, (uint64_t)p.recv_counts[t]);
    long long crow;
    int nch;
    chunking(cnt, p.chunk_rows, &crow, &nch);
    const int nsig = p.coupled ? nch : ngroups(nch, p.group);
    const uint64_t* sig = reinterpret_cast<const uint64_t*>(p.ctrl_local + MT_OFF_SIG) + (size_t)t * MT_MAX_SLOTS;
    for (int k = 0; k < nsig && ok; ++k) mt::wait_word(p.w, sig + k, p.epoch, true, MT_ERR_TIMEOUT_SIGNAL, t, k, &ok);
  } else if (t == 31) {
    // my own transfers completed (source rows may be reused after the kernel)
    bool ok = true;
    for (int q = 0; q < p.v.qps && ok; ++q)
      mt::wait_word(p.w, p.v.ack_dev + q, p.epoch, true, MT_ERR_TIMEOUT_OUTGOING, -1, q, &ok);
  }
}

__global__ void pxy_counts_kernel(PxParams p) {
  const int par = (int)(p.epoch & 1);
  const uint64_t tag = tag_of(p.epoch);
  if (threadIdx.x == 0) {
    Producer pr{&p, 0, true};
    for (int q = 0; q < p.world; ++q)
      pr.push(MT_OP_WRITE64, q, 0, 0, 0, MT_OFF_CNT + 8ull * (par * MT_MAX_WORLD + p.rank), 0,
              mt::tagged(tag, (uint64_t)p.send_counts[q]));
  }
  __syncthreads();
  const int t = threadIdx.x;
  if (t < p.world) {
    bool ok = true;
    const uint64_t* mine = reinterpret_cast<const uint64_t*>(p.ctrl_local + MT_OFF_CNT) + par * MT_MAX_WORLD + t;
    uint64_t v = mt::wait_word(p.w, mine, tag, false, MT_ERR_TIMEOUT_COUNTS, t, -2, &ok);
    p.recv_out[t] = ok ? (int64_t)(v & MT_COUNT_MASK) : 0;
  }
}

// Race checker: CTA i waits for flag i to reach `epoch`, then at once compares the LAST check_bytes
// of transfer i (bytes at base + i*stride) with the expected int32 pattern (pattern_base + i).
// bad[i] = number of stale 4-byte words seen (-1: the signal never came).
__global__ void race_check_kernel(const uint64_t* flags, uint64_t flag_stride_words, const char* base, uint64_t stride,
                                  uint64_t bytes, uint64_t check_bytes, int pattern_base, uint64_t epoch,
                                  uint64_t timeout_ns, int* bad) {
  const int i = blockIdx.x;
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    const uint64_t* f = flags + (uint64_t)i * flag_stride_words;
    uint64_t t0 = mt::now_ns();
    int ok = 1;
    while (mt::ld_acquire_sys(f) < epoch) {
      if (mt::now_ns() - t0 > timeout_ns) {
        ok = 0;
        break;
      }
    }
    s_ok = ok;
    if (!ok) bad[i] = -1;
  }
  __syncthreads();
  if (!s_ok) return;
  const uint64_t cb = check_bytes < bytes ? check_bytes : bytes;
  const int* w = reinterpret_cast<const int*>(base + (uint64_t)i * stride + (bytes - cb));
  const int expect = pattern_base + i;
  int n = 0;
  for (uint64_t k = threadIdx.x; k < cb / 4; k += blockDim.x) {
    int v = *reinterpret_cast<const volatile int*>(w + k);
    n += (v != expect);
  }
  if (n) atomicAdd(&bad[i], n);
}

}  // namespace

MT_API int mt_pxy_create(void* engine, int device, int rank, int world, uint64_t ctrl_local, double timeout_s, void** out) {
  MT_REQUIRE(world >= 1 && world <= MT_MAX_WORLD, 300, "world %d outside 1..%d", world, MT_MAX_WORLD);
  MT_REQUIRE(world < 32, 301, "world must be < 32");
  MT_REQUIRE(engine != nullptr, 305, "no proxy engine");
  {
    int rc = mt_proxy_mark_gpu_producer_internal(engine);
    if (rc != 0) return rc;
  }
  MT_CUDA(cudaSetDevice(device));
  PxCtx* c = new PxCtx();
  c->engine = engine;
  mt_proxy_gpu_view(engine, &c->v);
  c->device = device;
  c->rank = rank;
  c->world = world;
  c->ctrl_local = ctrl_local;
  c->timeout_ns = (uint64_t)(timeout_s * 1e9);
  cudaError_t e = cudaHostAlloc((void**)&c->err_host, MT_ERR_WORDS * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) {
    memset(c->err_host, 0, MT_ERR_WORDS * sizeof(int));
    e = cudaHostGetDevicePointer((void**)&c->err_dev, c->err_host, 0);
  }
  if (e == cudaSuccess) e = cudaMalloc((void**)&c->abort_flag, sizeof(int));
  if (e == cudaSuccess) e = cudaMemset(c->abort_flag, 0, sizeof(int));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    mt::set_error("mt_pxy_create: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
    delete c;
    return (int)e;
  }
  *out = c;
  return 0;
}

MT_API int mt_pxy_set_data(void* h, uint64_t data_bytes_per_parity) {
  static_cast<PxCtx*>(h)->data_bytes = data_bytes_per_parity;
  return 0;
}

static PxParams base_params(PxCtx* c, uint64_t epoch) {
  PxParams p;
  memset(&p, 0, sizeof(p));
  p.v = c->v;
  p.ctrl_local = c->ctrl_local;
  p.data_bytes = c->data_bytes;
  p.rank = c->rank;
  p.world = c->world;
  p.epoch = epoch;
  p.w.err = c->err_dev;
  p.w.abort_flag = c->abort_flag;
  p.w.timeout_ns = c->timeout_ns;
  p.w.rank = c->rank;
  return p;
}

MT_API int mt_pxy_counts(void* h, const int64_t* send_counts, int64_t* recv_counts, uint64_t epoch, uint64_t stream) {
  PxCtx* c = static_cast<PxCtx*>(h);
  MT_REQUIRE(epoch >= 1, 302, "epoch must be >= 1");
  MT_CUDA(cudaSetDevice(c->device));
  PxParams p = base_params(c, epoch);
  p.send_counts = send_counts;
  p.recv_out = recv_counts;
  pxy_counts_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(p);
  MT_CUDA(cudaGetLastError());
  return 0;
}

MT_API int mt_pxy_exchange(void* h, const void* send, uint64_t row_bytes, const int64_t* send_counts,
                           const int64_t* recv_counts, int coupled, int group_size, int chunk_rows, uint64_t epoch,
                           uint64_t stream) {
  PxCtx* c = static_cast<PxCtx*>(h);
  MT_REQUIRE(epoch >= 1, 302, "epoch must be >= 1");
  MT_REQUIRE(c->data_bytes > 0, 303, "no data buffer: call reserve() first");
  MT_REQUIRE(row_bytes > 0, 304, "row_bytes must be > 0");
  MT_CUDA(cudaSetDevice(c->device));
  PxParams p = base_params(c, epoch);
  p.send = static_cast<const char*>(send);
  p.row_bytes = row_bytes;
  p.send_counts = send_counts;
  p.recv_counts = recv_counts;
  p.coupled = coupled ? 1 : 0;
  p.group = group_size;
  p.chunk_rows = chunk_rows;
  pxy_exchange_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(p);
  MT_CUDA(cudaGetLastError());
  return 0;
}

MT_API int mt_pxy_err_ptr(void* h, void** out) {
  *out = static_cast<PxCtx*>(h)->err_host;
  return 0;
}

MT_API int mt_pxy_error(void* h, int* out) {
  PxCtx* c = static_cast<PxCtx*>(h);
  volatile int* e = c->err_host;
  for (int i = 0; i < MT_ERR_WORDS; ++i) out[i] = e[i];
  return 0;
}

MT_API int mt_pxy_destroy(void* h) {
  PxCtx* c = static_cast<PxCtx*>(h);
  if (c == nullptr) return 0;
  cudaSetDevice(c->device);
  cudaDeviceSynchronize();
  if (c->err_host) cudaFreeHost(c->err_host);
  if (c->abort_flag) cudaFree(c->abort_flag);
  delete c;
  return 0;
}

MT_API int mt_race_check_launch(int device, uint64_t stream, const uint64_t* flags, uint64_t flag_stride_words,
                                const void* base, uint64_t stride, uint64_t bytes, uint64_t check_bytes, int n,
                                int pattern_base, uint64_t epoch, double timeout_s, int* bad) {
  MT_REQUIRE(n >= 1 && n <= 4096, 310, "n %d outside 1..4096", n);
  MT_CUDA(cudaSetDevice(device));
  race_check_kernel<<<n, 256, 0, (cudaStream_t)stream>>>(flags, flag_stride_words, static_cast<const char*>(base), stride,
                                                        bytes, check_bytes, pattern_base, epoch,
                                                        (uint64_t)(timeout_s * 1e9), bad);
  MT_CUDA(cudaGetLastError());
  return 0;
}
