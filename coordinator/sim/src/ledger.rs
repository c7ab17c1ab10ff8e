//! The books of one policy's run: GPU time leased to jobs, the part of it that became saved
//! progress, the part lost at preemption, and the preemptions themselves.
//!
//! Every GPU-millisecond a job container holds falls in exactly one bucket:
//! `harvested = useful + lost + overhead`, where overhead is start-up time and the time
//! spent saving a checkpoint after the signal.

use nightshift_common::UnixMillis;

use crate::backlog::SimJob;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    pub harvested_gpu_ms: u128,
    pub useful_gpu_ms: u128,
    pub lost_gpu_ms: u128,
    pub preemptions: u64,
    pub completed: u64,
}

fn gpu_ms(gpus: &[u32], ms: u64) -> u128 {
    gpus.len() as u128 * u128::from(ms)
}

/// Work done in this attempt by `at`: time since start beyond the start-up overhead.
fn progress(job: &SimJob, started: UnixMillis, at: UnixMillis) -> u64 {
    at.saturating_sub(started + job.startup_ms)
        .min(job.remaining_ms())
}

impl Ledger {
    /// The job ran to completion at `now`.
    pub fn finish(&mut self, job: &mut SimJob, gpus: &[u32], started: UnixMillis, now: UnixMillis) {
        let done = progress(job, started, now);
        self.harvested_gpu_ms += gpu_ms(gpus, now.saturating_sub(started));
        self.useful_gpu_ms += gpu_ms(gpus, done);
        job.saved_ms += done;
        self.completed += 1;
    }

    /// The job was signalled at `signalled` and exited at `now`: it keeps what it could save.
    pub fn preempt(
        &mut self,
        job: &mut SimJob,
        gpus: &[u32],
        started: UnixMillis,
        signalled: UnixMillis,
        now: UnixMillis,
    ) {
        let done = progress(job, started, signalled);
        let saved = if job.saves_on_signal || job.checkpoint_ms == 0 {
            done
        } else {
            done / job.checkpoint_ms * job.checkpoint_ms
        };
        self.harvested_gpu_ms += gpu_ms(gpus, now.saturating_sub(started));
        self.useful_gpu_ms += gpu_ms(gpus, saved);
        self.lost_gpu_ms += gpu_ms(gpus, done - saved);
        self.preemptions += 1;
        job.saved_ms += saved;
    }

    /// The run is cut off by the end of the simulation: its progress counts as saved.
    pub fn truncate(&mut self, job: &SimJob, gpus: &[u32], started: UnixMillis, now: UnixMillis) {
        self.harvested_gpu_ms += gpu_ms(gpus, now.saturating_sub(started));
        self.useful_gpu_ms += gpu_ms(gpus, progress(job, started, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(saves: bool) -> SimJob {
        SimJob {
            class: "t",
            gpus: 2,
            work_ms: 10 * 60_000,
            saved_ms: 0,
            checkpoint_ms: 3 * 60_000,
            startup_ms: 60_000,
            saves_on_signal: saves,
        }
    }

    #[test]
    fn preemption_keeps_the_last_checkpoint_and_loses_the_rest() {
        let mut l = Ledger::default();
        let mut j = job(false);
        // Started at 0, signalled at 8 min: 7 min of work, checkpoints at 3 and 6 min.
        l.preempt(&mut j, &[0, 1], 0, 8 * 60_000, 8 * 60_000 + 20_000);
        assert_eq!(l.useful_gpu_ms, 2 * 6 * 60_000);
        assert_eq!(l.lost_gpu_ms, 2 * 60_000);
        assert_eq!(l.harvested_gpu_ms, 2 * (8 * 60_000 + 20_000));
        assert_eq!(j.saved_ms, 6 * 60_000);
        // Resumed: 4 min of work remain, plus a minute of start-up.
        l.finish(&mut j, &[0, 1], 10 * 60_000, 15 * 60_000);
        assert_eq!(j.remaining_ms(), 0);
        assert_eq!(l.useful_gpu_ms, 2 * 10 * 60_000);
        assert_eq!((l.preemptions, l.completed), (1, 1));
    }

    #[test]
    fn saving_on_signal_loses_nothing() {
        let mut l = Ledger::default();
        let mut j = job(true);
        l.preempt(&mut j, &[0, 1], 0, 8 * 60_000, 8 * 60_000 + 20_000);
        assert_eq!((l.useful_gpu_ms, l.lost_gpu_ms), (2 * 7 * 60_000, 0));
    }
}
