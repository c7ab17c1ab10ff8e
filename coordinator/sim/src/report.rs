//! The figures a run reports per policy, as defined in docs/SIMULATOR.md, and their table
//! and JSON forms.

use serde::Serialize;

use crate::baseline::Window;
use crate::timeline::MinuteSample;
use crate::trace::Gap;
use crate::world::Outcome;

/// One policy's figures. The first ten fields are the contract; the rest explain them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyResult {
    pub name: String,
    pub harvested_gpu_hours: f64,
    pub useful_gpu_hours: f64,
    pub oracle_gpu_hours: f64,
    pub harvest_ratio: f64,
    pub slo_violation_minutes: u64,
    pub preemptions: u64,
    pub lost_gpu_hours: f64,
    pub equivalent_gpus: f64,
    pub savings: f64,
    pub capacity_minutes: u64,
    pub queue_wait_minutes: u64,
    pub slo_violation_minutes_per_day: Vec<u64>,
    /// Per day, the longest any request waited, seconds.
    pub worst_wait_s_per_day: Vec<f64>,
    /// Each minute's 99th-percentile wait, at its 99th percentile over the run's minutes
    /// with requests, milliseconds.
    pub minute_p99_wait_ms: f64,
    pub jobs_completed: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    pub invariant_violations: u64,
    pub invariant_examples: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The run minute by minute, for the charts (not in the JSON).
    #[serde(skip)]
    pub timeline: Timeline,
}

/// One policy's run minute by minute.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    pub minutes: Vec<MinuteSample>,
    /// Each minute's 99th-percentile wait, seconds.
    pub p99_wait_s: Vec<f32>,
}

/// What the whole run was.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunInfo {
    pub trace: String,
    pub days: f64,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub peak_replicas: u32,
    pub seed: u64,
    pub faults: u64,
    pub scale: f64,
    pub requests: u64,
    pub replica_capacity_rps: f64,
    /// Stretches of the trace in which no client sent anything, between windows with load
    /// (`Trace::gaps`): gaps in the recording, as the run found them.
    pub trace_gaps: Vec<Gap>,
    /// Whether those gaps were filled from the windows around them, or simulated as
    /// recorded (no traffic).
    pub trace_gaps_filled: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub run: RunInfo,
    pub policies: Vec<PolicyResult>,
    /// Replicas each minute needs (the same for every policy; not in the JSON).
    #[serde(skip)]
    pub need: Vec<u32>,
}

fn round(x: f64, places: i32) -> f64 {
    let f = 10f64.powi(places);
    (x * f).round() / f
}

const MS_PER_HOUR: f64 = 3_600_000.0;

pub struct Figures {
    pub oracle_gpu_hours: f64,
    pub days: f64,
    pub gpu_hour_price: f64,
}

impl Figures {
    pub fn policy(&self, name: &str, o: &Outcome, window: Option<Window>) -> PolicyResult {
        let l = &o.ledger;
        let harvested = l.harvested_gpu_ms as f64 / MS_PER_HOUR;
        let useful = l.useful_gpu_ms as f64 / MS_PER_HOUR;
        let lost = l.lost_gpu_ms as f64 / MS_PER_HOUR;
        self.result(name, harvested, useful, lost, o, window)
    }

    pub fn result(
        &self,
        name: &str,
        harvested: f64,
        useful: f64,
        lost: f64,
        o: &Outcome,
        window: Option<Window>,
    ) -> PolicyResult {
        let ratio = if self.oracle_gpu_hours > 0.0 {
            useful / self.oracle_gpu_hours
        } else {
            0.0
        };
        PolicyResult {
            name: name.to_owned(),
            harvested_gpu_hours: round(harvested, 2),
            useful_gpu_hours: round(useful, 2),
            oracle_gpu_hours: round(self.oracle_gpu_hours, 2),
            harvest_ratio: round(ratio, 4),
            slo_violation_minutes: o.slo_violation_minutes,
            preemptions: o.ledger.preemptions,
            lost_gpu_hours: round(lost, 2),
            equivalent_gpus: round(useful / (self.days * 24.0), 2),
            savings: round(useful * self.gpu_hour_price, 2),
            capacity_minutes: o.capacity_minutes,
            queue_wait_minutes: o.queue_wait_minutes,
            slo_violation_minutes_per_day: o.slo_minutes_per_day.clone(),
            worst_wait_s_per_day: o
                .waits
                .worst_s_per_day
                .iter()
                .map(|&w| round(w, 3))
                .collect(),
            minute_p99_wait_ms: round(o.waits.p99_of_minute_p99_s * 1_000.0, 1),
            jobs_completed: o.ledger.completed,
            window: window.map(|w| {
                format!(
                    "{:02}:{:02}-{:02}:{:02} lending {}",
                    w.start_s / 3_600,
                    w.start_s % 3_600 / 60,
                    w.end_s / 3_600,
                    w.end_s % 3_600 / 60,
                    w.lent
                )
            }),
            invariant_violations: o.violation_count,
            invariant_examples: o.violations.clone(),
            note: None,
            timeline: Timeline {
                minutes: o.timeline.clone(),
                p99_wait_s: o.waits.minute_p99_s.clone(),
            },
        }
    }
}

