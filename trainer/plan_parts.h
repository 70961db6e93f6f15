// What the files of `trainer plan` share (plan.cpp: the command and its
// reports; plan_cpu.cpp: CPU mode's profile; plan_auto.cpp: parallel.auto;
// plan_calibrate.cpp: --calibrate). Not for other callers: trainer/plan.h
// is the interface.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/planner.h"
#include "trainer/plan.h"
#include "trainer/recipe.h"

namespace trainer {

// A figure in a report: %.6g.
std::string plan_number(double value);

// Data parallelism over dp ranks and nothing else: one stage, no tp, one
// micro-batch, no ZeRO-1 (the keys that only matter with pp or tp at defaults).
void set_plain_layout(ParallelRecipe& p, int64_t dp);

// CPU mode reads the data for a language model's vocabulary (tp must divide
// it): the recipe with model.vocab_size set from the corpus.
Recipe with_data_vocabulary(Recipe recipe);

// CPU mode's request for the recipe on `cluster`, its timer from block
// times profiled here; what was measured is appended to notes.
parallel::PlanRequest cpu_plan_request(const Recipe& recipe, const parallel::ModelDesc& model,
                                       const parallel::ClusterSpec& cluster,
                                       std::unique_ptr<parallel::BlockTimer>* timer,
                                       std::vector<std::string>* notes);

// --calibrate: the launcher of the two ranks, and one rank's part.
int calibrate_command(const PlanArgs& args);
int calibrate_rank(const PlanArgs& args);

}  // namespace trainer
