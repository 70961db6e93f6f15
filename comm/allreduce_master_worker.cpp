// Master-worker allreduce: every worker sends its buffer to the master (rank
// 0), which reduces the n copies and sends the result back to each worker.
// Two rounds of latency, but the master's link carries 2(n-1) buffers while
// the workers' carry two each: the bottleneck a parameter server shards away.
//
// The buffer moves in segments of at most segment_bytes: the master reduces
// segment j and sends it out while later segments arrive (kWindow segments
// per worker in its scratch), and a worker waits for a segment's result only
// once its own copy of that segment has left.
#include <algorithm>
#include <vector>

#include "comm/algorithms.h"

namespace trainer::comm {

namespace {
constexpr int kWindow = 4;
}  // namespace

void allreduce_master_worker(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op,
                             size_t segment_bytes) {
  const int n = ch.size(), master = 0;
  if (n == 1 || count == 0) return;
  const size_t element_bytes = dtype_size(dtype);
  const Segments parts(data, count, element_bytes, segment_bytes);
  const int segments = parts.n;
  const uint32_t result = uint32_t(segments);  // results are numbered after the gathers

  if (ch.rank() != master) {
    std::vector<Request> gathers, results;
    for (int j = 0; j < segments; ++j)
      gathers.push_back(
          ch.isend(master, uint32_t(j), parts.at(parts.range(j)), parts.bytes(parts.range(j))));
    for (int j = 0; j < segments; ++j) {
      ch.wait(gathers[size_t(j)]);
      results.push_back(ch.irecv(master, result + uint32_t(j), parts.at(parts.range(j)),
                                 parts.bytes(parts.range(j))));
    }
    ch.wait_all(results);
    return;
  }

  // Worker p's copy of segment j lands in slot (j % window, p - 1).
  const int window = std::min(segments, kWindow);
  const size_t slot_bytes = parts.bytes(parts.range(0)), workers = size_t(n - 1);
  char* scratch = thread_scratch(size_t(window) * workers * slot_bytes);
  auto slot = [&](int j, int p) {
    return scratch + (size_t(j % window) * workers + size_t(p - 1)) * slot_bytes;
  };
  std::vector<Request> gathers(size_t(window) * workers), results;
  auto post_gathers = [&](int j) {
    for (int p = 1; p < n; ++p)
      gathers[size_t(j % window) * workers + size_t(p - 1)] =
          ch.irecv(p, uint32_t(j), slot(j, p), parts.bytes(parts.range(j)));
  };
  for (int j = 0; j < window; ++j) post_gathers(j);
  for (int j = 0; j < segments; ++j) {
    const Range seg = parts.range(j);
    for (int p = 1; p < n; ++p) {
      ch.wait(gathers[size_t(j % window) * workers + size_t(p - 1)]);
      reduce_into(parts.at(seg), slot(j, p), seg.count, dtype, op);
    }
    if (j + window < segments) post_gathers(j + window);
    if (op == ReduceOp::avg) scale(parts.at(seg), seg.count, dtype, 1.0 / n);
    for (int p = 1; p < n; ++p)
      results.push_back(ch.isend(p, result + uint32_t(j), parts.at(seg), parts.bytes(seg)));
  }
  ch.wait_all(results);
}

}  // namespace trainer::comm
