//! The planner's key decisions, pure: no runtime, no fake, a time made up by the test.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use nightshift_common::{
    DesiredNode, JobRunState, JobSpec, LeaseGrant, ReplicaState, SequenceKind, labels,
};

use super::*;
use crate::config::{PlanConfig, ReclaimMode};
use crate::container::{Container, ContainerState, GRACE_LABEL};
use crate::lifecycle::ReplicaEvent;
use crate::time::Moment;

const GIB: u64 = 1 << 30;

fn cfg() -> PlanConfig {
    PlanConfig {
        readiness_grace: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(120),
        free_timeout: Duration::from_secs(30),
        ..PlanConfig::default()
    }
}

/// A moment of an agent that has run for a minute.
fn t0() -> Moment {
    Moment::from_origin(Duration::from_secs(60))
}

fn lease(lease_id: u64, epoch: u64, gpus: Vec<u32>) -> LeaseGrant {
    LeaseGrant {
        lease_id,
        epoch,
        job_id: lease_id,
        attempt: 1,
        job: JobSpec::new("j", "trainer:1", gpus.len() as u32),
        gpus,
        rendezvous: None,
    }
}

fn desired(serve: bool, leases: &[LeaseGrant]) -> DesiredNode {
    DesiredNode {
        version: 1,
        serve,
        leases: leases.to_vec(),
        lease_ttl_ms: 10_000,
    }
}

fn job(id: &str, lease: &LeaseGrant, state: ContainerState) -> Container {
    Container {
        id: id.into(),
        name: id.into(),
        image: "trainer:1".into(),
        image_id: None,
        labels: BTreeMap::from([
            (labels::ROLE.to_owned(), labels::ROLE_JOB.to_owned()),
            (labels::LEASE_ID.to_owned(), lease.lease_id.to_string()),
            (labels::EPOCH.to_owned(), lease.epoch.to_string()),
            (
                labels::GPUS.to_owned(),
                lease
                    .gpus
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            (GRACE_LABEL.to_owned(), "9".to_owned()),
        ]),
        state,
        published_port: None,
    }
}

fn replica_container() -> Container {
    Container {
        id: "r".into(),
        name: "nightshift-replica-n1".into(),
        image: "vllm".into(),
        image_id: None,
        labels: BTreeMap::from([(labels::ROLE.to_owned(), labels::ROLE_REPLICA.to_owned())]),
        state: ContainerState::Running,
        published_port: Some(8000),
    }
}

/// vLLM up, with `running` requests.
fn probe(running: f64) -> ReplicaProbe {
    ReplicaProbe {
        container_id: "r".into(),
        url: Some("http://127.0.0.1:8000".into()),
        health: Some(Health::Healthy),
        requests_running: Some(running),
        requests_waiting: Some(0.0),
        is_sleeping: Some(false),
        sleep_state: Some("awake".into()),
    }
}

/// A host with its replica running and `used` bytes on each of 4 GPUs.
fn serving_host(running: f64, used: u64) -> Observation {
    Observation {
        containers: vec![replica_container()],
        gpus: vec![0, 1, 2, 3],
        gpu_memory: Some((0..4).map(|g| (g, used)).collect()),
        replica: Some(probe(running)),
        checkpoint_free_bytes: Some(100 * GIB),
        missing_images: Default::default(),
        unrestored: Default::default(),
    }
}

fn memory(replica: ReplicaState, phase: Option<(Phase, Moment)>) -> Memory {
    Memory {
        replica,
        phase,
        ..Memory::default()
    }
}

#[test]
fn lending_a_serving_node_begins_a_drain_and_waits_out_the_readiness_grace() {
    let (cfg, t0) = (cfg(), t0());
    let l = [lease(1, 1, vec![0, 1])];
    let lend = desired(false, &l);
    let obs = serving_host(3.0, 70 * GIB);
    assert_eq!(
        plan(
            &cfg,
            Some(&lend),
            &l,
            &obs,
            &memory(ReplicaState::Serving, None),
            t0
        ),
        [
            Step::Replica(ReplicaEvent::DrainBegan),
            Step::Enter(Some(Phase::MarkNotReady))
        ]
    );
    let mem = memory(ReplicaState::Draining, Some((Phase::MarkNotReady, t0)));
    let early = t0 + Duration::from_secs(4);
    assert_eq!(plan(&cfg, Some(&lend), &l, &obs, &mem, early), [Step::Wait]);
    let late = t0 + Duration::from_secs(5);
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &mem, late),
        [
            Step::Record {
                sequence: SequenceKind::Drain,
                phase: "mark_not_ready",
                began: t0
            },
            Step::Enter(Some(Phase::WaitInFlight))
        ]
    );
}

