#!/usr/bin/env bash
# Builds the nightshift packages into target/packages/:
#   .deb and .rpm of nightshift-agent (crate agent/), nightshift-coordinator (crate
#   coordinator/) and the CLI nightshift (crate coordinator/cli/, package nightshift-cli),
#   each from its own crate's [package.metadata.deb] and [package.metadata.generate-rpm].
# packaging/package.py reads those tables and makes the packages with Debian's dpkg-deb and
# rpmbuild, as cargo-deb and cargo-generate-rpm would (the same files, modes, control fields
# and maintainer scripts), so neither tool has to be compiled from source (about 15 minutes
# on 2 cores). What it needs is installed from Debian's packages when missing: python3,
# dpkg-dev (dpkg-shlibdeps, for the .debs' library dependencies), binutils (strip), rpm
# (rpmbuild).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="$root/target/packages"

missing=()
python3 -c 'import tomllib' >/dev/null 2>&1 || missing+=(python3)
command -v dpkg-shlibdeps >/dev/null 2>&1 || missing+=(dpkg-dev)
command -v strip >/dev/null 2>&1 || missing+=(binutils)
command -v rpmbuild >/dev/null 2>&1 || missing+=(rpm)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "packaging/build.sh: installing ${missing[*]}" >&2
    if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

started=$SECONDS
cargo build --release --locked -p nightshift-agent -p nightshift-coordinator -p nightshift-cli --bins
# The .rpms take the binaries as they are; package.py strips the .debs' copies further, as
# cargo-deb does.
strip target/release/nightshift-agent target/release/nightshift-coordinator target/release/nightshift
echo "packaging/build.sh: the release build took $((SECONDS - started)) s" >&2

started=$SECONDS
rm -rf "$out"
python3 packaging/package.py "$out" agent coordinator coordinator/cli >/dev/null
echo "packaging/build.sh: packed in $((SECONDS - started)) s:" >&2
ls -1 "$out" >&2
