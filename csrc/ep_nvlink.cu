// moetune csrc: NVLink one-sided exchange. Kernels store packed rows straight into the peer's
// receive buffer (a symmetric buffer mapped into this process), then signal.
//
// One launch per exchange, grid = world * cpp CTAs (cpp = CTAs per destination, from num_sms):
//   phase 0  CTA 0 broadcasts this rank's send_counts row into every rank's count matrix
//            (tagged 64-bit words: count and the call's tag in one store: a signalled put of 8 bytes);
//   phase 1  CTA (d, j) computes its source offset locally and its offset inside d's buffer as
//            sum_{s < rank} M[s][d] (waiting on the tagged words of lower ranks) -- on the GPU;
//   phase 2  CTA (d, j) copies its 1/cpp share of the rows bound for d with 16-byte vector loads/stores:
//            the bytes of a packed send buffer as one span, or row by row (a warp per row) from a
//            strided source (combine reading the receive buffer's payload columns in place) or gathered
//            from the tokens (dispatch writing EPBuffer's wire rows -- payload, ids, weights -- straight
//            from x, so no packing launch and no packed copy in local memory);
//   phase 3  signal: coupled  -> every thread fences (system scope), CTA's thread 0 writes its slot;
//                    decoupled-> CTAs fence at GPU scope and bump a per-group counter; the last CTA
//                                of the group to arrive issues ONE system fence and the group's signals;
//   phase 4  CTA (d, j) waits for source d's signal slot j (>= this call's epoch), bounded by a timeout;
//            CTA 0 then checks that the rows all sources send this rank fit its area (else reports the overflow).
// Signals are epoch counters (the call number, kept on the device so launches can be captured in a
// CUDA graph): buffers need no reset between calls.
#include <string.h>

#include "mt_common.h"

namespace {

using mt::WaitCtx;

__host__ __device__ inline uint64_t tag_of(uint64_t n) { return ((n - 1) % 0xFFFFFEull) + 1; }

struct NvlCtx {
  int device = 0, rank = 0, world = 1;
  int num_sms = 24, sm_count = 132;
  uint64_t ctrl[MT_MAX_WORLD] = {0};
  uint64_t data[MT_MAX_WORLD] = {0};
  uint64_t data_bytes = 0;  // bytes of ONE parity area
  int* err_host = nullptr;
  int* err_dev = nullptr;
  int* abort_flag = nullptr;  // device memory, 2 words: the abort flag, the error record's claim (mt::WaitCtx)
  unsigned long long* group_ctr = nullptr;  // [MT_MAX_WORLD][MT_MAX_SLOTS]
  // Device-side epochs (so launches can be captured in CUDA graphs): [0] last completed exchange,
  // [1] last completed exchange_counts, [2] exchange CTA arrivals (monotonic).
  unsigned long long* epochs = nullptr;
  int last_kind = 0;  // the last call launched: 0 exchange, 1 exchange_counts (mt_nvl_clear_error)
  uint64_t timeout_ns = 10ull * 1000 * 1000 * 1000;
};

enum RowMode { kSpan = 0, kStrided = 1, kGather = 2 };

struct XParams {
  uint64_t ctrl[MT_MAX_WORLD];
  uint64_t data[MT_MAX_WORLD];
  uint64_t data_bytes;
  const char* send;
  uint64_t send_rows;       // the rows the counts address: send's rows (kSpan, kStrided) or tok's entries (kGather)
  uint64_t x_rows;          // kGather: rows of x, g_idx and g_w (every token tok[i] the counts reach is below it)
  uint64_t row_bytes;
  int mode;                 // RowMode
  uint64_t src_stride;      // kStrided / kGather: bytes between source rows (of send / of x)
  const int64_t* tok;       // kGather: token of every send row (rank-major, as the plan kernel wrote it)
  const int64_t* g_idx;     // kGather: int64 [S, k] expert ids
  const float* g_w;         // kGather: fp32 [S, k] weights
  int k;
  uint64_t payload_bytes, id_off, weight_off;  // kGather: the wire row's layout
  const int64_t* send_counts;
  const int64_t* recv_counts;  // may be null: checked against what the senders sent
  int64_t* recv_out;           // may be null: receives the counts (fused dispatch, no exchange_counts)
  int rank, world, cpp, group, coupled;
  unsigned long long* epochs;
  unsigned long long* group_ctr;
  WaitCtx w;
};

struct CParams {
  uint64_t ctrl[MT_MAX_WORLD];
  const int64_t* send_counts;
  int64_t* recv_counts;
  int rank, world;
  unsigned long long* epochs;
  WaitCtx w;
};

__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void copy_bytes(char* dst, const char* src, uint64_t n) {
  const uint64_t tid = threadIdx.x, nt = blockDim.x;
  if ((((uintptr_t)dst | (uintptr_t)src | n) & 15ull) == 0) {
    int4* d = reinterpret_cast<int4*>(dst);
    const int4* s = reinterpret_cast<const int4*>(src);
    const uint64_t nv = n >> 4;
    uint64_t i = tid;
    for (; i + 3 * nt < nv; i += 4 * nt) {
      int4 a = ld_nc_v4(s + i), b = ld_nc_v4(s + i + nt), c = ld_nc_v4(s + i + 2 * nt),
           e = ld_nc_v4(s + i + 3 * nt);
      d[i] = a;
      d[i + nt] = b;
      d[i + 2 * nt] = c;
      d[i + 3 * nt] = e;
    }
    for (; i < nv; i += nt) d[i] = ld_nc_v4(s + i);
  } else {
    for (uint64_t i = tid; i < n; i += nt) dst[i] = src[i];
  }
}

// A warp copies n bytes (16-byte vectors when aligned; 8 in flight per lane).
__device__ __forceinline__ void warp_copy(char* dst, const char* src, uint64_t n, int lane) {
  if ((((uintptr_t)dst | (uintptr_t)src | n) & 15ull) == 0) {
    int4* d = reinterpret_cast<int4*>(dst);
    const int4* s = reinterpret_cast<const int4*>(src);
    const uint64_t nv = n >> 4;
    constexpr int U = 8;
    for (uint64_t base = 0; base < nv; base += 32 * U) {
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint64_t i = base + (uint64_t)u * 32 + lane;
        if (i < nv) v[u] = ld_nc_v4(s + i);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint64_t i = base + (uint64_t)u * 32 + lane;
        if (i < nv) d[i] = v[u];
      }
    }
  } else {
    for (uint64_t i = lane; i < n; i += 32) dst[i] = src[i];
  }
}

