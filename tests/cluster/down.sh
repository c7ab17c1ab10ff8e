#!/usr/bin/env bash
# tests/cluster/down.sh: removes everything tests/cluster/up.sh made: the agents, the
# coordinator, the registry, each host's dockerd with its containerd, shims and containers (by
# PID and by cgroup), the namespaces and veths, /etc/netns entries, the engines' cgroup
# directories and the state directory /var/lib/nightshift-cluster. Safe to run twice, with no
# rig up, and after an up.sh that failed half-way: it looks for what exists rather than
# trusting pid files. Exits 1 when something could not be removed, naming it.
set -uo pipefail
# shellcheck source=tests/cluster/lib.sh
. "$(dirname "$0")/lib.sh"
nsc_require_root

T0=$(nsc_now)
problems=0
problem() {
  nsc_log "$*"
  problems=$((problems + 1))
}

# The command line of PID, or nothing when it is gone.
cmdline() { tr "\0" " " 2>/dev/null <"/proc/$1/cmdline"; }

# stop SECONDS PID...: SIGTERM, wait up to SECONDS for all, then SIGKILL what is left.
stop() {
  local secs=$1 p alive
  shift
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null
  for _ in $(seq 1 $((secs * 10))); do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && return 0
    sleep 0.1
  done
  for p in "$@"; do
    kill -0 "$p" 2>/dev/null && { nsc_log "pid $p ($(cmdline "$p" | cut -c1-60)) ignored SIGTERM: SIGKILL"; kill -KILL "$p" 2>/dev/null; }
  done
  return 0
}

# Rig processes whose command line matches a pattern (a substring).
rig_pids_matching() {
  local p
  for p in $(nsc_rig_pids); do
    [[ "$(cmdline "$p")" == *"$1"* ]] && echo "$p"
  done
}

# The hosts that may exist: those of the state file, and any namespace or directory left.
hosts=$(
  {
    seq 1 "$(nsc_hosts)"
    find /run/netns -maxdepth 1 -name 'nsc-gpu*' -printf '%f\n' 2>/dev/null | sed 's/^nsc-gpu//'
    find "$NSC_STATE" -maxdepth 1 -name 'gpu*' -printf '%f\n' 2>/dev/null | sed 's/^gpu//'
  } | grep -E '^[0-9]+$' | sort -un
)

# ------------------------------------------------------------------ agents, coordinator, registry
# Together (each takes 1 to 2 s to exit), before the engines are emptied; a stopped agent
# leaves its containers running, and starts none.
# shellcheck disable=SC2046
stop 15 $(rig_pids_matching "nightshift-agent run") $(rig_pids_matching "nightshift-coordinator serve") \
  $(rig_pids_matching "docker-registry serve")
nsc_log "agents, coordinator and registry stopped after $(nsc_since "$T0")s"

