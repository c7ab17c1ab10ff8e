#!/usr/bin/env bash
# The packages under a booted systemd (run by packaging/test.sh): boots a Debian 12 container
# with systemd as PID 1 (as ../shared/notes/real-components.md describes), installs the .debs
# from target/packages with apt, and checks as an operator would:
#   - `systemctl enable --now nightshift-coordinator` starts it; the journal holds our lines
#     as text (`journalctl -o json`: MESSAGE a string, no ANSI colour, no timestamp of ours),
#     with their level as PRIORITY (`journalctl -p warning` finds the warning we log);
#   - `systemctl restart` under an open agent long-poll finishes within 5 s, without SIGKILL;
#   - the agent on a host without a docker group: the package creates the group, and while the
#     Docker socket is not the group's the agent's journal says why it cannot reach Docker;
#     once it is, the agent starts its replica on the host's engine;
#   - purging the agent stops and removes the containers it manages, and only those;
#   - a broken configuration makes the unit give up (its start limit) instead of restarting
#     for ever, its error printed once, at PRIORITY err.
# Every check runs even when one before it failed; the script fails if any did.
#
# Needs root, a running Docker engine, debootstrap (installed when missing) and the image
# nightshift/vllm-standin:dev (tests/images/build.sh, which tests/run.sh runs first; built here
# when missing). The Debian root filesystem is made once per machine (about 90 s) and kept in
# target/systemd-test/; everything else (the container, its image, the agent's containers on
# the host's engine) is removed at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="$root/target/packages"
cache="$root/target/systemd-test"
tag="nightshift-systemd-test:$$"
ctr="nightshift-systemd-test-$$"
node="systemd-test-$$"         # the agent's node name: the label on its containers
bound_s=5                      # the longest a restart under an open long-poll may take
started=$SECONDS

step() { echo "packaging/systemd-test.sh: $*" >&2; }
die() {
    echo "packaging/systemd-test.sh: error: $*" >&2
    exit 1
}
failures=()
fail() {
    echo "packaging/systemd-test.sh: FAIL: $*" >&2
    failures+=("$*")
}
in_ctr() { docker exec "$ctr" "$@"; }
# wait_for SECONDS COMMAND...: retries COMMAND every 0.5 s until it succeeds.
wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.5
    done
}

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, and a container with systemd)"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable"
for pkg in nightshift-agent nightshift-coordinator nightshift; do
    ls "$out/${pkg}_"*.deb >/dev/null 2>&1 || die "no $pkg .deb in $out (run packaging/build.sh)"
done
if ! docker image inspect nightshift/vllm-standin:dev >/dev/null 2>&1; then
    step "building the stand-in images (the agent's replica)"
    bash tests/images/build.sh >/dev/null
fi

# The root filesystem: Debian 12 with systemd, made once per machine.
includes="systemd,systemd-sysv,dbus,ca-certificates,curl,iproute2"
tarball="$cache/bookworm-$(echo "$includes" | sha256sum | cut -c1-12).tar"
if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || {
        step "installing debootstrap"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    }
    # The Debian mirror this machine uses (deb822 `URIs:` or one-line `deb` entries).
    mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        grep -v '^[[:space:]]*#' | grep -oE 'https?://[^ ]*/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ')" || true
    mirror="${mirror:-http://deb.debian.org/debian}"
    step "making the Debian 12 root filesystem from $mirror (once per machine)"
    mkdir -p "$cache"
    rootfs="$(mktemp -d "$cache/rootfs.XXXXXX")"
    t=$SECONDS
    debootstrap --variant=minbase --include="$includes" bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
        { rm -rf "$rootfs"; die "debootstrap failed; see $cache/debootstrap.log"; }
    tar -C "$rootfs" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
    step "root filesystem made in $((SECONDS - t)) s"
    started=$SECONDS # the bound below is for the test, not the one-off debootstrap
fi

cleanup() {
    docker rm -f "$ctr" >/dev/null 2>&1 || true
    docker image rm "$tag" >/dev/null 2>&1 || true
    local left
    left="$(docker ps -aq --filter "label=io.nightshift.node=$node")"
    # shellcheck disable=SC2086 # one id per word
    [ -z "$left" ] || docker rm -f $left >/dev/null 2>&1 || true
}
trap cleanup EXIT

step "booting the container"
docker import - "$tag" <"$tarball" >/dev/null
docker run -d --name "$ctr" --hostname "$ctr" \
    --cap-add ALL --cap-drop SYS_RESOURCE \
    --security-opt seccomp=unconfined --security-opt apparmor=unconfined --security-opt systempaths=unconfined \
    --cgroupns=host -v /sys/fs/cgroup:/sys/fs/cgroup:rw --tmpfs /run --tmpfs /run/lock \
    -v /var/run/docker.sock:/var/run/docker.sock \
    "$tag" /sbin/init >/dev/null
booted() { in_ctr systemctl is-system-running 2>/dev/null | grep -qE '^(running|degraded)$'; }
wait_for 60 booted || die "systemd did not boot: $(in_ctr systemctl is-system-running 2>&1)"

