// The MoE megakernel on one GPU: routing (two small kernels) and ONE persistent kernel that runs the
// layer's expert work as tile tasks handed out by an on-GPU scheduler.
//
// Task graph (one launch):
//   GEMM1 (expert e, m-tile mt, n-block nb): rows of x routed to e  x  128 interleaved gate/up rows of
//          W_gate_up[e]  ->  SwiGLU in registers  ->  h[(t,j), 64 columns]          (N1 = 2I/128 per m-tile)
//   GEMM2 (e, mt, nb): the m-tile's h rows  x  128 rows of W_down[e]  ->  times the routing weight
//          ->  y[(t,j), 128 columns]                                                   (N2 = H/128 per m-tile)
//   COMBINE (token tile): out[t] = sum over j = 0..K-1 of y[(t,j)], in that order, fp32 -> bf16.
// Dependencies: GEMM2(e, mt, *) after all N1 GEMM1(e, mt, *); COMBINE(tile) after every GEMM2 of every
// row of its tokens. Rows are named by (token, slot) = t*K + j, so no row's result depends on the order
// atomics put it into an expert's list, and the combine sums in a fixed order: bit-identical outputs.
//
// Roles: CTA 0 is the scheduler ("OS" CTA). It counts the tasks, publishes every GEMM1 task, then one
// warp subscribes: it polls the per-m-tile GEMM1 counters and the per-combine-tile counters and
// publishes GEMM2 and COMBINE tasks as they become ready. CTAs 1.. are processors: each claims the next
// queue slot (atomicAdd), waits for it to be published, runs it, signals its counter, and repeats until
// the slot index passes the task total. All CTAs are resident (grid <= occupancy x SMs, checked), so a
// processor waiting for a slot never blocks the work that slot waits on. Every wait is bounded by the
// globaltimer and ends in an error record + abort flag, never a hang.
#include <cuda.h>  // CUtensorMap (the encode entry point comes through the runtime: no -lcuda)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>  // the routing cluster's distributed shared memory (k_route)
#include <mutex>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <utility>  // std::forward (launch_k)

#include "mk_api.h"
#include "mk_index.h"

namespace {

thread_local char g_err[512] = "";

// Record the error and clear the runtime's last-error state: a launch that failed (cudaLaunchKernelEx returns the
// error and also leaves it there) must not be reported again by the next launch's cudaGetLastError check (run 94b: a
// decode launch's "invalid argument" came back as "k_logits launch" on the next layer).
int fail(const char* what, cudaError_t e) {
  snprintf(g_err, sizeof g_err, "%s: %s", what, cudaGetErrorString(e));
  (void)cudaGetLastError();
  return 1;
}
int fail_msg(const char* msg) {
  snprintf(g_err, sizeof g_err, "%s", msg);
  return 1;
}

constexpr int BK = 64;        // k elements per pipeline stage (128 bytes per row: 8 chunks of 16 B)
constexpr int BN = 128;       // n rows of weights per tile
constexpr int THREADS = 128;  // the routing kernels' block; tile kernels use Tile::THREADS
constexpr int MAXE_PER_LANE = 16;  // E <= 512 (32 lanes x 16)
constexpr int LOCAL_MAX_E = 128;   // experts up to which processors derive the publish_all queue themselves

template <int BM_, int WM_, int WN_, int MINB_, bool TMA_ = false>
struct Tile {
  static constexpr int BM = BM_, WM = WM_, WN = WN_, THREADS = WM * WN * 32, MINB = MINB_;
  static constexpr bool TMA = TMA_;  // B (weights) by one TMA pair per stage on an mbarrier (expert tasks only)
  static constexpr int BNT = BN, NBLK = 1;  // tile columns, 128-column n-blocks per task (wide tile: WgTile)
  static constexpr int WTM = BM / WM, WTN = BN / WN;
  static constexpr int MT = WTM / 16, NT = WTN / 8;
  static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
  // Per-task metadata after the pipeline stages: A row offsets, B row offsets, row ids.
  // (+16: the split-K "last part" flag)
  // (TMA: + one mbarrier per stage, <= 16 stages, 8 bytes for their alignment)
  static constexpr int META = BM * 8 + BN * 8 + BM * 4 + 16 + (TMA ? 8 + 16 * 8 : 0);
  static constexpr int NACC = MT * NT * 4;  // fp32 accumulators per thread
  static constexpr bool WG = false;         // mma.sync core (the wgmma core is WgTile below)
  static constexpr int XR = 0;              // tail rows (WgTile)
  static constexpr int ALIGN = TMA ? 1024 : 0;  // extra dynamic shared memory for aligning the tiles (the TMA's
                                                // 128-byte swizzle repeats every 1024 bytes from the tile base)
  static_assert(MT >= 1 && NT % 2 == 0 && NACC <= 64, "warp tile");
  // TMA tiles hold B as two 64-row boxes (GEMM1: gate rows, then up rows); the warp-to-column map below
  // (b_col) gives each warp 16 columns of both halves, so a warp holds (gate, up) pairs: 4 warps of 32.
  static_assert(!TMA || (WN == 4 && NT == 4 && A_BYTES % 1024 == 0 && STAGE % 1024 == 0), "TMA tile shape");
};
using Small = Tile<16, 1, 4, 1>;   // decode: 16 rows x 128, 4 warps of 16 x 32
using Large = Tile<64, 2, 2, 1>;   // 64 rows x 128, 4 warps of 32 x 64
using SmallTma = Tile<16, 1, 4, 1, true>;  // decode with B by TMA (opt-in: MkParams.tma_b)
using Huge = Tile<128, 2, 4, 2>;  // prefill: 128 rows x 128, 8 warps of 64 x 32 (twice Large's FLOP per L2 byte);
                                  // 2 CTAs/SM need <= 128 registers (run 4: 1 CTA/SM was 1.6x slower)

__host__ __device__ constexpr int smem_bytes(int stage_bytes, int meta, int stages) { return stage_bytes * stages + meta; }

// ---- PTX helpers ---------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// Arrive on mbarrier `bar` once every cp.async this thread issued so far has landed (.noinc: the arrival counts
// toward the barrier's expected count, so the producer threads are the count and never wait for their copies).
__device__ __forceinline__ void cp_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// wait until at most n groups are pending (n is a run-time pipeline depth, the PTX needs an immediate)
__device__ __forceinline__ void cp_wait(int n) {
  switch (n) {
#define MK_CP_WAIT(k) \
  case k: asm volatile("cp.async.wait_group " #k ";\n" ::); break;
    MK_CP_WAIT(0) MK_CP_WAIT(1) MK_CP_WAIT(2) MK_CP_WAIT(3) MK_CP_WAIT(4) MK_CP_WAIT(5) MK_CP_WAIT(6) MK_CP_WAIT(7)
    MK_CP_WAIT(8) MK_CP_WAIT(9)
#undef MK_CP_WAIT
    default: asm volatile("cp.async.wait_group 10;\n" ::); break;
  }
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ int ld_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_relaxed(const int32_t* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int32_t* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed(int32_t* p, int v) {
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add(int32_t* p, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t gtime() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
  return t;
}
// Timeline stamps (MkParams.trace, profiling only; mk_api.h: MK_TR_*): word f of queue slot i, a scheduler word,
// and this CTA's start (f = 0) or end (f = 1). One predictable branch each when tracing is off.
__device__ __forceinline__ void tr_slot(const MkParams& p, int i, int f, int64_t v) {
  if (p.trace && i >= 0 && i < p.q_cap) p.trace[MK_TR_HEAD + (int64_t)MK_TR_SLOT * i + f] = v;
}
// Publish stamps of queue slots first, first + step, .. < end (one clock read for the batch).
__device__ __forceinline__ void tr_published(const MkParams& p, int first, int end, int step) {
  if (!p.trace) return;
  const int64_t now = (int64_t)gtime();
  for (int i = first; i < end; i += step) tr_slot(p, i, MK_TR_PUB, now);
}
__device__ __forceinline__ void tr_sched(const MkParams& p, int f) {
  if (p.trace) p.trace[f] = (int64_t)gtime();
}
__device__ __forceinline__ void tr_cta(const MkParams& p, int f) {
  if (p.trace) p.trace[MK_TR_HEAD + (int64_t)MK_TR_SLOT * p.q_cap + 2 * blockIdx.x + f] = (int64_t)gtime();
}

// ---- TMA (cp.async.bulk.tensor) and mbarrier helpers ----
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Raise the barrier's expected transaction bytes without arriving (the arrival count stays the threads').
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrive and expect `bytes` (barriers of count 1 that only the TMA issuer arrives on).
__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// L2 eviction policies for the .L2::cache_hint forms (one instruction each, so made where they are used)
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
// One box of a 2-D tensor map (inner coordinate x = k element, outer y = weight row) into shared memory at
// dst; its bytes count down the transaction count of the mbarrier `bar`. Only weight tiles come this way.
// evict_first (MkParams.l2_evict_w): with the L2 evict-first policy, for launches that read each expert's weights
// about once; the activations (x, h, y) and the gate then stay in the L2 longer.
// The weights are k-tiled (mk_api.h: W [K / 64][rows][64]), so weight (row y, k element x) is row (x / 64) * rows + y
// of the map's [K / 64 * rows, 64] matrix: each 64 x 64 box is 8 KB of contiguous DRAM instead of 64 rows of 128
// bytes a row pitch apart (run 158: S=16 8.7, 128 10.0, 1024 8.1 µs a forward faster), and lands in shared memory
// exactly as a row-major box did. `rows` = the weight matrix's rows (E * 2I or E * H).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar,
                                            bool evict_first, int64_t rows) {
  y = (int)((x / BK) * rows + y);
  x = 0;
  if (evict_first) {
    const uint64_t pol = l2_evict_first_policy();
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
        "%3}], [%4], %5;\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(x), "r"(y), "r"(bar), "l"(pol)
        : "memory");
    return;
  }
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"((uint64_t)map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// Rows of the weight matrix a task of `kind` reads (W_gate_up: E * 2I, W_down: E * H): tma_load_2d's `rows`.
__device__ __forceinline__ int64_t weight_rows(const MkParams& p, int kind) {
  return kind == MK_TASK_GEMM1 ? p.E * 2 * p.I : p.E * p.H;
}
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)map) : "memory");
}
// Programmatic dependent launch (MkParams.pdl): a kernel launched with the programmatic-serialization attribute may
// start once every CTA of the kernel before it has run launch_dependents; wait returns once that kernel has finished
// and its writes are visible. Both are no-ops for kernels launched in plain stream order. What a predecessor wrote
// is never read through the non-coherent path (__ldg / ld.global.nc: only for data read-only while the kernel
// lives, which an overlapping predecessor breaks); run 50 read logits and routing weights so and got routing bits
// that differed from plain stream order in 3 of 410 GPU tests (k_topk_small at S = 128 .. 1024): __ldcg (L2) now.
__device__ __forceinline__ void griddep_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// The persistent kernel's entry under pdl: wait for routing before reading anything it wrote (the launch epoch,
// the counts, the lists). Run 48 also had the CTAs that start early load W_gate_up into the L2 meanwhile: the
// routing kernels' own reads queued behind those loads and the layer got slower (prefetch_mb, dropped).
// A speculative L2 prefetch of the first GEMM1 tasks' first weight stages by the CTAs before this wait (where every
// expert surely has rows in one m-tile, slot i guessed as expert i / G1's n-block; 1c7b4d1's prefetch_first_tasks)
// was no faster side by side (run 98, graph µs: S=128 311.9 / 311.5 / 312.4 vs 311.9 / 312.2 / 312.1 with 4 stages,
// 316.6-317.0 with 8; S=1024 within that process's noise): the persistent kernel starts too late under pdl for the
// DRAM to idle long before routing ends. Dropped.
__device__ __forceinline__ void pdl_enter(const MkParams& p) {
  if (p.pdl) griddep_wait();
}
constexpr int TMA_BOX_ROWS = 64;  // B tile = two boxes of 64 rows x 64 k (128 bytes a row, 8 KB each)

// The error records (err[], mk_api.h). An aborting error (report) is recorded in err[0..3], first error wins. An error
// the launch still completes correctly around (non-finite gate logits: the token's picks are valid experts, its output
// row is NaN, every other row is computed), so no wait gives up and the other tokens' rows stay right, is recorded
// without the abort in words of its own, err[MK_ERR_NOABORT..+3] (record_noabort), first such error wins. In one
// slot, its "the other rows were computed" kept a later abort of the same or a later launch (a timeout, an expert out
// of range, a full list) out of the record, and check() named it over that launch's invalid outputs; apart, the host
// names the aborting record whenever there is one, and neither record's words mix with the other's.
__device__ void record(const MkParams& p, int64_t code, int64_t where, int64_t detail, int64_t waited) {
  if (atomicCAS((unsigned long long*)p.err, 0ull, (unsigned long long)code) == 0ull) {
    p.err[1] = where;
    p.err[2] = detail;
    p.err[3] = waited;
    __threadfence_system();
  }
}
__device__ void record_noabort(const MkParams& p, int64_t code, int64_t where, int64_t detail) {
  int64_t* const r = p.err + MK_ERR_NOABORT;
  if (atomicCAS((unsigned long long*)r, 0ull, (unsigned long long)code) == 0ull) {
    r[1] = where;
    r[2] = detail;
    r[3] = 0;
    __threadfence_system();
  }
}
// The abort flag a wait polls and a report raises: the task graph's ctl word (its routing kernels lift it at the start
// of every launch), or, given (`abort`), the decode kernel's own word of its counters (mk_decode.cuh: DEC_ABORT; its
// last CTA lifts it at the end of every launch): either way a launch never starts aborted by an earlier one's error.
__device__ __forceinline__ int32_t* abort_flag(const MkParams& p, int32_t* abort) {
  return abort ? abort : &p.ctl[MK_CTL_ABORT];
}
// First error wins; the abort flag makes every other wait give up at once. (This body is the one the persistent
// kernels inline at every bounded wait: a spin and a second CAS here to let an abort replace a non-aborting record in
// one slot cost the wide wgmma kernels 8 -> 24 and 0 -> 32 bytes of stack frame, spills, in ptxas.)
__device__ void report(const MkParams& p, int64_t code, int64_t where, int64_t detail, int64_t waited,
                       int32_t* abort = nullptr) {
  record(p, code, where, detail, waited);
  atomicExch(abort_flag(p, abort), 1);
}

__device__ __forceinline__ bool mbar_try(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
// Wait for the phase of `parity` to complete; bounded like every other wait in the kernel: after the timeout
// it reports MK_ERR_PIPE_TIMEOUT (where = stage counter) and returns, and it returns at once once another
// wait has aborted the launch. The tile is garbage then, but the launch ends and the host sees the error.
// `abort`: the flag of abort_flag (null: the task graph's).
__device__ __forceinline__ void mbar_wait(const MkParams& p, uint32_t bar, uint32_t parity, uint32_t g,
                                          int32_t* abort = nullptr) {
  if (mbar_try(bar, parity)) return;
  const uint64_t since = gtime();
  while (!mbar_try(bar, parity)) {
    if (*(volatile int32_t*)abort_flag(p, abort)) return;
    const uint64_t waited = gtime() - since;
    if (waited > (uint64_t)p.timeout_ns) {
      report(p, MK_ERR_PIPE_TIMEOUT, g, parity, (int64_t)waited, abort);
      return;
    }
  }
}
// publish_all: a task's inputs, waited for by the processor itself (thread 0 spins on the readiness counter with
// acquire loads; the CTA barrier then hands what the producers published to every thread). Bounded like every
// wait: after timeout_ns it reports MK_ERR_INPUT_TIMEOUT (where = the counter's tile); an aborted launch goes on
// at once (the tile is garbage, the host sees the error). `never`: the test hook's stalled tile.
// wait_count: the calling thread's bounded wait for one counter (the decode kernel polls one slot per thread, with
// its own abort flag: `abort`, as mbar_wait's).
__device__ __forceinline__ void wait_count(const MkParams& p, const int32_t* cnt, int need, bool never, int where,
                                           int32_t* abort = nullptr) {
  if (!never && ld_acquire(cnt) >= need) return;
  const uint64_t since = gtime();
  unsigned ns = 32;
  while (never || ld_acquire(cnt) < need) {
    if (*(volatile int32_t*)abort_flag(p, abort)) break;
    const uint64_t waited = gtime() - since;
    if (waited > (uint64_t)p.timeout_ns) {
      report(p, MK_ERR_INPUT_TIMEOUT, where, need, (int64_t)waited, abort);
      break;
    }
    __nanosleep(ns);
    ns = min(ns * 2, 128u);  // a handful of counters, each polled by the few CTAs waiting on it
  }
}
__device__ __forceinline__ void wait_inputs(const MkParams& p, const int32_t* cnt, int need, bool never, int where) {
  if (threadIdx.x == 0) wait_count(p, cnt, need, never, where);
  __syncthreads();
}
// ---- the tile GEMM: acc[BM x 128] = A[BM rows, K] . B[128 rows, K]^T (bf16 in, fp32 accumulate) -------
// A row r starts at a_base + a_off[r]; B row n at b_base + b_off[n] (offset < 0: a zero row). Shared tiles
// are [rows][64] bf16 with the 16-byte chunk index XOR-swizzled by (row & 7): conflict-free for both the
// cp.async stores and the ldmatrix reads. `stages`-deep cp.async pipeline (keeps stages-1 tiles of
// weights in flight per CTA: what decode sizes, bound by reading the weights, need).
using bf16 = __nv_bfloat16;

// b_rows = 0: B row-major (b_off[n] = row * K, the routing gate); else k-tiled weights of b_rows rows (b_off[n] =
// row * 64, each k-step b_rows * 64 elements further).
template <class T>
__device__ __forceinline__ void load_stage(char* smem, int stages, int kt, const bf16* a_base, const int64_t* a_off,
                                           const bf16* b_base, const int64_t* b_off, int64_t b_rows) {
  const int tid = threadIdx.x;
  char* sA = smem + (kt % stages) * T::STAGE;
  char* sB = sA + T::A_BYTES;
  const int k0 = kt * BK;
#pragma unroll
  for (int c = tid; c < T::BM * 8; c += T::THREADS) {
    const int r = c >> 3, ch = c & 7;
    const int64_t off = a_off[r];
    cp_async16(su32(sA + (r * 8 + (ch ^ (r & 7))) * 16), a_base + (off < 0 ? 0 : off) + k0 + ch * 8, off < 0 ? 0 : 16);
  }
#pragma unroll
  for (int c = tid; c < BN * 8; c += T::THREADS) {
    const int r = c >> 3, ch = c & 7;
    const int64_t off = b_off[r], kb = b_rows ? (int64_t)kt * b_rows * BK : k0;
    cp_async16(su32(sB + (r * 8 + (ch ^ (r & 7))) * 16), b_base + (off < 0 ? 0 : off) + kb + ch * 8, off < 0 ? 0 : 16);
  }
}

// Tile column of accumulator n8 block j of warp column wn (lane's first column: + 2 * (lane & 3)). TMA tiles
// read B rows j/2 * 64 + wn * 16 + (j & 1) * 8 ..: blocks j and j + 2 are a (gate, up) pair in GEMM1.
template <class T>
__device__ __forceinline__ int b_col(int wn, int j) {
  return T::TMA ? mkidx::tma_bcol(wn, j) : wn * T::WTN + j * 8;
}

// One 64-wide k stage of the warp's tile from shared memory (ldmatrix + mma.sync).
template <class T>
__device__ __forceinline__ void mma_stage(float (&acc)[T::MT][T::NT][4], const char* sA, const char* sB, int wm,
                                          int wn, int lane) {
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    uint32_t a[T::MT][4], b[T::NT][2];
#pragma unroll
    for (int i = 0; i < T::MT; ++i) {
      const int row = wm * T::WTM + i * 16 + (lane & 15), ch = kk * 2 + (lane >> 4);
      ldsm_x4(a[i], su32(sA + (row * 8 + (ch ^ (row & 7))) * 16));
    }
#pragma unroll
    for (int j = 0; j < T::NT / 2; ++j) {
      const int row = b_col<T>(wn, 2 * j) + (lane & 7) + ((lane >> 4) << 3), ch = kk * 2 + ((lane >> 3) & 1);
      uint32_t r[4];
      ldsm_x4(r, su32(sB + (row * 8 + (ch ^ (row & 7))) * 16));
      b[2 * j][0] = r[0];
      b[2 * j][1] = r[1];
      b[2 * j + 1][0] = r[2];
      b[2 * j + 1][1] = r[3];
    }
#pragma unroll
    for (int i = 0; i < T::MT; ++i)
#pragma unroll
      for (int j = 0; j < T::NT; ++j) mma16816(acc[i][j], a[i], b[j][0], b[j][1]);
  }
}

