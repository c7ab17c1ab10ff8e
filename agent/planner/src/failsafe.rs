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

use std::borrow::Cow;

use nightshift_common::{DesiredNode, LeaseGrant};

use crate::config::PlanConfig;
use crate::plan::Memory;

/// How long the coordinator may be silent before the fail-safe acts.
pub fn silence_limit(cfg: &PlanConfig, desired: &DesiredNode) -> Duration {
    let limit = cfg
        .failsafe_silence
        .unwrap_or(Duration::from_millis(desired.lease_ttl_ms));
    // The planted bug the fault simulation must find (the feature's comment in Cargo.toml).
    #[cfg(feature = "inject-late-failsafe")]
    let limit = limit * 4;
    limit
}

/// How long the coordinator has been silent past the limit, if it has.
fn silent_for(
    cfg: &PlanConfig,
    desired: &DesiredNode,
    since_contact: Option<Duration>,
) -> Option<Duration> {
    since_contact.filter(|d| *d > silence_limit(cfg, desired))
}

/// The desired state to act on: the coordinator's, without the void leases; with none at
/// all while the fail-safe acts. A node whose every listed lease is void serves.
pub fn effective<'a>(
    cfg: &PlanConfig,
    desired: &'a DesiredNode,
    since_contact: Option<Duration>,
    mem: &Memory,
) -> Cow<'a, DesiredNode> {
    let failing_safe = cfg.failsafe && silent_for(cfg, desired, since_contact).is_some();
    let kept = |l: &&LeaseGrant| !failing_safe && !mem.void.contains_key(&l.lease_id);
    if desired.leases.iter().all(|l| kept(&l)) {
        return Cow::Borrowed(desired);
    }
    let leases: Vec<LeaseGrant> = desired.leases.iter().filter(kept).cloned().collect();
    Cow::Owned(DesiredNode {
        version: desired.version,
        serve: desired.serve || leases.is_empty(),
        leases,
        lease_ttl_ms: desired.lease_ttl_ms,
    })
}

/// What the fail-safe has to say, once per silence.
#[derive(Debug, Clone, PartialEq)]
pub enum Alarm {
    /// Silent past the TTL with the fail-safe disabled: the jobs run on.
    Disabled { silent: Duration, leases: Vec<u64> },
    /// Silent past the limit: these leases are void from now on.
    Acting {
        silent: Duration,
        limit: Duration,
        leases: Vec<u64>,
    },
    /// The coordinator answers again.
    Back { void: Vec<u64> },
}

/// Enters or leaves the fail-safe: keeps the void leases and whether the silence was told,
/// and says what is worth logging.
pub fn track(
    cfg: &PlanConfig,
    desired: &DesiredNode,
    since_contact: Option<Duration>,
    mem: &mut Memory,
) -> Option<Alarm> {
    match silent_for(cfg, desired, since_contact) {
        Some(silent) if !desired.leases.is_empty() => {
            if !cfg.failsafe {
                let first = !mem.silence_logged;
                mem.silence_logged = true;
                return first.then(|| Alarm::Disabled {
                    silent,
                    leases: desired.leases.iter().map(|l| l.lease_id).collect(),
                });
            }
            let mut newly = Vec::new();
            for l in &desired.leases {
                if mem.void.insert(l.lease_id, l.epoch).is_none() {
                    newly.push(l.lease_id);
                }
            }
            mem.silence_logged = true;
            (!newly.is_empty()).then(|| Alarm::Acting {
                silent,
                limit: silence_limit(cfg, desired),
                leases: newly,
            })
        }
        Some(_) => None,
        None => {
            let back = mem.silence_logged.then(|| Alarm::Back {
                void: mem.void.keys().copied().collect(),
            });
            mem.silence_logged = false;
            // The coordinator has dropped a void lease once it no longer lists it.
            let listed: Vec<u64> = desired.leases.iter().map(|l| l.lease_id).collect();
            mem.void.retain(|id, _| listed.contains(id));
            back
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::{JobSpec, LeaseGrant};

    fn desired(leases: &[u64]) -> DesiredNode {
        DesiredNode {
            version: 1,
            serve: false,
            leases: leases
                .iter()
                .map(|&id| LeaseGrant {
                    lease_id: id,
                    epoch: id,
                    job_id: id,
                    attempt: 1,
                    gpus: vec![0],
                    job: JobSpec::new("j", "i", 1),
                    rendezvous: None,
                })
                .collect(),
            lease_ttl_ms: 2_000,
        }
    }

    #[test]
    fn silence_past_the_ttl_voids_the_leases_once_and_the_node_serves() {
        let cfg = PlanConfig::default();
        let mut mem = Memory::default();
        let d = desired(&[4, 5]);
        let heard = Some(Duration::from_millis(500));
        assert_eq!(track(&cfg, &d, heard, &mut mem), None);
        assert!(matches!(effective(&cfg, &d, heard, &mem), Cow::Borrowed(e) if *e == d));

        let silent = Some(Duration::from_millis(2_500));
        assert!(matches!(
            track(&cfg, &d, silent, &mut mem),
            Some(Alarm::Acting { leases, .. }) if leases == [4, 5]
        ));
        assert_eq!(track(&cfg, &d, silent, &mut mem), None, "loud once");
        let e = effective(&cfg, &d, silent, &mem);
        assert!(e.serve && e.leases.is_empty());

        // Back, still listing them: refused; then dropped: forgotten.
        assert_eq!(
            track(&cfg, &d, heard, &mut mem),
            Some(Alarm::Back { void: vec![4, 5] })
        );
        let e = effective(&cfg, &d, heard, &mem);
        assert!(e.serve && e.leases.is_empty(), "void leases stay refused");
        let dropped = desired(&[6]);
        assert_eq!(track(&cfg, &dropped, heard, &mut mem), None);
        assert!(mem.void.is_empty());
        assert!(
            matches!(effective(&cfg, &dropped, heard, &mem), Cow::Borrowed(e) if *e == dropped)
        );
    }

    #[test]
    fn disabled_it_only_says_so_once() {
        let cfg = PlanConfig {
            failsafe: false,
            ..PlanConfig::default()
        };
        let mut mem = Memory::default();
        let d = desired(&[4]);
        let silent = Some(Duration::from_secs(3));
        assert!(matches!(
            track(&cfg, &d, silent, &mut mem),
            Some(Alarm::Disabled { .. })
        ));
        assert_eq!(track(&cfg, &d, silent, &mut mem), None);
        assert!(
            matches!(effective(&cfg, &d, silent, &mem), Cow::Borrowed(e) if *e == d),
            "jobs run on"
        );
    }
}
