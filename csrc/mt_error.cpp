// moetune csrc: the calling thread's last error message (shared by the CUDA build and the host simulation).
#include <stdarg.h>
#include <stdio.h>

#include "mt_common.h"

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
