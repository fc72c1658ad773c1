// Host-only stand-ins for the few CUDA runtime/driver calls the proxy engine makes, so its FIFO,
// drain loop, fence modes and flow control can be tested on a machine without a GPU
// (tests/proxy_sim.py builds proxy_engine.cpp, proxy_gpu.cu and mt_common.cu with -DMT_HOST_SIM). By default copies and
// stream writes run at once (synchronous streams); mtsim_set_async(1, delay_us) gives every stream a
// worker thread that runs its operations in order, each copy after `delay_us` -- then the ordering the
// fence modes promise (or fail to promise: round_robin + nic_ordered) shows, as on a GPU.
// Not part of the library build (csrc_build compiles only csrc/*.cu and csrc/*.cpp).
#pragma once
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>

typedef int cudaError_t;
typedef void* cudaStream_t;
typedef int CUresult;
typedef void* CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
enum {
  cudaSuccess = 0,
  CUDA_SUCCESS = 0,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNotReady = 600,
  cudaErrorPeerAccessAlreadyEnabled = 704
};
enum cudaMemcpyKind { cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };
enum cudaDriverEntryPointQueryResult { cudaDriverEntryPointSuccess = 0, cudaDriverEntryPointSymbolNotFound = 1 };
#define cudaStreamNonBlocking 1
#define cudaHostAllocMapped 2
#define cudaHostAllocPortable 1
#define cudaEnableDefault 0
#define cudaHostRegisterPortable 1
#define cudaHostRegisterMapped 2
#define cudaIpcMemLazyEnablePeerAccess 1

namespace mtsim {
extern unsigned long long memcpys, writes, syncs;
extern int async_mode, copy_delay_us;
// the proxy's host pages and idle loop (mtsim_set_host_pages, mtsim_proxy_counters)
extern unsigned long long getcpu_calls, yields, registrations;
extern unsigned long long idle_sleeps;  // the idle threads' sleeps (mtsim_idle_counters)
extern unsigned long long idle_nap_min_ns, idle_nap_max_ns;  // their lengths, set by a test (0: the engine's own)
extern long long registered;  // host ranges registered now (cudaHostRegister minus cudaHostUnregister of a range's base)
extern const char* sysfs_cpu_dir;  // the engine's /sys/devices/system/cpu (NULL: the machine's)
extern int mbind_errno, register_error, malloc_error;  // injected failures (0: none)
// the FIFO pages' own mapping (Engine::place_pages): mmaps so far, mappings and bytes mapped now (mmap minus munmap)
extern long long page_maps, pages_mapped, page_bytes_mapped;
extern int madvise_errno, devptr_error;  // injected: madvise's errno, cudaHostGetDevicePointer's error on registered pages
// injected: cudaMemcpyAsync fails with copy_fault_err (copying nothing) for a source in [copy_fault_lo, copy_fault_hi)
extern int thread_errno;  // injected: mt_proxy_create's thread fails to start (std::system_error with this errno)
extern int copy_fault_err;
extern uintptr_t copy_fault_lo, copy_fault_hi;
// injected: a device that does not become idle (a stuck persistent kernel): cudaDeviceSynchronize returns only once a
// test clears it (mtsim_set_device_busy)
extern int device_busy;
extern unsigned long long device_frees;  // cudaFree / cudaFreeHost calls so far (a test sees what was not freed)
// called after every mt::fence_system where set (mtsim_race_reports: a reporter yields between its record's stores)
extern void (*fence_hook)();
// the stream being captured into a CUDA graph (mtsim_set_capturing; 0: none): a proxy launch on it is captured, and
// the simulation never replays it (a graph captured and not, or not yet, replayed)
extern unsigned long long capturing_stream;
void host_register(void* p, size_t n);
void host_unregister(void* p);
bool host_registered(const void* p);
void* stream_new();
void stream_delete(void* s);
void stream_copy(void* s, void* d, const void* src, size_t n);
void stream_write64(void* s, uint64_t* addr, uint64_t v);
void stream_sync(void* s);
bool stream_idle(void* s);
}

