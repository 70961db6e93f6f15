#include "trainer/stop_signals.h"

#include <atomic>
#include <csignal>
#include <cstdint>
#include <ctime>
#include <exception>

namespace trainer {

namespace {

std::atomic<int> g_signal{0};
std::atomic<int64_t> g_signal_ns{0};  // CLOCK_MONOTONIC when it came

int64_t monotonic_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);  // async-signal-safe
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void on_stop_signal(int sig) {
  g_signal_ns.store(monotonic_ns());
  g_signal.store(sig);
}

}  // namespace

StopSignals::StopSignals() : uncaught_(std::uncaught_exceptions()) {
  g_signal.store(0);
  old_term_ = std::signal(SIGTERM, on_stop_signal);
  old_int_ = std::signal(SIGINT, on_stop_signal);
}

StopSignals::~StopSignals() {
  if (std::uncaught_exceptions() > uncaught_) return;
  std::signal(SIGTERM, old_term_);
  std::signal(SIGINT, old_int_);
}

int StopSignals::received() { return g_signal.load(); }

bool StopSignals::waited(double seconds) {
  return g_signal.load() != 0 && double(monotonic_ns() - g_signal_ns.load()) >= seconds * 1e9;
}

}  // namespace trainer