#[test]
fn the_replica_is_stopped_once_idle_or_at_the_drain_timeout() {
    let (cfg, t0) = (cfg(), t0());
    let l = [lease(1, 1, vec![0, 1])];
    let lend = desired(false, &l);
    let mem = memory(ReplicaState::Draining, Some((Phase::WaitInFlight, t0)));
    let busy = serving_host(2.0, 70 * GIB);
    let stop = [
        Step::StopReplica {
            id: "r".into(),
            grace: Duration::from_secs(60),
        },
        Step::Enter(Some(Phase::ConfirmStopped)),
    ];
    let record = Step::Record {
        sequence: SequenceKind::Drain,
        phase: "wait_in_flight",
        began: t0,
    };
    let soon = t0 + Duration::from_secs(10);
    assert_eq!(plan(&cfg, Some(&lend), &l, &busy, &mem, soon), [Step::Wait]);
    let idle = serving_host(0.0, 70 * GIB);
    let mut expect = vec![record.clone()];
    expect.extend(stop.clone());
    assert_eq!(plan(&cfg, Some(&lend), &l, &idle, &mem, soon), expect);
    let timeout = t0 + Duration::from_secs(120);
    let mut expect = vec![
        Step::Note(Note::DrainTimeout {
            running: Some(2.0),
            waiting: Some(0.0),
        }),
        record,
    ];
    expect.extend(stop);
    assert_eq!(plan(&cfg, Some(&lend), &l, &busy, &mem, timeout), expect);
}

#[test]
fn in_sleep_mode_the_idle_replica_is_put_to_sleep_and_stopped_if_memory_stays() {
    let (mut cfg, t0) = (cfg(), t0());
    cfg.reclaim = ReclaimMode::Sleep;
    cfg.sleep_free_timeout = Duration::from_secs(10);
    let l = [lease(1, 1, vec![0, 1])];
    let lend = desired(false, &l);
    let obs = serving_host(0.0, 70 * GIB);
    let mem = memory(ReplicaState::Draining, Some((Phase::WaitInFlight, t0)));
    let steps = plan(&cfg, Some(&lend), &l, &obs, &mem, t0);
    assert_eq!(
        steps[1..],
        [
            Step::SleepReplica {
                url: "http://127.0.0.1:8000".into()
            },
            Step::Enter(Some(Phase::ConfirmAsleep))
        ]
    );
    // Asleep, but 20 GiB still held per GPU: wait, then give up on sleeping.
    let mut asleep = serving_host(0.0, 20 * GIB);
    asleep.replica.as_mut().unwrap().is_sleeping = Some(true);
    let mem = memory(ReplicaState::Draining, Some((Phase::ConfirmAsleep, t0)));
    let soon = t0 + Duration::from_secs(2);
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &asleep, &mem, soon),
        [Step::Wait]
    );
    let late = t0 + Duration::from_secs(10);
    let steps = plan(&cfg, Some(&lend), &l, &asleep, &mem, late);
    assert!(steps.contains(&Step::Record {
        sequence: SequenceKind::Drain,
        phase: "sleep_insufficient",
        began: t0
    }));
    assert!(matches!(steps[2], Step::StopReplica { .. }), "{steps:?}");
    // Released down to its CUDA context: it sleeps, lent.
    let mut freed = serving_host(0.0, GIB);
    freed.replica.as_mut().unwrap().is_sleeping = Some(true);
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &freed, &mem, soon)[0],
        Step::Replica(ReplicaEvent::Slept)
    );
}

#[test]
fn an_agent_restarted_mid_lend_in_sleep_mode_keeps_the_sleeping_replica() {
    // Found by the fault simulation (seed 99): the agent restarts while its job runs beside
    // the sleeping replica; the job's memory is not the replica's failure to release its own.
    let (mut cfg, t0) = (cfg(), t0());
    cfg.reclaim = ReclaimMode::Sleep;
    let l = [lease(1, 1, vec![0, 1])];
    let lend = desired(false, &l);
    let mut obs = serving_host(0.0, GIB / 2);
    obs.replica.as_mut().unwrap().is_sleeping = Some(true);
    obs.containers
        .push(job("j1", &l[0], ContainerState::Running));
    let gpu_memory = obs.gpu_memory.as_mut().unwrap();
    for g in [0, 1] {
        gpu_memory.insert(g, 60 * GIB);
    }
    let fresh = memory(ReplicaState::Stopped, None);
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &fresh, t0),
        [
            Step::Replica(ReplicaEvent::DrainBegan),
            Step::Enter(Some(Phase::ConfirmAsleep))
        ]
    );
    let confirming = memory(ReplicaState::Draining, Some((Phase::ConfirmAsleep, t0)));
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &confirming, t0)[0],
        Step::Replica(ReplicaEvent::Slept)
    );
    // A GPU no job holds is still weighed: the replica's own memory there stops it.
    obs.gpu_memory.as_mut().unwrap().insert(3, 20 * GIB);
    let late = t0 + cfg.sleep_free_timeout;
    let steps = plan(&cfg, Some(&lend), &l, &obs, &confirming, late);
    assert!(
        steps.iter().any(|s| matches!(s, Step::StopReplica { .. })),
        "{steps:?}"
    );
}

