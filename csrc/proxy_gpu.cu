// moetune csrc: the GPU side of the proxy transport. A single GPU thread produces requests into the
// proxy engine's FIFO (pinned host memory) -- the count-matrix words, the PUTs, their signals -- then
// the kernel waits for the signals of what the other ranks sent (and for the ACK of its own
// transfers). The logic lives in proxy_xchg.h (shared with the host simulation); by default the
// launching host thread then waits for the kernel's completion word (see mt_pxy_set_host_wait).
// Also: the race checker used by the unsafe-mode test.
#include <string.h>

#include <thread>
#include <vector>

#include "proxy_xchg.h"

using mtpx::PxParams;

namespace {

struct PxCtx {
  void* engine = nullptr;
  MtGpuView v;
  int device = 0, rank = 0, world = 1;
  uint64_t ctrl_local = 0;  // my control region (local pointer)
  uint64_t data_bytes = 0;  // one parity area
  int* err_host = nullptr;
  int* err_dev = nullptr;
  int* abort_flag = nullptr;      // device memory, 2 words: the abort flag, the error record's claim (mt::WaitCtx)
  uint64_t* done_host = nullptr;  // completion word (pinned, mapped), written by each call's kernel
  uint64_t* done_dev = nullptr;
  uint64_t launches = 0;
  uint64_t direct_seq = 0;  // the last launch run where it was issued, not captured in a graph (mt_pxy_destroy)
  uint64_t last_epoch = 0;  // the epoch of the last call launched: mt_pxy_clear_error
  int last_kind = 0;        // and its kind: 0 exchange, 1 exchange_counts
  int host_wait = 1;
  uint64_t timeout_ns = 10ull * 1000 * 1000 * 1000;
#ifdef MT_HOST_SIM
  std::vector<std::thread> sim_threads;  // simulated kernels (joined at destroy)
#endif
};

#ifndef MT_HOST_SIM
__global__ void pxy_exchange_kernel(PxParams p) {
  __shared__ int s_acked, s_refused;
  __shared__ AckSet s_acks;
  if (threadIdx.x == 0) {
    bool refused = false;
    s_acked = mtpx::produce_exchange(p, &s_acks, &refused) ? 1 : 0;
    s_refused = refused ? 1 : 0;
  }
  __syncthreads();
  mtpx::wait_exchange_lane(p, (int)threadIdx.x, s_acked != 0, s_acks, s_refused != 0);
  __syncthreads();
  if (threadIdx.x == 0) mtpx::finish(p);
}

__global__ void pxy_counts_kernel(PxParams p) {
  if (threadIdx.x == 0) mtpx::produce_counts(p);
  __syncthreads();
  mtpx::wait_counts_lane(p, (int)threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) mtpx::finish(p);
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

#endif  // !MT_HOST_SIM

}  // namespace

MT_API int mt_pxy_create(void* engine, int device, int rank, int world, uint64_t ctrl_local, double timeout_s, void** out) {
  MT_REQUIRE(world >= 1 && world <= MT_MAX_WORLD, 300, "world %d outside 1..%d", world, MT_MAX_WORLD);
  MT_REQUIRE(world < 32, 301, "world must be < 32");
  // the kernels index the count matrix and the count words by rank (as mt_nvl_create checks, 101)
  MT_REQUIRE(rank >= 0 && rank < world, 306, "mt_pxy_create: rank %d outside 0..%d", rank, world - 1);
  MT_REQUIRE(engine != nullptr, 305, "no proxy engine");
  {
    // one engine peer per rank: the kernels push to every rank of the world and the ACK lane waits on
    // ack[peer * qps + k] for each, which the engine holds for its npeers * qps streams only
    MtGpuView v;
    mt_proxy_gpu_view(engine, &v);
    const int npeers = v.qps > 0 ? v.nstreams / v.qps : 0;
    MT_REQUIRE(world == npeers, 307, "mt_pxy_create: world %d but the proxy engine has %d peers", world, npeers);
  }
  {
    int rc = mt_proxy_mark_gpu_producer_internal(engine);
    if (rc != 0) return rc;
  }
  MT_SET_DEVICE(device);
  PxCtx* c = new PxCtx();
  c->engine = engine;
  mt_proxy_gpu_view(engine, &c->v);
  c->device = device;
  c->rank = rank;
  c->world = world;
  c->ctrl_local = ctrl_local;
  c->timeout_ns = mt::timeout_ns(timeout_s);
  // each allocation lands in a local first: a failed one leaves its field null, so the error path below frees
  // exactly what was allocated
  void* m = nullptr;
  cudaError_t e = cudaHostAlloc(&m, MT_ERR_WORDS * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) {
    c->err_host = static_cast<int*>(m);
    memset(c->err_host, 0, MT_ERR_WORDS * sizeof(int));
    e = cudaHostGetDevicePointer((void**)&c->err_dev, c->err_host, 0);
  }
  m = nullptr;
  if (e == cudaSuccess) e = cudaHostAlloc(&m, 64, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) {
    c->done_host = static_cast<uint64_t*>(m);
    memset(c->done_host, 0, 64);
    e = cudaHostGetDevicePointer((void**)&c->done_dev, c->done_host, 0);
  }
  m = nullptr;
  if (e == cudaSuccess) e = cudaMalloc(&m, 2 * sizeof(int));
  if (e == cudaSuccess) {
    c->abort_flag = static_cast<int*>(m);
    e = cudaMemset(c->abort_flag, 0, 2 * sizeof(int));
  }
  // the memset done before any launch, within the context's timeout (as mt_pxy_destroy waits): never without end
  if (e == cudaSuccess) e = mt::setup_sync_within(device, c->timeout_ns);
  if (e == cudaErrorNotReady) {
    // the memset may still be queued behind that work: the abort flag is leaked, and the pinned error record and
    // completion word with it (cudaFreeHost may wait for the device to be idle), as mt_pxy_destroy leaks them
    mt::set_error("mt_pxy_create: the set-up work on device %d (the memset of its abort flag) did not complete within "
                  "%.1f s: other work on the device does not end (a stuck persistent kernel, a peer that never "
                  "signals). The error record, completion word and abort flag are leaked rather than freed under it; "
                  "end that work (or restart the process) before building the transport again", device,
                  (double)mt::setup_timeout_ns(c->timeout_ns) / 1e9);
    delete c;
    return 326;
  }
  if (e != cudaSuccess) {
    mt::set_error("mt_pxy_create: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
    (void)cudaGetLastError();  // not sticky: keep it out of the next call's launch check
    // everything allocated before the failing step: the pinned error record and completion word, the abort flag
    if (c->err_host) cudaFreeHost(c->err_host);
    if (c->done_host) cudaFreeHost(c->done_host);
    if (c->abort_flag) cudaFree(c->abort_flag);
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

// 1 (default): each counts/exchange call returns only after its kernel finished (host-completed).
// Why: the kernel spins until copies and stream writes that the proxy thread issues on OTHER streams
// of the same device have executed. If the caller queues more work behind the spinning kernel (its
// next kernel, an event for NCCL, a D2H copy), that work waits for the kernel; when a QP stream shares
// a hardware work queue with such a stream (CUDA maps many streams onto CUDA_DEVICE_MAX_CONNECTIONS
// queues), the proxy's copies queue behind it too: a deadlock until the kernel's timeout. Waiting on
// the host keeps the launching stream empty behind the kernel. 0: asynchronous (CUDA-graph capture,
// experiments); safe only when nothing is queued behind the kernel on its device.
MT_API int mt_pxy_set_host_wait(void* h, int on) {
  static_cast<PxCtx*>(h)->host_wait = on ? 1 : 0;
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
  c->last_epoch = epoch;
  p.done = c->done_dev;
  p.done_value = ++c->launches;
  p.w.err = c->err_dev;
  p.w.abort_flag = c->abort_flag;
  p.w.claim = c->abort_flag + 1;
  p.w.timeout_ns = c->timeout_ns;
  p.w.rank = c->rank;
  return p;
}

// Bounded wait for the completion word of launch `seq` (the kernel writes it even after a timeout, so this returns).
// A failed proxy engine (321) is reported once the kernel has ended, not when the failure is seen: the failed engine
// still issues the PUTs behind the failed one (it only stops signalling), and the kernel's ACK lane waits, bounded, for
// the ACK it then writes on every stream behind them, so the kernel's end is what tells that no copy of the call still
// reads the caller's rows (a caller that catches the error reuses them at once). 322 past the deadline: the kernel, and
// the copies it covers, may still read the call's buffers; mt_last_error says so.
static int wait_done(PxCtx* c, uint64_t seq) {
  const uint64_t deadline = mt::host_ns() + 4 * c->timeout_ns + 10ull * 1000 * 1000 * 1000;
  uint32_t spins = 0;
  int failed = 0;  // the engine's error code once seen, its text in why
  char why[512] = "";
  while (__atomic_load_n(c->done_host, __ATOMIC_ACQUIRE) < seq) {
    if ((++spins & 255u) == 0) {
      if (failed == 0) failed = mt_proxy_error(c->engine, why, sizeof(why));
      if (mt::host_ns() >= deadline) {
        char buf[512];
        mt_proxy_diag(c->engine, buf, sizeof(buf));
        mt::set_error("proxy kernel did not complete (launch %llu)%s%s; %s. Its copies may still read the call's send "
                      "rows and counts: do not reuse or free them", (unsigned long long)seq,
                      failed != 0 ? "; proxy engine failed: " : "", failed != 0 ? why : "", buf);
        return 322;
      }
      if ((spins & 4095u) == 0) std::this_thread::yield();
    }
  }
  // once more after the end: the engine is polled every 256 spins, so a failure in the last stretch (or a kernel that
  // ended within 256 spins) would otherwise return 0 for a call whose copies the failed engine did not signal
  if (failed == 0) failed = mt_proxy_error(c->engine, why, sizeof(why));
  MT_REQUIRE(failed == 0, 321, "proxy engine failed: %s", why);
  return 0;
}

// The host wait of a call (mt_pxy_set_host_wait): wait_done, except for a launch being captured (it runs at a replay).
static int host_wait_done(PxCtx* c, uint64_t seq, uint64_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing((cudaStream_t)stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone) return 0;
  return wait_done(c, seq);
}

#ifdef MT_HOST_SIM
// Host simulation: a "kernel" runs its lanes one after another on one thread (each lane only waits
// for words other threads write).
static void run_exchange_block(const PxParams& p) {
  AckSet acks;
  bool refused = false;
  const bool acked = mtpx::produce_exchange(p, &acks, &refused);
  for (int t = 0; t < 32; ++t) mtpx::wait_exchange_lane(p, t, acked, acks, refused);
  mtpx::finish(p);
}
static void run_counts_block(const PxParams& p) {
  mtpx::produce_counts(p);
  for (int t = 0; t < 32; ++t) mtpx::wait_counts_lane(p, t);
  mtpx::finish(p);
}
// An asynchronous "launch": the block runs on its own thread once the previous launch run where it was issued
// finished (stream order; a captured launch is not on the stream), like a kernel; the calling thread returns at once.
static void sim_launch(PxCtx* c, const PxParams& p, bool exchange) {
  const uint64_t prev = c->direct_seq;
  uint64_t* done = c->done_host;
  c->sim_threads.emplace_back([p, prev, done, exchange] {
    while (__atomic_load_n(done, __ATOMIC_ACQUIRE) < prev) std::this_thread::yield();
    if (exchange)
      run_exchange_block(p);
    else
      run_counts_block(p);
  });
}
// Tests: the completion word and the number of launches so far.
MT_API int mt_pxy_sim_done(void* h, uint64_t** word, uint64_t* launches) {
  PxCtx* c = static_cast<PxCtx*>(h);
  *word = c->done_host;
  *launches = c->launches;
  return 0;
}
#endif

// Before a launch: an idle-sleeping proxy thread polls again, and keeps polling until this call's kernel wrote its
// completion word (a kernel being captured runs later, at a replay nobody announces: only the wake, then). Returns
// whether the kernel runs now (not captured).
static bool announce(PxCtx* c, uint64_t seq, uint64_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing((cudaStream_t)stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone) {
    mt_proxy_expect_internal(c->engine, nullptr, 0);  // wake only: an earlier call in flight keeps its marker
    return false;
  }
  mt_proxy_expect_internal(c->engine, c->done_host, seq);
  return true;
}

#ifndef MT_HOST_SIM
// A launch failed: its kernel never writes the completion word, so the thread need not poll for it; it polls for
// the launch before it again (an asynchronous call may still be in flight: forgetting the word would let the
// thread sleep under it). A captured launch announced nothing: the retract finds another seq and does nothing.
static int launch_failed(PxCtx* c, cudaError_t e, uint64_t seq) {
  mt_proxy_retract_internal(c->engine, c->done_host, seq);
  mt::set_error("proxy kernel launch -> %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
  return (int)e;
}
#endif

MT_API int mt_pxy_counts(void* h, const int64_t* send_counts, int64_t* recv_counts, uint64_t epoch, uint64_t stream) {
  PxCtx* c = static_cast<PxCtx*>(h);
  MT_REQUIRE(epoch >= 1, 302, "epoch must be >= 1");
  MT_SET_DEVICE(c->device);
  PxParams p = base_params(c, epoch);
  p.send_counts = send_counts;
  p.recv_out = recv_counts;
  const bool direct = announce(c, p.done_value, stream);
#ifdef MT_HOST_SIM
  c->last_kind = 1;
  if (direct) sim_launch(c, p, false);  // a captured launch runs at a replay, which the simulation has none of
#else
  (void)cudaGetLastError();  // drop a stale, non-sticky error from an earlier call
  c->last_kind = 1;
  pxy_counts_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(p);
  if (cudaError_t le = cudaGetLastError(); le != cudaSuccess) return launch_failed(c, le, p.done_value);
#endif
  if (direct) c->direct_seq = p.done_value;
  return c->host_wait ? host_wait_done(c, p.done_value, stream) : 0;
}

// send: send_rows rows of row_bytes; send_counts (device) must be >= 0 and sum to at most send_rows (the kernel
// checks before any PUT: MT_ERR_SEND_COUNTS here, MT_ERR_PEER_REFUSED on the others at once, no rows to or from this
// rank; mt_pxy_clear_error forgets it).
MT_API int mt_pxy_exchange(void* h, const void* send, uint64_t send_rows, uint64_t row_bytes, const int64_t* send_counts,
                           const int64_t* recv_counts, int coupled, int group_size, int chunk_rows, uint64_t epoch,
                           uint64_t stream) {
  PxCtx* c = static_cast<PxCtx*>(h);
  MT_REQUIRE(epoch >= 1, 302, "epoch must be >= 1");
  MT_REQUIRE(c->data_bytes > 0, 303, "no data buffer: call reserve() first");
  MT_REQUIRE(row_bytes > 0, 304, "row_bytes must be > 0");
  MT_SET_DEVICE(c->device);
  PxParams p = base_params(c, epoch);
  p.send = static_cast<const char*>(send);
  p.send_rows = send_rows;
  p.row_bytes = row_bytes;
  p.send_counts = send_counts;
  p.recv_counts = recv_counts;
  p.coupled = coupled ? 1 : 0;
  p.group = group_size;
  p.chunk_rows = chunk_rows;
  const bool direct = announce(c, p.done_value, stream);
#ifdef MT_HOST_SIM
  c->last_kind = 0;
  if (direct) sim_launch(c, p, true);  // a captured launch runs at a replay, which the simulation has none of
#else
  (void)cudaGetLastError();  // drop a stale, non-sticky error from an earlier call
  c->last_kind = 0;
  pxy_exchange_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(p);
  if (cudaError_t le = cudaGetLastError(); le != cudaSuccess) return launch_failed(c, le, p.done_value);
#endif
  if (direct) c->direct_seq = p.done_value;
  return c->host_wait ? host_wait_done(c, p.done_value, stream) : 0;
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

// Forget a refused call so that the next one runs, where mt::refusal_clearable allows it (else 323): such a call kept
// the protocol in step (every rank published its row of the count matrix and saw every other rank's, csrc/proxy_xchg.h;
// no rows went to or from the refusing rank; the signal slots stay monotonic). Waits (bounded) for every launch so far
// that runs: the last one issued where it was launched (direct_seq, as mt_pxy_destroy), then the device's work. Not for
// the completion word of a launch captured into a CUDA graph: it is written at a replay, which may never come (the
// wait would last until its bound and fail); a replay in flight is device work, waited for below. A captured launch
// still counts as the rank's last call for the rule (mt::refusal_clearable).
MT_API int mt_pxy_clear_error(void* h) {
  PxCtx* c = static_cast<PxCtx*>(h);
  MT_SET_DEVICE(c->device);
  if (c->direct_seq > 0) {
    int rc = wait_done(c, c->direct_seq);
    if (rc != 0) return rc;
  }
  const uint64_t deadline = mt::host_ns() + c->timeout_ns;  // graph replays too: their completion words are not waited
  MT_REQUIRE(mt::device_sync_within(c->device, deadline) != cudaErrorNotReady, 325,
             "mt_pxy_clear_error: the device's work did not complete within %.1f s", (double)c->timeout_ns / 1e9);
  int aborted = 0;
  MT_CUDA(cudaMemcpy(&aborted, c->abort_flag, sizeof(int), cudaMemcpyDeviceToHost));
  if (!mt::refusal_clearable(c->err_host, aborted != 0, c->last_kind, c->last_epoch)) return 323;
  // the claim with the record: a claim left set would keep every later error out of the record
  MT_CUDA(cudaMemset(c->abort_flag + 1, 0, sizeof(int)));
  // the memset is asynchronous: done before the next launch on any stream
  MT_REQUIRE(mt::device_sync_within(c->device, deadline) != cudaErrorNotReady, 325,
             "mt_pxy_clear_error: the device's work did not complete within %.1f s", (double)c->timeout_ns / 1e9);
  memset(c->err_host, 0, MT_ERR_WORDS * sizeof(int));
  return 0;
}

// Waits, within the context's timeout, for the completion word of the last launch not captured in a graph (its kernel
// writes it last, also after its own timeout; launches complete in order on the caller's stream), then for the rest
// of the device's work, graph replays of this context's kernels included (mt::device_sync_within: their completion
// words are not tracked). Past the timeout (324) nothing a kernel may still write is freed: the error record, the
// completion word and the abort flag are leaked, and mt_last_error says so.
MT_API int mt_pxy_destroy(void* h) {
  PxCtx* c = static_cast<PxCtx*>(h);
  if (c == nullptr) return 0;
  mt::DeviceGuard device_guard;
  (void)device_guard.set(c->device);
  const uint64_t deadline = mt::host_ns() + c->timeout_ns;
  while (__atomic_load_n(c->done_host, __ATOMIC_ACQUIRE) < c->direct_seq && mt::host_ns() < deadline)
    std::this_thread::yield();
  const uint64_t done = __atomic_load_n(c->done_host, __ATOMIC_ACQUIRE), want = c->direct_seq;
#ifdef MT_HOST_SIM
  for (auto& t : c->sim_threads) {  // a simulated kernel still running keeps the leaked words
    if (done >= want)
      t.join();
    else
      t.detach();
  }
#endif
  mt_proxy_forget_internal(c->engine, c->done_host);
  const bool idle = done >= want && mt::device_sync_within(c->device, deadline) != cudaErrorNotReady;
  (void)cudaGetLastError();  // another launch's error is not this destroy's: keep it out of the next call's check
  const double timeout_s = (double)c->timeout_ns / 1e9;
  if (idle) {
    if (c->err_host) cudaFreeHost(c->err_host);
    if (c->done_host) cudaFreeHost(c->done_host);
    if (c->abort_flag) cudaFree(c->abort_flag);
  }
  delete c;
  MT_REQUIRE(done >= want, 324, "mt_pxy_destroy: proxy kernel launch %llu did not complete within %.1f s (completed "
             "up to %llu): its error record, completion word and abort flag are leaked rather than freed under it",
             (unsigned long long)want, timeout_s, (unsigned long long)done);
  MT_REQUIRE(idle, 324, "mt_pxy_destroy: the device's work (a graph replay of this context's kernels, or another's) did "
             "not complete within %.1f s: the error record, completion word and abort flag are leaked rather than "
             "freed under it", timeout_s);
  return 0;
}

#ifndef MT_HOST_SIM
MT_API int mt_race_check_launch(int device, uint64_t stream, const uint64_t* flags, uint64_t flag_stride_words,
                                const void* base, uint64_t stride, uint64_t bytes, uint64_t check_bytes, int n,
                                int pattern_base, uint64_t epoch, double timeout_s, int* bad) {
  MT_REQUIRE(n >= 1 && n <= 4096, 310, "n %d outside 1..4096", n);
  MT_SET_DEVICE(device);
  (void)cudaGetLastError();  // drop a stale, non-sticky error from an earlier call
  race_check_kernel<<<n, 256, 0, (cudaStream_t)stream>>>(flags, flag_stride_words, static_cast<const char*>(base), stride,
                                                        bytes, check_bytes, pattern_base, epoch,
                                                        mt::timeout_ns(timeout_s), bad);
  MT_CUDA(cudaGetLastError());
  return 0;
}
#endif  // !MT_HOST_SIM
