// moetune csrc: shared helpers for the one-sided transports (plain C ABI, loaded with ctypes).
//
// Every exported function returns 0 on success or a nonzero code; the message of the last error on
// the calling thread is available through mt_last_error(). Nothing here aborts the process.
#pragma once

#ifdef MT_HOST_SIM
#include "sim/mt_cuda_sim.h"
#else
#include <cuda.h>
#include <cuda_runtime.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>

#define MT_API extern "C" __attribute__((visibility("default")))

// Limits shared with the Python side (runtime/transports/_onesided.py keeps the same numbers).
#define MT_MAX_WORLD 8
#define MT_MAX_SLOTS 1024  // signal slots per source rank

// Control (symmetric) buffer layout, in bytes from its base. Same on every rank.
//   SIG   : uint64 sig[MT_MAX_WORLD][MT_MAX_SLOTS]   data signals, epoch-valued, monotonic
//   CNT   : uint64 cnt[2][MT_MAX_WORLD]              exchange_counts words (tag<<40 | count), by parity
//   MAT   : uint64 mat[2][MT_MAX_WORLD][MT_MAX_WORLD] count matrix rows inside exchange, by parity
#define MT_OFF_SIG 0ull
#define MT_OFF_CNT (MT_OFF_SIG + 8ull * MT_MAX_WORLD * MT_MAX_SLOTS)
#define MT_OFF_MAT (MT_OFF_CNT + 8ull * 2 * MT_MAX_WORLD)
#define MT_CTRL_BYTES (MT_OFF_MAT + 8ull * 2 * MT_MAX_WORLD * MT_MAX_WORLD)

// Error record in host-mapped pinned memory (int32 words), written by kernels, read by Python.
enum MtErr {
  MT_OK = 0,
  MT_ERR_TIMEOUT_COUNTS = 1,   // waited too long for a peer's count word
  MT_ERR_TIMEOUT_SIGNAL = 2,   // waited too long for a data signal
  MT_ERR_CAPACITY = 3,         // rows would overflow the receiver's buffer
  MT_ERR_COUNT_MISMATCH = 4,   // recv_counts given by the caller differ from what the senders sent
  MT_ERR_FIFO_FULL = 5,        // proxy FIFO stayed full (proxy thread dead or stalled)
  MT_ERR_TIMEOUT_OUTGOING = 6, // my own outgoing transfers did not complete
  MT_ERR_TOO_MANY_SLOTS = 7,   // more signal slots than MT_MAX_SLOTS
  MT_ERR_SEND_COUNTS = 8,      // a send count is negative or the counts sum past the send rows (nothing was sent;
                               // peer = the first bad destination, slot 0: negative (seen = the count), slot 1: past
                               // the rows (seen = the rows through it), expected = the send rows; slot 2 (nvlink
                               // gather): a row's token is outside x (seen = the token, expected = x's rows); slot 3
                               // (exchange_counts): a count outside 0..MT_COUNT_MASK, sent marked as refused)).
                               // The call still publishes its count-matrix row, marked MT_COUNT_REFUSED.
  MT_ERR_PEER_REFUSED = 9,     // peer = a rank whose call refused its send counts (MT_ERR_SEND_COUNTS there): its
                               // marked row arrived, so no rows went to or came from it in this call (slot -1)
};
// err[0]=code err[1]=rank err[2]=peer err[3]=slot err[4]=epoch(lo) err[5]=seen value(lo)
// err[6]=seen value(hi) err[7]=expected(lo)
#define MT_ERR_WORDS 16

// Tagged 64-bit words carry a count and the call's tag in one atomic store (data + signal in one).
// Bit 39 of a count-matrix word is the refusal marker: the sender refused its own send counts in this call
// (MT_ERR_SEND_COUNTS) and sends nothing. It travels in the same store as the tag, so a peer waiting for the word
// learns of the refusal when the word arrives (at once, not at its timeout); counts are 39 bits (mt::tagged masks
// them, so no count can set the marker).
#define MT_TAG_SHIFT 40
#define MT_COUNT_REFUSED (1ull << (MT_TAG_SHIFT - 1))
#define MT_COUNT_MASK (MT_COUNT_REFUSED - 1)

