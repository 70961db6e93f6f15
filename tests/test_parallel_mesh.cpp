// The mesh and the step's action tables: the coordinate maths over many
// shapes; the groups of every set of the six dimensions against a closed
// form; the mesh's communicators on 4 and 8 ranks as threads of this process
// (members and closed-form allreduce sums per group); the one-stage schedule
// and what check_schedule finds wrong in hand-made tables.
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "comm/collectives.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"
#include "tests/testing.h"
#include "tests/thread_world.h"

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

// The dp x pp x tp meshes every layout of the trainer runs (dp is
// dp_replicate: the others have size 1).
MeshShape dp_pp_tp(int dp, int pp, int tp) {
  return MeshShape{{Dim::dp_replicate, dp}, {Dim::pp, pp}, {Dim::tp, tp}};
}

TEST_CASE("mesh: coordinates and ranks round-trip, tp innermost, for many shapes", "[parallel]") {
  for (int dp : {1, 2, 3, 4})
    for (int pp : {1, 2, 3})
      for (int tp : {1, 2, 4}) {
        const MeshShape shape = dp_pp_tp(dp, pp, tp);
        INFO(to_string(shape));
        std::set<std::vector<int>> dp_groups, pp_groups, tp_groups;
        for (int rank = 0; rank < shape.size(); ++rank) {
          const MeshCoord c = mesh_coord(shape, rank);
          REQUIRE(mesh_rank(shape, c) == rank);
          const int cdp = c[Dim::dp_replicate], cpp = c[Dim::pp], ctp = c[Dim::tp];
          // The closed form of the header: tp innermost, then pp, then dp.
          CHECK(rank == (cdp * pp + cpp) * tp + ctp);
          CHECK((cdp >= 0 && cdp < dp && cpp >= 0 && cpp < pp && ctp >= 0 && ctp < tp));
          // A group: the ranks sharing the other two coordinates, by index.
          for (Dim dim : {Dim::dp_replicate, Dim::pp, Dim::tp}) {
            const std::vector<int> group = mesh_group(shape, rank, dim);
            const int n = shape[dim];
            REQUIRE(int(group.size()) == n);
            for (int i = 0; i < n; ++i) {
              const MeshCoord g = mesh_coord(shape, group[size_t(i)]);
              CHECK(g[dim] == i);
              CHECK((dim == Dim::dp_replicate || g[Dim::dp_replicate] == cdp));
              CHECK((dim == Dim::pp || g[Dim::pp] == cpp));
              CHECK((dim == Dim::tp || g[Dim::tp] == ctp));
            }
            (dim == Dim::dp_replicate ? dp_groups
             : dim == Dim::pp         ? pp_groups
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
  const MeshShape shape = dp_pp_tp(2, 2, 2);
  const int dp[] = {0, 0, 0, 0, 1, 1, 1, 1}, pp[] = {0, 0, 1, 1, 0, 0, 1, 1},
            tp[] = {0, 1, 0, 1, 0, 1, 0, 1};
  for (int rank = 0; rank < 8; ++rank)
    CHECK(
        mesh_coord(shape, rank) ==
        MeshCoord().set(Dim::dp_replicate, dp[rank]).set(Dim::pp, pp[rank]).set(Dim::tp, tp[rank]));
  CHECK(mesh_group(shape, 5, kDataParallel) == std::vector<int>{1, 5});
  CHECK(mesh_group(shape, 5, Dim::pp) == std::vector<int>{5, 7});
  CHECK(mesh_group(shape, 5, Dim::tp) == std::vector<int>{4, 5});
  CHECK(to_string(shape) == "dp=2, pp=2, tp=2");
  // A single process: no communicators.
  Mesh single;
  CHECK(single.shape().size() == 1);
  CHECK(single.comm(kDataParallel) == nullptr);
}

TEST_CASE("mesh: names, sets of dimensions and the text of a shape", "[parallel]") {
  for (Dim d : kAllDims) CHECK(dim_from_name(dim_name(d)) == d);
  CHECK(!dim_from_name("dp"));
  CHECK(to_string(kDataParallel) == "dp_replicate x dp_shard");
  CHECK(to_string(Dims{Dim::tp, Dim::cp}) == "cp x tp");
  CHECK(Dims(Dim::pp).complement() ==
        Dims{Dim::dp_replicate, Dim::dp_shard, Dim::ep, Dim::cp, Dim::tp});
  CHECK((Dims(Dim::cp) | Dim::tp) == Dims{Dim::cp, Dim::tp});
  CHECK(to_string(MeshShape{{Dim::dp_shard, 4}}) == "dp=4, pp=1, tp=1");
  CHECK(to_string(MeshShape{{Dim::dp_replicate, 2}, {Dim::dp_shard, 2}, {Dim::cp, 2}}) ==
        "dp_replicate=2, dp_shard=2, pp=1, cp=2, tp=1");
}

namespace {

// The closed form the mesh promises, written out independently: the world
// rank is sum_d index_d x prod_{e inner to d} size_e over the fixed order,
// and the group of a set D holds the ranks whose indices outside D equal
// this rank's, numbered by the mixed-radix value of their indices in D.
std::vector<int> group_by_formula(const std::array<int, kDims>& size, int rank, unsigned in_set) {
  std::array<int, kDims> stride{}, index{};
  int s = 1;
  for (int d = kDims - 1; d >= 0; --d) {
    stride[size_t(d)] = s;
    index[size_t(d)] = rank / s % size[size_t(d)];
    s *= size[size_t(d)];
  }
  std::vector<std::pair<int, int>> members;  // (number in the group, world rank)
  for (int other = 0; other < s; ++other) {
    bool same = true;
    int number = 0;
    for (int d = 0; d < kDims; ++d) {
      const int i = other / stride[size_t(d)] % size[size_t(d)];
      if (in_set & (1u << d))
        number = number * size[size_t(d)] + i;
      else
        same = same && i == index[size_t(d)];
    }
    if (same) members.push_back({number, other});
  }
  std::sort(members.begin(), members.end());
  std::vector<int> out;
  for (const auto& m : members) out.push_back(m.second);
  return out;
}

// Every set of dimensions (63 of them) on a shape with these sizes.
std::vector<Dims> every_set() {
  std::vector<Dims> sets;
  for (unsigned bits = 1; bits < (1u << kDims); ++bits) {
    Dims d;
    for (int k = 0; k < kDims; ++k)
      if (bits & (1u << k)) d = d | kAllDims[size_t(k)];
    sets.push_back(d);
  }
  return sets;
}

}  // namespace

TEST_CASE("mesh: groups of every set of dimensions match the formula on six-dimension shapes",
          "[parallel]") {
  // Each shape names all six dimensions; 8 ranks as 2 x 2 x 2 placed every way.
  for (int a = 0; a < kDims; ++a)
    for (int b = a + 1; b < kDims; ++b)
      for (int c = b + 1; c < kDims; ++c) {
        std::array<int, kDims> size{1, 1, 1, 1, 1, 1};
        size[size_t(a)] = size[size_t(b)] = size[size_t(c)] = 2;
        MeshShape shape;
        for (int d = 0; d < kDims; ++d) shape.set(kAllDims[size_t(d)], size[size_t(d)]);
        INFO(to_string(shape));
        REQUIRE(shape.size() == 8);
        for (Dims dims : every_set())
          for (int rank = 0; rank < 8; ++rank) {
            INFO(to_string(dims) << ", rank " << rank);
            const std::vector<int> group = mesh_group(shape, rank, dims);
            REQUIRE(group == group_by_formula(size, rank, dims.bits()));
            CHECK(group[size_t(group_index(shape, mesh_coord(shape, rank), dims))] == rank);
          }
      }
}

TEST_CASE(
    "mesh: 8 ranks in one process, all six dimensions: every group's communicator is the "
    "formula's and reduces over it",
    "[parallel][threads]") {
  const MeshShape shape{{Dim::dp_replicate, 2}, {Dim::dp_shard, 1}, {Dim::ep, 1},
                        {Dim::pp, 2},           {Dim::cp, 1},       {Dim::tp, 2}};
  const MeshShape other{{Dim::dp_replicate, 1}, {Dim::dp_shard, 2}, {Dim::ep, 2},
                        {Dim::pp, 1},           {Dim::cp, 2},       {Dim::tp, 1}};
  for (const MeshShape& s : {shape, other}) {
    INFO(to_string(s));
    std::array<int, kDims> size{};
    for (int d = 0; d < kDims; ++d) size[size_t(d)] = s[kAllDims[size_t(d)]];
    // What each rank found: per set of dimensions, (members, its rank, the sum).
    using Found = std::vector<std::tuple<std::vector<int>, int, double>>;
    const std::vector<Dims> sets = every_set();
    const std::vector<Found> found =
        testing::run_thread_ranks<Found>(8, [&](comm::Communicator& world) {
          std::shared_ptr<comm::Communicator> mine(&world, [](comm::Communicator*) {});
          Mesh mesh(s, mine);
          Found out;
          for (Dims dims : sets) {  // the same order on every rank: collective
            std::shared_ptr<comm::Communicator> group = mesh.comm(dims);
            std::vector<int> members;
            for (int r = 0; r < group->size(); ++r) members.push_back(group->world_rank(r));
            double value = world.rank() + 1;
            comm::allreduce(*group, &value, 1, DType::f64, {.op = comm::ReduceOp::sum});
            out.emplace_back(members, group->rank(), value);
          }
          if (mesh.index(Dim::tp) != mesh.coord()[Dim::tp]) throw Error("index(tp) != coord[tp]");
          return out;
        });
    for (int rank = 0; rank < 8; ++rank)
      for (size_t k = 0; k < sets.size(); ++k) {
        INFO("rank " << rank << ", " << to_string(sets[k]));
        const auto& [members, index, sum] = found[size_t(rank)][k];
        const std::vector<int> want = group_by_formula(size, rank, sets[k].bits());
        CHECK(members == want);
        CHECK(want[size_t(index)] == rank);
        double expected = 0;
        for (int m : want) expected += m + 1;
        CHECK(sum == expected);
      }
  }
}

TEST_CASE("mesh: 4 ranks as dp2 x pp2, dp2 x tp2, pp2 x tp2 and dp4 split the world right",
          "[parallel][threads]") {
  for (const auto& [dp, pp, tp] : {std::tuple{2, 2, 1}, {2, 1, 2}, {1, 2, 2}, {4, 1, 1}}) {
    const MeshShape shape = dp_pp_tp(dp, pp, tp);
    INFO(to_string(shape));
    // Per rank: its coordinates, and per dimension (members, index, allreduce sum).
    struct Found {
      MeshCoord coord;
      std::vector<std::tuple<std::vector<int>, int, double>> groups;
    };
    const std::vector<Found> found =
        testing::run_thread_ranks<Found>(4, [&](comm::Communicator& world) {
          Mesh mesh(shape, std::shared_ptr<comm::Communicator>(&world, [](comm::Communicator*) {}));
          Found out{.coord = mesh.coord(), .groups = {}};
          for (Dims dim : {kDataParallel, Dims(Dim::pp), Dims(Dim::tp)}) {
            std::shared_ptr<comm::Communicator> group = mesh.comm(dim);
            std::vector<int> members;
            for (int r = 0; r < group->size(); ++r) members.push_back(group->world_rank(r));
            double value = world.rank() + 1;
            comm::allreduce(*group, &value, 1, DType::f64, {.op = comm::ReduceOp::sum});
            out.groups.emplace_back(members, group->rank(), value);
          }
          // Rank 0 hosts the store the groups' channels meet through.
          comm::barrier(world);
          return out;
        });
    for (int rank = 0; rank < 4; ++rank) {
      INFO("rank " << rank);
      CHECK(found[size_t(rank)].coord == mesh_coord(shape, rank));
      size_t k = 0;
      for (Dims dim : {kDataParallel, Dims(Dim::pp), Dims(Dim::tp)}) {
        const auto& [members, index, sum] = found[size_t(rank)].groups[k++];
        const std::vector<int> want = mesh_group(shape, rank, dim);
        CHECK(members == want);
        CHECK(index == group_index(shape, mesh_coord(shape, rank), dim));
        double expected = 0;
        for (int member : want) expected += member + 1;
        CHECK(sum == expected);
      }
    }
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
