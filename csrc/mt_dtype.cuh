// moetune csrc: activation dtypes in device code (CUDA only). Python passes a dtype as a code:
// 0 fp32, 1 bf16, 2 fp16 (runtime/buffer.py's _DTYPE_CODE).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mt {

template <typename T>
__device__ __forceinline__ float to_f(T v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f<__half>(__half v) {
  return __half2float(v);
}

// Round to nearest even.
template <typename T>
__device__ __forceinline__ T from_f(float v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}

}  // namespace mt
