// moetune csrc: a CPU proxy engine over CUDA copy engines (NVSHMEM's proxy submission path, on one node).
//
// One engine = one CPU thread bound to one GPU, draining a request FIFO in pinned mapped host memory.
// PUTs become cudaMemcpyAsync (peer pointers: device-to-device over NVLink/PCIe copy engines) on one
// of `qps` CUDA streams (the queue pairs); signals are stream memory writes (cuStreamWriteValue64)
// into the receiver's signal slots. Fence modes:
//   proxy_drain : before a signal, the thread stops until every earlier transfer on every QP has
//                 completed (cudaStreamSynchronize of each busy stream), as NVSHMEM's proxies quiet;
//   nic_ordered : the thread never stops; the signal is enqueued on the peer's QP stream behind its
//                 data, so the stream orders it (correct only when a peer's PUTs and SIGNAL share a
//                 stream: peer_hash, or a single QP);
//   none        : no ordering at all (put-only baselines, and the deliberately unsafe test mode).
#include "proxy_engine.h"

#ifndef MT_HOST_SIM
#include <cuda.h>
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

typedef CUresult (*PfnWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

inline uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

enum Phase { PH_IDLE = 0, PH_COPY = 1, PH_WRITE = 2, PH_SYNC = 3 };

enum StatIdx {
  ST_PROCESSED = 0,
  ST_PUTS,
  ST_SIGNALS,
  ST_DRAINS,
  ST_DRAIN_NS,
  ST_WRITE64,
  ST_BYTES,
  ST_ACKS,
  ST_BUSY_NS,  // time spent issuing (between picking up a request and finishing it)
  ST_BATCHES,  // cudaMemcpyBatchAsync calls
  ST_COUNT
};

struct Engine {
  int device = 0;
  int npeers = 0;
  int qps = 1;
  int qp_mapping = MT_QP_PEER_HASH;
  int fence_mode = MT_FENCE_PROXY_DRAIN;
  std::vector<uint64_t> peer_data, peer_ctrl, peer_sig;
  MtRequest* fifo_host = nullptr;
  MtRequest* fifo_dev = nullptr;
  uint32_t nslots = 0;
  uint64_t* ctl_host = nullptr;  // [0]=unused [1]=tail (consumer index)
  uint64_t* ctl_dev = nullptr;
  unsigned long long* head_dev = nullptr;
  uint64_t* ack_dev = nullptr;
  std::vector<cudaStream_t> streams;
  std::vector<char> dirty;
  PfnWriteValue64 write64 = nullptr;
  uint64_t rr = 0;
  uint64_t tail = 0;  // proxy-thread private copy
  std::thread th;
  std::atomic<bool> stop{false};
  std::atomic<bool> running{false};
  std::atomic<int> err{0};
  // what the thread is doing (for diagnostics): 0 idle, else the CUDA call it is inside (PH_*) since when
  std::atomic<int> phase{0};
  std::atomic<uint64_t> phase_since{0};
  std::atomic<uint32_t> phase_peer{0};
  std::mutex err_mu;
  std::string errmsg;
  std::atomic<uint64_t> stats[ST_COUNT];
  // batching: consecutive unsignalled PUTs bound for one QP stream are issued as one
  // cudaMemcpyBatchAsync (batch_max requests drained per loop iteration; 1 = one call per request)
  std::atomic<int> batch_max{1};
  struct Pending {
    std::vector<void*> dst;
    std::vector<const void*> src;
    std::vector<size_t> size;
  };
  std::vector<Pending> pend;
  // host producer
  std::mutex host_mu;
  uint64_t host_head = 0;
  int producer_kind = 0;  // 0 unset, 1 host, 2 gpu
  // CPU affinity of the proxy thread: the thread pins itself (pin_self) to the set of CPUs asked for before it
  // drains anything; the OS places it within the set. A pinning the kernel refuses (no CPU of the set in the
  // process's cpuset or online, an index out of range) leaves the thread unpinned with the errno recorded; the
  // engine runs on either way. Pinning places the thread only: the FIFO and control pages are allocated (and
  // first touched) by the creating thread in mt_proxy_create, before this thread exists.
  std::vector<int> cpu_req;                   // the CPUs asked for at create (empty: no pinning)
  std::atomic<int> cpu_state{MT_PCPU_PENDING};  // MtProxyCpuState
  std::atomic<int> cpu_errno{0};
  std::atomic<int> cpu_now{-1};  // sched_getcpu() of the thread: after pinning, and again whenever it idles long
  std::atomic<int> tid{0};       // the thread's kernel id (/proc/self/task/<tid>)

  Engine() {
    for (auto& s : stats) s.store(0);
  }

  void fail(const char* what, int code) {
    if (err.load() == 0) {
      std::lock_guard<std::mutex> g(err_mu);
      errmsg = what;
      err.store(code == 0 ? -1 : code);
    }
  }

  int pick(uint32_t peer) {
    if (qps <= 1) return 0;
    if (qp_mapping == MT_QP_PEER_HASH) return (int)(peer % (uint32_t)qps);
    return (int)(rr++ % (uint64_t)qps);
  }

  bool cuda_ok(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    char buf[512];
    snprintf(buf, sizeof(buf), "proxy: %s -> %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
    fail(buf, (int)e);
    return false;
  }

  bool cu_ok(CUresult r, const char* what) {
    if (r == CUDA_SUCCESS) return true;
    char buf[256];
    snprintf(buf, sizeof(buf), "proxy: %s -> CUresult %d", what, (int)r);
    fail(buf, 900 + (int)r);
    return false;
  }

  void enter(int ph, uint32_t peer) {
    phase_peer.store(peer, std::memory_order_relaxed);
    phase_since.store(mono_ns(), std::memory_order_relaxed);
    phase.store(ph, std::memory_order_release);
  }
  template <class T>
  T leave(T v) {
    phase.store(0, std::memory_order_release);
    return v;
  }

  void drain_all() {
    uint64_t t0 = mono_ns();
    for (int q = 0; q < qps; ++q) {
      if (dirty[q]) {
        cuda_ok((enter(PH_SYNC, (uint32_t)q), leave(cudaStreamSynchronize(streams[q]))), "cudaStreamSynchronize (drain)");
        dirty[q] = 0;
      }
    }
    stats[ST_DRAINS]++;
    stats[ST_DRAIN_NS] += mono_ns() - t0;
  }

  void signal(uint32_t peer, uint32_t idx, uint64_t value) {
    if (fence_mode == MT_FENCE_PROXY_DRAIN) drain_all();
    // nic_ordered / none: no wait; ordering (if any) comes from the stream the signal lands on.
    int q = pick(peer);
    CUdeviceptr addr = (CUdeviceptr)(peer_sig[peer] + 8ull * idx);
    cu_ok((enter(PH_WRITE, peer), leave(write64((CUstream)streams[q], addr, value, 0))), "cuStreamWriteValue64 (signal)");
    dirty[q] = 1;
    stats[ST_SIGNALS]++;
  }

  void process(const MtRequest& r) {
    if (r.peer >= (uint32_t)npeers && r.op != MT_OP_ACK) {
      fail("proxy: request for a peer index out of range", 700);
      return;
    }
    switch (r.op) {
      case MT_OP_PUT: {
        int q = pick(r.peer);
        if (r.bytes > 0) {
          cuda_ok((enter(PH_COPY, r.peer), leave(cudaMemcpyAsync((void*)(peer_data[r.peer] + r.dst_off), (const void*)r.src,
                                                                 r.bytes, cudaMemcpyDeviceToDevice, streams[q]))),
                  "cudaMemcpyAsync (put)");
          dirty[q] = 1;
          stats[ST_BYTES] += r.bytes;
        }
        stats[ST_PUTS]++;
        if (r.flags & MT_F_SIGNAL) signal(r.peer, r.signal_idx, r.value);
        break;
      }
      case MT_OP_SIGNAL:
        signal(r.peer, r.signal_idx, r.value);
        break;
      case MT_OP_WRITE64: {
        int q = pick(r.peer);
        cu_ok((enter(PH_WRITE, r.peer),
               leave(write64((CUstream)streams[q], (CUdeviceptr)(peer_ctrl[r.peer] + r.dst_off), r.value, 0))),
              "cuStreamWriteValue64 (write64)");
        dirty[q] = 1;
        stats[ST_WRITE64]++;
        break;
      }
      case MT_OP_ACK:
        for (int q = 0; q < qps; ++q)
          cu_ok((enter(PH_WRITE, (uint32_t)q), leave(write64((CUstream)streams[q], (CUdeviceptr)(ack_dev + q), r.value, 0))),
                "cuStreamWriteValue64 (ack)");
        stats[ST_ACKS]++;
        break;
      default:
        fail("proxy: unknown request op", 701);
    }
  }

  void flush() {
    for (int q = 0; q < qps; ++q) {
      Pending& p = pend[q];
      size_t n = p.dst.size();
      if (n == 0) continue;
      if (n == 1) {
        cuda_ok((enter(PH_COPY, (uint32_t)q), leave(cudaMemcpyAsync(p.dst[0], p.src[0], p.size[0], cudaMemcpyDeviceToDevice,
                                                                     streams[q]))),
                "cudaMemcpyAsync (put)");
      } else {
        cudaMemcpyAttributes attr;
        memset(&attr, 0, sizeof(attr));
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t idx = 0;
        cuda_ok((enter(PH_COPY, (uint32_t)q),
                 leave(cudaMemcpyBatchAsync(p.dst.data(), p.src.data(), p.size.data(), n, &attr, &idx, 1, streams[q]))),
                "cudaMemcpyBatchAsync (puts)");
        stats[ST_BATCHES]++;
      }
      dirty[q] = 1;
      p.dst.clear();
      p.src.clear();
      p.size.clear();
    }
  }

  void pin_self() {
    tid.store((int)syscall(SYS_gettid));
    if (cpu_req.empty()) {
      cpu_state.store(MT_PCPU_UNPINNED);
    } else {
      int rc = EINVAL;  // an index past MT_PROXY_MAX_CPU is refused as the kernel refuses a CPU it lacks
#ifdef __linux__
      int top = 0;
      for (int c : cpu_req) top = c > top ? c : top;
      if (top < MT_PROXY_MAX_CPU) {
        cpu_set_t* set = CPU_ALLOC(top + 1);
        if (set == nullptr) {
          rc = ENOMEM;
        } else {
          const size_t sz = CPU_ALLOC_SIZE(top + 1);
          CPU_ZERO_S(sz, set);
          for (int c : cpu_req) CPU_SET_S(c, sz, set);
          rc = pthread_setaffinity_np(pthread_self(), sz, set);  // migrates this thread into the set before it returns
          CPU_FREE(set);
        }
      }
#else
      rc = ENOSYS;
#endif
      cpu_errno.store(rc);
      cpu_state.store(rc == 0 ? MT_PCPU_PINNED : MT_PCPU_FAILED);
    }
    cpu_now.store(sched_getcpu());
  }

  void loop() {
    pin_self();  // first: whatever the thread itself allocates or first touches from here on is on the set's node
    cudaSetDevice(device);
    uint64_t idle = 0;
    running.store(true);
    while (!stop.load(std::memory_order_relaxed)) {
      const int bmax = batch_max.load(std::memory_order_relaxed) < 1 ? 1 : batch_max.load(std::memory_order_relaxed);
      int got = 0;
      uint64_t t0 = 0;
      while (got < bmax) {
        MtRequest* s = &fifo_host[tail % nslots];
        uint64_t seq = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
        if (seq != tail + 1) break;
        if (t0 == 0) t0 = mono_ns();
        MtRequest r;
        memcpy(&r, (const void*)s, sizeof(r));
        std::atomic_thread_fence(std::memory_order_acquire);
        if (bmax > 1 && r.op == MT_OP_PUT && !(r.flags & MT_F_SIGNAL) && r.peer < (uint32_t)npeers && r.bytes > 0) {
          int q = pick(r.peer);  // same mapping decisions, in the same order, as unbatched issue
          pend[q].dst.push_back((void*)(peer_data[r.peer] + r.dst_off));
          pend[q].src.push_back((const void*)r.src);
          pend[q].size.push_back(r.bytes);
          stats[ST_BYTES] += r.bytes;
          stats[ST_PUTS]++;
        } else {
          flush();  // everything before a signal/word/ack is issued first
          process(r);
        }
        ++tail;
        ++got;
        stats[ST_PROCESSED]++;
      }
      if (got == 0) {
        if (++idle < (1u << 16)) {
          cpu_relax();
        } else {
          cpu_now.store(sched_getcpu(), std::memory_order_relaxed);  // cheap (vDSO/rseq) next to the yield
          std::this_thread::yield();
        }
        continue;
      }
      idle = 0;
      flush();
      // published only once issued: quiesce() then syncs streams that hold everything consumed
      __atomic_store_n(&ctl_host[1], tail, __ATOMIC_RELEASE);
      stats[ST_BUSY_NS] += mono_ns() - t0;
    }
    running.store(false);
  }
};

}  // namespace

extern "C" int mt_proxy_gpu_view(void* h, MtGpuView* out) {
  Engine* e = static_cast<Engine*>(h);
  out->fifo_dev = e->fifo_dev;
  out->nslots = e->nslots;
  out->head_dev = e->head_dev;
  out->tail_dev = e->ctl_dev + 1;
  out->ack_dev = e->ack_dev;
  out->qps = e->qps;
  return 0;
}

// peer_data[i]: base of peer i's data region; peer_ctrl[i]: base of peer i's control region;
// peer_sig[i]: address of MY signal slot 0 at peer i (the proxy writes slot k at peer_sig[i] + 8k).
// cpus[0..ncpus): the set of CPUs the proxy thread pins itself to (the OS places it within the set); ncpus 0 or
// -1 (or cpus NULL with ncpus <= 0): no pinning. A pinning the kernel refuses is recorded (mt_proxy_cpu), not an
// error.
MT_API int mt_proxy_create(int device, int npeers, const uint64_t* peer_data, const uint64_t* peer_ctrl,
                           const uint64_t* peer_sig, int qps, int qp_mapping, int fence_mode, int fifo_slots,
                           const int* cpus, int ncpus, void** out) {
  MT_REQUIRE(npeers >= 1 && npeers <= 4096, 200, "npeers %d outside 1..4096", npeers);
  MT_REQUIRE(qps >= 1 && qps <= MT_MAX_QPS, 201, "qps %d outside 1..%d", qps, MT_MAX_QPS);
  MT_REQUIRE(fifo_slots >= 16 && fifo_slots <= (1 << 20), 202, "fifo_slots %d outside 16..2^20", fifo_slots);
  MT_REQUIRE(fence_mode >= 0 && fence_mode <= 2, 203, "bad fence_mode %d", fence_mode);
  MT_REQUIRE(qp_mapping >= 0 && qp_mapping <= 1, 204, "bad qp_mapping %d", qp_mapping);
  MT_REQUIRE(ncpus >= -1 && ncpus <= MT_PROXY_MAX_CPU, 208, "bad ncpus %d (-1 or 0 = no pinning, at most %d)", ncpus,
             MT_PROXY_MAX_CPU);
  MT_REQUIRE(ncpus <= 0 || cpus != nullptr, 208, "ncpus %d with no cpus array", ncpus);
  for (int i = 0; i < ncpus; ++i) MT_REQUIRE(cpus[i] >= 0, 208, "bad cpu %d (cpus[%d])", cpus[i], i);
  MT_CUDA(cudaSetDevice(device));
  Engine* e = new Engine();
  e->device = device;
  if (ncpus > 0) e->cpu_req.assign(cpus, cpus + ncpus);
  e->npeers = npeers;
  e->qps = qps;
  e->qp_mapping = qp_mapping;
  e->fence_mode = fence_mode;
  e->peer_data.assign(peer_data, peer_data + npeers);
  e->peer_ctrl.assign(peer_ctrl, peer_ctrl + npeers);
  e->peer_sig.assign(peer_sig, peer_sig + npeers);
  e->nslots = (uint32_t)fifo_slots;
  e->dirty.assign(qps, 0);
  e->pend.resize(qps);
  cudaError_t ce = cudaSuccess;
  cudaDriverEntryPointQueryResult q;
  void* fn = nullptr;
  ce = cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000, cudaEnableDefault, &q);
  if (ce != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) {
    mt::set_error("proxy: cuStreamWriteValue64 not available from the driver (%s, query %d)",
                  cudaGetErrorName(ce), (int)q);
    delete e;
    return 205;
  }
  e->write64 = (PfnWriteValue64)fn;
  size_t ring = sizeof(MtRequest) * (size_t)fifo_slots;
  ce = cudaHostAlloc((void**)&e->fifo_host, ring, cudaHostAllocMapped | cudaHostAllocPortable);
  if (ce == cudaSuccess) {
    memset(e->fifo_host, 0, ring);
    ce = cudaHostGetDevicePointer((void**)&e->fifo_dev, e->fifo_host, 0);
  }
  if (ce == cudaSuccess) ce = cudaHostAlloc((void**)&e->ctl_host, 64, cudaHostAllocMapped | cudaHostAllocPortable);
  if (ce == cudaSuccess) {
    memset(e->ctl_host, 0, 64);
    ce = cudaHostGetDevicePointer((void**)&e->ctl_dev, e->ctl_host, 0);
  }
  if (ce == cudaSuccess) ce = cudaMalloc((void**)&e->head_dev, 64);
  if (ce == cudaSuccess) ce = cudaMemset(e->head_dev, 0, 64);
  if (ce == cudaSuccess) ce = cudaMalloc((void**)&e->ack_dev, 8 * MT_MAX_QPS);
  if (ce == cudaSuccess) ce = cudaMemset(e->ack_dev, 0, 8 * MT_MAX_QPS);
  for (int i = 0; i < qps && ce == cudaSuccess; ++i) {
    cudaStream_t s;
    ce = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (ce == cudaSuccess) e->streams.push_back(s);
  }
#ifndef MT_HOST_SIM
  if (ce == cudaSuccess) {
    // warm-up: a few small device-to-device copies and a stream write on every QP stream, so whatever
    // the driver sets up lazily for them happens now, never while a kernel spins waiting on this engine
    void* scratch = nullptr;
    ce = cudaMalloc(&scratch, 1 << 16);
    for (int i = 0; i < qps && ce == cudaSuccess; ++i) {
      char* b = static_cast<char*>(scratch);
      ce = cudaMemcpyAsync(b + 32768, b, 4096, cudaMemcpyDeviceToDevice, e->streams[i]);
      if (ce == cudaSuccess) ce = cudaMemcpyAsync(b + 40963, b + 5, 777, cudaMemcpyDeviceToDevice, e->streams[i]);
      if (ce == cudaSuccess) ce = cudaMemcpyAsync(b + 49152, b, 16384, cudaMemcpyDeviceToDevice, e->streams[i]);
      if (ce == cudaSuccess && e->write64((CUstream)e->streams[i], (CUdeviceptr)(b + 65528), 1, 0) != CUDA_SUCCESS)
        ce = cudaErrorUnknown;
    }
    if (ce == cudaSuccess) ce = cudaDeviceSynchronize();
    if (scratch) cudaFree(scratch);
  }
#endif
  if (ce == cudaSuccess) ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    mt::set_error("mt_proxy_create: %s (%s)", cudaGetErrorName(ce), cudaGetErrorString(ce));
    delete e;  // leaks the partial CUDA allocations on this error path; acceptable (process is failing)
    return (int)ce;
  }
  e->th = std::thread([e] { e->loop(); });
  // wait (bounded) for the thread to come up
  for (int i = 0; i < 2000 && !e->running.load(); ++i) std::this_thread::sleep_for(std::chrono::microseconds(500));
  *out = e;
  return 0;
}

