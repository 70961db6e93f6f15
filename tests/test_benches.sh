#!/usr/bin/env bash
# The benchmarks still run and print their figures: each at its smallest
# (one or two rounds, a step or two, the small CNN, a GPT of context 32 over two
# pipeline stages, allreduces up to 64 KiB), without
# PyTorch. What they measure is not checked here, only that every figure is
# there and is a number.
#
#   tests/test_benches.sh BUILD_DIR
set -euo pipefail
build=$1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() { echo "FAIL: $*" >&2; cat "$out" >&2; exit 1; }
num='[0-9]+(\.[0-9]+)?'

"$build/bench_dp" --case small_cnn_28 --steps 2 --warmup 1 --rounds 2 --no-torch > "$out"
for row in "  round 1" "  round 2" small_cnn_28; do
  # Without PyTorch the ours/DDP column (median ratio and range) reads "-".
  grep -Eq "^$row +128 \| +$num +$num \| +$num% +$num +$num +$num% +$num% \| +$num% +$num% +$num% +$num% \| +- +- \| -$" "$out" ||
    fail "bench_dp: no figures row '$row'"
done
for row in dp=1 dp=2 "pair 0" "pair 1" "sync 0"; do
  grep -Eq "^ +$row +$num \+ +$num \+ +$num \+ +$num \( *$num\)" "$out" || fail "bench_dp: no $row phases"
done

"$build/bench_dp" --case small_cnn_28 --steps 2 --warmup 1 --batch 16 --dp2-only > "$out"
grep -Eq "^small_cnn_28 +16 \| dp=2 step $num ms: forward $num \+ backward $num" "$out" ||
  fail "bench_dp --dp2-only --batch 16"
if "$build/bench_dp" --bogus > "$out" 2>&1; then fail "bench_dp accepted --bogus"; fi
grep -q "usage: bench_dp" "$out" || fail "bench_dp --bogus: no usage"

"$build/bench_loader" --images 8 --epochs 1 --rounds 2 > "$out"
grep -Eq "^copy bound: single-thread memcpy $num GB/s" "$out" || fail "bench_loader: no copy bound"
grep -Eq "^  round 2: ours one thread $num, Loader 1 worker $num, 2 workers $num" "$out" ||
  fail "bench_loader: no second round"
[ "$(grep -Ec "^  one thread, CPU ms per image: .* -> $num images per CPU second; output $num GB/s = $num of copy$" "$out")" = 2 ] ||
  fail "bench_loader: no train and eval medians with their fraction of the copy bound"
grep -Eq "^  Loader, 2 worker\(s\): $num images/s wall .* images per CPU second; output $num GB/s = $num of copy$" "$out" ||
  fail "bench_loader: no Loader medians"
# With Python and Pillow, the peer's median and ours / its, median and range over the rounds.
if grep -q "^Python, same files" "$out"; then
  grep -Eq "^  ours / Python, .*: one thread ${num}x \($num-$num\), Loader 1 worker ${num}x \($num-$num\)$" "$out" ||
    fail "bench_loader: no median ratio with its range"
fi
if "$build/bench_loader" --bogus > "$out" 2>&1; then fail "bench_loader accepted --bogus"; fi
grep -q "usage: bench_loader" "$out" || fail "bench_loader --bogus: no usage"

"$build/bench_cp" --seq 256 --layers 1 --width 64 --steps 1 --warmup 0 --rounds 2 > "$out"
for row in "2 ring" "2 all_to_all" "4 ring" "4 all_to_all"; do
  grep -Eq "^ +256 +${row% *} +${row#* } +\| +$num +$num +$num-$num +$num +$num \| +$num +$num +$num \| +[0-9.e+-]+ ok" "$out" ||
    fail "bench_cp: no checked cp ${row% *} ${row#* } row"
done
grep -Eq "^ +256 +1 +pair +\| +$num +$num +$num-$num +1.00 +$num \|" "$out" || fail "bench_cp: no cp 1 pair row"
grep -q "2 rounds, medians" "$out" || fail "bench_cp: rounds not stated"
if "$build/bench_cp" --bogus > "$out" 2>&1; then fail "bench_cp accepted --bogus"; fi

"$build/bench_moe" --no-torch --rounds 1 --steps 1 --warmup 0 --tokens 256 --batch 4 --context 32 \
  --ep 1,2,4 > "$out"
grep -Eq "^ +ours top-2 softmax, dropless +\| 0 of 256 assignments dropped, aux $num, z $num$" "$out" ||
  fail "bench_moe: no dropless check row"
