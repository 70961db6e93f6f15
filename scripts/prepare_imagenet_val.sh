#!/usr/bin/env bash
# Moves the flat ILSVRC2012 validation images into class folders, so that
# val/ has the same ImageFolder layout as train/ (val/<wnid>/<image>.JPEG).
#
#   scripts/prepare_imagenet_val.sh VAL_DIR GROUND_TRUTH MAPPING
#
#   VAL_DIR       the extracted ILSVRC2012_img_val.tar: ILSVRC2012_val_00000001.JPEG ...
#   GROUND_TRUTH  the devkit's data/ILSVRC2012_validation_ground_truth.txt: line i holds
#                 the ILSVRC2012_ID (1..1000) of image i
#   MAPPING       ILSVRC2012_ID -> WNID, either
#                 - the devkit's data/meta.mat (read with python3 + scipy), or
#                 - a text file with one "ILSVRC2012_ID WNID" pair per line.
#
# The ILSVRC2012_IDs are the devkit's own numbering, not ImageFolder's label
# indices (those follow the sorted wnids), hence the mapping. Without scipy,
# write the text mapping from meta.mat with either of:
#   python3 -c "import scipy.io as s; [print(r['ILSVRC2012_ID'], r['WNID']) for r in
#     s.loadmat('meta.mat', squeeze_me=True)['synsets'] if r['ILSVRC2012_ID'] <= 1000]" > ids.txt
#   octave --eval "load('meta.mat'); for i = 1:1000, printf('%d %s\n', \
#     synsets(i).ILSVRC2012_ID, synsets(i).WNID); end" > ids.txt
#
# Safe to run again: images already in their class folder are left there.
set -euo pipefail

die() { echo "prepare_imagenet_val: $*" >&2; exit 1; }

[[ $# -eq 3 ]] || die "usage: $0 VAL_DIR GROUND_TRUTH MAPPING (see the comment at the top)"
val_dir=$1 ground_truth=$2 mapping=$3
[[ -d $val_dir ]] || die "$val_dir is not a directory"
[[ -f $ground_truth ]] || die "ground truth file $ground_truth not found"
[[ -f $mapping ]] || die "mapping file $mapping not found"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ $mapping == *.mat ]]; then
  python3 - "$mapping" > "$work/ids.txt" <<'PY' || die "cannot read $mapping: python3 with scipy is needed (pip install scipy), or pass a text mapping (see the comment at the top)"
import sys
import scipy.io
synsets = scipy.io.loadmat(sys.argv[1], squeeze_me=True)["synsets"]
for row in synsets:
    if int(row["ILSVRC2012_ID"]) <= 1000:
        print(int(row["ILSVRC2012_ID"]), row["WNID"])
PY
  mapping_text=$work/ids.txt
else
  mapping_text=$mapping
fi

# Check the mapping: "ID WNID" lines, IDs unique, WNIDs of WordNet's form.
awk -v file="$mapping_text" '
  NF == 0 { next }
  NF != 2 || $1 !~ /^[0-9]+$/ || $2 !~ /^n[0-9]+$/ {
    printf "prepare_imagenet_val: %s line %d: expected \"ILSVRC2012_ID WNID\", got \"%s\"\n", file, NR, $0 > "/dev/stderr"; bad = 1; exit 1 }
  seen[$1]++ { printf "prepare_imagenet_val: %s line %d: ID %s given twice\n", file, NR, $1 > "/dev/stderr"; bad = 1; exit 1 }
  END { if (!bad && length(seen) == 0) { printf "prepare_imagenet_val: %s holds no mapping\n", file > "/dev/stderr"; exit 1 } }
' "$mapping_text" || exit 1

# One "image wnid" line per ground-truth line; an ID without a WNID stops everything.
awk -v gt="$ground_truth" '
  NR == FNR { if (NF == 2) wnid[$1] = $2; next }
  NF == 0 { next }
  {
    if (!($1 in wnid)) {
      printf "prepare_imagenet_val: %s line %d: ILSVRC2012_ID %s is not in the mapping\n", gt, FNR, $1 > "/dev/stderr"; exit 1 }
    printf "ILSVRC2012_val_%08d.JPEG %s\n", FNR, wnid[$1]
  }
' "$mapping_text" "$ground_truth" > "$work/moves.txt" || exit 1

moved=0 already=0
while read -r image wnid; do
  if [[ -f $val_dir/$image ]]; then
    mkdir -p "$val_dir/$wnid"
    mv "$val_dir/$image" "$val_dir/$wnid/$image"
    moved=$((moved + 1))
  elif [[ -f $val_dir/$wnid/$image ]]; then
    already=$((already + 1))
  else
    die "$image (line $((moved + already + 1)) of $ground_truth) is neither in $val_dir nor in $val_dir/$wnid"
  fi
done < "$work/moves.txt"

classes=$(cut -d' ' -f2 "$work/moves.txt" | sort -u | wc -l)
echo "prepare_imagenet_val: moved $moved images ($already already in place) into $classes class folders of $val_dir"
