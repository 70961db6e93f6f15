#include "parallel/context_parallel.h"

#include "comm/collectives.h"

namespace trainer {
namespace {

// The ring's messages carry no header: both ends know each block's shape,
// and messages of one stream between two ranks match in send order.
class CommContextGroup final : public ContextParallelGroup {
 public:
  CommContextGroup(std::shared_ptr<comm::Communicator> comm, ContextAttention attention,
                   bool load_balance)
      : comm_(std::move(comm)), attention_(attention), load_balance_(load_balance) {}

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  ContextAttention attention() const override { return attention_; }
  bool load_balance() const override { return load_balance_; }

  std::function<void()> send_next(const Tensor& t, int stream) override {
    comm::Work w = comm_->send(t, (rank() + 1) % size(), tag(stream));
    return [w] { w.wait(); };
  }
  std::function<void()> recv_prev(const Tensor& t, int stream) override {
    comm::Work w = comm_->recv(t, (rank() + size() - 1) % size(), tag(stream));
    return [w] { w.wait(); };
  }
  Tensor all_to_all(const Tensor& t) override { return comm::all_to_all(*comm_, t); }

 private:
  static comm::P2PTag tag(int stream) {
    return comm::P2PTag{
        .micro_batch = 0, .direction = comm::P2PDirection::activation, .stream = stream};
  }

  std::shared_ptr<comm::Communicator> comm_;
  ContextAttention attention_;
  bool load_balance_;
};

}  // namespace

std::shared_ptr<ContextParallelGroup> make_context_group(std::shared_ptr<comm::Communicator> comm,
                                                         ContextAttention attention,
                                                         bool load_balance) {
  return std::make_shared<CommContextGroup>(std::move(comm), attention, load_balance);
}

}  // namespace trainer
