// moetune csrc: the EP buffer's send-side packing on the GPU (its device-resident layout).
//
// Two launches replace the dozen small torch ops of the dispatch's packing step (each of which costs
// host time to issue, and a node in a CUDA graph):
//   plan            (one CTA up to kSinglePlanMax tokens; above, two grid launches: per-block counts, then
//                   placement, so a large S is not walked by one CTA once per rank)
//                   for every destination rank d, in rank order, the tokens with at least one top-k
//                   expert on d, in token order: tok[] (rank-major), send_counts[d]; tok is padded to
//                   S x world entries with S (the spare row: never sent, and combine adds padding
//                   rows into a spare output row). Expert ids outside [0, E) count for no rank.
//                   Optionally inv[t * world + d]: the send row of token t bound for d, or -1 (the
//                   inverse map combine's reduce reads).
//   rows (grid)     send row i = the wire row of token tok[i]: payload bytes of x, the k int64 ids,
//                   the k fp32 weights, zeros up to row_bytes (EPBuffer's row layout, no fp8 scales).
//                   Padding rows are left untouched. (The nvlink transport skips this launch: its
//                   exchange kernel writes the same rows straight into the peers' buffers.)
// And combine's last step:
//   reduce (grid)   out[t] = sum over d of back[inv[t * world + d]] (fp32 accumulation in rank order,
//                   one rounding to the activation dtype): replaces a zero fill and an index_add whose
//                   atomics add in no fixed order.
#include <cub/block/block_scan.cuh>

#include "mt_common.h"
#include "mt_dtype.cuh"