/// The policies that are not the product's: what `nightshift` is compared with.
const BASELINES: [&str; 3] = ["fixed-window", "night-20-08", "reactive"];

fn baseline_kind(name: &str) -> &'static str {
    match name {
        "fixed-window" => "one daily window and lent count chosen with hindsight",
        "night-20-08" => "the literal 20:00-08:00 window",
        "reactive" => "the core without prediction",
        _ => "",
    }
}

/// `n` things, `noun` in the plural where `n` is not one (`es` after a sibilant).
fn count(n: u64, noun: &str) -> String {
    match (n, noun.ends_with("ch") || noun.ends_with('s')) {
        (1, _) => format!("1 {noun}"),
        (_, true) => format!("{n} {noun}es"),
        (_, false) => format!("{n} {noun}s"),
    }
}

impl Report {
    /// What the run found of the trace's gaps and did with them, when it found any.
    pub fn gaps_summary(&self) -> Option<String> {
        let r = &self.run;
        let at = r.trace_gaps.first()?.start_s;
        let windows: u64 = r.trace_gaps.iter().map(|g| g.windows).sum();
        Some(format!(
            "{} in {} with no client sending anything between windows with load (the first on day {} at {:02}:{:02}), {}",
            count(windows, "window"),
            count(r.trace_gaps.len() as u64, "stretch"),
            at / 86_400 + 1,
            at % 86_400 / 3_600,
            at % 3_600 / 60,
            if r.trace_gaps_filled {
                "filled from the windows around them"
            } else {
                "simulated as recorded, without traffic (--fill-trace-gaps fills them)"
            }
        ))
    }

    /// What the policies compare against, each named for what it is: the foresight oracle
    /// (an upper bound on every policy's useful GPU-hours) and the best of the baselines
    /// run, by useful GPU-hours among those within the SLO gate.
    pub fn references(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(o) = self.policies.iter().find(|p| p.name == "oracle") {
            lines.push(format!(
                "upper bound: oracle, perfect foresight and free transitions: {:.1} useful GPU-h (ratio 1)",
                o.useful_gpu_hours
            ));
        }
        let best = self
            .policies
            .iter()
            .filter(|p| BASELINES.contains(&p.name.as_str()) && p.slo_violation_minutes == 0)
            .max_by(|a, b| a.useful_gpu_hours.total_cmp(&b.useful_gpu_hours));
        if let Some(b) = best {
            lines.push(format!(
                "best baseline within the SLO gate: {} ({}): {:.1} useful GPU-h (ratio {:.3})",
                b.name,
                baseline_kind(&b.name),
                b.useful_gpu_hours,
                b.harvest_ratio
            ));
        }
        lines
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    pub fn to_table(&self) -> String {
        let r = &self.run;
        let mut s = format!(
            "trace {} · {} days · {} nodes × {} GPUs · peak {} replicas (scale {:.4}, {} requests) · seed {} · {} faults\n\n",
            r.trace,
            r.days,
            r.nodes,
            r.gpus_per_node,
            r.peak_replicas,
            r.scale,
            r.requests,
            r.seed,
            r.faults
        );
        if let Some(gaps) = self.gaps_summary() {
            s.push_str(&format!("trace gaps: {gaps}\n\n"));
        }
        s.push_str(&format!(
            "{:<13} {:>10} {:>10} {:>10} {:>7} {:>8} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>6}\n",
            "POLICY",
            "HARVESTED",
            "USEFUL",
            "ORACLE",
            "RATIO",
            "SLO-MIN",
            "CAP-MIN",
            "WORST-S",
            "P99-MS",
            "PREEMPT",
            "LOST",
            "EQ-GPUS",
            "SAVINGS",
            "INVAR"
        ));
        for p in &self.policies {
            s.push_str(&format!(
                "{:<13} {:>10.1} {:>10.1} {:>10.1} {:>7.3} {:>8} {:>8} {:>9.1} {:>8.0} {:>8} {:>8.1} {:>8.1} {:>10.0} {:>6}\n",
                p.name,
                p.harvested_gpu_hours,
                p.useful_gpu_hours,
                p.oracle_gpu_hours,
                p.harvest_ratio,
                p.slo_violation_minutes,
                p.capacity_minutes,
                p.worst_wait_s_per_day.iter().copied().fold(0.0, f64::max),
                p.minute_p99_wait_ms,
                p.preemptions,
                p.lost_gpu_hours,
                p.equivalent_gpus,
                p.savings,
                p.invariant_violations
            ));
        }
        s.push_str(
            "\nSLO-MIN: minutes whose requests waited over 2 s on average or found no ready replica (the gate); \
             CAP-MIN: minutes with fewer ready replicas than the need at some second (planning); \
             WORST-S: the longest wait of the run, s; P99-MS: each minute's p99 wait, its p99 over the run, ms\n",
        );
        for line in self.references() {
            s.push_str(&format!("{line}\n"));
        }
        for p in &self.policies {
            if let Some(w) = &p.window {
                s.push_str(&format!("\n{}: {w}", p.name));
            }
            if let Some(n) = &p.note {
                s.push_str(&format!("\n{}: {n}", p.name));
            }
            for v in &p.invariant_examples {
                s.push_str(&format!("\n{}: invariant: {v}", p.name));
            }
        }
        s.push('\n');
        s
    }
}
