// moetune csrc: fp8 e4m3 dispatch compression in one launch each way (EPBuffer's wire rows).
//
// quant (grid, a CTA per token)   the token's wire row: fp8 payload, the scale of each group, and
//                                 (optionally) its k int64 ids and fp32 weights -- replacing the ~9 torch
//                                 ops of runtime/fp8.py's quantise_into plus the id/weight copies, each of
//                                 which costs host time to issue.
// dequant (grid)                  received rows -> [n, H] in the activation dtype.
// Same arithmetic as runtime/fp8.py, so the bytes are the same: amax in fp32, multiplier 440 / amax
// rounded to the work dtype (bf16 for bf16 input, else fp32), product rounded to the work dtype, e4m3 by
// round-to-nearest-even; scale = 1 / multiplier in fp32; dequant = dtype(float(q) * scale).
#include <cuda_fp8.h>

#include "mt_common.h"
#include "mt_dtype.cuh"

namespace {

constexpr int kThreads = 256;
constexpr float kTarget = 440.0f;
constexpr float kTiny = 1e-30f;

// The work dtype's rounding: bf16 input works in bf16, fp32 and fp16 inputs in fp32 (as runtime/fp8.py).
template <typename T>
__device__ __forceinline__ float work_round(float v) {
  return v;
}
template <>
__device__ __forceinline__ float work_round<__nv_bfloat16>(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quant_rows_kernel(const T* __restrict__ x, int64_t s, int h, int groups, const int64_t* __restrict__ idx,
                      const float* __restrict__ w, int k, unsigned char* __restrict__ rows, uint64_t row_bytes,
                      uint64_t id_off, uint64_t weight_off, uint64_t scale_off) {
  __shared__ float red[kThreads / 32];
  __shared__ float s_mult;
  const int gs = h / groups;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t t = blockIdx.x; t < s; t += gridDim.x) {
    const T* xr = x + t * (int64_t)h;
    unsigned char* row = rows + (uint64_t)t * row_bytes;
    for (int g = 0; g < groups; ++g) {
      float m = 0.f;
      for (int c = threadIdx.x; c < gs; c += kThreads) m = fmaxf(m, fabsf(mt::to_f<T>(xr[(int64_t)g * gs + c])));
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (lane == 0) red[warp] = m;
      __syncthreads();
      if (threadIdx.x == 0) {
        float a = 0.f;
        for (int i = 0; i < kThreads / 32; ++i) a = fmaxf(a, red[i]);
        const float mult = work_round<T>(kTarget / fmaxf(a, kTiny));
        s_mult = mult;
        reinterpret_cast<float*>(row + scale_off)[g] = 1.0f / mult;
      }
      __syncthreads();
      const float mult = s_mult;
      for (int c = threadIdx.x; c < gs; c += kThreads) {
        const int64_t e = (int64_t)g * gs + c;
        const float v = work_round<T>(mt::to_f<T>(xr[e]) * mult);
        row[e] = (unsigned char)__nv_cvt_float_to_fp8(v, __NV_NOSAT, __NV_E4M3);
      }
      __syncthreads();  // s_mult and red are reused by the next group
    }
    if (idx != nullptr)
      for (int q = threadIdx.x; q < k; q += kThreads) {
        reinterpret_cast<int64_t*>(row + id_off)[q] = idx[t * k + q];
        reinterpret_cast<float*>(row + weight_off)[q] = w[t * k + q];
      }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequant_rows_kernel(const unsigned char* __restrict__ rows, uint64_t row_stride, int64_t n, int h, int groups,
                        uint64_t scale_off, T* __restrict__ out) {
  const int gs = h / groups;
  const int64_t total = n * (int64_t)h;
  for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < total; i += (int64_t)gridDim.x * kThreads) {
    const int64_t r = i / h;
    const int c = (int)(i - r * h);
    const unsigned char* row = rows + (uint64_t)r * row_stride;
    const __half_raw hr = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)row[c], __NV_E4M3);
    const float q = __half2float(__half(hr));
    out[i] = mt::from_f<T>(q * reinterpret_cast<const float*>(row + scale_off)[c / gs]);
  }
}

