//! The last 24 hours of each service at a glance, for the web UI's overview: replicas
//! serving, GPUs lent and the load vLLM reports, sampled by the ticker once a minute.
//!
//! The samples live in memory only (1,440 per service a day): a restarted coordinator's
//! chart starts empty. What is durable about the past (leases, hence GPU-hours) is in the
//! store and the report; this is a glance, not a record.

use std::collections::VecDeque;
use std::sync::Mutex;

use nightshift_common::{NodeMode, NodeView, ReplicaState, UnixMillis};

/// How often a sample is taken.
pub const EVERY_MS: u64 = 60_000;
/// How far back samples are kept.
pub const SPAN_MS: u64 = 24 * 3_600_000;

/// One service at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at: UnixMillis,
    pub service: String,
    /// Replicas serving (ready for requests).
    pub serving: u32,
    /// GPUs of its nodes lent to jobs.
    pub lent_gpus: u32,
    /// Requests running and waiting in its replicas, as vLLM reports them; `None` when no
    /// replica reported either.
    pub load: Option<f64>,
}

#[derive(Debug, Default)]
pub struct Timeline {
    samples: Mutex<VecDeque<Sample>>,
    last: Mutex<Option<UnixMillis>>,
}

impl Timeline {
    /// Takes a sample of `nodes` (called for only when one is due) if the last is
    /// [`EVERY_MS`] old, and forgets those older than [`SPAN_MS`].
    pub fn note(&self, now: UnixMillis, nodes: impl FnOnce() -> Vec<NodeView>) {
        {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|l| now < l + EVERY_MS) {
                return;
            }
            *last = Some(now);
        }
        let new = sample(now, &nodes());
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples.extend(new);
        while samples.front().is_some_and(|s| s.at + SPAN_MS < now) {
            samples.pop_front();
        }
    }

    /// The samples of `service` since `since`, oldest first.
    pub fn of(&self, service: &str, since: UnixMillis) -> Vec<Sample> {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples
            .iter()
            .filter(|s| s.service == service && s.at >= since)
            .cloned()
            .collect()
    }
}

/// One sample per service of `nodes`.
pub fn sample(at: UnixMillis, nodes: &[NodeView]) -> Vec<Sample> {
    let mut out: Vec<Sample> = Vec::new();
    for n in nodes {
        let i = match out.iter().position(|s| s.service == n.service) {
            Some(i) => i,
            None => {
                out.push(Sample {
                    at,
                    service: n.service.clone(),
                    serving: 0,
                    lent_gpus: 0,
                    load: None,
                });
                out.len() - 1
            }
        };
        let s = &mut out[i];
        if let Some(r) = &n.replica {
            if n.mode == NodeMode::Serve && r.state == ReplicaState::Serving && n.reachable {
                s.serving += 1;
            }
            let load = [r.signals.requests_running, r.signals.requests_waiting]
                .into_iter()
                .flatten()
                .reduce(|a, b| a + b);
            if let Some(l) = load {
                s.load = Some(s.load.unwrap_or(0.0) + l);
            }
        }
        if n.mode == NodeMode::Lend {
            s.lent_gpus += n.gpus.len() as u32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::{NodeGpuView, ReplicaStatus, ServingSignals};

    fn node(name: &str, mode: NodeMode, state: ReplicaState, running: Option<f64>) -> NodeView {
        NodeView {
            name: name.into(),
            service: "llm".into(),
            mode,
            desired_version: 1,
            applied_version: 1,
            gpus: (0..4)
                .map(|i| NodeGpuView {
                    index: i,
                    uuid: format!("GPU-{i}"),
                    name: "H100".into(),
                    memory_total_bytes: 80 << 30,
                    memory_used_bytes: None,
                    job_id: None,
                    healthy: Some(true),
                    unhealthy_reason: None,
                    utilization_gpu_percent: None,
                    power_milliwatts: None,
                    temperature_celsius: None,
                })
                .collect(),
            replica: Some(ReplicaStatus {
                state,
                signals: ServingSignals {
                    requests_running: running,
                    requests_waiting: running.map(|_| 1.0),
                    ..ServingSignals::default()
                },
                url: None,
            }),
            reachable: true,
            last_heartbeat: Some(0),
            recent_phases: Vec::new(),
        }
    }

    #[test]
    fn a_sample_counts_serving_replicas_lent_gpus_and_load() {
        let nodes = [
            node("a", NodeMode::Serve, ReplicaState::Serving, Some(3.0)),
            node("b", NodeMode::Lend, ReplicaState::Stopped, None),
        ];
        let s = sample(7, &nodes);
        assert_eq!(
            s,
            vec![Sample {
                at: 7,
                service: "llm".into(),
                serving: 1,
                lent_gpus: 4,
                load: Some(4.0),
            }]
        );
    }

    #[test]
    fn samples_are_taken_once_a_minute_and_kept_a_day() {
        let t = Timeline::default();
        let nodes = || vec![node("a", NodeMode::Serve, ReplicaState::Serving, None)];
        t.note(0, nodes);
        t.note(EVERY_MS - 1, || panic!("not due"));
        t.note(EVERY_MS, nodes);
        assert_eq!(t.of("llm", 0).len(), 2);
        t.note(SPAN_MS + EVERY_MS + 1, nodes);
        let kept: Vec<u64> = t.of("llm", 0).iter().map(|s| s.at).collect();
        assert_eq!(kept, vec![SPAN_MS + EVERY_MS + 1]);
        assert!(t.of("other", 0).is_empty());
    }
}
