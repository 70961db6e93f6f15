#!/usr/bin/env bash
# Builds the project with sanitizers (CMake's TRAINER_SANITIZE) and runs tests
# under them; any finding, in a test binary or in a process it starts (the
# trainer, the workers), fails the script.
#
#   bash scripts/sanitize.sh asan [CTEST_ARGS...]   # ASan+UBSan, build-asan/: the default suite (ctest -LE slow)
#   bash scripts/sanitize.sh tsan [CTEST_ARGS...]   # TSan, build-tsan/: the comm, parallel and data tests
#   BUILD_DIR=/tmp/b bash scripts/sanitize.sh asan -R 'store:'   # another build, some tests
#
# The build directory is configured on first use (RelWithDebInfo, CUDA off).
# halt_on_error stops a process at its first finding, with exit code 66.
# ASan, LSan and TSan write their reports to $BUILD_DIR/sanitizer-logs/
# rather than to stderr, so that a child whose failure a test expects (a
# trainer given a broken recipe) cannot hide one: the script prints them and
# fails when that directory is not empty, even if every test passed. UBSan
# (GCC's, combined with ASan) ignores log_path and prints to stderr: its
# findings fail through the exit code, and the script also fails when ctest's
# log (Testing/Temporary/LastTest.log) holds a "runtime error:".
#
# Suppressions (scripts/sanitizers/*.supp) are for third-party code only, one
# comment each saying why it is not ours. TSan runs with OMP_NUM_THREADS=1:
# libgomp is not instrumented, so TSan does not see its barriers and reports
# every parallel loop (ours and oneDNN's) as a race; with one thread the OpenMP
# regions run on the calling thread and what is checked is the project's own
# threads (loader workers, comm progress and store threads, the watchdog).
#
# Environment: BUILD_DIR, JOBS (ninja and ctest, default nproc), TIMEOUT (ctest's
# per-test limit, default 1800 s for asan and 3000 s for tsan: test.sh's 600 s
# scaled by the sanitizers' slow-down).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODE=${1:-}
shift || true
case "$MODE" in
  asan) SANITIZE=address,undefined; DEFAULT_TIMEOUT=1800 ;;
  tsan) SANITIZE=thread; DEFAULT_TIMEOUT=3000 ;;
  *) echo "usage: bash scripts/sanitize.sh asan|tsan [ctest args]" >&2; exit 2 ;;
esac
BUILD_DIR=${BUILD_DIR:-$ROOT/build-$MODE}
JOBS=${JOBS:-$(nproc)}
TIMEOUT=${TIMEOUT:-$DEFAULT_TIMEOUT}
SUPP=$ROOT/scripts/sanitizers

# ---- configure (once) and build ----
build_start=$SECONDS
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DTRAINER_CUDA=OFF -DTRAINER_SANITIZE="$SANITIZE"
elif ! grep -qx "TRAINER_SANITIZE:STRING=$SANITIZE" "$BUILD_DIR/CMakeCache.txt"; then
  echo "error: $BUILD_DIR is not configured with TRAINER_SANITIZE=$SANITIZE; set BUILD_DIR" >&2
  exit 1
fi
if [ "$MODE" = tsan ]; then
  # Only what the comm, parallel and data tests run.
  ninja -C "$BUILD_DIR" -j "$JOBS" trainer comm_worker zero_worker dp_worker pipeline_worker \
        tp_worker test_comm test_launch test_data test_parameter_server test_planner \
        test_parallel_zero test_parallel_ddp test_parallel_mesh test_parallel_schedule \
        test_parallel_pipeline test_parallel_pipeline_runtime test_parallel_tensor_ops \
        test_parallel_tensor_cnn test_parallel_tensor
else
  ninja -C "$BUILD_DIR" -j "$JOBS"
fi
build_seconds=$((SECONDS - build_start))

# ---- sanitizer options: the first finding stops the process and fails it ----
LOGS=$BUILD_DIR/sanitizer-logs
rm -rf "$LOGS"
mkdir -p "$LOGS"
COMMON="halt_on_error=1:exitcode=66:log_path=$LOGS/$MODE"
if [ "$MODE" = asan ]; then
  export ASAN_OPTIONS="$COMMON:detect_leaks=1:check_initialization_order=1"
  export UBSAN_OPTIONS="$COMMON:print_stacktrace=1"
  export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
else
  export TSAN_OPTIONS="$COMMON:suppressions=$SUPP/tsan.supp:print_suppressions=0:second_deadlock_stack=1"
  export OMP_NUM_THREADS=1
  # UCX's memory hooks (libucm) patch madvise, which glibc calls on a thread's
  # stack as the thread exits, after TSan has torn down the thread's state:
  # every process with a short-lived thread then dies with SIGSEGV inside
  # TSan's mutex interceptor (ucm_event_enter). The TSan run turns them off;
  # the transports the tests use (TCP, and shared memory on one host) run
  # without them.
  export UCX_MEM_MMAP_HOOK_MODE=none
fi

# ---- tests ----
cd "$BUILD_DIR"
selection=(-LE slow)
if [ "$MODE" = tsan ]; then
  # The comm, parallel and data families are binaries, not name prefixes: pick
  # their default-group cases (not slow:, not cuda:) from ctest's own list by
  # the program they run, and pass their numbers to -I.
  command -v jq > /dev/null || { echo "error: tsan needs jq (apt-get install jq)" >&2; exit 1; }
  numbers=$(ctest --show-only=json-v1 | jq -r '.tests | to_entries[]
      | select((.value.name | test("^(slow|cuda):") | not)
               and ((.value.command[0] // "") | test("/tests/(test_comm|test_launch|test_data|test_parameter_server|test_planner|test_parallel_[a-z_]+)$")))
      | .key + 1' | paste -sd, -)
  [ -n "$numbers" ] || { echo "error: no comm, parallel or data test is registered in $BUILD_DIR" >&2; exit 1; }
  selection=(-I "0,0,0,$numbers")
fi
test_start=$SECONDS
status=0
ctest --output-on-failure -j "$JOBS" --timeout "$TIMEOUT" "${selection[@]}" "$@" || status=$?
test_seconds=$((SECONDS - test_start))

reports=("$LOGS"/*)
if [ -e "${reports[0]}" ]; then
  echo "== ${#reports[@]} sanitizer report(s) in $LOGS:"
  for r in "${reports[@]}"; do echo "-- $r"; cat "$r"; done
  [ "$status" -ne 0 ] || status=1
fi
if grep -q 'runtime error:' Testing/Temporary/LastTest.log 2>/dev/null; then
  echo "== UBSan findings in Testing/Temporary/LastTest.log:"
  grep -B2 -A12 'runtime error:' Testing/Temporary/LastTest.log
  [ "$status" -ne 0 ] || status=1
fi
echo "sanitize $MODE: build ${build_seconds} s, tests ${test_seconds} s ($BUILD_DIR)"
exit "$status"
