//! `nightshift demo`: the whole harvest loop on this machine, with Docker and no GPU.
//!
//! It starts the real `nightshift-coordinator` and `nightshift-agent` programs (SQLite in a
//! temporary folder, 4 fake GPUs; see [`crate::cluster`]), the vLLM stand-in as the serving
//! replica behind a small gateway, and a load generator. Then it
//! tells the story: light load → night (the replica drains, a toy trainer runs on its GPUs
//! and checkpoints) → a surge (the node is reclaimed: the job is checkpointed and stopped,
//! vLLM restarts, the held requests are served) → the load falls → the job resumes from its
//! checkpoint and finishes. Every request must succeed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nightshift_cli::client::Client;
use nightshift_common::{
    CheckpointPolicy, EnvVar, JobSpec, JobState, PhaseRecord, ReplicaState, SequenceKind, labels,
};
use serde_json::json;

use crate::cluster::{Binaries, DevCluster, TOY_TRAINER, VLLM_STANDIN, standin_image};
use crate::gateway::{self, GatewayConfig};
use crate::loadgen::{LoadGen, RequestShape};

const LIGHT_RATE: f64 = 4.0;
const SURGE_RATE: f64 = 24.0;
/// The trainer: 1200 steps at 60 per second (20 s of work), a checkpoint every 60 steps.
const TARGET_STEP: u64 = 1200;
const STEPS_PER_SEC: u64 = 60;
const CHECKPOINT_EVERY: u64 = 60;
/// Longest any single wait of the story may take before the demo gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(180);

/// A readable, timestamped account of what happened.
struct Timeline {
    start: Instant,
    live: bool,
    events: Mutex<Vec<(f64, String)>>,
}

impl Timeline {
    fn note(&self, what: impl Into<String>) {
        let what = what.into();
        let t = self.start.elapsed().as_secs_f64();
        if self.live {
            println!("[{t:6.1}s] {what}");
        }
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((t, what));
    }

    fn to_json(&self) -> serde_json::Value {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        events
            .iter()
            .map(|(t, e)| json!({"t_s": (t * 10.0).round() / 10.0, "event": e}))
            .collect()
    }
}

/// What the demo has seen of the agent: its replica's state (from the agent's `/status`) and
/// every finished phase of its drains and reclaims (from the coordinator's view of the node).
#[derive(Default)]
struct Seen {
    replica: Option<ReplicaState>,
    phases: Vec<PhaseRecord>,
}

type Shared = Arc<Mutex<Seen>>;

fn replica(seen: &Shared) -> Option<ReplicaState> {
    seen.lock().unwrap_or_else(|p| p.into_inner()).replica
}

/// Runs the demo; returns the process exit code (0 when every promise held). The coordinator
/// and agent programs are stopped and the node's containers removed on every way out: the
/// story's end, its failure, and Ctrl-C or SIGTERM.
pub async fn run(json: bool) -> anyhow::Result<i32> {
    let binaries = Binaries::find()?;
    ensure_images().await?;
    // The node is named after this process, so that containers of two demos never mix.
    let node = format!("demo-{}", std::process::id());
    let dir = tempfile::tempdir().context("creating a temporary folder")?;
    let mut cluster = None;
    let (result, failed) = tokio::select! {
        result = story(&binaries, &node, dir.path(), !json, &mut cluster) => {
            let failed = result.is_err();
            (result, failed)
        }
        signal = interrupted() => (Err(anyhow::anyhow!("interrupted by {signal}")), false),
    };
    if let Some(cluster) = cluster.as_mut() {
        // A failure shows what the programs said last; an interruption does not need to.
        if failed {
            for log in cluster.logs() {
                eprintln!(
                    "--- the end of {}:\n{}",
                    log.display(),
                    crate::cluster::tail(log, 15)
                );
            }
        }
        cluster.stop().await;
    }
    remove_containers(&node).await;
    let report = result?;
    let ok = report["ok"].as_bool().unwrap_or(false);
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_summary(&report);
    }
    Ok(if ok { 0 } else { 1 })
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM, naming it.
async fn interrupted() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

async fn story(
    binaries: &Binaries,
    node: &str,
    dir: &Path,
    live: bool,
    slot: &mut Option<DevCluster>,
) -> anyhow::Result<serde_json::Value> {
    let timeline = Arc::new(Timeline {
        start: Instant::now(),
        live,
        events: Mutex::new(Vec::new()),
    });
    let cluster = slot.insert(DevCluster::start(binaries, dir, node).await?);
    timeline.note(format!(
        "{} up at {} and {} up as node {node} with 4 fake GPUs (state and logs in {}); \
         starting the vLLM stand-in",
        crate::cluster::COORDINATOR_BIN,
        cluster.url,
        crate::cluster::AGENT_BIN,
        dir.display()
    ));
    let client = Client::new(&cluster.url)?;
    let seen = Shared::default();
    let watcher = tokio::spawn(watch(
        timeline.clone(),
        client.clone(),
        cluster.agent_status_url.clone(),
        node.to_owned(),
        seen.clone(),
    ));
    let result = tell(cluster, &client, &timeline, &seen).await;
    watcher.abort();
    result
}