template <class T>
__device__ __forceinline__ void gemm_tile(float (&acc)[T::MT][T::NT][4], char* smem, int stages, const bf16* a_base,
                                          const int64_t* a_off, const bf16* b_base, const int64_t* b_off, int K,
                                          int64_t b_rows = 0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN;
#pragma unroll
  for (int i = 0; i < T::MT; ++i)
#pragma unroll
    for (int j = 0; j < T::NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
  const int KT = K / BK;
  if (KT <= stages) {  // no slot is reused: every k-step's loads in flight at once (the routing GEMMs' short spans:
                       // stages - 1 ahead made H / 8 = 4 k-steps at H = 2048 wait for the first before the last issued).
                       // (One loop with KT or stages - 1 k-steps ahead does the same loads but ran k_route 0.5-0.6 µs
                       // and k_logits 0.4 µs slower, run 120.)
    for (int s = 0; s < KT; ++s) {
      load_stage<T>(smem, stages, s, a_base, a_off, b_base, b_off, b_rows);
      cp_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
      cp_wait(KT - 1 - kt);
      __syncthreads();  // tile kt landed for every thread
      const char* sA = smem + kt * T::STAGE;
      mma_stage<T>(acc, sA, sA + T::A_BYTES, wm, wn, lane);
    }
    __syncthreads();  // shared memory free for the caller
    return;
  }
  for (int s = 0; s < stages - 1; ++s) {
    if (s < KT) load_stage<T>(smem, stages, s, a_base, a_off, b_base, b_off, b_rows);
    cp_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_wait(stages - 2);
    __syncthreads();  // tile kt landed for every thread; slot (kt-1) % stages is free again
    if (kt + stages - 1 < KT) load_stage<T>(smem, stages, kt + stages - 1, a_base, a_off, b_base, b_off, b_rows);
    cp_commit();
    const char* sA = smem + (kt % stages) * T::STAGE;
    mma_stage<T>(acc, sA, sA + T::A_BYTES, wm, wn, lane);
  }
  cp_wait(0);
  __syncthreads();  // shared memory free for the caller
}

// Expert tasks of a TMA tile (T::TMA): A rows by every thread with cp.async as above; the B tile by thread 0
// as two TMA boxes (rows brow.. and brow2.., k from kb) completing on the stage's mbarrier (count 1:
// arrive.expect_tx). Stage g = it + kt (the CTA's running counter, so the barrier phases carry across
// tasks) sits in slot g % stages with parity (g / stages) & 1. Each thread still waits for its own A
// group, then the barrier, then the CTA barrier that also frees the slot of stage kt-1 for the next copy.
template <class T>
__device__ __forceinline__ void gemm_tile_tma(float (&acc)[T::MT][T::NT][4], const MkParams& p, char* smem, uint32_t bars,
                                              uint32_t& it, const bf16* a_base, const int64_t* a_off,
                                              const CUtensorMap* bmap, int brow, int brow2, int kb, int K,
                                              bool dep, const int32_t* cnt, int need, bool never, int where,
                                              int64_t wrows) {
  static_assert(T::TMA, "TMA tile");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN;
  const int stages = (int)p.stages;
#pragma unroll
  for (int i = 0; i < T::MT; ++i)
#pragma unroll
    for (int j = 0; j < T::NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
  const int KT = K / BK;
  auto issue_a = [&](int kt) {  // the A rows of stage kt (cp.async: this thread's group)
    char* sA = smem + ((it + kt) % stages) * T::STAGE;
    const int k0 = kt * BK;
#pragma unroll
    for (int c = tid; c < T::BM * 8; c += T::THREADS) {
      const int r = c >> 3, ch = c & 7;
      const int64_t off = a_off[r];
      cp_async16(su32(sA + (r * 8 + (ch ^ (r & 7))) * 16), a_base + (off < 0 ? 0 : off) + k0 + ch * 8,
                 off < 0 ? 0 : 16);
    }
  };
  auto issue_b = [&](int kt) {  // the weight tile of stage kt (thread 0: TMA on the stage's mbarrier)
    if (tid == 0) {
      const uint32_t slot = (it + kt) % stages, bar = bars + 8 * slot;
      const uint32_t sB = su32(smem + slot * T::STAGE + T::A_BYTES);
      mbar_arrive_tx(bar, T::B_BYTES);
      tma_load_2d(sB, bmap, kb + kt * BK, brow, bar, p.l2_evict_w != 0, wrows);
      tma_load_2d(sB + TMA_BOX_ROWS * 128, bmap, kb + kt * BK, brow2, bar, p.l2_evict_w != 0, wrows);
    }
  };
  if (dep) {  // publish_all: the first stages' weights need no inputs, so they stream while the task waits for them
    for (int s = 0; s < stages - 1 && s < KT; ++s) issue_b(s);
    wait_inputs(p, cnt, need, never, where);
  }
  for (int s = 0; s < stages - 1; ++s) {
    if (s < KT) {
      issue_a(s);
      if (!dep) issue_b(s);
    }
    cp_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    const uint32_t g = it + kt, slot = g % stages;
    cp_wait(stages - 2);  // this thread's A rows of stage kt landed
    mbar_wait(p, bars + 8 * slot, (g / stages) & 1, g);  // the B tile of stage kt landed
    __syncthreads();  // every thread's A rows landed; slot of stage kt-1 is free again
    if (kt + stages - 1 < KT) {
      issue_a(kt + stages - 1);
      issue_b(kt + stages - 1);
    }
    cp_commit();
    const char* sA = smem + slot * T::STAGE;
    mma_stage<T>(acc, sA, sA + T::A_BYTES, wm, wn, lane);
  }
  cp_wait(0);
  it += KT;
  __syncthreads();  // shared memory free for the caller
}

// ---- task encoding -----------------------------------------------------------------------------------
using mkidx::enc;  // kind, splits-1, expert, m-tile, n-field (nb + N * ks), tile: see mk_index.h

struct Meta {
  int64_t* a_off;
  int64_t* b_off;
  int* row_id;
  int* last;  // split-K: this CTA finished the slot's last part
};
template <class T>
__device__ __forceinline__ Meta meta(char* smem, int stages) {
  Meta m;
  m.a_off = (int64_t*)(smem + T::STAGE * stages);
  m.b_off = m.a_off + T::BM + T::XR;
  m.row_id = (int*)(m.b_off + T::BNT);
  m.last = m.row_id + T::BM + T::XR;
  return m;
}
// Shared address of the first stage mbarrier (8-byte aligned, after the metadata; TMA and wgmma tiles).
__device__ __forceinline__ uint32_t bar_base(const Meta& md) { return (su32(md.last + 4) + 7u) & ~7u; }

// Tail rows of this launch's m-tiles (MkParams.tail_rows): the tiles without a tail ring take none.
template <class T>
__device__ __forceinline__ int tail_of(const MkParams& p) {
  return T::XR ? (int)min(p.tail_rows, (int64_t)T::XR) : 0;
}

// Per-task metadata: A row offsets (token rows of x for GEMM1, (token, slot) rows of h for GEMM2) and
// B row offsets (GEMM1: interleaved gate/up rows, so each accumulator pair (c0, c1) is (gate, up) of one
// intermediate column and SwiGLU runs in registers; GEMM2: 128 rows of W_down), by threads first, first +
// stride, .. (fill_meta: the whole CTA; the overlap kernel: its producer warpgroup).
template <class T>
__device__ __forceinline__ void fill_meta_part(const MkParams& p, const Meta& md, int kind, int e, int mt, int nb, int first,
                                               int stride) {
  const int tid = first, K = (int)p.K, H = (int)p.H, I = (int)p.I;
  const int cnt = p.counts[e * MK_COUNT_STRIDE];  // written by the routing kernel (earlier in the stream)
  const int end = mkidx::tile_end(cnt, mt, T::BM, tail_of<T>(p));  // (rows BM.. : the tail, XR > 0 only)
  for (int r = tid; r < T::BM + T::XR; r += stride) {
    const int m = mt * T::BM + r;
    const int v = m < end ? p.lists[(int64_t)e * p.S_cap + m] : -1;
    md.row_id[r] = v;
    md.a_off[r] = v < 0 ? -1 : (kind == MK_TASK_GEMM1 ? (int64_t)(v / K) * H : (int64_t)v * I);
  }
  for (int n = tid; n < T::BNT; n += stride) {
    if constexpr (T::NBLK == 2) {  // the wide tile: gate rows stacked over up rows (mk_index.h: wide_gemm1_row)
      md.b_off[n] = kind == MK_TASK_GEMM1 ? ((int64_t)e * 2 * I + mkidx::wide_gemm1_row(nb, n, I)) * BK
                                          : ((int64_t)e * H + mkidx::wide_gemm2_row(nb, n)) * BK;
    } else if (kind == MK_TASK_GEMM1) {
      const int q = n >> 1;
      const int64_t row = (n & 1) ? (int64_t)I + nb * 64 + q : (int64_t)nb * 64 + q;
      md.b_off[n] = ((int64_t)e * 2 * I + row) * BK;  // (k-tiled weights: the row's first 64 k)
    } else {
      md.b_off[n] = ((int64_t)e * H + nb * BN + n) * BK;
    }
  }
}
template <class T>
__device__ __forceinline__ void fill_meta(const MkParams& p, const Meta& md, int kind, int e, int mt, int nb) {
  fill_meta_part<T>(p, md, kind, e, mt, nb, threadIdx.x, blockDim.x);
}

// y's L2 residency (MK_Y_L2): bit 0 = the GEMM2 epilogues store y with the L2 evict-last policy, bit 1 = the combine
// loads y with evict-first, bit 2 = the combine discards the y lines it read, so a dead y is never written back to
// DRAM while the next layer streams its weights. Run 142 (S=1024, y 33.5 MB): the kernel's DRAM writes 33.4 MB ->
// 24.7 with all three, the same bits; what it saves shows in back-to-back replays of one build (see
// megakernel_profile's interleaved chains). 0 builds the plain stores and loads (measurement builds).
#ifndef MK_Y_L2
#define MK_Y_L2 7
#endif
__device__ __forceinline__ void st_y16(void* dst, const uint4& v) {
  if constexpr ((MK_Y_L2 & 1) != 0) {
    const uint64_t pol = l2_evict_last_policy();
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(dst), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w), "l"(pol)
                 : "memory");
  } else {
    *reinterpret_cast<uint4*>(dst) = v;
  }
}
__device__ __forceinline__ void st_y4(void* dst, __nv_bfloat162 v) {
  if constexpr ((MK_Y_L2 & 1) != 0) {
    const uint64_t pol = l2_evict_last_policy();
    asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;\n" ::"l"(dst), "r"(*reinterpret_cast<uint32_t*>(&v)),
                 "l"(pol)
                 : "memory");
  } else {
    *reinterpret_cast<__nv_bfloat162*>(dst) = v;
  }
}
__device__ __forceinline__ uint4 ld_y16(const uint4* src) {
  if constexpr ((MK_Y_L2 & 2) != 0) {
    const uint64_t pol = l2_evict_first_policy();
    uint4 v;
    asm volatile("ld.global.cg.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(src), "l"(pol));
    return v;
  } else {
    return __ldcg(src);
  }
}

// Epilogue of one accumulator pair: row r of the tile (its (token, slot) id v >= 0), tile column c (even).
// GEMM1: (c0, c1) = (gate, up) of intermediate column nb*64 + c/2 -> h = silu(gate) * up (bf16). The division is
// __fdividef (a reciprocal and a multiply; 0 once 1 + exp(-gate) passes 2^126, where |silu| < 1e-36): the IEEE
// `/` is a subroutine of a dozen instructions per element, and 128 of them per thread kept the GEMM1 epilogue
// 4+ us long (run 25: S=1024 437 -> 400 us, S=4096 993 -> 934 us).
// GEMM2: columns nb*128 + c, c+1 of y = acc * w (bf16), w = the row's routing weight, which the caller loads ONCE
// per row (loaded here, each pair's load had to follow the previous pair's y store, which may alias it; run 20:
// the wide-tile layer 2% faster from S=1024 with the load hoisted).
__device__ __forceinline__ void store_pair(const MkParams& p, int kind, int nb, int v, int c, float c0, float c1,
                                           float w) {
  if (kind == MK_TASK_GEMM1) {
    ((bf16*)p.h)[(int64_t)v * p.I + nb * 64 + (c >> 1)] = __float2bfloat16(__fdividef(c0, 1.f + __expf(-c0)) * c1);
  } else {
    st_y4((bf16*)p.y + (int64_t)v * p.H + nb * BN + c, __floats2bfloat162_rn(c0 * w, c1 * w));
  }
}
__device__ __forceinline__ float row_weight(const MkParams& p, int kind, int v) {
  return kind == MK_TASK_GEMM2 ? __ldcg(p.topk_w + v) : 0.f;  // L2, not .nc: see griddep_wait
}

// GEMM1 epilogue of a TMA tile (gate rows 0..63, up rows 64..127): gate columns q, q+1 (g0, g1) and their up
// columns (u0, u1) -> h columns nb*64 + q, q+1; the same arithmetic as store_pair's, so the same bits.
__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ uint32_t silu_pair(float g0, float g1, float u0, float u1) {
  return bf2_bits(__floats2bfloat162_rn(__fdividef(g0, 1.f + __expf(-g0)) * u0, __fdividef(g1, 1.f + __expf(-g1)) * u1));
}
__device__ __forceinline__ void store_h2(const MkParams& p, int nb, int v, int q, float g0, float g1, float u0,
                                         float u1) {
  *(uint32_t*)((bf16*)p.h + (int64_t)v * p.I + nb * 64 + q) = silu_pair(g0, g1, u0, u1);
}

// After the epilogue's stores, by threads first, first + stride, .. that all passed a barrier following every
// store of the task: the readiness counters. GEMM1: thread 0 alone, one counter. GEMM2: each thread counts its
// share of the rows in their combine tiles (one thread walking all 128 rows sat on the consumers' critical path,
// run 20's timeline: GEMM2 tasks 2-2.5x GEMM1's time per k stage). Every counting thread fences first: fence +
// relaxed red = release, cumulative over the barrier, so the subscriber's or a waiter's acquire sees h / y.
template <class T>
__device__ __forceinline__ void signal_rows(const MkParams& p, const Meta& md, int kind, int tile, int first,
                                            int stride) {
  if (kind == MK_TASK_GEMM1) {
    if (first == 0) {
      __threadfence();
      red_add(&p.g1done[tile], T::NBLK);  // a wide task finishes two 128-column n-blocks
    }
    return;
  }
  const int rows_per_ct = (int)p.K * (int)p.combine_tokens;  // (v / K) / combine_tokens, in one division
  bool fenced = false;
  for (int r = first; r < T::BM + T::XR; r += stride) {
    const int v = md.row_id[r];
    if (v < 0) continue;
    if (!fenced) {
      __threadfence();
      fenced = true;
    }
    red_add(&p.comb[v / rows_per_ct], T::NBLK);
  }
}
// The same over a whole CTA whose threads all passed a __syncthreads after their stores.
template <class T>
__device__ __forceinline__ void signal_done(const MkParams& p, const Meta& md, int kind, int tile) {
  signal_rows<T>(p, md, kind, tile, threadIdx.x, blockDim.x);
}

// GEMM1 / GEMM2 task of m-tile `tile` = (e, mt), n-block nb, split-K part ks of `splits` (mma.sync core).
// Split-K (decode, bm=16): part ks covers k in [ks, ks+1) * K/splits; each part stores its fp32
// accumulators in its own place of p.sk_part, then counts itself in p.sk_cnt[slot]; the CTA that counts
// last adds the parts in part order 0, 1, .., splits-1 (whatever order they finished in: bit-identical
// results run to run) and runs the epilogue and the readiness signal. The other parts signal nothing.
template <class T>
__device__ void run_gemm(const MkParams& p, char* smem, int kind, int e, int mt, int nb, int tile, int ks, int splits,
                         uint32_t& it, const CUtensorMap* tm1, const CUtensorMap* tm2, int qi) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN;
  const int H = (int)p.H, I = (int)p.I;
  const int stages = (int)p.stages;
  Meta md = meta<T>(smem, stages);
  fill_meta<T>(p, md, kind, e, mt, nb);
  __syncthreads();
  float acc[T::MT][T::NT][4];
  const int Kfull = kind == MK_TASK_GEMM1 ? H : I, Kpart = Kfull / splits, k0 = ks * Kpart;
  // publish_all: a GEMM2 waits here for its m-tile's GEMM1s (the TMA tile after starting its first weight stages)
  const bool dep = p.publish_all && kind == MK_TASK_GEMM2;
  const int32_t* cnt = p.g1done + tile;  // (always a valid address: run 15 read through a conditional null pointer)
  const int need = (int)(2 * p.I / BN);
  if constexpr (T::TMA) {  // B boxes: GEMM1 gate rows, up rows; GEMM2 128 consecutive rows of W_down[e]
    const int brow = kind == MK_TASK_GEMM1 ? (int)(e * 2 * p.I + nb * 64) : (int)(e * p.H + nb * BN);
    const int brow2 = kind == MK_TASK_GEMM1 ? brow + I : brow + TMA_BOX_ROWS;
    const bf16* a_base = (kind == MK_TASK_GEMM1 ? (const bf16*)p.x : (const bf16*)p.h) + k0;
    gemm_tile_tma<T>(acc, p, smem, bar_base(md), it, a_base, md.a_off, kind == MK_TASK_GEMM1 ? tm1 : tm2, brow, brow2,
                     k0, Kpart, dep, cnt, need, tile == (int)p.stall_tile, tile, weight_rows(p, kind));
  } else {
    if (dep) wait_inputs(p, cnt, need, tile == (int)p.stall_tile, tile);  // (cp.async tiles: nothing streams first)
    const int64_t rows = weight_rows(p, kind);  // k-tiled: k0 is k0 / 64 planes in
    const bf16* w = (kind == MK_TASK_GEMM1 ? (const bf16*)p.w1 : (const bf16*)p.w2) + (int64_t)(k0 / BK) * rows * BK;
    gemm_tile<T>(acc, smem, stages, (kind == MK_TASK_GEMM1 ? (const bf16*)p.x : (const bf16*)p.h) + k0, md.a_off, w,
                 md.b_off, Kpart, rows);
  }

  if (tid == 0) tr_slot(p, qi, MK_TR_MAIN, (int64_t)gtime());  // qi: thread 0's queue slot (timeline)
  if constexpr (T::BM == 16) if (splits > 1) {  // decode tiles only (the scheduler splits nothing else):
    // the larger tiles keep their register budget (bm=128 is launch-bounded to 128 for 2 CTAs/SM)
    const int N1 = (int)(2 * p.I / BN), N2 = (int)(p.H / BN);
    const int slot = mkidx::sk_slot(kind == MK_TASK_GEMM2, tile, nb, N1, N2, (int)p.sk_max_tiles);
    float* part = p.sk_part;
    const int stride = (int)(p.split_k1 > p.split_k2 ? p.split_k1 : p.split_k2);  // parts room per slot
#pragma unroll
    for (int i = 0; i < T::MT; ++i)
#pragma unroll
      for (int j = 0; j < T::NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          __stcg(part + mkidx::sk_index(slot, ks, (i * T::NT + j) * 4 + c, tid, T::THREADS, T::NACC, stride),
                 acc[i][j][c]);
    __syncthreads();  // every part stored before thread 0's fence + count
    if (tid == 0) {
      __threadfence();  // release, cumulative over the barrier: this CTA's part before its count
      const bool last = atomicAdd(&p.sk_cnt[slot], 1) == splits - 1;
      if (last) __threadfence();  // acquire: the count read, then this fence, then the barrier, then every thread's
      *md.last = last;            // reads of the other parts (they fenced before counting); as wait_inputs' order
    }
    __syncthreads();
    if (!*md.last) return;  // uniform: another part's CTA finishes the slot
#pragma unroll
    for (int i = 0; i < T::MT; ++i)
#pragma unroll
      for (int j = 0; j < T::NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int q = (i * T::NT + j) * 4 + c;
          float sum = __ldcg(part + mkidx::sk_index(slot, 0, q, tid, T::THREADS, T::NACC, stride));
          for (int z = 1; z < splits; ++z)  // fixed order: reproducible bits
            sum += __ldcg(part + mkidx::sk_index(slot, z, q, tid, T::THREADS, T::NACC, stride));
          acc[i][j][c] = sum;
        }
  }

#pragma unroll
  for (int i = 0; i < T::MT; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * T::WTM + i * 16 + (lane >> 2) + half * 8;
      const int v = md.row_id[r];
      if (v < 0) continue;
      if (T::TMA && kind == MK_TASK_GEMM1) {  // blocks j (gate) and j + 2 (up) hold the same h columns
#pragma unroll
        for (int j = 0; j < 2; ++j)
          store_h2(p, nb, v, b_col<T>(wn, j) + 2 * (lane & 3), acc[i][j][2 * half], acc[i][j][2 * half + 1],
                   acc[i][j + 2][2 * half], acc[i][j + 2][2 * half + 1]);
        continue;
      }
      const float w = row_weight(p, kind, v);
#pragma unroll
      for (int j = 0; j < T::NT; ++j)
        store_pair(p, kind, nb, v, b_col<T>(wn, j) + 2 * (lane & 3), acc[i][j][2 * half], acc[i][j][2 * half + 1], w);
    }
  __syncthreads();  // every thread's stores issued before thread 0's fence + signal
  signal_done<T>(p, md, kind, tile);
}

// ---- the wgmma core (sm_90a): GEMM1/GEMM2 tasks with bm = 64 or 128 ---------------------------------------
// Warp-specialised: warpgroup 0 is the producer (128 threads copy A = gathered token rows and B = 128
// weight rows into the swizzled stage tiles with cp.async), warpgroups 1..BM/64 are consumers (each owns
// 64 rows of the tile: wgmma m64n128k16, four per 64-wide k stage, fp32 accumulators in registers).
// Stages hand over through mbarriers: full[s] (count 128: every producer thread arrives once its own
// cp.async group for the stage has landed AND it has run fence.proxy.async.shared::cta, so its
// generic-proxy writes are visible to the async proxy the wgmma reads through), empty[s] (count 128 per
// consumer warpgroup: each consumer thread arrives once the wgmmas that read the stage have completed).
// Producer and consumers walk one running stage counter `it` across the CTA's tasks, so the barrier
// phases never need re-initialising. Each producer thread keeps up to stages-1 of its own groups in flight.
//
// The wide tile (BNT = 256, MkParams.bn = 256; bm = 128 only): 128 rows x 256 columns per task, twice the
// FLOP per L2 byte of 128 x 128 (run 10: the bm=64 x 128 core moved ~7 GB through L2 per S=4096 layer, at
// about the L2's bandwidth). Same roles: two consumer warpgroups, each m64n256k16 (128 fp32 accumulators a
// thread), one producer; a stage is A 16 KB + B 32 KB = 48 KB, so <= 4 stages fit. B rows are stacked gate
// over up (mk_index.h: wide_gemm1_row) for cp.async and TMA alike: the (gate, up) pair of an h column is
// registers i and i + 64 of one thread. The scheduler keeps its 128-column n-blocks: a wide task runs n-blocks
// nb (even) and nb + 1 and counts both, so the readiness thresholds are the 128-column tile's.
// Measurement builds only (the library is built without it): MK_PROBE bit 0 = the wgmma tiles' producer issues no
// loads (stages are published empty), bit 1 = their consumers issue no wgmma (they wait for and free the stages).
// Outputs are garbage; the task timeline then shows what the loads alone and the wgmmas alone cost (run 41). Bit 2 =
// no A rows (the gathered x / h cp.async copies), bit 3 = no B tile (the TMA weight boxes): which of the two draws the
// power under the 700 W cap (run 137). Bit 4 = every TMA weight box from expert 0 (9.4 MB, kept in the L2, no
// evict-first): the same L2 -> shared-memory bytes without the weights' DRAM reads.
#ifndef MK_PROBE
#define MK_PROBE 0
#endif

// 0: no tail ring in any tile (the wide tile as before tail rows, for side-by-side builds; tail_rows then does nothing)
#ifndef MK_TAIL_RING
#define MK_TAIL_RING 1
#endif
template <int BM_, bool TMA_ = false, int BNT_ = 128>
struct WgTile {
  static constexpr int BM = BM_, CONSUMERS = BM / 64, THREADS = 128 * (1 + CONSUMERS);
  static constexpr int BNT = BNT_, NBLK = BNT / BN;  // tile columns (B rows), 128-column n-blocks per task
  static constexpr int NACC = BNT / 2;                // fp32 accumulators per consumer thread (m64 x BNT)
  static_assert(BNT == 128 || (BNT == 256 && BM == 128), "wide tile: bm = 128 only");
  // TMA: producer thread 0 loads each stage's B tile as two boxes (mbarrier.expect_tx on full[s]: the 128
  // arrivals stay the producer threads' A rows); GEMM1's tile is then gate rows 0..63, up rows 64..127.
  static constexpr bool TMA = TMA_;
  static constexpr int MINB = 1;  // bm=64: 2 CTAs/SM still fit by shared memory at <= 4 stages (launch bound 1
                                  // keeps the consumers' 64 accumulators + descriptors off the spill path)
  // XR: rows an m-tile may hold past BM (MkParams.tail_rows, the wide tile only). Their A rows sit in a 2 KB ring
  // at the end of each stage (X_OFF), computed by mma.sync from the consumer warps beside their wgmmas (tail_mainloop)
  static constexpr int XR = MK_TAIL_RING && NBLK == 2 && TMA_ ? 16 : 0;
  static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BNT * BK * 2, X_OFF = A_BYTES + B_BYTES;
  static constexpr int STAGE = X_OFF + XR * BK * 2;
  static constexpr int META = (BM + XR) * 8 + BNT * 8 + (BM + XR) * 4 + 16 + 2 * 8 * 16;  // + full/empty barriers
  static constexpr bool WG = true;
  static constexpr int ALIGN = 1024;  // the 128-byte swizzle needs 1024-byte aligned tiles
  static_assert(A_BYTES % 1024 == 0 && STAGE % 1024 == 0, "stage tiles must stay 1024-byte aligned");
};
using WgLarge = WgTile<64>;  // 256 threads: 1 producer + 1 consumer warpgroup
using WgHuge = WgTile<128>;  // 384 threads: 1 producer + 2 consumer warpgroups
using WgLargeTma = WgTile<64, true>;  // the same with B by TMA (opt-in: MkParams.tma_b)
using WgHugeTma = WgTile<128, true>;
using WgWide = WgTile<128, false, 256>;   // bn = 256: 384 threads, 128 x 256 per task (opt-in: MkParams.bn)
using WgWideTma = WgTile<128, true, 256>;  // the same with B by TMA (four 64-row boxes per stage)

__device__ __forceinline__ char* align_smem(char* smem, int align) {
  if (!align) return smem;
  const uint32_t a = su32(smem);
  return smem + ((align - (a & (align - 1))) & (align - 1));
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void acc_fence(float (&d)[N]) {  // keep the compiler from moving accumulator accesses
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// D[64 x 128] (+)= A[64 x 16] . B[128 x 16]^T, both K-major in shared memory (descriptors), fp32 accumulate.
// scale_d = 0 ignores D's old value (the first k step of a tile).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 256] (+)= A[64 x 16] . B[256 x 16]^T: the wide tile's consumer step (128 accumulators a thread).
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, "
      "%128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_tile(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  wgmma_m64n128k16(d, da, db, scale_d);
}
__device__ __forceinline__ void wgmma_tile(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  wgmma_m64n256k16(d, da, db, scale_d);
}

template <class T>
struct WgBars {
  uint32_t full, empty;  // shared addresses of full[0], empty[0] (8 bytes apart per stage)
};
template <class T>
__device__ __forceinline__ WgBars<T> wg_bars(const Meta& md) {
  const uint32_t b = bar_base(md);
  return {b, b + 8u * 16u};
}

// Column blocks per combine tile: the tile's work is split over H so the combine at the end of the layer
// (on the critical path) runs on many CTAs (run 2: 16-token combine tasks cost 46 us at S=128 over 4-token ones).
__host__ __device__ __forceinline__ int combine_blocks(int64_t H) { return (H / 8) % 4 == 0 ? 4 : 1; }

// COMBINE task: out[t] = sum_j y[t*K + j] in slot order (fp32), for the tile's tokens, column block cb, on
// threads first, first + stride, .. (the whole CTA, or the overlap kernel's consumer warpgroups).
// One item = one token's 8 columns: K 16-byte loads of y, summed in slot order, one 16-byte store. y was written
// long before (it is 134 MB at S=4096: mostly from DRAM), so a combine task is bound by how many loads each thread
// has in flight. With top-k 8 (KK = 8) all 8 loads of an item are issued before its first add (the compiler's own
// unrolling kept 4 in flight: run 33, 2.9-3.1 instead of 3.8-3.9 us per task at S=1024-4096; two items' 16 loads
// spilled 576 bytes in the wide kernels); any other K runs the general loop below.
__device__ __forceinline__ void combine_add(float (&s)[8], const uint4& v) {
  const __nv_bfloat162* b = (const __nv_bfloat162*)&v;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(b[q]);
    s[2 * q] += f.x;
    s[2 * q + 1] += f.y;
  }
}
__device__ __forceinline__ uint4 combine_out(const float (&s)[8]) {
  uint4 o;
  __nv_bfloat162* ob = (__nv_bfloat162*)&o;
#pragma unroll
  for (int q = 0; q < 4; ++q) ob[q] = __floats2bfloat162_rn(s[2 * q], s[2 * q + 1]);
  return o;
}
template <int KK>
__device__ __forceinline__ void combine_items(const MkParams& p, int t0, int c0, int chunks, int n, int first, int stride) {
  const bf16* y = (const bf16*)p.y;
  bf16* out = (bf16*)p.out;
  const int H = (int)p.H;
  // warp-uniform rounds (first is a multiple of 32 plus the lane, stride a multiple of 32): with MK_Y_L2 bit 2 the 8
  // lanes that read a 128-byte line of y are done with it at the __syncwarp, and the first of them discards it, but
  // only a line this task and this round read whole: chunks c..c+7 of one token inside the task's column block
  // (c - c0 + 8 <= chunks) on lanes lane..lane+7 (lane <= 24). Where chunks = H/32 is a multiple of 8 (H % 256 == 0)
  // that is every line; where H % 256 == 128 a line may straddle two column blocks' tasks or two rounds, and the
  // other reader would find it discarded (undefined bytes). schedule.combine_discards mirrors this predicate.
  const int lane = threadIdx.x & 31;
  for (int i0 = first - lane; i0 < n; i0 += stride) {
    const int i = i0 + lane;
    const bool on = i < n;
    const int t = t0 + i / chunks, c = c0 + i % chunks;
    const uint4* src = (const uint4*)(y + (int64_t)t * KK * H + c * 8);
    if (on) {
      uint4 v[KK];
#pragma unroll
      for (int j = 0; j < KK; ++j) v[j] = ld_y16(src + (int64_t)j * (H / 8));
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < KK; ++j) combine_add(acc, v[j]);  // slot order
      *(uint4*)(out + (int64_t)t * H + c * 8) = combine_out(acc);
    }
    if constexpr ((MK_Y_L2 & 4) != 0) {
      __syncwarp();
      if (on && (c & 7) == 0 && c - c0 + 8 <= chunks && lane <= 24)
#pragma unroll
        for (int j = 0; j < KK; ++j)
          asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(src + (int64_t)j * (H / 8)) : "memory");
    }
  }
}
__device__ void run_combine_part(const MkParams& p, int ct, int cb, int first, int stride) {
  const int K = (int)p.K, H = (int)p.H;
  const int t0 = ct * (int)p.combine_tokens;
  const int t1 = min((int)p.S, t0 + (int)p.combine_tokens);
  const int chunks = H / 8 / combine_blocks(H), c0 = cb * chunks, n = (t1 - t0) * chunks;
  if (K == 8) {
    combine_items<8>(p, t0, c0, chunks, n, first, stride);
    return;
  }
  const bf16* y = (const bf16*)p.y;
  bf16* out = (bf16*)p.out;
  for (int i = first; i < n; i += stride) {
    const int t = t0 + i / chunks, c = c0 + i % chunks;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < K; ++j)  // (evict-first where y was stored evict-last; this path discards nothing)
      combine_add(acc, ld_y16((const uint4*)(y + ((int64_t)t * K + j) * H + c * 8)));
    *(uint4*)(out + (int64_t)t * H + c * 8) = combine_out(acc);
  }
}

