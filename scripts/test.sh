#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: the default tests,
# then the [slow] ones. [cuda] tests are reported as skipped without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
cd "$BUILD_DIR"
echo "== default tests =="
ctest --output-on-failure -j2 -LE slow --timeout 600
echo "== slow tests =="
ctest --output-on-failure -L slow --timeout 1800
