#!/usr/bin/env bash
# Builds the nightshift packages into target/packages/:
#   .deb (cargo-deb) and .rpm (cargo-generate-rpm) of nightshift-agent (crate agent/),
#   nightshift-coordinator (crate coordinator/) and the CLI nightshift (crate coordinator/cli/,
#   package nightshift-cli), each from its own crate's metadata.
# Installs cargo-deb and cargo-generate-rpm with `cargo install --locked` when they are
# missing (about 1.5 and 4.5 minutes on 2 cores, once per machine).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="$root/target/packages"

need_tool() { # need_tool SUBCOMMAND CRATE [INSTALL-FLAGS...]
    local sub="$1" crate="$2"
    shift 2
    if ! cargo "$sub" --version >/dev/null 2>&1; then
        echo "packaging/build.sh: installing $crate" >&2
        local started=$SECONDS
        cargo install --locked --quiet "$crate" "$@"
        echo "packaging/build.sh: installed $crate in $((SECONDS - started)) s" >&2
    fi
}
# cargo-deb without its default `lzma` feature: no liblzma-sys to compile (a faster install);
# build.sh then compresses with gzip.
need_tool deb cargo-deb --no-default-features
need_tool generate-rpm cargo-generate-rpm

started=$SECONDS
cargo build --release --locked -p nightshift-agent -p nightshift-coordinator -p nightshift-cli --bins
# cargo-deb strips its own copies; cargo-generate-rpm takes the files as they are.
strip target/release/nightshift-agent target/release/nightshift-coordinator target/release/nightshift

rm -rf "$out"
mkdir -p "$out"
cargo deb --no-build --locked -Z gz -p nightshift-agent -o "$out/" >/dev/null
cargo deb --no-build --locked -Z gz -p nightshift-coordinator -o "$out/" >/dev/null
cargo deb --no-build --locked -Z gz -p nightshift-cli -o "$out/" >/dev/null
cargo generate-rpm -p agent -o "$out/" >/dev/null
cargo generate-rpm -p coordinator -o "$out/" >/dev/null
cargo generate-rpm -p coordinator/cli -o "$out/" >/dev/null
echo "packaging/build.sh: built in $((SECONDS - started)) s:" >&2
ls -1 "$out" >&2