int grid_for(int64_t work) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t cap = (int64_t)sms * 8;
  return (int)(work < cap ? (work > 0 ? work : 1) : cap);
}

}  // namespace

// x: [s, h] contiguous of dtype (0 fp32, 1 bf16, 2 fp16); rows: [s, row_bytes]; groups divides h; idx/w
// (int64 / fp32 [s, k], contiguous) may be null: then only payload and scales are written.
MT_API int mt_fp8_quant_rows(const void* x, int dtype, int64_t s, int h, int groups, const int64_t* idx,
                             const float* w, int k, void* rows, uint64_t row_bytes, uint64_t id_off,
                             uint64_t weight_off, uint64_t scale_off, uint64_t stream) {
  MT_REQUIRE(dtype >= 0 && dtype <= 2, 114, "dtype code %d unknown (0 fp32, 1 bf16, 2 fp16)", dtype);
  MT_REQUIRE(groups >= 1 && h > 0 && h % groups == 0, 118, "%d scale groups do not divide hidden %d", groups, h);
  MT_REQUIRE((uint64_t)h <= id_off && scale_off % 4 == 0 && scale_off + 4ull * groups <= row_bytes, 113,
             "row layout inconsistent");
  MT_REQUIRE(idx == nullptr || (w != nullptr && k >= 1 && id_off % 8 == 0 && weight_off % 4 == 0 &&
                                weight_off + 4ull * k <= row_bytes),
             113, "row layout inconsistent");
  if (s <= 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  const int grid = grid_for(s);
  unsigned char* r = static_cast<unsigned char*>(rows);
  (void)cudaGetLastError();
  if (dtype == 0)
    quant_rows_kernel<float><<<grid, kThreads, 0, st>>>(static_cast<const float*>(x), s, h, groups, idx, w, k, r,
                                                        row_bytes, id_off, weight_off, scale_off);
  else if (dtype == 1)
    quant_rows_kernel<__nv_bfloat16><<<grid, kThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(x), s, h, groups,
                                                                idx, w, k, r, row_bytes, id_off, weight_off, scale_off);
  else
    quant_rows_kernel<__half><<<grid, kThreads, 0, st>>>(static_cast<const __half*>(x), s, h, groups, idx, w, k, r,
                                                         row_bytes, id_off, weight_off, scale_off);
  MT_CUDA(cudaGetLastError());
  return 0;
}

// rows: n rows of row_stride bytes (fp8 payload at 0, fp32 scales at scale_off); out: [n, h] contiguous.
MT_API int mt_fp8_dequant_rows(const void* rows, uint64_t row_stride, int64_t n, int h, int groups,
                               uint64_t scale_off, int dtype, void* out, uint64_t stream) {
  MT_REQUIRE(dtype >= 0 && dtype <= 2, 114, "dtype code %d unknown (0 fp32, 1 bf16, 2 fp16)", dtype);
  MT_REQUIRE(groups >= 1 && h > 0 && h % groups == 0, 118, "%d scale groups do not divide hidden %d", groups, h);
  MT_REQUIRE(scale_off + 4ull * groups <= row_stride, 113, "row layout inconsistent");
  if (n <= 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  const int grid = grid_for((n * (int64_t)h + kThreads - 1) / kThreads);
  const unsigned char* r = static_cast<const unsigned char*>(rows);
  (void)cudaGetLastError();
  if (dtype == 0)
    dequant_rows_kernel<float><<<grid, kThreads, 0, st>>>(r, row_stride, n, h, groups, scale_off,
                                                          static_cast<float*>(out));
  else if (dtype == 1)
    dequant_rows_kernel<__nv_bfloat16><<<grid, kThreads, 0, st>>>(r, row_stride, n, h, groups, scale_off,
                                                                  static_cast<__nv_bfloat16*>(out));
  else
    dequant_rows_kernel<__half><<<grid, kThreads, 0, st>>>(r, row_stride, n, h, groups, scale_off,
                                                           static_cast<__half*>(out));
  MT_CUDA(cudaGetLastError());
  return 0;
}
