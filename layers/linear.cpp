#include "layers/linear.h"

#include <cmath>

#include "core/ops.h"
#include "layers/init.h"

namespace trainer {

Linear::Linear(int64_t in_features, int64_t out_features, Generator& gen, bool with_bias) {
  CHECK(in_features >= 1 && out_features >= 1)
      << "Linear: features " << in_features << " -> " << out_features;
  weight = register_parameter("weight", empty({out_features, in_features}));
  kaiming_uniform_(weight, std::sqrt(5.0), gen);
  if (with_bias) {
    bias = register_parameter("bias", empty({out_features}));
    double bound = 1.0 / std::sqrt(double(in_features));
    uniform_(bias, -bound, bound, gen);
  }
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  Tensor y = matmul(x, weight.t());
  return bias.defined() ? y + bias : y;
}

Tensor Linear::forward(const Tensor& x) { return linear(x, weight, bias); }

Dropout::Dropout(double p, Generator gen) : p_(p), gen_(gen) {
  CHECK(p >= 0.0 && p < 1.0) << "Dropout: p " << p << " outside [0, 1)";
}

Tensor Dropout::forward(const Tensor& x) { return dropout(x, p_, is_training(), gen_); }

}  // namespace trainer
