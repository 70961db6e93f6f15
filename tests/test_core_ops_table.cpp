// The op table (tests/op_cases.h) on every registered backend: the CPU's
// fast kernels always, every other backend with a device in the [cuda] case
// (skipped without one). Then the runner itself: a kernel that lacks an op
// is reported as unsupported, one that is off as FAILED with the element,
// a case the reference cannot run as an error of the table; and the
// coverage matrix prints a row per op.
#include <algorithm>
#include <set>
#include <sstream>

#include "tests/op_cases.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

std::string label(const CaseResult& r) {
  return cat(r.backend, " ", r.op_case->op, " [", r.op_case->variant, "] ", dtype_name(r.dtype));
}

// Every case of the table on device: failures fail the test, unsupported
// kernels are listed (the backend's coverage, not an error).
void require_table_passes(Device device) {
  const std::vector<CaseResult> results = run_cases(op_cases(), device);
  int ok = 0, unsupported = 0;
  for (const CaseResult& r : results) {
    if (r.outcome == Outcome::failed) FAIL_CHECK(label(r) << ": " << r.detail);
    if (r.outcome == Outcome::unsupported) {
      WARN(label(r) << ": unsupported: " << r.detail);
      ++unsupported;
    }
    ok += r.outcome == Outcome::ok;
  }
  INFO(backend(device).name() << ": " << ok << " ok, " << unsupported << " unsupported of "
                              << results.size());
  CHECK(ok + unsupported == int(results.size()));
}

// The words of the line of printed that starts with first (none when no line does).
std::vector<std::string> row_of(const std::string& printed, const std::string& first) {
  std::istringstream lines(printed);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::vector<std::string> row;
    for (std::string w; words >> w;) row.push_back(w);
    if (!row.empty() && row[0] == first) return row;
  }
  return {};
}

// A case on the CPU whose fast path is f_fast and reference path f_ref.
OpCase split_case(std::string op, OpFn f_fast, OpFn f_ref) {
  return {.op = std::move(op),
          .variant = "[7, 33]",
          .inputs = {{7, 33}},
          .f =
              [=](const TensorList& t) {
                const bool reference = &backend(t[0].device()) == &reference_backend();
                return reference ? f_ref(t) : f_fast(t);
              },
          .reduction = {.length = 1}};
}

}  // namespace

TEST_CASE("op table: the CPU fast kernels match the reference on every case", "[ops]") {
  require_table_passes(Device{});
}

// Tagged [cuda] alone: without a GPU it exits 77 (skipped), so "[ops]" runs
// everything else.
TEST_CASE("op table: every other registered backend matches the reference", "[cuda]") {
  std::vector<Device> devices;
  for (DeviceKind kind : registered_device_kinds())
    if (kind != kCPU && backend(Device{kind}).device_count() > 0) devices.push_back(Device{kind});
  if (devices.empty()) require_gpu_or_skip();
  for (Device device : devices) {
    INFO(device);
    require_table_passes(device);
  }
}

TEST_CASE("op table: every case has inputs, dtypes and a name of its own", "[ops]") {
  std::set<std::string> names;
  for (const OpCase& c : op_cases()) {
    INFO(c.op << " [" << c.variant << "]");
    CHECK(!c.op.empty());
    CHECK(!c.inputs.empty());
    CHECK(!c.dtypes.empty());
    CHECK(c.f);
    CHECK(names.insert(c.op + " [" + c.variant + "]").second);
    // The same values on every call (and so on every device).
    TensorList a = make_inputs(c, c.dtypes[0], Device{}), b = make_inputs(c, c.dtypes[0], Device{});
    for (size_t k = 0; k < a.size(); ++k) require_close(a[k], b[k], 0, 0, "input");
  }
  // The families the table promises.
  const std::vector<std::string> ops = op_names(op_cases());
  for (const char* op :
       {"add",           "sub",        "mul",        "div",         "pow",          "neg",
        "exp",           "log",        "tanh",       "sigmoid",     "relu",         "gelu_erf",
        "gelu_tanh",     "sqrt",       "sum",        "mean",        "max",          "matmul",
        "bmm",           "linear",     "softmax",    "log_softmax", "layer_norm",   "batch_norm",
        "conv2d",        "max_pool2d", "avg_pool2d", "embedding",   "index_select", "gather",
        "cross_entropy", "attention",  "lstm",       "dropout",     "sgd_step",     "adamw_step"}) {
    INFO(op);
    CHECK(std::find(ops.begin(), ops.end(), op) != ops.end());
  }
}

