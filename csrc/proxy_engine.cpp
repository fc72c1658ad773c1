// moetune csrc: a CPU proxy engine over CUDA copy engines (NVSHMEM's proxy submission path, on one node).
//
// One engine = one CPU thread bound to one GPU, draining a request FIFO in pinned mapped host memory.
// PUTs become cudaMemcpyAsync (peer pointers: device-to-device over NVLink/PCIe copy engines) on CUDA
// streams, the queue pairs: `qps` of them per peer (npeers x qps streams; peer p owns streams
// p*qps .. p*qps+qps-1), as the knob qps_per_pe and the tuner's fabric model say. Signals are stream memory
// writes (cuStreamWriteValue64) into the receiver's signal slots. QP mapping, inside the peer's streams:
//   peer_hash   : stream k = signal_idx mod qps, where a PUT's signal_idx is the slot of the signal that
//                 covers it (coupled: its own; decoupled: its group's SIGNAL): a signal group's PUTs and
//                 its SIGNAL share one stream, and the groups rotate over the peer's streams;
//   round_robin : each PUT and SIGNAL takes the peer's next stream (the rotation restarts at every ACK,
//                 i.e. every exchange call);
// count words (WRITE64) always go on the peer's first stream. An ACK (a call's completion word, one per stream) is
// written on the streams picked since the previous ACK only (AckSet, proxy_engine.h). Fence modes:
//   proxy_drain : before a signal, the thread stops until every earlier transfer on every QP has
//                 completed (each busy stream polled, bounded by the engine's timeout), as NVSHMEM's proxies quiet;
//   nic_ordered : the thread never stops; the signal is enqueued on its QP stream behind its data,
//                 so the stream orders it (correct only when the PUTs a signal covers and the SIGNAL
//                 share a stream: peer_hash, or a single QP per peer);
//   none        : no ordering at all (put-only baselines, and the deliberately unsafe test mode).
#include "proxy_engine.h"

#ifndef MT_HOST_SIM
#include <cuda.h>
#endif
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <system_error>
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

// "CUDA_ERROR_NOT_SUPPORTED (operation not supported)" for a driver API result: cuGetErrorName/cuGetErrorString
// through the runtime's driver entry point (the library does not link libcuda); "CUresult <n>" where they are
// missing.
void* driver_entry(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return q == cudaDriverEntryPointSuccess ? f : nullptr;
}
std::string cu_error_text(CUresult r) {
  typedef CUresult (*PfnErrText)(CUresult, const char**);
  static const PfnErrText name_fn = (PfnErrText)driver_entry("cuGetErrorName");
  static const PfnErrText string_fn = (PfnErrText)driver_entry("cuGetErrorString");
  const char* name = nullptr;
  const char* text = nullptr;
  if (name_fn == nullptr || name_fn(r, &name) != CUDA_SUCCESS) name = nullptr;
  if (string_fn == nullptr || string_fn(r, &text) != CUDA_SUCCESS) text = nullptr;
  char buf[256];
  if (name != nullptr)
    snprintf(buf, sizeof(buf), "%s (%s)", name, text != nullptr ? text : "no description");
  else
    snprintf(buf, sizeof(buf), "CUresult %d", (int)r);
  return buf;
}

// The idle loop's system calls, counted in host simulation (tests/test_proxy_numa.py checks the rates).
inline int current_cpu() {
#ifdef MT_HOST_SIM
  __atomic_add_fetch(&mtsim::getcpu_calls, 1, __ATOMIC_RELAXED);
#endif
  return sched_getcpu();
}
inline void idle_yield() {
#ifdef MT_HOST_SIM
  __atomic_add_fetch(&mtsim::yields, 1, __ATOMIC_RELAXED);
#endif
  std::this_thread::yield();
}
// An idle thread refreshes the CPU it reports on the first yield of an idle stretch and on every
// kCpuRefreshYields-th after it: sched_getcpu costs little, but the yield loop runs up to a million times a second.
// Counted, not timed: reading a clock on every yield would cost about what it saves.
constexpr uint64_t kIdleSpins = 1u << 16;  // pauses before the idle loop starts yielding
constexpr uint64_t kCpuRefreshYields = 1024;
// An idle thread sleeps (Engine::idle_sleep) once nothing it serves is outstanding: no call announced by
// mt_proxy_expect_internal is unfinished (its kernel's completion word is below the call's number) and it has
// polled kIdleGraceNs since the idle stretch began. Sleeps double from kIdleNapMinNs to kIdleNapMaxNs; a host call
// that is about to produce (mt_proxy_enqueue, the proxy kernels' launches) ends a sleep at once and starts the idle
// stretch over, so the bound only delays a producer nobody announced (a replayed CUDA graph: the proxy transport
// is not graph-capturable). Why 1 ms: every MoE layer has its own engine (~48 a rank), nearly all idle at any time,
// and each wake costs CPU: 48 idle engines took 0.14 CPU-s per second at 1 ms sleeps, 0.27 at 100 us and a whole
// core at 50 us (host simulation, a loaded 2-core VM). Without the sleeps an idle engine yielded forever: a core each.
constexpr uint64_t kIdleGraceNs = 200 * 1000;       // polling (pause, then yield) before the first sleep
constexpr uint64_t kIdleNapMinNs = 1000;
constexpr uint64_t kIdleNapMaxNs = 1000 * 1000;
constexpr uint64_t kCpuRefreshSleeps = 64;          // the CPU the thread reports: refreshed at the first sleep of
                                                    // an idle stretch and every 64th after it
constexpr uint64_t kIdleClockPolls = 64;            // the spin phase reads the clock every 64th empty poll

// NUMA placement of the FIFO and control pages (Engine::place_pages). Raw system calls: no libnuma dependency.
constexpr int kMpolPreferred = 1;                 // linux/mempolicy.h MPOL_PREFERRED
constexpr unsigned long kMpolFNode = 1, kMpolFAddr = 2;  // MPOL_F_NODE, MPOL_F_ADDR
constexpr const char* kSysCpuDir = "/sys/devices/system/cpu";
constexpr int kMaskBits = 8 * (int)sizeof(unsigned long);

