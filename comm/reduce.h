// The reduction math of the collectives, on raw buffers of a floating dtype
// (f32, bf16, f16; f64 too). bf16/f16 are loaded to f32, combined, and
// rounded back (core/dtype.h load/store_as), so every rank rounds the same way.
//
//   reduce_into(mine, received, count, DType::bf16, ReduceOp::sum);  // mine[i] = mine[i] +
//   received[i]
#pragma once

#include <cstddef>
#include <string_view>

#include "core/dtype.h"

namespace trainer::comm {

// avg reduces as sum and the collective scales its result by 1/size once.
enum class ReduceOp { sum, avg, max };
std::string_view reduce_op_name(ReduceOp op);

// dst[i] = dst[i] (op) src[i] for i < count; dst and src do not overlap.
void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);
// dst[i] = a[i] (op) b[i] for i < count; dst is a, b or overlaps neither. The
// same call with the same operands in the same places gives the same bits on
// every rank, NaN payloads included (x86 keeps the first operand's).
void reduce_pair(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);
// d0[i] = d1[i] = a[i] (op) b[i] for i < count, for avg then scaled by factor
// (rounded after the sum, as scale() would): the two ranks' halves of a
// shared-region allreduce in one pass. d0 and d1 are each a, b or overlap
// neither.
void reduce_pair_to_both(void* d0, void* d1, const void* a, const void* b, size_t count,
                         DType dtype, ReduceOp op, double factor);
// data[i] *= factor.
void scale(void* data, size_t count, DType dtype, double factor);

}  // namespace trainer::comm
