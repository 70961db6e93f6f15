#!/bin/bash
# A one-node Slurm cluster on this machine for the multi-host tests:
# munged, slurmctld and slurmd from Debian's packages, started here in the
# background with a configuration, a munge key, sockets, state and logs of
# their own in DIR (nothing under /etc, no systemd). The node (this host)
# has 4 CPUs whatever the machine has (SlurmdParameters=config_overrides),
# so 4 tasks run on 2 cores.
#
#   slurm_cluster.sh DIR    start the daemons, print "ready SLURM_CONF=DIR/slurm.conf"
#                           once the node is idle, and stop them when stdin
#                           ends or a signal comes (trap)
#   slurm_cluster.sh DIR PREFIX
#                           the same with two nodes, host0 and host1 (2 CPUs
#                           each), the "hosts" of `netns_hosts.sh guard PREFIX`:
#                           slurmctld and one slurmd on host0, the other slurmd
#                           on host1; Slurm's commands must run on host0.
#
# Exits 77 with "SKIPPED: <what is missing>" when a daemon is not installed
# or does not start (then its log's end is printed).
set -u

dir=$1
netns=${2:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
skip() {
  echo "SKIPPED: $*"
  exit 77
}
[[ $(id -u) -eq 0 ]] || skip "not root: slurmd runs jobs as any user only as root"
for program in munged slurmctld slurmd sbatch scontrol sinfo; do
  command -v "$program" >/dev/null || skip "$program is not installed (apt-get install slurmctld slurmd slurm-client munge)"
done

# The nodes, and how to run a command on node i.
if [[ -n "$netns" ]]; then
  nodes=(host0 host1)
  node_lines=("NodeName=host0 NodeAddr=10.201.0.1 CPUs=2 State=UNKNOWN"
    "NodeName=host1 NodeAddr=10.201.0.2 CPUs=2 State=UNKNOWN")
  controller="host0(10.201.0.1)"
  on_node() { exec "$here/netns_hosts.sh" run "$netns" "$@"; }  # in a subshell only
else
  nodes=("$(hostname)")
  node_lines=("NodeName=${nodes[0]} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN")
  controller="${nodes[0]}(127.0.0.1)"
  on_node() { exec "${@:2}"; }
fi
mkdir -p "$dir/state" "$dir/munge" || exit 1
for node in "${nodes[@]}"; do mkdir -p "$dir/spool-$node" || exit 1; done
chmod 700 "$dir/munge"
pids=()
stop() {
  local pid
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
  done
}
trap stop EXIT
trap 'exit 1' INT TERM HUP

# Ports of this cluster: free ones, so that two runs never meet.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo $((20000 + RANDOM % 20000)); }
ctld_port=$(free_port)
slurmd_port=$(free_port)

dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none && chmod 400 "$dir/munge/munge.key"
munged --foreground --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munge/munged.pid" --seed-file="$dir/munge/munged.seed" \
  --log-file="$dir/munge/munged.log" >"$dir/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [[ -S "$dir/munge/munge.socket" ]] && break; sleep 0.1; done
[[ -S "$dir/munge/munge.socket" ]] || { tail -5 "$dir/munged.out" "$dir/munge/munged.log" 2>/dev/null; skip "munged did not start"; }

cat >"$dir/slurm.conf" <<CONF
ClusterName=trainertest
SlurmctldHost=$controller
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=600
$(printf '%s\n' "${node_lines[@]}")
PartitionName=test Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
export SLURM_CONF=$dir/slurm.conf

on_node 0 slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
pids+=($!)
# `ip netns exec` gives a host a sysfs of its own, without the cgroup file
# systems slurmd insists on finding: this host's mounts under
# /sys/fs/cgroup, mounted again there.
cgroups=$(awk '$2 ~ "^/sys/fs/cgroup" { printf "mkdir -p %s && mount -t %s -o %s %s %s; ", $2, $3, $4, $1, $2 }' /proc/self/mounts)
for ((i = 0; i < ${#nodes[@]}; i++)); do
  if [[ -n "$netns" ]]; then
    on_node "$i" /bin/sh -c "$cgroups exec slurmd -D -f '$SLURM_CONF' -N ${nodes[i]}"
  else
    on_node "$i" slurmd -D -f "$SLURM_CONF" -N "${nodes[i]}"
  fi >"$dir/slurmd-${nodes[i]}.out" 2>&1 &
  pids+=($!)
done
for _ in $(seq 150); do
  state=$(on_node 0 sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')
  [[ "$state" == "idle " ]] && break
  sleep 0.2
done
if [[ "$state" != "idle " ]]; then
  tail -n 5 "$dir"/slurmctld.out "$dir"/slurmctld.log "$dir"/slurmd-* 2>/dev/null
  skip "slurmctld and slurmd did not bring up idle nodes (state '${state:-none}'; logs in $dir)"
fi
echo "ready SLURM_CONF=$SLURM_CONF"
exec >/dev/null 2>&1  # the reader may be gone by the time we clean up
while read -r _; do :; done
