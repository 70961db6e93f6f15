#include "parallel/schedule.h"

#include <map>
#include <set>
#include <tuple>

#include "core/check.h"

namespace trainer::parallel {

namespace {

bool is_per_micro_batch(ActionKind kind) {
  return kind != ActionKind::grad_sync && kind != ActionKind::optimizer_step;
}

// A message between virtual stages: (is gradient, micro-batch, receiving virtual stage).
using Message = std::tuple<bool, int, int>;

// What one stage's list does to one (micro-batch, chunk), and in which order.
struct MicroBatchTrack {
  int forward = 0, backward = 0, backward_input = 0, backward_weight = 0;
  bool activation_received = false, gradient_received = false;
};

class Checker {
 public:
  explicit Checker(const Schedule& s)
      : s_(s), stages_(int(s.stages.size())), virtual_stages_(stages_ * s.chunks) {}

  std::vector<std::string> run() {
    if (stages_ < 1 || s_.micro_batches < 1 || s_.chunks < 1) {
      problem(cat("the table has ", stages_, " stages, ", s_.micro_batches, " micro-batches, ",
                  s_.chunks, " chunks: each must be at least 1"));
      return problems_;
    }
    for (int stage = 0; stage < stages_; ++stage) check_stage(stage);
    check_messages();
    if (problems_.empty()) check_deadlock();
    return problems_;
  }

 private:
  void problem(std::string line) { problems_.push_back(std::move(line)); }

  std::string where(int stage, size_t index) const {
    return cat("stage ", stage, " action ", index, " (", to_string(s_.stages[size_t(stage)][index]),
               ")");
  }

  int virtual_stage(int stage, int chunk) const { return chunk * stages_ + stage; }

  void check_stage(int stage) {
    const std::vector<Action>& actions = s_.stages[size_t(stage)];
    std::map<std::pair<int, int>, MicroBatchTrack> track;
    int syncs = 0, steps = 0;
    bool backward_after_sync = false;
    for (size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (!is_per_micro_batch(a.kind)) {
        if (a.micro_batch != -1 || a.chunk != 0)
          problem(cat(where(stage, i), ": has a micro-batch"));
        if (a.kind == ActionKind::grad_sync) ++syncs;
        if (a.kind == ActionKind::optimizer_step) {
          ++steps;
          if (syncs == 0)
            problem(cat(where(stage, i), ": the step comes before the gradient sync"));
          if (i + 1 != actions.size()) problem(cat(where(stage, i), ": the step is not last"));
        }
        continue;
      }
      if (a.micro_batch < 0 || a.micro_batch >= s_.micro_batches || a.chunk < 0 ||
          a.chunk >= s_.chunks) {
        problem(cat(where(stage, i), ": outside ", s_.micro_batches, " micro-batches x ", s_.chunks,
                    " chunks"));
        continue;
      }
      const int v = virtual_stage(stage, a.chunk);
      const bool first = v == 0, last = v == virtual_stages_ - 1;
      MicroBatchTrack& t = track[{a.micro_batch, a.chunk}];
      const bool backwarded = t.backward > 0 || t.backward_input > 0;
      switch (a.kind) {
        case ActionKind::forward:
          if (!first && !t.activation_received)
            problem(cat(where(stage, i), ": forward before its activation is received"));
          ++t.forward;
          break;
        case ActionKind::backward:
        case ActionKind::backward_input:
          if (t.forward == 0) problem(cat(where(stage, i), ": backward before its forward"));
          if (!last && !t.gradient_received)
            problem(cat(where(stage, i), ": backward before its gradient is received"));
          ++(a.kind == ActionKind::backward ? t.backward : t.backward_input);
          backward_after_sync = backward_after_sync || syncs > 0;
          break;
        case ActionKind::backward_weight:
          if (t.backward_input == 0)
            problem(cat(where(stage, i), ": weight gradient before the input gradient"));
          ++t.backward_weight;
          backward_after_sync = backward_after_sync || syncs > 0;
          break;
        case ActionKind::send_activation:
          if (last) problem(cat(where(stage, i), ": the last virtual stage sends no activation"));
          if (t.forward == 0) problem(cat(where(stage, i), ": sent before its forward"));
          sent_[{false, a.micro_batch, v + 1}].push_back(where(stage, i));
          break;
        case ActionKind::recv_activation:
          if (first)
            problem(cat(where(stage, i), ": the first virtual stage receives no activation"));
          t.activation_received = true;
          received_[{false, a.micro_batch, v}].push_back(where(stage, i));
          break;
        case ActionKind::send_gradient:
          if (first) problem(cat(where(stage, i), ": the first virtual stage sends no gradient"));
          if (!backwarded) problem(cat(where(stage, i), ": sent before its backward"));
          sent_[{true, a.micro_batch, v - 1}].push_back(where(stage, i));
          break;
        case ActionKind::recv_gradient:
          if (last) problem(cat(where(stage, i), ": the last virtual stage receives no gradient"));
          t.gradient_received = true;
          received_[{true, a.micro_batch, v}].push_back(where(stage, i));
          break;
        case ActionKind::grad_sync:
        case ActionKind::optimizer_step:
          break;
      }
    }
    if (syncs != 1) problem(cat("stage ", stage, ": ", syncs, " gradient syncs, not 1"));
    if (steps != 1) problem(cat("stage ", stage, ": ", steps, " optimizer steps, not 1"));
    if (backward_after_sync) problem(cat("stage ", stage, ": a backward after the gradient sync"));
    for (int m = 0; m < s_.micro_batches; ++m)
      for (int c = 0; c < s_.chunks; ++c) {
        const MicroBatchTrack& t = track[{m, c}];
        const std::string what = cat("stage ", stage, " micro-batch ", m, " chunk ", c, ": ");
        if (t.forward != 1) problem(cat(what, "forwarded ", t.forward, " times, not once"));
        const bool whole = t.backward == 1 && t.backward_input == 0 && t.backward_weight == 0;
        const bool split = t.backward == 0 && t.backward_input == 1 && t.backward_weight == 1;
        if (!whole && !split)
          problem(cat(what, "backward ", t.backward, " times, input half ", t.backward_input,
                      ", weight half ", t.backward_weight, "; not once (B, or I then W)"));
      }
  }