__device__ __forceinline__ void run_combine(const MkParams& p, int ct, int cb) {
  run_combine_part(p, ct, cb, threadIdx.x, blockDim.x);
}

using mkidx::tile_expert;  // expert owning an m-tile (mk_index.h)

// Split-K parts for a GEMM of this launch (schedule.splits mirrors it): decode tiles (bm = 16) only, and
// only when the launch's m-tiles fit the partial-sum buffer (p.sk_max_tiles).
__device__ __forceinline__ int sk_splits(const MkParams& p, int64_t want, int n_tiles, int bm) {
  return (want > 1 && bm == 16 && n_tiles <= p.sk_max_tiles) ? (int)want : 1;
}

// ---- cross-task overlap (MkParams.overlap = 1; the wgmma tiles only) ----------------------------------------------
// k_experts_ov<T> runs the same tasks, the same stage pipeline and the same epilogue arithmetic as k_experts<T>, with
// the roles split across tasks as well as within them:
//   producer warpgroup (128 threads): its thread 0 waits until task slot s = j & 1 is free (tempty[s]: the consumers
//     finished task j - 2), claims the next queue slot (claim_task: k_experts' protocol, timeouts and abort), and
//     writes the task word into the slot; the warpgroup (named barrier 1) fills the slot's metadata (GEMM tasks),
//     then each thread arrives on tfull[s] (count 128: release of its own writes) and, for a GEMM task, copies the
//     task's stages (wg_produce: publish-before-wait, all stages published on return). Then it claims task j + 1,
//     while the consumers still run task j's last stages and epilogue.
//     Order that matters: the producer publishes EVERY stage of task j before it claims task j + 1. The queue slot
//     it claims may hold a task that waits for task j (a GEMM2 of the m-tile task j is a GEMM1 of): if task j's
//     last stages were still unpublished while the producer spins on that slot, neither would ever move.
//   consumer warpgroups (128 x CONSUMERS threads): wait tfull[s], agree (bar.red.and on named barrier 2) that the
//     wait succeeded, read the task word: 0 = end of work -> return; COMBINE -> free the slot, run the combine on
//     the consumer threads (run_combine_part), next; GEMM -> wgmma stages (wg_consume) + epilogue, named barrier 2
//     (every consumer's stores issued), the consumer threads fence and count (signal_rows: the same
//     counters as signal_done), every consumer thread arrives on tempty[s] (count 128 x CONSUMERS).
//   No __syncthreads inside the loop. End of work: the producer hands the consumers task word 0 and returns.
//   Abort / timeout: every wait is bounded; a failed tfull wait ends every consumer together (the vote), a failed
//     tempty wait or claim makes the producer hand over word 0 and return. A consumer waits for a task up to twice
//     the timeout, so a producer spinning on an unpublished queue slot reports MK_ERR_PROC_TIMEOUT first, as today.
template <class T>
struct OvSlot {  // one task slot: fill_meta's arrays and the task word
  int64_t a_off[T::BM + T::XR];
  int64_t b_off[T::BNT];
  int row_id[T::BM + T::XR];
  uint64_t task;
  int qi;  // its queue slot (timeline stamps)
};
// Bytes of the staged epilogue (overlap kernel): per consumer warp 16 rows x 64 columns of bf16 (2 KB).
template <class T>
constexpr int stage_out_bytes() {
  if constexpr (T::WG) return T::CONSUMERS * 4 * 2048;
  return 0;
}
// Shared memory after the stages: two task slots, then full[16], empty[16], tfull[2], tempty[2] (8 bytes each), then
// (128-byte aligned) the consumer warps' epilogue buffers (wg_store_staged).
template <class T>
constexpr int ov_meta_bytes() { return 2 * (int)sizeof(OvSlot<T>) + 8 * (16 + 16 + 2 + 2) + 8 + 128 + stage_out_bytes<T>(); }

// Registers per thread of a warpgroup from here on (all its warps run it): the tail tile's producer gives registers
// to its consumers (128 x 56 + 256 x 224 <= 384 x 168, what the launch holds). 56, not 40: at 40 the producer had to
// read its A row offsets from shared memory every stage, and each stage's loads issued later (run 124: the layer
// 20 us slower at S=1024 than without the tail ring, 66 at 4096).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
constexpr int TAIL_PRODUCER_REGS = 56, TAIL_CONSUMER_REGS = 224;

__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
// bar.sync on barrier `id` of n threads that also returns the AND of every participant's `ok` (uniform result).
__device__ __forceinline__ bool named_sync_and(int id, int n, bool ok) {
  uint32_t r;
  asm volatile(
      "{\n.reg .pred a, b;\nsetp.ne.u32 a, %1, 0;\nbar.red.and.pred b, %2, %3, a;\nselp.u32 %0, 1, 0, b;\n}\n"
      : "=r"(r)
      : "r"((uint32_t)ok), "r"(id), "r"(n)
      : "memory");
  return r != 0;
}
// mbar_wait that says whether the phase completed (false: the launch aborted, or this wait timed out after
// `timeout` ns and reported MK_ERR_PIPE_TIMEOUT).
__device__ __forceinline__ bool mbar_wait_ok(const MkParams& p, uint32_t bar, uint32_t parity, uint32_t g,
                                             int64_t timeout) {
  if (mbar_try(bar, parity)) return true;
  const uint64_t since = gtime();
  while (!mbar_try(bar, parity)) {
    if (*(volatile int32_t*)&p.ctl[MK_CTL_ABORT]) return false;
    const uint64_t waited = gtime() - since;
    if (waited > (uint64_t)timeout) {
      report(p, MK_ERR_PIPE_TIMEOUT, g, parity, (int64_t)waited);
      return false;
    }
  }
  return true;
}
// k_experts' claim by one thread: the next queue slot (claim_task), waited for until published (the task word), past
// the task total or aborted (0), or timed out (0 after reporting MK_ERR_PROC_TIMEOUT). *slot: the queue slot.
// Measurement builds: MK_SLOT_POLL_NS = the longest back-off between polls, MK_SLOT_POLL_EVERY = polls of the flag per
// look at the total, the abort flag and the clock (each a round trip to the L2 of its own).
#ifndef MK_SLOT_POLL_NS
#define MK_SLOT_POLL_NS 512
#endif
#ifndef MK_SLOT_POLL_EVERY
#define MK_SLOT_POLL_EVERY 1
#endif
__device__ __forceinline__ uint64_t wait_slot(const MkParams& p, int epoch, int i, int* slot) {
  uint64_t task = 0;
  *slot = i;
  const uint64_t since = gtime();
  unsigned ns = 32;
  for (unsigned n = 0;; ++n) {
    if (i < p.q_cap && ld_acquire(&p.q_flag[i]) == epoch) {
      task = *(volatile uint64_t*)&p.q_task[i];
      if (p.trace) {
        tr_slot(p, i, MK_TR_CLAIM, (int64_t)gtime());
        tr_slot(p, i, MK_TR_CTA, blockIdx.x);
      }
      break;
    }
    if (n % MK_SLOT_POLL_EVERY == 0) {
      const int tot = ld_acquire(&p.ctl[MK_CTL_TOTAL]);
      if (tot > 0 && i >= tot - 1) break;
      if (*(volatile int32_t*)&p.ctl[MK_CTL_ABORT]) break;
      const uint64_t waited = gtime() - since;
      if (waited > (uint64_t)p.timeout_ns) {
        report(p, MK_ERR_PROC_TIMEOUT, i, tot - 1, (int64_t)waited);
        break;
      }
    }
    __nanosleep(ns);
    ns = min(ns * 2, (unsigned)MK_SLOT_POLL_NS);  // back off: hundreds of waiting CTAs must not crowd the L2 lines they poll
  }
  return task;
}
__device__ __forceinline__ uint64_t claim_task(const MkParams& p, int epoch, int* slot) {
  return wait_slot(p, epoch, atomicAdd(&p.ctl[MK_CTL_HEAD], 1), slot);
}

