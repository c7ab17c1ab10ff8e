#!/usr/bin/env bash
# The project's test command: installs what the tests need on a fresh machine with Docker,
# builds the stand-in images, then runs every test of the workspace.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if ! docker info >/dev/null 2>&1; then
    echo "tests/run.sh: the Docker engine is not reachable; start dockerd first" >&2
    exit 1
fi

# What the tests run besides Docker, from Debian's packages, installed when missing (one
# `apt-get update` for all):
# - busybox-static: the engine tests build a tiny FROM-scratch image around the static busybox;
# - nginx: tests/tests/nginx.rs runs it (a throwaway process, no service) before two replicas;
# - docker-registry, apache2-utils: tests/tests/registry.rs and the cluster rig run a registry
#   (a throwaway process) with htpasswd auth;
# - python3-venv: the S3 server below installs into a virtual environment;
# - prometheus (with promtool): tests/tests/prometheus.rs runs it as a throwaway process on
#   its own port, configuration and storage, so a system-wide prometheus.service, which the
#   package starts where systemd runs, is neither used nor in the way. Recommends are left out:
#   prometheus' is prometheus-node-exporter, another service, which no test needs.
# - chromium, chromium-driver: tests/tests/ui.rs drives the web UI in headless Chromium over
#   WebDriver (chromedriver as a throwaway process on its own port).
# - postgresql (with psql): the coordinator's PostgreSQL store is tested against a throwaway
#   server (tests/postgres.sh, below), never the package's own service;
# - openssl: tests/postgres.sh makes that server's TLS certificate with it.
# - faketime (libfaketime): coordinator/tests/lifecycle.rs steps the coordinator's wall clock
#   under it.
missing=()
[ -x /bin/busybox ] || missing+=(busybox-static)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
command -v docker-registry >/dev/null 2>&1 || missing+=(docker-registry)
command -v htpasswd >/dev/null 2>&1 || missing+=(apache2-utils)
python3 -m venv --help >/dev/null 2>&1 && python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || missing+=(chromium chromium-driver)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "tests/run.sh: installing ${missing[*]}"
    if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# An S3-compatible server for object checkpoint storage (tests/tests/checkpoint_object.rs and
# the rig's follow-object scenario): moto, from PyPI, in a virtual environment under target/,
# made once. The tests find its moto_server through NIGHTSHIFT_TEST_MOTO.
moto_venv="$root/target/moto-venv"
if [ ! -x "$moto_venv/bin/moto_server" ]; then
    echo "tests/run.sh: installing moto[server] in $moto_venv"
    rm -rf "$moto_venv"
    python3 -m venv "$moto_venv"
    "$moto_venv/bin/pip" install -q 'moto[server]'
fi
export NIGHTSHIFT_TEST_MOTO="$moto_venv/bin/moto_server"

# rustls runs on ring only: aws-lc-sys must not be anywhere in the graph (docs: crates.md §3).
if cargo tree --workspace -i aws-lc-sys >/dev/null 2>&1; then
    echo "tests/run.sh: aws-lc-sys is in the dependency graph; use rustls' ring provider only:" >&2
    cargo tree --workspace -i aws-lc-sys >&2
    exit 1
fi

# One crate per product (ARCHITECTURE.md): the CLI is a client and links neither the service
# nor the agent nor their I/O crates; the service reaches agents over HTTP only. Dev- and
# build-dependencies count too.
forbid() { # forbid PACKAGE CRATE...: PACKAGE must not depend on any CRATE
    local package="$1" crate
    shift
    for crate in "$@"; do
        if cargo tree -p "$package" -i "$crate" >/dev/null 2>&1; then
            echo "tests/run.sh: $package must not depend on $crate, but does:" >&2
            cargo tree -p "$package" -i "$crate" >&2
            exit 1
        fi
    done
}
forbid nightshift-cli nightshift-coordinator nightshift-agent rusqlite axum bollard
forbid nightshift-coordinator nightshift-agent bollard
# The OpenAPI schemas are the coordinator's (common's `openapi` feature); the validator is a test's.
forbid nightshift-cli utoipa jsonschema
forbid nightshift-agent utoipa jsonschema
# The web UI is the coordinator's (coordinator/src/http/ui): its templates stay out of the CLI
# and the agent.
forbid nightshift-cli maud
forbid nightshift-agent maud

