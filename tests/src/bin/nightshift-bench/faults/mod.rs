//! `nightshift-bench faults`: faults injected into a busy multi-host cluster, and what was
//! survived.
//!
//! It brings up the cluster rig (`tests/cluster/up.sh`: hosts in network namespaces, each
//! with its own Docker engine and agent process, one coordinator, one registry), keeps it
//! busy (training jobs queued, a pipeline always running, the service's load rising and
//! falling so that nodes are lent and reclaimed: [`load`]), and injects one fault at a time:
//! first every kind once, then kinds at random until the time is up. Every half second it
//! looks at the cluster from the outside (the API, each host's engine) and checks the
//! invariants that must always hold ([`check::always`]); after each fault it waits for the
//! cluster to settle, times that, and checks what must hold once it has
//! ([`check::settled`]). It prints one table (fault, times injected, survived, longest
//! recovery, violations) or `--output json`, and fails when anything broke.
//!
//! Needs root (the rig does). Tears the rig down at the end, unless `--keep`.

mod check;
mod load;
mod rig;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nightshift_common::{JobState, NodeMode};
use nightshift_sim::rng::Rng;
use serde::Serialize;
use tokio::sync::watch;

use check::{Ledger, Snapshot};
use load::Load;
use rig::Rig;

/// The lease TTL of the rig's coordinator (`lease_ttl_ms` in up.sh); an agent's fail-safe
/// acts after this much silence.
const LEASE_TTL: Duration = Duration::from_secs(15);
/// How long the harness waits for the cluster to settle after a fault before it calls the
/// fault not survived.
const SETTLE_LIMIT: Duration = Duration::from_secs(180);
/// How often the harness looks again while it waits for something.
const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A host's link cut for longer than the lease TTL, then restored.
    Partition,
    /// A host's link cut for less than the lease TTL.
    ShortPartition,
    /// A host's agent SIGKILLed (mid-drain, mid-reclaim, mid-start or idle) and restarted.
    AgentKill,
    /// A host's dockerd stopped and started again.
    EngineRestart,
    /// The coordinator SIGKILLed and restarted on the same data.
    CoordinatorKill,
    /// The coordinator SIGTERMed and restarted on the same data.
    CoordinatorTerm,
    /// The coordinator's data directory full for longer than the lease TTL.
    DiskFull,
    /// A job that ignores its checkpoint signal, reclaimed.
    JobIgnoresSignal,
    /// A job that fails at once, with retries and backoff.
    JobCrashLoop,
    /// A job that fills the checkpoint volume below the agents' floor.
    CheckpointFull,
}

