#include "parallel/expert_parallel.h"

#include "comm/collectives.h"

namespace trainer {
namespace {

class CommExpertGroup final : public ExpertParallelGroup {
 public:
  explicit CommExpertGroup(std::shared_ptr<comm::Communicator> comm) : comm_(std::move(comm)) {}

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }

  Tensor all_to_all_v(const Tensor& rows, const std::vector<int64_t>& send_counts,
                      std::vector<int64_t>* recv_counts) override {
    return comm::all_to_all_v(*comm_, rows, send_counts, recv_counts);
  }

  std::vector<int64_t> exchange(const std::vector<int64_t>& counts) override {
    CHECK(counts.size() % size_t(size()) == 0)
        << "expert exchange: " << counts.size() << " counts over " << size() << " ranks";
    if (counts.empty()) return {};
    return comm::all_to_all(*comm_, from_vector(counts)).to_vector<int64_t>();
  }

 private:
  std::shared_ptr<comm::Communicator> comm_;
};

}  // namespace

std::shared_ptr<ExpertParallelGroup> make_expert_group(std::shared_ptr<comm::Communicator> comm) {
  return std::make_shared<CommExpertGroup>(std::move(comm));
}

}  // namespace trainer
