#!/bin/bash
# Trains a recipe under OpenMPI's mpirun: one rank per MPI process, placed
# and bound by mpirun from a hostfile (by slot, rank 0 on the first host;
# --bind-to core up to 2 processes per node, else socket, as mpirun does).
# The ranks read OMPI_COMM_WORLD_* and meet at the first host of the
# hostfile (MASTER_ADDR, passed to every rank with -x).
#
#   scripts/mpirun.sh --hostfile hosts -- recipes/fmnist_cnn.yaml training.epochs=1
#   scripts/mpirun.sh --hostfile hosts -np 16 --max-restarts 2 --bind-to none \
#       -- recipes/resnet50_imagenet.yaml data.root=/data/imagenet
#
# hosts holds one host per line, with its slots (ranks) in OpenMPI's syntax:
#   node01 slots=8
#   node02 slots=8
#
# Options (before the recipe):
#   --hostfile FILE     required: the hosts and their slots
#   -np N               ranks (default: every slot of the hostfile)
#   --max-restarts K    after a failed run, run mpirun again up to K times with
#                       `--resume auto` (the newest complete checkpoint)
#   --trainer PATH      the trainer binary, at the same path on every host
#                       (default: $TRAINER, else build/trainer of this repository)
#   anything else       passed to mpirun; then a `--` must come before the recipe
#                       (as root: --allow-run-as-root; more ranks than cores: --oversubscribe)
# After the recipe: what `trainer train` takes (key=value overrides, --trace, ...).

set -u

fail() {
  echo "error: $*" >&2
  exit 1
}

usage="usage: scripts/mpirun.sh --hostfile FILE [-np N] [--max-restarts K] [--trainer PATH] [mpirun options --] RECIPE [key=value ...]"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hostfile=""
np=""
max_restarts=0
trainer=${TRAINER:-$here/../build/trainer}
mpirun_args=()
have_separator=0
for arg in "$@"; do [[ "$arg" == "--" ]] && have_separator=1; done

count_arg() {  # option value
  [[ "$2" =~ ^[0-9]+$ ]] || fail "$1 needs a count, not '$2'"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --hostfile | --trainer | -np | -n | --np | --max-restarts)
      [[ $# -ge 2 ]] || fail "$1 needs a value; $usage"
      case "$1" in
        --hostfile) hostfile=$2 ;;
        --trainer) trainer=$2 ;;
        -np | -n | --np) count_arg "$1" "$2" && np=$2 ;;
        --max-restarts) count_arg "$1" "$2" && max_restarts=$2 ;;
      esac
      shift 2
      ;;
    --)
      shift
      break
      ;;
    -*)
      ((have_separator)) || fail "unknown option $1: put mpirun's own options before a '--' that precedes the recipe; $usage"
      mpirun_args+=("$1")
      shift
      ;;
    *)
      ((have_separator)) || break
      mpirun_args+=("$1")  # the value of an mpirun option
      shift
      ;;
  esac
done

[[ -n "$hostfile" ]] || fail "no hostfile: pass --hostfile FILE (one host per line, 'node01 slots=8'; on one machine 'localhost slots=4'); $usage"
[[ -f "$hostfile" && -r "$hostfile" ]] || fail "hostfile $hostfile not found or not readable"
master=$(awk '!/^[[:space:]]*(#|$)/ { print $1; exit }' "$hostfile")
[[ -n "$master" ]] || fail "hostfile $hostfile names no host"
[[ $# -ge 1 ]] || fail "no recipe; $usage"
recipe=$1
shift
[[ "$recipe" != -* ]] || fail "expected the recipe, not the option $recipe; $usage"
[[ -f "$recipe" ]] || fail "recipe $recipe not found"
[[ -x "$trainer" ]] || fail "trainer binary $trainer not found or not executable; build it, or pass --trainer PATH"
command -v mpirun >/dev/null || fail "mpirun not found: install OpenMPI (apt-get install openmpi-bin)"

# `--resume` given by the user applies to the first run; restarts resume
# from the newest complete checkpoint instead.
train_args=("$@")
restart_args=()
for ((i = 0; i < ${#train_args[@]}; i++)); do
  case "${train_args[i]}" in
    --resume) ((i++)) ;;
    --resume=*) ;;
    *) restart_args+=("${train_args[i]}") ;;
  esac
done
restart_args+=(--resume auto)

command=(mpirun --hostfile "$hostfile" -x "MASTER_ADDR=${MASTER_ADDR:-$master}")
[[ -n "$np" ]] && command+=(-np "$np")
[[ -n "${MASTER_PORT:-}" ]] && command+=(-x "MASTER_PORT=$MASTER_PORT")
[[ -n "${OMP_NUM_THREADS:-}" ]] && command+=(-x OMP_NUM_THREADS)
[[ -n "${TRAINER_LOG_LEVEL:-}" ]] && command+=(-x TRAINER_LOG_LEVEL)
command+=("${mpirun_args[@]}")

args=("${train_args[@]}")
for ((attempt = 0; ; attempt++)); do
  echo "mpirun.sh: ${command[*]} $trainer train $recipe ${args[*]}" >&2
  "${command[@]}" "$trainer" train "$recipe" "${args[@]}"
  code=$?
  [[ $code -eq 0 ]] && exit 0
  if ((attempt >= max_restarts)); then
    echo "mpirun.sh: mpirun failed with code $code after $attempt restart(s); giving up" >&2
    exit "$code"
  fi
  echo "mpirun.sh: mpirun failed with code $code; restart $((attempt + 1)) of $max_restarts from the newest checkpoint (--resume auto)" >&2
  args=("${restart_args[@]}")
done
