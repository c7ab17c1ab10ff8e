#!/bin/sh
# /usr/libexec/nightshift/remove-agent-containers: stops and removes the containers this host's
# nightshift agent manages (its vLLM replica and any job containers), found by the label the
# agent puts on each, io.nightshift.node=NODE (common/src/labels.rs), NODE being the agent's node
# name as it computes it: NIGHTSHIFT_AGENT__NODE in /etc/default/nightshift-agent, else `node`
# in /etc/nightshift/agent.toml, else /etc/hostname. Containers of other nodes (an engine
# shared by several agents) and every other container are left alone.
#
# The package runs it when it is removed (not upgraded): a job left running would keep its
# GPUs with no agent to reclaim them, and a replica would serve with no agent to drain it.
# Uses the docker CLI when there is one, else curl on the socket; stops each container with
# a 10 s grace (SIGTERM, then SIGKILL), then removes it. Never fails: it reports what it could
# not do.
set -u

label=io.nightshift.node
socket=/var/run/docker.sock
case "${DOCKER_HOST:-}" in unix://*) socket="${DOCKER_HOST#unix://}" ;; esac

node=""
if [ -r /etc/default/nightshift-agent ]; then
    node="$(sed -n 's/^[[:space:]]*\(export[[:space:]]\{1,\}\)\{0,1\}NIGHTSHIFT_AGENT__NODE=["'\'']\{0,1\}\([^"'\'']*\).*/\2/p' \
        /etc/default/nightshift-agent | tail -n1)"
fi
if [ -z "$node" ] && [ -r /etc/nightshift/agent.toml ]; then
    # The top-level key only: stop at the first table header.
    node="$(sed -n '/^[[:space:]]*\[/q; s/^[[:space:]]*node[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' \
        /etc/nightshift/agent.toml | tail -n1)"
fi
if [ -z "$node" ]; then
    node="$(tr -d '[:space:]' </etc/hostname 2>/dev/null || true)"
fi
[ -n "$node" ] || node=localhost

say() { echo "nightshift-agent: $*" >&2; }
manual="docker rm -f \$(docker ps -aq --filter label=$label=$node)"

if [ ! -S "$socket" ]; then
    exit 0 # no Docker engine here: nothing of ours can run
fi

if command -v docker >/dev/null 2>&1; then
    ids="$(docker ps -aq --filter "label=$label=$node" 2>/dev/null)" || {
        say "could not list the containers of node $node; remove them with: $manual"
        exit 0
    }
    [ -n "$ids" ] || exit 0
    say "stopping and removing the containers of node $node: $(echo $ids)"
    # shellcheck disable=SC2086 # one id per word
    docker stop -t 10 $ids >/dev/null 2>&1 || true
    # shellcheck disable=SC2086
    docker rm -f $ids >/dev/null 2>&1 || say "could not remove every container; remove them with: $manual"
    exit 0
fi

if command -v curl >/dev/null 2>&1; then
    api() { curl -fsS --max-time 30 --unix-socket "$socket" "$@"; }
    # filters={"label":["io.nightshift.node=NODE"]}, URL-encoded (every byte of NODE).
    encoded="$(printf %s "$node" | od -An -tx1 -v | tr -d ' \n' | sed 's/\(..\)/%\1/g')"
    filter="%7B%22label%22%3A%5B%22$label%3D$encoded%22%5D%7D"
    if ! listing="$(api "http://docker/containers/json?all=1&filters=$filter")"; then
        say "could not list the containers of node $node; remove them with: $manual"
        exit 0
    fi
    ids="$(printf %s "$listing" | grep -o '"Id":"[0-9a-f]*"' | cut -d'"' -f4)"
    [ -n "$ids" ] || exit 0
    say "stopping and removing the containers of node $node: $(echo "$ids" | cut -c1-12 | tr '\n' ' ')"
    failed=""
    for id in $ids; do
        api -X POST "http://docker/containers/$id/stop?t=10" >/dev/null 2>&1 || true
        api -X DELETE "http://docker/containers/$id?force=1" >/dev/null 2>&1 || failed="$failed $id"
    done
    [ -z "$failed" ] || say "could not remove$failed; remove them with: $manual"
    exit 0
fi

say "neither docker nor curl is installed: the containers of node $node were not removed; remove them with: $manual"
exit 0
