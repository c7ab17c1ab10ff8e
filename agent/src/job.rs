//! The job container contract: how a lease becomes a container (GPUs, checkpoint and output
//! directories, environment, labels), and reading a finished job's output parameters.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nightshift_common::labels::{self, env};
use nightshift_common::{LeaseGrant, labels::CHECKPOINT_MOUNT, labels::OUTPUT_MOUNT};

use nightshift_common::{Capture, STDOUT_OUTPUT};

use crate::engine::{ContainerSpec, Engine, GpuAccess, PortPublish};

/// Output parameter files read back after a job ends: at most this many ...
const MAX_OUTPUTS: usize = 32;
/// ... of at most this many bytes each.
const MAX_OUTPUT_BYTES: u64 = 64 << 10;

/// The mode of a job's checkpoint and output directories: read, write and enter for their
/// owner (the agent) and group, nothing for others; set-group-ID, so that what the job
/// creates there belongs to the group too and a later attempt running as another user can
/// still replace it. Not 0777: the checkpoints and outputs of a job (its secrets, say) are
/// no business of the host's other users.
pub const JOB_DIR_MODE: u32 = 0o2770;

/// Label carrying the grace period, so that an adopted container is stopped as it asked.
pub const GRACE_LABEL: &str = "io.nightshift.grace-seconds";

/// The host directories of a job, shared by all its attempts.
pub struct JobDirs {
    pub checkpoint: PathBuf,
    pub outputs: PathBuf,
}

impl JobDirs {
    pub fn new(work_dir: &Path, job_id: u64) -> Self {
        let root = work_dir.join("jobs").join(job_id.to_string());
        Self {
            checkpoint: root.join("checkpoint"),
            outputs: root.join("outputs"),
        }
    }

    /// Creates both directories, mode [`JOB_DIR_MODE`]: the agent's user and group may
    /// write them, nobody else may even list them. The job's container gets their group as a
    /// supplementary group ([`JobDirs::group`]), so whatever user its image runs as may write
    /// there.
    pub fn create(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        for dir in [&self.checkpoint, &self.outputs] {
            std::fs::create_dir_all(dir)?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(JOB_DIR_MODE))?;
        }
        Ok(())
    }

    /// The group that owns the job's directories (the agent's), once created.
    pub fn group(&self) -> Option<u32> {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&self.checkpoint).ok().map(|m| m.gid())
    }

    /// When the job last wrote to its checkpoint directory: the newest modification time of
    /// anything in it, in Unix milliseconds.
    pub fn last_checkpoint(&self) -> Option<u64> {
        std::fs::read_dir(&self.checkpoint)
            .ok()?
            .flatten()
            .filter_map(|e| e.metadata().ok()?.modified().ok())
            .filter_map(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64)
            .max()
    }

    /// Whether an earlier attempt left anything to resume from.
    pub fn has_checkpoint(&self) -> bool {
        std::fs::read_dir(&self.checkpoint).is_ok_and(|mut d| d.next().is_some())
    }
}

pub fn container_name(node: &str, lease: &LeaseGrant) -> String {
    format!("nightshift-job-{node}-{}-{}", lease.job_id, lease.lease_id)
}

