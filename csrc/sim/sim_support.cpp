// Host-simulation support for tests: streams and counters (see mt_cuda_sim.h).
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../mt_common.h"

namespace mtsim {
unsigned long long memcpys = 0, writes = 0, syncs = 0;
int async_mode = 0, copy_delay_us = 0;
unsigned long long getcpu_calls = 0, yields = 0, registrations = 0;
unsigned long long idle_sleeps = 0, idle_nap_min_ns = 0, idle_nap_max_ns = 0;
long long registered = 0;
const char* sysfs_cpu_dir = nullptr;
int mbind_errno = 0, register_error = 0, malloc_error = 0;
long long page_maps = 0, pages_mapped = 0, page_bytes_mapped = 0;
int madvise_errno = 0, devptr_error = 0;
int copy_fault_err = 0;
int thread_errno = 0;
int device_busy = 0;
unsigned long long device_frees = 0;
void (*fence_hook)() = nullptr;
unsigned long long capturing_stream = 0;
uintptr_t copy_fault_lo = 0, copy_fault_hi = 0;
static std::string sysfs_cpu_dir_text;

// Registered host ranges [base, base + n): a registration is counted (so a test sees it undone), and the device
// alias of an address inside one can be refused (devptr_error). Unregistering an address that is no range's base
// changes nothing, as the driver refuses it.
static std::mutex reg_mu;
static std::map<uintptr_t, size_t> reg_ranges;
void host_register(void* p, size_t n) {
  std::lock_guard<std::mutex> g(reg_mu);
  reg_ranges[(uintptr_t)p] = n;
  __atomic_add_fetch(&registrations, 1, __ATOMIC_RELAXED);
  __atomic_store_n(&registered, (long long)reg_ranges.size(), __ATOMIC_RELAXED);
}
void host_unregister(void* p) {
  std::lock_guard<std::mutex> g(reg_mu);
  reg_ranges.erase((uintptr_t)p);
  __atomic_store_n(&registered, (long long)reg_ranges.size(), __ATOMIC_RELAXED);
}
bool host_registered(const void* p) {
  std::lock_guard<std::mutex> g(reg_mu);
  auto it = reg_ranges.upper_bound((uintptr_t)p);
  if (it == reg_ranges.begin()) return false;
  --it;
  return (uintptr_t)p < it->first + it->second;
}

// A stream: operations run in order on the stream's own thread (async mode) or at once.
struct Stream {
  std::mutex mu;
  std::condition_variable cv, idle;
  std::deque<std::function<void()>> q;
  size_t busy = 0;
  bool stop = false;
  std::thread th;
  Stream() {
    th = std::thread([this] {
      std::unique_lock<std::mutex> g(mu);
      for (;;) {
        cv.wait(g, [this] { return stop || !q.empty(); });
        if (q.empty()) return;
        auto f = std::move(q.front());
        q.pop_front();
        g.unlock();
        f();
        g.lock();
        --busy;
        if (busy == 0) idle.notify_all();
      }
    });
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> g(mu);
      stop = true;
    }
    cv.notify_all();
    th.join();
  }
  void push(std::function<void()> f) {
    std::lock_guard<std::mutex> g(mu);
    ++busy;
    q.push_back(std::move(f));
    cv.notify_one();
  }
  void sync() {
    std::unique_lock<std::mutex> g(mu);
    idle.wait(g, [this] { return busy == 0; });
  }
  bool is_idle() {
    std::lock_guard<std::mutex> g(mu);
    return busy == 0;
  }
};

// Hardware-queue aliasing model: with alias_n > 0 every new stream is one of alias_n shared queues
// (round robin), as CUDA maps streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware work queues.
static std::mutex pool_mu;
static std::vector<Stream*> pool;
static size_t pool_next = 0;