namespace mt {

void set_error(const char* fmt, ...);

}  // namespace mt

#define MT_CUDA(call)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      mt::set_error("%s:%d %s -> %s (%s)", __FILE__, __LINE__, #call, cudaGetErrorName(e_),    \
                    cudaGetErrorString(e_));                                                   \
      return (int)e_;                                                                          \
    }                                                                                          \
  } while (0)

namespace mt {

// The longest wait any timeout gives (a week): a bound on timeout_ns so that converting, and deadlines and multiples
// derived from it (proxy_gpu.cu's host wait: 4 * timeout + 10 s), stay far inside uint64.
constexpr uint64_t kMaxTimeoutNs = 7ull * 24 * 3600 * 1000000000ull;

// A timeout in seconds as nanoseconds, saturating: at most kMaxTimeoutNs (also for +inf), 0 for <= 0 and NaN.
// (uint64_t)(s * 1e9) is undefined past ~1.8e10 s (gcc gives 0 there: every wait failed at once) and for negatives.
// The Python side bounds the options itself; this is the library's own guard.
inline uint64_t timeout_ns(double s) {
  if (!(s > 0.0)) return 0;
  if (s >= (double)kMaxTimeoutNs / 1e9) return kMaxTimeoutNs;
  return (uint64_t)(s * 1e9);
}

// CLOCK_MONOTONIC in ns (host).
inline uint64_t host_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// Polls `query` (a cudaStreamQuery / cudaEventQuery of a context's own stream or event) until it returns anything
// but cudaErrorNotReady or host_ns() passes deadline_ns; returns its last result (cudaErrorNotReady: still busy).
// A destroy's first wait, on what it can name (a stuck lane in its error); device_sync_within below covers the rest.
template <class Query>
inline cudaError_t poll_ready(Query query, uint64_t deadline_ns) {
  for (;;) {
    const cudaError_t e = query();
    if (e != cudaErrorNotReady || host_ns() >= deadline_ns) return e;
    std::this_thread::yield();
  }
}

// cudaDeviceSynchronize with a bound: it runs on a thread of its own and the caller polls until it returns or
// host_ns() passes deadline_ns (cudaErrorNotReady; the thread is left to finish on its own). What a destroy or
// clear_error needs: every launch of the context done, graph replays included, which no stream or event of the
// context's own can tell, and never a wait without end. Another library's work delays it, within the bound.
inline cudaError_t device_sync_within(int device, uint64_t deadline_ns) {
  struct State {
    std::atomic<int> done{0};
    cudaError_t err = cudaSuccess;
  };
  auto st = std::make_shared<State>();
  try {
    std::thread([st, device] {
#ifndef MT_HOST_SIM
      // relaxed: a CUDA graph another thread is capturing (global mode, torch's default) is not failed by this wait
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      (void)cudaThreadExchangeStreamCaptureMode(&mode);
#endif
      cudaError_t e = cudaSetDevice(device);
      if (e == cudaSuccess) e = cudaDeviceSynchronize();
      st->err = e;
      st->done.store(1, std::memory_order_release);
    }).detach();
  } catch (...) {
    return cudaErrorNotReady;  // no thread: nothing waited for, so nothing may be freed
  }
  while (!st->done.load(std::memory_order_acquire)) {
    if (host_ns() >= deadline_ns) return cudaErrorNotReady;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return st->err;
}

// How long a wait that was given no timeout of its own lasts: RuntimeOptions.onesided_timeout_s's default. What a
// timeout_s <= 0 of mt_nvl_create / mt_pxy_create takes (setup_timeout_ns). mt_proxy_create, mt_ipc_malloc and
// mt_device_malloc take the caller's bound instead and refuse one that is not a finite number > 0 (timeout_s_ok).
constexpr uint64_t kDefaultTimeoutNs = 20ull * 1000000000ull;

// Whether `s` is a bound those creations accept: finite and > 0. Not mapped to kDefaultTimeoutNs: the Python side
// passes RuntimeOptions.onesided_timeout_s, validated to (0, 86400], so anything else is a caller's bug, and a
// silent 20 s is what made the user's bound go unheeded before (ABI 23). NaN fails `s > 0`; +inf would saturate to
// a week, which nobody configures.
inline bool timeout_s_ok(double s) { return s > 0.0 && std::isfinite(s); }

// The bound of a creation's wait for its set-up work: timeout_ns, the same its destroy waits (the context's timeout);
// 0 (from a timeout_s <= 0) takes kDefaultTimeoutNs, so that such a creation succeeds as it did before.
inline uint64_t setup_timeout_ns(uint64_t timeout_ns) { return timeout_ns > 0 ? timeout_ns : kDefaultTimeoutNs; }

// A creation's wait for the set-up work it queued (the cudaMemset of its device words; the proxy engine's warm-up
// copies): device_sync_within from now, within setup_timeout_ns(timeout_ns). Never a wait without end: a kernel that
// does not end (a stuck persistent kernel, a peer that never signals) would hold a bare cudaDeviceSynchronize, and
// the caller, forever. cudaErrorNotReady past the bound: the memsets may still be queued behind that kernel, so the
// caller leaks what they write rather than free it (cudaFree / cudaFreeHost may also wait for the device to be idle)
// and returns its own code with the leak named in mt_last_error.
inline cudaError_t setup_sync_within(int device, uint64_t timeout_ns) {
  return device_sync_within(device, host_ns() + setup_timeout_ns(timeout_ns));
}

// Whether `device`'s primary context exists (a cudaSetDevice to it would not create one): cuDevicePrimaryCtxGetState
// through the runtime's driver entry point (the library does not link libcuda). Unknown (no such entry point): false.
inline bool primary_context_active(int device) {
#ifdef MT_HOST_SIM
  (void)device;
  return true;  // no contexts in the simulation
#else
  typedef CUresult (*Pfn)(CUdevice, unsigned int*, int*);
  static const Pfn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &f, 12000, cudaEnableDefault, &q) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return q == cudaDriverEntryPointSuccess ? (Pfn)f : nullptr;
  }();
  unsigned int flags = 0;
  int active = 0;
  return fn != nullptr && fn((CUdevice)device, &flags, &active) == CUDA_SUCCESS && active != 0;
#endif
}

