// Pipeline schedules: the generators (GPipe, 1F1B, interleaved, ZB-H1), the
// static check with its in-flight limits, the simulator against the
// published step times, the swimlane and the Chrome trace, and `trainer plan`.
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "parallel/pipeline_sim.h"
#include "parallel/schedule.h"
#include "tests/process.h"

using namespace trainer;
using namespace trainer::parallel;
using trainer::testing::joined;
using trainer::testing::mentions;

namespace {

bool is_backward(ActionKind kind) {
  return kind == ActionKind::backward || kind == ActionKind::backward_input;
}

// Every (name, P, M, V) the generators are tested over.
struct TableShape {
  std::string name;
  int stages, micro_batches, chunks;
};
std::vector<TableShape> all_shapes() {
  std::vector<TableShape> shapes;
  for (int p : {1, 2, 3, 4, 8})
    for (int m = 1; m <= 12; ++m) {
      shapes.push_back({"gpipe", p, m, 1});
      shapes.push_back({"1f1b", p, m, 1});
      shapes.push_back({"zbh1", p, m, 1});
      if (m % p == 0)
        for (int v : {1, 2, 3}) shapes.push_back({"interleaved", p, m, v});
    }
  return shapes;
}

Schedule generate(const TableShape& shape) {
  if (shape.name == "gpipe") return gpipe_schedule(shape.stages, shape.micro_batches);
  if (shape.name == "1f1b") return one_f_one_b_schedule(shape.stages, shape.micro_batches);
  if (shape.name == "zbh1") return zero_bubble_h1_schedule(shape.stages, shape.micro_batches);
  return interleaved_schedule(shape.stages, shape.micro_batches, shape.chunks);
}

// Where a stage's list breaks the generators' conventions, or "".
std::string convention_breach(const Schedule& s, int stage) {
  const std::vector<Action>& actions = s.stages[size_t(stage)];
  const int stages = int(s.stages.size()), virtual_stages = stages * s.chunks;
  const size_t n = actions.size();
  if (n < 2 || actions[n - 2].kind != ActionKind::grad_sync ||
      actions[n - 1].kind != ActionKind::optimizer_step)
    return "does not end with sync, step";
  std::map<int, int> next_backward, next_weight;  // per chunk: the micro-batch due next
  for (size_t i = 0; i < n; ++i) {
    const Action& a = actions[i];
    const int v = a.chunk * stages + stage;
    const bool first = v == 0, last = v == virtual_stages - 1;
    auto at = [&](size_t j) { return j < n ? actions[j] : Action{ActionKind::grad_sync}; };
    const std::string where = cat("action ", i, " (", to_string(a), ")");
    if (is_backward(a.kind) && next_backward[a.chunk]++ != a.micro_batch)
      return where + ": backwards of a chunk out of micro-batch order";
    if (a.kind == ActionKind::backward_weight && next_weight[a.chunk]++ != a.micro_batch)
      return where + ": weight halves out of micro-batch order";
    const Action recv_act{ActionKind::recv_activation, a.micro_batch, a.chunk};
    const Action send_act{ActionKind::send_activation, a.micro_batch, a.chunk};
    const Action recv_grad{ActionKind::recv_gradient, a.micro_batch, a.chunk};
    const Action send_grad{ActionKind::send_gradient, a.micro_batch, a.chunk};
    if (a.kind == ActionKind::forward) {
      if (!first && (i == 0 || actions[i - 1] != recv_act))
        return where + ": recvA not just before";
      if (!last && at(i + 1) != send_act) return where + ": sendA not just after";
    }
    if (is_backward(a.kind)) {
      if (!last && (i == 0 || actions[i - 1] != recv_grad))
        return where + ": recvG not just before";
      if (!first && at(i + 1) != send_grad) return where + ": sendG not just after";
    }
  }
  return "";
}

std::string compute_only(const Schedule& s, int stage) {
  std::string out;
  for (const Action& a : s.stages[size_t(stage)]) {
    if (a.kind != ActionKind::forward && !is_backward(a.kind) &&
        a.kind != ActionKind::backward_weight)
      continue;
    if (!out.empty()) out += ' ';
    out += to_string(a);
  }
  return out;
}

PipelineCosts uniform(double forward, double backward) {
  PipelineCosts costs;
  costs.forward = {forward};
  costs.backward = {backward};
  return costs;
}

}  // namespace

