#!/usr/bin/env bash
# Builds the test stand-ins as static binaries and packs each into a FROM-scratch image.
# Usage: build.sh [IMAGE...]   with IMAGE among (all three when none is named):
#   vllm-standin   nightshift/vllm-standin:TAG  (tests/standins/src/bin/vllm-standin.rs)
#   toy-trainer    nightshift/toy-trainer:TAG   (tests/standins/src/bin/toy-trainer.rs)
#   argo-examples  busybox, alpine:3.23/3.7 and argoproj/argosay:v1/v2 stand-ins, through
#                  argo-examples.sh, which needs /bin/busybox (package busybox-static)
# `nightshift-demo` names the first two only, so the demo needs nothing from apt. TAG is
# $NIGHTSHIFT_STANDIN_TAG, `dev` by default (the demo reads it too; its test builds and runs
# images of a tag of its own, so that it never replaces the ones other tests run).
# Idempotent and runnable from any directory. Needs cargo, a reachable Docker engine, and `file`
# or `ldd` to check that the binaries are static.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
TARGET=x86_64-unknown-linux-gnu
BIN_DIR="$ROOT/target/static/$TARGET/release"
TAG="${NIGHTSHIFT_STANDIN_TAG:-dev}"

die() {
    echo "build.sh: error: $*" >&2
    exit 1
}

# What to build: the images named, and the static binaries they hold.
IMAGES=()
ARGO=0
[[ $# -gt 0 ]] || set -- vllm-standin toy-trainer argo-examples
for name in "$@"; do
    case "$name" in
        vllm-standin | toy-trainer) IMAGES+=("$name") ;;
        argo-examples) ARGO=1 ;;
        *) die "unknown image '$name': name vllm-standin, toy-trainer or argo-examples" ;;
    esac
done
[[ "$TAG" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] ||
    die "NIGHTSHIFT_STANDIN_TAG='$TAG' is not a Docker tag (letters, digits, _ . -, at most 128)"
BINS=("${IMAGES[@]}")
[[ $ARGO = 0 ]] || BINS+=(argosay)

# Fail before compiling anything if Docker cannot be used.
command -v docker >/dev/null 2>&1 || die "the docker CLI is not installed"
if ! docker_err="$(docker version --format '{{.Server.Version}}' 2>&1 >/dev/null)"; then
    die "the Docker engine is not reachable (DOCKER_HOST=${DOCKER_HOST:-unset}): $docker_err"
fi

echo "build.sh: building ${BINS[*]} statically into $BIN_DIR"
bin_args=()
for bin in "${BINS[@]}"; do bin_args+=(--bin "$bin"); done
RUSTFLAGS="-C target-feature=+crt-static" cargo build \
    --manifest-path "$ROOT/Cargo.toml" \
    --release \
    --target "$TARGET" \
    --target-dir "$ROOT/target/static" \
    -p nightshift-standins "${bin_args[@]}"

is_static() {
    local bin="$1"
    if command -v file >/dev/null 2>&1; then
        file -L "$bin" | grep -Eq 'statically linked|static-pie linked'
    elif command -v ldd >/dev/null 2>&1; then
        ! ldd "$bin" >/dev/null 2>&1 || ldd "$bin" 2>&1 | grep -q 'statically linked'
    else
        die "neither file nor ldd is installed: cannot check that $bin is static"
    fi
}

for name in "${BINS[@]}"; do
    bin="$BIN_DIR/$name"
    [[ -x "$bin" ]] || die "cargo did not produce $bin"
    is_static "$bin" || die "$bin is not statically linked: $(file -L "$bin" 2>/dev/null || ldd "$bin" 2>&1)"
done

context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT

for name in "${IMAGES[@]}"; do
    tag="nightshift/$name:$TAG"
    mkdir "$context/$name"
    cp "$BIN_DIR/$name" "$context/$name/$name"
    cp "$HERE/Dockerfile.$name" "$context/$name/Dockerfile"
    id="$(docker build -q -t "$tag" "$context/$name")" || die "docker build of $tag failed"
    size="$(docker image inspect --format '{{.Size}}' "$tag")"
    echo "build.sh: built $tag ($id, $size bytes) from $BIN_DIR/$name"
done

# The images Argo's examples name (busybox, alpine, argosay), for the pipeline tests.
[[ $ARGO = 0 ]] || bash "$HERE/argo-examples.sh" "$BIN_DIR"
