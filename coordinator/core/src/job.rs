//! A job and its state machine: one transition function, illegal moves are typed errors.
//!
//! A job holds one lease per node it runs on (a gang holds several). Members end one by one;
//! the job's outcome is decided when its last lease is gone, so that a job never runs again
//! while an earlier instance of it may still be writing its checkpoint.

use std::collections::BTreeMap;

use nightshift_common::{AttemptEnding, AttemptMember, AttemptView, JobSpec, JobState, UnixMillis};

/// A job keeps the records of this many of its latest attempts.
pub const KEPT_ATTEMPTS: usize = 20;

/// What happens to a job. [`Job::apply`] is the only place a job's state changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEvent {
    /// GPUs were leased to it, one lease per node, in rank order.
    Leased { leases: Vec<u64> },
    /// The agent reports a member's container running.
    Started,
    /// Its leases were revoked so that their nodes serve again.
    Preempt,
    /// The user cancelled it.
    Cancel,
    /// A member's container exited by itself.
    MemberExited {
        lease: u64,
        exit_code: i64,
        outputs: BTreeMap<String, String>,
    },
    /// A member's container could not be started, e.g. its image is missing.
    MemberStartFailed { lease: u64, message: String },
    /// A member's host refused to start its container for a reason of its own (its
    /// checkpoint volume is short of space). Not the job's fault: no failure is counted.
    MemberRefused { lease: u64, message: String },
    /// A member's container is gone without finishing: stopped for a reclaim, vanished, or its
    /// lease expired with its node silent. Not the job's fault. `ran` is true when the agent
    /// reported the container itself (it exited): it existed, so its attempt began.
    MemberLost {
        lease: u64,
        message: String,
        ran: bool,
    },
    /// It has run for its whole `maxRunSeconds`: it is stopped and fails, without a retry.
    RunLimit,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job {job}: cannot {event} while {from}")]
pub struct IllegalTransition {
    pub job: u64,
    pub from: &'static str,
    pub event: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub id: u64,
    pub spec: JobSpec,
    pub state: JobState,
    pub attempt: u32,
    pub preemptions: u32,
    pub failures: u32,
    pub not_before: Option<UnixMillis>,
    pub submitted_at: UnixMillis,
    pub started_at: Option<UnixMillis>,
    /// When the current attempt's first member started running.
    pub attempt_started_at: Option<UnixMillis>,
    /// Milliseconds its ended attempts ran (from their first member running to their last
    /// member gone): what counts against `maxRunSeconds`, with the current attempt's time.
    pub ran_ms: u64,
    /// Stopped for running past `maxRunSeconds`: it fails when stopped, whatever its retries.
    pub timed_out: bool,
    pub last_checkpoint_at: Option<UnixMillis>,
    pub finished_at: Option<UnixMillis>,
    /// The leases it holds, revoked or not, in rank order.
    pub leases: Vec<u64>,
    pub exit_code: Option<i64>,
    pub outputs: BTreeMap<String, String>,
    pub message: Option<String>,
    /// `spec.image` pinned to its registry digest (`repo@sha256:...`) by the first attempt
    /// that started: what every later attempt runs, so that a tag moved since never changes
    /// the job. `None` until then, and for an image no registry knows.
    pub image_digest: Option<String>,
    /// Its latest placements, oldest first, at most [`KEPT_ATTEMPTS`]: the last one is open
    /// (no `ended_at`) while the job holds leases.
    pub attempts: Vec<AttemptView>,
}

impl JobEvent {
    fn name(&self) -> &'static str {
        match self {
            Self::Leased { .. } => "lease",
            Self::Started => "start",
            Self::Preempt => "preempt",
            Self::Cancel => "cancel",
            Self::MemberExited { .. } => "exit",
            Self::MemberStartFailed { .. } => "fail to start",
            Self::MemberRefused { .. } => "be refused by its host",
            Self::MemberLost { .. } => "lose a member",
            Self::RunLimit => "reach its run-time limit",
        }
    }

    /// Whether the event shows that the member's container existed: it exited, or the agent
    /// had reported it before it was lost.
    pub fn container_existed(&self) -> bool {
        matches!(
            self,
            Self::MemberExited { .. } | Self::MemberLost { ran: true, .. }
        )
    }

    fn lease(&self) -> Option<u64> {
        match self {
            Self::MemberExited { lease, .. }
            | Self::MemberStartFailed { lease, .. }
            | Self::MemberRefused { lease, .. }
            | Self::MemberLost { lease, .. } => Some(*lease),
            _ => None,
        }
    }
}

