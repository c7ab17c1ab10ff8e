#!/usr/bin/env bash
# Builds, under the names Argo's examples use, small local images for hosts that cannot pull:
#   busybox:latest, alpine:3.23, alpine:3.7   Debian's static busybox FROM scratch, with /tmp
#   argoproj/argosay:v1, argoproj/argosay:v2  the same plus the static argosay stand-in
# Usage: argo-examples.sh BIN_DIR   (BIN_DIR holds the static `argosay`; build.sh passes it)
# Needs /bin/busybox (package busybox-static) and a reachable Docker engine. Idempotent. An
# image of the same name that is NOT ours (no io.nightshift.standin label) is left alone, so a
# site that has the real images keeps them.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN_DIR="${1:?usage: argo-examples.sh BIN_DIR}"
BUSYBOX="${BUSYBOX:-/bin/busybox}"
LABEL=io.nightshift.standin

die() {
    echo "argo-examples.sh: error: $*" >&2
    exit 1
}

[[ -x "$BUSYBOX" ]] || die "$BUSYBOX is missing: install busybox-static"
[[ -x "$BIN_DIR/argosay" ]] || die "$BIN_DIR/argosay is missing: build nightshift-standins first"

# Whether TAG may be (re)built: absent, or built by this script.
ours_or_absent() {
    local label
    label="$(docker image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$1" 2>/dev/null)" || return 0
    [[ "$label" == argo-examples ]]
}

context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT

build() {
    local dockerfile="$1" binary="$2"
    shift 2
    local tags=() tag
    for tag in "$@"; do
        if ours_or_absent "$tag"; then
            tags+=(-t "$tag")
        else
            echo "argo-examples.sh: keeping $tag (not built by nightshift)"
        fi
    done
    [[ ${#tags[@]} -gt 0 ]] || return 0
    rm -rf "$context"/*
    cp "$binary" "$context/"
    cp "$HERE/$dockerfile" "$context/Dockerfile"
    docker build -q --label "$LABEL=argo-examples" "${tags[@]}" "$context" >/dev/null \
        || die "docker build of $* failed"
    echo "argo-examples.sh: built $*"
}

build Dockerfile.busybox "$BUSYBOX" busybox:latest alpine:3.23 alpine:3.7
build Dockerfile.argosay "$BIN_DIR/argosay" argoproj/argosay:v1 argoproj/argosay:v2
