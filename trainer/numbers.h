// Numbers a user hands the trainer, checked in one place: command-line
// options, recipe keys and cluster-file figures are finite, inside a stated
// range, and products of counts cannot overflow. Every refusal names the
// option or key, the value and the range; the callers add the file and line.
//
//   cmd->add_option("--grace-seconds", o.grace_seconds)->check(number_in(0, 3600));
//   cmd->add_option("--pp", args.pp)->check(integer_in(1, 4096));
//   const int64_t world = checked_product(nodes, per_node, kMaxWorld, "--nodes x --per-node");
//
// The ranges print with %g ("[0, 1e+06]"), never as the 309 digits of the
// largest double.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace CLI {
class Validator;
}

namespace trainer {

// A number as messages print it: %g, so 1e308 stays short and 0.1 stays 0.1.
std::string number_text(double value);
// "[lo, hi]" in number_text.
std::string range_text(double lo, double hi);

// The whole of `text` as a finite number (strtod's syntax, surrounding
// blanks refused); nullopt for "", "nan", "inf", "1e999", "3x".
std::optional<double> parse_finite(const std::string& text);
// The whole of `text` as a base-10 integer that fits int64; nullopt
// otherwise ("", "1.5", "99999999999999999999", "0x10").
std::optional<int64_t> parse_integer(const std::string& text);

// Why `value` is refused, or "" when it is a finite number in [lo, hi].
std::string number_problem(double value, double lo, double hi);

// CLI11 validators: the option's text is a finite number (an integer) in
// [lo, hi]. Their errors read "--grace-seconds: 'nan' is not a finite
// number in [0, 3600]", and --help shows the range.
CLI::Validator number_in(double lo, double hi);
CLI::Validator integer_in(int64_t lo, int64_t hi);

// a x b for counts >= 0; throws Error "<what> = a x b is more than <limit>"
// when the product passes `limit` (never overflows).
int64_t checked_product(int64_t a, int64_t b, int64_t limit, const std::string& what);

}  // namespace trainer
