#!/usr/bin/env bash
# Parameter servers against allreduce data parallelism, as a user would run
# them: the Fashion-MNIST CNN (recipes/fmnist_cnn.yaml) for one epoch with W
# workers under allreduce, and with W workers plus one server under bsp, asp
# and ssp (staleness 2). Prints a table (final test accuracy, wall time) and
# draws test accuracy against time (scripts/plot_ps.py, needs matplotlib).
#
#   bash scripts/ps_compare.sh                      # W = 2 and 4, into runs/ps_compare
#   WORKERS="2" EPOCHS=1 OUT=/tmp/ps bash scripts/ps_compare.sh
#
# One thread per rank; the table names the CPU and its cores (with more
# ranks than cores they share them).
set -euo pipefail
cd "$(dirname "$0")/.."
TRAINER=${TRAINER:-./build/trainer}
OUT=${OUT:-runs/ps_compare}
WORKERS=${WORKERS:-"2 4"}
EPOCHS=${EPOCHS:-1}
if [ ! -x "$TRAINER" ]; then
  echo "error: $TRAINER is not built; run bash scripts/setup.sh (or set TRAINER=...)" >&2
  exit 1
fi
mkdir -p "$OUT"
table="$OUT/table.tsv"
printf "workers\tmode\tranks\ttop1\tseconds\n" >"$table"

run() {  # name ranks extra-args...
  local name=$1 ranks=$2
  shift 2
  local dir="$OUT/$name"
  rm -rf "$dir"
  mkdir -p "$dir"
  local start end
  start=$(date +%s.%N)
  echo "$start" >"$dir/start_time"
  "$TRAINER" launch --nproc-per-node "$ranks" --grace-seconds 5 -- train recipes/fmnist_cnn.yaml \
    output_dir="$dir" training.epochs="$EPOCHS" training.eval_every=60 training.log_every=60 \
    training.threads=1 data.workers=1 "$@" >"$dir/output.log" 2>&1 || {
    echo "error: run $name failed; see $dir/output.log" >&2
    exit 1
  }
  end=$(date +%s.%N)
  local top1
  top1=$(grep -o 'final eval top1 [0-9.]*%' "$dir/output.log" | sed 's/.*top1 //; s/%//' | head -1)
  printf "%s\t%s\t%s\t%s\t%.1f\n" "${name%%_*}" "${name#*_}" "$ranks" "$top1" \
    "$(echo "$end - $start" | bc)" >>"$table"
}

for w in $WORKERS; do
  run "${w}_allreduce" "$w"
  run "${w}_bsp" $((w + 1)) parallel.mode=parameter_server parallel.sync=bsp
  run "${w}_asp" $((w + 1)) parallel.mode=parameter_server parallel.sync=asp
  run "${w}_ssp2" $((w + 1)) parallel.mode=parameter_server parallel.sync=ssp parallel.staleness=2
done

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
echo "# fmnist_cnn, $EPOCHS epoch(s), global batch 128, 1 thread per rank; $cpu, $(nproc) cores; $(date -u +%F)"
column -t -s $'\t' "$table"
if python3 -c "import matplotlib" 2>/dev/null; then
  python3 scripts/plot_ps.py "$OUT" --out "$OUT/accuracy_vs_time.png"
else
  echo "(no matplotlib: pip install -r bench/requirements.txt to draw the plot)"
fi
