// moetune csrc: the CPU proxy engine's request FIFO (shared by the host engine and GPU producers).
#pragma once

#include <stdint.h>

#include "mt_common.h"

// One request = one 64-byte slot of a ring in pinned, mapped host memory. A producer (GPU thread or
// host) fills every field, fences, then writes `seq` = slot index + 1 (the ready flag); the proxy
// thread consumes slots strictly in order.
enum MtOp : uint32_t {
  MT_OP_PUT = 1,      // copy `bytes` from device address `src` to peer's data region + dst_off
  MT_OP_SIGNAL = 2,   // fence (per fence_mode), then write `value` into peer's signal slot signal_idx
  MT_OP_WRITE64 = 3,  // write immediate `value` at peer's control region + dst_off (self-validating word)
  MT_OP_ACK = 4,      // behind everything issued so far: write `value` to local ack[stream] on each stream picked
                      // since the previous ACK (AckSet below; every stream once the engine failed)
};
enum MtFlags : uint32_t {
  MT_F_SIGNAL = 1,  // PUT followed by fence + signal (coupled put-with-signal)
};
enum MtFenceMode : int { MT_FENCE_NONE = 0, MT_FENCE_PROXY_DRAIN = 1, MT_FENCE_NIC_ORDERED = 2 };
enum MtQpMapping : int { MT_QP_ROUND_ROBIN = 0, MT_QP_PEER_HASH = 1 };

struct alignas(64) MtRequest {
  uint32_t op;
  uint32_t peer;
  uint32_t flags;
  uint32_t signal_idx;  // SIGNAL, PUT with F_SIGNAL: the slot written; a PUT without: the slot of the SIGNAL that
                        // covers it (peer_hash keeps both on one stream)
  uint64_t src;      // absolute device address of the source bytes (PUT)
  uint64_t dst_off;  // byte offset in the peer's data region (PUT) or control region (WRITE64)
  uint64_t bytes;
  uint64_t value;    // signal value / immediate
  uint64_t reserved0;
  uint64_t seq;      // ready flag, written last
};
static_assert(sizeof(MtRequest) == 64, "request slot must be 64 bytes");

#define MT_MAX_QPS 64  // QPs (CUDA streams) per peer
// Streams of one engine (peers x QPs per peer): every qps_per_pe at every transport world size (MT_MAX_WORLD).
#define MT_MAX_STREAMS (MT_MAX_WORLD * MT_MAX_QPS)

// The proxy thread's CPU affinity (mt_proxy_create's `cpus`/`ncpus`, read back by mt_proxy_cpu into
// out[MT_PCPU_F_*] and mt_proxy_cpu_list). The thread pins itself to the whole SET (the OS places it within it):
// every engine of a process may get the same set without stacking their threads on one core.
#define MT_PROXY_MAX_CPU 65536  // a larger index is refused (recorded as EINVAL, as the kernel refuses a CPU it lacks)
enum MtProxyCpuField : int {
  MT_PCPU_F_NCPUS = 0,    // how many CPUs were asked for (mt_proxy_cpu_list lists them), 0 = no pinning
  MT_PCPU_F_STATE = 1,    // MtProxyCpuState
  MT_PCPU_F_ERRNO = 2,    // why pinning failed (pthread_setaffinity_np's error), else 0
  MT_PCPU_F_CURRENT = 3,  // the CPU the thread last saw itself on (sched_getcpu), -1 before it ran
  MT_PCPU_F_TID = 4,      // the thread's kernel id, 0 before it ran (its mask: sched_getaffinity(tid))
  MT_PCPU_F_COUNT = 5
};
enum MtProxyCpuState : int {
  MT_PCPU_PENDING = 0,   // the thread has not run yet
  MT_PCPU_UNPINNED = 1,  // no CPU asked for
  MT_PCPU_PINNED = 2,    // pinned to the set of CPUs asked for
  MT_PCPU_FAILED = 3,    // asked for, refused (errno in MT_PCPU_F_ERRNO): runs unpinned
};

