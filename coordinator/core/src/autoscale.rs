//! One service's autoscaler: when to lend a serving replica's node, and when to take a lent
//! node back.
//!
//! Taking back is fast: the floor of `min_replicas`, or one reading of queue or running
//! requests over the scale-up thresholds, reclaims a node at once. Lending is careful: the
//! load must stay low for a whole window, the service must be out of its cooldown, the floor
//! must hold without the node, and a queued job must be waiting that fits on it.

use nightshift_common::{JobState, NodeMode, UnixMillis};

use crate::config::ServicePolicy;
use crate::core::Core;
use crate::node::Node;

/// The service's load, summed over its serving replicas.
struct Load {
    /// Nodes in serve mode (serving, starting or draining back).
    serve_nodes: usize,
    /// Replicas that are up and ready.
    ready: usize,
    /// Unknown when any ready replica's signals are unknown.
    waiting: Option<f64>,
    running: Option<f64>,
    gateway_waiting: u64,
}

impl Core {
    pub(crate) fn autoscale(&mut self, now: UnixMillis, service: &str) {
        let Some(policy) = self
            .config
            .services
            .iter()
            .find(|p| p.name == service)
            .cloned()
        else {
            return;
        };
        let load = self.load(now, &policy);
        if let Some(node) = self.reclaim_candidate(now, &policy, &load) {
            self.reclaim(now, &node);
            return;
        }
        let low = self.is_low(&policy, &load);
        let state = self.services.entry(service.to_owned()).or_default();
        if !low {
            state.low_since = None;
            return;
        }
        let low_since = *state.low_since.get_or_insert(now);
        let cooled = state
            .last_change
            .is_none_or(|t| now >= t + policy.cooldown_ms);
        if now < low_since + policy.scale_down.window_ms || !cooled {
            return;
        }
        if load.serve_nodes <= policy.min_replicas as usize {
            return;
        }
        if let Some(node) = self.lend_candidate(now, &policy) {
            self.set_mode(now, &node, NodeMode::Lend);
        }
    }

    fn load(&self, now: UnixMillis, policy: &ServicePolicy) -> Load {
        let ttl = self.config.lease_ttl_ms;
        let nodes: Vec<&Node> = self
            .nodes
            .values()
            .filter(|n| n.service == policy.name && n.reachable(now, ttl))
            .collect();
        let ready: Vec<&Node> = nodes
            .iter()
            .copied()
            .filter(|n| n.mode == NodeMode::Serve && n.replica_serving())
            .collect();
        let sum = |f: fn(&Node) -> Option<f64>| -> Option<f64> {
            ready.iter().map(|n| f(n)).sum::<Option<f64>>()
        };
        let gateway_waiting = self
            .services
            .get(&policy.name)
            .and_then(|s| s.gateway)
            .filter(|(_, at)| now < at + policy.gateway_signal_ttl_ms)
            .map_or(0, |(w, _)| w);
        Load {
            serve_nodes: nodes.iter().filter(|n| n.mode == NodeMode::Serve).count(),
            ready: ready.len(),
            waiting: sum(|n| n.replica.as_ref()?.signals.requests_waiting),
            running: sum(|n| n.replica.as_ref()?.signals.requests_running),
            gateway_waiting,
        }
    }

    /// A lent node to take back now, if the service needs one.
    fn reclaim_candidate(
        &self,
        now: UnixMillis,
        policy: &ServicePolicy,
        load: &Load,
    ) -> Option<String> {
        let below_floor = load.serve_nodes < policy.min_replicas as usize;
        let coming_back = load.serve_nodes > load.ready;
        let pressure = if load.ready == 0 {
            load.gateway_waiting > 0
        } else {
            let per = |v: Option<f64>| v.map(|v| v / load.ready as f64);
            load.gateway_waiting > 0
                || per(load.waiting).is_some_and(|w| w >= policy.scale_up.waiting_per_replica)
                || per(load.running).is_some_and(|r| r >= policy.scale_up.running_per_replica)
        };
        // One replica coming back at a time answers pressure; the floor does not wait.
        if !(below_floor || (pressure && !coming_back)) {
            return None;
        }
        self.cheapest_lent_node(now, &policy.name)
    }

