// A toy language-modelling task for the sequence-model tests (test_rnn,
// test_transformer): a fixed batch every model must be able to overfit, and
// the training loop that fits it.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "optim/optimizer.h"
#include "tests/testing.h"

namespace trainer::testing {

// B sequences of T + 1 tokens below V whose first tokens differ (B <= V), so
// every next token is a function of the prefix. Returns the inputs
// x = tokens[:, :T] and the targets y = tokens[:, 1:], both [B, T] i64 and
// contiguous.
inline std::pair<Tensor, Tensor> next_token_task(int64_t B, int64_t T, int64_t V) {
  std::vector<int64_t> data(size_t(B * (T + 1)));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t <= T; ++t)
      data[size_t(b * (T + 1) + t)] = t == 0 ? b : int64_t((b * 7 + t * t * 3 + 1) % V);
  Tensor all = from_vector(data, {B, T + 1});
  return {all.narrow(1, 0, T).contiguous(), all.narrow(1, 1, T).contiguous()};
}

struct FitResult {
  double first = 0;  // the loss before any step
  double last = 0;   // the loss before the last step
};

// `steps` AdamW steps (lr, no weight decay) on the scalar loss() over params.
inline FitResult fit(const std::vector<NamedTensor>& params, double lr, int steps,
                     const std::function<Tensor()>& loss) {
  optim::AdamW opt({optim::ParamGroup{params}}, {.lr = lr, .weight_decay = 0.0});
  FitResult r;
  for (int step = 0; step < steps; ++step) {
    Tensor l = loss();
    if (step == 0) r.first = l.item<float>();
    r.last = l.item<float>();
    l.backward();
    opt.step();
    opt.zero_grad();
  }
  return r;
}

}  // namespace trainer::testing
