// Binary-tree allreduce: rank v's children are 2v+1 and 2v+2 and its parent
// (v-1)/2, so rank 0 is the root and the tree is floor(log2 n) levels deep.
// Reduce: every rank adds its children's copy of a segment into its own and
// sends the sum up; broadcast: the root's result flows back down the same edges.
//
// The buffer moves as a pipeline of segments of at most segment_bytes: a
// rank sends segment j up as soon as its children's have arrived, with up to
// kPipelineDepth segments travelling up before it waits for the first one
// to come back down, so the depth costs a few segments' time rather than
// the whole buffer's. Only the root reduces whole values, so every rank
// ends with the same bits.
#include <algorithm>
#include <vector>

#include "comm/algorithms.h"

namespace trainer::comm {

namespace {
constexpr int kPipelineDepth = 8;
}  // namespace

void allreduce_tree(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op,
                    size_t segment_bytes) {
  const int n = ch.size(), rank = ch.rank();
  if (n == 1 || count == 0) return;
  const size_t element_bytes = dtype_size(dtype);
  const Segments parts(data, count, element_bytes, segment_bytes);
  const int segments = parts.n;
  const int parent = rank == 0 ? -1 : (rank - 1) / 2;
  std::vector<int> children;
  for (int child : {2 * rank + 1, 2 * rank + 2})
    if (child < n) children.push_back(child);
  const size_t fanout = children.size();

  // Up: the children's copies of segment j land in slot (j % window, child).
  const int window = std::min(segments, kPipelineDepth);
  const size_t slot_bytes = parts.bytes(parts.range(0));
  char* scratch = thread_scratch(std::max<size_t>(1, size_t(window) * fanout * slot_bytes));
  auto slot = [&](int j, size_t c) {
    return scratch + (size_t(j % window) * fanout + c) * slot_bytes;
  };
  std::vector<Request> up_receives(static_cast<size_t>(window) * fanout), down_sends;
  std::vector<Request> up_sends(static_cast<size_t>(segments));
  auto post_up_receives = [&](int j) {
    for (size_t c = 0; c < fanout; ++c)
      up_receives[size_t(j % window) * fanout + c] =
          ch.irecv(children[c], uint32_t(j), slot(j, c), parts.bytes(parts.range(j)));
  };
  const uint32_t down = uint32_t(segments);  // down messages are numbered after the up ones

  // Adds the children's segment j to ours and sends it up (the root: finishes it).
  auto reduce_up = [&](int j) {
    const Range seg = parts.range(j);
    for (size_t c = 0; c < fanout; ++c) {
      ch.wait(up_receives[size_t(j % window) * fanout + c]);
      reduce_into(parts.at(seg), slot(j, c), seg.count, dtype, op);
    }
    if (j + window < segments) post_up_receives(j + window);
    if (parent >= 0)
      up_sends[size_t(j)] = ch.isend(parent, uint32_t(j), parts.at(seg), parts.bytes(seg));
    else if (op == ReduceOp::avg)
      scale(parts.at(seg), seg.count, dtype, 1.0 / n);
  };
  // Receives the result of segment j from the parent (once our sum of it has
  // left: it lands in the same place) and passes it on to the children.
  auto broadcast_down = [&](int j) {
    const Range seg = parts.range(j);
    if (parent >= 0) {
      ch.wait(up_sends[size_t(j)]);
      Request result = ch.irecv(parent, down + uint32_t(j), parts.at(seg), parts.bytes(seg));
      ch.wait(result);
    }
    for (int child : children)
      down_sends.push_back(ch.isend(child, down + uint32_t(j), parts.at(seg), parts.bytes(seg)));
  };

  for (int j = 0; j < window; ++j) post_up_receives(j);
  // The root turns each segment around at once; the others keep `lag`
  // segments going up before they wait for one to come down.
  const int lag = parent >= 0 ? window : 0;
  for (int k = 0; k < segments + lag; ++k) {
    if (k < segments) reduce_up(k);
    if (k >= lag) broadcast_down(k - lag);
  }
  ch.wait_all(down_sends);
}

}  // namespace trainer::comm
