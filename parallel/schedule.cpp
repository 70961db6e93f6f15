#include "parallel/schedule.h"

#include <algorithm>
#include <functional>

#include "core/check.h"

namespace trainer::parallel {

namespace {

bool is_per_micro_batch(ActionKind kind) {
  return kind != ActionKind::grad_sync && kind != ActionKind::optimizer_step;
}

// What one stage's list does to one (micro-batch, chunk), and in which order.
struct MicroBatchTrack {
  int forward = 0, backward = 0, backward_input = 0, backward_weight = 0;
  bool activation_received = false, gradient_received = false;
};

// +1 for an action that puts a (micro-batch, chunk) in flight, -1 for one that frees it.
int in_flight_change(ActionKind kind, InFlightUntil until) {
  if (kind == ActionKind::forward) return 1;
  if (kind == ActionKind::backward) return -1;
  if (kind == ActionKind::backward_input) return until == InFlightUntil::backward_input ? -1 : 0;
  if (kind == ActionKind::backward_weight) return until == InFlightUntil::backward_weight ? -1 : 0;
  return 0;
}

class Checker {
 public:
  Checker(const Schedule& s, const ScheduleLimits& limits)
      : s_(s),
        limits_(limits),
        stages_(int(s.stages.size())),
        virtual_stages_(stages_ * s.chunks),
        message_{std::max(1, s.micro_batches), std::max(1, virtual_stages_)},
        sent_(message_.count()),
        received_(message_.count()) {}

