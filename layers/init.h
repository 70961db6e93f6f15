// Parameter initialisation as torch.nn.init does it, drawing from a
// Generator (core/rng.h) so a model built with the same seed is the same
// model on every machine. Each function overwrites t in place (no autograd);
// a deferred t (core/tensor.h DeferredInit) records the draw at the
// generator's offset instead, and the generator advances alike.
//
//   kaiming_uniform_(conv.weight, std::sqrt(5.0), gen);     // nn.Conv2d / nn.Linear default
//   kaiming_normal_(conv.weight, FanMode::fan_out, gen);    // torchvision ResNet convs
//
// Fans follow torch: for a weight [O, I, k...], fan_in = I * prod(k) and
// fan_out = O * prod(k) (with groups, I is already the per-group count).
#pragma once

#include "core/rng.h"
#include "core/tensor.h"

namespace trainer {

enum class FanMode { fan_in, fan_out };

int64_t fan_in(const Tensor& weight);
int64_t fan_out(const Tensor& weight);

void uniform_(const Tensor& t, double lo, double hi, Generator& gen);
void normal_(const Tensor& t, double mean, double std, Generator& gen);
// Uniform(-b, b), b = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2)) (leaky-relu gain).
void kaiming_uniform_(const Tensor& t, double a, Generator& gen);
// Normal(0, std), std = sqrt(2) / sqrt(fan) (relu gain).
void kaiming_normal_(const Tensor& t, FanMode mode, Generator& gen);

}  // namespace trainer
