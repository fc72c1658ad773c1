// The MoE megakernel's plain C ABI (libmoetune_moe.so), mirrored by runtime/megakernel/_lib.py.
//
// Every field of MkParams is 8 bytes wide (pointers and int64), so the ctypes mirror has no padding
// questions. The caller owns every buffer (torch tensors); the library allocates nothing.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MK_ABI_VERSION 19
// int32 words from one expert's routing counter to the next (MkParams.counts): one 128-byte line each. Packed,
// the 128 counters of a layer sat in four lines, so all top-k atomics of a launch queued at four L2 slices.
#define MK_COUNT_STRIDE 32
#define MK_MAX_SPLITS 16  // split-K parts per GEMM task (decode)

// ctl[] words (int32), one set per layer instance.
enum {
  MK_CTL_HEAD = 0,       // next queue slot a processor claims (atomicAdd)
  MK_CTL_TOTAL = 1,      // total tasks + 1 once the scheduler has counted them (0 = not yet)
  MK_CTL_ABORT = 2,      // set on the first error: every spin gives up
  MK_CTL_EPOCH = 3,      // launch number (queue flags carry it; never 0)
  MK_CTL_PUBLISHED = 4,  // tasks the scheduler has published (diagnostics)
  MK_CTL_TILES = 5,      // m-tiles this launch (diagnostics)
  MK_CTL_WORDS = 8
};

// err[] (int64, MK_ERR_WORDS): sticky until the host clears it. Words 0..3: the first error that aborted a launch (code,
// where, detail, waited ns). Words MK_ERR_NOABORT..+3 (ABI 19): the first error recorded without the abort
// (MK_ERR_NONFINITE_LOGITS, waited 0), the same layout. Apart, so that its "the other rows were computed" never keeps a
// later abort (of the same or a later launch) out of the record: the host names words 0..3 whenever they hold a code.
#define MK_ERR_NOABORT 4
enum {
  MK_OK = 0,
  MK_ERR_SCHED_TIMEOUT = 1,  // the scheduler waited past the timeout for a task's inputs
  MK_ERR_PROC_TIMEOUT = 2,   // a processor waited past the timeout for a queue slot
  MK_ERR_QUEUE_FULL = 3,     // more tasks than queue slots (a sizing bug; nothing written out of bounds)
  MK_ERR_BAD_EXPERT = 4,     // a given routing (or a routing kernel's pick: a bug) named an expert outside 0..E-1
                             // (the row is dropped and the launch aborted: none of its output rows is valid)
  MK_ERR_PIPE_TIMEOUT = 5,   // a stage mbarrier (wgmma core, TMA tiles) waited past the timeout
  MK_ERR_INPUT_TIMEOUT = 6,  // publish_all: a task waited past the timeout for its inputs (where = m-tile / combine tile)
  MK_ERR_EXPERT_FULL = 7,    // a given routing gave one expert more rows than S_cap = max_tokens (a token's picks
                             // repeat an expert; where = the row, detail = the expert): the rows past S_cap are
                             // dropped and the launch aborted (none of its output rows is valid)
  MK_ERR_NONFINITE_LOGITS = 8,  // a token's softmax broke: a NaN or +inf gate logit, or all of them -inf (NaN / inf
                                // in x or the gate weights; where = the token row, detail = its lowest expert whose
                                // logit is not finite). Recorded without the abort: its picks are still K distinct
                                // experts (0..K-1, NaN weights), its output row is NaN, and the other rows are
                                // computed as usual. -inf logits among finite ones (masking) are no error: their
                                // probabilities are 0 and the token routes as usual
  MK_ERR_WORDS = 8           // words of err[]: [1] = where (slot or tile), [2] = detail, [3] = waited ns; [4..7] the
                             // same for the record without the abort (MK_ERR_NOABORT)
};

// Task timeline (MkParams.trace): scheduler words, then MK_TR_SLOT words per queue slot.
enum {
  MK_TR_SCHED_START = 0,  // the scheduler CTA began
  MK_TR_SCHED_G1 = 1,     // every GEMM1 task published
  MK_TR_SCHED_END = 2,    // the subscriber released its last task
  MK_TR_HEAD = 8,
  MK_TR_PUB = 0, MK_TR_CLAIM = 1, MK_TR_DONE = 2, MK_TR_CTA = 3,
  MK_TR_MAIN = 4,  // the GEMM mainloop done, epilogue next (the first consumer thread / thread 0)
  MK_TR_EPI = 5,   // wgmma tiles: the first consumer thread's epilogue stores issued (signal next)
  MK_TR_SLOT = 6
};

