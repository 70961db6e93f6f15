// Forward records that one backward consumes: cuDNN's RNN backward data
// rewrites the reserve space of its forward, so a second backward from the
// same record (autograd's retain_graph) would compute garbage. The record's
// storage is remembered when a backward takes it and refused the next time;
// entries whose storage was freed are dropped (a new record may reuse the
// address). Host-only, so it is tested without a GPU.
//
//   ConsumedRecords consumed;                 // guarded by the caller's mutex
//   consumed.take(record, "lstm_layer backward");   // throws Error the 2nd time
#pragma once

#include <iterator>
#include <map>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace trainer::cuda {

class ConsumedRecords {
 public:
  // Marks record's storage consumed, or throws Error naming op when it was already.
  void take(const Tensor& record, const std::string& op) {
    for (auto it = taken_.begin(); it != taken_.end();)
      it = it->second.expired() ? taken_.erase(it) : std::next(it);
    const std::shared_ptr<Storage>& storage = record.storage();
    auto it = taken_.find(storage.get());
    if (it != taken_.end() && it->second.lock() == storage)
      throw Error(cat(op, ": a second backward through the same forward; cuDNN's RNN backward ",
                      "consumes its forward's reserve space, so run the forward again (or "
                      "backward once, without retain_graph, through a recurrent layer on CUDA)"));
    taken_[storage.get()] = storage;
  }
  size_t size() const { return taken_.size(); }

 private:
  std::map<const Storage*, std::weak_ptr<Storage>> taken_;
};

}  // namespace trainer::cuda
