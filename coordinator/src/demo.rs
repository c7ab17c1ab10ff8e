//! `nightshift demo`: the whole harvest loop on this machine, with Docker and no GPU.
//!
//! It starts a coordinator (SQLite in a temporary folder), one agent with 4 fake GPUs, the
//! vLLM stand-in as the serving replica behind a small gateway, and a load generator. Then it
//! tells the story: light load → night (the replica drains, a toy trainer runs on its GPUs
//! and checkpoints) → a surge (the node is reclaimed: the job is checkpointed and stopped,
//! vLLM restarts, the held requests are served) → the load falls → the job resumes from its
//! checkpoint and finishes. Every request must succeed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nightshift_agent::agent::AgentHandle;
use nightshift_agent::config::AgentConfig;
use nightshift_agent::engine::Engine;
use nightshift_agent::engine::docker::DockerEngine;
use nightshift_agent::gpus::fake::FakeGpus;
use nightshift_agent::serving::http::HttpServing;
use nightshift_common::{
    CheckpointPolicy, EnvVar, JobSpec, JobState, PhaseRecord, ReplicaState, SequenceKind, labels,
};
use serde_json::json;

use crate::client::Client;
use crate::config::{CoordinatorConfig, ScaleDownConfig, ScaleUpConfig, ServiceConfig};
use crate::gateway::{self, GatewayConfig};
use crate::loadgen::{LoadGen, RequestShape};

const VLLM_IMAGE: &str = "nightshift/vllm-standin:dev";
const TRAINER_IMAGE: &str = "nightshift/toy-trainer:dev";
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

