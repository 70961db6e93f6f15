#include "parallel/pipeline_eval.h"

#include "comm/collectives.h"
#include "core/autograd.h"
#include "parallel/pipeline_runtime.h"

namespace trainer::parallel {

PipelineEvalSums evaluate_pipeline(PipelineRuntime& runtime, Module& model, comm::Communicator& pp,
                                   int time_chunks, const PipelineEvalBatches& batches) {
  const PipelinePlan& plan = runtime.plan();
  const int last = plan.split().stage_of(plan.pieces() - 1);
  const bool sums_here = runtime.stage() == last;
  {
    autograd::NoGradGuard no_grad;
    model.eval();
    batches.start();
    const int K = time_chunks;
    for (int64_t m = 0; batches.next(); ++m)
      for (int k = 0; k < K; ++k) {
        const TensorList outputs = runtime.evaluate(m * K + k, batches.inputs(k, K));
        batches.outputs(outputs, sums_here);
      }
    runtime.finish_step();
    model.train();
  }
  // The last stage's sums, to every stage of this pipeline.
  PipelineEvalSums v = batches.sums();
  comm::broadcast(pp, v.data(), sizeof v, last);
  return v;
}

}  // namespace trainer::parallel