/// The story proper, once the cluster is up.
async fn tell(
    cluster: &mut DevCluster,
    client: &Client,
    timeline: &Arc<Timeline>,
    seen: &Shared,
) -> anyhow::Result<serde_json::Value> {
    let gw_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gw_url = format!("http://{}", gw_listener.local_addr()?);
    let gateway = gateway::start(
        gw_listener,
        GatewayConfig {
            agent_status_url: cluster.agent_status_url.clone(),
            coordinator_url: cluster.url.clone(),
            service: "default".into(),
            hold_timeout: Duration::from_secs(150),
            poll: Duration::from_millis(100),
            report_every: Duration::from_millis(250),
        },
    )
    .await;

    let serving = || replica(seen) == Some(ReplicaState::Serving);
    wait(cluster, "the replica to serve", serving).await?;
    let load = LoadGen::start(&gw_url, LIGHT_RATE, RequestShape::default());
    timeline.note(format!(
        "evening: light load, {LIGHT_RATE} requests/s through the gateway"
    ));
    tokio::time::sleep(Duration::from_secs(4)).await;

    let job = client.submit(&trainer()).await?;
    timeline.note(format!(
        "job {} submitted: toy trainer, 4 GPUs, {TARGET_STEP} steps, checkpoint every {CHECKPOINT_EVERY}",
        job.id
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    load.set_rate(0.0);
    timeline.note("night: the load stops");

    wait_job(cluster, client, job.id, |s| s == JobState::Running).await?;
    let checkpoints = cluster
        .agent_work_dir
        .join("jobs")
        .join(job.id.to_string())
        .join("checkpoints");
    wait(cluster, "the job's first checkpoint", || {
        has_checkpoint(&checkpoints)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let surge_at = Instant::now();
    load.set_rate(SURGE_RATE);
    timeline.note(format!(
        "morning surge: {SURGE_RATE} requests/s; the gateway holds them while no replica is ready"
    ));
    wait(cluster, "the replica to serve again", serving).await?;
    let serving_again = surge_at.elapsed();
    timeline.note(format!(
        "serving again {:.1}s after the surge began",
        serving_again.as_secs_f64()
    ));
    tokio::time::sleep(Duration::from_secs(6)).await;

    load.set_rate(0.0);
    timeline.note("the surge is over: load falls to zero");
    let done = wait_job(cluster, client, job.id, JobState::is_finished).await?;
    wait(cluster, "the replica to serve after the job", serving).await?;
    timeline.note("the node serves again");

    let stats = load.finish(Duration::from_secs(60)).await;
    let gw = gateway.stats();
    gateway.stop();
    // The phases the coordinator has passed on by now (it hears them with each heartbeat).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let phases = seen
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .phases
        .clone();

    let resumed_from: u64 = done
        .outputs
        .get("resumed_from_step")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let final_step: u64 = done
        .outputs
        .get("final_step")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let ok = done.state == JobState::Succeeded
        && done.attempt >= 2
        && resumed_from > 0
        && stats.errors == 0;
    Ok(json!({
        "ok": ok,
        "timeline": timeline.to_json(),
        "phases": phase_summary(&phases, serving_again),
        "phase_log": phases.iter().map(|p| json!({
            "sequence": p.sequence, "phase": p.phase, "duration_s": secs(p.duration_ms),
        })).collect::<Vec<_>>(),
        "job": {
            "id": done.id,
            "state": done.state,
            "attempts": done.attempt,
            "preemptions": done.preemptions,
            "resumed_from_step": resumed_from,
            "final_step": final_step,
        },
        "load": {
            "requests": stats.sent,
            "ok": stats.ok,
            "errors": stats.errors,
            "latency_ms_p50": stats.latency_ms_p50,
            "latency_ms_p99": stats.latency_ms_p99,
            "latency_ms_max": stats.latency_ms_max,
        },
        "gateway": {"forwarded": gw.forwarded, "held": gw.held_total, "max_held": gw.max_held, "retried": gw.retried},
    }))
}

fn secs(ms: u64) -> f64 {
    (ms as f64 / 10.0).round() / 100.0
}

/// `drain_s`: the first drain, from not-ready to the job started. `reclaim_s`: the first
/// reclaim's job stop and GPU check (GPUs back from the job). `serving_ready_s`: from the
/// surge to the replica ready again, as the gateway saw it.
fn phase_summary(phases: &[PhaseRecord], serving_again: Duration) -> serde_json::Value {
    let first_run = |kind: SequenceKind, names: &[&str]| -> u64 {
        let mut total = 0;
        let mut seen = Vec::new();
        for p in phases.iter().filter(|p| p.sequence == kind) {
            if seen.contains(&p.phase.as_str()) {
                break;
            }
            seen.push(p.phase.as_str());
            if names.contains(&p.phase.as_str()) {
                total += p.duration_ms;
            }
        }
        total
    };
    let drain = first_run(
        SequenceKind::Drain,
        &[
            "mark_not_ready",
            "wait_in_flight",
            "stop_replica",
            "confirm_free",
            "start_jobs",
        ],
    );
    let reclaim = first_run(SequenceKind::Reclaim, &["stop_jobs", "confirm_free"]);
    json!({
        "drain_s": secs(drain),
        "reclaim_s": secs(reclaim),
        "serving_ready_s": (serving_again.as_secs_f64() * 100.0).round() / 100.0,
    })
}

fn print_summary(r: &serde_json::Value) {
    println!();
    println!(
        "phases:   drain {}s, reclaim {}s, serving ready {}s after the surge",
        r["phases"]["drain_s"], r["phases"]["reclaim_s"], r["phases"]["serving_ready_s"]
    );
    println!(
        "job:      {} after {} attempts, resumed from step {}",
        r["job"]["state"].as_str().unwrap_or("?"),
        r["job"]["attempts"],
        r["job"]["resumed_from_step"]
    );
    let ms = |v: &serde_json::Value| v.as_f64().map_or("?".to_owned(), |v| format!("{v:.0}"));
    println!(
        "load:     {} requests, {} errors, latency p50 {} ms, p99 {} ms (held through the reclaim)",
        r["load"]["requests"],
        r["load"]["errors"],
        ms(&r["load"]["latency_ms_p50"]),
        ms(&r["load"]["latency_ms_p99"])
    );
    let ok = r["ok"].as_bool().unwrap_or(false);
    println!("result:   {}", if ok { "ok" } else { "FAILED" });
}

fn trainer() -> JobSpec {
    let env = |k: &str, v: u64| EnvVar {
        name: k.into(),
        value: v.to_string(),
    };
    JobSpec {
        name: "toy-trainer".into(),
        image: standin_image(TOY_TRAINER),
        command: vec![],
        args: vec![],
        env: vec![
            env("TRAINER_TARGET_STEP", TARGET_STEP),
            env("TRAINER_STEPS_PER_SEC", STEPS_PER_SEC),
            env("TRAINER_CHECKPOINT_EVERY", CHECKPOINT_EVERY),
        ],
        gpus: 4,
        nodes: 1,
        priority: 0,
        owner: Some("demo".into()),
        checkpoint: CheckpointPolicy {
            signal: "SIGTERM".into(),
            grace_period_seconds: 20,
        },
        retry: Default::default(),
        capture: Default::default(),
        files: Vec::new(),
        sandbox: Default::default(),
        max_run_seconds: None,
    }
}

/// Whether any attempt's checkpoint directory (`checkpoints/EPOCH`, one per lease) holds a
/// checkpoint file.
fn has_checkpoint(attempts: &Path) -> bool {
    let holds_one = |dir: &Path| {
        std::fs::read_dir(dir).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".ckpt"))
        })
    };
    std::fs::read_dir(attempts).is_ok_and(|d| d.flatten().any(|e| holds_one(&e.path())))
}

