//! The agent's sequences on the host model, driven by the real planner: the drain before a
//! job starts, the reclaim after, the sleep mode, the fail-safe and the fence.

use std::collections::HashMap;
use std::time::Duration;

use nightshift_common::{
    DesiredNode, JobRunState, JobSpec, LeaseGrant, ReplicaState, SequenceKind, ServingSignals,
};
use nightshift_hostmodel::{Agent, Exit, Host, Proc, Pull, Timings, Workload};
use nightshift_planner::{Moment, PlanConfig, ReclaimMode};

/// Jobs that run for a set time, save in a set time, and whose exits are kept.
#[derive(Default)]
struct Jobs {
    work: HashMap<u64, Duration>,
    save: Duration,
    exits: Vec<Exit>,
}

impl Workload for Jobs {
    fn ends_at(&self, p: Proc<'_>, started: Moment) -> Option<Moment> {
        self.work.get(&p.job).map(|w| started + *w)
    }
    fn save(&self, _p: Proc<'_>) -> Duration {
        self.save
    }
    fn exited(&mut self, exit: &Exit) {
        self.exits.push(exit.clone());
    }
}

fn lease(id: u64, epoch: u64, gpus: &[u32]) -> LeaseGrant {
    LeaseGrant {
        lease_id: id,
        epoch,
        job_id: id,
        attempt: 1,
        gpus: gpus.to_vec(),
        job: JobSpec::new("train", "trainer:1", gpus.len() as u32),
        rendezvous: None,
    }
}

fn desired(version: u64, leases: Vec<LeaseGrant>) -> DesiredNode {
    DesiredNode {
        version,
        serve: leases.is_empty(),
        leases,
        lease_ttl_ms: 10_000,
    }
}

fn secs(s: u64) -> Moment {
    Moment::ZERO + Duration::from_secs(s)
}

/// A host that serves, its agent, its jobs, on a one-second clock; the coordinator
/// acknowledges a heartbeat every second while `connected`.
struct Rig {
    host: Host,
    agent: Agent,
    jobs: Jobs,
    t: u64,
    connected: bool,
}

impl Rig {
    fn new(cfg: PlanConfig) -> Self {
        let mut rig = Self {
            host: Host::serving("node-a", 4, Timings::default()),
            agent: Agent::new(cfg, 1, 1_000_000),
            jobs: Jobs {
                save: Duration::from_secs(20),
                ..Jobs::default()
            },
            t: 0,
            connected: true,
        };
        rig.agent.receive(desired(1, vec![]));
        rig.run(2);
        assert!(rig.agent.ready(), "the adopted replica serves");
        rig
    }

    /// `s` seconds, checking one owner per GPU after each.
    fn run(&mut self, s: u64) {
        for _ in 0..s {
            self.t += 1;
            let now = secs(self.t);
            // Requests keep arriving while the replica is ready; the last takes 8 s.
            if self.agent.ready() {
                self.host.load(now + Duration::from_secs(8));
            }
            self.agent.tick(now, &mut self.host, &mut self.jobs);
            if self.connected {
                self.agent.contact(now);
            }
            self.host.check_owners().unwrap();
        }
    }

    /// Runs until `cond` holds; the seconds it took.
    fn until(&mut self, limit: u64, what: &str, cond: impl Fn(&Self) -> bool) -> u64 {
        let from = self.t;
        while !cond(self) {
            assert!(self.t - from < limit, "{what}: not within {limit} s");
            self.run(1);
        }
        self.t - from
    }

    /// Cuts the coordinator off; the seconds until the fail-safe signals a job.
    fn cut_off_until_the_fail_safe_acts(&mut self) -> u64 {
        self.connected = false;
        self.until(30, "the fail-safe signals the job", |r| {
            r.runs().iter().any(|(_, s)| *s == JobRunState::Stopping)
        })
    }

    fn runs(&self) -> Vec<(u64, JobRunState)> {
        self.agent
            .heartbeat(&self.host, &ServingSignals::default())
            .jobs
            .into_iter()
            .map(|r| (r.lease_id, r.state))
            .collect()
    }
}