// GEMM cores (MkParams.core). The wgmma core serves bm = 64 / 128 only; bm = 16 always runs mma.
enum { MK_CORE_MMA = 0, MK_CORE_WGMMA = 1 };

// Task kinds (bits 61..63 of a queue word).
enum { MK_TASK_GEMM1 = 1, MK_TASK_GEMM2 = 2, MK_TASK_COMBINE = 3 };

typedef struct MkParams {
  // layer inputs (bf16, contiguous)
  const void* x;       // [S, H]
  const void* wg;      // [E, H]   gate
  // ABI 18: the expert weights are k-tiled: W [K / 64][rows][64], element (row, k) at ((k / 64) * rows + row) * 64 + k % 64
  // (rows = E * 2I, K = H for w1; rows = E * H, K = I for w2; runtime/megakernel/weights.py converts)
  const void* w1;      // [E, 2I, H] first I rows gate, last I rows up, k-tiled
  const void* w2;      // [E, H, I], k-tiled
  void* out;           // [S, H]
  // routing results / scratch
  float* logits;       // [logit_splits_max, S, E] fp32 partial gate logits (split over H)
  int32_t* topk_idx;   // [S_cap, K]
  float* topk_w;       // [S_cap, K]  renormalised weights; row (t, j) is t*K + j
  int32_t* counts;     // [E * MK_COUNT_STRIDE]: expert e's row count at e * MK_COUNT_STRIDE (ABI 12)
  int32_t* lists;      // [E, S_cap]  rows t*K + j routed to each expert (order: atomics; results do not depend on it)
  void* h;             // [S_cap*K, I] bf16   SwiGLU activations per (token, slot)
  void* y;             // [S_cap*K, H] bf16   weighted expert output per (token, slot)
  // scheduler state
  int32_t* ctl;        // [MK_CTL_WORDS]
  int32_t* g1done;     // [max_tiles]  finished GEMM1 n-blocks per m-tile
  int32_t* comb;       // [max_ctiles] finished (row, GEMM2 n-block) pairs per combine tile
  int32_t* rel;        // [max_tiles + max_ctiles] epoch of release (scheduler-private)
  int32_t* tile_base;  // [E + 1] first m-tile id of each expert
  uint64_t* q_task;    // [q_cap]
  int32_t* q_flag;     // [q_cap] epoch when the slot's task is published
  int64_t* err;        // [MK_ERR_WORDS]
  // sizes
  int64_t S, S_cap, H, I, E, K;
  int64_t bm;          // m-tile rows: 16, 64 or 128
  int64_t stages;      // cp.async pipeline depth, 2..12 (shared memory: bm=16 <= 12, 64 <= 9, 8 on wgmma with overlap, 128 <= 6)
  int64_t combine_tokens;  // tokens per combine task
  int64_t q_cap, max_tiles, max_ctiles;
  int64_t grid;        // CTAs of the persistent launch: 1 scheduler + grid-1 processors
  int64_t timeout_ns;
  int64_t stall_tile;  // test hook: this m-tile's GEMM2 is never released (-1: off)
  int64_t logit_splits_max;  // planes in `logits` (the gate GEMM splits H into up to this many parts, <= 16)
  // ABI 6: GEMM core and decode split-K
  int64_t core;          // MK_CORE_MMA (mma.sync, ldmatrix) or MK_CORE_WGMMA (sm_90a warpgroup MMA, bm >= 64)
  int64_t split_k1;      // split-K parts of each GEMM1 task (1..16; 1 = none): bm = 16 launches with <= sk_max_tiles m-tiles
  int64_t split_k2;      // the same for GEMM2
  int64_t sk_max_tiles;  // m-tiles the partial-sum buffer holds (0: split-K off)
  float* sk_part;        // [sk_max_tiles * (N1 + N2) slots][max(split_k1, split_k2) parts][16 acc registers][128 threads] fp32
  int32_t* sk_cnt;       // [sk_max_tiles * (N1 + N2)] finished parts per slot (zeroed by the routing kernels)
  // ABI 7
  int64_t tma_b;  // 1: expert tasks load the weight (B) tiles by TMA (wgmma core, and bm = 16 on the mma core;
                  // bm = 64 / 128 on the mma core keep cp.async); 0: every thread's cp.async (default)
  // ABI 8
  int64_t bn;  // columns per GEMM task: 128 (default), or 256 (the wide tile: wgmma core with bm = 128 only; hidden
               // and 2 x intermediate multiples of 256). A wide task covers two 128-column n-blocks (nb even, nb + 1)
               // and counts both in the readiness counters, so g1done / comb thresholds stay per 128 columns.
  // ABI 9
  int64_t overlap;  // 1: the wgmma tiles run the cross-task overlap kernel (the producer warpgroup claims the next task
                    // and loads its stages while the consumers finish the current one; COMBINE tasks run on the
                    // consumer warpgroups); 0: k_experts as before (default). The mma core and bm = 16 ignore it.
  // ABI 10
  int64_t route_small_max;  // launches with S <= this run k_topk_small (one block per token, rank selection) instead of
                            // k_topk (one warp per token); 0 = always k_topk. Same bits either way.
  // ABI 11
  int64_t* trace;  // null (default), or globaltimer stamps (ns) of the persistent launch, for profiling the schedule:
                   // [MK_TR_HEAD] scheduler words, then per queue slot MK_TR_SLOT words (published, claimed, done,
                   // CTA, mainloop done, epilogue stores issued), then per CTA (start, end). The host zeroes it; every stamp is a plain store.
  int64_t publish_all;  // 1: the mma-core tiles (bm = 16 decode, and core = mma) publish every task at launch and a
                        // processor waits for a GEMM2's / COMBINE's inputs itself, after starting the weight loads
                        // that need none; 0: the subscriber publishes them as they become ready (the wgmma tiles
                        // always do)
  // ABI 13
  int64_t pdl;  // 1: programmatic dependent launch: k_topk and the persistent kernel are launched while the kernel
                // before them still runs (griddepcontrol) and wait for it before reading anything it writes; 0: plain
                // stream order
  // ABI 14
  int64_t l2_evict_w;  // 1: the TMA weight tiles load with the L2 evict-first policy (the layer sets it for launches that
                       // read each expert's weights about once); 0: the default policy
  // ABI 15
  int64_t decode;  // 0: the task graph's persistent kernel. 1 / 2: mk_experts runs the decode kernel instead (one CTA
                   // per SM: row-pair GEMVs for the up projection while each CTA's rows of the down projection load
                   // into shared memory; mk_decode_grid says where it fits), with the picks given in topk_idx /
                   // topk_w (1) or (ABI 16) routing from the gate in the kernel itself (2, no mk_route before it)
  // ABI 16
  int32_t* dec_cnt;  // [(64 + 1) * 32 + 4096] the decode kernel's counters and routing logits (DEC_CNT_WORDS in
                     // mk_decode.cuh; zero between launches: its last CTA resets them)
  // ABI 17
  int64_t tail_rows;  // 0..16: an expert's last rows past a multiple of 128, up to this many, ride in its last full
                      // m-tile (128 + r rows: mma.sync beside the wgmmas) instead of an m-tile of their own (mk_index.h:
                      // expert_tiles). The wide tile (bn = 256) on the overlap kernel only; every other launch ignores it.
} MkParams;