// The producer warpgroup's part of one GEMM task (thread t of warpgroup 0; md: the task's metadata, it: the
// running stage counter at the task's first stage): copy KT stages, each as soon as its slot is free. A thread's
// A rows (and the B rows of the cp.async tiles) arrive on full[s] when they land (cp.async.mbarrier.arrive.noinc),
// so the producer never waits for its own copies (run 41: it used to wait for stage kt - stages + 1 before taking
// slot kt, and the S=4096 experts kernel took 852 instead of 743 us). Returns with every stage of the task issued:
// the consumers can finish the task without the producer. (Asking the L2 for the task's next 2-8 weight k-steps ahead of
// these copies, the first at the claim, was slower at every S: S=1024 +76..+98 µs, 4096 +32..+62; run 129, b56f1b5.)
template <class T>
__device__ __forceinline__ void wg_produce(const MkParams& p, const Meta& md, const WgBars<T>& bars, uint32_t s0, int kind,
                                           int e, int nb, int KT, uint32_t it, int t, const CUtensorMap* tm1,
                                           const CUtensorMap* tm2) {
  const int stages = (int)p.stages;
  // ---- producer: thread t copies chunk (t & 7) of rows (t >> 3) + 16 q, for A and B ----
  const bf16* a_base = kind == MK_TASK_GEMM1 ? (const bf16*)p.x : (const bf16*)p.h;
  const bf16* b_base = kind == MK_TASK_GEMM1 ? (const bf16*)p.w1 : (const bf16*)p.w2;
  const int ch = t & 7, r0 = t >> 3;
  // A rows 16 q + r0 of the tile (tail tiles: and tail row r0, AQ = 9), chunk ch of each
  static_assert(!T::XR || (T::TMA && T::XR == 16), "tail rows: one row per 8 producer threads, B by TMA");
  constexpr int AQ = T::BM / 16 + (T::XR ? 1 : 0), BQ = T::TMA ? 1 : T::BNT / 16;
  const bf16* asrc[AQ];
  int abytes[AQ];
  const bf16* bsrc[BQ];
#pragma unroll
  for (int q = 0; q < AQ; ++q) {
    const int64_t off = md.a_off[r0 + 16 * q];
    asrc[q] = a_base + (off < 0 ? 0 : off) + ch * 8;
    abytes[q] = off < 0 ? 0 : 16;  // rows past the expert's count: zero-filled
  }
  if constexpr (!T::TMA) {
#pragma unroll
    for (int q = 0; q < T::BNT / 16; ++q) bsrc[q] = b_base + md.b_off[r0 + 16 * q] + ch * 8;
  }
  bool tail = false;  // this task's m-tile has tail rows (rows fill in order: row BM is the first)
  if constexpr (T::XR > 0) tail = md.row_id[T::BM] >= 0;
  // TMA: the B tile's two boxes start at weight rows brow and brow2 (GEMM1: gate, up; GEMM2: 128 rows)
  const CUtensorMap* bmap = kind == MK_TASK_GEMM1 ? tm1 : tm2;
  const int we = MK_PROBE & 16 ? 0 : e;  // the expert whose weight boxes load
  const int brow = kind == MK_TASK_GEMM1 ? (int)(we * 2 * p.I + nb * 64) : (int)(we * p.H + nb * BN);
  const int brow2 = kind == MK_TASK_GEMM1 ? brow + (int)p.I : brow + TMA_BOX_ROWS;
  // wide tile: four boxes, box b at tile row 64 b from weight row wbase + wide_box_row (gate, gate, up, up
  // for GEMM1; 256 consecutive rows for GEMM2)
  const int64_t wbase = kind == MK_TASK_GEMM1 ? we * 2 * p.I : we * p.H;
  const int64_t wrows = weight_rows(p, kind);  // the k-tiled weights' rows
  for (int kt = 0; kt < KT; ++kt) {
    const uint32_t g = it + kt, slot = g % stages;
    mbar_wait(p, bars.empty + 8 * slot, ((g / stages) & 1) ^ 1, g);  // a fresh barrier passes parity 1 at once
    const uint32_t sA = s0 + slot * T::STAGE, sB = sA + T::A_BYTES;
    if constexpr (T::TMA && !(MK_PROBE & 9)) {
      if (t == 0) {  // expect_tx before the copies: thread 0's own arrival (later) keeps the phase open until then
        const uint32_t full = bars.full + 8 * slot;
        mbar_expect_tx(full, T::B_BYTES);
        if constexpr (T::NBLK == 2) {
#pragma unroll
          for (int b = 0; b < 4; ++b)
            tma_load_2d(sB + b * TMA_BOX_ROWS * 128, bmap, kt * BK,
                        (int)(wbase + mkidx::wide_box_row(kind == MK_TASK_GEMM2, nb, b, p.I)), full,
                        p.l2_evict_w != 0 && !(MK_PROBE & 16), wrows);
        } else {
          tma_load_2d(sB, bmap, kt * BK, brow, full, p.l2_evict_w != 0 && !(MK_PROBE & 16), wrows);
          tma_load_2d(sB + TMA_BOX_ROWS * 128, bmap, kt * BK, brow2, full,
                      p.l2_evict_w != 0 && !(MK_PROBE & 16), wrows);
        }
      }
    }
    if constexpr (!(MK_PROBE & 5)) {
#pragma unroll
      for (int q = 0; q < T::BM / 16; ++q)
        cp_async16(sA + mkidx::swz_off(r0 + 16 * q, ch * 8), asrc[q] + kt * BK, abytes[q]);
      if constexpr (T::XR > 0) {
        if (tail)  // tail row r0 into the stage's ring (zero-filled past the m-tile's rows)
          cp_async16(sA + (T::X_OFF + mkidx::swz_off(r0, ch * 8)), asrc[AQ - 1] + kt * BK, abytes[AQ - 1]);
      }
      if constexpr (!T::TMA) {
#pragma unroll
        for (int q = 0; q < T::BNT / 16; ++q)  // k-tiled weights: k-step kt is kt planes of wrows x 64 further
          cp_async16(sB + mkidx::swz_off(r0 + 16 * q, ch * 8), bsrc[q] + (int64_t)kt * wrows * BK, 16);
      }
    }
    cp_arrive_noinc(bars.full + 8 * slot);  // this thread's arrival on full[s], made when its copies have landed
  }
}

// Consumer warpgroup c's part of one GEMM task (thread t): rows 64c .. 64c+63, wgmma from the stages, each stage
// released once its wgmmas completed, then the epilogue from registers (h / y stores; no signal here).
// stmatrix .x4: four 8x8 b16 matrices, register i of every thread holds its (row lane/4, columns 2 (lane%4), +1)
// of matrix i, which is the wgmma accumulator fragment's layout; lane l gives the address of row l%8 of matrix l/8.
__device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}


// Epilogue through shared memory (the overlap kernel): the warp's 16 rows go out in chunks of 64 columns. Four
// stmatrix.x4 put a chunk into the warp's 2 KB buffer (row r at r * 128, its 16-byte unit u at (u ^ (r & 7)) * 16:
// no bank conflicts either way), then every lane copies 16-byte units to global memory, so a warp store writes four
// whole 128-byte row segments (the fragment's own stores write 16 bytes of each of 8 rows: 4-8x the store
// instructions; run 25's timeline: 2-4.4 us per task from mainloop done to stores issued). The values are
// computed as the direct path computes them, so the outputs are the same bits.
// GEMM1 (gate rows over up rows: the TMA and wide tiles): P(half, j) = silu pair of registers i, i+1 and i+UP,
// i+UP+1 (i = 4j + 2 half) -> h columns nb*64 + 8j + .., GEMM2: (d[i], d[i+1]) * w -> y columns nb*128 + 8j + ..
template <class T, bool G1>
__device__ __forceinline__ void wg_store_staged(const MkParams& p, const Meta& md, int nb, int t, int c,
                                                const float (&d)[T::NACC], const float (&wrow)[2], uint32_t stg) {
  constexpr int UP = T::NACC / 2;
  constexpr int JN = G1 ? T::NACC / 8 : T::NACC / 4;  // 8-column groups of the output row
  static_assert(JN % 8 == 0, "whole 64-column chunks");
  const int lane = t & 31, w = t >> 5;
  const uint32_t buf = stg + (uint32_t)(c * 4 + w) * 2048u;
  const int row0 = 64 * c + 16 * w;
  const uint32_t rr = mkidx::stsm_row(lane);  // the row whose address this lane gives to stmatrix
#pragma unroll
  for (int ch = 0; ch < JN / 8; ++ch) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      uint32_t r[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // matrix q: half q & 1, 8-column group j
        const int j = (int)mkidx::stsm_group(ch, m, q), i = 4 * j + 2 * (q & 1);
        if constexpr (G1)
          r[q] = silu_pair(d[i], d[i + 1], d[i + UP], d[i + UP + 1]);
        else
          r[q] = bf2_bits(__floats2bfloat162_rn(d[i] * wrow[q & 1], d[i + 1] * wrow[q & 1]));
      }
      stsm_x4(buf + mkidx::stage_out_off(rr, mkidx::stsm_unit(m, lane)), r[0], r[1], r[2], r[3]);
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int row = (lane >> 3) + 4 * k, u = lane & 7, v = md.row_id[row0 + row];  // (read here: registers)
      if (v < 0) continue;
      uint4 val;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(buf + mkidx::stage_out_off(row, u)));
      if constexpr (G1)
        *reinterpret_cast<uint4*>((bf16*)p.h + (int64_t)v * p.I + nb * 64 + ch * 64 + u * 8) = val;
      else
        st_y16((bf16*)p.y + (int64_t)v * p.H + nb * BN + ch * 64 + u * 8, val);
    }
    __syncwarp();  // the buffer is rewritten by the next chunk
  }
}

// ---- tail rows (T::XR = 16, the wide tile on the overlap kernel) ----
// Consumer warp w8 = 4c + warp (0..7) computes the tail's 16 rows x 32 of the 256 tile columns on mma.sync m16n8k16
// (four n8 blocks, 16 fp32 accumulators), A from the stage's ring, B from the stage's wgmma tile: GEMM1 gate columns
// 16 w8 .. +15 (blocks 0, 1) and their up columns 128 + 16 w8 .. (blocks 2, 3), so a thread holds (gate, up) pairs;
// GEMM2 columns 32 w8 .. +31. Blocks 2q, 2q + 1 are 8 columns apart: one ldmatrix.x4 per k16 step gives both.
__device__ __forceinline__ int tail_bcol(bool g1, int w8, int q) { return g1 ? 128 * q + 16 * w8 : 32 * w8 + 16 * q; }
// One stage (64 k) of the warp's tail tile; sX: the stage's ring, sB: its B tile (both 128-byte swizzled: swz_off).
__device__ __forceinline__ void tail_mma_stage(float (&x)[4][4], uint32_t sX, uint32_t sB, bool g1, int w8, int lane) {
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    uint32_t a[4];  // rows lane & 15, k 8 (lane >> 4) of this k16 step: a0..a3 of the m16n8k16 A fragment
    ldsm_x4(a, sX + mkidx::swz_off(lane & 15, kk * 16 + 8 * (lane >> 4)));
#pragma unroll
    for (int q = 0; q < 2; ++q) {  // lanes 0-7 / 8-15: block 2q at k 0-7 / 8-15; lanes 16-31: block 2q + 1
      uint32_t b[4];
      const int row = tail_bcol(g1, w8, q) + (lane & 7) + ((lane >> 4) << 3);
      ldsm_x4(b, sB + mkidx::swz_off(row, kk * 16 + 8 * ((lane >> 3) & 1)));
      mma16816(x[2 * q], a, b[0], b[1]);
      mma16816(x[2 * q + 1], a, b[2], b[3]);
    }
  }
}
// The tail's epilogue from the fragments (16 rows: stores straight from registers). Accumulator i of block j: row
// (lane >> 2) + 8 (i >> 1), column 2 (lane & 3) + (i & 1) of the block. xw: GEMM2's weights of the two rows.
__device__ __forceinline__ void tail_store(const MkParams& p, const int* row_id, int kind, int nb, int w8, int lane,
                                           const float (&x)[4][4], const float (&xw)[2]) {
  const bool g1 = kind == MK_TASK_GEMM1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int v = row_id[(lane >> 2) + 8 * half];
    if (v < 0) continue;
    const int i = 2 * half, c2 = 2 * (lane & 3);
    if (g1) {  // gate block j, up block j + 2: h columns nb*64 + 16 w8 + 8 j + c2, +1
#pragma unroll
      for (int j = 0; j < 2; ++j)
        store_h2(p, nb, v, 16 * w8 + 8 * j + c2, x[j][i], x[j][i + 1], x[j + 2][i], x[j + 2][i + 1]);
    } else {  // y columns nb*128 + 32 w8 + 8 j + c2, +1
      __nv_bfloat162* yrow = (__nv_bfloat162*)((bf16*)p.y + (int64_t)v * p.H + nb * BN + 32 * w8 + c2);
#pragma unroll
      for (int j = 0; j < 4; ++j) st_y4(yrow + 4 * j, __floats2bfloat162_rn(x[j][i] * xw[half], x[j][i + 1] * xw[half]));
    }
  }
}
// The wide consumers' k loop with the tail (both warpgroups busy: a tail rides in a full m-tile): each stage's wgmmas
// are issued, then the warp's tail mma.sync run while they execute, then the stage is freed once both are done.
template <class T>
__device__ __forceinline__ void tail_mainloop(const MkParams& p, const WgBars<T>& bars, uint32_t s0, bool g1, int KT,
                                              uint32_t it, int c, int w8, int lane, float (&d)[T::NACC],
                                              float (&x)[4][4]) {
  const int stages = (int)p.stages;
  for (int kt = 0; kt < KT; ++kt) {
    const uint32_t g = it + kt, slot = g % stages;
    mbar_wait(p, bars.full + 8 * slot, (g / stages) & 1, g);
    fence_proxy_async();  // the producers' cp.async rows (generic proxy) before the wgmmas read them (async proxy)
    const uint32_t st = s0 + slot * T::STAGE, sA = st + c * 64 * 128, sB = st + T::A_BYTES;
    acc_fence(d);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
      wgmma_tile(d, mkidx::wg_desc(sA + kk * 32), mkidx::wg_desc(sB + kk * 32), kt > 0 || kk > 0);
    wg_commit();
    acc_fence(d);
    tail_mma_stage(x, st + T::X_OFF, sB, g1, w8, lane);
    wg_wait<0>();
    acc_fence(d);
    mbar_arrive(bars.empty + 8 * slot);  // (the ldmatrix reads are done: the mma.sync consumed them)
  }
}

// (Partial m-tiles computed transposed, the weight rows as wgmma's M and the m-tile's rows as N = rows rounded up to
// 16 (two m64nN wgmmas a warpgroup per k16 step): the same bits as this path, but slower at every S, S=4096 +43 µs
// and 1024 +43 with N up to 112 (run 133, 887b44d): its tasks took longer on fewer FLOPs, S=4096's GEMM1 tasks of
// 65-127 rows 29.3 µs against 26.9.)
// XT: the overlap kernel's tail tiles (T::XR > 0; setmaxnreg gives the consumers the registers for x).
template <class T, bool XT = false>
__device__ __forceinline__ void wg_consume(const MkParams& p, const Meta& md, const WgBars<T>& bars, uint32_t s0, int kind,
                                           int nb, int KT, uint32_t it, int t, int c, int qi, uint32_t stg = 0) {
  static_assert(!XT || (T::XR == 16 && T::CONSUMERS == 2), "tail rows: the wide tile");
  const int stages = (int)p.stages;
  float d[T::NACC];
#pragma unroll
  for (int i = 0; i < T::NACC; ++i) d[i] = 0.f;
  // Rows are filled in order, so a warpgroup whose first row is padding has nothing to compute: it only passes
  // the stages on (waits full, frees empty), and the other warpgroup's wgmmas get the SM's tensor cores alone.
  // (Uniform per warpgroup, as the .sync.aligned wgmma instructions need.)
  const bool busy = md.row_id[64 * c] >= 0;
  // GEMM2: the routing weights of this thread's two rows, loaded before the mainloop (off the epilogue's path)
  float wrow[2] = {0.f, 0.f};
  if (kind == MK_TASK_GEMM2) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int v = md.row_id[64 * c + (int)mkidx::acc_row(t, 2 * half)];
      if (v >= 0) wrow[half] = __ldcg(p.topk_w + v);  // L2, not .nc: see griddep_wait
    }
  }
  if (!busy) {  // each arrival lands in that fill's phase: the producer refilled the slot after the last phase
    for (int kt = 0; kt < KT; ++kt) {
      const uint32_t g = it + kt, slot = g % stages;
      mbar_wait(p, bars.full + 8 * slot, (g / stages) & 1, g);
      mbar_arrive(bars.empty + 8 * slot);
    }
    return;  // every row padding: no stores
  }
  // tail rows: this m-tile holds rows past BM (then both warpgroups are busy); their fragments and GEMM2 weights
  float x[4][4] = {}, xw[2] = {0.f, 0.f};
  const int w8 = 4 * c + (t >> 5), lane = t & 31;
  const bool tail = XT && md.row_id[T::BM] >= 0;
  if constexpr (XT) {
    if (tail && kind == MK_TASK_GEMM2) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int v = md.row_id[T::BM + (lane >> 2) + 8 * half];
        if (v >= 0) xw[half] = __ldcg(p.topk_w + v);
      }
    }
  }
  if (tail) {  // (a branch outside the k loop: a test inside it would make ptxas serialise the wgmmas, C7518)
    if constexpr (XT) tail_mainloop<T>(p, bars, s0, kind == MK_TASK_GEMM1, KT, it, c, w8, lane, d, x);
  } else for (int kt = 0; kt < KT; ++kt) {
    const uint32_t g = it + kt, slot = g % stages;
    mbar_wait(p, bars.full + 8 * slot, (g / stages) & 1, g);
    fence_proxy_async();  // the producers' cp.async rows (generic proxy) before the wgmmas read them (async proxy)
    const uint32_t sA = s0 + slot * T::STAGE + c * 64 * 128, sB = s0 + slot * T::STAGE + T::A_BYTES;
    acc_fence(d);
    wg_fence();
    if constexpr (!(MK_PROBE & 2)) {
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma_tile(d, mkidx::wg_desc(sA + kk * 32), mkidx::wg_desc(sB + kk * 32), kt > 0 || kk > 0);
    }
    wg_commit();
    acc_fence(d);
    if constexpr (T::CONSUMERS >= 2) {
      wg_wait<0>();  // this stage's wgmmas are done: hand its slot back now, not once the next stage has landed
      acc_fence(d);  // (the other consumer warpgroup's wgmmas keep the tensor cores busy meanwhile)
      mbar_arrive(bars.empty + 8 * slot);
    } else {
      wg_wait<1>();  // one consumer warpgroup: keep a stage in flight; the previous stage's wgmmas are done
      if (kt > 0) mbar_arrive(bars.empty + 8 * ((g - 1) % stages));
    }
  }
  wg_wait<0>();
  acc_fence(d);
  if (T::CONSUMERS < 2 && KT > 0) mbar_arrive(bars.empty + 8 * ((it + KT - 1) % stages));
  if (c == 0 && t == 0) tr_slot(p, qi, MK_TR_MAIN, (int64_t)gtime());  // timeline: mainloop done
  if (stg && (kind == MK_TASK_GEMM2 || T::TMA || T::NBLK == 2)) {  // staged (overlap kernel; stacked GEMM1 tiles)
    if (kind == MK_TASK_GEMM1)
      wg_store_staged<T, true>(p, md, nb, t, c, d, wrow, stg);
    else
      wg_store_staged<T, false>(p, md, nb, t, c, d, wrow, stg);
    if constexpr (XT) {
      if (tail) tail_store(p, md.row_id + T::BM, kind, nb, w8, lane, x, xw);
    }
    if (c == 0 && t == 0) tr_slot(p, qi, MK_TR_EPI, (int64_t)gtime());
    return;
  }
  // (XT: never here; the overlap kernel's wide tile always takes the staged epilogue above)
  // epilogue straight from the fragment (mk_index.h: acc_row / acc_col)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 64 * c + (int)mkidx::acc_row(t, 2 * half);
    const int v = md.row_id[r];
    if (v < 0) continue;
    if (kind == MK_TASK_GEMM1) {
      if constexpr (T::TMA || T::NBLK == 2) {
        // gate column cc sits in register i, its up column cc + BNT/2 in register i + NACC/2 of the same thread
        // (64 + 32 for the 128-column tile, 128 + 64 for the wide one: gate rows stacked over up rows)
        constexpr int UP = T::NACC / 2;
#pragma unroll
        for (int j = 0; j < T::NACC / 8; ++j) {
          const int i = 4 * j + 2 * half;
          store_h2(p, nb, v, (int)mkidx::acc_col(t, i), d[i], d[i + 1], d[i + UP], d[i + UP + 1]);
        }
      } else {  // interleaved (gate, up) columns: cp.async narrow tile
#pragma unroll
        for (int j = 0; j < T::NACC / 4; ++j) {
          const int i = 4 * j + 2 * half;
          store_pair(p, kind, nb, v, (int)mkidx::acc_col(t, i), d[i], d[i + 1], 0.f);
        }
      }
      continue;
    }
    // GEMM2: y row v, columns nb*128 + acc_col (store_pair's arithmetic), the row's routing weight loaded above
    const float w = wrow[half];
    __nv_bfloat162* yrow = (__nv_bfloat162*)((bf16*)p.y + (int64_t)v * p.H + nb * BN);
#pragma unroll
    for (int j = 0; j < T::NACC / 4; ++j) {
      const int i = 4 * j + 2 * half;
      st_y4(yrow + (mkidx::acc_col(t, i) >> 1), __floats2bfloat162_rn(d[i] * w, d[i + 1] * w));
    }
  }
  if (c == 0 && t == 0) tr_slot(p, qi, MK_TR_EPI, (int64_t)gtime());  // timeline: its epilogue stores issued
}


// One GEMM task on the whole CTA (overlap = 0): metadata, then producer and consumers as above, then the signal.
template <class T>
__device__ void run_gemm_wg(const MkParams& p, char* smem, int kind, int e, int mt, int nb, int tile, uint32_t& it,
                            const CUtensorMap* tm1, const CUtensorMap* tm2, int qi) {
  const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127;
  Meta md = meta<T>(smem, (int)p.stages);
  const WgBars<T> bars = wg_bars<T>(md);
  fill_meta<T>(p, md, kind, e, mt, nb);
  __syncthreads();
  const int KT = (kind == MK_TASK_GEMM1 ? (int)p.H : (int)p.I) / BK;
  if (wg == 0)
    wg_produce<T>(p, md, bars, su32(smem), kind, e, nb, KT, it, t, tm1, tm2);
  else
    wg_consume<T>(p, md, bars, su32(smem), kind, nb, KT, it, t, wg - 1, qi);
  it += KT;
  __syncthreads();  // every consumer's stores issued (and the producer done) before thread 0's fence + signal
  signal_done<T>(p, md, kind, tile);
}

