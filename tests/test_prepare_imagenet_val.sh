#!/usr/bin/env bash
# scripts/prepare_imagenet_val.sh on a tiny fake ILSVRC2012 validation set:
# six flat images, ground-truth IDs whose order differs from the wnids',
# a text mapping; then a second run (nothing to move) and bad inputs.
#
#   tests/test_prepare_imagenet_val.sh scripts/prepare_imagenet_val.sh
set -euo pipefail
script=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

mkdir "$dir/val"
for i in 1 2 3 4 5 6; do printf 'image %d' "$i" > "$dir/val/$(printf 'ILSVRC2012_val_%08d.JPEG' "$i")"; done
printf '3\n1\n3\n2\n1\n2\n' > "$dir/gt.txt"
printf '1 n00000003\n2 n00000001\n3 n00000002\n' > "$dir/ids.txt"

bash "$script" "$dir/val" "$dir/gt.txt" "$dir/ids.txt" > "$dir/out.txt"
grep -q "moved 6 images (0 already in place) into 3 class folders" "$dir/out.txt" || fail "summary: $(cat "$dir/out.txt")"
expect() {  # image number, wnid
  local name; name=$(printf 'ILSVRC2012_val_%08d.JPEG' "$1")
  [[ -f $dir/val/$2/$name ]] || fail "$name not in $2"
  [[ $(cat "$dir/val/$2/$name") == "image $1" ]] || fail "$name has the wrong content"
}
expect 1 n00000002; expect 2 n00000003; expect 3 n00000002
expect 4 n00000001; expect 5 n00000003; expect 6 n00000001
[[ -z $(find "$dir/val" -maxdepth 1 -type f) ]] || fail "files left at the top of val/"

bash "$script" "$dir/val" "$dir/gt.txt" "$dir/ids.txt" | grep -q "moved 0 images (6 already in place)" ||
  fail "second run is not a no-op"

printf '1 n00000003\n2 n00000001\n' > "$dir/short.txt"
if bash "$script" "$dir/val" "$dir/gt.txt" "$dir/short.txt" 2> "$dir/err.txt"; then fail "missing ID accepted"; fi
grep -q "ILSVRC2012_ID 3 is not in the mapping" "$dir/err.txt" || fail "message: $(cat "$dir/err.txt")"
printf '1 n00000003 extra\n' > "$dir/bad.txt"
if bash "$script" "$dir/val" "$dir/gt.txt" "$dir/bad.txt" 2> "$dir/err.txt"; then fail "bad mapping accepted"; fi
grep -q "line 1: expected" "$dir/err.txt" || fail "message: $(cat "$dir/err.txt")"
if bash "$script" "$dir/nope" "$dir/gt.txt" "$dir/ids.txt" 2> /dev/null; then fail "missing dir accepted"; fi
echo "prepare_imagenet_val: all checks passed"
