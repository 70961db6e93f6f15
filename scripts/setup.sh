#!/usr/bin/env bash
# Installs every Debian package the project needs (idempotent: apt runs only
# when something is missing) and makes a Release build in ./build.
#
#   bash scripts/setup.sh                    # packages + build
#   TRAINER_CUDA=ON bash scripts/setup.sh    # also compile the CUDA backend (CI does)
#   BUILD_DIR=build-asan CMAKE_ARGS="-DTRAINER_SANITIZE=address,undefined" bash scripts/setup.sh
#
# The CUDA backend is compiled when this machine has an NVIDIA driver
# (/proc/driver/nvidia/version, or nvidia-smi answers): compiling it takes
# most of a first build and nothing on a machine without a GPU can run it.
# TRAINER_CUDA=ON|OFF|AUTO forces the choice (AUTO: wherever nvcc and cuDNN
# are found, driver or not).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libdnnl-dev ocl-icd-opencl-dev libucx-dev libyaml-cpp-dev libopencv-dev libjpeg-dev catch2
  nlohmann-json3-dev libcli11-dev zlib1g-dev libsentencepiece-dev
  openmpi-bin libopenmpi-dev
  iproute2 slurmctld slurmd slurm-client munge
  clang libclang-rt-14-dev
  dataset-fashion-mnist bible-kjv
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The language-model corpus of recipes/gpt_kjv.yaml and lstm_kjv.yaml: the
# King James Bible as bible-kjv prints it (4.4 MB of ASCII), one verse per
# line after its reference ("Ge1:1 In the beginning God created ...").
if [ ! -s datasets/kjv.txt ]; then
  mkdir -p datasets
  bible -f "gen1:1-rev22:21" >datasets/kjv.txt.tmp
  mv datasets/kjv.txt.tmp datasets/kjv.txt
  echo "setup: wrote datasets/kjv.txt"
fi

BUILD_DIR=${BUILD_DIR:-build}
if [ -z "${TRAINER_CUDA:-}" ]; then
  if [ -r /proc/driver/nvidia/version ] || nvidia-smi -L >/dev/null 2>&1; then
    TRAINER_CUDA=AUTO
  else
    TRAINER_CUDA=OFF
    echo "setup: no NVIDIA driver here, so the CUDA backend is not compiled (TRAINER_CUDA=ON forces it)"
  fi
fi
case "$TRAINER_CUDA" in
  ON | OFF | AUTO) ;;
  *) echo "setup: TRAINER_CUDA must be ON, OFF or AUTO, not '$TRAINER_CUDA'" >&2; exit 2 ;;
esac
start=$(date +%s)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRAINER_CUDA="$TRAINER_CUDA" \
  ${CMAKE_ARGS:-} >/dev/null
ninja -C "$BUILD_DIR" -j"$(nproc)"
echo "setup: built $BUILD_DIR (CUDA backend: $TRAINER_CUDA) in $(($(date +%s) - start)) s"
