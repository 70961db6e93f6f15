// Error channels (docs/architecture.md "Errors").
//
// 1. Invariants and library calls: CHECK(cond) << context. On failure prints
//    "[rank R] file:line: CHECK failed: expr: context" and aborts. Backends add
//    their own (CUDA_CHECK, CUDNN_CHECK, UCS_CHECK) on top of check_fail().
// 2. What a user or the environment causes (a recipe, a data file, a
//    checkpoint, a dead peer): throw trainer::Error with a message that names
//    the file, key, line or rank and says what to do.
//
//   CHECK(x.dim() == 2) << "matmul expects a matrix, got " << x.shape_str();
//   if (!file) throw Error(cat("cannot open ", path, ": ", std::strerror(errno)));
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace trainer {

// The error type for user- and environment-caused failures.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Concatenates anything printable with operator<<.
template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

// The rank printed in every CHECK failure; set once by the comm layer.
void set_log_rank(int rank);
int log_rank();

[[noreturn]] void check_fail(const char* file, int line, const char* expr,
                             const std::string& message);

namespace detail {
class CheckFailStream {
 public:
  CheckFailStream(const char* file, int line, const char* expr)
      : file_(file), line_(line), expr_(expr) {}
  [[noreturn]] ~CheckFailStream() { check_fail(file_, line_, expr_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  const char* file_;
  int line_;
  const char* expr_;
  std::ostringstream stream_;
};
// Lets the failure branch of the ?: in CHECK be a void expression.
struct Voidify {
  void operator&(std::ostream&) {}
};
}  // namespace detail
}  // namespace trainer

#define TRAINER_LIKELY(x) __builtin_expect(!!(x), 1)

#define CHECK(cond)                \
  TRAINER_LIKELY(cond)             \
  ? (void)0                        \
  : ::trainer::detail::Voidify() & \
          ::trainer::detail::CheckFailStream(__FILE__, __LINE__, #cond).stream()

#define CHECK_EQ(a, b) CHECK((a) == (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_NE(a, b) CHECK((a) != (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_LT(a, b) CHECK((a) < (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_LE(a, b) CHECK((a) <= (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_GE(a, b) CHECK((a) >= (b)) << "(" << (a) << " vs " << (b) << ") "