// Where the request FIFO and the control page live (mt_proxy_mem into out[MT_PMEM_F_*], with a reason text).
// With a CPU set asked for, mt_proxy_create places both on the NUMA node holding most CPUs of the set (mmap,
// mbind MPOL_PREFERRED, first touch, cudaHostRegister); without one, or when that cannot be done, cudaHostAlloc
// allocates them on the creating thread's node (the reason says why).
#define MT_PROXY_MAX_NODE 1024  // NUMA nodes at or past this index are not placed on (the mbind mask's size)
enum MtProxyMemField : int {
  MT_PMEM_F_STATE = 0,        // MtProxyMemState
  MT_PMEM_F_WANT = 1,         // the node chosen for the pages (most CPUs of the set), -1 none
  MT_PMEM_F_NODE = 2,         // the node the FIFO's first page is on now (get_mempolicy at the call), -1 unknown
  MT_PMEM_F_ERRNO = 3,        // why placing failed: the errno of the failing step, or cudaHostRegister's error code
  MT_PMEM_F_QUERY_ERRNO = 4,  // why MT_PMEM_F_NODE is -1 (get_mempolicy's errno), else 0
  MT_PMEM_F_COUNT = 5
};
enum MtProxyMemState : int {
  MT_PMEM_DEFAULT = 0,   // no CPU set asked for: cudaHostAlloc on the creating thread's node
  MT_PMEM_BOUND = 1,     // placed on the set's node (MT_PMEM_F_WANT)
  MT_PMEM_FALLBACK = 2,  // a set was asked for but its node could not be bound (reason): as MT_PMEM_DEFAULT
};

// What a GPU producer kernel needs to know about an engine.
struct MtGpuView {
  MtRequest* fifo_dev;      // device alias of the host ring
  uint32_t nslots;
  unsigned long long* head_dev;  // producer index (device memory; GPU producers only)
  const uint64_t* tail_dev;     // consumer index (device alias of host memory, written by the proxy)
  uint64_t* ack_dev;            // [nstreams] local completion words (device memory), one per stream
  int nstreams;                 // the engine's streams (peers x QPs per peer)
  int qps;                      // streams per peer (stream p * qps + k is peer p's k-th)
  int qp_mapping;               // MtQpMapping: a producer mirrors the engine's stream picks (AckSet)
};

// The streams an ACK is written on: those its requests picked since the previous ACK (bit k of q[p]: peer p's k-th
// stream), as the engine picks them (count words on a peer's first stream; PUTs and signals by the QP mapping, a
// signalled PUT picking twice). A GPU producer records the same set as it pushes and waits for the ACK on those
// streams only: an untouched stream's earlier work was covered by an earlier ACK an earlier call waited for.
static_assert(MT_MAX_QPS <= 64, "AckSet holds a peer's streams in 64 bits");
struct AckSet {
  uint64_t q[MT_MAX_WORLD];
  uint32_t rr[MT_MAX_WORLD];  // round_robin: each peer's next stream (restarts at every ACK, as the engine's)
};

// Internal (same shared library): the GPU view of an engine; mark it as fed by GPU producers.
extern "C" int mt_proxy_gpu_view(void* engine, MtGpuView* out);
extern "C" int mt_proxy_mark_gpu_producer_internal(void* engine);
// A kernel call numbered seq, which writes seq into *done_word when finished, is about to be launched: the proxy
// thread comes back from an idle sleep and polls until then. forget: done_word is about to be freed.
extern "C" int mt_proxy_expect_internal(void* engine, const uint64_t* done_word, uint64_t seq);
extern "C" int mt_proxy_retract_internal(void* engine, const uint64_t* done_word, uint64_t seq);
extern "C" int mt_proxy_forget_internal(void* engine, const uint64_t* done_word);
// The engine's error (0 = none; message into buf) -- also exported to Python.
extern "C" int mt_proxy_error(void* engine, char* buf, int len);
extern "C" int mt_proxy_diag(void* engine, char* buf, int len);
