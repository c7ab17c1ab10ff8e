//! `nightshift-bench`: benchmarks that need real processes.
//!
//! `reclaim --repeat K`: see `reclaim.rs`; `agent-footprint`: see `footprint.rs`.
//!
//! `coordinator --agents N --duration S`: starts the real `nightshift-coordinator` binary (the
//! one built next to this one) on loopback with a fresh store, queues 10,000 one-GPU jobs, then
//! N simulated agents heartbeat once a second over real HTTP for S seconds. Agents report their
//! replicas idle, so the coordinator lends their nodes and places jobs on them; an agent
//! reports each job it is given as running, then as finished at its next heartbeat, so
//! placements keep flowing. Reports heartbeats per second, their p50/p99 latency, errors,
//! placements per second, and the coordinator's CPU (from /proc) and peak RSS (VmHWM), with
//! the load generator's own CPU and the machine's load average, since both share the cores.

use std::collections::BTreeMap;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use nightshift_common::{
    DesiredNode, GpuInfo, GpuStatus, Heartbeat, JobRun, JobRunState, JobSpec, RegisterRequest,
    ReplicaState, ReplicaStatus, ServingSignals,
};
use serde::Serialize;
use tokio::sync::Mutex;

mod failover;
mod faults;
mod footprint;
mod reclaim;

/// A process's CPU seconds and resident memory, read from /proc.
pub struct ProcStat {
    pub at: Instant,
    pub cpu_s: f64,
    pub rss_mib: f64,
}

impl ProcStat {
    pub fn read(pid: u32) -> anyhow::Result<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        let after = stat
            .rsplit_once(')')
            .map(|(_, s)| s)
            .context("stat format")?;
        let f: Vec<&str> = after.split_whitespace().collect();
        let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .context("VmRSS")?;
        Ok(Self {
            at: Instant::now(),
            cpu_s: ticks / clock_ticks(),
            rss_mib: kb / 1024.0,
        })
    }
}

/// Milliseconds since the Unix epoch, as the API's timestamps count.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Polls `check` every `every` until it gives a value; fails naming `what` once `timeout`
/// has passed.
pub async fn until<T, F, Fut>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() > end {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(every).await;
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "nightshift-bench",
    about = "nightshift benchmarks against real processes"
)]
struct Args {
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    command: Bench,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Simulated agents heartbeating over HTTP to a real coordinator with a deep queue.
    Coordinator(CoordinatorRun),
    /// The agent's CPU and RSS, sampled once a second while it serves.
    AgentFootprint {
        #[arg(long, default_value_t = 60)]
        seconds: u64,
    },
    /// Reclaim latency against real Docker with the stand-in vLLM and the toy trainer.
    Reclaim {
        #[arg(long, default_value_t = 5)]
        repeat: usize,
    },
    /// Faults injected into a busy cluster rig (needs root): see `faults/mod.rs`.
    Faults(faults::FaultsRun),
    /// Two coordinators on one PostgreSQL database: the leader killed `kills` times, the
    /// time until the standby leads (see `failover.rs`).
    Failover {
        #[arg(long, default_value_t = 10)]
        kills: usize,
        /// Jobs in the state, which each new leader loads.
        #[arg(long, default_value_t = 1000)]
        jobs: usize,
    },
}

/// What `nightshift-bench coordinator` runs.
#[derive(Debug, clap::Args)]
struct CoordinatorRun {
    #[arg(long, default_value_t = 100)]
    agents: u32,
    /// Seconds of heartbeating.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    #[arg(long, default_value_t = 10_000)]
    jobs: u32,
    /// Seconds between an agent's heartbeats.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Heartbeats a job runs before its agent reports it finished (1: at the next one).
    #[arg(long, default_value_t = 1)]
    job_beats: u32,
    /// The coordinator's data folder (a fresh temporary one by default); point it at a
    /// tmpfs to take fsync out of the measurement.
    #[arg(long)]
    data_dir: Option<std::path::PathBuf>,
    /// The coordinator's `[store] url` (e.g. `postgres://...`); its SQLite file in the data
    /// folder when unset.
    #[arg(long)]
    store_url: Option<String>,
    /// Also sample the coordinator's queue length through `/metrics` this often (ms; 0:
    /// not at all), to time how fast the coordinator itself places the queue. Each scrape
    /// is real work for the coordinator, so the latencies of such a run are not the
    /// plain ones.
    #[arg(long, default_value_t = 0)]
    queue_sample_ms: u64,
}