// The C API's entry points run on the caller's thread (a Python thread, a GC finalizer on any thread): set() makes
// `device` current for the scope and the destructor gives the caller its own current device back, so building or
// collecting a transport on cuda:1 does not leave a thread that had selected cuda:0 on cuda:1. As torch's device
// guards, the device is restored only where its primary context exists (restoring to a device the thread never
// used would create a context on it). Nothing happens when `device` is already current.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t set(int device) {
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess) {
      (void)cudaGetLastError();
      cur = -1;
    }
    if (cur == device) return cudaSuccess;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess && !switched_) {
      switched_ = true;
      prev_ = cur;
    }
    return e;
  }
  ~DeviceGuard() {
    if (switched_ && prev_ >= 0 && primary_context_active(prev_) && cudaSetDevice(prev_) != cudaSuccess)
      (void)cudaGetLastError();  // keep a failed restore out of the caller's next launch check
  }

 private:
  bool switched_ = false;  // set() changed the device
  int prev_ = -1;          // the caller's device before it (-1: unknown, nothing to restore)
};

}  // namespace mt

// Makes `dev` current until the end of the enclosing scope (mt::DeviceGuard); returns the error where it cannot.
#define MT_SET_DEVICE(dev)           \
  mt::DeviceGuard mt_device_guard_; \
  MT_CUDA(mt_device_guard_.set(dev))

#define MT_REQUIRE(cond, code, ...)  \
  do {                               \
    if (!(cond)) {                   \
      mt::set_error(__VA_ARGS__);    \
      return (code);                 \
    }                                \
  } while (0)

