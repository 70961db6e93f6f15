#include "core/check.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace trainer {

namespace {
std::atomic<int> g_log_rank{0};
}

void set_log_rank(int rank) { g_log_rank.store(rank); }
int log_rank() { return g_log_rank.load(); }

void check_fail(const char* file, int line, const char* expr, const std::string& message) {
  std::fprintf(stderr, "[rank %d] %s:%d: CHECK failed: %s%s%s\n", log_rank(), file, line, expr,
               message.empty() ? "" : ": ", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace trainer
