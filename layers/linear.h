// Linear and Dropout.
//
//   Linear fc(512, 10, gen);            // weight [10, 512], bias [10]
//   Tensor logits = fc(features);       // [N, 512] -> [N, 10]
//   Dropout drop(0.5, Generator(seed, kStreamDropout));
#pragma once

#include "core/rng.h"
#include "layers/module.h"

namespace trainer {

// y = x W^T + b over the last dim: [..., in] -> [..., out]; b may be undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);

// The layer computing linear(x, weight, bias). Initialised as
// nn.Linear: weight kaiming_uniform(a = sqrt(5)) = uniform(+-1/sqrt(in)),
// bias uniform(+-1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, Generator& gen, bool bias = true);
  // A layer over existing tensors (weight tying: GPT's head over its token
  // embedding); weight [out, in], bias [out] or undefined.
  Linear(Tensor weight, Tensor bias);
  Tensor forward(const Tensor& x) override;

  Tensor weight, bias;  // [out, in], [out] (undefined without bias)
};

// Zeroes each element with probability p and scales the rest by 1/(1-p) in
// training; the identity in evaluation. The masks come from the module's own
// generator, so a run is reproducible from the seed its owner gives it (and
// resumable: the generator's offset is its whole state).
class Dropout : public Module {
 public:
  Dropout(double p, Generator gen);
  Tensor forward(const Tensor& x) override;
  Generator& generator() { return gen_; }
  double p() const { return p_; }

 private:
  double p_;
  Generator gen_;
};

}  // namespace trainer
