//! `nightshift simulate`: the fleet simulator (`nightshift-sim`) behind the CLI's flags.

use std::time::Instant;

use nightshift_sim::fault::FaultRates;
use nightshift_sim::model::Release;
use nightshift_sim::{Policy, Report, SimConfig, SimError};

/// Flags of `nightshift simulate`.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct SimulateArgs {
    /// Traffic: servegen:DIR (per-client 10-minute windows), azure:FILE (Azure LLM
    /// inference 2023 CSV), mooncake:FILE (Mooncake JSONL) or csv:FILE (timestamp,rate).
    #[arg(long, value_name = "KIND:PATH")]
    pub trace: String,
    /// Scale the trace so that its busiest 10-minute window needs this many replicas.
    #[arg(long, default_value_t = 28)]
    pub peak_replicas: u32,
    /// Hosts in the fleet (4 GPUs each, one replica per host).
    #[arg(long, default_value_t = 32)]
    pub nodes: u32,
    /// Simulated days (fractions allowed); a shorter trace repeats.
    #[arg(long, default_value_t = 14.0)]
    pub days: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Faults per day: none, default, or agent-crash=N,coordinator-restart=N,partition=N.
    #[arg(long, default_value = "none")]
    pub faults: String,
    /// The service's min_replicas.
    #[arg(long, default_value_t = 2)]
    pub min_replicas: u32,
    /// Lend by putting vLLM to sleep (level 1) instead of stopping it.
    #[arg(long)]
    pub sleep: bool,
    /// Replica cold start, seconds.
    #[arg(long, default_value_t = 225)]
    pub cold_start_s: u64,
    /// Seconds between heartbeats in the simulation.
    #[arg(long, default_value_t = 5)]
    pub heartbeat_s: u64,
    /// Fill a ServeGen trace's gaps (windows in which no client sent anything, between
    /// windows with load) from the windows around them, instead of simulating them as
    /// recorded, without traffic (docs/SIMULATOR.md, "Gaps in a trace").
    #[arg(long)]
    pub fill_trace_gaps: bool,
    /// Also write an HTML page with one chart per policy of the run over time (offline,
    /// no script).
    #[arg(long, value_name = "FILE")]
    pub html: Option<std::path::PathBuf>,
    /// Policies to compare (comma-separated); all by default.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "nightshift,fixed-window,night-20-08,reactive,oracle"
    )]
    pub policies: Vec<String>,
}

impl Eq for SimulateArgs {}

impl SimulateArgs {
    pub fn config(&self) -> Result<SimConfig, SimError> {
        let mut cfg = SimConfig {
            nodes: self.nodes,
            peak_replicas: self.peak_replicas,
            days: self.days,
            seed: self.seed,
            min_replicas: self.min_replicas,
            heartbeat_s: self.heartbeat_s,
            fill_trace_gaps: self.fill_trace_gaps,
            ..SimConfig::default()
        };
        cfg.faults =
            FaultRates::parse(&self.faults).map_err(|e| SimError::Faults(e.to_string()))?;
        cfg.lifecycle.cold_start_s = self.cold_start_s;
        if self.sleep {
            cfg.lifecycle.release = Release::Sleep;
        }
        Ok(cfg)
    }
}

/// Reads the trace ([`crate::traces::load`]) and runs the policies; the wall-clock time goes
/// to stderr only, so that the report itself stays byte-for-byte reproducible.
pub fn run(args: &SimulateArgs) -> Result<Report, SimError> {
    let cfg = args.config()?;
    let policies = args
        .policies
        .iter()
        .map(|p| p.parse::<Policy>())
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let trace = crate::traces::load(&args.trace)?;
    let report = nightshift_sim::simulate(&trace, &cfg, &policies)?;
    if let Some(gaps) = report.gaps_summary().filter(|_| !cfg.fill_trace_gaps) {
        eprintln!("warning: the trace has {gaps}");
    }
    eprintln!(
        "simulated {} policies in {:.2} s",
        policies.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(report)
}
