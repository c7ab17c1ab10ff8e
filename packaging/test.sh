#!/usr/bin/env bash
# The package test (run by tests/run.sh): builds the packages, checks what they hold
# (binaries, systemd units, conffiles, maintainer scripts), installs the .debs on this
# machine, runs `validate` as the service user, checks that an edited configuration survives
# a reinstall and that a bad one is refused with its file, key and line, then purges them and
# checks that nothing of ours is left but the nightshift system user (Debian policy keeps
# system users). Then packaging/systemd-test.sh boots them under systemd in a container.
#
# It installs system-wide, so it needs root (or sudo) and refuses to run where a nightshift
# package is already installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="$root/target/packages"
if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi

fail() {
    echo "packaging/test.sh: FAIL: $*" >&2
    exit 1
}
step() { echo "packaging/test.sh: $*" >&2; }

if [ "${NIGHTSHIFT_SKIP_BUILD:-}" != 1 ]; then
    bash packaging/build.sh
fi

deb() { ls "$out"/"$1"_*.deb 2>/dev/null | head -n1; }
rpm_of() { ls "$out"/"$1"-[0-9]*.rpm 2>/dev/null | head -n1; }
agent_deb="$(deb nightshift-agent)"
coord_deb="$(deb nightshift-coordinator)"
cli_deb="$(deb nightshift)"
for f in "$agent_deb" "$coord_deb" "$cli_deb"; do
    [ -n "$f" ] || fail "a .deb is missing in $out"
done

# has LISTING PATH: the listing holds PATH as a whole entry.
has() { grep -qE "(^|[ .])${2//./\\.}\$" <<<"$1" || fail "$3 lacks $2"; }
lacks() { ! grep -qE "${2//./\\.}" <<<"$1" || fail "$3 should not hold $2"; }

step "checking .deb contents"
list="$(dpkg-deb -c "$agent_deb" | awk '{print $NF}')"
has "$list" /usr/bin/nightshift-agent "$agent_deb"
has "$list" /etc/nightshift/agent.toml "$agent_deb"
has "$list" /usr/lib/systemd/system/nightshift-agent.service "$agent_deb"
lacks "$list" nightshift-coordinator "$agent_deb"
[ "$(dpkg-deb -I "$agent_deb" conffiles)" = "/etc/nightshift/agent.toml" ] ||
    fail "$agent_deb: conffiles is not exactly /etc/nightshift/agent.toml"
for script in postinst postrm prerm; do
    dpkg-deb -I "$agent_deb" "$script" >/dev/null || fail "$agent_deb lacks $script"
done
dpkg-deb -I "$agent_deb" postinst | grep -q "useradd --system" || fail "agent postinst creates no user"
dpkg-deb -I "$agent_deb" postinst | grep -q "groupadd --system docker" ||
    fail "agent postinst does not create a missing docker group (the unit would fail with 216/GROUP)"
has "$list" /usr/libexec/nightshift/remove-agent-containers "$agent_deb"
dpkg-deb -I "$agent_deb" prerm | grep -q "remove-agent-containers" ||
    fail "agent prerm does not remove the agent's containers"

list="$(dpkg-deb -c "$coord_deb" | awk '{print $NF}')"
has "$list" /usr/bin/nightshift-coordinator "$coord_deb"
has "$list" /etc/nightshift/coordinator.toml "$coord_deb"
has "$list" /usr/lib/systemd/system/nightshift-coordinator.service "$coord_deb"
has "$list" /usr/share/nightshift/grafana/nightshift.json "$coord_deb"
lacks "$list" /usr/bin/nightshift-agent "$coord_deb"
[ "$(dpkg-deb -I "$coord_deb" conffiles)" = "/etc/nightshift/coordinator.toml" ] ||
    fail "$coord_deb: conffiles is not exactly /etc/nightshift/coordinator.toml"

# Each package its own one-line description.
descriptions="$(for f in "$agent_deb" "$coord_deb" "$cli_deb"; do dpkg-deb -f "$f" Description | head -n1; done)"
[ "$(sort -u <<<"$descriptions" | wc -l)" = 3 ] || fail "two packages share a description: $descriptions"
list="$(dpkg-deb -c "$cli_deb" | awk '{print $NF}')"
has "$list" /usr/bin/nightshift "$cli_deb"
lacks "$list" /usr/bin/nightshift- "$cli_deb"
lacks "$list" systemd "$cli_deb"

