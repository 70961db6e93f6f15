// Point-to-point messages between two ranks of a communicator, the traffic
// of pipeline parallelism: a stage sends its activations forward and its
// input gradients backward, once per micro-batch, receives posted ahead and
// sends overlapped with compute; and of parameter servers (gradient pushes
// and parameter pulls, parallel/parameter_server.h), which reuse the tag's
// fields and name their messages with P2POptions::label. Communicator::send
// and recv (declared in comm/communicator.h, implemented in comm/p2p.cpp)
// take a contiguous tensor whose shape and dtype both sides know in advance,
// so messages carry no header: a receive names the peer and the P2PTag, and
// matches the send of that peer with the same tag (messages with equal tags
// between the same pair match in send order). Both return at once with the
// same Work handle as the collectives; the thread that calls Work::test() or
// wait() progresses the transport.
//
//   Work r = pp->recv(input, stage - 1, {.micro_batch = 3});          // posted ahead
//   Work s = pp->send(output, stage + 1, {.micro_batch = 2});
//   Work g = pp->send(grad_input, stage - 1,
//                     {.micro_batch = 1, .direction = P2PDirection::gradient});
//   ... compute ...
//   r.wait();   // Error: "... receive of activation micro-batch 3 stream 0 from rank 0 ..."
//   Work p = ps->send(grads, server, tag, {.label = "the gradients of gradient push message 12"});
//
// The tag lives in the communicator's point-to-point field of the transport
// tag (comm/transport.h: 31 bits, transport tag bits [50..20]), laid out
//   [30..11] micro_batch (20 bits)  [10..1] stream (10 bits)  [0] direction
// so a receive for micro-batch 3 posted before the one for micro-batch 0
// matches only its own message. Collectives use another kind bit and never
// match these.
//
// Messages run over UCX whatever CommOptions::shared_memory says: between
// ranks of one host UCX picks its own shared-memory transports (posix fifos
// for small messages, a cross-memory-attach rendezvous above a few KB),
// between hosts TCP or the network's transport. The communicator's
// shared-memory channel (comm/shm_channel.h) serves collectives only: its
// operations run in one ticket order over all members and it is created
// collectively, neither of which fits a message between two ranks posted
// out of order. bench/bench_p2p.cpp measures what a pairwise path through it
// could gain: a one-copy read with one handshake each way takes 0.65-0.9x
// UCX's time from 16 KB to 4 MB, about the same at 16-64 MB. A dead peer is
// an Error naming it within milliseconds (comm/transport.h); a silent one a
// timeout naming the peer and the tag.
//
// Glossary: peer = the other rank (in the communicator), micro-batch = the
// pipeline's unit of work, direction = activation (forward) or gradient
// (backward), stream = which of several tensors of one micro-batch and
// direction (a virtual stage's chunk, or the n-th tensor of a boundary).
#pragma once

#include <cstdint>
#include <string>

#include "comm/transport.h"

namespace trainer::comm {

enum class P2PDirection : uint32_t { activation = 0, gradient = 1 };

struct P2PTag {
  static constexpr int kMicroBatchBits = 20;
  static constexpr int kStreamBits = 10;

  int64_t micro_batch = 0;  // in [0, 2^20)
  P2PDirection direction = P2PDirection::activation;
  int64_t stream = 0;  // in [0, 2^10)
};
static_assert(P2PTag::kMicroBatchBits + P2PTag::kStreamBits + 1 == kTagSeqBits + kTagMessageBits,
              "the point-to-point tag fills the transport tag's sequence and message fields");

struct P2POptions {
  Millis timeout{0};  // of each wait without progress; 0: the communicator's
  // What the message is, for errors and logs ("the gradients of gradient
  // push message 12"); empty: the pipeline's reading of the tag, p2p_tag_str.
  std::string label{};
};

// "activation micro-batch 3 stream 0", for messages.
std::string p2p_tag_str(const P2PTag& tag);

// The transport tag of a message of communicator comm_id from source_world_rank.
// Error when a field is out of its range (naming the field and the range).
uint64_t make_p2p_tag(uint32_t comm_id, const P2PTag& tag, int source_world_rank);

}  // namespace trainer::comm
