// DistributedRun's evaluation over the ranks, the ranks' agreement on each
// step, the link models and traces it keeps, and a parameter server's loop.
#include "trainer/distributed.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>

#include "comm/bootstrap.h"
#include "comm/collectives.h"
#include "optim/clip.h"
#include "parallel/device_staging.h"
#include "parallel/fsdp.h"
#include "parallel/pipeline_eval.h"
#include "parallel/planner.h"
#include "parallel/sync_batchnorm.h"
#include "trainer/device.h"
#include "trainer/metrics.h"
#include "trainer/pipeline_split.h"
#include "trainer/session.h"
#include "trainer/tensorboard.h"

namespace trainer {

EvalMetrics DistributedRun::evaluate(Session& session) const {
  if (!dist_.active()) return session.evaluate();
  if (dp_) dp_->broadcast_buffers(0);
  // ZeRO-3: each unit gathered as the forward passes run it, the ranks in
  // lockstep (their shares of the validation set may take different
  // numbers of passes).
  if (sharded_parameters_) sharded_parameters_->begin_lockstep();
  EvalSums mine = pipeline_ ? evaluate_pipeline(session) : session.evaluate_shard();
  if (sharded_parameters_) sharded_parameters_->end_lockstep();
  // Gathered, not allreduced: a ring's sums would round differently on each
  // rank, and best-checkpoint decisions must agree.
  constexpr int kValues = 5;
  const double local[kValues] = {mine.loss, double(mine.top1), double(mine.top5),
                                 double(mine.samples), double(mine.skipped)};
  comm::Communicator& dp_comm = *eval_comm();
  std::vector<double> all(kValues * size_t(dp_comm.size()));
  comm::allgather(dp_comm, local, all.data(), sizeof(local));
  EvalSums sums;
  for (int r = 0; r < dp_comm.size(); ++r) {
    const double* v = all.data() + kValues * r;
    sums.loss += v[0];
    sums.top1 += int64_t(v[1]);
    sums.top5 += int64_t(v[2]);
    sums.samples += int64_t(v[3]);
    sums.skipped += int64_t(v[4]);
  }
  return eval_metrics(sums, session.is_language_model(), session.token_unit());
}

EvalSums DistributedRun::evaluate_pipeline(Session& session) const {
  BatchSource& source = session.data();
  EvalSums sums;
  StepBatch batch, chunk;
  const parallel::PipelineEvalBatches batches{
      .start = [&] { source.start_eval(); },
      .next = [&] { return source.next_eval(batch); },
      .inputs =
          [&](int k, int K) {
            chunk = time_chunk(batch, k, K);
            return source.eval_inputs(chunk);
          },
      .outputs =
          [&](const TensorList& outputs, bool last_stage) {
            source.keep_eval_outputs(outputs);
            if (last_stage) source.add_eval_sums(chunk, outputs, sums);
            chunk = StepBatch{};  // its tensors are freed with its micro-batch's
          },
      .sums =
          [&] {
            return parallel::PipelineEvalSums{sums.loss, double(sums.top1), double(sums.top5),
                                              double(sums.samples)};
          }};
  // The wavefront's messages are time chunks of the windows (probed so).
  const int K = std::max(1, int(session.recipe().parallel.time_chunks));
  const parallel::PipelineEvalSums v = parallel::evaluate_pipeline(
      *pipeline_, session.model(), *dist_.mesh.comm(parallel::Dim::pp), K, batches);
  return EvalSums{v[0], int64_t(v[1]), int64_t(v[2]), int64_t(v[3])};
}

StepVerdict DistributedRun::agree(double loss, bool finite, bool stop, bool has_loss) const {
  if (!dist_.active()) return StepVerdict{loss, finite, stop};
  // Sums of (loss, non-finite ranks, stopping ranks, ranks with a loss): one message.
  double v[4] = {finite && has_loss ? loss : 0.0, finite ? 0.0 : 1.0, stop ? 1.0 : 0.0,
                 has_loss ? 1.0 : 0.0};
  comm::allreduce(*dist_.world(), v, 4, DType::f64, {.op = comm::ReduceOp::sum});
  StepVerdict verdict;
  verdict.finite = v[1] == 0;
  verdict.loss = verdict.finite ? v[0] / v[3] : std::nan("");
  verdict.stop = v[2] > 0;
  return verdict;
}

bool DistributedRun::any_rank(bool flag) const {
  if (!dist_.active()) return flag;
  double v = flag ? 1.0 : 0.0;
  comm::allreduce(*dist_.world(), &v, 1, DType::f64, {.op = comm::ReduceOp::max});
  return v > 0;
}

std::string DistributedRun::memory_summary() const {
  const MemoryPeaks m = memory_peaks();
  double v[3] = {m.tensors_mib, m.shared_mib, m.resident_mib};
  if (dist_.active())
    comm::allreduce(*dist_.world(), v, 3, DType::f64, {.op = comm::ReduceOp::max});
  char text[200];
  std::snprintf(text, sizeof text,
                "memory: peak %.1f MiB of tensors (%.1f MiB of them shared with the host's other "
                "ranks), %.1f MiB resident%s",
                v[0], v[1], v[2], dist_.active() ? " (the largest of any rank)" : "");
  return text;
}

void DistributedRun::barrier() const {
  if (dist_.active()) comm::barrier(*dist_.world());
}

namespace {

// Link models as text, a line each: "<ranks>|<alpha>|<beta>|<gamma>" with
// the numbers as hexadecimal floats (exact), the ranks space-separated.
std::string encode_link_models(const std::map<std::vector<int>, comm::LinkModel>& models) {
  std::string text;
  for (const auto& [ranks, m] : models) {
    for (size_t k = 0; k < ranks.size(); ++k) text += cat(k ? " " : "", ranks[k]);
    char numbers[128];
    std::snprintf(numbers, sizeof numbers, "|%a|%a|%a\n", m.alpha, m.beta, m.gamma);
    text += numbers;
  }
  return text;
}

void decode_link_models(const std::string& text,
                        std::map<std::vector<int>, comm::LinkModel>& into) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t bar = line.find('|');
    CHECK(bar != std::string::npos) << "link model record without '|': " << line;
    std::vector<int> ranks;
    std::istringstream rank_list(line.substr(0, bar));
    for (int r; rank_list >> r;) ranks.push_back(r);
    comm::LinkModel m;
    CHECK_EQ(std::sscanf(line.c_str() + bar, "|%la|%la|%la", &m.alpha, &m.beta, &m.gamma), 3)
        << line;
    into.emplace(std::move(ranks), m);
  }
}

}  // namespace

