// Test helpers: the finite-difference gradient checker, fast-versus-reference
// comparison, tensor builders and closeness checks that name the index. The
// tolerance rule of fast kernels against the reference is tests/comparison.h's.
//
//   gradcheck([](const TensorList& in) { return tanh(in[0]) * in[1]; },
//             {rand_f64({3, 4}, gen), rand_f64({4}, gen)});
//   check_fast_vs_reference([](const TensorList& in) { return softmax(in[0], 1); },
//                           {rand_f32({5, 7}, gen)});
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "core/ops.h"
#include "tests/comparison.h"
// Catch2 has its own CHECK: project headers come first (their inline code is
// already expanded), then Catch's CHECK replaces ours in test code.
#undef CHECK
#include <catch2/catch.hpp>

namespace trainer::testing {

using Fn = std::function<Tensor(const TensorList&)>;

// A path under the temporary directory that belongs to this test process
// ("trainer_<name>_<pid>"): two checkouts testing at once, or ctest -j,
// never share one. Calling it again gives the same path. Whatever is there
// is removed when the process exits (not by forked children).
inline std::filesystem::path temp_path(const std::string& name) {
  struct Cleanup {
    const pid_t owner = ::getpid();
    std::vector<std::filesystem::path> paths;
    ~Cleanup() {
      std::error_code ignored;
      if (::getpid() == owner)
        for (const std::filesystem::path& p : paths) std::filesystem::remove_all(p, ignored);
    }
  };
  static Cleanup cleanup;
  std::filesystem::path p = std::filesystem::temp_directory_path() /
                            ("trainer_" + name + "_" + std::to_string(::getpid()));
  if (std::find(cleanup.paths.begin(), cleanup.paths.end(), p) == cleanup.paths.end())
    cleanup.paths.push_back(p);
  return p;
}

// temp_path(name), emptied: removed with its contents, then created unless
// create is false (for a run's output_dir, which the trainer makes).
inline std::filesystem::path fresh_temp_dir(const std::string& name, bool create = true) {
  const std::filesystem::path d = temp_path(name);
  std::filesystem::remove_all(d);
  if (create) std::filesystem::create_directories(d);
  return d;
}

// What a CHECK failure inside f prints (it aborts, so f runs in a forked
// child); empty when f returns normally.
inline std::string check_failure_of(const std::function<void()>& f) {
  int fd[2];
  if (::pipe(fd) != 0) return "pipe failed";
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(60);  // a child stuck after fork (a lock held by another thread) dies, never hangs
    ::dup2(fd[1], 2);
    ::close(fd[0]);
    f();
    ::_exit(0);
  }
  ::close(fd[1]);
  std::string printed;
  char buf[512];
  for (ssize_t n; (n = ::read(fd[0], buf, sizeof buf)) > 0;) printed.append(buf, size_t(n));
  ::close(fd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT ? printed : "";
}

// The message of the trainer::Error that f throws; empty when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Whether some line of a list of problems (or messages) contains text.
inline bool mentions(const std::vector<std::string>& lines, const std::string& text) {
  for (const std::string& l : lines)
    if (l.find(text) != std::string::npos) return true;
  return false;
}

// The lines, each ended by a newline (for INFO).
inline std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

inline Tensor rand_tensor(const Shape& shape, Generator& gen, double lo = -1.0, double hi = 1.0,
                          DType dtype = DType::f32) {
  return uniform(shape, lo, hi, gen, DType::f32).to(dtype);
}
inline Tensor rand_f64(const Shape& shape, Generator& gen, double lo = -1.0, double hi = 1.0) {
  return uniform(shape, lo, hi, gen, DType::f64);
}

// Checks |a - b| <= atol + rtol |b| elementwise; reports the first failure.
inline void require_close(const Tensor& actual, const Tensor& expected, double rtol, double atol,
                          const std::string& what = "") {
  INFO(what);
  REQUIRE(actual.defined());
  REQUIRE(expected.defined());
  REQUIRE(shape_str(actual.shape()) == shape_str(expected.shape()));
  const std::string why = mismatch(actual, expected, rtol, atol);
  if (!why.empty()) FAIL(what + ": " + why);
}

// Compares analytic gradients of sum(f(inputs) * v) with central finite
// differences in double. Inputs must be f64; those not floating are passed
// through. eps is the step; tolerances are on |analytic - numeric|.
inline void gradcheck(const Fn& f, TensorList inputs, double eps = 1e-6, double atol = 1e-5,
                      double rtol = 1e-4) {
  for (Tensor& t : inputs)
    if (t.dtype() == DType::f64) t = t.detach().contiguous().requires_grad_();
  Tensor out = f(inputs);
  REQUIRE(out.dtype() == DType::f64);
  Tensor v = probe_like(out);
  sum(out * v).backward();
  for (size_t k = 0; k < inputs.size(); ++k) {
    Tensor x = inputs[k];
    if (x.dtype() != DType::f64) continue;
    Tensor numeric = zeros(x.shape(), DType::f64);
    double* px = x.data<double>();
    double* pn = numeric.data<double>();
    autograd::NoGradGuard no_grad;
    for (int64_t i = 0; i < x.numel(); ++i) {
      double orig = px[i];
      px[i] = orig + eps;
      double plus = sum(f(inputs) * v).item<double>();
      px[i] = orig - eps;
      double minus = sum(f(inputs) * v).item<double>();
      px[i] = orig;
      pn[i] = (plus - minus) / (2 * eps);
    }
    Tensor analytic = x.grad().defined() ? x.grad() : zeros(x.shape(), DType::f64);
    require_close(analytic, numeric, rtol, atol, "gradient of input " + std::to_string(k));
  }
}

// Runs f (forward and backward) with the CPU fast kernels and with the
// reference kernels on the same inputs and compares outputs and gradients,
// each with tolerance(its dtype, r).
inline void check_fast_vs_reference(const Fn& f, const TensorList& inputs,
                                    const Reduction& r = {}) {
  auto run = [&](TensorList& grads) {
    TensorList in;
    for (const Tensor& t : inputs)
      in.push_back(is_floating(t.dtype()) ? t.detach().requires_grad_() : t);
    Tensor out = f(in);
    if (is_floating(out.dtype()) && out.requires_grad()) {
      Tensor v = probe_like(out);
      out.backward(v);
    }
    for (const Tensor& t : in) grads.push_back(is_floating(t.dtype()) ? t.grad() : Tensor());
    return out;
  };
  TensorList fast_grads, ref_grads;
  Tensor fast = run(fast_grads);
  Tensor ref;
  {
    ReferenceKernelsGuard guard;
    ref = run(ref_grads);
  }
  const Tolerance out_tol = tolerance(fast.dtype(), r);
  require_close(fast, ref, out_tol.rtol, out_tol.atol, "forward");
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!ref_grads[k].defined()) continue;
    const Tolerance tol = tolerance(fast_grads[k].dtype(), r);
    require_close(fast_grads[k], ref_grads[k], tol.rtol, tol.atol,
                  "gradient of input " + std::to_string(k));
  }
}

// [cuda] tests call this first: without a GPU the test exits 77, which CTest
// reports as skipped.
void require_gpu_or_skip();

// A multi-process worker run passed: the job exited 0, every rank printed
// its "rank r: ..." summary, a summary says " 0 failed" and no line says
// "mismatch". The output is attached to every failure.
inline void require_ranks_passed(int code, const std::string& output, int nproc) {
  INFO(output);
  REQUIRE(code == 0);
  for (int r = 0; r < nproc; ++r)
    CHECK(output.find("rank " + std::to_string(r) + ": ") != std::string::npos);
  CHECK(output.find(" 0 failed") != std::string::npos);
  CHECK(output.find("mismatch") == std::string::npos);
}

}  // namespace trainer::testing
