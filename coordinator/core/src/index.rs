//! What the decisions ask of the jobs on every call, kept in step with each job change
//! instead of being recomputed from every job ever submitted: the queued jobs in queue order
//! (priority, then age), how many are queued per team, the retry back-offs still pending,
//! the run-time limits of running jobs, and the GPUs each owner's unfinished jobs ask for.
//!
//! [`JobIndex::sync`] is called with a job after every change to it (the core does so where
//! it records [`crate::Effect::JobChanged`]), so the index is a function of the jobs' current
//! records and a restore rebuilds it from them.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use nightshift_common::{JobState, UnixMillis};

use crate::job::Job;

/// Queue order: higher priority first, then first submitted, then lower id.
pub(crate) type QueueKey = (Reverse<i32>, UnixMillis, u64);

/// What one job contributes to the index.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    /// Its place in the queue, while queued.
    queued: Option<QueueKey>,
    not_before: Option<UnixMillis>,
    /// When it reaches its `maxRunSeconds`, while running.
    run_deadline: Option<UnixMillis>,
    /// GPUs it asks for, while unfinished.
    asked: u64,
    owner: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct JobIndex {
    entries: BTreeMap<u64, Entry>,
    /// Queued jobs in queue order, each with the time its back-off ends.
    queued: BTreeMap<QueueKey, Option<UnixMillis>>,
    /// Queued jobs per team; a team with none has no entry.
    queued_teams: BTreeMap<String, usize>,
    /// Every job's pending retry back-off, by when it ends.
    backoffs: BTreeSet<(UnixMillis, u64)>,
    /// Every running job's run-time limit, by when it is reached.
    run_limits: BTreeSet<(UnixMillis, u64)>,
    /// GPUs asked for by unfinished jobs, per owner; an owner with none has no entry.
    asked: BTreeMap<Option<String>, u64>,
}

