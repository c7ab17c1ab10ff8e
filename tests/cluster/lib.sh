# shellcheck shell=bash disable=SC2034
# tests/cluster/lib.sh: names and helpers shared by up.sh, down.sh and selftest.sh.
# Sourced, never run. Every name the rig creates starts with "nsc" (nightshift cluster) or
# lives under $NSC_STATE, so that down.sh can find all of it again, even after an up.sh that
# failed half-way and wrote no pid files.

NSC_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
NSC_STATE=/var/lib/nightshift-cluster   # everything the rig writes: configs, data, logs, pids
NSC_NET=198.18.0                        # RFC 2544 benchmark range: nobody's real addresses
NSC_GW=$NSC_NET.1                       # the root namespace on the switch
NSC_REGISTRY=$NSC_GW:5000
NSC_COORDINATOR_PORT=7400
NSC_SWITCH=nsc-switch                   # the namespace holding the bridge
NSC_BRIDGE=nsc-br0
NSC_ROOT_VETH=nsc-root                  # the root namespace's leg on the switch
NSC_MAX_HOSTS=20                        # 198.18.0.11 .. 198.18.0.30
NSC_REGISTRY_USER=nightshift
NSC_BIN=$NSC_REPO/target/debug
NSC_REPLICA_IMAGE=nightshift/vllm-standin:dev
NSC_TRAINER_IMAGE=nightshift/toy-trainer:dev
NSC_BUSYBOX_IMAGE=busybox:latest            # tests/images/build.sh makes all three

# Host i: node name and host name gpuI, namespace nsc-gpuI, address 198.18.0.(10+I).
nsc_host() { echo "gpu$1"; }
nsc_netns() { echo "nsc-gpu$1"; }
nsc_addr() { echo "$NSC_NET.$((10 + $1))"; }
nsc_sock() { echo "$NSC_STATE/gpu$1/docker.sock"; }
nsc_cgroup() { echo "nsc-gpu$1"; }   # the engine's cgroup parent (/nsc-gpuI in every hierarchy)

nsc_log() { printf '[cluster %s] %s\n' "$(date +%T)" "$*" >&2; }
nsc_die() {
  nsc_log "error: $*"
  exit 1
}
nsc_now() { echo "$EPOCHREALTIME"; }
nsc_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# The Docker CLI against host i's engine, with the rig's registry login (never ~/.docker).
nsc_docker() {
  local i=$1
  shift
  DOCKER_CONFIG=$NSC_STATE/docker-client docker -H "unix://$(nsc_sock "$i")" "$@"
}

# Starts host i's agent inside its namespace, with its own host name and engine, on
# $NSC_STATE/gpuI/agent.toml; its pid in agent.pid, its output appended to agent.log.
nsc_agent_start() {
  local i=$1 dir=$NSC_STATE/gpu$1
  # shellcheck disable=SC2016 # expanded by the inner sh
  H=$(nsc_host "$i") setsid ip netns exec "$(nsc_netns "$i")" unshare --uts sh -c 'hostname "$H"; exec "$@"' sh \
    env DOCKER_HOST="unix://$(nsc_sock "$i")" \
    "$NSC_BIN/nightshift-agent" run --config "$dir/agent.toml" \
    >>"$dir/agent.log" 2>&1 </dev/null &
  echo $! >"$dir/agent.pid"
}

# How many hosts the rig that is up has (0 when none).
nsc_hosts() { cat "$NSC_STATE/hosts" 2>/dev/null || echo 0; }

nsc_require_root() {
  [ "$(id -u)" -eq 0 ] || nsc_die "the rig needs root (network namespaces, dockerd, mounts)"
}

# PIDs of processes whose command line mentions the rig's state directory: the agents, the
# coordinator, the registry, the engines and their containerd and shims. Never this shell or
# its ancestors (a caller's command line may name the directory too).
nsc_rig_pids() {
  local p a=$$ self=" $BASHPID "
  while [ "$a" -gt 1 ] 2>/dev/null; do
    self+="$a "
    a=$(awk '{ print $4 }' "/proc/$a/stat" 2>/dev/null || echo 1)
  done
  for p in $(pgrep -f -- "$NSC_STATE/"); do
    [[ $self == *" $p "* ]] || echo "$p"
  done
}

