//! `reclaim --repeat K`: a real coordinator and a real agent (in-process), the real Docker
//! engine, the vLLM stand-in and the toy trainer. Each round waits for the node to be lent and
//! the trainer to run, then a gateway report of held requests makes the core take the node
//! back, and the agent's own phase records (sent to the coordinator with its heartbeats) give:
//! decision → job signalled (from the gateway request being sent to the start of the agent's
//! `stop_jobs` phase), signal → GPUs free (`stop_jobs` + `confirm_free`) and free → serving
//! ready (`start_replica` + `wait_health`).

use std::time::Duration;

use anyhow::{Context, bail};
use nightshift_common::{JobState, PhaseRecord, SequenceKind};
use nightshift_tests::{
    Cleanup, TestCoordinator, agent_config, coordinator_config, require_images, start_agent,
    trainer_job, unique_node,
};
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct ReclaimReport {
    pub rounds: usize,
    pub decision_to_signal: Percentiles,
    pub signal_to_gpus_free: Percentiles,
    pub free_to_serving_ready: Percentiles,
    pub samples_ms: Vec<[u64; 3]>,
}

/// How often the benchmark looks again: its figures are this fine.
const POLL: Duration = Duration::from_millis(20);

pub fn percentiles(mut v: Vec<u64>) -> Percentiles {
    v.sort_unstable();
    let at = |p: f64| {
        if v.is_empty() {
            return 0.0;
        }
        let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
        v[i] as f64
    };
    Percentiles {
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        max_ms: v.last().map_or(0.0, |&x| x as f64),
    }
}

pub async fn reclaim(repeat: usize) -> anyhow::Result<ReclaimReport> {
    require_images();
    let node = unique_node("bench-reclaim");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir()?;
    let coordinator = TestCoordinator::start(&coordinator_config(&dir.path().join("state"))).await;
    let client = coordinator.client();
    let (agent, _) = start_agent(
        agent_config(&coordinator.url, &node, &dir.path().join("work"), 4),
        4,
    )
    .await;
    let job = client
        .submit(&trainer_job("bench-trainer", 4, 100_000_000, 20, 100))
        .await?;
    let http = reqwest::Client::new();
    let mut samples = Vec::new();
    let mut seen_seq = 0;
    for round in 0..repeat {
        crate::until(
            "the trainer to run",
            Duration::from_secs(120),
            POLL,
            || async {
                let j = client.job(job.id).await.ok()?;
                (j.state == JobState::Running).then_some(())
            },
        )
        .await
        .with_context(|| format!("round {round}"))?;
        // Let the trainer get past its start before taking the node back, and skip every
        // phase recorded so far (the first replica start is recorded as a reclaim too).
        tokio::time::sleep(Duration::from_millis(500)).await;
        let nodes = client.nodes().await?;
        if let Some(n) = nodes.nodes.iter().find(|n| n.name == node) {
            seen_seq = n
                .recent_phases
                .iter()
                .map(|p| p.seq)
                .max()
                .unwrap_or(seen_seq);
        }
        let decided = crate::now_ms();
        let r = http
            .post(format!("{}/v1/services/default/gateway", coordinator.url))
            .json(&serde_json::json!({"waiting": 1}))
            .send()
            .await?;
        if !r.status().is_success() {
            bail!("gateway report: {}", r.status());
        }
        let phases: Vec<PhaseRecord> = crate::until(
            "serving ready again",
            Duration::from_secs(120),
            POLL,
            || async {
                let nodes = client.nodes().await.ok()?;
                let n = nodes.nodes.into_iter().find(|n| n.name == node)?;
                let fresh: Vec<PhaseRecord> = n
                    .recent_phases
                    .into_iter()
                    .filter(|p| p.seq > seen_seq && p.sequence == SequenceKind::Reclaim)
                    .collect();
                fresh
                    .iter()
                    .any(|p| p.phase == "wait_health")
                    .then_some(fresh)
            },
        )
        .await
        .with_context(|| format!("round {round}"))?;
        seen_seq = phases.iter().map(|p| p.seq).max().unwrap_or(seen_seq);
        let phase = |name: &str| phases.iter().find(|p| p.phase == name);
        let stop = phase("stop_jobs").context("no stop_jobs phase recorded")?;
        let dur = |name: &str| phase(name).map_or(0, |p| p.duration_ms);
        samples.push([
            stop.started_at.saturating_sub(decided),
            dur("stop_jobs") + dur("confirm_free"),
            dur("start_replica") + dur("wait_health"),
        ]);
    }
    agent.stop();
    let col = |i: usize| samples.iter().map(|s| s[i]).collect::<Vec<u64>>();
    Ok(ReclaimReport {
        rounds: samples.len(),
        decision_to_signal: percentiles(col(0)),
        signal_to_gpus_free: percentiles(col(1)),
        free_to_serving_ready: percentiles(col(2)),
        samples_ms: samples,
    })
}
