//! One reconcile round's bookkeeping around [`crate::plan`], in the order every driver of the
//! planner keeps: the agent's executor (`agent/src/reconcile.rs`) and the host model
//! (`nightshift-hostmodel`) alike.
//!
//! 1. [`begin`]: the fail-safe weighs the coordinator's silence ([`failsafe::track`]) and
//!    the desired state to act on is the coordinator's less the void leases
//!    ([`failsafe::effective`]);
//! 2. the driver observes the host;
//! 3. [`observed`]: what the observation teaches the memory (containers stopped with the
//!    engine, the epochs running on each GPU), the leases honoured (stale ones refused) and
//!    the start failures to keep reporting;
//! 4. the driver reads what else the plan needs, publishes the runs ([`crate::runs`]) and
//!    asks [`crate::plan`] for the steps.

use std::borrow::Cow;
use std::time::Duration;

use nightshift_common::{DesiredNode, LeaseGrant, ReplicaState};

use crate::config::PlanConfig;
use crate::container::Container;
use crate::failsafe::{self, Alarm};
use crate::plan::{Memory, Observation, Phase, Stale, honoured};
use crate::time::Moment;

/// Whether a desired state heard from the coordinator replaces the one `held`: only a newer
/// version does; an older one is a late answer (a long poll that overtook another) and is
/// dropped.
pub fn supersedes(offered: &DesiredNode, held: Option<&DesiredNode>) -> bool {
    held.is_none_or(|h| offered.version > h.version)
}

/// What the round acts on, decided before the host is looked at.
#[derive(Debug, Clone, PartialEq)]
pub struct Round<'a> {
    /// What the fail-safe has to say this round.
    pub alarm: Option<Alarm>,
    /// The desired state to act on (the coordinator's itself, unless a lease is void);
    /// `None` before the coordinator has answered.
    pub desired: Option<Cow<'a, DesiredNode>>,
    /// Whether the replica's vLLM is to be asked (`/health`, its queue, `/is_sleeping`): a
    /// replica serving with no sequence under way is left alone, the heartbeat scrapes it.
    pub ask_replica: bool,
}

/// Begins a round: `heard` is the coordinator's latest desired state, `since_contact` the
/// time since it last acknowledged a heartbeat.
pub fn begin<'a>(
    cfg: &PlanConfig,
    heard: Option<&'a DesiredNode>,
    since_contact: Option<Duration>,
    mem: &mut Memory,
) -> Round<'a> {
    let alarm = heard.and_then(|d| failsafe::track(cfg, d, since_contact, mem));
    let desired = heard.map(|d| failsafe::effective(cfg, d, since_contact, mem));
    let ask_replica =
        heard.is_none() || mem.replica != ReplicaState::Serving || mem.phase.is_some();
    Round {
        alarm,
        desired,
        ask_replica,
    }
}

/// What the round learnt from the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed<'a> {
    /// The leases to act on.
    pub leases: Vec<LeaseGrant>,
    /// The stale leases refused: a newer epoch has run on one of their GPUs.
    pub stale: Vec<Stale>,
    /// Job containers that exited while the container engine was away: stopped with the
    /// engine, so reported as stopped by the agent (see [`Memory::engine_seen`]).
    pub stopped_with_engine: Vec<&'a Container>,
}

/// Takes in the round's observation of the host, at `now`.
pub fn observed<'a>(
    desired: Option<&DesiredNode>,
    obs: &'a Observation,
    mem: &mut Memory,
    now: Moment,
) -> Observed<'a> {
    let stopped_with_engine = mem.engine_seen(&obs.containers);
    mem.learn_fences(&obs.containers);
    let (leases, stale) = match desired {
        Some(d) => honoured(&d.leases, &mem.fenced),
        None => Default::default(),
    };
    if let Some(d) = desired {
        mem.track_start_failures(d, now);
    }
    Observed {
        leases,
        stale,
        stopped_with_engine,
    }
}

/// The latest moment after `now` at which a round that planned nothing could plan something
/// with nothing observed having changed: the fail-safe's deadline, and when an unlisted
/// start failure is forgotten. `None` when nothing in the memory waits on the clock.
/// (The host's own timers, a container exiting or a replica turning healthy, are the
/// driver's to add.)
pub fn next_deadline(
    cfg: &PlanConfig,
    heard: Option<&DesiredNode>,
    last_contact: Option<Moment>,
    mem: &Memory,
) -> Option<Moment> {
    let d = heard?;
    let silence = (cfg.failsafe && !d.leases.is_empty())
        .then(|| last_contact.map(|t| t + failsafe::silence_limit(cfg, d)))
        .flatten();
    let ttl = Duration::from_millis(d.lease_ttl_ms);
    let forgotten = mem
        .start_failures
        .values()
        .filter_map(|f| f.unlisted_since)
        .map(|t| t + ttl)
        .min();
    silence.into_iter().chain(forgotten).min()
}

