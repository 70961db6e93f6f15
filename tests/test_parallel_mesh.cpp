// The mesh and the step's action tables: the (dp, pp, tp) coordinate maths
// over many shapes; the mesh's communicators over 4 ranks (tests/dp_worker.cpp
// under `trainer launch`: members and closed-form allreduce sums per
// dimension); the one-stage schedule and what check_schedule finds wrong in
// hand-made tables.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "parallel/mesh.h"
#include "parallel/schedule.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::parallel;
using trainer::testing::joined;
using trainer::testing::mentions;

namespace {

Action F(int m, int chunk = 0) { return {ActionKind::forward, m, chunk}; }
Action B(int m, int chunk = 0) { return {ActionKind::backward, m, chunk}; }
Action I(int m) { return {ActionKind::backward_input, m}; }
Action W(int m) { return {ActionKind::backward_weight, m}; }
Action send_act(int m) { return {ActionKind::send_activation, m}; }
Action recv_act(int m) { return {ActionKind::recv_activation, m}; }
Action send_grad(int m) { return {ActionKind::send_gradient, m}; }
Action recv_grad(int m) { return {ActionKind::recv_gradient, m}; }
const Action kSync{ActionKind::grad_sync};
const Action kStep{ActionKind::optimizer_step};

// GPipe on two stages, two micro-batches: every forward, then every backward.
Schedule gpipe_two_stages() {
  Schedule s{.name = "gpipe", .micro_batches = 2, .chunks = 1, .stages = {}};
  s.stages.push_back(
      {F(0), send_act(0), F(1), send_act(1), recv_grad(1), B(1), recv_grad(0), B(0), kSync, kStep});
  s.stages.push_back(
      {recv_act(0), F(0), recv_act(1), F(1), B(1), send_grad(1), B(0), send_grad(0), kSync, kStep});
  return s;
}

}  // namespace

TEST_CASE("mesh: coordinates and ranks round-trip, tp innermost, for many shapes", "[parallel]") {
  for (int dp : {1, 2, 3, 4})
    for (int pp : {1, 2, 3})
      for (int tp : {1, 2, 4}) {
        const MeshShape shape{.dp = dp, .pp = pp, .tp = tp};
        INFO(to_string(shape));
        std::set<std::vector<int>> dp_groups, pp_groups, tp_groups;
        for (int rank = 0; rank < shape.size(); ++rank) {
          const MeshCoord c = mesh_coord(shape, rank);
          REQUIRE(mesh_rank(shape, c) == rank);
          // The closed form of the header: tp innermost, then pp, then dp.
          CHECK(rank == (c.dp * pp + c.pp) * tp + c.tp);
          CHECK((c.dp >= 0 && c.dp < dp && c.pp >= 0 && c.pp < pp && c.tp >= 0 && c.tp < tp));
          // A group: the ranks sharing the other two coordinates, by index.
          for (MeshDim dim : {MeshDim::dp, MeshDim::pp, MeshDim::tp}) {
            const std::vector<int> group = mesh_group(shape, rank, dim);
            const int n = dim == MeshDim::dp ? dp : dim == MeshDim::pp ? pp : tp;
            REQUIRE(int(group.size()) == n);
            for (int i = 0; i < n; ++i) {
              const MeshCoord g = mesh_coord(shape, group[size_t(i)]);
              CHECK((dim == MeshDim::dp ? g.dp : dim == MeshDim::pp ? g.pp : g.tp) == i);
              CHECK((dim == MeshDim::dp || g.dp == c.dp));
              CHECK((dim == MeshDim::pp || g.pp == c.pp));
              CHECK((dim == MeshDim::tp || g.tp == c.tp));
            }
            (dim == MeshDim::dp   ? dp_groups
             : dim == MeshDim::pp ? pp_groups
                                  : tp_groups)
                .insert(group);
          }
        }
        // The groups of a dimension partition the world.
        CHECK(int(dp_groups.size()) == pp * tp);
        CHECK(int(pp_groups.size()) == dp * tp);
        CHECK(int(tp_groups.size()) == dp * pp);
      }
}

TEST_CASE("mesh: the header's example table of dp2 x pp2 x tp2", "[parallel]") {
  const MeshShape shape{.dp = 2, .pp = 2, .tp = 2};
  const int dp[] = {0, 0, 0, 0, 1, 1, 1, 1}, pp[] = {0, 0, 1, 1, 0, 0, 1, 1},
            tp[] = {0, 1, 0, 1, 0, 1, 0, 1};
  for (int rank = 0; rank < 8; ++rank)
    CHECK(mesh_coord(shape, rank) == MeshCoord{.dp = dp[rank], .pp = pp[rank], .tp = tp[rank]});
  CHECK(mesh_group(shape, 5, MeshDim::dp) == std::vector<int>{1, 5});
  CHECK(mesh_group(shape, 5, MeshDim::pp) == std::vector<int>{5, 7});
  CHECK(mesh_group(shape, 5, MeshDim::tp) == std::vector<int>{4, 5});
  // A single process: no communicators.
  Mesh single;
  CHECK(single.shape().size() == 1);
  CHECK(single.dp_comm() == nullptr);
}

