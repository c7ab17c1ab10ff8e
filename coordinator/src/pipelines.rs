//! Pipeline runs in the coordinator: the pure driver ([`nightshift_pipeline::driver`]) is
//! given the core as its job queue ([`StepJobs`]), each step admitted by the job policy as a
//! job submitted alone is ([`PolicyConfig::admit`]). `Cluster::apply` drives it under the
//! core's lock, so its changes are written in the same transaction as the jobs it submits.

use nightshift_common::{JobSpec, JobView, UnixMillis};
use nightshift_core::Core;
pub use nightshift_pipeline::driver::{PipelineChanges, PipelineSnapshot, Pipelines, StepJobs};

use crate::policy::{PolicyConfig, Submitter};

/// The core as the queue of pipeline steps, admitting each by `policy`.
pub struct AdmittedSteps<'a> {
    pub core: &'a mut Core,
    pub policy: &'a PolicyConfig,
}

impl StepJobs for AdmittedSteps<'_> {
    fn job(&self, id: u64) -> Option<JobView> {
        self.core.job(id)
    }

    fn submit(&mut self, now: UnixMillis, spec: JobSpec) -> Result<u64, String> {
        let core = &mut *self.core;
        let admitted = self
            .policy
            .admit(Submitter::Anyone, spec, |owner| core.gpus_asked_by(owner))
            .map_err(|e| e.to_string())?;
        core.submit(now, admitted.spec).map_err(|e| e.to_string())
    }

    fn cancel(&mut self, now: UnixMillis, id: u64) {
        // A job that finished meanwhile stays as it ended.
        let _ = self.core.cancel(now, id);
    }
}
