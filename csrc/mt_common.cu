// moetune csrc: ABI version, host-mapped flags, CUDA IPC fallback for symmetric buffers (errors: mt_error.cpp).
#include <string.h>

#include "mt_common.h"

// mt::set_error and mt_last_error live in mt_error.cpp.

// ABI version: bump when a signature, a struct's layout or an argument's meaning changes (Python checks it after
// loading). 19: mt_proxy_create's `qps` is per peer (npeers*qps streams, 201 beyond MT_PROXY_MAX_STREAMS) and
// MtGpuView.qps became nstreams; an 18 library would take qps as the total. 21: mt_pxy_exchange takes the send
// buffer's rows (send_rows, after `send`) and checks the send counts against them. 22: the nvlink exchanges take the
// rows their counts address (mt_nvl_exchange send_rows, mt_nvl_exchange_strided src_rows, mt_nvl_exchange_gather
// x_rows and tok_rows) and refuse counts outside them; a refused call's count-matrix row carries MT_COUNT_REFUSED
// (count words are 39 bits) and its peers report MT_ERR_PEER_REFUSED; mt_pxy_clear_error is new and
// mt_nvl_clear_error clears only a refusal. 23: mt_proxy_create, mt_ipc_malloc and mt_device_malloc take the
// caller's timeout_s (before their out-pointers) as the bound of their set-up waits, and refuse one that is not a
// finite number > 0 (215, 121, 121); a 22 library would read the out-pointer where the timeout now is.
MT_API int mt_abi_version() { return 23; }

MT_API int mt_ctrl_bytes(uint64_t* out) {
  *out = MT_CTRL_BYTES;
  return 0;
}

MT_API int mt_device_count(int* out) {
  MT_CUDA(cudaGetDeviceCount(out));
  return 0;
}

MT_API int mt_runtime_versions(int* runtime_version, int* driver_version) {
  MT_CUDA(cudaRuntimeGetVersion(runtime_version));
  MT_CUDA(cudaDriverGetVersion(driver_version));
  return 0;
}

MT_API int mt_can_access_peer(int dev, int peer, int* out) {
  MT_CUDA(cudaDeviceCanAccessPeer(out, dev, peer));
  return 0;
}

MT_API int mt_enable_peer_access(int dev, int peer) {
  MT_SET_DEVICE(dev);
  cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return 0;
  }
  if (e != cudaSuccess) cudaGetLastError();  // not sticky: clear it so a later launch check stays clean
  MT_CUDA(e);
  return 0;
}

// Pinned, mapped host memory (zeroed): the host pointer and the device alias of it.
MT_API int mt_host_alloc_mapped(int device, uint64_t bytes, void** host_ptr, void** dev_ptr) {
  MT_SET_DEVICE(device);
  MT_CUDA(cudaHostAlloc(host_ptr, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  memset(*host_ptr, 0, bytes);
  cudaError_t e = cudaHostGetDevicePointer(dev_ptr, *host_ptr, 0);
  if (e != cudaSuccess) {  // no device alias: the caller gets an error and nothing to free
    (void)cudaGetLastError();
    cudaFreeHost(*host_ptr);
    *host_ptr = nullptr;
    *dev_ptr = nullptr;
  }
  MT_CUDA(e);
  return 0;
}

MT_API int mt_host_free(void* host_ptr) {
  MT_CUDA(cudaFreeHost(host_ptr));
  return 0;
}

// The zeroing of `what` (mt_ipc_malloc, mt_device_malloc: *ptr, `bytes` at it) did not complete within the caller's
// timeout: *ptr is leaked rather than freed under the memset that may still be queued, and nulled, so the caller frees
// nothing (SymmBuffer.close frees only the pointer it got). Returns 120.
static int zeroing_timed_out(const char* what, int device, void** ptr, uint64_t bytes, uint64_t timeout_ns) {
  *ptr = nullptr;
  mt::set_error("%s: the zeroing of %llu bytes on device %d did not complete within %.1f s: other work on the device "
                "does not end (a stuck persistent kernel, a peer that never signals). The allocation is leaked rather "
                "than freed under it; end that work (or restart the process) before building the transport again",
                what, (unsigned long long)bytes, device, (double)timeout_ns / 1e9);
  return 120;
}

// --- CUDA IPC fallback for symmetric buffers (used when torch symmetric memory is unavailable) ---
// timeout_s: the bound of the wait for the zeroing (RuntimeOptions.onesided_timeout_s); not finite and > 0: 121,
// before anything is allocated.
MT_API int mt_ipc_malloc(int device, uint64_t bytes, double timeout_s, void** ptr,
                         unsigned char* handle_out /*64 bytes*/) {
  MT_REQUIRE(mt::timeout_s_ok(timeout_s), 121, "mt_ipc_malloc: timeout_s %g is not a finite number > 0", timeout_s);
  MT_SET_DEVICE(device);
  MT_CUDA(cudaMalloc(ptr, bytes));
  MT_CUDA(cudaMemset(*ptr, 0, bytes));
  {
    // within the caller's timeout, never without end (mt::setup_sync_within); past it 120, the memory leaked
    const uint64_t timeout_ns = mt::timeout_ns(timeout_s);
    const cudaError_t e = mt::setup_sync_within(device, timeout_ns);
    if (e == cudaErrorNotReady) return zeroing_timed_out("mt_ipc_malloc", device, ptr, bytes, timeout_ns);
    MT_REQUIRE(e == cudaSuccess, (int)e, "mt_ipc_malloc: cudaDeviceSynchronize -> %s (%s)", cudaGetErrorName(e),
               cudaGetErrorString(e));
  }
  cudaIpcMemHandle_t h;
  MT_CUDA(cudaIpcGetMemHandle(&h, *ptr));
  memcpy(handle_out, &h, sizeof(h));
  return 0;
}

MT_API int mt_ipc_open(int device, const unsigned char* handle /*64 bytes*/, void** ptr) {
  MT_SET_DEVICE(device);
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  MT_CUDA(cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess));
  return 0;
}

MT_API int mt_ipc_close(int device, void* ptr) {
  MT_SET_DEVICE(device);
  MT_CUDA(cudaIpcCloseMemHandle(ptr));
  return 0;
}

MT_API int mt_device_free(int device, void* ptr) {
  MT_SET_DEVICE(device);
  MT_CUDA(cudaFree(ptr));
  return 0;
}

// timeout_s as mt_ipc_malloc's (121: not finite and > 0).
MT_API int mt_device_malloc(int device, uint64_t bytes, double timeout_s, void** ptr) {
  MT_REQUIRE(mt::timeout_s_ok(timeout_s), 121, "mt_device_malloc: timeout_s %g is not a finite number > 0", timeout_s);
  MT_SET_DEVICE(device);
  MT_CUDA(cudaMalloc(ptr, bytes));
  cudaError_t e = cudaMemset(*ptr, 0, bytes);
  // within the caller's timeout, never without end (mt::setup_sync_within); past it 120, the memory leaked
  const uint64_t timeout_ns = mt::timeout_ns(timeout_s);
  if (e == cudaSuccess) e = mt::setup_sync_within(device, timeout_ns);
  if (e == cudaErrorNotReady) return zeroing_timed_out("mt_device_malloc", device, ptr, bytes, timeout_ns);
  if (e != cudaSuccess) {  // not zeroed: freed here, the caller gets an error and nothing to free
    (void)cudaGetLastError();
    cudaFree(*ptr);
    *ptr = nullptr;
  }
  MT_CUDA(e);
  return 0;
}