step "checking the units' hardening"
for unit in packaging/agent/nightshift-agent.service packaging/coordinator/nightshift-coordinator.service; do
    for line in "NoNewPrivileges=yes" "ProtectSystem=strict" "User=nightshift" "ProtectHome=yes" \
        "CapabilityBoundingSet=" "ExecStartPre=/usr/bin/nightshift-.* validate --config /etc/nightshift/"; do
        grep -qE "^$line\$|^$line" "$unit" || fail "$unit lacks $line"
    done
    # A broken configuration must not restart it every 5 s for ever.
    grep -qE "^StartLimitIntervalSec=[1-9]" "$unit" && grep -qE "^StartLimitBurst=[1-9]" "$unit" ||
        fail "$unit has no start limit"
    # Only the state directory is writable: no ReadWritePaths beyond it.
    ! grep -q "^ReadWritePaths=" "$unit" || fail "$unit opens more writable paths than its state"
done
grep -q "^SupplementaryGroups=docker$" packaging/agent/nightshift-agent.service ||
    fail "the agent unit does not reach the docker socket through the docker group"
! grep -q "docker" packaging/coordinator/nightshift-coordinator.service ||
    fail "the coordinator unit must not reach docker"
if command -v systemd-analyze >/dev/null; then
    for unit in packaging/agent/nightshift-agent.service packaging/coordinator/nightshift-coordinator.service; do
        # verify resolves ExecStart binaries; point it at the built ones through a copy.
        tmp="$(mktemp -d)"
        sed "s#/usr/bin/#$root/target/package-binaries/#g" "$unit" >"$tmp/$(basename "$unit")"
        if ! msg="$(systemd-analyze verify "$tmp/$(basename "$unit")" 2>&1)"; then
            # Without systemd as PID 1 some checks cannot run; only unit syntax errors count.
            if grep -qiE "unknown (key|section)|invalid|failed to parse" <<<"$msg"; then
                rm -rf "$tmp"
                fail "systemd-analyze verify $unit: $msg"
            fi
        fi
        rm -rf "$tmp"
    done
fi

step "checking .rpm contents"
if ! command -v rpm >/dev/null; then
    step "installing rpm (to read the .rpm packages)"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends rpm >/dev/null
fi
agent_rpm="$(rpm_of nightshift-agent)"
coord_rpm="$(rpm_of nightshift-coordinator)"
cli_rpm="$(rpm_of nightshift)"
for f in "$agent_rpm" "$coord_rpm" "$cli_rpm"; do
    [ -n "$f" ] || fail "an .rpm is missing in $out"
done
list="$(rpm -qlp "$agent_rpm" 2>/dev/null)"
has "$list" /usr/bin/nightshift-agent "$agent_rpm"
has "$list" /etc/nightshift/agent.toml "$agent_rpm"
has "$list" /usr/lib/systemd/system/nightshift-agent.service "$agent_rpm"
[ "$(rpm -qcp "$agent_rpm" 2>/dev/null)" = "/etc/nightshift/agent.toml" ] ||
    fail "$agent_rpm: the config files are not exactly /etc/nightshift/agent.toml"
rpm -qp --qf '[%{FILEFLAGS:fflags} %{FILENAMES}\n]' "$agent_rpm" 2>/dev/null |
    grep -q "^cn /etc/nightshift/agent.toml$" || fail "$agent_rpm: agent.toml is not %config(noreplace)"
rpm -qp --scripts "$agent_rpm" 2>/dev/null | grep -q "useradd --system" || fail "agent rpm creates no user"
rpm -qp --scripts "$agent_rpm" 2>/dev/null | grep -q "remove-agent-containers" ||
    fail "agent rpm does not remove the agent's containers on erase"
has "$list" /usr/libexec/nightshift/remove-agent-containers "$agent_rpm"
list="$(rpm -qlp "$coord_rpm" 2>/dev/null)"
has "$list" /usr/bin/nightshift-coordinator "$coord_rpm"
has "$list" /etc/nightshift/coordinator.toml "$coord_rpm"
has "$list" /usr/lib/systemd/system/nightshift-coordinator.service "$coord_rpm"
has "$list" /usr/share/nightshift/grafana/nightshift.json "$coord_rpm"
rpm -qp --qf '[%{FILEFLAGS:fflags} %{FILENAMES}\n]' "$coord_rpm" 2>/dev/null |
    grep -q "^cn /etc/nightshift/coordinator.toml$" || fail "$coord_rpm: coordinator.toml is not %config(noreplace)"
