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
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "mk_api.h"

namespace {

thread_local char g_err[512] = "";

int fail(const char* what, cudaError_t e) {
  snprintf(g_err, sizeof g_err, "%s: %s", what, cudaGetErrorString(e));
  return 1;
}
int fail_msg(const char* msg) {
  snprintf(g_err, sizeof g_err, "%s", msg);
  return 1;
}

constexpr int BK = 64;        // k elements per pipeline stage (128 bytes per row: 8 chunks of 16 B)
constexpr int BN = 128;       // n rows of weights per tile
constexpr int THREADS = 128;  // the routing kernels' block; tile kernels use Tile::THREADS

template <int BM_, int WM_, int WN_, int MINB_>
struct Tile {
  static constexpr int BM = BM_, WM = WM_, WN = WN_, THREADS = WM * WN * 32, MINB = MINB_;
  static constexpr int WTM = BM / WM, WTN = BN / WN;
  static constexpr int MT = WTM / 16, NT = WTN / 8;
  static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
  // Per-task metadata after the pipeline stages: A row offsets, B row offsets, row ids.
  static constexpr int META = BM * 8 + BN * 8 + BM * 4;
  static_assert(MT >= 1 && NT % 2 == 0, "warp tile");
};
using Small = Tile<16, 1, 4, 1>;   // decode: 16 rows x 128, 4 warps of 16 x 32
using Large = Tile<64, 2, 2, 1>;   // 64 rows x 128, 4 warps of 32 x 64
using Huge = Tile<128, 2, 4, 2>;  // prefill: 128 rows x 128, 8 warps of 64 x 32 (twice Large's FLOP per L2 byte);
                                  // 2 CTAs/SM need <= 128 registers (run 4: 1 CTA/SM was 1.6x slower)

__host__ __device__ constexpr int smem_bytes(int stage_bytes, int meta, int stages) { return stage_bytes * stages + meta; }

// ---- PTX helpers ---------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
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

// First error wins; the abort flag makes every other wait give up at once.
__device__ void report(const MkParams& p, int64_t code, int64_t where, int64_t detail, int64_t waited) {
  if (atomicCAS((unsigned long long*)p.err, 0ull, (unsigned long long)code) == 0ull) {
    p.err[1] = where;
    p.err[2] = detail;
    p.err[3] = waited;
    __threadfence_system();
  }
  atomicExch(&p.ctl[MK_CTL_ABORT], 1);
}

// ---- the tile GEMM: acc[BM x 128] = A[BM rows, K] . B[128 rows, K]^T (bf16 in, fp32 accumulate) -------
// A row r starts at a_base + a_off[r]; B row n at b_base + b_off[n] (offset < 0: a zero row). Shared tiles
// are [rows][64] bf16 with the 16-byte chunk index XOR-swizzled by (row & 7): conflict-free for both the
// cp.async stores and the ldmatrix reads. `stages`-deep cp.async pipeline (keeps stages-1 tiles of
// weights in flight per CTA: what decode sizes, bound by reading the weights, need).
using bf16 = __nv_bfloat16;

template <class T>
__device__ __forceinline__ void load_stage(char* smem, int stages, int kt, const bf16* a_base, const int64_t* a_off,
                                           const bf16* b_base, const int64_t* b_off) {
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
    const int64_t off = b_off[r];
    cp_async16(su32(sB + (r * 8 + (ch ^ (r & 7))) * 16), b_base + (off < 0 ? 0 : off) + k0 + ch * 8, off < 0 ? 0 : 16);
  }
}

