#!/usr/bin/env bash
# An emulated cluster on this machine (issue 7): network namespaces as hosts, veth pairs through a
# bridge as the fabric, tc capping every NIC, OpenMPI launching ranks through its ordinary rsh path.
# `moe cluster ...` runs this script; docs/cluster.md describes the design and what was measured.
#
#   cluster.sh check                     root, namespaces and tc work here? (exit 0 / 1 with why)
#   cluster.sh up --nodes N [--ranks-per-node R] [--nic RATE] [--latency T] [--subnet A.B.C] [--mtu M]
#   cluster.sh status | down
#   cluster.sh shape [--nic RATE] [--latency T]        re-cap every link of a running cluster
#   cluster.sh run [--ranks-per-node R] -- COMMAND...   mpirun across the emulated hosts
#   cluster.sh cut NODE | heal NODE | kill NODE         fault injection (NODE: n1 or 1)
#   --name NAME (before or after the verb; default $MOE_CLUSTER_NAME or "moe") picks the cluster.
#
# What `up` makes (all recorded in /run/moe-cluster/NAME/state, which `down` reads):
#   namespaces NAME-head (the fabric: bridge br0, its ports v0..vN-1, address A.B.C.254; mpirun
#   runs here, like a login node) and NAME-n0..NAME-nN-1 (host i: eth0 = A.B.C.(i+1));
#   /etc/netns/<ns>/hosts for each (ip netns exec mounts it over /etc/hosts there).
# CPUs: with at least as many CPUs (in this script's affinity mask) as hosts, each host gets its own
# equal share (cpuset=HOST:LIST in the state; the rsh agent starts the host's processes under
# taskset), so an emulated host sees its own cores as a real one does and moe sizes its threads from
# them. With fewer CPUs than hosts every host shares all of them, and `up` says so.
# Every interface and address is created inside those namespaces, so the machine's own network is
# never touched. Caps: an htb class at RATE on both egresses of every host link (eth0 in the host:
# what it sends; v<i> in the fabric: what it receives), so a host's NIC is full duplex at RATE and
# two flows through it share it. --latency T adds netem delay T/2 on each of the two egresses of a
# path (host to host: T one way); it needs the kernel's sch_netem and is refused without it. Hosts
# ACK at once on the fabric (route option quickack), as the RDMA fabrics the emulation stands for
# have no delayed ACK.
set -euo pipefail

readonly STATE_ROOT=/run/moe-cluster
readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly AGENT="$SCRIPT_DIR/cluster/rsh-agent.sh"

die() { echo "moe cluster: $*" >&2; exit 1; }
bad_usage() { echo "moe cluster: $*" >&2; exit 2; }  # a bad argument exits 2, as moe's other commands
note() { echo "moe cluster: $*"; }

usage() {
  sed -n '5,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

need_root() {
  [[ $(id -u) -eq 0 ]] || die "needs root (it creates network namespaces and tc qdiscs); run it as root"
  command -v ip >/dev/null && command -v tc >/dev/null ||
    die "needs ip and tc (Debian package iproute2; scripts/setup.sh installs it)"
}

# ---- arguments ----
name=${MOE_CLUSTER_NAME:-moe}
verb=""
nodes=0 rpn=1 nic=1gbit latency=0 subnet=10.213.0 mtu=1500
rpn_given=0 nic_given=0 latency_given=0
node_arg=""
cmd=()
while (($#)); do
  case "$1" in
    --name) name=${2:?--name needs a value}; shift 2 ;;
    --nodes) nodes=${2:?}; shift 2 ;;
    --ranks-per-node) rpn=${2:?}; rpn_given=1; shift 2 ;;
    --nic) nic=${2:?}; nic_given=1; shift 2 ;;
    --latency) latency=${2:?}; latency_given=1; shift 2 ;;
    --subnet) subnet=${2:?}; shift 2 ;;
    --mtu) mtu=${2:?}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; cmd=("$@"); break ;;
    -*) bad_usage "unknown option '$1' (see --help)" ;;
    *)
      if [[ -z $verb ]]; then verb=$1
      elif [[ -z $node_arg ]]; then node_arg=$1
      else bad_usage "unexpected argument '$1' (a command to run goes after --)"; fi
      shift ;;
  esac