list="$(rpm -qlp "$cli_rpm" 2>/dev/null)"
has "$list" /usr/bin/nightshift "$cli_rpm"
lacks "$list" systemd "$cli_rpm"

step "installing the .debs"
for pkg in nightshift-agent nightshift-coordinator nightshift; do
    if dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q installed; then
        fail "$pkg is already installed here; this test installs and purges it, so it will not run"
    fi
done
exec 9>/run/lock/nightshift-package-test.lock
flock 9
purge() { $sudo dpkg --purge nightshift-agent nightshift-coordinator nightshift >/dev/null 2>&1 || true; }
trap purge EXIT
$sudo dpkg -i "$agent_deb" "$coord_deb" "$cli_deb" >/dev/null
getent passwd nightshift >/dev/null || fail "the nightshift user was not created"
for f in /usr/bin/nightshift-agent /usr/bin/nightshift-coordinator /usr/bin/nightshift \
    /etc/nightshift/agent.toml /etc/nightshift/coordinator.toml \
    /usr/lib/systemd/system/nightshift-agent.service \
    /usr/lib/systemd/system/nightshift-coordinator.service; do
    [ -e "$f" ] || fail "$f is not installed"
done
[ "$(stat -c %U /var/lib/nightshift/agent)" = nightshift ] || fail "/var/lib/nightshift/agent is not the user's"

step "validating the installed configurations as the service user"
as_user() { $sudo runuser -u nightshift -- "$@"; }
as_user /usr/bin/nightshift-agent validate --config /etc/nightshift/agent.toml >/dev/null ||
    fail "the installed agent.toml does not validate"
as_user /usr/bin/nightshift-coordinator validate --config /etc/nightshift/coordinator.toml >/dev/null ||
    fail "the installed coordinator.toml does not validate"
# A token created as root is readable by the service user, and never stored in clear.
token="$(/usr/bin/nightshift-coordinator token create --role admin --name package-test \
    --data-dir /var/lib/nightshift/coordinator 2>/dev/null)"
[ "$(stat -c %U /var/lib/nightshift/coordinator/tokens.json)" = nightshift ] ||
    fail "tokens.json is not the service user's"
as_user cat /var/lib/nightshift/coordinator/tokens.json >/dev/null || fail "the service cannot read tokens.json"
! grep -q "${token#nst_}" /var/lib/nightshift/coordinator/tokens.json || fail "tokens.json holds the token"
/usr/bin/nightshift --version >/dev/null || fail "nightshift --version"