// Requests drained per loop iteration; > 1 issues consecutive unsignalled PUTs per QP stream as one
// cudaMemcpyBatchAsync. Set while idle.
MT_API int mt_proxy_set_batch(void* h, int batch_max) {
  Engine* e = static_cast<Engine*>(h);
  MT_REQUIRE(batch_max >= 1 && batch_max <= 4096, 207, "batch_max %d outside 1..4096", batch_max);
  e->batch_max.store(batch_max);
  return 0;
}

// Replace the peers' data region bases (only while no request is in flight: after a quiesce/collective).
MT_API int mt_proxy_set_peer_data(void* h, const uint64_t* peer_data, int npeers) {
  Engine* e = static_cast<Engine*>(h);
  MT_REQUIRE(npeers == e->npeers, 206, "npeers %d != engine's %d", npeers, e->npeers);
  e->peer_data.assign(peer_data, peer_data + npeers);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return 0;
}

MT_API int mt_proxy_error(void* h, char* buf, int len) {
  Engine* e = static_cast<Engine*>(h);
  int code = e->err.load();
  if (code != 0 && buf && len > 0) {
    std::lock_guard<std::mutex> g(e->err_mu);
    snprintf(buf, (size_t)len, "%s", e->errmsg.c_str());
  }
  return code;
}

