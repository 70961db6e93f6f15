// Context parallelism over a communicator: the ContextParallelGroup the
// layers use (layers/context_parallel.h), its ring messages as
// point-to-point messages of the group's communicator and its all-to-all
// as comm's collective.
//
//   auto g = make_context_group(mesh.comm(Dim::cp), ContextAttention::ring, /*load_balance=*/true);
//   Tensor y = context_parallel_attention(q, k, v, NH, KV, 0.0, true, gen, *g);
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "layers/context_parallel.h"

namespace trainer {

std::shared_ptr<ContextParallelGroup> make_context_group(std::shared_ptr<comm::Communicator> comm,
                                                         ContextAttention attention,
                                                         bool load_balance);

}  // namespace trainer
