//! The agent's sequences on the fakes (`crate::fake`): drain, reclaim, the sleep path and its
//! fall-back to stop, the fail-safe, adoption after a restart, a desired state that changes
//! mid-drain, a job that ignores its signal, a stale lease and start failures. Time is
//! tokio's, paused: each test runs minutes of host time in milliseconds.

use std::sync::Arc;
use std::time::Duration;

use nightshift_common::{
    Capture, CheckpointPolicy, DesiredNode, HostFacts, JobRunState, JobSpec, LeaseGrant,
    ReplicaState, STDOUT_OUTPUT, SequenceKind, labels,
};
use tokio::time::Instant;

use super::Reconciler;
use crate::config::{AgentConfig, ReclaimMode};
use crate::engine::ContainerState;
use crate::fake::{
    Behaviour, EngineCall, FakeEngine, FakeHostGpus, FakeNode, FakeVllm, VllmBehaviour,
};
use crate::host::FixedHost;
use crate::state::Shared;

const GIB: u64 = 1 << 30;
const NODE: &str = "n1";
const TRAINER: &str = "trainer:1";

type FakeReconciler = Reconciler<FakeEngine, FakeHostGpus, FakeVllm>;

/// A fake host, the agent's shared state and a reconciler over them.
struct Rig {
    node: FakeNode,
    shared: Arc<Shared>,
    host: Arc<FixedHost>,
    cfg: Arc<AgentConfig>,
    r: FakeReconciler,
    _dir: tempfile::TempDir,
}

fn config(dir: &std::path::Path) -> AgentConfig {
    let mut cfg = AgentConfig {
        node: NODE.into(),
        work_dir: dir.to_path_buf(),
        readiness_grace_s: 1.0,
        drain_timeout_s: 30.0,
        free_timeout_s: 10.0,
        health_timeout_s: 60.0,
        ..AgentConfig::default()
    };
    cfg.replica.image = "vllm:fake".into();
    cfg.replica.host_ip = "127.0.0.1".into();
    cfg.replica.host_port = 0;
    cfg.replica.shutdown_timeout_s = 5.0;
    cfg.replica.sleep_free_timeout_s = 3.0;
    cfg
}

fn rig(tweak: impl FnOnce(&mut AgentConfig)) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    tweak(&mut cfg);
    let node = FakeNode::new(NODE, 4);
    let host = Arc::new(FixedHost::new(HostFacts {
        checkpoint_volume_free_bytes: Some(100 * GIB),
        ..HostFacts::default()
    }));
    let (shared, cfg) = (Arc::new(Shared::new(NODE)), Arc::new(cfg));
    let r = reconciler(&node, &shared, &cfg, &host);
    Rig {
        node,
        shared,
        host,
        cfg,
        r,
        _dir: dir,
    }
}

fn reconciler(
    node: &FakeNode,
    shared: &Arc<Shared>,
    cfg: &Arc<AgentConfig>,
    host: &Arc<FixedHost>,
) -> FakeReconciler {
    Reconciler::new(
        cfg.clone(),
        node.engine.clone(),
        node.gpus.clone(),
        node.vllm.clone(),
        shared.clone(),
    )
    .with_host(host.clone())
}

impl Rig {
    /// Offers `desired` as the coordinator's answer to a heartbeat just sent, and runs a pass.
    async fn tell(&mut self, desired: DesiredNode) {
        self.shared.offer_desired(desired);
        self.shared.contact();
        self.r.pass().await.expect("pass");
    }

    fn phases(&self, sequence: SequenceKind) -> Vec<String> {
        self.shared
            .phases()
            .into_iter()
            .filter(|p| p.sequence == sequence)
            .map(|p| p.phase)
            .collect()
    }

    fn phase_ms(&self, sequence: SequenceKind, phase: &str) -> u64 {
        self.shared
            .phases()
            .into_iter()
            .rfind(|p| p.sequence == sequence && p.phase == phase)
            .unwrap_or_else(|| panic!("no phase {phase}"))
            .duration_ms
    }

    fn jobs(&self) -> Vec<crate::engine::Container> {
        self.node.containers_of(labels::ROLE_JOB)
    }

    fn replicas(&self) -> Vec<crate::engine::Container> {
        self.node.containers_of(labels::ROLE_REPLICA)
    }

    fn run_state(&self, lease_id: u64) -> Option<JobRunState> {
        self.shared
            .observed()
            .runs
            .into_iter()
            .find(|r| r.lease_id == lease_id)
            .map(|r| r.state)
    }

    /// Serves: the replica started and healthy.
    async fn serving(&mut self) {
        self.tell(serve(1)).await;
        assert_eq!(self.shared.observed().replica(), ReplicaState::Serving);
        assert!(self.shared.ready());
    }
}

fn desired(version: u64, serve: bool, leases: Vec<LeaseGrant>) -> DesiredNode {
    DesiredNode {
        version,
        serve,
        leases,
        lease_ttl_ms: 600_000,
    }
}

fn serve(version: u64) -> DesiredNode {
    desired(version, true, Vec::new())
}

fn lend(version: u64, leases: Vec<LeaseGrant>) -> DesiredNode {
    desired(version, false, leases)
}