#[test]
fn a_lent_host_drains_before_the_job_and_serves_again_after_the_reclaim() {
    let mut rig = Rig::new(PlanConfig::default());
    rig.agent
        .receive(desired(2, vec![lease(1, 1, &[0, 1, 2, 3])]));
    // The readiness grace (5 s) runs inside the last request's 8 s; then the replica's
    // 10 s stop, and the job starts in the tick that sees its GPUs free.
    let took = rig.until(60, "the job starts", |r| r.host.lent());
    assert_eq!(took, 19, "drain took {took} s");
    assert!(!rig.agent.ready());
    assert_eq!(rig.agent.mem.replica, ReplicaState::Stopped);
    assert_eq!(rig.runs(), vec![(1, JobRunState::Running)]);

    rig.run(100);
    rig.agent.receive(desired(3, vec![]));
    // The checkpoint signal, a 20 s save, then the cold start (225 s).
    let took = rig.until(300, "the replica serves", |r| r.agent.ready());
    assert!((245..=260).contains(&took), "reclaim took {took} s");
    let exit = &rig.jobs.exits[0];
    assert_eq!((exit.lease, exit.exit_code), (1, 143));
    assert_eq!(
        exit.at.duration_since(exit.signalled.unwrap()),
        Duration::from_secs(20)
    );
    let beat = rig.agent.heartbeat(&rig.host, &ServingSignals::default());
    let reclaim: Vec<(&str, u64)> = beat
        .phases
        .iter()
        .filter(|p| p.sequence == SequenceKind::Reclaim)
        .map(|p| (p.phase.as_str(), p.duration_ms / 1_000))
        .collect();
    assert_eq!(
        reclaim,
        vec![
            ("stop_jobs", 20),
            ("confirm_free", 0),
            ("start_replica", 0),
            ("wait_health", 225)
        ],
        "{reclaim:?}"
    );
    // Its exit was reported while listed; the lease gone, the container is removed.
    rig.run(3);
    assert!(rig.runs().is_empty());
    assert_eq!(beat.applied_version, 3);
}

#[test]
fn in_sleep_mode_the_replica_sleeps_through_the_job_and_wakes_after() {
    let cfg = PlanConfig {
        reclaim: ReclaimMode::Sleep,
        ..PlanConfig::default()
    };
    let mut rig = Rig::new(cfg);
    rig.agent.receive(desired(2, vec![lease(1, 1, &[0, 1])]));
    rig.until(60, "the job starts", |r| r.host.lent());
    assert_eq!(rig.agent.mem.replica, ReplicaState::Sleeping);
    assert!(!rig.host.replica_up());
    rig.run(30);
    rig.agent.receive(desired(3, vec![]));
    let took = rig.until(60, "the replica serves", |r| r.agent.ready());
    // 20 s of checkpoint, a 6 s wake.
    assert!((26..=30).contains(&took), "wake took {took} s");
}

#[test]
fn a_lend_called_off_while_the_replica_falls_asleep_wakes_it_before_it_is_ready_again() {
    let cfg = PlanConfig {
        reclaim: ReclaimMode::Sleep,
        ..PlanConfig::default()
    };
    let mut rig = Rig::new(cfg);
    rig.agent.receive(desired(2, vec![lease(1, 1, &[0, 1])]));
    // Told to sleep: no longer serving, its memory not yet released.
    rig.until(60, "the replica is told to sleep", |r| {
        r.host.replica_up() && !r.host.replica_serving()
    });
    rig.agent.receive(desired(3, vec![]));
    rig.until(60, "the replica is ready", |r| r.agent.ready());
    assert!(
        rig.host.replica_serving(),
        "ready only once vLLM is awake again"
    );
    assert!(!rig.host.lent(), "the called-off job never started");
}

#[test]
fn in_sleep_mode_a_failed_sleep_stops_the_replica_instead_and_the_reclaim_starts_it() {
    let cfg = PlanConfig {
        reclaim: ReclaimMode::Sleep,
        ..PlanConfig::default()
    };
    let mut rig = Rig::new(cfg);
    rig.host.fail_sleeps(secs(3_600));
    rig.agent.receive(desired(2, vec![lease(1, 1, &[0, 1])]));
    rig.until(60, "the job starts", |r| r.host.lent());
    assert_eq!(
        rig.agent.mem.replica,
        ReplicaState::Stopped,
        "stopped, not asleep"
    );
    rig.run(30);
    rig.agent.receive(desired(3, vec![]));
    // Nothing to wake: 20 s of checkpoint, then the cold start (225 s).
    let took = rig.until(300, "the replica serves", |r| r.agent.ready());
    assert!((245..=260).contains(&took), "reclaim took {took} s");
}

#[test]
fn a_silent_coordinator_stops_the_job_after_the_ttl_and_the_host_serves() {
    let mut rig = Rig::new(PlanConfig::default());
    rig.agent
        .receive(desired(2, vec![lease(1, 1, &[0, 1, 2, 3])]));
    rig.until(60, "the job starts", |r| r.host.lent());
    // Counted from the last acknowledged heartbeat: past the 10 s TTL, within a tick.
    assert_eq!(rig.cut_off_until_the_fail_safe_acts(), 11);
    rig.until(300, "the replica serves", |r| r.agent.ready());
    let beat = rig.agent.heartbeat(&rig.host, &ServingSignals::default());
    assert_eq!(beat.expired_leases, vec![1]);
    // Back in touch with the lease still listed: it stays void, the host serves on.
    rig.connected = true;
    rig.run(30);
    assert!(rig.agent.ready() && !rig.host.lent());
}

