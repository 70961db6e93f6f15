#!/bin/bash
# Starts a job on plain hosts over ssh: `trainer launch` on every host of a
# hostfile (node rank = line number, rendezvous at the first host), with
# each host's output prefixed by its node rank and name. When one host's
# launcher fails, the others are stopped (their launchers get SIGTERM: the
# ranks finish their step and checkpoint), and the script exits with the
# failed host's code. Ctrl-C stops every host the same way.
#
#   scripts/launch_hosts.sh --hostfile hosts --nproc-per-node 8 -- train recipes/resnet50_imagenet.yaml
#   scripts/launch_hosts.sh --hostfile hosts --nproc-per-node 2 --max-restarts 3 \
#       -- train recipes/fmnist_cnn.yaml training.epochs=1
#
# hosts: one host per line (what ssh accepts: name, user@name or address;
# '#' starts a comment). Every host must reach the first one at its name and
# --master-port, ssh to each must not ask for a password, and the trainer,
# the recipe and the data must be at the same paths on every host (a shared
# file system, or copies).
#
# Options (before the `--`):
#   --hostfile FILE       required
#   --nproc-per-node N    ranks per host (default 1)
#   --master-addr A       host of rank 0 (default: the first host of the hostfile)
#   --master-port P       port of the rendezvous store (default 29500)
#   --max-restarts K      passed to `trainer launch`: restart the ranks up to K
#                         times after a failure, resuming from the newest checkpoint
#   --grace-seconds S     passed to `trainer launch`; also how long stopped
#                         hosts get before their ssh is killed (default 30)
#   --trainer PATH        the trainer binary on every host (default: $TRAINER,
#                         else build/trainer of this repository)
#   --workdir DIR         directory the launchers run in (default: this one)
#   --ssh COMMAND         how to reach a host: COMMAND HOST REMOTE-COMMAND
#                         (default: ssh -o BatchMode=yes)
# After `--`: the arguments of every rank (train RECIPE [key=value ...]).

set -u

fail() {
  echo "error: $*" >&2
  exit 1
}

# wait -n -p (below) came with bash 5.1.
((BASH_VERSINFO[0] > 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] >= 1))) ||
  fail "bash 5.1 or newer is needed (this is $BASH_VERSION)"
usage="usage: scripts/launch_hosts.sh --hostfile FILE [--nproc-per-node N] [--master-port P] [--max-restarts K] [options] -- train RECIPE [key=value ...]"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hostfile=""
nproc=1
master_addr=""
master_port=29500
max_restarts=""
grace=30
trainer=${TRAINER:-$here/../build/trainer}
workdir=$PWD
ssh_command="ssh -o BatchMode=yes"

count_arg() {  # option value
  [[ "$2" =~ ^[0-9]+$ ]] || fail "$1 needs a number, not '$2'"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --)
      shift
      break
      ;;
    --hostfile | --nproc-per-node | --master-addr | --master-port | --max-restarts | --grace-seconds | --trainer | --workdir | --ssh)
      [[ $# -ge 2 ]] || fail "$1 needs a value; $usage"
      case "$1" in
        --hostfile) hostfile=$2 ;;
        --nproc-per-node) count_arg "$1" "$2" && nproc=$2 ;;
        --master-addr) master_addr=$2 ;;
        --master-port) count_arg "$1" "$2" && master_port=$2 ;;
        --max-restarts) count_arg "$1" "$2" && max_restarts=$2 ;;
        --grace-seconds) count_arg "$1" "$2" && grace=$2 ;;
        --trainer) trainer=$2 ;;
        --workdir) workdir=$2 ;;
        --ssh) ssh_command=$2 ;;
      esac
      shift 2
      ;;
    *) fail "unexpected argument $1 (the ranks' arguments follow a '--'); $usage" ;;
  esac
done
rank_args=("$@")

