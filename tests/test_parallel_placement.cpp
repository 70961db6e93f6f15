// Placements (parallel/placement.h): the pieces of every rank tile the
// logical tensor (each element held once per replica, written exactly once),
// over meshes of several dimensions and nested shards; tensor parallelism's
// own split (shard_of, layers/tensor_parallel.h) is the piece the placement
// of its ParameterSplit describes.
#include <map>

#include "core/ops.h"
#include "layers/tensor_parallel.h"
#include "parallel/parallel_plan.h"
#include "parallel/placement.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::parallel;
using trainer::testing::error_of;

namespace {

// How often each element of the logical tensor is held (all ranks) and
// written (ranks with writes()), with the local shape checked against the boxes.
void count_cover(const TensorPlacement& p, const MeshShape& mesh, std::vector<int>& held,
                 std::vector<int>& written) {
  int64_t n = 1;
  for (int64_t e : p.global) n *= e;
  held.assign(size_t(n), 0);
  written.assign(size_t(n), 0);
  const Shape local = local_shape(p, mesh);
  for (int rank = 0; rank < mesh.size(); ++rank) {
    const MeshCoord coord = mesh_coord(mesh, rank);
    int64_t local_elements = 0;
    for (const Box& b : local_boxes(p, mesh, coord)) {
      // Every element of the box, row-major over the logical tensor.
      int64_t count = 1;
      for (int64_t e : b.extent) count *= e;
      local_elements += count;
      for (int64_t k = 0; k < count; ++k) {
        int64_t rest = k, flat = 0;
        Shape at(b.extent.size());
        for (size_t d = b.extent.size(); d-- > 0;) {
          at[d] = b.offset[d] + rest % b.extent[d];
          rest /= b.extent[d];
        }
        for (size_t d = 0; d < at.size(); ++d) flat = flat * p.global[d] + at[d];
        ++held[size_t(flat)];
        if (writes(p, coord)) ++written[size_t(flat)];
      }
    }
    int64_t want = 1;
    for (int64_t e : local) want *= e;
    CHECK(local_elements == want);
  }
}

}  // namespace

TEST_CASE("placement: every rank's boxes tile the tensor, and one copy of each element is written",
          "[parallel]") {
  const MeshShape dp_tp{{Dim::dp_replicate, 2}, {Dim::tp, 2}};
  const MeshShape six{{Dim::dp_replicate, 2}, {Dim::dp_shard, 2}, {Dim::pp, 2}, {Dim::tp, 2}};
  struct Case {
    TensorPlacement p;
    MeshShape mesh;
  };
  const TensorPlacement whole = TensorPlacement::replicated({12, 8});
  const std::vector<Case> cases = {
      {whole, dp_tp},
      {whole.with(Dim::tp, Placement::shard(0)), dp_tp},
      {whole.with(Dim::tp, Placement::shard(1)), dp_tp},
      {whole.with(Dim::tp, Placement::shard(0, 3)), dp_tp},
      {whole.with(Dim::tp, Placement::shard(0, 3)).with(Dim::dp_shard, Placement::shard(1)), six},
      {whole.with(Dim::tp, Placement::shard(1)).with(Dim::dp_shard, Placement::shard(1)), six},
      {whole.with(Dim::dp_replicate, Placement::shard(0, 3)).with(Dim::tp, Placement::shard(0)),
       six},
  };
  for (const Case& c : cases) {
    INFO(to_string(c.p) << " on " << to_string(c.mesh));
    std::vector<int> held, written;
    count_cover(c.p, c.mesh, held, written);
    int replicas = 1;
    for (Dim d : kAllDims)
      if (c.p[d].kind != Placement::Kind::shard) replicas *= c.mesh[d];
    for (size_t e = 0; e < held.size(); ++e) {
      INFO("element " << e);
      REQUIRE(held[e] == replicas);
      REQUIRE(written[e] == 1);
    }
  }
}

TEST_CASE("placement: a fused tensor's pieces, the text, and shapes that do not divide",
          "[parallel]") {
  const MeshShape tp2{{Dim::tp, 2}};
  const TensorPlacement qkv =
      TensorPlacement::replicated({12, 4}).with(Dim::tp, Placement::shard(0, 3));
  CHECK(local_shape(qkv, tp2) == Shape{6, 4});
  // Rank 1 holds the second half of q, of k and of v.
  CHECK(local_boxes(qkv, tp2, mesh_coord(tp2, 1)) ==
        std::vector<Box>{{{2, 0}, {2, 4}}, {{6, 0}, {2, 4}}, {{10, 0}, {2, 4}}});
  CHECK(to_string(qkv) == "tp: shard(0, 3 pieces)");
  CHECK(to_string(TensorPlacement::replicated({3})) == "replicate");
  CHECK(to_string(TensorPlacement::replicated({3}).with(Dim::cp, Placement::partial())) ==
        "cp: partial");
  // A pipeline stage's tensor, and a tied copy the owner writes.
  const MeshShape pp2_dp2{{Dim::dp_replicate, 2}, {Dim::pp, 2}};
  const TensorPlacement stage1 =
      TensorPlacement::replicated({3}).with(Dim::pp, Placement::owned(1));
  CHECK(to_string(stage1) == "pp: owned by 1");
  for (int rank = 0; rank < 4; ++rank) {
    const MeshCoord c = mesh_coord(pp2_dp2, rank);
    CHECK(writes(stage1, c) == (c[Dim::pp] == 1 && c[Dim::dp_replicate] == 0));
  }
  CHECK(writes(qkv, mesh_coord(tp2, 1)));
  const MeshShape dp2{{Dim::dp_replicate, 2}};
  CHECK(writes(qkv, mesh_coord(dp2, 0)));
  CHECK(!writes(qkv, mesh_coord(dp2, 1)));
  CHECK_THAT(error_of([&] {
               local_shape(
                   TensorPlacement::replicated({10, 4}).with(Dim::tp, Placement::shard(0, 3)), tp2);
             }),
             Catch::Contains("dimension 0 (10 here) does not divide into 3 pieces of 2 slices"));
}

