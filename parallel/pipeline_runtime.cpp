#include "parallel/pipeline_runtime.h"

#include <algorithm>

#include "comm/collectives.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "core/ops_conv.h"

namespace trainer::parallel {

using parallel::Action;
using parallel::ActionKind;

namespace {

bool is_recv(ActionKind k) {
  return k == ActionKind::recv_activation || k == ActionKind::recv_gradient;
}

// The contiguous tensor whose bytes travel for t: t itself, or the
// [N, H, W, C] view of a channels-last t (converted first if it is not one).
Tensor wire(const Tensor& t, bool channels_last) {
  if (!channels_last) return t.contiguous();
  Tensor nhwc = to_channels_last(t).permute({0, 2, 3, 1});
  return nhwc.is_contiguous() ? nhwc : nhwc.contiguous();
}

// A receive buffer of a transfer's shape and layout.
Tensor wire_buffer(const parallel::Transfer& tr) {
  return tr.channels_last ? empty_channels_last(tr.shape, tr.dtype) : empty(tr.shape, tr.dtype);
}

}  // namespace

PipelineRuntime::PipelineRuntime(parallel::PipelinePlan plan, int stage,
                                 std::shared_ptr<comm::Communicator> pp, const BlockList& blocks,
                                 parallel::Timeline* timeline)
    : plan_(std::move(plan)),
      stage_(stage),
      pp_(std::move(pp)),
      blocks_(blocks),
      timeline_(timeline) {
  CHECK(pp_ != nullptr) << "a pipeline stage without a pipeline communicator";
  CHECK_EQ(pp_->size(), plan_.split().stages);
  CHECK_EQ(pp_->rank(), stage_);
  CHECK(plan_.transfers().size() < (size_t(1) << comm::P2PTag::kStreamBits))
      << plan_.transfers().size() << " transfers between pipeline pieces; at most "
      << (1 << comm::P2PTag::kStreamBits);
}

bool PipelineRuntime::is_last_piece(int chunk) const {
  return plan_.split().piece(stage_, chunk) == plan_.pieces() - 1;
}

bool PipelineRuntime::is_first_piece(int chunk) const {
  return plan_.split().piece(stage_, chunk) == 0;
}

void PipelineRuntime::probe(const TensorList& model_inputs, DType autocast_dtype) {
  autograd::NoGradGuard no_grad;
  AutocastGuard autocast(autocast_dtype);
  // Piece by piece: its stage runs it (on zeros of the received shapes) and
  // tells every stage what its transfers carry, so no stage needs another's
  // weights. Per transfer: rank, dims, dtype, channels-last.
  constexpr size_t kMaxDims = 8, kFields = kMaxDims + 3;
  for (int v = 0; v < plan_.pieces(); ++v) {
    const parallel::Piece& p = plan_.piece(v);
    const int owner = plan_.split().stage_of(v);
    std::vector<int> outgoing;
    for (const std::vector<int>& ts : p.output_transfers)
      outgoing.insert(outgoing.end(), ts.begin(), ts.end());
    std::vector<int64_t> wire(outgoing.size() * kFields, 0);
    if (owner == stage_) {
      TensorList in;
      for (size_t k = 0; k < p.input_source.size(); ++k) {
        const int source = p.input_source[k];
        if (source == parallel::Piece::kAbsent) {
          in.push_back(Tensor());
        } else if (source == parallel::Piece::kModelInput) {
          const std::vector<std::string>& names = blocks_.boundary(0);
          const std::string& name = blocks_.boundary(p.first)[k];
          const size_t i = size_t(std::find(names.begin(), names.end(), name) - names.begin());
          CHECK(i < names.size()) << "model input '" << name << "'";
          in.push_back(model_inputs.at(i));
        } else {
          Tensor received = wire_buffer(plan_.transfers()[size_t(source)]);  // its layout too
          received.zero_();
          in.push_back(received);
        }
      }
      TensorList out = blocks_.run(p.first, p.last, in);
      size_t n = 0;
      for (size_t k = 0; k < out.size(); ++k)
        for (int t : p.output_transfers[k]) {
          const parallel::Transfer& tr = plan_.transfers()[size_t(t)];
          CHECK(out[k].defined()) << "transfer '" << tr.name << "' is undefined in the probe";
          CHECK(out[k].dim() <= int(kMaxDims)) << "transfer '" << tr.name << "' has "
                                               << out[k].dim() << " dims; at most " << kMaxDims;
          int64_t* f = wire.data() + kFields * n++;
          f[0] = out[k].dim();
          for (int d = 0; d < out[k].dim(); ++d) f[1 + d] = out[k].size(d);
          f[kMaxDims + 1] = int64_t(out[k].dtype());
          f[kMaxDims + 2] = out[k].dim() == 4 && is_channels_last(out[k]);
        }
    }
    if (!wire.empty()) comm::broadcast(*pp_, wire.data(), wire.size() * sizeof(int64_t), owner);
    for (size_t n = 0; n < outgoing.size(); ++n) {
      const int64_t* f = wire.data() + kFields * n;
      parallel::Transfer& tr = plan_.transfers()[size_t(outgoing[n])];
      tr.shape.assign(f + 1, f + 1 + f[0]);
      tr.dtype = DType(f[kMaxDims + 1]);
      tr.has_gradient = is_floating(tr.dtype);
      tr.channels_last = f[kMaxDims + 2] != 0;
    }
  }
}

std::string PipelineRuntime::where(const Action& a) const {
  return cat("pipeline stage ", stage_, " (", parallel::to_string(a), ")");
}

void PipelineRuntime::record(const std::string& name, parallel::Track track,
                             int64_t begin_us) const {
  if (timeline_) timeline_->add(name, track, begin_us, parallel::trace_now_us());
}

void PipelineRuntime::begin_step(const std::vector<Action>& actions) {
  CHECK(posted_.empty() && sends_.empty()) << "begin_step before the last step finished";
  actions_ = actions;
  recv_index_.clear();
  for (size_t i = 0; i < actions_.size(); ++i)
    if (is_recv(actions_[i].kind))
      recv_index_[{actions_[i].kind == ActionKind::recv_gradient, actions_[i].micro_batch,
                   actions_[i].chunk}] = i;
  // The step's first receive goes out at once.
  for (size_t i = 0; i < actions_.size(); ++i)
    if (is_recv(actions_[i].kind)) {
      post(i);
      break;
    }
}

comm::Work PipelineRuntime::message(bool sending, const Tensor& bytes, int t, const Action& a) {
  const parallel::Transfer& tr = plan_.transfers()[size_t(t)];
  const bool gradient = a.kind == ActionKind::send_gradient || a.kind == ActionKind::recv_gradient;
  // Activations go from the producing piece to the consuming one, gradients back.
  const int peer = peer_of(sending != gradient ? tr.to : tr.from);
  const comm::P2PTag tag{
      .micro_batch = a.micro_batch,
      .direction = gradient ? comm::P2PDirection::gradient : comm::P2PDirection::activation,
      .stream = t};
  try {
    return sending ? pp_->send(bytes, peer, tag) : pp_->recv(bytes, peer, tag);
  } catch (const Error& e) {
    throw Error(cat(where(a), ", ", sending ? "sending '" : "receiving '", tr.name,
                    sending ? "' to stage " : "' from stage ", peer, ": ", e.what()));
  }
}

void PipelineRuntime::post(size_t i) {
  if (posted_.count(i)) return;
  const Action& a = actions_[i];
  const bool gradient = a.kind == ActionKind::recv_gradient;
  const parallel::Piece& p = piece(a.chunk);
  Posted& posted = posted_[i];
  for (int t : gradient ? p.sends : p.receives) {
    const parallel::Transfer& tr = plan_.transfers()[size_t(t)];
    if (gradient && !tr.has_gradient) continue;
    Tensor buffer = wire_buffer(tr);
    Tensor bytes = wire(buffer, tr.channels_last);
    CHECK(bytes.data_ptr() == buffer.data_ptr()) << "a receive buffer that is not its own bytes";
    posted.works.push_back(message(false, bytes, t, a));
    posted.buffers.push_back(std::move(buffer));
  }
}

void PipelineRuntime::wait_recv(const Action& a) {
  const bool gradient = a.kind == ActionKind::recv_gradient;
  const size_t i = recv_index_.at({gradient, a.micro_batch, a.chunk});
  post(i);
  const int64_t begin = parallel::trace_now_us();
  Posted& posted = posted_.at(i);
  for (size_t k = 0; k < posted.works.size(); ++k) {
    try {
      posted.works[k].wait();
    } catch (const Error& e) {
      std::string peers;
      for (int t : gradient ? piece(a.chunk).sends : piece(a.chunk).receives) {
        const parallel::Transfer& tr = plan_.transfers()[size_t(t)];
        if (gradient && !tr.has_gradient) continue;
        peers += cat(peers.empty() ? "" : ", ", "stage ", peer_of(gradient ? tr.to : tr.from),
                     " ('", tr.name, "')");
      }
      throw Error(cat(where(a), ", waiting on ", peers, ": ", e.what()));
    }
  }
  record(parallel::to_string(a), parallel::Track::comm, begin);
  // Post the next receive of the list while this action's consumer computes.
  for (size_t j = i + 1; j < actions_.size(); ++j)
    if (is_recv(actions_[j].kind)) {
      post(j);
      break;
    }
  InFlight& f = in_flight(a.micro_batch, a.chunk);
  const parallel::Piece& p = piece(a.chunk);
  size_t k = 0;
  for (int t : gradient ? p.sends : p.receives) {
    const parallel::Transfer& tr = plan_.transfers()[size_t(t)];
    if (gradient && !tr.has_gradient) continue;
    Tensor got = std::move(posted.buffers[k++]);
    if (gradient) {
      f.grad_in[t] = std::move(got);
    } else {
      if (tr.has_gradient) got.requires_grad_();
      f.received[t] = std::move(got);
    }
  }
  posted_.erase(i);
}

void PipelineRuntime::recv_activation(int m, int chunk) {
  wait_recv(Action{ActionKind::recv_activation, m, chunk});
}

void PipelineRuntime::recv_gradient(int m, int chunk) {
  wait_recv(Action{ActionKind::recv_gradient, m, chunk});
}

TensorList PipelineRuntime::forward(int m, int chunk, const TensorList& model_inputs) {
  const parallel::Piece& p = piece(chunk);
  InFlight& f = in_flight(m, chunk);
  f.inputs.clear();
  for (size_t k = 0; k < p.input_source.size(); ++k) {
    const int source = p.input_source[k];
    if (source == parallel::Piece::kAbsent) {
      f.inputs.push_back(Tensor());
    } else if (source == parallel::Piece::kModelInput) {
      // boundary(first) lists model inputs by name; find it in boundary(0).
      const std::vector<std::string>& names = blocks_.boundary(0);
      const std::string& name = blocks_.boundary(p.first)[k];
      size_t i = 0;
      while (i < names.size() && names[i] != name) ++i;
      CHECK(i < names.size()) << "model input '" << name << "'";
      Tensor previous = carry_state_ && m > 0 ? carried_output(m - 1, chunk, name) : Tensor();
      if (previous.defined()) {
        // The state the previous time chunk ended in, its gradient to come back.
        Tensor leaf = previous.detach();
        if (is_floating(leaf.dtype())) leaf.requires_grad_();
        f.carried_in[k] = leaf;
        f.inputs.push_back(leaf);
        continue;
      }
      f.inputs.push_back(model_inputs.at(i));
    } else {
      auto it = f.received.find(source);
      CHECK(it != f.received.end())
          << "pipeline stage " << stage_ << ": F" << m << " before its input '"
          << plan_.transfers()[size_t(source)].name << "' was received";
      f.inputs.push_back(it->second);
    }
  }
  const int64_t begin = parallel::trace_now_us();
  f.outputs = blocks_.run(p.first, p.last, f.inputs);
  record(cat("F", m, chunk ? cat(".c", chunk) : std::string()), parallel::Track::compute, begin);
  // The kept outputs by name, in the model outputs' order.
  const std::vector<std::string>& model_outputs = blocks_.boundary(blocks_.size());
  const std::vector<std::string>& here = blocks_.boundary(p.last);
  TensorList kept(model_outputs.size());
  for (size_t k = 0; k < f.outputs.size(); ++k)
    if (p.output_kept[k])
      for (size_t j = 0; j < model_outputs.size(); ++j)
        if (model_outputs[j] == here[k]) kept[j] = f.outputs[k];
  return kept;
}

Tensor PipelineRuntime::carried_output(int m, int chunk, const std::string& name) {
  const parallel::Piece& p = piece(chunk);
  const InFlight& f = in_flight(m, chunk);
  const std::vector<std::string>& here = blocks_.boundary(p.last);
  for (size_t j = 0; j < f.outputs.size(); ++j)
    if (p.output_kept[j] && here[j] == name) return f.outputs[j];
  return Tensor();
}

void PipelineRuntime::send_activation(int m, int chunk) {
  const parallel::Piece& p = piece(chunk);
  InFlight& f = in_flight(m, chunk);
  const int64_t begin = parallel::trace_now_us();
  for (size_t k = 0; k < f.outputs.size(); ++k)
    for (int t : p.output_transfers[k]) {
      const parallel::Transfer& tr = plan_.transfers()[size_t(t)];
      const Tensor& out = f.outputs[k];
      if (!out.defined() || out.shape() != tr.shape || out.dtype() != tr.dtype)
        throw Error(cat("pipeline stage ", stage_, " sends '", tr.name, "' of micro-batch ", m,
                        " to stage ", peer_of(tr.to), " as ",
                        out.defined() ? cat(out.shape_str(), " ", out.dtype()) : "undefined",
                        ", but both stages expect ", shape_str(tr.shape), " ", tr.dtype,
                        " (the shape probe's); a model's boundary tensors must keep their shape "
                        "from micro-batch to micro-batch"));
      Tensor buffer = wire(out.detach(), tr.channels_last);
      sends_.push_back(message(true, buffer, t, Action{ActionKind::send_activation, m, chunk}));
      send_buffers_.push_back(std::move(buffer));
    }
  record(cat("sendA", m, chunk ? cat(".c", chunk) : std::string()), parallel::Track::comm, begin);
}

void PipelineRuntime::set_loss(int m, Tensor loss) {
  CHECK(is_last_piece(plan_.split().chunks - 1)) << "a loss on a stage without the last piece";
  in_flight(m, plan_.split().chunks - 1).loss = std::move(loss);
}

void PipelineRuntime::backward_roots(InFlight& f, int chunk, TensorList& roots,
                                     TensorList& grads) const {
  const parallel::Piece& p = piece(chunk);
  if (f.loss.defined()) {
    roots.push_back(f.loss);
    grads.push_back(ones_like(f.loss));
  }
  for (size_t k = 0; k < f.outputs.size(); ++k)
    for (int t : p.output_transfers[k]) {
      if (!plan_.transfers()[size_t(t)].has_gradient || !f.outputs[k].requires_grad()) continue;
      auto it = f.grad_in.find(t);
      CHECK(it != f.grad_in.end())
          << "pipeline stage " << stage_ << ": backward before the gradient of '"
          << plan_.transfers()[size_t(t)].name << "' was received";
      roots.push_back(f.outputs[k]);
      grads.push_back(it->second);
    }
  // Time chunks: the state this micro-batch ended in, as the next one used it.
  for (const auto& [k, grad] : f.carried_grad)
    if (grad.defined() && f.outputs.at(k).requires_grad()) {
      roots.push_back(f.outputs[k]);
      grads.push_back(grad);
    }
}

void PipelineRuntime::collect_input_grads(InFlight& f, int chunk, const TensorList* grads) {
  size_t k = 0;
  for (int t : piece(chunk).receives) {
    if (!plan_.transfers()[size_t(t)].has_gradient) continue;
    const Tensor& leaf = f.received.at(t);
    Tensor g = grads ? (*grads)[k++] : leaf.grad();
    f.grad_out[t] = g.defined() ? g : zeros_like(leaf);
  }
}

void PipelineRuntime::backward(int m, int chunk) {
  InFlight& f = in_flight(m, chunk);
  TensorList roots, grads;
  backward_roots(f, chunk, roots, grads);
  const int64_t begin = parallel::trace_now_us();
  if (!roots.empty()) autograd::run_backward(roots, grads, false);
  record(cat("B", m, chunk ? cat(".c", chunk) : std::string()), parallel::Track::compute, begin);
  collect_input_grads(f, chunk);
  if (!f.carried_in.empty()) {
    // To the previous time chunk's backward, by the name of the state.
    const parallel::Piece& p = piece(chunk);
    const std::vector<std::string>& in_names = blocks_.boundary(p.first);
    const std::vector<std::string>& out_names = blocks_.boundary(p.last);
    InFlight& previous = in_flight(m - 1, chunk);
    for (const auto& [k, leaf] : f.carried_in)
      for (size_t j = 0; j < out_names.size(); ++j)
        if (p.output_kept[j] && out_names[j] == in_names[k]) previous.carried_grad[j] = leaf.grad();
    f.carried_in.clear();
  }
  f.carried_grad.clear();
  f.outputs.clear();
  f.loss = Tensor();
  f.grad_in.clear();
  f.inputs.clear();
}

void PipelineRuntime::backward_input(int m, int chunk) {
  CHECK(!carry_state_)
      << "time chunks run whole backwards (the wavefront schedule), not split ones";
  InFlight& f = in_flight(m, chunk);
  TensorList roots, grads, inputs;
  backward_roots(f, chunk, roots, grads);
  for (int t : piece(chunk).receives)
    if (plan_.transfers()[size_t(t)].has_gradient) inputs.push_back(f.received.at(t));
  const int64_t begin = parallel::trace_now_us();
  if (!roots.empty()) {
    autograd::SplitBackward split = autograd::run_backward_input(roots, grads, inputs);
    f.deferred.emplace(std::move(split.weight_grads));
    collect_input_grads(f, chunk, &split.input_grads);
  } else {
    collect_input_grads(f, chunk);
  }
  record(cat("I", m, chunk ? cat(".c", chunk) : std::string()), parallel::Track::compute, begin);
  f.outputs.clear();
  f.loss = Tensor();
  f.grad_in.clear();
  f.inputs.clear();
}

void PipelineRuntime::backward_weight(int m, int chunk) {
  InFlight& f = in_flight(m, chunk);
  const int64_t begin = parallel::trace_now_us();
  if (f.deferred) {
    f.deferred->run();
    f.deferred.reset();
  }
  record(cat("W", m, chunk ? cat(".c", chunk) : std::string()), parallel::Track::compute, begin);
}

void PipelineRuntime::send_gradient(int m, int chunk) {
  InFlight& f = in_flight(m, chunk);
  const int64_t begin = parallel::trace_now_us();
  for (int t : piece(chunk).receives) {
    const parallel::Transfer& tr = plan_.transfers()[size_t(t)];
    if (!tr.has_gradient) continue;
    const Tensor& grad = f.grad_out.at(t);
    CHECK(grad.shape() == tr.shape && grad.dtype() == tr.dtype)
        << "the gradient of '" << tr.name << "' is " << grad.shape_str() << " " << grad.dtype();
    Tensor g = wire(grad, tr.channels_last);
    sends_.push_back(message(true, g, t, Action{ActionKind::send_gradient, m, chunk}));
    send_buffers_.push_back(std::move(g));
  }
  f.grad_out.clear();
  f.received.clear();
  record(cat("sendG", m, chunk ? cat(".c", chunk) : std::string()), parallel::Track::comm, begin);
}

bool PipelineRuntime::run(const Action& a) {
  const int m = a.micro_batch, c = a.chunk;
  switch (a.kind) {
    case ActionKind::recv_activation:
      recv_activation(m, c);
      return true;
    case ActionKind::send_activation:
      send_activation(m, c);
      return true;
    case ActionKind::recv_gradient:
      recv_gradient(m, c);
      return true;
    case ActionKind::send_gradient:
      send_gradient(m, c);
      return true;
    case ActionKind::backward:
      backward(m, c);
      return true;
    case ActionKind::backward_input:
      backward_input(m, c);
      return true;
    case ActionKind::backward_weight:
      backward_weight(m, c);
      return true;
    case ActionKind::forward:
    case ActionKind::grad_sync:
    case ActionKind::optimizer_step:
      return false;
  }
  return false;
}

void PipelineRuntime::wait_sends(size_t n) {
  for (size_t i = 0; i < n; ++i) {
    try {
      sends_[i].wait();
    } catch (const Error& e) {
      throw Error(cat("pipeline stage ", stage_, ", completing the step's sends: ", e.what()));
    }
  }
  sends_.erase(sends_.begin(), sends_.begin() + ptrdiff_t(n));
  send_buffers_.erase(send_buffers_.begin(), send_buffers_.begin() + ptrdiff_t(n));
}

TensorList PipelineRuntime::evaluate(int64_t m, const TensorList& model_inputs) {
  CHECK(posted_.empty()) << "pipeline stage " << stage_ << ": evaluation inside a training step";
  while (eval_sends_.size() >= 2) {
    wait_sends(eval_sends_.front());
    eval_sends_.pop_front();
  }
  // Batches in flight are at most 2 apart, so the tag's micro-batch field
  // may wrap around.
  const int b = int(m % (int64_t(1) << comm::P2PTag::kMicroBatchBits));
  const size_t sends_before = sends_.size();
  const bool carry = carry_state_;
  carry_state_ = false;
  TensorList kept(blocks_.boundary(blocks_.size()).size());
  for (int chunk = 0; chunk < plan_.split().chunks; ++chunk) {
    const Action a{ActionKind::recv_activation, b, chunk};
    InFlight& f = in_flight(b, chunk);
    std::vector<comm::Work> works;
    for (int t : piece(chunk).receives) {
      Tensor buffer = wire_buffer(plan_.transfers()[size_t(t)]);
      works.push_back(
          message(false, wire(buffer, plan_.transfers()[size_t(t)].channels_last), t, a));
      f.received[t] = buffer;
    }
    for (size_t k = 0; k < works.size(); ++k) {
      try {
        works[k].wait();
      } catch (const Error& e) {
        const parallel::Transfer& tr = plan_.transfers()[size_t(piece(chunk).receives[k])];
        throw Error(cat(where(a), " of an evaluation, waiting on stage ", peer_of(tr.from), " ('",
                        tr.name, "'): ", e.what()));
      }
    }
    const TensorList out = forward(b, chunk, model_inputs);
    for (size_t j = 0; j < out.size(); ++j)
      if (out[j].defined()) kept[j] = out[j];
    send_activation(b, chunk);
    in_flight_.erase({b, chunk});
  }
  carry_state_ = carry;
  eval_sends_.push_back(sends_.size() - sends_before);
  return kept;
}

void PipelineRuntime::finish_step() {
  const int64_t begin = parallel::trace_now_us();
  wait_sends(sends_.size());
  record("sends", parallel::Track::comm, begin);
  eval_sends_.clear();
  posted_.clear();
  in_flight_.clear();
}

}  // namespace trainer::parallel