/// When the wait the sequence is in times out: the one moment at which a round that said
/// [`crate::Step::Wait`] decides otherwise with nothing observed having changed (every wait
/// is a [`Phase`] with a timeout from `PlanConfig`). `None` outside a wait, or in one that
/// ends at once.
pub fn wait_deadline(cfg: &PlanConfig, mem: &Memory) -> Option<Moment> {
    let (phase, began) = mem.phase?;
    let timeout = match phase {
        Phase::MarkNotReady => cfg.readiness_grace,
        Phase::WaitInFlight => cfg.drain_timeout,
        Phase::ConfirmAsleep => cfg.sleep_free_timeout,
        Phase::ConfirmStopped
        | Phase::ConfirmFreeForJobs
        | Phase::ConfirmFreeForReplica
        | Phase::ConfirmFreeForWake => cfg.free_timeout,
        Phase::WakeReplica | Phase::WaitHealth => cfg.health_timeout,
        Phase::StopInstead => return None,
    };
    Some(began + timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::{DesiredNode, JobSpec, LeaseGrant};

    fn lease(id: u64, epoch: u64, gpus: &[u32]) -> LeaseGrant {
        LeaseGrant {
            lease_id: id,
            job_id: id,
            attempt: 1,
            epoch,
            gpus: gpus.to_vec(),
            job: JobSpec::new("j", "trainer:1", gpus.len() as u32),
            rendezvous: None,
        }
    }

    fn desired(leases: Vec<LeaseGrant>) -> DesiredNode {
        DesiredNode {
            version: 3,
            serve: leases.is_empty(),
            leases,
            lease_ttl_ms: 10_000,
        }
    }

    #[test]
    fn a_silent_coordinator_voids_the_leases_and_the_node_serves() {
        let cfg = PlanConfig::default();
        let mut mem = Memory::default();
        let d = desired(vec![lease(1, 1, &[0])]);
        let heard = begin(&cfg, Some(&d), Some(Duration::from_secs(2)), &mut mem);
        assert_eq!(heard.alarm, None);
        assert_eq!(heard.desired.as_ref().map(|d| d.leases.len()), Some(1));
        let silent = begin(&cfg, Some(&d), Some(Duration::from_secs(11)), &mut mem);
        assert!(matches!(silent.alarm, Some(Alarm::Acting { .. })));
        let acted = silent.desired.expect("a desired state");
        assert!(acted.serve && acted.leases.is_empty());
        // Back in touch, the lease stays void until the coordinator drops it.
        let back = begin(&cfg, Some(&d), Some(Duration::from_secs(1)), &mut mem);
        assert!(matches!(back.alarm, Some(Alarm::Back { .. })));
        assert!(back.desired.expect("a desired state").leases.is_empty());
    }

    #[test]
    fn the_fail_safe_deadline_counts_from_the_last_contact() {
        let cfg = PlanConfig::default();
        let mem = Memory::default();
        let t = Moment::ZERO + Duration::from_secs(5);
        let d = desired(vec![lease(1, 1, &[0])]);
        assert_eq!(
            next_deadline(&cfg, Some(&d), Some(t), &mem),
            Some(t + Duration::from_secs(10))
        );
        // Nothing to void, nothing to wait for.
        assert_eq!(
            next_deadline(&cfg, Some(&desired(vec![])), Some(t), &mem),
            None
        );
        assert_eq!(next_deadline(&cfg, None, Some(t), &mem), None);
    }

    #[test]
    fn a_lease_older_than_a_running_epoch_is_refused() {
        let mut mem = Memory::default();
        let labels = crate::job_labels("n", &lease(7, 9, &[0]));
        let obs = Observation {
            containers: vec![Container {
                id: "c7".into(),
                name: "c7".into(),
                image: "trainer:1".into(),
                image_id: None,
                labels,
                state: crate::ContainerState::Running,
                published_port: None,
            }],
            gpus: vec![0, 1],
            gpu_memory: None,
            replica: None,
            checkpoint_free_bytes: None,
            missing_images: Default::default(),
            unrestored: Default::default(),
        };
        let d = desired(vec![
            lease(7, 9, &[0]),
            lease(8, 4, &[0]),
            lease(9, 4, &[1]),
        ]);
        let seen = observed(Some(&d), &obs, &mut mem, Moment::ZERO);
        let ids: Vec<u64> = seen.leases.iter().map(|l| l.lease_id).collect();
        assert_eq!(ids, vec![7, 9]);
        assert_eq!(seen.stale.len(), 1);
        assert_eq!((seen.stale[0].lease_id, seen.stale[0].seen), (8, 9));
    }

    #[test]
    fn a_wait_times_out_by_its_own_phase() {
        let cfg = PlanConfig::default();
        let t = Moment::ZERO + Duration::from_secs(7);
        let mut mem = Memory::default();
        assert_eq!(wait_deadline(&cfg, &mem), None);
        for (phase, timeout) in [
            (Phase::MarkNotReady, cfg.readiness_grace),
            (Phase::WaitInFlight, cfg.drain_timeout),
            (Phase::ConfirmAsleep, cfg.sleep_free_timeout),
            (Phase::ConfirmFreeForJobs, cfg.free_timeout),
            (Phase::WaitHealth, cfg.health_timeout),
        ] {
            mem.phase = Some((phase, t));
            assert_eq!(wait_deadline(&cfg, &mem), Some(t + timeout), "{phase:?}");
        }
    }
}