step "mutual TLS files from tls init/issue validate, given through NIGHTSHIFT_ overrides"
tls="$(mktemp -d)"
/usr/bin/nightshift-coordinator tls init --dir "$tls" --server-name localhost >/dev/null
/usr/bin/nightshift-coordinator tls issue --dir "$tls" --node gpu-01 >/dev/null
$sudo chgrp nightshift "$tls"/*.key && $sudo chmod 0640 "$tls"/*.key && chmod 0755 "$tls"
as_user env NIGHTSHIFT_COORDINATOR__TLS__CA_FILE="$tls/ca.pem" \
    NIGHTSHIFT_COORDINATOR__TLS__CERT_FILE="$tls/coordinator.pem" \
    NIGHTSHIFT_COORDINATOR__TLS__KEY_FILE="$tls/coordinator.key" \
    /usr/bin/nightshift-coordinator validate --config /etc/nightshift/coordinator.toml >/dev/null ||
    fail "the coordinator's TLS files do not validate"
as_user env NIGHTSHIFT_AGENT__COORDINATOR=https://localhost:7400 NIGHTSHIFT_AGENT__NODE=gpu-01 \
    NIGHTSHIFT_AGENT__TLS__CA_FILE="$tls/ca.pem" NIGHTSHIFT_AGENT__TLS__CERT_FILE="$tls/gpu-01.pem" \
    NIGHTSHIFT_AGENT__TLS__KEY_FILE="$tls/gpu-01.key" \
    /usr/bin/nightshift-agent validate --config /etc/nightshift/agent.toml >/dev/null ||
    fail "the agent's TLS files do not validate"
# A certificate its CA did not sign (the coordinator's server certificate is not a client
# certificate either) is refused, naming the key.
if msg="$(as_user env NIGHTSHIFT_AGENT__TLS__CA_FILE="$tls/ca.pem" \
    NIGHTSHIFT_AGENT__TLS__CERT_FILE="$tls/coordinator.pem" \
    NIGHTSHIFT_AGENT__TLS__KEY_FILE="$tls/coordinator.key" \
    /usr/bin/nightshift-agent validate --config /etc/nightshift/agent.toml 2>&1)"; then
    fail "a server certificate validated as the agent's"
fi
grep -q "tls.cert_file ($tls/coordinator.pem)" <<<"$msg" || fail "the refusal does not name tls.cert_file: $msg"
if msg="$(as_user env NIGHTSHIFT_AGENT__TLS__CA_FILE="$tls/missing.pem" \
    /usr/bin/nightshift-agent validate --config /etc/nightshift/agent.toml 2>&1)"; then
    fail "a missing CA file validated"
fi
grep -q "tls.ca_file ($tls/missing.pem): cannot read" <<<"$msg" || fail "the refusal does not name tls.ca_file: $msg"
$sudo rm -rf "$tls"

step "an edited configuration survives a reinstall; a bad one is refused with file, key and line"
# drain_timeout_s set twice: TOML refuses a duplicate key.
$sudo sed -i 's/^drain_timeout_s = 120$/drain_timeout_s = 120\ndrain_timeout_s = 77/' /etc/nightshift/agent.toml
if msg="$(as_user /usr/bin/nightshift-agent validate --config /etc/nightshift/agent.toml 2>&1)"; then
    fail "a duplicate key validated"
fi
grep -q "agent.toml" <<<"$msg" && grep -q "line" <<<"$msg" || fail "the refusal does not name file and line: $msg"
$sudo sed -i '/^drain_timeout_s = 77$/d; s/^drain_timeout_s = 120$/drain_timeout_s = "soon"/' /etc/nightshift/agent.toml
if msg="$(as_user /usr/bin/nightshift-agent validate --config /etc/nightshift/agent.toml 2>&1)"; then
    fail "a wrong type validated"
fi
line="$(grep -n '^drain_timeout_s' /etc/nightshift/agent.toml | cut -d: -f1)"
for want in /etc/nightshift/agent.toml drain_timeout_s "line $line"; do
    grep -qF "$want" <<<"$msg" || fail "the refusal does not name $want: $msg"
done
$sudo sed -i 's/^drain_timeout_s = "soon"$/drain_timeout_s = 77/' /etc/nightshift/agent.toml
$sudo dpkg -i "$agent_deb" >/dev/null
grep -q '^drain_timeout_s = 77$' /etc/nightshift/agent.toml || fail "reinstalling overwrote the edited agent.toml"
as_user /usr/bin/nightshift-agent validate --config /etc/nightshift/agent.toml >/dev/null ||
    fail "the edited agent.toml does not validate"

step "purging"
$sudo dpkg --purge nightshift-agent nightshift-coordinator nightshift >/dev/null
trap - EXIT
left="$(ls -d /etc/nightshift /var/lib/nightshift /usr/bin/nightshift* \
    /usr/lib/systemd/system/nightshift-* /etc/systemd/system/*/nightshift-* \
    /var/lib/systemd/deb-systemd-helper-enabled/*nightshift* \
    /var/lib/systemd/deb-systemd-helper-masked/*nightshift* \
    /usr/share/doc/nightshift* /usr/share/nightshift /usr/libexec/nightshift 2>/dev/null || true)"
[ -z "$left" ] || fail "purge left files behind: $left"
for pkg in nightshift-agent nightshift-coordinator nightshift; do
    ! dpkg-query -W "$pkg" >/dev/null 2>&1 || fail "dpkg still knows $pkg after purge"
done
step "ok (the nightshift system user stays, as Debian policy advises)"

# The same packages under a booted systemd, in a container (journal, restarts, start limit,
# the docker group, purge): packaging/systemd-test.sh.
if [ "${NIGHTSHIFT_SKIP_SYSTEMD_TEST:-}" = 1 ]; then
    step "NIGHTSHIFT_SKIP_SYSTEMD_TEST=1: the systemd test did not run"
else
    started=$SECONDS
    $sudo bash packaging/systemd-test.sh
    step "the systemd test took $((SECONDS - started)) s"
fi
