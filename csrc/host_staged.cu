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
// pieces (their waits and copies) in between. Run 31 waited for a slot right after writing its flag, with
// nothing between, and read it stale (so it seems): keep a wait per piece, and if the ring's uses must come
// closer, give each side a flag only the other writes.
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
constexpr uint64_t HS_EMPTY = 0, HS_FULL = 1;  // a slot's flag

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
  w.timeout_ns = c->timeout_ns;
  w.rank = c->rank;
  hs_wait_kernel<<<1, 1, 0, s>>>(reinterpret_cast<const uint64_t*>(c->dev_base + off), want, w, code, peer,
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

// One piece through one slot on stream s: wait until the slot's flag says it is ours (sender: empty,
// receiver: full), copy nbytes (device -> slot when `to_host`, slot -> device otherwise), hand the slot over.
static int stage_piece(HsCtx* c, const uint64_t* op, bool to_host, cudaStream_t s) {
  uint64_t data_off = op[0], nbytes = op[2], flag_off = op[3];
  void* dev = (void*)op[1];
  int peer = (int)op[4], rc;
  if ((rc = check_range(c, data_off, nbytes, "staging slot")) || (rc = check_range(c, flag_off, 8, "flag"))) return rc;
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
    if (j < n_out && (rc = stage_piece(c, out_ops + HS_OP_WORDS * j, true, so))) return rc;
    if (j < n_in && (rc = stage_piece(c, in_ops + HS_OP_WORDS * j, false, si))) return rc;
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
