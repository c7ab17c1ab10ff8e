//! One service's autoscaler: when to lend a serving replica's node, and when to take a lent
//! node back.
//!
//! Taking back is fast: the floor of `min_replicas`, or one reading of queue or running
//! requests over the scale-up thresholds, reclaims a node at once. Lending is careful: the
//! load must stay low for a whole window, the service must be out of its cooldown, the floor
//! must hold without the node, and a queued job must be waiting that fits on it.
//!
//! On top of that, three rules look ahead: a service takes nodes back before its harvest
//! window closes, before the load its profile predicts arrives (both by the measured reclaim
//! lead time), and never lends below the replicas that load will need plus its headroom.

use nightshift_common::{NodeMode, UnixMillis};

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
    /// The highest KV-cache usage among ready replicas.
    kv_max: Option<f64>,
    /// The highest TTFT p95 among ready replicas, in seconds.
    ttft_p95_max: Option<f64>,
    /// Generated tokens per second, summed over ready replicas.
    generation_tokens_per_s: Option<f64>,
    gateway_waiting: u64,
}

/// What the service expects over the reclaim lead time.
struct Outlook {
    /// Whether lending is allowed now and for the whole lead time.
    window_open: bool,
    /// Replicas to have serving now: what the load expected over the reclaim lead time
    /// needs, headroom included; at least `min_replicas`, at most `max_replicas`.
    wanted: usize,
    /// The most replicas wanted in any minute of the last scale-down window: lending never
    /// goes below it, so a load that just fell must stay down a whole window first.
    wanted_window: usize,
}

