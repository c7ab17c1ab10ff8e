//! The research backlog: an endless, seeded stream of jobs drawn from a mix of classes
//! (GPU count, run length, checkpoint interval, start-up overhead). Every policy in a run sees
//! the same sequence of jobs.

use nightshift_common::JobSpec;

/// The image every simulated job runs.
pub const JOB_IMAGE: &str = "registry.invalid/research:sim";

use crate::rng::Rng;

/// One kind of research job.
#[derive(Debug, Clone, PartialEq)]
pub struct JobClass {
    pub name: &'static str,
    pub gpus: u32,
    /// Relative frequency in the mix.
    pub weight: u32,
    /// Work needed, hours: log-uniform between the two.
    pub run_hours: (f64, f64),
    /// Minutes of work between periodic checkpoints.
    pub checkpoint_min: f64,
    /// Minutes from container start to useful work (image pull, data and model loading).
    pub startup_min: f64,
    /// Saves a checkpoint when signalled (inside its grace period), so loses nothing.
    pub saves_on_signal: bool,
}

/// The default mix: evaluation, preprocessing, fine-tuning and pretraining.
pub fn default_mix() -> Vec<JobClass> {
    vec![
        JobClass {
            name: "eval",
            gpus: 1,
            weight: 3,
            run_hours: (0.5, 2.0),
            checkpoint_min: 10.0,
            startup_min: 2.0,
            saves_on_signal: true,
        },
        JobClass {
            name: "preprocess",
            gpus: 2,
            weight: 2,
            run_hours: (1.0, 4.0),
            checkpoint_min: 20.0,
            startup_min: 1.0,
            saves_on_signal: true,
        },
        JobClass {
            name: "sft",
            gpus: 4,
            weight: 3,
            run_hours: (2.0, 8.0),
            checkpoint_min: 30.0,
            startup_min: 5.0,
            saves_on_signal: true,
        },
        JobClass {
            name: "pretrain",
            gpus: 4,
            weight: 2,
            run_hours: (6.0, 24.0),
            checkpoint_min: 60.0,
            startup_min: 10.0,
            saves_on_signal: false,
        },
    ]
}

/// A job as the simulator tracks it: its class's parameters and the work it has saved.
#[derive(Debug, Clone, PartialEq)]
pub struct SimJob {
    pub class: &'static str,
    pub gpus: u32,
    pub work_ms: u64,
    pub saved_ms: u64,
    pub checkpoint_ms: u64,
    pub startup_ms: u64,
    pub saves_on_signal: bool,
}

impl SimJob {
    pub fn remaining_ms(&self) -> u64 {
        self.work_ms.saturating_sub(self.saved_ms)
    }
}

#[derive(Debug, Clone)]
pub struct Backlog {
    mix: Vec<JobClass>,
    rng: Rng,
    issued: u64,
}

impl Backlog {
    pub fn new(mix: Vec<JobClass>, seed: u64) -> Self {
        Self {
            mix,
            rng: Rng::stream(seed, 7),
            issued: 0,
        }
    }

    /// The next job of the stream and the spec the core receives.
    pub fn next_job(&mut self) -> Option<(SimJob, JobSpec)> {
        let total: u32 = self.mix.iter().map(|c| c.weight).sum();
        if total == 0 {
            return None;
        }
        let mut pick = self.rng.below(u64::from(total)) as u32;
        let class = self.mix.iter().find(|c| {
            if pick < c.weight {
                true
            } else {
                pick -= c.weight;
                false
            }
        })?;
        let (lo, hi) = class.run_hours;
        let hours = (lo.ln() + (hi.ln() - lo.ln()) * self.rng.uniform()).exp();
        self.issued += 1;
        let job = SimJob {
            class: class.name,
            gpus: class.gpus,
            work_ms: (hours * 3_600_000.0) as u64,
            saved_ms: 0,
            checkpoint_ms: (class.checkpoint_min * 60_000.0) as u64,
            startup_ms: (class.startup_min * 60_000.0) as u64,
            saves_on_signal: class.saves_on_signal,
        };
        let spec = JobSpec::new(
            format!("{}-{}", class.name, self.issued),
            JOB_IMAGE,
            class.gpus,
        );
        Some((job, spec))
    }
}
