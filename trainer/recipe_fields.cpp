// The kinds of key a recipe's schema is made of (recipe_parts.h): integers,
// numbers, booleans, strings, parallel.stages and lists of numbers, each
// parsed from YAML with its type and range checked, and emitted back.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <type_traits>

#include "core/check.h"
#include "trainer/recipe_parts.h"

namespace trainer {

namespace {

// Shortest faithful text for a number (yaml-cpp would print 17 digits).
std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", x);
  return buf;
}

[[noreturn]] void type_error(const Origin& o, const std::string& path, const char* expected,
                             const YAML::Node& v) {
  std::string got = v.IsScalar() ? "'" + v.Scalar() + "'" : (v.IsSequence() ? "a list" : "a map");
  throw Error(cat(o.text, ": key '", path, "' expects ", expected, ", got ", got));
}

template <class T>
T scalar_as(const YAML::Node& v, const Origin& o, const std::string& path, const char* expected) {
  if (!v.IsScalar()) type_error(o, path, expected, v);
  try {
    return v.as<T>();
  } catch (const YAML::Exception&) {
    type_error(o, path, expected, v);
  }
}

template <class T>
void check_range(T value, T lo, T hi, const Origin& o, const std::string& path) {
  if constexpr (std::is_floating_point_v<T>)
    if (!std::isfinite(value))
      throw Error(cat(o.text, ": key '", path, "' = ", value,
                      " is not a finite number; give one in [", lo, ", ", hi, "]"));
  if (value < lo || value > hi)
    throw Error(
        cat(o.text, ": key '", path, "' = ", value, " is out of range [", lo, ", ", hi, "]"));
}

// "a, b, c": the accepted values of a string key (empty: any text).
std::string join_choices(const std::vector<std::string>& choices) {
  std::string list;
  for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
  return list;
}

}  // namespace

Field int_field(std::string path, int64_t* p, int64_t lo, int64_t hi) {
  return Field{path,
               [=](const YAML::Node& v, const Origin& o) {
                 int64_t x = scalar_as<int64_t>(v, o, path, "an integer");
                 check_range(x, lo, hi, o, path);
                 *p = x;
               },
               [=] { return YAML::Node(*p); }, "int", cat("[", lo, ", ", hi, "]")};
}

Field float_field(std::string path, double* p, double lo, double hi) {
  return Field{path,
               [=](const YAML::Node& v, const Origin& o) {
                 double x = scalar_as<double>(v, o, path, "a number");
                 check_range(x, lo, hi, o, path);
                 *p = x;
               },
               [=] { return YAML::Node(format_number(*p)); }, "float",
               cat("[", format_number(lo), ", ", format_number(hi), "]")};
}

Field alias_field(std::string path, const Field& target) {
  Field f = target;
  f.path = std::move(path);
  f.alias_of = target.path;
  return f;
}

Field bool_field(std::string path, bool* p) {
  return Field{path,
               [=](const YAML::Node& v, const Origin& o) {
                 *p = scalar_as<bool>(v, o, path, "true or false");
               },
               [=] { return YAML::Node(*p); }, "bool", "true, false"};
}

// A string; `choices` empty means free text.
Field string_field(std::string path, std::string* p, std::vector<std::string> choices) {
  return Field{
      path,
      [=](const YAML::Node& v, const Origin& o) {
        std::string s = scalar_as<std::string>(v, o, path, "a string");
        if (!choices.empty() && std::find(choices.begin(), choices.end(), s) == choices.end())
          throw Error(
              cat(o.text, ": key '", path, "' = '", s, "' is not one of: ", join_choices(choices)));
        *p = s;
      },
      [=] { return YAML::Node(*p); }, "string", join_choices(choices)};
}

// "even", "auto", or a list of block indices (parallel.stages).
Field stages_field(std::string path, std::string* mode, std::vector<int64_t>* starts) {
  return Field{path,
               [=](const YAML::Node& v, const Origin& o) {
                 if (v.IsSequence()) {
                   std::vector<int64_t> out;
                   for (const YAML::Node& e : v) {
                     int64_t x = scalar_as<int64_t>(e, o, path, "even, auto or a list of blocks");
                     check_range<int64_t>(x, 1, 1000000000, o, path);
                     out.push_back(x);
                   }
                   *mode = "list";
                   *starts = out;
                   return;
                 }
                 std::string s =
                     scalar_as<std::string>(v, o, path, "even, auto or a list of blocks");
                 if (s != "even" && s != "auto")
                   throw Error(cat(o.text, ": key '", path, "' = '", s,
                                   "' is not one of: even, auto, or a list of block indices "
                                   "such as [3, 6]"));
                 *mode = s;
                 starts->clear();
               },
               [=] {
                 if (*mode != "list") return YAML::Node(*mode);
                 YAML::Node n(YAML::NodeType::Sequence);
                 for (int64_t x : *starts) n.push_back(x);
                 n.SetStyle(YAML::EmitterStyle::Flow);
                 return n;
               },
               "string or list of ints", "even, auto, or increasing block indices"};
}

Field float_list_field(std::string path, std::vector<double>* p, double lo, double hi) {
  return Field{path,
               [=](const YAML::Node& v, const Origin& o) {
                 if (!v.IsSequence()) type_error(o, path, "a list of numbers", v);
                 std::vector<double> out;
                 for (const YAML::Node& e : v) {
                   double x = scalar_as<double>(e, o, path, "a list of numbers");
                   check_range(x, lo, hi, o, path);
                   out.push_back(x);
                 }
                 *p = out;
               },
               [=] {
                 YAML::Node n(YAML::NodeType::Sequence);
                 for (double x : *p) n.push_back(format_number(x));
                 n.SetStyle(YAML::EmitterStyle::Flow);
                 return n;
               },
               "list of floats", cat("each in [", format_number(lo), ", ", format_number(hi), "]")};
}

}  // namespace trainer