# ------------------------------------------------------------------ engines
engine_down() {
  local i=$1 sock dir cg ns p cmd ids socks=() nsname id dpid cpid
  dir=$NSC_STATE/gpu$i
  sock=$(nsc_sock "$i")
  cg=$(nsc_cgroup "$i")
  ns=$(nsc_netns "$i")
  if [ -S "$sock" ] && ids=$(timeout 10 docker -H "unix://$sock" ps -aq 2>/dev/null) && [ -n "$ids" ]; then
    # shellcheck disable=SC2086
    timeout 30 docker -H "unix://$sock" rm -f $ids >/dev/null 2>&1
  fi
  dpid=$(rig_pids_matching "dockerd --config-file $dir/daemon.json")
  # shellcheck disable=SC2086
  stop 20 $dpid
  # A dockerd that died takes its containerd along, normally; if not:
  cpid=$(rig_pids_matching "$dir/exec/containerd")
  for p in $cpid; do
    [[ "$(cmdline "$p")" == *containerd-shim* ]] && continue
    # shellcheck disable=SC2086
    stop 5 $p
  done
  # What is left runs only after an aborted run: containers in the engine's cgroup parent,
  # shims and host-network processes in the namespace. Killed by PID; a killed shim leaves
  # its socket /run/containerd/s/sha256("<containerd address>/<namespace>/<id>").
  while read -r p; do
    [ -n "$p" ] || continue
    nsc_log "gpu$i: container process $p left: SIGKILL"
    kill -KILL "$p" 2>/dev/null
  done < <(cat /sys/fs/cgroup/*/"$cg"/*/cgroup.procs /sys/fs/cgroup/"$cg"/*/cgroup.procs 2>/dev/null | sort -un)
  if [ -e "/run/netns/$ns" ]; then
    for p in $(ip netns pids "$ns" 2>/dev/null); do
      cmd=$(cmdline "$p")
      if [[ $cmd == *containerd-shim*"-address $dir/exec/containerd/containerd.sock"* ]]; then
        nsname=$(sed -n 's/.*-namespace \([^ ]*\).*/\1/p' <<<"$cmd")
        id=$(sed -n 's/.*-id \([^ ]*\).*/\1/p' <<<"$cmd")
        socks+=("/run/containerd/s/$(printf '%s' "$dir/exec/containerd/containerd.sock/$nsname/$id" | sha256sum | cut -d' ' -f1)")
      fi
      nsc_log "gpu$i: process $p (${cmd:0:50}) left in $ns: SIGKILL"
      kill -KILL "$p" 2>/dev/null
    done
    if [ ${#socks[@]} -gt 0 ]; then
      sleep 0.2
      rm -f "${socks[@]}"
    fi
  fi
}
pids=()
for i in $hosts; do
  engine_down "$i" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
nsc_log "engines stopped after $(nsc_since "$T0")s"

# Anything else started with the state directory on its command line.
leftover=$(nsc_rig_pids)
if [ -n "$leftover" ]; then
  for p in $leftover; do nsc_log "rig process $p ($(cmdline "$p" | cut -c1-60)) left: SIGKILL"; done
  # shellcheck disable=SC2086
  kill -KILL $leftover 2>/dev/null
  sleep 0.2
fi

# ------------------------------------------------------------------ network
ip link del "$NSC_ROOT_VETH" 2>/dev/null # else it lingers until the switch namespace is reaped
while read -r ns; do
  ip netns del "$ns" || problem "cannot delete network namespace $ns"
done < <(find /run/netns -maxdepth 1 \( -name 'nsc-gpu*' -o -name "$NSC_SWITCH" \) -printf '%f\n' 2>/dev/null)
rm -rf /etc/netns/nsc-gpu*
rmdir /etc/netns 2>/dev/null
# `ip netns add` made /run/netns a shared bind mount of itself; drop it once it is empty.
if mountpoint -q /run/netns && [ -z "$(ls -A /run/netns)" ]; then
  umount /run/netns && rmdir /run/netns
fi

# ------------------------------------------------------------------ cgroups
for d in /sys/fs/cgroup/*/nsc-gpu* /sys/fs/cgroup/nsc-gpu*; do
  [ -d "$d" ] || continue
  find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
  [ -d "$d" ] && problem "cannot remove cgroup $d (processes left: $(tr '\n' ' ' 2>/dev/null <"$d/cgroup.procs"))"
done

# ------------------------------------------------------------------ state
# Never rm -rf through a mount: the engines' overlay mounts live in their own mount
# namespaces, so normally there is none here.
mounts=$(findmnt -rn -o TARGET | grep -E "^$NSC_STATE(/|$)")
if [ -n "$mounts" ]; then
  while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done < <(sort -r <<<"$mounts")
fi
if findmnt -rn -o TARGET | grep -qE "^$NSC_STATE(/|$)"; then
  problem "mounts left under $NSC_STATE, not deleting it: $(findmnt -rn -o TARGET | grep -E "^$NSC_STATE" | tr '\n' ' ')"
elif [ -e "$NSC_STATE" ]; then
  rm -rf "$NSC_STATE" || problem "cannot remove $NSC_STATE"
fi

if [ $problems -gt 0 ]; then
  nsc_log "down.sh: $problems thing(s) left behind (above), after $(nsc_since "$T0")s"
  exit 1
fi
nsc_log "cluster rig down in $(nsc_since "$T0")s"