TEST_CASE("placement: tensor parallelism's split of a parameter is the piece its placement names",
          "[parallel]") {
  Generator gen(7, kStreamInit);
  const Tensor full = normal({12, 6}, 0.0, 1.0, gen);
  for (int parts : {1, 3})
    for (int dim : {0, 1}) {
      if (dim == 1 && parts == 3) continue;  // 6 columns: 3 pieces of 2, split in 2 = 1 each
      for (int rank = 0; rank < 2; ++rank) {
        INFO("dim " << dim << ", " << parts << " parts, rank " << rank);
        const ParameterSplit split{.kind = ParameterSplit::Kind::sharded,
                                   .dim = dim,
                                   .parts = parts,
                                   .rank = rank,
                                   .size = 2};
        const Tensor mine = shard_of(full, split);
        const TensorPlacement p = tensor_parallel_placement(mine.shape(), &split);
        CHECK(p.global == full.shape());
        const MeshShape tp2{{Dim::tp, 2}};
        TensorList pieces;
        for (const Box& b : local_boxes(p, tp2, mesh_coord(tp2, rank)))
          pieces.push_back(full.narrow(dim, b.offset[size_t(dim)], b.extent[size_t(dim)]));
        testing::require_close(concat(pieces, dim).contiguous(), mine.contiguous(), 0, 0, "piece");
      }
    }
  const ParameterSplit partial{
      .kind = ParameterSplit::Kind::partial_gradient, .rank = 0, .size = 2};
  CHECK(tensor_parallel_placement({6}, &partial) == TensorPlacement::replicated({6}));
  CHECK(tensor_parallel_placement({6}, nullptr) == TensorPlacement::replicated({6}));
}

TEST_CASE("parallel plan: passes in order, placements by name, one writer per piece",
          "[parallel]") {
  ParallelPlan plan;
  CHECK(plan.describe() == "one process");
  plan.mesh = MeshShape{{Dim::dp_replicate, 2}, {Dim::pp, 2}, {Dim::tp, 2}};
  plan.record("tensor", "tp=2");
  plan.record("pipeline", "stage 1 of 2");
  plan.record("data", "dp=2, zero1");
  CHECK(plan.describe() == "tensor (tp=2) -> pipeline (stage 1 of 2) -> data (dp=2, zero1)");
  CHECK(plan.applied("pipeline"));
  CHECK(!plan.applied("parameter servers"));
  // A weight split over tp on stage 1, and a bias replicated there.
  plan.place("w", TensorPlacement::replicated({8, 4})
                      .with(Dim::tp, Placement::shard(0))
                      .with(Dim::pp, Placement::owned(1)));
  plan.place("b", TensorPlacement::replicated({4}).with(Dim::pp, Placement::owned(1)));
  int w_writers = 0, b_writers = 0;
  for (int rank = 0; rank < plan.mesh.size(); ++rank) {
    plan.coord = mesh_coord(plan.mesh, rank);
    w_writers += plan.writes("w");
    b_writers += plan.writes("b");
    if (plan.writes("b"))
      CHECK(rank == mesh_rank(plan.mesh, [] {
              MeshCoord c;
              c.set(Dim::pp, 1);
              return c;
            }()));
  }
  CHECK(w_writers == 2);  // one per tp part, on stage 1 of the first replica
  CHECK(b_writers == 1);
  CHECK_THAT(error_of([&] { plan.placement("c"); }),
             Catch::Contains("the parallel plan places no tensor 'c'"));
}

TEST_CASE("parallel plan: the data-parallel replicas share the writing of replicated tensors",
          "[parallel]") {
  ParallelPlan plan;
  plan.mesh = MeshShape{{Dim::dp_replicate, 2}, {Dim::tp, 2}};
  plan.place("big", TensorPlacement::replicated({100}));
  plan.place("mid", TensorPlacement::replicated({60}));
  plan.place("small", TensorPlacement::replicated({50}));
  plan.place("split", TensorPlacement::replicated({8}).with(Dim::tp, Placement::shard(0)));
  plan.spread_writers({{"big", 400}, {"mid", 240}, {"small", 200}, {"split", 16}});
  // Largest first, each to the replica with the fewest bytes so far.
  CHECK(plan.replica_writer_of("big") == 0);
  CHECK(plan.replica_writer_of("mid") == 1);
  CHECK(plan.replica_writer_of("small") == 1);
  CHECK(plan.replica_writer_of("split") == 0);
  std::map<std::string, int> writers;
  for (int rank = 0; rank < plan.mesh.size(); ++rank) {
    plan.coord = mesh_coord(plan.mesh, rank);
    for (const char* name : {"big", "mid", "small", "split"})
      if (plan.writes(name)) {
        ++writers[name];
        // Whole tensors on the first tp rank of their replica; the split one on both.
        CHECK(plan.coord[Dim::dp_replicate] == plan.replica_writer_of(name));
        if (std::string(name) != "split") CHECK(plan.coord[Dim::tp] == 0);
      }
  }
  CHECK(writers == std::map<std::string, int>{{"big", 1}, {"mid", 1}, {"small", 1}, {"split", 2}});
  // One replica: every tensor on it.
  ParallelPlan one;
  one.mesh = MeshShape{{Dim::tp, 2}};
  one.place("big", TensorPlacement::replicated({100}));
  one.spread_writers({{"big", 400}});
  CHECK(one.replica_writer_of("big") == 0);
}