TEST_CASE("mesh: 4 ranks as dp2 x pp2, dp2 x tp2, pp2 x tp2 and dp4 split the world right",
          "[parallel][mp]") {
  for (const char* shape : {"2 2 1", "2 1 2", "1 2 2", "4 1 1"}) {
    INFO("dp pp tp = " << shape);
    std::string command = cat(TRAINER_BINARY, " launch --nproc-per-node 4 --program ",
                              DP_WORKER_BINARY, " -- mesh ", shape, " 2>&1");
    FILE* pipe = ::popen(command.c_str(), "r");
    REQUIRE(pipe != nullptr);
    std::string output;
    char buf[4096];
    while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) output.append(buf, n);
    const int status = ::pclose(pipe);
    INFO(output);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    for (int r = 0; r < 4; ++r)
      CHECK(output.find(cat("rank ", r, ": 7 checks, 0 failed")) != std::string::npos);
  }
}

TEST_CASE("schedule: gradient accumulation is F0 B0 F1 B1 ... sync step, and checks clean",
          "[parallel]") {
  CHECK(to_string(one_stage_schedule(1)) == "stage 0: F0 B0 sync step");
  CHECK(to_string(one_stage_schedule(3)) == "stage 0: F0 B0 F1 B1 F2 B2 sync step");
  for (int m : {1, 2, 5, 16}) {
    INFO(m << " micro-batches");
    CHECK(schedule_problems(one_stage_schedule(m)).empty());
  }
  CHECK(to_string(Action{ActionKind::forward, 3, 1}) == "F3.c1");
  // A two-stage GPipe table written by hand is runnable too.
  const std::vector<std::string> problems = schedule_problems(gpipe_two_stages());
  INFO(joined(problems));
  CHECK(problems.empty());
}

TEST_CASE("schedule: the static check names what makes a table unrunnable", "[parallel]") {
  auto one = [](std::vector<Action> actions, int micro_batches = 2) {
    Schedule s{.name = "bad", .micro_batches = micro_batches, .chunks = 1, .stages = {actions}};
    return schedule_problems(s);
  };
  std::vector<std::string> p;
  p = one({B(0), F(0), F(1), B(1), kSync, kStep});
  INFO(joined(p));
  CHECK(mentions(p, "stage 0 action 0 (B0): backward before its forward"));
  p = one({F(0), B(0), F(1), kSync, B(1), kStep});
  CHECK(mentions(p, "a backward after the gradient sync"));
  p = one({F(0), B(0), F(1), B(1), kStep, kSync});
  CHECK(mentions(p, "the step comes before the gradient sync"));
  CHECK(mentions(p, "the step is not last"));
  p = one({F(0), B(0), F(1), B(1), kSync});
  CHECK(mentions(p, "0 optimizer steps, not 1"));
  p = one({F(0), B(0), F(1), B(1), kStep});
  CHECK(mentions(p, "0 gradient syncs, not 1"));
  p = one({F(0), B(0), F(0), B(0), kSync, kStep});
  CHECK(mentions(p, "micro-batch 0 chunk 0: forwarded 2 times, not once"));
  CHECK(mentions(p, "micro-batch 1 chunk 0: forwarded 0 times, not once"));
  p = one({F(0), B(0), F(2), B(2), kSync, kStep});
  CHECK(mentions(p, "(F2): outside 2 micro-batches"));
  // Split backward: I then W, never W alone or both halves and B.
  CHECK(one({F(0), I(0), W(0), kSync, kStep}, 1).empty());
  p = one({F(0), W(0), I(0), kSync, kStep}, 1);
  CHECK(mentions(p, "weight gradient before the input gradient"));
  p = one({F(0), B(0), I(0), W(0), kSync, kStep}, 1);
  CHECK(mentions(p, "not once (B, or I then W)"));
  // One stage sends nothing.
  p = one({F(0), send_act(0), B(0), kSync, kStep}, 1);
  CHECK(mentions(p, "the last virtual stage sends no activation"));
  CHECK(one({}, 0).size() == 1);
}

TEST_CASE("schedule: unmatched messages, missing receives and deadlocks across stages",
          "[parallel]") {
  SECTION("a forward on stage 1 without its activation received") {
    Schedule s = gpipe_two_stages();
    s.stages[1].erase(s.stages[1].begin());  // recvA0
    std::vector<std::string> p = schedule_problems(s);
    INFO(joined(p));
    CHECK(mentions(p, "stage 1 action 0 (F0): forward before its activation is received"));
    CHECK(mentions(p, "(sendA0): sent 1 times, received 0 times"));
  }
  SECTION("a send nobody receives, a receive nobody sends") {
    Schedule s = gpipe_two_stages();
    s.stages[1].erase(s.stages[1].begin() + 7);  // sendG0
    std::vector<std::string> p = schedule_problems(s);
    INFO(joined(p));
    CHECK(mentions(p, "stage 0 action 6 (recvG0): nothing sends it"));
  }
  SECTION("both stages wait to receive before they send") {
    Schedule s = gpipe_two_stages();
    // Stage 0 waits for micro-batch 1's gradient before sending micro-batch 1's activation.
    s.stages[0] = {F(0), send_act(0),  F(1), recv_grad(1), send_act(1),
                   B(1), recv_grad(0), B(0), kSync,        kStep};
    std::vector<std::string> p = schedule_problems(s);
    INFO(joined(p));
    CHECK(mentions(p, "waits for a message no stage can send (the lists deadlock)"));
  }
}
