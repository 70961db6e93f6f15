// The op table's runner (tests/op_cases.h): inputs, one case on one backend
// against the reference kernels, and the coverage matrix.
#include <algorithm>
#include <exception>
#include <iomanip>
#include <map>
#include <ostream>
#include <sstream>

#include "core/ops_conv.h"
#include "tests/op_cases.h"

namespace trainer::testing {
namespace {

// FNV-1a of the case's name: its inputs stay the same when cases are added.
uint64_t case_seed(const OpCase& c) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : c.op + "/" + c.variant) h = (h ^ uint8_t(ch)) * 1099511628211ull;
  return h;
}

// Values of one input on the CPU in the shape they are drawn in (before
// the layout's view), in dtype.
Tensor draw(const Input& in, const Shape& shape, DType dtype, Generator& gen) {
  Tensor x = uniform(shape, in.lo, in.hi, gen, DType::f32);
  if (in.away_from_zero) {
    std::vector<float> v = x.to_vector<float>();
    for (float& e : v) e = e < 0 ? std::min(e, -0.1f) : std::max(e, 0.1f);
    x = from_vector(v, shape);
  }
  return x.to(dtype);
}

Tensor make_input(const Input& in, DType dtype, Device device, Generator& gen) {
  if (!in.index.empty()) return from_vector(in.index, in.shape).to(in.index_dtype).to(device);
  Shape drawn = in.shape;
  if (in.layout == Layout::transposed) std::swap(drawn[drawn.size() - 2], drawn.back());
  if (in.layout == Layout::broadcast) drawn.front() = 1;
  Tensor x = draw(in, drawn, dtype, gen).to(device);
  switch (in.layout) {
    case Layout::contiguous:
      return x;
    case Layout::strided:
      return non_contiguous(x);
    case Layout::transposed:
      return x.transpose(-2, -1);
    case Layout::broadcast:
      return x.expand(in.shape);
    case Layout::channels_last:
      return to_channels_last(x);
  }
  return x;
}

// Forward, then backward of the probe cotangent.
struct Run {
  Tensor out;
  TensorList grads;  // of each input; undefined where none
};

Run run_once(const OpCase& c, const TensorList& inputs) {
  TensorList in;
  for (const Tensor& t : inputs)
    in.push_back(is_floating(t.dtype()) ? t.detach().requires_grad_() : t);
  Run r{c.f(in), {}};
  if (r.out.requires_grad()) r.out.backward(probe_like(r.out).to(r.out.device()));
  for (const Tensor& t : in) r.grads.push_back(t.requires_grad() ? t.grad() : Tensor());
  r.out = r.out.detach();
  return r;
}

// The tolerance of a result of dtype t of case c computed on device.
Tolerance tolerance_of(const OpCase& c, DType t, Device device) {
  Reduction r = c.reduction;
  if (t == DType::bf16 || t == DType::f16) r.roundings = std::max(r.roundings, c.lowp_roundings);
  // CUDA's f32 GEMMs, convolutions and RNNs take cuBLASLt's and cuDNN's TF32 math.
  if (c.tf32 && t == DType::f32 && device.is_cuda() && !r.exact) return tf32_tolerance(r);
  return tolerance(t, r);
}

// Why got is not the reference's result within the tolerance; empty when it is.
std::string compare(const OpCase& c, const Run& got, const Run& ref, Device device) {
  if (got.out.dtype() != ref.out.dtype())
    return cat("forward: dtype ", got.out.dtype(), ", the reference's ", ref.out.dtype());
  const Device host{};
  Tolerance tol = tolerance_of(c, ref.out.dtype(), device);
  std::string why = mismatch(got.out.to(host), ref.out, tol.rtol, tol.atol);
  if (!why.empty()) return "forward: " + why;
  for (size_t k = 0; k < ref.grads.size(); ++k) {
    if (!ref.grads[k].defined()) continue;
    const std::string what = cat("gradient of input ", k, ": ");
    if (!got.grads[k].defined()) return what + "none";
    tol = tolerance_of(c, ref.grads[k].dtype(), device);
    why = mismatch(got.grads[k].to(host), ref.grads[k], tol.rtol, tol.atol);
    if (!why.empty()) return what + why;
  }
  return "";
}

}  // namespace

std::vector<std::string> op_names(const std::vector<OpCase>& cases) {
  std::vector<std::string> names;
  for (const OpCase& c : cases)
    if (std::find(names.begin(), names.end(), c.op) == names.end()) names.push_back(c.op);
  return names;
}

TensorList make_inputs(const OpCase& c, DType dtype, Device device) {
  Generator gen(case_seed(c));
  TensorList inputs;
  for (const Input& in : c.inputs) inputs.push_back(make_input(in, dtype, device, gen));
  return inputs;
}

