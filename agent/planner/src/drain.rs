//! Drain: lend the node. Not-ready on the load-balancer endpoint for the readiness grace,
//! wait for vLLM to report no running and no waiting request (or the drain timeout), stop
//! the container, and confirm through NVML that its GPUs are free. Only then may jobs start
//! (`plan.rs`). With `replica.reclaim = "sleep"` vLLM is put to sleep instead of stopped and
//! the container kept; when it then does not say it sleeps, or NVML shows more than
//! `replica.sleep_max_used_bytes` per GPU after `replica.sleep_free_timeout_s`, it is stopped
//! after all (`sleep_insufficient`). Each wait is a [`Phase`]: this is the planner's half of
//! the drain, pure; the executor runs its steps.

use nightshift_common::{ReplicaState, SequenceKind};

use crate::config::{PlanConfig, ReclaimMode};
use crate::container::{ContainerState, gpus_of, jobs};
use crate::lifecycle::ReplicaEvent;
use crate::plan::{Health, Memory, Note, Observation, Phase, Step, busy};
use crate::time::Moment;

const DRAIN: SequenceKind = SequenceKind::Drain;

/// The drain's next steps; none once the replica is stopped (its GPUs confirmed free) or
/// asleep.
pub fn plan(cfg: &PlanConfig, obs: &Observation, mem: &Memory, now: Moment) -> Vec<Step> {
    let Some(p) = &obs.replica else {
        if mem.replica != ReplicaState::Stopped {
            return vec![Step::Replica(ReplicaEvent::Stopped)];
        }
        let Some(began) = mem.since(Phase::ConfirmStopped) else {
            return Vec::new();
        };
        let timeout = cfg.free_timeout;
        return busy(obs, &obs.gpus, cfg.free_memory_bytes, began, now, timeout).unwrap_or_else(
            || {
                vec![
                    Step::Record {
                        sequence: DRAIN,
                        phase: "confirm_free",
                        began,
                    },
                    Step::Enter(None),
                ]
            },
        );
    };
    let sleep_mode = cfg.reclaim == ReclaimMode::Sleep;
    let stop = || {
        vec![
            Step::StopReplica {
                id: p.container_id.clone(),
                grace: cfg.replica_stop_grace,
            },
            Step::Enter(Some(Phase::ConfirmStopped)),
        ]
    };
    match mem.replica {
        ReplicaState::Sleeping => Vec::new(),
        ReplicaState::Draining => match mem.phase {
            Some((Phase::MarkNotReady, began)) => {
                if now.duration_since(began) < cfg.readiness_grace {
                    return vec![Step::Wait];
                }
                vec![
                    Step::Record {
                        sequence: DRAIN,
                        phase: "mark_not_ready",
                        began,
                    },
                    Step::Enter(Some(Phase::WaitInFlight)),
                ]
            }
            Some((Phase::WaitInFlight, began)) => {
                let idle = p.requests_running == Some(0.0) && p.requests_waiting == Some(0.0);
                let gone = p.requests_running.is_none() && p.health == Some(Health::Unreachable);
                let late = now.duration_since(began) >= cfg.drain_timeout;
                let mut steps = match (idle, gone, late) {
                    (true, _, _) => Vec::new(),
                    (false, true, _) => vec![Step::Note(Note::ReplicaUnreachable)],
                    (false, false, true) => vec![Step::Note(Note::DrainTimeout {
                        running: p.requests_running,
                        waiting: p.requests_waiting,
                    })],
                    (false, false, false) => return vec![Step::Wait],
                };
                steps.push(Step::Record {
                    sequence: DRAIN,
                    phase: "wait_in_flight",
                    began,
                });
                match (&p.url, sleep_mode) {
                    (Some(url), true) => steps.extend([
                        Step::SleepReplica { url: url.clone() },
                        Step::Enter(Some(Phase::ConfirmAsleep)),
                    ]),
                    _ => steps.extend(stop()),
                }
                steps
            }
            Some((Phase::ConfirmAsleep, began)) => confirm_asleep(cfg, obs, began, now, stop),
            Some((Phase::StopInstead, _)) => stop(),
            _ => vec![Step::Enter(Some(Phase::MarkNotReady))],
        },
        // Found asleep already (an agent restarted mid-lend): only the memory check is left.
        _ if sleep_mode && p.is_sleeping == Some(true) => vec![
            Step::Replica(ReplicaEvent::DrainBegan),
            Step::Enter(Some(Phase::ConfirmAsleep)),
        ],
        _ => vec![
            Step::Replica(ReplicaEvent::DrainBegan),
            Step::Enter(Some(Phase::MarkNotReady)),
        ],
    }
}

/// After the sleep: vLLM must say it sleeps, and NVML show at most
/// `replica.sleep_max_used_bytes` on every GPU within `replica.sleep_free_timeout_s`; else
/// the replica is stopped. A GPU a running job holds is not weighed: its memory is the
/// job's (an agent restarted mid-lend finds the replica asleep and the jobs running; found
/// by the fault simulation, seed 99).
fn confirm_asleep(
    cfg: &PlanConfig,
    obs: &Observation,
    began: Moment,
    now: Moment,
    stop: impl Fn() -> Vec<Step>,
) -> Vec<Step> {
    let asleep = obs.replica.as_ref().is_some_and(|p| p.says_asleep());
    if !asleep {
        let mut steps = vec![Step::Note(Note::NotAsleep)];
        steps.extend(stop());
        return steps;
    }
    let limit = cfg.sleep_max_used_bytes;
    let timeout = cfg.sleep_free_timeout;
    let held: Vec<u32> = jobs(&obs.containers)
        .filter(|c| c.state == ContainerState::Running)
        .flat_map(gpus_of)
        .collect();
    let weighed: Vec<u32> = obs
        .gpus
        .iter()
        .copied()
        .filter(|g| !held.contains(g))
        .collect();
    match busy(obs, &weighed, limit, began, now, timeout) {
        None => vec![
            Step::Replica(ReplicaEvent::Slept),
            Step::Record {
                sequence: DRAIN,
                phase: "confirm_free",
                began,
            },
            Step::Enter(None),
        ],
        Some(wait) if wait == [Step::Wait] => wait,
        Some(_) => {
            let mut steps = vec![
                Step::Note(Note::SleepFreedTooLittle { limit }),
                Step::Record {
                    sequence: DRAIN,
                    phase: "sleep_insufficient",
                    began,
                },
            ];
            steps.extend(stop());
            steps
        }
    }
}