// A one-line account of the proxy thread's state, for error messages: requests consumed, whether it is
// inside a CUDA call (which, for how long) or idle waiting for the next slot's ready flag.
MT_API int mt_proxy_diag(void* h, char* buf, int len) {
  Engine* e = static_cast<Engine*>(h);
  if (buf == nullptr || len <= 0) return 0;
  const uint64_t tail = __atomic_load_n(&e->ctl_host[1], __ATOMIC_ACQUIRE);
  const uint64_t seq = __atomic_load_n(&e->fifo_host[tail % e->nslots].seq, __ATOMIC_ACQUIRE);
  const int ph = e->phase.load(std::memory_order_acquire);
  static const char* names[] = {"idle", "cudaMemcpyAsync", "cuStreamWriteValue64", "cudaStreamSynchronize"};
  char what[192];
  if (ph != PH_IDLE)
    snprintf(what, sizeof(what), "inside %s (peer/qp %u) for %.3f s", names[ph & 3], e->phase_peer.load(),
             (double)(mono_ns() - e->phase_since.load()) / 1e9);
  else
    snprintf(what, sizeof(what), "idle at slot %llu (ready flag there %llu, waiting for %llu)",
             (unsigned long long)tail, (unsigned long long)seq, (unsigned long long)(tail + 1));
  snprintf(buf, (size_t)len,
           "thread %s; consumed %llu requests (puts %llu, signals %llu, words %llu, acks %llu, drains %llu)%s", what,
           (unsigned long long)tail, (unsigned long long)e->stats[ST_PUTS].load(),
           (unsigned long long)e->stats[ST_SIGNALS].load(), (unsigned long long)e->stats[ST_WRITE64].load(),
           (unsigned long long)e->stats[ST_ACKS].load(), (unsigned long long)e->stats[ST_DRAINS].load(),
           e->running.load() ? "" : "; thread NOT running");
  return 0;
}

