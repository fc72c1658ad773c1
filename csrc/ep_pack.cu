// moetune csrc: the EP buffer's send-side packing on the GPU (its device-resident layout).
//
// Two launches replace the dozen small torch ops of the dispatch's packing step (each of which costs
// host time to issue, and a node in a CUDA graph):
//   plan (one CTA)  for every destination rank d, in rank order, the tokens with at least one top-k
//                   expert on d, in token order: tok[] (rank-major), send_counts[d]; tok is padded to
//                   S x world entries with S (the spare row: never sent, and combine adds padding
//                   rows into a spare output row). Expert ids outside [0, E) count for no rank.
//   rows (grid)     send row i = the wire row of token tok[i]: payload bytes of x, the k int64 ids,
//                   the k fp32 weights, zeros up to row_bytes (EPBuffer's row layout, no fp8 scales).
//                   Padding rows are left untouched.
#include <cub/block/block_scan.cuh>

#include "mt_common.h"

namespace {

constexpr int kPlanThreads = 1024;
constexpr int kRowThreads = 256;

__global__ void __launch_bounds__(kPlanThreads)
    pack_plan_kernel(const int64_t* __restrict__ idx, int64_t s, int k, int64_t experts, int world,
                     int64_t* __restrict__ tok, int64_t* __restrict__ counts) {
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

}  // namespace

// idx: int64 [s, k] (contiguous); tok: int64 [s * world]; counts: int64 [world].
MT_API int mt_pack_plan(const int64_t* idx, int64_t s, int k, int64_t experts, int world, int64_t* tok,
                        int64_t* counts, uint64_t stream) {
  MT_REQUIRE(world >= 1 && world <= MT_MAX_WORLD, 110, "world out of range");
  MT_REQUIRE(k >= 1 && k <= kRowThreads, 111, "top-k out of range");
  MT_REQUIRE(experts % world == 0, 112, "experts not divisible by world");
  (void)cudaGetLastError();
  pack_plan_kernel<<<1, kPlanThreads, 0, (cudaStream_t)stream>>>(idx, s, k, experts, world, tok, counts);
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