#[test]
fn a_drain_is_abandoned_when_the_node_should_serve_again() {
    let (cfg, t0) = (cfg(), t0());
    let mem = memory(ReplicaState::Draining, Some((Phase::WaitInFlight, t0)));
    assert_eq!(
        plan(
            &cfg,
            Some(&desired(true, &[])),
            &[],
            &serving_host(3.0, 70 * GIB),
            &mem,
            t0
        ),
        [
            Step::Note(Note::DrainAbandoned),
            Step::Replica(ReplicaEvent::DrainAbandoned),
            Step::Enter(None)
        ]
    );
}

#[test]
fn a_drain_called_off_after_the_replica_was_told_to_sleep_wakes_it() {
    let (cfg, t0) = (cfg(), t0());
    let serve = desired(true, &[]);
    let mut obs = serving_host(0.0, GIB);
    let told = memory(ReplicaState::Draining, Some((Phase::ConfirmAsleep, t0)));
    let called_off = [
        Step::Note(Note::DrainAbandoned),
        Step::Replica(ReplicaEvent::Slept),
        Step::Enter(None),
    ];
    assert_eq!(plan(&cfg, Some(&serve), &[], &obs, &told, t0), called_off);
    // Seen asleep, whatever the phase (an agent restarted mid-sleep).
    obs.replica.as_mut().unwrap().is_sleeping = Some(true);
    let waiting = memory(ReplicaState::Draining, Some((Phase::WaitInFlight, t0)));
    assert_eq!(
        plan(&cfg, Some(&serve), &[], &obs, &waiting, t0),
        called_off
    );
    // Then the reclaim wakes it once the GPUs are free.
    let slept = memory(
        ReplicaState::Sleeping,
        Some((Phase::ConfirmFreeForWake, t0)),
    );
    assert!(
        plan(&cfg, Some(&serve), &[], &obs, &slept, t0)
            .iter()
            .any(|s| matches!(s, Step::WakeReplica { .. }))
    );
}

#[test]
fn jobs_start_only_once_nvml_shows_their_gpus_free() {
    let (cfg, t0) = (cfg(), t0());
    let l = [lease(1, 1, vec![0, 1])];
    let lend = desired(false, &l);
    let mut obs = serving_host(0.0, 0);
    obs.containers.clear();
    obs.replica = None;
    obs.gpu_memory = Some(BTreeMap::from([(0, 0), (1, 5 * GIB), (2, 0), (3, 0)]));
    let stopped = memory(ReplicaState::Stopped, None);
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &stopped, t0),
        [Step::Enter(Some(Phase::ConfirmFreeForJobs))]
    );
    let waiting = memory(ReplicaState::Stopped, Some((Phase::ConfirmFreeForJobs, t0)));
    let soon = t0 + Duration::from_secs(1);
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &waiting, soon),
        [Step::Wait]
    );
    let late = t0 + Duration::from_secs(30);
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &waiting, late),
        [
            Step::Enter(None),
            Step::GiveUp(Stuck::GpusBusy {
                gpus: vec![1],
                waited: Duration::from_secs(30)
            })
        ]
    );
    obs.gpu_memory = Some((0..4).map(|g| (g, 0)).collect());
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &waiting, soon),
        [Step::StartJobs(l.to_vec()), Step::Enter(None)]
    );
    // Short of checkpoint space: refused by the host instead.
    obs.checkpoint_free_bytes = Some(GIB / 2);
    let steps = plan(&cfg, Some(&lend), &l, &obs, &waiting, soon);
    assert!(
        matches!(&steps[..], [Step::FailStart { lease, message, refused_by_host: true }] if lease.lease_id == 1 && message.contains("checkpoint_min_free_bytes")),
        "{steps:?}"
    );
}