namespace mt {
// The host's rule for forgetting a refused call (mt_pxy_clear_error, mt_nvl_clear_error), after every launch so far
// completed. The record `e` may hold nothing, or a refusal (MT_ERR_SEND_COUNTS / MT_ERR_PEER_REFUSED) with the abort
// flag clear: a refusal never raises it and every other error does (its waits ended early, the ranks may be out of
// step). The refusal must be of the last call launched, `last_kind` (0 an exchange, 1 exchange_counts: its refusals
// are slot 3 / -2) at `last_epoch`: the record keeps the first error only, so a refusal in a call launched after it went
// unrecorded, and ranks that noticed the refusal at different calls may have launched different operations since.
// False, with the reason in mt_last_error, where the record may not be cleared (build a new transport).
inline bool refusal_clearable(const volatile int* e, bool aborted, int last_kind, uint64_t last_epoch) {
  const int code = e[0];
  if (aborted || (code != 0 && code != MT_ERR_SEND_COUNTS && code != MT_ERR_PEER_REFUSED)) {
    set_error("the error record holds code %d%s: only a refused call (codes %d, %d) can be cleared; build a new "
              "transport", code, aborted ? " and a wait of that call failed (abort flag set)" : "", MT_ERR_SEND_COUNTS,
              MT_ERR_PEER_REFUSED);
    return false;
  }
  if (code == 0) return true;
  const int kind = (code == MT_ERR_SEND_COUNTS ? e[3] == 3 : e[3] == -2) ? 1 : 0;
  const unsigned long long rec = (uint32_t)e[4], last = last_epoch & 0x7fffffffull;
  if (kind == last_kind && rec == last) return true;
  set_error("the refused call (%s, epoch %llu) is not this rank's last (%s, epoch %llu, was launched after it, before "
            "the refusal was seen): a refusal there is not recorded and the ranks may be out of step; build a new "
            "transport (synchronise and check the error after each call to clear it)",
            kind ? "exchange_counts" : "exchange", rec, last_kind ? "exchange_counts" : "an exchange", last);
  return false;
}
}  // namespace mt

