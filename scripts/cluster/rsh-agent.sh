#!/usr/bin/env bash
# Open MPI's plm_rsh_agent for the emulated cluster (scripts/cluster.sh run): called as ssh would be,
# `rsh-agent.sh HOST COMMAND...`, it runs COMMAND (a shell command line, as ssh passes it) on HOST by
# entering HOST's network namespace, in a UTS namespace of its own whose hostname is HOST: each
# emulated host then has its own name, as real hosts do. HOST must be a namespace of the cluster in
# MOE_CLUSTER_STATE (set by cluster.sh run): it never enters a namespace the cluster did not make.
set -euo pipefail
host=${1:?usage: rsh-agent.sh HOST COMMAND...}
shift
state=${MOE_CLUSTER_STATE:?rsh-agent.sh runs under 'moe cluster run' (MOE_CLUSTER_STATE unset)}
grep -qx -- "netns=$host" "$state" || { echo "moe cluster: rsh-agent: $host is not a host of $state" >&2; exit 1; }
# The host's own CPUs (cluster.sh up records them when the machine has enough): taskset is inherited
# by Open MPI's daemon there and by every rank it starts.
cpus=$(sed -n "s/^cpuset=$host://p" "$state" | tail -n 1)
pin=()
[[ -n $cpus ]] && pin=(taskset -c "$cpus")
exec "${pin[@]}" ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
