// The `host_staged` transport's data path: rows cross PCIe twice through pinned host memory that every
// rank of the node maps (a shared file, registered with cudaHostRegister), moved by the copy engines.
//
// One staging slot carries one piece from a sender to a receiver at a time. Its flag lives in the same
// shared memory and says whether the slot is full: the sender fills it, the receiver empties it, so the
// two sides take turns on every slot. Everything is ordered on the callers' CUDA streams, so no host
// thread waits:
//
//   sender stream  : wait flag == EMPTY -> cudaMemcpyAsync D2H -> cuStreamWriteValue64(flag, FULL)
//   receiver stream: wait flag == FULL  -> cudaMemcpyAsync H2D -> cuStreamWriteValue64(flag, EMPTY)
//
// Both sides go through a (lane, sender, receiver) ring of slots in the same order (every rank posts the
// same exchanges in the same order), and the values are constants: the same operations can be captured
// in a CUDA graph and replayed any number of times, mixed with eager calls.
// Each side also reads back the flag it wrote itself one use of the slot earlier, with the ring's other
// pieces (their waits and copies) in between. Run 31 (one sender wait per ring) went wrong in the packed
// layout at pipeline_depth 4 and was blamed on such a read; run 35 showed the same failure (same case, max
// diff ~4.6) with a wait per piece, caused by send rows freed before the lane stream had copied them (the
// Python side now holds them until wait()), so that blame was probably wrong, but it was never re-tested.
// cuStreamWriteValue64 without NO_MEMORY_BARRIER makes the stream's earlier work (the copy) visible
// before the flag.
//
// Waits (wait_mode): 1 (the default) is cuStreamWaitValue64, done by the GPU's front end without an SM and
// the quickest hand-off to the copy after it (run 34: 769-795 us against 858-893 for a round trip). It has
// no timeout of its own, so a watchdog thread gives it one. A lane is stuck when none of its flags has
// changed for the timeout while either a slot it filled is still full (its receiver is gone: the sender
// waits, or will) or its receive stream is inside an exchange (a busy word the stream sets when it enters
// and clears when it leaves; CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER was refused there with
// CUDA_ERROR_INVALID_VALUE in run 36, so these writes keep the barrier). The watchdog then records the
// error and releases the lane (writes the values its waits want, again and again), so a lost peer costs
// one timeout and an error from check(), never a hang; what moves after that is garbage, as with 0.
// 0 is a one-thread spin kernel per wait with its own bounded spin (mt::wait_word).
#include <string.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "mt_common.h"

#ifndef MT_HOST_SIM
#include <cuda.h>

