#include "trainer/node_rendezvous.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/check.h"

namespace trainer {

NodeRendezvous::NodeRendezvous(const NodeRendezvousOptions& o) : options_(o) {
  comm::StoreOptions so;
  so.host = o.host;
  so.port = o.port;
  so.token = o.token + ":nodes";
  so.rank = o.node_rank;
  so.serve = o.node_rank == 0;
  so.connect_timeout = o.timeout;
  so.timeout = o.timeout;
  store_ = std::make_unique<comm::Store>(so);
}

Membership NodeRendezvous::join(int round) {
  using Clock = std::chrono::steady_clock;
  const NodeRendezvousOptions& o = options_;
  if (o.node_rank != 0) round = std::max<int>(round, int(store_->add("open", 0)));
  const std::string key = cat("round/", round, "/");
  if (o.node_rank == 0) store_->add("open", round - store_->add("open", 0));
  const int64_t place = store_->add(key + "joined", 1);
  store_->set(cat(key, "member/", place - 1), std::to_string(o.node_rank));
  if (o.node_rank == 0) {
    const Clock::time_point start = Clock::now();
    for (;;) {
      const int64_t joined = store_->add(key + "joined", 0);
      const auto waited = Clock::now() - start;
      if (joined >= o.max_nodes || (joined >= o.min_nodes && waited >= o.settle)) {
        store_->set(key + "closed", std::to_string(joined));
        break;
      }
      if (waited >= o.timeout)
        throw Error(cat("trainer launch: only ", joined, " of at least ", o.min_nodes,
                        " nodes joined within ", o.timeout.count() / 1000, " s (--nnodes ",
                        o.min_nodes, ":", o.max_nodes, ")"));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  const int64_t closed = std::stoll(store_->get(key + "closed"));
  if (place > closed)
    throw Error(cat("trainer launch: node ", o.node_rank, " joined round ", round,
                    " after it closed with ", closed, " nodes; start it again to join the next"));
  Membership m;
  m.round = round;
  for (int64_t i = 0; i < closed; ++i)
    m.members.push_back(std::stoi(store_->get(cat(key, "member/", i))));
  std::sort(m.members.begin(), m.members.end());
  m.index = int(std::find(m.members.begin(), m.members.end(), o.node_rank) - m.members.begin());
  return m;
}

}  // namespace trainer