__device__ __forceinline__ void warp_zero(char* dst, uint64_t from, uint64_t to, int lane) {
  for (uint64_t b = from + lane; b < to; b += 32) dst[b] = 0;
}

// Rows [lo, hi) of the cnt bound for this CTA's destination, a warp per row.
__device__ void copy_rows(const XParams& p, char* dst_base, long long src_off, uint64_t lo, uint64_t hi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (uint64_t r = lo + warp; r < hi; r += nwarps) {
    char* dst = dst_base + r * p.row_bytes;
    if (p.mode == kStrided) {
      warp_copy(dst, p.send + (uint64_t)(src_off + r) * p.src_stride, p.row_bytes, lane);
      continue;
    }
    const int64_t t = p.tok[src_off + r];
    warp_copy(dst, p.send + (uint64_t)t * p.src_stride, p.payload_bytes, lane);
    warp_zero(dst, p.payload_bytes, p.id_off, lane);
    for (int q = lane; q < p.k; q += 32) {
      reinterpret_cast<int64_t*>(dst + p.id_off)[q] = p.g_idx[t * p.k + q];
      reinterpret_cast<float*>(dst + p.weight_off)[q] = p.g_w[t * p.k + q];
    }
    warp_zero(dst, p.weight_off + 4ull * p.k, p.row_bytes, lane);
  }
}