void* stream_new() {
  std::lock_guard<std::mutex> g(pool_mu);
  if (!pool.empty()) return pool[pool_next++ % pool.size()];
  return new Stream();
}
void stream_delete(void* s) {
  std::lock_guard<std::mutex> g(pool_mu);
  for (Stream* q : pool)
    if (q == s) return;  // shared queue: lives until mtsim_set_alias(0)
  delete static_cast<Stream*>(s);
}
// The operations issued on streams, in issue order (mtsim_set_log): {stream, destination address, kind: 1 copy,
// 2 word write}. Tests read which stream each transfer and signal went on.
static std::mutex log_mu;
static bool log_on = false;
static std::vector<uint64_t> op_log;
static void log_op(void* s, const void* dst, uint64_t kind) {
  std::lock_guard<std::mutex> g(log_mu);
  if (!log_on) return;
  op_log.insert(op_log.end(), {(uint64_t)(uintptr_t)s, (uint64_t)(uintptr_t)dst, kind});
}

void stream_copy(void* s, void* d, const void* src, size_t n) {
  log_op(s, d, 1);
  if (!async_mode || s == nullptr) {
    memcpy(d, src, n);
    return;
  }
  const int delay = copy_delay_us;
  static_cast<Stream*>(s)->push([d, src, n, delay] {
    if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    memcpy(d, src, n);
    __atomic_thread_fence(__ATOMIC_RELEASE);
  });
}
void stream_write64(void* s, uint64_t* addr, uint64_t v) {
  log_op(s, addr, 2);
  if (!async_mode || s == nullptr) {
    __atomic_store_n(addr, v, __ATOMIC_RELEASE);
    return;
  }
  static_cast<Stream*>(s)->push([addr, v] { __atomic_store_n(addr, v, __ATOMIC_RELEASE); });
}
void stream_sync(void* s) {
  if (s != nullptr) static_cast<Stream*>(s)->sync();
}
bool stream_idle(void* s) { return s == nullptr || static_cast<Stream*>(s)->is_idle(); }
}  // namespace mtsim

// Test hook: asynchronous streams (1) with every copy delayed by delay_us, or synchronous ones (0).
// Set before creating engines.
MT_API int mtsim_get_device() { return sim_current_device(); }
MT_API void mtsim_set_device(int d) { sim_current_device() = d; }

MT_API void mtsim_set_async(int on, int delay_us) {
  mtsim::async_mode = on;
  mtsim::copy_delay_us = delay_us;
}
// mt::set_error and mt_last_error: ../mt_error.cpp (compiled with this file).
MT_API void mtsim_counters(unsigned long long* out) {
  out[0] = mtsim::memcpys;
  out[1] = mtsim::writes;
  out[2] = mtsim::syncs;
}

// Test hooks for the aliasing model (tests/test_onesided_cpu.py).
MT_API void mtsim_set_alias(int n) {
  std::lock_guard<std::mutex> g(mtsim::pool_mu);
  for (auto* q : mtsim::pool) delete q;
  mtsim::pool.clear();
  mtsim::pool_next = 0;
  for (int i = 0; i < n; ++i) mtsim::pool.push_back(new mtsim::Stream());
}
MT_API void* mtsim_stream_create() { return mtsim::stream_new(); }
MT_API void mtsim_stream_destroy(void* s) { mtsim::stream_delete(s); }
MT_API void mtsim_stream_sync(void* s) { mtsim::stream_sync(s); }
// Enqueue "wait until *word >= value" (bounded): work queued behind a kernel on the kernel's stream.
MT_API void mtsim_stream_wait_word(void* s, uint64_t* word, uint64_t value, double timeout_s) {
  static_cast<mtsim::Stream*>(s)->push([word, value, timeout_s] {
    auto t0 = std::chrono::steady_clock::now();
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < value &&
           std::chrono::steady_clock::now() - t0 < std::chrono::duration<double>(timeout_s))
      std::this_thread::yield();
  });
}

