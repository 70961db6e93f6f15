// One pipeline stage at run time: the
// forward and backward of its pieces per micro-batch, and the activations
// and gradients it exchanges with the other stages over the mesh's pipeline
// communicator. The step executor (trainer/step_executor.h) calls it action
// by action from the stage's list in the schedule (parallel/schedule.h).
//
//   PipelineRuntime rt(plan, stage, pp_comm, blocks, timeline);
//   rt.probe(source.model_inputs(source.probe_batch(n)), autocast);  // every transfer's shape
//   rt.recv_activation(m, chunk);                   // recvA: waits for the inputs
//   TensorList out = rt.forward(m, chunk, inputs);  // F: the piece's blocks
//   rt.send_activation(m, chunk);                   // sendA: posts the sends
//   ...
//   rt.set_loss(m, scaled_loss);                    // the last piece: backward starts here
//   rt.recv_gradient(m, chunk); rt.backward(m, chunk); rt.send_gradient(m, chunk);
//   rt.finish_step();                               // every send of the step completed
//
// Messages carry no header: both sides know each transfer's shape and dtype
// from the probe, a forward of the model at micro-batch size (no gradients)
// in which each stage runs its own pieces, on zeros of the shapes the
// stages before it broadcast. A tensor whose shape or dtype differs
// at run time is an Error naming both stages. Receives are posted one action
// ahead (the next receive in the stage's list is posted as soon as the
// current one is waited on), sends are waited for at the end of the step.
// A receive that fails (a dead peer, a timeout) is an Error naming this
// stage, the action and the peer.
//
// Split backward (zero-bubble schedules): backward_input computes only the
// gradients of the piece's received inputs, backward_weight later the
// weights' (core/autograd.h run_backward_input).
//
// Time chunks (the LSTM LM's wavefront, set_carry_state): the micro-batches
// are consecutive pieces of one sequence, so micro-batch m > 0 starts its
// carried state (names both model input and model output, e.g. h0, c0)
// from the state micro-batch m - 1 ended in on this stage, not from the
// batch; backward(m) hands the gradient of that state back to backward(m - 1),
// which the wavefront schedule runs next (backwards in reverse order).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "core/autograd.h"
#include "parallel/pipeline.h"
#include "parallel/schedule.h"
#include "parallel/trace.h"

namespace trainer::parallel {

class PipelineRuntime {
 public:
  PipelineRuntime(parallel::PipelinePlan plan, int stage, std::shared_ptr<comm::Communicator> pp,
                  const BlockList& blocks, parallel::Timeline* timeline);

  const parallel::PipelinePlan& plan() const { return plan_; }
  int stage() const { return stage_; }
  // Whether chunk runs the model's last piece (the loss) / its first.
  bool is_last_piece(int chunk) const;
  bool is_first_piece(int chunk) const;

  // Micro-batches continue each other's carried state (time chunks).
  void set_carry_state(bool carry) { carry_state_ = carry; }

  // Runs this stage's pieces on model_inputs under autocast_dtype (no
  // gradients) and records each transfer's shape and dtype, learning the
  // other stages' from their broadcasts (collective over the pp group).
  void probe(const TensorList& model_inputs, DType autocast_dtype);

  // The actions. forward takes the micro-batch's model inputs (boundary(0)
  // order) and returns the model outputs this piece keeps (boundary(size)
  // order: the loss's logits on the last piece, carried state where written;
  // undefined elsewhere).
  void recv_activation(int m, int chunk);
  TensorList forward(int m, int chunk, const TensorList& model_inputs);
  void send_activation(int m, int chunk);
  // The last piece's loss, scaled as backward should see it.
  void set_loss(int m, Tensor loss);
  void recv_gradient(int m, int chunk);
  void backward(int m, int chunk);
  void backward_input(int m, int chunk);
  void backward_weight(int m, int chunk);
  void send_gradient(int m, int chunk);

  // Runs a's message or backward action (recvA, sendA, recvG, sendG, B, I,
  // W) and returns true; false for the actions the caller runs (F, which
  // needs the batch, grad_sync, optimizer_step).
  bool run(const parallel::Action& a);

