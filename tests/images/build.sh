#!/usr/bin/env bash
# Builds the test stand-ins as static binaries and packs each into a FROM-scratch image:
#   nightshift/vllm-standin:dev  (tests/standins/src/bin/vllm-standin.rs)
#   nightshift/toy-trainer:dev   (tests/standins/src/bin/toy-trainer.rs)
# and, through argo-examples.sh, busybox, alpine:3.23/3.7 and argoproj/argosay:v1/v2 stand-ins.
# Idempotent and runnable from any directory. Needs cargo, a reachable Docker engine, and `file`
# or `ldd` to check that the binaries are static.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
TARGET=x86_64-unknown-linux-gnu
BIN_DIR="$ROOT/target/static/$TARGET/release"
IMAGES=(vllm-standin toy-trainer)

die() {
    echo "build.sh: error: $*" >&2
    exit 1
}

# Fail before compiling anything if Docker cannot be used.
command -v docker >/dev/null 2>&1 || die "the docker CLI is not installed"
if ! docker_err="$(docker version --format '{{.Server.Version}}' 2>&1 >/dev/null)"; then
    die "the Docker engine is not reachable (DOCKER_HOST=${DOCKER_HOST:-unset}): $docker_err"
fi

echo "build.sh: building static binaries into $BIN_DIR"
RUSTFLAGS="-C target-feature=+crt-static" cargo build \
    --manifest-path "$ROOT/Cargo.toml" \
    --release \
    --target "$TARGET" \
    --target-dir "$ROOT/target/static" \
    -p nightshift-standins

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

for name in "${IMAGES[@]}"; do
    bin="$BIN_DIR/$name"
    [[ -x "$bin" ]] || die "cargo did not produce $bin"
    is_static "$bin" || die "$bin is not statically linked: $(file -L "$bin" 2>/dev/null || ldd "$bin" 2>&1)"
done

context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT

for name in "${IMAGES[@]}"; do
    tag="nightshift/$name:dev"
    mkdir "$context/$name"
    cp "$BIN_DIR/$name" "$context/$name/$name"
    cp "$HERE/Dockerfile.$name" "$context/$name/Dockerfile"
    id="$(docker build -q -t "$tag" "$context/$name")" || die "docker build of $tag failed"
    size="$(docker image inspect --format '{{.Size}}' "$tag")"
    echo "build.sh: built $tag ($id, $size bytes) from $BIN_DIR/$name"
done

# The images Argo's examples name (busybox, alpine, argosay), for the pipeline tests.
bash "$HERE/argo-examples.sh" "$BIN_DIR"