done
[[ -n $verb ]] || { usage; exit 2; }
# Short names: namespaces are NAME-head / NAME-nI, and every name stays a valid hostname.
[[ $name =~ ^[a-z][a-z0-9]{0,11}$ ]] ||
  bad_usage "--name '$name': use 1-12 lower-case letters or digits, starting with a letter"

readonly STATE_DIR="$STATE_ROOT/$name"
readonly STATE="$STATE_DIR/state"
head_ns="$name-head"
host_ns() { echo "$name-n$1"; }

# Rate in bits/s from tc's notation (100mbit, 1gbit, 10gbit, 500kbit, 1e9).
rate_bps() {
  local v=${1,,} n unit
  [[ $v =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit)?$ ]] || die "--nic '$1': use a rate like 100mbit, 1gbit, 10gbit"
  n=${BASH_REMATCH[1]} unit=${BASH_REMATCH[3]:-bit}
  case $unit in
    bit) awk -v n="$n" 'BEGIN{printf "%.0f", n}' ;;
    kbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e3}' ;;
    mbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e6}' ;;
    gbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e9}' ;;
    tbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e12}' ;;
  esac
}
# Latency in microseconds from 50us, 1ms, 0.
latency_us() {
  local v=${1,,}
  [[ $v =~ ^([0-9]+(\.[0-9]+)?)(us|ms|s)?$ ]] || die "--latency '$1': use a time like 0, 50us, 1ms"
  case ${BASH_REMATCH[3]:-us} in
    us) awk -v n="${BASH_REMATCH[1]}" 'BEGIN{printf "%.0f", n}' ;;
    ms) awk -v n="${BASH_REMATCH[1]}" 'BEGIN{printf "%.0f", n*1e3}' ;;
    s) awk -v n="${BASH_REMATCH[1]}" 'BEGIN{printf "%.0f", n*1e6}' ;;
  esac
}

# ---- state file: key=value lines; several netns= / etcdir= lines, one per object made ----
state_get() { [[ -f $STATE ]] && sed -n "s/^$1=//p" "$STATE" | tail -n 1; }
state_all() { [[ -f $STATE ]] && sed -n "s/^$1=//p" "$STATE"; }
record() { echo "$1=$2" >> "$STATE"; }
load_state() {
  [[ -f $STATE ]] || die "no cluster '$name' (no $STATE): start one with 'moe cluster up --nodes N'"
  nodes=$(state_get nodes) subnet=$(state_get subnet)
  ((rpn_given)) || rpn=$(state_get ranks_per_node)
  ((nic_given)) || nic=$(state_get nic)
  ((latency_given)) || latency=$(state_get latency)
}
ours() { state_all netns | grep -qx -- "$1"; }

