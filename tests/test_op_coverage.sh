#!/usr/bin/env bash
# op_coverage prints the op table's coverage matrix: a row for every op of
# the table (op_coverage --ops) with an outcome in every dtype column of
# every backend that ran, and exits 0 (no case FAILED).
#
#   tests/test_op_coverage.sh OP_COVERAGE
set -euo pipefail
tool=$1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() { echo "FAIL: $*" >&2; cat "$out" >&2; exit 1; }

status=0
"$tool" > "$out" || status=$?
[ "$status" -eq 0 ] || fail "op_coverage exited $status"
cell='(ok|unsupported|FAILED|-)'
grep -Eq "^op +\| +f32 +f64 +bf16 +f16( |$)" "$out" || fail "no dtype header"
ops=0
while read -r op; do
  grep -Eq "^$op +[0-9]+( \| +$cell +$cell +$cell +$cell)+ *$" "$out" || fail "no row for $op"
  ops=$((ops + 1))
done < <("$tool" --ops)
[ "$ops" -gt 30 ] || fail "only $ops ops in the table"
if "$tool" --bogus > "$out" 2>&1; then fail "op_coverage accepted --bogus"; fi
grep -q "usage: op_coverage" "$out" || fail "op_coverage --bogus: no usage"
echo "op coverage ok: $ops ops"