// The proxy thread's CPU affinity: out[MT_PCPU_F_*] (csrc/proxy_engine.h), the first n of them.
MT_API int mt_proxy_cpu(void* h, int* out, int n) {
  Engine* e = static_cast<Engine*>(h);
  const int v[MT_PCPU_F_COUNT] = {(int)e->cpu_req.size(), e->cpu_state.load(), e->cpu_errno.load(),
                                  e->cpu_now.load(), e->tid.load()};
  for (int i = 0; i < n && i < MT_PCPU_F_COUNT; ++i) out[i] = v[i];
  return 0;
}

// The CPUs the proxy thread was asked to pin itself to, as given at create: the first n of them (their number
// is out[MT_PCPU_F_NCPUS] of mt_proxy_cpu). Fixed at create, so read without a lock.
MT_API int mt_proxy_cpu_list(void* h, int* out, int n) {
  Engine* e = static_cast<Engine*>(h);
  for (int i = 0; i < n && i < (int)e->cpu_req.size(); ++i) out[i] = e->cpu_req[i];
  return 0;
}

MT_API int mt_proxy_stats(void* h, uint64_t* out, int n) {
  Engine* e = static_cast<Engine*>(h);
  for (int i = 0; i < n && i < ST_COUNT; ++i) out[i] = e->stats[i].load();
  return 0;
}