// Every CTA decides alone, from the same inputs, whether this rank refuses its send counts (mt::send_counts_fit; for
// the gather, also a token outside x): every CTA must know before it copies anything, and CTA 0 before it publishes
// the row. The rows the counts address, and for the gather the tokens they reach, are checked before any byte goes
// to a peer; CTA 0 reports (MT_ERR_SEND_COUNTS, without the abort flag: mt::report_refusal).
__device__ bool refuse_send(const XParams& p, uint64_t epoch) {
  __shared__ int s_fit;
  __shared__ unsigned long long s_rows, s_bad;
  if (threadIdx.x == 0) {
    s_fit = mt::send_counts_fit(p.w, p.send_counts, p.world, p.send_rows, epoch, blockIdx.x == 0) ? 1 : 0;
    unsigned long long n = 0;
    for (int q = 0; s_fit && q < p.world; ++q) n += (unsigned long long)p.send_counts[q];
    s_rows = n;
    s_bad = ~0ull;
  }
  __syncthreads();
  if (!s_fit) return true;
  if (p.mode != kGather) return false;
  // the gather reads x, g_idx and g_w at row tok[i] for each send row i < s_rows (<= tok's entries, checked above).
  // Every CTA scans them all before its first copy; kept short: 16-byte loads (two tokens each), 8 of them in flight
  // per thread (at 8 ranks x 4096 tokens x top-8, ~21k rows: ~3 rounds of loads a thread instead of ~42 dependent ones)
  int bad = 0;
  auto check = [&](unsigned long long i, int64_t t) {
    if (t < 0 || (uint64_t)t >= p.x_rows) {
      bad = 1;
      atomicMin(&s_bad, i);
    }
  };
  unsigned long long head = 0;  // tokens before the first 16-byte boundary (tok is 8-byte aligned)
  if (reinterpret_cast<uintptr_t>(p.tok) & 15) head = s_rows > 0 ? 1 : 0;
  if (threadIdx.x == 0 && head) check(0, p.tok[0]);
  const longlong2* t2 = reinterpret_cast<const longlong2*>(p.tok + head);
  const unsigned long long n2 = (s_rows - head) / 2;
  constexpr int U = 8;
  for (unsigned long long base = 0; base < n2; base += (unsigned long long)U * blockDim.x) {
    longlong2 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned long long k = base + (unsigned long long)u * blockDim.x + threadIdx.x;
      v[u] = k < n2 ? t2[k] : make_longlong2(0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned long long k = base + (unsigned long long)u * blockDim.x + threadIdx.x;
      if (k < n2) {
        check(head + 2 * k, v[u].x);
        check(head + 2 * k + 1, v[u].y);
      }
    }
  }
  if (threadIdx.x == 0 && head + 2 * n2 < s_rows) check(s_rows - 1, p.tok[s_rows - 1]);
  if (!__syncthreads_or(bad)) return false;
  if (blockIdx.x == 0 && threadIdx.x == 0) {  // slot 2: peer = the destination of the first such row
    int dest = 0;
    for (unsigned long long end = 0; dest < p.world; ++dest)
      if (s_bad < (end += (unsigned long long)p.send_counts[dest])) break;
    mt::report_refusal(p.w, MT_ERR_SEND_COUNTS, dest, 2, epoch, (uint64_t)p.tok[s_bad], p.x_rows);
  }
  return true;
}

