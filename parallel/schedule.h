// Training-step schedules as data (docs/architecture.md "The step executor"): one
// list of actions per pipeline stage, over the micro-batches of one
// optimizer step. A generator produces the table, check_schedule() proves it
// runnable before anything executes, the trainer's step executor
// (trainer/step_executor.h) runs a stage's list, and the simulator
// (parallel/pipeline_sim.h) times the same table.
//
// With one stage the table is gradient accumulation: for M micro-batches
//   stage 0:  F0 B0 F1 B1 ... F(M-1) B(M-1) sync step
// (each backward right after its forward, so one micro-batch's activations
// are alive at a time; the gradient sync after the last backward).
//
//   Schedule s = one_stage_schedule(4);
//   check_schedule(s);                       // CHECK-fails with every problem found
//   for (const Action& a : s.stages[0]) ...  // "F0", "B0", ..., "sync", "step"
//
// Pipeline schedules over P stages are more generators of the same table:
//
//   Schedule s = make_schedule("1f1b", 4, 8);  // or gpipe_schedule(4, 8), ...
//   to_string(s);  // "stage 0: F0 sendA0 F1 sendA1 F2 sendA2 F3 sendA3 recvG0 B0 ..."
//   peak_in_flight(s);  // {4, 3, 2, 1}
//
//   gpipe         every forward, then every backward (Huang et al. 2019)
//   1f1b          stage s runs min(P-s-1, M) warm-up forwards, then one
//                 forward and one backward in turn, then the remaining
//                 backwards (PipeDream-Flush, Megatron-LM's 1F1B)
//   interleaved   1F1B over V chunks per stage, chunk c of stage s being
//                 virtual stage c*P + s (Narayanan et al. 2021); M must be
//                 a multiple of P; the bubble shrinks V-fold
//   zbh1          1F1B with the backward split into its input half I and
//                 weight half W; stage s holds back s weight halves and runs
//                 them where 1F1B idles (ZB-H1 of Qi et al. 2023, "Zero
//                 Bubble Pipeline Parallelism")
//   wavefront     every forward, then every backward in reverse order: for
//                 micro-batches that are consecutive time chunks of one
//                 sequence (parallel.time_chunks), where chunk m's backward
//                 needs the gradient of the state chunk m + 1 started from
//                 (a recurrent layer per stage, as a wavefront over time)
//
// In every table but the wavefront the backwards of one chunk run in
// micro-batch order (and so do the weight halves), so gradients accumulate
// in the order of gradient accumulation and a pipeline step gives the same
// bits. Messages
// sit next to the compute they serve: recvA before its F, sendA right after
// it, recvG before its B or I, sendG right after it. The runtime treats
// sends as non-blocking and receives as blocking until the data has arrived
// (posted early), which is the model check_schedule() proves deadlock-free.
//
// Glossary: stage = one pipeline rank's place (0 .. stages-1); chunk = one
// of the model pieces a stage holds (interleaved schedules hold several; the
// piece is virtual stage chunk * stages + stage); micro-batch = one slice of
// the step's batch, 0 .. micro_batches-1; P = stages, M = micro-batches,
// V = chunks per stage; in flight = forwarded on a stage and not yet
// backwarded there (see InFlightUntil).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trainer::parallel {

enum class ActionKind {
  forward,          // F: the chunk's forward; on the last virtual stage, through the loss
  backward,         // B: the chunk's whole backward (input and weight gradients)
  backward_input,   // I: the gradient of the chunk's input only
  backward_weight,  // W: the gradient of the chunk's weights only (after its I)
  send_activation,  // to the next virtual stage, after F
  recv_activation,  // from the previous virtual stage, before F
  send_gradient,    // to the previous virtual stage, after B or I
  recv_gradient,    // from the next virtual stage, before B or I
  grad_sync,        // the data-parallel gradient reduction is complete
  optimizer_step,   // clip, update, zero the gradients
};

struct Action {
  ActionKind kind = ActionKind::forward;
  int micro_batch = -1;  // -1 for grad_sync and optimizer_step
  int chunk = 0;
  bool operator==(const Action&) const = default;
};

// "F3", "B3", "I3", "W3", "sendA3", "recvA3", "sendG3", "recvG3", "sync",
// "step"; a chunk other than 0 is appended as ".c1".
std::string to_string(const Action& action);

