#!/usr/bin/env bash
# tests/cluster/scenarios.sh: issue 18's scenarios on the cluster rig. Brings up a 3-host rig
# (up.sh 3), runs each scenario with the CLI (target/debug/nightshift, env from $NSC_STATE/env)
# and checks it against the hosts' own engines, tears the rig down (down.sh), and prints each
# scenario's result and time, then "X passed, Y failed"; exits non-zero on any failure. Needs
# root. docs/CLUSTER.md describes what each scenario shows.
#
#   pull      an image that only the registry holds (made there through its HTTP API, while no
#             engine holds any toy-trainer image) runs on a host that never had it, which
#             pulled it; `job show` shows it pinned to its registry digest
#   badauth   with a wrong password in the agents' auth_file the job fails naming the
#             registry; with the right one again the next job runs
#   missing   a job naming a tag the registry does not hold fails once, naming the registry
#             and the reason; a job beside it on the same node runs
#   rerun-digest  a one-step workflow runs a tag, the tag is moved in the registry, and
#             `nightshift rerun` runs the old digest: its job records the first one's
#             image_digest, and its container on the host's engine is the first image's
#   gang      a 2-node gang with TRAINER_RENDEZVOUS=1 meets across two hosts: rank 0 logs
#             rank 1 joining from host B's address, rank 1 logs connecting to host A's
#   follow    a job checkpointing every 10 steps is preempted on host A (a surge at the
#             gateway takes A back); A's agent is then stopped, so the job runs on another
#             host, and resumes there from the newest checkpoint of the shared directory
#   follow-object
#             the same with object storage: moto (an S3 server) on the rig's gateway address,
#             every agent restarted with [checkpoints] storage = "object"; the preempted
#             attempt's upload lands in the bucket under its epoch (reported as the reclaim's
#             upload_checkpoint phase) and the next attempt, on another host, restores it
#   gang      a 2-node gang with TRAINER_RENDEZVOUS=1 meets across two hosts: rank 0 logs
#             rank 1 joining from host B's address, rank 1 logs connecting to host A's
#   gang-reclaim
#             a 2-node gang checkpointing every 20 steps is reclaimed whole when a surge takes
#             one of its hosts back: both members' containers leave both engines, the job is
#             requeued, and it resumes on two hosts (NIGHTSHIFT_RESUMING=1) from the newest
#             step both ranks' checkpoints in the shared directory hold, then finishes
#   follow    a job checkpointing every 10 steps is preempted on host A (a surge at the
#             gateway takes A back); A's agent is then stopped, so the job runs on another
#             host, and resumes there from the newest checkpoint of the shared directory
#   follow-object
#             the same with object storage: moto (an S3 server) on the rig's gateway address,
#             every agent restarted with [checkpoints] storage = "object"; the preempted
#             attempt's upload lands in the bucket under its epoch (reported as the reclaim's
#             upload_checkpoint phase) and the next attempt, on another host, restores it
#   local-back-to-A  the agents restart with local checkpoints; a job preempted on host A
#             (not the first node lending would pick) goes back to A when A is lent again,
#             and resumes there from its checkpoint (NIGHTSHIFT_RESUMING=1)
#   two-services  a fresh coordinator with two services (alpha on gpu1, beta on gpu2 and gpu3,
#             each with its own replica image and policy): lending takes a node of each, a
#             surge at alpha's gateway takes back only alpha's, and load on beta's serving
#             replica takes back beta's. It replaces the coordinator: it runs last
#   clean     down.sh leaves nothing; a second up.sh 3 and down.sh leave nothing either
# The scenarios are called through `scenario NAME FUNCTION`, which shellcheck cannot follow.
# shellcheck disable=SC2317
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/lib.sh
. "$HERE/lib.sh"
nsc_require_root

N=3
LOG=${TMPDIR:-/tmp}/nsc-scenarios
RESULTS=()
PASS=0
FAIL=0

say() { echo "  $*"; }
# fail MESSAGE: says why a scenario failed; the scenario then returns 1.
fail() {
  echo "  FAIL: $*"
  return 1
}

# scenario NAME FUNCTION: runs it, timed, and records the result. With NSC_ONLY (scenario
# names, the words before the colons, space-separated) only those run; the others are skipped.
scenario() {
  local name=$1 t rc
  if [ -n "${NSC_ONLY:-}" ] && [[ " $NSC_ONLY " != *" ${name%%:*} "* ]]; then
    RESULTS+=("SKIP  $name")
    return
  fi
  echo "== $name"
  t=$(nsc_now)
  "$2"
  rc=$?
  if [ $rc -eq 0 ]; then
    PASS=$((PASS + 1))
    RESULTS+=("PASS  $name ($(nsc_since "$t")s)")
  else
    FAIL=$((FAIL + 1))
    RESULTS+=("FAIL  $name ($(nsc_since "$t")s)")
  fi
}

finish() {
  echo "== results"
  printf '%s\n' "${RESULTS[@]}"
  echo "== times: up ${T_UP:-?}s, down ${T_DOWN:-?}s, whole $(nsc_since "$T0")s"
  echo "$PASS passed, $FAIL failed"
  [ "$FAIL" -eq 0 ]
  exit
}

# A job's view as JSON, and one field of it.
job_json() { nightshift job show "$1" -o json 2>/dev/null; }
job_field() { job_json "$1" | jq -r "$2" 2>/dev/null; }

# submit FILE: prints the new job's id.
submit() { nightshift submit "$1" -o json 2>/dev/null | jq -r '.id' 2>/dev/null; }

# wait_ended ID SECONDS: waits for the job to succeed, fail or be cancelled; prints its state.
wait_ended() {
  local s=""
  for _ in $(seq 1 $(($2 * 2))); do
    s=$(job_field "$1" .state)
    case $s in succeeded | failed | cancelled) break ;; esac
    sleep 0.5
  done
  echo "$s"
}

# The rig hosts (numbers) whose agent keeps a work directory for job ID.
ran_on() {
  local i out=""
  for i in $(seq 1 "$N"); do [ -d "$NSC_STATE/gpu$i/agent/jobs/$1" ] && out+="$i "; done
  echo "${out% }"
}

# surge [SERVICE]: a demand surge at the service's gateway (default: "default"): the
# autoscaler wants replicas back.
surge() {
  curl -sf --max-time 3 --cacert "$NIGHTSHIFT_CA" -H "Authorization: Bearer $NIGHTSHIFT_TOKEN" \
    -H 'content-type: application/json' -d '{"waiting": 5}' \
    "$NIGHTSHIFT_URL/v1/services/${1:-default}/gateway" >/dev/null
}

# wait_running ID SECONDS [JQ]: waits until the job runs (and JQ, a condition on its view,
# holds); prints its view.
wait_running() {
  local j
  for _ in $(seq 1 $(($2 * 2))); do
    j=$(job_json "$1")
    jq -e ".state == \"running\" and (.leases | length > 0) and (${3:-true})" <<<"$j" >/dev/null 2>&1 && break
    sleep 0.5
  done
  echo "$j"
}

# The nodes as the coordinator sees them.
nodes_json() { nightshift nodes -o json 2>/dev/null; }
node_mode() { nodes_json | jq -r --arg n "$1" '.nodes[] | select(.name == $n) | .mode'; }

# wait_serving COUNT SECONDS: waits until the coordinator sees COUNT nodes reachable, serving,
# with a ready replica.
wait_serving() {
  local n=0
  for _ in $(seq 1 $(($2 * 5))); do
    n=$(nodes_json | jq '[.nodes[] | select(.reachable and .mode == "serve" and .replica.state == "serving")] | length' 2>/dev/null)
    [ "$n" = "$1" ] && return 0
    sleep 0.2
  done
  echo "  $n of $1 nodes serving after $2 s"
  return 1
}