impl Job {
    pub fn new(id: u64, spec: JobSpec, now: UnixMillis) -> Self {
        Self {
            id,
            spec,
            state: JobState::Queued,
            attempt: 1,
            preemptions: 0,
            failures: 0,
            not_before: None,
            submitted_at: now,
            started_at: None,
            attempt_started_at: None,
            ran_ms: 0,
            timed_out: false,
            last_checkpoint_at: None,
            finished_at: None,
            leases: Vec::new(),
            exit_code: None,
            outputs: BTreeMap::new(),
            message: None,
            image_digest: None,
            attempts: Vec::new(),
        }
    }

    /// The open attempt record, while the job holds leases.
    fn open_attempt(&mut self) -> Option<&mut AttemptView> {
        self.attempts.last_mut().filter(|a| a.ending.is_none())
    }

    /// Names where the open attempt runs: one member per lease, in rank order.
    pub fn place_attempt(&mut self, members: Vec<AttemptMember>) {
        if let Some(a) = self.open_attempt() {
            a.members = members;
        }
    }

    /// Closes the open attempt record (before `end_attempt` forgets its start).
    fn close_attempt(&mut self, now: UnixMillis, ending: AttemptEnding) {
        let (started, message) = (self.attempt_started_at, self.message.clone());
        if let Some(a) = self.open_attempt() {
            a.started_at = a.started_at.or(started);
            a.ended_at = Some(now);
            a.ending = Some(ending);
            a.message = message.filter(|_| ending != AttemptEnding::Succeeded);
        }
    }

    /// The spec an attempt runs: the image pinned to its digest once it is known.
    pub fn attempt_spec(&self) -> JobSpec {
        let mut spec = self.spec.clone();
        if let Some(pinned) = &self.image_digest {
            spec.image = pinned.clone();
        }
        spec
    }

    /// Pins the image to `digest` (`repo@sha256:...`) as an attempt reported it; true when
    /// this changed the job. The first pin stands: a tag moved since changes nothing.
    pub fn pin_image(&mut self, digest: &str) -> bool {
        if self.image_digest.is_some() || !digest.contains("@sha256:") {
            return false;
        }
        self.image_digest = Some(digest.to_owned());
        true
    }

    /// Whether the job is being stopped: its remaining leases must all be revoked.
    pub fn stopping(&self) -> bool {
        matches!(
            self.state,
            JobState::Preempting | JobState::Cancelling | JobState::Failing
        )
    }

    /// How long it has run, its ended attempts and the current one until `now`.
    pub fn run_ms(&self, now: UnixMillis) -> u64 {
        self.ran_ms
            + self
                .attempt_started_at
                .map_or(0, |started| now.saturating_sub(started))
    }

    /// When a running job reaches its `maxRunSeconds`.
    pub fn run_deadline(&self) -> Option<UnixMillis> {
        if self.state != JobState::Running {
            return None;
        }
        let limit_ms = self.spec.max_run_seconds?.saturating_mul(1000);
        let started = self.attempt_started_at?;
        Some(started + limit_ms.saturating_sub(self.ran_ms))
    }