std::map<std::vector<int>, comm::LinkModel> DistributedRun::link_models() const {
  std::map<std::vector<int>, comm::LinkModel> models = comm::link_models();
  if (!dist_.active()) return models;
  // Each rank knows the models of its own communicators: all of them gathered.
  comm::Communicator& world = *dist_.world();
  std::string mine = encode_link_models(models);
  const int64_t length = int64_t(mine.size());
  std::vector<int64_t> lengths(size_t(world.size()));
  comm::allgather(world, &length, lengths.data(), sizeof length);
  const size_t longest = size_t(*std::max_element(lengths.begin(), lengths.end()));
  if (longest == 0) return models;
  mine.resize(longest);
  std::string all(longest * lengths.size(), '\0');
  comm::allgather(world, mine.data(), all.data(), longest);
  for (size_t r = 0; r < lengths.size(); ++r)
    decode_link_models(all.substr(r * longest, size_t(lengths[r])), models);
  return models;
}

bool DistributedRun::keep_link_models(const std::map<std::vector<int>, comm::LinkModel>& models,
                                      int saved) const {
  if (models.empty() || saved != dist_.world_size()) return false;
  for (const auto& [ranks, model] : models) comm::preset_link_model(ranks, model);
  return true;
}

void DistributedRun::end_trace_window(int64_t steps_done) {
  // 50 steps show the steady state and keep the file a few MB.
  constexpr int64_t kTracedSteps = 50;
  if (timeline_ && steps_done >= kTracedSteps) timeline_->set_recording(false);
}

void DistributedRun::write_trace(const std::string& path) const {
  if (!timeline_) return;
  if (dist_.active())
    timeline_->write_merged(*dist_.world(), path);
  else
    timeline_->write(path);
}

void serve_parameter_shard(const Distributed& dist, Session& session) {
  const Recipe& r = session.recipe();
  const std::vector<optim::ParamGroup> groups = session.trained_param_groups();
  const parallel::ShardMap shards = parallel::assign_shards(groups, dist.servers);
  const int workers = dist.layout.dp_size(), k = dist.rank() - workers;
  std::printf(
      "parameter server %d of %d (rank %d): %lld of %lld parameters, for %d workers, %s\n", k,
      dist.servers, dist.rank(), (long long)shards.elements[size_t(k)],
      (long long)std::accumulate(shards.elements.begin(), shards.elements.end(), int64_t(0)),
      workers,
      r.parallel.sync == "ssp" ? cat("ssp, staleness ", r.parallel.staleness).c_str()
                               : r.parallel.sync.c_str());
  std::fflush(stdout);
  // SIGTERM and SIGINT stop the workers, which checkpoint (the servers' state
  // with it) and say they are done: the server serves until then.
  std::signal(SIGTERM, SIG_IGN);
  std::signal(SIGINT, SIG_IGN);
  const parallel::ServerReport report = parallel::serve_parameters(
      dist.everyone, shards, workers, groups,
      [&r](std::vector<optim::ParamGroup> g) { return make_optimizer(r, std::move(g)); },
      {.sync = parallel::parse_sync(r.parallel.sync), .staleness = r.parallel.staleness});
  std::printf("parameter server %d: %s\n", k, report.summary().c_str());
  std::fflush(stdout);
  // The staleness histogram, one record per server in the run's metrics.jsonl.
  Scalars scalars{{"server", double(k)}, {"gradients", double(report.gradients)}};
  for (const auto& [staleness, count] : report.staleness)
    scalars.push_back({cat("staleness_", staleness), double(count)});
  MetricsLog(r.output_dir, /*tensorboard=*/false).write("staleness", report.updates, scalars);
  TensorBoardWriter(r.output_dir + "/tb", cat(".server", k))
      .add_histogram(cat("staleness/server", k), report.staleness, report.updates);
}

}  // namespace trainer
