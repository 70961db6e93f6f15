#include "comm/log.h"

#include <atomic>
#include <cstdio>

namespace trainer::comm {

namespace {
std::atomic<int> g_level{int(LogLevel::info)};
const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::debug:
      return "debug";
    case LogLevel::info:
      return "info";
    case LogLevel::warn:
      return "warn";
    case LogLevel::error:
      return "error";
  }
  return "?";
}
}  // namespace

void set_log_level(LogLevel level) { g_level.store(int(level)); }
bool log_enabled(LogLevel level) { return int(level) >= g_level.load(std::memory_order_relaxed); }

void log_line(LogLevel level, const std::string& message) {
  // One fprintf per line: stdio locks the stream, so lines of threads do not interleave.
  std::fprintf(stderr, "[rank %d] comm %s: %s\n", log_rank(), level_name(level), message.c_str());
}

LogLevel parse_log_level(const std::string& name) {
  for (LogLevel level : {LogLevel::debug, LogLevel::info, LogLevel::warn, LogLevel::error})
    if (name == level_name(level)) return level;
  throw Error(
      cat("TRAINER_LOG_LEVEL=", name, " is not a log level; use debug, info, warn or error"));
}

}  // namespace trainer::comm