fn lease(lease_id: u64, epoch: u64, job_id: u64, gpus: Vec<u32>) -> LeaseGrant {
    LeaseGrant {
        lease_id,
        epoch,
        job_id,
        attempt: 1,
        job: JobSpec {
            checkpoint: CheckpointPolicy {
                signal: "SIGTERM".into(),
                grace_period_seconds: 7,
            },
            ..JobSpec::new(format!("job-{job_id}"), TRAINER, gpus.len() as u32)
        },
        gpus,
        rendezvous: None,
    }
}

fn running(c: &crate::engine::Container) -> bool {
    c.state == ContainerState::Running
}

#[tokio::test(start_paused = true)]
async fn drain_stops_the_replica_after_its_requests_and_starts_the_job_on_free_gpus() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    let replica = rig.replicas()[0].id.clone();
    // Six requests, four at a time, one finishing every 500 ms: 3 s of work.
    rig.node.set_load(6, 4, Duration::from_millis(500));

    let t = Instant::now();
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1])])).await;
    assert_eq!(
        rig.phases(SequenceKind::Drain),
        [
            "mark_not_ready",
            "wait_in_flight",
            "stop_replica",
            "confirm_free",
            "start_jobs"
        ]
    );
    assert!(!rig.shared.ready());
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Stopped);
    assert_eq!(rig.shared.observed().replica_url, None);
    // Not-ready for the readiness grace, then the requests finish, then the memory frees.
    assert!(rig.phase_ms(SequenceKind::Drain, "mark_not_ready") >= 1_000);
    assert!(rig.phase_ms(SequenceKind::Drain, "wait_in_flight") >= 1_900);
    assert!(rig.phase_ms(SequenceKind::Drain, "confirm_free") >= 1_900);
    assert!(t.elapsed() >= Duration::from_secs(5));
    let replicas = rig.replicas();
    assert_eq!(replicas[0].id, replica);
    assert!(matches!(replicas[0].state, ContainerState::Exited { .. }));
    let jobs = rig.jobs();
    assert_eq!(jobs.len(), 1);
    assert!(running(&jobs[0]));
    assert_eq!(jobs[0].labels[labels::GPUS], "0,1");
    assert_eq!(rig.run_state(1), Some(JobRunState::Running));
    // The job started only once the replica's memory was gone.
    assert_eq!(
        (rig.node.memory_used(0), rig.node.memory_used(3)),
        (10 * GIB, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn reclaim_stops_the_jobs_and_serves_again() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1, 2, 3])]))
        .await;
    let job = rig.jobs()[0].id.clone();

    rig.tell(serve(3)).await;
    assert_eq!(
        rig.phases(SequenceKind::Reclaim),
        [
            "confirm_free",
            "start_replica",
            "wait_health",
            "stop_jobs",
            "confirm_free",
            "start_replica",
            "wait_health"
        ]
    );
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert!(rig.shared.ready());
    assert!(rig.node.engine_calls().contains(&EngineCall::Stop {
        id: job.clone(),
        grace: Duration::from_secs(7)
    }));
    // The job took its signal and exited; its lease is no longer listed, so it is removed.
    assert!(rig.jobs().is_empty(), "{:?}", rig.jobs());
    assert!(
        rig.node
            .engine_calls()
            .contains(&EngineCall::Remove { id: job })
    );
    let replicas: Vec<_> = rig.replicas().into_iter().filter(running).collect();
    assert_eq!(replicas.len(), 1);
    // Its output was kept before the container went.
    assert!(crate::logs::archive_path(&rig.cfg.work_dir, 1, 1).exists());
}

#[tokio::test(start_paused = true)]
async fn sleep_mode_lends_a_sleeping_replica_and_wakes_it_on_reclaim() {
    let mut rig = rig(|c| c.replica.reclaim = ReclaimMode::Sleep);
    rig.serving().await;
    let replica = rig.replicas()[0].id.clone();

    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1, 2, 3])]))
        .await;
    assert_eq!(
        rig.phases(SequenceKind::Drain),
        [
            "mark_not_ready",
            "wait_in_flight",
            "sleep_replica",
            "confirm_free",
            "start_jobs"
        ]
    );
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Sleeping);
    assert!(!rig.shared.ready(), "a sleeping replica is not ready");
    assert_eq!(rig.node.replica_asleep(), Some(true));
    assert!(running(&rig.replicas()[0]), "the container is kept, asleep");
    assert!(running(&rig.jobs()[0]));

    rig.tell(serve(3)).await;
    let reclaim = rig.phases(SequenceKind::Reclaim);
    assert_eq!(
        reclaim[reclaim.len() - 4..],
        ["stop_jobs", "confirm_free", "wake_replica", "wait_health"]
    );
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert!(rig.shared.ready());
    let replicas = rig.replicas();
    assert_eq!(replicas.len(), 1);
    assert_eq!(replicas[0].id, replica, "woken, not restarted");
    assert_eq!(rig.node.replica_asleep(), Some(false));
}