grep -Eq "^layer fwd\+bwd +1 \| +$num +$num +$num% \|" "$out" || fail "bench_moe: no layer row"
for ep in 1 2 4; do
  grep -Eq "^gpt train step +$ep \| +$num +$num +$num% \|" "$out" || fail "bench_moe: no gpt ep $ep row"
done
if "$build/bench_moe" --bogus > "$out" 2>&1; then fail "bench_moe accepted --bogus"; fi
grep -q "usage: bench_moe" "$out" || fail "bench_moe --bogus: no usage"

"$build/bench_pipeline" --case gpt --seq 32 --batch 2 --micro-batches 2 --steps 1 --warmup 1 --rounds 1 \
  --schedule 1f1b --no-torch > "$out"
grep -Eq "^gpt +1f1b +2 \| +$num +$num +$num (ok|off by [+-][0-9]+%) +$num \| +$num% +$num% \| +$num +$num +$num +$num \|" "$out" ||
  fail "bench_pipeline: no figures row"
grep -Eq "^gpt +1f1b +\| +2 +1 \| +$num +$num \| +$num +$num \|" "$out" || fail "bench_pipeline: no memory row"
"$build/bench_pipeline" --case lstm --seq 16 --batch 2 --micro-batches 4 --steps 1 --warmup 1 --rounds 1 \
  > "$out"
grep -Eq "^lstm +wavefront +4 \| +$num +$num +$num (ok|off by [+-][0-9]+%) +$num \| +$num% +$num% \|" "$out" ||
  fail "bench_pipeline --case lstm: no wavefront row"
if "$build/bench_pipeline" --bogus > "$out" 2>&1; then fail "bench_pipeline accepted --bogus"; fi
grep -q "usage: bench_pipeline" "$out" || fail "bench_pipeline --bogus: no usage"

"$build/bench_tp" --case gpt --layers 1 --width 64 --heads 2 --seq 32 --batch 2 --steps 1 --rounds 1 \
  --warmup 1 --no-torch > "$out"
grep -Eq "^gpt +tp=2 +\| +$num +$num \| +$num +$num +1\.000 \|" "$out" ||
  fail "bench_tp: no tp=2 row, or its bytes differ from the analytic count"
grep -Eq "^gpt +dp=2 +\| +$num +$num \|" "$out" || fail "bench_tp: no dp=2 row"
"$build/bench_tp" --case gpt --layers 1 --width 64 --heads 2 --seq 32 --batch 2 --steps 1 --rounds 1 \
  --warmup 1 --no-torch --sequence-parallel > "$out"
grep -Eq "^gpt +tp=2 +\| +$num +$num \| +$num +$num +1\.000 \|" "$out" ||
  fail "bench_tp --sequence-parallel: its bytes differ from the analytic count"
"$build/bench_planner" --quick > "$out"
grep -Eq "^175B +a100-80gb +1024 \| +[0-9]+ x [0-9]+ x [0-9]+ " "$out" || fail "bench_planner: no 175B x 1024 row"
grep -q "Narayanan et al. 2021" "$out" || fail "bench_planner: no published comparison"
if "$build/bench_planner" --bogus > "$out" 2>&1; then fail "bench_planner accepted --bogus"; fi
grep -q "usage: bench_planner" "$out" || fail "bench_planner --bogus: no usage"
if [ -f "$(dirname "$0")/../datasets/kjv.txt" ]; then
  "$build/bench_planner" --local --quick > "$out"
  for row in "dp=2 pp=1 tp=1 M=1" "dp=1 pp=2 tp=1 M=2 1f1b" "dp=1 pp=1 tp=2 M=1"; do
    grep -Eq "^gpt +$row +\| +$num +$num +[+-]$num% +$num \|" "$out" || fail "bench_planner --local: no $row row"
  done
  grep -Eq "^Spearman rank correlation -?$num over 3 configurations" "$out" ||
    fail "bench_planner --local: no rank correlation"
  grep -Eq "^gpt: first choice .* (within|NOT within) 10%" "$out" || fail "bench_planner --local: no choice"
fi

if "$build/bench_tp" --bogus > "$out" 2>&1; then fail "bench_tp accepted --bogus"; fi
grep -q "usage: bench_tp" "$out" || fail "bench_tp --bogus: no usage"

"$build/bench_recompute" --layers 2 --width 64 --heads 2 --seq 32 --batch 2 --steps 1 > "$out"
for row in none blocks; do
  grep -Eq "^gpt +$row +\| +$num +$num +$num \| +$num$" "$out" || fail "bench_recompute: no $row row"