namespace {

constexpr int kPlanThreads = 1024;
constexpr int kRowThreads = 256;
constexpr int kBlk = 512;                 // tokens per block of the grid plan
constexpr int64_t kSinglePlanMax = 2048;  // auto mode: the one-CTA plan up to here (one launch, not two)

// Bit d set when one of token t's k expert ids (in range) lives on rank d.
__device__ __forceinline__ unsigned dest_mask(const int64_t* __restrict__ idx, int64_t t, int k, int64_t experts,
                                              int64_t epr) {
  unsigned m = 0;
  const int64_t* row = idx + t * k;
  for (int j = 0; j < k; ++j) {
    const int64_t e = row[j];
    if (e >= 0 && e < experts) m |= 1u << (unsigned)(e / epr);
  }
  return m;
}

// Grid plan, launch 1: bc[b * world + d] = tokens of block b bound for rank d.
__global__ void __launch_bounds__(kBlk)
    plan_count_kernel(const int64_t* __restrict__ idx, int64_t s, int k, int64_t experts, int world,
                      int* __restrict__ bc) {
  __shared__ int cnt[MT_MAX_WORLD];
  if ((int)threadIdx.x < world) cnt[threadIdx.x] = 0;
  __syncthreads();
  const int64_t t = (int64_t)blockIdx.x * kBlk + threadIdx.x;
  const unsigned m = t < s ? dest_mask(idx, t, k, experts, experts / world) : 0u;
  for (int d = 0; d < world; ++d) {
    const unsigned b = __ballot_sync(0xffffffffu, (m >> d) & 1u);
    if ((threadIdx.x & 31) == 0 && b) atomicAdd(&cnt[d], __popc(b));
  }
  __syncthreads();
  if ((int)threadIdx.x < world) bc[(int64_t)blockIdx.x * world + threadIdx.x] = cnt[threadIdx.x];
}

// Grid plan, launch 2: every block places its tokens (token order within each rank's segment), block 0
// writes the counts, and all blocks pad tok past the last real row with s.
__global__ void __launch_bounds__(kBlk)
    plan_place_kernel(const int64_t* __restrict__ idx, int64_t s, int k, int64_t experts, int world,
                      const int* __restrict__ bc, int64_t* __restrict__ tok, int64_t* __restrict__ counts,
                      int64_t* __restrict__ inv) {
  __shared__ long long before[MT_MAX_WORLD], total[MT_MAX_WORLD], base[MT_MAX_WORLD];
  __shared__ long long s_all;
  __shared__ int wcnt[kBlk / 32][MT_MAX_WORLD];
  const int nblk = gridDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if ((int)threadIdx.x < world) {
    const int d = threadIdx.x;
    long long b4 = 0, tot = 0;
    for (int b = 0; b < nblk; ++b) {
      const int c = bc[(int64_t)b * world + d];
      if (b < (int)blockIdx.x) b4 += c;
      tot += c;
    }
    before[d] = b4;
    total[d] = tot;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    long long seg = 0;
    for (int d = 0; d < world; ++d) {
      base[d] = seg + before[d];
      if (blockIdx.x == 0) counts[d] = total[d];
      seg += total[d];
    }
    s_all = seg;
  }
  const int64_t t = (int64_t)blockIdx.x * kBlk + threadIdx.x;
  const unsigned m = t < s ? dest_mask(idx, t, k, experts, experts / world) : 0u;
  for (int d = 0; d < world; ++d) {
    const unsigned b = __ballot_sync(0xffffffffu, (m >> d) & 1u);
    if (lane == 0) wcnt[warp][d] = __popc(b);
  }
  __syncthreads();
  const unsigned lt = (1u << lane) - 1u;
  for (int d = 0; d < world; ++d) {
    const unsigned b = __ballot_sync(0xffffffffu, (m >> d) & 1u);
    if (t >= s) continue;
    if ((m >> d) & 1u) {
      long long r = base[d] + __popc(b & lt);
      for (int w = 0; w < warp; ++w) r += wcnt[w][d];
      tok[r] = t;
      if (inv != nullptr) inv[t * world + d] = r;
    } else if (inv != nullptr) {
      inv[t * world + d] = -1;
    }
  }
  for (int64_t i = s_all + t; i < s * world; i += (int64_t)nblk * kBlk) tok[i] = s;
}

__global__ void __launch_bounds__(kPlanThreads)
    pack_plan_kernel(const int64_t* __restrict__ idx, int64_t s, int k, int64_t experts, int world,
                     int64_t* __restrict__ tok, int64_t* __restrict__ counts, int64_t* __restrict__ inv) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t s_base;
  const int64_t epr = experts / world;
  if (threadIdx.x == 0) s_base = 0;
  __syncthreads();
  for (int d = 0; d < world; ++d) {
    const int64_t d_start = s_base;
    for (int64_t t0 = 0; t0 < s; t0 += kPlanThreads) {
      const int64_t t = t0 + threadIdx.x;
      int flag = 0;
      if (t < s) {
        const int64_t* row = idx + t * k;
        for (int j = 0; j < k; ++j) {
          const int64_t e = row[j];
          if (e >= 0 && e < experts && e / epr == d) {
            flag = 1;
            break;
          }
        }
      }
      int pos = 0, total = 0;
      Scan(tmp).ExclusiveSum(flag, pos, total);
      if (flag) tok[s_base + pos] = t;
      if (inv != nullptr && t < s) inv[t * world + d] = flag ? s_base + pos : -1;
      __syncthreads();  // everyone has read s_base (and tmp may be reused)
      if (threadIdx.x == 0) s_base += total;
      __syncthreads();
    }
    if (threadIdx.x == 0) counts[d] = s_base - d_start;
  }
  __syncthreads();
  for (int64_t i = s_base + threadIdx.x; i < s * world; i += kPlanThreads) tok[i] = s;
}