struct Schedule {
  std::string name;  // "one-stage", "gpipe", "1f1b", ...
  int micro_batches = 1;
  int chunks = 1;                           // model chunks per stage
  std::vector<std::vector<Action>> stages;  // the actions of each stage, in order
};
// "stage 0: F0 B0 F1 B1 sync step".
std::string to_string(const Schedule& schedule);

// Gradient accumulation over micro_batches (>= 1) on one stage.
Schedule one_stage_schedule(int micro_batches);

// The pipeline generators. Each throws trainer::Error when stages,
// micro_batches or chunks is below 1, or (interleaved) when micro_batches is
// not a multiple of stages.
Schedule gpipe_schedule(int stages, int micro_batches);
Schedule one_f_one_b_schedule(int stages, int micro_batches);
Schedule interleaved_schedule(int stages, int micro_batches, int chunks);
Schedule zero_bubble_h1_schedule(int stages, int micro_batches);
Schedule wavefront_schedule(int stages, int micro_batches);

// A message between virtual stages, (is gradient, micro-batch, receiving
// virtual stage), as one index of a flat table of count() entries, in the
// order of those tuples. The checker and the simulator keep their
// per-message state in such tables (maps took most of a large plan's time).
struct MessageIndex {
  int micro_batches, virtual_stages;
  size_t operator()(bool gradient, int micro_batch, int virtual_stage) const {
    return (size_t(gradient) * size_t(micro_batches) + size_t(micro_batch)) *
               size_t(virtual_stages) +
           size_t(virtual_stage);
  }
  size_t count() const { return 2 * size_t(micro_batches) * size_t(virtual_stages); }
};

// "gpipe", "1f1b", "interleaved", "zbh1", "wavefront": the names
// make_schedule() takes.
const std::vector<std::string>& schedule_names();
// The generator of that name. chunks > 1 is for "interleaved" only (the
// others throw). One stage is gradient accumulation (one_stage_schedule)
// whichever the schedule. An unknown name throws trainer::Error listing the
// known ones.
Schedule make_schedule(const std::string& name, int stages, int micro_batches, int chunks = 1);
// The largest schedule the generators build: stages x micro-batches x chunks
// forward passes per step (about six actions each). Larger asks throw
// Error: such a table takes seconds to build and simulate, and no step of
// that many micro-batches is worth its bubble-free share.
inline constexpr int64_t kMaxSchedulePasses = int64_t(1) << 18;

// When a split backward frees a micro-batch's activations. A whole backward
// B frees them; of a split one, the input half I frees the bulk (the
// activations inside the chunk) and the weight half W holds only what it
// reads (each layer's input and output gradient). backward_input is how the
// zero-bubble paper counts, and how ZB-H1 keeps 1F1B's peak; backward_weight
// counts until W, the stricter bound.
enum class InFlightUntil { backward_input, backward_weight };

// The most (micro-batch, chunk) pairs in flight at once on each stage.
// GPipe: M; 1F1B and ZB-H1: min(P - s, M) on stage s (ZB-H1 counted until
// W: min(P, M)).
std::vector<int> peak_in_flight(const Schedule& schedule,
                                InFlightUntil until = InFlightUntil::backward_input);

// What a stage can hold, for schedule_problems().
struct ScheduleLimits {
  // Most (micro-batch, chunk) pairs in flight on each stage: one value per
  // stage, or one for every stage; empty or 0: no limit.
  std::vector<int> max_in_flight{};
  InFlightUntil until = InFlightUntil::backward_input;
};

// What makes a table unrunnable, one line each (empty: it is runnable):
// actions out of range; a (micro-batch, chunk) not forwarded or not
// backwarded exactly once per stage (B, or I then W); a backward before its
// forward; a forward on a virtual stage after the first without its
// activation received, a backward on one before the last without its
// gradient received; a send without its matching receive or the reverse;
// grad_sync not exactly once after every backward and optimizer_step not
// exactly once, last, after it; and receives that can never be satisfied
// (the stages' lists, run together with blocking receives, deadlock).
// Each line names the stage, the action's index and text, and the partner
// it lacks ("stage 1 action 0 (F0): forward before its activation is
// received (no recvA0 before it)").
std::vector<std::string> schedule_problems(const Schedule& schedule);
// The same, and a stage holding more in flight than its limit: "stage 0
// action 6 (F3): 4 micro-batches in flight, above the limit of 3".
std::vector<std::string> schedule_problems(const Schedule& schedule, const ScheduleLimits& limits);
// CHECK-fails listing schedule_problems() (generators are code: a bad table is a bug).
void check_schedule(const Schedule& schedule);

}  // namespace trainer::parallel
