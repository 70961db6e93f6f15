#include "parallel/trace.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "comm/collectives.h"
#include "core/check.h"

namespace trainer::parallel {

namespace {

const char* track_name(Track track) { return track == Track::compute ? "compute" : "comm"; }

nlohmann::json metadata(const char* kind, int pid, int tid, const std::string& name) {
  return {{"name", kind}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
}

// Sorted, merged [begin, end) intervals of the selected spans.
std::vector<std::pair<int64_t, int64_t>> union_of(const std::vector<TraceSpan>& spans,
                                                  const SpanFilter& select) {
  std::vector<std::pair<int64_t, int64_t>> in;
  for (const TraceSpan& s : spans)
    if (select(s) && s.end_us > s.begin_us) in.emplace_back(s.begin_us, s.end_us);
  std::sort(in.begin(), in.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& iv : in) {
    if (!out.empty() && iv.first <= out.back().second)
      out.back().second = std::max(out.back().second, iv.second);
    else
      out.push_back(iv);
  }
  return out;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw Error(cat("cannot write the timeline ", path, ": ", std::strerror(errno)));
}

std::string trace_document(const std::string& events) {
  return "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[" + events + "]}\n";
}

}  // namespace

int64_t trace_now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

void Timeline::add(std::string name, Track track, int64_t begin_us, int64_t end_us) {
  if (!recording_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back(TraceSpan{std::move(name), track, begin_us, end_us});
}

TraceScope::TraceScope(Timeline* timeline, const char* name, Track track)
    : timeline_(timeline), name_(name), track_(track) {
  if (timeline_) begin_us_ = trace_now_us();
}

TraceScope::~TraceScope() {
  if (timeline_) timeline_->add(name_, track_, begin_us_, trace_now_us());
}

std::vector<TraceSpan> Timeline::spans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spans_;
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.clear();
}

std::string Timeline::events_json() const {
  // Complete events ("ph": "X") with begin and duration, one process per
  // rank, one thread per track, and metadata events naming them.
  std::vector<TraceSpan> spans = this->spans();
  std::string out;
  auto append = [&](const nlohmann::json& event) {
    if (!out.empty()) out += ",\n";
    out += event.dump();
  };
  append(metadata("process_name", rank_, 0, cat("rank ", rank_)));
  append({{"name", "process_sort_index"},
          {"ph", "M"},
          {"pid", rank_},
          {"args", {{"sort_index", rank_}}}});
  for (Track track : {Track::compute, Track::comm})
    append(metadata("thread_name", rank_, int(track), track_name(track)));
  for (const TraceSpan& s : spans) {
    append({{"name", s.name},
            {"cat", track_name(s.track)},
            {"ph", "X"},
            {"ts", s.begin_us},
            {"dur", s.end_us - s.begin_us},
            {"pid", rank_},
            {"tid", int(s.track)}});
  }
  return out;
}

void Timeline::write(const std::string& path) const {
  write_file(path, trace_document(events_json()));
}

void Timeline::write_merged(comm::Communicator& comm, const std::string& path) const {
  // Variable-length gather over the fixed-size allgather: sizes first, then
  // every rank's text padded to the longest.
  std::string mine = events_json();
  const int n = comm.size();
  uint64_t my_size = mine.size();
  std::vector<uint64_t> sizes(size_t(n), 0);
  comm::allgather(comm, &my_size, sizes.data(), sizeof(uint64_t));
  const uint64_t longest = *std::max_element(sizes.begin(), sizes.end());
  mine.resize(longest, ' ');
  std::string all(longest * uint64_t(n), ' ');
  comm::allgather(comm, mine.data(), all.data(), longest);
  if (comm.rank() != 0) return;
  std::string events;
  for (int r = 0; r < n; ++r) {
    if (r > 0) events += ",\n";
    events.append(all, size_t(longest) * size_t(r), sizes[size_t(r)]);
  }
  write_file(path, trace_document(events));
}

int64_t covered_us(const std::vector<TraceSpan>& spans, const SpanFilter& select) {
  int64_t total = 0;
  for (const auto& [b, e] : union_of(spans, select)) total += e - b;
  return total;
}

int64_t overlap_us(const std::vector<TraceSpan>& spans, const SpanFilter& a, const SpanFilter& b) {
  // Two-pointer sweep over the two sorted unions.
  auto ua = union_of(spans, a), ub = union_of(spans, b);
  int64_t total = 0;
  size_t i = 0, j = 0;
  while (i < ua.size() && j < ub.size()) {
    int64_t lo = std::max(ua[i].first, ub[j].first), hi = std::min(ua[i].second, ub[j].second);
    if (hi > lo) total += hi - lo;
    if (ua[i].second < ub[j].second)
      ++i;
    else
      ++j;
  }
  return total;
}

}  // namespace trainer::parallel
