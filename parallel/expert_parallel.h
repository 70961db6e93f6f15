// Expert parallelism over a communicator: the ExpertParallelGroup the
// mixture-of-experts layers use (layers/moe.h), its exchanges as comm's
// all-to-all collectives (shared memory on a host, UCX across hosts).
//
//   auto g = make_expert_group(mesh.comm(Dim::ep));
//   moe_layer->set_expert_parallel(g);
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "layers/moe.h"

namespace trainer {

std::shared_ptr<ExpertParallelGroup> make_expert_group(std::shared_ptr<comm::Communicator> comm);

}  // namespace trainer