#[test]
fn a_host_short_of_checkpoint_space_refuses_jobs_before_the_drain() {
    let (cfg, t0) = (cfg(), t0());
    let l = [lease(1, 1, vec![0, 1]), lease(2, 1, vec![2, 3])];
    let lend = desired(false, &l);
    let mut obs = serving_host(3.0, 70 * GIB);
    obs.checkpoint_free_bytes = Some(GIB / 2);
    let mut serving = memory(ReplicaState::Serving, None);
    // No drain, no pull: both leases are refused, saying why.
    let steps = plan(&cfg, Some(&lend), &l, &obs, &serving, t0);
    assert_eq!(steps.len(), 2, "{steps:?}");
    for (step, want) in steps.iter().zip([1, 2]) {
        assert!(
            matches!(step, Step::FailStart { lease, message, refused_by_host: true }
                if lease.lease_id == want && message.contains("below the floor of 1073741824")),
            "{step:?}"
        );
    }
    // Once they are refused, the replica serves on until the coordinator drops them.
    for lease in &l {
        serving.start_failures.insert(
            lease.lease_id,
            StartFailure::refused(lease, "short of space".into()),
        );
    }
    assert_eq!(plan(&cfg, Some(&lend), &l, &obs, &serving, t0), []);
    // With room again, a new lease drains the replica as usual.
    obs.checkpoint_free_bytes = Some(2 * GIB);
    let again = [lease(3, 2, vec![0, 1])];
    assert_eq!(
        plan(
            &cfg,
            Some(&desired(false, &again)),
            &again,
            &obs,
            &serving,
            t0
        )[0],
        Step::Replica(ReplicaEvent::DrainBegan)
    );
}

#[test]
fn unleased_jobs_are_stopped_first_with_their_grace() {
    let (cfg, t0) = (cfg(), t0());
    let gone = lease(1, 1, vec![0, 1]);
    let obs = Observation {
        containers: vec![job("j1", &gone, ContainerState::Running)],
        gpus: vec![0, 1, 2, 3],
        gpu_memory: Some((0..4).map(|g| (g, 0)).collect()),
        replica: None,
        checkpoint_free_bytes: None,
        missing_images: Default::default(),
        unrestored: Default::default(),
    };
    let stop = |reclaim| {
        vec![Step::StopJobs {
            jobs: vec![StopJob {
                id: "j1".into(),
                lease_id: Some(1),
                grace: Duration::from_secs(9),
            }],
            reclaim,
        }]
    };
    let mem = memory(ReplicaState::Stopped, None);
    assert_eq!(
        plan(&cfg, Some(&desired(true, &[])), &[], &obs, &mem, t0),
        stop(true)
    );
    assert_eq!(
        plan(&cfg, Some(&desired(false, &[])), &[], &obs, &mem, t0),
        stop(false)
    );
    // Once it exited, and only when nothing else is left to do, it is removed.
    let exited = Observation {
        containers: vec![job("j1", &gone, ContainerState::Exited { exit_code: 143 })],
        ..obs
    };
    assert_eq!(
        plan(&cfg, Some(&desired(false, &[])), &[], &exited, &mem, t0),
        [Step::Remove(exited.containers[0].clone())]
    );
}

#[test]
fn reclaim_confirms_the_gpus_free_then_starts_the_replica_and_waits_for_health() {
    let (cfg, t0) = (cfg(), t0());
    let serve = desired(true, &[]);
    let empty = Observation {
        containers: Vec::new(),
        gpus: vec![0, 1],
        gpu_memory: Some(BTreeMap::from([(0, 0), (1, 0)])),
        replica: None,
        checkpoint_free_bytes: None,
        missing_images: Default::default(),
        unrestored: Default::default(),
    };
    let mem = memory(
        ReplicaState::Stopped,
        Some((Phase::ConfirmFreeForReplica, t0)),
    );
    assert_eq!(
        plan(&cfg, Some(&serve), &[], &empty, &mem, t0)[1..],
        [Step::StartReplica, Step::Enter(Some(Phase::WaitHealth))]
    );
    let mut loading = serving_host(0.0, 70 * GIB);
    loading.replica.as_mut().unwrap().health = Some(Health::Unreachable);
    let mem = memory(ReplicaState::Starting, Some((Phase::WaitHealth, t0)));
    assert_eq!(
        plan(&cfg, Some(&serve), &[], &loading, &mem, t0),
        [Step::Wait]
    );
    let up = serving_host(0.0, 70 * GIB);
    assert_eq!(
        plan(&cfg, Some(&serve), &[], &up, &mem, t0)[1..],
        [Step::Replica(ReplicaEvent::Healthy), Step::Enter(None)]
    );
    let late = t0 + Duration::from_secs(900);
    assert_eq!(
        plan(&cfg, Some(&serve), &[], &loading, &mem, late)[0],
        Step::Replica(ReplicaEvent::Failed)
    );
    assert!(
        plan(
            &cfg,
            Some(&serve),
            &[],
            &up,
            &memory(ReplicaState::Serving, None),
            t0
        )
        .is_empty()
    );
}

