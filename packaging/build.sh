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

# NIGHTSHIFT_PACKAGE_PROFILE=dev packs the debug build instead of making a release one:
# tests/run.sh sets it, since its package test checks the packaging (files, units, scripts,
# installs, a boot under systemd), which does not depend on the optimiser, and the debug build
# is already there, where a release build would cost a second compile of the workspace. Packages
# to ship are built without it.
profile="${NIGHTSHIFT_PACKAGE_PROFILE:-release}"
# The dev build names the whole workspace, as tests/run.sh's build does, so that the features
# resolve the same and nothing is compiled again.
case "$profile" in
    release)
        build=(--release -p nightshift-agent -p nightshift-coordinator -p nightshift-cli)
        bin_dir="$root/target/release"
        ;;
    dev) build=(--workspace) bin_dir="$root/target/debug" ;;
    *)
        echo "packaging/build.sh: NIGHTSHIFT_PACKAGE_PROFILE='$profile': name release or dev" >&2
        exit 1
        ;;
esac
started=$SECONDS
cargo build --locked "${build[@]}" --bins
echo "packaging/build.sh: the $profile build took $((SECONDS - started)) s" >&2
# The .rpms take the binaries as they are, stripped here (copies, so that cargo's own stay
# as built); package.py strips the .debs' copies further, as cargo-deb does.
binaries="$root/target/package-binaries"
rm -rf "$binaries"
mkdir -p "$binaries"
for bin in nightshift-agent nightshift-coordinator nightshift; do
    cp "$bin_dir/$bin" "$binaries/$bin"
    strip "$binaries/$bin"
done
export NIGHTSHIFT_PACKAGE_BINARIES="$binaries"

started=$SECONDS
rm -rf "$out"
python3 packaging/package.py "$out" agent coordinator coordinator/cli >/dev/null
echo "packaging/build.sh: packed in $((SECONDS - started)) s:" >&2
ls -1 "$out" >&2
