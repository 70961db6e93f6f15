// SIGTERM and SIGINT during a run: the handler records the signal and when
// it came; the training loop checkpoints and exits at the end of the step,
// and a data loader still waiting for a read seconds later gives up
// (data::LoaderOptions::interrupted), so a hung read cannot make the run
// deaf to the signal.
//
//   StopSignals signals;                       // handlers for the run's lifetime
//   if (signals.received()) ...                // the signal number, or 0
//   lo.interrupted = [] { return StopSignals::waited(2.0); };
#pragma once

namespace trainer {

class StopSignals {
 public:
  StopSignals();
  // Leaving by an error (a dead peer, say), the handlers stay: the launcher
  // sends SIGTERM when it sees a rank fail, and the default action would
  // kill this process before main prints the error that says why.
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The last stop signal received (0: none).
  static int received();
  // True once a stop signal came at least `seconds` ago.
  static bool waited(double seconds);

 private:
  void (*old_term_)(int);
  void (*old_int_)(int);
  int uncaught_;
};

}  // namespace trainer