template <class T>
__device__ __forceinline__ void gemm_tile(float (&acc)[T::MT][T::NT][4], char* smem, int stages, const bf16* a_base,
                                          const int64_t* a_off, const bf16* b_base, const int64_t* b_off, int K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN;
#pragma unroll
  for (int i = 0; i < T::MT; ++i)
#pragma unroll
    for (int j = 0; j < T::NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
  const int KT = K / BK;
  for (int s = 0; s < stages - 1; ++s) {
    if (s < KT) load_stage<T>(smem, stages, s, a_base, a_off, b_base, b_off);
    cp_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_wait(stages - 2);
    __syncthreads();  // tile kt landed for every thread; slot (kt-1) % stages is free again
    if (kt + stages - 1 < KT) load_stage<T>(smem, stages, kt + stages - 1, a_base, a_off, b_base, b_off);
    cp_commit();
    const char* sA = smem + (kt % stages) * T::STAGE;
    const char* sB = sA + T::A_BYTES;
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
        const int row = wn * T::WTN + j * 16 + (lane & 7) + ((lane >> 4) << 3), ch = kk * 2 + ((lane >> 3) & 1);
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
  cp_wait(0);
  __syncthreads();  // shared memory free for the caller
}

// ---- task encoding -----------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t enc(int kind, int e, int mt, int nb, int tile) {
  return ((uint64_t)kind << 61) | ((uint64_t)e << 48) | ((uint64_t)mt << 32) | ((uint64_t)nb << 20) | (uint64_t)tile;
}

struct Meta {
  int64_t* a_off;
  int64_t* b_off;
  int* row_id;
};
template <class T>
__device__ __forceinline__ Meta meta(char* smem, int stages) {
  Meta m;
  m.a_off = (int64_t*)(smem + T::STAGE * stages);
  m.b_off = m.a_off + T::BM;
  m.row_id = (int*)(m.b_off + BN);
  return m;
}

// GEMM1 / GEMM2 task of m-tile `tile` = (e, mt), n-block nb.
template <class T>
__device__ void run_gemm(const MkParams& p, char* smem, int kind, int e, int mt, int nb, int tile) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN;
  const int K = (int)p.K, H = (int)p.H, I = (int)p.I;
  const int stages = (int)p.stages;
  Meta md = meta<T>(smem, stages);
  const int cnt = p.counts[e];  // written by the routing kernel (earlier in the stream)
  for (int r = tid; r < T::BM; r += T::THREADS) {
    const int m = mt * T::BM + r;
    const int v = m < cnt ? p.lists[(int64_t)e * p.S_cap + m] : -1;
    md.row_id[r] = v;
    md.a_off[r] = v < 0 ? -1 : (kind == MK_TASK_GEMM1 ? (int64_t)(v / K) * H : (int64_t)v * I);
  }
  for (int n = tid; n < BN; n += T::THREADS) {
    if (kind == MK_TASK_GEMM1) {
      // interleave: tile row 2q = gate row nb*64+q, row 2q+1 = up row I+nb*64+q, so each thread's
      // accumulator pair (c0, c1) is (gate, up) of one intermediate column: SwiGLU in registers.
      const int q = n >> 1;
      const int64_t row = (n & 1) ? (int64_t)I + nb * 64 + q : (int64_t)nb * 64 + q;
      md.b_off[n] = ((int64_t)e * 2 * I + row) * H;
    } else {
      md.b_off[n] = ((int64_t)e * H + nb * BN + n) * I;
    }
  }
  __syncthreads();
  float acc[T::MT][T::NT][4];
  if (kind == MK_TASK_GEMM1)
    gemm_tile<T>(acc, smem, stages, (const bf16*)p.x, md.a_off, (const bf16*)p.w1, md.b_off, H);
  else
    gemm_tile<T>(acc, smem, stages, (const bf16*)p.h, md.a_off, (const bf16*)p.w2, md.b_off, I);

  bf16* h = (bf16*)p.h;
  bf16* y = (bf16*)p.y;
#pragma unroll
  for (int i = 0; i < T::MT; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * T::WTM + i * 16 + (lane >> 2) + half * 8;
      const int v = md.row_id[r];
      if (v < 0) continue;
      if (kind == MK_TASK_GEMM1) {
#pragma unroll
        for (int j = 0; j < T::NT; ++j) {
          const float g = acc[i][j][2 * half], u = acc[i][j][2 * half + 1];
          const int col = nb * 64 + (wn * T::WTN + j * 8) / 2 + (lane & 3);
          h[(int64_t)v * I + col] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
        }
      } else {
        const float w = p.topk_w[v];
#pragma unroll
        for (int j = 0; j < T::NT; ++j) {
          const int col = nb * BN + wn * T::WTN + j * 8 + 2 * (lane & 3);
          *(__nv_bfloat162*)(y + (int64_t)v * H + col) =
              __floats2bfloat162_rn(acc[i][j][2 * half] * w, acc[i][j][2 * half + 1] * w);
        }
      }
    }
  __syncthreads();  // every thread's stores issued before thread 0's fence + signal
  if (tid == 0) {
    __threadfence();  // fence + relaxed reds = release: the subscriber's acquire sees h / y
    if (kind == MK_TASK_GEMM1) {
      red_add(&p.g1done[tile], 1);
    } else {
      for (int r = 0; r < T::BM; ++r) {
        const int v = md.row_id[r];
        if (v >= 0) red_add(&p.comb[(v / K) / (int)p.combine_tokens], 1);
      }
    }
  }
}

