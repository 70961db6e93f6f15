#include "trainer/train.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>

#include "core/cpu/cpu_backend.h"
#include "core/ops.h"
#include "optim/clip.h"
#include "trainer/checkpoint.h"
#include "trainer/metrics.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"

namespace trainer {

namespace {

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// Installs SIGTERM/SIGINT handlers for the lifetime of a run.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    old_term_ = std::signal(SIGTERM, on_stop_signal);
    old_int_ = std::signal(SIGINT, on_stop_signal);
  }
  ~StopSignals() {
    std::signal(SIGTERM, old_term_);
    std::signal(SIGINT, old_int_);
  }
  int received() const { return g_stop_signal.load(); }

 private:
  void (*old_term_)(int);
  void (*old_int_)(int);
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string checkpoint_root(const Recipe& r) { return r.output_dir + "/checkpoints"; }

void apply_threads(const Recipe& r) {
  if (r.training.threads > 0) set_num_threads(int(r.training.threads));
}

// The directory to resume from: --resume auto (newest complete, or none),
// or an explicit directory that must be a complete checkpoint.
std::optional<std::string> resume_dir(const std::string& resume, const Recipe& r) {
  if (resume.empty()) return std::nullopt;
  if (resume == "auto") {
    if (!std::filesystem::exists(checkpoint_root(r))) return std::nullopt;
    return CheckpointDir(checkpoint_root(r), r.training.keep_last).latest_complete();
  }
  if (!CheckpointDir::is_complete(resume))
    throw Error(
        cat("--resume ", resume, ": not a complete checkpoint directory (no trainer_state.json)"));
  return resume;
}

class TrainLoop {
 public:
  TrainLoop(Session& s, TrainState state, bool print)
      : s_(s),
        r_(s.recipe()),
        state_(state),
        print_(print),
        ckpt_(checkpoint_root(r_), r_.training.keep_last),
        log_(r_.output_dir) {}

  int run() {
    const int64_t total = s_.total_steps();
    const int64_t spe = s_.steps_per_epoch();
    const int64_t per_step = s_.micro_batch() * r_.training.grad_accum;
    t0_ = std::chrono::steady_clock::now();
    step_at_start_ = state_.step;
    while (state_.step < total) {
      data::Loader& loader = s_.train_loader();
      loader.start_epoch(state_.epoch, state_.position);
      for (int64_t k = state_.position / per_step; k < spe && state_.step < total; ++k) {
        if (!train_step(loader)) throw Error("the training loader ended an epoch early");
        bool epoch_end = k + 1 == spe;
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
        if (signals_.received()) {
          if (!(periodic || state_.step == total)) save();
          say(cat("received signal ", signals_.received(), ": checkpoint written at step ",
                  state_.step, ", exiting"));
          return 0;
        }
      }
    }
    summary();
    return 0;
  }

 private:
  // One optimizer step; false if the loader ran out of batches.
  bool train_step(data::Loader& loader) {
    const int64_t accum = r_.training.grad_accum;
    double loss_sum = 0;
    bool finite = true;
    data::Batch batch;
    for (int64_t m = 0; m < accum; ++m) {
      if (!loader.next(batch)) return false;
      s_.rekey_dropout(state_.step * accum + m);
      Tensor loss = cross_entropy(s_.forward(batch.images), batch.labels);
      double v = loss.item<double>();
      finite = finite && std::isfinite(v);
      loss_sum += v;
      if (finite) (accum == 1 ? loss : loss * (1.0 / double(accum))).backward();
      state_.position = batch.position;
      samples_ += batch.labels.numel();
    }
    double lr = s_.schedule().lr(state_.step);
    if (!finite) {
      ++state_.nonfinite_skipped;
      if (++nonfinite_in_a_row_ > r_.training.max_nonfinite)
        throw Error(cat("the loss was not finite for ", nonfinite_in_a_row_,
                        " steps in a row (training.max_nonfinite = ", r_.training.max_nonfinite,
                        ") at step ", state_.step, "; lower optimizer.lr or check the data"));
      say(cat("step ", state_.step, ": non-finite loss, step skipped"));
    } else {
      nonfinite_in_a_row_ = 0;
      if (r_.optimizer.clip_grad_norm > 0)
        last_grad_norm_ =
            optim::clip_grad_norm(s_.model().parameters(), r_.optimizer.clip_grad_norm);
      s_.optimizer().set_lr(lr);
      s_.optimizer().step();
    }
    s_.optimizer().zero_grad();
    ++state_.step;
    last_loss_ = loss_sum / double(accum);
    last_lr_ = lr;
    return true;
  }