const char* outcome_name(Outcome outcome) {
  switch (outcome) {
    case Outcome::ok:
      return "ok";
    case Outcome::unsupported:
      return "unsupported";
    case Outcome::failed:
      return "FAILED";
  }
  return "?";
}

CaseResult run_case(const OpCase& c, DType dtype, Device device) {
  CaseResult result;
  result.op_case = &c;
  result.dtype = dtype;
  result.device = device;
  result.backend = backend(device).name();
  auto fail = [&](std::string why) {
    result.outcome = Outcome::failed;
    result.detail = std::move(why);
    return result;
  };
  const TensorList host_inputs = make_inputs(c, dtype, Device{});
  Run ref;
  try {
    ReferenceKernelsGuard reference;
    ref = run_once(c, host_inputs);
  } catch (const std::exception& e) {
    return fail(cat("the reference cannot run this case (an error of the table): ", e.what()));
  }
  Run got;
  try {
    got = run_once(c, device.is_cpu() ? host_inputs : make_inputs(c, dtype, device));
  } catch (const UnsupportedOp& e) {
    result.outcome = Outcome::unsupported;
    result.detail = e.what();
    return result;
  } catch (const std::exception& e) {
    return fail(cat("error: ", e.what()));
  }
  std::string why = compare(c, got, ref, device);
  return why.empty() ? result : fail(std::move(why));
}

std::vector<CaseResult> run_cases(const std::vector<OpCase>& cases, Device device) {
  std::vector<CaseResult> results;
  for (const OpCase& c : cases)
    for (DType dtype : c.dtypes) results.push_back(run_case(c, dtype, device));
  return results;
}

void print_coverage(std::ostream& os, const std::vector<OpCase>& cases,
                    const std::vector<BackendCoverage>& backends) {
  const DType dtypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
  const std::vector<std::string> ops = op_names(cases);
  int op_width = 2;
  for (const std::string& op : ops) op_width = std::max(op_width, int(op.size()));
  std::map<std::string, int> case_count;
  for (const OpCase& c : cases) ++case_count[c.op];
  const int cell = 13;  // "unsupported" and a gap
  // Lines are built padded, then printed without their trailing blanks.
  std::ostringstream line;
  auto end_line = [&] {
    std::string text = line.str();
    text.erase(text.find_last_not_of(' ') + 1);
    os << text << "\n";
    line.str("");
  };
  // The worst outcome of op's cases in dtype t ("-": none).
  auto cell_of = [](const BackendCoverage& b, const std::string& op, DType t) -> const char* {
    bool any = false;
    Outcome worst = Outcome::ok;
    for (const CaseResult& r : b.results) {
      if (r.op_case->op != op || r.dtype != t) continue;
      any = true;
      worst = std::max(worst, r.outcome);
    }
    return any ? outcome_name(worst) : "-";
  };

  os << "coverage of the op table: " << cases.size()
     << " cases, forward and every input gradient against the reference kernels\n"
     << "ok: within the tolerance; unsupported: the backend lacks the kernel; FAILED: beyond "
     << "the tolerance, or an error; -: no case in that dtype\n\n";
  line << std::left << std::setw(op_width) << ""
       << "  cases";
  for (const BackendCoverage& b : backends)
    if (b.has_device) line << " | " << std::setw(4 * cell) << b.backend;
  end_line();
  line << std::setw(op_width) << "op"
       << "       ";
  for (const BackendCoverage& b : backends) {
    if (!b.has_device) continue;
    line << " | ";
    for (DType t : dtypes) line << std::setw(cell) << dtype_name(t);
  }
  end_line();
  for (const std::string& op : ops) {
    line << std::setw(op_width) << op << "  " << std::right << std::setw(5) << case_count[op]
         << std::left;
    for (const BackendCoverage& b : backends) {
      if (!b.has_device) continue;
      line << " | ";
      for (DType t : dtypes) line << std::setw(cell) << cell_of(b, op, t);
    }
    end_line();
  }
  for (const BackendCoverage& b : backends)
    if (!b.has_device) os << "\n" << b.backend << ": registered, but no device here: not run\n";
  bool header = false;
  for (const BackendCoverage& b : backends)
    for (const CaseResult& r : b.results) {
      if (r.outcome == Outcome::ok) continue;
      if (!header) os << "\ncases not ok:\n";
      header = true;
      os << "  " << outcome_name(r.outcome) << " " << b.backend << " " << r.op_case->op << " ["
         << r.op_case->variant << "] " << dtype_name(r.dtype) << ": " << r.detail << "\n";
    }
}

}  // namespace trainer::testing