long sys_mbind(void* addr, unsigned long len, int mode, const unsigned long* mask, unsigned long maxnode) {
#ifdef MT_HOST_SIM
  if (mtsim::mbind_errno != 0) {  // a kernel that refuses (EPERM under a container's seccomp, ENOSYS)
    errno = mtsim::mbind_errno;
    return -1;
  }
#endif
#ifdef SYS_mbind
  return syscall(SYS_mbind, addr, len, (unsigned long)mode, mask, maxnode, 0ul);  // every argument a full word
#else
  (void)addr, (void)len, (void)mode, (void)mask, (void)maxnode;
  errno = ENOSYS;
  return -1;
#endif
}

// The FIFO pages' own mapping (Engine::place_pages, release): counted in host simulation, so a test sees every
// mapping undone; madvise's failure can be injected there.
void* map_pages(size_t len) {
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
#ifdef MT_HOST_SIM
  if (p != MAP_FAILED) {
    __atomic_add_fetch(&mtsim::page_maps, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&mtsim::pages_mapped, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&mtsim::page_bytes_mapped, (long long)len, __ATOMIC_RELAXED);
  }
#endif
  return p;
}
void unmap_pages(void* p, size_t len) {
#ifdef MT_HOST_SIM
  __atomic_sub_fetch(&mtsim::pages_mapped, 1, __ATOMIC_RELAXED);
  __atomic_sub_fetch(&mtsim::page_bytes_mapped, (long long)len, __ATOMIC_RELAXED);
#endif
  munmap(p, len);
}
int dontfork_pages(void* p, size_t len) {
#ifdef MT_HOST_SIM
  if (mtsim::madvise_errno != 0) {
    errno = mtsim::madvise_errno;
    return -1;
  }
#endif
  return madvise(p, len, MADV_DONTFORK);
}

// The NUMA node the page at `addr` is on now; -1 with errno set where the kernel cannot say.
int page_node(const void* addr) {
#ifdef SYS_get_mempolicy
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0ul, addr, kMpolFNode | kMpolFAddr) != 0) return -1;
  return node;
#else
  (void)addr;
  errno = ENOSYS;
  return -1;
#endif
}

// The NUMA node sysfs lists for `cpu` (an entry node<N> in <cpu_dir>/cpu<cpu>/), -1 where it lists none.
int cpu_node(const char* cpu_dir, int cpu) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/cpu%d", cpu_dir, cpu);
  DIR* d = opendir(path);
  if (d == nullptr) return -1;
  int node = -1;
  while (const dirent* ent = readdir(d)) {
    const char* n = ent->d_name;
    if (strncmp(n, "node", 4) != 0 || !isdigit((unsigned char)n[4])) continue;
    char* end = nullptr;
    const long v = strtol(n + 4, &end, 10);
    if (*end == '\0' && v < MT_PROXY_MAX_NODE) {
      node = (int)v;
      break;
    }
  }
  closedir(d);
  return node;
}

// The node to place the pages on for a CPU set: the node holding most of its CPUs (ties: the lowest node), so a
// set that spans nodes still gets one; -1 where sysfs lists a node for none of them.
int set_node(const char* cpu_dir, const int* cpus, int n) {
  std::map<int, int> count;
  for (int c : std::set<int>(cpus, cpus + n)) {
    const int node = cpu_node(cpu_dir, c);
    if (node >= 0) ++count[node];
  }
  int best = -1;
  for (const auto& kv : count)  // ascending nodes: a later node wins only with strictly more CPUs
    if (best < 0 || kv.second > count[best]) best = kv.first;
  return best;
}

const char* numa_cpu_dir() {
#ifdef MT_HOST_SIM
  if (mtsim::sysfs_cpu_dir != nullptr) return mtsim::sysfs_cpu_dir;  // a test's fake topology
#endif
  return kSysCpuDir;
}

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
  ST_ACK_WRITES,  // the ACKs' stream writes (one per stream picked since the previous ACK)
  ST_COUNT
};

struct Engine {
  int device = 0;
  int npeers = 0;
  int qps = 1;       // streams per peer
  int nstreams = 1;  // npeers * qps: stream p * qps + k is peer p's k-th
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
  std::vector<uint32_t> rr;  // round_robin: each peer's next stream (restarts at every ACK)
  std::vector<char> touched;  // streams picked since the previous ACK: the next ACK is written on those (AckSet)
  uint64_t tail = 0;  // proxy-thread private copy
  std::thread th;
  std::atomic<bool> stop{false};
  std::atomic<bool> running{false};
  // how long a drain or release() waits for a QP stream, and mt_proxy_create for its set-up work: the create's
  // timeout_s, which mt_proxy_set_timeout may change later (ProxyEngine passes RuntimeOptions.onesided_timeout_s to both)
  std::atomic<uint64_t> timeout_ns{mt::kDefaultTimeoutNs};
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
  // engine runs on either way. The FIFO and control pages go on the set's NUMA node (place_pages).
  std::vector<int> cpu_req;                   // the CPUs asked for at create (empty: no pinning)
  std::atomic<int> cpu_state{MT_PCPU_PENDING};  // MtProxyCpuState
  std::atomic<int> cpu_errno{0};
  std::atomic<int> cpu_now{-1};  // sched_getcpu() of the thread: after pinning, and now and then while it idles
  std::atomic<int> tid{0};       // the thread's kernel id (/proc/self/task/<tid>)
  // Sleeping while idle (see kIdleGraceNs): `wakes` counts host calls about to produce (wake()); a sleeping thread
  // returns at the next one. hot_word/hot_seq (under idle_mu): the completion word of the last kernel call
  // announced and that call's number; while the word is below it the thread polls and never sleeps.
  std::mutex idle_mu;
  std::condition_variable idle_cv;
  std::atomic<uint64_t> wakes{0};
  std::atomic<int> sleeping{0};
  const uint64_t* hot_word = nullptr;
  uint64_t hot_seq = 0;
  // Where the FIFO and control pages are (MtProxyMemState; fixed once mt_proxy_create returns). BOUND: one mapping
  // `pages` (the ring, page-rounded, then one control page), mmap'ed and cudaHostRegister'ed; else two cudaHostAllocs.
  void* pages = nullptr;
  size_t pages_len = 0;
  int mem_state = MT_PMEM_DEFAULT;
  int mem_want = -1;
  int mem_errno = 0;
  std::string mem_reason = "no CPU set asked for: allocated on the creating thread's NUMA node";

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