  void log_train() {
    double elapsed = seconds_since(t0_);
    double rate = elapsed > 0 ? double(samples_) / elapsed : 0;
    // The ETA extrapolates from the steps of this run (not those before a resume).
    int64_t done = state_.step - step_at_start_;
    double eta = done > 0 ? elapsed / double(done) * double(s_.total_steps() - state_.step) : -1;
    say(progress_line(
        {state_.epoch, state_.step, s_.total_steps(), last_loss_, last_lr_, rate, eta}));
    Scalars sc{{"loss", last_loss_}, {"lr", last_lr_}, {"samples_per_second", rate}};
    if (r_.optimizer.clip_grad_norm > 0) sc.push_back({"grad_norm", last_grad_norm_});
    log_.write("train", state_.step, sc);
  }

  void evaluate() {
    auto t = std::chrono::steady_clock::now();
    EvalMetrics m = s_.evaluate();
    last_eval_ = m;
    bool best = m.top1 > state_.best_metric;
    if (best) state_.best_metric = m.top1;
    pending_best_ = pending_best_ || best;
    say(cat("eval step ", state_.step, ": loss ", m.loss, " | top1 ", m.top1, "% | top5 ", m.top5,
            "% | ", m.samples, " samples in ", format_duration(seconds_since(t)),
            best ? " (best)" : ""));
    log_.write("val", state_.step, {{"loss", m.loss}, {"top1", m.top1}, {"top5", m.top5}});
  }

  void save() {
    std::string tmp = ckpt_.begin(state_.step);
    s_.save(tmp, state_);
    std::string dir = ckpt_.commit(state_.step, pending_best_);
    pending_best_ = false;
    say(cat("checkpoint: ", dir));
  }

  void summary() {
    double elapsed = seconds_since(t0_);
    say(cat("done: ", state_.step, " steps in ", format_duration(elapsed), ", ",
            int64_t(elapsed > 0 ? double(samples_) / elapsed : 0), " samples/s; final eval top1 ",
            last_eval_.top1, "%, best ", state_.best_metric, "%; ", state_.nonfinite_skipped,
            " non-finite steps skipped"));
  }

  void say(const std::string& line) const {
    if (print_) std::printf("%s\n", line.c_str()), std::fflush(stdout);
  }

  Session& s_;
  const Recipe& r_;
  TrainState state_;
  bool print_;
  CheckpointDir ckpt_;
  MetricsLog log_;
  StopSignals signals_;
  std::chrono::steady_clock::time_point t0_;
  int64_t step_at_start_ = 0;
  int64_t samples_ = 0;
  int64_t nonfinite_in_a_row_ = 0;
  double last_loss_ = 0, last_lr_ = 0, last_grad_norm_ = 0;
  bool pending_best_ = false;
  EvalMetrics last_eval_;
};

}  // namespace

int train_command(const TrainArgs& args) {
  Recipe r = load_recipe(args.recipe, args.overrides);
  apply_threads(r);
  std::printf("recipe %s (resolved):\n%s", r.source.c_str(), recipe_to_yaml(r).c_str());
  Session s(r);
  std::printf("parallel layout: world 1 (dp=1, pp=1, tp=1), %d CPU threads\n", num_threads());
  std::printf("%lld steps (%lld per epoch), micro-batch %lld x grad_accum %lld\n",
              (long long)s.total_steps(), (long long)s.steps_per_epoch(),
              (long long)s.micro_batch(), (long long)r.training.grad_accum);
  if (args.dry_run) {
    std::printf("%s", s.summary().c_str());
    return 0;
  }
  if (!args.init_from.empty()) s.init_from(args.init_from, args.init_strict);
  TrainState state;
  if (std::optional<std::string> dir = resume_dir(args.resume, r)) {
    state = s.load(*dir);
    std::printf("resumed from %s at step %lld (epoch %lld, position %lld)\n", dir->c_str(),
                (long long)state.step, (long long)state.epoch, (long long)state.position);
  } else if (args.resume == "auto") {
    std::printf("no checkpoint under %s: starting from scratch\n", checkpoint_root(r).c_str());
  }
  std::filesystem::create_directories(r.output_dir);
  write_file_atomic(r.output_dir + "/recipe.yaml", recipe_to_yaml(r));
  return TrainLoop(s, state, true).run();
}

int eval_command(const EvalArgs& args) {
  Recipe r = load_recipe(args.recipe, args.overrides);
  apply_threads(r);
  Session s(r);
  std::string dir = args.checkpoint;
  if (!std::filesystem::is_directory(dir))
    throw Error(cat("--checkpoint ", dir, ": no such directory"));
  if (!CheckpointDir::is_complete(dir)) {
    std::optional<std::string> latest = CheckpointDir(dir, 1 << 30).latest_complete();
    if (!latest) throw Error(cat("--checkpoint ", dir, ": no complete checkpoint there"));
    dir = *latest;
  }
  TrainState state = s.load(dir);
  EvalMetrics m = s.evaluate();
  std::printf("eval %s (step %lld): loss %.4f | top1 %.2f%% | top5 %.2f%% | %lld samples\n",
              dir.c_str(), (long long)state.step, m.loss, m.top1, m.top5, (long long)m.samples);
  return 0;
}

}  // namespace trainer