#[tokio::test(start_paused = true)]
async fn sleep_that_frees_too_little_falls_back_to_stopping_the_replica() {
    let mut rig = rig(|c| c.replica.reclaim = ReclaimMode::Sleep);
    rig.node.set_vllm(VllmBehaviour {
        asleep_bytes: 20 * GIB,
        ..VllmBehaviour::default()
    });
    rig.serving().await;

    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1, 2, 3])]))
        .await;
    assert_eq!(
        rig.phases(SequenceKind::Drain),
        [
            "mark_not_ready",
            "wait_in_flight",
            "sleep_replica",
            "sleep_insufficient",
            "stop_replica",
            "confirm_free",
            "start_jobs"
        ]
    );
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Stopped);
    assert!(!running(&rig.replicas()[0]));
    assert!(running(&rig.jobs()[0]));
}

#[tokio::test(start_paused = true)]
async fn the_fail_safe_stops_jobs_when_the_coordinator_is_silent_and_refuses_their_leases() {
    let mut rig = rig(|_| {});
    let mut lent = lend(1, vec![lease(41, 1, 1, vec![0, 1])]);
    lent.lease_ttl_ms = 2_000;
    rig.tell(lent.clone()).await;
    assert!(running(&rig.jobs()[0]));

    // Silent past the lease TTL: the job is stopped and the node serves on its own.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    rig.r.pass().await.expect("fail-safe");
    assert_eq!(rig.shared.observed().expired_leases, vec![41]);
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert!(rig.shared.ready());
    assert!(rig.jobs().iter().all(|c| !running(c)), "{:?}", rig.jobs());
    assert!(
        rig.node.engine_calls().iter().any(
            |c| matches!(c, EngineCall::Stop { grace, .. } if *grace == Duration::from_secs(7))
        ),
        "stopped with its grace"
    );

    // The coordinator answers again, still listing the lease: it stays void.
    rig.shared.contact();
    rig.r.pass().await.expect("coordinator back");
    assert!(rig.jobs().iter().all(|c| !running(c)), "nothing restarted");
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert_eq!(rig.shared.observed().expired_leases, vec![41]);

    // Once the coordinator drops it, it is no longer reported.
    rig.tell(serve(2)).await;
    assert!(rig.shared.observed().expired_leases.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_restarted_agent_adopts_the_containers_it_finds() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    // A new agent process: fresh shared state and reconciler over the same host.
    let shared = Arc::new(Shared::new(NODE));
    let mut r = reconciler(&rig.node, &shared, &rig.cfg, &rig.host);
    r.pass().await.expect("before the coordinator answers");
    assert_eq!(shared.observed().replica(), ReplicaState::Serving);
    assert!(shared.ready(), "a healthy replica is adopted as serving");
    shared.offer_desired(serve(1));
    shared.contact();
    r.pass().await.expect("serve");
    assert_eq!(rig.replicas().len(), 1, "no second replica");

    // Lent, then restarted again: the job is adopted, not started twice.
    shared.offer_desired(lend(2, vec![lease(1, 1, 1, vec![0, 1])]));
    r.pass().await.expect("lend");
    let job = rig.jobs()[0].id.clone();
    let shared = Arc::new(Shared::new(NODE));
    let mut r = reconciler(&rig.node, &shared, &rig.cfg, &rig.host);
    r.pass().await.expect("before the coordinator answers");
    assert_eq!(
        shared
            .observed()
            .runs
            .iter()
            .map(|r| (r.lease_id, r.state.clone()))
            .collect::<Vec<_>>(),
        [(1, JobRunState::Running)],
        "the running job is reported"
    );
    shared.offer_desired(lend(2, vec![lease(1, 1, 1, vec![0, 1])]));
    shared.contact();
    r.pass().await.expect("lend again");
    let jobs = rig.jobs();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0].id, job);
    assert!(running(&jobs[0]));
    assert_eq!(shared.observed().replica(), ReplicaState::Stopped);
}

#[tokio::test(start_paused = true)]
async fn a_restarted_agent_adopts_a_sleeping_replica_as_sleeping() {
    let mut rig = rig(|c| c.replica.reclaim = ReclaimMode::Sleep);
    rig.serving().await;
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1, 2, 3])]))
        .await;
    let shared = Arc::new(Shared::new(NODE));
    let mut r = reconciler(&rig.node, &shared, &rig.cfg, &rig.host);
    r.pass().await.expect("before the coordinator answers");
    assert_eq!(shared.observed().replica(), ReplicaState::Sleeping);
    assert!(!shared.ready());
}

#[tokio::test(start_paused = true)]
async fn a_drain_is_abandoned_when_the_node_should_serve_again() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    let replica = rig.replicas()[0].id.clone();
    // A long queue: the drain waits on it.
    rig.node.set_load(100, 4, Duration::from_secs(1));
    rig.shared
        .offer_desired(lend(2, vec![lease(1, 1, 1, vec![0, 1])]));
    rig.shared.contact();
    let shared = rig.shared.clone();
    let surge = async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!shared.ready(), "draining");
        assert_eq!(shared.observed().replica(), ReplicaState::Draining);
        shared.offer_desired(serve(3));
    };
    let (result, ()) = tokio::join!(rig.r.pass(), surge);
    result.expect("pass");
    rig.r.pass().await.expect("serve");
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert!(rig.shared.ready());
    let replicas = rig.replicas();
    assert_eq!(replicas.len(), 1);
    assert_eq!(replicas[0].id, replica, "the same replica serves on");
    assert!(running(&replicas[0]));
    assert!(rig.jobs().is_empty(), "no job started");
    assert!(
        !rig.phases(SequenceKind::Drain)
            .contains(&"stop_replica".to_owned()),
        "{:?}",
        rig.phases(SequenceKind::Drain)
    );
}