/// Polls `done` until it holds, failing when a program of the cluster exits or after
/// [`STEP_TIMEOUT`].
async fn wait(
    cluster: &mut DevCluster,
    what: &str,
    mut done: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let started = Instant::now();
    while !done() {
        cluster.check_running()?;
        if started.elapsed() > STEP_TIMEOUT {
            bail!("timed out after {STEP_TIMEOUT:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn wait_job(
    cluster: &mut DevCluster,
    client: &Client,
    id: u64,
    done: impl Fn(JobState) -> bool,
) -> anyhow::Result<nightshift_common::JobView> {
    let started = Instant::now();
    loop {
        let job = client.job(id).await?;
        if done(job.state) {
            return Ok(job);
        }
        cluster.check_running()?;
        if started.elapsed() > STEP_TIMEOUT {
            bail!(
                "timed out after {STEP_TIMEOUT:?}: job {id} is {}",
                job.state.as_str()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The replica's state as the agent's `/status` says.
async fn read_replica(http: &reqwest::Client, status_url: &str) -> Option<ReplicaState> {
    let status: serde_json::Value = http.get(status_url).send().await.ok()?.json().await.ok()?;
    serde_json::from_value(status.get("replica")?.clone()).ok()
}

/// Every 100 ms: reads the replica's state from the agent and the node's phases and the jobs
/// from the coordinator, keeps them in `seen` and notes each change on the timeline.
async fn watch(
    timeline: Arc<Timeline>,
    client: Client,
    status_url: String,
    node: String,
    seen: Shared,
) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_default();
    let mut jobs = std::collections::BTreeMap::new();
    loop {
        if let Some(r) = read_replica(&http, &status_url).await {
            let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
            if seen.replica != Some(r) {
                timeline.note(format!("replica {}", r.as_str()));
                seen.replica = Some(r);
            }
        }
        if let Ok(list) = client.nodes().await {
            let recent = list
                .nodes
                .into_iter()
                .find(|n| n.name == node)
                .map(|n| n.recent_phases)
                .unwrap_or_default();
            let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
            let last_seq = seen.phases.last().map_or(0, |p| p.seq);
            for p in recent.into_iter().filter(|p| p.seq > last_seq) {
                let seq = match p.sequence {
                    SequenceKind::Drain => "drain",
                    SequenceKind::Reclaim => "reclaim",
                };
                timeline.note(format!(
                    "  {seq}: {} {:.2}s",
                    p.phase,
                    p.duration_ms as f64 / 1000.0
                ));
                seen.phases.push(p);
            }
        }
        if let Ok(list) = client.jobs().await {
            for j in list.jobs {
                if jobs.insert(j.id, (j.state, j.attempt)) != Some((j.state, j.attempt)) {
                    let detail = j
                        .message
                        .as_deref()
                        .map(|m| format!(" ({m})"))
                        .unwrap_or_default();
                    timeline.note(format!(
                        "job {} {} (attempt {}){detail}",
                        j.id,
                        j.state.as_str(),
                        j.attempt
                    ));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Builds the stand-in images the demo runs with `tests/images/build.sh` when they are
/// missing, those alone: the script's other images (Argo's examples) need Debian's
/// busybox-static, and the README's first command must run without anything from apt.
async fn ensure_images() -> anyhow::Result<()> {
    let mut missing = Vec::new();
    for name in [VLLM_STANDIN, TOY_TRAINER] {
        let image = standin_image(name);
        let inspect = tokio::process::Command::new("docker")
            .args(["image", "inspect", &image])
            .output()
            .await
            .context("running docker (is the Docker CLI installed?)")?;
        if !inspect.status.success() {
            let stderr = String::from_utf8_lossy(&inspect.stderr);
            if stderr.contains("Cannot connect") || stderr.contains("permission denied") {
                bail!(
                    "docker cannot reach its engine (is dockerd running?): {}",
                    stderr.trim()
                );
            }
            missing.push((name, image));
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let images: Vec<&str> = missing.iter().map(|(_, image)| image.as_str()).collect();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../images/build.sh");
    if !script.exists() {
        bail!(
            "images {} are missing and {} is not here to build them; run the demo from a \
             nightshift source checkout",
            images.join(", "),
            script.display()
        );
    }
    eprintln!(
        "building the stand-in images {} (first run only) with {}",
        images.join(", "),
        script.display()
    );
    // Its output goes to stderr: stdout is the demo's own (one JSON object under `--output json`).
    let status = tokio::process::Command::new("bash")
        .arg(&script)
        .args(missing.iter().map(|(name, _)| name))
        .stdout(std::io::stderr())
        .status()
        .await?;
    if !status.success() {
        bail!("{} failed ({status})", script.display());
    }
    Ok(())
}

/// Removes every container the demo's agent started (the agent, stopped, leaves them for
/// its next start to adopt).
async fn remove_containers(node: &str) {
    let filter = format!("label={}={node}", labels::MANAGED_BY);
    let Ok(out) = tokio::process::Command::new("docker")
        .args(["ps", "-aq", "--filter", &filter])
        .output()
        .await
    else {
        return;
    };
    let ids = String::from_utf8_lossy(&out.stdout);
    let ids: Vec<&str> = ids.split_whitespace().collect();
    if ids.is_empty() {
        return;
    }
    match tokio::process::Command::new("docker")
        .args(["rm", "-f"])
        .args(&ids)
        .output()
        .await
    {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "warning: could not remove containers {}: {}",
            ids.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => eprintln!(
            "warning: could not remove containers {}: {e}",
            ids.join(" ")
        ),
    }
}
