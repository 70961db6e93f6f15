#include "parallel/split_model.h"

#include <cmath>

#include "comm/collectives.h"
#include "core/autograd.h"
#include "core/ops.h"
#include "optim/clip.h"

namespace trainer::parallel {

void add_tied_gradient(comm::Communicator& pp, int peer, int64_t tie, const std::string& name,
                       Tensor& grad) {
  Tensor mine = grad.contiguous().clone(), theirs = empty_like(mine);
  const comm::P2PTag tag{.micro_batch = (int64_t(1) << comm::P2PTag::kMicroBatchBits) - 1,
                         .direction = comm::P2PDirection::gradient,
                         .stream = tie};
  comm::Work sent = pp.send(mine, peer, tag);
  comm::Work got = pp.recv(theirs, peer, tag);
  try {
    got.wait();
    sent.wait();
  } catch (const Error& e) {
    throw Error(cat("pipeline stage ", pp.rank(), ", exchanging the gradient of ", name,
                    " (tied across stages) with stage ", peer, ": ", e.what()));
  }
  autograd::NoGradGuard no_grad;
  add_(grad, theirs);
}

double clip_split_gradients(const std::vector<Tensor>& order,
                            const std::function<bool(size_t)>& counted,
                            const std::vector<comm::Communicator*>& over,
                            const std::vector<Tensor>& held, double max_norm) {
  std::vector<double> sums(order.size(), 0.0);
  for (size_t k = 0; k < order.size(); ++k)
    if (counted(k)) sums[k] = optim::grad_power_sum(order[k], 2.0);
  for (comm::Communicator* c : over)
    comm::allreduce(*c, sums.data(), sums.size(), DType::f64, {.op = comm::ReduceOp::sum});
  double total = 0;
  for (double v : sums) total += v;
  const double norm = std::sqrt(total);
  optim::clip_to_norm(held, max_norm, norm);
  return norm;
}

}  // namespace trainer::parallel
