// Timeline: a Chrome-trace (Perfetto) record of compute and communication
// spans per rank (docs/architecture.md "Logs").
//
// Each rank records its own spans into a Timeline (thread-safe: the training
// thread records forward/backward/optimizer, the communicator's progress
// thread records collectives). At the end every rank calls write_merged():
// the events travel to rank 0 over the communicator and rank 0 writes one
// JSON file in which each rank is a process ("rank 0", "rank 1", ...) and each
// track a thread ("compute", "comm"). Timestamps are wall-clock microseconds,
// shared by all processes of a node, so the ranks line up in Perfetto.
//
//   Timeline timeline(world->rank());
//   { TraceScope s(&timeline, "forward"); loss = model(x); }
//   timeline.write_merged(*world, "run/trace.json");   // ui.perfetto.dev opens it
//
// Glossary: span = [begin, end) of one named activity on one track; track =
// the Perfetto thread row (compute or comm); category = the span's kind
// ("compute", "comm"), which the benchmark sums over.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace trainer::comm {
class Communicator;
}

namespace trainer::parallel {

enum class Track : int { compute = 0, comm = 1 };

struct TraceSpan {
  std::string name;
  Track track = Track::compute;
  int64_t begin_us = 0;
  int64_t end_us = 0;
};

// Wall-clock microseconds (the common time base of the ranks).
int64_t trace_now_us();

class Timeline {
 public:
  explicit Timeline(int rank) : rank_(rank) {}
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  int rank() const { return rank_; }
  // Records a span (dropped while recording is off).
  void add(std::string name, Track track, int64_t begin_us, int64_t end_us);
  // Long runs record a window of steps, not all of them.
  void set_recording(bool on) { recording_ = on; }

  // A copy of the spans recorded so far, in recording order.
  std::vector<TraceSpan> spans() const;
  void clear();

  // This rank's events as a JSON array body (no brackets), for merging.
  std::string events_json() const;
  // This rank alone as a complete trace file.
  void write(const std::string& path) const;
  // Collective over comm: every rank's events are gathered on rank 0, which
  // writes them to path as one trace. Throws Error naming path if rank 0
  // cannot write it.
  void write_merged(comm::Communicator& comm, const std::string& path) const;

 private:
  int rank_;
  std::atomic<bool> recording_{true};
  mutable std::mutex mutex_;
  std::vector<TraceSpan> spans_;
};

// Records [construction, destruction) as one span; nothing when timeline is
// null (tracing off).
class TraceScope {
 public:
  TraceScope(Timeline* timeline, const char* name, Track track = Track::compute);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Timeline* timeline_;
  const char* name_;
  Track track_;
  int64_t begin_us_ = 0;
};

// Which spans a measurement counts, e.g. [](const TraceSpan& s) { return s.name == "backward"; }.
using SpanFilter = std::function<bool(const TraceSpan&)>;
// The time covered by the union of the selected spans, in microseconds.
int64_t covered_us(const std::vector<TraceSpan>& spans, const SpanFilter& select);
// The time covered both by a spans and by b spans (the unions of each), in
// microseconds: e.g. allreduce time hidden behind the backward pass.
int64_t overlap_us(const std::vector<TraceSpan>& spans, const SpanFilter& a, const SpanFilter& b);

}  // namespace trainer::parallel