  // Evaluation, forward only (the caller holds a NoGradGuard): runs batch m
  // of an evaluation through this stage's pieces in order, receiving each
  // piece's inputs and sending its outputs as a training forward does (the
  // same transfers and shapes: evaluation batches are padded to the
  // micro-batch size), and returns the model outputs this stage keeps. A
  // stage goes on to batch m + 1 while the next stage runs m; the sends of
  // batch m - 2 complete before batch m runs, and finish_step() waits for
  // the rest. The carried state is the caller's (model_inputs), not the
  // previous batch's.
  TensorList evaluate(int64_t m, const TensorList& model_inputs);

  // Call once per step before running its actions: the receives it will post.
  void begin_step(const std::vector<parallel::Action>& actions);
  // Waits for every send of the step; drops what the step kept.
  void finish_step();

 private:
  struct InFlight {                  // one (micro-batch, chunk)
    TensorList inputs;               // boundary(first) of the piece
    std::map<int, Tensor> received;  // transfer -> the leaf made from it
    TensorList outputs;              // boundary(last)
    std::map<int, Tensor> grad_in;   // send transfer -> its gradient from downstream
    std::map<int, Tensor> grad_out;  // receive transfer -> its gradient to send upstream
    Tensor loss;
    std::optional<autograd::DeferredWeightGrads> deferred;
    // Time chunks: boundary(first) index -> the leaf made from the previous
    // micro-batch's state; boundary(last) index -> the gradient of this
    // micro-batch's state from the next one's backward.
    std::map<size_t, Tensor> carried_in;
    std::map<size_t, Tensor> carried_grad;
  };
  InFlight& in_flight(int m, int chunk) { return in_flight_[{m, chunk}]; }
  const parallel::Piece& piece(int chunk) const {
    return plan_.piece(plan_.split().piece(stage_, chunk));
  }
  // The world rank... of the stage holding a piece, in the pp communicator.
  int peer_of(int piece) const { return plan_.split().stage_of(piece); }
  // Sends or posts the receive of transfer t's bytes for action a (an
  // Error naming this stage, the action, the tensor and the peer when the
  // transport refuses, e.g. a peer already known dead).
  comm::Work message(bool sending, const Tensor& bytes, int t, const parallel::Action& a);
  // Micro-batch m's kept output `name` on this stage (undefined: none).
  Tensor carried_output(int m, int chunk, const std::string& name);
  // Posts the receive of actions_[i] (a recv action), once.
  void post(size_t i);
  // Waits for the receive of action a (posted if it was not), then posts the next one.
  void wait_recv(const parallel::Action& a);
  // The roots and their gradients of a piece's backward.
  void backward_roots(InFlight& f, int chunk, TensorList& roots, TensorList& grads) const;
  // After a backward: the gradients of the received inputs, for send_gradient.
  void collect_input_grads(InFlight& f, int chunk, const TensorList* grads = nullptr);
  void record(const std::string& name, parallel::Track track, int64_t begin_us) const;
  std::string where(const parallel::Action& a) const;

  parallel::PipelinePlan plan_;
  int stage_;
  std::shared_ptr<comm::Communicator> pp_;
  const BlockList& blocks_;
  parallel::Timeline* timeline_;
  std::map<std::pair<int, int>, InFlight> in_flight_;
  bool carry_state_ = false;

  // The step's receives: posted (action index -> buffers and works).
  struct Posted {
    std::vector<Tensor> buffers;  // one per transfer of the action
    std::vector<comm::Work> works;
  };
  std::vector<parallel::Action> actions_;
  std::map<size_t, Posted> posted_;
  std::map<std::tuple<int, int, int>, size_t> recv_index_;  // (gradient?, m, chunk) -> action
  std::vector<comm::Work> sends_;
  std::vector<Tensor> send_buffers_;
  std::deque<size_t> eval_sends_;  // evaluation: the sends of each batch in flight, oldest first
  // Waits for sends_[0, n) and drops them (an Error naming this stage).
  void wait_sends(size_t n);
};

}  // namespace trainer::parallel