/// Headroom, in replicas, until the forecast's own errors have been measured.
const PRIOR_HEADROOM: f64 = 0.0;

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
        let outlook = self.outlook(now, &policy, &load);
        if !outlook.window_open {
            // The window is closing: every lent node goes back.
            while let Some(node) = self.cheapest_lent_node(now, &policy.name) {
                self.reclaim(now, &node);
            }
            return;
        }
        let back = self.reclaim_count(&policy, &load, &outlook);
        if back > 0 {
            for _ in 0..back {
                let Some(node) = self.cheapest_lent_node(now, &policy.name) else {
                    break;
                };
                self.reclaim(now, &node);
            }
            return;
        }
        // Ready replicas beyond max_replicas are lendable whatever the load; a node still
        // coming back is not yet one, and lending a ready replica for it would leave the
        // service short until it is.
        let above_max = policy
            .max_replicas
            .map_or(0, |m| load.ready.saturating_sub(m as usize));
        if above_max > 0 {
            for node in self.lend_candidates(now, &policy, above_max) {
                self.set_mode(now, &node, NodeMode::Lend);
            }
            return;
        }
        let spare = self.spare(&policy, &load, outlook.wanted);
        let state = self.services.entry(service.to_owned()).or_default();
        if spare == 0 {
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
        // Low for the whole window; lend no more than the window's busiest moment allows.
        let spare = spare.min(self.spare(&policy, &load, outlook.wanted_window));
        for node in self.lend_candidates(now, &policy, spare) {
            self.set_mode(now, &node, NodeMode::Lend);
        }
    }

    /// One walk of the service's nodes, nothing collected. Sums and maxima are taken in
    /// name order, as an iterator's `sum` and `reduce` over the ready replicas would: a sum
    /// is unknown (`None`) as soon as one ready replica's signal is.
    fn load(&self, now: UnixMillis, policy: &ServicePolicy) -> Load {
        let ttl = self.config.lease_ttl_ms;
        let add = |acc: Option<f64>, v: Option<f64>| Some(acc? + v?);
        let max = |acc: Option<f64>, v: Option<f64>| match (acc, v) {
            (Some(a), Some(v)) => Some(a.max(v)),
            (a, v) => a.or(v),
        };
        let mut load = Load {
            serve_nodes: 0,
            ready: 0,
            // The additive identity that `Sum` for floats starts from.
            waiting: Some(-0.0),
            running: Some(-0.0),
            kv_max: None,
            ttft_p95_max: None,
            generation_tokens_per_s: Some(-0.0),
            gateway_waiting: self
                .services
                .get(&policy.name)
                .and_then(|s| s.gateway)
                .filter(|(_, at)| now < at + policy.gateway_signal_ttl_ms)
                .map_or(0, |(w, _)| w),
        };
        for n in self.nodes.values() {
            if n.service != policy.name || !n.reachable(now, ttl) || n.mode != NodeMode::Serve {
                continue;
            }
            load.serve_nodes += 1;
            if !n.replica_serving() {
                continue;
            }
            load.ready += 1;
            let signals = n.replica.as_ref().map(|r| &r.signals);
            load.waiting = add(load.waiting, signals.and_then(|s| s.requests_waiting));
            load.running = add(load.running, signals.and_then(|s| s.requests_running));
            load.kv_max = max(load.kv_max, signals.and_then(|s| s.kv_cache_usage));
            load.ttft_p95_max = max(load.ttft_p95_max, signals.and_then(|s| s.ttft_p95_s));
            load.generation_tokens_per_s = add(
                load.generation_tokens_per_s,
                signals.and_then(|s| s.generation_tokens_per_s),
            );
        }
        load
    }

    /// The measured time to take a node back and have it serving: the longest of the latest
    /// complete reclaims of the service's nodes, with a quarter added for margin.
    pub(crate) fn reclaim_lead_ms(&self, policy: &ServicePolicy) -> u64 {
        let measured = self
            .nodes
            .values()
            .filter(|n| n.service == policy.name)
            .filter_map(Node::reclaim_ms)
            .max();
        measured.map_or(policy.default_reclaim_lead_ms, |ms| {
            ms + ms / 4 + self.config.heartbeat_interval_ms
        })
    }

    /// Requests in the system (running, waiting, and held at the gateway), when known.
    fn demand(load: &Load) -> Option<f64> {
        match (load.waiting, load.running) {
            (Some(w), Some(r)) if load.ready > 0 => Some(w + r + load.gateway_waiting as f64),
            _ if load.gateway_waiting > 0 => Some(load.gateway_waiting as f64),
            _ => None,
        }
    }

    /// What the service will need over the reclaim lead time. Without prediction, the
    /// replicas the load needs now. With it, the highest of: the last minutes' peak, their
    /// trend one lead time ahead, and the learned profile's peak over the lead time; plus
    /// headroom sized by how far such forecasts fell short before. Feeds the profile and
    /// the short-term record with the load seen now.
    fn outlook(&mut self, now: UnixMillis, policy: &ServicePolicy, load: &Load) -> Outlook {
        let lead = self.reclaim_lead_ms(policy);
        let window_open = crate::calendar::open_for(
            &policy.harvest_windows,
            now,
            lead,
            policy.utc_offset_minutes,
        );
        let per = policy.scale_up.running_per_replica.max(f64::MIN_POSITIVE);
        let demand = Self::demand(load);
        let offset = policy.utc_offset_minutes;
        let state = self.services.entry(policy.name.clone()).or_default();
        let mut profile_changed = false;
        // Smoothing over a twentieth of the scale-down window (30 s of the default 10 min)
        // keeps one busy second from taking nodes back; lending waits the window anyway.
        let smooth_ms = policy.scale_down.window_ms / 20;
        if let Some(d) = demand.filter(|_| load.ready > 0) {
            // The profile learns each minute's mean load, the measure the SLO holds
            // capacity to.
            if let Some((minute, mean)) = state.profile.observe_recent(now, d, per, smooth_ms) {
                profile_changed = state.profile.observe(minute, offset, mean);
            }
        }
        let (forecast, with_profile, replicas) = if policy.predictive {
            let profile = state.profile.predict_peak(now, now + lead, offset);
            let st = state.profile.short_term(
                now,
                demand.unwrap_or(0.0),
                lead,
                profile.is_some(),
                PRIOR_HEADROOM,
            );
            let forecast = st.trend.max(profile.unwrap_or(0.0));
            let replicas = replicas_for(forecast / per + st.headroom);
            (forecast, profile.is_some(), replicas)
        } else {
            let now_load = demand.unwrap_or(0.0);
            (now_load, false, replicas_for(now_load / per))
        };
        let mut wanted = (replicas + policy.headroom as usize).max(policy.min_replicas as usize);
        if let Some(max) = policy.max_replicas {
            wanted = wanted.min((max as usize).max(policy.min_replicas as usize));
        }
        state
            .profile
            .note_forecast(now, forecast, with_profile, lead, wanted);
        let wanted_window = state
            .profile
            .wanted_since(now.saturating_sub(policy.scale_down.window_ms))
            .unwrap_or(wanted)
            .max(wanted);
        if profile_changed {
            self.profile_changed(&policy.name);
        }
        Outlook {
            window_open,
            wanted,
            wanted_window,
        }
    }

    /// How many lent nodes to take back now: enough to reach the replicas wanted (the
    /// floor and the forecast do not wait), or one for pressure on the serving replicas
    /// when none is already coming back.
    fn reclaim_count(&self, policy: &ServicePolicy, load: &Load, outlook: &Outlook) -> usize {
        let at_max = policy
            .max_replicas
            .is_some_and(|m| load.serve_nodes >= m as usize);
        let coming_back = load.serve_nodes > load.ready;
        let pressure = if load.ready == 0 {
            load.gateway_waiting > 0
        } else {
            let per = |v: Option<f64>| v.map(|v| v / load.ready as f64);
            load.gateway_waiting > 0
                || per(load.waiting).is_some_and(|w| w >= policy.scale_up.waiting_per_replica)
                || per(load.running).is_some_and(|r| r >= policy.scale_up.running_per_replica)
                || load
                    .kv_max
                    .is_some_and(|kv| kv >= policy.scale_up.kv_cache_usage)
                || matches!((load.ttft_p95_max, policy.scale_up.ttft_p95_s),
                    (Some(t), Some(limit)) if t >= limit)
                || matches!((per(load.generation_tokens_per_s), policy.scale_up.generation_tokens_per_s_per_replica),
                    (Some(t), Some(limit)) if t >= limit)
        };
        let floor = (policy.min_replicas as usize).saturating_sub(load.serve_nodes);
        let short = outlook.wanted.saturating_sub(load.serve_nodes);
        let pressed = usize::from(pressure && !coming_back && !at_max);
        floor.max(short).max(pressed)
    }

    /// The lent node whose return costs the least: idle ones first, then the one whose jobs
    /// have the lowest priority, then one whose jobs are all past the preemption-exempt time,
    /// then the one that loses the least work (GPUs times the time since each job's last
    /// checkpoint, counting every node of a gang, since a gang is taken back whole).
    fn cheapest_lent_node(&self, now: UnixMillis, service: &str) -> Option<String> {
        let ttl = self.config.lease_ttl_ms;
        self.nodes
            .values()
            .filter(|n| n.service == service && n.mode == NodeMode::Lend && n.reachable(now, ttl))
            .min_by_key(|n| {
                let jobs = self.jobs_on(&n.name);
                let busy = !jobs.is_empty();
                let priority = jobs
                    .iter()
                    .map(|j| j.spec.priority)
                    .max()
                    .unwrap_or(i32::MIN);
                let exempt = jobs.iter().any(|j| {
                    j.attempt_started_at
                        .is_none_or(|t| now < t + self.config.preempt_exempt_ms)
                        && self.config.preempt_exempt_ms > 0
                });
                let lost: u64 = jobs.iter().map(|j| self.work_at_risk(now, j)).sum();
                (busy, priority, exempt, lost, n.name.clone())
            })
            .map(|n| n.name.clone())
    }

    /// Jobs holding a live lease on `node`, each once.
    fn jobs_on(&self, node: &str) -> Vec<&crate::job::Job> {
        let mut ids: Vec<u64> = self
            .leases
            .on_node(node)
            .filter(|l| !l.revoked)
            .map(|l| l.job)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.iter().filter_map(|id| self.jobs.get(id)).collect()
    }

    /// GPU-milliseconds a job would lose if stopped now: all its GPUs, times the time since
    /// its last checkpoint (or since its attempt started).
    pub(crate) fn work_at_risk(&self, now: UnixMillis, job: &crate::job::Job) -> u64 {
        let since = job
            .last_checkpoint_at
            .max(job.attempt_started_at)
            .unwrap_or(now);
        let gpus = u64::from(job.spec.gpus) * u64::from(job.spec.nodes);
        now.saturating_sub(since) * gpus
    }

    /// Takes `node` back: every job on it is preempted (a gang on all its nodes).
    fn reclaim(&mut self, now: UnixMillis, node: &str) {
        let jobs: Vec<u64> = self.jobs_on(node).iter().map(|j| j.id).collect();
        for job in jobs {
            let _ = self.job_event(now, job, crate::job::JobEvent::Preempt);
        }
        self.set_mode(now, node, NodeMode::Serve);
    }

    /// How many serving replicas could be lent, keeping `wanted`: none unless the signals
    /// are low (nothing waiting, KV cache, TTFT and token rate under their limits, every
    /// serving node ready); then those beyond `wanted` and beyond what keeps the running
    /// requests at most `max_running_per_replica` on each remaining replica, less the
    /// headroom.
    fn spare(&self, policy: &ServicePolicy, load: &Load, wanted: usize) -> usize {
        if load.gateway_waiting > 0 || load.ready == 0 || load.ready < load.serve_nodes {
            return 0;
        }
        let (Some(waiting), Some(running)) = (load.waiting, load.running) else {
            return 0;
        };
        let headroom = policy.headroom as usize;
        let low = waiting <= policy.scale_down.max_waiting
            && load
                .kv_max
                .is_none_or(|kv| kv <= policy.scale_down.max_kv_cache_usage)
            && !matches!((load.ttft_p95_max, policy.scale_up.ttft_p95_s),
                (Some(t), Some(limit)) if t >= limit / 2.0);
        if !low {
            return 0;
        }
        // Replicas the running requests need at the lending threshold.
        let max_running = policy.scale_down.max_running_per_replica;
        let for_running = if running <= 0.0 {
            0
        } else if max_running <= 0.0 {
            return 0;
        } else {
            (running / max_running).ceil() as usize
        };
        let mut keep = (for_running + headroom)
            .max(wanted)
            .max(policy.min_replicas as usize)
            .max(headroom);
        // Generated tokens per second stay under half the limit on the remaining replicas.
        if let (Some(t), Some(limit)) = (
            load.generation_tokens_per_s,
            policy.scale_up.generation_tokens_per_s_per_replica,
        ) {
            let half = limit / 2.0;
            if half <= 0.0 {
                return 0;
            }
            keep = keep.max((t / half).floor() as usize + 1 + headroom);
        }
        load.ready.saturating_sub(keep)
    }

    /// Up to `spare` serving nodes worth lending: as many as the runnable queued jobs need
    /// beyond the GPUs lent nodes already have free, by the placement the scheduler will
    /// then make ([`Core::lending_plan`]).
    fn lend_candidates(
        &self,
        now: UnixMillis,
        policy: &ServicePolicy,
        spare: usize,
    ) -> Vec<String> {
        // Nothing runnable is queued (the usual case once the queue is placed): no node is
        // worth lending, and no node needs looking at.
        if spare == 0 || self.index.runnable(now).next().is_none() {
            return Vec::new();
        }
        let ttl = self.config.lease_ttl_ms;
        let mut candidates: Vec<&Node> = self
            .nodes
            .values()
            .filter(|n| {
                n.service == policy.name
                    && n.mode == NodeMode::Serve
                    && n.replica_serving()
                    && n.reachable(now, ttl)
                    && !n.occupies_any()
            })
            .collect();
        if candidates.is_empty() {
            return Vec::new();
        }
        // Lend the nodes with the fewest GPUs that fit, to keep big nodes for big jobs (a
        // stable sort: by name among equals, the map's order).
        candidates.sort_by_key(|n| n.gpus.len());
        let healthy: Vec<usize> = candidates.iter().map(|n| n.healthy_gpus()).collect();
        let names: Vec<&str> = candidates.iter().map(|n| n.name.as_str()).collect();
        self.lending_plan(now, &names, &healthy, spare)
            .into_iter()
            .map(|i| candidates[i].name.clone())
            .collect()
    }
}

/// Whole replicas for a fractional need, ignoring the last hundredth of a replica (the dust a
/// smoothed load leaves as it decays towards zero).
fn replicas_for(need: f64) -> usize {
    (need - 0.01).ceil().max(0.0) as usize
}
