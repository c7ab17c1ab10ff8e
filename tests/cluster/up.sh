#!/usr/bin/env bash
# tests/cluster/up.sh [N]: a nightshift cluster of N hosts (default 3) on this one machine.
#
#   switch      namespace nsc-switch holding bridge nsc-br0. Not in the root namespace: the
#               machine's own Docker engine sets the root FORWARD policy to DROP and
#               br_netfilter sends bridged frames through it, so host-to-host frames on a
#               root-namespace bridge would be dropped.
#   root        joins the switch as 198.18.0.1 (veth nsc-root): the coordinator (:7400) and
#               the registry (:5000) listen there.
#   host I      namespace nsc-gpuI, eth0 at 198.18.0.(10+I)/24, host name gpuI (its own UTS
#               namespace), no default route: nothing in a host reaches beyond 198.18.0.0/24.
#               Its own dockerd (socket, data root, exec root, config file, cgroup parent
#               /nsc-gpuI, all under /var/lib/nightshift-cluster/gpuI) and its own
#               nightshift-agent (4 fake GPUs, the vLLM stand-in as replica), both started
#               inside the namespace.
#   registry    Debian's docker-registry with htpasswd (bcrypt) auth, holding the stand-in
#               images, which the agents pull from it (no engine holds an image at up time),
#               with the credentials of their [registry] auth_file, $NSC_STATE/registry-auth.json.
#   checkpoints every agent keeps them in $NSC_STATE/shared/checkpoints ([checkpoints] storage
#               = "shared"): the hosts share the machine's file system, so that one directory
#               is at the same path on every host.
#
# The coordinator and the agents speak mutual TLS (the cluster CA of `nightshift-coordinator
# tls init`, one certificate per node), and the API needs a token (an admin token is created).
# The script ends by printing the lines to paste into a shell; tests/cluster/down.sh removes
# everything. docs/CLUSTER.md explains the rig. Needs root.
set -Eeuo pipefail
# shellcheck source=tests/cluster/lib.sh
. "$(dirname "$0")/lib.sh"

N=${1:-3}
if ! [[ $N =~ ^[0-9]+$ ]] || [ "$N" -lt 1 ] || [ "$N" -gt "$NSC_MAX_HOSTS" ]; then
  nsc_die "usage: up.sh [N], N hosts from 1 to $NSC_MAX_HOSTS (default 3)"
fi
nsc_require_root

# Idempotence: one rig at a time, and never on top of the remains of a failed one.
if [ -e "$NSC_STATE" ] || [ -e "/run/netns/$NSC_SWITCH" ] || ip link show "$NSC_ROOT_VETH" >/dev/null 2>&1; then
  nsc_die "a cluster rig is already up ($(nsc_hosts) hosts; state in $NSC_STATE), or a failed up.sh left \
parts of one: run tests/cluster/down.sh first"
fi

# From here on a failure leaves parts of a rig: say where, and what removes them.
trap 'nsc_log "up.sh failed at line $LINENO: $BASH_COMMAND"' ERR
on_exit() {
  local rc=$?
  [ $rc -eq 0 ] || nsc_log "up.sh failed (exit $rc); logs: $NSC_STATE/*.log, $NSC_STATE/gpu*/*.log; \
remove what it made with tests/cluster/down.sh"
}
trap on_exit EXIT

T0=$(nsc_now)

# ------------------------------------------------------------------ what the rig needs
need_pkgs=()
command -v docker-registry >/dev/null || need_pkgs+=(docker-registry)
command -v htpasswd >/dev/null || need_pkgs+=(apache2-utils)
command -v busybox >/dev/null || need_pkgs+=(busybox-static)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  nsc_log "installing ${need_pkgs[*]} with apt"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
for tool in dockerd docker ip unshare setsid curl jq; do
  command -v "$tool" >/dev/null || nsc_die "$tool is missing (docker.io, iproute2, util-linux, curl, jq)"
done
if [ ! -x "$NSC_BIN/nightshift-coordinator" ] || [ ! -x "$NSC_BIN/nightshift-agent" ] || [ ! -x "$NSC_BIN/nightshift" ]; then
  nsc_log "building the coordinator, the agent and the CLI"
  (cd "$NSC_REPO" && cargo build -q -p nightshift-coordinator -p nightshift-agent -p nightshift-cli)
fi
for image in "$NSC_REPLICA_IMAGE" "$NSC_TRAINER_IMAGE" "$NSC_BUSYBOX_IMAGE"; do
  if ! docker image inspect "$image" >/dev/null 2>&1; then
    nsc_log "building the stand-in images on this machine's engine (tests/images/build.sh)"
    bash "$NSC_REPO/tests/images/build.sh"
    break
  fi