[[ -n "$hostfile" ]] || fail "no hostfile: pass --hostfile FILE (one host per line); $usage"
[[ -f "$hostfile" && -r "$hostfile" ]] || fail "hostfile $hostfile not found or not readable"
mapfile -t hosts < <(awk '{ sub(/#.*/, "") } NF { print $1 }' "$hostfile")
[[ ${#hosts[@]} -gt 0 ]] || fail "hostfile $hostfile names no host"
[[ ${#rank_args[@]} -gt 0 ]] || fail "no command for the ranks after '--'; $usage"
if [[ "${rank_args[0]}" =~ ^(train|eval|sample)$ ]]; then
  [[ ${#rank_args[@]} -ge 2 && "${rank_args[1]}" != -* ]] || fail "no recipe: '${rank_args[0]}' needs RECIPE; $usage"
  recipe=${rank_args[1]}
  [[ "$recipe" == /* ]] || recipe=$workdir/$recipe
  [[ -f "$recipe" ]] || fail "recipe ${rank_args[1]} not found (in $workdir)"
fi
[[ -x "$trainer" ]] || fail "trainer binary $trainer not found or not executable; build it, or pass --trainer PATH"
((nproc >= 1)) || fail "--nproc-per-node must be at least 1"
[[ -n "$master_addr" ]] || master_addr=${hosts[0]#*@}
read -ra ssh <<<"$ssh_command"
nnodes=${#hosts[@]}

# The command each host runs: its launcher, and beside it a watcher that
# stops the launcher (SIGTERM) when the host's stdin reaches its end, which
# happens when this script closes its end of the host's pipe or dies, or
# when the ssh connection drops.
remote_command() {  # node_rank
  local launch=("$trainer" launch --nnodes "$nnodes" --node-rank "$1" --nproc-per-node "$nproc"
    --master-addr "$master_addr" --master-port "$master_port" --grace-seconds "$grace")
  [[ -n "$max_restarts" ]] && launch+=(--max-restarts "$max_restarts")
  launch+=(-- "${rank_args[@]}")
  printf 'cd %q || exit 1; exec 3<&0; %s 3<&- </dev/null & pid=$!; ' "$workdir" "$(printf '%q ' "${launch[@]}")"
  printf '( exec 0<&3 3<&-; while read -r _; do :; done; kill -TERM $pid ) >/dev/null 2>&1 & watch=$!; '
  printf 'wait $pid; code=$?; kill $watch 2>/dev/null; exit $code'
}

tmp=$(mktemp -d)
declare -a pids keep_fds
declare -A node_of_pid
killer=""
cleanup() {
  [[ -n "$killer" ]] && kill "$killer" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

# Each host reads its stdin from a pipe this script holds open.
for ((r = 0; r < nnodes; r++)); do
  mkfifo "$tmp/keep$r" || fail "cannot create a pipe in $tmp"
  exec {fd}<>"$tmp/keep$r"
  keep_fds[r]=$fd
done

# In a child: the host pipes stay open only in this script, or no host would see their end.
close_pipes() {
  local fd
  for fd in "${keep_fds[@]}"; do exec {fd}>&-; done
}

stop_hosts() {  # closes every host's pipe; their ssh clients are killed after the grace period
  close_pipes
  keep_fds=()
  if [[ -z "$killer" ]]; then
    (
      sleep "$grace"
      kill -TERM "${pids[@]}" 2>/dev/null
    ) &
    killer=$!
  fi
}

echo "launch_hosts.sh: $nnodes host(s) x $nproc rank(s), rendezvous at $master_addr:$master_port" >&2
for ((r = 0; r < nnodes; r++)); do
  host=${hosts[r]}
  (
    close_pipes
    exec "${ssh[@]}" "$host" "$(remote_command "$r")" <"$tmp/keep$r"
  ) > >(
    close_pipes
    exec sed -u "s|^|node $r ($host): |"
  ) 2>&1 &
  pids[r]=$!
  node_of_pid[$!]=$r
done

interrupted=0
trap 'interrupted=1; stop_hosts' INT TERM
status=0
failed=""
running=("${pids[@]}")
while ((${#running[@]} > 0)); do
  done_pid=""
  wait -n -p done_pid "${running[@]}"
  code=$?
  [[ -n "${done_pid:-}" ]] || continue  # interrupted by a signal (wait unsets it)
  r=${node_of_pid[$done_pid]}
  running=()
  for pid in "${pids[@]}"; do
    [[ $pid != "$done_pid" && -n "${node_of_pid[$pid]:-}" ]] && running+=("$pid")
  done
  unset "node_of_pid[$done_pid]"
  if ((code != 0)) && [[ -z "$failed" ]] && ((!interrupted)); then
    failed=$r
    status=$code
    echo "launch_hosts.sh: node $r (${hosts[r]}) exited with code $code; stopping the other hosts" >&2
    stop_hosts
  fi
done
if ((interrupted)) && [[ -z "$failed" ]]; then
  echo "launch_hosts.sh: interrupted; every host stopped" >&2
  exit 130
fi
[[ -n "$failed" ]] && exit "$status"
exit 0
