// What the files of the trainer's commands share (train.cpp: `trainer
// train`; eval_sample.cpp: `trainer eval` and `trainer sample`). Not for
// other callers: trainer/train.h is the interface.
#pragma once

#include "trainer/recipe.h"

namespace trainer {

// training.threads > 0: the number of CPU threads the kernels use.
void apply_threads(const Recipe& r);

}  // namespace trainer
