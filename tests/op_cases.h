// The op table: one list of op cases (tests/op_cases.cpp, built with the
// families of tests/op_families.h) that every registered backend runs
// against the reference kernels, in the spirit of ggml's test-backend-ops. A case names its op, the
// inputs (shapes, value ranges, layouts: strided, transposed, stride-0 broadcast, channels-last;
// index tensors), a function building the op from them with its attributes
// (axis, convolution and pooling attributes, heads, dropout key), the dtypes
// it runs in and the Reduction that gives its tolerance (tests/comparison.h).
//
// A run builds the inputs, runs the case forward and backward (the probe
// cotangent into every floating input's gradient) with the reference
// kernels and on the backend under test, and compares the output and every
// gradient. The CPU's fast kernels run it in test_core ("[ops]"), every
// other registered backend with a device in its "[cuda]" case, and
// op_coverage prints the matrix op x dtype x backend: ok, unsupported (the
// backend threw UnsupportedOp: it lacks the kernel) or FAILED. A case the
// reference cannot run is an error of the table and fails.
//
//   for (const OpCase& c : op_cases())
//     for (DType dtype : c.dtypes)
//       CaseResult r = run_case(c, dtype, Device{kCUDA, 0});  // r.outcome, r.detail
//
// A new backend needs no test of its own: registered (core/backend.h), it
// runs the whole table.
#pragma once

#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <string>
#include <vector>

#include "core/ops.h"
#include "tests/comparison.h"

namespace trainer::testing {

// How an input is laid out in memory (the values are the same).
enum class Layout {
  contiguous,
  strided,        // every other element of a wider buffer (testing.h's non_contiguous)
  transposed,     // the last two dims swapped in memory
  broadcast,      // dim 0 a stride-0 expansion of a single row
  channels_last,  // [N, C, H, W] seen over an NHWC buffer (core/ops_conv.h)
};

// One input of a case: values uniform in [lo, hi] in the case's dtype, or
// (index non-empty) an integer tensor of exactly these values.
struct Input {
  Input() = default;  // a 0-d tensor
  Input(std::initializer_list<int64_t> dims) : shape(dims) {}
  Input(Shape dims) : shape(std::move(dims)) {}

  Shape shape;
  double lo = -1.0, hi = 1.0;
  bool away_from_zero = false;  // magnitudes of at least 0.1: divisors, the kinks of abs and relu
  Layout layout = Layout::contiguous;
  std::vector<int64_t> index;      // an index tensor of index_dtype instead of random values
  DType index_dtype = DType::i64;  // i64 or i32
};

using OpFn = std::function<Tensor(const TensorList&)>;

struct OpCase {
  std::string op;       // the row of the coverage matrix: "add", "conv2d", "adamw_step"
  std::string variant;  // what this case exercises: shapes, layouts, attributes
  std::vector<Input> inputs;
  OpFn f;                  // the op on the inputs (on the device under test)
  Reduction reduction;     // the tolerance rule's description of the longest sum
  int lowp_roundings = 1;  // bf16 and f16: roundings on the longest path (Reduction::roundings)
  bool tf32 = false;       // f32 products may run on TF32 tensor cores (CUDA matmul, conv, RNN)
  std::vector<DType> dtypes = {DType::f32, DType::f64, DType::bf16, DType::f16};
};

// The table, built once.
const std::vector<OpCase>& op_cases();
// The ops of the table in order of first appearance: the matrix's rows.
std::vector<std::string> op_names(const std::vector<OpCase>& cases);

// The inputs of a case in dtype on device: the same values on every device.
TensorList make_inputs(const OpCase& c, DType dtype, Device device);

enum class Outcome { ok, unsupported, failed };
const char* outcome_name(Outcome outcome);  // "ok", "unsupported", "FAILED"

struct CaseResult {
  const OpCase* op_case = nullptr;
  DType dtype = DType::f32;
  Device device;
  std::string backend;  // the name of the backend that ran: "cpu", "cuda"
  Outcome outcome = Outcome::ok;
  std::string detail;  // why, when not ok
};

// Runs c in dtype on device's backend (on the CPU: the fast kernels) and
// with the reference kernels, and compares the outputs and the gradients of
// the floating inputs.
CaseResult run_case(const OpCase& c, DType dtype, Device device);
// Every case of cases in every dtype of its own, on device.
std::vector<CaseResult> run_cases(const std::vector<OpCase>& cases, Device device);

// A backend of the coverage matrix: results empty when no device was there.
struct BackendCoverage {
  std::string backend;
  bool has_device = true;
  std::vector<CaseResult> results;
};
// The coverage matrix: a row per op of cases, a column per backend and
// dtype, each cell the worst outcome of the op's cases ("-": none in that
// dtype), then every case not ok with its reason.
void print_coverage(std::ostream& os, const std::vector<OpCase>& cases,
                    const std::vector<BackendCoverage>& backends);

}  // namespace trainer::testing