__global__ void __launch_bounds__(512) nvl_exchange_kernel(XParams p) {
  const uint64_t epoch = *reinterpret_cast<volatile unsigned long long*>(p.epochs) + 1;
  const int b = blockIdx.x;
  const int d = b / p.cpp, j = b % p.cpp;
  const int par = (int)(epoch & 1);
  const uint64_t tag = tag_of(epoch);
  __shared__ long long s_cnt, s_src_off, s_dst_off;
  __shared__ int s_skip, s_d_refused;

  // A refusing rank still publishes its row (every word marked MT_COUNT_REFUSED, this call's tag) and still waits
  // for a word of every peer's row (phase 1: CTA (d, j) waits for d's), but copies, signals and receives nothing:
  // the peers end their waits on its words at once (MT_ERR_PEER_REFUSED), send it nothing and wait for no signal
  // from it, and every rank has seen every rank's word of this call (the parity protocol: mt::report_refusal).
  const bool refused = refuse_send(p, epoch);

  // phase 0: my row of the count matrix to every rank (including me)
  if (b == 0 && (int)threadIdx.x < p.world * p.world) {
    const int q = threadIdx.x / p.world, col = threadIdx.x % p.world;
    uint64_t* m = reinterpret_cast<uint64_t*>(p.ctrl[q] + MT_OFF_MAT) +
                  ((size_t)(par * MT_MAX_WORLD + p.rank) * MT_MAX_WORLD + col);
    mt::st_relaxed_sys(m, refused ? mt::tagged_refused(tag) : mt::tagged(tag, (uint64_t)p.send_counts[col]));
  }

  // phase 1: offsets, computed on the GPU
  if (threadIdx.x == 0) {
    long long src_off = 0;
    for (int q = 0; q < d; ++q) src_off += p.send_counts[q];
    const long long cnt = p.send_counts[d];
    long long dst_off = 0;
    bool ok = true, d_refused = false;
    const uint64_t* mine = reinterpret_cast<const uint64_t*>(p.ctrl[p.rank] + MT_OFF_MAT);
    for (int s = 0; s < p.rank && ok; ++s) {
      uint64_t v = mt::wait_word(p.w, mine + ((size_t)(par * MT_MAX_WORLD + s) * MT_MAX_WORLD + d), tag, false,
                                 MT_ERR_TIMEOUT_COUNTS, s, d, &ok);
      dst_off += (long long)(v & MT_COUNT_MASK);  // a refusing rank's word: 0 rows (it sends none)
      if (s == d && mt::is_refused(v)) d_refused = true;  // d < rank: d's own word is among these
    }
    // d has entered this call (its row arrived): everything d enqueued before it -- readers of the
    // output of call epoch-2, which lives in the area we are about to write -- has completed.
    if (ok && d >= p.rank)
      d_refused = mt::is_refused(mt::wait_word(p.w, mine + ((size_t)(par * MT_MAX_WORLD + d) * MT_MAX_WORLD), tag,
                                               false, MT_ERR_TIMEOUT_COUNTS, d, -3, &ok));
    // refused: this rank sends nothing; d_refused: d refused its counts, takes no rows and waits for no signal
    int skip = ok && !refused && !d_refused ? 0 : 1;
    if (!skip && cnt > 0 && (uint64_t)(dst_off + cnt) * p.row_bytes > p.data_bytes) {  // 0 rows overflow nothing
      if (j == 0) mt::report(p.w, MT_ERR_CAPACITY, d, (int)cnt, epoch, (uint64_t)(dst_off + cnt), p.data_bytes / p.row_bytes);
      skip = 1;
    }
    s_cnt = cnt;
    s_src_off = src_off;
    s_dst_off = dst_off;
    s_skip = skip;
    s_d_refused = d_refused ? 1 : 0;
  }
  __syncthreads();
  // no signal either way when this rank or d refused: d (refusing) waits for none, and we (refusing) sent nothing.
  // The group counters below still count every CTA (their targets assume every call's arrivals).
  const bool signal = !refused && !s_d_refused;

  // phase 2: this CTA's share of the bytes bound for d
  if (!s_skip && s_cnt > 0 && p.mode != kSpan) {
    const uint64_t per = ((uint64_t)s_cnt + p.cpp - 1) / p.cpp;
    const uint64_t lo = (uint64_t)j * per;
    const uint64_t hi = lo + per < (uint64_t)s_cnt ? lo + per : (uint64_t)s_cnt;
    char* dst_base = reinterpret_cast<char*>(p.data[d] + (uint64_t)par * p.data_bytes) + (uint64_t)s_dst_off * p.row_bytes;
    if (lo < hi) copy_rows(p, dst_base, s_src_off, lo, hi);
  } else if (!s_skip && s_cnt > 0) {
    const uint64_t total = (uint64_t)s_cnt * p.row_bytes;
    uint64_t chunk = (total + p.cpp - 1) / p.cpp;
    chunk = (chunk + 15) & ~15ull;
    const uint64_t lo = (uint64_t)j * chunk;
    const uint64_t hi = lo + chunk < total ? lo + chunk : total;
    if (lo < hi) {
      char* dst = reinterpret_cast<char*>(p.data[d] + (uint64_t)par * p.data_bytes) +
                  (uint64_t)s_dst_off * p.row_bytes + lo;
      const char* src = p.send + (uint64_t)s_src_off * p.row_bytes + lo;
      copy_bytes(dst, src, hi - lo);
    }
  }

  // phase 3: signal(s)
  uint64_t* sig_at_peer = reinterpret_cast<uint64_t*>(p.ctrl[d] + MT_OFF_SIG) + (size_t)p.rank * MT_MAX_SLOTS;
  if (p.coupled) {
    __threadfence_system();  // the fence between this transfer's data and its signal
    __syncthreads();
    if (threadIdx.x == 0 && signal) mt::st_release_sys(sig_at_peer + j, epoch);
  } else {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const int g = p.group;
      const int gid = j / g, first = gid * g;
      const int members = (first + g <= p.cpp) ? g : (p.cpp - first);
      unsigned long long old = atomicAdd(&p.group_ctr[(size_t)d * MT_MAX_SLOTS + gid], 1ull);
      if (old + 1 == epoch * (unsigned long long)members && signal) {  // (a group's CTAs share d: one verdict)
        __threadfence_system();  // one fence for the whole group
        for (int k = 0; k < members; ++k) mt::st_relaxed_sys(sig_at_peer + first + k, epoch);
      }
    }
  }

  // phase 4: wait for what source d sent me (slot j)
  if (threadIdx.x == 0) {
    bool ok = true;
    if (refused || s_d_refused) {
      // nothing comes from d in this call: this rank refused (nobody sends it rows) or d did (its marked word is
      // why: reported once, by CTA (d, 0), unless this rank's own refusal is the record)
      if (j == 0 && p.recv_out != nullptr) p.recv_out[d] = 0;
      if (j == 0 && !refused) mt::report_refusal(p.w, MT_ERR_PEER_REFUSED, d, -1, epoch, 0, 0);
    } else {
      const uint64_t* mysig = reinterpret_cast<const uint64_t*>(p.ctrl[p.rank] + MT_OFF_SIG) + (size_t)d * MT_MAX_SLOTS + j;
      mt::wait_word(p.w, mysig, epoch, true, MT_ERR_TIMEOUT_SIGNAL, d, j, &ok);
      if (ok && j == 0 && (p.recv_counts != nullptr || p.recv_out != nullptr)) {
        const uint64_t* m = reinterpret_cast<const uint64_t*>(p.ctrl[p.rank] + MT_OFF_MAT) +
                            ((size_t)(par * MT_MAX_WORLD + d) * MT_MAX_WORLD + p.rank);
        uint64_t v = mt::wait_word(p.w, m, tag, false, MT_ERR_TIMEOUT_COUNTS, d, -1, &ok);
        if (p.recv_out != nullptr) p.recv_out[d] = ok ? (int64_t)(v & MT_COUNT_MASK) : 0;
        if (ok && p.recv_counts != nullptr && (long long)(v & MT_COUNT_MASK) != p.recv_counts[d])
          mt::report(p.w, MT_ERR_COUNT_MISMATCH, d, 0, epoch, v & MT_COUNT_MASK, (uint64_t)p.recv_counts[d]);
      }
    }
    // CTA 0: the receiver's own capacity check (mt::check_receive_capacity: senders that each fit can together
    // overflow this rank, whose call would then complete with rows missing); a refusing rank receives nothing
    if (ok && b == 0 && !refused)
      mt::check_receive_capacity(p.w, reinterpret_cast<const uint64_t*>(p.ctrl[p.rank] + MT_OFF_MAT), par, p.rank,
                                 p.world, tag, epoch, p.data_bytes / p.row_bytes, &ok);
    // the last CTA to finish publishes this epoch (the next launch on the stream reads it)
    unsigned long long old = atomicAdd(p.epochs + 2, 1ull);
    if (old + 1 == epoch * (unsigned long long)gridDim.x) atomicExch(p.epochs, (unsigned long long)epoch);
  }
}

