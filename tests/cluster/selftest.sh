#!/usr/bin/env bash
# tests/cluster/selftest.sh: brings up a 3-host cluster rig (up.sh 3), checks it, tears it down
# (down.sh) and checks that nothing is left. Prints each check, the times of up, down and the
# whole, and "X passed, Y failed"; exits non-zero on any failure. Needs root.
#
# Checks: each host's engine answers under its own name and data root; the hosts reach each
# other's addresses and the registry (which refuses anonymous pulls) and have no default route;
# every engine pulled the replica image from the registry, at one digest; a second up.sh is
# refused; `nightshift nodes` lists the 3 nodes, serving; a small toy-trainer job submitted with
# the CLI succeeds on a rig host's engine; down.sh leaves no namespace, link, process, mount,
# cgroup directory, /etc/netns entry or state directory, and a second down.sh is harmless.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/lib.sh
. "$HERE/lib.sh"
nsc_require_root

N=3
PASS=0
FAIL=0
ok() {
  PASS=$((PASS + 1))
  echo "PASS: $*"
}
bad() {
  FAIL=$((FAIL + 1))
  echo "FAIL: $*"
}
# check DESCRIPTION COMMAND...: passes when the command succeeds.
check() {
  local what=$1
  shift
  if "$@" >/dev/null 2>&1; then ok "$what"; else bad "$what"; fi
}
# expect DESCRIPTION WANT GOT
expect() {
  if [ "$2" = "$3" ]; then ok "$1: $3"; else bad "$1: wanted [$2], got [$3]"; fi
}

# none_left PASS-TEXT FAIL-TEXT WHAT-WAS-FOUND
none_left() {
  if [ -z "$3" ]; then ok "$1"; else bad "$2 ${3//$'\n'/; }"; fi
}

finish() {
  echo "== times: up ${T_UP:-?}s, down ${T_DOWN:-?}s, whole $(nsc_since "$T0")s"
  echo "$PASS passed, $FAIL failed"
  [ "$FAIL" -eq 0 ]
  exit
}

T0=$(nsc_now)
if [ -e "$NSC_STATE" ] || [ -e "/run/netns/$NSC_SWITCH" ]; then
  bad "a rig is already up (or left over): run tests/cluster/down.sh first"
  finish
fi

# ------------------------------------------------------------------ up
t=$(nsc_now)
if "$HERE/up.sh" "$N" >"${TMPDIR:-/tmp}/nsc-selftest-up.log" 2>&1; then
  T_UP=$(nsc_since "$t")
  ok "up.sh $N (${T_UP}s)"
else
  T_UP=$(nsc_since "$t")
  bad "up.sh $N failed; its output:"
  sed 's/^/    /' "${TMPDIR:-/tmp}/nsc-selftest-up.log"
  "$HERE/down.sh"
  finish
fi
if grep -q '^export NIGHTSHIFT_URL=https://198.18.0.1:7400$' "${TMPDIR:-/tmp}/nsc-selftest-up.log" &&
  grep -q '^export NIGHTSHIFT_TOKEN=nst_' "${TMPDIR:-/tmp}/nsc-selftest-up.log"; then
  ok "up.sh printed the NIGHTSHIFT_URL and NIGHTSHIFT_TOKEN lines"
else
  bad "up.sh did not print the export lines"
fi
# shellcheck disable=SC1091
. "$NSC_STATE/env"

out=$("$HERE/up.sh" "$N" 2>&1)
rc=$?
if [ $rc -ne 0 ] && grep -q "already up" <<<"$out"; then
  ok "a second up.sh is refused: ${out#*error: }"
else
  bad "a second up.sh was not refused (rc $rc): $out"
fi

# ------------------------------------------------------------------ engines and network
for i in $(seq 1 "$N"); do
  expect "gpu$i: its engine answers with its own name and data root" \
    "gpu$i $NSC_STATE/gpu$i/docker" "$(nsc_docker "$i" info --format '{{.Name}} {{.DockerRootDir}}' 2>&1)"
done
for i in $(seq 1 "$N"); do
  for j in $(seq 1 "$N"); do
    [ "$i" = "$j" ] && continue
    check "gpu$i reaches gpu$j at $(nsc_addr "$j")" \
      ip netns exec "$(nsc_netns "$i")" busybox ping -c1 -W2 "$(nsc_addr "$j")"
  done
  expect "gpu$i reaches the registry, which asks for credentials" 401 \
    "$(ip netns exec "$(nsc_netns "$i")" curl -s -o /dev/null -w '%{http_code}' --max-time 3 "http://$NSC_REGISTRY/v2/")"
done
expect "the registry answers the rig's credentials" 200 \
  "$(ip netns exec "$(nsc_netns 1)" curl -s -o /dev/null -w '%{http_code}' --max-time 3 \
    -u "$NSC_REGISTRY_USER:$(cat "$NSC_STATE/registry/password")" "http://$NSC_REGISTRY/v2/")"