#[tokio::test(start_paused = true)]
async fn a_job_that_ignores_its_signal_is_killed_after_its_grace() {
    let mut rig = rig(|_| {});
    rig.node.behave(
        TRAINER,
        Behaviour {
            ignores_signal: true,
            ..Behaviour::default()
        },
    );
    rig.tell(lend(1, vec![lease(1, 1, 1, vec![0, 1])])).await;
    // The lease is revoked while the node stays lent.
    rig.tell(lend(2, Vec::new())).await;
    let stop = rig
        .shared
        .phases()
        .into_iter()
        .filter(|p| p.sequence == SequenceKind::Reclaim && p.phase == "stop_jobs")
        .count();
    assert_eq!(stop, 0, "not a reclaim: the node stays lent");
    let jobs = rig.jobs();
    // Reported as killed by the agent before it is removed on the next pass.
    assert!(jobs.is_empty() || jobs[0].state == ContainerState::Exited { exit_code: 137 });

    // And on reclaim: stop_jobs lasts the whole grace.
    let mut rig = self::rig(|_| {});
    rig.node.behave(
        TRAINER,
        Behaviour {
            ignores_signal: true,
            ..Behaviour::default()
        },
    );
    rig.tell(lend(1, vec![lease(1, 1, 1, vec![0, 1])])).await;
    let job = rig.jobs()[0].id.clone();
    rig.tell(serve(2)).await;
    assert!(rig.phase_ms(SequenceKind::Reclaim, "stop_jobs") >= 7_000);
    assert!(
        !rig.jobs().iter().any(|c| c.id == job),
        "removed once exited"
    );
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
}

#[tokio::test(start_paused = true)]
async fn a_stale_lease_is_refused() {
    let mut rig = rig(|_| {});
    rig.tell(lend(1, vec![lease(1, 5, 1, vec![0, 1])])).await;
    // An older epoch on a GPU a newer lease holds: refused, neither started nor reported.
    rig.tell(lend(
        2,
        vec![lease(1, 5, 1, vec![0, 1]), lease(2, 3, 2, vec![1])],
    ))
    .await;
    assert_eq!(rig.jobs().len(), 1);
    assert!(rig.run_state(2).is_none());
    // A newer epoch on a free GPU starts.
    rig.tell(lend(
        3,
        vec![lease(1, 5, 1, vec![0, 1]), lease(3, 6, 3, vec![2])],
    ))
    .await;
    assert_eq!(rig.jobs().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn start_failures_are_reported_and_kept_a_lease_ttl_after_unlisting() {
    let mut rig = rig(|_| {});
    rig.node.image_missing("missing:1");
    rig.node.refuse_image("refused:1", "exec format error");
    let mut missing = lease(1, 1, 1, vec![0]);
    missing.job.image = "missing:1".into();
    let mut refused = lease(2, 2, 2, vec![1]);
    refused.job.image = "refused:1".into();
    let fine = lease(3, 3, 3, vec![2]);
    let mut lent = lend(1, vec![missing, refused, fine.clone()]);
    lent.lease_ttl_ms = 5_000;
    rig.tell(lent).await;
    assert!(
        matches!(rig.run_state(1), Some(JobRunState::FailedToStart { message, refused_by_host: false }) if message.contains("missing:1"))
    );
    assert!(
        matches!(rig.run_state(2), Some(JobRunState::FailedToStart { message, refused_by_host: false }) if message.contains("exec format error"))
    );
    assert_eq!(rig.run_state(3), Some(JobRunState::Running));
    assert_eq!(rig.jobs().len(), 1, "the others go on");

    // Unlisted: still reported for a lease TTL, then forgotten.
    let mut later = lend(2, vec![fine.clone()]);
    later.lease_ttl_ms = 5_000;
    rig.tell(later.clone()).await;
    assert!(matches!(
        rig.run_state(1),
        Some(JobRunState::FailedToStart { .. })
    ));
    tokio::time::sleep(Duration::from_secs(6)).await;
    rig.tell(DesiredNode {
        version: 3,
        ..later
    })
    .await;
    assert!(rig.run_state(1).is_none());
    assert!(rig.run_state(2).is_none());

    // The checkpoint volume short of its floor: nothing starts, and it says why.
    rig.host.set(HostFacts {
        checkpoint_volume_free_bytes: Some(GIB / 2),
        ..HostFacts::default()
    });
    let mut lent = lend(4, vec![fine, lease(4, 4, 4, vec![3])]);
    lent.lease_ttl_ms = 5_000;
    rig.tell(lent).await;
    assert!(
        matches!(rig.run_state(4), Some(JobRunState::FailedToStart { message, refused_by_host: true }) if message.contains("checkpoint_min_free_bytes"))
    );
    assert_eq!(rig.jobs().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_job_that_ends_alone_is_reported_with_its_outputs_then_removed() {
    let mut rig = rig(|_| {});
    rig.node.behave(
        TRAINER,
        Behaviour {
            exits_after: Some((Duration::from_secs(3), 0)),
            stdout: "loss 0.1\ndone\n".into(),
            files: vec![("/out/score".into(), b"0.93".to_vec())],
            ..Behaviour::default()
        },
    );
    let mut l = lease(1, 1, 1, vec![0]);
    l.job.capture = Capture {
        files: vec![nightshift_common::CaptureFile {
            name: "score".into(),
            path: "/out/score".into(),
        }],
        stdout: true,
    };
    rig.tell(lend(1, vec![l.clone()])).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    rig.tell(lend(2, vec![l])).await;
    let run = rig.shared.observed().runs.remove(0);
    assert_eq!(
        run.state,
        JobRunState::Exited {
            exit_code: 0,
            stopped_by_agent: false
        }
    );
    assert_eq!(run.outputs["score"], "0.93");
    assert_eq!(run.outputs[STDOUT_OUTPUT], "loss 0.1\ndone\n");
    // The coordinator has seen it end and drops the lease: the container goes, its log kept.
    rig.tell(lend(3, Vec::new())).await;
    assert!(rig.jobs().is_empty());
    let kept = std::fs::read_to_string(crate::logs::archive_path(&rig.cfg.work_dir, 1, 1)).unwrap();
    assert_eq!(kept, "loss 0.1\ndone\n");
}

#[tokio::test(start_paused = true)]
async fn a_failed_sleep_stops_the_replica_instead() {
    let mut rig = rig(|c| c.replica.reclaim = ReclaimMode::Sleep);
    rig.node.set_vllm(VllmBehaviour {
        sleep_fails: true,
        ..VllmBehaviour::default()
    });
    rig.serving().await;
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1, 2, 3])]))
        .await;
    assert_eq!(
        rig.phases(SequenceKind::Drain),
        [
            "mark_not_ready",
            "wait_in_flight",
            "stop_replica",
            "confirm_free",
            "start_jobs"
        ]
    );
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Stopped);
    assert!(running(&rig.jobs()[0]));
}

