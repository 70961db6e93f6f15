#include "comm/traffic.h"

namespace trainer::comm {

Traffic traffic() {
  auto read = [](TrafficKind kind) {
    return detail::traffic_bytes[int(kind)].load(std::memory_order_relaxed);
  };
  return {.allreduce = read(TrafficKind::allreduce),
          .reduce_scatter = read(TrafficKind::reduce_scatter),
          .allgather = read(TrafficKind::allgather),
          .broadcast = read(TrafficKind::broadcast),
          .p2p = read(TrafficKind::p2p),
          .transport = read(TrafficKind::transport),
          .network = read(TrafficKind::network),
          .all_to_all = read(TrafficKind::all_to_all)};
}

}  // namespace trainer::comm