    /// The one transition function. On an illegal move nothing changes. Returns the lease
    /// that left the job: the member the event is about, if any. No other lease ever
    /// leaves it (a job finishes or is requeued only once its last member has left), so
    /// the caller learns what to release without copying the job's leases.
    ///
    /// Every legal move is one arm of its match and changes the job only there; before it,
    /// only the member the event is about leaves the job, and an illegal move puts it back
    /// where it was. So no copy of the job is needed to undo one.
    pub fn apply(
        &mut self,
        now: UnixMillis,
        event: JobEvent,
    ) -> Result<Option<u64>, IllegalTransition> {
        use JobState::*;
        let illegal = IllegalTransition {
            job: self.id,
            from: self.state.as_str(),
            event: event.name(),
        };
        // A job's leases are distinct (one per member).
        let left = match event.lease() {
            Some(lease) => {
                let Some(at) = self.leases.iter().position(|l| *l == lease) else {
                    return Err(illegal);
                };
                Some((at, self.leases.remove(at)))
            }
            None => None,
        };
        let last = self.leases.is_empty();
        let ran = event.container_existed();
        // The attempt a member's exit code belongs to, recorded once the move is legal.
        let exited = match &event {
            JobEvent::MemberExited { exit_code, .. } => self
                .attempts
                .len()
                .checked_sub(1)
                .filter(|_| self.attempts.last().is_some_and(|a| a.ending.is_none()))
                .map(|at| (at, *exit_code)),
            _ => None,
        };
        let began = self.attempt_started_at;
        if ran && !self.state.is_finished() {
            // A container that exited existed: its attempt began (seen first now, so it adds
            // no run time).
            self.attempt_started_at.get_or_insert(now);
        }
        let next = match (self.state, event) {
            (Queued, JobEvent::Leased { leases }) if !leases.is_empty() => {
                self.leases = leases;
                self.message = None;
                self.not_before = None;
                self.attempt_started_at = None;
                if self.attempts.len() >= KEPT_ATTEMPTS {
                    self.attempts.remove(0);
                }
                self.attempts.push(AttemptView {
                    attempt: self.attempt,
                    members: Vec::new(),
                    leased_at: now,
                    started_at: None,
                    ended_at: None,
                    ending: None,
                    exit_code: None,
                    message: None,
                });
                Starting
            }
            (Starting | Running, JobEvent::Started) => {
                self.started_at.get_or_insert(now);
                self.attempt_started_at.get_or_insert(now);
                Running
            }
            // Running while it is being stopped: its attempt began, nothing else changes.
            (Preempting | Cancelling | Failing, JobEvent::Started) => {
                self.started_at.get_or_insert(now);
                self.attempt_started_at.get_or_insert(now);
                self.state
            }
            (Starting | Running, JobEvent::Preempt) => Preempting,
            (Running, JobEvent::RunLimit) => {
                let limit = self.spec.max_run_seconds.unwrap_or(0);
                self.timed_out = true;
                self.message = Some(format!(
                    "stopped after running {} s, its limit (maxRunSeconds: {limit})",
                    self.run_ms(now) / 1000
                ));
                Failing
            }
            (Starting | Running | Preempting | Failing, JobEvent::Cancel) => Cancelling,
            (Queued, JobEvent::Cancel) => self.finish(now, Cancelled),

            (
                Starting | Running,
                JobEvent::MemberExited {
                    exit_code: 0,
                    outputs,
                    ..
                },
            ) => {
                self.outputs.extend(outputs);
                if last {
                    self.exit_code = Some(0);
                    self.finish(now, Succeeded)
                } else {
                    self.state
                }
            }
            (
                Starting | Running,
                JobEvent::MemberExited {
                    exit_code, outputs, ..
                },
            ) => {
                self.outputs.extend(outputs);
                self.exit_code = Some(exit_code);
                self.message = Some(format!("exited with code {exit_code}"));
                if last {
                    self.fail_or_retry(now)
                } else {
                    Failing
                }
            }
            (Starting | Running, JobEvent::MemberStartFailed { message, .. }) => {
                self.message = Some(message);
                if last {
                    self.fail_or_retry(now)
                } else {
                    Failing
                }
            }
            (Starting | Running, JobEvent::MemberLost { message, .. }) => {
                self.message = Some(message);
                if last { self.requeue(now) } else { Preempting }
            }
            (Starting | Running, JobEvent::MemberRefused { message, .. }) => {
                self.message = Some(message);
                if last { self.refused(now) } else { Preempting }
            }
            (Preempting, JobEvent::MemberRefused { .. }) => {
                if last {
                    self.refused(now)
                } else {
                    Preempting
                }
            }
            // A member that cannot start fails the attempt, preempted or not: requeued as a
            // preemption, it would be lent again and again, never spending its retries.
            (Preempting, JobEvent::MemberStartFailed { message, .. }) => {
                self.message = Some(message);
                if last {
                    self.fail_or_retry(now)
                } else {
                    Failing
                }
            }
            (Preempting, JobEvent::MemberExited { .. })
            | (Preempting, JobEvent::MemberLost { .. }) => {
                if last {
                    self.requeue(now)
                } else {
                    Preempting
                }
            }
            (
                Failing,
                JobEvent::MemberExited { .. }
                | JobEvent::MemberLost { .. }
                | JobEvent::MemberStartFailed { .. }
                | JobEvent::MemberRefused { .. },
            ) => {
                if last {
                    self.fail_or_retry(now)
                } else {
                    Failing
                }
            }
            (
                Cancelling,
                JobEvent::MemberExited { .. }
                | JobEvent::MemberLost { .. }
                | JobEvent::MemberStartFailed { .. }
                | JobEvent::MemberRefused { .. },
            ) => {
                if last {
                    self.finish(now, Cancelled)
                } else {
                    Cancelling
                }
            }
            _ => {
                if let Some((at, lease)) = left {
                    self.leases.insert(at, lease);
                }
                self.attempt_started_at = began;
                return Err(illegal);
            }
        };
        self.state = next;
        let started = self.attempt_started_at;
        if let Some(a) = self.open_attempt() {
            a.started_at = a.started_at.or(started);
        }
        if let Some((at, code)) = exited {
            // A gang's first error is the attempt's code; 0 only when every member exited so.
            let a = &mut self.attempts[at];
            if a.exit_code.is_none_or(|c| c == 0) {
                a.exit_code = Some(code);
            }
        }
        Ok(left.map(|(_, lease)| lease))
    }