#[test]
fn before_the_coordinator_answers_a_running_replica_is_adopted_and_nothing_else_changes() {
    let (cfg, t0) = (cfg(), t0());
    let fresh = memory(ReplicaState::Stopped, None);
    let up = serving_host(0.0, 70 * GIB);
    assert_eq!(
        plan(&cfg, None, &[], &up, &fresh, t0),
        [Step::Replica(ReplicaEvent::Adopted {
            healthy: true,
            asleep: false
        })]
    );
    let mut asleep = serving_host(0.0, GIB);
    asleep.replica.as_mut().unwrap().is_sleeping = Some(true);
    assert_eq!(
        plan(&cfg, None, &[], &asleep, &fresh, t0),
        [Step::Replica(ReplicaEvent::Adopted {
            healthy: true,
            asleep: true
        })]
    );
    assert!(
        plan(
            &cfg,
            None,
            &[],
            &up,
            &memory(ReplicaState::Serving, None),
            t0
        )
        .is_empty()
    );
}

#[test]
fn a_stale_lease_is_refused() {
    let fenced = BTreeMap::from([(0, 5), (1, 5)]);
    let (ok, stale) = honoured(
        &[
            lease(1, 5, vec![0]),
            lease(2, 3, vec![1, 2]),
            lease(3, 6, vec![2]),
        ],
        &fenced,
    );
    assert_eq!(ok.iter().map(|l| l.lease_id).collect::<Vec<_>>(), [1, 3]);
    assert_eq!(
        stale,
        [Stale {
            lease_id: 2,
            epoch: 3,
            gpu: 1,
            seen: 5
        }]
    );
}

#[test]
fn a_started_lease_fences_its_gpus_against_every_lower_epoch() {
    let mut mem = Memory::default();
    mem.fence(&lease(1, 7, vec![0, 1]));
    // A lease seen later with a lower epoch (a coordinator restored from an older state)
    // never lowers the fence.
    mem.fence(&lease(2, 4, vec![1]));
    assert_eq!(mem.fenced, BTreeMap::from([(0, 7), (1, 7)]));
    let (ok, stale) = honoured(
        &[lease(3, 6, vec![1]), lease(4, 8, vec![0, 2])],
        &mem.fenced,
    );
    assert_eq!(ok.iter().map(|l| l.lease_id).collect::<Vec<_>>(), [4]);
    assert_eq!(
        stale,
        [Stale {
            lease_id: 3,
            epoch: 6,
            gpu: 1,
            seen: 7
        }]
    );
}

#[test]
fn a_job_that_exited_while_the_engine_was_away_counts_as_stopped_by_the_host() {
    let (a, b, c) = (
        lease(1, 1, vec![0]),
        lease(2, 2, vec![1]),
        lease(3, 3, vec![2]),
    );
    let mut mem = Memory::default();
    // Before the engine goes: a and b run, c has exited already (the job's own verdict).
    let before = [
        job("a", &a, ContainerState::Running),
        job("b", &b, ContainerState::Running),
        job("c", &c, ContainerState::Exited { exit_code: 1 }),
    ];
    assert!(mem.engine_seen(&before).is_empty());
    mem.engine_lost();
    // Still away at the next look: what ran when it went is kept, not what runs now (none).
    mem.engine_lost();
    // Back: a exited with the engine's SIGTERM, b survived (a live restore), c is as it was.
    let after = [
        job("a", &a, ContainerState::Exited { exit_code: 143 }),
        job("b", &b, ContainerState::Running),
        job("c", &c, ContainerState::Exited { exit_code: 1 }),
    ];
    let stopped: Vec<&str> = mem
        .engine_seen(&after)
        .iter()
        .map(|c| c.id.as_str())
        .collect();
    assert_eq!(stopped, ["a"]);
    assert!(mem.stopped.contains("a") && !mem.stopped.contains("c"));
    assert_eq!(mem.running_jobs, BTreeSet::from(["b".to_owned()]));
    // Once back, nothing more is put on the engine's account.
    let later = [job("b", &b, ContainerState::Exited { exit_code: 0 })];
    assert!(mem.engine_seen(&later).is_empty());
    assert!(!mem.stopped.contains("b"));
}

#[test]
fn each_exited_attempt_is_uploaded_once_as_part_of_a_reclaim_when_the_agent_stopped_it() {
    let labelled = |id: &str, lease_id: u64, epoch: u64, rank: Option<u32>, state| {
        let mut c = job(id, &lease(lease_id, epoch, vec![0]), state);
        c.labels.insert(labels::JOB_ID.to_owned(), "7".to_owned());
        if let Some(r) = rank {
            c.labels.insert(labels::RANK.to_owned(), r.to_string());
        }
        c
    };
    let mut mem = Memory::default();
    mem.stopped.insert("reclaimed".to_owned());
    let host = vec![
        labelled("running", 1, 3, None, ContainerState::Running),
        labelled("ended", 2, 4, None, ContainerState::Exited { exit_code: 0 }),
        labelled(
            "reclaimed",
            3,
            5,
            Some(1),
            ContainerState::Exited { exit_code: 143 },
        ),
    ];
    let due = mem.uploads_due(&host);
    assert_eq!(
        due,
        [
            Upload {
                job: 7,
                rank: None,
                epoch: 4,
                reclaim: false
            },
            Upload {
                job: 7,
                rank: Some(1),
                epoch: 5,
                reclaim: true
            },
        ]
    );
    // Once: the next pass starts none again; a container removed is forgotten.
    assert!(mem.uploads_due(&host).is_empty());
    assert!(mem.uploads_due(&host[..1]).is_empty());
    assert!(mem.uploading.is_empty());
}