// Primitives of the spin-waits and signalled words: device versions (nvcc) or host stand-ins
// (MT_HOST_SIM: the proxy transport's GPU-side logic runs on CPU threads in tests/test_onesided_cpu.py).
#if defined(__CUDACC__)
#define MT_DEV __device__ __forceinline__
namespace mt {

MT_DEV uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MT_DEV uint64_t ld_volatile(const uint64_t* p) { return *reinterpret_cast<const volatile uint64_t*>(p); }
MT_DEV void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MT_DEV void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MT_DEV uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
MT_DEV void fence_system() { __threadfence_system(); }
MT_DEV unsigned long long atomic_add_u64(unsigned long long* p, unsigned long long v) { return atomicAdd(p, v); }
// True for the one caller that turns *p from 0 to 1 (device memory: atomics on host-mapped memory over PCIe are not
// guaranteed atomic).
MT_DEV bool claim_once(int* p) { return atomicCAS(p, 0, 1) == 0; }
MT_DEV void spin_pause() {}

}  // namespace mt
#elif defined(MT_HOST_SIM)
#include <sched.h>
#include <time.h>
#define MT_DEV inline
namespace mt {

MT_DEV uint64_t ld_acquire_sys(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
MT_DEV uint64_t ld_volatile(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
MT_DEV void st_release_sys(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
MT_DEV void st_relaxed_sys(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
MT_DEV uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
MT_DEV void fence_system() {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (mtsim::fence_hook != nullptr) mtsim::fence_hook();
}
MT_DEV unsigned long long atomic_add_u64(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
MT_DEV bool claim_once(int* p) {
  int zero = 0;
  return __atomic_compare_exchange_n(p, &zero, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
MT_DEV void spin_pause() { sched_yield(); }  // the CI box has 2 cores: let the proxy thread run

}  // namespace mt
#endif

#if defined(__CUDACC__) || defined(MT_HOST_SIM)
namespace mt {

// Shared state of a spinning wait: a device-side abort flag lets every later wait give up at once
// after the first timeout, so a bug costs one timeout, never a hang.
struct WaitCtx {
  int* err;           // host-mapped error record
  int* abort_flag;    // device memory
  int* claim;         // device memory: the error record's claim word (write_record); the host zeroes it with the record
  uint64_t timeout_ns;
  int rank;
};

// The error record (first error wins), without the abort flag: report_refusal's part of report. Only the reporter
// that claims the record writes it: testing e[0] == 0 instead let two reporters failing at once both pass and mix
// one error's code with the other's peer, slot and epoch.
MT_DEV void write_record(const WaitCtx& w, int code, int peer, int slot, uint64_t epoch, uint64_t seen,
                         uint64_t expected) {
  if (!claim_once(w.claim)) return;
  volatile int* e = w.err;
  e[1] = w.rank;
  e[2] = peer;
  e[3] = slot;
  e[4] = (int)(epoch & 0x7fffffff);
  e[5] = (int)(seen & 0xffffffffu);
  e[6] = (int)(seen >> 32);
  e[7] = (int)(expected & 0xffffffffu);
  fence_system();
  e[0] = code;
}

MT_DEV void report(const WaitCtx& w, int code, int peer, int slot, uint64_t epoch, uint64_t seen, uint64_t expected) {
  write_record(w, code, peer, slot, epoch, seen, expected);
  *(volatile int*)w.abort_flag = 1;
  fence_system();
}

// A refusal (MT_ERR_SEND_COUNTS on the refusing rank, MT_ERR_PEER_REFUSED on its peers) is recorded WITHOUT the abort
// flag: the call's other waits must still see every rank's count-matrix word of this call. Those waits are what
// tells a rank that each peer has entered this call (so left the call two before, whose parity of the count matrix
// and of the receive area the next call reuses); a wait cut short by the flag would let the next call overwrite
// words a slow peer has not read yet. Every word does come (every rank publishes its row, refused or not), so
// these waits end promptly; the call still fails (the record), and only a refusal may be cleared
// (mt_nvl_clear_error, mt_pxy_clear_error: the abort flag says whether anything else went wrong).
MT_DEV void report_refusal(const WaitCtx& w, int code, int peer, int slot, uint64_t epoch, uint64_t seen,
                           uint64_t expected) {
  write_record(w, code, peer, slot, epoch, seen, expected);
  fence_system();
}

// How wait_word compares (callers may pass true/false for GE/TAG).
enum { MT_WAIT_TAG = 0, MT_WAIT_GE = 1, MT_WAIT_EQ = 2 };

// Spin until *p >= target (MT_WAIT_GE), (*p >> MT_TAG_SHIFT) == target (MT_WAIT_TAG) or *p == target
// (MT_WAIT_EQ). Returns the last value seen; on timeout reports `code` and returns with ok=false. heed_abort
// false: the abort flag does not end the wait, only the timeout does (a wait that must not return early even after
// another lane failed: the ACK of this rank's own transfers, which still read the caller's buffer until it comes).
MT_DEV uint64_t wait_word(const WaitCtx& w, const uint64_t* p, uint64_t target, int how, int code, int peer, int slot,
                          bool* ok, bool heed_abort = true) {
  uint64_t v = ld_acquire_sys(p);
  uint64_t t0 = 0;
  uint32_t spins = 0;
  while (how == MT_WAIT_GE ? (v < target) : how == MT_WAIT_EQ ? (v != target) : ((v >> MT_TAG_SHIFT) != target)) {
    if ((++spins & 1023u) == 0) {
      uint64_t t = now_ns();
      if (t0 == 0) t0 = t;
      if ((heed_abort && *(volatile int*)w.abort_flag != 0) || t - t0 > w.timeout_ns) {
        report(w, code, peer, slot, target, v, target);
        *ok = false;
        return v;
      }
      spin_pause();
    }
    v = ld_acquire_sys(p);
  }
  *ok = true;
  return v;
}

MT_DEV uint64_t tagged(uint64_t tag, uint64_t count) { return (tag << MT_TAG_SHIFT) | (count & MT_COUNT_MASK); }
// The count-matrix word of a rank that refused its send counts: this call's tag, the marker, no rows.
MT_DEV uint64_t tagged_refused(uint64_t tag) { return (tag << MT_TAG_SHIFT) | MT_COUNT_REFUSED; }
MT_DEV bool is_refused(uint64_t word) { return (word & MT_COUNT_REFUSED) != 0; }

// The count word of exchange_counts (both transports) for count `cnt` to `peer`: a negative count, or one past what
// a word carries (MT_COUNT_MASK), would arrive masked as a huge or wrapped count. Refused as the exchanges refuse
// (MT_ERR_SEND_COUNTS, slot 3, no abort flag) and sent marked (MT_COUNT_REFUSED, 0 rows): the peer's wait ends at
// once with MT_ERR_PEER_REFUSED (`counts_received`), and every word of the call is still published and awaited.
MT_DEV uint64_t count_word(const WaitCtx& w, uint64_t tag, long long cnt, int peer, uint64_t epoch) {
  if (cnt >= 0 && (uint64_t)cnt <= MT_COUNT_MASK) return tagged(tag, (uint64_t)cnt);
  report_refusal(w, MT_ERR_SEND_COUNTS, peer, 3, epoch, (uint64_t)cnt, MT_COUNT_MASK);
  return tagged_refused(tag);
}
// The rows exchange_counts received in word `v` from rank `src` (0 from a rank that refused its count: reported).
MT_DEV int64_t counts_received(const WaitCtx& w, uint64_t v, int src, uint64_t epoch) {
  if (is_refused(v)) report_refusal(w, MT_ERR_PEER_REFUSED, src, -2, epoch, 0, 0);
  return (int64_t)(v & MT_COUNT_MASK);
}

// The caller's send counts against the rows they address (both one-sided exchanges, before anything is sent): a
// negative count, or counts summing past `send_rows`, would make copies whose source lies outside the send buffer
// (the device memory next to it shipped to the peers). False when refused; `report`: record MT_ERR_SEND_COUNTS
// (peer = the first bad destination; slot 0: negative, 1: past the rows) -- one reporter per rank is enough.
// Counts are also bounded by MT_COUNT_MASK (they travel in 39 bits of a tagged word).
MT_DEV bool send_counts_fit(const WaitCtx& w, const int64_t* counts, int world, uint64_t send_rows, uint64_t epoch,
                            bool report) {
  const uint64_t rows = send_rows < MT_COUNT_MASK ? send_rows : MT_COUNT_MASK;
  // every count loaded before the first test: independent loads in flight together (one memory round trip on the
  // call's critical path, not one per destination behind the early exit)
  long long c[MT_MAX_WORLD];
  for (int d = 0; d < MT_MAX_WORLD; ++d) c[d] = d < world ? counts[d] : 0;
  uint64_t total = 0;
  for (int d = 0; d < world; ++d) {
    const long long cnt = c[d];
    if (cnt < 0 || (uint64_t)cnt > rows - total) {
      if (report)
        report_refusal(w, MT_ERR_SEND_COUNTS, d, cnt < 0 ? 0 : 1, epoch,
                       cnt < 0 ? (uint64_t)cnt : total + (uint64_t)cnt, send_rows);
      return false;
    }
    total += (uint64_t)cnt;
  }
  return true;
}

// The receiver's own capacity check (both one-sided exchanges). A sender checks only where ITS rows end in the
// receiver's area (after the lower ranks' rows) and skips what would not fit; several senders together can still
// overflow a receiver, whose call would then complete with rows missing. The receiver has its whole column of the
// count matrix `mat` (parity `par`, words tagged `tag`): it checks the total and reports MT_ERR_CAPACITY (peer -1,
// slot -1: all sources; seen = the rows sent to it, expected = `cap_rows`, the rows its area holds). A refusing
// source's word counts 0 rows (the mask drops its marker): it sends nothing.
MT_DEV void check_receive_capacity(const WaitCtx& w, const uint64_t* mat, int par, int rank, int world, uint64_t tag,
                                   uint64_t epoch, uint64_t cap_rows, bool* ok) {
  uint64_t total = 0;
  for (int s = 0; s < world && *ok; ++s)
    total += wait_word(w, mat + ((size_t)(par * MT_MAX_WORLD + s) * MT_MAX_WORLD + rank), tag, MT_WAIT_TAG,
                       MT_ERR_TIMEOUT_COUNTS, s, -1, ok) &
             MT_COUNT_MASK;
  if (*ok && total > cap_rows) report(w, MT_ERR_CAPACITY, -1, -1, epoch, total, cap_rows);  // no product to overflow
}

}  // namespace mt
#endif