    /// The current attempt is over: its time joins the run time.
    fn end_attempt(&mut self, now: UnixMillis) {
        self.ran_ms = self.run_ms(now);
        self.attempt_started_at = None;
    }

    fn finish(&mut self, now: UnixMillis, state: JobState) -> JobState {
        debug_assert!(self.leases.is_empty(), "a job finishes with no member left");
        let ending = match state {
            JobState::Succeeded => AttemptEnding::Succeeded,
            JobState::Cancelled => AttemptEnding::Cancelled,
            _ if !self.attempt_began() => AttemptEnding::FailedToStart,
            _ => AttemptEnding::Failed,
        };
        self.close_attempt(now, ending);
        self.end_attempt(now);
        self.finished_at = Some(now);
        if state == JobState::Succeeded {
            self.message = None;
        }
        state
    }

    /// Whether the current attempt began: a member's container was reported running (or
    /// exited). A lease taken back before then started nothing.
    pub fn attempt_began(&self) -> bool {
        self.attempt_started_at.is_some()
    }

    /// Back to the queue after a preemption: a new attempt, no failure counted. An attempt
    /// that never began (every lease taken back before its container was reported) is no
    /// attempt and no preemption: the job goes back as it was.
    fn requeue(&mut self, now: UnixMillis) -> JobState {
        if !self.attempt_began() {
            let why = self
                .message
                .take()
                .map(|m| format!(" ({m})"))
                .unwrap_or_default();
            self.message = Some(format!("requeued before its container started{why}"));
            self.close_attempt(now, AttemptEnding::Preempted);
            return JobState::Queued;
        }
        self.message.get_or_insert_with(|| "preempted".to_owned());
        self.close_attempt(now, AttemptEnding::Preempted);
        self.end_attempt(now);
        self.attempt += 1;
        self.preemptions += 1;
        self.message.get_or_insert_with(|| "preempted".to_owned());
        JobState::Queued
    }

    /// Refused by its host (see [`JobEvent::MemberRefused`]): back to the queue as after a
    /// preemption, and placed again only after its first retry backoff, so that a host still
    /// short of space is not asked again at once.
    fn refused(&mut self, now: UnixMillis) -> JobState {
        let state = self.requeue(now);
        self.not_before = Some(now + self.spec.retry.backoff_ms(1));
        state
    }