node_index() {
  local a=${1#n}
  [[ $a =~ ^[0-9]+$ ]] && ((a < nodes)) || die "node '$1': this cluster has nodes n0..n$((nodes - 1))"
  echo "$a"
}

# The CPUs of this script's affinity mask, one per line (taskset prints a list such as 0-3,6,8-9).
cpu_list() {
  local list part a b c
  list=$(taskset -pc $$ | sed 's/.*: //')
  IFS=, read -ra parts <<< "$list"
  for part in "${parts[@]}"; do
    if [[ $part == *-* ]]; then a=${part%-*} b=${part#*-}; for ((c = a; c <= b; ++c)); do echo "$c"; done
    else echo "$part"; fi
  done
}

# Gives host i CPUs [i*per, (i+1)*per) of the mask when there are enough, recording them in the state.
assign_cpus() {
  local cpus i per list j
  command -v taskset >/dev/null || { note "no taskset (util-linux): the hosts share all CPUs"; return 0; }
  mapfile -t cpus < <(cpu_list)
  if ((${#cpus[@]} < nodes)); then
    record cpus_per_host 0
    note "only ${#cpus[@]} CPU(s) for $nodes hosts: every host shares all of them (moe train runs 1 thread per rank there)"
    return 0
  fi
  per=$((${#cpus[@]} / nodes))
  record cpus_per_host "$per"
  for ((i = 0; i < nodes; ++i)); do
    list=""
    for ((j = i * per; j < (i + 1) * per; ++j)); do list+="${list:+,}${cpus[j]}"; done
    record cpuset "$(host_ns "$i"):$list"
  done
}
host_cpus() { state_all cpuset | sed -n "s/^$1://p" | tail -n 1; }

# TCP segments a host's kernel sent since `up`, how many it retransmitted, and how many of those the
# peer reported as received twice (D-SACK: the first copy had arrived, the retransmission was
# spurious). The counters are the namespace's own (/proc/net/snmp, /proc/net/netstat).
tcp_summary() {
  ip netns exec "$1" awk '
    /^Tcp:/    { if (!tcp_head) { for (i = 2; i <= NF; ++i) t[$i] = i; tcp_head = 1 }
                 else { sent = $t["OutSegs"]; again = $t["RetransSegs"] } }
    /^TcpExt:/ { if (!ext_head) { for (i = 2; i <= NF; ++i) x[$i] = i; ext_head = 1 }
                 else if ("TCPDSACKRecvSegs" in x) twice = $x["TCPDSACKRecvSegs"] }
    END {
      if (sent == "") exit 1
      printf "tcp since up: %d segments sent, %d retransmitted (%.2f%%)", sent, again,
             (sent > 0 ? 100 * again / sent : 0)
      if (twice != "") printf ", %d of them received twice (spurious)", twice
      printf "\n"
    }' /proc/net/snmp /proc/net/netstat
}

# ---- tc ----
# htb: one class at the rate on the device's egress. burst/cburst of ~1 ms at the rate (at least
# 32 KiB) so the token bucket keeps up when the qdisc watchdog fires late on a busy VM; quantum set
# explicitly so large rates do not warn. netem delay as its leaf when a latency is asked for.
shape_dev() {
  local ns=$1 dev=$2 bps=$3 half_us=$4 burst quantum
  burst=$(( bps / 8 / 1000 )); (( burst < 32768 )) && burst=32768
  quantum=60000
  ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
  ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: htb default 1 ||
    die "tc: cannot add an htb qdisc in $ns (kernel without CONFIG_NET_SCH_HTB?)"
  ip netns exec "$ns" tc class add dev "$dev" parent 1: classid 1:1 htb rate "$bps"bit ceil "$bps"bit \
    burst "$burst" cburst "$burst" quantum "$quantum" || die "tc: cannot add the htb class in $ns"
  if (( half_us > 0 )); then
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: netem delay "${half_us}us" limit 100000 2>/dev/null ||
      die "--latency needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), which this kernel lacks; use --latency 0"
  fi
}
shape_all() {
  local bps us half i
  bps=$(rate_bps "$nic") us=$(latency_us "$latency")
  half=$(( us / 2 ))
  for ((i = 0; i < nodes; ++i)); do
    shape_dev "$(host_ns "$i")" eth0 "$bps" "$half"
    shape_dev "$head_ns" "v$i" "$bps" "$half"
  done
}

# ---- verbs ----
do_check() {
  need_root
  local probe="moeprobe$$" mounted_before=0
  # `ip netns add` bind-mounts /run/netns on itself the first time; undo that if the probe made it,
  # so a check leaves nothing behind (a chroot's cleanup cannot remove a busy mount).
  mountpoint -q /run/netns 2>/dev/null && mounted_before=1
  ip netns add "$probe" 2>/dev/null || die "cannot create a network namespace here (ip netns add failed: no CAP_SYS_ADMIN, or a container without netns support)"
  local ok=1 why=""
  if ! ip -n "$probe" link add v0 type veth peer name v1 2>/dev/null; then ok=0 why="cannot create veth pairs"
  elif ! ip netns exec "$probe" tc qdisc add dev v0 root handle 1: htb 2>/dev/null; then ok=0 why="tc htb is not available (CONFIG_NET_SCH_HTB)"
  elif ! command -v unshare >/dev/null; then ok=0 why="unshare (util-linux) is missing"
  elif ! command -v mpirun >/dev/null; then ok=0 why="mpirun is missing (scripts/setup.sh installs OpenMPI)"
  fi
  local netem=no
  ip netns exec "$probe" tc qdisc add dev v1 root netem delay 1ms 2>/dev/null && netem=yes
  ip netns delete "$probe"
  if ((!mounted_before)) && [[ -z $(ls -A /run/netns 2>/dev/null) ]]; then umount /run/netns 2>/dev/null || true; fi
  ((ok)) || die "$why"
  note "ok: root, network namespaces, veth, tc htb; netem (for --latency): $netem"
}

do_up() {
  need_root
  (( nodes >= 1 && nodes <= 250 )) || die "--nodes N: give 1..250 nodes"
  [[ $rpn =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node R: give a positive number"
  [[ $subnet =~ ^10\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || die "--subnet '$subnet': give the first three numbers of a private 10.x.y.0/24"
  rate_bps "$nic" >/dev/null; latency_us "$latency" >/dev/null
  [[ -e $STATE ]] && die "cluster '$name' is already up ($STATE); 'moe cluster down --name $name' first"
  # Refuse before making anything if a name we would use is taken by something we did not make.
  local all=("$head_ns") i ns
  for ((i = 0; i < nodes; ++i)); do all+=("$(host_ns "$i")"); done
  for ns in "${all[@]}"; do
    [[ -e /run/netns/$ns ]] && die "network namespace $ns exists and was not made by this cluster; refusing to touch it"
    [[ -e /etc/netns/$ns ]] && die "/etc/netns/$ns exists and was not made by this cluster; refusing to touch it"
  done
  mkdir -p "$STATE_DIR"
  {
    echo "# moe cluster state, written by scripts/cluster.sh up; 'down' removes exactly what is listed here"
    echo "name=$name"; echo "nodes=$nodes"; echo "ranks_per_node=$rpn"; echo "nic=$nic"; echo "latency=$latency"
    echo "subnet=$subnet"; echo "mtu=$mtu"; echo "created=$(date -Is)"
  } > "$STATE"
  # Anything failing from here on: undo what was made, then report the one error.
  trap 'rc=$?; if ((rc)); then do_down quiet || true; fi' EXIT
  # /etc/netns itself, if we make it, is shared by every cluster: a marker outside any one cluster's
  # state says so, and the last `down` that leaves it empty removes it.
  [[ -d /etc/netns ]] || { mkdir /etc/netns; touch "$STATE_ROOT/etc-netns-made"; }
  for ns in "${all[@]}"; do
    ip netns add "$ns" 2>/dev/null || die "cannot create network namespace $ns (no netns support here?)"
    record netns "$ns"
    mkdir "/etc/netns/$ns"; record etcdir "/etc/netns/$ns"
    ip -n "$ns" link set lo up
  done
  local hosts="127.0.0.1 localhost"$'\n'"$subnet.254 $head_ns"
  for ((i = 0; i < nodes; ++i)); do hosts+=$'\n'"$subnet.$((i + 1)) $(host_ns "$i")"; done
  for ns in "${all[@]}"; do printf '%s\n' "$hosts" > "/etc/netns/$ns/hosts"; done
  # The fabric: a bridge; one veth per host, created from inside the fabric namespace with its peer
  # born in the host's namespace (no interface ever appears in the machine's own namespace).
  ip -n "$head_ns" link add br0 type bridge
  record link "$head_ns/br0"
  ip -n "$head_ns" addr add "$subnet.254/24" dev br0
  for ((i = 0; i < nodes; ++i)); do
    ns=$(host_ns "$i")
    ip -n "$head_ns" link add "v$i" mtu "$mtu" type veth peer name eth0 netns "$ns" mtu "$mtu"
    record link "$head_ns/v$i"; record link "$ns/eth0"
    ip -n "$head_ns" link set "v$i" master br0
    ip -n "$head_ns" link set "v$i" up
    ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    # ACK every segment at once (no delayed ACK) on the fabric: at 10 Gbit/s a sender waiting on an
    # ACK the receiver held back stalled up to 40 ms, about 10 times a 20-step run (docs/cluster.md).
    ip -n "$ns" route replace "$subnet.0/24" dev eth0 proto kernel scope link src "$subnet.$((i + 1))" quickack 1
  done
  ip -n "$head_ns" link set br0 up
  assign_cpus
  # mpirun (in the fabric namespace) waits for every daemon to confirm a job's end; TCP would retry
  # a cut-off daemon for ~15 minutes (tcp_retries2 = 15). Give up after ~3 s (RTO 0.2+0.4+0.8+1.6 s)
  # so a cut host ends the job promptly. Only this namespace's sysctl: ranks' sockets keep the default.
  ip netns exec "$head_ns" sh -c 'echo 3 > /proc/sys/net/ipv4/tcp_retries2'
  shape_all
  trap - EXIT
  local per
  per=$(state_get cpus_per_host)
  note "up: $nodes nodes x $rpn rank(s) ($head_ns, $(host_ns 0)..$(host_ns $((nodes - 1)))), NIC $nic full duplex, latency $latency, subnet $subnet.0/24, $( ((per > 0)) && echo "$per CPU(s) per host" || echo "CPUs shared by all hosts")"
}

# Kills every process in the namespace: SIGTERM, then SIGKILL whatever is left after 2 s.
kill_ns() {
  local ns=$1 pids t
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [[ -z $pids ]] && return 0
  kill -TERM $pids 2>/dev/null || true
  for ((t = 0; t < 20; ++t)); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -z $pids ]] && return 0
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null || true
  sleep 0.2
}

do_down() {
  local quiet=${1:-}
  need_root
  if [[ ! -f $STATE ]]; then
    [[ -n $quiet ]] || note "down: no cluster '$name' is up; nothing to do"
    return 0
  fi
  local ns d
  # Hosts first, so no job in them outlives its network; then the fabric namespace.
  for ns in $(state_all netns | tac); do
    [[ -e /run/netns/$ns ]] || continue
    kill_ns "$ns"
    ip netns delete "$ns" || die "down: cannot delete namespace $ns"
  done
  for d in $(state_all etcdir); do
    [[ $d == /etc/netns/"$name"-* ]] && rm -rf -- "$d"
  done
  rm -f "$STATE" "$STATE_DIR/hostfile"
  rmdir "$STATE_DIR" 2>/dev/null || true
  if [[ -f $STATE_ROOT/etc-netns-made ]] && rmdir /etc/netns 2>/dev/null; then rm -f "$STATE_ROOT/etc-netns-made"; fi
  rmdir "$STATE_ROOT" 2>/dev/null || true
  [[ -n $quiet ]] || note "down: removed cluster '$name'"
}

do_status() {
  need_root
  if [[ ! -f $STATE ]]; then note "no cluster '$name' is up"; return 0; fi
  load_state
  echo "cluster $name: $nodes nodes x $rpn rank(s), NIC $nic full duplex, latency $latency, subnet $subnet.0/24, since $(state_get created)"
  local i ns link cap procs
  for ((i = -1; i < nodes; ++i)); do
    if ((i < 0)); then ns=$head_ns; else ns=$(host_ns "$i"); fi
    if [[ ! -e /run/netns/$ns ]]; then echo "  $ns: MISSING (namespace gone)"; continue; fi
    if ((i < 0)); then
      echo "  $ns: fabric (bridge br0, $subnet.254), runs mpirun"
    else
      link=$(ip -n "$head_ns" -o link show "v$i" 2>/dev/null | grep -q 'state UP' && echo up || echo "DOWN (cut)")
      cap=$(ip netns exec "$ns" tc class show dev eth0 2>/dev/null | sed -n 's/.* rate \([^ ]*\) .*/\1/p' | head -1)
      echo "  $ns: eth0 $subnet.$((i + 1)), link $link, cap ${cap:-none} each way, CPUs $(host_cpus "$ns" | grep . || echo "all (shared)")"
      echo "    $(tcp_summary "$ns" || echo "tcp: counters unreadable")"
    fi
    procs=$(ip netns pids "$ns" 2>/dev/null | xargs -r ps -o pid=,comm= -p 2>/dev/null | awk '{printf "%s%s(%s)", sep, $2, $1; sep=" "}')
    echo "    running: ${procs:-nothing}"
  done
}

do_shape() {
  need_root
  load_state
  shape_all
  sed -i "s/^nic=.*/nic=$nic/; s/^latency=.*/latency=$latency/" "$STATE"
  note "shape: NIC $nic full duplex, latency $latency on every host"
}

do_link() {
  need_root
  load_state
  [[ -n $node_arg ]] || die "$verb NODE: which node (n0..n$((nodes - 1)))?"
  local i
  i=$(node_index "$node_arg")
  # The fabric side of the host's cable: the host's eth0 loses carrier with it, as with a pulled cable.
  if [[ $verb == cut ]]; then ip -n "$head_ns" link set "v$i" down; note "cut: $(host_ns "$i") is off the fabric"
  else ip -n "$head_ns" link set "v$i" up; note "heal: $(host_ns "$i") is back on the fabric"; fi
}

do_kill() {
  need_root
  load_state
  [[ -n $node_arg ]] || die "kill NODE: which node (n0..n$((nodes - 1)))?"
  local i ns pids
  i=$(node_index "$node_arg")
  ns=$(host_ns "$i")
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [[ -n $pids ]] || { note "kill: nothing runs on $ns"; return 0; }
  # SIGKILL, as a crashing host would: no process gets to say goodbye. The job's processes go first
  # and the Open MPI daemon (orted) once they are gone: mpirun then reports each lost process by its
  # rank ("process rank 1 ... exited on signal 9"); a daemon lost first is reported by host only.
  local procs=() daemons=() p t n=0
  for p in $pids; do
    if [[ $(cat /proc/"$p"/comm 2>/dev/null) == orted ]]; then daemons+=("$p"); else procs+=("$p"); fi
  done
  if ((${#procs[@]})); then
    kill -KILL "${procs[@]}" 2>/dev/null || true
    for ((t = 0; t < 20; ++t)); do
      n=0; for p in "${procs[@]}"; do [[ -e /proc/$p ]] && n=$((n + 1)); done
      ((n == 0)) && break
      sleep 0.05
    done
    sleep 0.3  # the daemon reports its children's deaths to mpirun
  fi
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [[ -n $pids ]] && kill -KILL $pids 2>/dev/null || true
  note "kill: killed ${#procs[@]} process(es) and ${#daemons[@]} daemon(s) on $ns"
}

do_run() {
  need_root
  load_state
  ((${#cmd[@]})) || die "run: give the command after --, e.g. 'moe cluster run -- moe train --steps 10'"
  [[ $rpn =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node R: give a positive number"
  local i ns hostfile="$STATE_DIR/hostfile" np=$((nodes * rpn))
  for ns in "$head_ns" $(for ((i = 0; i < nodes; ++i)); do host_ns "$i"; done); do
    [[ -e /run/netns/$ns ]] || die "run: namespace $ns is gone; 'moe cluster down' and up again"
  done
  : > "$hostfile"
  for ((i = 0; i < nodes; ++i)); do echo "$(host_ns "$i") slots=$rpn" >> "$hostfile"; done
  # `moe` as the command: the moe that called us (MOE_BIN, set by `moe cluster`) unless on PATH.
  if [[ ${cmd[0]} == moe ]] && ! command -v moe >/dev/null && [[ -n ${MOE_BIN:-} ]]; then cmd[0]=$MOE_BIN; fi
  local cores
  cores=$(nproc)
  local mpi=(mpirun --hostfile "$hostfile" -n "$np" --map-by slot
    # Each host's processes run under its cpuset (the rsh agent's taskset) or, with too few CPUs, on
    # all of them; Open MPI's own binding would pin rank 0 of every host to the same core.
    --bind-to none
    # ssh's place: enter the host's namespace (and a UTS namespace with its hostname).
    --mca plm_rsh_agent "$AGENT" --mca plm_rsh_no_tree_spawn 1
    # Only the emulated fabric: daemons and ranks never find another path between the namespaces.
    --mca oob_tcp_if_include "$subnet.0/24" --mca btl_tcp_if_include "$subnet.0/24"
    --mca btl self,vader,tcp
    # Daemons and mpirun probe their idle connections every second: a cut host's daemon is declared
    # lost after ~5 s (not Open MPI's default 300 + 9 x 20 s), and a cut-off daemon ends itself and
    # its ranks instead of lingering.
    --mca oob_tcp_keepalive_time 2 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 3)
  # Open MPI 4.1's TCP BTL with its RDMA-pipeline (put) protocol serialises the two directions of a
  # bidirectional exchange on one connection: measured 95 Mbit/s each way at a 200 Mbit/s cap,
  # 190 Mbit/s with plain send/receive fragments. Keep send/receive unless the user chose otherwise.
  [[ -n ${OMPI_MCA_btl_tcp_flags:-} ]] || mpi+=(--mca btl_tcp_flags send)
  # Messages up to 1 MiB go eagerly, without the rendezvous (64 KiB by default) whose handshake waits
  # for the receiver's lane to be scheduled: with 2 ranks on a host's one core that wait is a time
  # slice. Measured 2026-11-28 (16-step runs, skew 1.5, 3 rounds): 2 x 2 at 1 Gbit/s ep 0.93 and
  # hecate 0.85 of their steps with the default; 2 x 1 at 1 and 10 Gbit/s within 2% either way.
  [[ -n ${OMPI_MCA_btl_tcp_eager_limit:-} ]] ||
    mpi+=(--mca btl_tcp_eager_limit 1048576 --mca btl_tcp_rndv_eager_limit 1048576
      --mca btl_tcp_max_send_size 1048576)
  # More ranks than the CPUs they run on (a host's own, or the machine's when hosts share them):
  # idle ranks yield, and OpenMP threads forced beyond one per CPU wait passively.
  local per
  per=$(state_get cpus_per_host)
  if { ((${per:-0} > 0)) && ((rpn > per)); } || { ((${per:-0} == 0)) && ((np > cores)); }; then
    mpi+=(--mca mpi_yield_when_idle 1)
  fi
  if ((${per:-0} == 0)) && ((np > cores)) && [[ -z ${OMP_WAIT_POLICY:-} ]]; then export OMP_WAIT_POLICY=PASSIVE; fi
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # mpirun names a lost daemon by its host, a failed process by its rank: say which is which.
  local map="" r
  for ((i = 0; i < nodes; ++i)); do
    map+="${map:+, }$(host_ns "$i"): rank"; ((rpn > 1)) && map+=s
    for ((r = i * rpn; r < (i + 1) * rpn; ++r)); do map+=" $r"; done
  done
  echo "moe cluster: run on $nodes hosts ($map), NIC $nic, latency $latency" >&2
  export MOE_CLUSTER_NAME=$name MOE_CLUSTER_STATE=$STATE
  # For the job (benchmarks and tests compare their times with the cap).
  export MOE_CLUSTER_NIC=$nic MOE_CLUSTER_NIC_BPS=$(rate_bps "$nic") MOE_CLUSTER_MTU=$(state_get mtu)
  # mpirun runs in the fabric namespace, so every host is remote to it and is started alike.
  exec ip netns exec "$head_ns" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$head_ns" "${mpi[@]}" "${cmd[@]}"
}

case "$verb" in
  check) do_check ;;
  up) do_up ;;
  down) do_down ;;
  status) do_status ;;
  shape) do_shape ;;
  cut|heal) do_link ;;
  kill) do_kill ;;
  run) do_run ;;
  help) usage ;;
  *) bad_usage "unknown command '$verb' (check, up, down, status, shape, run, cut, heal, kill)" ;;
esac