#[derive(Debug, Serialize)]
struct CoordinatorReport {
    agents: u32,
    duration_s: f64,
    jobs_queued: u32,
    submit_per_s: f64,
    /// Registrations per second (64 in flight), before the heartbeats start.
    register_per_s: f64,
    heartbeats: u64,
    heartbeats_per_s: f64,
    offered_heartbeats_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// The same, without each agent's first heartbeat (its connection set-up, arriving in
    /// the first interval together with the fleet's first decisions).
    steady_p50_ms: f64,
    steady_p99_ms: f64,
    /// p99 per second of the run (by when the heartbeat was sent), to show where a tail is.
    p99_ms_by_second: Vec<f64>,
    errors: u64,
    placements: u64,
    placements_per_s: f64,
    /// From the start of the heartbeats until the agents had seen 99 % of all placements:
    /// how long placing the queue took, as the agents saw it (to their heartbeat interval).
    placement_99_s: f64,
    /// The coordinator's side of the same (with `--queue-sample-ms`): its
    /// `nightshift_queue_length`, sampled that often, from the last sample with nothing placed
    /// to the first with 99 % of the queue placed (seconds), and the jobs placed in between
    /// per second.
    queue_drain_s: Option<f64>,
    queue_drain_per_s: Option<f64>,
    coordinator_cpu_cores: f64,
    coordinator_peak_rss_mib: f64,
    /// The coordinator's timed decisions (after heartbeats and by its ticker), from its
    /// `nightshift_decision_duration_seconds` histogram: how many, their mean, and the
    /// bucket bound that 99 % of them stayed within.
    decisions: u64,
    decision_mean_ms: f64,
    decision_p99_le_ms: f64,
    /// This process's own CPU (the simulated agents), on the same cores.
    load_generator_cpu_cores: f64,
    /// The machine's load average at the end of the run.
    load_average_1m: f64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Bench::Faults(run) => {
            let r = faults::faults(run).await?;
            if args.output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", r.table());
            }
            if !r.ok() {
                bail!(
                    "{} of {} faults not survived, {} jobs lost, {} jobs or runs failed by a fault",
                    r.faults - r.survived,
                    r.faults,
                    r.jobs_lost,
                    r.lost_work.len()
                );
            }
            Ok(())
        }
        Bench::AgentFootprint { seconds } => {
            let r = footprint::footprint(seconds).await?;
            if args.output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!(
                    "agent over {} s: cpu mean {:.2} % max {:.2} %  rss mean {:.1} MiB max {:.1} MiB",
                    r.seconds, r.cpu_percent_mean, r.cpu_percent_max, r.rss_mib_mean, r.rss_mib_max
                );
            }
            Ok(())
        }
        Bench::Reclaim { repeat } => {
            let r = reclaim::reclaim(repeat).await?;
            if args.output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                let line = |name: &str, p: &reclaim::Percentiles| {
                    format!(
                        "{name:<24} p50 {:>8.0} ms  p99 {:>8.0} ms  max {:>8.0} ms\n",
                        p.p50_ms, p.p99_ms, p.max_ms
                    )
                };
                print!(
                    "{} rounds\n{}{}{}",
                    r.rounds,
                    line("decision -> signalled", &r.decision_to_signal),
                    line("signal -> gpus free", &r.signal_to_gpus_free),
                    line("free -> serving ready", &r.free_to_serving_ready)
                );
            }
            Ok(())
        }
        Bench::Failover { kills, jobs } => {
            let r = failover::failover(kills, jobs).await?;
            if args.output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                let line = |name: &str, p: &reclaim::Percentiles| {
                    format!(
                        "{name:<44} p50 {:>6.0} ms  p99 {:>6.0} ms  max {:>6.0} ms\n",
                        p.p50_ms, p.p99_ms, p.max_ms
                    )
                };
                print!(
                    "{} kills, {} jobs in the state\n{}{}",
                    r.kills,
                    r.jobs,
                    line("SIGKILL of the leader -> standby leads", &r.failover),
                    line("reference: SIGKILL, restart -> answers", &r.restart)
                );
            }
            Ok(())
        }
        Bench::Coordinator(run) => {
            let report = coordinator(run).await?;
            if args.output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!(
                    "agents {}  duration {:.1}s  queue {} jobs (submitted at {:.0}/s)  registered at {:.0}/s\n\
                     heartbeats {:.0}/s of {:.0}/s offered  p50 {:.2} ms  p99 {:.2} ms  max {:.1} ms  errors {}\n\
                     without each agent's first heartbeat: p50 {:.2} ms  p99 {:.2} ms\n\
                     placements {} ({:.1}/s; 99 % seen {:.1} s after the start; the coordinator's queue 99 % placed in {} s, {}/s)\ncoordinator cpu {:.2} cores  peak rss {:.1} MiB\n\
                     load generator cpu {:.2} cores  load average {:.1}",
                    report.agents,
                    report.duration_s,
                    report.jobs_queued,
                    report.submit_per_s,
                    report.register_per_s,
                    report.heartbeats_per_s,
                    report.offered_heartbeats_per_s,
                    report.p50_ms,
                    report.p99_ms,
                    report.max_ms,
                    report.errors,
                    report.steady_p50_ms,
                    report.steady_p99_ms,
                    report.placements,
                    report.placements_per_s,
                    report.placement_99_s,
                    shown(report.queue_drain_s, 2),
                    shown(report.queue_drain_per_s, 0),
                    report.coordinator_cpu_cores,
                    report.coordinator_peak_rss_mib,
                    report.load_generator_cpu_cores,
                    report.load_average_1m
                );
            }
            Ok(())
        }
    }
}