int mk_abi_version(void);
const char* mk_last_error(void);
// Resident CTAs per SM of the persistent kernel for (bm, stages, core, tma, bn, overlap), and the SM count of the
// current device (ABI 8: bn added; ABI 9: overlap).
int mk_occupancy(int64_t bm, int64_t stages, int64_t core, int64_t tma, int64_t bn, int64_t overlap, int* per_sm,
                 int* sms);
// The decode kernel's launch for S tokens of this shape (E experts) on the current device: 0 and its CTAs (*grid, one per SM) and
// output rows per CTA (*rows) where it fits (S x topk <= 64, each CTA's rows of W_down in its shared memory), else 1
// and mk_last_error says why (ABI 15).
int mk_decode_grid(int64_t S, int64_t H, int64_t I, int64_t K, int64_t E, int* grid, int* rows);
// Launch the routing kernels (gate GEMM + softmax/top-k/lists) on `stream`.
int mk_route(const MkParams* p, void* stream);
// Given routing (p->topk_idx / p->topk_w filled by the caller): reset + per-expert row lists.
int mk_route_given(const MkParams* p, void* stream);
// Launch the persistent expert kernel on `stream` (needs mk_route's outputs).
int mk_experts(const MkParams* p, void* stream);

#ifdef __cplusplus
}
#endif