__global__ void nvl_counts_kernel(CParams p) {
  const uint64_t epoch = *reinterpret_cast<volatile unsigned long long*>(p.epochs + 1) + 1;
  const int t = threadIdx.x;
  const int par = (int)(epoch & 1);
  const uint64_t tag = tag_of(epoch);
  if (t < p.world) {
    uint64_t* dst = reinterpret_cast<uint64_t*>(p.ctrl[t] + MT_OFF_CNT) + par * MT_MAX_WORLD + p.rank;
    mt::st_relaxed_sys(dst, mt::count_word(p.w, tag, p.send_counts[t], t, epoch));
    bool ok = true;
    const uint64_t* mine = reinterpret_cast<const uint64_t*>(p.ctrl[p.rank] + MT_OFF_CNT) + par * MT_MAX_WORLD + t;
    uint64_t v = mt::wait_word(p.w, mine, tag, false, MT_ERR_TIMEOUT_COUNTS, t, -2, &ok);
    p.recv_counts[t] = ok ? mt::counts_received(p.w, v, t, epoch) : 0;
  }
  __syncthreads();
  if (t == 0) atomicExch(p.epochs + 1, (unsigned long long)epoch);
}

}  // namespace

MT_API int mt_nvl_create(int device, int rank, int world, const uint64_t* ctrl_ptrs, int num_sms, double timeout_s,
                         void** out) {
  MT_REQUIRE(world >= 1 && world <= MT_MAX_WORLD, 100, "world %d outside 1..%d", world, MT_MAX_WORLD);
  MT_REQUIRE(rank >= 0 && rank < world, 101, "rank %d outside 0..%d", rank, world - 1);
  MT_SET_DEVICE(device);
  NvlCtx* c = new NvlCtx();
  c->device = device;
  c->rank = rank;
  c->world = world;
  c->num_sms = num_sms < 1 ? 1 : num_sms;
  for (int i = 0; i < world; ++i) c->ctrl[i] = ctrl_ptrs[i];
  c->timeout_ns = mt::timeout_ns(timeout_s);
  cudaError_t e = cudaDeviceGetAttribute(&c->sm_count, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaHostAlloc((void**)&c->err_host, MT_ERR_WORDS * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) {
    memset(c->err_host, 0, MT_ERR_WORDS * sizeof(int));
    e = cudaHostGetDevicePointer((void**)&c->err_dev, c->err_host, 0);
  }
  if (e == cudaSuccess) e = cudaMalloc((void**)&c->abort_flag, 2 * sizeof(int));
  if (e == cudaSuccess) e = cudaMemset(c->abort_flag, 0, 2 * sizeof(int));
  if (e == cudaSuccess) e = cudaMalloc((void**)&c->group_ctr, sizeof(unsigned long long) * MT_MAX_WORLD * MT_MAX_SLOTS);
  if (e == cudaSuccess) e = cudaMemset(c->group_ctr, 0, sizeof(unsigned long long) * MT_MAX_WORLD * MT_MAX_SLOTS);
  if (e == cudaSuccess) e = cudaMalloc((void**)&c->epochs, 64);
  if (e == cudaSuccess) e = cudaMemset(c->epochs, 0, 64);
  // the memsets done before any launch, within the context's timeout (as mt_nvl_destroy waits): never without end
  if (e == cudaSuccess) e = mt::setup_sync_within(device, c->timeout_ns);
  if (e == cudaErrorNotReady) {
    // the memsets may still be queued behind that work: what they write is leaked, as mt_nvl_destroy leaks it
    mt::set_error("mt_nvl_create: the set-up work on device %d (the memsets of its abort flag, group counters and "
                  "epochs) did not complete within %.1f s: other work on the device does not end (a stuck persistent "
                  "kernel, a peer that never signals). The error record, abort flag, group counters and epochs are "
                  "leaked rather than freed under it; end that work (or restart the process) before building the "
                  "transport again", device, (double)mt::setup_timeout_ns(c->timeout_ns) / 1e9);
    delete c;
    return 119;
  }
  if (e != cudaSuccess) {
    mt::set_error("mt_nvl_create: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
    delete c;
    return (int)e;
  }
  *out = c;
  return 0;
}

MT_API int mt_nvl_set_data(void* h, const uint64_t* data_ptrs, uint64_t data_bytes_per_parity) {
  NvlCtx* c = static_cast<NvlCtx*>(h);
  for (int i = 0; i < c->world; ++i) c->data[i] = data_ptrs[i];
  c->data_bytes = data_bytes_per_parity;
  return 0;
}

MT_API int mt_nvl_ctas_per_peer(void* h, int* out) {
  NvlCtx* c = static_cast<NvlCtx*>(h);
  int cpp = c->num_sms / c->world;
  int cap = c->sm_count / c->world;  // all CTAs must be co-resident (they wait for each other's peers)
  if (cpp > cap) cpp = cap;
  if (cpp > MT_MAX_SLOTS) cpp = MT_MAX_SLOTS;
  if (cpp < 1) cpp = 1;
  *out = cpp;
  return 0;
}

static WaitCtx make_wait(NvlCtx* c) {
  WaitCtx w;
  w.err = c->err_dev;
  w.abort_flag = c->abort_flag;
  w.claim = c->abort_flag + 1;
  w.timeout_ns = c->timeout_ns;
  w.rank = c->rank;
  return w;
}

MT_API int mt_nvl_counts(void* h, const int64_t* send_counts, int64_t* recv_counts, uint64_t stream) {
  NvlCtx* c = static_cast<NvlCtx*>(h);
  MT_SET_DEVICE(c->device);
  CParams p;
  for (int i = 0; i < MT_MAX_WORLD; ++i) p.ctrl[i] = c->ctrl[i];
  p.send_counts = send_counts;
  p.recv_counts = recv_counts;
  p.rank = c->rank;
  p.world = c->world;
  p.epochs = c->epochs;
  p.w = make_wait(c);
  (void)cudaGetLastError();  // drop a stale, non-sticky error from an earlier call
  c->last_kind = 1;
  nvl_counts_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(p);
  MT_CUDA(cudaGetLastError());
  return 0;
}

static int nvl_launch(NvlCtx* c, XParams& p, const int64_t* send_counts, const int64_t* recv_counts,
                      int64_t* recv_out, int coupled, int group_size, uint64_t stream) {
  c->last_kind = 0;
  MT_REQUIRE(c->data_bytes > 0, 103, "no data buffer: call reserve() first");
  MT_REQUIRE(p.row_bytes > 0, 104, "row_bytes must be > 0");
  MT_SET_DEVICE(c->device);
  int cpp = 1;
  mt_nvl_ctas_per_peer(c, &cpp);
  int g = group_size <= 0 ? cpp : (group_size > cpp ? cpp : group_size);
  for (int i = 0; i < MT_MAX_WORLD; ++i) {
    p.ctrl[i] = c->ctrl[i];
    p.data[i] = c->data[i];
  }
  p.data_bytes = c->data_bytes;
  p.send_counts = send_counts;
  p.recv_counts = recv_counts;
  p.recv_out = recv_out;
  p.rank = c->rank;
  p.world = c->world;
  p.cpp = cpp;
  p.group = g;
  p.coupled = coupled ? 1 : 0;
  p.epochs = c->epochs;
  p.group_ctr = c->group_ctr;
  p.w = make_wait(c);
  (void)cudaGetLastError();  // drop a stale, non-sticky error from an earlier call
  nvl_exchange_kernel<<<c->world * cpp, 512, 0, (cudaStream_t)stream>>>(p);
  MT_CUDA(cudaGetLastError());
  return 0;
}

// send: send_rows packed rows of row_bytes, contiguous; send_counts (device) must be >= 0 and sum to at most
// send_rows (every CTA checks before anything is sent: MT_ERR_SEND_COUNTS on this rank, MT_ERR_PEER_REFUSED on the
// others, and the call moves no rows; mt_nvl_clear_error forgets it).
MT_API int mt_nvl_exchange(void* h, const void* send, uint64_t send_rows, uint64_t row_bytes, const int64_t* send_counts,
                           const int64_t* recv_counts, int64_t* recv_out, int coupled, int group_size,
                           uint64_t stream) {
  XParams p{};
  p.send = static_cast<const char*>(send);
  p.send_rows = send_rows;
  p.row_bytes = row_bytes;
  p.mode = kSpan;
  return nvl_launch(static_cast<NvlCtx*>(h), p, send_counts, recv_counts, recv_out, coupled, group_size, stream);
}

// src: src_rows rows, row i of the send order at src + i * src_stride, row_bytes of it sent (src_stride >=
// row_bytes); the send counts are checked against src_rows as mt_nvl_exchange's against send_rows.
MT_API int mt_nvl_exchange_strided(void* h, const void* src, uint64_t src_rows, uint64_t src_stride, uint64_t row_bytes,
                                   const int64_t* send_counts, const int64_t* recv_counts, int64_t* recv_out,
                                   int coupled, int group_size, uint64_t stream) {
  MT_REQUIRE(src_stride >= row_bytes, 105, "source row stride %llu shorter than the row (%llu bytes)",
             (unsigned long long)src_stride, (unsigned long long)row_bytes);
  XParams p{};
  p.send = static_cast<const char*>(src);
  p.send_rows = src_rows;
  p.row_bytes = row_bytes;
  p.mode = kStrided;
  p.src_stride = src_stride;
  return nvl_launch(static_cast<NvlCtx*>(h), p, send_counts, recv_counts, recv_out, coupled, group_size, stream);
}

// Dispatch gathered from the tokens: send row i is built from token tok[i] (x at x + t * x_stride,
// payload_bytes of it; ids int64 [S, k]; weights fp32 [S, k]; S = x_rows) in EPBuffer's wire-row layout.
// What bounds the source here is tok: the send counts address its first sum(send_counts) entries (at most
// tok_rows), and each of those tokens addresses a row of x, idx and w (below x_rows). Both are checked before
// anything is sent (MT_ERR_SEND_COUNTS: slots 0/1 for the counts, 2 for a token), with mt_nvl_exchange's refusal.
MT_API int mt_nvl_exchange_gather(void* h, const void* x, uint64_t x_rows, uint64_t x_stride, uint64_t payload_bytes,
                                  const int64_t* tok, uint64_t tok_rows, const int64_t* idx, const float* w, int k,
                                  uint64_t row_bytes, uint64_t id_off, uint64_t weight_off, const int64_t* send_counts,
                                  int64_t* recv_out, int coupled, int group_size, uint64_t stream) {
  MT_REQUIRE(k >= 1 && k <= 1024, 111, "top-k %d out of range", k);
  MT_REQUIRE(tok != nullptr && idx != nullptr && w != nullptr, 106, "gather needs tok, ids and weights");
  MT_REQUIRE(id_off % 8 == 0 && weight_off % 4 == 0 && weight_off + 4ull * k <= row_bytes && payload_bytes <= id_off &&
                 id_off + 8ull * k <= weight_off,
             113, "row layout inconsistent");
  XParams p{};
  p.send = static_cast<const char*>(x);
  p.send_rows = tok_rows;
  p.x_rows = x_rows;
  p.row_bytes = row_bytes;
  p.mode = kGather;
  p.src_stride = x_stride;
  p.tok = tok;
  p.g_idx = idx;
  p.g_w = w;
  p.k = k;
  p.payload_bytes = payload_bytes;
  p.id_off = id_off;
  p.weight_off = weight_off;
  return nvl_launch(static_cast<NvlCtx*>(h), p, send_counts, nullptr, recv_out, coupled, group_size, stream);
}

// Host address of the error record (int32[16], pinned): Python polls word 0 without a call.
MT_API int mt_nvl_err_ptr(void* h, void** out) {
  *out = static_cast<NvlCtx*>(h)->err_host;
  return 0;
}

MT_API int mt_nvl_error(void* h, int* out) {
  NvlCtx* c = static_cast<NvlCtx*>(h);
  volatile int* e = c->err_host;
  for (int i = 0; i < MT_ERR_WORDS; ++i) out[i] = e[i];
  return 0;
}

// Forget a refused call so that the next one runs, where mt::refusal_clearable allows it (else 107), after every
// launch so far completed: such a call kept the protocol in step (every rank published its row and saw a word of every
// other rank's, the device epochs and the group counters advanced as after any call, no rows went to or from the
// refusing rank, and a skipped signal only leaves a slot at an older epoch).
MT_API int mt_nvl_clear_error(void* h) {
  NvlCtx* c = static_cast<NvlCtx*>(h);
  MT_SET_DEVICE(c->device);
  const uint64_t deadline = mt::host_ns() + c->timeout_ns;
  MT_REQUIRE(mt::device_sync_within(c->device, deadline) != cudaErrorNotReady, 109,
             "mt_nvl_clear_error: the device's work did not complete within %.1f s", (double)c->timeout_ns / 1e9);
  int aborted = 0;
  MT_CUDA(cudaMemcpy(&aborted, c->abort_flag, sizeof(int), cudaMemcpyDeviceToHost));
  unsigned long long last = 0;  // the last launched kind's device epoch (completed by the synchronisation above)
  MT_CUDA(cudaMemcpy(&last, c->epochs + c->last_kind, sizeof(last), cudaMemcpyDeviceToHost));
  if (!mt::refusal_clearable(c->err_host, aborted != 0, c->last_kind, last)) return 107;
  // the claim with the record: a claim left set would keep every later error out of the record
  MT_CUDA(cudaMemset(c->abort_flag + 1, 0, sizeof(int)));
  // the memset is asynchronous: done before the next launch on any stream
  MT_REQUIRE(mt::device_sync_within(c->device, deadline) != cudaErrorNotReady, 109,
             "mt_nvl_clear_error: the device's work did not complete within %.1f s", (double)c->timeout_ns / 1e9);
  memset(c->err_host, 0, MT_ERR_WORDS * sizeof(int));
  return 0;
}

// Waits for every launch of this context to end, graph replays included (their kernels run on streams the context
// never sees), within the context's timeout (mt::device_sync_within); a kernel's own waits end within that timeout.
// Past it (108) what a kernel may still write is not freed: the error record, abort flag, group counters and epochs
// are leaked, and mt_last_error says so.
MT_API int mt_nvl_destroy(void* h) {
  NvlCtx* c = static_cast<NvlCtx*>(h);
  if (c == nullptr) return 0;
  mt::DeviceGuard device_guard;
  (void)device_guard.set(c->device);
  const bool busy = mt::device_sync_within(c->device, mt::host_ns() + c->timeout_ns) == cudaErrorNotReady;
  (void)cudaGetLastError();  // another launch's error is not this destroy's: keep it out of the next call's check
  if (!busy) {
    if (c->err_host) cudaFreeHost(c->err_host);
    if (c->abort_flag) cudaFree(c->abort_flag);
    if (c->group_ctr) cudaFree(c->group_ctr);
    if (c->epochs) cudaFree(c->epochs);
  }
  const double timeout_s = (double)c->timeout_ns / 1e9;
  delete c;
  MT_REQUIRE(!busy, 108, "mt_nvl_destroy: the device's work did not complete within %.1f s: the error record, abort "
             "flag, group counters and epochs are leaked rather than freed under a kernel that may still write them",
             timeout_s);
  return 0;
}