namespace {

typedef CUresult (*PfnWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
typedef CUresult (*PfnWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

constexpr int HS_ERR_TIMEOUT_DRAIN = 8;  // waited too long for the receiver to drain a staging slot
constexpr uint64_t HS_EMPTY = 0, HS_FULL = 1;  // a slot's flag

struct HsCtx {
  int device = 0;
  int rank = 0;
  uint8_t* host_base = nullptr;  // the shared staging memory in this process
  uint8_t* dev_base = nullptr;   // its device alias
  uint64_t bytes = 0;
  int* err_host = nullptr;  // error record (host-mapped)
  int* err_dev = nullptr;
  int* abort_dev = nullptr;  // device memory, 2 words: set after the first timeout, later waits give up at once; the
                             // error record's claim (mt::WaitCtx)
  uint64_t timeout_ns = 0;
  PfnWriteValue64 write64 = nullptr;
  PfnWaitValue64 wait64 = nullptr;  // wait_mode 1: the driver's stream wait (no SM; the watchdog times it)
  int wait_mode = 0;
  // wait_mode 1: per lane a busy word (its receive stream is inside an exchange; host-mapped), the flags
  // each lane has used (with the side this rank takes on them and the peer), and the watchdog thread
  uint64_t* busy_host = nullptr;
  uint64_t* busy_dev = nullptr;
  std::mutex flags_mu;
  std::vector<std::vector<uint64_t>> lane_flags;  // per lane: flag offset | sender bit (1 << 63) | peer << 48
  std::thread watchdog;
  std::atomic<bool> stop{false};
  int lanes = 0;
  cudaStream_t* s_out = nullptr;  // per lane: device -> host copies
  cudaStream_t* s_in = nullptr;   // per lane: host -> device copies
  cudaEvent_t* ev = nullptr;      // per lane, HS_TICKETS tickets x {start, out done, in done}
  unsigned* next_ticket = nullptr;
  // host time spent in each kind of CUDA call (ns) and calls, for mt_hs_stats: 0 events/stream waits,
  // 1 local copy, 2 wait launches, 3 staging copies, 4 flag writes
  uint64_t stat_ns[5] = {0, 0, 0, 0, 0};
  uint64_t stat_calls[5] = {0, 0, 0, 0, 0};
};

struct Timed {  // adds the scope's host time to one stat
  HsCtx* c;
  int k;
  uint64_t t0;
  Timed(HsCtx* c_, int k_) : c(c_), k(k_), t0(mt::host_ns()) {}
  ~Timed() {
    c->stat_ns[k] += mt::host_ns() - t0;
    c->stat_calls[k] += 1;
  }
};

constexpr int HS_OP_WORDS = 5;  // one piece for mt_hs_post: data offset, device address, bytes, flag offset, peer
constexpr int HS_TICKETS = 64;  // exchanges of one lane that may be in flight before a ticket's events are reused

__global__ void hs_wait_kernel(const uint64_t* flag, uint64_t want, mt::WaitCtx w, int code, int peer, int slot) {
  bool ok;
  mt::wait_word(w, flag, want, mt::MT_WAIT_EQ, code, peer, slot, &ok);
}

// Make stream s wait until the flag at `off` equals `want`.
int wait_flag(HsCtx* c, uint64_t off, uint64_t want, int code, int peer, cudaStream_t s) {
  Timed tm(c, 2);
  if (c->wait_mode == 1) {
    CUresult r = c->wait64((CUstream)s, (CUdeviceptr)(c->dev_base + off), want, CU_STREAM_WAIT_VALUE_EQ);
    MT_REQUIRE(r == CUDA_SUCCESS, 303, "host_staged: cuStreamWaitValue64 failed (CUresult %d)", (int)r);
    return 0;
  }
  mt::WaitCtx w;
  w.err = c->err_dev;
  w.abort_flag = c->abort_dev;
  w.claim = c->abort_dev + 1;
  w.timeout_ns = c->timeout_ns;
  w.rank = c->rank;
  hs_wait_kernel<<<1, 1, 0, s>>>(reinterpret_cast<const uint64_t*>(c->dev_base + off), want, w, code, peer,
                                 (int)(off / 8));
  MT_CUDA(cudaGetLastError());
  return 0;
}

int write_word(HsCtx* c, uint64_t* dev_addr, uint64_t value, cudaStream_t s) {
  Timed tm(c, 4);
  CUresult r = c->write64((CUstream)s, (CUdeviceptr)dev_addr, value, 0);
  MT_REQUIRE(r == CUDA_SUCCESS, 300, "host_staged: cuStreamWriteValue64 failed (CUresult %d)", (int)r);
  return 0;
}

int write_flag(HsCtx* c, uint64_t off, uint64_t value, cudaStream_t s) {
  return write_word(c, (uint64_t*)(c->dev_base + off), value, s);
}

// Remember that `lane` waits on the flag at `off` (as sender or receiver of `peer`), for the watchdog.
void note_flag(HsCtx* c, int lane, uint64_t off, bool sender, int peer) {
  uint64_t key = off | (sender ? (1ull << 63) : 0) | ((uint64_t)(peer & 0x7fff) << 48);
  std::lock_guard<std::mutex> g(c->flags_mu);
  std::vector<uint64_t>& v = c->lane_flags[lane];
  if (std::find(v.begin(), v.end(), key) == v.end()) v.push_back(key);
}

constexpr uint64_t HS_FLAG_OFF_MASK = (1ull << 48) - 1;

// wait_mode 1's timeout (see the top of the file): polls every millisecond.
void watchdog_loop(HsCtx* c) {
  const int lanes = c->lanes;
  std::vector<std::vector<uint64_t>> last(lanes);
  std::vector<uint64_t> progress(lanes, mt::host_ns());
  std::vector<uint64_t> keys, vals;  // reused every poll (no allocation once the lanes' flags are known)
  bool aborted = false;
  while (!c->stop.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    uint64_t now = mt::host_ns();
    for (int l = 0; l < lanes; ++l) {
      {
        std::lock_guard<std::mutex> g(c->flags_mu);
        keys.assign(c->lane_flags[l].begin(), c->lane_flags[l].end());
      }
      vals.resize(keys.size());
      bool full_out = false;  // a slot this rank filled is still full
      for (size_t i = 0; i < keys.size(); ++i) {
        vals[i] = __atomic_load_n((uint64_t*)(c->host_base + (keys[i] & HS_FLAG_OFF_MASK)), __ATOMIC_ACQUIRE);
        if ((keys[i] >> 63) != 0 && vals[i] == HS_FULL) full_out = true;
      }
      bool busy_in = __atomic_load_n(&c->busy_host[l], __ATOMIC_ACQUIRE) != 0;
      if (vals != last[l] || !(full_out || busy_in)) progress[l] = now;
      last[l].assign(vals.begin(), vals.end());
      if (!aborted && (full_out || busy_in) && now - progress[l] > c->timeout_ns) {
        // name the peer: of a slot still full (its receiver never drained it), else of one still empty
        int code = full_out ? HS_ERR_TIMEOUT_DRAIN : MT_ERR_TIMEOUT_SIGNAL, peer = -1, slot = -1;
        for (size_t i = 0; i < keys.size() && peer < 0; ++i) {
          bool sender = (keys[i] >> 63) != 0;
          if (sender == full_out && vals[i] == (sender ? HS_FULL : HS_EMPTY)) {
            peer = (int)((keys[i] >> 48) & 0x7fff);
            slot = (int)((keys[i] & HS_FLAG_OFF_MASK) / 8);
          }
        }
        volatile int* e = c->err_host;
        if (e[0] == 0) {
          e[1] = c->rank;
          e[2] = peer;
          e[3] = slot;
          e[7] = full_out ? (int)HS_EMPTY : (int)HS_FULL;
          __atomic_thread_fence(__ATOMIC_SEQ_CST);
          e[0] = code;
        }
        aborted = true;
      }
      if (aborted) {
        // release: every wait of the lane sees the value it wants (the data are garbage from here on)
        for (uint64_t k : keys) {
          bool sender = (k >> 63) != 0;
          if (sender || busy_in)
            __atomic_store_n((uint64_t*)(c->host_base + (k & HS_FLAG_OFF_MASK)), sender ? HS_EMPTY : HS_FULL,
                             __ATOMIC_RELEASE);
        }
      }
    }
  }
}

void free_lanes(HsCtx* c) {
  for (int l = 0; l < c->lanes; ++l) {
    if (c->s_out && c->s_out[l]) cudaStreamDestroy(c->s_out[l]);
    if (c->s_in && c->s_in[l]) cudaStreamDestroy(c->s_in[l]);
  }
  for (int i = 0; c->ev && i < c->lanes * HS_TICKETS * 3; ++i)
    if (c->ev[i]) cudaEventDestroy(c->ev[i]);
  delete[] c->s_out;
  delete[] c->s_in;
  delete[] c->ev;
  delete[] c->next_ticket;
  c->s_out = c->s_in = nullptr;
  c->ev = nullptr;
  c->next_ticket = nullptr;
  c->lanes = 0;
}

// A driver entry point (the library links without libcuda); nonzero with the error set when it is missing.
int driver_fn(const char* name, void** fn) {
  cudaDriverEntryPointQueryResult q;
  *fn = nullptr;
  cudaError_t ce = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
  if (ce != cudaSuccess || q != cudaDriverEntryPointSuccess || *fn == nullptr) {
    mt::set_error("host_staged: %s not available from the driver (%s, query %d)", name, cudaGetErrorName(ce), (int)q);
    return 1;
  }
  return 0;
}

int check_range(HsCtx* c, uint64_t off, uint64_t n, const char* what) {
  MT_REQUIRE(off + n <= c->bytes && off + n >= off, 301,
             "host_staged: %s [%llu, +%llu) outside the staging memory (%llu bytes)", what,
             (unsigned long long)off, (unsigned long long)n, (unsigned long long)c->bytes);
  return 0;
}

}  // namespace

// Register `bytes` of shared host memory at `host_base` (page aligned) for this process and device.
// wait_mode 1: waits are cuStreamWaitValue64, timed by the watchdog thread; 0: one-thread spin kernels.
MT_API int mt_hs_create(int device, int rank, void* host_base, uint64_t bytes, double timeout_s, int wait_mode,
                        int lanes, void** out) {
  MT_REQUIRE(wait_mode == 0 || wait_mode == 1, 314, "host_staged: wait_mode %d is not 0 or 1", wait_mode);
  MT_REQUIRE(lanes >= 1 && lanes <= 64, 316, "host_staged: lanes %d outside 1..64", lanes);
  MT_REQUIRE(host_base != nullptr && bytes > 0 && ((uintptr_t)host_base & 4095u) == 0, 310,
             "host_staged: staging memory must be a non-empty page-aligned region");
  MT_SET_DEVICE(device);
  HsCtx* c = new HsCtx();
  c->device = device;
  c->rank = rank;
  c->bytes = bytes;
  c->timeout_ns = mt::timeout_ns(timeout_s);
  void* fn = nullptr;
  if (driver_fn("cuStreamWriteValue64", &fn)) {
    delete c;
    return 311;
  }
  c->write64 = (PfnWriteValue64)fn;
  c->wait_mode = wait_mode;
  if (wait_mode == 1) {
    if (driver_fn("cuStreamWaitValue64", &fn)) {
      delete c;
      return 315;
    }
    c->wait64 = (PfnWaitValue64)fn;
  }
  cudaError_t ce = cudaHostRegister(host_base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    mt::set_error("host_staged: cudaHostRegister of %llu bytes failed: %s (%s)", (unsigned long long)bytes,
                  cudaGetErrorName(ce), cudaGetErrorString(ce));
    delete c;
    return 312;
  }
  c->host_base = (uint8_t*)host_base;
  void* dp = nullptr;
  ce = cudaHostGetDevicePointer(&dp, host_base, 0);
  if (ce == cudaSuccess) {
    c->dev_base = (uint8_t*)dp;
    ce = cudaHostAlloc((void**)&c->err_host, MT_ERR_WORDS * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  }
  if (ce == cudaSuccess) {
    memset(c->err_host, 0, MT_ERR_WORDS * sizeof(int));
    ce = cudaHostGetDevicePointer((void**)&c->err_dev, c->err_host, 0);
  }
  if (ce == cudaSuccess)
    ce = cudaHostAlloc((void**)&c->busy_host, (size_t)lanes * sizeof(uint64_t),
                       cudaHostAllocMapped | cudaHostAllocPortable);
  if (ce == cudaSuccess) {
    memset(c->busy_host, 0, (size_t)lanes * sizeof(uint64_t));
    ce = cudaHostGetDevicePointer((void**)&c->busy_dev, c->busy_host, 0);
  }
  if (ce == cudaSuccess) ce = cudaMalloc((void**)&c->abort_dev, 2 * sizeof(int));
  if (ce == cudaSuccess) ce = cudaMemset(c->abort_dev, 0, 2 * sizeof(int));
  if (ce == cudaSuccess) {
    c->lanes = lanes;
    c->s_out = new cudaStream_t[lanes]();
    c->s_in = new cudaStream_t[lanes]();
    c->ev = new cudaEvent_t[(size_t)lanes * HS_TICKETS * 3]();
    c->next_ticket = new unsigned[lanes]();
    for (int l = 0; l < lanes && ce == cudaSuccess; ++l) {
      ce = cudaStreamCreateWithFlags(&c->s_out[l], cudaStreamNonBlocking);
      if (ce == cudaSuccess) ce = cudaStreamCreateWithFlags(&c->s_in[l], cudaStreamNonBlocking);
    }
    for (int i = 0; i < lanes * HS_TICKETS * 3 && ce == cudaSuccess; ++i)
      ce = cudaEventCreateWithFlags(&c->ev[i], cudaEventDisableTiming);
  }
  if (ce != cudaSuccess) {
    cudaGetLastError();
    mt::set_error("host_staged: setup failed: %s (%s)", cudaGetErrorName(ce), cudaGetErrorString(ce));
    if (c->err_host) cudaFreeHost(c->err_host);
    if (c->busy_host) cudaFreeHost(c->busy_host);
    if (c->abort_dev) cudaFree(c->abort_dev);
    free_lanes(c);
    cudaHostUnregister(host_base);
    delete c;
    return 313;
  }
  c->lane_flags.resize(lanes);
  if (wait_mode == 1) c->watchdog = std::thread(watchdog_loop, c);
  *out = c;
  return 0;
}

// One piece through one slot on stream s: wait until the slot's flag says it is ours (sender: empty,
// receiver: full), copy nbytes (device -> slot when `to_host`, slot -> device otherwise), hand the slot over.
static int stage_piece(HsCtx* c, int lane, const uint64_t* op, bool to_host, cudaStream_t s) {
  uint64_t data_off = op[0], nbytes = op[2], flag_off = op[3];
  void* dev = (void*)op[1];
  int peer = (int)op[4], rc;
  if ((rc = check_range(c, data_off, nbytes, "staging slot")) || (rc = check_range(c, flag_off, 8, "flag"))) return rc;
  if (c->wait_mode == 1) note_flag(c, lane, flag_off, to_host, peer);
  if ((rc = wait_flag(c, flag_off, to_host ? HS_EMPTY : HS_FULL, to_host ? HS_ERR_TIMEOUT_DRAIN : MT_ERR_TIMEOUT_SIGNAL,
                      peer, s)))
    return rc;
  if (nbytes) {
    Timed tm(c, 3);
    uint8_t* slot = c->host_base + data_off;
    MT_CUDA(to_host ? cudaMemcpyAsync(slot, dev, nbytes, cudaMemcpyDeviceToHost, s)
                    : cudaMemcpyAsync(dev, slot, nbytes, cudaMemcpyHostToDevice, s));
  }
  return write_flag(c, flag_off, to_host ? HS_FULL : HS_EMPTY, s);
}

// One exchange on a lane, in one call: both lane streams start after `cur_stream`'s work so far; the local
// block (if any) is a device copy on the receive stream; the pieces go send 0, receive 0, send 1, ...
// (ops: HS_OP_WORDS words each: data offset, device address, bytes, flag offset, peer). *ticket names the
// exchange for mt_hs_wait. Capturable in a CUDA graph (cur_stream capturing: the lane streams join it).
MT_API int mt_hs_post(void* h, int lane, uint64_t cur_stream, int n_out, const uint64_t* out_ops, int n_in,
                      const uint64_t* in_ops, void* local_dst, const void* local_src, uint64_t local_bytes,
                      int* ticket) {
  HsCtx* c = (HsCtx*)h;
  MT_REQUIRE(lane >= 0 && lane < c->lanes, 304, "host_staged: lane %d outside 0..%d", lane, c->lanes - 1);
  MT_SET_DEVICE(c->device);  // the wait kernels launch on this device's streams (a no-op when it is current)
  unsigned t = c->next_ticket[lane]++ % HS_TICKETS;
  cudaEvent_t* ev = c->ev + ((size_t)lane * HS_TICKETS + t) * 3;
  cudaStream_t so = c->s_out[lane], si = c->s_in[lane];
  {
    Timed tm(c, 0);
    MT_CUDA(cudaEventRecord(ev[0], (cudaStream_t)cur_stream));
    MT_CUDA(cudaStreamWaitEvent(so, ev[0], 0));
    MT_CUDA(cudaStreamWaitEvent(si, ev[0], 0));
  }
  int rc;
  // the receive stream is busy while inside this exchange (the watchdog's view)
  if (c->wait_mode == 1 && (rc = write_word(c, c->busy_dev + lane, 1, si))) return rc;
  if (local_bytes) {
    Timed tm(c, 1);
    MT_CUDA(cudaMemcpyAsync(local_dst, local_src, local_bytes, cudaMemcpyDeviceToDevice, si));
  }
  for (int j = 0; j < n_out || j < n_in; ++j) {
    if (j < n_out && (rc = stage_piece(c, lane, out_ops + HS_OP_WORDS * j, true, so))) return rc;
    if (j < n_in && (rc = stage_piece(c, lane, in_ops + HS_OP_WORDS * j, false, si))) return rc;
  }
  // left it (before the event: in a capture, every node must join back)
  if (c->wait_mode == 1 && (rc = write_word(c, c->busy_dev + lane, 0, si))) return rc;
  {
    Timed tm(c, 0);
    MT_CUDA(cudaEventRecord(ev[1], so));
    MT_CUDA(cudaEventRecord(ev[2], si));
  }
  *ticket = (int)t;
  return 0;
}

// Make `cur_stream` wait for exchange `ticket` of `lane` (both its copies and its flags).
MT_API int mt_hs_wait(void* h, int lane, int ticket, uint64_t cur_stream) {
  HsCtx* c = (HsCtx*)h;
  MT_REQUIRE(lane >= 0 && lane < c->lanes && ticket >= 0 && ticket < HS_TICKETS, 305,
             "host_staged: lane %d / ticket %d out of range", lane, ticket);
  MT_SET_DEVICE(c->device);  // a cur_stream of 0 is the current device's default stream
  cudaEvent_t* ev = c->ev + ((size_t)lane * HS_TICKETS + ticket) * 3;
  MT_CUDA(cudaStreamWaitEvent((cudaStream_t)cur_stream, ev[1], 0));
  MT_CUDA(cudaStreamWaitEvent((cudaStream_t)cur_stream, ev[2], 0));
  return 0;
}

// out[0..4]: host ns spent in event/stream waits, local copies, wait launches, staging copies, flag writes;
// out[5..9]: how many of each.
MT_API int mt_hs_stats(void* h, uint64_t* out) {
  HsCtx* c = (HsCtx*)h;
  for (int i = 0; i < 5; ++i) {
    out[i] = c->stat_ns[i];
    out[5 + i] = c->stat_calls[i];
  }
  return 0;
}

// The error record (MT_ERR_WORDS ints: code, rank, peer, slot, ...); code 0 = no error. Read without a sync.
MT_API int mt_hs_error(void* h, int* words) {
  HsCtx* c = (HsCtx*)h;
  memcpy(words, (const void*)c->err_host, MT_ERR_WORDS * sizeof(int));
  return 0;
}

// No copy or kernel may still touch the memory being unregistered or freed: each lane's streams, then the rest of the
// device's work (mt::device_sync_within: the kernels on the caller's streams, graph replays included), get the
// context's timeout (all together). The watchdog keeps running meanwhile (it still releases a stream whose peer is
// gone). Past the timeout (317) the streams and events are destroyed (that returns at once) but the staging
// registration, the error record, the busy words and the abort flag are leaked rather than freed under work that may
// still write them; mt_last_error says so.
MT_API int mt_hs_destroy(void* h) {
  HsCtx* c = (HsCtx*)h;
  if (c == nullptr) return 0;
  mt::DeviceGuard device_guard;
  (void)device_guard.set(c->device);
  const uint64_t deadline = mt::host_ns() + c->timeout_ns;
  int stuck = -1;
  for (int i = 0; i < 2 * c->lanes && stuck < 0; ++i) {
    cudaStream_t s = (i & 1) ? c->s_in[i / 2] : c->s_out[i / 2];
    if (mt::poll_ready([s] { return cudaStreamQuery(s); }, deadline) == cudaErrorNotReady) stuck = i;
  }
  const bool idle = stuck < 0 && mt::device_sync_within(c->device, deadline) != cudaErrorNotReady;
  (void)cudaGetLastError();  // a query's error is not this destroy's: keep it out of the next call's launch check
  if (c->watchdog.joinable()) {
    c->stop = true;
    c->watchdog.join();
  }
  free_lanes(c);
  cudaError_t ce = cudaSuccess;
  if (idle) {
    if (c->err_host) cudaFreeHost(c->err_host);
    if (c->busy_host) cudaFreeHost(c->busy_host);
    if (c->abort_dev) cudaFree(c->abort_dev);
    ce = cudaHostUnregister(c->host_base);
  }
  const double timeout_s = (double)c->timeout_ns / 1e9;
  delete c;
  MT_REQUIRE(stuck < 0, 317, "mt_hs_destroy: lane %d's %s stream did not complete its copies within %.1f s: the "
             "staging registration, error record, busy words and abort flag are leaked rather than freed under it",
             stuck / 2, (stuck & 1) ? "receive" : "send", timeout_s);
  MT_REQUIRE(idle, 317, "mt_hs_destroy: the device's work did not complete within %.1f s: the staging registration, "
             "error record, busy words and abort flag are leaked rather than freed under it", timeout_s);
  MT_CUDA(ce);
  return 0;
}
#endif