#[tokio::test(start_paused = true)]
async fn the_drain_timeout_stops_a_replica_that_keeps_working() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    // Far more work than the 30 s drain timeout allows.
    rig.node.set_load(1_000, 4, Duration::from_secs(1));
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1])])).await;
    let waited = rig.phase_ms(SequenceKind::Drain, "wait_in_flight");
    assert!((30_000..31_000).contains(&waited), "{waited} ms");
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Stopped);
    assert!(running(&rig.jobs()[0]));
}

#[tokio::test(start_paused = true)]
async fn a_replica_that_never_becomes_healthy_fails_and_the_next_pass_waits_again() {
    let mut rig = rig(|c| c.health_timeout_s = 10.0);
    rig.node.set_vllm(VllmBehaviour {
        healthy_after: Duration::from_secs(15),
        ..VllmBehaviour::default()
    });
    rig.shared.offer_desired(serve(1));
    rig.shared.contact();
    let err = rig.r.pass().await.expect_err("health timeout");
    assert!(
        matches!(err, super::ReconcileError::HealthTimeout(d) if d == Duration::from_secs(10)),
        "{err}"
    );
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Failed);
    assert!(!rig.shared.ready());
    // The same container is waited for again, and now answers.
    rig.shared.contact();
    rig.r.pass().await.expect("healthy at last");
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert_eq!(rig.replicas().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn jobs_wait_for_gpu_memory_that_frees_late_and_give_up_after_the_free_timeout() {
    let mut rig = rig(|c| c.free_timeout_s = 5.0);
    rig.serving().await;
    // The driver shows the replica's memory for 8 s after it stopped: past the timeout.
    rig.node.set_memory_frees_after(Duration::from_secs(8));
    rig.shared
        .offer_desired(lend(2, vec![lease(1, 1, 1, vec![0, 1])]));
    rig.shared.contact();
    let err = rig.r.pass().await.expect_err("gpus busy");
    assert!(
        matches!(&err, super::ReconcileError::GpusBusy { gpus, .. } if gpus.len() == 4),
        "{err}"
    );
    assert!(rig.jobs().is_empty(), "nothing started on busy gpus");
    // A pass later the memory is gone and the job starts.
    rig.shared.contact();
    rig.r.pass().await.expect("free at last");
    assert!(running(&rig.jobs()[0]));
}

#[tokio::test(start_paused = true)]
async fn a_failed_wake_is_sent_again_on_the_next_pass() {
    let mut rig = rig(|c| c.replica.reclaim = ReclaimMode::Sleep);
    rig.serving().await;
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1, 2, 3])]))
        .await;
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Sleeping);
    rig.node.set_vllm(VllmBehaviour {
        wake_fails: true,
        ..VllmBehaviour::default()
    });
    rig.shared.offer_desired(serve(3));
    rig.shared.contact();
    let err = rig.r.pass().await.expect_err("wake fails");
    assert!(matches!(err, super::ReconcileError::Wake(_)), "{err}");
    assert!(!rig.shared.ready());
    rig.node.set_vllm(VllmBehaviour::default());
    rig.r.pass().await.expect("woken");
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert_eq!(rig.node.replica_asleep(), Some(false));
    let wakes = rig
        .node
        .vllm_calls()
        .into_iter()
        .filter(|c| *c == crate::fake::VllmCall::WakeUp)
        .count();
    assert_eq!(wakes, 2);
}