// Column blocks per combine tile: the tile's work is split over H so the combine at the end of the layer
// (on the critical path) runs on many CTAs (run 2: 16-token combine tasks cost 46 us at S=128 over 4-token ones).
__host__ __device__ __forceinline__ int combine_blocks(int64_t H) { return (H / 8) % 4 == 0 ? 4 : 1; }

// COMBINE task: out[t] = sum_j y[t*K + j] in slot order (fp32), for the tile's tokens, column block cb.
__device__ void run_combine(const MkParams& p, int ct, int cb) {
  const int K = (int)p.K, H = (int)p.H;
  const int t0 = ct * (int)p.combine_tokens;
  const int t1 = min((int)p.S, t0 + (int)p.combine_tokens);
  const int chunks = H / 8 / combine_blocks(H), c0 = cb * chunks;
  const bf16* y = (const bf16*)p.y;
  bf16* out = (bf16*)p.out;
  for (int i = threadIdx.x; i < (t1 - t0) * chunks; i += blockDim.x) {
    const int t = t0 + i / chunks, c = c0 + i % chunks;
    float s[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) s[q] = 0.f;
    for (int j = 0; j < K; ++j) {
      const uint4 v = __ldcg((const uint4*)(y + ((int64_t)t * K + j) * H + c * 8));
      const __nv_bfloat162* b = (const __nv_bfloat162*)&v;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(b[q]);
        s[2 * q] += f.x;
        s[2 * q + 1] += f.y;
      }
    }
    uint4 o;
    __nv_bfloat162* ob = (__nv_bfloat162*)&o;
#pragma unroll
    for (int q = 0; q < 4; ++q) ob[q] = __floats2bfloat162_rn(s[2 * q], s[2 * q + 1]);
    *(uint4*)(out + (int64_t)t * H + c * 8) = o;
  }
}