  // The stream of a PUT or SIGNAL for `peer` (a valid peer index) covered by signal slot `idx`: one of the peer's
  // qps streams (see the top of this file).
  // A GPU producer mirrors this (AckSet in proxy_engine.h, Producer::pick in proxy_xchg.h): change both together.
  int pick(uint32_t peer, uint32_t idx) {
    const int base = (int)peer * qps;
    int q = base;
    if (qps > 1)
      q += qp_mapping == MT_QP_PEER_HASH ? (int)(idx % (uint32_t)qps) : (int)(rr[peer]++ % (uint32_t)qps);
    touched[q] = 1;
    return q;
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
    char buf[384];
    snprintf(buf, sizeof(buf), "proxy: %s -> %s", what, cu_error_text(r).c_str());
    fail(buf, 900 + (int)r);
    return false;
  }

  // phase_peer: a peer index, or kPhaseStream | a global stream index (drains, ACKs, batched copies; mt_proxy_diag
  // names which).
  static constexpr uint32_t kPhaseStream = 1u << 31;
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

  // Until stream `s` completed its work (cudaSuccess), failed (its error), or `deadline` (mono_ns) or `stop` came
  // (cudaErrorNotReady). Polled, never synchronised: work stuck on a stream, such as a copy behind a spinning kernel
  // on a hardware queue it shares, would hold a cudaStreamSynchronize forever.
  cudaError_t wait_stream(cudaStream_t s, uint64_t deadline, bool heed_stop) {
    for (;;) {
      const cudaError_t e = cudaStreamQuery(s);
      if (e != cudaErrorNotReady) return e;
      if (mono_ns() >= deadline || (heed_stop && stop.load(std::memory_order_relaxed))) return e;
      cpu_relax();
    }
  }

  // Every busy stream completed, within the engine's timeout: else the engine fails (213, as mt_proxy_quiesce's
  // timeout) and writes no more signals.
  void drain_all() {
    uint64_t t0 = mono_ns();
    const uint64_t deadline = t0 + timeout_ns.load(std::memory_order_relaxed);
    for (int q = 0; q < nstreams; ++q) {
      if (dirty[q]) {
        const cudaError_t e = (enter(PH_SYNC, kPhaseStream | (uint32_t)q), leave(wait_stream(streams[q], deadline, true)));
        if (e == cudaErrorNotReady) {
          char buf[256];
          snprintf(buf, sizeof(buf), "proxy: QP stream %d did not complete its transfers within %.1f s (drain before "
                   "a signal)%s", q, (double)timeout_ns.load(std::memory_order_relaxed) / 1e9,
                   stop.load() ? "; stopped while waiting" : "");
          fail(buf, 213);
          return;
        }
        if (!cuda_ok(e, "cudaStreamQuery (drain)")) return;
        dirty[q] = 0;
      }
    }
    stats[ST_DRAINS]++;
    stats[ST_DRAIN_NS] += mono_ns() - t0;
  }