#[test]
fn a_lease_older_than_the_epoch_a_gpu_ran_is_never_started() {
    let mut rig = Rig::new(PlanConfig::default());
    rig.agent.receive(desired(2, vec![lease(5, 5, &[0])]));
    rig.until(60, "the job starts", |r| r.host.lent());
    // The coordinator (restored from an old store, say) grants GPU 0 again at epoch 3.
    rig.agent
        .receive(desired(3, vec![lease(5, 5, &[0]), lease(6, 3, &[0])]));
    rig.run(30);
    assert_eq!(rig.runs(), vec![(5, JobRunState::Running)]);
}

#[test]
fn a_restarted_agent_fails_safe_once_in_touch_and_cut_off_again() {
    let mut rig = Rig::new(PlanConfig::default());
    rig.agent
        .receive(desired(2, vec![lease(1, 1, &[0, 1, 2, 3])]));
    rig.until(60, "the job starts", |r| r.host.lent());
    // The agent process restarts: a new memory, no contact yet; the job runs on.
    rig.agent = Agent::new(PlanConfig::default(), 2, 1_000_000);
    rig.agent
        .receive(desired(2, vec![lease(1, 1, &[0, 1, 2, 3])]));
    rig.run(120);
    assert!(rig.host.lent());
    assert_eq!(rig.runs(), vec![(1, JobRunState::Running)]);
    // In touch since; now cut off: the fail-safe acts past the TTL, as before the restart.
    assert_eq!(rig.cut_off_until_the_fail_safe_acts(), 11);
}

fn lease_of_image(id: u64, gpus: &[u32], image: &str) -> LeaseGrant {
    let mut l = lease(id, id, gpus);
    l.job.image = image.to_owned();
    l
}

fn run_of(rig: &Rig, lease: u64) -> Option<JobRunState> {
    rig.runs()
        .into_iter()
        .find(|(l, _)| *l == lease)
        .map(|(_, s)| s)
}

#[test]
fn a_missing_image_is_pulled_while_the_replica_serves_then_the_drain_begins() {
    let mut rig = Rig::new(PlanConfig::default());
    rig.host.lack(
        "trainer:2",
        Pull::Takes(Duration::from_secs(40)),
        secs(rig.t),
    );
    rig.agent.receive(desired(
        2,
        vec![lease_of_image(1, &[0, 1, 2, 3], "trainer:2")],
    ));
    // The pull's 40 s: the replica serves on, and the run is reported not ready.
    rig.run(30);
    assert!(rig.agent.ready(), "serving while the image arrives");
    let beat = rig.agent.heartbeat(&rig.host, &ServingSignals::default());
    assert_eq!(
        (beat.jobs[0].state.clone(), beat.jobs[0].ready),
        (JobRunState::Pending, false)
    );
    // Then the drain (19 s, as without a pull) and the start.
    let took = rig.until(60, "the job starts", |r| r.host.lent());
    assert!((25..=35).contains(&took), "pull's rest and drain: {took} s");
    assert_eq!(run_of(&rig, 1), Some(JobRunState::Running));
}

#[test]
fn a_refused_pull_fails_the_leases_that_need_the_image_and_the_others_go_on() {
    let mut rig = Rig::new(PlanConfig::default());
    let refusal = Pull::Fails(Duration::from_secs(3), "manifest unknown".into());
    rig.host.lack("trainer:gone", refusal, secs(rig.t));
    rig.agent.receive(desired(
        2,
        vec![
            lease_of_image(1, &[0, 1], "trainer:gone"),
            lease_of_image(2, &[2, 3], "trainer:1"),
        ],
    ));
    // Every leased image is there before the drain: the replica serves while the
    // registry takes its time to refuse.
    rig.run(2);
    assert!(rig.agent.ready());
    assert_eq!(run_of(&rig, 2), Some(JobRunState::Pending));
    rig.run(2);
    let Some(JobRunState::FailedToStart {
        message,
        refused_by_host,
    }) = run_of(&rig, 1)
    else {
        panic!("lease 1 failed to start: {:?}", rig.runs());
    };
    assert!(
        message.contains("trainer:gone") && message.contains("manifest unknown"),
        "{message}"
    );
    assert!(
        !refused_by_host,
        "the job's own image: a failure, not a refusal"
    );
    // The other lease drains the replica and starts; the failed one never does.
    rig.until(60, "lease 2 starts", |r| {
        run_of(r, 2) == Some(JobRunState::Running)
    });
    assert!(matches!(
        run_of(&rig, 1),
        Some(JobRunState::FailedToStart { .. })
    ));
    assert_eq!(rig.host.job_starts(), 1);
}