// Test hooks for the proxy's host pages (tests/test_proxy_numa.py): the sysfs CPU directory the engine reads the
// CPUs' NUMA nodes from (NULL: the machine's), and failures to inject: mbind's errno, cudaHostRegister's and
// cudaMalloc's error codes (0: none). Set before creating engines.
MT_API void mtsim_set_host_pages(const char* sysfs_cpu_dir, int mbind_errno, int register_error, int malloc_error) {
  if (sysfs_cpu_dir != nullptr) mtsim::sysfs_cpu_dir_text = sysfs_cpu_dir;
  mtsim::sysfs_cpu_dir = sysfs_cpu_dir != nullptr ? mtsim::sysfs_cpu_dir_text.c_str() : nullptr;
  mtsim::mbind_errno = mbind_errno;
  mtsim::register_error = register_error;
  mtsim::malloc_error = malloc_error;
}
// More failures to inject into the placement of the FIFO pages (0: none): madvise(MADV_DONTFORK)'s errno and
// cudaHostGetDevicePointer's error for an address in a registered range. Set before creating engines.
MT_API void mtsim_set_page_faults(int madvise_errno, int devptr_error) {
  mtsim::madvise_errno = madvise_errno;
  mtsim::devptr_error = devptr_error;
}
// Record every stream operation from now on (on != 0; the record is emptied) or stop recording (0).
MT_API void mtsim_set_log(int on) {
  std::lock_guard<std::mutex> g(mtsim::log_mu);
  mtsim::log_on = on != 0;
  if (on) mtsim::op_log.clear();
}
// The record: up to n operations into out as {stream, destination, kind} triples; returns how many are recorded.
MT_API long long mtsim_log(uint64_t* out, long long n) {
  std::lock_guard<std::mutex> g(mtsim::log_mu);
  const long long have = (long long)mtsim::op_log.size() / 3;
  for (long long i = 0; i < n && i < have; ++i)
    for (int k = 0; k < 3; ++k) out[3 * i + k] = mtsim::op_log[3 * i + k];
  return have;
}
// A failing copy engine: every cudaMemcpyAsync (and cudaMemcpyBatchAsync) reading from [lo, hi) fails with `err`
// and copies nothing (err 0: none). Set while no engine issues copies.
MT_API void mtsim_set_copy_fault(int err, uint64_t lo, uint64_t hi) {
  mtsim::copy_fault_lo = (uintptr_t)lo;
  mtsim::copy_fault_hi = (uintptr_t)hi;
  mtsim::copy_fault_err = err;
}
// A system that refuses threads: mt_proxy_create's std::thread throws std::system_error(err) (0: none). Set while no
// engine is being created.
MT_API void mtsim_set_thread_errno(int err) { mtsim::thread_errno = err; }
// A device whose work does not end (1: every cudaDeviceSynchronize waits until it is 0 again, as behind a stuck
// persistent kernel). The creations' bounds on their set-up waits are their callers' timeouts (a test passes a short
// one), not set here.
MT_API void mtsim_set_device_busy(int on) { __atomic_store_n(&mtsim::device_busy, on, __ATOMIC_RELEASE); }
// A stream being captured into a CUDA graph (its handle; 0: none): the proxy kernels' launches on it are captured,
// never run (the simulation has no replay).
MT_API void mtsim_set_capturing(uint64_t stream) { __atomic_store_n(&mtsim::capturing_stream, stream, __ATOMIC_RELEASE); }
// cudaFree and cudaFreeHost calls so far
MT_API unsigned long long mtsim_device_frees() { return __atomic_load_n(&mtsim::device_frees, __ATOMIC_RELAXED); }
// [the FIFO pages' mappings now, their bytes mapped now, their mmaps so far] (Engine::place_pages and release)
MT_API void mtsim_page_counters(long long* out) {
  out[0] = __atomic_load_n(&mtsim::pages_mapped, __ATOMIC_RELAXED);
  out[1] = __atomic_load_n(&mtsim::page_bytes_mapped, __ATOMIC_RELAXED);
  out[2] = __atomic_load_n(&mtsim::page_maps, __ATOMIC_RELAXED);
}
// [the proxy threads' idle yields, their sched_getcpu calls, their idle sleeps]
MT_API void mtsim_idle_counters(long long* out) {
  out[0] = (long long)__atomic_load_n(&mtsim::yields, __ATOMIC_RELAXED);
  out[1] = (long long)__atomic_load_n(&mtsim::getcpu_calls, __ATOMIC_RELAXED);
  out[2] = (long long)__atomic_load_n(&mtsim::idle_sleeps, __ATOMIC_RELAXED);
}
// The idle sleeps' first and longest length from now on (0, 0: the engine's own). A test sets both long, so that
// only a wake can end a sleep in time.
MT_API void mtsim_set_idle_naps(unsigned long long min_ns, unsigned long long max_ns) {
  __atomic_store_n(&mtsim::idle_nap_min_ns, min_ns, __ATOMIC_RELAXED);
  __atomic_store_n(&mtsim::idle_nap_max_ns, max_ns, __ATOMIC_RELAXED);
}
// [host ranges registered now, registrations so far, the proxy threads' sched_getcpu calls, their idle yields]
MT_API void mtsim_proxy_counters(long long* out) {
  out[0] = __atomic_load_n(&mtsim::registered, __ATOMIC_RELAXED);
  out[1] = (long long)__atomic_load_n(&mtsim::registrations, __ATOMIC_RELAXED);
  out[2] = (long long)__atomic_load_n(&mtsim::getcpu_calls, __ATOMIC_RELAXED);
  out[3] = (long long)__atomic_load_n(&mtsim::yields, __ATOMIC_RELAXED);
}
// Test hook (tests/test_error_record.py): `threads` threads report a different error each (mt::report) into the same
// `records` error records, one record after the other, `rounds` times (records, abort flags and claims zeroed before
// each round). Every fence yields the CPU, so a reporter stops between its record's fields and its code word as a
// warp may, and the others run there (without it the gap is a few stores wide and a race is rare on a CPU). Returns
// the records that end up other than one reporter's whole error (-1: threads outside 2..64 or records outside
// 1..4096). Not while a simulated exchange runs (its fences would yield too).
MT_API long long mtsim_race_reports(int threads, int records, long long rounds) {
  if (threads < 2 || threads > 64 || records < 1 || records > 4096) return -1;
  mtsim::fence_hook = [] { std::this_thread::yield(); };
  std::vector<int> err((size_t)records * MT_ERR_WORDS), flags((size_t)records * 2);  // per record: abort flag, claim
  std::atomic<long long> go{0};
  std::atomic<int> done{0};
  std::vector<std::thread> th;
  for (int i = 0; i < threads; ++i)
    th.emplace_back([&, i] {
      for (long long r = 1; r <= rounds; ++r) {
        // spin, so that the reporters start together (a yield now and then: more threads than cores)
        for (uint32_t spins = 1; go.load(std::memory_order_acquire) < r; ++spins)
          if ((spins & 1023u) == 0) std::this_thread::yield();
        for (int k = 0; k < records; ++k) {
          mt::WaitCtx w;
          w.err = &err[(size_t)k * MT_ERR_WORDS];
          w.abort_flag = &flags[2 * (size_t)k];
          w.claim = &flags[2 * (size_t)k + 1];
          w.timeout_ns = 0;
          w.rank = 7;
          mt::report(w, i + 1, 100 + i, 200 + i, 300 + i, ((uint64_t)(400 + i) << 32) | (500u + i), 600 + i);
        }
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  long long bad = 0;
  for (long long r = 1; r <= rounds; ++r) {
    std::fill(err.begin(), err.end(), 0);
    std::fill(flags.begin(), flags.end(), 0);
    done.store(0, std::memory_order_relaxed);
    go.store(r, std::memory_order_release);
    while (done.load(std::memory_order_acquire) < threads) std::this_thread::yield();
    for (int k = 0; k < records; ++k) {
      const int* e = &err[(size_t)k * MT_ERR_WORDS];
      const int i = e[0] - 1;
      bad += !(i >= 0 && i < threads && e[1] == 7 && e[2] == 100 + i && e[3] == 200 + i && e[4] == 300 + i &&
               e[5] == 500 + i && e[6] == 400 + i && e[7] == 600 + i);
    }
  }
  for (auto& t : th) t.join();
  mtsim::fence_hook = nullptr;
  return bad;
}