#[test]
fn a_restore_the_coordinator_dropped_is_aborted_or_its_unstarted_directory_uploaded() {
    let (listed, started, unstarted, running, with_container) = (
        lease(1, 10, vec![0]),
        lease(2, 11, vec![1]),
        lease(3, 12, vec![2]),
        lease(4, 13, vec![3]),
        lease(5, 14, vec![3]),
    );
    let mut mem = Memory::default();
    for l in [&listed, &started, &unstarted, &with_container] {
        mem.restored(l.clone(), Some(l.epoch - 1));
    }
    mem.restored.get_mut(&2).unwrap().started = true;
    // Only `listed` (and, not yet restored, a sixth lease) are still the coordinator's.
    let waiting = lease(6, 15, vec![0]);
    let host = [job(
        "c5",
        &with_container,
        ContainerState::Exited { exit_code: 0 },
    )];
    let (abort, uploads) = mem.forget_restores(
        &[listed.clone(), waiting.clone()],
        &host,
        [running.lease_id, waiting.lease_id],
    );
    assert_eq!(
        abort,
        [4],
        "the restore under way of a lease no longer listed"
    );
    assert_eq!(
        uploads,
        [Upload {
            job: unstarted.job_id,
            rank: None,
            epoch: 12,
            reclaim: false
        }],
        "only the directory restored for a container that never ran is uploaded back"
    );
    assert_eq!(mem.restored.keys().copied().collect::<Vec<_>>(), [1]);
    assert_eq!(
        unrestored(&[listed, waiting], &[], &mem),
        BTreeSet::from([6])
    );
}

#[test]
fn every_listed_lease_its_unlisted_containers_and_unheard_start_failures_are_reported() {
    use crate::runs::{RunFacts, runs};
    let (running, stopping, waiting, missing, gone) = (
        lease(1, 1, vec![0]),
        lease(2, 2, vec![1]),
        lease(3, 3, vec![2]),
        lease(4, 4, vec![3]),
        lease(5, 5, vec![3]),
    );
    let mut missing = missing;
    missing.job.image = "absent:1".into();
    let mut mem = Memory::default();
    mem.stopped.insert("c2".into());
    let mut taken_back = StartFailure::new(&lease(6, 6, vec![0]), "image missing".into());
    taken_back.unlisted_since = Some(t0());
    mem.start_failures.insert(6, taken_back);
    let mut obs = serving_host(0.0, 0);
    obs.containers = vec![
        job("c1", &running, ContainerState::Running),
        job("c2", &stopping, ContainerState::Running),
        job("c5", &gone, ContainerState::Exited { exit_code: 0 }),
    ];
    obs.containers[0].image = "r/trainer@sha256:ab".into();
    obs.missing_images.insert("absent:1".into());
    let facts = BTreeMap::from([(
        1,
        RunFacts {
            last_checkpoint_at: Some(42),
        },
    )]);
    let listed = [running, stopping, waiting, missing];
    let reported = runs(&listed, &obs, &mem, &facts);
    let by_lease = |id: u64| reported.iter().find(|r| r.lease_id == id).unwrap();
    assert_eq!(reported.len(), 6, "{reported:?}");
    assert_eq!(by_lease(1).state, JobRunState::Running);
    assert_eq!(by_lease(1).last_checkpoint_at, Some(42));
    assert_eq!(
        by_lease(1).image_digest.as_deref(),
        Some("r/trainer@sha256:ab")
    );
    assert_eq!(by_lease(2).state, JobRunState::Stopping);
    // Pending: ready to start once its image is there (and, in object storage, restored).
    assert_eq!(
        (by_lease(3).state.clone(), by_lease(3).ready),
        (JobRunState::Pending, true)
    );
    assert_eq!(
        (by_lease(4).state.clone(), by_lease(4).ready),
        (JobRunState::Pending, false)
    );
    // A container of a lease no longer listed, while it exists.
    assert_eq!(
        by_lease(5).state,
        JobRunState::Exited {
            exit_code: 0,
            stopped_by_agent: false
        }
    );
    assert_eq!(by_lease(6).state, mem.start_failures[&6].run.state);
}