step "installing the .debs with apt"
in_ctr mkdir -p /tmp/pkgs
for pkg in nightshift-agent nightshift-coordinator nightshift; do
    docker cp "$(ls "$out/${pkg}_"*.deb | head -n1)" "$ctr:/tmp/pkgs/" >/dev/null
done
in_ctr getent group docker >/dev/null && die "the image has a docker group; the test needs a host without one"
install_log="$(in_ctr sh -c 'DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends /tmp/pkgs/*.deb 2>&1')" ||
    die "apt-get install failed: $install_log"

# journal UNIT [ARGS...]: the unit's journal since boot as JSON, one entry a line.
journal() {
    local unit="$1"
    shift
    in_ctr journalctl -u "$unit" -o json --no-pager "$@"
}

step "coordinator: systemctl enable --now"
in_ctr systemctl enable --now nightshift-coordinator.service >/dev/null 2>&1 ||
    fail "systemctl enable --now nightshift-coordinator failed"
api_up() { in_ctr curl -fsS -o /dev/null http://127.0.0.1:7400/healthz; }
wait_for 20 api_up || fail "the coordinator does not answer /healthz"

# The journal's entries as the operator reads them: every MESSAGE text (journald stores a
# message with control characters, such as ANSI colours, as a byte array), no timestamp of
# ours, and the level as PRIORITY.
check_journal() { # check_journal UNIT
    journal "$1" | python3 -c '
import json, re, sys
unit = sys.argv[1]
bad = []
for line in sys.stdin:
    e = json.loads(line)
    if e.get("_PID") == "1" or e.get("SYSLOG_IDENTIFIER") == "systemd":
        continue  # systemd`s own lines about the unit
    m = e.get("MESSAGE")
    if not isinstance(m, str):
        bad.append(f"MESSAGE stored as bytes (control characters): {m!r:.120}")
    elif "\x1b" in m:
        bad.append(f"ANSI escape in MESSAGE: {m!r:.120}")
    elif re.match(r"\s*\d{4}-\d\d-\d\dT\d\d:\d\d", m):
        bad.append(f"a timestamp of our own in MESSAGE: {m!r:.120}")
    elif re.match(r"<\d>", m):
        bad.append(f"a priority prefix journald did not take: {m!r:.120}")
for b in bad[:5]:
    print(f"{unit}: {b}")
' "$1"
}
problems="$(check_journal nightshift-coordinator.service)"
[ -z "$problems" ] || fail "the coordinator's journal: $problems"
warnings="$(in_ctr journalctl -u nightshift-coordinator.service -p warning -o cat --no-pager)"
grep -q "no API tokens" <<<"$warnings" ||
    fail "journalctl -p warning does not find the coordinator's 'no API tokens' warning: $warnings"
grep -q "coordinator listening" <<<"$warnings" &&
    fail "journalctl -p warning shows an info line: $warnings"
# The info line is there, at PRIORITY info (6).
priority="$(journal nightshift-coordinator.service | python3 -c '
import json, sys
for line in sys.stdin:
    e = json.loads(line)
    if "coordinator listening" in str(e.get("MESSAGE")):
        print(e.get("PRIORITY")); break
')"
[ "$priority" = 6 ] || fail "'coordinator listening' is at PRIORITY '${priority}', not 6 (info)"

step "coordinator: restart under an open long-poll (bound ${bound_s} s)"
docker exec -d "$ctr" curl -s -o /dev/null \
    "http://127.0.0.1:7400/v1/agents/long-poller/desired?after=999999&wait_ms=60000"
sleep 1
since="$(in_ctr date +%s)"
t0=$(date +%s%N)
in_ctr timeout 60 systemctl restart nightshift-coordinator.service >/dev/null 2>&1 ||
    fail "systemctl restart nightshift-coordinator failed"
restart_ms=$((($(date +%s%N) - t0) / 1000000))
step "restart took ${restart_ms} ms"
[ "$restart_ms" -le $((bound_s * 1000)) ] ||
    fail "systemctl restart under an open long-poll took ${restart_ms} ms (bound ${bound_s} s)"
killed="$(in_ctr journalctl -u nightshift-coordinator.service --since "@$since" -o cat --no-pager |
    grep -E "timed out\. Killing|status=9/KILL|signal=KILL" || true)"
[ -z "$killed" ] || fail "the coordinator was killed on restart: $killed"
wait_for 20 api_up || fail "the coordinator does not answer /healthz after the restart"

step "agent: a host without a docker group"
grep -q "had no docker group; created it" <<<"$install_log" ||
    fail "installing the agent did not say it created the docker group: $install_log"
in_ctr getent group docker >/dev/null || fail "the agent's package did not create the docker group"
docker exec -i "$ctr" sh -c 'cat >/etc/nightshift/agent.toml' <<EOF
coordinator = "http://127.0.0.1:7400"
node = "$node"
readiness_listen = "127.0.0.1:7401"
[gpus]
fake = 1
[replica]
image = "nightshift/vllm-standin:dev"
host_ip = "127.0.0.1"
host_port = 0
EOF
sock_gid="$(in_ctr stat -c %g /var/run/docker.sock)"
# The socket is not the group's (as on a host whose Docker came without the group).
if [ "$(in_ctr getent group docker | cut -d: -f3)" = "$sock_gid" ]; then
    in_ctr groupmod -g $((sock_gid + 1000)) docker
