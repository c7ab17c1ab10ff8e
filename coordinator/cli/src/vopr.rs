//! `nightshift vopr`: the whole-system fault simulation (`nightshift_sim::vopr`) behind the
//! CLI's flags. Seeds of a small fleet under random faults, the real core and the agent's
//! real planner on every host, every invariant after every simulated second; a failing seed
//! is printed with the fewest faults that still reproduce it, and the command exits 1.

use std::collections::BTreeMap;
use std::time::Instant;

use nightshift_sim::vopr::{self, Summary, VoprConfig};
use serde::Serialize;

/// Flags of `nightshift vopr`.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct VoprArgs {
    /// How many seeds to run.
    #[arg(long, default_value_t = 100)]
    pub seeds: u64,
    /// The first seed; seeds FIRST..FIRST+SEEDS run. `--first-seed S --seeds 1` replays S.
    #[arg(long, default_value_t = 0)]
    pub first_seed: u64,
    /// Simulated days per seed.
    #[arg(long, default_value_t = 1.0)]
    pub days: f64,
    /// Hosts in each seed's fleet (4 GPUs each).
    #[arg(long, default_value_t = 8)]
    pub nodes: u32,
    /// Faults injected per simulated day, of every kind.
    #[arg(long, default_value_t = 60)]
    pub faults_per_day: u32,
}

impl Eq for VoprArgs {}

/// What `nightshift vopr` reports (the wall-clock rate goes to stderr, so that the report
/// of a seed range is the same on every machine).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VoprReport {
    pub seeds: u64,
    pub first_seed: u64,
    pub days: f64,
    pub nodes: u32,
    pub faults_per_day: u32,
    pub simulated_host_hours: f64,
    pub faults: BTreeMap<&'static str, u64>,
    pub failures: Vec<Failure>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Failure {
    pub seed: u64,
    /// The simulated second of the first violation, with the faults shrunk.
    pub at_s: Option<u64>,
    pub violations: Vec<String>,
    /// The fewest faults found that still reproduce a violation.
    pub faults: Vec<String>,
}

impl VoprArgs {
    fn config(&self) -> Result<VoprConfig, String> {
        if !(self.days > 0.0 && self.days.is_finite()) {
            return Err(format!("--days must be positive, not {}", self.days));
        }
        if self.nodes < 2 {
            return Err(format!("--nodes must be at least 2, not {}", self.nodes));
        }
        Ok(VoprConfig {
            days: self.days,
            nodes: self.nodes,
            faults_per_day: self.faults_per_day,
        })
    }
}

/// Runs the seeds; the rate, in simulated host-hours per wall-clock second, goes to stderr.
pub fn run(args: &VoprArgs) -> Result<VoprReport, String> {
    let cfg = args.config()?;
    let started = Instant::now();
    let end = args
        .first_seed
        .checked_add(args.seeds)
        .ok_or("--first-seed and --seeds run past the last seed")?;
    let summary: Summary = vopr::run(args.first_seed..end, &cfg);
    let wall = started.elapsed().as_secs_f64();
    eprintln!(
        "{} seeds, {:.0} simulated host-hours in {wall:.2} s: {:.0} host-hours per second",
        summary.seeds,
        summary.host_hours,
        summary.host_hours / wall.max(1e-9)
    );
    Ok(VoprReport {
        seeds: summary.seeds,
        first_seed: args.first_seed,
        days: args.days,
        nodes: args.nodes,
        faults_per_day: args.faults_per_day,
        simulated_host_hours: (summary.host_hours * 100.0).round() / 100.0,
        faults: summary.faults,
        failures: summary
            .failures
            .iter()
            .map(|f| Failure {
                seed: f.seed,
                at_s: f.stopped_at_s,
                violations: f.violations.clone(),
                faults: f.faults.iter().map(ToString::to_string).collect(),
            })
            .collect(),
    })
}

impl VoprReport {
    pub fn to_table(&self) -> String {
        let mut s = format!(
            "seeds {}..{} ({} days, {} hosts each): {:.0} simulated host-hours\nfaults:",
            self.first_seed,
            self.first_seed + self.seeds,
            self.days,
            self.nodes,
            self.simulated_host_hours
        );
        for (kind, n) in &self.faults {
            s += &format!(" {kind} {n},");
        }
        s.pop();
        s.push('\n');
        if self.failures.is_empty() {
            s += "no invariant violated\n";
        }
        for f in &self.failures {
            s += &format!("FAILED seed {}: {}\n", f.seed, f.violations.join("; "));
            s += &format!(
                "  reproduce: nightshift vopr --first-seed {} --seeds 1 --days {} --nodes {} --faults-per-day {}\n  the faults it needs ({}):\n",
                f.seed,
                self.days,
                self.nodes,
                self.faults_per_day,
                f.faults.len()
            );
            for fault in &f.faults {
                s += &format!("    {fault}\n");
            }
        }
        s
    }
}