impl JobIndex {
    pub(crate) fn build<'a>(jobs: impl IntoIterator<Item = &'a Job>) -> Self {
        let mut index = Self::default();
        for job in jobs {
            index.sync(job);
        }
        index
    }

    /// Brings the index in step with `job`'s current record.
    pub(crate) fn sync(&mut self, job: &Job) {
        let entry = Entry::of(job);
        if self.entries.get(&job.id) == Some(&entry) {
            return;
        }
        if let Some(old) = self.entries.remove(&job.id) {
            self.remove(job.id, &old);
        }
        self.add(job.id, &entry);
        self.entries.insert(job.id, entry);
    }

    /// A job whose entry does not match its record (a change that was not synced), or
    /// whose entry is missing or left over: for the invariant checks.
    pub(crate) fn stale_entry<'a>(&self, jobs: impl IntoIterator<Item = &'a Job>) -> Option<u64> {
        let mut count = 0;
        for job in jobs {
            count += 1;
            if self.entries.get(&job.id) != Some(&Entry::of(job)) {
                return Some(job.id);
            }
        }
        (count != self.entries.len()).then(|| self.entries.keys().next_back().copied().unwrap_or(0))
    }

    fn add(&mut self, id: u64, e: &Entry) {
        if let Some(key) = e.queued {
            self.queued.insert(key, e.not_before);
            *self.queued_teams.entry(e.team().to_owned()).or_default() += 1;
        }
        if let Some(at) = e.not_before {
            self.backoffs.insert((at, id));
        }
        if let Some(at) = e.run_deadline {
            self.run_limits.insert((at, id));
        }
        if e.asked > 0 {
            *self.asked.entry(e.owner.clone()).or_default() += e.asked;
        }
    }

    fn remove(&mut self, id: u64, e: &Entry) {
        if let Some(key) = e.queued {
            self.queued.remove(&key);
            if let Some(n) = self.queued_teams.get_mut(e.team()) {
                *n -= 1;
                if *n == 0 {
                    self.queued_teams.remove(e.team());
                }
            }
        }
        if let Some(at) = e.not_before {
            self.backoffs.remove(&(at, id));
        }
        if let Some(at) = e.run_deadline {
            self.run_limits.remove(&(at, id));
        }
        if e.asked > 0
            && let Some(n) = self.asked.get_mut(&e.owner)
        {
            *n -= e.asked;
            if *n == 0 {
                self.asked.remove(&e.owner);
            }
        }
    }

    /// Queued jobs whose back-off has ended by `now`, in queue order.
    pub(crate) fn runnable(&self, now: UnixMillis) -> impl Iterator<Item = u64> + '_ {
        self.queued
            .iter()
            .filter(move |(_, not_before)| not_before.is_none_or(|t| t <= now))
            .map(|((_, _, id), _)| *id)
    }

    /// The first queued job after `after` (from the head when none) whose back-off has
    /// ended by `now`, with its place in the queue: a walk of [`JobIndex::runnable`] that
    /// holds no borrow between steps, so the jobs may change on the way.
    pub(crate) fn next_runnable(
        &self,
        now: UnixMillis,
        after: Option<QueueKey>,
    ) -> Option<(QueueKey, u64)> {
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.queued
            .range((from, Bound::Unbounded))
            .find(|(_, not_before)| not_before.is_none_or(|t| t <= now))
            .map(|(key, _)| (*key, key.2))
    }

    /// Whether the queued jobs all belong to one team (or none is queued).
    pub(crate) fn one_team_queued(&self) -> bool {
        self.queued_teams.len() <= 1
    }

    /// The earliest pending back-off, and the earliest one after `after`: all that a
    /// search for the next deadline, or the next one after the last decision, can use.
    pub(crate) fn next_backoffs(
        &self,
        after: Option<UnixMillis>,
    ) -> impl Iterator<Item = UnixMillis> + '_ {
        first_and_first_after(&self.backoffs, after)
    }

    /// Running jobs that have reached their run-time limit by `now`, soonest first.
    pub(crate) fn run_limits_reached(&self, now: UnixMillis) -> impl Iterator<Item = u64> + '_ {
        self.run_limits
            .range(..(now.saturating_add(1), 0))
            .map(|(_, id)| *id)
    }

    /// The earliest run-time limit of a running job, and the earliest one after `after`
    /// (as [`JobIndex::next_backoffs`]).
    pub(crate) fn next_run_limits(
        &self,
        after: Option<UnixMillis>,
    ) -> impl Iterator<Item = UnixMillis> + '_ {
        first_and_first_after(&self.run_limits, after)
    }

    /// GPUs asked for by `owner`'s unfinished jobs.
    pub(crate) fn asked_by(&self, owner: Option<&str>) -> u64 {
        self.asked
            .get(&owner.map(str::to_owned))
            .copied()
            .unwrap_or(0)
    }
}

impl Entry {
    fn team(&self) -> &str {
        team_of(self.owner.as_deref())
    }

    fn of(job: &Job) -> Self {
        Self {
            queued: (job.state == JobState::Queued).then_some((
                Reverse(job.spec.priority),
                job.submitted_at,
                job.id,
            )),
            not_before: job.not_before,
            run_deadline: job.run_deadline(),
            asked: if job.state.is_finished() {
                0
            } else {
                u64::from(job.spec.gpus) * u64::from(job.spec.nodes)
            },
            owner: job.spec.owner.clone(),
        }
    }
}

/// The earliest time in `set`, and the earliest one after `after`.
fn first_and_first_after(
    set: &BTreeSet<(UnixMillis, u64)>,
    after: Option<UnixMillis>,
) -> impl Iterator<Item = UnixMillis> + '_ {
    let first = set.first().map(|(at, _)| *at);
    let later = after.and_then(|t| {
        set.range((t.saturating_add(1), 0)..)
            .next()
            .map(|(at, _)| *at)
    });
    first.into_iter().chain(later)
}

