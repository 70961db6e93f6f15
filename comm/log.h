// Leveled logging for the comm layer: one line per message on stderr,
// prefixed with the rank, so interleaved output of several processes stays
// readable. The level comes from the bootstrap (TRAINER_LOG_LEVEL) and is set
// once by init_world; collectives log their algorithm choice at debug level.
//
//   COMM_LOG(LogLevel::debug, "allreduce: ring, ", bytes, " bytes");
#pragma once

#include <string>

#include "core/check.h"

namespace trainer::comm {

enum class LogLevel { debug, info, warn, error };

void set_log_level(LogLevel level);
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& message);
// "debug" | "info" | "warn" | "error"; unknown names are an Error naming the value.
LogLevel parse_log_level(const std::string& name);

}  // namespace trainer::comm

// Formats the message only when the level is enabled.
#define COMM_LOG(level, ...)                                         \
  do {                                                               \
    if (::trainer::comm::log_enabled(level))                         \
      ::trainer::comm::log_line(level, ::trainer::cat(__VA_ARGS__)); \
  } while (0)
