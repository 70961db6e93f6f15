#include "trainer/numbers.h"

#include <CLI/CLI.hpp>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/check.h"

namespace trainer {

std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
}

std::string range_text(double lo, double hi) {
  return cat("[", number_text(lo), ", ", number_text(hi), "]");
}

namespace {

// Leading blanks are skipped by strtod and strtoll; a value with them is
// not one the user meant to give.
bool starts_with_blank(const std::string& text) {
  return !text.empty() && std::isspace(static_cast<unsigned char>(text[0]));
}

}  // namespace

std::optional<double> parse_finite(const std::string& text) {
  if (text.empty() || starts_with_blank(text)) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(value))
    return std::nullopt;
  return value;
}

std::optional<int64_t> parse_integer(const std::string& text) {
  if (text.empty() || starts_with_blank(text)) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (end != text.c_str() + text.size() || errno == ERANGE) return std::nullopt;
  return int64_t(value);
}

std::string number_problem(double value, double lo, double hi) {
  if (!std::isfinite(value)) return cat(number_text(value), " is not a finite number");
  if (value < lo || value > hi)
    return cat(number_text(value), " is out of range ", range_text(lo, hi));
  return "";
}

CLI::Validator number_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        const std::optional<double> value = parse_finite(text);
        if (!value || *value < lo || *value > hi)
          return cat("'", text, "' is not a finite number in ", range_text(lo, hi));
        return "";
      },
      range_text(lo, hi));
}

CLI::Validator integer_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        const std::optional<int64_t> value = parse_integer(text);
        if (!value || *value < lo || *value > hi)
          return cat("'", text, "' is not a whole number in [", lo, ", ", hi, "]");
        return "";
      },
      cat("[", lo, ", ", hi, "]"));
}

int64_t checked_product(int64_t a, int64_t b, int64_t limit, const std::string& what) {
  CHECK(a >= 0 && b >= 0 && limit >= 0) << what << ": " << a << " x " << b;
  // For b > 0, a x b > limit exactly when a > floor(limit / b): no overflow.
  if (b != 0 && a > limit / b) throw Error(cat(what, " = ", a, " x ", b, " is more than ", limit));
  return a * b;
}

}  // namespace trainer