  void check_messages() {
    for (const auto& [message, senders] : sent_) {
      auto it = received_.find(message);
      const size_t receivers = it == received_.end() ? 0 : it->second.size();
      if (senders.size() != 1 || receivers != 1)
        problem(cat(senders.front(), ": sent ", senders.size(), " times, received ", receivers,
                    " times; each message is sent and received once"));
    }
    for (const auto& [message, receivers] : received_)
      if (!sent_.count(message)) problem(cat(receivers.front(), ": nothing sends it"));
  }

  // Runs the lists together, sends never blocking and receives waiting for
  // their send: every list must reach its end.
  void check_deadlock() {
    std::vector<size_t> next(size_t(stages_), 0);
    std::set<Message> delivered;
    for (bool progress = true; progress;) {
      progress = false;
      for (int stage = 0; stage < stages_; ++stage) {
        const std::vector<Action>& actions = s_.stages[size_t(stage)];
        for (size_t& i = next[size_t(stage)]; i < actions.size(); ++i, progress = true) {
          const Action& a = actions[i];
          const int v = virtual_stage(stage, a.chunk);
          if (a.kind == ActionKind::recv_activation && !delivered.count({false, a.micro_batch, v}))
            break;
          if (a.kind == ActionKind::recv_gradient && !delivered.count({true, a.micro_batch, v}))
            break;
          if (a.kind == ActionKind::send_activation)
            delivered.insert({false, a.micro_batch, v + 1});
          if (a.kind == ActionKind::send_gradient) delivered.insert({true, a.micro_batch, v - 1});
        }
      }
    }
    for (int stage = 0; stage < stages_; ++stage)
      if (next[size_t(stage)] < s_.stages[size_t(stage)].size())
        problem(cat(where(stage, next[size_t(stage)]),
                    ": waits for a message no stage can send "
                    "(the lists deadlock)"));
  }

  const Schedule& s_;
  const int stages_, virtual_stages_;
  std::map<Message, std::vector<std::string>> sent_, received_;
  std::vector<std::string> problems_;
};

}  // namespace

std::string to_string(const Action& a) {
  std::string s;
  switch (a.kind) {
    case ActionKind::forward:
      s = "F";
      break;
    case ActionKind::backward:
      s = "B";
      break;
    case ActionKind::backward_input:
      s = "I";
      break;
    case ActionKind::backward_weight:
      s = "W";
      break;
    case ActionKind::send_activation:
      s = "sendA";
      break;
    case ActionKind::recv_activation:
      s = "recvA";
      break;
    case ActionKind::send_gradient:
      s = "sendG";
      break;
    case ActionKind::recv_gradient:
      s = "recvG";
      break;
    case ActionKind::grad_sync:
      return "sync";
    case ActionKind::optimizer_step:
      return "step";
  }
  s += std::to_string(a.micro_batch);
  if (a.chunk != 0) s += cat(".c", a.chunk);
  return s;
}

std::string to_string(const Schedule& schedule) {
  std::string out;
  for (size_t stage = 0; stage < schedule.stages.size(); ++stage) {
    if (stage > 0) out += "\n";
    out += cat("stage ", stage, ":");
    for (const Action& a : schedule.stages[stage]) out += " " + to_string(a);
  }
  return out;
}

Schedule one_stage_schedule(int micro_batches) {
  CHECK_GE(micro_batches, 1) << "micro-batches of a step";
  Schedule s{.name = "one-stage", .micro_batches = micro_batches, .chunks = 1, .stages = {{}}};
  std::vector<Action>& actions = s.stages[0];
  for (int m = 0; m < micro_batches; ++m) {
    actions.push_back({ActionKind::forward, m});
    actions.push_back({ActionKind::backward, m});
  }
  actions.push_back({ActionKind::grad_sync});
  actions.push_back({ActionKind::optimizer_step});
  return s;
}

std::vector<std::string> schedule_problems(const Schedule& schedule) {
  return Checker(schedule).run();
}

void check_schedule(const Schedule& schedule) {
  std::vector<std::string> problems = schedule_problems(schedule);
  std::string lines;
  for (const std::string& p : problems) lines += "\n  " + p;
  CHECK(problems.empty()) << "schedule '" << schedule.name << "' cannot run:" << lines << "\n"
                          << to_string(schedule);
}

}  // namespace trainer::parallel
