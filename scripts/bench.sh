#!/usr/bin/env bash
# Runs the benchmark suite, or the named benchmarks, and writes a dated result
# directory: each benchmark's raw output and commands, results.md (one
# markdown table per benchmark, with what "faster" means and the ratio
# against the peer measured in the same run) and, with matplotlib, the
# allreduce and data-parallel figures.
#
#   scripts/bench.sh                    # all: train dp allreduce alltoall matmul loader pipeline tp checkpoint fsdp cp
#   scripts/bench.sh train dp           # the named ones
#   scripts/bench.sh --quick            # smallest sizes: checks that all run, figures not meaningful
#   scripts/bench.sh --out DIR ...      # default bench/results/<UTC date>-<commit>
#
# It installs nothing. The peers it compares with, when present:
#   PyTorch, torchvision, matplotlib:  pip install -r bench/requirements.txt
#   OpenMPI (allreduce, alltoall):     apt-get install openmpi-bin libopenmpi-dev, then scripts/setup.sh
# Without them the figures of ours are still measured and the peer columns read "-".
# train dp allreduce matmul loader take an hour or more on 2 cores with their three
# rounds (bench_train's 2-thread table alone took 18 minutes on the Xeon VM,
# 2026-11-29; its 1-thread table takes longer), pipeline
# and tp (two ranks each, with PyTorch's runs) add to that, checkpoint about 25
# minutes (GPT 12 x 768 and ResNet-50 on 1, 2 and 4 ranks, with PyTorch DCP), fsdp about 30
# (the same models under each parallel.shard, with DDP and FSDP2), cp about 10 (GPT at 1k, 4k
# and 16k tokens on 1, 2 and 4 ranks); two ranks on a
# 2-core machine need both cores free, so run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
ALL=(train dp allreduce alltoall matmul loader pipeline tp checkpoint fsdp cp)

quick=0
out=""
names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out=$2; shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    train | dp | allreduce | alltoall | matmul | loader | pipeline | tp | checkpoint | fsdp | cp) names+=("$1") ;;
    *) echo "bench.sh: unknown argument '$1' (benchmarks: ${ALL[*]}; options: --quick, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#names[@]} -gt 0 ] || names=("${ALL[@]}")

# The binaries each benchmark runs: allreduce and pipeline start their ranks
# with the trainer's launcher.
binaries_of() {
  case "$1" in
    allreduce | alltoall | pipeline | checkpoint | fsdp) echo "bench_$1 trainer" ;;
    *) echo "bench_$1" ;;
  esac
}
for name in "${names[@]}"; do
  for b in $(binaries_of "$name"); do
    [ -x "$BUILD_DIR/$b" ] || { echo "bench.sh: $BUILD_DIR/$b not built: run scripts/setup.sh first" >&2; exit 1; }
  done
done

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# Uncommitted changes to anything but the documentation make the figures not the commit's.
git diff --quiet HEAD -- . ':!*.md' ':!docs' 2>/dev/null || commit="$commit+changes"
date=$(date -u +%Y-%m-%d)
out=${out:-bench/results/$date-${commit%+changes}}
mkdir -p "$out/raw"

# The peers: say what is there and how to get what is not.
peers=()
if python3 -c 'import torch, torchvision' 2>/dev/null; then
  peers+=("PyTorch $(python3 -c 'import torch; print(torch.__version__)'), torchvision $(python3 -c 'import torchvision; print(torchvision.__version__)')")
else
  echo "bench.sh: PyTorch/torchvision not found: ours only (pip install -r bench/requirements.txt)"
  peers+=("no PyTorch")
fi
if [ -x "$BUILD_DIR/mpi_allreduce" ] && command -v mpirun >/dev/null; then
  peers+=("$(mpirun --version 2>/dev/null | head -1)")
else
  echo "bench.sh: OpenMPI not found: no allreduce comparison (apt-get install openmpi-bin libopenmpi-dev; scripts/setup.sh)"
  peers+=("no OpenMPI")
fi
python3 -c 'import matplotlib' 2>/dev/null ||
  echo "bench.sh: matplotlib not found: tables only (pip install -r bench/requirements.txt)"

cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)
load() { cut -d' ' -f1-3 /proc/loadavg; }
{
  echo "date: $date $(date -u +%H:%M) UTC"
  echo "commit: $commit"
  echo "machine: ${cpu:-unknown CPU}, $(nproc) cores, $(free -g | awk '/^Mem:/{print $2}') GiB"
  echo "peers: $(printf '%s; ' "${peers[@]}" | sed 's/; $//')"
  echo "mode: $([ $quick = 1 ] && echo quick || echo full)"
  echo "load before: $(load)"
} >"$out/meta.txt"

# The commands of each benchmark, one a line: full and quick sizes.
commands_of() {
  local b=$BUILD_DIR
  case "$1:$quick" in
    train:0) echo "$b/bench_train --threads 1 --steps 5 --rounds 3"; echo "$b/bench_train --threads 2 --steps 5 --rounds 3" ;;
    train:1) echo "$b/bench_train --threads 1 --steps 1 --rounds 1 --case small_cnn_28" ;;
    dp:0) echo "$b/bench_dp --steps 8 --rounds 3" ;;
    dp:1) echo "$b/bench_dp --case small_cnn_28 --steps 2 --warmup 1 --rounds 1" ;;
    allreduce:0) echo "$b/trainer launch --nproc-per-node 2 --program $b/bench_allreduce -- --rounds 3" ;;
    allreduce:1) echo "$b/trainer launch --nproc-per-node 2 --program $b/bench_allreduce -- --max-bytes 65536 --rounds 1" ;;
    alltoall:0) echo "$b/trainer launch --nproc-per-node 2 --program $b/bench_alltoall -- --rounds 3" ;;
    alltoall:1) echo "$b/trainer launch --nproc-per-node 2 --program $b/bench_alltoall -- --max-bytes 65536 --rounds 1" ;;
    matmul:0) echo "$b/bench_matmul" ;;
    matmul:1) echo "$b/bench_matmul --quick" ;;
    loader:0) echo "$b/bench_loader --rounds 3" ;;
    loader:1) echo "$b/bench_loader --images 16 --epochs 1 --rounds 1" ;;
    pipeline:0) echo "$b/bench_pipeline --rounds 3" ;;
    pipeline:1) echo "$b/bench_pipeline --case gpt --seq 32 --batch 2 --micro-batches 2 --steps 1 --warmup 1 --schedule 1f1b --rounds 1" ;;
    tp:0) echo "$b/bench_tp --rounds 3" ;;
    tp:1) echo "$b/bench_tp --case gpt --layers 1 --width 64 --heads 2 --seq 32 --batch 2 --steps 1 --warmup 1 --rounds 1" ;;
    checkpoint:0) echo "$b/bench_checkpoint" ;;
    checkpoint:1) echo "$b/bench_checkpoint --case gpt --ranks 2 --layers 1 --width 64" ;;
    fsdp:0) echo "$b/bench_fsdp" ;;
    fsdp:1) echo "$b/bench_fsdp --case gpt --ranks 2 --layers 1 --width 64 --steps 1 --warmup 1" ;;
    cp:0) echo "$b/bench_cp --seq 1024,4096 --steps 5"; echo "$b/bench_cp --seq 16384 --attention ring --steps 2 --warmup 0 --rounds 1" ;;
    cp:1) echo "$b/bench_cp --seq 256 --layers 1 --width 64 --steps 1 --warmup 0 --rounds 1" ;;
  esac
}

for name in "${names[@]}"; do
  commands_of "$name" >"$out/raw/$name.cmd"
  : >"$out/raw/$name.txt"
  while read -r cmd; do
    echo "== $name: $cmd"
    # shellcheck disable=SC2086  # the command is a word list
    $cmd </dev/null 2>&1 | tee -a "$out/raw/$name.txt"
  done <"$out/raw/$name.cmd"
done
echo "load after: $(load)" >>"$out/meta.txt"

python3 scripts/bench_report.py "$out"
echo "bench.sh: $out/results.md"
