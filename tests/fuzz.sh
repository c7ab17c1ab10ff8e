#!/usr/bin/env bash
# The fuzz targets (fuzz/, cargo-fuzz's layout), each run briefly from its committed corpus:
# NIGHTSHIFT_FUZZ_SECONDS per target (10 by default; five targets, under a minute of fuzzing
# in all). Fails when a target crashes, times out or runs out of memory; the input that did
# it is left under fuzz/artifacts/TARGET/. Runs on stable: `-s none` needs no nightly
# (../shared/notes/crates.md §8); there is no AddressSanitizer then, but Rust's own checks
# (debug assertions included, `-a`) still panic.
#
# The committed corpus is read, never written: new inputs go to a scratch directory.
# Where ../shared holds the Argo conformance files and the vLLM metrics fixtures, the
# workflow and prometheus targets read them as extra corpora.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

seconds="${NIGHTSHIFT_FUZZ_SECONDS:-10}"

if ! cargo fuzz --version 2>/dev/null | grep -q '^cargo-fuzz 0\.13\.'; then
    echo "tests/fuzz.sh: installing cargo-fuzz 0.13.2"
    cargo install cargo-fuzz --locked --version 0.13.2
fi
if ! command -v c++ >/dev/null 2>&1; then
    # libfuzzer-sys compiles libFuzzer, which is C++.
    echo "tests/fuzz.sh: installing g++ (libFuzzer is C++)"
    if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq g++ >/dev/null
fi

# Every target in one cargo invocation (fuzz/ is a workspace of its own; its target dir is
# fuzz/target), in the dev profile: a few seconds per target replay the corpus and explore a
# little, where an optimised build of the whole agent and coordinator under coverage
# instrumentation took 9 minutes on 2 cores. A longer campaign drops --dev (README).
started=$SECONDS
cargo fuzz build --dev -s none -a
echo "tests/fuzz.sh: building the fuzz targets took $((SECONDS - started)) s" >&2

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
failed=()
for target in $(cargo fuzz list); do
    corpora=("$scratch/$target" "fuzz/corpus/$target")
    case "$target" in
        workflow) extra="../shared/conformance/argo-workflows" ;;
        prometheus) extra="../shared/fixtures/vllm-metrics" ;;
        *) extra="" ;;
    esac
    if [ -n "$extra" ] && [ -d "$extra" ]; then corpora+=("$extra"); fi
    mkdir -p "$scratch/$target" "fuzz/artifacts/$target"
    echo "tests/fuzz.sh: $target for ${seconds} s"
    # Without a sanitizer libFuzzer cannot stop one huge allocation (-rss_limit_mb samples
    # once a second): the address-space limit makes it fail at once, as a crash.
    if ! (ulimit -v 4194304 && cargo fuzz run --dev -s none -a "$target" "${corpora[@]}" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="fuzz/artifacts/$target/" -print_final_stats=1); then
        failed+=("$target")
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "tests/fuzz.sh: crashed: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
echo "tests/fuzz.sh: every target ran ${seconds} s without a crash"
