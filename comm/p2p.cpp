// Communicator::send and recv (comm/p2p.h): validation, the tag, and the
// Work that completes a posted transport request on the waiting thread.
#include "comm/p2p.h"

#include <mutex>

#include "comm/communicator.h"
#include "comm/log.h"
#include "comm/traffic.h"

namespace trainer::comm {

std::string p2p_tag_str(const P2PTag& tag) {
  return cat(tag.direction == P2PDirection::gradient ? "gradient" : "activation", " micro-batch ",
             tag.micro_batch, " stream ", tag.stream);
}

uint64_t make_p2p_tag(uint32_t comm_id, const P2PTag& tag, int source_world_rank) {
  auto check_field = [&](const char* field, int64_t value, int bits) {
    if (value < 0 || value >= (int64_t(1) << bits))
      throw Error(cat("point-to-point tag (", p2p_tag_str(tag), "): ", field, " must be in [0, ",
                      int64_t(1) << bits, "), got ", value));
  };
  check_field("micro_batch", tag.micro_batch, P2PTag::kMicroBatchBits);
  check_field("stream", tag.stream, P2PTag::kStreamBits);
  if (tag.direction != P2PDirection::activation && tag.direction != P2PDirection::gradient)
    throw Error(cat("point-to-point tag: direction ", uint32_t(tag.direction),
                    " is neither activation nor gradient"));
  const uint32_t packed = (uint32_t(tag.micro_batch) << (P2PTag::kStreamBits + 1)) |
                          (uint32_t(tag.stream) << 1) | uint32_t(tag.direction);
  return make_tag(comm_id, TagKind::point_to_point, packed >> kTagMessageBits,
                  packed & ((1u << kTagMessageBits) - 1), source_world_rank);
}

namespace {

// A posted send or receive. The request is progressed by whichever thread
// tests or waits (one at a time: the mutex); the first outcome is kept, so
// every later test() or wait() returns or rethrows the same.
class P2POperation final : public Work::Operation {
 public:
  P2POperation(bool is_send, Request request, Tensor tensor, std::string what, Millis timeout)
      : is_send_(is_send),
        request_(std::move(request)),
        tensor_(std::move(tensor)),
        what_(std::move(what)),
        timeout_(timeout) {}

  // A send still pending may have UCX read its buffer later (rendezvous):
  // finish it while the tensor is alive. Receives are cancelled by the Request.
  ~P2POperation() override {
    if (!is_send_pending()) return;
    try {
      request_.wait(timeout_);
    } catch (const Error& e) {
      COMM_LOG(LogLevel::warn, what_, ": dropped unfinished: ", e.what());
    }
  }

  bool test() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return finish([&] { return request_.test(); });
  }
  void wait() override {
    std::lock_guard<std::mutex> lock(mutex_);
    finish([&] {
      request_.wait(timeout_);
      return true;
    });
  }

 private:
  bool is_send_pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !done_ && is_send_ && request_.pending();
  }

  // Runs step (true: complete) unless already done; records and rethrows an
  // Error with what this message was.
  template <class Step>
  bool finish(Step&& step) {
    if (!done_) {
      try {
        done_ = step();
      } catch (const Error& e) {
        error_ = std::make_exception_ptr(Error(cat(what_, ": ", e.what())));
        done_ = true;
      }
      if (done_) tensor_ = Tensor();  // the caller owns the buffer again
    }
    if (error_) std::rethrow_exception(error_);
    return done_;
  }

  const bool is_send_;
  std::mutex mutex_;
  Request request_;
  Tensor tensor_;
  std::string what_;
  Millis timeout_;
  bool done_ = false;
  std::exception_ptr error_;
};

// "rank 0 of communicator 2: send of activation micro-batch 3 stream 0 (f32 [4, 8]) to rank 1
// (world rank 5)", with the caller's label for the message when it gave one.
std::string describe(const Communicator& comm, bool is_send, const Tensor& tensor, int peer,
                     const P2PTag& tag, const std::string& label) {
  std::string peer_str = peer >= 0 && peer < comm.size()
                             ? cat("rank ", peer, " (world rank ", comm.world_rank(peer), ")")
                             : cat("rank ", peer);
  return cat("rank ", comm.rank(), " of communicator ", comm.id(), " (", comm.size(),
             " ranks): ", is_send ? "send of " : "receive of ",
             label.empty() ? p2p_tag_str(tag) : label, " (",
             tensor.defined()
                 ? cat(tensor.dtype(), " ", tensor.shape_str(), " on ", tensor.device())
                 : std::string("undefined tensor"),
             ") ", is_send ? "to " : "from ", peer_str);
}

Work post(Communicator& comm, bool is_send, const Tensor& tensor, int peer, const P2PTag& tag,
          const P2POptions& options) {
  const std::string what = describe(comm, is_send, tensor, peer, tag, options.label);
  if (peer < 0 || peer >= comm.size() || peer == comm.rank())
    throw Error(cat(what, ": the peer must be another rank of the communicator, in [0, ",
                    comm.size(), ") and not ", comm.rank()));
  if (!tensor.defined()) throw Error(cat(what, ": the tensor is undefined"));
  if (!tensor.is_contiguous())
    throw Error(cat(what, ": the tensor is not contiguous (strides ", shape_str(tensor.strides()),
                    "); pass .contiguous()"));
  if (tensor.device().is_cuda() && !ucx_supports_cuda_memory())
    throw Error(cat(what, ": this UCX cannot move CUDA memory (it was built without CUDA, or ",
                    "its cuda transports do not load); copy the tensor to the CPU first"));
  const int me = comm.world_rank(comm.rank()), other = comm.world_rank(peer);
  // The sender's world rank is part of the tag: a receive names its source.
  const uint64_t wire = make_p2p_tag(comm.id(), tag, is_send ? me : other);
  const Millis timeout = options.timeout.count() > 0 ? options.timeout : comm.options().timeout;
  COMM_LOG(LogLevel::debug, what, ": ", tensor.nbytes(), " bytes");
  Request request;
  try {  // a peer already known dead fails at once
    request = is_send
                  ? comm.transport().isend(other, wire, tensor.data_ptr(), tensor.nbytes(), "send")
                  : comm.transport().irecv(other, wire, tensor.data_ptr(), tensor.nbytes(), "recv");
  } catch (const Error& e) {
    throw Error(cat(what, ": ", e.what()));
  }
  if (is_send) count_traffic(TrafficKind::p2p, tensor.nbytes());
  return Work(std::shared_ptr<Work::Operation>(
      std::make_shared<P2POperation>(is_send, std::move(request), tensor, what, timeout)));
}

}  // namespace

Work Communicator::send(const Tensor& tensor, int peer, const P2PTag& tag,
                        const P2POptions& options) {
  return post(*this, true, tensor, peer, tag, options);
}

Work Communicator::recv(const Tensor& tensor, int peer, const P2PTag& tag,
                        const P2POptions& options) {
  return post(*this, false, tensor, peer, tag, options);
}

}  // namespace trainer::comm
