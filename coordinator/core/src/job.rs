//! A job and its state machine: one transition function, illegal moves are typed errors.

use std::collections::BTreeMap;

use nightshift_common::{JobSpec, JobState, UnixMillis};

/// What happens to a job. [`Job::apply`] is the only place a job's state changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEvent {
    /// GPUs were leased to it.
    Leased { lease: u64 },
    /// The agent reports its container running.
    Started,
    /// Its lease was revoked so that the node serves again.
    Preempt,
    /// The user cancelled it.
    Cancel,
    /// Its container exited by itself.
    Exited {
        exit_code: i64,
        outputs: BTreeMap<String, String>,
    },
    /// The container could not be started, e.g. its image is missing.
    StartFailed { message: String },
    /// Its container is gone after a preemption, or its lease expired: run it again later.
    Requeue { message: Option<String> },
    /// Its container is gone after a cancel.
    Stopped,
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
    pub submitted_at: UnixMillis,
    pub started_at: Option<UnixMillis>,
    pub finished_at: Option<UnixMillis>,
    /// The lease it holds, revoked or not.
    pub lease: Option<u64>,
    pub exit_code: Option<i64>,
    pub outputs: BTreeMap<String, String>,
    pub message: Option<String>,
}

impl JobEvent {
    fn name(&self) -> &'static str {
        match self {
            Self::Leased { .. } => "lease",
            Self::Started => "start",
            Self::Preempt => "preempt",
            Self::Cancel => "cancel",
            Self::Exited { .. } => "exit",
            Self::StartFailed { .. } => "fail to start",
            Self::Requeue { .. } => "requeue",
            Self::Stopped => "stop",
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
            submitted_at: now,
            started_at: None,
            finished_at: None,
            lease: None,
            exit_code: None,
            outputs: BTreeMap::new(),
            message: None,
        }
    }

    /// The one transition function.
    pub fn apply(&mut self, now: UnixMillis, event: JobEvent) -> Result<(), IllegalTransition> {
        use JobState::*;
        let illegal = |job: &Job, event: &JobEvent| IllegalTransition {
            job: job.id,
            from: job.state.as_str(),
            event: event.name(),
        };
        let next = match (self.state, &event) {
            (Queued, JobEvent::Leased { lease }) => {
                self.lease = Some(*lease);
                self.message = None;
                Starting
            }
            (Starting, JobEvent::Started) => {
                self.started_at.get_or_insert(now);
                Running
            }
            (Running, JobEvent::Started) => Running,
            // Still running while it is being stopped: nothing changes.
            (Preempting | Cancelling, JobEvent::Started) => self.state,
            (Starting | Running, JobEvent::Preempt) => Preempting,
            (Starting | Running | Preempting, JobEvent::Cancel) => Cancelling,
            (Queued, JobEvent::Cancel) => {
                self.finished_at = Some(now);
                Cancelled
            }
            (Starting | Running | Preempting, JobEvent::Exited { exit_code, outputs }) => {
                self.lease = None;
                self.exit_code = Some(*exit_code);
                self.outputs = outputs.clone();
                self.finished_at = Some(now);
                if *exit_code == 0 {
                    self.message = None;
                    Succeeded
                } else {
                    self.message = Some(format!("exited with code {exit_code}"));
                    Failed
                }
            }
            (Starting | Running | Preempting, JobEvent::StartFailed { message }) => {
                self.lease = None;
                self.finished_at = Some(now);
                self.message = Some(message.clone());
                Failed
            }
            (Starting | Running | Preempting, JobEvent::Requeue { message }) => {
                self.lease = None;
                self.attempt += 1;
                self.preemptions += 1;
                self.message = message.clone();
                Queued
            }
            (
                Cancelling,
                JobEvent::Stopped
                | JobEvent::Requeue { .. }
                | JobEvent::Exited { .. }
                | JobEvent::StartFailed { .. },
            ) => {
                self.lease = None;
                self.finished_at = Some(now);
                Cancelled
            }
            _ => return Err(illegal(self, &event)),
        };
        self.state = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::CheckpointPolicy;

    fn job() -> Job {
        let spec = JobSpec {
            name: "t".into(),
            image: "i".into(),
            command: vec![],
            args: vec![],
            env: vec![],
            gpus: 1,
            priority: 0,
            owner: None,
            checkpoint: CheckpointPolicy::default(),
            capture: Default::default(),
            files: Vec::new(),
        };
        Job::new(1, spec, 0)
    }

    #[test]
    fn preempted_job_is_requeued_with_a_higher_attempt() {
        let mut j = job();
        j.apply(1, JobEvent::Leased { lease: 7 }).unwrap();
        j.apply(2, JobEvent::Started).unwrap();
        j.apply(3, JobEvent::Preempt).unwrap();
        j.apply(4, JobEvent::Requeue { message: None }).unwrap();
        assert_eq!(
            (j.state, j.attempt, j.preemptions, j.lease),
            (JobState::Queued, 2, 1, None)
        );
        assert_eq!(j.started_at, Some(2));
    }

    #[test]
    fn finished_job_cannot_start_again() {
        let mut j = job();
        j.apply(1, JobEvent::Cancel).unwrap();
        let err = j.apply(2, JobEvent::Leased { lease: 1 }).unwrap_err();
        assert_eq!(err.to_string(), "job 1: cannot lease while cancelled");
    }

    #[test]
    fn non_zero_exit_fails_with_the_code() {
        let mut j = job();
        j.apply(1, JobEvent::Leased { lease: 7 }).unwrap();
        j.apply(
            2,
            JobEvent::Exited {
                exit_code: 3,
                outputs: BTreeMap::new(),
            },
        )
        .unwrap();
        assert_eq!(j.state, JobState::Failed);
        assert_eq!(j.message.as_deref(), Some("exited with code 3"));
    }
}
