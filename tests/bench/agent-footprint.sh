#!/usr/bin/env bash
# The agent's footprint at one vLLM scrape and one heartbeat a second: runs the real
# (release) nightshift-agent with 4 fake GPUs against a real coordinator and the vLLM
# stand-in container it starts itself, waits until the replica serves, then samples
# /proc/PID for DURATION seconds (default 60): peak and final RSS, CPU share of one core,
# and the scrapes counted by the agent's own /metrics over the window.
#
#   cargo build --release -p nightshift-agent --bin nightshift-agent
#   cargo build -p nightshift-coordinator --bin nightshift-coordinator
#   tests/bench/agent-footprint.sh [DURATION]
set -euo pipefail
cd "$(dirname "$0")/../.."
DURATION=${1:-60}
AGENT=${AGENT:-target/release/nightshift-agent}
COORD=${COORD:-target/debug/nightshift-coordinator}
[ -x "$AGENT" ] && [ -x "$COORD" ] || { echo "build $AGENT and $COORD first (see the header)" >&2; exit 2; }
docker image inspect nightshift/vllm-standin:dev >/dev/null || { echo "run tests/images/build.sh first" >&2; exit 2; }

work=$(mktemp -d)
node="bench-$$"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cport=$(port); aport=$(port)
cleanup() {
  [ -n "${apid:-}" ] && kill "$apid" 2>/dev/null || true
  [ -n "${cpid:-}" ] && kill "$cpid" 2>/dev/null || true
  wait 2>/dev/null || true
  ids=$(docker ps -aq --filter "label=io.nightshift.node=$node")
  [ -n "$ids" ] && docker rm -f $ids >/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/coordinator.toml" <<TOML
heartbeat_interval_ms = 1000
lease_ttl_ms = 30000
[[services]]
name = "default"
min_replicas = 1
TOML
cat > "$work/agent.toml" <<TOML
coordinator = "http://127.0.0.1:$cport"
node = "$node"
work_dir = "$work/agent"
readiness_listen = "127.0.0.1:$aport"
[gpus]
fake = 4
[replica]
image = "nightshift/vllm-standin:dev"
host_ip = "127.0.0.1"
host_port = 0
TOML

RUST_LOG=warn "$COORD" serve --listen "127.0.0.1:$cport" --data-dir "$work/state" --config "$work/coordinator.toml" >"$work/coordinator.log" 2>&1 &
cpid=$!
RUST_LOG=warn "$AGENT" run --config "$work/agent.toml" >"$work/agent.log" 2>&1 &
apid=$!

for _ in $(seq 1 120); do
  curl -fs "http://127.0.0.1:$aport/ready" >/dev/null 2>&1 && break
  sleep 0.5
done
curl -fs "http://127.0.0.1:$aport/ready" >/dev/null || { echo "the replica never became ready" >&2; cat "$work/agent.log" >&2; exit 1; }
sleep 5   # warm-up

tck=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$apid/stat"; }
rss() { awk '/^VmRSS:/ {print $2}' "/proc/$apid/status"; }
scrapes() { curl -fs "http://127.0.0.1:$aport/metrics" | awk '/^nightshift_agent_vllm_scrapes_total\{result="ok"\}/ {print $2}'; }

c0=$(cpu); s0=$(scrapes); t0=$(date +%s.%N); peak=0
for _ in $(seq 1 "$DURATION"); do
  r=$(rss); [ "$r" -gt "$peak" ] && peak=$r
  sleep 1
done
c1=$(cpu); s1=$(scrapes); t1=$(date +%s.%N); final=$(rss)

awk -v c0="$c0" -v c1="$c1" -v t0="$t0" -v t1="$t1" -v tck="$tck" -v peak="$peak" -v final="$final" \
    -v s0="$s0" -v s1="$s1" 'BEGIN {
  wall = t1 - t0; cpu = (c1 - c0) / tck;
  printf "window %.1f s: cpu %.2f s = %.2f %% of one core; rss peak %.1f MiB, final %.1f MiB; %d vllm scrapes (%.2f/s)\n",
    wall, cpu, 100 * cpu / wall, peak / 1024, final / 1024, s1 - s0, (s1 - s0) / wall }'