TEST_CASE("schedule: every generator's table checks clean for P in {1,2,3,4,8}, M in 1..12",
          "[parallel]") {
  for (const TableShape& shape : all_shapes()) {
    INFO(shape.name << " P=" << shape.stages << " M=" << shape.micro_batches
                    << " V=" << shape.chunks);
    const Schedule s = generate(shape);
    REQUIRE(int(s.stages.size()) == shape.stages);
    CHECK(s.name == shape.name);
    CHECK(s.micro_batches == shape.micro_batches);
    CHECK(s.chunks == shape.chunks);
    const std::vector<std::string> problems = schedule_problems(s);
    INFO(joined(problems) << to_string(s));
    CHECK(problems.empty());
    for (int stage = 0; stage < shape.stages; ++stage) {
      INFO("stage " << stage);
      CHECK(convention_breach(s, stage) == "");
    }
  }
}

TEST_CASE("schedule: GPipe, 1F1B, ZB-H1 and the wavefront run their actions in the published order",
          "[parallel]") {
  // GPipe: every forward, then every backward in micro-batch order.
  const Schedule gpipe = gpipe_schedule(2, 3);
  CHECK(to_string(gpipe) ==
        "stage 0: F0 sendA0 F1 sendA1 F2 sendA2 recvG0 B0 recvG1 B1 recvG2 B2 sync step\n"
        "stage 1: recvA0 F0 recvA1 F1 recvA2 F2 B0 sendG0 B1 sendG1 B2 sendG2 sync step");
  // The wavefront: GPipe's forwards, then the backwards from the last time chunk to the first.
  CHECK(to_string(wavefront_schedule(2, 3)) ==
        "stage 0: F0 sendA0 F1 sendA1 F2 sendA2 recvG2 B2 recvG1 B1 recvG0 B0 sync step\n"
        "stage 1: recvA0 F0 recvA1 F1 recvA2 F2 B2 sendG2 B1 sendG1 B0 sendG0 sync step");
  CHECK(peak_in_flight(wavefront_schedule(4, 6)) == std::vector<int>{6, 6, 6, 6});
  // 1F1B: stage s warms up with min(P-s-1, M) forwards.
  const Schedule one_f_one_b = one_f_one_b_schedule(4, 6);
  CHECK(compute_only(one_f_one_b, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  CHECK(compute_only(one_f_one_b, 1) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5");
  CHECK(compute_only(one_f_one_b, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  CHECK(compute_only(one_f_one_b_schedule(4, 2), 0) == "F0 F1 B0 B1");
  // ZB-H1: 1F1B's F and I; stage s holds back s weight halves.
  const Schedule zbh1 = zero_bubble_h1_schedule(3, 5);
  CHECK(compute_only(zbh1, 0) == "F0 F1 F2 I0 W0 F3 I1 W1 F4 I2 W2 I3 W3 I4 W4");
  CHECK(compute_only(zbh1, 1) == "F0 F1 I0 F2 I1 W0 F3 I2 W1 F4 I3 W2 I4 W3 W4");
  CHECK(compute_only(zbh1, 2) == "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 F4 I4 W2 W3 W4");
  // Interleaved: chunk 0 for a group of P micro-batches, then chunk 1, ...;
  // backwards through the chunks in reverse.
  const Schedule interleaved = interleaved_schedule(2, 4, 2);
  CHECK(compute_only(interleaved, 1) ==
        "F0 F1 F0.c1 B0.c1 F1.c1 B1.c1 F2 B0 F3 B1 F2.c1 B2.c1 F3.c1 B3.c1 B2 B3");
  // One stage: one_f_one_b is gradient accumulation.
  CHECK(to_string(one_f_one_b_schedule(1, 2)) == to_string(one_stage_schedule(2)));
}

TEST_CASE("schedule: make_schedule picks by name and rejects bad requests by name", "[parallel]") {
  CHECK(make_schedule("gpipe", 3, 4).stages == gpipe_schedule(3, 4).stages);
  CHECK(make_schedule("1f1b", 3, 4).stages == one_f_one_b_schedule(3, 4).stages);
  CHECK(make_schedule("interleaved", 2, 4, 2).stages == interleaved_schedule(2, 4, 2).stages);
  CHECK(make_schedule("zbh1", 3, 4).stages == zero_bubble_h1_schedule(3, 4).stages);
  for (const std::string& name : schedule_names())
    CHECK(make_schedule(name, 1, 3).stages == one_stage_schedule(3).stages);
  CHECK_THROWS_WITH(make_schedule("pipedream", 2, 4),
                    Catch::Contains("unknown pipeline schedule 'pipedream'") &&
                        Catch::Contains("gpipe, 1f1b, interleaved, zbh1"));
  CHECK_THROWS_WITH(make_schedule("interleaved", 4, 6, 2),
                    Catch::Contains("6 micro-batches are not a multiple of the 4 stages"));
  CHECK_THROWS_WITH(interleaved_schedule(3, 4, 2), Catch::Contains("not a multiple"));
  CHECK_THROWS_WITH(make_schedule("1f1b", 2, 4, 2),
                    Catch::Contains("model chunks are for the interleaved schedule"));
  CHECK_THROWS_WITH(gpipe_schedule(0, 4), Catch::Contains("each must be at least 1"));
  CHECK_THROWS_AS(one_f_one_b_schedule(2, 0), Error);
  CHECK_THROWS_AS(zero_bubble_h1_schedule(-1, 2), Error);
}

TEST_CASE("schedule: micro-batches in flight: GPipe M, 1F1B min(P-s, M), ZB-H1 as 1F1B",
          "[parallel]") {
  for (int p : {1, 2, 3, 4, 8})
    for (int m = 1; m <= 12; ++m) {
      INFO("P=" << p << " M=" << m);
      std::vector<int> one_f_one_b, all_m(size_t(p), m), min_p_m(size_t(p), std::min(p, m));
      for (int s = 0; s < p; ++s) one_f_one_b.push_back(std::min(p - s, m));
      CHECK(peak_in_flight(gpipe_schedule(p, m)) == all_m);
      CHECK(peak_in_flight(one_f_one_b_schedule(p, m)) == one_f_one_b);
      const Schedule zbh1 = zero_bubble_h1_schedule(p, m);
      CHECK(peak_in_flight(zbh1) == one_f_one_b);
      // Counted until the weight half, every stage holds back up to P.
      CHECK(peak_in_flight(zbh1, InFlightUntil::backward_weight) == min_p_m);
      // The limits the peaks state pass; one less on any stage fails there.
      CHECK(schedule_problems(one_f_one_b_schedule(p, m), {.max_in_flight = one_f_one_b}).empty());
      CHECK(schedule_problems(zbh1, {.max_in_flight = one_f_one_b}).empty());
    }
  // Interleaved: per (micro-batch, chunk), Megatron-LM's warm-up plus one.
  CHECK(peak_in_flight(interleaved_schedule(4, 8, 2)) == std::vector<int>{11, 9, 7, 5});
}

TEST_CASE("schedule: a stage above its in-flight limit is named with the action and count",
          "[parallel]") {
  std::vector<std::string> p = schedule_problems(gpipe_schedule(2, 4), {.max_in_flight = {2}});
  INFO(joined(p));
  // Stage 0: F0 sendA0 F1 sendA1 F2: the third forward is over.
  CHECK(mentions(p, "stage 0 action 4 (F2): 3 micro-batches in flight, above the limit of 2"));
  CHECK(mentions(p, "stage 1 action 5 (F2): 3 micro-batches in flight, above the limit of 2"));
  CHECK(p.size() == 2);
  // Per stage: 1F1B on 4 stages holds {4, 3, 2, 1}.
  p = schedule_problems(one_f_one_b_schedule(4, 8), {.max_in_flight = {4, 2, 2, 1}});
  INFO(joined(p));
  REQUIRE(p.size() == 1);
  CHECK(mentions(p, "stage 1 action "));
  CHECK(mentions(p, "(F2): 3 micro-batches in flight, above the limit of 2"));
  // ZB-H1 keeps 1F1B's limit counted until I, not until W.
  const ScheduleLimits until_w{.max_in_flight = {4, 3, 2, 1},
                               .until = InFlightUntil::backward_weight};
  p = schedule_problems(zero_bubble_h1_schedule(4, 8), until_w);
  CHECK(p.size() == 3);
  CHECK(mentions(p, "stage 3 action "));
  // 0: no limit; a list of the wrong length is a problem of its own.
  CHECK(schedule_problems(gpipe_schedule(2, 4), {.max_in_flight = {0, 4}}).empty());
  CHECK(mentions(schedule_problems(gpipe_schedule(2, 4), {.max_in_flight = {1, 2, 3}}),
                 "the limits name 3 stages; give 1 (every stage) or 2"));
}

TEST_CASE("schedule: the check names the missing partner of a broken message", "[parallel]") {
  SECTION("a receive removed") {
    Schedule s = one_f_one_b_schedule(2, 2);
    REQUIRE(to_string(s.stages[1][0]) == "recvA0");
    s.stages[1].erase(s.stages[1].begin());
    const std::vector<std::string> p = schedule_problems(s);
    INFO(joined(p));
    CHECK(mentions(p,
                   "stage 1 action 0 (F0): forward before its activation is received "
                   "(no recvA0 before it)"));
    CHECK(mentions(p,
                   "stage 0 action 1 (sendA0): sent 1 times, received 0 times; each message "
                   "is sent and received once (by recvA0 on stage 1)"));
  }
  SECTION("a send removed") {
    Schedule s = one_f_one_b_schedule(2, 2);
    REQUIRE(to_string(s.stages[1][3]) == "sendG0");
    s.stages[1].erase(s.stages[1].begin() + 3);
    const std::vector<std::string> p = schedule_problems(s);
    INFO(joined(p));
    CHECK(mentions(p, "stage 0 action 4 (recvG0): nothing sends it (no sendG0 on stage 1)"));
  }
  SECTION("interleaved: chunk 1 of stage 0 receives from chunk 0 of the last stage") {
    Schedule s = interleaved_schedule(2, 2, 2);
    auto& actions = s.stages[0];
    const auto it =
        std::find(actions.begin(), actions.end(), Action{ActionKind::recv_activation, 1, 1});
    REQUIRE(it != actions.end());
    actions.erase(it);
    const std::vector<std::string> p = schedule_problems(s);
    INFO(joined(p));
    CHECK(mentions(p, "(F1.c1): forward before its activation is received (no recvA1.c1 before"));
    CHECK(mentions(p,
                   "(sendA1): sent 1 times, received 0 times; each message is sent and "
                   "received once (by recvA1.c1 on stage 0)"));
  }
  SECTION("a deadlock names the sender and where it waits") {
    Schedule s = one_f_one_b_schedule(2, 2);
    // Stage 0 waits for micro-batch 1's gradient before sending its activation.
    s.stages[0] = {{ActionKind::forward, 0},         {ActionKind::send_activation, 0},
                   {ActionKind::forward, 1},         {ActionKind::recv_gradient, 1},
                   {ActionKind::send_activation, 1}, {ActionKind::recv_gradient, 0},
                   {ActionKind::backward, 0},        {ActionKind::backward, 1},
                   {ActionKind::grad_sync},          {ActionKind::optimizer_step}};
    const std::vector<std::string> p = schedule_problems(s);
    INFO(joined(p));
    CHECK(mentions(p,
                   "stage 0 action 3 (recvG1): waits for a message no stage can send (the "
                   "lists deadlock): its sender sendG1 on stage 1 comes after that stage's "
                   "own wait at stage 1 action 4 (recvA1)"));
  }
}

TEST_CASE("pipeline sim: GPipe and 1F1B take (M + P - 1)(t_f + t_b), busy M / (M + P - 1)",
          "[parallel]") {
  for (const auto& [t_f, t_b] : {std::pair{1.0, 2.0}, std::pair{0.75, 1.25}})
    for (int p : {1, 2, 3, 4, 8})
      for (int m = 1; m <= 12; ++m)
        for (const char* name : {"gpipe", "1f1b", "wavefront"}) {
          INFO(name << " P=" << p << " M=" << m << " t_f=" << t_f << " t_b=" << t_b);
          const Schedule s = make_schedule(name, p, m);
          const SimResult r = simulate(s, uniform(t_f, t_b));
          CHECK(r.step_time == (m + p - 1) * (t_f + t_b));
          CHECK(r.ideal_time == m * (t_f + t_b));
          for (double busy : r.busy) CHECK(busy == Approx(double(m) / (m + p - 1)));
          CHECK(r.bubble_fraction() == Approx(double(p - 1) / (m + p - 1)).margin(1e-12));
          CHECK(r.bubble_over_ideal() == Approx(double(p - 1) / m).margin(1e-12));
          CHECK(r.peak_in_flight == peak_in_flight(s));
        }
}

TEST_CASE("pipeline sim: interleaved 1F1B shrinks the bubble to (P - 1) / (V M)", "[parallel]") {
  const double t_f = 1.0, t_b = 2.0;
  for (int p : {2, 3, 4, 8})
    for (int v : {1, 2, 3, 4})
      for (int m = p; m <= 24; m += p) {
        INFO("P=" << p << " V=" << v << " M=" << m);
        const SimResult r = simulate(interleaved_schedule(p, m, v), uniform(t_f / v, t_b / v));
        CHECK(r.step_time == Approx((m + double(p - 1) / v) * (t_f + t_b)));
        CHECK(r.bubble_over_ideal() == Approx(double(p - 1) / (v * m)));
      }
}

TEST_CASE("pipeline sim: ZB-H1 takes M(t_f + t_i + t_w) + (P - 1)(t_f + t_i - t_w)", "[parallel]") {
  struct Costs {
    double t_f, t_i, t_w;
  };
  for (const Costs c : {Costs{1, 1, 1}, Costs{1, 1, 0.5}, Costs{1, 1.5, 0.8}, Costs{2, 1, 1}})
    for (int p : {1, 2, 3, 4, 8})
      for (int m = p; m <= 12; ++m) {
        INFO("P=" << p << " M=" << m << " t_f=" << c.t_f << " t_i=" << c.t_i << " t_w=" << c.t_w);
        PipelineCosts costs = uniform(c.t_f, c.t_i + c.t_w);
        costs.backward_input_fraction = c.t_i / (c.t_i + c.t_w);
        costs.backward_weight_fraction = c.t_w / (c.t_i + c.t_w);
        const SimResult zbh1 = simulate(zero_bubble_h1_schedule(p, m), costs);
        const double work = m * (c.t_f + c.t_i + c.t_w);
        CHECK(zbh1.step_time == Approx(work + (p - 1) * (c.t_f + c.t_i - c.t_w)));
        // 1F1B's bubble is (P - 1)(t_f + t_i + t_w): a third of it with equal costs.
        const SimResult one_f_one_b = simulate(one_f_one_b_schedule(p, m), costs);
        CHECK(one_f_one_b.step_time == Approx(work + (p - 1) * (c.t_f + c.t_i + c.t_w)));
      }
  // Fewer micro-batches than stages: still never slower than 1F1B.
  for (int p : {2, 4, 8})
    for (int m = 1; m < p; ++m) {
      INFO("P=" << p << " M=" << m);
      CHECK(simulate(zero_bubble_h1_schedule(p, m), uniform(1, 2)).step_time <
            simulate(one_f_one_b_schedule(p, m), uniform(1, 2)).step_time);
    }
}

TEST_CASE("pipeline sim: latency, unequal stages, sync and step costs, bad costs", "[parallel]") {
  // Two stages, one micro-batch: F0, latency, F0, B0, latency, B0.
  PipelineCosts costs = uniform(1, 2);
  costs.latency = 0.5;
  SimResult r = simulate(one_f_one_b_schedule(2, 1), costs);
  CHECK(r.step_time == 7.0);
  // The receive's end is when its data arrived.
  const Schedule s = one_f_one_b_schedule(2, 1);
  REQUIRE(to_string(s.stages[1][0]) == "recvA0");
  CHECK(r.times[1][0].start == 0.0);
  CHECK(r.times[1][0].end == 1.5);
  // The slowest stage sets the pace: 1F1B in steady state runs at its speed.
  costs = uniform(1, 2);
  costs.forward = {1, 2};
  costs.backward = {2, 4};
  r = simulate(one_f_one_b_schedule(2, 8), costs);
  CHECK(r.ideal_time == 48.0);
  CHECK(r.step_time == 51.0);
  CHECK(r.busy[1] == Approx(48.0 / 51.0));
  // Sync and step are compute time on every stage.
  costs = uniform(1, 2);
  costs.grad_sync = 1;
  costs.optimizer_step = 0.5;
  CHECK(simulate(gpipe_schedule(2, 2), costs).step_time == 10.5);
  costs = uniform(1, 2);
  costs.forward = {1, 1, 1};
  CHECK_THROWS_WITH(simulate(gpipe_schedule(2, 2), costs),
                    Catch::Contains("3 values for 2 stages; give 1 (every stage) or 2"));
  costs.forward = {-1};
  CHECK_THROWS_WITH(simulate(gpipe_schedule(2, 2), costs), Catch::Contains("is not a time"));
}

TEST_CASE("pipeline sim: the swimlane draws one cell per unit, '.' where a stage idles",
          "[parallel]") {
  const Schedule s = one_f_one_b_schedule(2, 2);
  const SimResult r = simulate(s, uniform(1, 2));
  CHECK(swimlane_text(s, r, 1.0) ==
        "stage 0 | F0 F1 .  .  B0 B0 .  B1 B1 | busy 66.7%\n"
        "stage 1 | .  F0 B0 B0 F1 B1 B1 .  .  | busy 66.7%\n");
  // Coarser cells show what covers most of each, if it covers half.
  CHECK(swimlane_text(s, r, 2.0) ==
        "stage 0 | F0 .  B0 B1 B1 | busy 66.7%\n"
        "stage 1 | F0 B0 F1 B1 .  | busy 66.7%\n");
  // Split backwards and chunks.
  const Schedule zbh1 = zero_bubble_h1_schedule(2, 2);
  CHECK(swimlane_text(zbh1, simulate(zbh1, uniform(1, 2)), 1.0) ==
        "stage 0 | F0 F1 .  I0 W0 I1 W1 | busy 85.7%\n"
        "stage 1 | .  F0 I0 F1 I1 W0 W1 | busy 85.7%\n");
  const Schedule interleaved = interleaved_schedule(2, 2, 2);
  const std::string lanes = swimlane_text(interleaved, simulate(interleaved, uniform(1, 2)), 1.0);
  CHECK(lanes.find("F0.1") != std::string::npos);
  CHECK(lanes.find("B1.1") != std::string::npos);
}

TEST_CASE("pipeline sim: the Chrome trace has one thread per stage and an event per action",
          "[parallel]") {
  const Schedule s = zero_bubble_h1_schedule(3, 4);
  PipelineCosts costs = uniform(1.5, 3);
  costs.optimizer_step = 0.25;
  const SimResult r = simulate(s, costs);
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(s, r));
  REQUIRE(trace.contains("traceEvents"));
  std::map<int, int> compute_events, thread_names;
  int steps = 0;
  for (const nlohmann::json& event : trace["traceEvents"]) {
    CHECK(event["pid"] == 0);
    const int tid = event["tid"].get<int>();
    if (event["ph"] == "M") {
      if (event["name"] == "thread_name") {
        ++thread_names[tid];
        CHECK(event["args"]["name"] == cat("stage ", tid));
      }
      continue;
    }
    REQUIRE(event["ph"] == "X");
    if (event["name"] == "step") {
      ++steps;
      CHECK(event["dur"].get<double>() == 250.0);
      continue;
    }
    ++compute_events[tid];
    const int micro_batch = event["args"]["micro_batch"].get<int>();
    const std::string name = event["name"].get<std::string>();
    CHECK(name.substr(1) == std::to_string(micro_batch));
    CHECK(std::string("FIW").find(name[0]) != std::string::npos);
    CHECK(event["dur"].get<double>() == 1500.0);  // F 1.5 ms; I and W each half of B = 3 ms
    CHECK(event["args"]["chunk"] == 0);
  }
  CHECK(steps == 3);
  for (int stage = 0; stage < 3; ++stage) {
    CHECK(thread_names[stage] == 1);
    CHECK(compute_events[stage] == 12);  // F, I and W of 4 micro-batches
  }
  // Times are the simulation's, in microseconds.
  const nlohmann::json& first_forward = trace["traceEvents"][2];
  CHECK(first_forward["name"] == "F0");
  CHECK(first_forward["ts"].get<double>() == 0.0);
}

TEST_CASE("trainer plan: prints the schedule, its swimlane and figures, bad requests exit 1",
          "[parallel]") {
  using testing::run_trainer;
  const std::filesystem::path dir = testing::temp_path("plan");
  std::filesystem::create_directories(dir);
  const std::string recipe = (dir / "pipeline.yaml").string();
  {
    std::ofstream out(recipe);
    out << "model:\n  name: mlp\nparallel:\n  pp: 2\n  micro_batches: 4\n  schedule: gpipe\n";
  }
  SECTION("flags") {
    const std::string trace = (dir / "plan.json").string();
    testing::ProcessResult r = run_trainer({"plan", recipe, "--pp", "4", "--micro-batches", "8",
                                            "--schedule", "1f1b", "--trace", trace});
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("schedule 1f1b: P=4 stages, M=8 micro-batches, V=1 chunks per stage\n") ==
          0);
    CHECK(r.output.find("stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 F6 B3 "
                        "B3 F7 B4 B4 .  B5 B5 .  B6 B6 .  B7 B7 | busy 72.7%\n") !=
          std::string::npos);
    CHECK(r.output.find("step time 33 ms (without bubble 24 ms)") != std::string::npos);
    CHECK(r.output.find("bubble 27.3% of the stages' time (37.5% over the time without bubble)") !=
          std::string::npos);
    CHECK(r.output.find("0      72.7%   4\n") != std::string::npos);
    CHECK(r.output.find("3      72.7%   1\n") != std::string::npos);
    std::ifstream in(trace);
    REQUIRE(in.good());
    const nlohmann::json events = nlohmann::json::parse(in)["traceEvents"];
    CHECK(events.size() == 1 + 4 + 4 * 16);  // process, 4 threads, 8 F and 8 B per stage
  }
  SECTION("the recipe's parallel section gives the defaults") {
    testing::ProcessResult r = run_trainer({"plan", recipe});
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("schedule gpipe: P=2 stages, M=4 micro-batches, V=1") == 0);
    CHECK(r.output.find("step time 15 ms") != std::string::npos);
    r = run_trainer({"plan", recipe, "parallel.micro_batches=2", "--schedule", "zbh1"});
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("schedule zbh1: P=2 stages, M=2 micro-batches") == 0);
    CHECK(r.output.find("peak in flight  (until W)") != std::string::npos);
    r = run_trainer({"plan", recipe, "--pp", "4", "--micro-batches", "8", "--schedule",
                     "interleaved", "--fwd-ms", "2", "--bwd-ms", "4,4,4,4"});
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("schedule interleaved: P=4 stages, M=8 micro-batches, V=2") == 0);
    CHECK(r.output.find("step time 57 ms") != std::string::npos);  // (8 + 3/2) * 6
  }
  SECTION("errors") {
    testing::ProcessResult r = run_trainer({"plan", recipe, "--schedule", "pipedream"});
    CHECK(r.code == 1);
    CHECK(r.output.find("error: unknown pipeline schedule 'pipedream'; the schedules are gpipe, "
                        "1f1b, interleaved, zbh1") != std::string::npos);
    r = run_trainer(
        {"plan", recipe, "--pp", "4", "--micro-batches", "6", "--schedule", "interleaved"});
    CHECK(r.code == 1);
    CHECK(r.output.find("error: schedule 'interleaved': 6 micro-batches are not a multiple of "
                        "the 4 stages") != std::string::npos);
    r = run_trainer({"plan", recipe, "--pp", "4", "--fwd-ms", "1,2,3"});
    CHECK(r.code == 1);
    CHECK(r.output.find("error: --fwd-ms has 3 values for 4 stages; give 1 (every stage) or 4") !=
          std::string::npos);
    r = run_trainer({"plan", recipe, "--bwd-ms", "-2"});
    CHECK(r.code == 1);
    CHECK(r.output.find("error: --bwd-ms: '-2' is not a finite number in [0, 8.64e+07]") !=
          std::string::npos);
    r = run_trainer({"plan", (dir / "missing.yaml").string()});
    CHECK(r.code == 1);
    CHECK(r.output.find("error: ") != std::string::npos);
  }
}
