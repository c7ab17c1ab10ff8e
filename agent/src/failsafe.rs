//! The fail-safe: service first when the coordinator is lost.
//!
//! When the coordinator has been silent for longer than a lease lives (or the configured
//! `failsafe.silence_s`), every lease has expired: the agent stops its jobs (checkpoint
//! signal, grace, kill) and restores serving on its own. It logs that once, at `error`. The
//! leases it stopped become void: it refuses them from then on, even once the coordinator
//! answers again with a desired state that still lists them, and reports them in each
//! heartbeat (`expired_leases`) until the coordinator stops granting them, so that their
//! jobs are requeued as preempted.
//!
//! The coordinator relies on a bound this keeps: it starts a silent node's job on another
//! node only once the old container has surely stopped (its `restart_elsewhere_after_s`,
//! by default the job's grace period and 10 s after the lease expired). The silence is
//! counted from the *sending* of the last heartbeat the coordinator acknowledged (answers to
//! the desired-state long poll do not count: they renew no lease), and the coordinator
//! renews a node's leases for the TTL when it receives a heartbeat, so with `silence_s` at
//! most the TTL (the default: the TTL itself) the fail-safe acts no later than the lease
//! expires, within a reconcile pass (1 s when idle), and the container is gone a grace period
//! and a kill later. With a longer `silence_s`, or the fail-safe disabled, a job may run
//! twice at once unless the coordinator's `restart_elsewhere_after_s` is raised to match;
//! an agent process that is down stops nothing until it is back (each attempt's own
//! checkpoint directory keeps that harmless, see `job.rs`).

use std::time::Duration;

use nightshift_common::DesiredNode;

use crate::engine::Engine;
use crate::gpus::Gpus;
use crate::reconcile::Reconciler;
use crate::serving::ServingMetrics;

impl<E: Engine, G: Gpus, S: ServingMetrics> Reconciler<E, G, S> {
    /// How long the coordinator may be silent before the fail-safe acts.
    fn silence_limit(&self, desired: &DesiredNode) -> Duration {
        self.cfg
            .failsafe
            .silence_s
            .map(Duration::from_secs_f64)
            .unwrap_or(Duration::from_millis(desired.lease_ttl_ms))
    }

    fn silent_for(&self, desired: &DesiredNode) -> Option<Duration> {
        self.shared
            .since_contact()
            .filter(|d| *d > self.silence_limit(desired))
    }

    /// The desired state to act on: the coordinator's, without the void leases; with none
    /// at all while the fail-safe acts. A node whose every listed lease is void serves.
    pub(crate) fn effective_desired(&self) -> Option<DesiredNode> {
        let desired = self.shared.desired()?;
        let failing_safe = self.cfg.failsafe.enabled && self.silent_for(&desired).is_some();
        let leases: Vec<_> = desired
            .leases
            .iter()
            .filter(|l| !failing_safe && !self.void.contains_key(&l.lease_id))
            .cloned()
            .collect();
        if leases.len() == desired.leases.len() {
            return Some(desired);
        }
        Some(DesiredNode {
            serve: desired.serve || leases.is_empty(),
            leases,
            ..desired
        })
    }

    /// Enters or leaves the fail-safe, loudly, and keeps the void leases and their report
    /// up to date.
    pub(crate) fn track_failsafe(&mut self) {
        let Some(desired) = self.shared.desired() else {
            return;
        };
        match self.silent_for(&desired) {
            Some(silent) if !desired.leases.is_empty() => {
                if !self.cfg.failsafe.enabled {
                    if !self.silence_logged {
                        tracing::error!(
                            node = %self.node(), silent_s = silent.as_secs_f64(),
                            leases = ?desired.leases.iter().map(|l| l.lease_id).collect::<Vec<_>>(),
                            "coordinator silent past the lease ttl and the fail-safe is disabled: jobs keep running on expired leases"
                        );
                        self.silence_logged = true;
                    }
                    return;
                }
                let mut newly = Vec::new();
                for l in &desired.leases {
                    if self.void.insert(l.lease_id, l.epoch).is_none() {
                        newly.push(l.lease_id);
                    }
                }
                if !newly.is_empty() {
                    tracing::error!(
                        node = %self.node(), silent_s = silent.as_secs_f64(),
                        limit_s = self.silence_limit(&desired).as_secs_f64(), leases = ?newly,
                        "FAIL-SAFE: the coordinator is silent and these leases expired; checkpointing and stopping their jobs and serving again"
                    );
                }
                self.silence_logged = true;
            }
            Some(_) => {}
            None => {
                if self.silence_logged {
                    tracing::warn!(
                        node = %self.node(), void = ?self.void.keys().collect::<Vec<_>>(),
                        "coordinator answers again; reporting the leases the fail-safe stopped"
                    );
                    self.silence_logged = false;
                }
                // The coordinator has dropped a void lease once it no longer lists it.
                let listed: Vec<u64> = desired.leases.iter().map(|l| l.lease_id).collect();
                self.void.retain(|id, _| listed.contains(id));
            }
        }
        let expired: Vec<u64> = self.void.keys().copied().collect();
        if self.shared.observed().expired_leases != expired {
            self.shared.update(|o| o.expired_leases = expired);
        }
    }
}