MT_API int mt_proxy_reset_stats(void* h) {
  Engine* e = static_cast<Engine*>(h);
  for (auto& s : e->stats) s.store(0);
  return 0;
}

// Host producer: enqueue n requests (blocks, bounded, while the ring is full).
MT_API int mt_proxy_enqueue(void* h, const MtRequest* reqs, int n, double timeout_s) {
  Engine* e = static_cast<Engine*>(h);
  std::lock_guard<std::mutex> g(e->host_mu);
  MT_REQUIRE(e->producer_kind != 2, 210, "this engine has a GPU producer; host enqueue is not allowed");
  e->producer_kind = 1;
  uint64_t deadline = mono_ns() + (uint64_t)(timeout_s * 1e9);
  for (int i = 0; i < n; ++i) {
    uint64_t h0 = e->host_head;
    while (h0 - __atomic_load_n(&e->ctl_host[1], __ATOMIC_ACQUIRE) >= e->nslots) {
      MT_REQUIRE(e->err.load() == 0, 211, "proxy thread failed: %s", e->errmsg.c_str());
      MT_REQUIRE(mono_ns() < deadline, 212, "proxy FIFO full for %.1f s", timeout_s);
      cpu_relax();
    }
    MtRequest* s = &e->fifo_host[h0 % e->nslots];
    MtRequest r = reqs[i];
    r.seq = 0;
    memcpy((void*)s, &r, offsetof(MtRequest, seq));
    __atomic_store_n(&s->seq, h0 + 1, __ATOMIC_RELEASE);
    e->host_head = h0 + 1;
  }
  return 0;
}