done

mkdir -p "$NSC_STATE"
chmod 0700 "$NSC_STATE"

# ------------------------------------------------------------------ network
t=$(nsc_now)
ip netns add "$NSC_SWITCH"
ip -n "$NSC_SWITCH" link set lo up
ip -n "$NSC_SWITCH" link add "$NSC_BRIDGE" type bridge
ip -n "$NSC_SWITCH" link set "$NSC_BRIDGE" up
ip link add "$NSC_ROOT_VETH" type veth peer name to-root netns "$NSC_SWITCH"
ip -n "$NSC_SWITCH" link set to-root master "$NSC_BRIDGE" up
ip addr add "$NSC_GW/24" dev "$NSC_ROOT_VETH"
ip link set "$NSC_ROOT_VETH" up
mkdir -p /etc/netns
for i in $(seq 1 "$N"); do
  ns=$(nsc_netns "$i")
  ip netns add "$ns"
  ip -n "$NSC_SWITCH" link add "to-gpu$i" type veth peer name eth0 netns "$ns"
  ip -n "$NSC_SWITCH" link set "to-gpu$i" master "$NSC_BRIDGE" up
  ip -n "$ns" addr add "$(nsc_addr "$i")/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  # No default route. `ip netns exec` bind-mounts these two over /etc/hosts and
  # /etc/resolv.conf for what runs in the namespace.
  mkdir -p "/etc/netns/$ns"
  echo "nameserver $NSC_GW" >"/etc/netns/$ns/resolv.conf"
  {
    echo "127.0.0.1 localhost"
    echo "$NSC_GW coordinator registry"
    for j in $(seq 1 "$N"); do echo "$(nsc_addr "$j") $(nsc_host "$j")"; done
  } >"/etc/netns/$ns/hosts"
done
echo "$N" >"$NSC_STATE/hosts"
nsc_log "network: switch, gateway $NSC_GW and $N hosts in $(nsc_since "$t")s"

# ------------------------------------------------------------------ checkpoints
# The shared checkpoint directory: the hosts share this machine's file system, so one plain
# directory is "mounted at the same path on every host" (an NFS mount on a real cluster).
mkdir -p "$NSC_STATE/shared/checkpoints"
# NSC_CHECKPOINT_MB=M puts that directory on a tmpfs of M MiB, and NSC_CHECKPOINT_MIN_FREE_MB=F
# sets the agents' checkpoint_min_free_bytes to F MiB (1 GiB, the default, otherwise), so that
# the fault harness can fill the volume below the floor; down.sh unmounts it with the rest.
# Mounted before the engines start: each runs in a mount namespace of its own (ip netns exec),
# copied from this one when it starts, and must see the tmpfs to bind it into job containers.
if [ -n "${NSC_CHECKPOINT_MB:-}" ]; then
  [[ $NSC_CHECKPOINT_MB =~ ^[0-9]+$ ]] || nsc_die "NSC_CHECKPOINT_MB must be a number of MiB, not [$NSC_CHECKPOINT_MB]"
  mount -t tmpfs -o "size=${NSC_CHECKPOINT_MB}m,mode=0755" nsc-checkpoints "$NSC_STATE/shared/checkpoints"
fi
min_free_mb=${NSC_CHECKPOINT_MIN_FREE_MB:-1024}
[[ $min_free_mb =~ ^[0-9]+$ ]] || nsc_die "NSC_CHECKPOINT_MIN_FREE_MB must be a number of MiB, not [$min_free_mb]"

# ------------------------------------------------------------------ engines
t=$(nsc_now)
for i in $(seq 1 "$N"); do nsc_engine_start "$i"; done
for i in $(seq 1 "$N"); do nsc_engine_wait "$i"; done
nsc_log "engines: $N dockerd up in $(nsc_since "$t")s"

# ------------------------------------------------------------------ registry
t=$(nsc_now)
reg=$NSC_STATE/registry
mkdir -p "$reg/storage"
password=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
(umask 077 && printf '%s\n' "$password" >"$reg/password")
htpasswd -Bbc "$reg/htpasswd" "$NSC_REGISTRY_USER" "$password" 2>/dev/null
cat >"$reg/config.yml" <<EOF
version: 0.1
log:
  level: info
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $reg/storage
  delete:
    enabled: true