    /// A failure: retried after its backoff while the retry budget lasts.
    fn fail_or_retry(&mut self, now: UnixMillis) -> JobState {
        self.failures += 1;
        if self.timed_out || self.failures > self.spec.retry.limit {
            return self.finish(now, JobState::Failed);
        }
        let ending = if self.attempt_began() {
            AttemptEnding::Failed
        } else {
            AttemptEnding::FailedToStart
        };
        self.close_attempt(now, ending);
        self.end_attempt(now);
        self.attempt += 1;
        self.not_before = Some(now + self.spec.retry.backoff_ms(self.failures));
        JobState::Queued
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::{CheckpointPolicy, RetryPolicy};

    fn job(nodes: u32, retries: u32) -> Job {
        let spec = JobSpec {
            name: "t".into(),
            image: "i".into(),
            command: vec![],
            args: vec![],
            env: vec![],
            gpus: 1,
            nodes,
            priority: 0,
            owner: None,
            checkpoint: CheckpointPolicy::default(),
            retry: RetryPolicy {
                limit: retries,
                ..RetryPolicy::default()
            },
            capture: Default::default(),
            files: Vec::new(),
            sandbox: Default::default(),
            max_run_seconds: None,
        };
        Job::new(1, spec, 0)
    }

    fn exited(lease: u64, exit_code: i64) -> JobEvent {
        JobEvent::MemberExited {
            lease,
            exit_code,
            outputs: BTreeMap::new(),
        }
    }

    #[test]
    fn each_attempt_is_recorded_with_its_ending_and_only_the_last_ones_are_kept() {
        let mut j = job(1, 100);
        j.apply(1, JobEvent::Leased { leases: vec![1] }).unwrap();
        let start_failed = JobEvent::MemberStartFailed {
            lease: 1,
            message: "no such image".into(),
        };
        j.apply(2, start_failed).unwrap();
        j.apply(3, JobEvent::Leased { leases: vec![2] }).unwrap();
        j.apply(4, JobEvent::Started).unwrap();
        j.apply(5, exited(2, 3)).unwrap();
        let ends: Vec<_> = j
            .attempts
            .iter()
            .map(|a| {
                (
                    a.attempt,
                    a.leased_at,
                    a.started_at,
                    a.ended_at,
                    a.ending,
                    a.exit_code,
                )
            })
            .collect();
        assert_eq!(
            ends,
            [
                (
                    1,
                    1,
                    None,
                    Some(2),
                    Some(AttemptEnding::FailedToStart),
                    None
                ),
                (2, 3, Some(4), Some(5), Some(AttemptEnding::Failed), Some(3)),
            ]
        );
        assert_eq!(j.attempts[0].message.as_deref(), Some("no such image"));
        assert_eq!(j.attempts[1].message.as_deref(), Some("exited with code 3"));

        // An illegal move leaves the records as they were.
        let before = j.attempts.clone();
        assert!(j.apply(6, exited(2, 0)).is_err());
        assert_eq!(j.attempts, before);

        for t in 0..(2 * KEPT_ATTEMPTS as u64) {
            j.not_before = None;
            let (now, lease) = (10 + 3 * t, 3 + t);
            j.apply(
                now,
                JobEvent::Leased {
                    leases: vec![lease],
                },
            )
            .unwrap();
            j.apply(now + 1, JobEvent::Started).unwrap();
            j.apply(now + 2, exited(lease, 1)).unwrap();
        }
        assert_eq!(j.attempts.len(), KEPT_ATTEMPTS);
        assert_eq!(j.attempts.last().unwrap().attempt, j.attempt - 1);
        assert!(
            j.attempts
                .iter()
                .all(|a| a.ending == Some(AttemptEnding::Failed))
        );
    }

    #[test]
    fn preempted_job_is_requeued_with_a_higher_attempt_and_no_failure() {
        let mut j = job(1, 0);
        j.apply(1, JobEvent::Leased { leases: vec![7] }).unwrap();
        j.apply(2, JobEvent::Started).unwrap();
        j.apply(3, JobEvent::Preempt).unwrap();
        j.apply(4, exited(7, 143)).unwrap();
        assert_eq!(
            (j.state, j.attempt, j.preemptions, j.failures),
            (JobState::Queued, 2, 1, 0)
        );
        assert!(j.leases.is_empty());
        assert_eq!(j.started_at, Some(2));
    }

    #[test]
    fn finished_job_cannot_start_again() {
        let mut j = job(1, 0);
        j.apply(1, JobEvent::Cancel).unwrap();
        let err = j
            .apply(2, JobEvent::Leased { leases: vec![1] })
            .unwrap_err();
        assert_eq!(err.to_string(), "job 1: cannot lease while cancelled");
    }

    #[test]
    fn a_failure_is_retried_after_backoff_until_the_limit() {
        let mut j = job(1, 1);
        j.apply(1, JobEvent::Leased { leases: vec![7] }).unwrap();
        j.apply(2, exited(7, 3)).unwrap();
        assert_eq!(
            (j.state, j.attempt, j.failures, j.not_before),
            (JobState::Queued, 2, 1, Some(10_002))
        );
        j.apply(20_000, JobEvent::Leased { leases: vec![8] })
            .unwrap();
        j.apply(20_001, exited(8, 3)).unwrap();
        assert_eq!((j.state, j.failures), (JobState::Failed, 2));
        assert_eq!(j.message.as_deref(), Some("exited with code 3"));
    }

    #[test]
    fn a_gang_succeeds_when_its_last_member_exits_zero() {
        let mut j = job(2, 0);
        j.apply(1, JobEvent::Leased { leases: vec![1, 2] }).unwrap();
        j.apply(2, exited(2, 0)).unwrap();
        assert_eq!(j.state, JobState::Starting);
        j.apply(3, exited(1, 0)).unwrap();
        assert_eq!(j.state, JobState::Succeeded);
    }

    #[test]
    fn a_failed_gang_member_stops_the_others_before_the_retry() {
        let mut j = job(2, 3);
        j.apply(1, JobEvent::Leased { leases: vec![1, 2] }).unwrap();
        j.apply(2, JobEvent::Started).unwrap();
        j.apply(3, exited(1, 1)).unwrap();
        assert_eq!((j.state, j.leases.clone()), (JobState::Failing, vec![2]));
        j.apply(
            4,
            JobEvent::MemberLost {
                lease: 2,
                message: "stopped".into(),
                ran: true,
            },
        )
        .unwrap();
        assert_eq!((j.state, j.failures, j.attempt), (JobState::Queued, 1, 2));
    }

    #[test]
    fn a_lost_gang_member_preempts_the_whole_gang() {
        let mut j = job(2, 0);
        j.apply(1, JobEvent::Leased { leases: vec![1, 2] }).unwrap();
        j.apply(
            2,
            JobEvent::MemberLost {
                lease: 1,
                message: "lease expired".into(),
                ran: false,
            },
        )
        .unwrap();
        assert_eq!(j.state, JobState::Preempting);
        j.apply(3, exited(2, 143)).unwrap();
        assert_eq!(
            (j.state, j.preemptions, j.failures),
            (JobState::Queued, 1, 0)
        );
    }

    #[test]
    fn an_unknown_member_is_refused() {
        let mut j = job(1, 0);
        j.apply(1, JobEvent::Leased { leases: vec![7] }).unwrap();
        assert!(j.apply(2, exited(8, 0)).is_err());
        assert_eq!(j.leases, vec![7]);
    }

    #[test]
    fn a_running_job_reported_running_is_kept_as_it_is() {
        let mut j = job(1, 0);
        assert_eq!(j.apply(1, JobEvent::Leased { leases: vec![7] }), Ok(None));
        let starting = j.clone();
        assert_eq!(j.apply(2, JobEvent::Started), Ok(None));
        assert_ne!(j, starting, "starting: the report moves it on");
        let before = j.clone();
        assert_eq!(j.apply(3, JobEvent::Started), Ok(None));
        assert_eq!(j, before, "running, reported running: nothing changes");
    }

    #[test]
    fn the_member_a_report_is_about_is_the_lease_that_leaves() {
        let mut j = job(2, 0);
        j.apply(1, JobEvent::Leased { leases: vec![4, 5] }).unwrap();
        j.apply(2, JobEvent::Started).unwrap();
        assert_eq!(j.apply(3, JobEvent::Preempt), Ok(None));
        assert_eq!(j.apply(4, exited(5, 143)), Ok(Some(5)));
        assert_eq!(j.leases, vec![4]);
        assert_eq!(
            j.apply(
                5,
                JobEvent::MemberLost {
                    lease: 4,
                    message: "gone".into(),
                    ran: false,
                }
            ),
            Ok(Some(4))
        );
        assert_eq!((j.state, j.leases.len()), (JobState::Queued, 0));
    }

    #[test]
    fn a_refused_report_about_a_member_leaves_the_job_as_it_was() {
        let mut j = job(3, 0);
        j.apply(
            1,
            JobEvent::Leased {
                leases: vec![4, 5, 6],
            },
        )
        .unwrap();
        // No legal move takes a member report in this state; the member the report is
        // about leaves the job first and must come back where it was.
        j.state = JobState::Queued;
        let before = j.clone();
        assert!(j.apply(2, exited(5, 0)).is_err());
        assert_eq!(j, before);
        assert_eq!(j.leases, vec![4, 5, 6]);
    }
}