check "gpu1 has no route out of the rig" bash -c "! ip -n $(nsc_netns 1) route get 192.0.2.1"
digests=""
for i in $(seq 1 "$N"); do
  d=$(nsc_docker "$i" image inspect -f '{{join .RepoDigests " "}}' "$NSC_REGISTRY/$NSC_REPLICA_IMAGE" 2>/dev/null)
  if [[ $d == "$NSC_REGISTRY/${NSC_REPLICA_IMAGE%:*}@sha256:"* ]]; then
    ok "gpu$i pulled the replica image from the registry: ${d:0:70}..."
  else
    bad "gpu$i: the replica image has no digest from the registry: [$d]"
  fi
  digests+="$d"$'\n'
done
expect "every engine holds the same replica image digest" 1 "$(sort -u <<<"${digests%$'\n'}" | wc -l)"

# ------------------------------------------------------------------ the cluster, through the CLI
json=$(nightshift nodes -o json 2>&1)
got=$(jq -r '[.nodes[] | "\(.name) \(.mode) \(.replica.state)"] | sort | join(", ")' <<<"$json" 2>&1)
expect "nightshift nodes lists the 3 nodes, serving" "gpu1 serve serving, gpu2 serve serving, gpu3 serve serving" "$got"
nightshift nodes

job_file=$NSC_STATE/selftest-job.yaml
cat >"$job_file" <<EOF
name: rig-selftest
image: $NSC_REGISTRY/$NSC_TRAINER_IMAGE
gpus: 1
env:
  - name: TRAINER_TARGET_STEP
    value: "50"
  - name: TRAINER_STEPS_PER_SEC
    value: "100"
  - name: TRAINER_CHECKPOINT_EVERY
    value: "10"
EOF
t=$(nsc_now)
id=$(nightshift submit "$job_file" -o json 2>&1 | jq -r '.id' 2>/dev/null)
if [[ $id =~ ^[0-9]+$ ]]; then
  ok "nightshift submit: job $id"
  state=""
  for _ in $(seq 1 120); do
    state=$(nightshift job show "$id" -o json 2>/dev/null | jq -r '.state')
    case $state in succeeded | failed | cancelled) break ;; esac
    sleep 0.5
  done
  expect "job $id ended (after $(nsc_since "$t")s)" succeeded "$state"
  expect "job $id reached its target step" 50 \
    "$(nightshift job show "$id" -o json 2>/dev/null | jq -r '.outputs.final_step')"
  # Where it ran: the agent that ran it keeps work_dir/jobs/ID; that host's engine saw the
  # container exit 0.
  ran_on=""
  for i in $(seq 1 "$N"); do [ -d "$NSC_STATE/gpu$i/agent/jobs/$id" ] && ran_on+="$i "; done
  ran_on=${ran_on% }
  if [[ $ran_on =~ ^[0-9]+$ ]]; then
    ok "job $id ran on gpu$ran_on (its work directory)"
    died=$(nsc_docker "$ran_on" events --since 10m --until "$(date +%s)" \
      --filter "container=nightshift-job-gpu$ran_on-$id-1" --filter event=die \
      --format '{{.Actor.Attributes.name}} exit {{.Actor.Attributes.exitCode}}' 2>&1)
    expect "gpu$ran_on's engine ran the job's container to exit 0" "nightshift-job-gpu$ran_on-$id-1 exit 0" "$died"
  else
    bad "job $id: no single host holds its work directory (hosts: [$ran_on])"
  fi
else
  bad "nightshift submit failed: $id"
fi

# ------------------------------------------------------------------ down
t=$(nsc_now)
if "$HERE/down.sh"; then ok "down.sh"; else bad "down.sh exited non-zero"; fi
T_DOWN=$(nsc_since "$t")
check "a second down.sh is harmless" "$HERE/down.sh"

check "no rig network namespace left" bash -c "! ip netns list | grep -qE '^nsc-'"
check "no rig link left in the root namespace" bash -c "! ip -br link | grep -q '^$NSC_ROOT_VETH'"
check "no address of the rig left" bash -c "! ip -br addr | grep -q '$NSC_GW/'"
left=$(pgrep -af -- "$NSC_STATE/")
none_left "no rig process left" "rig processes left:" "$left"
left=$(pgrep -af -- 'containerd-shim' | grep -F "$NSC_STATE/")
none_left "no containerd shim of the rig left" "shims left:" "$left"
left=$(findmnt -rn -o TARGET | grep -E "^($NSC_STATE|/run/netns/nsc-)")
none_left "no rig mount left" "mounts left:" "$left"
left=$(ls -d /sys/fs/cgroup/*/nsc-gpu* /sys/fs/cgroup/nsc-gpu* 2>/dev/null)
none_left "no rig cgroup directory left" "cgroup directories left:" "$left"
check "no /etc/netns entry of the rig left" bash -c "! ls -d /etc/netns/nsc-* 2>/dev/null | grep -q ."
check "no state directory left" test ! -e "$NSC_STATE"
finish
