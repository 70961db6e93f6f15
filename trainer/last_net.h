// The trainer's last net: runs a command and turns whatever it throws into
// `error: ...` on stderr and exit status 1. A trainer::Error is the message
// a user acts on; any other exception should have been an Error where it was
// thrown (a bug to fix there), but is still not a crash.
//
//   int main(...) { ... return run_with_last_net([&] { return train_command(args); }); }
#pragma once

#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <typeinfo>

#include "core/check.h"

namespace trainer {

// The exception's type, readable ("std::filesystem::filesystem_error").
inline std::string exception_type_name(const std::exception& e) {
  int status = 0;
  char* name = abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status);
  std::string out = status == 0 && name ? name : typeid(e).name();
  std::free(name);
  return out;
}

inline int run_with_last_net(const std::function<int()>& command) {
  try {
    return command();
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s (an unexpected %s; please report it)\n", e.what(),
                 exception_type_name(e).c_str());
  } catch (...) {
    std::fprintf(stderr, "error: an unexpected exception of unknown type; please report it\n");
  }
  return 1;
}

}  // namespace trainer
