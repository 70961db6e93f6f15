// Training-step schedules as data (DESIGN.md "The step executor"): one
// list of actions per pipeline stage, over the micro-batches of one
// optimizer step. A generator produces the table, check_schedule() proves it
// runnable before anything executes, the trainer's step executor
// (trainer/step_executor.h) runs a stage's list, and a planner can simulate
// the same table.
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
// Pipeline schedules (GPipe, 1F1B, interleaved, zero-bubble) will be more
// generators of the same table, with send/recv actions between stages and
// backward split into its input and weight halves where they pay.
//
// Glossary: stage = one pipeline rank's place (0 .. stages-1); chunk = one
// of the model pieces a stage holds (interleaved schedules hold several; the
// piece is virtual stage chunk * stages + stage); micro-batch = one slice of
// the step's batch, 0 .. micro_batches-1.
#pragma once

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

// What makes a table unrunnable, one line each (empty: it is runnable):
// actions out of range; a (micro-batch, chunk) not forwarded or not
// backwarded exactly once per stage (B, or I then W); a backward before its
// forward; a forward on a virtual stage after the first without its
// activation received, a backward on one before the last without its
// gradient received; a send without its matching receive or the reverse;
// grad_sync not exactly once after every backward and optimizer_step not
// exactly once, last, after it; and receives that can never be satisfied
// (the stages' lists, run together with blocking receives, deadlock).
std::vector<std::string> schedule_problems(const Schedule& schedule);
// CHECK-fails listing schedule_problems() (generators are code: a bad table is a bug).
void check_schedule(const Schedule& schedule);

}  // namespace trainer::parallel