// ---- the launch's queue shape ---------------------------------------------------------------------------
// base[] (exclusive prefix of m-tiles per expert, base[E] = all m-tiles) from the routing counts, by warp 0 (each
// lane a contiguous run of experts, then a scan); the caller synchronises before reading it.
template <class T>
__device__ void tile_prefix(const MkParams& p, int* base) {
  const int lane = threadIdx.x & 31, E = (int)p.E, bm = T::BM, tail = tail_of<T>(p);
  const int per = (E + 31) / 32, e0 = lane * per, e1 = min(E, e0 + per);
  int sum = 0;
  for (int e = e0; e < e1; ++e) sum += mkidx::expert_tiles(p.counts[e * MK_COUNT_STRIDE], bm, tail);
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(~0u, incl, o);
    if (lane >= o) incl += n;
  }
  int run = incl - sum;
  for (int e = e0; e < e1; ++e) {
    base[e] = run;
    run += mkidx::expert_tiles(p.counts[e * MK_COUNT_STRIDE], bm, tail);
  }
  if (lane == 31) base[E] = incl;
}
// What every role derives from base[]: tasks per m-tile, split-K parts, the totals.
struct QueueShape {
  int n_tiles, n_ct, NC, KS1, KS2, G1, G2;  // G1 / G2: GEMM1 / GEMM2 tasks per m-tile
  int64_t total;
  bool fits;  // within the queue and counter buffers (else MK_ERR_QUEUE_FULL)
};
template <class T>
__device__ QueueShape queue_shape(const MkParams& p, const int* base) {
  QueueShape q;
  q.n_tiles = base[p.E];
  q.n_ct = (int)((p.S + p.combine_tokens - 1) / p.combine_tokens);
  q.NC = combine_blocks(p.H);
  // split-K parts of each GEMM1 / GEMM2 task (1 = none): decode tiles only, and only while the m-tiles fit
  // the partial-sum buffer (sk_splits: the same rule as schedule.splits)
  q.KS1 = sk_splits(p, p.split_k1, q.n_tiles, T::BM);
  q.KS2 = sk_splits(p, p.split_k2, q.n_tiles, T::BM);
  // the wide tile (T::NBLK = 2) runs two 128-column n-blocks per task: half the GEMM tasks, n-field = even nb
  // (never split: split-K is for bm = 16 only, so the n-field is nb itself)
  q.G1 = (int)(2 * p.I / BN) / T::NBLK * q.KS1;
  q.G2 = (int)(p.H / BN) / T::NBLK * q.KS2;
  q.total = (int64_t)q.n_tiles * (q.G1 + q.G2) + (int64_t)q.n_ct * q.NC;
  q.fits = q.total <= p.q_cap && q.n_tiles <= p.max_tiles && q.n_ct <= p.max_ctiles;
  return q;
}

// publish_all on the mma-core tiles: the queue is a function of the routing counts alone, so a processor claims the
// next slot (atomicAdd, as claim_task) and computes its word itself (mk_index.h: queue_word, the word the
// scheduler also writes) instead of waiting for the scheduler to count, publish, fence and flag it: that handoff
// took ~6 us at the start of every launch (run 20 timeline). 0: past the total, the queue does not fit, or aborted.
// local_word: the word of claimed slot i computed from the m-tile prefix (no publish), with its timeline stamps.
template <class T>
__device__ __forceinline__ uint64_t local_word(const MkParams& p, const int* base, const QueueShape& q, int i) {
  if (p.trace) {
    const int64_t now = (int64_t)gtime();
    tr_slot(p, i, MK_TR_PUB, now);  // (no publish: computed at the claim)
    tr_slot(p, i, MK_TR_CLAIM, now);
    tr_slot(p, i, MK_TR_CTA, blockIdx.x);
  }
  return mkidx::queue_word(i, base, (int)p.E, q.G1, q.KS1, q.G2, q.KS2, q.NC, T::NBLK);
}
template <class T>
__device__ __forceinline__ uint64_t claim_local(const MkParams& p, const int* base, const QueueShape& q, int* slot) {
  const int i = atomicAdd(&p.ctl[MK_CTL_HEAD], 1);
  *slot = i;
  if (!q.fits || i >= q.total || *(volatile int32_t*)&p.ctl[MK_CTL_ABORT]) return 0;
  return local_word<T>(p, base, q, i);
}

// The overlap kernel's claim with MK_WG_LOCAL_G1: slots below g1_local (every GEMM1 task: the scheduler publishes them
// all at once, a function of the routing counts alone) get their word computed here from the m-tile prefix, as
// claim_local does for the mma-core tiles, instead of waiting for the scheduler to count, publish, fence and flag
// them (run 47's timeline: the first GEMM1 published 4.4 us after the scheduler started at S=1024, 6.1 at 4096).
// Later slots (GEMM2 / COMBINE, published as they become ready) are waited for as before. Run 54 (builds side by
// side, two rounds, graph us): S=1024 365.1 / 364.5 against 368.4 / 367.6 with -DMK_WG_LOCAL_G1=0.
#ifndef MK_WG_LOCAL_G1
#define MK_WG_LOCAL_G1 1
#endif
template <class T>
__device__ __forceinline__ uint64_t claim_wg(const MkParams& p, int epoch, const int* base, const QueueShape& q,
                                             int g1_local, int* slot) {
  const int i = atomicAdd(&p.ctl[MK_CTL_HEAD], 1);
  if (i >= g1_local) return wait_slot(p, epoch, i, slot);
  *slot = i;
  if (*(volatile int32_t*)&p.ctl[MK_CTL_ABORT]) return 0;
  return local_word<T>(p, base, q, i);
}

// ---- the scheduler CTA ----------------------------------------------------------------------------------
// MK_SUB_BATCH: readiness counters each subscriber lane loads together per batch (1: one at a time, as before run 140).
#ifndef MK_SUB_BATCH
#define MK_SUB_BATCH 4
#endif
// The subscriber's batch (MK_SUB_BATCH = SW counters a lane): entries b + 32 u + lane below n not yet released
// (rel[] != epoch) load their counters together, relaxed (one round trip for the batch, not one per entry).
template <int SW>
__device__ __forceinline__ void load_batch(const int32_t* cnt, const int32_t* rel, int epoch, int b, int n, int lane,
                                           bool (&un)[SW], int (&v)[SW]) {
#pragma unroll
  for (int u = 0; u < SW; ++u) {
    const int i = b + 32 * u + lane;
    un[u] = i < n && rel[i] != epoch;
  }
#pragma unroll
  for (int u = 0; u < SW; ++u) v[u] = un[u] ? ld_relaxed(cnt + (b + 32 * u + lane)) : 0;
}
// ... and its flags: one fence for the warp's batch (acquire for the counters read, release for the task words
// written), then relaxed flag stores for the `tasks` queue slots from pos[u] of each entry published (rd[u]).
template <int SW>
__device__ __forceinline__ void flag_batch(const MkParams& p, int epoch, unsigned any, const bool (&rd)[SW],
                                           const int (&pos)[SW], int tasks) {
  if (!any) return;
  __threadfence();
#pragma unroll
  for (int u = 0; u < SW; ++u) {
    if (!rd[u]) continue;
    for (int k = 0; k < tasks; ++k) st_relaxed(&p.q_flag[pos[u] + k], epoch);
    tr_published(p, pos[u], pos[u] + tasks, 1);
  }
}

template <class T>
__device__ void scheduler(const MkParams& p, char* smem, int epoch) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int E = (int)p.E, K = (int)p.K;
  const int N1 = (int)(2 * p.I / BN), N2 = (int)(p.H / BN);
  const int CT = (int)p.combine_tokens;
  if (tid == 0) tr_sched(p, MK_TR_SCHED_START);
  int* base = (int*)smem;  // [E + 1]
  if (warp == 0) tile_prefix<T>(p, base);
  __syncthreads();
  const QueueShape q = queue_shape<T>(p, base);
  const int n_tiles = q.n_tiles, n_ct = q.n_ct, NC = q.NC, KS1 = q.KS1, KS2 = q.KS2, G2 = q.G2;
  constexpr int W = T::NBLK;
  const int g1 = n_tiles * q.G1;
  const int64_t total = q.total;
  if (!q.fits) {
    if (tid == 0) report(p, MK_ERR_QUEUE_FULL, total, p.q_cap, 0);
    return;
  }
  if (tid == 0) {
    p.ctl[MK_CTL_TILES] = n_tiles;
    st_release(&p.ctl[MK_CTL_TOTAL], (int)total + 1);
  }
  // every GEMM1 task is ready at once (routing finished before this launch). publish_all (mma-core tiles): every
  // task at once, GEMM2 tile-major after the GEMM1s and the COMBINEs last; a processor waits for a task's inputs
  // itself (after starting its weight loads), which cannot deadlock: a task waits only for tasks in earlier queue
  // slots, and slots are claimed in order by resident CTAs, so those are all claimed and never wait on later ones.
  const bool all_now = p.publish_all && !T::WG;
  const int n_pub = all_now ? (int)total : g1;
  // Release in batches: task words, then ONE fence per thread, then relaxed flag stores (a release per
  // flag would serialise a full fence per task: measured ~100 us per layer in run 1).
  for (int c0 = 0; c0 < n_pub; c0 += (int)blockDim.x * 8) {
    const int hi = min(n_pub, c0 + (int)blockDim.x * 8);
    for (int i = c0 + tid; i < hi; i += blockDim.x)  // n-field = nb + N1 * ks (mk_index.h: queue_word)
      p.q_task[i] = mkidx::queue_word(i, base, E, N1 / W * KS1, KS1, G2, KS2, NC, W);
    __threadfence();
    for (int i = c0 + tid; i < hi; i += blockDim.x) st_relaxed(&p.q_flag[i], epoch);
    tr_published(p, c0 + tid, hi, blockDim.x);
  }
  if (tid == 0) tr_sched(p, MK_TR_SCHED_G1);
  if (all_now) {
    if (tid == 0) {
      p.ctl[MK_CTL_PUBLISHED] = (int)total;
      tr_sched(p, MK_TR_SCHED_END);
    }
    return;
  }
  if (warp != 0) return;
  // subscriber: poll the readiness counters, publish what became ready; fail after timeout_ns without progress
  constexpr int SW = MK_SUB_BATCH;  // counters a lane loads at once
  int tail = g1, released = 0;
  const int need = n_tiles + n_ct;
  uint64_t since = gtime();
  int32_t* rel_ct = p.rel + p.max_tiles;
  long long seen = -1;  // sum of the unreleased counters last sweep: any change counts as progress
  while (released < need) {
    int got = 0;
    long long sum = 0;
    // Each lane's SW entries of a batch load their counters together (load_batch; run 128's timeline at S=4096: a
    // sweep of 25 acquire loads in turn took ~24 us), then one fence per batch orders them before the flags (flag_batch).
    for (int b = 0; b < n_tiles; b += 32 * SW) {
      bool un[SW], rd[SW];
      int v[SW], pos[SW];
      load_batch<SW>(p.g1done, p.rel, epoch, b, n_tiles, lane, un, v);
      unsigned any = 0;
#pragma unroll
      for (int u = 0; u < SW; ++u) {
        const int tile = b + 32 * u + lane;
        sum += v[u];
        rd[u] = un[u] && v[u] == N1 && tile != (int)p.stall_tile;
        const unsigned m = __ballot_sync(~0u, rd[u]);
        pos[u] = tail + __popc(m & ((1u << lane) - 1)) * G2;
        if (rd[u]) {
          const int e = tile_expert(base, E, tile);
          p.rel[tile] = epoch;
          for (int nf = 0; nf < G2; ++nf)
            p.q_task[pos[u] + nf] = enc(MK_TASK_GEMM2, e, tile - base[e], nf * W, tile, KS2);
        }
        tail += __popc(m) * G2;
        got += __popc(m);
        any |= m;
      }
      flag_batch<SW>(p, epoch, any, rd, pos, G2);
    }
    for (int b = 0; b < n_ct; b += 32 * SW) {
      bool un[SW], rd[SW];
      int v[SW], pos[SW];
      load_batch<SW>(p.comb, rel_ct, epoch, b, n_ct, lane, un, v);
      unsigned any = 0;
#pragma unroll
      for (int u = 0; u < SW; ++u) {
        const int ct = b + 32 * u + lane;
        const int ntok = min((int)p.S, (ct + 1) * CT) - ct * CT;
        sum += v[u];
        rd[u] = un[u] && v[u] == ntok * K * N2;
        const unsigned m = __ballot_sync(~0u, rd[u]);
        pos[u] = tail + __popc(m & ((1u << lane) - 1)) * NC;
        if (rd[u]) {
          rel_ct[ct] = epoch;
          for (int cb = 0; cb < NC; ++cb) p.q_task[pos[u] + cb] = enc(MK_TASK_COMBINE, 0, ct, cb, 0);
        }
        tail += __popc(m) * NC;
        got += __popc(m);
        any |= m;
      }
      flag_batch<SW>(p, epoch, any, rd, pos, NC);
    }
    released += got;
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
    if (got || sum != seen) {
      since = gtime();
      seen = sum;
    } else {
      if (*(volatile int32_t*)&p.ctl[MK_CTL_ABORT]) return;
      const uint64_t waited = gtime() - since;
      if (waited > (uint64_t)p.timeout_ns) {
        if (lane == 0) report(p, MK_ERR_SCHED_TIMEOUT, released, need, (int64_t)waited);
        return;
      }
      __nanosleep(64);
    }
  }
  if (lane == 0) {
    p.ctl[MK_CTL_PUBLISHED] = tail;
    tr_sched(p, MK_TR_SCHED_END);
  }
}