done
grep -Eq "^blocks/none: step time ${num}x, peak RSS ${num}x, alloc peak ${num}x; loss identical" "$out" ||
  fail "bench_recompute: no ratios, or the losses differ"
if "$build/bench_recompute" --bogus > "$out" 2>&1; then fail "bench_recompute accepted --bogus"; fi
grep -q "usage: bench_recompute" "$out" || fail "bench_recompute --bogus: no usage"

"$build/bench_checkpoint" --case gpt --ranks 2 --layers 1 --width 64 --no-torch > "$out"
grep -Eq "^2 +\| +$num \| +$num +$num \| +$num% \| +$num +$num +$num \| +- +- +-$" "$out" ||
  fail "bench_checkpoint: no 2-rank row"
if "$build/bench_checkpoint" --bogus > "$out" 2>&1; then fail "bench_checkpoint accepted --bogus"; fi
grep -q "usage: bench_checkpoint" "$out" || fail "bench_checkpoint --bogus: no usage"

"$build/bench_train" --threads 1 --steps 1 --rounds 2 --case small_cnn_28 --skip-torch > "$out"
grep -Eq "^peak: matmul f32 $num GFLOP/s at 1 thread$" "$out" || fail "bench_train: no peak line"
grep -Eq "^  round 2 +\| +$num +$num \| +- +- \| -$" "$out" || fail "bench_train: no second round"
grep -Eq "^small_cnn_28 +128 +1 \| +$num +$num \| +- +- \| - +\| +$num +$num% +-$" "$out" ||
  fail "bench_train: no row of medians with GFLOP/s and fraction of peak"
grep -Eq "^peak over the run: matmul f32 $num GFLOP/s at 1 thread \(best of 3 measurements\); of it: small_cnn_28 $num%$" "$out" ||
  fail "bench_train: the peak not measured again in each round"
"$build/bench_train" --self-check > "$out" || fail "bench_train --self-check: ResNet-50 not 4.1 GMACs +-2%"
grep -Eq "^flop counter: resnet50 224x224 $num GMACs forward per image .*: ok" "$out" ||
  fail "bench_train --self-check: no counter line"
if "$build/bench_train" --bogus > "$out" 2>&1; then fail "bench_train accepted --bogus"; fi
grep -q "usage: bench_train" "$out" || fail "bench_train --bogus: no usage"

"$build/bench_conv" --quick > "$out"
grep -Eq "^resnet18_224 +16 +64 +56 +64 +3 +1( \| +$num +$num +${num}x){3}$" "$out" ||
  fail "bench_conv: no first row"
grep -Eq "^geometric mean of own over oneDNN speed: forward ${num}x, data gradient ${num}x, weight gradient ${num}x" "$out" ||
  fail "bench_conv: no summary"
if "$build/bench_conv" --bogus > "$out" 2>&1; then fail "bench_conv accepted --bogus"; fi
grep -q "usage: bench_conv" "$out" || fail "bench_conv --bogus: no usage"

"$build/trainer" launch --nproc-per-node 2 --program "$build/bench_allreduce" -- \
  --max-bytes 65536 --rounds 2 > "$out"
grep -Eq "^ +65536 +16384 \| +$num +$num +$num +$num \|" "$out" || fail "bench_allreduce: no 64 KiB row"
# Medians of both sides, ours against the copy bound, and the median speedup with its range
# (without OpenMPI, our median alone).
grep -Eq "^ +65536 +16384 \| .* \| +$num +$num +$num \| ${num}x \($num-$num\)$|^ +65536 +16384 \| .* \| +$num +- +$num \| -$" "$out" ||
  fail "bench_allreduce: no medians on the 64 KiB row"
grep -Eq "^# largest size: busbw $num GB/s = $num of the copy bound .* median algbw $num GB/s = $num of it; per CPU second $num GB/s = $num of it$" "$out" ||
  fail "bench_allreduce: no summary"
"$build/trainer" launch --nproc-per-node 3 --program "$build/bench_allreduce" -- \
  --algorithm all --max-bytes 2048 --rounds 1 > "$out"
for algorithm in ring "recursive doubling" butterfly tree round-robin all-to-all master-worker; do
  grep -Eq "^ +2048 $algorithm +$num +$num +$num +$num +$num +$num +$num" "$out" ||
    fail "bench_allreduce --algorithm all: no 2 KiB $algorithm row with its model"
done
grep -q "^# alpha-beta model" "$out" || fail "bench_allreduce --algorithm all: no model line"
echo "benches ok"