// Wait until the proxy consumed everything a host producer enqueued, then until every QP stream is idle.
MT_API int mt_proxy_quiesce(void* h, double timeout_s) {
  Engine* e = static_cast<Engine*>(h);
  uint64_t deadline = mono_ns() + (uint64_t)(timeout_s * 1e9);
  uint64_t target;
  {
    std::lock_guard<std::mutex> g(e->host_mu);
    target = e->host_head;
  }
  while (__atomic_load_n(&e->ctl_host[1], __ATOMIC_ACQUIRE) < target) {
    MT_REQUIRE(e->err.load() == 0, 211, "proxy thread failed: %s", e->errmsg.c_str());
    MT_REQUIRE(mono_ns() < deadline, 213, "proxy did not drain its FIFO within %.1f s", timeout_s);
    cpu_relax();
  }
  for (auto s : e->streams) MT_CUDA(cudaStreamSynchronize(s));
  MT_REQUIRE(e->err.load() == 0, 211, "proxy thread failed: %s", e->errmsg.c_str());
  return 0;
}

// Microbenchmark: `iters` times, enqueue the batch from the host and wait until every transfer and
// signal has completed. out_us[i] = wall time of iteration i. `value_step`: added to every request's
// value each iteration (epoch-valued signals).
MT_API int mt_proxy_bench(void* h, const MtRequest* reqs, int n, int iters, uint64_t value_base,
                          uint64_t value_step, double timeout_s, double* out_us) {
  Engine* e = static_cast<Engine*>(h);
  std::vector<MtRequest> batch(reqs, reqs + n);
  for (int it = 0; it < iters; ++it) {
    uint64_t v = value_base + value_step * (uint64_t)it;
    for (auto& r : batch) r.value = v;
    uint64_t t0 = mono_ns();
    int rc = mt_proxy_enqueue(h, batch.data(), n, timeout_s);
    if (rc != 0) return rc;
    rc = mt_proxy_quiesce(h, timeout_s);
    if (rc != 0) return rc;
    out_us[it] = (double)(mono_ns() - t0) / 1000.0;
  }
  (void)e;
  return 0;
}

extern "C" int mt_proxy_mark_gpu_producer_internal(void* h) {
  Engine* e = static_cast<Engine*>(h);
  std::lock_guard<std::mutex> g(e->host_mu);
  MT_REQUIRE(e->producer_kind != 1, 214, "this engine has a host producer; GPU producers are not allowed");
  e->producer_kind = 2;
  return 0;
}

MT_API int mt_proxy_destroy(void* h) {
  Engine* e = static_cast<Engine*>(h);
  if (e == nullptr) return 0;
  e->stop.store(true);
  if (e->th.joinable()) e->th.join();
  cudaSetDevice(e->device);
  for (auto s : e->streams) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  if (e->fifo_host) cudaFreeHost(e->fifo_host);
  if (e->ctl_host) cudaFreeHost(e->ctl_host);
  if (e->head_dev) cudaFree(e->head_dev);
  if (e->ack_dev) cudaFree(e->ack_dev);
  delete e;
  return 0;
}
