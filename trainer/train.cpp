#include "trainer/train.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>

#include "comm/bootstrap.h"
#include "core/autocast.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "data/files.h"
#include "data/loader.h"
#include "parallel/tensor_parallel.h"
#include "parallel/trace.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_tool.h"
#include "trainer/checkpoint_writer.h"
#include "trainer/device.h"
#include "trainer/distributed.h"
#include "trainer/metrics.h"
#include "trainer/pipeline_split.h"
#include "trainer/plan.h"
#include "trainer/precision.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"
#include "trainer/step_executor.h"
#include "trainer/stop_signals.h"
#include "trainer/train_parts.h"

namespace trainer {

void apply_threads(const Recipe& r) {
  if (r.training.threads > 0) set_num_threads(int(r.training.threads));
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string checkpoint_root(const Recipe& r) { return r.output_dir + "/checkpoints"; }

// The directory to resume from: --resume auto (newest complete, or none),
// or a checkpoint as find_checkpoint takes one (trainer/checkpoint_tool.h).
std::optional<std::string> resume_dir(const std::string& resume, const Recipe& r) {
  if (resume.empty()) return std::nullopt;
  if (resume == "auto") {
    std::error_code missing;  // or unreadable: CheckpointDir then says why
    if (!std::filesystem::exists(checkpoint_root(r), missing)) return std::nullopt;
    return CheckpointDir(checkpoint_root(r), r.training.keep_last).latest_complete();
  }
  return find_checkpoint(resume, "--resume");
}

class TrainLoop {
 public:
  // Rank 0 alone prints, logs and writes checkpoints; every rank trains.
  TrainLoop(Session& s, TrainState state, DistributedRun& run, Precision& precision)
      : s_(s),
        r_(s.recipe()),
        state_(state),
        run_(run),
        precision_(precision),
        executor_(s, run, precision, training_schedule(s.recipe(), s.layout())),
        print_(run.dist().is_main()),
        ckpt_(checkpoint_root(r_), r_.training.keep_last),
        writer_(ckpt_,
                {.async = r_.training.async_checkpoint,
                 .max_staging_bytes = r_.training.async_checkpoint_mb << 20},
                print_),
        log_(print_ ? std::make_unique<MetricsLog>(r_.output_dir) : nullptr) {
    executor_.set_before_update([this] { writer_.wait_staged(); });
  }

  int run() {
    try {
      return run_steps();
    } catch (const data::LoaderStalled& stall) {
      return stop_in_stall(stall);
    }
  }

 private:
  int run_steps() {
    const int64_t total = s_.total_steps();
    const int64_t spe = s_.steps_per_epoch();
    const int64_t per_step = s_.micro_batch() * s_.micro_batches();
    t0_ = std::chrono::steady_clock::now();
    step_at_start_ = state_.step;
    while (state_.step < total) {
      // A position saved under another training.global_batch (kept in
      // samples) may leave less than a step of its epoch, or fall between
      // steps: the epoch's last partial step is dropped, as every epoch's is.
      const bool between_steps = state_.position % per_step != 0;
      if (state_.position / per_step >= spe) {
        ++state_.epoch;
        state_.position = 0;
        continue;
      }
      s_.start_epoch(state_.epoch, state_.position);
      for (int64_t k = state_.position / per_step; k < spe && state_.step < total; ++k) {
        if (!train_step()) {
          if (!(between_steps && k + 1 == spe))
            throw Error("the training data ended an epoch early");
          ++state_.epoch;
          state_.position = 0;
          break;
        }
        bool epoch_end = k + 1 == spe;
        poll_checkpoint();
        if (state_.step % r_.training.log_every == 0 || state_.step == total) log_train();
        bool eval_now =
            r_.training.eval_every > 0 ? state_.step % r_.training.eval_every == 0 : epoch_end;
        if (epoch_end) {
          ++state_.epoch;
          state_.position = 0;
        }
        if (eval_now || state_.step == total) evaluate();
        bool periodic = r_.training.checkpoint_every > 0
                            ? state_.step % r_.training.checkpoint_every == 0
                            : epoch_end;
        if (periodic || state_.step == total) save();
        run_.end_trace_window(state_.step - step_at_start_);
        if (stop_) {
          if (!(periodic || state_.step == total)) save();
          finish_checkpoint();
          run_.write_trace(trace_path());
          // The signal may have reached another rank only.
          std::string why = StopSignals::received()
                                ? cat("received signal ", StopSignals::received())
                                : std::string("a rank received a stop signal");
          say(cat(why, ": checkpoint written at step ", state_.step, ", exiting"));
          return 0;
        }
      }
    }
    finish_checkpoint();
    run_.write_trace(trace_path());
    summary();
    return 0;
  }

  // A stop signal came while the data loader waited for a read that did not
  // return (data::LoaderOptions::interrupted). Alone, between steps, the
  // state of the last step is whole: checkpoint it. Otherwise the step's
  // partners (other ranks, or this step's first micro-batches) cannot be
  // undone: exit with the last checkpoint kept.
  int stop_in_stall(const data::LoaderStalled& stall) {
    const std::string signal = cat("received signal ", StopSignals::received(), "; ");
    const bool alone = run_.dist().world_size() == 1 && run_.dist().servers == 0;
    if (!alone || executor_.step_begun())
      throw Error(cat(signal, stall.what(), "; exiting without a checkpoint (",
                      alone ? "the step had begun" : "the other ranks cannot join one",
                      "): the last checkpoint is kept"));
    save();
    finish_checkpoint();
    run_.write_trace(trace_path());
    say(cat(signal, stall.what(), ": checkpoint written at step ", state_.step, ", exiting"));
    return 0;
  }

  // One optimizer step by the executor; false if the epoch's data ran out.
  bool train_step() {
    StepResult result = executor_.run(state_.step, StopSignals::received() != 0);
    if (result.ran_out) return false;
    state_.position = result.position;
    samples_ += result.items;
    stop_ = result.stop;
    if (!result.finite) {
      ++state_.nonfinite_skipped;
      if (++nonfinite_in_a_row_ > r_.training.max_nonfinite)
        throw Error(cat("the loss was not finite for ", nonfinite_in_a_row_,
                        " steps in a row (training.max_nonfinite = ", r_.training.max_nonfinite,
                        ") at step ", state_.step, "; lower optimizer.lr or check the data"));
      say(cat("step ", state_.step, ": non-finite loss, step skipped"));
    } else {
      nonfinite_in_a_row_ = 0;
      last_grad_norm_ = result.grad_norm;
    }
    ++state_.step;
    last_loss_ = result.loss;
    last_lr_ = result.lr;
    return true;
  }

  void log_train() {
    double elapsed = seconds_since(t0_);
    // Every dp rank reads as many samples as this one.
    double rate = elapsed > 0 ? double(samples_) * run_.dist().layout.dp_size() / elapsed : 0;
    // The ETA extrapolates from the steps of this run (not those before a resume).
    int64_t done = state_.step - step_at_start_;
    double eta = done > 0 ? elapsed / double(done) * double(s_.total_steps() - state_.step) : -1;
    const char* items = s_.data().item_name();
    std::string line = progress_line(
        {state_.epoch, state_.step, s_.total_steps(), last_loss_, last_lr_, rate, eta, items});
    if (precision_.scales_loss())
      line += cat(" | loss scale ", precision_.scale(), " (", precision_.skipped_steps(),
                  " steps skipped)");
    say(line + executor_.moe().progress());
    Scalars sc{{"loss", last_loss_}, {"lr", last_lr_}, {cat(items, "_per_second"), rate}};
    for (const auto& kv : executor_.moe().scalars()) sc.push_back(kv);
    if (r_.optimizer.clip_grad_norm > 0) sc.push_back({"grad_norm", last_grad_norm_});
    if (const parallel::ParameterServerClient* ps = run_.parameter_server())
      sc.push_back({"staleness", double(ps->last_staleness())});
    for (const auto& kv : precision_.scalars()) sc.push_back(kv);
    const MemoryPeaks memory = memory_peaks();  // this rank's, so far
    sc.insert(sc.end(), {{"memory_peak_mib", memory.tensors_mib},
                         {"resident_peak_mib", memory.resident_mib}});
    const double comm_mib = comm_per_step_.mib(state_.step);  // this rank's, per step
    if (run_.dist().world_size() > 1 || run_.dist().servers > 0)
      sc.push_back({"comm_mib", comm_mib});
    write_log("train", sc);
  }

  void evaluate() {
    auto t = std::chrono::steady_clock::now();
    EvalMetrics m;
    {
      AutocastGuard autocast(precision_.autocast_dtype());
      m = run_.evaluate(s_);
    }
    last_eval_ = m;
    const bool best = m.improves_on(state_.best_metric);
    if (best) state_.best_metric = m.best_metric();
    pending_best_ = pending_best_ || best;
    say(cat("eval step ", state_.step, ": ", m.text(), " | ", m.samples, " ", s_.data().item_name(),
            " in ", format_duration(seconds_since(t)), best ? " (best)" : ""));
    write_log("val", m.scalars());
  }

  // Rank 0 creates the directory, then every rank hands its part to the
  // writer (trainer/checkpoint_writer.h): written now, or copied and
  // written in the background; `latest` moves once every rank has written
  // its part. A write in flight is finished first: never two.
  void save() {
    report(writer_.settle(run_, state_.step));
    // What the step waits from here: the directory, the part, the copy or the write.
    const auto t0 = std::chrono::steady_clock::now();
    // The name CheckpointDir::begin gives the directory on rank 0.
    std::string tmp = ckpt_.root() + "/" + CheckpointDir::step_name(state_.step) + ".tmp";
    if (print_) {
      const std::string made = ckpt_.begin(state_.step);
      CHECK_EQ(made, tmp);
    }
    run_.barrier();
    state_.link_models = run_.link_models();
    if (print_) precision_.save(tmp);
    std::vector<CommittedCheckpoint> done =
        writer_.start(tmp, state_.step, pending_best_, s_.checkpoint_part(state_), run_, t0);
    if (!writer_.fallback().empty()) say(cat("checkpoint: ", writer_.fallback()));
    report(done);
    pending_best_ = false;
  }

  // Commits a checkpoint written in the background once every rank is done.
  void poll_checkpoint() { report(writer_.poll(run_)); }
  void finish_checkpoint() { report(writer_.finish(run_)); }
  // "checkpoint: DIR (the step waited 12 ms to write 35.2 MiB)", or "(written
  // in the background; the step waited 3 ms to copy 35.2 MiB and 0 ms to
  // commit)" (rank 0's part).
  void report(const std::vector<CommittedCheckpoint>& done) const {
    for (const CommittedCheckpoint& c : done) {
      char text[128];
      const double mib = double(c.bytes) / (1 << 20);
      if (c.background)
        std::snprintf(text, sizeof text,
                      "written in the background; the step waited %.0f ms to copy %.1f MiB and "
                      "%.0f ms to commit",
                      c.blocked_seconds * 1e3, mib, c.commit_seconds * 1e3);
      else
        std::snprintf(text, sizeof text, "the step waited %.0f ms to write %.1f MiB",
                      c.blocked_seconds * 1e3, mib);
      say(cat("checkpoint: ", c.dir, " (", text, ")"));
    }
  }

  std::string trace_path() const { return r_.output_dir + "/trace.json"; }

  void write_log(const std::string& split, const Scalars& scalars) {
    if (log_) log_->write(split, state_.step, scalars);
  }

  void summary() {
    double elapsed = seconds_since(t0_);
    int64_t rate =
        int64_t(elapsed > 0 ? double(samples_) * run_.dist().layout.dp_size() / elapsed : 0);
    std::string skipped = cat(state_.nonfinite_skipped, " non-finite steps skipped");
    if (precision_.scales_loss())
      skipped += cat(", ", precision_.skipped_steps(), " fp16 overflow steps skipped");
    say(cat("done: ", state_.step, " steps in ", format_duration(elapsed), ", ", rate, " ",
            s_.data().item_name(), "/s; ", last_eval_.final_text(state_.best_metric), "; ",
            skipped));
    say(run_.memory_summary());
  }

  void say(const std::string& line) const {
    if (print_) std::printf("%s\n", line.c_str()), std::fflush(stdout);
  }

  Session& s_;
  const Recipe& r_;
  TrainState state_;
  DistributedRun& run_;
  Precision& precision_;
  StepExecutor executor_;
  bool print_;
  CheckpointDir ckpt_;
  CheckpointWriter writer_;
  std::unique_ptr<MetricsLog> log_;  // rank 0 only
  StopSignals signals_;
  std::chrono::steady_clock::time_point t0_;
  int64_t step_at_start_ = 0;
  int64_t samples_ = 0;
  int64_t nonfinite_in_a_row_ = 0;
  double last_loss_ = 0, last_lr_ = 0, last_grad_norm_ = 0;
  bool pending_best_ = false;
  bool stop_ = false;  // the ranks agreed to checkpoint and exit
  EvalMetrics last_eval_;
  CommPerStep comm_per_step_{state_.step};  // since the last logged step (made last)
};

// Rank 0's account of the job: parameter servers, the layout, the steps and
// where the model runs.
void print_job(const Recipe& r, const Distributed& dist, Session& s) {
  if (dist.servers > 0)
    std::printf("parameter servers: %d (ranks %d-%d), %s%s\n", dist.servers, dist.world_size(),
                dist.world_size() + dist.servers - 1, r.parallel.sync.c_str(),
                r.parallel.sync == "ssp" ? cat(", staleness ", r.parallel.staleness).c_str() : "");
  std::printf("parallel layout: world %d (%s%s), %d CPU threads per rank\n", dist.world_size(),
              parallel::to_string(dist.layout.job.mesh).c_str(),
              shard_label(r, dist.layout.job).c_str(), num_threads());
  std::printf("%lld steps (%lld per epoch), micro-batch %lld x %s %lld per rank\n",
              (long long)s.total_steps(), (long long)s.steps_per_epoch(),
              (long long)s.micro_batch(),
              dist.layout.job.mesh[parallel::Dim::pp] > 1 ? "micro_batches" : "grad_accum",
              (long long)s.micro_batches());
  std::printf("device %s\n", cat(module_device(s.model())).c_str());
  if (module_device(s.model()).is_cpu()) {
    std::printf("cpu %s: %s\n", cpu::cpu_name(cpu::cpu_features()).c_str(),
                cpu::describe_kernel_isas().c_str());
    if (r.precision != "fp32")
      std::printf("precision %s: %s\n", r.precision.c_str(),
                  cpu::describe_low_precision(r.precision == "fp16").c_str());
  }
}

// --dry-run, on rank 0: the model as the ranks would hold it (rank 0's part
// under tensor parallelism, the stages of a pipeline), without training.
void print_dry_run(const Recipe& r, const Distributed& dist, Session& s) {
  const int tp = dist.layout.job.mesh[parallel::Dim::tp];
  if (tp > 1) {
    // Rank 0's part of the split model, its collectives moving nothing.
    const int64_t whole = s.model().num_parameters();
    s.set_tensor_parallel(parallel::shape_only_group(0, tp, r.parallel.sequence_parallel));
    std::printf("tensor parallel: tp = %d%s; %s of the %s parameters on each rank\n", tp,
                r.parallel.sequence_parallel ? ", sequence parallel" : "",
                with_commas(s.model().num_parameters()).c_str(), with_commas(whole).c_str());
  }
  std::printf("%s", s.summary(s.measure_activation_bytes()).c_str());
  if (dist.layout.job.mesh[parallel::Dim::pp] > 1) {
    // Every stage as it would run, profiled here on one micro-batch.
    const DType autocast = Precision(r, false).autocast_dtype();
    BlockProfile profile = profile_blocks(s, autocast);
    std::printf("%s", describe_stages(s, choose_split(s, &profile), &profile).c_str());
  }
}

// The state training starts from: the checkpoint `dir` (model, optimizer,
// loss scale, and the allreduce cost models chosen before the stop), or a
// fresh one.
TrainState resume_state(const std::optional<std::string>& dir, bool auto_resume, bool main_rank,
                        const Recipe& r, Session& s, Precision& precision, DistributedRun& run) {
  TrainState state;
  if (dir) {
    state = s.load(*dir);
    precision.load(*dir);
    if (main_rank) {
      std::printf("resumed from %s at step %lld (epoch %lld, position %lld)\n", dir->c_str(),
                  (long long)state.step, (long long)state.epoch, (long long)state.position);
      if (!s.resharded().empty()) std::printf("resharded: %s\n", s.resharded().c_str());
    }
    // The allreduce algorithms chosen as before the stop: the same sums.
    if (run.keep_link_models(state.link_models, state.layout.world_size()) && main_rank)
      for (const auto& [ranks, model] : state.link_models) {
        std::string members;
        for (int r : ranks) members += cat(members.empty() ? "" : " ", r);
        std::printf("allreduce cost model of ranks %s kept from the checkpoint: %s\n",
                    members.c_str(), model.str().c_str());
      }
  } else if (auto_resume && main_rank) {
    std::printf("no checkpoint under %s: starting from scratch\n", checkpoint_root(r).c_str());
  }
  return state;
}

}  // namespace

int train_command(const TrainArgs& args) {
  Recipe r = load_recipe(args.recipe, args.overrides);
  apply_threads(r);
  // A job `trainer launch --max-restarts` started again picks up where it stopped.
  const int restart = comm::detect_bootstrap().restart_count;
  const std::string resume = restart > 0 && args.resume.empty() ? "auto" : args.resume;
  // Which checkpoint is found only once every rank has joined: a restarted
  // job's old ranks (on another host, say) may still be writing one until then.
  auto find_resume_dir = [&] { return resume_dir(resume, r); };
  // parallel.auto: the layout planned for the launched ranks (trainer/plan.h).
  Distributed dist = r.parallel.auto_plan ? join_job_planned(r, args.dry_run, find_resume_dir)
                                          : join_job(r, args.dry_run);
  // Only rank 0 prints; the others' stdout stays quiet (errors still go to stderr).
  const bool main_rank = dist.is_main();
  if (main_rank)
    std::printf("recipe %s (resolved):\n%s", r.source.c_str(), recipe_to_yaml(r).c_str());
  Session s(r, dist.layout, args.dry_run ? DataAccess::assume_if_missing : DataAccess::read);
  if (dist.is_server) {
    serve_parameter_shard(dist, s);
    return 0;
  }
  if (main_rank) print_job(r, dist, s);
  if (args.dry_run) {
    if (main_rank) print_dry_run(r, dist, s);
    return 0;
  }
  // Made first, so that an output_dir that cannot be made fails before any work.
  if (main_rank) data::make_directories(r.output_dir, "output_dir");
  // Before the checkpoint is read: under zero1 it builds the optimizer. Every
  // rank then loads the same model, so the broadcast it does now is harmless.
  DistributedRun run(dist, s, r.training.trace || args.trace);
  if (!args.init_from.empty()) s.init_from(args.init_from, args.init_strict);
  Precision precision(r, s.shards_optimizer());
  // Split models: each rank checks its part of the gradients for overflow.
  if (run.splits_model())
    precision.set_found_inf_across([&run](bool f) { return run.any_rank(f); });
  if (restart > 0 && main_rank)
    std::printf("restart %d: resuming from the newest complete checkpoint\n", restart);
  const TrainState state =
      resume_state(find_resume_dir(), resume == "auto", main_rank, r, s, precision, run);
  if (main_rank) {
    write_file_atomic(r.output_dir + "/recipe.yaml", recipe_to_yaml(r));
  }
  return TrainLoop(s, state, run, precision).run();
}

}  // namespace trainer