# What a rig left behind, one line per thing (nothing when nothing is left): namespaces, links,
# addresses, processes, shims, mounts, cgroup directories, /etc/netns entries, the state
# directory. selftest.sh checks each of these one by one; scenarios.sh after each down.sh.
nsc_leftovers() {
  ip netns list 2>/dev/null | grep -E '^nsc-' | sed 's/^/namespace /'
  ip -br link 2>/dev/null | grep "^$NSC_ROOT_VETH" | sed 's/^/link /'
  ip -br addr 2>/dev/null | grep "$NSC_GW/" | sed 's/^/address /'
  nsc_rig_pids | sed 's/^/process /'
  findmnt -rn -o TARGET | grep -E "^($NSC_STATE|/run/netns/nsc-)" | sed 's/^/mount /'
  find /sys/fs/cgroup /sys/fs/cgroup/* -maxdepth 1 -name 'nsc-gpu*' 2>/dev/null | sed 's/^/cgroup /'
  find /etc/netns -maxdepth 1 -name 'nsc-*' 2>/dev/null | sed 's/^/netns-etc /'
  [ ! -e "$NSC_STATE" ] || echo "state $NSC_STATE"
}

# Starts host i's dockerd inside its namespace, with its own config file, socket, data root,
# exec root and cgroup parent, all under $NSC_STATE/gpuI; its output appended to dockerd.log.
# up.sh starts every engine with it; the fault harness restarts one (a stopped engine keeps
# its daemon.json and data root, so its images are still there).
#
# `ip netns exec` remounts /sys, which leaves /sys/fs/cgroup empty ("Devices cgroup isn't
# mounted"): the cgroup filesystems of the root namespace are mounted again inside, in the
# engine's own mount namespace (they vanish with it).
nsc_engine_start() {
  local i=$1 dir h cgroup_mounts
  dir=$NSC_STATE/gpu$i
  h=$(nsc_host "$i")
  mkdir -p "$dir"
  cgroup_mounts=$(awk '$3 == "cgroup" || $3 == "cgroup2" { print $3, $4, $2 }' /proc/self/mounts)
  # Its own config file: without --config-file dockerd also reads the machine's
  # /etc/docker/daemon.json and refuses a setting given twice. The registry speaks plain HTTP
  # on the rig's private network, hence insecure-registries.
  cat >"$dir/daemon.json" <<JSON
{
  "storage-driver": "overlay2",
  "cgroup-parent": "/$(nsc_cgroup "$i")",
  "insecure-registries": ["$NSC_REGISTRY"],
  "shutdown-timeout": 5
}
JSON
  # shellcheck disable=SC2016 # expanded by the inner sh
  CG=$cgroup_mounts H=$h setsid ip netns exec "$(nsc_netns "$i")" unshare --uts sh -c '
      hostname "$H"
      mount -t tmpfs -o mode=755 nsc-cgroup /sys/fs/cgroup
      echo "$CG" | while read -r type opts path; do
        mkdir -p "$path" && mount -t "$type" -o "$opts" cgroup "$path" || exit 1
      done || { echo "mounting the cgroup filesystems failed" >&2; exit 1; }
      exec dockerd "$@"' sh \
    --config-file "$dir/daemon.json" \
    --host "unix://$(nsc_sock "$i")" \
    --data-root "$dir/docker" \
    --exec-root "$dir/exec" \
    --pidfile "$dir/dockerd.pid" \
    >>"$dir/dockerd.log" 2>&1 </dev/null &
}

# Waits up to 30 s for host i's engine to answer /_ping; says why not, and fails, if it does not.
nsc_engine_wait() {
  local i=$1
  for _ in $(seq 1 300); do
    [ "$(curl -s --max-time 1 --unix-socket "$(nsc_sock "$i")" http://engine/_ping 2>/dev/null)" = OK ] && return 0
    sleep 0.1
  done
  nsc_log "gpu$i: dockerd did not answer within 30 s; the end of $NSC_STATE/gpu$i/dockerd.log:"
  tail -5 "$NSC_STATE/gpu$i/dockerd.log" >&2
  return 1
}

# Starts the coordinator on $NSC_STATE/coordinator/coordinator.toml (written by up.sh); its
# pid in coordinator/pid, its output appended to coordinator.log.
nsc_coordinator_start() {
  local co=$NSC_STATE/coordinator
  setsid "$NSC_BIN/nightshift-coordinator" serve --config "$co/coordinator.toml" \
    >>"$NSC_STATE/coordinator.log" 2>&1 </dev/null &
  echo $! >"$co/pid"
}

# Waits up to SECONDS for the coordinator's /healthz to answer "ok"; fails when it does not,
# or when its process is gone.
nsc_coordinator_wait() {
  local co=$NSC_STATE/coordinator url=https://$NSC_GW:$NSC_COORDINATOR_PORT
  for _ in $(seq 1 $(($1 * 10))); do
    [ "$(curl -s --max-time 1 --cacert "$NSC_STATE/tls/ca.pem" "$url/healthz" 2>/dev/null)" = ok ] && return 0
    kill -0 "$(cat "$co/pid")" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