// Expert owning m-tile `tile` (base[] = exclusive prefix of m-tiles per expert, base[E] = total).
__device__ __forceinline__ int tile_expert(const int* base, int E, int tile) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {  // largest e with base[e] <= tile
    const int mid = (lo + hi + 1) >> 1;
    if (base[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// ---- the scheduler CTA ----------------------------------------------------------------------------------
template <class T>
__device__ void scheduler(const MkParams& p, char* smem, int epoch) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int E = (int)p.E, K = (int)p.K, bm = T::BM;
  const int N1 = (int)(2 * p.I / BN), N2 = (int)(p.H / BN);
  const int CT = (int)p.combine_tokens;
  int* base = (int*)smem;  // [E + 1]
  // m-tiles per expert -> exclusive prefix (warp 0: each lane a contiguous run of experts, then a scan)
  if (warp == 0) {
    const int per = (E + 31) / 32, e0 = lane * per, e1 = min(E, e0 + per);
    int sum = 0;
    for (int e = e0; e < e1; ++e) sum += (p.counts[e] + bm - 1) / bm;
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(~0u, incl, o);
      if (lane >= o) incl += n;
    }
    int run = incl - sum;
    for (int e = e0; e < e1; ++e) {
      base[e] = run;
      run += (p.counts[e] + bm - 1) / bm;
    }
    if (lane == 31) base[E] = incl;
  }
  __syncthreads();
  const int n_tiles = base[E];
  const int n_ct = (int)((p.S + CT - 1) / CT);
  const int g1 = n_tiles * N1;
  const int NC = combine_blocks(p.H);
  const int64_t total = (int64_t)n_tiles * (N1 + N2) + (int64_t)n_ct * NC;
  if (total > p.q_cap || n_tiles > p.max_tiles || n_ct > p.max_ctiles) {
    if (tid == 0) report(p, MK_ERR_QUEUE_FULL, total, p.q_cap, 0);
    return;
  }
  if (tid == 0) {
    p.ctl[MK_CTL_TILES] = n_tiles;
    st_release(&p.ctl[MK_CTL_TOTAL], (int)total + 1);
  }
  // every GEMM1 task is ready at once (routing finished before this launch)
  // Release in batches: task words, then ONE fence per thread, then relaxed flag stores (a release per
  // flag would serialise a full fence per task: measured ~100 us per layer in run 1).
  for (int c0 = 0; c0 < g1; c0 += (int)blockDim.x * 8) {
    const int hi = min(g1, c0 + (int)blockDim.x * 8);
    for (int i = c0 + tid; i < hi; i += blockDim.x) {
      const int tile = i / N1, nb = i % N1;
      const int e = tile_expert(base, E, tile);
      p.q_task[i] = enc(MK_TASK_GEMM1, e, tile - base[e], nb, tile);
    }
    __threadfence();
    for (int i = c0 + tid; i < hi; i += blockDim.x) st_relaxed(&p.q_flag[i], epoch);
  }
  if (warp != 0) return;
  // subscriber: poll the readiness counters, publish what became ready; fail after timeout_ns without progress
  int tail = g1, released = 0;
  const int need = n_tiles + n_ct;
  uint64_t since = gtime();
  int32_t* rel_ct = p.rel + p.max_tiles;
  long long seen = -1;  // sum of the unreleased counters last sweep: any change counts as progress
  while (released < need) {
    int got = 0;
    long long sum = 0;
    for (int b = 0; b < n_tiles; b += 32) {
      const int tile = b + lane;
      bool ready = false;
      if (tile < n_tiles && p.rel[tile] != epoch) {
        const int v = ld_acquire(&p.g1done[tile]);
        sum += v;
        ready = v == N1 && tile != (int)p.stall_tile;
      }
      const unsigned m = __ballot_sync(~0u, ready);
      const int pos = tail + __popc(m & ((1u << lane) - 1)) * N2;
      if (ready) {
        const int e = tile_expert(base, E, tile);
        p.rel[tile] = epoch;
        for (int nb = 0; nb < N2; ++nb) p.q_task[pos + nb] = enc(MK_TASK_GEMM2, e, tile - base[e], nb, tile);
      }
      if (m) {
        __threadfence();  // one fence for the warp's batch, then relaxed flags (release pattern)
        if (ready)
          for (int nb = 0; nb < N2; ++nb) st_relaxed(&p.q_flag[pos + nb], epoch);
      }
      tail += __popc(m) * N2;
      got += __popc(m);
    }
    for (int b = 0; b < n_ct; b += 32) {
      const int ct = b + lane;
      bool ready = false;
      if (ct < n_ct && rel_ct[ct] != epoch) {
        const int ntok = min((int)p.S, (ct + 1) * CT) - ct * CT;
        const int v = ld_acquire(&p.comb[ct]);
        sum += v;
        ready = v == ntok * K * N2;
      }
      const unsigned m = __ballot_sync(~0u, ready);
      const int pos = tail + __popc(m & ((1u << lane) - 1)) * NC;
      if (ready) {
        rel_ct[ct] = epoch;
        for (int cb = 0; cb < NC; ++cb) p.q_task[pos + cb] = enc(MK_TASK_COMBINE, 0, ct, cb, 0);
      }
      if (m) {
        __threadfence();
        if (ready)
          for (int cb = 0; cb < NC; ++cb) st_relaxed(&p.q_flag[pos + cb], epoch);
      }
      tail += __popc(m) * NC;
      got += __popc(m);
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
  if (lane == 0) p.ctl[MK_CTL_PUBLISHED] = tail;
}

// ---- the persistent kernel ------------------------------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(T::THREADS, T::MINB) k_experts(const MkParams p) {
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t s_task;
  const int epoch = p.ctl[MK_CTL_EPOCH];  // bumped by the routing kernel before this launch
  if (blockIdx.x == 0) {
    scheduler<T>(p, smem, epoch);
    return;
  }
  for (;;) {
    if (threadIdx.x == 0) {
      uint64_t task = 0;  // 0: no more work
      const int i = atomicAdd(&p.ctl[MK_CTL_HEAD], 1);
      const uint64_t since = gtime();
      unsigned ns = 32;
      for (;;) {
        if (i < p.q_cap && ld_acquire(&p.q_flag[i]) == epoch) {
          task = *(volatile uint64_t*)&p.q_task[i];
          break;
        }
        const int tot = ld_acquire(&p.ctl[MK_CTL_TOTAL]);
        if (tot > 0 && i >= tot - 1) break;
        if (*(volatile int32_t*)&p.ctl[MK_CTL_ABORT]) break;
        const uint64_t waited = gtime() - since;
        if (waited > (uint64_t)p.timeout_ns) {
          report(p, MK_ERR_PROC_TIMEOUT, i, tot - 1, (int64_t)waited);
          break;
        }
        __nanosleep(ns);
        ns = min(ns * 2, 512u);  // back off: hundreds of waiting CTAs must not crowd the L2 lines they poll
      }
      s_task = task;
    }
    __syncthreads();
    const uint64_t task = s_task;
    __syncthreads();  // everyone read s_task before thread 0 may overwrite it
    if (task == 0) return;
    const int kind = (int)(task >> 61), e = (int)((task >> 48) & 0x1fff), mt = (int)((task >> 32) & 0xffff);
    const int nb = (int)((task >> 20) & 0xfff), tile = (int)(task & 0xfffff);
    if (kind == MK_TASK_COMBINE)
      run_combine(p, mt, nb);
    else
      run_gemm<T>(p, smem, kind, e, mt, nb, tile);
  }
}

// ---- routing ----------
// Zero the counters of the expert kernel and bump the launch epoch (one block; the next kernels see it).
__device__ void reset_ctl(const MkParams& p) {
  const int tid = threadIdx.x;
  for (int i = tid; i < p.E; i += blockDim.x) p.counts[i] = 0;
  for (int i = tid; i < p.max_tiles; i += blockDim.x) p.g1done[i] = 0;
  for (int i = tid; i < p.max_ctiles; i += blockDim.x) p.comb[i] = 0;
  if (tid == 0) {
    p.ctl[MK_CTL_HEAD] = 0;
    p.ctl[MK_CTL_TOTAL] = 0;
    p.ctl[MK_CTL_ABORT] = 0;
    p.ctl[MK_CTL_PUBLISHED] = 0;
    const int ep = p.ctl[MK_CTL_EPOCH] + 1;
    p.ctl[MK_CTL_EPOCH] = ep == 0 ? 1 : ep;
  }
}

__global__ void k_reset(const MkParams p) { reset_ctl(p); }

// Given routing (topk_idx / topk_w already filled): build the per-expert row lists.
__global__ void k_lists(const MkParams p) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= p.S * p.K) return;
  const int e = p.topk_idx[row];
  if (e < 0 || e >= p.E) {
    report(p, MK_ERR_BAD_EXPERT, row, e, 0);
    return;
  }
  const int pos = atomicAdd(&p.counts[e], 1);
  p.lists[(int64_t)e * p.S_cap + pos] = (int)row;
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

constexpr int MAXE_PER_LANE = 16;  // E <= 512
constexpr int MAXK = 16;
constexpr int MAX_SPLITS = 16;     // logit planes k_topk adds (layer.py caps logit_splits at 16)
constexpr int TOPK_TOKENS = THREADS / 32;  // one warp per token

// Softmax (fp32), top-k (ties: lower expert first), renormalise; append (t, j) to its expert's list.
// Phase 1: the whole block adds the split planes of its tokens' logits into shared memory, every load of a
// thread issued before its first add (run 5 under ncu: 24 us at S=1 when each lane chained its 16 plane
// loads one after another); the planes are added in plane order, so the logits are the same bits as before.
// Phase 2: one warp per token: softmax, top-k, renormalise.
__global__ void __launch_bounds__(THREADS) k_topk(const MkParams p, int splits) {
  __shared__ float s_lg[TOPK_TOKENS][32 * MAXE_PER_LANE];
  const int lane = threadIdx.x & 31;
  const int t0 = blockIdx.x * TOPK_TOKENS;
  const int E = (int)p.E, K = (int)p.K;
  const int ntok = min(TOPK_TOKENS, (int)p.S - t0);
  const int64_t plane = p.S * p.E;
  for (int i0 = 0; i0 < ntok * E; i0 += THREADS * 4) {
    float part[4][MAX_SPLITS];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + r * THREADS + threadIdx.x;
      const bool ok = i < ntok * E;
      const float* src = p.logits + (int64_t)(t0 + (ok ? i / E : 0)) * E + (ok ? i % E : 0);
#pragma unroll
      for (int z = 0; z < MAX_SPLITS; ++z) part[r][z] = ok && z < splits ? __ldg(src + z * plane) : 0.f;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + r * THREADS + threadIdx.x;
      float a = part[r][0];
#pragma unroll
      for (int z = 1; z < MAX_SPLITS; ++z)
        if (z < splits) a += part[r][z];  // fixed order: reproducible
      if (i < ntok * E) s_lg[i / E][i % E] = a;
    }
  }
  __syncthreads();
  const int tl = threadIdx.x >> 5, t = t0 + tl;
  if (tl >= ntok) return;
  // One warp's serial chain is the whole cost at small S (run 7 under ncu: 13.6 us at S=1 with every loop
  // running to 32 * MAXE_PER_LANE): loops stop at E (warp-uniform), and each lane keeps its best unpicked
  // expert, rescanning only after its own pick.
  const int NI = (E + 31) / 32;
  float v[MAXE_PER_LANE];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < MAXE_PER_LANE; ++i) {
    if (i >= NI) break;
    const int e = lane + 32 * i;
    v[i] = e < E ? s_lg[tl][e] : -INFINITY;
    m = fmaxf(m, v[i]);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < MAXE_PER_LANE; ++i) {
    if (i >= NI) break;
    v[i] = lane + 32 * i < E ? expf(v[i] - m) : 0.f;
    s += v[i];
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
#pragma unroll
  for (int i = 0; i < MAXE_PER_LANE; ++i) {
    if (i >= NI) break;
    v[i] = lane + 32 * i < E ? v[i] / s : -1.f;
  }
  unsigned taken = 0;
  float sel_v[MAXK];
  int sel_i[MAXK];
  float sum = 0.f;
  float lv = -2.f;  // this lane's best unpicked (value, expert): ties keep the lower index
  int li = 1 << 30;
#pragma unroll
  for (int i = 0; i < MAXE_PER_LANE; ++i) {
    if (i >= NI) break;
    if (v[i] > lv) {
      lv = v[i];
      li = lane + 32 * i;
    }
  }
#pragma unroll
  for (int j = 0; j < MAXK; ++j) {
    if (j >= K) break;
    float bv = lv;
    int bi = li;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ov = __shfl_xor_sync(~0u, bv, o);
      const int oi = __shfl_xor_sync(~0u, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if ((bi & 31) == lane) {  // the winner's lane rescans its unpicked experts
      taken |= 1u << (bi >> 5);
      lv = -2.f;
      li = 1 << 30;
#pragma unroll
      for (int i = 0; i < MAXE_PER_LANE; ++i) {
        if (i >= NI) break;
        if (!((taken >> i) & 1) && v[i] > lv) {
          lv = v[i];
          li = lane + 32 * i;
        }
      }
    }
    sel_v[j] = bv;
    sel_i[j] = bi;
    sum += bv;
  }
  const float denom = fmaxf(sum, 1e-20f);
#pragma unroll
  for (int j = 0; j < MAXK; ++j) {
    if (j < K && lane == j) {
      const int e = sel_i[j], row = t * K + j;
      p.topk_idx[row] = e;
      p.topk_w[row] = sel_v[j] / denom;
      const int pos = atomicAdd(&p.counts[e], 1);
      p.lists[(int64_t)e * p.S_cap + pos] = row;
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------------------
constexpr int MAX_STAGES = 12;  // bm=16 only: 12 x 18 KB fits one CTA per SM
// Dynamic shared memory a CTA may opt into: 227 KB less room for the kernels' static shared memory (run 7:
// asking for the whole 227 KB failed with "invalid argument").
constexpr int SMEM_MAX = 227 * 1024 - 1024;

template <class T>
int smem_for(int stages) { return smem_bytes(T::STAGE, T::META, stages); }

template <class T>
cudaError_t prepare() {  // raise the dynamic shared-memory limit once per kernel (enough for MAX_STAGES)
  static bool done = false;
  if (done) return cudaSuccess;
  const int most = smem_for<T>(MAX_STAGES) <= SMEM_MAX ? smem_for<T>(MAX_STAGES) : SMEM_MAX;
  cudaError_t e = cudaFuncSetAttribute(k_experts<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k_logits<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
  done = e == cudaSuccess;
  return e;
}

int check_params(const MkParams* p) {
  if (!p) return fail_msg("mk: null params");
  if (p->bm != 16 && p->bm != 64 && p->bm != 128) return fail_msg("mk: bm must be 16, 64 or 128");
  if (p->logit_splits_max < 1 || p->logit_splits_max > MAX_SPLITS) return fail_msg("mk: logit_splits_max must be in 1..16");
  if (p->stages < 2 || p->stages > MAX_STAGES) return fail_msg("mk: stages must be in 2..12");
  {
    const int st = (int)p->stages;
    const int smem = p->bm == 16 ? smem_for<Small>(st) : p->bm == 64 ? smem_for<Large>(st) : smem_for<Huge>(st);
    if (smem > SMEM_MAX) return fail_msg("mk: stages too deep for bm (shared memory > 227 KB: bm=16 <= 12, 64 <= 8, 128 <= 6)");
  }
  if (p->H % BN || p->I % 64 || (2 * p->I) / BN > 4095 || p->H / BN > 4095)
    return fail_msg("mk: hidden must be a multiple of 128 and intermediate of 64");
  if (p->E < 1 || p->E > 32 * MAXE_PER_LANE) return fail_msg("mk: experts must be in 1..512");
  if (p->K < 1 || p->K > MAXK || p->K > p->E) return fail_msg("mk: topk must be in 1..min(16, experts)");
  if (p->S < 0 || p->S > p->S_cap) return fail_msg("mk: S must be in 0..S_cap");
  if (p->S_cap * p->K > (1ll << 30)) return fail_msg("mk: S_cap * topk too large");
  if (p->max_tiles >= (1 << 20) || p->max_ctiles > (1 << 16)) return fail_msg("mk: too many tiles");
  if (p->combine_tokens < 1) return fail_msg("mk: combine_tokens must be >= 1");
  if (p->timeout_ns <= 0) return fail_msg("mk: timeout must be > 0");
  return 0;
}

int occupancy(int64_t bm, int64_t stages, int* per_sm, int* sms) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail("cudaGetDevice", e);
  if ((e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess)
    return fail("cudaDeviceGetAttribute", e);
  if (bm == 16) {
    if ((e = prepare<Small>()) != cudaSuccess) return fail("cudaFuncSetAttribute", e);
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, k_experts<Small>, Small::THREADS, smem_for<Small>((int)stages));
  } else if (bm == 64) {
    if ((e = prepare<Large>()) != cudaSuccess) return fail("cudaFuncSetAttribute", e);
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, k_experts<Large>, Large::THREADS, smem_for<Large>((int)stages));
  } else {
    if ((e = prepare<Huge>()) != cudaSuccess) return fail("cudaFuncSetAttribute", e);
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, k_experts<Huge>, Huge::THREADS, smem_for<Huge>((int)stages));
  }
  if (e != cudaSuccess) return fail("cudaOccupancyMaxActiveBlocksPerMultiprocessor", e);
  return 0;
}

template <class T>
int launch_route(const MkParams* pp, cudaStream_t s) {
  MkParams q = *pp;
  q.stages = pp->stages < 4 ? pp->stages : 4;  // the gate GEMM's own depth: 0.5 MB of weights, no deep pipeline
  const MkParams* p = &q;
  cudaError_t e = prepare<T>();
  if (e != cudaSuccess) return fail("cudaFuncSetAttribute", e);
  dim3 grid((unsigned)((p->S + T::BM - 1) / T::BM), (unsigned)((p->E + BN - 1) / BN));
  if (grid.x == 0) grid.x = 1;  // S = 0 still resets the counters
  // split H until about two waves of CTAs (each split a multiple of BK, at most logit_splits_max planes)
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  int splits = 1;
  while (splits * 2 <= p->logit_splits_max && p->H % (splits * 2 * BK) == 0 &&
         (int64_t)grid.x * grid.y * splits * 2 <= 2 * sms)
    splits *= 2;
  grid.z = splits;
  k_logits<T><<<grid, T::THREADS, smem_for<T>((int)p->stages), s>>>(*p);
  if ((e = cudaGetLastError()) != cudaSuccess) return fail("k_logits launch", e);
  if (p->S > 0) {
    k_topk<<<(unsigned)((p->S + 3) / 4), THREADS, 0, s>>>(*p, splits);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail("k_topk launch", e);
  }
  return 0;
}

template <class T>
int launch_experts(const MkParams* p, cudaStream_t s) {
  int per_sm = 0, sms = 0;
  if (occupancy(T::BM, p->stages, &per_sm, &sms)) return 1;
  if (p->grid < 2 || p->grid > (int64_t)per_sm * sms) {
    snprintf(g_err, sizeof g_err, "mk: grid %lld not in 2..%d (resident CTAs: %d per SM x %d SMs)", (long long)p->grid,
             per_sm * sms, per_sm, sms);
    return 1;
  }
  k_experts<T><<<(unsigned)p->grid, T::THREADS, smem_for<T>((int)p->stages), s>>>(*p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail("k_experts launch", e);
  return 0;
}

}  // namespace

extern "C" {

int mk_abi_version(void) { return MK_ABI_VERSION; }
const char* mk_last_error(void) { return g_err; }

int mk_occupancy(int64_t bm, int64_t stages, int* per_sm, int* sms) {
  if (bm != 16 && bm != 64 && bm != 128) return fail_msg("mk: bm must be 16, 64 or 128");
  if (stages < 2 || stages > MAX_STAGES) return fail_msg("mk: stages must be in 2..12");
  return occupancy(bm, stages, per_sm, sms);
}

int mk_route(const MkParams* p, void* stream) {
  if (check_params(p)) return 1;
  // the gate GEMM needs no big tiles: 16-row tiles for few tokens, 64 otherwise
  return p->S <= 64 ? launch_route<Small>(p, (cudaStream_t)stream) : launch_route<Large>(p, (cudaStream_t)stream);
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

int mk_experts(const MkParams* p, void* stream) {
  if (check_params(p)) return 1;
  if (p->S == 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  return p->bm == 16 ? launch_experts<Small>(p, s) : p->bm == 64 ? launch_experts<Large>(p, s) : launch_experts<Huge>(p, s);
}

}  // extern "C"
