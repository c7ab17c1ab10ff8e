//! Reclaim: serve again. Job containers have already been sent their checkpoint signal and
//! stopped (the planner does that first, `stop_jobs`); confirm the GPUs are free, start vLLM
//! (or, asleep, wake it), wait for `/health`, and the replica serves, which makes it ready.
//! A drain still waiting when the node should serve again is abandoned: the replica serves
//! on (or, told to sleep already, is woken). This is the planner's half of the reclaim, pure; the executor runs its steps.

use std::time::Duration;

use nightshift_common::{ReplicaState, SequenceKind};

use crate::config::PlanConfig;
use crate::lifecycle::ReplicaEvent;
use crate::plan::{Health, Memory, Note, Observation, Phase, Step, Stuck, busy};
use crate::time::Moment;

const RECLAIM: SequenceKind = SequenceKind::Reclaim;

/// The reclaim's next steps; none once the replica serves.
pub fn plan(cfg: &PlanConfig, obs: &Observation, mem: &Memory, now: Moment) -> Vec<Step> {
    let free_timeout = cfg.free_timeout;
    let Some(p) = &obs.replica else {
        // Nothing runs: confirm the GPUs free, then start it.
        if !matches!(mem.replica, ReplicaState::Stopped | ReplicaState::Failed) {
            return vec![Step::Replica(ReplicaEvent::Stopped)];
        }
        let Some(began) = mem.since(Phase::ConfirmFreeForReplica) else {
            return vec![Step::Enter(Some(Phase::ConfirmFreeForReplica))];
        };
        return busy(
            obs,
            &obs.gpus,
            cfg.free_memory_bytes,
            began,
            now,
            free_timeout,
        )
        .unwrap_or_else(|| {
            vec![
                Step::Record {
                    sequence: RECLAIM,
                    phase: "confirm_free",
                    began,
                },
                Step::StartReplica,
                Step::Enter(Some(Phase::WaitHealth)),
            ]
        });
    };
    let health_timeout = cfg.health_timeout;
    match mem.replica {
        ReplicaState::Serving => Vec::new(),
        // A drain called off after vLLM was told to sleep: it sleeps, and is woken as a
        // lend's reclaim wakes it. (Serving on would report a ready replica that answers
        // nothing.)
        ReplicaState::Draining
            if p.is_sleeping == Some(true)
                || matches!(mem.phase, Some((Phase::ConfirmAsleep, _))) =>
        {
            vec![
                Step::Note(Note::DrainAbandoned),
                Step::Replica(ReplicaEvent::Slept),
                Step::Enter(None),
            ]
        }
        // A drain that was called off before the replica was touched: ready again.
        ReplicaState::Draining => vec![
            Step::Note(Note::DrainAbandoned),
            Step::Replica(ReplicaEvent::DrainAbandoned),
            Step::Enter(None),
        ],
        // Sleeping (lent in sleep mode, or found asleep after a restart): wake it once the
        // jobs' memory is gone.
        state
            if p.url.is_some()
                && (state == ReplicaState::Sleeping || p.is_sleeping == Some(true)) =>
        {
            let url = p.url.clone().unwrap_or_default();
            match mem.phase {
                Some((Phase::ConfirmFreeForWake, began)) => {
                    let limit = cfg.sleep_max_used_bytes;
                    busy(obs, &obs.gpus, limit, began, now, free_timeout).unwrap_or_else(|| {
                        vec![
                            Step::Record {
                                sequence: RECLAIM,
                                phase: "confirm_free",
                                began,
                            },
                            Step::Enter(Some(Phase::WakeReplica)),
                            Step::WakeReplica { url },
                        ]
                    })
                }
                Some((Phase::WakeReplica, began)) => {
                    if !p.says_asleep() {
                        let mut steps = vec![Step::Record {
                            sequence: RECLAIM,
                            phase: "wake_replica",
                            began,
                        }];
                        if state != ReplicaState::Starting {
                            steps.push(Step::Replica(ReplicaEvent::Started));
                        }
                        steps.push(Step::Enter(Some(Phase::WaitHealth)));
                        steps
                    } else if now.duration_since(began) >= health_timeout {
                        vec![
                            Step::Enter(None),
                            Step::GiveUp(Stuck::HealthTimeout(health_timeout)),
                        ]
                    } else {
                        vec![Step::Wait]
                    }
                }
                _ => vec![Step::Enter(Some(Phase::ConfirmFreeForWake))],
            }
        }
        // Started earlier, or found running after a restart: wait for it to be healthy.
        state => {
            if state != ReplicaState::Starting {
                return vec![
                    Step::Replica(ReplicaEvent::Started),
                    Step::Enter(Some(Phase::WaitHealth)),
                ];
            }
            let Some(began) = mem.since(Phase::WaitHealth) else {
                return vec![Step::Enter(Some(Phase::WaitHealth))];
            };
            if p.health == Some(Health::Healthy) {
                return vec![
                    Step::Record {
                        sequence: RECLAIM,
                        phase: "wait_health",
                        began,
                    },
                    Step::Replica(ReplicaEvent::Healthy),
                    Step::Enter(None),
                ];
            }
            let waited = now.duration_since(began);
            match (&p.url, waited >= health_timeout) {
                (None, _) => vec![
                    Step::Replica(ReplicaEvent::Failed),
                    Step::Enter(None),
                    Step::GiveUp(Stuck::HealthTimeout(Duration::ZERO)),
                ],
                (Some(_), true) => vec![
                    Step::Replica(ReplicaEvent::Failed),
                    Step::Enter(None),
                    Step::GiveUp(Stuck::HealthTimeout(health_timeout)),
                ],
                (Some(_), false) => vec![Step::Wait],
            }
        }
    }
}
