#!/bin/bash
# Builds the libFuzzer targets of fuzz/ and runs each for a given time on its
# seed corpus (fuzz/corpus/<target>/, kept in the repository).
#
#   scripts/fuzz.sh [SECONDS_EACH] [TARGET ...]     # default: 60 s, every target but store
#   BUILD=build scripts/fuzz.sh 10 recipe idx       # CI: a short run of some
#
# The code under test (the parser's own sources) is compiled by clang with
# -fsanitize=fuzzer,address,undefined; the rest of the engine it calls is
# linked from the static libraries of an existing build ($BUILD, default
# build/, e.g. `cmake -B build -G Ninja && ninja -C build trainer`).
# New inputs that found coverage go to $BUILD/fuzz/corpus/<target>/ (the
# seeds stay untouched); a crash leaves crash-<hash> in $BUILD/fuzz/ and
# fails the script: turn it into a regression test (tests/test_hardening.cpp)
# and fix it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(cd "${BUILD:-$ROOT/build}" && pwd)
SECONDS_EACH=${1:-60}
shift || true
TARGETS=("$@")
# The store's target (a server over loopback, checked by a client with a 10 s
# deadline) runs by name only: scripts/fuzz.sh 60 store.
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(recipe safetensors trainer_state idx image cluster command_line)
CXX=${FUZZ_CXX:-clang++}
OUT=$BUILD/fuzz
mkdir -p "$OUT"

# Exit 77 (ctest: skipped) where clang's libFuzzer is not installed
# (Debian: clang and libclang-rt-<version>-dev).
echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' \
    > "$OUT/probe.cpp"
if ! "$CXX" -fsanitize=fuzzer "$OUT/probe.cpp" -o "$OUT/probe" > /dev/null 2>&1; then
  echo "fuzz: $CXX cannot build libFuzzer targets (install clang and libclang-rt-dev): skipped"
  exit 77
fi

# The sources each target instruments (the parser under test and its helpers).
declare -A SOURCES=(
  [recipe]="trainer/recipe.cpp trainer/recipe_fields.cpp data/files.cpp"
  [safetensors]="trainer/safetensors.cpp trainer/durable_file.cpp data/files.cpp"
  [trainer_state]="trainer/checkpoint.cpp trainer/checkpoint_state.cpp trainer/checkpoint_optimizer.cpp trainer/checkpoint_pieces.cpp trainer/checkpoint_index.cpp trainer/safetensors.cpp trainer/durable_file.cpp data/files.cpp"
  [idx]="data/idx.cpp data/files.cpp"
  [image]="data/image_folder.cpp data/jpeg_decode.cpp data/transforms.cpp data/resample.cpp data/files.cpp"
  [store]="comm/store.cpp comm/store_server.cpp"
  [cluster]="trainer/cluster_file.cpp trainer/numbers.cpp data/files.cpp"
  [command_line]="trainer/plan.cpp trainer/launch.cpp trainer/launch_attempt.cpp trainer/numbers.cpp trainer/cluster_file.cpp trainer/recipe.cpp trainer/recipe_fields.cpp data/files.cpp"
)
# Libraries of the existing build a target needs beyond the engine's (the
# command-line target calls into the trainer's own library).
declare -A EXTRA_LIBS=(
  [command_line]="app data"
)
# The rest of the engine, from the existing build (not instrumented).
LIBS=()
for lib in parallel optim comm nn core; do
  [ -f "$BUILD/libtrainer_$lib.a" ] || { echo "error: $BUILD/libtrainer_$lib.a is missing; build the trainer in $BUILD first (or set BUILD)" >&2; exit 1; }
  LIBS+=("$BUILD/libtrainer_$lib.a")
done
# A CUDA build's parallel library calls into the backend: link it and the
# toolkit's libraries (listed by CMake in cuda_libraries.txt).
if [ -f "$BUILD/cuda_libraries.txt" ]; then
  read -r -a cuda_libs < "$BUILD/cuda_libraries.txt"
  for lib in "${cuda_libs[@]}"; do
    LIBS+=("$lib")
    [[ "$lib" == *.so* ]] && LIBS+=("-Wl,-rpath,$(dirname "$lib")")
  done
fi
SYSTEM_LIBS=(-lyaml-cpp -lz -ljpeg -lopencv_imgcodecs -lopencv_imgproc -lopencv_core -lucp -lucs
             -ldnnl -lsentencepiece_train -lsentencepiece -lgomp -lpthread -ldl)
FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=undefined -I"$ROOT" -I/usr/include/opencv4)

failed=()
for target in "${TARGETS[@]}"; do
  [ -n "${SOURCES[$target]:-}" ] || { echo "error: unknown fuzz target '$target' (known: ${!SOURCES[*]})" >&2; exit 1; }
  binary=$OUT/fuzz_$target
  sources=()
  for s in ${SOURCES[$target]}; do sources+=("$ROOT/$s"); done
  extra=()
  for lib in ${EXTRA_LIBS[$target]:-}; do
    [ -f "$BUILD/libtrainer_$lib.a" ] || { echo "error: $BUILD/libtrainer_$lib.a is missing; build the trainer in $BUILD first" >&2; exit 1; }
    extra+=("$BUILD/libtrainer_$lib.a")
  done
  echo "== building fuzz_$target"
  "$CXX" "${FLAGS[@]}" "$ROOT/fuzz/fuzz_$target.cpp" "${sources[@]}" -o "$binary" \
      -Wl,--start-group "${extra[@]}" "${LIBS[@]}" -Wl,--end-group "${SYSTEM_LIBS[@]}"
  corpus=$OUT/corpus/$target
  mkdir -p "$corpus"
  echo "== running fuzz_$target for ${SECONDS_EACH}s"
  if ! (cd "$OUT" && "$binary" -max_total_time="$SECONDS_EACH" -rss_limit_mb=4096 \
          -timeout=10 -print_final_stats=1 "$corpus" "$ROOT/fuzz/corpus/$target" \
          > "$OUT/fuzz_$target.log" 2>&1); then
    failed+=("$target")
    tail -40 "$OUT/fuzz_$target.log"
  fi
  grep -E "^stat::number_of_executed_units|^#[0-9]+.*DONE" "$OUT/fuzz_$target.log" | tail -2 || true
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashes in ${failed[*]} (inputs: $OUT/crash-*)" >&2
  exit 1
fi
echo "fuzz: ${TARGETS[*]}: no crash in ${SECONDS_EACH}s each"