#[test]
fn start_failures_are_forgotten_a_lease_ttl_after_unlisting() {
    let t0 = t0();
    let l = lease(1, 1, vec![0]);
    let mut mem = Memory::default();
    mem.start_failures
        .insert(1, StartFailure::new(&l, "image missing".into()));
    let listed = desired(false, std::slice::from_ref(&l));
    mem.track_start_failures(&listed, t0);
    assert_eq!(mem.start_failures[&1].unlisted_since, None);
    let unlisted = desired(false, &[]);
    mem.track_start_failures(&unlisted, t0);
    mem.track_start_failures(&unlisted, t0 + Duration::from_secs(9));
    assert_eq!(mem.start_failures[&1].unlisted_since, Some(t0));
    mem.track_start_failures(&unlisted, t0 + Duration::from_secs(10));
    assert!(mem.start_failures.is_empty());
}

#[test]
fn a_missing_image_is_pulled_before_the_drain_begins() {
    let (cfg, t0) = (cfg(), t0());
    let mut l = [lease(1, 1, vec![0, 1]), lease(2, 1, vec![2, 3])];
    l[1].job.image = "registry:5000/eval:2".into();
    let lend = desired(false, &l);
    let mut obs = serving_host(3.0, 70 * GIB);
    obs.missing_images = ["registry:5000/eval:2".to_owned()].into();
    let serving = memory(ReplicaState::Serving, None);
    // The replica still serves: no drain step, only the pull, for the leases that need it.
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &serving, t0),
        [Step::Pull {
            image: "registry:5000/eval:2".into(),
            leases: vec![l[1].clone()]
        }]
    );
    // Once every leased image is there, the drain begins.
    obs.missing_images.clear();
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &serving, t0)[0],
        Step::Replica(ReplicaEvent::DrainBegan)
    );
}

#[test]
fn checkpoints_are_restored_before_the_drain_begins() {
    let (cfg, t0) = (cfg(), t0());
    let mut l = [lease(1, 1, vec![0, 1]), lease(2, 1, vec![2, 3])];
    l[1].job.image = "registry:5000/eval:2".into();
    let lend = desired(false, &l);
    let mut obs = serving_host(3.0, 70 * GIB);
    obs.unrestored = [2].into();
    obs.missing_images = ["registry:5000/eval:2".to_owned()].into();
    let serving = memory(ReplicaState::Serving, None);
    // Images first (a pull is the longer wait, and the restore then runs beside nothing).
    assert!(matches!(
        plan(&cfg, Some(&lend), &l, &obs, &serving, t0)[..],
        [Step::Pull { .. }]
    ));
    obs.missing_images.clear();
    // The replica still serves: only the restore, for the lease that needs it.
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &serving, t0),
        [Step::Restore(vec![l[1].clone()])]
    );
    // A lease whose start failed (its restore did) is not restored again.
    let mut failed = serving.clone();
    failed
        .start_failures
        .insert(2, StartFailure::new(&l[1], "restoring failed".into()));
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &failed, t0)[0],
        Step::Replica(ReplicaEvent::DrainBegan)
    );
    // Once restored, the drain begins.
    obs.unrestored.clear();
    assert_eq!(
        plan(&cfg, Some(&lend), &l, &obs, &serving, t0)[0],
        Step::Replica(ReplicaEvent::DrainBegan)
    );
}

#[test]
fn leases_that_all_failed_to_pull_leave_the_replica_serving() {
    let (cfg, t0) = (cfg(), t0());
    let l = [lease(1, 1, vec![0, 1])];
    let lend = desired(false, &l);
    let obs = serving_host(3.0, 70 * GIB);
    let mut failed = memory(ReplicaState::Serving, None);
    failed.start_failures.insert(
        1,
        StartFailure::new(&l[0], "pulling trainer:1 failed".into()),
    );
    assert_eq!(plan(&cfg, Some(&lend), &l, &obs, &failed, t0), []);
    // Another lease that can start still drains the node.
    let two = [l[0].clone(), lease(2, 1, vec![2, 3])];
    assert_eq!(
        plan(&cfg, Some(&desired(false, &two)), &two, &obs, &failed, t0)[0],
        Step::Replica(ReplicaEvent::DrainBegan)
    );
}

/// Lease `id` as gang member `rank` of 2, held for its peers when `wait`.
fn member(id: u64, rank: u32, wait: bool) -> LeaseGrant {
    let mut l = lease(id, id, vec![0, 1, 2, 3]);
    l.rendezvous = Some(nightshift_common::Rendezvous {
        master_addr: "10.0.0.1".into(),
        master_port: 29_500,
        nnodes: 2,
        node_rank: rank,
        nproc_per_node: 4,
        wait_for_peers: wait,
    });
    l
}