const REGISTRY_IMAGE: &str = "127.0.0.1:5000/team/eval:1";

fn pulled_lease(lease_id: u64, job_id: u64, gpus: Vec<u32>, image: &str) -> LeaseGrant {
    let mut l = lease(lease_id, lease_id, job_id, gpus);
    l.job.image = image.into();
    l
}

/// The index of the first engine call that matches, if any.
fn call_at(calls: &[EngineCall], f: impl Fn(&EngineCall) -> bool) -> Option<usize> {
    calls.iter().position(f)
}

#[tokio::test(start_paused = true)]
async fn a_missing_image_is_pulled_while_the_replica_serves_then_pinned() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    rig.node.publish(REGISTRY_IMAGE, "sha256:aaa", None);
    rig.node.set_pull_takes(Duration::from_secs(40));
    let replica = rig.replicas()[0].id.clone();

    rig.tell(lend(
        2,
        vec![pulled_lease(1, 1, vec![0, 1], REGISTRY_IMAGE)],
    ))
    .await;
    let calls = rig.node.engine_calls();
    let pulled = call_at(
        &calls,
        |c| matches!(c, EngineCall::Pull { image, user: None } if image == REGISTRY_IMAGE),
    );
    let stopped = call_at(
        &calls,
        |c| matches!(c, EngineCall::Stop { id, .. } if *id == replica),
    );
    assert!(
        pulled.is_some() && pulled < stopped,
        "the pull comes before the replica stops: {calls:?}"
    );
    // The pull is no part of the drain's idle time: the drain's first phase is not 40 s.
    assert!(rig.phase_ms(SequenceKind::Drain, "pull_image") >= 40_000);
    assert!(rig.phase_ms(SequenceKind::Drain, "stop_replica") < 40_000);
    // The job runs its image pinned to the registry digest, and says so.
    let pinned = "127.0.0.1:5000/team/eval@sha256:aaa";
    assert_eq!(rig.jobs()[0].image, pinned);
    let run = rig.shared.observed().runs[0].clone();
    assert_eq!(run.state, JobRunState::Running);
    assert_eq!(run.image_digest.as_deref(), Some(pinned));
}

#[tokio::test(start_paused = true)]
async fn a_refused_pull_fails_its_lease_and_the_node_serves_or_runs_the_next() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    rig.node
        .publish(REGISTRY_IMAGE, "sha256:aaa", Some(("alice", "right")));
    let bad = pulled_lease(1, 1, vec![0, 1], REGISTRY_IMAGE);
    rig.tell(lend(2, vec![bad.clone()])).await;
    let failed = |rig: &Rig| match rig.run_state(1) {
        Some(JobRunState::FailedToStart { message, .. }) => message,
        other => panic!("expected a start failure, got {other:?}"),
    };
    let message = failed(&rig);
    assert!(
        message.contains("registry 127.0.0.1:5000") && message.contains("unauthorized"),
        "{message}"
    );
    // No drain for it: the replica still serves.
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert!(rig.shared.ready());
    assert!(rig.jobs().is_empty());
    // Asked again (the same lease still listed), it is not pulled again.
    let pulls = |rig: &Rig| {
        rig.node
            .engine_calls()
            .iter()
            .filter(|c| matches!(c, EngineCall::Pull { .. }))
            .count()
    };
    rig.tell(lend(3, vec![bad.clone()])).await;
    assert_eq!(pulls(&rig), 1);
    // The node's next lease goes on.
    rig.tell(lend(4, vec![bad, lease(2, 2, 2, vec![2, 3])]))
        .await;
    assert_eq!(rig.run_state(2), Some(JobRunState::Running));
    assert!(failed(&rig).contains("unauthorized"));
}

#[tokio::test(start_paused = true)]
async fn configured_credentials_are_sent_with_the_pull() {
    let auth = tempfile::NamedTempFile::new().unwrap();
    // base64("alice:right")
    std::fs::write(
        auth.path(),
        r#"{"auths": {"127.0.0.1:5000": {"auth": "YWxpY2U6cmlnaHQ="}}}"#,
    )
    .unwrap();
    let path = auth.path().to_path_buf();
    let mut rig = rig(move |c| c.registry.auth_file = Some(path));
    rig.serving().await;
    rig.node
        .publish(REGISTRY_IMAGE, "sha256:aaa", Some(("alice", "right")));
    rig.tell(lend(2, vec![pulled_lease(1, 1, vec![0], REGISTRY_IMAGE)]))
        .await;
    assert_eq!(rig.run_state(1), Some(JobRunState::Running));
    assert!(rig.node.engine_calls().contains(&EngineCall::Pull {
        image: REGISTRY_IMAGE.into(),
        user: Some("alice".into()),
    }));
}