/// Runs the demo; returns the process exit code (0 when every promise held).
pub async fn run(json: bool) -> anyhow::Result<i32> {
    ensure_images().await?;
    let node = format!("demo-{}", std::process::id());
    let dir = tempfile::tempdir().context("creating a temporary folder")?;
    let result = story(&node, dir.path(), !json).await;
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

async fn story(node: &str, dir: &Path, live: bool) -> anyhow::Result<serde_json::Value> {
    let timeline = Arc::new(Timeline {
        start: Instant::now(),
        live,
        events: Mutex::new(Vec::new()),
    });
    let coordinator = start_coordinator(&dir.join("coordinator")).await?;
    timeline.note(format!(
        "coordinator up at {} (state in {})",
        coordinator.url,
        dir.display()
    ));
    let client = Client::new(&coordinator.url)?;
    let agent = start_agent(&coordinator.url, node, &dir.join("agent")).await?;
    timeline.note(format!(
        "agent {node} up with 4 fake GPUs; starting the vLLM stand-in"
    ));
    let watcher = tokio::spawn(watch(
        timeline.clone(),
        client.clone(),
        agent.handle.shared.clone(),
    ));

    let gw_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gw_url = format!("http://{}", gw_listener.local_addr()?);
    let gateway = gateway::start(
        gw_listener,
        GatewayConfig {
            agent_status_url: agent.status_url.clone(),
            coordinator_url: coordinator.url.clone(),
            service: "default".into(),
            hold_timeout: Duration::from_secs(150),
            poll: Duration::from_millis(100),
            report_every: Duration::from_millis(250),
        },
    )
    .await;

    let shared = agent.handle.shared.clone();
    wait("the replica to serve", || {
        shared.observed().replica == ReplicaState::Serving
    })
    .await?;
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

    wait_job(&client, job.id, |s| s == JobState::Running).await?;
    let checkpoints = dir
        .join("agent")
        .join("jobs")
        .join(job.id.to_string())
        .join("checkpoints");
    wait("the job's first checkpoint", || {
        has_checkpoint(&checkpoints)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let surge_at = Instant::now();
    load.set_rate(SURGE_RATE);
    timeline.note(format!(
        "morning surge: {SURGE_RATE} requests/s; the gateway holds them while no replica is ready"
    ));
    wait("the replica to serve again", || {
        shared.observed().replica == ReplicaState::Serving
    })
    .await?;
    let serving_again = surge_at.elapsed();
    timeline.note(format!(
        "serving again {:.1}s after the surge began",
        serving_again.as_secs_f64()
    ));
    tokio::time::sleep(Duration::from_secs(6)).await;

    load.set_rate(0.0);
    timeline.note("the surge is over: load falls to zero");
    let done = wait_job(&client, job.id, JobState::is_finished).await?;
    wait("the replica to serve after the job", || {
        shared.observed().replica == ReplicaState::Serving
    })
    .await?;
    timeline.note("the node serves again");

    let stats = load.finish(Duration::from_secs(60)).await;
    let gw = gateway.stats();
    gateway.stop();
    watcher.abort();
    let phases = shared.phases();
    agent.handle.stop();

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
        image: TRAINER_IMAGE.into(),
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

async fn wait(what: &str, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let started = Instant::now();
    while !done() {
        if started.elapsed() > STEP_TIMEOUT {
            bail!("timed out after {STEP_TIMEOUT:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn wait_job(
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
        if started.elapsed() > STEP_TIMEOUT {
            bail!(
                "timed out after {STEP_TIMEOUT:?}: job {id} is {}",
                job.state.as_str()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Notes every change of the replica, the job states and each finished phase.
async fn watch(
    timeline: Arc<Timeline>,
    client: Client,
    shared: Arc<nightshift_agent::state::Shared>,
) {
    let mut replica = None;
    let mut jobs = std::collections::BTreeMap::new();
    let mut last_seq = 0;
    loop {
        let r = shared.observed().replica;
        if replica != Some(r) {
            timeline.note(format!("replica {}", r.as_str()));
            replica = Some(r);
        }
        let fresh: Vec<PhaseRecord> = shared
            .phases()
            .into_iter()
            .filter(|p| p.seq > last_seq)
            .collect();
        for p in fresh {
            last_seq = p.seq;
            let seq = match p.sequence {
                SequenceKind::Drain => "drain",
                SequenceKind::Reclaim => "reclaim",
            };
            timeline.note(format!(
                "  {seq}: {} {:.2}s",
                p.phase,
                p.duration_ms as f64 / 1000.0
            ));
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

struct DemoCoordinator {
    url: String,
}

async fn start_coordinator(data_dir: &Path) -> anyhow::Result<DemoCoordinator> {
    let cfg = CoordinatorConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: data_dir.to_owned(),
        heartbeat_interval_ms: 250,
        tls: None,
        policy: Default::default(),
        lease_ttl_ms: 15_000,
        services: vec![ServiceConfig {
            name: "default".into(),
            // One node: lending it leaves none serving, so the gateway holds requests meanwhile.
            min_replicas: 0,
            cooldown_s: 2.0,
            gateway_signal_ttl_s: 1.0,
            scale_down: ScaleDownConfig {
                max_waiting: 0.0,
                max_running_per_replica: 4.0,
                window_s: 2.0,
                ..ScaleDownConfig::default()
            },
            scale_up: ScaleUpConfig {
                waiting_per_replica: 2.0,
                running_per_replica: 8.0,
                ..ScaleUpConfig::default()
            },
            ..ServiceConfig::default()
        }],
        ..CoordinatorConfig::default()
    };
    cfg.validate()?;
    let cluster = crate::server::open(&cfg)?;
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        if let Err(e) = crate::server::serve(listener, cluster, std::future::pending()).await {
            tracing::error!(error = %e, "demo coordinator stopped");
        }
    });
    Ok(DemoCoordinator { url })
}

struct DemoAgent {
    handle: AgentHandle,
    status_url: String,
}

async fn start_agent(coordinator: &str, node: &str, work_dir: &Path) -> anyhow::Result<DemoAgent> {
    let mut cfg = AgentConfig {
        coordinator: coordinator.to_owned(),
        node: node.to_owned(),
        work_dir: work_dir.to_owned(),
        readiness_grace_s: 0.5,
        drain_timeout_s: 60.0,
        free_timeout_s: 10.0,
        health_timeout_s: 120.0,
        api_listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        ..AgentConfig::default()
    };
    cfg.gpus.fake = Some(4);
    cfg.replica.image = VLLM_IMAGE.into();
    cfg.replica.host_ip = "127.0.0.1".into();
    cfg.replica.host_port = 0;
    cfg.replica.shutdown_timeout_s = 30.0;
    cfg.replica.env = vec![
        // A model load of 3 s, so that the cold start shows on the timeline.
        "STANDIN_LOAD_DELAY_MS=3000".into(),
        "STANDIN_TOKEN_LATENCY_MS=10".into(),
        "STANDIN_MAX_NUM_SEQS=16".into(),
        "STANDIN_SHUTDOWN_TIMEOUT_S=30".into(),
    ];
    cfg.validate()?;
    let engine = DockerEngine::connect().await?;
    let serving = HttpServing::new()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let handle = nightshift_agent::agent::start(
        cfg,
        engine,
        FakeGpus::new(node, 4),
        serving,
        Some(listener),
    )?;
    let status_url = format!("{}/status", handle.api_url.as_deref().unwrap_or_default());
    Ok(DemoAgent { handle, status_url })
}

/// Builds the stand-in images with `tests/images/build.sh` when they are missing.
async fn ensure_images() -> anyhow::Result<()> {
    let docker = bollard::Docker::connect_with_local_defaults()
        .context("connecting to the Docker engine (is dockerd running?)")?;
    let mut missing = Vec::new();
    for image in [VLLM_IMAGE, TRAINER_IMAGE] {
        if docker.inspect_image(image).await.is_err() {
            missing.push(image);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/images/build.sh");
    if !script.exists() {
        bail!(
            "images {} are missing and {} is not here to build them; run the demo from a \
             nightshift source checkout",
            missing.join(", "),
            script.display()
        );
    }
    eprintln!(
        "building the stand-in images (first run only) with {}",
        script.display()
    );
    let status = tokio::process::Command::new("bash")
        .arg(&script)
        .status()
        .await?;
    if !status.success() {
        bail!("{} failed ({status})", script.display());
    }
    Ok(())
}

/// Removes every container the demo's agent started.
async fn remove_containers(node: &str) {
    let Ok(engine) = DockerEngine::connect().await else {
        return;
    };
    let filter =
        std::collections::BTreeMap::from([(labels::MANAGED_BY.to_owned(), node.to_owned())]);
    for c in engine.list(&filter).await.unwrap_or_default() {
        if let Err(e) = engine.remove(&c.id).await {
            eprintln!("warning: could not remove container {}: {e}", c.name);
        }
    }
}
