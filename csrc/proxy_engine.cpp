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

#include <cuda.h>
#include <immintrin.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

typedef CUresult (*PfnWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

inline uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

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
  std::mutex err_mu;
  std::string errmsg;
  std::atomic<uint64_t> stats[ST_COUNT];
  // host producer
  std::mutex host_mu;
  uint64_t host_head = 0;
  int producer_kind = 0;  // 0 unset, 1 host, 2 gpu

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

  void drain_all() {
    uint64_t t0 = mono_ns();
    for (int q = 0; q < qps; ++q) {
      if (dirty[q]) {
        cuda_ok(cudaStreamSynchronize(streams[q]), "cudaStreamSynchronize (drain)");
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
    cu_ok(write64((CUstream)streams[q], addr, value, 0), "cuStreamWriteValue64 (signal)");
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
          cuda_ok(cudaMemcpyAsync((void*)(peer_data[r.peer] + r.dst_off), (const void*)r.src, r.bytes,
                                  cudaMemcpyDeviceToDevice, streams[q]),
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
        cu_ok(write64((CUstream)streams[q], (CUdeviceptr)(peer_ctrl[r.peer] + r.dst_off), r.value, 0),
              "cuStreamWriteValue64 (write64)");
        dirty[q] = 1;
        stats[ST_WRITE64]++;
        break;
      }
      case MT_OP_ACK:
        for (int q = 0; q < qps; ++q)
          cu_ok(write64((CUstream)streams[q], (CUdeviceptr)(ack_dev + q), r.value, 0), "cuStreamWriteValue64 (ack)");
        stats[ST_ACKS]++;
        break;
      default:
        fail("proxy: unknown request op", 701);
    }
  }

  void loop() {
    cudaSetDevice(device);
    uint64_t idle = 0;
    running.store(true);
    while (!stop.load(std::memory_order_relaxed)) {
      MtRequest* s = &fifo_host[tail % nslots];
      uint64_t seq = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
      if (seq != tail + 1) {
        if (++idle < (1u << 16)) {
          _mm_pause();
        } else {
          std::this_thread::yield();
        }
        continue;
      }
      idle = 0;
      uint64_t t0 = mono_ns();
      MtRequest r;
      memcpy(&r, (const void*)s, sizeof(r));
      std::atomic_thread_fence(std::memory_order_acquire);
      process(r);
      ++tail;
      __atomic_store_n(&ctl_host[1], tail, __ATOMIC_RELEASE);
      stats[ST_PROCESSED]++;
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
MT_API int mt_proxy_create(int device, int npeers, const uint64_t* peer_data, const uint64_t* peer_ctrl,
                           const uint64_t* peer_sig, int qps, int qp_mapping, int fence_mode, int fifo_slots,
                           void** out) {
  MT_REQUIRE(npeers >= 1 && npeers <= 4096, 200, "npeers %d outside 1..4096", npeers);
  MT_REQUIRE(qps >= 1 && qps <= MT_MAX_QPS, 201, "qps %d outside 1..%d", qps, MT_MAX_QPS);
  MT_REQUIRE(fifo_slots >= 16 && fifo_slots <= (1 << 20), 202, "fifo_slots %d outside 16..2^20", fifo_slots);
  MT_REQUIRE(fence_mode >= 0 && fence_mode <= 2, 203, "bad fence_mode %d", fence_mode);
  MT_REQUIRE(qp_mapping >= 0 && qp_mapping <= 1, 204, "bad qp_mapping %d", qp_mapping);
  MT_CUDA(cudaSetDevice(device));
  Engine* e = new Engine();
  e->device = device;
  e->npeers = npeers;
  e->qps = qps;
  e->qp_mapping = qp_mapping;
  e->fence_mode = fence_mode;
  e->peer_data.assign(peer_data, peer_data + npeers);
  e->peer_ctrl.assign(peer_ctrl, peer_ctrl + npeers);
  e->peer_sig.assign(peer_sig, peer_sig + npeers);
  e->nslots = (uint32_t)fifo_slots;
  e->dirty.assign(qps, 0);
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
      _mm_pause();
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
    _mm_pause();
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