// ---- the persistent kernel ------------------------------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(T::THREADS, T::MINB)
    k_experts(const MkParams p, const __grid_constant__ CUtensorMap tm1, const __grid_constant__ CUtensorMap tm2) {
  // tm1 / tm2: the k-tiled W_gate_up as [H/64 * E*2I, 64] and W_down as [I/64 * E*H, 64] (bf16, 64 x 64 boxes,
  // 128-byte swizzle; tma_load_2d maps (k, row) to them); read
  // only by TMA tiles (T::TMA), zeros otherwise
  extern __shared__ __align__(128) char smem_raw[];
  __shared__ uint64_t s_task;
  __shared__ int s_qi;  // the task's queue slot, for the timeline stamps of other threads
  // publish_all with E <= LOCAL_MAX_E: the m-tile prefix (claim_local). Static shared memory counts against every
  // CTA: 129 ints still let the 4-stage decode tile keep 3 CTAs per SM (2 KB for E = 512 would not)
  __shared__ int s_base[LOCAL_MAX_E + 1];
  char* smem = align_smem(smem_raw, T::ALIGN);
  pdl_enter(p);  // pdl: routing may still run until here
  const int epoch = p.ctl[MK_CTL_EPOCH];  // bumped by the routing kernel before this launch
  if (blockIdx.x == 0) {
    scheduler<T>(p, smem, epoch);
    return;
  }
  uint32_t it = 0;  // wgmma core and TMA tiles: running k-stage counter (mbarrier phases) across this CTA's tasks
  if constexpr (T::WG) {
    if (threadIdx.x == 0) {
      const WgBars<T> b = wg_bars<T>(meta<T>(smem, (int)p.stages));
      for (int s = 0; s < (int)p.stages; ++s) {
        mbar_init(b.full + 8 * s, 128);
        mbar_init(b.empty + 8 * s, 128 * T::CONSUMERS);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  } else if constexpr (T::TMA) {
    if (threadIdx.x == 0) {
      const uint32_t b = bar_base(meta<T>(smem, (int)p.stages));
      for (int s = 0; s < (int)p.stages; ++s) mbar_init(b + 8 * s, 1);  // thread 0's arrive.expect_tx + the bytes
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  if constexpr (T::TMA) {
    if (threadIdx.x == 0) {  // the descriptors are read by every copy: fetch them early
      tma_prefetch_desc(&tm1);
      tma_prefetch_desc(&tm2);
    }
  }
  if (threadIdx.x == 0) tr_cta(p, 0);
  // publish_all (the mma-core tiles): every processor derives the queue from the counts (claim_local)
  const bool local = p.publish_all && !T::WG && p.E <= LOCAL_MAX_E;
  QueueShape qs = {};
  if (local) {
    if (threadIdx.x < 32) tile_prefix<T>(p, s_base);
    __syncthreads();
    qs = queue_shape<T>(p, s_base);
  }
  int qi = -1;  // thread 0: the queue slot of the current task (timeline stamps)
  for (;;) {
    if (threadIdx.x == 0) {
      s_task = local ? claim_local<T>(p, s_base, qs, &qi) : claim_task(p, epoch, &qi);  // 0: no more work
      s_qi = qi;
    }
    __syncthreads();
    const uint64_t task = s_task;
    const int slot = s_qi;
    __syncthreads();  // everyone read s_task before thread 0 may overwrite it
    if (task == 0) {
      if (threadIdx.x == 0) tr_cta(p, 1);
      return;
    }
    const int kind = mkidx::t_kind(task), e = mkidx::t_expert(task), mt = mkidx::t_mtile(task);
    const int nf = mkidx::t_nfield(task), tile = mkidx::t_tile(task), splits = mkidx::t_splits(task);
    if (kind == MK_TASK_COMBINE) {
      if (p.publish_all && !T::WG) {  // its tokens' GEMM2 rows, waited for here (see the scheduler)
        const int ct = (int)p.combine_tokens, ntok = min((int)p.S, (mt + 1) * ct) - mt * ct;
        wait_inputs(p, p.comb + mt, ntok * (int)p.K * (int)(p.H / BN), false, mt);
      }
      run_combine(p, mt, nf);
    } else {
      const int N = kind == MK_TASK_GEMM1 ? (int)(2 * p.I / BN) : (int)(p.H / BN);
      if constexpr (T::WG)
        run_gemm_wg<T>(p, smem, kind, e, mt, nf, tile, it, &tm1, &tm2, slot);  // never split (split-K: bm=16 only)
      else
        run_gemm<T>(p, smem, kind, e, mt, nf % N, tile, nf / N, splits, it, &tm1, &tm2, slot);
    }
    if (threadIdx.x == 0) tr_slot(p, qi, MK_TR_DONE, (int64_t)gtime());  // GEMM: after its signal
  }
}

// The overlap kernel (MkParams.overlap = 1, wgmma tiles): see "cross-task overlap" above for the protocol.
template <class T>
__global__ void __launch_bounds__(T::THREADS, T::MINB)
    k_experts_ov(const MkParams p, const __grid_constant__ CUtensorMap tm1, const __grid_constant__ CUtensorMap tm2) {
  static_assert(T::WG, "the overlap kernel runs the wgmma core only");
  extern __shared__ __align__(128) char smem_raw[];
  __shared__ int s_base[LOCAL_MAX_E + 1];  // MK_WG_LOCAL_G1: the m-tile prefix (claim_wg; in SMEM_MAX's 1 KB reserve)
  char* smem = align_smem(smem_raw, T::ALIGN);
  pdl_enter(p);  // pdl: routing may still run until here
  const int epoch = p.ctl[MK_CTL_EPOCH];  // bumped by the routing kernel before this launch
  if (blockIdx.x == 0) {
    scheduler<T>(p, smem, epoch);
    return;
  }
  const int stages = (int)p.stages;
  const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127;
  constexpr int NCONS = 128 * T::CONSUMERS;  // consumer threads (named barrier 2)
  OvSlot<T>* slots = (OvSlot<T>*)(smem + T::STAGE * stages);
  const uint32_t b0 = (su32(slots + 2) + 7u) & ~7u;
  const WgBars<T> bars = {b0, b0 + 8u * 16u};
  const uint32_t tfull = b0 + 8u * 32u, tempty = tfull + 16u;
  const uint32_t stg = (tempty + 16u + 127u) & ~127u;  // epilogue buffers
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(bars.full + 8 * s, 128);
      mbar_init(bars.empty + 8 * s, NCONS);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(tfull + 8 * s, 128);     // every producer thread, after its metadata writes
      mbar_init(tempty + 8 * s, NCONS);  // every consumer thread, after its last read of the slot
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    tr_cta(p, 0);
  }
  const bool local = MK_WG_LOCAL_G1 && p.E <= LOCAL_MAX_E;
  if (local && tid >= 32 && tid < 64) tile_prefix<T>(p, s_base);  // (warp 1: warp 0's thread 0 inits the barriers)
  __syncthreads();  // (before the loop only)
  QueueShape qs = {};
  int g1_local = 0;  // slots below: GEMM1 words computed at the claim (claim_wg)
  if (local) {
    qs = queue_shape<T>(p, s_base);
    if (qs.fits) g1_local = qs.n_tiles * qs.G1;
  }
  if constexpr (T::TMA) {
    if (tid == 0) {
      tma_prefetch_desc(&tm1);
      tma_prefetch_desc(&tm2);
    }
  }
  const uint32_t s0 = su32(smem);
  uint32_t it = 0;  // running k-stage counter: the producer and the consumers see the same task sequence
  if constexpr (T::XR > 0) {  // the tail's fragments: registers from the producer to the consumers
    if (wg == 0)
      setmaxnreg_dec<TAIL_PRODUCER_REGS>();
    else
      setmaxnreg_inc<TAIL_CONSUMER_REGS>();
  }
  if (wg == 0) {
    // ---- producer warpgroup ----
    for (uint32_t j = 0;; ++j) {
      const uint32_t s = j & 1, ph = (j >> 1) & 1;
      OvSlot<T>& sl = slots[s];
      if (t == 0) {
        uint64_t task = 0;  // slot s is free once the consumers finished task j - 2 (fresh barrier: parity 1 passes)
        if (mbar_wait_ok(p, tempty + 8 * s, ph ^ 1, j, p.timeout_ns))
          task = claim_wg<T>(p, epoch, s_base, qs, g1_local, &sl.qi);
        sl.task = task;
      }
      named_sync(1, 128);  // the task word, to the producer warpgroup
      const uint64_t task = sl.task;
      const int kind = mkidx::t_kind(task);
      const bool gemm = task != 0 && kind != MK_TASK_COMBINE;
      const int e = mkidx::t_expert(task), mt = mkidx::t_mtile(task), nb = mkidx::t_nfield(task);
      const Meta md = {sl.a_off, sl.b_off, sl.row_id, nullptr};
      if (gemm) {
        fill_meta_part<T>(p, md, kind, e, mt, nb, t, 128);
        named_sync(1, 128);  // every row's offsets written before any producer thread reads them
      }
      mbar_arrive(tfull + 8 * s);  // release: task word + metadata to the consumers
      if (task == 0) return;       // end of work (or abort): the consumers see word 0 too
      if (gemm) {
        const int KT = (kind == MK_TASK_GEMM1 ? (int)p.H : (int)p.I) / BK;
        wg_produce<T>(p, md, bars, s0, kind, e, nb, KT, it, t, &tm1, &tm2);  // returns with every stage published
        it += KT;
      }
    }
  } else {
    // ---- consumer warpgroups ----
    const int c = wg - 1, ct = tid - 128;
    for (uint32_t j = 0;; ++j) {
      const uint32_t s = j & 1, ph = (j >> 1) & 1;
      const bool ok = mbar_wait_ok(p, tfull + 8 * s, ph, j, 2 * p.timeout_ns);
      if (!named_sync_and(2, NCONS, ok)) return;  // abort / timeout: every consumer leaves together
      const OvSlot<T>& sl = slots[s];
      const uint64_t task = sl.task;
      if (task == 0) {  // end of work
        if (ct == 0) tr_cta(p, 1);
        return;
      }
      const int kind = mkidx::t_kind(task), mt = mkidx::t_mtile(task), nf = mkidx::t_nfield(task);
      const int qi = sl.qi;
      if (kind == MK_TASK_COMBINE) {
        mbar_arrive(tempty + 8 * s);  // the word was all it needed from the slot
        run_combine_part(p, mt, nf, ct, NCONS);
        if (ct == 0) tr_slot(p, qi, MK_TR_DONE, (int64_t)gtime());
        continue;
      }
      const Meta md = {const_cast<int64_t*>(sl.a_off), const_cast<int64_t*>(sl.b_off), const_cast<int*>(sl.row_id),
                       nullptr};
      const int KT = (kind == MK_TASK_GEMM1 ? (int)p.H : (int)p.I) / BK;
      wg_consume<T, (T::XR > 0)>(p, md, bars, s0, kind, nf, KT, it, t, c, qi, stg);
      it += KT;
      named_sync(2, NCONS);  // every consumer's stores issued before the fences + signals
      signal_rows<T>(p, md, kind, mkidx::t_tile(task), ct, NCONS);
      mbar_arrive(tempty + 8 * s);  // (after its signal: it read row_id)
      if (ct == 0) tr_slot(p, qi, MK_TR_DONE, (int64_t)gtime());
    }
  }
}

// ---- routing ----------
// Zero the counters of the expert kernel and bump the launch epoch (one block; the next kernels see it).
__device__ void reset_ctl(const MkParams& p) {
  const int tid = threadIdx.x;
  for (int i = tid; i < p.E; i += blockDim.x) p.counts[i * MK_COUNT_STRIDE] = 0;
  for (int i = tid; i < p.max_tiles; i += blockDim.x) p.g1done[i] = 0;
  for (int i = tid; i < p.max_ctiles; i += blockDim.x) p.comb[i] = 0;
  if (p.sk_cnt) {
    const int64_t n = p.sk_max_tiles * (2 * p.I / BN + p.H / BN);
    for (int64_t i = tid; i < n; i += blockDim.x) p.sk_cnt[i] = 0;
  }
  // The epoch counts in unsigned arithmetic (an int bumped past INT_MAX is undefined behaviour) and wraps after 2^32
  // launches. Queue flags and release marks are compared for equality with it, so at the wrap (never 0: a fresh
  // flag) the ones this launch uses are cleared: a slot last written 2^32 launches ago cannot look published.
  const uint32_t ep = (uint32_t)p.ctl[MK_CTL_EPOCH] + 1u;
  if (ep == 0u) {
    for (int64_t i = tid; i < p.q_cap; i += blockDim.x) p.q_flag[i] = 0;
    for (int64_t i = tid; i < p.max_tiles + p.max_ctiles; i += blockDim.x) p.rel[i] = 0;
  }
  __syncthreads();  // every thread read the epoch before thread 0 writes it
  if (tid == 0) {
    p.ctl[MK_CTL_HEAD] = 0;
    p.ctl[MK_CTL_TOTAL] = 0;
    p.ctl[MK_CTL_ABORT] = 0;
    p.ctl[MK_CTL_PUBLISHED] = 0;
    p.ctl[MK_CTL_EPOCH] = ep == 0u ? 1 : (int32_t)ep;
  }
}

__global__ void k_reset(const MkParams p) {
  if (p.pdl) griddep_launch();  // k_route may start its gate GEMM meanwhile (it waits before its appends)
  reset_ctl(p);
}

// Given routing (topk_idx / topk_w already filled): build the per-expert row lists. An expert's list holds S_cap
// rows, enough only while a token's picks are distinct experts (routing from the gate always is; given routing that
// repeats an expert can give one expert up to S * K rows). A row past S_cap takes its increment back and is dropped
// with MK_ERR_EXPERT_FULL, which aborts the launch like every report (the persistent kernel's waits give up: none of
// its output rows is valid, but nothing is read or written out of bounds): positions 0..S_cap-1 are still handed
// out once each (a thread sees pos < S_cap only while no taken-back increment is pending), so once this kernel ends
// the count is exactly S_cap and the kernels after it in the stream (they start only when it ends: it never triggers
// its dependents) read no more rows.
// Append row `row` (= token * K + slot) to expert e's list: an expert id out of range is reported
// (MK_ERR_BAD_EXPERT) and a row past S_cap given back and reported (MK_ERR_EXPERT_FULL), never written; either report
// aborts the launch.
__device__ __forceinline__ void append_row(const MkParams& p, int row, int e) {
  if (e < 0 || e >= p.E) {
    report(p, MK_ERR_BAD_EXPERT, row, e, 0);
    return;
  }
  int* const cnt = p.counts + e * MK_COUNT_STRIDE;
  const int pos = atomicAdd(cnt, 1);
  if (pos >= p.S_cap) {
    atomicSub(cnt, 1);
    report(p, MK_ERR_EXPERT_FULL, row, e, 0);
    return;
  }
  p.lists[(int64_t)e * p.S_cap + pos] = row;
}

__global__ void k_lists(const MkParams p) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= p.S * p.K) return;
  append_row(p, (int)row, p.topk_idx[row]);  // S * K <= 2^30 (check_params): the row fits an int
}
// ----------------------------------------------------------------------------------------------------------
// Gate logits [S, E] fp32 = x . Wg^T on the tensor cores (bf16 products are exact in fp32; fp32 accumulate).
// Block (0, 0) also resets the expert kernel's counters and bumps the launch epoch: the next kernels in the
// stream see it, and nothing here needs a host step (CUDA-graph safe).
// Split over H (blockIdx.z of gridDim.z): each split writes its own partial [S, E] plane; k_topk adds the
// planes in a fixed order, so the logits stay bit-reproducible (no float atomics) while few tokens still
// spread the 0.5 MB gate matrix over many SMs.
template <class T>
__global__ void __launch_bounds__(T::THREADS) k_logits(const MkParams p) {
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x;
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) reset_ctl(p);
  const int stages = (int)p.stages;
  Meta md = meta<T>(smem, stages);
  const int t0 = blockIdx.x * T::BM, e0 = blockIdx.y * BN;
  const int kspan = (int)p.H / (int)gridDim.z, k0 = blockIdx.z * kspan;
  for (int r = tid; r < T::BM; r += T::THREADS) md.a_off[r] = t0 + r < p.S ? (int64_t)(t0 + r) * p.H + k0 : -1;
  for (int n = tid; n < BN; n += T::THREADS) md.b_off[n] = e0 + n < p.E ? (int64_t)(e0 + n) * p.H + k0 : -1;
  __syncthreads();
  float acc[T::MT][T::NT][4];
  gemm_tile<T>(acc, smem, stages, (const bf16*)p.x, md.a_off, (const bf16*)p.wg, md.b_off, kspan);
  // pdl: k_topk (which waits for this kernel) may launch, and so the persistent kernel behind it, once this CTA's
  // loads are done (a trigger at the kernel's start let run 48's L2 prefetch delay the gate GEMM's own reads)
  if (p.pdl) griddep_launch();
  float* logits = p.logits + (int64_t)blockIdx.z * p.S * p.E;
  const int lane = tid & 31, warp = tid >> 5, wm = warp / T::WN, wn = warp % T::WN;
#pragma unroll
  for (int i = 0; i < T::MT; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = t0 + wm * T::WTM + i * 16 + (lane >> 2) + half * 8;
      if (t >= p.S) continue;
#pragma unroll
      for (int j = 0; j < T::NT; ++j) {
        const int e = e0 + wn * T::WTN + j * 8 + 2 * (lane & 3);
        if (e < p.E) logits[(int64_t)t * p.E + e] = acc[i][j][2 * half];
        if (e + 1 < p.E) logits[(int64_t)t * p.E + e + 1] = acc[i][j][2 * half + 1];
      }
    }
}

// S up to which the gate GEMM runs 16-row tiles (more CTAs for the same H splits), 64-row tiles above. Run 52
// (builds side by side, two rounds, routing / layer graph µs): 64 vs 256 at S=96 16.0-16.1 / 314.1-314.4 vs
// 14.0-14.1 / 312.8-313.0, S=128 16.0-16.1 / 318.1-318.8 vs 14.0-14.3 / 316.0, S=192 16.5 / 324.1-324.7 vs
// 14.7-14.8 / 321.1-322.5, S=256 16.5 / 326.7-326.8 vs 15.1-15.3 / 324.9. Run 55 (the same, 256 vs 4096, split cap
// 16): S=512 18.1 / 336.0, 336.0 vs 16.5 / 332.7, 333.8; S=1024 23.8 / 360.5, 361.7 vs 21.0 / 356.6, 357.0; but
// S=2048 29.1 / 470.1, 473.4 vs 32.9 / 475.3, 478.6 and S=4096 39.6 vs 61.6 (routing). A 32-row tile up to 4096
// (run 55) was no better than these two: S=1024 20.5 / 357.4, 356.8; S=2048 27.1 / 475.0, 468.5; S=4096 43.8.
#ifndef MK_ROUTE_SMALL_TILE_S
#define MK_ROUTE_SMALL_TILE_S 1024
#endif
constexpr int MAXK = 16;
constexpr int MAX_SPLITS = 16;     // logit planes k_topk adds (layer.py caps logit_splits at 16)
constexpr int TOPK_TOKENS = THREADS / 32;  // one warp per token

// fp32 <-> an unsigned key with the same order (negatives bit-flipped, positives with the sign bit set)
__device__ __forceinline__ unsigned ord_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float ord_val(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// The selection's total order on a probability: ord_key for a number; NAN_KEY, below every number and above PAD_KEY
// (experts past E), for NaN. Probabilities are never negative or -0, so on numbers the order and its ties are the
// float compare's: the picks of finite logits are the bits they were with `v > best` compares. A NaN or +inf logit, or
// all E of them -inf, make every probability of their token NaN (NaN: the sum; +inf: inf - inf; all -inf: -inf - -inf;
// a -inf among finite logits, as masking leaves, is a probability of +0 and routes as usual), and a NaN never
// compares greater, so no expert was ever found and every pick was out of range: the sentinel 1 << 30 (append_pick
// then wrote the lists at 2^30 S_cap: an illegal address, the context lost; the decode kernel read weights past W),
// or where E is not a multiple of 32 a padding lane's index past E (written past the lists). With NAN_KEY such a
// token ties on every expert and takes the lowest K in order (NaN weights): K distinct experts in 0..E-1 whatever
// the logits. ord_val(NAN_KEY) is a NaN (0xfffffffe), so the pick's value stays NaN without a branch.
constexpr unsigned NAN_KEY = 1u, PAD_KEY = 0u;
__device__ __forceinline__ unsigned pick_key(float v) { return isnan(v) ? NAN_KEY : ord_key(v); }
constexpr unsigned NO_BAD = 0x7fffffffu;  // a lane's (warp's) lowest expert with a non-finite logit: none
// The token's `bad` from nf (the warp's lowest expert whose logit is NaN or +-inf, or NO_BAD) and s (its softmax sum):
// nf where the softmax broke, else -1. It broke exactly where s is NaN: a NaN logit (NaN - m), a +inf one (m = +inf,
// inf - inf) or all of them -inf (m = -inf, -inf - -inf), and then every probability is NaN; finite logits, with or
// without -inf ones among them (masking: their probability is +0), give 1 <= s <= E. So a -inf among finite logits is
// no error: its token routes and computes as usual.
__device__ __forceinline__ int broken_softmax(unsigned nf, float s) { return nf != NO_BAD && isnan(s) ? (int)nf : -1; }
// One warp's softmax (fp32), top-k (ties: lower expert first) and renormalisation of the E logits at lg (shared
// memory): lane j < K gets pick j (expert, weight); `bad` (every lane) is broken_softmax's: where the token's
// probabilities are NaN, its lowest expert whose logit is not finite, else -1 (the caller records
// MK_ERR_NONFINITE_LOGITS). k_topk, k_route and the decode kernel's routing share it.
template <int NI>
__device__ __forceinline__ void warp_topk(const float* lg, int E, int K, int lane, int& pick_e, float& pick_w,
                                          int& bad) {
  float v[NI];
  float m = -INFINITY;
  unsigned nf = NO_BAD;
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? lg[e] : -INFINITY;
    if (e < E && !isfinite(v[i])) nf = min(nf, (unsigned)e);
    m = fmaxf(m, v[i]);
  }
  nf = __reduce_min_sync(~0u, nf);
#pragma unroll
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    v[i] = lane + 32 * i < E ? expf(v[i] - m) : 0.f;
    s += v[i];
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
  bad = broken_softmax(nf, s);  // s is the same on every lane (the xor butterfly)
  unsigned key[NI];
#pragma unroll
  for (int i = 0; i < NI; ++i) key[i] = lane + 32 * i < E ? pick_key(v[i] / s) : PAD_KEY;
  unsigned taken = 0;
  float sum = 0.f, my_v = 0.f;
  int my_i = 0;
  unsigned lk = PAD_KEY;  // this lane's best unpicked (key, expert): ties keep the lower index; PAD_KEY = none
  int li = 1 << 30;
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    if (key[i] > lk) {
      lk = key[i];
      li = lane + 32 * i;
    }
  }
  for (int j = 0; j < K; ++j) {
    // the warp's best (key, lowest expert on a tie) in two redux instructions (ten dependent shuffles per pick
    // before). K <= E (check_params), so an unpicked expert (key >= NAN_KEY) is left in every round: bi < E.
    const unsigned kmax = __reduce_max_sync(~0u, lk);
    const int bi = (int)__reduce_min_sync(~0u, lk == kmax ? (unsigned)li : 0x7fffffffu);
    const float bv = ord_val(kmax);
    if (bi < E && (bi & 31) == lane) {  // the winner's lane rescans its unpicked experts
      taken |= 1u << (bi >> 5);
      lk = PAD_KEY;
      li = 1 << 30;
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        if (!((taken >> i) & 1) && key[i] > lk) {
          lk = key[i];
          li = lane + 32 * i;
        }
      }
    }
    if (lane == j) {
      my_v = bv;
      my_i = bi;
    }
    sum += bv;  // warp-uniform: every lane adds the picks in pick order
  }
  // the top pick of finite logits is >= 1 / E, so the sum is never 0 for them (the clamp is torch's route's); a
  // token of NaN probabilities gets NaN weights (fmaxf drops the NaN sum, the NaN numerator stays)
  const float denom = fmaxf(sum, 1e-20f);
  pick_e = my_i;
  pick_w = my_v / denom;
}

// Store pick `row` (= token * K + slot) and append it to its expert's list (k_topk, k_topk_small and k_route).
// The selection only picks distinct experts in 0..E-1, so neither bound below is met; they are there so that a bug
// in it drops and reports the pick (as k_lists does given routing) instead of writing past the lists.
__device__ __forceinline__ void append_pick(const MkParams& p, int row, int e, float w) {
  p.topk_idx[row] = e;
  p.topk_w[row] = w;
  append_row(p, row, e);
}
// A token whose softmax broke (bad = broken_softmax's: its lowest expert with a non-finite logit): recorded, not
// aborted (its picks are valid; its output row is NaN, the others are computed).
__device__ __forceinline__ void note_nonfinite(const MkParams& p, int t, int bad) {
  if (bad >= 0) record_noabort(p, MK_ERR_NONFINITE_LOGITS, t, bad);
}

// Softmax (fp32), top-k (ties: lower expert first), renormalise; append (t, j) to its expert's list.
// Phase 1: the whole block adds the split planes of its tokens' logits into shared memory, a thread's loads of four
// planes issued before their adds (run 5 under ncu: 24 us at S=1 when each lane chained its 16 plane loads one after
// another); the planes are added in plane order, so the logits are the same bits as before.
// Phase 2: one warp per token: softmax, top-k, renormalise. NI = experts per lane, a compile-time bound (E <= 32 NI):
// with MAXE_PER_LANE-long arrays and runtime bounds, the unrolled loops ran predicated (ncu, run 27 at S=4096: 16.6
// of 32 threads doing work per instruction) and 96 registers left 1.55 waves of blocks; each lane now keeps only its
// own pick (lane j: pick j), and the 64-register bound fits S=4096's 1024 blocks in one wave.
// k_topk's planes go through shared memory when there are more than one round of them, every block's slice is whole
// 16-byte vectors (S x E and E multiples of 4: plane and token offsets stay 16-byte aligned) and the buffer stays
// within the default 48 KB with k_topk's own (the launch sizes it)
__host__ __device__ inline bool stage_planes(const MkParams& p, int splits) {
  return splits > 4 && p.E % 4 == 0 && (p.S * p.E) % 4 == 0 && (int64_t)splits * TOPK_TOKENS * p.E * 4 <= 40 * 1024;
}
template <int NI>
__global__ void __launch_bounds__(THREADS, 8) k_topk(const MkParams p, int splits) {
  static_assert(NI >= 1 && NI <= MAXE_PER_LANE, "experts per lane");
  __shared__ float s_lg[TOPK_TOKENS][32 * NI];
  if (p.pdl) {  // the persistent kernel may start (it waits for this one); then wait for the logits
    griddep_launch();
    griddep_wait();
  }
  const int lane = threadIdx.x & 31;
  const int t0 = blockIdx.x * TOPK_TOKENS;
  const int E = (int)p.E, K = (int)p.K;
  const int ntok = min(TOPK_TOKENS, (int)p.S - t0);
  const int64_t plane = p.S * p.E;
  const int n = ntok * E;
  if (stage_planes(p, splits)) {
    // every plane's slice of this block's logits in flight at once (16-byte cp.async through the L2, none through L1:
    // see griddep_wait), then added in plane order: the same bits as the loop below, in one L2 round trip instead of
    // one per four planes (run 92, S=128, pdl=0: k_topk 5.3 instead of 6.4 µs; the layer within 0.5 µs, its
    // routing mostly hidden by pdl)
    extern __shared__ __align__(16) float s_part[];  // [splits][n]
    const int nv = n / 4;
    for (int i = threadIdx.x; i < splits * nv; i += THREADS) {
      const int z = i / nv, v = i % nv;
      cp_async16(su32(s_part + (int64_t)z * n + 4 * v), p.logits + z * plane + (int64_t)t0 * E + 4 * v, 16);
    }
    cp_commit();
    cp_wait(0);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += THREADS) {
      float a = s_part[i];
      for (int z = 1; z < splits; ++z) a += s_part[z * n + i];
      s_lg[i / E][i % E] = a;
    }
  } else
  for (int i0 = 0; i0 < n; i0 += THREADS * 4) {
    const float* src[4];
    bool ok[4];
    float a[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + r * THREADS + threadIdx.x;
      ok[r] = i < ntok * E;
      src[r] = p.logits + (int64_t)(t0 + (ok[r] ? i / E : 0)) * E + (ok[r] ? i % E : 0);
      a[r] = 0.f;
    }
    for (int z0 = 0; z0 < splits; z0 += 4) {
      float part[4][4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int z = 0; z < 4; ++z) part[r][z] = ok[r] && z0 + z < splits ? __ldcg(src[r] + (z0 + z) * plane) : 0.f;
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int z = 0; z < 4; ++z)
          if (z0 + z < splits) a[r] = z0 + z == 0 ? part[r][z] : a[r] + part[r][z];  // plane order: the same bits
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + r * THREADS + threadIdx.x;
      if (ok[r]) s_lg[i / E][i % E] = a[r];
    }
  }
  __syncthreads();
  const int tl = threadIdx.x >> 5, t = t0 + tl;
  if (tl >= ntok) return;
  int my_i, bad;
  float my_w;
  warp_topk<NI>(s_lg[tl], E, K, lane, my_i, my_w, bad);
  if (lane < K) append_pick(p, t * K + lane, my_i, my_w);
  if (lane == 0) note_nonfinite(p, t, bad);
}

