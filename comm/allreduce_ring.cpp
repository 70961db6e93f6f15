// Ring allreduce (Patarasuk and Yuan): with n ranks the buffer is cut into n
// chunks; n-1 reduce-scatter steps leave rank r with chunk r fully reduced,
// n-1 all-gather steps pass the reduced chunks around. Each rank only talks
// to its neighbours (sends right, receives left) and moves 2(n-1)/n of the
// buffer, which is bandwidth-optimal.
//
// Chunks are cut into segments of at most segment_bytes, and a segment moves
// on as soon as it has arrived (and been reduced), so the steps overlap: the
// ring is a pipeline of segments rather than n-1 barriers. Both phases post
// their receives kPipelineDepth segments ahead of the one being handled; those
// of the reduce-scatter land in a window of scratch slots.
#include <algorithm>
#include <cstring>

#include "comm/algorithms.h"
#include "comm/collectives.h"
#include "comm/log.h"

namespace trainer::comm {

namespace {

constexpr int kPipelineDepth = 8;

class Ring {
 public:
  Ring(OpChannel& ch, char* data, size_t count, size_t element_bytes, size_t segment_bytes)
      : ch_(ch),
        data_(data),
        count_(count),
        element_bytes_(element_bytes),
        n_(ch.size()),
        rank_(ch.rank()) {
    size_t largest_chunk_bytes = chunk(0).count * element_bytes;
    segments_ = int(std::max<size_t>(1, (largest_chunk_bytes + segment_bytes - 1) / segment_bytes));
  }

  // Step s sends chunk r-s-1 to the right and receives chunk r-s-2 from the
  // left, reducing it into ours; the chunk received at step s is the one sent
  // at step s+1. After n-1 steps chunk r holds the reduction of every rank.
  void reduce_scatter(DType dtype, ReduceOp op, const Reducer* reducer = nullptr) {
    const int steps = n_ - 1, total = steps * segments_;
    const int window = std::min(total, kPipelineDepth);
    const size_t slot_bytes = segment(0, 0).count * element_bytes_;
    std::shared_ptr<void> own_scratch;
    if (reducer && reducer->scratch) own_scratch = reducer->scratch(size_t(window) * slot_bytes);
    char* scratch = own_scratch ? static_cast<char*>(own_scratch.get())
                                : thread_scratch(size_t(window) * slot_bytes);
    std::vector<Request> receives(static_cast<size_t>(window)), sends;
    auto post_receive = [&](int k) {
      Range seg = segment(recv_chunk_rs(k / segments_), k % segments_);
      if (seg.count)
        receives[k % window] =
            ch_.irecv(left(), k, &scratch[(k % window) * slot_bytes], bytes(seg));
    };
    for (int j = 0; j < segments_; ++j) send(0, mod(rank_ - 1), j, sends);
    for (int k = 0; k < window; ++k) post_receive(k);
    for (int k = 0; k < total; ++k) {
      const int s = k / segments_, j = k % segments_;
      const int c = recv_chunk_rs(s);
      Range seg = segment(c, j);
      ch_.wait(receives[k % window]);
      if (seg.count && reducer && reducer->reduce)
        reducer->reduce(at(seg), &scratch[(k % window) * slot_bytes], seg.count, dtype, op);
      else if (seg.count)
        reduce_into(at(seg), &scratch[(k % window) * slot_bytes], seg.count, dtype, op);
      if (s + 1 < steps) send((s + 1) * segments_, c, j, sends);
      if (k + window < total) post_receive(k + window);
    }
    ch_.wait_all(sends);
  }

  // Step s sends chunk r-s to the right and receives chunk r-s-1 from the
  // left straight into place; a received segment is forwarded at once.
  // Receives are posted kPipelineDepth segments ahead, as in the reduce-scatter.
  void all_gather() {
    const int steps = n_ - 1, total = steps * segments_, base = steps * segments_;
    const int window = std::min(total, kPipelineDepth);
    std::vector<Request> receives(static_cast<size_t>(window)), sends;
    auto post_receive = [&](int k) {
      Range seg = segment(mod(rank_ - k / segments_ - 1), k % segments_);
      if (seg.count) receives[k % window] = ch_.irecv(left(), base + k, at(seg), bytes(seg));
    };
    for (int k = 0; k < window; ++k) post_receive(k);
    for (int j = 0; j < segments_; ++j) send(base, rank_, j, sends);
    for (int k = 0; k < total; ++k) {
      const int s = k / segments_, j = k % segments_;
      ch_.wait(receives[k % window]);
      if (s + 1 < steps) send(base + (s + 1) * segments_, mod(rank_ - s - 1), j, sends);
      if (k + window < total) post_receive(k + window);
    }
    ch_.wait_all(sends);
  }

  Range chunk(int c) const { return part_of({0, count_}, n_, c); }
  Range segment(int c, int j) const { return part_of(chunk(c), segments_, j); }
  char* at(Range r) const { return data_ + r.begin * element_bytes_; }
  int segments() const { return segments_; }

 private:
  int mod(int c) const { return ((c % n_) + n_) % n_; }
  int left() const { return mod(rank_ - 1); }
  int right() const { return mod(rank_ + 1); }
  int recv_chunk_rs(int step) const { return mod(rank_ - step - 2); }
  size_t bytes(Range r) const { return r.count * element_bytes_; }

  // Sends segment j of chunk c as message first_message + j (the reduce-scatter
  // numbers its messages step * segments + j, the all-gather after those).
  void send(int first_message, int c, int j, std::vector<Request>& sends) {
    Range seg = segment(c, j);
    if (seg.count) sends.push_back(ch_.isend(right(), first_message + j, at(seg), bytes(seg)));
  }

  OpChannel& ch_;
  char* data_;
  size_t count_;
  size_t element_bytes_;
  int n_, rank_;
  int segments_ = 1;
};

}  // namespace

void allreduce_ring(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op,
                    size_t segment_bytes, const Reducer* reducer) {
  if (ch.size() == 1) return;
  Ring ring(ch, static_cast<char*>(data), count, dtype_size(dtype), segment_bytes);
  COMM_LOG(LogLevel::debug, "allreduce ring: ", count, " x ", dtype, ", ", ring.segments(),
           " segments per chunk");
  ring.reduce_scatter(dtype, op, reducer);
  Range mine = ring.chunk(ch.rank());
  if (op == ReduceOp::avg && reducer && reducer->scale)
    reducer->scale(ring.at(mine), mine.count, dtype, 1.0 / ch.size());
  else if (op == ReduceOp::avg)
    scale(ring.at(mine), mine.count, dtype, 1.0 / ch.size());
  ring.all_gather();
}

void reduce_scatter_ring(OpChannel& ch, void* data, size_t chunk_count, DType dtype, ReduceOp op,
                         size_t segment_bytes) {
  if (ch.size() == 1) return;
  Ring ring(ch, static_cast<char*>(data), chunk_count * size_t(ch.size()), dtype_size(dtype),
            segment_bytes);
  ring.reduce_scatter(dtype, op);
  Range mine = ring.chunk(ch.rank());
  if (op == ReduceOp::avg) scale(ring.at(mine), mine.count, dtype, 1.0 / ch.size());
}

void all_gather_ring(OpChannel& ch, void* data, size_t chunk_bytes, size_t segment_bytes) {
  if (ch.size() == 1) return;
  Ring ring(ch, static_cast<char*>(data), chunk_bytes * size_t(ch.size()), 1, segment_bytes);
  ring.all_gather();
}

}  // namespace trainer::comm