fi
since="$(in_ctr date +%s)"
in_ctr systemctl start nightshift-agent.service >/dev/null 2>&1 || true
said_why() {
    in_ctr journalctl -u nightshift-agent.service --since "@$since" -p err -o cat --no-pager |
        grep -q "cannot reach the docker daemon"
}
wait_for 20 said_why ||
    fail "the agent's journal (-p err) does not say why it cannot reach Docker: $(in_ctr journalctl -u nightshift-agent.service --since "@$since" -o cat --no-pager | tail -n 8)"
in_ctr systemctl stop nightshift-agent.service >/dev/null 2>&1 || true
in_ctr systemctl reset-failed nightshift-agent.service >/dev/null 2>&1 || true

step "agent: with the socket the docker group's, the agent starts its replica"
if in_ctr getent group docker >/dev/null; then
    in_ctr groupmod -o -g "$sock_gid" docker
else # (the checks above failed; go on with the rest)
    in_ctr groupadd -o -g "$sock_gid" docker
fi
in_ctr systemctl start nightshift-agent.service >/dev/null 2>&1 || fail "systemctl start nightshift-agent failed"
ours() { docker ps -aq --filter "label=io.nightshift.node=$node"; }
has_replica() { [ -n "$(ours)" ]; }
if ! wait_for 45 has_replica; then
    fail "the agent started no container: $(in_ctr journalctl -u nightshift-agent.service -o cat --no-pager | tail -n 8)"
fi
problems="$(check_journal nightshift-agent.service)"
[ -z "$problems" ] || fail "the agent's journal: $problems"

step "agent: apt purge removes its containers, and only those"
bystander="$(docker create --label io.nightshift.node=another-node nightshift/vllm-standin:dev)"
purge_log="$(in_ctr sh -c 'DEBIAN_FRONTEND=noninteractive apt-get purge -y nightshift-agent 2>&1')" ||
    fail "apt-get purge nightshift-agent failed: $purge_log"
[ -z "$(ours)" ] || fail "apt purge left the agent's containers: $(ours) ($purge_log)"
docker container inspect "$bystander" >/dev/null 2>&1 || fail "apt purge removed another node's container"
docker rm -f "$bystander" >/dev/null

step "coordinator: a broken configuration hits the start limit"
in_ctr sed -i 's/^heartbeat_interval_ms = .*/heartbeat_interval_ms = "soon"/' /etc/nightshift/coordinator.toml
since="$(in_ctr date +%s)"
in_ctr systemctl restart nightshift-coordinator.service >/dev/null 2>&1 || true
# systemd 252 keeps the failure's own Result (exit-code) when the restart is refused.
gave_up() {
    [ "$(in_ctr systemctl show -P ActiveState nightshift-coordinator.service)" = failed ] &&
        in_ctr journalctl -u nightshift-coordinator.service --since "@$since" -o cat --no-pager |
        grep -q "Start request repeated too quickly"
}
if wait_for 60 gave_up; then
    restarts="$(in_ctr systemctl show -P NRestarts nightshift-coordinator.service)"
    sleep 6 # RestartSec is 5 s: a unit that had not given up would be starting again by now
    state="$(in_ctr systemctl show -P ActiveState nightshift-coordinator.service)"
    again="$(in_ctr systemctl show -P NRestarts nightshift-coordinator.service)"
    [ "$state" = failed ] && [ "$again" = "$restarts" ] ||
        fail "after the start limit the coordinator is '$state' (restarts $restarts, then $again)"
    step "gave up after $restarts restarts"
else
    fail "a broken configuration did not hit the start limit: $(in_ctr systemctl show -P ActiveState,Result,NRestarts nightshift-coordinator.service | tr '\n' ' ')$(in_ctr journalctl -u nightshift-coordinator.service --since "@$since" -o short-precise --no-pager | tail -n 30)"
fi
errors="$(in_ctr journalctl -u nightshift-coordinator.service --since "@$since" -p err -o cat --no-pager |
    grep "heartbeat_interval_ms" || true)"
first="$(head -n1 <<<"$errors")"
if [ -z "$errors" ]; then
    fail "the configuration error is not in the journal at PRIORITY err"
# Once: the file, line and key appear a single time in the line (not the message nested in itself).
elif [ "$(grep -o "heartbeat_interval_ms" <<<"$first" | wc -l)" != 1 ]; then
    fail "the configuration error is printed twice in one line: $first"
fi

elapsed=$((SECONDS - started))
step "took ${elapsed} s (after the root filesystem)"
if [ "${#failures[@]}" -gt 0 ]; then
    step "${#failures[@]} check(s) failed:"
    printf '  - %s\n' "${failures[@]}" >&2
    exit 1
fi
step "ok"