inline const char* cudaGetErrorName(cudaError_t) { return "simError"; }
inline const char* cudaGetErrorString(cudaError_t) { return "simulated CUDA error"; }
// The calling thread's current device (no devices here: any index is taken), so a test sees an entry point give the
// caller its own device back (mtsim_get_device, mtsim_set_device).
inline int& sim_current_device() {
  static thread_local int d = 0;
  return d;
}
inline cudaError_t cudaSetDevice(int d) {
  sim_current_device() = d;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = sim_current_device();
  return cudaSuccess;
}
// At once, unless a test made the device busy (mtsim::device_busy): then once it is cleared.
inline cudaError_t cudaDeviceSynchronize() {
  while (__atomic_load_n(&mtsim::device_busy, __ATOMIC_ACQUIRE)) {
    const timespec ts = {0, 100000};
    nanosleep(&ts, nullptr);
  }
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  __atomic_add_fetch(&mtsim::syncs, 1, __ATOMIC_RELAXED);
  mtsim::stream_sync(s);
  return cudaSuccess;
}
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };
inline cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* cs) {
  const unsigned long long c = __atomic_load_n(&mtsim::capturing_stream, __ATOMIC_ACQUIRE);
  *cs = c != 0 && (unsigned long long)(uintptr_t)s == c ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
// Not ready while the stream (async mode: its worker thread) still has operations queued or running.
inline cudaError_t cudaStreamQuery(cudaStream_t s) { return mtsim::stream_idle(s) ? cudaSuccess : cudaErrorNotReady; }
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = mtsim::stream_new();
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  mtsim::stream_delete(s);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t st) {
  if (mtsim::copy_fault_err != 0 && (uintptr_t)s >= mtsim::copy_fault_lo && (uintptr_t)s < mtsim::copy_fault_hi)
    return mtsim::copy_fault_err;
  mtsim::stream_copy(st, d, s, n);
  __atomic_add_fetch(&mtsim::memcpys, 1, __ATOMIC_RELAXED);
  return cudaSuccess;
}
enum cudaMemcpySrcAccessOrder { cudaMemcpySrcAccessOrderStream = 1 };
struct cudaMemcpyAttributes {
  cudaMemcpySrcAccessOrder srcAccessOrder;
  int pad[5];
  unsigned flags;
};
inline cudaError_t cudaMemcpyBatchAsync(void* const* d, const void* const* s, const size_t* n, size_t count,
                                        cudaMemcpyAttributes*, size_t*, size_t, cudaStream_t st) {
  for (size_t i = 0; i < count; ++i) {
    const cudaError_t e = cudaMemcpyAsync(d[i], s[i], n[i], cudaMemcpyDeviceToDevice, st);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
inline cudaError_t cudaHostAlloc(void** p, size_t n, unsigned) {
  *p = aligned_alloc(64, (n + 63) / 64 * 64);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
// devptr_error: the device alias of a registered range is refused (as where the driver maps no host memory), that
// of cudaHostAlloc'ed pages is not -- so the engine's fallback still works.
inline cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned) {
  if (mtsim::devptr_error != 0 && mtsim::host_registered(h)) return mtsim::devptr_error;
  *d = h;
  return cudaSuccess;
}
inline cudaError_t cudaFreeHost(void* p) {
  __atomic_add_fetch(&mtsim::device_frees, 1, __ATOMIC_RELAXED);
  free(p);
  return cudaSuccess;
}
// No pinning and no device here: a registration is counted (so a test sees it undone) and the device alias of a
// host address is the address; register_error makes it fail as a driver may (then the engine falls back).
inline cudaError_t cudaHostRegister(void* p, size_t n, unsigned) {
  if (mtsim::register_error != 0) return mtsim::register_error;
  mtsim::host_register(p, n);
  return cudaSuccess;
}
inline cudaError_t cudaHostUnregister(void* p) {
  mtsim::host_unregister(p);
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, size_t n) {
  if (mtsim::malloc_error != 0) return mtsim::malloc_error;
  return cudaHostAlloc(p, n, 0);
}
inline cudaError_t cudaFree(void* p) { return cudaFreeHost(p); }
inline cudaError_t cudaMemset(void* p, int v, size_t n) {
  memset(p, v, n);
  return cudaSuccess;
}
// Synchronous copy (a device address is a host one here): read with an atomic load where it is a flag word.
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
  if (n == sizeof(int) && ((uintptr_t)s & (sizeof(int) - 1)) == 0)
    *(int*)d = __atomic_load_n((const int*)s, __ATOMIC_ACQUIRE);
  else
    memcpy(d, s, n);
  return cudaSuccess;
}
// mt_common.cu's calls (the allocators, device queries, CUDA IPC), so that its bounded waits run here too. One device
// that is its own peer; an IPC handle carries the address (one process: opening it gives the address back).
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDriverGetVersion(int* v) {
  *v = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceCanAccessPeer(int* out, int, int) {
  *out = 1;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceEnablePeerAccess(int, unsigned) { return cudaErrorPeerAccessAlreadyEnabled; }
struct cudaIpcMemHandle_t {
  char reserved[64];
};
inline cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) {
  memset(h, 0, sizeof(*h));
  memcpy(h->reserved, &p, sizeof(p));
  return cudaSuccess;
}
inline cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned) {
  memcpy(p, h.reserved, sizeof(*p));
  return cudaSuccess;
}
inline cudaError_t cudaIpcCloseMemHandle(void*) { return cudaSuccess; }
inline CUresult sim_write64(CUstream st, CUdeviceptr addr, cuuint64_t v, unsigned) {
  mtsim::stream_write64(st, reinterpret_cast<uint64_t*>(addr), (uint64_t)v);
  __atomic_add_fetch(&mtsim::writes, 1, __ATOMIC_RELAXED);
  return CUDA_SUCCESS;
}
// The driver functions the simulation has: cuStreamWriteValue64 only (any other name is not found, so the engine's
// error texts fall back to "CUresult <n>").
inline cudaError_t cudaGetDriverEntryPointByVersion(const char* name, void** fn, unsigned, unsigned long long,
                                                    cudaDriverEntryPointQueryResult* q) {
  if (strcmp(name, "cuStreamWriteValue64") != 0) {
    *fn = nullptr;
    *q = cudaDriverEntryPointSymbolNotFound;
    return cudaSuccess;
  }
  *fn = (void*)&sim_write64;
  *q = cudaDriverEntryPointSuccess;
  return cudaSuccess;
}