    /// The lent node whose return costs the least: idle ones first, then the one whose jobs
    /// have the lowest priority, then the one whose jobs started last (least work lost).
    fn cheapest_lent_node(&self, now: UnixMillis, service: &str) -> Option<String> {
        let ttl = self.config.lease_ttl_ms;
        self.nodes
            .values()
            .filter(|n| n.service == service && n.mode == NodeMode::Lend && n.reachable(now, ttl))
            .min_by_key(|n| {
                let jobs: Vec<_> = self
                    .leases
                    .on_node(&n.name)
                    .filter(|l| !l.revoked)
                    .filter_map(|l| self.jobs.get(&l.job))
                    .collect();
                let busy = !jobs.is_empty();
                let priority = jobs
                    .iter()
                    .map(|j| j.spec.priority)
                    .max()
                    .unwrap_or(i32::MIN);
                let newest_start = jobs
                    .iter()
                    .filter_map(|j| j.started_at.or(Some(now)))
                    .max()
                    .unwrap_or(now);
                (
                    busy,
                    priority,
                    std::cmp::Reverse(newest_start),
                    n.name.clone(),
                )
            })
            .map(|n| n.name.clone())
    }

    fn reclaim(&mut self, now: UnixMillis, node: &str) {
        let leases: Vec<u64> = self
            .leases
            .on_node(node)
            .filter(|l| !l.revoked)
            .map(|l| l.id)
            .collect();
        for lease in leases {
            let Some(job) = self.leases.get(lease).map(|l| l.job) else {
                continue;
            };
            self.revoke(lease);
            let _ = self.job_event(now, job, crate::job::JobEvent::Preempt);
        }
        self.set_mode(now, node, NodeMode::Serve);
    }

    fn is_low(&self, policy: &ServicePolicy, load: &Load) -> bool {
        if load.gateway_waiting > 0 || load.ready == 0 || load.ready < load.serve_nodes {
            return false;
        }
        let (Some(waiting), Some(running)) = (load.waiting, load.running) else {
            return false;
        };
        let remaining = (load.ready - 1) as f64;
        waiting <= policy.scale_down.max_waiting
            && running <= policy.scale_down.max_running_per_replica * remaining
    }

    /// A serving node worth lending: one on which the first queued job that fits anywhere
    /// would fit.
    fn lend_candidate(&self, now: UnixMillis, policy: &ServicePolicy) -> Option<String> {
        let ttl = self.config.lease_ttl_ms;
        let candidates: Vec<&Node> = self
            .nodes
            .values()
            .filter(|n| {
                n.service == policy.name
                    && n.mode == NodeMode::Serve
                    && n.replica_serving()
                    && n.reachable(now, ttl)
            })
            .collect();
        let first_queued = self.queue().into_iter().next()?;
        let gpus = self.jobs.get(&first_queued)?.spec.gpus as usize;
        candidates
            .into_iter()
            .filter(|n| n.gpus.len() >= gpus && n.occupied_gpus().is_empty())
            // Lend the node with the fewest GPUs that fits, to keep big nodes for big jobs.
            .min_by_key(|n| (n.gpus.len(), n.name.clone()))
            .map(|n| n.name.clone())
    }

    /// Queued jobs in the order they run: higher priority first, then first submitted.
    pub(crate) fn queue(&self) -> Vec<u64> {
        let mut queued: Vec<_> = self
            .jobs
            .values()
            .filter(|j| j.state == JobState::Queued)
            .collect();
        queued.sort_by_key(|j| (std::cmp::Reverse(j.spec.priority), j.submitted_at, j.id));
        queued.into_iter().map(|j| j.id).collect()
    }
}
