//! `nightshift-bench failover`: two coordinators on one PostgreSQL database (a throwaway
//! server of tests/postgres.sh), the leader killed with SIGKILL `kills` times: the time from
//! the kill until the standby answers `/healthz` as the leader, and a check each time that
//! it lists every job. The killed one is started again (as the standby) before the next
//! kill. As a reference in the same run, the time a single coordinator on the same database
//! takes to answer again after a SIGKILL and a restart by its supervisor (here: at once).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nightshift_tests::postgres::OwnServer;
use nightshift_tests::{CoordinatorProcess, coordinator_config, coordinator_toml, free_port};
use serde::Serialize;

use crate::reclaim::{Percentiles, percentiles};

#[derive(Debug, Serialize)]
pub struct FailoverReport {
    pub kills: usize,
    pub jobs: usize,
    /// SIGKILL of the leader until the standby leads.
    pub failover: Percentiles,
    /// SIGKILL of a lone coordinator until it answers again, restarted at once.
    pub restart: Percentiles,
}

async fn leads(url: &str) -> bool {
    match nightshift_cli::client::Client::new(url) {
        Ok(c) => c.healthz().await.is_ok(),
        Err(_) => false,
    }
}

/// Waits until the coordinator at `url` leads, for at most `within`: how long it took.
async fn until_leads(url: &str, within: Duration) -> anyhow::Result<Duration> {
    let started = Instant::now();
    while started.elapsed() < within {
        if leads(url).await {
            return Ok(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("{url} did not lead within {within:?}")
}

pub async fn failover(kills: usize, jobs: usize) -> anyhow::Result<FailoverReport> {
    let pg = OwnServer::start("bench-failover");
    let db = pg.database("failover");
    let dir = tempfile::tempdir()?;
    let mut side = Vec::new();
    for name in ["a", "b"] {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d)?;
        let cfg = coordinator_config(&d.join("state"));
        let config = d.join("coordinator.toml");
        std::fs::write(
            &config,
            coordinator_toml(&cfg) + &format!("[store]\nurl = \"{db}\"\n"),
        )?;
        side.push((free_port(), d.join("state"), config));
    }
    // The coordinator built beside this binary.
    let bin = std::env::current_exe()?
        .parent()
        .context("the bench's directory")?
        .join("nightshift-coordinator");
    if !bin.exists() {
        bail!(
            "{} not found: build it with cargo build -p nightshift-coordinator",
            bin.display()
        );
    }
    let spawn = |i: usize| CoordinatorProcess::spawn_bin(&bin, side[i].0, &side[i].1, &side[i].2);
    let mut procs = vec![Some(spawn(0)), None];
    let urls: Vec<String> = side
        .iter()
        .map(|s| format!("http://127.0.0.1:{}", s.0))
        .collect();
    until_leads(&urls[0], Duration::from_secs(60)).await?;
    procs[1] = Some(spawn(1));
    let client = nightshift_cli::client::Client::new(&urls.join(","))?;
    for i in 0..jobs {
        let spec = nightshift_common::JobSpec::new(format!("bench-{i}"), "trainer:1", 1);
        client.submit(&spec).await.context("submit")?;
    }
    let mut leader = 0;
    let mut took = Vec::new();
    for _ in 0..kills {
        // The standby is up and standing by before the kill.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let other = 1 - leader;
        let killed = Instant::now();
        procs[leader].take().expect("the leader runs").kill();
        until_leads(&urls[other], Duration::from_secs(30)).await?;
        took.push(killed.elapsed().as_millis() as u64);
        let listed = client.jobs().await?.jobs.len();
        if listed != jobs {
            bail!("the new leader lists {listed} jobs, not {jobs}");
        }
        procs[leader] = Some(spawn(leader));
        leader = other;
    }
    drop(procs);
    // The reference: one coordinator alone, restarted at once after each SIGKILL.
    let mut restart = Vec::new();
    let mut lone = Some(spawn(0));
    until_leads(&urls[0], Duration::from_secs(60)).await?;
    for _ in 0..kills {
        let killed = Instant::now();
        lone.take().expect("runs").kill();
        lone = Some(spawn(0));
        until_leads(&urls[0], Duration::from_secs(30)).await?;
        restart.push(killed.elapsed().as_millis() as u64);
    }
    drop(lone);
    Ok(FailoverReport {
        kills,
        jobs,
        failover: percentiles(took),
        restart: percentiles(restart),
    })
}
