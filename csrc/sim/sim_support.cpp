// Host-simulation support for tests: error text and counters (see mt_cuda_sim.h).
#include <stdarg.h>
#include <stdio.h>

#include "../mt_common.h"

namespace mtsim {
unsigned long long memcpys = 0, writes = 0, syncs = 0;
}
namespace mt {
static thread_local char g_err[1024] = {0};
void set_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof(g_err), fmt, ap);
  va_end(ap);
}
}  // namespace mt

MT_API const char* mt_last_error() { return mt::g_err; }
MT_API void mtsim_counters(unsigned long long* out) {
  out[0] = mtsim::memcpys;
  out[1] = mtsim::writes;
  out[2] = mtsim::syncs;
}