#[tokio::test(start_paused = true)]
async fn a_gang_starts_only_once_every_image_is_present() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    let other = "127.0.0.1:5000/team/eval:2";
    rig.node.publish(REGISTRY_IMAGE, "sha256:aaa", None);
    rig.node.publish(other, "sha256:bbb", None);
    rig.node.set_pull_takes(Duration::from_secs(20));
    let mut rank0 = pulled_lease(1, 7, vec![0, 1], REGISTRY_IMAGE);
    let mut rank1 = pulled_lease(2, 7, vec![2, 3], other);
    rank0.job.nodes = 2;
    rank1.job.nodes = 2;
    rig.tell(lend(2, vec![rank0, rank1])).await;
    let calls = rig.node.engine_calls();
    let last_pull = calls
        .iter()
        .rposition(|c| matches!(c, EngineCall::Pull { .. }))
        .unwrap();
    let first_job = call_at(
        &calls,
        |c| matches!(c, EngineCall::Run { image, .. } if image.contains("/team/eval@")),
    )
    .unwrap();
    assert!(last_pull < first_job, "{calls:?}");
    let images: Vec<String> = rig.jobs().into_iter().map(|c| c.image).collect();
    assert_eq!(images.len(), 2);
    assert!(images.contains(&"127.0.0.1:5000/team/eval@sha256:bbb".to_owned()));
}

/// `lease` as gang member `rank` of 2, held for its peers when `wait`.
fn gang_member(mut lease: LeaseGrant, rank: u32, wait: bool) -> LeaseGrant {
    lease.job.nodes = 2;
    lease.rendezvous = Some(nightshift_common::Rendezvous {
        master_addr: "10.0.0.1".into(),
        master_port: 29_507,
        nnodes: 2,
        node_rank: rank,
        nproc_per_node: lease.gpus.len() as u32,
        wait_for_peers: wait,
    });
    lease
}

#[tokio::test(start_paused = true)]
async fn a_held_gang_member_pulls_reports_ready_and_starts_only_when_released() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    rig.node.publish(REGISTRY_IMAGE, "sha256:aaa", None);
    rig.node.set_pull_takes(Duration::from_secs(20));
    let lease = pulled_lease(1, 7, vec![0, 1, 2, 3], REGISTRY_IMAGE);
    let ready = |rig: &Rig| {
        let runs = rig.shared.observed().runs;
        runs.iter()
            .find(|r| r.lease_id == 1)
            .map(|r| (r.state.clone(), r.ready))
    };
    rig.tell(lend(2, vec![gang_member(lease.clone(), 1, true)]))
        .await;
    // Pulled, and said: the member is ready; its peer is not, so it waits, serving.
    assert!(
        rig.node
            .engine_calls()
            .iter()
            .any(|c| matches!(c, EngineCall::Pull { .. }))
    );
    assert_eq!(ready(&rig), Some((JobRunState::Pending, true)));
    assert!(rig.jobs().is_empty(), "no member starts while held");
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Serving);
    assert!(rig.shared.ready(), "the replica still takes requests");
    // The coordinator says the whole gang is ready: drain, start.
    rig.tell(lend(3, vec![gang_member(lease, 1, false)])).await;
    assert_eq!(rig.run_state(1), Some(JobRunState::Running));
    assert_eq!(rig.shared.observed().replica(), ReplicaState::Stopped);
}

#[tokio::test(start_paused = true)]
async fn a_moved_tag_never_changes_a_pinned_attempt() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    rig.node.publish(REGISTRY_IMAGE, "sha256:aaa", None);
    rig.tell(lend(2, vec![pulled_lease(1, 1, vec![0], REGISTRY_IMAGE)]))
        .await;
    let pinned = rig.shared.observed().runs[0].image_digest.clone().unwrap();
    // The tag moves and the host loses the image; the next attempt carries the pinned
    // reference (the coordinator set it), which the registry still serves.
    rig.node.publish(REGISTRY_IMAGE, "sha256:bbb", None);
    rig.node.remove_image(REGISTRY_IMAGE);
    let mut next = pulled_lease(2, 1, vec![1], &pinned);
    next.attempt = 2;
    rig.tell(lend(3, vec![next])).await;
    assert_eq!(rig.run_state(2), Some(JobRunState::Running));
    let images: Vec<String> = rig.jobs().into_iter().map(|c| c.image).collect();
    assert!(images.iter().all(|i| i == &pinned), "{images:?}");
}

