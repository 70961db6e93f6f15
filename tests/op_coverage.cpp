// op_coverage: runs the op table (tests/op_cases.h) on every registered
// backend that has a device here and prints the coverage matrix, op x dtype
// x backend (ok, unsupported, FAILED), then the cases not ok and why.
//
//   build/tests/op_coverage           # the matrix; exit 1 when a case FAILED
//   build/tests/op_coverage --ops     # the table's ops, one per line
//   build/tests/op_coverage --cases   # every case and its dtypes, not run
#include <cstring>
#include <iostream>

#include "tests/op_cases.h"

using namespace trainer;
using namespace trainer::testing;

int main(int argc, char** argv) {
  const std::vector<OpCase>& cases = op_cases();
  const std::string option = argc > 1 ? argv[1] : "";
  if (argc > 2 || (!option.empty() && option != "--ops" && option != "--cases")) {
    std::cerr << "usage: op_coverage [--ops | --cases]\n";
    return 2;
  }
  if (option == "--ops") {
    for (const std::string& op : op_names(cases)) std::cout << op << "\n";
    return 0;
  }
  if (option == "--cases") {
    for (const OpCase& c : cases) {
      std::cout << c.op << " [" << c.variant << "]";
      for (DType t : c.dtypes) std::cout << " " << dtype_name(t);
      std::cout << "\n";
    }
    return 0;
  }
  std::vector<BackendCoverage> backends;
  bool failed = false;
  for (DeviceKind kind : registered_device_kinds()) {
    const Device device{kind};
    BackendCoverage b{backend(device).name(), backend(device).device_count() > 0, {}};
    if (b.has_device) b.results = run_cases(cases, device);
    for (const CaseResult& r : b.results) failed = failed || r.outcome == Outcome::failed;
    backends.push_back(std::move(b));
  }
  print_coverage(std::cout, cases, backends);
  return failed ? 1 : 0;
}