# stop_agent I: stops host I's agent (SIGTERM: its containers keep running) and waits for it.
stop_agent() {
  local pid
  pid=$(cat "$NSC_STATE/gpu$1/agent.pid" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  return 1
}

# agents_ready SECONDS: waits until every host's agent answers 200 at /ready (its replica serves),
# as up.sh does. After a restart the coordinator may still count the old agent's last report
# as serving, and then the new agent's first, with the replica not yet adopted, as stopped:
# wait for the new agents themselves before counting serving nodes.
agents_ready() {
  local i
  for i in $(seq 1 "$N"); do
    for _ in $(seq 1 $(($1 * 10))); do
      [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://$(nsc_addr "$i"):7401/ready")" = 200 ] && continue 2
      sleep 0.1
    done
    echo "  gpu$i's agent is not ready after $1 s"
    return 1
  done
}

# restart_agents SED: applies the sed program SED to every host's agent.toml, checks it and
# restarts the agents with it (they adopt their running containers).
restart_agents() {
  local i
  for i in $(seq 1 "$N"); do
    sed -i -e "$1" "$NSC_STATE/gpu$i/agent.toml" &&
      "$NSC_BIN/nightshift-agent" validate --config "$NSC_STATE/gpu$i/agent.toml" >/dev/null || return 1
  done
  for i in $(seq 1 "$N"); do stop_agent "$i" || return 1; done
  for i in $(seq 1 "$N"); do nsc_agent_start "$i"; done
  agents_ready 30
}

# container_of HOST ID: the container of job ID on host number HOST, if any.
container_of() { nsc_docker "$1" ps -aq --filter "name=nightshift-job-gpu$1-$2-" | head -1; }

# trainer_job FILE NAME IMAGE GPUS [ENV=VALUE...]: writes a toy-trainer job file.
trainer_job() {
  local file=$1 name=$2 image=$3 gpus=$4 kv
  shift 4
  {
    echo "name: $name"
    echo "image: $image"
    echo "gpus: $gpus"
    echo "env:"
    for kv in "$@"; do
      echo "  - name: ${kv%%=*}"
      echo "    value: \"${kv#*=}\""
    done
  } >"$file"
}

# registry_new_image REPO FROM_TAG NEW_TAG LABEL: a new image made in the registry alone,
# through its HTTP API (no engine ever holds it): FROM_TAG's layers, its config with the label
# nightshift.scenario=LABEL added, so its own image ID and digest.
registry_new_image() {
  local repo=$1 from=$2 to=$3 label=$4 u base manifest config cdigest csize loc
  u="$NSC_REGISTRY_USER:$(cat "$NSC_STATE/registry/password")"
  base=http://$NSC_REGISTRY/v2/$repo
  manifest=$(curl -sf -u "$u" -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' "$base/manifests/$from") || return 1
  config=$(curl -sfL -u "$u" "$base/blobs/$(jq -r .config.digest <<<"$manifest")" |
    jq -c --arg l "$label" '.config.Labels = ((.config.Labels // {}) + {"nightshift.scenario": $l})') || return 1
  cdigest=sha256:$(printf '%s' "$config" | sha256sum | cut -d' ' -f1)
  csize=$(printf '%s' "$config" | wc -c)
  loc=$(curl -sf -u "$u" -X POST -D- -o /dev/null "$base/blobs/uploads/" | tr -d '\r' | sed -n 's/^[Ll]ocation: //p') || return 1
  [[ $loc == http* ]] || loc=http://$NSC_REGISTRY$loc
  [[ $loc == *\?* ]] && loc+="&" || loc+="?"
  printf '%s' "$config" | curl -sf -u "$u" -X PUT -H 'content-type: application/octet-stream' --data-binary @- "${loc}digest=$cdigest" >/dev/null || return 1
  jq -c --arg d "$cdigest" --argjson s "$csize" '.config.digest = $d | .config.size = $s' <<<"$manifest" |
    curl -sf -u "$u" -X PUT -H 'content-type: application/vnd.docker.distribution.manifest.v2+json' --data-binary @- "$base/manifests/$to" >/dev/null
}

# ------------------------------------------------------------------ the scenarios
IMAGE=""      # the scenario's fresh tag, in the registry only
BAD_IMAGE=""  # a second fresh tag of it, first pulled by the badauth scenario

s_pull() {
  local tag id state digest where h
  tag=scn-$(od -An -tx1 -N4 /dev/urandom | tr -d ' \n')
  IMAGE=$NSC_REGISTRY/nightshift/toy-trainer:$tag
  BAD_IMAGE=$IMAGE-b
  registry_new_image nightshift/toy-trainer "${NSC_TRAINER_IMAGE#*:}" "$tag" "$tag" &&
    registry_new_image nightshift/toy-trainer "${NSC_TRAINER_IMAGE#*:}" "$tag-b" "$tag-b" ||
    fail "making $IMAGE in the registry" || return 1
  for h in $(seq 1 "$N"); do
    nsc_docker "$h" images --format '{{.Repository}}:{{.Tag}}' | grep -q toy-trainer &&
      { fail "gpu$h holds a toy-trainer image before the job" || return 1; }
  done
  say "made $IMAGE in the registry; no engine holds any toy-trainer image"

  trainer_job "$NSC_STATE/scn-pull.yaml" scn-pull "$IMAGE" 1 TRAINER_TARGET_STEP=50 TRAINER_STEPS_PER_SEC=100
  id=$(submit "$NSC_STATE/scn-pull.yaml")
  [[ $id =~ ^[0-9]+$ ]] || fail "submit: $id" || return 1
  state=$(wait_ended "$id" 60)
  [ "$state" = succeeded ] || fail "job $id: $state ($(job_field "$id" .message))" || return 1
  [ "$(job_field "$id" .outputs.final_step)" = 50 ] || fail "job $id did not reach step 50" || return 1
  digest=$(job_field "$id" .image_digest)
  [[ $digest == "${IMAGE%:*}@sha256:"* ]] || fail "job $id: image_digest [$digest] is no digest of ${IMAGE%:*}" || return 1
  nightshift job show "$id" | grep -qE "^pinned: +${digest//./\\.}$" || fail "job show prints no pinned: $digest" || return 1
  where=$(ran_on "$id")
  [[ $where =~ ^[0-9]$ ]] || fail "job $id: no single host ran it ($where)" || return 1
  # The host that ran it pulled it, and now holds it at the pinned digest.
  grep -q "image pulled image=\"$IMAGE\"" "$NSC_STATE/gpu$where/agent.log" ||
    fail "gpu$where's agent did not log pulling $IMAGE" || return 1
  nsc_docker "$where" image inspect -f '{{join .RepoDigests " "}}' "$IMAGE" 2>/dev/null | grep -qF "$digest" ||
    fail "gpu$where's engine does not hold $digest" || return 1
  say "job $id succeeded on gpu$where, which pulled it; pinned: $digest"
}

s_badauth() {
  local auth=$NSC_STATE/registry-auth.json id id2 state msg where
  [ -n "$BAD_IMAGE" ] || fail "no image (the pull scenario failed before pushing)" || return 1
  cp "$auth" "$auth.good"
  printf '{"auths": {"%s": {"auth": "%s"}}}\n' "$NSC_REGISTRY" \
    "$(printf '%s:wrong' "$NSC_REGISTRY_USER" | base64 -w0)" >"$auth.new" && mv "$auth.new" "$auth"
  trainer_job "$NSC_STATE/scn-badauth.yaml" scn-badauth "$BAD_IMAGE" 4 TRAINER_TARGET_STEP=50 TRAINER_STEPS_PER_SEC=100
  id=$(submit "$NSC_STATE/scn-badauth.yaml")
  state=$(wait_ended "$id" 60)
  mv "$auth.good" "$auth"
  [ "$state" = failed ] || fail "job $id with a wrong password: $state, not failed" || return 1
  msg=$(job_field "$id" .message)
  [[ $msg == *"from registry $NSC_REGISTRY failed"*unauthorized* ]] ||
    fail "job $id's message does not name the registry and the refusal: [$msg]" || return 1
  say "job $id failed: $msg"
  where=$(grep -l "pulling image image=\"$BAD_IMAGE\"" "$NSC_STATE"/gpu*/agent.log | head -1 | sed 's|.*/gpu\([0-9]*\)/agent.log|\1|')
  [[ $where =~ ^[0-9]+$ ]] || fail "no agent logged pulling $BAD_IMAGE" || return 1
  # The right password again: the next job (the same image, 4 GPUs: a whole node) runs.
  id2=$(submit "$NSC_STATE/scn-badauth.yaml")
  state=$(wait_ended "$id2" 90)
  [ "$state" = succeeded ] || fail "the next job $id2: $state ($(job_field "$id2" .message))" || return 1
  say "the pull failed on gpu$where; the next job $id2 succeeded on gpu$(ran_on "$id2")"
  # The node of the failed pull is not held up: its agent runs and the coordinator reaches it.
  kill -0 "$(cat "$NSC_STATE/gpu$where/agent.pid")" || fail "gpu$where's agent died" || return 1
  nightshift nodes -o json | jq -e --arg n "gpu$where" '.nodes[] | select(.name == $n and .reachable)' >/dev/null ||
    fail "gpu$where is not reachable in nightshift nodes" || return 1
}

s_gang() {
  local id j r0 r1 a b c1 log0 log1 state
  [ -n "$IMAGE" ] || fail "no image (the pull scenario failed before pushing)" || return 1
  trainer_job "$NSC_STATE/scn-gang.yaml" scn-gang "$IMAGE" 4 TRAINER_RENDEZVOUS=1 \
    TRAINER_TARGET_STEP=400 TRAINER_STEPS_PER_SEC=50 TRAINER_CHECKPOINT_EVERY=50
  echo "nodes: 2" >>"$NSC_STATE/scn-gang.yaml"
  id=$(submit "$NSC_STATE/scn-gang.yaml")
  [[ $id =~ ^[0-9]+$ ]] || fail "submit: $id" || return 1
  for _ in $(seq 1 120); do
    j=$(job_json "$id")
    [ "$(jq -r .state <<<"$j")" = running ] && break
    sleep 0.5
  done
  r0=$(jq -r '.leases[]? | select(.rank == 0) | .node' <<<"$j")
  r1=$(jq -r '.leases[]? | select(.rank == 1) | .node' <<<"$j")
  [[ $r0 =~ ^gpu[0-9]+$ && $r1 =~ ^gpu[0-9]+$ && $r0 != "$r1" ]] || fail "job $id: not running on two hosts ($j)" || return 1
  a=$(nsc_addr "${r0#gpu}")
  b=$(nsc_addr "${r1#gpu}")
  # Rank 1's container output, from its own host's engine, while it runs (the agent removes
  # the container when it exits); rank 0's through `nightshift logs`.
  for _ in $(seq 1 40); do
    c1=$(nsc_docker "${r1#gpu}" ps -aq --filter "name=nightshift-job-$r1-$id-" | head -1)
    [ -n "$c1" ] && log1=$(nsc_docker "${r1#gpu}" logs "$c1" 2>&1)
    log0=$(nightshift logs "$id" 2>&1)
    [[ $log1 == *"connected to rank 0"* && $log0 == *"rank 1 joined"* ]] && break
    sleep 0.5
  done
  grep -m1 "rendezvous" <<<"$log1" | sed "s/^/  rank 1 on $r1: /"
  grep -m1 "joined" <<<"$log0" | sed "s/^/  rank 0 on $r0: /"
  grep -q "connected to rank 0 at $a:" <<<"$log1" || fail "rank 1 did not log connecting to rank 0 at $a" || return 1
  grep -q "rank 1 joined from $b:" <<<"$log0" || fail "rank 0 did not log rank 1 joining from $b" || return 1
  state=$(wait_ended "$id" 60)
  [ "$state" = succeeded ] || fail "gang job $id: $state ($(job_field "$id" .message))" || return 1
  [ "$(job_field "$id" '.outputs.nnodes + " " + .outputs.rounds')" = "2 400" ] ||
    fail "job $id's outputs: $(job_field "$id" -c .outputs)" || return 1
  say "gang job $id met across $r0 ($a) and $r1 ($b) and took 400 steps in lock step"
}

# ckpt_steps DIR: the steps of the complete checkpoints in DIR, one a line, in order.
ckpt_steps() {
  find "$1" -maxdepth 1 -name 'step-*.ckpt' 2>/dev/null | sed 's/.*step-0*\([0-9][0-9]*\)\.ckpt/\1/' | sort -n
}

# common_step ID EPOCH0 EPOCH1: the newest checkpoint step that rank 0's directory of EPOCH0 and
# rank 1's of EPOCH1 both hold in the shared directory (nothing when there is none).
common_step() {
  local d=$NSC_STATE/shared/checkpoints/jobs/$1/checkpoints
  comm -12 <(ckpt_steps "$d/rank-0/$2" | sort) <(ckpt_steps "$d/rank-1/$3" | sort) | sort -n | tail -1
}

# The job's lease of rank R, as "NODE EPOCH", from its view J.
rank_lease() { jq -r --argjson r "$2" '.leases[]? | select(.rank == $r) | "\(.node) \(.epoch)"' <<<"$1"; }

s_gang_reclaim() {
  local id j r0 r1 e0 e1 h node left common rounds state c log i env pre step resumed=""
  [ -n "$IMAGE" ] || fail "no image (the pull scenario failed before pushing)" || return 1
  trainer_job "$NSC_STATE/scn-gang-reclaim.yaml" scn-gang-reclaim "$IMAGE" 4 TRAINER_RENDEZVOUS=1 \
    TRAINER_TARGET_STEP=600 TRAINER_STEPS_PER_SEC=50 TRAINER_CHECKPOINT_EVERY=20
  echo "nodes: 2" >>"$NSC_STATE/scn-gang-reclaim.yaml"
  id=$(submit "$NSC_STATE/scn-gang-reclaim.yaml")
  [[ $id =~ ^[0-9]+$ ]] || fail "submit: $id" || return 1
  for _ in $(seq 1 120); do
    j=$(job_json "$id")
    [ "$(jq -r .state <<<"$j")" = running ] && [ "$(jq -r .last_checkpoint_at <<<"$j")" != null ] && break
    sleep 0.5
  done
  read -r r0 e0 <<<"$(rank_lease "$j" 0)"
  read -r r1 e1 <<<"$(rank_lease "$j" 1)"
  [[ $r0 =~ ^gpu[0-9]+$ && $r1 =~ ^gpu[0-9]+$ && $r0 != "$r1" ]] ||
    fail "job $id is not running on two hosts with a checkpoint: $j" || return 1
  # Both ranks hold a checkpoint before the surge: the step the resumed gang must reach at least.
  for _ in $(seq 1 60); do
    pre=$(common_step "$id" "$e0" "$e1")
    [[ $pre =~ ^[0-9]+$ ]] && break
    sleep 0.25
  done
  [[ $pre =~ ^[0-9]+$ ]] || fail "job $id: no checkpoint that both ranks hold before the surge" || return 1
  say "gang job $id runs on $r0 (rank 0, epoch $e0) and $r1 (rank 1, epoch $e1); both hold step $pre; a surge"
  surge
  for _ in $(seq 1 100); do
    j=$(job_json "$id")
    [ "$(jq -r .preemptions <<<"$j")" = 1 ] && [ "$(jq -r .state <<<"$j")" != preempting ] && break
    surge
    sleep 0.3
  done
  [ "$(jq -r .preemptions <<<"$j")" = 1 ] || fail "job $id was not preempted: $j" || return 1
  [[ $(jq -r .state <<<"$j") =~ ^(queued|starting|running)$ ]] || fail "job $id after the reclaim: $j" || return 1
  say "reclaimed whole: job $id is $(jq -r .state <<<"$j") (attempt $(jq -r .attempt <<<"$j"), 1 preemption)"
  # Both members' containers leave both engines (the agents remove them once the coordinator
  # has seen them stop).
  for _ in $(seq 1 60); do
    left=""
    for node in "${r0#gpu}:$e0" "${r1#gpu}:$e1"; do
      [ -n "$(nsc_docker "${node%%:*}" ps -aq --filter "label=io.nightshift.job-id=$id" \
        --filter "label=io.nightshift.epoch=${node#*:}" 2>/dev/null)" ] && left+="${node%%:*} "
    done
    [ -z "$left" ] && break
    sleep 0.25
  done
  [ -z "$left" ] || fail "the first attempt's containers are still on the engines of host $left" || return 1
  # The common checkpoint: the newest step both ranks' directories (per rank, per epoch, in the
  # shared directory) hold. The agents remove those directories once the next attempt was seeded
  # from them, which may already have happened: then the resumed ranks' logs name the step.
  common=$(common_step "$id" "$e0" "$e1")
  say "both members' containers are gone from $r0 and $r1; the common checkpoint is step ${common:-(already moved to attempt 2)}"
  # The gang is placed again, whole, on two hosts, and resumes from it.
  for _ in $(seq 1 180); do
    j=$(job_json "$id")
    [ "$(jq -r .state <<<"$j")" = running ] && [ "$(jq -r '.leases | length' <<<"$j")" = 2 ] && break
    sleep 0.5
  done
  [ "$(jq -r .state <<<"$j")" = running ] && [ "$(jq -r .attempt <<<"$j")" = 2 ] ||
    fail "job $id did not run again: $j" || return 1
  for i in 0 1; do
    read -r node _ <<<"$(rank_lease "$j" "$i")"
    h=${node#gpu}
    for _ in $(seq 1 40); do
      c=$(nsc_docker "$h" ps -aq --filter "name=nightshift-job-$node-$id-" | head -1)
      [ -n "$c" ] && log=$(nsc_docker "$h" logs "$c" 2>&1) && [[ $log == *"resumed from step"* ]] && break
      sleep 0.25
    done
    env=$(nsc_docker "$h" inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$c" 2>/dev/null)
    grep -qx NIGHTSHIFT_RESUMING=1 <<<"$env" || fail "rank $i on $node: not started with NIGHTSHIFT_RESUMING=1" || return 1
    step=$(sed -n "s/.*resumed from step \([0-9][0-9]*\), the gang's common checkpoint.*/\1/p" <<<"${log:-}" | head -1)
    [[ $step =~ ^[0-9]+$ ]] && [ "$step" -ge "$pre" ] && [ "${common:-$step}" = "$step" ] &&
      [ "${resumed:-$step}" = "$step" ] ||
      fail "rank $i on $node did not resume from the common step ${common:-(at least $pre)}${resumed:+, as the other rank did ($resumed)}: $(grep -m1 -E 'resumed|fresh' <<<"${log:-}")" || return 1
    resumed=$step
    say "attempt 2, rank $i on $node: $(grep -m1 'resumed from step' <<<"$log")"
  done
  state=$(wait_ended "$id" 60)
  [ "$state" = succeeded ] || fail "job $id: $state ($(job_field "$id" .message))" || return 1
  common=$resumed
  rounds=$((600 - common))
  [ "$(job_field "$id" '.outputs.final_step + " " + .outputs.resumed_from_step + " " + .outputs.nnodes + " " + .outputs.rounds')" = "600 $common 2 $rounds" ] ||
    fail "job $id's outputs: $(job_field "$id" -c .outputs)" || return 1
  say "job $id finished at step 600, both ranks resumed from step $common ($rounds steps in lock step)"
}

s_follow() {
  local id j a state pre_epoch newest resumed where c log
  [ -n "$IMAGE" ] || fail "no image (the pull scenario failed before pushing)" || return 1
  trainer_job "$NSC_STATE/scn-follow.yaml" scn-follow "$IMAGE" 4 TRAINER_TARGET_STEP=600 \
    TRAINER_STEPS_PER_SEC=50 TRAINER_CHECKPOINT_EVERY=10
  id=$(submit "$NSC_STATE/scn-follow.yaml")
  [[ $id =~ ^[0-9]+$ ]] || fail "submit: $id" || return 1
  for _ in $(seq 1 120); do
    j=$(job_json "$id")
    [ "$(jq -r .state <<<"$j")" = running ] && [ "$(jq -r .last_checkpoint_at <<<"$j")" != null ] && break
    sleep 0.5
  done
  a=$(jq -r '.leases[0].node // empty' <<<"$j")
  pre_epoch=$(jq -r '.leases[0].epoch // empty' <<<"$j")
  [[ $a =~ ^gpu[0-9]+$ ]] || fail "job $id is not running with a checkpoint: $j" || return 1
  say "job $id runs on $a (epoch $pre_epoch) and has checkpointed; a surge takes $a back"
  surge
  for _ in $(seq 1 100); do
    j=$(job_json "$id")
    [ "$(jq -r .preemptions <<<"$j")" = 1 ] && [ "$(jq -r .state <<<"$j")" != preempting ] && break
    surge
    sleep 0.3
  done
  [ "$(jq -r .preemptions <<<"$j")" = 1 ] || fail "job $id was not preempted: $j" || return 1
  newest=$(find "$NSC_STATE/shared/checkpoints/jobs/$id/checkpoints/$pre_epoch" -name 'step-*.ckpt' 2>/dev/null |
    sed 's/.*step-0*\([0-9][0-9]*\)\.ckpt/\1/' | sort -n | tail -1)
  [[ $newest =~ ^[0-9]+$ ]] || fail "no checkpoint of epoch $pre_epoch in the shared directory" || return 1
  # A cannot take the job back: its agent is stopped (as if the host went away).
  kill "$(cat "$NSC_STATE/$a/agent.pid")"
  say "preempted at step $newest (the shared directory's newest checkpoint); $a's agent stopped"
  for _ in $(seq 1 180); do
    j=$(job_json "$id")
    [ "$(jq -r .state <<<"$j")" = running ] && break
    sleep 0.5
  done
  where=$(jq -r '.leases[0].node // empty' <<<"$j")
  [[ $where =~ ^gpu[0-9]+$ && $where != "$a" ]] || fail "job $id did not run again on another host: $j" || return 1
  for _ in $(seq 1 20); do
    c=$(nsc_docker "${where#gpu}" ps -aq --filter "name=nightshift-job-$where-$id-" | head -1)
    [ -n "$c" ] && log=$(nsc_docker "${where#gpu}" logs "$c" 2>&1) && [[ $log == *"resumed from step"* ]] && break
    sleep 0.5
  done
  grep -m1 "resumed from step" <<<"${log:-}" | sed "s/^/  attempt 2 on $where: /"
  state=$(wait_ended "$id" 60)
  [ "$state" = succeeded ] || fail "job $id: $state ($(job_field "$id" .message))" || return 1
  resumed=$(job_field "$id" .outputs.resumed_from_step)
  [ "$resumed" = "$newest" ] || fail "job $id resumed from step [$resumed], not $newest" || return 1
  [ "$(job_field "$id" .outputs.resumed_from_epoch)" = "$pre_epoch" ] ||
    fail "job $id resumed from epoch $(job_field "$id" .outputs.resumed_from_epoch), not $pre_epoch" || return 1
  say "job $id resumed on $where from step $resumed of epoch $pre_epoch and finished"
}

# s3 METHOD PATH [CURL ARGS...]: a request to the rig's S3 server (moto), signed as the agents'
# credentials sign theirs (moto checks no signature, but a real server would).
s3() {
  local method=$1 path=$2
  shift 2
  curl -sf --max-time 5 -X "$method" --aws-sigv4 "aws:amz:us-east-1:s3" \
    --user "$(sed -n 's/^aws_access_key_id = //p' "$NSC_STATE/s3.credentials"):$(sed -n 's/^aws_secret_access_key = //p' "$NSC_STATE/s3.credentials")" \
    "$@" "http://$NSC_GW:$NSC_MOTO_PORT$path"
}

# The keys under PREFIX of the rig's bucket, one a line.
s3_keys() { s3 GET "/$NSC_BUCKET?list-type=2&prefix=$1" | grep -o '<Key>[^<]*</Key>' | sed 's/<[^>]*>//g'; }

NSC_MOTO_PORT=5002
NSC_BUCKET=nightshift-rig

# Starts moto on the gateway address, makes the bucket, and restarts every agent with its
# checkpoints in the bucket (prefix rig/). moto runs through a link under $NSC_STATE, so that
# down.sh finds and stops it like the rig's other processes.
object_storage() {
  local moto=${NIGHTSHIFT_TEST_MOTO:-$NSC_REPO/target/moto-venv/bin/moto_server} i pid dir ok
  [ -x "$moto" ] || fail "no moto_server at $moto (tests/run.sh installs it in target/moto-venv)" || return 1
  mkdir -p "$NSC_STATE/moto"
  ln -sf "$moto" "$NSC_STATE/moto/moto_server"
  setsid "$NSC_STATE/moto/moto_server" -H "$NSC_GW" -p "$NSC_MOTO_PORT" >"$NSC_STATE/moto.log" 2>&1 </dev/null &
  echo $! >"$NSC_STATE/moto/pid"
  (umask 077 && printf '[default]\naws_access_key_id = nightshift-rig\naws_secret_access_key = %s\n' \
    "$(od -An -tx1 -N12 /dev/urandom | tr -d ' \n')" >"$NSC_STATE/s3.credentials")
  for _ in $(seq 1 100); do
    s3 PUT "/$NSC_BUCKET" -o /dev/null && break
    sleep 0.1
  done
  s3 GET "/$NSC_BUCKET?list-type=2" -o /dev/null || fail "moto did not answer at $NSC_GW:$NSC_MOTO_PORT" || return 1
  for i in $(seq 1 "$N"); do
    dir=$NSC_STATE/gpu$i
    pid=$(cat "$dir/agent.pid")
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    sed -i -e 's|^storage = "shared"$|storage = "object"|' \
      -e "s|^shared_dir = .*|[checkpoints.object]\\nendpoint = \"http://$NSC_GW:$NSC_MOTO_PORT\"\\nbucket = \"$NSC_BUCKET\"\\nprefix = \"rig\"\\ncredentials_file = \"$NSC_STATE/s3.credentials\"\\nupload_wait_s = 30.0|" \
      "$dir/agent.toml"
    "$NSC_BIN/nightshift-agent" validate --config "$dir/agent.toml" >/dev/null || fail "gpu$i's agent.toml with object storage" || return 1
    nsc_agent_start "$i"
  done
  # Each new agent adopts its running replica and answers /ready once it has (the old one is
  # gone: its pid was waited for); then the coordinator hears so.
  for i in $(seq 1 "$N"); do
    for _ in $(seq 1 300); do
      [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://$(nsc_addr "$i"):7401/ready")" = 200 ] && break
      sleep 0.1
    done
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://$(nsc_addr "$i"):7401/ready")" = 200 ] || {
      tail -5 "$NSC_STATE/gpu$i/agent.log" | sed 's/^/    /'
      fail "gpu$i's agent, restarted with object storage, is not ready"
      return 1
    }
  done
  # Seen serving three times in a row: a node's first heartbeat after the restart may still
  # say otherwise.
  ok=0
  for _ in $(seq 1 200); do
    if [ "$(nightshift nodes -o json 2>/dev/null | jq '[.nodes[] | select(.reachable and .replica.state == "serving")] | length')" = "$N" ]; then
      ok=$((ok + 1))
      [ "$ok" -ge 3 ] && break
    else
      ok=0
    fi
    sleep 0.1
  done
  [ "$ok" -ge 3 ] || {
    nightshift nodes 2>&1 | sed 's/^/    /'
    fail "not every agent serves again after the restart with object storage"
    return 1
  }
  say "moto at $NSC_GW:$NSC_MOTO_PORT, bucket $NSC_BUCKET; $N agents restarted with storage = \"object\""
}

s_follow_object() {
  local id j a pre_epoch ep keys newest phase where state resumed
  [ -n "$IMAGE" ] || fail "no image (the pull scenario failed before pushing)" || return 1
  object_storage || return 1
  trainer_job "$NSC_STATE/scn-follow-object.yaml" scn-follow-object "$IMAGE" 4 TRAINER_TARGET_STEP=600 \
    TRAINER_STEPS_PER_SEC=50 TRAINER_CHECKPOINT_EVERY=10
  id=$(submit "$NSC_STATE/scn-follow-object.yaml")
  [[ $id =~ ^[0-9]+$ ]] || fail "submit: $id" || return 1
  for _ in $(seq 1 120); do
    j=$(job_json "$id")
    [ "$(jq -r .state <<<"$j")" = running ] && [ "$(jq -r .last_checkpoint_at <<<"$j")" != null ] && break
    sleep 0.5
  done
  a=$(jq -r '.leases[0].node // empty' <<<"$j")
  pre_epoch=$(jq -r '.leases[0].epoch // empty' <<<"$j")
  [[ $a =~ ^gpu[0-9]+$ ]] || fail "job $id is not running with a checkpoint: $j" || return 1
  ep=$(printf '%020d' "$pre_epoch")
  say "job $id runs on $a (epoch $pre_epoch) and has checkpointed; a surge takes $a back"
  surge
  for _ in $(seq 1 100); do
    j=$(job_json "$id")
    [ "$(jq -r .preemptions <<<"$j")" = 1 ] && [ "$(jq -r .state <<<"$j")" != preempting ] && break
    surge
    sleep 0.3
  done
  [ "$(jq -r .preemptions <<<"$j")" = 1 ] || fail "job $id was not preempted: $j" || return 1
  # The upload, after the container stopped: the epoch's files, then its manifest.
  for _ in $(seq 1 60); do
    keys=$(s3_keys "rig/jobs/$id/checkpoints/")
    grep -qx "rig/jobs/$id/checkpoints/$ep/MANIFEST.json" <<<"$keys" && break
    sleep 0.5
  done
  grep -qx "rig/jobs/$id/checkpoints/$ep/MANIFEST.json" <<<"$keys" ||
    fail "no manifest of epoch $pre_epoch in the bucket: ${keys//$'\n'/ }" || return 1
  newest=$(grep "^rig/jobs/$id/checkpoints/$ep/files/step-" <<<"$keys" |
    sed 's/.*step-0*\([0-9][0-9]*\)\.ckpt/\1/' | sort -n | tail -1)
  [[ $newest =~ ^[0-9]+$ ]] || fail "no checkpoint file of epoch $pre_epoch in the bucket" || return 1
  for _ in $(seq 1 40); do
    phase=$(nightshift nodes -o json | jq -r --arg n "$a" \
      '.nodes[] | select(.name == $n) | .recent_phases[]? | select(.phase == "upload_checkpoint" and .sequence == "reclaim") | .duration_ms' | tail -1)
    [ -n "$phase" ] && break
    sleep 0.25
  done
  [[ $phase =~ ^[0-9]+$ ]] || fail "$a reported no upload_checkpoint phase" || return 1
  # A cannot take the job back: its agent is stopped (as if the host went away).
  kill "$(cat "$NSC_STATE/$a/agent.pid")"
  say "preempted at step $newest, uploaded to the bucket under epoch $pre_epoch in ${phase} ms; $a's agent stopped"
  for _ in $(seq 1 180); do
    j=$(job_json "$id")
    [ "$(jq -r .state <<<"$j")" = running ] && break
    sleep 0.5
  done
  where=$(jq -r '.leases[0].node // empty' <<<"$j")
  [[ $where =~ ^gpu[0-9]+$ && $where != "$a" ]] || fail "job $id did not run again on another host: $j" || return 1
  state=$(wait_ended "$id" 60)
  [ "$state" = succeeded ] || fail "job $id: $state ($(job_field "$id" .message))" || return 1
  resumed=$(job_field "$id" .outputs.resumed_from_step)
  [ "$resumed" = "$newest" ] || fail "job $id resumed from step [$resumed], not $newest" || return 1
  [ "$(job_field "$id" .outputs.resumed_from_epoch)" = "$pre_epoch" ] ||
    fail "job $id resumed from epoch $(job_field "$id" .outputs.resumed_from_epoch), not $pre_epoch" || return 1
  [ ! -e "$NSC_STATE/shared/checkpoints/jobs/$id" ] || fail "job $id wrote the shared directory" || return 1
  grep -q "checkpoint restored from the bucket.*job.id=$id .*from_epoch=Some($pre_epoch)" "$NSC_STATE/$where/agent.log" ||
    fail "$where's agent did not log restoring epoch $pre_epoch" || return 1
  say "job $id restored on $where from the bucket (step $resumed of epoch $pre_epoch) and finished"
  kill "$(cat "$NSC_STATE/moto/pid")" 2>/dev/null
}

s_missing() {
  local img id id2 state msg where pulls
  [ -n "$IMAGE" ] || fail "no image (the pull scenario failed before pushing)" || return 1
  img=$NSC_REGISTRY/nightshift/toy-trainer:missing-$(od -An -tx1 -N4 /dev/urandom | tr -d ' \n')
  # Two 2-GPU jobs, submitted together: lending takes one node for both.
  trainer_job "$NSC_STATE/scn-missing.yaml" scn-missing "$img" 2 TRAINER_TARGET_STEP=50
  trainer_job "$NSC_STATE/scn-missing-next.yaml" scn-missing-next "$IMAGE" 2 TRAINER_TARGET_STEP=50 TRAINER_STEPS_PER_SEC=100
  id=$(submit "$NSC_STATE/scn-missing.yaml")
  id2=$(submit "$NSC_STATE/scn-missing-next.yaml")
  [[ $id =~ ^[0-9]+$ && $id2 =~ ^[0-9]+$ ]] || fail "submit: $id $id2" || return 1
  state=$(wait_ended "$id" 60)
  [ "$state" = failed ] || fail "job $id naming a missing tag: $state, not failed" || return 1
  msg=$(job_field "$id" .message)
  [[ $msg == *"from registry $NSC_REGISTRY failed"*"not found"* ]] ||
    fail "job $id's message does not name the registry and the reason: [$msg]" || return 1
  say "job $id failed: $msg"
  state=$(wait_ended "$id2" 60)
  [ "$state" = succeeded ] || fail "job $id2 beside it: $state ($(job_field "$id2" .message))" || return 1
  where=$(grep -l "pulling image image=\"$img\"" "$NSC_STATE"/gpu*/agent.log | sed 's|.*/gpu\([0-9]*\)/agent.log|\1|' | tr '\n' ' ')
  [[ $where =~ ^[0-9]+\ $ ]] || fail "not one agent logged pulling $img: [$where]" || return 1
  where=${where% }
  [ "$(ran_on "$id2")" = "$where" ] || fail "job $id2 ran on gpu$(ran_on "$id2"), not gpu$where" || return 1
  # Tried once: one failure, one attempt, one pull in the agent's log (and none since, while
  # the next job ran).
  [ "$(job_field "$id" '"\(.failures) \(.attempt)"')" = "1 1" ] ||
    fail "job $id: failures and attempt $(job_field "$id" '"\(.failures) \(.attempt)"'), not 1 1" || return 1
  pulls=$(grep -c "pulling image image=\"$img\" registry" "$NSC_STATE/gpu$where/agent.log")
  [ "$pulls" = 1 ] || fail "gpu$where's agent began $pulls pulls of $img" || return 1
  say "tried once; job $id2 beside it on gpu$where succeeded"
}

# run_ended RUN SECONDS: waits for a pipeline run to end; prints its view.
run_ended() {
  local v
  for _ in $(seq 1 $(($2 * 2))); do
    v=$(nightshift get "$1" -o json 2>/dev/null)
    [ "$(jq -r .phase <<<"$v" 2>/dev/null)" != Running ] && break
    sleep 0.5
  done
  echo "$v"
}

s_rerun() {
  local repo=nightshift/toy-trainer tag wf run run2 v j1 j2 d1 moved u h j c label
  tag=rerun-$(od -An -tx1 -N4 /dev/urandom | tr -d ' \n')
  registry_new_image "$repo" "${NSC_TRAINER_IMAGE#*:}" "$tag" "$tag-first" ||
    fail "making $NSC_REGISTRY/$repo:$tag in the registry" || return 1
  wf=$NSC_STATE/scn-rerun.yaml
  cat >"$wf" <<EOF
apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  generateName: scn-rerun-
spec:
  entrypoint: train
  templates:
  - name: train
    container:
      image: $NSC_REGISTRY/$repo:$tag
      env:
      - name: TRAINER_TARGET_STEP
        value: "200"
      - name: TRAINER_STEPS_PER_SEC
        value: "100"
      resources:
        limits:
          nvidia.com/gpu: 4
EOF
  run=$(submit "$wf")
  [[ $run =~ ^[0-9]+$ ]] || fail "submit $wf: $run" || return 1
  v=$(run_ended "$run" 60)
  [ "$(jq -r .phase <<<"$v")" = Succeeded ] || fail "run $run: $(jq -c '[.phase, .nodes[].message]' <<<"$v")" || return 1
  j1=$(jq -r '[.nodes[].jobs[]?] | last' <<<"$v")
  d1=$(job_field "$j1" .image_digest)
  [[ $d1 == "$NSC_REGISTRY/$repo@sha256:"* ]] || fail "job $j1: image_digest [$d1] is no digest of $repo" || return 1
  say "run $run's job $j1 ran $NSC_REGISTRY/$repo:$tag, pinned: $d1"
  # The tag moves to another image (another label, so another digest).
  registry_new_image "$repo" "${NSC_TRAINER_IMAGE#*:}" "$tag" "$tag-second" || fail "moving $tag" || return 1
  u="$NSC_REGISTRY_USER:$(cat "$NSC_STATE/registry/password")"
  moved=$(curl -sfI -u "$u" -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
    "http://$NSC_REGISTRY/v2/$repo/manifests/$tag" | tr -d '\r' | sed -n 's/^[Dd]ocker-[Cc]ontent-[Dd]igest: //p')
  [[ $moved == sha256:* && $d1 != *"@$moved" ]] || fail "the tag did not move: [$moved]" || return 1
  say "moved $tag to $moved"
  run2=$(nightshift rerun "$run" -o json 2>/dev/null | jq -r .id)
  [[ $run2 =~ ^[0-9]+$ ]] || fail "nightshift rerun $run: $run2" || return 1
  # Its container, while it runs, on its host's engine: the first image (its label).
  for _ in $(seq 1 120); do
    j2=$(nightshift get "$run2" -o json 2>/dev/null | jq -r '[.nodes[].jobs[]?] | last // empty')
    [ -n "$j2" ] && j=$(job_json "$j2") && h=$(jq -r '.leases[0].node // empty' <<<"$j") && [ -n "$h" ] &&
      c=$(container_of "${h#gpu}" "$j2") && [ -n "$c" ] &&
      label=$(nsc_docker "${h#gpu}" inspect -f '{{index .Config.Labels "nightshift.scenario"}}' "$c" 2>/dev/null) && break
    sleep 0.5
  done
  [ "${label:-}" = "$tag-first" ] || fail "the rerun's container (job ${j2:-?} on ${h:-?}) has label [${label:-}], not $tag-first" || return 1
  v=$(run_ended "$run2" 60)
  [ "$(jq -r .phase <<<"$v")" = Succeeded ] || fail "rerun $run2: $(jq -c '[.phase, .nodes[].message]' <<<"$v")" || return 1
  [ "$(job_field "$j2" .image_digest)" = "$d1" ] || fail "job $j2's image_digest [$(job_field "$j2" .image_digest)], not $d1" || return 1
  [ "$(job_field "$j2" .spec.image)" = "$d1" ] || fail "job $j2 names [$(job_field "$j2" .spec.image)], not $d1" || return 1
  for h in $(seq 1 "$N"); do
    nsc_docker "$h" image inspect "$NSC_REGISTRY/$repo@$moved" >/dev/null 2>&1 &&
      { fail "gpu$h's engine pulled the moved tag's $moved" || return 1; }
  done
  say "rerun $run2's job $j2 ran $d1 on $h; no engine holds $moved"
}

s_local() {
  local blocker id j b0 a epoch first c env newest where state log
  [ -n "$IMAGE" ] || fail "no image (the pull scenario failed before pushing)" || return 1
  restart_agents 's/^storage = .*/storage = "local"/; /^shared_dir = /d; /^\[checkpoints\.object\]$/,/^$/d' ||
    fail "restarting the agents with local checkpoints" || return 1
  wait_serving "$N" 30 || fail "the agents did not come back" || return 1
  say "the agents restarted with [checkpoints] storage = \"local\""
  # A blocker takes the node lending picks first (by name), so that the job runs on another
  # one, A, which only the job's checkpoint can make lending pick again.
  trainer_job "$NSC_STATE/scn-local-blocker.yaml" scn-local-blocker "$IMAGE" 4 TRAINER_TARGET_STEP=1000000 TRAINER_STEPS_PER_SEC=10
  blocker=$(submit "$NSC_STATE/scn-local-blocker.yaml")
  j=$(wait_running "$blocker" 60)
  b0=$(jq -r '.leases[0].node // empty' <<<"$j")
  [[ $b0 =~ ^gpu[0-9]+$ ]] || fail "the blocker $blocker is not running: $j" || return 1
  trainer_job "$NSC_STATE/scn-local.yaml" scn-local "$IMAGE" 4 TRAINER_TARGET_STEP=500 \
    TRAINER_STEPS_PER_SEC=100 TRAINER_CHECKPOINT_EVERY=20
  id=$(submit "$NSC_STATE/scn-local.yaml")
  j=$(wait_running "$id" 60 '.last_checkpoint_at != null')
  a=$(jq -r '.leases[0].node // empty' <<<"$j")
  epoch=$(jq -r '.leases[0].epoch // empty' <<<"$j")
  [[ $a =~ ^gpu[0-9]+$ && $a != "$b0" ]] || fail "job $id is not running with a checkpoint beside the blocker on $b0: $j" || return 1
  c=$(container_of "${a#gpu}" "$id")
  env=$(nsc_docker "${a#gpu}" inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$c" 2>/dev/null)
  grep -qx NIGHTSHIFT_RESUMING=0 <<<"$env" || fail "attempt 1 of job $id on $a: no NIGHTSHIFT_RESUMING=0" || return 1
  nightshift cancel "$blocker" >/dev/null 2>&1 || fail "cancel $blocker" || return 1
  for _ in $(seq 1 60); do
    [ "$(node_mode "$b0")" = serve ] && break
    sleep 0.25
  done
  say "job $id runs on $a (epoch $epoch) and has checkpointed; the blocker on $b0 is cancelled; a surge takes $a back"
  surge
  for _ in $(seq 1 100); do
    j=$(job_json "$id")
    [ "$(jq -r .preemptions <<<"$j")" = 1 ] && [ "$(jq -r .state <<<"$j")" = queued ] && break
    surge
    sleep 0.3
  done
  [ "$(jq -r '"\(.preemptions) \(.state)"' <<<"$j")" = "1 queued" ] || fail "job $id was not preempted: $j" || return 1
  newest=$(find "$NSC_STATE/$a/agent/jobs/$id/checkpoints/$epoch" -name 'step-*.ckpt' 2>/dev/null |
    sed 's/.*step-0*\([0-9][0-9]*\)\.ckpt/\1/' | sort -n | tail -1)
  [[ $newest =~ ^[0-9]+$ ]] || fail "no checkpoint of epoch $epoch in $a's work_dir" || return 1
  [ ! -e "$NSC_STATE/shared/checkpoints/jobs/$id" ] || fail "job $id has checkpoints in the shared directory" || return 1
  # By name, lending's first pick among the serving nodes is not A: only the checkpoint
  # brings the job back there.
  first=$(nodes_json | jq -r '[.nodes[] | select(.mode == "serve") | .name] | sort | first')
  [ "$first" != "$a" ] || fail "$a is lending's first pick anyway: the scenario cannot tell" || return 1
  say "preempted at step $newest (on $a's own disk only); $first and $a serve"
  j=$(wait_running "$id" 60)
  where=$(jq -r '.leases[0].node // empty' <<<"$j")
  [ "$where" = "$a" ] || fail "job $id went to [$where], not back to $a: $j" || return 1
  for _ in $(seq 1 20); do
    c=$(container_of "${a#gpu}" "$id")
    [ -n "$c" ] && log=$(nsc_docker "${a#gpu}" logs "$c" 2>&1) && [[ $log == *"resumed from step"* ]] && break
    sleep 0.5
  done
  env=$(nsc_docker "${a#gpu}" inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$c" 2>/dev/null)
  grep -qx NIGHTSHIFT_RESUMING=1 <<<"$env" || fail "attempt 2 of job $id on $a: no NIGHTSHIFT_RESUMING=1" || return 1
  grep -m1 "resumed from step" <<<"${log:-}" | sed "s/^/  attempt 2 on $a: /"
  state=$(wait_ended "$id" 60)
  [ "$state" = succeeded ] || fail "job $id: $state ($(job_field "$id" .message))" || return 1
  [ "$(job_field "$id" .outputs.resumed_from_step)" = "$newest" ] ||
    fail "job $id resumed from step [$(job_field "$id" .outputs.resumed_from_step)], not $newest" || return 1
  [ "$(job_field "$id" .outputs.resumed_from_epoch)" = "$epoch" ] ||
    fail "job $id resumed from epoch [$(job_field "$id" .outputs.resumed_from_epoch)], not $epoch" || return 1
  say "job $id went back to $a (not $first), resumed from step $newest with NIGHTSHIFT_RESUMING=1, and finished"
}

# The two services' coordinator: alpha may lend its only node (min_replicas 0), beta keeps one
# of its two serving and counts one waiting request per replica as pressure.
services_toml() {
  cat <<EOF
# The cluster rig's coordinator for the two-services scenario (tests/cluster/scenarios.sh).
listen = "$NSC_GW:$NSC_COORDINATOR_PORT"
data_dir = "$NSC_STATE/coordinator/data-services"
heartbeat_interval_ms = 500
lease_ttl_ms = 15000

[[services]]
name = "alpha"
min_replicas = 0
cooldown_s = 5.0
gateway_signal_ttl_s = 5.0
[services.scale_down]
max_waiting = 0.0
max_running_per_replica = 4.0
window_s = 5.0
[services.scale_up]
waiting_per_replica = 2.0
running_per_replica = 32.0

[[services]]
name = "beta"
min_replicas = 1
cooldown_s = 3.0
gateway_signal_ttl_s = 5.0
[services.scale_down]
max_waiting = 0.0
max_running_per_replica = 4.0
window_s = 3.0
[services.scale_up]
waiting_per_replica = 1.0
running_per_replica = 32.0

[tls]
ca_file = "$NSC_STATE/tls/ca.pem"
cert_file = "$NSC_STATE/tls/coordinator.pem"
key_file = "$NSC_STATE/tls/coordinator.key"
EOF
}

s_services() {
  local co=$NSC_STATE/coordinator i svc ja jb j na nb nodes beta_serving label waiting load=()
  [ -n "$IMAGE" ] || fail "no image (the pull scenario failed before pushing)" || return 1
  # Each service's own replica image: the stand-in's layers under its own label.
  for svc in alpha beta; do
    registry_new_image nightshift/vllm-standin "${NSC_REPLICA_IMAGE#*:}" "$svc" "replica-$svc" ||
      fail "making the $svc replica image" || return 1
  done
  # A node keeps the service it first registered with: a fresh coordinator (its own data
  # directory and admin token) with the two services, and every agent restarted with its
  # service's name, replica image and replica containers.
  for i in $(seq 1 "$N"); do stop_agent "$i" || fail "stopping gpu$i's agent" || return 1; done
  kill "$(cat "$co/pid")" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$(cat "$co/pid")" 2>/dev/null || break; sleep 0.1; done
  for i in $(seq 1 "$N"); do
    # shellcheck disable=SC2046 # one container ID a word
    nsc_docker "$i" rm -f $(nsc_docker "$i" ps -aq) >/dev/null 2>&1
    svc=beta
    [ "$i" = 1 ] && svc=alpha
    sed -i -e "s/^service = .*/service = \"$svc\"/" \
      -e "s|^image = \"$NSC_REGISTRY/$NSC_REPLICA_IMAGE\"|image = \"$NSC_REGISTRY/nightshift/vllm-standin:$svc\"|" \
      -e 's/STANDIN_MAX_NUM_SEQS=16/STANDIN_MAX_NUM_SEQS=2/' "$NSC_STATE/gpu$i/agent.toml"
  done
  services_toml >"$co/services.toml"
  mkdir -p "$co/data-services"
  "$NSC_BIN/nightshift-coordinator" validate --config "$co/services.toml" >/dev/null || fail "services.toml does not validate" || return 1
  NIGHTSHIFT_TOKEN=$("$NSC_BIN/nightshift-coordinator" token create --role admin --name cluster-rig --data-dir "$co/data-services" 2>/dev/null)
  sed -i "s/^export NIGHTSHIFT_TOKEN=.*/export NIGHTSHIFT_TOKEN=$NIGHTSHIFT_TOKEN/" "$NSC_STATE/env"
  setsid "$NSC_BIN/nightshift-coordinator" serve --config "$co/services.toml" >>"$NSC_STATE/coordinator.log" 2>&1 </dev/null &
  echo $! >"$co/pid"
  for _ in $(seq 1 100); do
    [ "$(curl -s --max-time 1 --cacert "$NIGHTSHIFT_CA" "$NIGHTSHIFT_URL/healthz")" = ok ] && break
    sleep 0.1
  done
  for i in $(seq 1 "$N"); do nsc_agent_start "$i"; done
  agents_ready 60 || fail "the agents of the two services are not all ready" || return 1
  wait_serving "$N" 60 || fail "the nodes of the two services are not all serving" || return 1
  for i in $(seq 1 "$N"); do
    svc=beta
    [ "$i" = 1 ] && svc=alpha
    label=$(nsc_docker "$i" ps --format '{{.Label "nightshift.scenario"}}' | head -1)
    [ "$label" = "replica-$svc" ] || fail "gpu$i's replica is [$label], not replica-$svc" || return 1
    [ "$(nodes_json | jq -r --arg n "gpu$i" '.nodes[] | select(.name == $n) | .service')" = "$svc" ] ||
      fail "gpu$i is not in service $svc" || return 1
  done
  say "a fresh coordinator: gpu1 serves alpha, gpu2 and gpu3 serve beta, each from its own replica image"
  # Two whole-node jobs: lending takes alpha's only node and one of beta's two.
  trainer_job "$NSC_STATE/scn-services.yaml" scn-services "$IMAGE" 4 TRAINER_TARGET_STEP=1000000 TRAINER_STEPS_PER_SEC=10
  ja=$(submit "$NSC_STATE/scn-services.yaml")
  jb=$(submit "$NSC_STATE/scn-services.yaml")
  wait_running "$ja" 60 >/dev/null
  wait_running "$jb" 60 >/dev/null
  nodes=$(nodes_json)
  na=$(jq -r '[.nodes[] | select(.service == "alpha" and .mode == "lend") | .name] | join(" ")' <<<"$nodes")
  nb=$(jq -r '[.nodes[] | select(.service == "beta" and .mode == "lend") | .name] | join(" ")' <<<"$nodes")
  [ "$na" = gpu1 ] && [[ $nb =~ ^gpu[23]$ ]] || fail "lent: alpha [$na], beta [$nb]" || return 1
  # Which job runs where.
  [ "$(job_field "$ja" '.leases[0].node')" = gpu1 ] || { j=$ja; ja=$jb; jb=$j; }
  [ "$(job_field "$ja" '.leases[0].node')" = gpu1 ] && [ "$(job_field "$jb" '.leases[0].node')" = "$nb" ] ||
    fail "jobs $ja and $jb are not on gpu1 and $nb" || return 1
  say "lent: gpu1 of alpha (job $ja) and $nb of beta (job $jb)"
  # A surge at alpha's gateway takes gpu1 back, and nothing of beta's.
  for _ in $(seq 1 40); do
    surge alpha
    [ "$(node_mode gpu1)" = serve ] && break
    sleep 0.3
  done
  [ "$(node_mode gpu1)" = serve ] || fail "alpha's surge did not take gpu1 back" || return 1
  for _ in $(seq 1 40); do
    [ "$(job_field "$ja" .preemptions)" = 1 ] && break
    sleep 0.25
  done
  wait_serving 2 30 >/dev/null
  [ "$(node_mode "$nb")" = lend ] || fail "alpha's surge took beta's $nb back too" || return 1
  [ "$(job_field "$jb" '"\(.state) \(.preemptions)"')" = "running 0" ] ||
    fail "beta's job $jb: $(job_field "$jb" '"\(.state) \(.preemptions)"')" || return 1
  [ "$(job_field "$ja" .preemptions)" = 1 ] || fail "alpha's job $ja was not preempted" || return 1
  say "alpha's surge took gpu1 back (job $ja preempted); beta's $nb stays lent, job $jb running"
  # Load on beta's serving replica (2 sequences at a time, so most requests wait): beta takes
  # $nb back on its own replica's signals.
  beta_serving=$(nodes_json | jq -r '.nodes[] | select(.service == "beta" and .mode == "serve") | .name')
  [[ $beta_serving =~ ^gpu[23]$ ]] || fail "beta's serving node: [$beta_serving]" || return 1
  for _ in $(seq 1 12); do
    curl -s --max-time 40 -o /dev/null -H 'content-type: application/json' \
      -d '{"model": "standin-model", "prompt": "hi", "max_tokens": 500}' \
      "http://$(nsc_addr "${beta_serving#gpu}"):8000/v1/completions" &
    load+=($!)
  done
  for _ in $(seq 1 40); do
    [ "$(node_mode "$nb")" = serve ] && break
    sleep 0.25
  done
  [ "$(node_mode "$nb")" = serve ] || fail "load on beta's $beta_serving did not take $nb back" || return 1
  for _ in $(seq 1 40); do
    [ "$(job_field "$jb" .preemptions)" = 1 ] && break
    sleep 0.25
  done
  [ "$(job_field "$jb" .preemptions)" = 1 ] || fail "beta's job $jb was not preempted" || return 1
  say "load on beta's replica on $beta_serving took $nb back (job $jb preempted)"
  # Beta's load is beta's alone: once its surge's signal has lapsed and its window passed,
  # alpha lends gpu1 again for the queued jobs while beta's replica still has requests waiting.
  for _ in $(seq 1 80); do
    [ "$(node_mode gpu1)" = lend ] && break
    sleep 0.25
  done
  waiting=$(nodes_json | jq -r --arg n "$beta_serving" '.nodes[] | select(.name == $n) | .replica.signals.requests_waiting')
  [ "$(node_mode gpu1)" = lend ] || fail "alpha did not lend gpu1 again while beta was loaded" || return 1
  [[ $waiting =~ ^[1-9] ]] || fail "beta's replica had [$waiting] requests waiting when alpha lent gpu1: the scenario cannot tell" || return 1
  say "alpha lent gpu1 again while beta's replica on $beta_serving had $waiting requests waiting"
  nightshift cancel "$ja" >/dev/null 2>&1
  nightshift cancel "$jb" >/dev/null 2>&1
  kill "${load[@]}" 2>/dev/null
}

s_clean() {
  local left t
  left=$(nsc_leftovers)
  [ -z "$left" ] || fail "after the first down.sh: ${left//$'\n'/; }" || return 1
  t=$(nsc_now)
  "$HERE/up.sh" "$N" >"$LOG-up2.log" 2>&1 || {
    tail -5 "$LOG-up2.log"
    "$HERE/down.sh"
    fail "the second up.sh $N failed"
    return 1
  }
  say "a second up.sh $N in $(nsc_since "$t")s"
  t=$(nsc_now)
  "$HERE/down.sh" 2>/dev/null || fail "the second down.sh exited non-zero" || return 1
  say "a second down.sh in $(nsc_since "$t")s"
  "$HERE/down.sh" 2>/dev/null || fail "a down.sh with no rig up exited non-zero" || return 1
  left=$(nsc_leftovers)
  [ -z "$left" ] || fail "after the second down.sh: ${left//$'\n'/; }" || return 1
  say "nothing left after either down.sh"
}

# ------------------------------------------------------------------ run
T0=$(nsc_now)
if [ -e "$NSC_STATE" ] || [ -e "/run/netns/$NSC_SWITCH" ]; then
  echo "a rig is already up (or left over): run tests/cluster/down.sh first"
  FAIL=1
  finish
fi
t=$(nsc_now)
if ! "$HERE/up.sh" "$N" >"$LOG-up.log" 2>&1; then
  T_UP=$(nsc_since "$t")
  sed 's/^/    /' "$LOG-up.log"
  "$HERE/down.sh"
  RESULTS+=("FAIL  up.sh $N")
  FAIL=1
  finish
fi
T_UP=$(nsc_since "$t")
echo "== up.sh $N in ${T_UP}s"
# shellcheck disable=SC1091
. "$NSC_STATE/env"

scenario "pull: an image only the registry holds runs, pinned by digest" s_pull
scenario "badauth: a wrong registry password fails the job, the next runs" s_badauth
scenario "missing: a tag the registry does not hold fails once, naming it" s_missing
scenario "rerun-digest: the tag moved, rerun runs the old digest" s_rerun
scenario "gang: a 2-node gang rendezvouses across hosts" s_gang
scenario "gang-reclaim: a gang reclaimed whole resumes on two hosts from its common checkpoint" s_gang_reclaim
scenario "follow: preempted on A, resumes on another host from the shared checkpoint" s_follow
# The scenarios from here on restart the agents with other settings: object storage, local
# storage, and last (it replaces the coordinator) two services.
scenario "follow-object: preempted on A, resumes on another host from the bucket" s_follow_object
scenario "local-back-to-A: local checkpoints bring a preempted job back to A" s_local
scenario "two-services: each service lends and takes back its own nodes" s_services

t=$(nsc_now)
"$HERE/down.sh" 2>"$LOG-down.log" || { tail -5 "$LOG-down.log"; }
T_DOWN=$(nsc_since "$t")
echo "== down.sh in ${T_DOWN}s"
scenario "clean: down.sh leaves nothing, twice in a row" s_clean
finish