__global__ void __launch_bounds__(kRowThreads)
    pack_rows_kernel(const char* __restrict__ x, uint64_t payload_bytes, const int64_t* __restrict__ idx,
                     const float* __restrict__ w, int64_t s, int k, int64_t n_rows, const int64_t* __restrict__ tok,
                     char* __restrict__ out, uint64_t row_bytes, uint64_t id_off, uint64_t weight_off) {
  const bool vec = ((payload_bytes | (uintptr_t)x | (uintptr_t)out | row_bytes) & 15ull) == 0;
  const uint64_t tail_from = weight_off + 4ull * k;
  for (int64_t i = blockIdx.x; i < n_rows; i += gridDim.x) {
    const int64_t t = tok[i];
    if (t < 0 || t >= s) continue;  // padding
    char* dst = out + (uint64_t)i * row_bytes;
    const char* src = x + (uint64_t)t * payload_bytes;
    if (vec) {
      const int4* sv = reinterpret_cast<const int4*>(src);
      int4* dv = reinterpret_cast<int4*>(dst);
      for (uint64_t v = threadIdx.x; v < (payload_bytes >> 4); v += kRowThreads) dv[v] = sv[v];
    } else {
      for (uint64_t b = threadIdx.x; b < payload_bytes; b += kRowThreads) dst[b] = src[b];
    }
    for (uint64_t b = payload_bytes + threadIdx.x; b < id_off; b += kRowThreads) dst[b] = 0;
    if ((int)threadIdx.x < k) {
      reinterpret_cast<int64_t*>(dst + id_off)[threadIdx.x] = idx[t * k + threadIdx.x];
      reinterpret_cast<float*>(dst + weight_off)[threadIdx.x] = w[t * k + threadIdx.x];
    }
    for (uint64_t b = tail_from + threadIdx.x; b < row_bytes; b += kRowThreads) dst[b] = 0;
  }
}

// One CTA per token (grid-stride); 16-byte vectors of N elements when the row allows it.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    combine_reduce_kernel(const T* __restrict__ back, uint64_t back_stride, const int64_t* __restrict__ inv,
                          int64_t s, int world, int hidden, T* __restrict__ out) {
  constexpr int N = 16 / sizeof(T);
  const bool vec = ((hidden % N) == 0) && ((back_stride % N) == 0) && (((uintptr_t)back | (uintptr_t)out) & 15) == 0;
  __shared__ int64_t rows[MT_MAX_WORLD];
  for (int64_t t = blockIdx.x; t < s; t += gridDim.x) {
    __syncthreads();  // everyone is done with the previous token's rows
    if ((int)threadIdx.x < world) rows[threadIdx.x] = inv[t * world + threadIdx.x];
    __syncthreads();
    T* o = out + (uint64_t)t * hidden;
    if (vec) {
      for (int v = threadIdx.x; v < hidden / N; v += kRowThreads) {
        float acc[N];
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = 0.f;
        for (int d = 0; d < world; ++d) {
          if (rows[d] < 0) continue;
          const int4 raw = reinterpret_cast<const int4*>(back + (uint64_t)rows[d] * back_stride)[v];
          const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int i = 0; i < N; ++i) acc[i] += mt::to_f<T>(e[i]);
        }
        int4 res;
        T* r = reinterpret_cast<T*>(&res);
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = mt::from_f<T>(acc[i]);
        reinterpret_cast<int4*>(o)[v] = res;
      }
    } else {
      for (int c = threadIdx.x; c < hidden; c += kRowThreads) {
        float acc = 0.f;
        for (int d = 0; d < world; ++d)
          if (rows[d] >= 0) acc += mt::to_f<T>(back[(uint64_t)rows[d] * back_stride + c]);
        o[c] = mt::from_f<T>(acc);
      }
    }
  }
}

}  // namespace

// Scratch ints the grid plan needs (per-block counts), for mt_pack_plan's `scratch`.
MT_API int64_t mt_pack_plan_scratch(int64_t s, int world) { return ((s + kBlk - 1) / kBlk) * world; }

// idx: int64 [s, k] (contiguous); tok: int64 [s * world]; counts: int64 [world]; inv: int64 [s * world]
// or null; scratch: int32 [mt_pack_plan_scratch(s, world)] (used by the grid plan only; may be null when
// the one-CTA plan runs). mode: 0 = by size, 1 = one CTA, 2 = grid.
MT_API int mt_pack_plan(const int64_t* idx, int64_t s, int k, int64_t experts, int world, int64_t* tok,
                        int64_t* counts, int64_t* inv, int* scratch, int mode, uint64_t stream) {
  MT_REQUIRE(world >= 1 && world <= MT_MAX_WORLD, 110, "world out of range");
  MT_REQUIRE(k >= 1 && k <= kRowThreads, 111, "top-k out of range");
  MT_REQUIRE(experts % world == 0, 112, "experts not divisible by world");
  MT_REQUIRE(mode >= 0 && mode <= 2, 116, "plan mode %d unknown (0 auto, 1 one CTA, 2 grid)", mode);
  const bool grid = s > 0 && (mode == 2 || (mode == 0 && s > kSinglePlanMax));
  MT_REQUIRE(!grid || scratch != nullptr, 117, "the grid plan needs scratch (mt_pack_plan_scratch ints)");
  cudaStream_t st = (cudaStream_t)stream;
  (void)cudaGetLastError();
  if (grid) {
    const unsigned nblk = (unsigned)((s + kBlk - 1) / kBlk);
    plan_count_kernel<<<nblk, kBlk, 0, st>>>(idx, s, k, experts, world, scratch);
    plan_place_kernel<<<nblk, kBlk, 0, st>>>(idx, s, k, experts, world, scratch, tok, counts, inv);
  } else {
    pack_plan_kernel<<<1, kPlanThreads, 0, st>>>(idx, s, k, experts, world, tok, counts, inv);
  }
  MT_CUDA(cudaGetLastError());
  return 0;
}