TEST_CASE("op table runner: unsupported, off and table errors are told apart", "[ops]") {
  auto doubled = [](const TensorList& t) { return t[0] * 2.0; };
  SECTION("a kernel the backend lacks: unsupported, naming the op and backend") {
    OpCase c = split_case(
        "lacking",
        [](const TensorList&) -> Tensor {
          throw UnsupportedOp("op 'lacking' is not available on the cpu backend");
        },
        doubled);
    CaseResult r = run_case(c, DType::f32, Device{});
    CHECK(r.outcome == Outcome::unsupported);
    CHECK(r.detail == "op 'lacking' is not available on the cpu backend");
  }
  SECTION("a result off by more than the tolerance: FAILED, naming the element") {
    OpCase c = split_case(
        "off", [](const TensorList& t) { return t[0] * 2.0 + 1e-3; }, doubled);
    CaseResult r = run_case(c, DType::f32, Device{});
    CHECK(r.outcome == Outcome::failed);
    CHECK_THAT(r.detail, Catch::StartsWith("forward: mismatch at flat index 0 of shape [7, 33]"));
  }
  SECTION("a gradient off: FAILED, naming the input") {
    // The same forward values; the fast path's derivative is 2.001.
    OpCase c = split_case(
        "grad_off",
        [](const TensorList& t) { return t[0].detach() * 2.0 + (t[0] - t[0].detach()) * 2.001; },
        doubled);
    CaseResult r = run_case(c, DType::f64, Device{});
    CHECK(r.outcome == Outcome::failed);
    CHECK_THAT(r.detail, Catch::StartsWith("gradient of input 0: mismatch at flat index 0"));
  }
  SECTION("any other error of the backend: FAILED") {
    OpCase c = split_case(
        "throws", [](const TensorList&) -> Tensor { throw Error("out of memory"); }, doubled);
    CaseResult r = run_case(c, DType::f32, Device{});
    CHECK(r.outcome == Outcome::failed);
    CHECK(r.detail == "error: out of memory");
  }
  SECTION("a case the reference cannot run: FAILED as an error of the table") {
    OpCase c = split_case("no_reference", doubled,
                          [](const TensorList&) -> Tensor { throw Error("no such dtype"); });
    CaseResult r = run_case(c, DType::f32, Device{});
    CHECK(r.outcome == Outcome::failed);
    CHECK_THAT(r.detail,
               Catch::Contains("an error of the table") && Catch::Contains("no such dtype"));
  }
  SECTION("the backend's own lack of a kernel is UnsupportedOp") {
    struct Bare : Backend {
      const char* name() const override { return "bare"; }
    } bare;
    const std::string why = error_of([&] { bare.matmul(Tensor(), Tensor(), Tensor()); });
    CHECK(why == "op 'matmul' is not available on the bare backend");
    CHECK_THROWS_AS(bare.layer_norm_forward({}, {}, {}, 1e-5, {}, {}, {}), UnsupportedOp);
  }
}

TEST_CASE("op coverage matrix: a row per op, a column per dtype, the cases not ok", "[ops]") {
  const std::vector<OpCase> cases = {
      split_case(
          "good", [](const TensorList& t) { return t[0] * 2.0; },
          [](const TensorList& t) { return t[0] * 2.0; }),
      split_case(
          "lacking",
          [](const TensorList&) -> Tensor {
            throw UnsupportedOp("op 'lacking' is not available on the cpu backend");
          },
          [](const TensorList& t) { return t[0]; }),
      split_case(
          "off", [](const TensorList& t) { return t[0] + 1.0; },
          [](const TensorList& t) { return t[0]; }),
  };
  std::ostringstream out;
  print_coverage(out, cases, {{"cpu", true, run_cases(cases, Device{})}, {"cuda", false, {}}});
  const std::string printed = out.str();
  INFO(printed);
  using Row = std::vector<std::string>;
  CHECK(row_of(printed, "op") == Row{"op", "|", "f32", "f64", "bf16", "f16"});
  CHECK(row_of(printed, "good") == Row{"good", "1", "|", "ok", "ok", "ok", "ok"});
  CHECK(row_of(printed, "lacking") ==
        Row{"lacking", "1", "|", "unsupported", "unsupported", "unsupported", "unsupported"});
  CHECK(row_of(printed, "off") == Row{"off", "1", "|", "FAILED", "FAILED", "FAILED", "FAILED"});
  CHECK(printed.find("cuda: registered, but no device here: not run") != std::string::npos);
  CHECK(printed.find("unsupported cpu lacking [[7, 33]] bf16: op 'lacking' is not available") !=
        std::string::npos);
  CHECK(printed.find("FAILED cpu off [[7, 33]] f64: forward: mismatch at flat index 0") !=
        std::string::npos);
  // The whole table: one row per op, "-" where it was not run.
  std::ostringstream table;
  print_coverage(table, op_cases(), {{"cpu", true, {}}});
  for (const std::string& op : op_names(op_cases())) {
    INFO(op);
    const Row row = row_of(table.str(), op);
    REQUIRE(row.size() == 7);
    CHECK(row[1] == std::to_string(std::count_if(op_cases().begin(), op_cases().end(),
                                                 [&](const OpCase& c) { return c.op == op; })));
  }
}