  void signal(uint32_t peer, uint32_t idx, uint64_t value) {
    // A signal tells the receiver that the data before it has landed. Once a CUDA call of this engine has failed
    // (a copy not issued, in process() or a batch in flush()), that may be false: write no more signals, so the
    // receiver's wait ends in its timeout (a reported error) instead of success with rows missing. The engine stays
    // failed (mt_proxy_error); the sender's call reports it. (Checked again after a drain: an asynchronous copy
    // failure surfaces at its cudaStreamSynchronize.)
    if (err.load() != 0) return;
    if (fence_mode == MT_FENCE_PROXY_DRAIN) {
      drain_all();
      if (err.load() != 0) return;
    }
    // nic_ordered / none: no wait; ordering (if any) comes from the stream the signal lands on.
    int q = pick(peer, idx);
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
        int q = pick(r.peer, r.signal_idx);
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
        int q = (int)r.peer * qps;  // the peer's first stream
        touched[q] = 1;
        cu_ok((enter(PH_WRITE, r.peer),
               leave(write64((CUstream)streams[q], (CUdeviceptr)(peer_ctrl[r.peer] + r.dst_off), r.value, 0))),
              "cuStreamWriteValue64 (write64)");
        dirty[q] = 1;
        stats[ST_WRITE64]++;
        break;
      }
      case MT_OP_ACK: {
        // on the streams picked since the previous ACK: each write is a driver call of the thread's (an exploratory
        // look, run 204 in bench/results/archive: ~1-2 us each; the scenario proxy-ack-cost measures it); on every
        // stream once the engine failed, since a request it skipped picked nothing while the producer counted it
        const bool all = err.load() != 0;
        for (int q = 0; q < nstreams; ++q) {
          if (!all && !touched[q]) continue;
          cu_ok((enter(PH_WRITE, kPhaseStream | (uint32_t)q), leave(write64((CUstream)streams[q], (CUdeviceptr)(ack_dev + q), r.value, 0))),
                "cuStreamWriteValue64 (ack)");
          stats[ST_ACK_WRITES]++;
        }
        std::fill(touched.begin(), touched.end(), 0);
        std::fill(rr.begin(), rr.end(), 0u);  // the next call's rotation starts at each peer's first stream
        stats[ST_ACKS]++;
        break;
      }
      default:
        fail("proxy: unknown request op", 701);
    }
  }

  void flush() {
    for (int q = 0; q < nstreams; ++q) {
      Pending& p = pend[q];
      size_t n = p.dst.size();
      if (n == 0) continue;
      if (n == 1) {
        cuda_ok((enter(PH_COPY, kPhaseStream | (uint32_t)q), leave(cudaMemcpyAsync(p.dst[0], p.src[0], p.size[0], cudaMemcpyDeviceToDevice,
                                                                     streams[q]))),
                "cudaMemcpyAsync (put)");
      } else {
        cudaMemcpyAttributes attr;
        memset(&attr, 0, sizeof(attr));
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t idx = 0;
        cuda_ok((enter(PH_COPY, kPhaseStream | (uint32_t)q),
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

  bool unplaced(const char* why, int code, bool cuda) {
    char buf[512];
    if (cuda)
      snprintf(buf, sizeof(buf), "%s -> %s (%s)", why, cudaGetErrorName((cudaError_t)code),
               cudaGetErrorString((cudaError_t)code));
    else if (code != 0)
      snprintf(buf, sizeof(buf), "%s: %s (errno %d)", why, strerror(code), code);
    else
      snprintf(buf, sizeof(buf), "%s", why);
    mem_state = MT_PMEM_FALLBACK;
    mem_errno = code;
    mem_reason = std::string(buf) + "; allocated on the creating thread's NUMA node instead";
    return false;
  }

  // Places the FIFO (ring bytes) and the control page on the NUMA node of the CPU set the thread pins itself to:
  // one anonymous mapping, mbind MPOL_PREFERRED to that node, zeroed here (the first touch faults every page in
  // there), then cudaHostRegister'ed mapped + portable as cudaHostAlloc's pages are. Done on the creating thread
  // with an explicit policy rather than by first touch from the pinned thread: the node does not depend on which
  // CPU of the set the thread lands on (a set may span nodes) nor on the pinning being granted, and every failure
  // is known before mt_proxy_create returns. PREFERRED, not BIND: a full node gives pages elsewhere, never a fault
  // (mt_proxy_mem reports where the first page is). False (the reason recorded): the caller falls back to
  // cudaHostAlloc, as without a set.
  bool place_pages(size_t ring) {
    mem_want = set_node(numa_cpu_dir(), cpu_req.data(), (int)cpu_req.size());
    if (mem_want < 0) return unplaced("sysfs lists no NUMA node for any CPU of the set", 0, false);
    const long pg = sysconf(_SC_PAGESIZE);
    const size_t page = pg > 0 ? (size_t)pg : 4096;
    const size_t ring_len = (ring + page - 1) / page * page;
    const size_t len = ring_len + page;
    void* p = map_pages(len);
    if (p == MAP_FAILED) return unplaced("mmap of the FIFO pages", errno, false);
    unsigned long mask[MT_PROXY_MAX_NODE / kMaskBits] = {};
    mask[mem_want / kMaskBits] |= 1ul << (mem_want % kMaskBits);
    // maxnode is one more than the mask's bits: the kernel drops the last one
    if (sys_mbind(p, len, kMpolPreferred, mask, MT_PROXY_MAX_NODE + 1) != 0) {
      const int er = errno;
      unmap_pages(p, len);
      char what[96];
      snprintf(what, sizeof(what), "mbind of the FIFO pages to NUMA node %d", mem_want);
      return unplaced(what, er, false);
    }
    // not into a forked child (a DataLoader worker): a copy-on-write break in this process would leave the GPU
    // writing a page it no longer maps; cudaHostAlloc's pages are not inherited either
    if (dontfork_pages(p, len) != 0) {
      const int er = errno;
      unmap_pages(p, len);
      return unplaced("madvise(MADV_DONTFORK) of the FIFO pages", er, false);
    }
    memset(p, 0, len);
    cudaError_t ce = cudaHostRegister(p, len, cudaHostRegisterMapped | cudaHostRegisterPortable);
    const bool registered = ce == cudaSuccess;
    void* fdev = nullptr;
    void* cdev = nullptr;
    if (ce == cudaSuccess) ce = cudaHostGetDevicePointer(&fdev, p, 0);
    if (ce == cudaSuccess) ce = cudaHostGetDevicePointer(&cdev, static_cast<char*>(p) + ring_len, 0);
    if (ce != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: keep it out of later calls' error checks
      if (registered) cudaHostUnregister(p);
      unmap_pages(p, len);
      return unplaced(registered ? "cudaHostGetDevicePointer of the registered FIFO pages" : "cudaHostRegister of the FIFO pages",
                      (int)ce, true);
    }
    pages = p;
    pages_len = len;
    fifo_host = static_cast<MtRequest*>(p);
    fifo_dev = static_cast<MtRequest*>(fdev);
    ctl_host = reinterpret_cast<uint64_t*>(static_cast<char*>(p) + ring_len);
    ctl_dev = static_cast<uint64_t*>(cdev);
    mem_state = MT_PMEM_BOUND;
    char buf[160];
    snprintf(buf, sizeof(buf), "placed on NUMA node %d (of most CPUs of the set)", mem_want);
    mem_reason = buf;
    return true;
  }

  // Frees what mt_proxy_create allocated, once the thread has stopped (or never ran); CUDA errors are ignored, the
  // engine is going away either way. Each stream gets the engine's timeout to complete its work (all of them
  // together). Where one did not (its index is returned; -1: all did), nothing is freed (leaked on purpose): a stuck
  // stream may still write ack_dev, and cudaFree / cudaFreeHost / cudaHostUnregister may wait for the device to
  // be idle, i.e. forever. The streams themselves are destroyed: that returns at once, their resources go once
  // their work completed.
  int release() {
    mt::DeviceGuard device_guard;  // destroy may run on any thread (a GC finalizer): the caller's device stays
    (void)device_guard.set(device);
    const uint64_t deadline = mono_ns() + timeout_ns.load(std::memory_order_relaxed);
    int stuck = -1;
    for (size_t q = 0; q < streams.size(); ++q) {
      if (wait_stream(streams[q], deadline, false) == cudaErrorNotReady && stuck < 0) stuck = (int)q;
      cudaStreamDestroy(streams[q]);
    }
    streams.clear();
    if (stuck >= 0) return stuck;
    if (pages != nullptr) {
      cudaHostUnregister(pages);
      unmap_pages(pages, pages_len);
      pages = nullptr;
    } else {
      if (fifo_host) cudaFreeHost(fifo_host);
      if (ctl_host) cudaFreeHost(ctl_host);
    }
    fifo_host = nullptr;
    ctl_host = nullptr;
    if (head_dev) cudaFree(head_dev);
    if (ack_dev) cudaFree(ack_dev);
    head_dev = nullptr;
    ack_dev = nullptr;
    return -1;
  }

  // mt_proxy_create's set-up work (the memsets of head_dev and ack_dev, the warm-up copies into `scratch`) did not
  // complete within the engine's timeout: the streams are destroyed (that returns at once; their resources go once
  // their work completed) and everything else is leaked, as release() does for a stuck stream: the queued work may
  // still write head_dev, ack_dev and the scratch, and cudaFree / cudaFreeHost / cudaHostUnregister may wait for the
  // device to be idle, i.e. forever. Sets the error text; the caller deletes the engine and returns 216.
  void abandon_setup(const void* scratch) {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
    streams.clear();
    (void)cudaGetLastError();  // keep a failed destroy out of the caller's next launch check
    mt::set_error("mt_proxy_create: the set-up work on device %d (the memsets of its device words%s) did not complete "
                  "within %.1f s: other work on the device does not end (a stuck persistent kernel, a peer that never "
                  "signals). The engine's FIFO, control page and device words%s are leaked rather than freed under "
                  "it; end that work (or restart the process) before building the transport again", device,
                  scratch != nullptr ? ", the warm-up copies on its QP streams" : "",
                  (double)timeout_ns.load(std::memory_order_relaxed) / 1e9,
                  scratch != nullptr ? " and the warm-up scratch" : "");
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
    cpu_now.store(current_cpu());
  }

  // A host call is about to produce (or stop is set): a sleeping thread returns now. The seq_cst pair (wakes here,
  // `sleeping` in idle_sleep) means either the sleeper sees the new count or this sees it asleep and notifies under
  // idle_mu, which the sleeper holds until it waits: no wake is lost.
  void wake() {
    wakes.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> g(idle_mu);
      idle_cv.notify_all();
    }
  }

  // A kernel call numbered `seq` that writes `seq` into `*word` when it finished is about to be launched: until
  // then the thread does not sleep. Then wake(). word null (a launch being captured: it runs at a replay nobody
  // announces): only the wake; the marker of an earlier call still in flight stays (clearing it would let the
  // thread sleep under that call).
  void expect(const uint64_t* word, uint64_t seq) {
    if (word != nullptr) {
      std::lock_guard<std::mutex> g(idle_mu);
      hot_word = word;
      hot_seq = seq;
    }
    wake();
  }

  // The launch of call `seq` announced on `word` failed (it never writes the word): the marker goes back to the
  // call before it on that word (seq - 1, the same context's previous launch, stream-ordered: still polled for
  // while unfinished), if the marker is still this call's.
  void retract(const uint64_t* word, uint64_t seq) {
    std::lock_guard<std::mutex> g(idle_mu);
    if (hot_word == word && hot_seq == seq) hot_seq = seq - 1;
  }

  // `word` is about to be freed: never read it again.
  void forget(const uint64_t* word) {
    std::lock_guard<std::mutex> g(idle_mu);
    if (hot_word == word) hot_word = nullptr;
  }

  bool hot() {
    std::lock_guard<std::mutex> g(idle_mu);
    return hot_word != nullptr && __atomic_load_n(hot_word, __ATOMIC_ACQUIRE) < hot_seq;
  }

  bool fifo_ready() const {
    return __atomic_load_n(&fifo_host[tail % nslots].seq, __ATOMIC_ACQUIRE) == tail + 1;
  }

  // Sleep up to `ns` unless a wake came since `seen` (or comes meanwhile), stop is set or a request is there.
  void idle_sleep(uint64_t ns, uint64_t seen) {
    std::unique_lock<std::mutex> lk(idle_mu);
    sleeping.store(1, std::memory_order_seq_cst);
    auto woken = [&] { return wakes.load(std::memory_order_seq_cst) != seen || stop.load(); };
    if (!woken() && !fifo_ready()) {
#ifdef MT_HOST_SIM
      __atomic_add_fetch(&mtsim::idle_sleeps, 1, __ATOMIC_RELAXED);
#endif
      idle_cv.wait_for(lk, std::chrono::nanoseconds(ns), woken);
    }
    sleeping.store(0, std::memory_order_relaxed);
  }

  void loop() {
    pin_self();  // first: whatever the thread itself allocates or first touches from here on is on the set's node
    cudaSetDevice(device);
    // The idle stretch (no request since the last one): pauses, then yields after kIdleSpins empty polls; once
    // kIdleGraceNs passed and no announced call is unfinished, sleeps (kIdleNapMinNs doubling to kIdleNapMaxNs).
    uint64_t idle = 0;        // empty polls in this stretch
    uint64_t idle_since = 0;  // when the stretch was first timed (0: not yet)
    uint64_t nap = 0;         // the last sleep's length (0: not sleeping)
    uint64_t naps = 0;        // sleeps in this stretch (the first and every kCpuRefreshSleeps-th refresh cpu_now)
    uint64_t seen = wakes.load();
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
          int q = pick(r.peer, r.signal_idx);  // same mapping decisions, in the same order, as unbatched issue
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
        ++idle;
        if (nap == 0 && idle < kIdleSpins && idle % kIdleClockPolls != 0) {
          cpu_relax();
          continue;
        }
        const uint64_t w = wakes.load(std::memory_order_acquire);
        if (w != seen) {  // a host call about to produce: the stretch starts over
          seen = w;
          idle = 1;
          idle_since = 0;
          nap = 0;
          naps = 0;
        }
        const uint64_t now = mono_ns();
        if (idle_since == 0) idle_since = now;
        if (now - idle_since >= kIdleGraceNs && !hot()) {
          uint64_t nap_min = kIdleNapMinNs, nap_max = kIdleNapMaxNs;
#ifdef MT_HOST_SIM
          if (const uint64_t m = __atomic_load_n(&mtsim::idle_nap_min_ns, __ATOMIC_RELAXED)) nap_min = m;
          if (const uint64_t m = __atomic_load_n(&mtsim::idle_nap_max_ns, __ATOMIC_RELAXED)) nap_max = m;
#endif
          nap = nap == 0 ? nap_min : (2 * nap < nap_max ? 2 * nap : nap_max);
          if (naps++ % kCpuRefreshSleeps == 0) cpu_now.store(current_cpu(), std::memory_order_relaxed);
          idle_sleep(nap, seen);
          continue;
        }
        nap = 0;
        if (idle < kIdleSpins) {
          cpu_relax();
        } else {
          if ((idle - kIdleSpins) % kCpuRefreshYields == 0) cpu_now.store(current_cpu(), std::memory_order_relaxed);
          idle_yield();
        }
        continue;
      }
      idle = 0;
      idle_since = 0;
      nap = 0;
      naps = 0;
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
  out->nstreams = e->nstreams;
  out->qps = e->qps;
  out->qp_mapping = e->qp_mapping;
  return 0;
}

// peer_data[i]: base of peer i's data region; peer_ctrl[i]: base of peer i's control region;
// peer_sig[i]: address of MY signal slot 0 at peer i (the proxy writes slot k at peer_sig[i] + 8k).
// cpus[0..ncpus): the set of CPUs the proxy thread pins itself to (the OS places it within the set); ncpus 0 or
// -1 (or cpus NULL with ncpus <= 0): no pinning. A pinning the kernel refuses is recorded (mt_proxy_cpu), not an
// error. timeout_s: the engine's timeout (as mt_proxy_set_timeout sets it), so also the bound of this create's wait
// for its set-up work (216 past it); not a finite number > 0: 215, as mt_proxy_set_timeout refuses one <= 0.
MT_API int mt_proxy_create(int device, int npeers, const uint64_t* peer_data, const uint64_t* peer_ctrl,
                           const uint64_t* peer_sig, int qps, int qp_mapping, int fence_mode, int fifo_slots,
                           const int* cpus, int ncpus, double timeout_s, void** out) {
  MT_REQUIRE(npeers >= 1 && npeers <= 4096, 200, "npeers %d outside 1..4096", npeers);
  MT_REQUIRE(qps >= 1 && qps <= MT_MAX_QPS, 201, "qps %d (per peer) outside 1..%d", qps, MT_MAX_QPS);
  MT_REQUIRE((long)npeers * qps <= MT_MAX_STREAMS, 201, "%d peers x %d QPs per peer = %ld streams, more than %d",
             npeers, qps, (long)npeers * qps, MT_MAX_STREAMS);
  MT_REQUIRE(fifo_slots >= 16 && fifo_slots <= (1 << 20), 202, "fifo_slots %d outside 16..2^20", fifo_slots);
  MT_REQUIRE(fence_mode >= 0 && fence_mode <= 2, 203, "bad fence_mode %d", fence_mode);
  MT_REQUIRE(qp_mapping >= 0 && qp_mapping <= 1, 204, "bad qp_mapping %d", qp_mapping);
  MT_REQUIRE(ncpus >= -1 && ncpus <= MT_PROXY_MAX_CPU, 208, "bad ncpus %d (-1 or 0 = no pinning, at most %d)", ncpus,
             MT_PROXY_MAX_CPU);
  MT_REQUIRE(ncpus <= 0 || cpus != nullptr, 208, "ncpus %d with no cpus array", ncpus);
  for (int i = 0; i < ncpus; ++i) MT_REQUIRE(cpus[i] >= 0, 208, "bad cpu %d (cpus[%d])", cpus[i], i);
  MT_REQUIRE(mt::timeout_s_ok(timeout_s), 215, "mt_proxy_create: timeout_s %g is not a finite number > 0", timeout_s);
  MT_SET_DEVICE(device);
  Engine* e = new Engine();
  e->device = device;
  e->timeout_ns.store(mt::timeout_ns(timeout_s));
  if (ncpus > 0) e->cpu_req.assign(cpus, cpus + ncpus);
  e->npeers = npeers;
  e->qps = qps;
  e->nstreams = npeers * qps;
  e->rr.assign(npeers, 0u);
  e->qp_mapping = qp_mapping;
  e->fence_mode = fence_mode;
  e->peer_data.assign(peer_data, peer_data + npeers);
  e->peer_ctrl.assign(peer_ctrl, peer_ctrl + npeers);
  e->peer_sig.assign(peer_sig, peer_sig + npeers);
  e->nslots = (uint32_t)fifo_slots;
  e->dirty.assign(e->nstreams, 0);
  e->touched.assign(e->nstreams, 0);
  e->pend.resize(e->nstreams);
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
  // with a CPU set, on its NUMA node; without one (or where that fails: the reason is kept), where the creating
  // thread is, as cudaHostAlloc places them
  if (e->cpu_req.empty() || !e->place_pages(ring)) {
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
  }
  if (ce == cudaSuccess) ce = cudaMalloc((void**)&e->head_dev, 64);
  if (ce == cudaSuccess) ce = cudaMemset(e->head_dev, 0, 64);
  if (ce == cudaSuccess) ce = cudaMalloc((void**)&e->ack_dev, 8ull * e->nstreams);
  if (ce == cudaSuccess) ce = cudaMemset(e->ack_dev, 0, 8ull * e->nstreams);
  for (int i = 0; i < e->nstreams && ce == cudaSuccess; ++i) {
    cudaStream_t s;
    ce = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (ce == cudaSuccess) e->streams.push_back(s);
  }
  // the set-up work (the memsets above, the warm-up copies below) is waited for within the engine's timeout (the
  // caller's timeout_s), never without end (mt::device_sync_within); past it 216
  const uint64_t setup_deadline = mt::host_ns() + e->timeout_ns.load(std::memory_order_relaxed);
#ifndef MT_HOST_SIM
  if (ce == cudaSuccess) {
    // warm-up: a few small device-to-device copies and a stream write on every QP stream, so whatever
    // the driver sets up lazily for them happens now, never while a kernel spins waiting on this engine
    void* scratch = nullptr;
    CUresult cr = CUDA_SUCCESS;
    ce = cudaMalloc(&scratch, 1 << 16);
    for (int i = 0; i < e->nstreams && ce == cudaSuccess; ++i) {
      char* b = static_cast<char*>(scratch);
      ce = cudaMemcpyAsync(b + 32768, b, 4096, cudaMemcpyDeviceToDevice, e->streams[i]);
      if (ce == cudaSuccess) ce = cudaMemcpyAsync(b + 40963, b + 5, 777, cudaMemcpyDeviceToDevice, e->streams[i]);
      if (ce == cudaSuccess) ce = cudaMemcpyAsync(b + 49152, b, 16384, cudaMemcpyDeviceToDevice, e->streams[i]);
      if (ce == cudaSuccess && (cr = e->write64((CUstream)e->streams[i], (CUdeviceptr)(b + 65528), 1, 0)) != CUDA_SUCCESS) {
        // the driver's own error (e.g. CUDA_ERROR_NOT_SUPPORTED: no stream memory operations here), not a made-up
        // cudaErrorUnknown; code 900 + CUresult as the proxy thread's driver failures (Engine::cu_ok)
        mt::set_error("mt_proxy_create: warm-up cuStreamWriteValue64 on stream %d -> %s", i, cu_error_text(cr).c_str());
        break;
      }
    }
    if (ce == cudaSuccess && cr == CUDA_SUCCESS) ce = mt::device_sync_within(device, setup_deadline);
    if (ce == cudaErrorNotReady) {  // the copies may still run: the scratch is leaked with the rest
      e->abandon_setup(scratch);
      delete e;
      return 216;
    }
    if (scratch) cudaFree(scratch);
    if (cr != CUDA_SUCCESS) {
      (void)cudaGetLastError();
      e->release();  // the registered pages too, as below
      delete e;
      return 900 + (int)cr;
    }
  }
#endif
  if (ce == cudaSuccess) ce = mt::device_sync_within(device, setup_deadline);
  if (ce == cudaErrorNotReady) {
    e->abandon_setup(nullptr);
    delete e;
    return 216;
  }
  if (ce != cudaSuccess) {
    mt::set_error("mt_proxy_create: %s (%s)", cudaGetErrorName(ce), cudaGetErrorString(ce));
    e->release();  // the registered pages too: a caller may try again (or fall back to another transport)
    delete e;
    return (int)ce;
  }
  // std::thread throws where the system refuses a thread (EAGAIN: a pids cgroup, RLIMIT_NPROC, ~48 engines a rank);
  // an exception out of this C entry point would end the process (std::terminate): an error code instead
  try {
#ifdef MT_HOST_SIM
    if (mtsim::thread_errno != 0) throw std::system_error(mtsim::thread_errno, std::generic_category());
#endif
    e->th = std::thread([e] { e->loop(); });
  } catch (const std::system_error& ex) {
    mt::set_error("mt_proxy_create: the proxy thread could not be started: %s", ex.what());
    e->release();  // the registered pages too, as above
    delete e;
    return 209;
  }
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

// How long a drain (fence mode proxy_drain, before a signal) and mt_proxy_destroy wait for a QP stream: past it,
// the drain fails the engine (213) and destroy leaks the engine's memory (213). Set while idle.
MT_API int mt_proxy_set_timeout(void* h, double timeout_s) {
  Engine* e = static_cast<Engine*>(h);
  MT_REQUIRE(timeout_s > 0, 215, "timeout_s %g is not > 0", timeout_s);  // NaN fails too
  e->timeout_ns.store(mt::timeout_ns(timeout_s));
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
  static const char* names[] = {"idle", "cudaMemcpyAsync", "cuStreamWriteValue64", "a drain"};
  char what[192];
  if (ph != PH_IDLE) {
    const uint32_t pp = e->phase_peer.load();
    const bool stream = (pp & Engine::kPhaseStream) != 0;
    snprintf(what, sizeof(what), "inside %s (%s %u) for %.3f s", names[ph & 3], stream ? "stream" : "peer",
             pp & ~Engine::kPhaseStream, (double)(mono_ns() - e->phase_since.load()) / 1e9);
  }
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

// Where the FIFO and control pages are: out[MT_PMEM_F_*] (csrc/proxy_engine.h), the first n of them, and the
// reason (how they were placed, or why not) into buf. The node is asked of the kernel now (get_mempolicy on the
// FIFO's first page), so a GPU test sees where pages the engine placed really are. Where the kernel cannot say
// (cudaHostAlloc's pages, the default and fallback states, may be a driver mapping get_mempolicy refuses with
// EFAULT; not seen yet: the H200 machine of run 188 reported node 0 for them) the query errno field says why.
MT_API int mt_proxy_mem(void* h, int* out, int n, char* buf, int len) {
  Engine* e = static_cast<Engine*>(h);
  errno = 0;
  const int node = page_node(e->fifo_host);
  const int query_errno = node < 0 ? (errno != 0 ? errno : EINVAL) : 0;
  const int v[MT_PMEM_F_COUNT] = {e->mem_state, e->mem_want, node, e->mem_errno, query_errno};
  for (int i = 0; i < n && i < MT_PMEM_F_COUNT; ++i) out[i] = v[i];
  if (buf != nullptr && len > 0) snprintf(buf, (size_t)len, "%s", e->mem_reason.c_str());
  return 0;
}

// The node of a CPU set as mt_proxy_create chooses it (most CPUs of the set; -1 none), under `cpu_dir` (NULL: the
// machine's /sys/devices/system/cpu). For tests of that choice on a fake topology.
MT_API int mt_proxy_numa_node(const int* cpus, int n, const char* cpu_dir, int* out) {
  MT_REQUIRE(n >= 0 && (n == 0 || cpus != nullptr), 208, "bad cpu set (n %d)", n);
  *out = set_node(cpu_dir != nullptr ? cpu_dir : kSysCpuDir, cpus, n);
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

// Host producer: enqueue n requests (blocks, bounded, while the ring is full). `reqs` is n packed 64-byte
// requests at ANY address: MtRequest is declared 64-byte aligned, a caller's array need not be (a ctypes array of
// Request from Python is 8- or 16-aligned), so each request is copied byte-wise into an aligned local, never read
// through the pointer as an MtRequest (that is undefined behaviour, and the compiler's aligned vector loads fault).
MT_API int mt_proxy_enqueue(void* h, const void* reqs, int n, double timeout_s) {
  Engine* e = static_cast<Engine*>(h);
  const unsigned char* in = static_cast<const unsigned char*>(reqs);
  std::lock_guard<std::mutex> g(e->host_mu);
  MT_REQUIRE(e->producer_kind != 2, 210, "this engine has a GPU producer; host enqueue is not allowed");
  e->producer_kind = 1;
  uint64_t deadline = mono_ns() + mt::timeout_ns(timeout_s);
  for (int i = 0; i < n; ++i) {
    uint64_t h0 = e->host_head;
    if (h0 - __atomic_load_n(&e->ctl_host[1], __ATOMIC_ACQUIRE) >= e->nslots) e->wake();  // full: it may sleep
    while (h0 - __atomic_load_n(&e->ctl_host[1], __ATOMIC_ACQUIRE) >= e->nslots) {
      MT_REQUIRE(e->err.load() == 0, 211, "proxy thread failed: %s", e->errmsg.c_str());
      MT_REQUIRE(mono_ns() < deadline, 212, "proxy FIFO full for %.1f s", timeout_s);
      cpu_relax();
    }
    MtRequest* s = &e->fifo_host[h0 % e->nslots];
    MtRequest r;
    memcpy(&r, in + (size_t)i * sizeof(MtRequest), sizeof(MtRequest));
    r.seq = 0;
    memcpy((void*)s, &r, offsetof(MtRequest, seq));
    __atomic_store_n(&s->seq, h0 + 1, __ATOMIC_RELEASE);
    e->host_head = h0 + 1;
  }
  e->wake();  // after the writes: a thread that went to sleep before them (it checks the FIFO first) returns
  return 0;
}

// Wait until the proxy consumed everything a host producer enqueued, then until every QP stream is idle; both
// within timeout_s (a stream is polled, never synchronised: work stuck on it, such as a copy behind a spinning kernel
// on a hardware queue it shares, would hold a cudaStreamSynchronize forever).
MT_API int mt_proxy_quiesce(void* h, double timeout_s) {
  Engine* e = static_cast<Engine*>(h);
  uint64_t deadline = mono_ns() + mt::timeout_ns(timeout_s);
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
  for (size_t q = 0; q < e->streams.size(); ++q) {
    for (;;) {
      const cudaError_t qe = cudaStreamQuery(e->streams[q]);
      if (qe == cudaSuccess) break;
      if (qe != cudaErrorNotReady) MT_CUDA(qe);
      MT_REQUIRE(mono_ns() < deadline, 213, "proxy QP stream %d did not complete its transfers within %.1f s", (int)q,
                 timeout_s);
      cpu_relax();
    }
  }
  MT_REQUIRE(e->err.load() == 0, 211, "proxy thread failed: %s", e->errmsg.c_str());
  return 0;
}

// Microbenchmark: `iters` times, enqueue the batch from the host and wait until every transfer and
// signal has completed. out_us[i] = wall time of iteration i. `value_step`: added to every request's
// value each iteration (epoch-valued signals). `reqs` at any address, as mt_proxy_enqueue's.
MT_API int mt_proxy_bench(void* h, const void* reqs, int n, int iters, uint64_t value_base,
                          uint64_t value_step, double timeout_s, double* out_us) {
  Engine* e = static_cast<Engine*>(h);
  std::vector<MtRequest> batch(n > 0 ? (size_t)n : 0);
  if (n > 0) memcpy((void*)batch.data(), reqs, (size_t)n * sizeof(MtRequest));
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

// A GPU producer's kernel call numbered `seq` is about to be launched; it writes `seq` (or more) into `*done_word`
// when it finished. A sleeping proxy thread comes back now and does not sleep again until then (Engine::expect).
// done_word null: the wake only (a captured launch), the marker of a call in flight is kept.
extern "C" int mt_proxy_expect_internal(void* h, const uint64_t* done_word, uint64_t seq) {
  static_cast<Engine*>(h)->expect(done_word, seq);
  return 0;
}

// The launch announced as (done_word, seq) failed: the thread polls for the call before it again (Engine::retract).
extern "C" int mt_proxy_retract_internal(void* h, const uint64_t* done_word, uint64_t seq) {
  static_cast<Engine*>(h)->retract(done_word, seq);
  return 0;
}

// `done_word` (given to mt_proxy_expect_internal) is about to be freed: the thread stops reading it.
extern "C" int mt_proxy_forget_internal(void* h, const uint64_t* done_word) {
  static_cast<Engine*>(h)->forget(done_word);
  return 0;
}

MT_API int mt_proxy_destroy(void* h) {
  Engine* e = static_cast<Engine*>(h);
  if (e == nullptr) return 0;
  e->stop.store(true);
  e->wake();  // a sleeping thread returns now, not after its sleep
  if (e->th.joinable()) e->th.join();
  const int stuck = e->release();
  const double timeout_s = (double)e->timeout_ns.load() / 1e9;
  delete e;
  MT_REQUIRE(stuck < 0, 213, "proxy QP stream %d did not complete its transfers within %.1f s of destroy: the "
             "engine's FIFO, control page and device words are leaked rather than freed under it", stuck, timeout_s);
  return 0;
}