/// The container for `lease` on `node`, given its GPUs through `gpus`.
pub fn container_spec(
    node: &str,
    lease: &LeaseGrant,
    dirs: &JobDirs,
    gpus: GpuAccess,
    bind_ip: &str,
) -> ContainerSpec {
    let job = &lease.job;
    let gpu_list = lease
        .gpus
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let resuming = lease.attempt > 1 || dirs.has_checkpoint();
    let mut env_vars: Vec<(String, String)> = job
        .env
        .iter()
        .map(|e| (e.name.clone(), e.value.clone()))
        .collect();
    env_vars.extend([
        (env::JOB_ID.to_owned(), lease.job_id.to_string()),
        (env::JOB_NAME.to_owned(), job.name.clone()),
        (env::ATTEMPT.to_owned(), lease.attempt.to_string()),
        (
            env::RESUMING.to_owned(),
            if resuming { "1" } else { "0" }.to_owned(),
        ),
        (env::CHECKPOINT_DIR.to_owned(), CHECKPOINT_MOUNT.to_owned()),
        (env::OUTPUT_DIR.to_owned(), OUTPUT_MOUNT.to_owned()),
        (env::LEASE_ID.to_owned(), lease.lease_id.to_string()),
        (env::GPUS.to_owned(), gpu_list.clone()),
    ]);
    let mut publish = None;
    if let Some(r) = &lease.rendezvous {
        env_vars.extend([
            ("MASTER_ADDR".to_owned(), r.master_addr.clone()),
            ("MASTER_PORT".to_owned(), r.master_port.to_string()),
            ("NNODES".to_owned(), r.nnodes.to_string()),
            ("NODE_RANK".to_owned(), r.node_rank.to_string()),
            ("NPROC_PER_NODE".to_owned(), r.nproc_per_node.to_string()),
            (
                "WORLD_SIZE".to_owned(),
                (r.nnodes * r.nproc_per_node).to_string(),
            ),
        ]);
        if r.node_rank == 0 {
            publish = Some(PortPublish {
                container_port: r.master_port,
                host_ip: bind_ip.to_owned(),
                host_port: r.master_port,
            });
        }
    }
    let labels = BTreeMap::from([
        (labels::MANAGED_BY.to_owned(), node.to_owned()),
        (labels::ROLE.to_owned(), labels::ROLE_JOB.to_owned()),
        (labels::JOB_ID.to_owned(), lease.job_id.to_string()),
        (labels::ATTEMPT.to_owned(), lease.attempt.to_string()),
        (labels::LEASE_ID.to_owned(), lease.lease_id.to_string()),
        (labels::EPOCH.to_owned(), lease.epoch.to_string()),
        (labels::GPUS.to_owned(), gpu_list),
        (
            GRACE_LABEL.to_owned(),
            job.checkpoint.grace_period_seconds.to_string(),
        ),
    ]);
    ContainerSpec {
        name: container_name(node, lease),
        image: job.image.clone(),
        entrypoint: job.command.clone(),
        args: job.args.clone(),
        env: env_vars,
        labels,
        gpus,
        binds: vec![
            (
                dirs.checkpoint.display().to_string(),
                CHECKPOINT_MOUNT.to_owned(),
            ),
            (dirs.outputs.display().to_string(), OUTPUT_MOUNT.to_owned()),
        ],
        publish,
        stop_signal: Some(job.checkpoint.signal.clone()),
        files: job
            .files
            .iter()
            .map(|f| (f.path.clone(), f.content.clone().into_bytes()))
            .collect(),
        groups: dirs.group().into_iter().collect(),
        sandbox: job.sandbox.clone(),
    }
}

/// Longest standard output kept as a job's `nightshift.io/stdout` output.
pub const MAX_STDOUT_BYTES: usize = 256 << 10;

/// What `capture` asks for, read from the exited container `id`: each file under its name
/// (a missing or unreadable file is left out, so that a default can apply), and standard
/// output under [`STDOUT_OUTPUT`].
pub async fn capture<E: Engine>(
    engine: &E,
    id: &str,
    capture: &Capture,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for f in &capture.files {
        match engine.read_file(id, &f.path, MAX_OUTPUT_BYTES).await {
            Ok(Some(bytes)) => {
                out.insert(f.name.clone(), String::from_utf8_lossy(&bytes).into_owned());
            }
            Ok(None) => tracing::info!(container = %id, path = %f.path, "output file not found"),
            Err(e) => {
                tracing::warn!(container = %id, path = %f.path, error = %e, "output file not read")
            }
        }
    }
    if capture.stdout {
        match engine.stdout(id, MAX_STDOUT_BYTES).await {
            Ok(text) => {
                out.insert(STDOUT_OUTPUT.to_owned(), text);
            }
            Err(e) => tracing::warn!(container = %id, error = %e, "standard output not read"),
        }
    }
    out
}