// x: [s, payload_bytes] contiguous; w: fp32 [s, k]; out: [n_rows, row_bytes].
MT_API int mt_pack_rows(const void* x, uint64_t payload_bytes, const int64_t* idx, const float* w, int64_t s, int k,
                        int64_t n_rows, const int64_t* tok, void* out, uint64_t row_bytes, uint64_t id_off,
                        uint64_t weight_off, uint64_t stream) {
  MT_REQUIRE(k >= 1 && k <= kRowThreads, 111, "top-k out of range");
  MT_REQUIRE(id_off % 8 == 0 && weight_off % 4 == 0 && weight_off + 4ull * k <= row_bytes && payload_bytes <= id_off,
             113, "row layout inconsistent");
  if (n_rows <= 0) return 0;
  int dev = 0;
  MT_CUDA(cudaGetDevice(&dev));
  int sms = 132;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t grid = n_rows < (int64_t)sms * 8 ? n_rows : (int64_t)sms * 8;
  (void)cudaGetLastError();
  pack_rows_kernel<<<(unsigned)grid, kRowThreads, 0, (cudaStream_t)stream>>>(
      static_cast<const char*>(x), payload_bytes, idx, w, s, k, n_rows, tok, static_cast<char*>(out), row_bytes,
      id_off, weight_off);
  MT_CUDA(cudaGetLastError());
  return 0;
}

// back: [rows, back_stride elements] of dtype (0 fp32, 1 bf16, 2 fp16); inv: int64 [s * world];
// out: [s, hidden] contiguous.
MT_API int mt_combine_reduce(const void* back, uint64_t back_stride, const int64_t* inv, int64_t s, int world,
                             int hidden, int dtype, void* out, uint64_t stream) {
  MT_REQUIRE(world >= 1 && world <= MT_MAX_WORLD, 110, "world out of range");
  MT_REQUIRE(dtype >= 0 && dtype <= 2, 114, "dtype code %d unknown (0 fp32, 1 bf16, 2 fp16)", dtype);
  MT_REQUIRE(back_stride >= (uint64_t)hidden, 115, "row stride shorter than hidden");
  if (s <= 0 || hidden <= 0) return 0;
  int dev = 0;
  MT_CUDA(cudaGetDevice(&dev));
  int sms = 132;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const unsigned grid = (unsigned)(s < (int64_t)sms * 8 ? s : (int64_t)sms * 8);
  cudaStream_t st = (cudaStream_t)stream;
  (void)cudaGetLastError();
  if (dtype == 0)
    combine_reduce_kernel<float><<<grid, kRowThreads, 0, st>>>(static_cast<const float*>(back), back_stride, inv, s,
                                                               world, hidden, static_cast<float*>(out));
  else if (dtype == 1)
    combine_reduce_kernel<__nv_bfloat16><<<grid, kRowThreads, 0, st>>>(
        static_cast<const __nv_bfloat16*>(back), back_stride, inv, s, world, hidden, static_cast<__nv_bfloat16*>(out));
  else
    combine_reduce_kernel<__half><<<grid, kRowThreads, 0, st>>>(static_cast<const __half*>(back), back_stride, inv, s,
                                                                world, hidden, static_cast<__half*>(out));
  MT_CUDA(cudaGetLastError());
  return 0;
}
