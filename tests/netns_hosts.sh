#!/bin/bash
# Two "hosts" on this machine for the multi-host tests: network namespaces
# PREFIX-0 and PREFIX-1 joined by a veth pair (mhveth in each) with the
# addresses 10.201.0.1/24 and 10.201.0.2/24. Commands run in a host's
# namespace and in a UTS namespace of its own named host0 or host1, so that
# the trainer sees two hosts (it tells hosts apart by name, boot id and pid
# namespace); inside them the names host0 and host1 resolve to the
# addresses (/etc/netns/NS/hosts, removed with the namespaces).
#
#   netns_hosts.sh guard PREFIX          create them, print "ready", and remove them
#                                        when stdin ends or a signal comes (trap)
#   netns_hosts.sh run PREFIX I ARGV...  run ARGV on host I (0 or 1)
#   netns_hosts.sh ssh PREFIX ADDRESS COMMAND...
#                                        as ssh: run the command line on the host
#                                        with that address (launch_hosts.sh --ssh)
#
# Needs root and iproute2; `guard` exits 77 when it cannot create them.
# PREFIX must end in the pid of the process that owns the namespaces
# ("trnmh1234"): guard first removes namespaces left by dead owners.
set -u

host_name() { echo "host$1"; }
address() { echo "10.201.0.$(($1 + 1))"; }

in_host() {  # prefix index argv...
  local ns="$1-$2" name
  name=$(host_name "$2")
  shift 2
  exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
}

case "${1:-}" in
  guard)
    prefix=$2
    [[ $(id -u) -eq 0 ]] || {
      echo "SKIPPED: not root: network namespaces need root"
      exit 77
    }
    command -v ip >/dev/null && ip netns list >/dev/null 2>&1 || {
      echo "SKIPPED: 'ip netns' is not available (install iproute2)"
      exit 77
    }
    command -v unshare >/dev/null || {
      echo "SKIPPED: unshare (util-linux) is not installed"
      exit 77
    }
    # Namespaces of owners that died without removing theirs.
    base=${prefix%%[0-9]*}
    for ns in $(ip netns list | awk '{ print $1 }'); do
      [[ "$ns" =~ ^${base}([0-9]+)-[01]$ ]] || continue
      [[ -d /proc/${BASH_REMATCH[1]} ]] || {
        ip netns del "$ns" 2>/dev/null
        rm -rf "/etc/netns/$ns"
      }
    done
    remove() {
      for i in 0 1; do
        ip netns del "$prefix-$i" 2>/dev/null
        rm -rf "/etc/netns/$prefix-$i"
      done
      rmdir /etc/netns 2>/dev/null
    }
    trap remove EXIT
    trap 'exit 1' INT TERM HUP
    ip netns add "$prefix-0" && ip netns add "$prefix-1" &&
      ip link add mhveth netns "$prefix-0" type veth peer name mhveth netns "$prefix-1" || {
      echo "SKIPPED: cannot create network namespaces and a veth pair here"
      exit 77
    }
    for i in 0 1; do
      ip -n "$prefix-$i" addr add "$(address $i)/24" dev mhveth &&
        ip -n "$prefix-$i" link set mhveth up &&
        ip -n "$prefix-$i" link set lo up || exit 1
    done
    # Inside the hosts their names resolve to their addresses: `ip netns
    # exec` puts /etc/netns/NS/hosts in place of /etc/hosts.
    for i in 0 1; do
      mkdir -p "/etc/netns/$prefix-$i" &&
        { cat /etc/hosts; printf '%s %s\n' "$(address 0)" "$(host_name 0)" "$(address 1)" "$(host_name 1)"; } \
          >"/etc/netns/$prefix-$i/hosts" || exit 1
    done
    # The link carries traffic once both ends report state UP (carrier):
    # UCX leaves out interfaces that are not running when a rank starts.
    for i in 0 1; do
      for _ in $(seq 100); do
        ip -n "$prefix-$i" -o link show mhveth | grep -q "state UP" && break
        sleep 0.05
      done
      ip -n "$prefix-$i" -o link show mhveth | grep -q "state UP" || {
        echo "the veth link of $prefix-$i did not come up"
        exit 1
      }
    done
    echo ready
    exec >/dev/null 2>&1  # the reader may be gone by the time we clean up
    while read -r _; do :; done
    ;;
  run)
    in_host "$2" "$3" "${@:4}"
    ;;
  ssh)
    prefix=$2 host=$3
    shift 3
    for i in 0 1; do
      [[ "$host" == "$(address $i)" || "$host" == "$(host_name $i)" ]] && in_host "$prefix" "$i" /bin/sh -c "$*"
    done
    echo "ssh: $host: no such host" >&2
    exit 255
    ;;
  *)
    echo "usage: netns_hosts.sh guard PREFIX | run PREFIX I ARGV... | ssh PREFIX ADDRESS COMMAND..." >&2
    exit 2
    ;;
esac