// Top-k for small S: one block per token (blockIdx.x), thread tid owning experts tid + 128 q. The planes are
// added in plane order and the softmax sum runs in warp 0 in k_topk's order (lane l: experts l, l+32, .., then
// the xor tree), so probabilities, picks, their order and the renormalised weights are k_topk's bits. Selection:
// each thread ranks its experts against all E (k_topk's key desc, lower index on ties) from shared memory, a pass of
// independent compares instead of K dependent rounds of shuffles; ranks < K are the picks in pick order.
constexpr int SMALL_THREADS = 128;
constexpr int SMALL_Q = 4;  // E <= 512
__global__ void __launch_bounds__(SMALL_THREADS) k_topk_small(const MkParams p, int splits) {
  __shared__ float s_p[SMALL_THREADS * SMALL_Q];
  __shared__ float s_sel_v[MAXK];
  __shared__ int s_sel_i[MAXK];
  __shared__ float s_s;
  if (p.pdl) {  // as k_topk
    griddep_launch();
    griddep_wait();
  }
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
  const int E = (int)p.E, K = (int)p.K;
  const int64_t plane = p.S * p.E;
  const float* row = p.logits + (int64_t)t * E;
  float part[SMALL_Q][MAX_SPLITS];
#pragma unroll
  for (int q = 0; q < SMALL_Q; ++q) {
    const int e = tid + SMALL_THREADS * q;
#pragma unroll
    for (int z = 0; z < MAX_SPLITS; ++z) part[q][z] = e < E && z < splits ? __ldcg(row + e + z * plane) : 0.f;
  }
#pragma unroll
  for (int q = 0; q < SMALL_Q; ++q) {
    const int e = tid + SMALL_THREADS * q;
    float a = part[q][0];
#pragma unroll
    for (int z = 1; z < MAX_SPLITS; ++z)
      if (z < splits) a += part[q][z];  // plane order, as k_topk
    if (e < E) s_p[e] = a;
  }
  __syncthreads();
  if (tid < 32) {  // warp 0: max, exp, sum exactly as k_topk's warp does for its token
    const int NI = (E + 31) / 32;
    float m = -INFINITY;
    unsigned nf = NO_BAD;
    for (int i = 0; i < NI; ++i) {
      const int e = lane + 32 * i;
      if (e < E) {
        m = fmaxf(m, s_p[e]);
        if (!isfinite(s_p[e])) nf = min(nf, (unsigned)e);
      }
    }
    nf = __reduce_min_sync(~0u, nf);
#pragma unroll
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
    float sum = 0.f;
    for (int i = 0; i < NI; ++i) {
      const int e = lane + 32 * i;
      const float x = e < E ? expf(s_p[e] - m) : 0.f;
      if (e < E) s_p[e] = x;
      sum += x;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
    if (lane == 0) {
      s_s = sum;
      note_nonfinite(p, t, broken_softmax(nf, sum));  // as warp_topk: a -inf among finite logits is no error
    }
  }
  __syncthreads();
  const float denom_all = s_s;
  float pv[SMALL_Q];
#pragma unroll
  for (int q = 0; q < SMALL_Q; ++q) {
    const int e = tid + SMALL_THREADS * q;
    pv[q] = e < E ? s_p[e] / denom_all : -1.f;
  }
  __syncthreads();  // everyone has read the exps before they become probabilities' keys
  unsigned* const s_k = (unsigned*)s_p;  // k_topk's total order (pick_key): NaN probabilities rank below every number
  unsigned pk[SMALL_Q];
#pragma unroll
  for (int q = 0; q < SMALL_Q; ++q) {
    const int e = tid + SMALL_THREADS * q;
    pk[q] = pick_key(pv[q]);
    if (e < E) s_k[e] = pk[q];
  }
  __syncthreads();
  // a total order (key desc, lower index on ties): the E ranks are 0..E-1 once each, so slots 0..K-1 each get one
  // expert whatever the logits (float compares ranked every expert of a NaN token 0 and left the slots unset)
  int rank[SMALL_Q];
#pragma unroll
  for (int q = 0; q < SMALL_Q; ++q) rank[q] = 0;
  for (int j = 0; j < E; ++j) {
    const unsigned o = s_k[j];  // broadcast read
#pragma unroll
    for (int q = 0; q < SMALL_Q; ++q) {
      if (SMALL_THREADS * q >= E) break;  // block-uniform: E = 128 compares one expert per thread
      const int e = tid + SMALL_THREADS * q;
      rank[q] += (o > pk[q] || (o == pk[q] && j < e)) ? 1 : 0;
    }
  }
#pragma unroll
  for (int q = 0; q < SMALL_Q; ++q) {
    const int e = tid + SMALL_THREADS * q;
    if (e < E && rank[q] < K) {
      s_sel_v[rank[q]] = pv[q];
      s_sel_i[rank[q]] = e;
    }
  }
  __syncthreads();
  if (tid < K) {
    float sum = 0.f;
    for (int j = 0; j < K; ++j) sum += s_sel_v[j];  // pick order, as k_topk
    const float denom = fmaxf(sum, 1e-20f);
    append_pick(p, t * K + tid, s_sel_i[tid], s_sel_v[tid] / denom);
  }
}

// ---- Routing as one cluster kernel (MK_ROUTE_FUSED_S <= S <= MK_ROUTE_FUSED_MAX_S, E <= BN) ------------------
// k_logits + k_topk write the gate GEMM's split-H planes to the L2 and read them back, and the 16-row tiles re-read
// the 0.5 MB gate once per tile: at S=1024 32 MB of gate reads and two dependent kernels, 12.2 + 6.4 µs (run 102).
// Here the ROUTE_SPLITS CTAs of one token tile form a thread-block cluster, one H split each: every CTA leaves its
// partial [BM, BN] logits in its own shared memory, then adds its BM / ROUTE_SPLITS tokens' rows from all the
// cluster's CTAs (distributed shared memory) in split order and selects them with warp_topk. No planes, no second
// kernel; the counters it appends to are zeroed by k_reset launched just before (waited for under pdl only where
// the appends start).
// Measurement builds (never the default): MK_ROUTE_PROBE 1 = no gate GEMM (the partials a hash of (token, expert,
// split), so the picks still spread over the experts), 2 = no cross-CTA sums (each CTA selects on its own split).
#ifndef MK_ROUTE_PROBE
#define MK_ROUTE_PROBE 0
#endif
constexpr int ROUTE_MAX_STAGES = 4;  // the gate GEMM's own depth: 0.5 MB of weights, no deep pipeline
constexpr int ROUTE_SPLITS = 8;      // the cluster: 8 is the portable cluster size
constexpr int ROUTE_LD = BN + 4;     // partial tile row pitch in floats (16-byte rows, writes spread over banks)
template <class T>
__global__ void __launch_bounds__(T::THREADS) k_route(const MkParams p) {
  static_assert(T::BM % ROUTE_SPLITS == 0, "tokens per cluster rank");
  extern __shared__ __align__(128) char smem[];
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  const int tid = threadIdx.x, z = (int)cl.block_rank();
  const int stages = (int)p.stages;
  Meta md = meta<T>(smem, stages);
  const int t0 = blockIdx.x * T::BM;
  const int kspan = (int)p.H / ROUTE_SPLITS, k0 = z * kspan;
  for (int r = tid; r < T::BM; r += T::THREADS) md.a_off[r] = t0 + r < p.S ? (int64_t)(t0 + r) * p.H + k0 : -1;
  for (int n = tid; n < BN; n += T::THREADS) md.b_off[n] = n < p.E ? (int64_t)n * p.H + k0 : -1;
  __syncthreads();
  float acc[T::MT][T::NT][4];
#if MK_ROUTE_PROBE & 1
  for (int i = 0; i < T::MT; ++i)
    for (int j = 0; j < T::NT; ++j)
      for (int c = 0; c < 4; ++c) acc[i][j][c] = (float)((((t0 + i) * 131 + j * 17 + c * 7 + z * 29 + tid) * 2654435761u) >> 20);
#else
  gemm_tile<T>(acc, smem, stages, (const bf16*)p.x, md.a_off, (const bf16*)p.wg, md.b_off, kspan);
#endif
  if (p.pdl) griddep_launch();  // as k_logits: after this CTA's loads
  float* part = (float*)smem;   // the stages are free again (gemm_tile ends on a CTA barrier)
  const int lane = tid & 31, warp = tid >> 5, wm = warp / T::WN, wn = warp % T::WN;
#pragma unroll
  for (int i = 0; i < T::MT; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * T::WTM + i * 16 + (lane >> 2) + half * 8;
#pragma unroll
      for (int j = 0; j < T::NT; ++j) {
        const int c = wn * T::WTN + j * 8 + 2 * (lane & 3);
        *(float2*)(part + r * ROUTE_LD + c) = make_float2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
      }
    }
  cl.sync();  // every split's partial tile is in its CTA's shared memory
  constexpr int TPC = T::BM / ROUTE_SPLITS, V = BN / 4;  // tokens this CTA selects; float4s per row
  float* lg = part + T::BM * ROUTE_LD;                   // [TPC][BN]: their logits
  const float* rp[ROUTE_SPLITS];
#pragma unroll
  for (int q = 0; q < ROUTE_SPLITS; ++q) rp[q] = cl.map_shared_rank(part, q);
  for (int v = tid; v < TPC * V; v += T::THREADS) {
    const int off = (z * TPC + v / V) * ROUTE_LD + 4 * (v % V);
    float4 b[ROUTE_SPLITS];
#pragma unroll
    for (int q = 0; q < ROUTE_SPLITS; ++q) b[q] = *(const float4*)(rp[MK_ROUTE_PROBE & 2 ? z : q] + off);  // all in flight, then added
    float4 a = b[0];
#pragma unroll
    for (int q = 1; q < ROUTE_SPLITS; ++q) {  // split order, as k_topk adds its planes
      a.x += b[q].x;
      a.y += b[q].y;
      a.z += b[q].z;
      a.w += b[q].w;
    }
    *(float4*)(lg + (v / V) * BN + 4 * (v % V)) = a;
  }
  cl.sync();  // no CTA leaves while another reads its tile; this CTA's lg is complete
  if (p.pdl) griddep_wait();  // k_reset's zeroed counters (it ran ahead of this kernel)
  const int E = (int)p.E, K = (int)p.K;
  for (int tl = warp; tl < TPC; tl += T::THREADS / 32) {
    const int t = t0 + z * TPC + tl;
    if (t >= p.S) break;
    int my_i, bad;
    float my_w;
    warp_topk<BN / 32>(lg + tl * BN, E, K, lane, my_i, my_w, bad);
    if (lane < K) append_pick(p, t * K + lane, my_i, my_w);
    if (lane == 0) note_nonfinite(p, t, bad);
  }
}
static_assert(Small::STAGE * ROUTE_MAX_STAGES >= (Small::BM * ROUTE_LD + Small::BM / ROUTE_SPLITS * BN) * 4, "k_route<Small>");
static_assert(Large::STAGE * ROUTE_MAX_STAGES >= (Large::BM * ROUTE_LD + Large::BM / ROUTE_SPLITS * BN) * 4, "k_route<Large>");

#include "mk_decode.cuh"

// ---- host side ----------------------------------------------------------------------------------------------
constexpr int MAX_STAGES = 12;  // bm=16 only: 12 x 18 KB fits one CTA per SM
// Dynamic shared memory a CTA may opt into: 227 KB less room for the kernels' static shared memory (run 7:
// asking for the whole 227 KB failed with "invalid argument").
constexpr int SMEM_MAX = 227 * 1024 - 1024;

template <class T>
int smem_for(int stages) { return smem_bytes(T::STAGE, T::META, stages) + T::ALIGN; }
// The overlap kernel (wgmma tiles): two task slots instead of one set of metadata.
template <class T>
int smem_for_ov(int stages) { return smem_bytes(T::STAGE, ov_meta_bytes<T>(), stages) + T::ALIGN; }
// overlap = 1 runs k_experts_ov on the wgmma tiles; every other tile ignores it.
template <class T>
int smem_for(int stages, int64_t overlap) { return T::WG && overlap ? smem_for_ov<T>(stages) : smem_for<T>(stages); }

// A function attribute is set in the current device's context: raised once per kernel AND device (one flag for
// the process left a second GPU's kernels at the 48 KB default, and a layer there found no CTA resident).
constexpr int PREP_DEVICES = 64;
// set() once on the current device until it succeeds, under the kernel's lock (as decode_attrs)
template <class F>
cudaError_t once_per_device(std::mutex& mu, bool (&done)[PREP_DEVICES], F set) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < PREP_DEVICES && done[dev]) return cudaSuccess;
  e = set();
  if (dev < PREP_DEVICES) done[dev] = e == cudaSuccess;
  return e;
}

template <class T>
cudaError_t prepare() {  // raise the dynamic shared-memory limit once per kernel and device (enough for MAX_STAGES)
  static std::mutex mu;
  static bool done[PREP_DEVICES];
  return once_per_device(mu, done, [] {
    const int most = smem_for<T>(MAX_STAGES) <= SMEM_MAX ? smem_for<T>(MAX_STAGES) : SMEM_MAX;
    cudaError_t e = cudaFuncSetAttribute(k_experts<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
    if constexpr (T::WG) {
      const int ov = smem_for_ov<T>(MAX_STAGES) <= SMEM_MAX ? smem_for_ov<T>(MAX_STAGES) : SMEM_MAX;
      if (e == cudaSuccess) e = cudaFuncSetAttribute(k_experts_ov<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, ov);
    }
    return e;
  });
}

template <class T>
cudaError_t prepare_route() {  // the routing kernels' limit (k_logits<T>, k_route<T> at up to ROUTE_MAX_STAGES), per device
  static std::mutex mu;
  static bool done[PREP_DEVICES];
  return once_per_device(mu, done, [] {
    cudaError_t e =
        cudaFuncSetAttribute(k_logits<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_for<T>(ROUTE_MAX_STAGES));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(k_route<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_for<T>(ROUTE_MAX_STAGES));
    return e;
  });
}

// The wgmma core serves bm = 64 / 128 when asked for; bm = 16 always runs the mma core.
bool use_wgmma(int64_t bm, int64_t core) { return core == MK_CORE_WGMMA && bm >= 64; }
// B by TMA (tma_b = 1) exists for the wgmma tiles and the bm = 16 mma tile; bm = 64 / 128 on the mma core
// keep cp.async.
bool use_tma(int64_t bm, int64_t core, int64_t tma) { return tma != 0 && (use_wgmma(bm, core) || bm == 16); }

// The wide tile (bn = 256) exists for the wgmma core at bm = 128 only (check_bn).
bool use_wide(int64_t bm, int64_t core, int64_t bn) { return bn == 256 && use_wgmma(bm, core) && bm == 128; }
const char* check_bn(int64_t bm, int64_t core, int64_t bn) {
  if (bn != 128 && bn != 256) return "mk: bn must be 128 or 256";
  if (bn == 256 && !use_wide(bm, core, bn)) return "mk: bn = 256 (the wide tile) needs core = wgmma and bm = 128";
  return nullptr;
}

// Call f(Tile{}) with the expert kernel's tile type for (bm, core, tma, bn).
template <class F>
int with_tile(int64_t bm, int64_t core, int64_t tma, int64_t bn, F&& f) {
  const bool t = use_tma(bm, core, tma);
  if (use_wide(bm, core, bn)) return t ? f(WgWideTma{}) : f(WgWide{});
  if (use_wgmma(bm, core)) {
    if (bm == 64) return t ? f(WgLargeTma{}) : f(WgLarge{});
    return t ? f(WgHugeTma{}) : f(WgHuge{});
  }
  if (bm == 16) return t ? f(SmallTma{}) : f(Small{});
  return bm == 64 ? f(Large{}) : f(Huge{});
}

int expert_smem(int64_t bm, int64_t core, int64_t tma, int64_t bn, int64_t overlap, int st) {
  return with_tile(bm, core, tma, bn, [&](auto tile) { return smem_for<decltype(tile)>(st, overlap); });
}

int check_params(const MkParams* p) {
  if (!p) return fail_msg("mk: null params");
  if (p->bm != 16 && p->bm != 64 && p->bm != 128) return fail_msg("mk: bm must be 16, 64 or 128");
  if (p->logit_splits_max < 1 || p->logit_splits_max > MAX_SPLITS) return fail_msg("mk: logit_splits_max must be in 1..16");
  if (p->stages < 2 || p->stages > MAX_STAGES) return fail_msg("mk: stages must be in 2..12");
  if (p->core != MK_CORE_MMA && p->core != MK_CORE_WGMMA) return fail_msg("mk: core must be 0 (mma) or 1 (wgmma)");
  if (p->tma_b != 0 && p->tma_b != 1) return fail_msg("mk: tma_b must be 0 or 1");
  if (const char* m = check_bn(p->bm, p->core, p->bn)) return fail_msg(m);
  if (p->bn == 256 && (p->H % 256 || (2 * p->I) % 256))
    return fail_msg("mk: bn = 256 needs hidden and 2 x intermediate to be multiples of 256");
  if (p->overlap != 0 && p->overlap != 1) return fail_msg("mk: overlap must be 0 or 1");
  if (expert_smem(p->bm, p->core, p->tma_b, p->bn, p->overlap, (int)p->stages) > SMEM_MAX)
    return fail_msg("mk: stages too deep for bm (shared memory > 226 KB: bm=16 <= 12, 64 <= 9, 128 <= 6; wgmma 64 <= 9 "
                    "(8 with overlap), 128 <= 6, 128 with bn=256 <= 4)");
  if (p->split_k1 < 1 || p->split_k1 > MK_MAX_SPLITS || p->split_k2 < 1 || p->split_k2 > MK_MAX_SPLITS)
    return fail_msg("mk: split_k1 / split_k2 must be in 1..16");
  if (p->H % (p->split_k1 * BK) || p->I % (p->split_k2 * BK))
    return fail_msg("mk: split-K parts must be multiples of 64 (hidden % (64 split_k1), intermediate % (64 split_k2))");
  if ((p->split_k1 > 1 || p->split_k2 > 1) && p->sk_max_tiles > 0 && (!p->sk_part || !p->sk_cnt))
    return fail_msg("mk: split-K needs sk_part and sk_cnt");
  if (p->sk_max_tiles < 0 || p->sk_max_tiles >= (1 << 20)) return fail_msg("mk: sk_max_tiles out of range");
  if (p->H % BN || p->I % 64 || (2 * p->I) / BN * p->split_k1 > 4095 || p->H / BN * p->split_k2 > 4095)
    return fail_msg("mk: hidden must be a multiple of 128 and intermediate of 64");
  if (p->E < 1 || p->E > 32 * MAXE_PER_LANE) return fail_msg("mk: experts must be in 1..512");
  if (p->K < 1 || p->K > MAXK || p->K > p->E) return fail_msg("mk: topk must be in 1..min(16, experts)");
  if (p->S < 0 || p->S > p->S_cap) return fail_msg("mk: S must be in 0..S_cap");
  if (p->S_cap * p->K > (1ll << 30)) return fail_msg("mk: S_cap * topk too large");
  if (p->max_tiles >= (1 << 20) || p->max_ctiles > (1 << 16)) return fail_msg("mk: too many tiles");
  if (p->combine_tokens < 1) return fail_msg("mk: combine_tokens must be >= 1");
  if (p->timeout_ns <= 0) return fail_msg("mk: timeout must be > 0");
  if (p->l2_evict_w != 0 && p->l2_evict_w != 1) return fail_msg("mk: l2_evict_w must be 0 or 1");
  if (p->decode < 0 || p->decode > 2) return fail_msg("mk: decode must be 0, 1 or 2");
  if (p->decode && !p->dec_cnt) return fail_msg("mk: decode needs dec_cnt");
  if (p->tail_rows < 0 || p->tail_rows > 16) return fail_msg("mk: tail_rows must be in 0..16");
  // A task word numbers an m-tile within its expert in 16 bits (mk_index.h: enc): past that the m-tile spills into
  // the expert's bits and the task computes another expert's rows. The decode kernel forms no m-tiles.
  if (!p->decode && mkidx::expert_tiles_max(p->S_cap, p->bm) > mkidx::MAX_EXPERT_TILES) {
    snprintf(g_err, sizeof g_err, "mk: S_cap = %lld rows make up to %lld m-tiles of bm = %lld for one expert, more than "
             "the %lld a task word's 16-bit m-tile field numbers (S_cap <= %lld x bm)", (long long)p->S_cap,
             (long long)mkidx::expert_tiles_max(p->S_cap, p->bm), (long long)p->bm,
             (long long)mkidx::MAX_EXPERT_TILES, (long long)mkidx::MAX_EXPERT_TILES);
    return 1;
  }
  return 0;
}

template <class T>
int occupancy_of(int64_t stages, int64_t overlap, int* per_sm) {
  cudaError_t e = prepare<T>();
  if (e != cudaSuccess) return fail("cudaFuncSetAttribute", e);
  if constexpr (T::WG) {
    if (overlap) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, k_experts_ov<T>, T::THREADS, smem_for_ov<T>((int)stages));
      if (e != cudaSuccess) return fail("cudaOccupancyMaxActiveBlocksPerMultiprocessor", e);
      return 0;
    }
  }
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, k_experts<T>, T::THREADS, smem_for<T>((int)stages));
  if (e != cudaSuccess) return fail("cudaOccupancyMaxActiveBlocksPerMultiprocessor", e);
  return 0;
}