  std::vector<std::string> run() {
    if (stages_ < 1 || s_.micro_batches < 1 || s_.chunks < 1) {
      problem(cat("the table has ", stages_, " stages, ", s_.micro_batches, " micro-batches, ",
                  s_.chunks, " chunks: each must be at least 1"));
      return problems_;
    }
    for (int stage = 0; stage < stages_; ++stage) check_stage(stage);
    check_limits();
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

  // The action that must come earlier in the same list, as the message's tail.
  static std::string missing(ActionKind kind, const Action& a) {
    return cat(" (no ", to_string(Action{kind, a.micro_batch, a.chunk}), " before it)");
  }

  // The other end of a message action: the stage it is on and its text.
  std::pair<int, Action> partner(const Action& a, int stage) const {
    const int v = virtual_stage(stage, a.chunk);
    const bool to_next =
        a.kind == ActionKind::send_activation || a.kind == ActionKind::recv_gradient;
    const int other = to_next ? v + 1 : v - 1;
    ActionKind kind = ActionKind::recv_activation;
    if (a.kind == ActionKind::recv_activation) kind = ActionKind::send_activation;
    if (a.kind == ActionKind::send_gradient) kind = ActionKind::recv_gradient;
    if (a.kind == ActionKind::recv_gradient) kind = ActionKind::send_gradient;
    return {other % stages_, Action{kind, a.micro_batch, other / stages_}};
  }

  std::string partner_text(int stage, size_t index) const {
    const auto [other, action] = partner(s_.stages[size_t(stage)][index], stage);
    return cat(to_string(action), " on stage ", other);
  }

  void check_stage(int stage) {
    const std::vector<Action>& actions = s_.stages[size_t(stage)];
    // Per (micro-batch, chunk), flat: a map here took most of a large plan's time.
    std::vector<MicroBatchTrack> track(size_t(s_.micro_batches) * size_t(s_.chunks));
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
      MicroBatchTrack& t = track[size_t(a.micro_batch) * size_t(s_.chunks) + size_t(a.chunk)];
      const bool backwarded = t.backward > 0 || t.backward_input > 0;
      switch (a.kind) {
        case ActionKind::forward:
          if (!first && !t.activation_received)
            problem(cat(where(stage, i), ": forward before its activation is received",
                        missing(ActionKind::recv_activation, a)));
          ++t.forward;
          break;
        case ActionKind::backward:
        case ActionKind::backward_input:
          if (t.forward == 0)
            problem(cat(where(stage, i), ": backward before its forward",
                        missing(ActionKind::forward, a)));
          if (!last && !t.gradient_received)
            problem(cat(where(stage, i), ": backward before its gradient is received",
                        missing(ActionKind::recv_gradient, a)));
          ++(a.kind == ActionKind::backward ? t.backward : t.backward_input);
          backward_after_sync = backward_after_sync || syncs > 0;
          break;
        case ActionKind::backward_weight:
          if (t.backward_input == 0)
            problem(cat(where(stage, i), ": weight gradient before the input gradient",
                        missing(ActionKind::backward_input, a)));
          ++t.backward_weight;
          backward_after_sync = backward_after_sync || syncs > 0;
          break;
        case ActionKind::send_activation:
          if (last) problem(cat(where(stage, i), ": the last virtual stage sends no activation"));
          if (t.forward == 0)
            problem(
                cat(where(stage, i), ": sent before its forward", missing(ActionKind::forward, a)));
          if (!last) sent_[message_(false, a.micro_batch, v + 1)].add(stage, i);
          break;
        case ActionKind::recv_activation:
          if (first)
            problem(cat(where(stage, i), ": the first virtual stage receives no activation"));
          t.activation_received = true;
          if (!first) received_[message_(false, a.micro_batch, v)].add(stage, i);
          break;
        case ActionKind::send_gradient:
          if (first) problem(cat(where(stage, i), ": the first virtual stage sends no gradient"));
          if (!backwarded)
            problem(cat(where(stage, i), ": sent before its backward (no ",
                        to_string(Action{ActionKind::backward, a.micro_batch, a.chunk}), " or ",
                        to_string(Action{ActionKind::backward_input, a.micro_batch, a.chunk}),
                        " before it)"));
          if (!first) sent_[message_(true, a.micro_batch, v - 1)].add(stage, i);
          break;
        case ActionKind::recv_gradient:
          if (last) problem(cat(where(stage, i), ": the last virtual stage receives no gradient"));
          t.gradient_received = true;
          if (!last) received_[message_(true, a.micro_batch, v)].add(stage, i);
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
        const MicroBatchTrack& t = track[size_t(m) * size_t(s_.chunks) + size_t(c)];
        const std::string what = cat("stage ", stage, " micro-batch ", m, " chunk ", c, ": ");
        if (t.forward != 1) problem(cat(what, "forwarded ", t.forward, " times, not once"));
        const bool whole = t.backward == 1 && t.backward_input == 0 && t.backward_weight == 0;
        const bool split = t.backward == 0 && t.backward_input == 1 && t.backward_weight == 1;
        if (!whole && !split)
          problem(cat(what, "backward ", t.backward, " times, input half ", t.backward_input,
                      ", weight half ", t.backward_weight, "; not once (B, or I then W)"));
      }
  }

  // Each stage's count in flight against its limit: the first action above it.
  void check_limits() {
    const std::vector<int>& limit = limits_.max_in_flight;
    if (limit.empty()) return;
    if (limit.size() != 1 && int(limit.size()) != stages_) {
      problem(cat("the limits name ", limit.size(), " stages; give 1 (every stage) or ", stages_));
      return;
    }
    for (int stage = 0; stage < stages_; ++stage) {
      const int most = limit.size() == 1 ? limit[0] : limit[size_t(stage)];
      if (most <= 0) continue;
      const std::vector<Action>& actions = s_.stages[size_t(stage)];
      int in_flight = 0;
      for (size_t i = 0; i < actions.size(); ++i) {
        in_flight += in_flight_change(actions[i].kind, limits_.until);
        if (in_flight > most) {
          problem(cat(where(stage, i), ": ", in_flight,
                      " micro-batches in flight, above the limit of ", most));
          break;
        }
      }
    }
  }

  void check_messages() {
    for (size_t message = 0; message < sent_.size(); ++message) {
      const Ends& senders = sent_[message];
      if (senders.count == 0) continue;
      const int receivers = received_[message].count;
      const int stage = senders.stage;
      const size_t index = senders.index;
      if (senders.count != 1 || receivers != 1)
        problem(cat(where(stage, index), ": sent ", senders.count, " times, received ", receivers,
                    " times; each message is sent and received once (by ",
                    partner_text(stage, index), ")"));
    }
    for (size_t message = 0; message < received_.size(); ++message)
      if (received_[message].count > 0 && sent_[message].count == 0) {
        const int stage = received_[message].stage;
        const size_t index = received_[message].index;
        problem(
            cat(where(stage, index), ": nothing sends it (no ", partner_text(stage, index), ")"));
      }
  }

  // Runs the lists together, sends never blocking and receives waiting for
  // their send: every list must reach its end.
  void check_deadlock() {
    std::vector<size_t> next(size_t(stages_), 0);
    std::vector<char> delivered(message_.count(), 0);
    for (bool progress = true; progress;) {
      progress = false;
      for (int stage = 0; stage < stages_; ++stage) {
        const std::vector<Action>& actions = s_.stages[size_t(stage)];
        for (size_t& i = next[size_t(stage)]; i < actions.size(); ++i, progress = true) {
          const Action& a = actions[i];
          const int v = virtual_stage(stage, a.chunk);
          if (a.kind == ActionKind::recv_activation &&
              !delivered[message_(false, a.micro_batch, v)])
            break;
          if (a.kind == ActionKind::recv_gradient && !delivered[message_(true, a.micro_batch, v)])
            break;
          if (a.kind == ActionKind::send_activation)
            delivered[message_(false, a.micro_batch, v + 1)] = 1;
          if (a.kind == ActionKind::send_gradient)
            delivered[message_(true, a.micro_batch, v - 1)] = 1;
        }
      }
    }
    for (int stage = 0; stage < stages_; ++stage) {
      const size_t i = next[size_t(stage)];
      if (i == s_.stages[size_t(stage)].size()) continue;
      // Its sender is blocked before reaching the send: name where it waits.
      const int sender = partner(s_.stages[size_t(stage)][i], stage).first;
      problem(cat(where(stage, i),
                  ": waits for a message no stage can send (the lists deadlock): its sender ",
                  partner_text(stage, i), " comes after that stage's own wait at ",
                  where(sender, next[size_t(sender)])));
    }
  }

  const Schedule& s_;
  const ScheduleLimits& limits_;
  const int stages_, virtual_stages_;
  const MessageIndex message_;
  // How often each message is sent and received, and where first: (stage,
  // action index), by MessageIndex.
  struct Ends {
    int count = 0;
    int stage = 0;
    size_t index = 0;
    void add(int at_stage, size_t at_index) {
      if (count++ == 0) stage = at_stage, index = at_index;
    }
  };
  std::vector<Ends> sent_, received_;
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
    for (const Action& a : schedule.stages[stage]) {
      out += ' ';
      out += to_string(a);
    }
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

namespace {

// A stage's compute actions (F, B, I, W) in the order it runs them.
using ComputeOrder = std::vector<Action>;

void require_shape(const std::string& name, int stages, int micro_batches, int chunks) {
  if (stages < 1 || micro_batches < 1 || chunks < 1)
    throw Error(cat("schedule '", name, "': ", stages, " stages, ", micro_batches,
                    " micro-batches, ", chunks, " chunks per stage; each must be at least 1"));
  const int64_t passes = int64_t(stages) * micro_batches * chunks;
  if (passes > kMaxSchedulePasses)
    throw Error(cat("schedule '", name, "': ", stages, " stages x ", micro_batches,
                    " micro-batches x ", chunks, " chunks = ", passes,
                    " forward passes per step, more than the ", kMaxSchedulePasses,
                    " a schedule is built for; use fewer micro-batches (a larger micro-batch) or "
                    "fewer stages"));
}

// The table of a schedule whose stage s computes order(s): each compute
// action gets its messages (recvA before F and sendA right after it, recvG
// before B or I and sendG right after it, wherever the neighbouring virtual
// stage exists), and every list ends with the gradient sync and the step.
Schedule make_table(std::string name, int stages, int micro_batches, int chunks,
                    const std::function<ComputeOrder(int stage)>& order) {
  Schedule schedule{
      .name = std::move(name), .micro_batches = micro_batches, .chunks = chunks, .stages = {}};
  const int virtual_stages = stages * chunks;
  for (int stage = 0; stage < stages; ++stage) {
    std::vector<Action>& actions = schedule.stages.emplace_back();
    for (const Action& a : order(stage)) {
      const int v = a.chunk * stages + stage;
      const bool first = v == 0, last = v == virtual_stages - 1;
      const bool backward = a.kind == ActionKind::backward || a.kind == ActionKind::backward_input;
      if (a.kind == ActionKind::forward && !first)
        actions.push_back({ActionKind::recv_activation, a.micro_batch, a.chunk});
      if (backward && !last) actions.push_back({ActionKind::recv_gradient, a.micro_batch, a.chunk});
      actions.push_back(a);
      if (a.kind == ActionKind::forward && !last)
        actions.push_back({ActionKind::send_activation, a.micro_batch, a.chunk});
      if (backward && !first)
        actions.push_back({ActionKind::send_gradient, a.micro_batch, a.chunk});
    }
    actions.push_back({ActionKind::grad_sync});
    actions.push_back({ActionKind::optimizer_step});
  }
  return schedule;
}

Action compute(ActionKind kind, int micro_batch, int chunk = 0) {
  return Action{kind, micro_batch, chunk};
}

}  // namespace

Schedule gpipe_schedule(int stages, int micro_batches) {
  require_shape("gpipe", stages, micro_batches, 1);
  return make_table("gpipe", stages, micro_batches, 1, [&](int) {
    ComputeOrder order;
    for (int m = 0; m < micro_batches; ++m) order.push_back(compute(ActionKind::forward, m));
    for (int m = 0; m < micro_batches; ++m) order.push_back(compute(ActionKind::backward, m));
    return order;
  });
}

Schedule one_f_one_b_schedule(int stages, int micro_batches) {
  require_shape("1f1b", stages, micro_batches, 1);
  return make_table("1f1b", stages, micro_batches, 1, [&](int stage) {
    // Warm-up forwards fill the pipeline below this stage; then each forward
    // is followed by the oldest backward, so at most warm_up + 1 are in flight.
    const int warm_up = std::min(stages - stage - 1, micro_batches);
    ComputeOrder order;
    for (int m = 0; m < warm_up; ++m) order.push_back(compute(ActionKind::forward, m));
    for (int m = 0; m + warm_up < micro_batches; ++m) {
      order.push_back(compute(ActionKind::forward, m + warm_up));
      order.push_back(compute(ActionKind::backward, m));
    }
    for (int m = micro_batches - warm_up; m < micro_batches; ++m)
      order.push_back(compute(ActionKind::backward, m));
    return order;
  });
}

Schedule interleaved_schedule(int stages, int micro_batches, int chunks) {
  require_shape("interleaved", stages, micro_batches, chunks);
  if (micro_batches % stages != 0)
    throw Error(cat("schedule 'interleaved': ", micro_batches,
                    " micro-batches are not a multiple of the ", stages,
                    " stages; choose a multiple (micro-batches run in groups of one per stage)"));
  // The k-th forward of a stage (k = 0 .. M*V-1) walks the chunks in groups
  // of P micro-batches: group g = k / (P*V), chunk (k / P) % V, micro-batch
  // g*P + k % P. Backwards walk the same way with the chunks reversed, so
  // each chunk's backwards are in micro-batch order.
  const int per_stage = micro_batches * chunks;
  auto micro_batch_of = [=](int k) { return k / (stages * chunks) * stages + k % stages; };
  auto forward_k = [=](int k) {
    return compute(ActionKind::forward, micro_batch_of(k), k / stages % chunks);
  };
  auto backward_k = [=](int k) {
    return compute(ActionKind::backward, micro_batch_of(k), chunks - 1 - k / stages % chunks);
  };
  return make_table("interleaved", stages, micro_batches, chunks, [&](int stage) {
    // Megatron-LM's warm-up: the forwards of every chunk but the last for
    // one group, and two per later stage, so the first backward's gradient
    // has arrived when the warm-up ends.
    const int warm_up = std::min(2 * (stages - stage - 1) + (chunks - 1) * stages, per_stage);
    ComputeOrder order;
    for (int k = 0; k < warm_up; ++k) order.push_back(forward_k(k));
    for (int k = 0; k + warm_up < per_stage; ++k) {
      order.push_back(forward_k(k + warm_up));
      order.push_back(backward_k(k));
    }
    for (int k = per_stage - warm_up; k < per_stage; ++k) order.push_back(backward_k(k));
    return order;
  });
}

Schedule zero_bubble_h1_schedule(int stages, int micro_batches) {
  require_shape("zbh1", stages, micro_batches, 1);
  return make_table("zbh1", stages, micro_batches, 1, [&](int stage) {
    // 1F1B's forwards and input halves, in 1F1B's order (so as many
    // activations in flight). The weight halves run in micro-batch order:
    // in the steady phase one after each input half once `stage` of them are
    // held back, in the cool-down one after each input half, then the rest.
    // The held-back W fill the time 1F1B spends waiting for gradients.
    const int warm_up = std::min(stages - stage - 1, micro_batches);
    ComputeOrder order;
    int next_weight = 0;
    for (int m = 0; m < warm_up; ++m) order.push_back(compute(ActionKind::forward, m));
    for (int m = 0; m + warm_up < micro_batches; ++m) {
      order.push_back(compute(ActionKind::forward, m + warm_up));
      order.push_back(compute(ActionKind::backward_input, m));
      if (m >= stage) order.push_back(compute(ActionKind::backward_weight, next_weight++));
    }
    for (int m = micro_batches - warm_up; m < micro_batches; ++m) {
      order.push_back(compute(ActionKind::backward_input, m));
      order.push_back(compute(ActionKind::backward_weight, next_weight++));
    }
    while (next_weight < micro_batches)
      order.push_back(compute(ActionKind::backward_weight, next_weight++));
    return order;
  });
}

Schedule wavefront_schedule(int stages, int micro_batches) {
  require_shape("wavefront", stages, micro_batches, 1);
  return make_table("wavefront", stages, micro_batches, 1, [&](int) {
    ComputeOrder order;
    for (int m = 0; m < micro_batches; ++m) order.push_back(compute(ActionKind::forward, m));
    for (int m = micro_batches - 1; m >= 0; --m) order.push_back(compute(ActionKind::backward, m));
    return order;
  });
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe", "1f1b", "interleaved", "zbh1",
                                                 "wavefront"};
  return names;
}

Schedule make_schedule(const std::string& name, int stages, int micro_batches, int chunks) {
  const std::vector<std::string>& names = schedule_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string known;
    for (const std::string& n : names) known += (known.empty() ? "" : ", ") + n;
    throw Error(cat("unknown pipeline schedule '", name, "'; the schedules are ", known));
  }
  if (name != "interleaved" && chunks != 1)
    throw Error(cat("schedule '", name, "' runs one chunk per stage, not ", chunks,
                    "; model chunks are for the interleaved schedule"));
  require_shape(name, stages, micro_batches, chunks);
  if (stages == 1) return one_stage_schedule(micro_batches);
  if (name == "gpipe") return gpipe_schedule(stages, micro_batches);
  if (name == "1f1b") return one_f_one_b_schedule(stages, micro_batches);
  if (name == "interleaved") return interleaved_schedule(stages, micro_batches, chunks);
  if (name == "wavefront") return wavefront_schedule(stages, micro_batches);
  return zero_bubble_h1_schedule(stages, micro_batches);
}

std::vector<std::string> schedule_problems(const Schedule& schedule) {
  return Checker(schedule, ScheduleLimits{}).run();
}

std::vector<std::string> schedule_problems(const Schedule& schedule, const ScheduleLimits& limits) {
  return Checker(schedule, limits).run();
}

std::vector<int> peak_in_flight(const Schedule& schedule, InFlightUntil until) {
  std::vector<int> peaks;
  for (const std::vector<Action>& actions : schedule.stages) {
    int in_flight = 0, peak = 0;
    for (const Action& a : actions) {
      in_flight += in_flight_change(a.kind, until);
      peak = std::max(peak, in_flight);
    }
    peaks.push_back(peak);
  }
  return peaks;
}

void check_schedule(const Schedule& schedule) {
  std::vector<std::string> problems = schedule_problems(schedule);
  std::string lines;
  for (const std::string& p : problems) lines += "\n  " + p;
  CHECK(problems.empty()) << "schedule '" << schedule.name << "' cannot run:" << lines << "\n"
                          << to_string(schedule);
}

}  // namespace trainer::parallel
