// Elastic membership of a job's nodes, for `trainer launch --nnodes MIN:MAX`:
// before each start of the ranks (the first, and every restart), the node
// launchers meet in a rendezvous store that node 0's launcher serves on
// master port + 1, and node 0 closes the round once every node has joined,
// or once at least MIN have joined and the settle time has passed. The
// nodes of a round are numbered by their --node-rank in order, so node 0 is
// always the first and its local rank 0 is rank 0 of the job (the host of
// the ranks' own store at the master port). A node that comes back while the
// round is open joins it; one that comes later waits for the next.
//
//   NodeRendezvous rdzv({.host = "node01", .port = 29501, .node_rank = 1, .min_nodes = 1,
//                        .max_nodes = 2});
//   Membership m = rdzv.join(restart);    // m.index, m.nodes
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/store.h"

namespace trainer {

struct NodeRendezvousOptions {
  std::string host;  // node 0's address
  int port = 0;      // of the launchers' store (served by node 0)
  std::string token;
  int node_rank = 0;
  int min_nodes = 1, max_nodes = 1;
  comm::Millis settle{10000};    // node 0 waits this long for more nodes once MIN have joined
  comm::Millis timeout{600000};  // for MIN nodes to join, and for the others to hear the result
};

struct Membership {
  int round = 0;
  int index = 0;             // this node's place among the members
  std::vector<int> members;  // node ranks, increasing
};

class NodeRendezvous {
 public:
  explicit NodeRendezvous(const NodeRendezvousOptions& options);
  // Joins round `round` (or a later one already open) and returns its members.
  Membership join(int round);

 private:
  NodeRendezvousOptions options_;
  std::unique_ptr<comm::Store> store_;
};

}  // namespace trainer
