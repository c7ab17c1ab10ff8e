//! The coordinator's `/metrics`: GPUs by state, jobs by state, the queue, harvested GPU time,
//! and the duration of every drain and reclaim phase the agents report, as histograms (the
//! preemption latency that schedulers rarely publish).
//!
//! Gauges are computed from the core at each scrape; the phase histograms accumulate as
//! heartbeats bring new phase records (deduplicated by their sequence numbers).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use nightshift_common::{JobState, NodeMode, PhaseRecord, ReplicaState, SequenceKind, UnixMillis};
use nightshift_core::{Core, Lease};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// Phase durations from 10 ms to about 20 minutes.
#[derive(Clone)]
struct PhaseBuckets;

impl MetricConstructor<Histogram> for PhaseBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new([
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
            1200.0,
        ])
    }
}

pub struct Metrics {
    phases: Family<Labels, Histogram, PhaseBuckets>,
    seen: Mutex<HashMap<String, u64>>,
    /// How long each decision of the core took (it holds the core's lock meanwhile).
    decisions: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            phases: Family::new_with_constructor(PhaseBuckets),
            seen: Mutex::new(HashMap::new()),
            decisions: Histogram::new([
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0,
            ]),
        }
    }
}

/// The states a GPU is counted in.
pub const GPU_STATES: [&str; 6] = [
    "serving",
    "lent",
    "draining",
    "reclaiming",
    "idle",
    "unhealthy",
];

impl Metrics {
    /// Records the phases of `node` not seen before.
    pub fn observe_phases(&self, node: &str, phases: &[PhaseRecord]) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let last = seen.entry(node.to_owned()).or_default();
        let from = *last;
        for p in phases.iter().filter(|p| p.seq > from) {
            let sequence = match p.sequence {
                SequenceKind::Drain => "drain",
                SequenceKind::Reclaim => "reclaim",
            };
            self.phases
                .get_or_create(&vec![
                    ("sequence".into(), sequence.into()),
                    ("phase".into(), p.phase.clone()),
                ])
                .observe(p.duration_ms as f64 / 1000.0);
            *last = p.seq;
        }
    }

    /// One decision of the core took `seconds`.
    pub fn observe_decision(&self, seconds: f64) {
        self.decisions.observe(seconds);
    }

    /// The text exposition of every metric, now.
    pub fn render(&self, core: &Core, now: UnixMillis, harvested_gpu_ms: u64) -> String {
        let mut registry = Registry::with_prefix("nightshift");
        let gpus = Family::<Labels, Gauge>::default();
        for (state, count) in gpu_states(core, now) {
            gpus.get_or_create(&vec![("state".into(), state.into())])
                .set(count);
        }
        registry.register("gpus", "GPUs by what they are doing", gpus);

        let jobs = Family::<Labels, Gauge>::default();
        let mut by_state: BTreeMap<&str, i64> = BTreeMap::new();
        let mut oldest_queued: Option<UnixMillis> = None;
        for (state, submitted_at) in core.job_states() {
            *by_state.entry(state.as_str()).or_default() += 1;
            if state == JobState::Queued {
                oldest_queued = Some(oldest_queued.map_or(submitted_at, |t| t.min(submitted_at)));
            }
        }
        for (state, count) in &by_state {
            jobs.get_or_create(&vec![("state".into(), (*state).into())])
                .set(*count);
        }
        registry.register("jobs", "Jobs by state", jobs);

        let queue_age = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        queue_age.set(oldest_queued.map_or(0.0, |t| now.saturating_sub(t) as f64 / 1000.0));
        registry.register(
            "queue_oldest_age_seconds",
            "Age of the oldest queued job",
            queue_age,
        );
        let queued = Gauge::<i64>::default();
        queued.set(by_state.get("queued").copied().unwrap_or(0));
        registry.register("queue_length", "Jobs waiting in the queue", queued);

        let harvested = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        harvested.inc_by(harvested_gpu_ms as f64 / 1000.0);
        registry.register(
            "harvested_gpu_seconds",
            "GPU-seconds lent to jobs, by ended leases",
            harvested,
        );

        registry.register(
            "phase_duration_seconds",
            "Duration of each drain and reclaim phase reported by agents",
            self.phases.clone(),
        );
        registry.register(
            "decision_duration_seconds",
            "Duration of the decisions (scaling, placement) made after heartbeats and by the ticker; the core serves no other call meanwhile",
            self.decisions.clone(),
        );
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &registry);
        out
    }
}

/// How many GPUs are in each state.
fn gpu_states(core: &Core, now: UnixMillis) -> BTreeMap<&'static str, i64> {
    let mut counts: BTreeMap<&'static str, i64> = GPU_STATES.iter().map(|s| (*s, 0)).collect();
    let ttl = core.config().lease_ttl_ms;
    for name in core.node_names() {
        let Some(n) = core.node(name) else { continue };
        let replica = n.replica.as_ref().map(|r| r.state);
        // Through the per-node index: scanning every lease for every GPU made one scrape of
        // a 10,000-node fleet take seconds, under the core's lock.
        let leases: Vec<&Lease> = core.leases_on(name).collect();
        for g in &n.gpus {
            let healthy = n
                .gpu_status
                .iter()
                .find(|s| s.index == g.index)
                .is_none_or(|s| s.healthy);
            let lease = leases.iter().find(|l| l.gpus.contains(&g.index));
            let state = if !healthy || !n.reachable(now, ttl) {
                "unhealthy"
            } else if let Some(l) = lease {
                if l.revoked { "reclaiming" } else { "lent" }
            } else if n.mode == NodeMode::Lend {
                if replica == Some(ReplicaState::Draining) {
                    "draining"
                } else {
                    "idle"
                }
            } else if replica == Some(ReplicaState::Serving) {
                "serving"
            } else {
                "reclaiming"
            };
            *counts.entry(state).or_default() += 1;
        }
    }
    counts
}