/// The output parameters a job wrote: one file per parameter, its content the value.
pub fn read_outputs(dir: &Path) -> BTreeMap<String, String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for entry in entries.flatten().take(MAX_OUTPUTS) {
        let path = entry.path();
        let small = entry
            .metadata()
            .is_ok_and(|m| m.is_file() && m.len() <= MAX_OUTPUT_BYTES);
        if !small {
            continue;
        }
        if let (Some(name), Ok(value)) = (
            path.file_name().and_then(|n| n.to_str()),
            std::fs::read_to_string(&path),
        ) {
            out.insert(name.to_owned(), value.trim_end().to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::{CheckpointPolicy, EnvVar, JobSpec};

    fn lease() -> LeaseGrant {
        LeaseGrant {
            lease_id: 9,
            epoch: 4,
            job_id: 3,
            attempt: 2,
            gpus: vec![1, 2],
            job: JobSpec {
                name: "train".into(),
                image: "trainer:1".into(),
                command: vec!["/train".into()],
                args: vec!["--fast".into()],
                env: vec![EnvVar {
                    name: "LR".into(),
                    value: "0.1".into(),
                }],
                gpus: 2,
                nodes: 1,
                priority: 0,
                owner: None,
                checkpoint: CheckpointPolicy {
                    signal: "SIGUSR1".into(),
                    grace_period_seconds: 7,
                },
                retry: Default::default(),
                capture: Default::default(),
                files: Vec::new(),
                sandbox: Default::default(),
                max_run_seconds: None,
            },
            rendezvous: None,
        }
    }

    #[test]
    fn the_spec_carries_the_contract() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = JobDirs::new(dir.path(), 3);
        let spec = container_spec(
            "n1",
            &lease(),
            &dirs,
            GpuAccess::VisibleDevicesEnv {
                indices: vec![1, 2],
            },
            "0.0.0.0",
        );
        let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
        assert_eq!(env["LR"], "0.1");
        assert_eq!(env["NIGHTSHIFT_ATTEMPT"], "2");
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "1");
        assert_eq!(env["NIGHTSHIFT_CHECKPOINT_DIR"], "/nightshift/checkpoint");
        assert_eq!(env["NIGHTSHIFT_GPUS"], "1,2");
        assert_eq!(spec.labels["io.nightshift.epoch"], "4");
        assert_eq!(spec.labels[GRACE_LABEL], "7");
        assert_eq!(spec.stop_signal.as_deref(), Some("SIGUSR1"));
        assert_eq!(spec.name, "nightshift-job-n1-3-9");
        assert!(spec.binds[0].0.ends_with("jobs/3/checkpoint"));
    }

    #[test]
    fn a_gang_member_gets_the_rendezvous_and_rank_zero_publishes_the_port() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = JobDirs::new(dir.path(), 3);
        let mut l = lease();
        l.rendezvous = Some(nightshift_common::Rendezvous {
            master_addr: "10.0.0.1".into(),
            master_port: 29503,
            nnodes: 2,
            node_rank: 0,
            nproc_per_node: 2,
        });
        let spec = container_spec("n1", &l, &dirs, GpuAccess::None, "127.0.0.1");
        let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
        assert_eq!(
            (
                env["MASTER_ADDR"].as_str(),
                env["MASTER_PORT"].as_str(),
                env["WORLD_SIZE"].as_str()
            ),
            ("10.0.0.1", "29503", "4")
        );
        assert_eq!(
            (env["NNODES"].as_str(), env["NODE_RANK"].as_str()),
            ("2", "0")
        );
        assert_eq!(
            spec.publish.map(|p| (p.host_ip, p.host_port)),
            Some(("127.0.0.1".into(), 29503))
        );
        l.rendezvous.as_mut().unwrap().node_rank = 1;
        assert!(
            container_spec("n2", &l, &dirs, GpuAccess::None, "127.0.0.1")
                .publish
                .is_none()
        );
    }

    #[test]
    fn job_directories_are_closed_to_others_and_the_container_gets_their_group() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let dirs = JobDirs::new(dir.path(), 3);
        dirs.create().unwrap();
        for d in [&dirs.checkpoint, &dirs.outputs] {
            let mode = std::fs::metadata(d).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o2770, "{} is {mode:o}", d.display());
        }
        let gid = std::fs::metadata(&dirs.outputs).unwrap().gid();
        let spec = container_spec("n1", &lease(), &dirs, GpuAccess::None, "0.0.0.0");
        assert_eq!(spec.groups, vec![gid]);
    }

    #[test]
    fn outputs_are_read_trimmed_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("final_step"), "1000\n").unwrap();
        std::fs::write(dir.path().join("huge"), vec![b'x'; 70 << 10]).unwrap();
        let out = read_outputs(dir.path());
        assert_eq!(out.len(), 1);
        assert_eq!(out["final_step"], "1000");
    }
}
