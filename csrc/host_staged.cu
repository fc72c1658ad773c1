// The `host_staged` transport's data path: rows cross PCIe twice through pinned host memory that every
// rank of the node maps (a shared file, registered with cudaHostRegister), moved by the copy engines.
//
// One staging slot carries one block from a sender to a receiver. Its two flags live in the same shared
// memory: `ready` (written by the sender after its device->host copy) and `ack` (written by the receiver
// after its host->device copy). The k-th use of a slot carries sequence number seq = k (from 1); both
// sides count the uses, since every rank posts the same exchanges in the same order. Everything is
// ordered on the callers' CUDA streams, so no host thread waits:
//
//   sender stream  : wait ack >= seq-1 (slot drained) -> cudaMemcpyAsync D2H -> cuStreamWriteValue64(ready, seq)
//   receiver stream: wait ready >= seq                 -> cudaMemcpyAsync H2D -> cuStreamWriteValue64(ack, seq)
//
// cuStreamWriteValue64 without NO_MEMORY_BARRIER makes the stream's earlier work (the copy) visible
// before the flag. The waits are one-thread kernels with a bounded spin (mt::wait_word): a peer that
// never arrives costs one timeout recorded in the error record, never a hang.
#include <string.h>
#include <time.h>

#include "mt_common.h"

#ifndef MT_HOST_SIM
#include <cuda.h>

