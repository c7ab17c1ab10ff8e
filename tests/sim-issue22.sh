#!/usr/bin/env bash
# Issue 22's benchmark: the four ServeGen traces, 14 days, 32 nodes, peak 28 replicas, seed 1,
# in both lend modes (stop and --sleep); one table row per trace, mode and policy.
#
#   tests/sim-issue22.sh [TRACE_ROOT] [extra simulate flags...]
#
# TRACE_ROOT defaults to ../shared/traces/servegen/data (the traces are read in place). Builds
# the release binary first. Prints markdown rows: trace, mode, policy, useful GPU-h, harvest
# ratio, queue-wait minutes, capacity minutes, SLO minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-../shared/traces/servegen/data}
shift || true
cargo build --release -q -p nightshift-cli --bin nightshift
bin=target/release/nightshift
echo "| trace | mode | policy | useful GPU-h | harvest ratio | queue-wait min | capacity min | SLO min |"
echo "|---|---|---|---|---|---|---|---|"
for trace in language/m-small language/m-large reason/deepseek-r1 multimodal/mm-image; do
    for mode in stop sleep; do
        flags=()
        [ "$mode" = sleep ] && flags+=(--sleep)
        "$bin" simulate --trace "servegen:$root/$trace" --days 14 --nodes 32 \
            --peak-replicas 28 --seed 1 --policies nightshift,reactive,fixed-window,oracle \
            --output json "${flags[@]}" "$@" 2>/dev/null |
            jq -r --arg t "$trace" --arg m "$mode" '.policies[] |
                "| \($t) | \($m) | \(.name) | \(.useful_gpu_hours) | \(.harvest_ratio) | \(.queue_wait_minutes) | \(.capacity_minutes) | \(.slo_violation_minutes) |"'
    done
done
