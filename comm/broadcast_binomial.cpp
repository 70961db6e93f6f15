// Binomial-tree broadcast: relative to the root, rank v receives from
// v - 2^k (its lowest set bit k) and then sends to v + 2^j for every j < k,
// so the data reaches all n ranks in ceil(log2 n) rounds.
//
// A buffer larger than segment_bytes moves as a pipeline of segments: a rank
// forwards segment j to its children as soon as it has arrived, while the
// next ones are still on their way, so the tree's depth costs one segment's
// time rather than the whole buffer's. Receives are posted kPipelineDepth
// segments ahead.
#include "comm/algorithms.h"

namespace trainer::comm {

namespace {
constexpr int kPipelineDepth = 8;
}  // namespace

void broadcast_binomial(OpChannel& ch, void* data, size_t bytes, int root, size_t segment_bytes) {
  const int n = ch.size();
  if (n == 1) return;
  const int v = (ch.rank() - root + n) % n;  // rank relative to the root
  auto real = [&](int relative) { return (relative + root) % n; };
  int parent = -1, mask = 1;
  for (; mask < n; mask <<= 1) {
    if (v & mask) {
      parent = real(v - mask);
      break;
    }
  }
  std::vector<int> children;  // farthest first: it roots the largest subtree
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (v + mask < n) children.push_back(real(v + mask));

  const int segments = int(std::max<size_t>(1, (bytes + segment_bytes - 1) / segment_bytes));
  auto segment = [&](int j) { return part_of({0, bytes}, segments, j); };
  char* base = static_cast<char*>(data);
  const int window = std::min(segments, kPipelineDepth);
  std::vector<Request> receives(static_cast<size_t>(window)), sends;
  auto post_receive = [&](int j) {
    Range seg = segment(j);
    receives[j % window] = ch.irecv(parent, uint32_t(j), base + seg.begin, seg.count);
  };
  for (int j = 0; parent >= 0 && j < window; ++j) post_receive(j);
  for (int j = 0; j < segments; ++j) {
    if (parent >= 0) {
      ch.wait(receives[j % window]);
      if (j + window < segments) post_receive(j + window);
    }
    Range seg = segment(j);
    for (int child : children)
      sends.push_back(ch.isend(child, uint32_t(j), base + seg.begin, seg.count));
  }
  ch.wait_all(sends);
}

}  // namespace trainer::comm