namespace {

typedef CUresult (*PfnWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
typedef CUresult (*PfnWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

enum { HS_ERR_TIMEOUT_DRAIN = 8 };  // waited too long for the receiver to drain a staging slot

struct HsCtx {
  int device = 0;
  int rank = 0;
  uint8_t* host_base = nullptr;  // the shared staging memory in this process
  uint8_t* dev_base = nullptr;   // its device alias
  uint64_t bytes = 0;
  int* err_host = nullptr;  // error record (host-mapped)
  int* err_dev = nullptr;
  int* abort_dev = nullptr;  // device memory: set after the first timeout, later waits give up at once
  uint64_t timeout_ns = 0;
  PfnWriteValue64 write64 = nullptr;
  PfnWaitValue64 wait64 = nullptr;  // wait_mode 1: the driver's stream wait (no SM, no timeout)
  int wait_mode = 0;
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

uint64_t host_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct Timed {  // adds the scope's host time to one stat
  HsCtx* c;
  int k;
  uint64_t t0;
  Timed(HsCtx* c_, int k_) : c(c_), k(k_), t0(host_ns()) {}
  ~Timed() {
    c->stat_ns[k] += host_ns() - t0;
    c->stat_calls[k] += 1;
  }
};

constexpr int HS_TICKETS = 64;  // exchanges of one lane that may be in flight before a ticket's events are reused

__global__ void hs_wait_kernel(const uint64_t* flag, uint64_t target, mt::WaitCtx w, int code, int peer, int slot) {
  bool ok;
  mt::wait_word(w, flag, target, true, code, peer, slot, &ok);
}

int wait_flag(HsCtx* c, uint64_t off, uint64_t target, int code, int peer, cudaStream_t s) {
  Timed tm(c, 2);
  if (c->wait_mode == 1) {
    CUresult r = c->wait64((CUstream)s, (CUdeviceptr)(c->dev_base + off), target, CU_STREAM_WAIT_VALUE_GEQ);
    MT_REQUIRE(r == CUDA_SUCCESS, 303, "host_staged: cuStreamWaitValue64 failed (CUresult %d)", (int)r);
    return 0;
  }
  mt::WaitCtx w;
  w.err = c->err_dev;
  w.abort_flag = c->abort_dev;
  w.timeout_ns = c->timeout_ns;
  w.rank = c->rank;
  hs_wait_kernel<<<1, 1, 0, s>>>(reinterpret_cast<const uint64_t*>(c->dev_base + off), target, w, code, peer,
                                 (int)(off / 8));
  MT_CUDA(cudaGetLastError());
  return 0;
}

int write_flag(HsCtx* c, uint64_t off, uint64_t value, cudaStream_t s) {
  Timed tm(c, 4);
  CUresult r = c->write64((CUstream)s, (CUdeviceptr)(c->dev_base + off), value, 0);
  MT_REQUIRE(r == CUDA_SUCCESS, 300, "host_staged: cuStreamWriteValue64 failed (CUresult %d)", (int)r);
  return 0;
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
// wait_mode 0: waits are one-thread spin kernels with a timeout; 1: cuStreamWaitValue64 (for comparison).
MT_API int mt_hs_create(int device, int rank, void* host_base, uint64_t bytes, double timeout_s, int wait_mode,
                        int lanes, void** out) {
  MT_REQUIRE(wait_mode == 0 || wait_mode == 1, 314, "host_staged: wait_mode %d is not 0 or 1", wait_mode);
  MT_REQUIRE(lanes >= 1 && lanes <= 64, 316, "host_staged: lanes %d outside 1..64", lanes);
  MT_REQUIRE(host_base != nullptr && bytes > 0 && ((uintptr_t)host_base & 4095u) == 0, 310,
             "host_staged: staging memory must be a non-empty page-aligned region");
  MT_CUDA(cudaSetDevice(device));
  HsCtx* c = new HsCtx();
  c->device = device;
  c->rank = rank;
  c->bytes = bytes;
  c->timeout_ns = (uint64_t)(timeout_s * 1e9);
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
  if (ce == cudaSuccess) ce = cudaMalloc((void**)&c->abort_dev, sizeof(int));
  if (ce == cudaSuccess) ce = cudaMemset(c->abort_dev, 0, sizeof(int));
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
    if (c->abort_dev) cudaFree(c->abort_dev);
    free_lanes(c);
    cudaHostUnregister(host_base);
    delete c;
    return 313;
  }
  *out = c;
  return 0;
}

// One piece through one slot, on stream s: wait until `wait_off` >= wait_target (0: no wait), copy nbytes
// (device -> slot when `to_host`, slot -> device otherwise), then write seq into `signal_off`. The sender
// waits for the slot's ack (drained) and signals ready; the receiver waits for ready and signals ack.
static int stage_piece(HsCtx* c, uint64_t data_off, void* dev, uint64_t nbytes, bool to_host, uint64_t wait_off,
                       uint64_t wait_target, int wait_code, uint64_t signal_off, uint64_t seq, int peer, cudaStream_t s) {
  int rc;
  if ((rc = check_range(c, data_off, nbytes, "staging slot")) || (rc = check_range(c, wait_off, 8, "flag")) ||
      (rc = check_range(c, signal_off, 8, "flag")))
    return rc;
  MT_REQUIRE(seq >= 1, 302, "host_staged: sequence numbers start at 1");
  if (wait_target && (rc = wait_flag(c, wait_off, wait_target, wait_code, peer, s))) return rc;
  if (nbytes) {
    Timed tm(c, 3);
    uint8_t* slot = c->host_base + data_off;
    MT_CUDA(to_host ? cudaMemcpyAsync(slot, dev, nbytes, cudaMemcpyDeviceToHost, s)
                    : cudaMemcpyAsync(dev, slot, nbytes, cudaMemcpyHostToDevice, s));
  }
  return write_flag(c, signal_off, seq, s);
}

// One exchange on a lane, in one call: both lane streams start after `cur_stream`'s work so far; the local
// block (if any) is a device copy on the receive stream; the pieces go send 0, receive 0, send 1, ...
// (ops: 7 words each: data offset, device address, bytes, ready offset, ack offset, seq, peer). *ticket
// names the exchange for mt_hs_wait.
MT_API int mt_hs_post(void* h, int lane, uint64_t cur_stream, int n_out, const uint64_t* out_ops, int n_in,
                      const uint64_t* in_ops, void* local_dst, const void* local_src, uint64_t local_bytes,
                      int* ticket) {
  HsCtx* c = (HsCtx*)h;
  MT_REQUIRE(lane >= 0 && lane < c->lanes, 304, "host_staged: lane %d outside 0..%d", lane, c->lanes - 1);
  unsigned t = c->next_ticket[lane]++ % HS_TICKETS;
  cudaEvent_t* ev = c->ev + ((size_t)lane * HS_TICKETS + t) * 3;
  cudaStream_t so = c->s_out[lane], si = c->s_in[lane];
  {
    Timed tm(c, 0);
    MT_CUDA(cudaEventRecord(ev[0], (cudaStream_t)cur_stream));
    MT_CUDA(cudaStreamWaitEvent(so, ev[0], 0));
    MT_CUDA(cudaStreamWaitEvent(si, ev[0], 0));
  }
  if (local_bytes) {
    Timed tm(c, 1);
    MT_CUDA(cudaMemcpyAsync(local_dst, local_src, local_bytes, cudaMemcpyDeviceToDevice, si));
  }
  int rc;
  for (int j = 0; j < n_out || j < n_in; ++j) {
    if (j < n_out) {
      const uint64_t* o = out_ops + 7 * j;  // sender: wait for ack >= seq - 1, signal ready
      if ((rc = stage_piece(c, o[0], (void*)o[1], o[2], true, o[4], o[5] - 1, HS_ERR_TIMEOUT_DRAIN, o[3], o[5],
                            (int)o[6], so)))
        return rc;
    }
    if (j < n_in) {
      const uint64_t* o = in_ops + 7 * j;  // receiver: wait for ready >= seq, signal ack
      if ((rc = stage_piece(c, o[0], (void*)o[1], o[2], false, o[3], o[5], MT_ERR_TIMEOUT_SIGNAL, o[4], o[5],
                            (int)o[6], si)))
        return rc;
    }
  }
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

MT_API int mt_hs_destroy(void* h) {
  HsCtx* c = (HsCtx*)h;
  if (c == nullptr) return 0;
  cudaSetDevice(c->device);
  cudaDeviceSynchronize();  // no copy may still touch the memory being unregistered
  if (c->err_host) cudaFreeHost(c->err_host);
  if (c->abort_dev) cudaFree(c->abort_dev);
  free_lanes(c);
  cudaError_t ce = cudaHostUnregister(c->host_base);
  delete c;
  MT_CUDA(ce);
  return 0;
}
#endif