/// A job's team: its owner, or `default`.
pub(crate) fn team(j: &Job) -> &str {
    team_of(j.spec.owner.as_deref())
}

fn team_of(owner: Option<&str>) -> &str {
    owner.unwrap_or("default")
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::JobSpec;

    fn job(id: u64, priority: i32, owner: Option<&str>, submitted_at: UnixMillis) -> Job {
        let mut spec: JobSpec =
            serde_json::from_str(r#"{"name":"j","image":"i","gpus":2}"#).expect("spec");
        spec.priority = priority;
        spec.owner = owner.map(str::to_owned);
        Job::new(id, spec, submitted_at)
    }

    #[test]
    fn queue_order_is_priority_then_age_and_follows_changes() {
        let mut a = job(1, 0, Some("a"), 10);
        let b = job(2, 5, Some("b"), 20);
        let c = job(3, 0, Some("a"), 5);
        let mut index = JobIndex::build([&a, &b, &c]);
        assert_eq!(index.runnable(0).collect::<Vec<_>>(), vec![2, 3, 1]);
        assert!(!index.one_team_queued());
        assert_eq!(index.asked_by(Some("a")), 4);

        a.state = JobState::Running;
        index.sync(&a);
        assert_eq!(index.runnable(0).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(index.asked_by(Some("a")), 4, "a running job still asks");

        a.state = JobState::Queued;
        a.not_before = Some(100);
        index.sync(&a);
        assert_eq!(index.runnable(99).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(index.runnable(100).collect::<Vec<_>>(), vec![2, 3, 1]);
        let walk = |now| {
            std::iter::successors(index.next_runnable(now, None), |(key, _)| {
                index.next_runnable(now, Some(*key))
            })
            .map(|(_, id)| id)
            .collect::<Vec<_>>()
        };
        assert_eq!(walk(99), vec![2, 3], "the walk is the runnable order");
        assert_eq!(walk(100), vec![2, 3, 1]);
        assert_eq!(index.next_backoffs(None).collect::<Vec<_>>(), vec![100]);
        assert_eq!(
            index.next_backoffs(Some(100)).collect::<Vec<_>>(),
            vec![100]
        );
        assert_eq!(
            index.next_backoffs(Some(99)).collect::<Vec<_>>(),
            vec![100, 100]
        );

        a.state = JobState::Succeeded;
        a.not_before = None;
        index.sync(&a);
        assert_eq!(index.asked_by(Some("a")), 2);
        assert_eq!(index.asked_by(None), 0);
        assert_eq!(index.next_backoffs(Some(0)).count(), 0);
    }

    #[test]
    fn rebuilding_from_the_jobs_gives_the_same_index() {
        let mut jobs = vec![
            job(1, 0, None, 1),
            job(2, 1, Some("x"), 2),
            job(3, 0, None, 3),
        ];
        let mut index = JobIndex::build(&jobs);
        assert_eq!(index.stale_entry(&jobs), None);
        jobs[0].state = JobState::Cancelled;
        jobs[1].state = JobState::Running;
        jobs[2].state = JobState::Queued;
        jobs[2].not_before = Some(50);
        for j in &jobs {
            index.sync(j);
        }
        let rebuilt = JobIndex::build(&jobs);
        assert_eq!(index.entries, rebuilt.entries);
        assert_eq!(index.queued, rebuilt.queued);
        assert_eq!(index.queued_teams, rebuilt.queued_teams);
        assert_eq!(index.backoffs, rebuilt.backoffs);
        assert_eq!(index.run_limits, rebuilt.run_limits);
        assert_eq!(index.asked, rebuilt.asked);
        assert!(index.one_team_queued(), "only team default is queued now");
        assert_eq!(index.stale_entry(&jobs), None);
        jobs[1].state = JobState::Queued;
        assert_eq!(
            index.stale_entry(&jobs),
            Some(2),
            "a change not synced is found"
        );
    }
}
