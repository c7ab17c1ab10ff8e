//! `agent-footprint`: the real `nightshift-agent` binary (built next to this one) on 4 fake
//! GPUs, serving the vLLM stand-in under a coordinator in this process with the production
//! heartbeat of one second. Once the replica serves, the agent's CPU and RSS are sampled from
//! /proc once a second for `--seconds`.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use nightshift_common::ReplicaState;
use nightshift_tests::{
    Cleanup, TestCoordinator, VLLM_IMAGE, coordinator_config, free_port, require_images,
    unique_node,
};
use serde::Serialize;

use crate::ProcStat;

#[derive(Debug, Serialize)]
pub struct FootprintReport {
    pub seconds: u64,
    pub cpu_percent_mean: f64,
    pub cpu_percent_max: f64,
    pub rss_mib_mean: f64,
    pub rss_mib_max: f64,
}

pub async fn footprint(seconds: u64) -> anyhow::Result<FootprintReport> {
    require_images();
    let exe = std::env::current_exe()?;
    let bin = exe.parent().context("no folder")?.join("nightshift-agent");
    if !bin.exists() {
        bail!(
            "{} not found: cargo build -p nightshift-agent",
            bin.display()
        );
    }
    let node = unique_node("bench-footprint");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir()?;
    let mut cfg = coordinator_config(&dir.path().join("state"));
    cfg.heartbeat_interval_ms = 1_000;
    let coordinator = TestCoordinator::start(&cfg).await;
    let client = coordinator.client();
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "coordinator = \"{}\"\nnode = \"{node}\"\nwork_dir = \"{}\"\n\
             readiness_listen = \"127.0.0.1:{}\"\napi_listen = \"127.0.0.1:{}\"\n\
             [gpus]\nfake = 4\n[replica]\n\
             image = \"{VLLM_IMAGE}\"\nhost_ip = \"127.0.0.1\"\nhost_port = 0\n\
             env = [\"STANDIN_TOKEN_LATENCY_MS=10\"]\n",
            coordinator.url,
            dir.path().join("work").display(),
            free_port(),
            free_port()
        ),
    )?;
    let mut child = Command::new(&bin)
        .args(["run", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id();
    let result = async {
        let end = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let serving = client.nodes().await.ok().is_some_and(|l| {
                l.nodes.iter().any(|n| {
                    n.name == node
                        && n.replica
                            .as_ref()
                            .is_some_and(|r| r.state == ReplicaState::Serving)
                })
            });
            if serving {
                break;
            }
            if std::time::Instant::now() > end {
                bail!("the agent's replica did not serve within 120 s");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut cpu = Vec::new();
        let mut rss = Vec::new();
        let mut last = ProcStat::read(pid)?;
        for _ in 0..seconds {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = ProcStat::read(pid)?;
            cpu.push((now.cpu_s - last.cpu_s) / (now.at - last.at).as_secs_f64() * 100.0);
            rss.push(now.rss_mib);
            last = now;
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        Ok(FootprintReport {
            seconds,
            cpu_percent_mean: mean(&cpu),
            cpu_percent_max: max(&cpu),
            rss_mib_mean: mean(&rss),
            rss_mib_max: max(&rss),
        })
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    result
}