http:
  addr: $NSC_REGISTRY
  secret: $(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
auth:
  htpasswd:
    realm: nightshift-cluster
    path: $reg/htpasswd
EOF
setsid docker-registry serve "$reg/config.yml" >"$NSC_STATE/registry.log" 2>&1 </dev/null &
echo $! >"$reg/pid"
for _ in $(seq 1 100); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://$NSC_REGISTRY/v2/")" = 401 ] && break
  kill -0 "$(cat "$reg/pid")" 2>/dev/null || break
  sleep 0.1
done
[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://$NSC_REGISTRY/v2/")" = 401 ] || {
  tail -5 "$NSC_STATE/registry.log" >&2
  nsc_die "the registry did not answer on $NSC_REGISTRY"
}
nsc_log "registry on $NSC_REGISTRY (htpasswd auth, user $NSC_REGISTRY_USER) up in $(nsc_since "$t")s"

# ------------------------------------------------------------------ images
# Built on the machine's own engine; pushed through gpu1's engine, because the machine's engine
# does not trust a plain-HTTP registry at 198.18.0.1 (only loopback ones) and its daemon.json
# is not the rig's to change. `docker login` keeps its credentials in
# $NSC_STATE/docker-client (DOCKER_CONFIG), never in ~/.docker.
t=$(nsc_now)
mkdir -p "$NSC_STATE/docker-client"
printf '%s\n' "$password" | nsc_docker 1 login -u "$NSC_REGISTRY_USER" --password-stdin "$NSC_REGISTRY" >/dev/null
images=("$NSC_REPLICA_IMAGE" "$NSC_TRAINER_IMAGE" "$NSC_BUSYBOX_IMAGE")
docker save "${images[@]}" | nsc_docker 1 load -q >/dev/null
for image in "${images[@]}"; do
  nsc_docker 1 tag "$image" "$NSC_REGISTRY/$image"
  nsc_docker 1 push -q "$NSC_REGISTRY/$image" >/dev/null
  nsc_docker 1 rmi -f "$image" "$NSC_REGISTRY/$image" >/dev/null
done
# No engine holds an image now, gpu1's included: each agent pulls the replica's image and
# every job's image itself, with the credentials of its [registry] auth_file, a Docker
# config.json the rig writes here. Every host reads the same file.
auth=$(printf '%s:%s' "$NSC_REGISTRY_USER" "$password" | base64 -w0)
(umask 077 && printf '{"auths": {"%s": {"auth": "%s"}}}\n' "$NSC_REGISTRY" "$auth" >"$NSC_STATE/registry-auth.json")
nsc_log "images: pushed ${#images[@]} to $NSC_REGISTRY in $(nsc_since "$t")s (the agents pull them)"

# ------------------------------------------------------------------ coordinator
t=$(nsc_now)
co=$NSC_STATE/coordinator
tls=$NSC_STATE/tls
mkdir -p "$co/data" "$tls"
# NSC_COORDINATOR_DATA_MB=M puts the coordinator's data directory on a tmpfs of M MiB, so that
# the fault harness can fill it (a full disk); down.sh unmounts it with the rest.
if [ -n "${NSC_COORDINATOR_DATA_MB:-}" ]; then
  [[ $NSC_COORDINATOR_DATA_MB =~ ^[0-9]+$ ]] || nsc_die "NSC_COORDINATOR_DATA_MB must be a number of MiB, not [$NSC_COORDINATOR_DATA_MB]"
  mount -t tmpfs -o "size=${NSC_COORDINATOR_DATA_MB}m,mode=0700" nsc-coordinator-data "$co/data"
fi
"$NSC_BIN/nightshift-coordinator" tls init --dir "$tls" --server-name "$NSC_GW" >/dev/null
token=$("$NSC_BIN/nightshift-coordinator" token create --role admin --name cluster-rig --data-dir "$co/data" 2>/dev/null)
(umask 077 && printf '%s\n' "$token" >"$co/admin-token")
cat >"$co/coordinator.toml" <<EOF
# The cluster rig's coordinator (tests/cluster/up.sh): short windows, so that a quiet service
# lends its spare nodes within seconds.
listen = "$NSC_GW:$NSC_COORDINATOR_PORT"
data_dir = "$co/data"
heartbeat_interval_ms = 500
lease_ttl_ms = 15000

[[services]]
name = "default"
min_replicas = 1
cooldown_s = 5.0
gateway_signal_ttl_s = 5.0
[services.scale_down]
max_waiting = 0.0
max_running_per_replica = 4.0
window_s = 5.0
[services.scale_up]
waiting_per_replica = 2.0
running_per_replica = 32.0

[tls]
ca_file = "$tls/ca.pem"
cert_file = "$tls/coordinator.pem"
key_file = "$tls/coordinator.key"
EOF
"$NSC_BIN/nightshift-coordinator" validate --config "$co/coordinator.toml" >/dev/null
nsc_coordinator_start
url=https://$NSC_GW:$NSC_COORDINATOR_PORT
nsc_coordinator_wait 10 || {
  tail -5 "$NSC_STATE/coordinator.log" >&2
  nsc_die "the coordinator did not answer at $url/healthz"
}
nsc_log "coordinator at $url up in $(nsc_since "$t")s"

# ------------------------------------------------------------------ agents
t=$(nsc_now)
for i in $(seq 1 "$N"); do
  dir=$NSC_STATE/gpu$i
  h=$(nsc_host "$i")
  addr=$(nsc_addr "$i")
  mkdir -p "$dir/tls" "$dir/agent"
  "$NSC_BIN/nightshift-coordinator" tls issue --node "$h" --dir "$tls" --out "$dir/tls" >/dev/null
  cp "$tls/ca.pem" "$dir/tls/ca.pem"
  # The engine is named by DOCKER_HOST, which nsc_agent_start (lib.sh) sets; `[engine]
  # docker_host` in agent.toml would name it as well.
  cat >"$dir/agent.toml" <<EOF
# Host $h of the cluster rig (tests/cluster/up.sh). Its engine: DOCKER_HOST=unix://$(nsc_sock "$i").
coordinator = "$url"
node = "$h"
service = "default"
address = "$addr"
rendezvous_bind_ip = "$addr"
work_dir = "$dir/agent"
readiness_listen = "$addr:7401"
api_listen = "$addr:7402"
readiness_grace_s = 0.5
drain_timeout_s = 30.0
free_timeout_s = 10.0
health_timeout_s = 120.0
checkpoint_min_free_bytes = $((min_free_mb * 1048576))

[gpus]
fake = 4

[replica]
image = "$NSC_REGISTRY/$NSC_REPLICA_IMAGE"
port = 8000
host_ip = "$addr"
host_port = 8000
shutdown_timeout_s = 10.0
env = ["STANDIN_LOAD_DELAY_MS=500", "STANDIN_TOKEN_LATENCY_MS=10", "STANDIN_MAX_NUM_SEQS=16"]

[registry]
auth_file = "$NSC_STATE/registry-auth.json"

[checkpoints]
storage = "shared"
shared_dir = "$NSC_STATE/shared/checkpoints"

[tls]
ca_file = "$dir/tls/ca.pem"
cert_file = "$dir/tls/$h.pem"
key_file = "$dir/tls/$h.key"
EOF
  "$NSC_BIN/nightshift-agent" validate --config "$dir/agent.toml" >/dev/null
  nsc_agent_start "$i"
done
# An agent is up once its replica serves: GET /ready answers 200.
for i in $(seq 1 "$N"); do
  addr=$(nsc_addr "$i")
  for _ in $(seq 1 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://$addr:7401/ready")" = 200 ] && break
    kill -0 "$(cat "$NSC_STATE/gpu$i/agent.pid")" 2>/dev/null || break
    sleep 0.1
  done
  [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://$addr:7401/ready")" = 200 ] || {
    tail -20 "$NSC_STATE/gpu$i/agent.log" >&2
    nsc_die "gpu$i: the agent's replica is not ready at http://$addr:7401/ready"
  }
done
# ...and once the coordinator has heard so (a heartbeat later), as `nightshift nodes` shows.
serving=0
for _ in $(seq 1 100); do
  serving=$(NIGHTSHIFT_URL=$url NIGHTSHIFT_CA=$tls/ca.pem NIGHTSHIFT_TOKEN=$token \
    "$NSC_BIN/nightshift" nodes -o json 2>/dev/null |
    jq '[.nodes[] | select(.mode == "serve" and .replica.state == "serving")] | length' 2>/dev/null || echo 0)
  [ "$serving" = "$N" ] && break
  sleep 0.1
done
[ "$serving" = "$N" ] || nsc_die "the coordinator sees $serving of $N nodes serving after 10 s (see $NSC_STATE/coordinator.log)"
nsc_log "agents: $N nodes serving in $(nsc_since "$t")s"

cat >"$NSC_STATE/env" <<EOF
export NIGHTSHIFT_URL=$url
export NIGHTSHIFT_CA=$tls/ca.pem
export NIGHTSHIFT_TOKEN=$token
export PATH=$NSC_BIN:\$PATH
EOF
chmod 0600 "$NSC_STATE/env"
nsc_log "cluster of $N hosts up in $(nsc_since "$T0")s; tear it down with tests/cluster/down.sh"
echo
echo "# Paste into a shell (or: . $NSC_STATE/env), then try: nightshift nodes"
cat "$NSC_STATE/env"