# part NAME COMMAND...: runs one part of the run and says how long it took.
part() {
    local name="$1" started=$SECONDS
    shift
    "$@"
    echo "tests/run.sh: $name took $((SECONDS - started)) s" >&2
}

# The house style is checked before anything runs: rustfmt's layout and clippy's lints, with
# the workspace's own table ([workspace.lints] in Cargo.toml), every warning an error.
part "the format check" cargo fmt --all -- --check
part "clippy" cargo clippy --workspace --all-targets -- -D warnings

part "the stand-in images" bash tests/images/build.sh
part "the build" cargo build --workspace --bins

# Every test logs under one directory and records the tokens and keys it creates there; after
# the run, nightshift-logscan fails if any log line holds one (tests/src/secrets.rs).
export NIGHTSHIFT_TEST_LOGS="$root/target/test-logs"
rm -rf "$NIGHTSHIFT_TEST_LOGS"

# A throwaway PostgreSQL (127.0.0.1 only, a free port, TLS from its own CA) for the store's
# tests on the PostgreSQL backend: each test makes a database of its own there. They read
# NIGHTSHIFT_TEST_POSTGRES and _CA; stopped and removed when this script exits, however.
pg_dir="$(mktemp -u -d /tmp/nightshift-pg.XXXXXX)"
trap 'bash "$root/tests/postgres.sh" stop "$pg_dir"' EXIT
start_postgres() {
    local vars
    vars="$(bash tests/postgres.sh start "$pg_dir")"
    export NIGHTSHIFT_TEST_POSTGRES NIGHTSHIFT_TEST_POSTGRES_CA
    eval "$vars"
}
part "the PostgreSQL start" start_postgres
part "the tests" cargo test --workspace "$@"
cargo run -q -p nightshift-tests --bin nightshift-logscan -- "$NIGHTSHIFT_TEST_LOGS"

# The whole-system fault simulation (docs/RELIABILITY.md): seeds of a simulated day of a small
# fleet under nine kinds of fault, the real core and the agent's real planner deciding, every
# invariant checked each simulated second; a failing seed fails the run, named with the
# faults that reproduce it. Then the same search must find a bug planted in the planner.
part "the fault simulation" target/debug/nightshift vopr --seeds 200
part "the fault simulation's planted bug" \
    cargo test -q -p nightshift-sim --features inject-late-failsafe --test vopr

# The cluster rig: 3 hosts, each a network namespace with its own dockerd and agent, and
# issue 18's scenarios on it (tests/cluster/scenarios.sh, docs/CLUSTER.md), then the fault
# harness on a fresh one. Needs root.
if [ "${NIGHTSHIFT_SKIP_CLUSTER:-}" = 1 ]; then
    echo "tests/run.sh: NIGHTSHIFT_SKIP_CLUSTER=1: the cluster rig's scenarios did not run" >&2
else
    part "the cluster rig" bash tests/cluster/scenarios.sh
    # Faults on a rig of its own, every kind once (docs/RELIABILITY.md): about 3 minutes.
    part "the fault harness" target/debug/nightshift-bench faults --seed 1
fi

# The fuzz targets, each for a few seconds from its committed corpus (tests/fuzz.sh).
if [ "${NIGHTSHIFT_SKIP_FUZZ:-}" = 1 ]; then
    echo "tests/run.sh: NIGHTSHIFT_SKIP_FUZZ=1: the fuzz targets did not run" >&2
else
    part "the fuzz targets" bash tests/fuzz.sh
fi

# The packages: build the .deb and .rpm (dpkg-deb and rpmbuild from the crates' package
# metadata: packaging/build.sh), of the debug build above rather than a second, release
# compile; check them, install, validate and purge the .debs, then boot them under systemd
# in a container.
if [ "${NIGHTSHIFT_SKIP_PACKAGES:-}" = 1 ]; then
    echo "tests/run.sh: NIGHTSHIFT_SKIP_PACKAGES=1: the package test did not run" >&2
else
    part "the package test" env NIGHTSHIFT_PACKAGE_PROFILE=dev bash packaging/test.sh
fi