/// The coordinator child, killed when dropped.
struct Coordinator {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Coordinator {
    /// CPU seconds used so far (user + system), from /proc/PID/stat.
    fn cpu_s(&self) -> anyhow::Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        let after = stat
            .rsplit_once(')')
            .map(|(_, s)| s)
            .context("stat format")?;
        let f: Vec<&str> = after.split_whitespace().collect();
        let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
        Ok(ticks / clock_ticks())
    }

    fn peak_rss_mib(&self) -> anyhow::Result<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .context("VmHWM")?;
        Ok(kb / 1024.0)
    }
}

/// Clock ticks per second, for /proc's CPU times.
fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions and only reads.
    #[allow(unsafe_code)]
    let v = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if v > 0 { v as f64 } else { 100.0 }
}

async fn start_coordinator(
    data_dir: Option<std::path::PathBuf>,
    store_url: Option<&str>,
) -> anyhow::Result<Coordinator> {
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .context("bench binary has no folder")?
        .join("nightshift-coordinator");
    if !bin.exists() {
        bail!(
            "{} not found: build it with cargo build --release -p nightshift-coordinator",
            bin.display()
        );
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("coordinator.toml");
    let mut toml = "[[services]]\nname = \"llm\"\nmin_replicas = 1\ncooldown_s = 0.0\n\
                    [services.scale_down]\nwindow_s = 0.0\n"
        .to_owned();
    if let Some(url) = store_url {
        toml.push_str(&format!("[store]\nurl = {url:?}\n"));
    }
    std::fs::write(&config, toml)?;
    let child = Command::new(&bin)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(data_dir.unwrap_or_else(|| dir.path().join("data")))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let c = Coordinator {
        child,
        url: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    };
    let http = reqwest::Client::new();
    for _ in 0..200 {
        if http
            .get(format!("{}/healthz", c.url))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(c);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("the coordinator did not answer /healthz within 10 s")
}

/// POSTs `body(i)` to `url` for every `i` below `count`, `in_flight` at a time; fails on the
/// first answer that is not a success.
async fn post_each<T: Serialize + Send + 'static>(
    http: &reqwest::Client,
    url: &str,
    count: u32,
    in_flight: usize,
    body: fn(u32) -> T,
) -> anyhow::Result<()> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let (http, url, next) = (http.clone(), url.to_owned(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= u64::from(count) {
                    return Ok::<_, anyhow::Error>(());
                }
                let r = http.post(&url).json(&body(i as u32)).send().await?;
                if !r.status().is_success() {
                    bail!("POST {url}: {}", r.status());
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

fn register_request(i: u32) -> RegisterRequest {
    RegisterRequest {
        node: format!("bench-{i:05}"),
        gpus: (0..4)
            .map(|g| GpuInfo {
                index: g,
                uuid: format!("GPU-bench-{i}-{g}"),
                name: "bench".into(),
                memory_total_bytes: 80 << 30,
            })
            .collect(),
        service: "llm".into(),
        address: None,
        agent_url: None,
        metrics_url: None,
        readiness_url: None,
        agent_version: "bench".into(),
    }
}

fn spec(i: u32) -> JobSpec {
    JobSpec::new(format!("bench-{i}"), "registry.invalid/bench:1", 1)
}

/// One simulated agent's memory between heartbeats.
#[derive(Default)]
struct AgentState {
    serve: bool,
    version: u64,
    /// Runs to report, with how many heartbeats have reported each.
    runs: Vec<(JobRun, u32)>,
}

struct Shared {
    /// (sent, µs after the start; took, µs; the agent's first heartbeat)
    latencies_us: Mutex<Vec<(u64, u64, bool)>>,
    errors: AtomicU64,
    /// Lease id → µs after the start when an agent first saw it.
    placements: Mutex<BTreeMap<u64, u64>>,
}

async fn coordinator(run: CoordinatorRun) -> anyhow::Result<CoordinatorReport> {
    let CoordinatorRun {
        agents,
        duration,
        jobs,
        interval,
        job_beats,
        data_dir,
        store_url,
        queue_sample_ms,
    } = run;
    let c = start_coordinator(data_dir, store_url.as_deref()).await?;
    // One kept-alive HTTP/1.1 connection per agent, as a real agent holds.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(agents as usize + 64)
        .http1_only()
        .timeout(Duration::from_secs(10))
        .build()?;

    // The queue, submitted with 32 requests in flight.
    let started = Instant::now();
    post_each(&http, &format!("{}/v1/jobs", c.url), jobs, 32, spec).await?;
    let submit_per_s = f64::from(jobs) / started.elapsed().as_secs_f64();

    // Registrations, 64 in flight.
    let register = format!("{}/v1/agents/register", c.url);
    let started = Instant::now();
    post_each(&http, &register, agents, 64, register_request).await?;
    let register_per_s = f64::from(agents) / started.elapsed().as_secs_f64();

    let shared = Arc::new(Shared {
        latencies_us: Mutex::new(Vec::new()),
        errors: AtomicU64::new(0),
        placements: Mutex::new(BTreeMap::new()),
    });
    let cpu_before = c.cpu_s()?;
    let own_before = ProcStat::read(std::process::id())?;
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(duration);
    let period = Duration::from_secs_f64(interval);
    let mut tasks = Vec::new();
    for i in 0..agents {
        let (http, url, shared) = (http.clone(), c.url.clone(), shared.clone());
        let offset = period.mul_f64(f64::from(i) / f64::from(agents.max(1)));
        tasks.push(tokio::spawn(async move {
            let node = format!("bench-{i:05}");
            let mut state = AgentState {
                serve: true,
                ..AgentState::default()
            };
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut first = true;
            loop {
                tick.tick().await;
                if Instant::now() >= end {
                    return;
                }
                let beat = beat_of(&mut state, job_beats);
                let sent = Instant::now();
                let r = http
                    .post(format!("{url}/v1/agents/{node}/heartbeat"))
                    .json(&beat)
                    .send()
                    .await;
                let desired = match r {
                    Ok(r) if r.status().is_success() => r.json::<DesiredNode>().await.ok(),
                    _ => None,
                };
                let took = sent.elapsed().as_micros() as u64;
                let Some(desired) = desired else {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let at = sent.duration_since(t0).as_micros() as u64;
                shared.latencies_us.lock().await.push((at, took, first));
                first = false;
                let seen = t0.elapsed().as_micros() as u64;
                let mut placed = shared.placements.lock().await;
                for l in &desired.leases {
                    placed.entry(l.lease_id).or_insert(seen);
                }
                drop(placed);
                absorb(&mut state, &desired);
            }
        }));
    }
    let sampler = (queue_sample_ms > 0).then(|| {
        let (http, url) = (http.clone(), format!("{}/metrics", c.url));
        tokio::spawn(async move {
            let mut samples: Vec<(f64, f64)> = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(queue_sample_ms));
            while Instant::now() < end {
                tick.tick().await;
                let text = match http.get(&url).send().await {
                    Ok(r) => r.text().await.unwrap_or_default(),
                    Err(_) => continue,
                };
                if let Some(queued) = gauge(&text, "nightshift_queue_length") {
                    samples.push((t0.elapsed().as_secs_f64(), queued));
                }
            }
            samples
        })
    });
    for t in tasks {
        t.await?;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let drain = match sampler {
        Some(s) => queue_drain(&s.await?, f64::from(jobs)),
        None => None,
    };
    let (queue_drain_s, queue_drain_per_s) = (drain.map(|d| d.0), drain.map(|d| d.1));
    let cpu = c.cpu_s()? - cpu_before;
    let own_cpu = ProcStat::read(std::process::id())?.cpu_s - own_before.cpu_s;
    let load_average_1m = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN);
    let beats = std::mem::take(&mut *shared.latencies_us.lock().await);
    let sorted = |keep: &dyn Fn(&(u64, u64, bool)) -> bool| {
        let mut v: Vec<u64> = beats.iter().filter(|b| keep(b)).map(|b| b.1).collect();
        v.sort_unstable();
        v
    };
    let lat = sorted(&|_| true);
    let steady = sorted(&|b| !b.2);
    let by_second: Vec<f64> = (0..duration)
        .map(|s| {
            let range = s * 1_000_000..(s + 1) * 1_000_000;
            percentile(&sorted(&|b| range.contains(&b.0)), 0.99)
        })
        .collect();
    let seen: Vec<u64> = {
        let mut v: Vec<u64> = shared.placements.lock().await.values().copied().collect();
        v.sort_unstable();
        v
    };
    let placements = seen.len() as u64;
    let metrics = http
        .get(format!("{}/metrics", c.url))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    let decisions = Decisions::parse(&metrics);
    // `seen` is sorted microseconds, like the latencies.
    let placement_99_s = percentile(&seen, 0.99) / 1_000.0;
    Ok(CoordinatorReport {
        agents,
        duration_s: elapsed,
        jobs_queued: jobs,
        submit_per_s,
        register_per_s,
        heartbeats: lat.len() as u64,
        heartbeats_per_s: lat.len() as f64 / elapsed,
        offered_heartbeats_per_s: f64::from(agents) / interval,
        p50_ms: percentile(&lat, 0.50),
        p99_ms: percentile(&lat, 0.99),
        max_ms: lat.last().map_or(0.0, |&v| v as f64 / 1_000.0),
        steady_p50_ms: percentile(&steady, 0.50),
        steady_p99_ms: percentile(&steady, 0.99),
        p99_ms_by_second: by_second,
        placement_99_s,
        queue_drain_s,
        queue_drain_per_s,
        errors: shared.errors.load(Ordering::Relaxed),
        placements,
        placements_per_s: placements as f64 / elapsed,
        coordinator_cpu_cores: cpu / elapsed,
        coordinator_peak_rss_mib: c.peak_rss_mib()?,
        decisions: decisions.count,
        decision_mean_ms: decisions.mean_ms(),
        decision_p99_le_ms: decisions.quantile_le_ms(0.99),
        load_generator_cpu_cores: own_cpu / elapsed,
        load_average_1m,
    })
}

/// What the agent reports: its replica idle (or stopped when lent), and each leased job
/// running once, then finished.
fn beat_of(state: &mut AgentState, job_beats: u32) -> Heartbeat {
    let jobs = state
        .runs
        .iter_mut()
        .map(|(run, beats)| {
            if *beats >= job_beats {
                run.state = JobRunState::Exited {
                    exit_code: 0,
                    stopped_by_agent: false,
                };
            }
            *beats += 1;
            run.clone()
        })
        .collect();
    Heartbeat {
        gpus: (0..4).map(|g| GpuStatus::healthy(g, 0)).collect(),
        replica: ReplicaStatus {
            state: if state.serve {
                ReplicaState::Serving
            } else {
                ReplicaState::Stopped
            },
            signals: ServingSignals {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                ..ServingSignals::default()
            },
            url: None,
        },
        jobs,
        applied_version: state.version,
        phases: vec![],
        expired_leases: Vec::new(),
        host: None,
        agent_url: None,
        metrics_url: None,
    }
}

fn absorb(state: &mut AgentState, desired: &DesiredNode) {
    state.serve = desired.serve;
    state.version = desired.version;
    // Finished runs whose lease is gone are forgotten; new leases start running.
    state.runs.retain(|(r, _)| {
        desired.leases.iter().any(|l| l.lease_id == r.lease_id)
            || !matches!(r.state, JobRunState::Exited { .. })
    });
    for l in &desired.leases {
        if !state.runs.iter().any(|(r, _)| r.lease_id == l.lease_id) {
            state.runs.push((
                JobRun {
                    job_id: l.job_id,
                    attempt: l.attempt,
                    lease_id: l.lease_id,
                    epoch: l.epoch,
                    gpus: l.gpus.clone(),
                    state: JobRunState::Running,
                    last_checkpoint_at: None,
                    outputs: Default::default(),
                    // As a real agent reports it: the coordinator records it once per attempt.
                    image_id: Some(format!("sha256:{:064x}", l.job_id)),
                    image_digest: None,
                    ready: false,
                },
                0,
            ));
        }
    }
}

/// The `p` quantile of sorted microseconds, in milliseconds (0 when empty).
fn percentile(sorted_us: &[u64], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let i = ((sorted_us.len() as f64 * p).ceil() as usize).clamp(1, sorted_us.len()) - 1;
    sorted_us[i] as f64 / 1_000.0
}

/// A figure that may be missing, for the table.
fn shown(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// A gauge's value in a `/metrics` text.
fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// From `(seconds, queue length)` samples of a queue that started with `jobs`: the time from
/// the last sample with nothing placed to the first with 99 % placed, and the jobs placed in
/// between per second (`None` when the samples do not show the queue getting there).
fn queue_drain(samples: &[(f64, f64)], jobs: f64) -> Option<(f64, f64)> {
    let placed = |q: f64| jobs - q;
    let end = samples
        .iter()
        .position(|&(_, q)| placed(q) >= 0.99 * jobs)?;
    let start = samples[..end]
        .iter()
        .rposition(|&(_, q)| placed(q) <= 0.0)?;
    let span = samples[end].0 - samples[start].0;
    Some((
        span,
        (placed(samples[end].1) - placed(samples[start].1)) / span,
    ))
}

/// The coordinator's decision-duration histogram, read from its `/metrics` text.
#[derive(Debug, Default)]
struct Decisions {
    count: u64,
    sum_s: f64,
    /// `(le, cumulative count)` in the order exposed (ascending).
    buckets: Vec<(f64, u64)>,
}

impl Decisions {
    const NAME: &'static str = "nightshift_decision_duration_seconds";

    fn parse(text: &str) -> Self {
        let mut d = Self::default();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(Self::NAME) else {
                continue;
            };
            let Some((key, value)) = rest.rsplit_once(' ') else {
                continue;
            };
            match key {
                "_count" => d.count = value.parse().unwrap_or(0),
                "_sum" => d.sum_s = value.parse().unwrap_or(0.0),
                _ => {
                    let le = key
                        .strip_prefix("_bucket{le=\"")
                        .and_then(|k| k.strip_suffix("\"}"))
                        .and_then(|le| le.parse::<f64>().ok());
                    if let (Some(le), Ok(n)) = (le, value.parse()) {
                        d.buckets.push((le, n));
                    }
                }
            }
        }
        d
    }

    fn mean_ms(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_s / self.count as f64 * 1_000.0
        }
    }

    /// The smallest bucket bound that a share `q` of the decisions stayed within.
    fn quantile_le_ms(&self, q: f64) -> f64 {
        let want = (self.count as f64 * q).ceil() as u64;
        self.buckets
            .iter()
            .find(|(_, n)| *n >= want)
            .map_or(f64::INFINITY, |(le, _)| le * 1_000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::{Decisions, gauge, queue_drain};

    #[test]
    fn the_queue_drain_runs_from_the_last_empty_handed_sample_to_99_percent() {
        let text = "# TYPE nightshift_queue_length gauge\nnightshift_queue_length 250\n";
        assert_eq!(gauge(text, "nightshift_queue_length"), Some(250.0));
        assert_eq!(gauge(text, "nightshift_queue"), None);
        let samples = [
            (0.0, 1_000.0),
            (0.1, 1_000.0),
            (0.2, 600.0),
            (0.3, 100.0),
            (0.4, 5.0),
            (0.5, 0.0),
        ];
        let (span, rate) = queue_drain(&samples, 1_000.0).unwrap();
        assert!((span - 0.3).abs() < 1e-9, "{span}");
        assert!((rate - 995.0 / 0.3).abs() < 1e-6, "{rate}");
        assert_eq!(queue_drain(&samples[..3], 1_000.0), None, "not yet 99 %");
        assert_eq!(
            queue_drain(&samples[3..], 1_000.0),
            None,
            "no sample before any"
        );
    }

    #[test]
    fn the_decision_histogram_is_read_from_the_exposition() {
        let text = "\
# TYPE nightshift_decision_duration_seconds histogram
nightshift_decision_duration_seconds_sum 0.3
nightshift_decision_duration_seconds_count 100
nightshift_decision_duration_seconds_bucket{le=\"0.001\"} 90
nightshift_decision_duration_seconds_bucket{le=\"0.01\"} 99
nightshift_decision_duration_seconds_bucket{le=\"0.1\"} 100
nightshift_decision_duration_seconds_bucket{le=\"+Inf\"} 100
nightshift_queue_length 0
";
        let d = Decisions::parse(text);
        assert_eq!(d.count, 100);
        assert!((d.mean_ms() - 3.0).abs() < 1e-9);
        assert_eq!(d.quantile_le_ms(0.99), 10.0);
        assert_eq!(d.quantile_le_ms(0.5), 1.0);
    }
}