impl Kind {
    const ALL: [Kind; 10] = [
        Kind::Partition,
        Kind::ShortPartition,
        Kind::AgentKill,
        Kind::EngineRestart,
        Kind::CoordinatorKill,
        Kind::CoordinatorTerm,
        Kind::DiskFull,
        Kind::JobIgnoresSignal,
        Kind::JobCrashLoop,
        Kind::CheckpointFull,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Partition => "partition",
            Kind::ShortPartition => "short-partition",
            Kind::AgentKill => "agent-kill",
            Kind::EngineRestart => "engine-restart",
            Kind::CoordinatorKill => "coordinator-kill",
            Kind::CoordinatorTerm => "coordinator-term",
            Kind::DiskFull => "disk-full",
            Kind::JobIgnoresSignal => "job-ignores-signal",
            Kind::JobCrashLoop => "job-crash-loop",
            Kind::CheckpointFull => "checkpoint-full",
        }
    }

    /// How often a kind comes up in the random part of a run, out of the weights' sum: the
    /// coordinator kills most (the issue asks for 20 kills to 5 terms), the slow ones least.
    fn weight(self) -> u64 {
        match self {
            Kind::CoordinatorKill => 8,
            Kind::AgentKill => 6,
            Kind::CoordinatorTerm => 2,
            Kind::ShortPartition => 2,
            Kind::Partition | Kind::EngineRestart => 2,
            Kind::DiskFull | Kind::JobIgnoresSignal | Kind::JobCrashLoop | Kind::CheckpointFull => {
                1
            }
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct FaultsRun {
    /// Hosts in the rig.
    #[arg(long, default_value_t = 3)]
    hosts: usize,
    /// Keep injecting faults at random, after every kind has come once, until this many
    /// minutes have passed since the first (0: every kind once, then stop).
    #[arg(long, default_value_t = 0.0)]
    minutes: f64,
    /// Only these kinds (comma-separated); all by default.
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<Kind>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds before a killed agent or coordinator is started again (the packaged units'
    /// RestartSec).
    #[arg(long, default_value_t = 5.0)]
    restart_delay: f64,
    /// Leave the rig up at the end (tests/cluster/down.sh removes it).
    #[arg(long)]
    keep: bool,
    /// Size in MiB of the tmpfs that holds the coordinator's data (the disk-full fault fills
    /// what is left of it): room for an hour's jobs and events.
    #[arg(long, default_value_t = 256)]
    coordinator_data_mb: u32,
}

/// One injected fault and what came of it.
#[derive(Debug, Clone, Serialize)]
pub struct Injection {
    pub kind: Kind,
    /// Where and when it hit, e.g. "gpu2 mid-drain".
    pub target: String,
    /// Seconds since the run began.
    pub at_s: f64,
    /// From the fault's end (the link restored, the process restarted) until the cluster
    /// settled; `None` when it did not within the limit.
    pub recovery_s: Option<f64>,
    /// Figures particular to the kind, e.g. how long a cut-off host took to serve again.
    pub figures: BTreeMap<String, f64>,
    /// What broke: invariants violated while it lasted, expectations of the kind not met.
    pub violations: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct KindSummary {
    pub kind: Kind,
    pub injected: usize,
    pub survived: usize,
    pub longest_recovery_s: Option<f64>,
    pub violations: usize,
}

#[derive(Debug, Serialize)]
pub struct FaultsReport {
    pub hosts: usize,
    pub seed: u64,
    pub duration_s: f64,
    pub faults: usize,
    pub survived: usize,
    pub kinds: Vec<KindSummary>,
    /// Jobs submitted, and how they stand at the end.
    pub jobs_submitted: usize,
    pub jobs_by_state: BTreeMap<String, usize>,
    pub jobs_lost: usize,
    pub pipelines_run: usize,
    pub pipelines_succeeded: usize,
    /// Submissions the coordinator refused or did not answer (while it was down or full).
    pub submissions_refused: u64,
    /// Work lost to a fault: a training job or pipeline run that failed (they only fail if
    /// a fault was taken for their own failure), with why.
    pub lost_work: Vec<String>,
    pub injections: Vec<Injection>,
}

impl FaultsReport {
    pub fn ok(&self) -> bool {
        self.survived == self.faults && self.jobs_lost == 0 && self.lost_work.is_empty()
    }

    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<20} {:>8} {:>8} {:>13} {:>10}\n",
            "fault", "injected", "survived", "recovery max", "violations"
        );
        for k in &self.kinds {
            out.push_str(&format!(
                "{:<20} {:>8} {:>8} {:>13} {:>10}\n",
                k.kind.name(),
                k.injected,
                k.survived,
                k.longest_recovery_s
                    .map_or("-".to_owned(), |s| format!("{s:.1} s")),
                k.violations
            ));
        }
        out.push_str(&format!(
            "{} faults in {:.0} s, {} survived; {} jobs submitted, {} lost ({}); {} of {} pipelines succeeded; {} submissions refused\n",
            self.faults,
            self.duration_s,
            self.survived,
            self.jobs_submitted,
            self.jobs_lost,
            self.jobs_by_state
                .iter()
                .map(|(s, n)| format!("{s} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.pipelines_succeeded,
            self.pipelines_run,
            self.submissions_refused
        ));
        for w in &self.lost_work {
            out.push_str(&format!("  lost: {w}\n"));
        }
        for i in self.injections.iter().filter(|i| !i.violations.is_empty()) {
            out.push_str(&format!(
                "  {} ({}) at {:.0} s:\n",
                i.kind.name(),
                i.target,
                i.at_s
            ));
            for v in &i.violations {
                out.push_str(&format!("    {v}\n"));
            }
        }
        out
    }
}

/// The repository root (the harness runs the rig's scripts from it).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_owned)
        .unwrap_or_default()
}

pub async fn faults(args: FaultsRun) -> anyhow::Result<FaultsReport> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    if unsafe { libc::geteuid() } != 0 {
        bail!("the fault harness needs root: the rig makes network namespaces and runs dockerd");
    }
    let repo = repo();
    let rig = Arc::new(Rig::up(&repo, args.hosts, args.coordinator_data_mb)?);
    let result = run(&args, rig.clone()).await;
    if !args.keep
        && let Err(e) = Rig::down(&repo)
    {
        eprintln!("faults: {e:#}");
    }
    result
}

/// The run's shared parts: the rig, the ledger, the load it is asked for, the violations the
/// watcher saw, and the random numbers.
struct Run {
    rig: Arc<Rig>,
    ledger: Arc<Mutex<Ledger>>,
    load: watch::Sender<Load>,
    seen: Arc<Mutex<Vec<(Instant, String)>>>,
    rng: Rng,
    t0: Instant,
    restart_delay: Duration,
}

async fn run(args: &FaultsRun, rig: Arc<Rig>) -> anyhow::Result<FaultsReport> {
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let refused = Arc::new(AtomicU64::new(0));
    let (stop_tx, stop_rx) = watch::channel(false);
    let (load_tx, load_rx) = watch::channel(Load::Cycle);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let tasks = vec![
        tokio::spawn(load::keep_busy(
            rig.clone(),
            ledger.clone(),
            refused.clone(),
            stop_rx.clone(),
        )),
        tokio::spawn(load::drive_load(rig.clone(), load_rx)),
        tokio::spawn(watch_invariants(
            rig.clone(),
            ledger.clone(),
            seen.clone(),
            stop_rx,
        )),
    ];
    let mut r = Run {
        rig,
        ledger,
        load: load_tx,
        seen,
        rng: Rng::new(args.seed),
        t0: Instant::now(),
        restart_delay: Duration::from_secs_f64(args.restart_delay),
    };
    // Let the work start: jobs placed, a node or two lent.
    tokio::time::sleep(Duration::from_secs(20)).await;

    let kinds: Vec<Kind> = if args.kinds.is_empty() {
        Kind::ALL.to_vec()
    } else {
        args.kinds.clone()
    };
    let mut injections = Vec::new();
    let mut agent_moments = 0usize;
    let mut plan: Vec<Kind> = kinds.clone();
    let deadline = r.t0 + Duration::from_secs_f64(args.minutes * 60.0);
    loop {
        let kind = if let Some(k) = (!plan.is_empty()).then(|| plan.remove(0)) {
            k
        } else if Instant::now() < deadline {
            pick(&mut r.rng, &kinds)
        } else {
            break;
        };
        let mark = Instant::now();
        let at_s = r.t0.elapsed().as_secs_f64();
        let mut inj = match kind {
            Kind::Partition => partition(&mut r).await,
            Kind::ShortPartition => short_partition(&mut r).await,
            Kind::AgentKill => {
                agent_moments += 1;
                agent_kill(&mut r, Moment::ALL[(agent_moments - 1) % Moment::ALL.len()]).await
            }
            Kind::EngineRestart => engine_restart(&mut r).await,
            Kind::CoordinatorKill => coordinator_restart(&mut r, "KILL").await,
            Kind::CoordinatorTerm => coordinator_restart(&mut r, "TERM").await,
            Kind::DiskFull => disk_full(&mut r).await,
            Kind::JobIgnoresSignal => job_ignores_signal(&mut r).await,
            Kind::JobCrashLoop => job_crash_loop(&mut r).await,
            Kind::CheckpointFull => checkpoint_full(&mut r).await,
        }
        .unwrap_or_else(|e| Injection {
            kind,
            target: "-".to_owned(),
            at_s,
            recovery_s: None,
            figures: BTreeMap::new(),
            violations: vec![format!("the harness could not run it: {e:#}")],
        });
        inj.at_s = at_s;
        // What the watcher saw meanwhile counts against this fault.
        let mut seen = r.seen.lock().unwrap();
        for (t, v) in seen.drain(..) {
            if t >= mark {
                inj.violations.push(v);
            }
        }
        drop(seen);
        inj.violations.dedup();
        eprintln!(
            "faults: {:>6.0} s  {:<18} {:<28} recovery {:>6} {} {}",
            inj.at_s,
            kind.name(),
            inj.target,
            inj.recovery_s
                .map_or("-".to_owned(), |s| format!("{s:.1} s")),
            inj.figures
                .iter()
                .map(|(k, v)| format!("{k} {v:.1}"))
                .collect::<Vec<_>>()
                .join(" "),
            if inj.violations.is_empty() {
                "ok".to_owned()
            } else {
                inj.violations.join("; ")
            }
        );
        r.load.send_replace(Load::Cycle);
        injections.push(inj);
    }

    // The end: the load falls, the pipeline in flight finishes, nothing was lost.
    r.load.send_replace(Load::Night);
    let _ = settle(&r.rig, Duration::from_secs(120)).await;
    let _ = stop_tx.send(true);
    for t in tasks {
        t.abort();
    }
    let end = Snapshot::take(&r.rig).await;
    let ledger = r.ledger.lock().unwrap();
    let mut jobs_by_state = BTreeMap::new();
    let mut lost = 0;
    let mut lost_work = Vec::new();
    if let Some(jobs) = &end.jobs {
        for id in ledger.jobs.keys() {
            match jobs.iter().find(|j| j.id == *id) {
                Some(j) => {
                    *jobs_by_state
                        .entry(j.state.as_str().to_owned())
                        .or_insert(0) += 1;
                    if j.state == JobState::Failed && j.spec.name.starts_with("fx-train-") {
                        lost_work.push(format!(
                            "job {} ({}) failed: {}",
                            j.id,
                            j.spec.name,
                            j.message.as_deref().unwrap_or("no message")
                        ));
                    }
                }
                None => lost += 1,
            }
        }
        for run in ledger.runs.values() {
            if run.phase == "Failed" || run.phase == "Error" {
                let why: Vec<String> = run
                    .nodes
                    .iter()
                    .filter_map(|n| Some(format!("{}: {}", n.name, n.message.as_ref()?)))
                    .collect();
                lost_work.push(format!(
                    "pipeline run {} ended {}: {}",
                    run.id,
                    run.phase,
                    why.join("; ")
                ));
            }
        }
    } else {
        bail!("the coordinator does not answer at the end of the run");
    }
    // One row per kind, in the order first asked (`--kinds` may name one twice).
    let mut rows: Vec<Kind> = Vec::new();
    for k in &kinds {
        if !rows.contains(k) {
            rows.push(*k);
        }
    }
    let kinds_summary = rows
        .iter()
        .map(|&k| {
            let of: Vec<&Injection> = injections.iter().filter(|i| i.kind == k).collect();
            KindSummary {
                kind: k,
                injected: of.len(),
                survived: of
                    .iter()
                    .filter(|i| i.violations.is_empty() && i.recovery_s.is_some())
                    .count(),
                longest_recovery_s: of
                    .iter()
                    .filter_map(|i| i.recovery_s)
                    .fold(None, |m: Option<f64>, s| Some(m.map_or(s, |m| m.max(s)))),
                violations: of.iter().map(|i| i.violations.len()).sum(),
            }
        })
        .collect();
    let survived = injections
        .iter()
        .filter(|i| i.violations.is_empty() && i.recovery_s.is_some())
        .count();
    Ok(FaultsReport {
        hosts: args.hosts,
        seed: args.seed,
        duration_s: r.t0.elapsed().as_secs_f64(),
        faults: injections.len(),
        survived,
        kinds: kinds_summary,
        jobs_submitted: ledger.jobs.len(),
        jobs_by_state,
        jobs_lost: lost,
        pipelines_run: ledger.pipelines.len(),
        pipelines_succeeded: ledger
            .runs
            .values()
            .filter(|r| r.phase == "Succeeded")
            .count(),
        submissions_refused: refused.load(Ordering::Relaxed),
        lost_work,
        injections,
    })
}

fn pick(rng: &mut Rng, kinds: &[Kind]) -> Kind {
    let total: u64 = kinds.iter().map(|k| k.weight()).sum();
    let mut x = rng.below(total);
    for &k in kinds {
        if x < k.weight() {
            return k;
        }
        x -= k.weight();
    }
    kinds[0]
}

/// Every half second: one look at the cluster, the invariants checked on it, each violation
/// kept with its time (the same line again only after it stopped for a while).
async fn watch_invariants(
    rig: Arc<Rig>,
    ledger: Arc<Mutex<Ledger>>,
    seen: Arc<Mutex<Vec<(Instant, String)>>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut last: Vec<String> = Vec::new();
    loop {
        let s = Snapshot::take(&rig).await;
        let mut v = {
            let mut l = ledger.lock().unwrap();
            let mut v = check::always(&s, &mut l);
            for run in l.runs.values() {
                v.extend(check::steps_once(run));
            }
            v
        };
        v.sort();
        v.dedup();
        {
            let mut out = seen.lock().unwrap();
            for line in &v {
                if !last.contains(line) {
                    out.push((s.at, line.clone()));
                }
            }
        }
        last = v;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Waits until the cluster has converged ([`check::unsettled`] says nothing) and the
/// settled-state checks hold twice in a row a second apart (so that a container a heartbeat
/// has not reported yet is not taken for an orphan); returns how long that took, or what
/// still did not hold at `limit`.
async fn settle(rig: &Rig, limit: Duration) -> Result<Duration, String> {
    let t = Instant::now();
    let mut why = String::new();
    let mut clean_once = false;
    while t.elapsed() < limit {
        let s = Snapshot::take(rig).await;
        let ready = futures_util::future::join_all((1..=rig.hosts).map(|i| rig.ready(i))).await;
        match check::unsettled(&s, &ready) {
            Some(w) => {
                why = w;
                clean_once = false;
            }
            None => {
                let v = check::settled(&s);
                if v.is_empty() {
                    if clean_once {
                        return Ok(t.elapsed());
                    }
                    clean_once = true;
                } else {
                    why = v.join("; ");
                    clean_once = false;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!(
        "not settled after {:.0} s: {why}",
        limit.as_secs_f64()
    ))
}

/// Settles, recording the time in `inj` or the failure among its violations.
async fn settle_into(r: &Run, inj: &mut Injection, from: Instant) {
    match settle(&r.rig, SETTLE_LIMIT).await {
        Ok(_) => inj.recovery_s = Some(from.elapsed().as_secs_f64()),
        Err(why) => inj.violations.push(why),
    }
}

fn injection(kind: Kind, target: String) -> Injection {
    Injection {
        kind,
        target,
        at_s: 0.0,
        recovery_s: None,
        figures: BTreeMap::new(),
        violations: Vec::new(),
    }
}

/// Puts the load at `load`, waits for the cluster to settle there, and returns the settled
/// snapshot.
async fn steady(r: &Run, load: Load) -> anyhow::Result<Snapshot> {
    r.load.send_replace(load);
    settle(&r.rig, SETTLE_LIMIT)
        .await
        .map_err(|why| anyhow::anyhow!("before the fault: {why}"))?;
    Ok(Snapshot::take(&r.rig).await)
}

/// A lent host running a job in `s`, else any lent host, else a random host.
fn lent_host(r: &mut Run, s: &Snapshot) -> usize {
    let hosts = r.rig.hosts;
    let lent: Vec<usize> = (1..=hosts)
        .filter(|&i| s.node(i).is_some_and(|n| n.mode == NodeMode::Lend))
        .collect();
    let busy: Vec<usize> = lent
        .iter()
        .copied()
        .filter(|&i| {
            s.engines[i - 1]
                .iter()
                .flatten()
                .any(|c| c.running && c.job.is_some())
        })
        .collect();
    let from = if !busy.is_empty() {
        busy
    } else if !lent.is_empty() {
        lent
    } else {
        (1..=hosts).collect()
    };
    from[r.rng.below(from.len() as u64) as usize]
}

// ------------------------------------------------------------------ partitions

async fn partition(r: &mut Run) -> anyhow::Result<Injection> {
    let s = steady(r, Load::Night).await?;
    let host = lent_host(r, &s);
    let jobs_there: Vec<(u64, u64)> = s.engines[host - 1]
        .iter()
        .flatten()
        .filter(|c| c.running)
        .filter_map(|c| Some((c.job?, c.epoch?)))
        .collect();
    let mut inj = injection(
        Kind::Partition,
        format!("gpu{host} ({} jobs) cut 25 s", jobs_there.len()),
    );
    let cut = Instant::now();
    r.rig.link(host, false).await?;
    // The host, alone, must serve again: fail-safe after the lease TTL, the jobs stopped,
    // the replica started.
    let rig = r.rig.clone();
    let served = crate::until(
        "the cut-off host to serve",
        Duration::from_secs(25),
        POLL,
        || {
            let rig = rig.clone();
            async move { rig.ready(host).await.then_some(()) }
        },
    )
    .await
    .ok();
    match served {
        Some(()) => {
            inj.figures
                .insert("served_alone_after_s".into(), cut.elapsed().as_secs_f64());
        }
        None => inj.violations.push(format!(
            "gpu{host} did not serve on its own within 25 s of being cut off"
        )),
    }
    let held = Duration::from_secs(25).saturating_sub(cut.elapsed());
    tokio::time::sleep(held).await;
    let after = r.rig.containers(host).await.unwrap_or_default();
    if after.iter().any(|c| c.running && c.job.is_some()) {
        inj.violations.push(format!(
            "gpu{host} still runs job containers after {} s alone",
            cut.elapsed().as_secs()
        ));
    }
    let healed = Instant::now();
    r.rig.link(host, true).await?;
    settle_into(r, &mut inj, healed).await;
    // The cut-off attempts wrote nothing after they were cut off past the TTL plus grace.
    let fence = cut + LEASE_TTL + Duration::from_secs(6);
    let fence_ms = crate::now_ms() - fence.elapsed().as_millis() as u64;
    for (job, epoch) in jobs_there {
        let dir = Path::new(rig::STATE)
            .join("shared/checkpoints/jobs")
            .join(job.to_string())
            .join("checkpoints")
            .join(epoch.to_string());
        if let Some(late) = newest_mtime_ms(&dir)
            && late > fence_ms
        {
            inj.violations.push(format!(
                "job {job}'s cut-off attempt (epoch {epoch}) wrote its checkpoint {:.1} s after its lease expired",
                (late - fence_ms) as f64 / 1000.0 + 6.0
            ));
        }
    }
    Ok(inj)
}

/// The newest modification time (ms since the epoch) of a file under `dir`.
fn newest_mtime_ms(dir: &Path) -> Option<u64> {
    let mut newest = None;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).ok()?.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else if let Ok(t) = m.modified() {
                let ms = t
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                newest = Some(newest.map_or(ms, |n: u64| n.max(ms)));
            }
        }
    }
    newest
}

async fn short_partition(r: &mut Run) -> anyhow::Result<Injection> {
    let s = steady(r, Load::Night).await?;
    let host = lent_host(r, &s);
    let before: Vec<(String, Option<u64>)> = s.engines[host - 1]
        .iter()
        .flatten()
        .filter(|c| c.running)
        .map(|c| (c.name.clone(), c.job))
        .collect();
    let preempted = preemptions(&s);
    let mut inj = injection(Kind::ShortPartition, format!("gpu{host} cut 5 s"));
    r.rig.link(host, false).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let healed = Instant::now();
    r.rig.link(host, true).await?;
    settle_into(r, &mut inj, healed).await;
    let s = Snapshot::take(&r.rig).await;
    // Nothing restarted and nothing was preempted: each container that ran before still
    // runs, unless its job finished meanwhile (and the agent may have removed it since).
    let finished: Vec<u64> = s
        .jobs
        .iter()
        .flatten()
        .filter(|j| j.state.is_finished())
        .map(|j| j.id)
        .collect();
    let now: Vec<&rig::Seen> = s.engines[host - 1].iter().flatten().collect();
    for (name, job) in &before {
        let c = now.iter().find(|c| &c.name == name);
        let ended_well = job.is_some_and(|j| finished.contains(&j));
        if !c.is_some_and(|c| c.running) && !ended_well {
            inj.violations
                .push(format!("gpu{host}: {name} stopped during a 5 s cut"));
        }
    }
    for (job, n) in preemptions(&s) {
        if n > preempted.get(&job).copied().unwrap_or(0) {
            inj.violations
                .push(format!("job {job} was preempted during a 5 s cut"));
        }
    }
    Ok(inj)
}

fn preemptions(s: &Snapshot) -> BTreeMap<u64, u32> {
    s.jobs
        .iter()
        .flatten()
        .map(|j| (j.id, j.preemptions))
        .collect()
}

// ------------------------------------------------------------------ processes

/// When an agent is killed.
#[derive(Debug, Clone, Copy)]
enum Moment {
    /// While it drains its replica for a lend.
    Drain,
    /// While it stops its jobs and starts its replica again.
    Reclaim,
    /// While a job's container starts on it.
    Start,
    /// With nothing under way.
    Idle,
}

impl Moment {
    const ALL: [Moment; 4] = [Moment::Drain, Moment::Reclaim, Moment::Start, Moment::Idle];
}

async fn agent_kill(r: &mut Run, moment: Moment) -> anyhow::Result<Injection> {
    // Bring the cluster where the moment comes next, then wait for it on some host.
    let (from, to) = match moment {
        Moment::Drain | Moment::Start => (Load::Day, Load::Night),
        Moment::Reclaim => (Load::Night, Load::Day),
        Moment::Idle => (Load::Cycle, Load::Cycle),
    };
    steady(r, from).await?;
    r.load.send_replace(to);
    let rig = r.rig.clone();
    let host = crate::until(
        "the moment to kill the agent",
        Duration::from_secs(60),
        POLL,
        || {
            let rig = rig.clone();
            async move {
                let s = Snapshot::take(&rig).await;
                let nodes = s.nodes.as_ref()?;
                let jobs = s.jobs.as_ref()?;
                (1..=rig.hosts).find(|&i| {
                    let Some(n) = nodes.iter().find(|n| n.name == format!("gpu{i}")) else {
                        return false;
                    };
                    let moving = n.applied_version < n.desired_version;
                    match moment {
                        Moment::Drain => moving && n.mode == NodeMode::Lend,
                        Moment::Reclaim => moving && n.mode == NodeMode::Serve,
                        Moment::Start => jobs.iter().any(|j| {
                            j.state == JobState::Starting
                                && j.leases.iter().any(|l| l.node == n.name && !l.revoked)
                        }),
                        Moment::Idle => !moving,
                    }
                })
            }
        },
    )
    .await
    .ok();
    let (host, when) = match host {
        Some(h) => (h, format!("{moment:?}").to_lowercase()),
        None => (
            1 + r.rng.below(r.rig.hosts as u64) as usize,
            "late".to_owned(),
        ),
    };
    let mut inj = injection(Kind::AgentKill, format!("gpu{host} mid-{when}"));
    let pid = r
        .rig
        .agent_pid(host)
        .with_context(|| format!("gpu{host}'s agent is not running"))?;
    if !rig::signal_and_wait(pid, "KILL", Duration::from_secs(5)).await? {
        bail!("gpu{host}'s agent (pid {pid}) survived SIGKILL");
    }
    let killed = Instant::now();
    tokio::time::sleep(r.restart_delay).await;
    r.rig.start_agent(host).await?;
    settle_into(r, &mut inj, killed).await;
    Ok(inj)
}

async fn engine_restart(r: &mut Run) -> anyhow::Result<Injection> {
    let s = steady(r, Load::Cycle).await?;
    let host = lent_host(r, &s);
    let mut inj = injection(Kind::EngineRestart, format!("gpu{host}'s dockerd"));
    let pid = r
        .rig
        .engine_pid(host)
        .with_context(|| format!("gpu{host}'s dockerd is not running"))?;
    if !rig::signal_and_wait(pid, "TERM", Duration::from_secs(30)).await? {
        bail!("gpu{host}'s dockerd (pid {pid}) did not stop within 30 s of SIGTERM");
    }
    let stopped = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    r.rig.start_engine(host).await?;
    inj.figures
        .insert("engine_down_s".into(), stopped.elapsed().as_secs_f64());
    settle_into(r, &mut inj, stopped).await;
    Ok(inj)
}

/// Why pipeline run `id` cannot be read, if it cannot: asked again while the coordinator
/// answers 429 (too many requests) or not at all, for up to 20 s.
async fn pipeline_missing(rig: &Rig, id: u64) -> Option<String> {
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match rig.api.pipeline(id).await {
            Ok(_) => return None,
            Err(e) => {
                let again = e.status().is_none_or(|s| s.as_u16() == 429);
                if !again || Instant::now() >= give_up {
                    return Some(e.to_string());
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn coordinator_restart(r: &mut Run, sig: &str) -> anyhow::Result<Injection> {
    // A random moment of the busy cluster: nothing is arranged first.
    let wait = Duration::from_millis(r.rng.below(10_000));
    tokio::time::sleep(wait).await;
    let kind = if sig == "KILL" {
        Kind::CoordinatorKill
    } else {
        Kind::CoordinatorTerm
    };
    let before = Snapshot::take(&r.rig).await;
    let mut inj = injection(kind, format!("SIG{sig}"));
    let pid = r
        .rig
        .coordinator_pid()
        .context("the coordinator is not running")?;
    if !rig::signal_and_wait(pid, sig, Duration::from_secs(30)).await? {
        bail!("the coordinator (pid {pid}) did not exit within 30 s of SIG{sig}");
    }
    let down = Instant::now();
    tokio::time::sleep(r.restart_delay).await;
    r.rig.start_coordinator().await?;
    settle_into(r, &mut inj, down).await;
    // Every pipeline run is still there. One request per run: paced under the API's rate
    // limit for the harness's token (20 a second, shared with the watcher and the load), and
    // only a run the coordinator says it does not know is gone.
    let pipelines: Vec<u64> = r.ledger.lock().unwrap().pipelines.iter().copied().collect();
    for id in pipelines {
        if let Some(e) = pipeline_missing(&r.rig, id).await {
            inj.violations
                .push(format!("pipeline run {id} is gone after the restart: {e}"));
        }
    }
    // The containers that ran under live leases before still run (adopted, not restarted),
    // unless their job ended or was taken back meanwhile.
    let after = Snapshot::take(&r.rig).await;
    for (job, list) in before.running_jobs() {
        for (host, c) in list {
            let still = after.engines[host - 1]
                .iter()
                .flatten()
                .any(|a| a.id == c.id && a.running);
            let moved_on = after
                .jobs
                .iter()
                .flatten()
                .find(|j| j.id == job)
                .is_none_or(|j| {
                    j.state != JobState::Running
                        || !j.leases.iter().any(|l| Some(l.lease_id) == c.lease)
                });
            if !still && !moved_on {
                inj.violations.push(format!(
                    "gpu{host}: job {job}'s container {} was replaced across the restart",
                    c.name
                ));
            }
        }
    }
    Ok(inj)
}

async fn disk_full(r: &mut Run) -> anyhow::Result<Injection> {
    let s = steady(r, Load::Night).await?;
    let lent: Vec<usize> = (1..=r.rig.hosts)
        .filter(|&i| s.node(i).is_some_and(|n| n.mode == NodeMode::Lend))
        .collect();
    let mut inj = injection(
        Kind::DiskFull,
        format!("coordinator data full {} s", LEASE_TTL.as_secs() + 10),
    );
    let fill = r.rig.coordinator_data().join("fault-harness-fill");
    fill_up(&fill)?;
    let full = Instant::now();
    // A submission fails, saying why, or is kept: SQLite may still write into the space its
    // write-ahead log already holds. A job accepted is tracked, and missing at the end is lost.
    let spec = load::spec(&format!(
        "name: fx-while-full\nimage: {}/busybox:latest\ncommand: [true]\ngpus: 1\n",
        load::REGISTRY
    ));
    match r.rig.api.submit(&spec).await {
        Ok(j) => {
            r.ledger.lock().unwrap().track(j.id);
            inj.figures.insert("accepted_while_full".to_owned(), 1.0);
        }
        Err(e) => {
            let msg = e.to_string();
            let says = ["space", "full", "disk", "save", "storage"]
                .iter()
                .any(|w| msg.to_lowercase().contains(w));
            if !says {
                inj.violations.push(format!(
                    "a submission while the disk was full failed without saying why: {msg}"
                ));
            }
        }
    }
    // The lent hosts keep their jobs: no fail-safe because the coordinator cannot write.
    let mut served_again = Vec::new();
    while full.elapsed() < LEASE_TTL + Duration::from_secs(10) {
        for &i in &lent {
            if !served_again.contains(&i) && r.rig.ready(i).await {
                served_again.push(i);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for i in served_again {
        inj.violations.push(format!(
            "gpu{i} took its replica back (its jobs stopped) while the coordinator could not write"
        ));
    }
    std::fs::remove_file(&fill).context("removing the fill file")?;
    let freed = Instant::now();
    settle_into(r, &mut inj, freed).await;
    match r.rig.api.submit(&spec).await {
        Ok(j) => r.ledger.lock().unwrap().track(j.id),
        Err(e) => inj
            .violations
            .push(format!("a submission after space returned failed: {e}")),
    }
    Ok(inj)
}

/// Writes `file` until its file system is full.
fn fill_up(file: &Path) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(file).context("creating the fill file")?;
    let block = vec![0u8; 1 << 20];
    loop {
        match f.write(&block) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => return Ok(()),
            Err(e) => return Err(e).context("filling the coordinator's disk"),
        }
    }
}

// ------------------------------------------------------------------ jobs that misbehave

async fn job_ignores_signal(r: &mut Run) -> anyhow::Result<Injection> {
    steady(r, Load::Night).await?;
    let grace = 4u64;
    let spec = load::spec(&format!(
        "name: fx-stubborn
image: {}/nightshift/toy-trainer:dev
gpus: 2
priority: 10
checkpoint: {{gracePeriodSeconds: {grace}}}
env:
  - {{name: TRAINER_IGNORE_SIGTERM, value: \"1\"}}
  - {{name: TRAINER_TARGET_STEP, value: \"1000000\"}}
  - {{name: TRAINER_STEPS_PER_SEC, value: \"20\"}}
",
        load::REGISTRY
    ));
    let job = r.rig.api.submit(&spec).await?.id;
    r.ledger.lock().unwrap().track(job);
    let mut inj = injection(Kind::JobIgnoresSignal, format!("job {job}"));
    let rig = r.rig.clone();
    let running = crate::until(
        "the stubborn job to run",
        Duration::from_secs(90),
        POLL,
        || {
            let rig = rig.clone();
            async move {
                let s = Snapshot::take(&rig).await;
                s.running_jobs().contains_key(&job).then_some(())
            }
        },
    )
    .await
    .ok();
    if running.is_none() {
        let _ = r.rig.api.cancel(job).await;
        bail!("job {job} did not start within 90 s of a night");
    }
    // The surge takes its node back: the signal is ignored, the kill comes after the grace.
    r.load.send_replace(Load::Day);
    let revoked = crate::until(
        "the surge to take the job back",
        Duration::from_secs(30),
        POLL,
        || {
            let rig = rig.clone();
            async move {
                let j = rig.api.job(job).await.ok()?;
                (j.state != JobState::Running).then_some(Instant::now())
            }
        },
    )
    .await?;
    let gone = crate::until(
        "the stubborn job's container to go",
        Duration::from_secs(grace + 30),
        POLL,
        || {
            let rig = rig.clone();
            async move {
                let s = Snapshot::take(&rig).await;
                (!s.running_jobs().contains_key(&job)).then_some(Instant::now())
            }
        },
    )
    .await
    .ok();
    match gone {
        Some(t) => {
            let s = (t - revoked).as_secs_f64();
            inj.figures.insert("killed_after_s".into(), s);
            if s > grace as f64 + 10.0 {
                inj.violations.push(format!(
                    "job {job} was killed {s:.1} s after it was taken back, past its grace of {grace} s"
                ));
            }
        }
        None => inj.violations.push(format!(
            "job {job} still ran {} s after it was taken back",
            grace + 30
        )),
    }
    r.rig.api.cancel(job).await?;
    let t = Instant::now();
    settle_into(r, &mut inj, t).await;
    Ok(inj)
}

async fn job_crash_loop(r: &mut Run) -> anyhow::Result<Injection> {
    steady(r, Load::Night).await?;
    let spec = load::spec(&format!(
        "name: fx-crash
image: {}/busybox:latest
command: [sh, -c, 'echo failing; exit 3']
gpus: 1
priority: 10
retry: {{limit: 2, backoffSeconds: 2, backoffFactor: 2}}
",
        load::REGISTRY
    ));
    let job = r.rig.api.submit(&spec).await?.id;
    r.ledger.lock().unwrap().track(job);
    let mut inj = injection(Kind::JobCrashLoop, format!("job {job}"));
    let t = Instant::now();
    let end = job_end(
        &r.rig,
        job,
        "the crash-looping job",
        Duration::from_secs(120),
    )
    .await
    .ok();
    let Some(j) = end else {
        inj.violations.push(format!(
            "job {job} had not ended 120 s after it was submitted"
        ));
        return Ok(inj);
    };
    if j.state != JobState::Failed || j.failures != 3 {
        inj.violations.push(format!(
            "job {job} ended {} after {} failures, not failed after 3",
            j.state.as_str(),
            j.failures
        ));
    }
    // Backoff: 2 s before the second attempt, 4 s before the third.
    let starts: Vec<u64> = j.attempts.iter().filter_map(|a| a.started_at).collect();
    let ends: Vec<u64> = j.attempts.iter().filter_map(|a| a.ended_at).collect();
    for (k, want) in [(1usize, 2_000u64), (2, 4_000)] {
        if let (Some(s), Some(e)) = (starts.get(k), ends.get(k - 1)) {
            let gap = s.saturating_sub(*e);
            inj.figures
                .insert(format!("backoff_{k}_s"), gap as f64 / 1000.0);
            if gap + 500 < want {
                inj.violations.push(format!(
                    "job {job}'s attempt {} started {gap} ms after the failure before it, not after {want} ms",
                    k + 1
                ));
            }
        } else {
            inj.violations.push(format!(
                "job {job} has no record of attempt {} ({} attempts recorded)",
                k + 1,
                j.attempts.len()
            ));
        }
    }
    settle_into(r, &mut inj, t).await;
    Ok(inj)
}

/// A job writes its checkpoint volume (shared by every host) full to below the agents'
/// floor: a job submitted then is refused by its host before anything is done for it, with
/// no failure counted, and starts once the space is freed.
async fn checkpoint_full(r: &mut Run) -> anyhow::Result<Injection> {
    steady(r, Load::Night).await?;
    let volume = r.rig.checkpoints();
    let floor = rig::CHECKPOINT_MIN_FREE_MB << 20;
    let free = free_bytes(&volume)?;
    let fill_mb = free.saturating_sub(floor / 2) >> 20;
    let mut inj = injection(
        Kind::CheckpointFull,
        format!("{fill_mb} MiB written, {} MiB left", (free >> 20) - fill_mb),
    );
    let filler = r
        .rig
        .api
        .submit(&load::spec(&format!(
            "name: fx-fill
image: {}/busybox:latest
command: [sh, -c, 'dd if=/dev/zero of=$NIGHTSHIFT_CHECKPOINT_DIR/{FILL} bs=1048576 count={fill_mb} && sync']
gpus: 1
priority: 10
",
            load::REGISTRY
        )))
        .await?
        .id;
    r.ledger.lock().unwrap().track(filler);
    let filled = job_end(&r.rig, filler, "the filling job", Duration::from_secs(90)).await?;
    if filled.state != JobState::Succeeded {
        bail!(
            "the filling job {filler} ended {}: {}",
            filled.state.as_str(),
            filled.message.as_deref().unwrap_or("no message")
        );
    }
    let left = free_bytes(&volume)?;
    inj.figures
        .insert("free_mb".to_owned(), (left >> 20) as f64);
    if left >= floor {
        bail!("the volume still has {left} bytes free after the fill, above the floor of {floor}");
    }

    // A job submitted now is refused, says why, and keeps its retries (it has none).
    let probe = r
        .rig
        .api
        .submit(&load::spec(&format!(
            "name: fx-after-fill\nimage: {}/busybox:latest\ncommand: [true]\ngpus: 1\npriority: 10\n",
            load::REGISTRY
        )))
        .await?
        .id;
    r.ledger.lock().unwrap().track(probe);
    let submitted = Instant::now();
    let rig = r.rig.clone();
    let refused = crate::until(
        "the job to be refused",
        Duration::from_secs(60),
        POLL,
        || {
            let rig = rig.clone();
            async move {
                let j = rig.api.job(probe).await.ok()?;
                let said = j
                    .message
                    .as_deref()
                    .is_some_and(|m| m.contains("checkpoint_min_free_bytes"));
                (said || j.state.is_finished()).then_some(j)
            }
        },
    )
    .await;
    match refused {
        Ok(j) if j.state == JobState::Queued && j.failures == 0 => {
            inj.figures.insert(
                "refused_after_s".to_owned(),
                submitted.elapsed().as_secs_f64(),
            );
        }
        Ok(j) => inj.violations.push(format!(
            "job {probe}, submitted to a full checkpoint volume, is {} after {} failures: {}",
            j.state.as_str(),
            j.failures,
            j.message.as_deref().unwrap_or("no message")
        )),
        Err(e) => inj.violations.push(format!(
            "job {probe} was not refused for want of checkpoint space: {e}"
        )),
    }

    // The operator frees the space: the job starts, with no failure counted.
    remove_fill(&volume.join("jobs").join(filler.to_string()))?;
    let freed = Instant::now();
    let ended = job_end(&r.rig, probe, "the refused job", Duration::from_secs(90)).await;
    match ended {
        Ok(j) if j.state == JobState::Succeeded && j.failures == 0 => {
            inj.figures.insert(
                "ran_after_space_s".to_owned(),
                freed.elapsed().as_secs_f64(),
            );
        }
        Ok(j) => inj.violations.push(format!(
            "job {probe} ended {} after {} failures once space returned: {}",
            j.state.as_str(),
            j.failures,
            j.message.as_deref().unwrap_or("no message")
        )),
        Err(e) => inj
            .violations
            .push(format!("job {probe} did not run once space returned: {e}")),
    }
    settle_into(r, &mut inj, freed).await;
    Ok(inj)
}

/// Job `id` once it has finished, polled for up to `limit`; `what` names it in the error.
async fn job_end(
    rig: &Arc<Rig>,
    id: u64,
    what: &str,
    limit: Duration,
) -> anyhow::Result<nightshift_common::JobView> {
    crate::until(&format!("{what} to end"), limit, POLL, || {
        let rig = rig.clone();
        async move {
            let j = rig.api.job(id).await.ok()?;
            j.state.is_finished().then_some(j)
        }
    })
    .await
}

/// The name of the file the filling job writes.
const FILL: &str = "fault-harness-fill";

/// Bytes free to an unprivileged writer on the file system holding `path`, as the agent sees
/// them.
fn free_bytes(path: &Path) -> anyhow::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `stat` a place for statvfs to write into; it is
    // read only after statvfs said it wrote it.
    #[allow(unsafe_code)]
    let stat = unsafe {
        if libc::statvfs(c.as_ptr(), stat.as_mut_ptr()) != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("statvfs {}", path.display()));
        }
        stat.assume_init()
    };
    Ok(stat.f_bavail * stat.f_frsize)
}

/// Removes the fill files under `dir`, as an operator freeing the volume would.
fn remove_fill(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            remove_fill(&path)?;
        } else if path.file_name().is_some_and(|n| n == FILL) {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}