#[tokio::test(start_paused = true)]
async fn a_low_disk_removes_unused_pulled_job_images_oldest_first_never_the_replicas() {
    let mut rig = rig(|c| c.registry.image_min_free_bytes = Some(2 * GIB));
    rig.host.set(HostFacts {
        checkpoint_volume_free_bytes: Some(3 * GIB / 2),
        ..HostFacts::default()
    });
    rig.serving().await;
    let (a, b) = (REGISTRY_IMAGE, "127.0.0.1:5000/team/eval:2");
    rig.node.publish(a, "sha256:aaa", None);
    rig.node.publish(b, "sha256:bbb", None);
    rig.node.behave(
        a,
        Behaviour {
            exits_after: Some((Duration::from_secs(1), 0)),
            ..Behaviour::default()
        },
    );
    rig.tell(lend(2, vec![pulled_lease(1, 1, vec![0], a)]))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    rig.tell(serve(3)).await;
    assert!(rig.jobs().is_empty(), "the finished job is removed");
    let removed = |rig: &Rig| -> Vec<String> {
        rig.node
            .engine_calls()
            .into_iter()
            .filter_map(|c| match c {
                EngineCall::RemoveImage { id } => Some(id),
                _ => None,
            })
            .collect()
    };
    assert!(
        removed(&rig).is_empty(),
        "nothing pulled yet asks for space"
    );

    rig.tell(lend(4, vec![pulled_lease(2, 2, vec![1], b)]))
        .await;
    assert_eq!(removed(&rig), ["sha256:fake-sha256:aaa"]);
    assert_eq!(rig.run_state(2), Some(JobRunState::Running));
    // The image in use and the replica's stay, however low the disk.
    rig.tell(lend(5, vec![pulled_lease(3, 3, vec![2], a)]))
        .await;
    assert_eq!(removed(&rig).len(), 1, "{:?}", removed(&rig));
    assert_eq!(rig.run_state(3), Some(JobRunState::Running));
}

#[tokio::test(start_paused = true)]
async fn a_long_pull_holds_up_nothing_and_the_node_serves_throughout() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    rig.node.publish(REGISTRY_IMAGE, "sha256:aaa", None);
    rig.node.set_pull_takes(Duration::from_secs(600));
    rig.shared.offer_desired(lend(
        2,
        vec![pulled_lease(1, 1, vec![0, 1], REGISTRY_IMAGE)],
    ));
    rig.shared.contact();
    let shared = rig.shared.clone();
    // Mid-pull, the lease is taken back: the pass acts on it at once rather than after the
    // pull, and the replica never stopped serving.
    let taken_back = async move {
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(shared.ready(), "serving during the pull");
        assert_eq!(shared.observed().replica(), ReplicaState::Serving);
        shared.offer_desired(serve(3));
    };
    let started = Instant::now();
    let (result, ()) = tokio::join!(rig.r.pass(), taken_back);
    result.expect("pass");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the pass did not wait out the pull: {:?}",
        started.elapsed()
    );
    assert!(rig.shared.ready());
    assert!(rig.jobs().is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_replicas_image_is_pulled_when_the_host_lacks_it() {
    let mut rig = rig(|_| {});
    rig.node.publish("vllm:fake", "sha256:vvv", None);
    rig.serving().await;
    let calls = rig.node.engine_calls();
    let pulled = call_at(
        &calls,
        |c| matches!(c, EngineCall::Pull { image, .. } if image == "vllm:fake"),
    );
    let ran = call_at(
        &calls,
        |c| matches!(c, EngineCall::Run { image, .. } if image == "vllm:fake"),
    );
    assert!(pulled.is_some() && pulled < ran, "{calls:?}");
    assert_eq!(rig.replicas().len(), 1);
}

/// The engine stopped under a running job (`systemctl restart docker`) stops its container with
/// SIGTERM: exit code 143, which is not the job's verdict. Once the engine answers again the
/// job is reported as stopped by the host, so the coordinator requeues it rather than counting
/// a failure against its retries. A job that exits by itself with the same code while the
/// engine answers is still the job's own exit. Found by the fault harness (engine-restart).
#[tokio::test(start_paused = true)]
async fn a_job_stopped_with_the_engine_is_reported_stopped_by_the_host() {
    let mut rig = rig(|_| {});
    rig.serving().await;
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1])])).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1])])).await;
    assert_eq!(rig.run_state(1), Some(JobRunState::Running));

    rig.node.stop_engine();
    rig.shared
        .offer_desired(lend(2, vec![lease(1, 1, 1, vec![0, 1])]));
    assert!(
        rig.r.pass().await.is_err(),
        "a pass with the engine stopped"
    );
    rig.node.start_engine();
    rig.tell(lend(2, vec![lease(1, 1, 1, vec![0, 1])])).await;
    assert_eq!(
        rig.run_state(1),
        Some(JobRunState::Exited {
            exit_code: 143,
            stopped_by_agent: true
        })
    );

    // A job of its own exiting 143 with the engine up is the job's exit.
    rig.node.behave(
        "exits-143",
        Behaviour {
            exits_after: Some((Duration::from_secs(3), 143)),
            ..Behaviour::default()
        },
    );
    let mut own = lease(2, 2, 2, vec![2]);
    own.job.image = "exits-143".into();
    rig.tell(lend(3, vec![own.clone()])).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    rig.tell(lend(3, vec![own])).await;
    assert_eq!(
        rig.run_state(2),
        Some(JobRunState::Exited {
            exit_code: 143,
            stopped_by_agent: false
        })
    );
}
