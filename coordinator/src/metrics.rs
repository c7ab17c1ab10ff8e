//! The coordinator's `/metrics`: GPUs by service and state, jobs by state, the queue,
//! finished jobs and preemptions, harvested GPU time by service, each replica's vLLM queue
//! (by service and node, as its agent reports it), and the duration of every drain and
//! reclaim phase the agents report, as histograms (the preemption latency that schedulers
//! rarely publish). `packaging/grafana/nightshift.json` reads them; `tests/tests/prometheus.rs`
//! proves every panel of it against a real Prometheus.
//!
//! Gauges are computed from the core at each scrape, and so are the counters of durable
//! facts (finished jobs and preemptions from the jobs, harvested time from the store's
//! accounting), which therefore survive a restart; the phase histograms accumulate as
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

    /// The text exposition of every metric, now; `harvested_gpu_ms` is the store's
    /// GPU-milliseconds of ended leases by node.
    pub fn render(
        &self,
        core: &Core,
        now: UnixMillis,
        harvested_gpu_ms: &[(String, u64)],
    ) -> String {
        let mut registry = Registry::with_prefix("nightshift");
        // Every configured service's every state, zeros included, so that a state no GPU is
        // in reads 0 rather than no data.
        let services: Vec<&str> = core
            .config()
            .services
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        let gpus = Family::<Labels, Gauge>::default();
        for service in &services {
            for state in GPU_STATES {
                gpus.get_or_create(&service_labels(service, &[("state", state)]))
                    .set(0);
            }
        }
        for ((service, state), count) in gpu_states(core, now) {
            gpus.get_or_create(&service_labels(service, &[("state", state)]))
                .set(count);
        }
        registry.register("gpus", "GPUs by service and what they are doing", gpus);

        let jobs = Family::<Labels, Gauge>::default();
        let finished = Family::<Labels, Counter>::default();
        for state in JobState::ALL {
            jobs.get_or_create(&vec![("state".into(), state.as_str().into())])
                .set(0);
            if state.is_finished() {
                finished
                    .get_or_create(&vec![("state".into(), state.as_str().into())])
                    .inc_by(0);
            }
        }
        let mut oldest_queued: Option<UnixMillis> = None;
        let (mut queued, mut preemptions) = (0, 0u64);
        for (state, submitted_at, preempted) in core.job_states() {
            let labels = vec![("state".into(), state.as_str().into())];
            jobs.get_or_create(&labels).inc();
            if state.is_finished() {
                // A finished job stays so and is never deleted: counting them is a counter.
                finished.get_or_create(&labels).inc();
            }
            if state == JobState::Queued {
                queued += 1;
                oldest_queued = Some(oldest_queued.map_or(submitted_at, |t| t.min(submitted_at)));
            }
            preemptions += u64::from(preempted);
        }
        registry.register("jobs", "Jobs by state", jobs);
        registry.register(
            "jobs_finished",
            "Jobs that finished, by how (succeeded, failed, cancelled)",
            finished,
        );
        let preempted = Counter::<u64>::default();
        preempted.inc_by(preemptions);
        registry.register(
            "job_preemptions",
            "Attempts of jobs ended by a preemption (a reclaim, a lost node); each was requeued",
            preempted,
        );

        let queue_age = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        queue_age.set(oldest_queued.map_or(0.0, |t| now.saturating_sub(t) as f64 / 1000.0));
        registry.register(
            "queue_oldest_age_seconds",
            "Age of the oldest queued job",
            queue_age,
        );
        let queue_length = Gauge::<i64>::default();
        queue_length.set(queued);
        registry.register("queue_length", "Jobs waiting in the queue", queue_length);

        let wall_offset = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        wall_offset.set(crate::clock::wall_offset_ms() as f64 / 1000.0);
        registry.register(
            "wall_clock_offset_seconds",
            "How far the wall clock has stepped from the coordinator's monotonic time since it started (leases and liveness keep the latter)",
            wall_offset,
        );

        let harvested = Family::<Labels, Counter<f64, std::sync::atomic::AtomicU64>>::default();
        for service in &services {
            harvested
                .get_or_create(&service_labels(service, &[]))
                .inc_by(0.0);
        }
        for (node, gpu_ms) in harvested_gpu_ms {
            // A node forgotten since (none is, today) counts under no service.
            let service = core.node(node).map_or("", |n| n.service.as_str());
            harvested
                .get_or_create(&service_labels(service, &[]))
                .inc_by(*gpu_ms as f64 / 1000.0);
        }
        registry.register(
            "harvested_gpu_seconds",
            "GPU-seconds lent to jobs, by the service whose nodes lent them, counted when each lease ends",
            harvested,
        );

        let (waiting, running) = (
            Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default(),
            Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default(),
        );
        let ttl = core.config().lease_ttl_ms;
        for name in core.node_names() {
            let Some(n) = core.node(name) else { continue };
            // A silent node's last signals are stale: no series rather than old numbers.
            let Some(signals) = n
                .replica
                .as_ref()
                .filter(|_| n.reachable(now, ttl))
                .map(|r| &r.signals)
            else {
                continue;
            };
            let labels = service_labels(&n.service, &[("node", name)]);
            if let Some(v) = signals.requests_waiting {
                waiting.get_or_create(&labels).set(v);
            }
            if let Some(v) = signals.requests_running {
                running.get_or_create(&labels).set(v);
            }
        }
        registry.register(
            "vllm_requests_waiting",
            "Requests waiting in each replica's vLLM queue, as its agent last reported",
            waiting,
        );
        registry.register(
            "vllm_requests_running",
            "Requests each replica's vLLM is running, as its agent last reported",
            running,
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

/// `service="S"` then `extra`.
fn service_labels(service: &str, extra: &[(&str, &str)]) -> Labels {
    let mut labels = vec![("service".to_owned(), service.to_owned())];
    labels.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    labels
}

/// How many GPUs of each service are in each state.
fn gpu_states(core: &Core, now: UnixMillis) -> BTreeMap<(&str, &'static str), i64> {
    let mut counts = BTreeMap::new();
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
            *counts.entry((n.service.as_str(), state)).or_default() += 1;
        }
    }
    counts
}
