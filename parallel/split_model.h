// What a model split over ranks (pipeline stages, tensor-parallel parts)
// needs at the end of a step beyond data parallelism: the gradient of a
// weight tied across two stages, summed on both, and the gradient norm of
// the whole model, summed in one order on every layout.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace trainer::parallel {

// Adds the other stage's gradient of a weight tied across stages to grad:
// both stages compute own + other's, the same bits on both (a + b == b + a).
// tie: the tie's number, the same on both stages. Collective over the pair;
// Error naming this stage, the weight and the peer when the exchange fails.
void add_tied_gradient(comm::Communicator& pp, int peer, int64_t tie, const std::string& name,
                       Tensor& grad);

// The global 2-norm of the gradients of a split model. order holds every
// parameter of the whole model in one fixed order (the same on every rank);
// entry k is the squared norm of order[k]'s gradient on the one rank that
// counts it (counted(k)) and zero elsewhere, and the entries are summed over
// the communicators of over (the pipeline's, the tensor-parallel group's),
// so the total adds the parameters in one order whatever the layout. The
// gradients of held (what this rank trains) are then clipped to max_norm.
double clip_split_gradients(const std::vector<Tensor>& order,
                            const std::function<bool(size_t)>& counted,
                            const std::vector<comm::Communicator*>& over,
                            const std::vector<Tensor>& held, double max_norm);

}  // namespace trainer::parallel