int occupancy(int64_t bm, int64_t stages, int64_t core, int64_t tma, int64_t bn, int64_t overlap, int* per_sm, int* sms) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail("cudaGetDevice", e);
  if ((e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess)
    return fail("cudaDeviceGetAttribute", e);
  return with_tile(bm, core, tma, bn, [&](auto tile) { return occupancy_of<decltype(tile)>(stages, overlap, per_sm); });
}

// ---- tensor maps of the weights (TMA tiles) ----
// cuTensorMapEncodeTiled through the runtime's driver entry point (the library links no libcuda). Encoded
// maps are cached by (address, rows, cols): a launch (or a graph capture, which copies the kernel
// parameters by value) re-encodes nothing for weights it has seen.
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (PFN_cuTensorMapEncodeTiled_v12000)f;
  });
  return fn;
}

struct MapEntry {
  const void* ptr;
  uint64_t rows, cols;
  CUtensorMapL2promotion promo;
  CUtensorMap map;
};

// The weight maps' L2 promotion (`w_promotion`; MK_W_PROMO forces one for measurement builds: 0 none, 1 64 B, 2 128 B,
// 3 256 B). A box reads 64 rows of 128 bytes a row pitch apart; promoted to 256 B, each row also pulls the next
// k-stage's 128 bytes into the L2 early (hit rate 36% against 19% without promotion at S=1024, the same DRAM bytes).
// Where the weights load evict-first (each expert's read about once) that early half costs time: 128 B against 256 B
// side by side, chains of 20 forwards, S=1024 -3.8 µs a forward, S=16 -2.9 (run 155), S=128 +1.0; where they load with
// the default policy (m-tiles of one expert re-read them) it pays: S=2048 +4.2 with 128 B (run 156). So: 128 B for
// evict-first launches, 256 B otherwise; a host-side choice of map, nothing in the kernel. (A k-tiled copy of the
// weights, each box 8 KB contiguous, gave S=1024 -6.1 at twice the weights' memory in run 155: the layout since ABI 18.)
#ifndef MK_W_PROMO
#define MK_W_PROMO -1
#endif
CUtensorMapL2promotion w_promotion(const MkParams* p) {
  if (MK_W_PROMO >= 0) return (CUtensorMapL2promotion)MK_W_PROMO;
  return p->l2_evict_w ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
}
// bf16 matrix [rows, cols] (row-major, contiguous) -> map with 64 x 64 boxes and the 128-byte swizzle: a box
// lands in shared memory as mkidx::swz_off lays a tile out (chunk c of row r at chunk c ^ (r & 7)).
int weight_map(const void* ptr, uint64_t rows, uint64_t cols, CUtensorMapL2promotion promo, CUtensorMap* out) {
  static std::mutex mu;
  static MapEntry cache[32];
  static int used = 0, next = 0;
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < used; ++i)
    if (cache[i].ptr == ptr && cache[i].rows == rows && cache[i].cols == cols && cache[i].promo == promo) {
      *out = cache[i].map;
      return 0;
    }
  PFN_cuTensorMapEncodeTiled_v12000 enc = encode_fn();
  if (!enc) return fail_msg("mk: cuTensorMapEncodeTiled not available from the driver");
  if ((uintptr_t)ptr % 16 || (cols * 2) % 16) return fail_msg("mk: TMA needs 16-byte aligned weights and rows");
  const cuuint64_t dims[2] = {cols, rows}, strides[1] = {cols * 2};
  const cuuint32_t box[2] = {BK, TMA_BOX_ROWS}, estr[2] = {1, 1};
  CUtensorMap m;
  const CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box, estr,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    snprintf(g_err, sizeof g_err, "mk: cuTensorMapEncodeTiled failed (CUresult %d)", (int)r);
    return 1;
  }
  MapEntry& slot = cache[used < 32 ? used++ : next++ % 32];  // full: replace the oldest entries in turn
  slot = {ptr, rows, cols, promo, m};
  *out = m;
  return 0;
}


// Launch `kernel` on s in thread-block clusters of `cluster` (1 x 1 x 1: none); pdl: with programmatic stream
// serialization, so it may start before the kernel ahead of it in the stream ends (it must griddep_wait before reading
// that kernel's results; see MkParams.pdl).
template <class... P, class... A>
cudaError_t launch_kc(void (*kernel)(P...), dim3 grid, dim3 cluster, unsigned threads, size_t smem, cudaStream_t s,
                      bool pdl, A&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}
template <class... P, class... A>
cudaError_t launch_k(void (*kernel)(P...), dim3 grid, unsigned threads, size_t smem, cudaStream_t s, bool pdl,
                     A&&... args) {
  return launch_kc(kernel, grid, dim3(1, 1, 1), threads, smem, s, pdl, std::forward<A>(args)...);
}

// Routing as ONE kernel of one CTA per SM for few tokens (the gate dot products on every warp, logits polled where
// they land, a warp per token selecting, as the decode kernel routes; f2eca64, 63d632c) was at most ~1 µs faster at
// S=2..16 and slower from S=32 (runs 84-86): these two kernels stay.
// The gate GEMM's H splits double while its CTAs stay within MK_ROUTE_WAVES x the SMs (comparison builds vary it).
// Run 106 (builds side by side, graph µs, three rounds): 4 or 8 waves were slower at every size, S=512 334.7-342.3
// vs 331.9-335.4, 1024 371.7-394.8 vs 357.5-366.0, 2048 552.0-571.2 vs 514.3-547.0, 4096 874.5-887.3 vs 837.1-844.4.
#ifndef MK_ROUTE_WAVES
#define MK_ROUTE_WAVES 2
#endif
template <class T>
int launch_route(const MkParams* pp, cudaStream_t s) {
  MkParams q = *pp;
  q.stages = pp->stages < ROUTE_MAX_STAGES ? pp->stages : ROUTE_MAX_STAGES;
  const MkParams* p = &q;
  cudaError_t e = prepare_route<T>();
  if (e != cudaSuccess) return fail("cudaFuncSetAttribute", e);
  dim3 grid((unsigned)((p->S + T::BM - 1) / T::BM), (unsigned)((p->E + BN - 1) / BN));
  if (grid.x == 0) grid.x = 1;  // S = 0 still resets the counters
  // split H until about two waves of CTAs (each split a multiple of BK, at most logit_splits_max planes)
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  int splits = 1;
  while (splits * 2 <= p->logit_splits_max && p->H % (splits * 2 * BK) == 0 &&
         (int64_t)grid.x * grid.y * splits * 2 <= MK_ROUTE_WAVES * sms)
    splits *= 2;
  grid.z = splits;
  k_logits<T><<<grid, T::THREADS, smem_for<T>((int)p->stages), s>>>(*p);
  if ((e = cudaGetLastError()) != cudaSuccess) return fail("k_logits launch", e);
  if (p->S > 0 && p->S <= p->route_small_max) {
    e = launch_k(k_topk_small, dim3((unsigned)p->S), SMALL_THREADS, 0, s, p->pdl != 0, *p, splits);
    if (e != cudaSuccess) return fail("k_topk_small launch", e);
  } else if (p->S > 0) {
    const unsigned blocks = (unsigned)((p->S + TOPK_TOKENS - 1) / TOPK_TOKENS);
    const int ni = (int)(p->E + 31) / 32;  // experts per lane, rounded up to the instantiated bounds
    auto kt = ni <= 1 ? k_topk<1> : ni <= 2 ? k_topk<2> : ni <= 4 ? k_topk<4> : ni <= 8 ? k_topk<8> : k_topk<16>;
    const size_t part = stage_planes(*p, splits) ? (size_t)splits * TOPK_TOKENS * p->E * 4 : 0;
    e = launch_k(kt, dim3(blocks), THREADS, part, s, p->pdl != 0, *p, splits);
    if (e != cudaSuccess) return fail("k_topk launch", e);
  }
  return 0;
}

// Routing by k_route (one cluster kernel) for MK_ROUTE_FUSED_S..MK_ROUTE_FUSED_MAX_S tokens, where top-k is not
// k_topk_small's; its token tile is 16 rows up to MK_ROUTE_FUSED_SMALL_S, 64 above (S=256, 1024, 2048: 128, 128, 256
// CTAs). Run 121 (the layer side by side, replay by replay, two kernels minus k_route per round, median): S=512
// +0.9 µs, 1024 +2.8, but 2048 -8.4 (256 CTAs: more than one wave), and k_route up to 4096 was 13.2 µs slower at
// 4096: so up to 1024. Runs 107-108 (one H200, pdl=0 traces, routing µs): S=256 k_reset 1.3 + k_route 9.2 vs k_logits
// 5.9 + k_topk 5.3; S=1024 1.3 + 15.0 vs 12.2 + 5.7; but S=4096 (128-row tiles, 256 CTAs) 1.5 + 35.5 vs 20.2 + 9.7,
// and a 32-row tile at S=1024 20.8. Below 256 (runs 112-113; one cluster at S=16, eight at 128): 1.4 + 8.8 vs
// 4.6 + 5.2 µs at S=16 and 1.3 + 8.8 vs 4.8 + 5.3 at 128 alone, yet the layer side by side (graph µs, medians of three
// rounds) was faster with k_route from S=8 (142.1 vs 143.3, S=16 212.3 vs 213.2, 128 309.1 vs 310.3: one kernel fewer
// for the persistent kernel to follow under pdl) and slower at S=2 (60.6 vs 59.9).
#ifndef MK_ROUTE_FUSED_S
#define MK_ROUTE_FUSED_S 8
#endif
#ifndef MK_ROUTE_FUSED_SMALL_S
#define MK_ROUTE_FUSED_SMALL_S 256
#endif
#ifndef MK_ROUTE_FUSED_MAX_S
#define MK_ROUTE_FUSED_MAX_S 1024
#endif
bool route_fused(const MkParams* p) {
  return p->S >= MK_ROUTE_FUSED_S && p->S <= MK_ROUTE_FUSED_MAX_S && p->S > p->route_small_max && p->E <= BN &&
         p->H % (ROUTE_SPLITS * BK) == 0;
}
template <class T>
int launch_route_fused(const MkParams* pp, cudaStream_t s) {
  MkParams q = *pp;
  q.stages = ROUTE_MAX_STAGES;  // H / 8 is a few k-steps: all of them in flight at once at H = 2048 (gemm_tile)
  cudaError_t e = prepare_route<T>();
  if (e != cudaSuccess) return fail("cudaFuncSetAttribute", e);
  k_reset<<<1, 256, 0, s>>>(q);
  if ((e = cudaGetLastError()) != cudaSuccess) return fail("k_reset launch", e);
  e = launch_kc(k_route<T>, dim3((unsigned)((q.S + T::BM - 1) / T::BM), 1, ROUTE_SPLITS), dim3(1, 1, ROUTE_SPLITS),
                T::THREADS, (size_t)smem_for<T>(ROUTE_MAX_STAGES), s, q.pdl != 0, q);
  return e == cudaSuccess ? 0 : fail("k_route launch", e);
}

template <class T>
int launch_experts(const MkParams* p, cudaStream_t s) {
  int per_sm = 0, sms = 0;
  if (occupancy(T::BM, p->stages, T::WG ? MK_CORE_WGMMA : MK_CORE_MMA, T::TMA, T::BNT, p->overlap, &per_sm, &sms))
    return 1;
  if (p->grid < 2 || p->grid > (int64_t)per_sm * sms) {
    snprintf(g_err, sizeof g_err, "mk: grid %lld not in 2..%d (resident CTAs: %d per SM x %d SMs)", (long long)p->grid,
             per_sm * sms, per_sm, sms);
    return 1;
  }
  CUtensorMap tm1, tm2;
  memset(&tm1, 0, sizeof tm1);
  memset(&tm2, 0, sizeof tm2);
  if constexpr (T::TMA) {  // the k-tiled weights as [K / 64 * rows, 64] matrices (tma_load_2d's coordinates)
    const uint64_t r1 = (uint64_t)(p->E * 2 * p->I), r2 = (uint64_t)(p->E * p->H);
    if (weight_map(p->w1, r1 * (uint64_t)(p->H / BK), BK, w_promotion(p), &tm1)) return 1;
    if (weight_map(p->w2, r2 * (uint64_t)(p->I / BK), BK, w_promotion(p), &tm2)) return 1;
  }
  bool launched = false;
  cudaError_t e = cudaSuccess;
  MkParams q = *p;  // tail rows: the overlap kernel's tail tile only (the other launches' m-tiles hold bm rows)
  if (!(T::XR > 0 && p->overlap)) q.tail_rows = 0;
  p = &q;
  if constexpr (T::WG) {
    if (p->overlap) {
      e = launch_k(k_experts_ov<T>, dim3((unsigned)p->grid), T::THREADS, smem_for_ov<T>((int)p->stages), s,
                   p->pdl != 0, *p, tm1, tm2);
      launched = true;
    }
  }
  if (!launched)
    e = launch_k(k_experts<T>, dim3((unsigned)p->grid), T::THREADS, smem_for<T>((int)p->stages), s, p->pdl != 0, *p,
                 tm1, tm2);
  if (e != cudaSuccess) return fail("k_experts launch", e);
  return 0;
}

// k_decode<NI>'s shared-memory limit raised to SMEM_MAX on device `dev` (once per device: launches of several sizes
// share the function's attribute, so raising it to each launch's size in turn, as before, left a larger launch over a
// smaller one's limit, as the streaming kernel's tests found in run 94) and one CTA per SM of `bytes` checked resident;
// done once per (device, NI, size): every launch asks (mk_experts -> launch_decode), and these are driver calls.
template <int NI>
int decode_attrs(int dev, int bytes) {
  static std::mutex mu;
  static bool raised[64];  // per device (< 64): the limit raised to SMEM_MAX
  static int done[16][2];  // (device + 1, bytes) pairs checked resident
  std::lock_guard<std::mutex> lock(mu);
  for (auto& d : done)
    if (d[0] == dev + 1 && d[1] == bytes) return 0;
  cudaError_t e;
  if (dev >= 64 || !raised[dev]) {
    if ((e = cudaFuncSetAttribute(k_decode<NI>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_MAX)) != cudaSuccess)
      return fail("cudaFuncSetAttribute (k_decode)", e);
    if (dev < 64) raised[dev] = true;
  }
  int per_sm = 0;
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_decode<NI>, DEC_THREADS, bytes)) != cudaSuccess)
    return fail("cudaOccupancyMaxActiveBlocksPerMultiprocessor (k_decode)", e);
  if (per_sm < 1) return fail_msg("mk: decode: no CTA of k_decode fits an SM");
  for (auto& d : done)
    if (d[0] == 0) {
      d[0] = dev + 1, d[1] = bytes;
      break;
    }
  return 0;
}
// Call f(k_decode<NI>) with the experts-per-lane bound of the in-kernel top-k (as k_topk's)
template <class F>
int with_decode(int64_t E, F&& f) {
  const int ni = (int)(E + 31) / 32;
  return ni <= 1 ? f(k_decode<1>, decode_attrs<1>) : ni <= 2 ? f(k_decode<2>, decode_attrs<2>)
       : ni <= 4 ? f(k_decode<4>, decode_attrs<4>) : ni <= 8 ? f(k_decode<8>, decode_attrs<8>)
       : f(k_decode<16>, decode_attrs<16>);
}

// The decode kernel's plan for S tokens on the current device, its shared-memory limit raised and one CTA per SM
// checked resident (every CTA waits for pairs other CTAs compute); 1 + g_err where it does not fit.
int decode_plan_for(int64_t S, int64_t H, int64_t I, int64_t K, int64_t E, DecPlan* out) {
  if (S < 1 || S * K > DEC_MAX_SLOTS) return fail_msg("mk: decode takes 1..64 routed rows (S x topk)");
  if (H % 8 || I % 8) return fail_msg("mk: decode needs hidden and intermediate to be multiples of 8");
  int dev = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail("cudaGetDevice", e);
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess)
    return fail("cudaDeviceGetAttribute", e);
  if (E < 1 || E > 32 * MAXE_PER_LANE) return fail_msg("mk: decode takes 1..512 experts");
  if (S * E > DEC_MAX_LOGITS) return fail_msg("mk: decode takes at most 4096 gate logits (S x experts)");
  const DecPlan d = dec_plan(S, H, I, K, E, sms);
  if (d.bytes == 0 || d.bytes > SMEM_MAX) {
    snprintf(g_err, sizeof g_err, "mk: decode: S x topk = %lld rows of W_down per CTA need %lld bytes of shared memory "
             "(at most %d)", (long long)(S * K), (long long)S * K * d.rows * I * 2, SMEM_MAX);
    return 1;
  }
  if (with_decode(E, [&](auto, auto attrs) { return attrs(dev, d.bytes); })) return 1;
  *out = d;
  return 0;
}

int launch_decode(const MkParams* p, cudaStream_t s) {
  DecPlan d;
  if (decode_plan_for(p->S, p->H, p->I, p->K, p->E, &d)) return 1;
  return with_decode(p->E, [&](auto kernel, auto) {
    const cudaError_t e = launch_k(kernel, dim3((unsigned)d.grid), DEC_THREADS, (size_t)d.bytes, s, p->pdl != 0, *p, d);
    return e == cudaSuccess ? 0 : fail("k_decode launch", e);
  });
}

}  // namespace

extern "C" {

int mk_abi_version(void) { return MK_ABI_VERSION; }
const char* mk_last_error(void) { return g_err; }

int mk_occupancy(int64_t bm, int64_t stages, int64_t core, int64_t tma, int64_t bn, int64_t overlap, int* per_sm,
                 int* sms) {
  if (bm != 16 && bm != 64 && bm != 128) return fail_msg("mk: bm must be 16, 64 or 128");
  if (stages < 2 || stages > MAX_STAGES) return fail_msg("mk: stages must be in 2..12");
  if (core != MK_CORE_MMA && core != MK_CORE_WGMMA) return fail_msg("mk: core must be 0 (mma) or 1 (wgmma)");
  if (tma != 0 && tma != 1) return fail_msg("mk: tma must be 0 or 1");
  if (const char* m = check_bn(bm, core, bn)) return fail_msg(m);
  if (overlap != 0 && overlap != 1) return fail_msg("mk: overlap must be 0 or 1");
  if (expert_smem(bm, core, tma, bn, overlap, (int)stages) > SMEM_MAX)
    return fail_msg("mk: stages too deep for bm (shared memory)");
  return occupancy(bm, stages, core, tma, bn, overlap, per_sm, sms);
}

int mk_route(const MkParams* p, void* stream) {
  if (check_params(p)) return 1;
  if (route_fused(p))
    return p->S <= MK_ROUTE_FUSED_SMALL_S ? launch_route_fused<Small>(p, (cudaStream_t)stream)
                                          : launch_route_fused<Large>(p, (cudaStream_t)stream);
  // the gate GEMM needs no big tiles: 16-row tiles up to MK_ROUTE_SMALL_TILE_S tokens, 64 otherwise
  return p->S <= MK_ROUTE_SMALL_TILE_S ? launch_route<Small>(p, (cudaStream_t)stream)
                                       : launch_route<Large>(p, (cudaStream_t)stream);
}

int mk_route_given(const MkParams* p, void* stream) {
  if (check_params(p)) return 1;
  cudaStream_t s = (cudaStream_t)stream;
  k_reset<<<1, 256, 0, s>>>(*p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail("k_reset launch", e);
  if (p->S > 0) {
    k_lists<<<(unsigned)((p->S * p->K + 255) / 256), 256, 0, s>>>(*p);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail("k_lists launch", e);
  }
  return 0;
}

int mk_decode_grid(int64_t S, int64_t H, int64_t I, int64_t K, int64_t E, int* grid, int* rows) {
  DecPlan d;
  if (decode_plan_for(S, H, I, K, E, &d)) return 1;
  *grid = d.grid;
  *rows = d.rows;
  return 0;
}

int mk_experts(const MkParams* p, void* stream) {
  if (check_params(p)) return 1;
  if (p->S == 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  if (p->decode) return launch_decode(p, s);
  return with_tile(p->bm, p->core, p->tma_b, p->bn, [&](auto tile) { return launch_experts<decltype(tile)>(p, s); });
}

}  // extern "C"