#[test]
fn a_gang_member_held_for_its_peers_pulls_but_neither_drains_nor_starts() {
    let (cfg, t0) = (cfg(), t0());
    let held = [member(1, 1, true)];
    let lend = desired(false, &held);
    let mut obs = serving_host(3.0, 70 * GIB);
    let serving = memory(ReplicaState::Serving, None);
    // Its own image first, while the replica serves.
    obs.missing_images = ["trainer:1".to_owned()].into();
    assert!(
        matches!(
            &plan(&cfg, Some(&lend), &held, &obs, &serving, t0)[..],
            [Step::Pull { .. }]
        ),
        "the held member's image is pulled"
    );
    // The image is there, a peer still pulls: the replica serves on, nothing to do.
    obs.missing_images.clear();
    assert_eq!(plan(&cfg, Some(&lend), &held, &obs, &serving, t0), []);
    // The whole gang is ready: the drain begins.
    let go = [member(1, 1, false)];
    assert_eq!(
        plan(&cfg, Some(&desired(false, &go)), &go, &obs, &serving, t0)[0],
        Step::Replica(ReplicaEvent::DrainBegan)
    );
}

#[test]
fn on_a_node_already_lent_a_held_member_waits_with_free_gpus_and_starts_when_told() {
    let (cfg, t0) = (cfg(), t0());
    let mut obs = serving_host(0.0, 0);
    obs.containers.clear();
    obs.replica = None;
    let stopped = memory(ReplicaState::Stopped, Some((Phase::ConfirmFreeForJobs, t0)));
    let held = [member(1, 0, true)];
    assert_eq!(
        plan(
            &cfg,
            Some(&desired(false, &held)),
            &held,
            &obs,
            &stopped,
            t0
        ),
        [],
        "nothing starts while a peer is not ready"
    );
    let go = [member(1, 0, false)];
    assert_eq!(
        plan(&cfg, Some(&desired(false, &go)), &go, &obs, &stopped, t0),
        [Step::StartJobs(go.to_vec()), Step::Enter(None)]
    );
    // Beside a single-node lease that may start: that one starts, the member waits.
    let mixed = [member(1, 0, true), lease(2, 2, vec![])];
    assert_eq!(
        plan(
            &cfg,
            Some(&desired(false, &mixed)),
            &mixed,
            &obs,
            &stopped,
            t0
        ),
        [Step::StartJobs(vec![mixed[1].clone()]), Step::Enter(None)]
    );
    // A serving node with such a pair drains for the lease that may start.
    let serving = memory(ReplicaState::Serving, None);
    let obs = serving_host(0.0, 70 * GIB);
    assert_eq!(
        plan(
            &cfg,
            Some(&desired(false, &mixed)),
            &mixed,
            &obs,
            &serving,
            t0
        )[0],
        Step::Replica(ReplicaEvent::DrainBegan)
    );
}

#[test]
fn an_exited_containers_outputs_are_read_once_and_forgotten_with_it() {
    let (exited, running, unlisted) = (
        lease(1, 1, vec![0]),
        lease(2, 2, vec![1]),
        lease(3, 3, vec![2]),
    );
    let containers = vec![
        job("c1", &exited, ContainerState::Exited { exit_code: 0 }),
        job("c2", &running, ContainerState::Running),
        job("c3", &unlisted, ContainerState::Exited { exit_code: 0 }),
    ];
    let listed = [exited, running];
    let mut mem = Memory::default();
    let due: Vec<&str> = mem
        .outputs_due(&listed, &containers)
        .iter()
        .map(|(_, c)| c.id.as_str())
        .collect();
    assert_eq!(due, ["c1"], "only the listed lease's exited container");
    mem.outputs
        .insert("c1".into(), BTreeMap::from([("loss".into(), "0.1".into())]));
    assert!(
        mem.outputs_due(&listed, &containers).is_empty(),
        "read once"
    );
    mem.removed(&containers[0]);
    assert!(mem.outputs.is_empty(), "forgotten with its container");
}

#[test]
fn a_failed_restore_fails_the_start_and_a_failed_upload_is_tried_four_more_times() {
    let l = lease(7, 3, vec![0]);
    let mut mem = Memory::default();
    mem.restore_ended(l.clone(), Err("the bucket answers 403".into()));
    let failure = &mem.start_failures[&7];
    assert!(
        matches!(&failure.run.state, JobRunState::FailedToStart { message, refused_by_host: false }
            if message == "restoring the checkpoint: the bucket answers 403"),
        "{:?}",
        failure.run.state
    );
    assert!(!mem.restored.contains_key(&7));
    mem.restore_ended(lease(8, 4, vec![1]), Ok(Some(3)));
    assert_eq!(mem.restored[&8].from_epoch, Some(3));

    let waits: Vec<Option<u64>> = (1..=UPLOAD_TRIES)
        .map(|t| upload_retry(t).map(|d| d.as_secs()))
        .collect();
    assert_eq!(waits, [Some(2), Some(4), Some(8), Some(16), None]);
}
