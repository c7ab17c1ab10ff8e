//! The job container contract: how a lease becomes a container (GPUs, checkpoint and output
//! directories, environment, labels), and reading a finished job's output parameters.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nightshift_common::labels::env;
use nightshift_common::{LeaseGrant, labels::CHECKPOINT_MOUNT, labels::OUTPUT_MOUNT};

use nightshift_common::{Capture, STDOUT_OUTPUT};
use nightshift_planner::CheckpointLayout;

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

/// Label carrying the grace period, so that an adopted container is stopped as it asked
/// (the planner reads it).
pub use nightshift_planner::GRACE_LABEL;

/// The host directories of a job: its output directory, and the checkpoint directory of one
/// attempt.
///
/// Each attempt (lease) writes its own checkpoint directory, `jobs/JOB_ID/checkpoints/EPOCH`
/// named by its lease's fencing epoch, seeded before it starts with a copy of the newest
/// earlier attempt's ([`JobDirs::seed`]). An attempt that runs on after its lease was taken
/// from it (a node that lost the coordinator) so writes only its own, older directory: it
/// can never overwrite the checkpoint of the attempt that replaced it.
///
/// The checkpoint directories live under a root of their own ([`JobDirs::attempt`]): the
/// agent's `work_dir` (local storage), or a directory every host mounts at the same path
/// (shared storage), where an attempt on any host finds the newest earlier attempt's, since
/// epochs are the coordinator's and rise across hosts. Outputs always stay under `work_dir`.
///
/// A gang's members each write their own rank's state, so each rank keeps its attempts
/// apart, `jobs/JOB_ID/checkpoints/rank-R/EPOCH` ([`JobDirs::for_lease`]): a member is seeded
/// from the newest earlier attempt *of its rank*, wherever that ran, never from another
/// rank's (the members of one attempt have different epochs).
pub struct JobDirs {
    /// The checkpoint directory mounted at [`CHECKPOINT_MOUNT`].
    pub checkpoint: PathBuf,
    pub outputs: PathBuf,
    /// The root the checkpoint directories are under (`work_dir`, or the shared directory).
    root: PathBuf,
    /// Where under it each attempt's is, by epoch, and the job's single directory from
    /// before attempts had their own.
    layout: CheckpointLayout,
    epoch: Option<u64>,
    /// The epoch of the earlier attempt whose checkpoint this one's was seeded from; 0 for
    /// the directory from before attempts had their own.
    pub resumed_from: Option<u64>,
}

impl JobDirs {
    /// The directories of the job as a whole: its outputs, and as its checkpoint directory
    /// the one its attempts shared before each had its own.
    pub fn new(work_dir: &Path, job_id: u64) -> Self {
        let layout = CheckpointLayout::new(job_id, None);
        Self {
            checkpoint: layout.legacy_dir(work_dir),
            outputs: work_dir
                .join("jobs")
                .join(job_id.to_string())
                .join("outputs"),
            root: work_dir.to_owned(),
            layout,
            epoch: None,
            resumed_from: None,
        }
    }

    /// The directories of the attempt that runs under the lease of fencing epoch `epoch`:
    /// its outputs under `work_dir`, its checkpoints under `checkpoint_root` (`work_dir`
    /// itself with local storage, the shared directory with shared storage).
    pub fn attempt(work_dir: &Path, checkpoint_root: &Path, job_id: u64, epoch: u64) -> Self {
        Self::member(work_dir, checkpoint_root, job_id, epoch, None)
    }

    /// The directories of the attempt that runs under `lease`: [`JobDirs::attempt`], with a
    /// gang member's checkpoints among those of its rank.
    pub fn for_lease(work_dir: &Path, checkpoint_root: &Path, lease: &LeaseGrant) -> Self {
        Self::member(
            work_dir,
            checkpoint_root,
            lease.job_id,
            lease.epoch,
            gang_rank(lease),
        )
    }

    /// The directories of the attempt of `job` under epoch `epoch`, as gang rank `rank`
    /// (`None`: a single-node job): [`JobDirs::for_lease`] from what a container's labels say.
    pub fn member(
        work_dir: &Path,
        checkpoint_root: &Path,
        job: u64,
        epoch: u64,
        rank: Option<u32>,
    ) -> Self {
        let layout = CheckpointLayout::new(job, rank);
        Self {
            checkpoint: layout.attempt_dir(checkpoint_root, epoch),
            root: checkpoint_root.to_owned(),
            layout,
            epoch: Some(epoch),
            ..Self::new(work_dir, job)
        }
    }

    /// Before the attempt starts: fills its checkpoint directory with a copy of the newest
    /// earlier attempt's (the highest epoch below its own with anything in it, whatever a
    /// stale attempt wrote since), so that it finds what was saved at [`CHECKPOINT_MOUNT`].
    /// The copy is made beside it and renamed into place, so an agent that dies meanwhile
    /// leaves no half copy to resume from; it keeps modification times. Directories of
    /// attempts older than the one copied are removed. An attempt whose directory exists
    /// already (the agent restarted before its container started) keeps it.
    pub fn seed(&mut self) -> std::io::Result<()> {
        let Some(epoch) = self.epoch else {
            return Ok(());
        };
        let source = self.newest_earlier(epoch)?;
        self.resumed_from = source.as_ref().map(|(e, _)| *e);
        if self.checkpoint.exists() {
            return Ok(());
        }
        std::fs::create_dir_all(self.layout.attempts_dir(&self.root))?;
        let Some((from_epoch, from)) = source else {
            return std::fs::create_dir_all(&self.checkpoint);
        };
        let partial = self.layout.partial_dir(&self.root, epoch);
        if partial.exists() {
            std::fs::remove_dir_all(&partial)?;
        }
        if let Err(e) = copy_tree(&from, &partial) {
            // Something the job saved is not the agent's to read (a job running as another
            // user with a private umask): rather than start from nothing, this attempt
            // carries on in that directory, unfenced, as all attempts did before.
            tracing::warn!(
                from = %from.display(), lease.epoch = epoch, error = %e,
                "checkpoint of the earlier attempt not copied; this attempt writes into it"
            );
            let _ = std::fs::remove_dir_all(&partial);
            self.checkpoint = from;
            return Ok(());
        }
        std::fs::rename(&partial, &self.checkpoint)?;
        tracing::info!(
            from = %from.display(), to = %self.checkpoint.display(), lease.epoch = epoch,
            resumed_from_epoch = from_epoch, "checkpoint of the earlier attempt copied"
        );
        // Older attempts than the one copied are superseded twice over.
        for (old, dir) in self.earlier(from_epoch)? {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!(dir = %dir.display(), lease.epoch = old, error = %e, "old checkpoint not removed");
            }
        }
        Ok(())
    }

    /// Checkpoint directories of attempts below `epoch`, highest first; the legacy one, if
    /// any, counts as epoch 0.
    fn earlier(&self, epoch: u64) -> std::io::Result<Vec<(u64, PathBuf)>> {
        let mut found: Vec<(u64, PathBuf)> =
            match std::fs::read_dir(self.layout.attempts_dir(&self.root)) {
                Ok(entries) => entries
                    .flatten()
                    .filter_map(|e| {
                        let n = CheckpointLayout::dir_epoch(e.file_name().to_str()?)?;
                        (n < epoch && e.file_type().ok()?.is_dir()).then(|| (n, e.path()))
                    })
                    .collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(e),
            };
        let legacy = self.layout.legacy_dir(&self.root);
        if epoch > 0 && legacy.is_dir() {
            found.push((0, legacy));
        }
        found.sort_unstable_by_key(|(epoch, _)| std::cmp::Reverse(*epoch));
        Ok(found)
    }

    /// The newest earlier attempt's checkpoint directory that holds anything.
    fn newest_earlier(&self, epoch: u64) -> std::io::Result<Option<(u64, PathBuf)>> {
        Ok(self
            .earlier(epoch)?
            .into_iter()
            .find(|(_, dir)| std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some())))
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

    /// Whether there is anything to resume from: the checkpoint directory, once seeded,
    /// holds what an earlier attempt saved (on this host, or on any with shared storage).
    pub fn has_checkpoint(&self) -> bool {
        std::fs::read_dir(&self.checkpoint).is_ok_and(|mut d| d.next().is_some())
    }
}

/// Opens what was restored into `dir` to the job directories' group, as [`copy_tree`]
/// does: directories [`JOB_DIR_MODE`], files readable and writable by the group, so that a
/// job running as another user can still update what it resumes from.
pub fn open_to_group(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(JOB_DIR_MODE))?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            open_to_group(&entry.path())?;
        } else if kind.is_file() {
            let mode = entry.metadata()?.permissions().mode() | 0o060;
            std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(mode))?;
        }
    }
    Ok(())
}

/// Copies the directory `from` to `to` (which must not exist): files, directories and
/// symbolic links, with their modification times; pipes and sockets are left out.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type()?;
        // The copy is the agent's: the group (which the job's container is given) may write
        // it, so that a job running as another user can still update what it saved.
        let group_rw = if kind.is_dir() {
            copy_tree(&src, &dst)?;
            0o2070
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)?;
            continue;
        } else if kind.is_file() {
            std::fs::copy(&src, &dst)?;
            0o060
        } else {
            // A pipe or a socket holds nothing to resume from (and reading a pipe would
            // block the agent).
            continue;
        };
        let meta = entry.metadata()?;
        std::fs::set_permissions(
            &dst,
            std::fs::Permissions::from_mode(meta.permissions().mode() | group_rw),
        )?;
        std::fs::File::open(&dst)?.set_modified(meta.modified()?)?;
    }
    Ok(())
}

/// The node rank of a gang member's lease; `None` for a single-node job.
pub use nightshift_planner::gang_rank;

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
    // Resuming only when there is a checkpoint to resume from: a later attempt placed on a
    // host that does not hold the job's checkpoint (local storage) starts from nothing, and
    // says so.
    let resuming = dirs.has_checkpoint();
    // The GPU variables are the agent's alone, whatever the job says: the coordinator refuses
    // a job that sets one, but a job saved before that rule (or sent by an older coordinator)
    // may still carry one, and next to a device request it could reach every GPU of the host.
    let (gpu_vars, own): (Vec<_>, Vec<_>) = job
        .env
        .iter()
        .partition(|e| nightshift_common::is_gpu_variable(&e.name));
    if !gpu_vars.is_empty() {
        let names: Vec<&str> = gpu_vars.iter().map(|e| e.name.as_str()).collect();
        tracing::warn!(
            job.id = lease.job_id,
            variables = %names.join(","),
            "the job sets GPU variables; they are left out: the agent alone selects its GPUs"
        );
    }
    let mut env_vars: Vec<(String, String)> = own
        .into_iter()
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
        (env::EPOCH.to_owned(), lease.epoch.to_string()),
        (env::GPUS.to_owned(), gpu_list),
    ]);
    if let Some(from) = dirs.resumed_from {
        env_vars.push((env::RESUMED_FROM_EPOCH.to_owned(), from.to_string()));
    }
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
    let labels = nightshift_planner::job_labels(node, lease);
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
    use nightshift_common::labels;
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
        // A second attempt with nothing to resume from (it ran on another host) is told so.
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "0");
        assert!(!env.contains_key("NIGHTSHIFT_RESUMED_FROM_EPOCH"));
        assert_eq!(env["NIGHTSHIFT_CHECKPOINT_DIR"], "/nightshift/checkpoint");
        assert_eq!(env["NIGHTSHIFT_GPUS"], "1,2");
        assert_eq!(spec.labels["io.nightshift.epoch"], "4");
        assert_eq!(spec.labels[GRACE_LABEL], "7");
        assert!(
            !spec.labels.contains_key(labels::RANK),
            "no rank: not a gang"
        );
        assert_eq!(spec.stop_signal.as_deref(), Some("SIGUSR1"));
        assert_eq!(spec.name, "nightshift-job-n1-3-9");
        assert!(spec.binds[0].0.ends_with("jobs/3/checkpoint"));
    }

    #[test]
    fn a_jobs_own_gpu_variables_are_never_passed_on() {
        // A job saved before the coordinator refused them: in both GPU modes the container
        // gets the agent's selection only.
        let mut lease = lease();
        lease.job.env = [
            ("NVIDIA_VISIBLE_DEVICES", "all"),
            ("LR", "0.1"),
            ("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"),
            ("NVIDIA_DRIVER_CAPABILITIES", "all"),
            ("NVIDIA_REQUIRE_CUDA", "cuda>=99"),
            ("ROCR_VISIBLE_DEVICES", "0"),
        ]
        .map(|(name, value)| EnvVar {
            name: name.into(),
            value: value.into(),
        })
        .to_vec();
        let dir = tempfile::tempdir().unwrap();
        let dirs = JobDirs::new(dir.path(), 3);
        for gpus in [
            GpuAccess::DeviceRequest {
                device_ids: vec!["GPU-b".into(), "GPU-c".into()],
            },
            GpuAccess::VisibleDevicesEnv {
                indices: vec![1, 2],
            },
        ] {
            let spec = container_spec("n1", &lease, &dirs, gpus.clone(), "0.0.0.0");
            let names: Vec<&str> = spec.env.iter().map(|(k, _)| k.as_str()).collect();
            assert!(
                !names.iter().any(|n| nightshift_common::is_gpu_variable(n)),
                "{gpus:?}: {names:?}"
            );
            assert!(names.contains(&"LR"), "{names:?}");
            assert_eq!(spec.gpus, gpus);
        }
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
            wait_for_peers: false,
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
        assert_eq!(spec.labels[labels::RANK], "0");
        l.rendezvous.as_mut().unwrap().node_rank = 1;
        let spec = container_spec("n2", &l, &dirs, GpuAccess::None, "127.0.0.1");
        assert!(spec.publish.is_none());
        // Its rank, for where its checkpoint goes once it stops (object storage).
        assert_eq!(spec.labels[labels::RANK], "1");
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
    fn each_attempt_writes_its_own_checkpoint_seeded_from_the_newest_earlier_one() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = |d: &JobDirs, name: &str| std::fs::read_to_string(d.checkpoint.join(name));
        let mut first = JobDirs::attempt(dir.path(), dir.path(), 3, 5);
        first.seed().unwrap();
        first.create().unwrap();
        assert_eq!(first.resumed_from, None);
        assert!(!first.has_checkpoint());
        std::fs::write(first.checkpoint.join("step-100"), "100").unwrap();
        std::fs::create_dir(first.checkpoint.join("shards")).unwrap();
        std::fs::write(first.checkpoint.join("shards/0"), "a").unwrap();
        let saved_at = first.last_checkpoint().unwrap();
        // A pipe is left out (reading it would block the agent).
        let mkfifo = std::process::Command::new("mkfifo")
            .arg(first.checkpoint.join("pipe"))
            .status()
            .unwrap();
        assert!(mkfifo.success());

        let mut l = lease();
        l.epoch = 9;
        let mut second = JobDirs::attempt(dir.path(), dir.path(), 3, 9);
        second.seed().unwrap();
        second.create().unwrap();
        assert_ne!(first.checkpoint, second.checkpoint);
        assert_eq!(second.resumed_from, Some(5));
        assert_eq!(ckpt(&second, "step-100").unwrap(), "100");
        assert_eq!(ckpt(&second, "shards/0").unwrap(), "a");
        assert!(!second.checkpoint.join("pipe").exists());
        assert_eq!(second.last_checkpoint(), Some(saved_at), "times are kept");
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode();
            assert_eq!(mode(&second.checkpoint.join("step-100")) & 0o060, 0o060);
            assert_eq!(mode(&second.checkpoint.join("shards")) & 0o2070, 0o2070);
        }
        let spec = container_spec("n1", &l, &second, GpuAccess::None, "0.0.0.0");
        let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
        assert_eq!(env["NIGHTSHIFT_EPOCH"], "9");
        assert_eq!(env["NIGHTSHIFT_RESUMED_FROM_EPOCH"], "5");
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "1");
        assert_eq!(env["NIGHTSHIFT_CHECKPOINT_DIR"], "/nightshift/checkpoint");
        assert_eq!(
            spec.binds[0],
            (
                second.checkpoint.display().to_string(),
                "/nightshift/checkpoint".to_owned()
            )
        );

        // The first attempt runs on (its node lost the coordinator) and writes: the second's
        // checkpoint is untouched, and a third attempt resumes from the second's, not from
        // the stale attempt's newer files.
        std::fs::write(first.checkpoint.join("step-100"), "overwritten").unwrap();
        std::fs::write(first.checkpoint.join("step-999"), "999").unwrap();
        assert_eq!(ckpt(&second, "step-100").unwrap(), "100");
        assert!(ckpt(&second, "step-999").is_err());
        std::fs::write(second.checkpoint.join("step-200"), "200").unwrap();
        let mut third = JobDirs::attempt(dir.path(), dir.path(), 3, 12);
        third.seed().unwrap();
        assert_eq!(third.resumed_from, Some(9));
        assert_eq!(ckpt(&third, "step-200").unwrap(), "200");
        assert!(ckpt(&third, "step-999").is_err());
        assert!(
            !first.checkpoint.exists(),
            "attempts older than the copied one go"
        );
        assert!(second.checkpoint.exists());
    }

    #[test]
    fn a_first_attempt_with_its_directory_from_before_attempts_had_their_own_resumes_it() {
        let dir = tempfile::tempdir().unwrap();
        let old = JobDirs::new(dir.path(), 3);
        std::fs::create_dir_all(&old.checkpoint).unwrap();
        std::fs::write(old.checkpoint.join("step-7"), "7").unwrap();
        // A half copy left by an agent that died while seeding is replaced.
        std::fs::create_dir_all(dir.path().join("jobs/3/checkpoints/4.partial/junk")).unwrap();
        let mut next = JobDirs::attempt(dir.path(), dir.path(), 3, 4);
        next.seed().unwrap();
        assert_eq!(next.resumed_from, Some(0));
        assert_eq!(
            std::fs::read_dir(&next.checkpoint)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect::<Vec<_>>(),
            vec!["step-7"]
        );
        assert!(!dir.path().join("jobs/3/checkpoints/4.partial").exists());
    }

    /// Gang member `rank` of job 3 (of 2) under the lease of epoch `epoch`.
    fn member(rank: u32, epoch: u64) -> LeaseGrant {
        let mut l = lease();
        l.epoch = epoch;
        l.rendezvous = Some(nightshift_common::Rendezvous {
            master_addr: "10.0.0.1".into(),
            master_port: 29503,
            nnodes: 2,
            node_rank: rank,
            nproc_per_node: 1,
            wait_for_peers: false,
        });
        l
    }

    #[test]
    fn a_gang_member_resumes_from_its_own_ranks_newest_checkpoint_on_any_host() {
        // Shared storage: two hosts' work directories, one checkpoint root.
        let (a, b, shared) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let root = shared.path();
        // Attempt 1: rank 0 on A (epoch 5), rank 1 on B (epoch 6); each saves its own shard.
        let seeded = |work: &Path, rank: u32, epoch: u64| {
            let mut dirs = JobDirs::for_lease(work, root, &member(rank, epoch));
            dirs.seed().unwrap();
            dirs.create().unwrap();
            dirs
        };
        let (r0, r1) = (seeded(a.path(), 0, 5), seeded(b.path(), 1, 6));
        assert_ne!(r0.checkpoint, r1.checkpoint);
        std::fs::write(r0.checkpoint.join("shard"), "rank 0").unwrap();
        std::fs::write(r1.checkpoint.join("shard"), "rank 1").unwrap();
        // Attempt 2, placed the other way round: rank 1 on A (epoch 9) first, then rank 0
        // on B (epoch 10), whose newest earlier directory of any rank is rank 1's new one.
        let (n1, n0) = (seeded(a.path(), 1, 9), seeded(b.path(), 0, 10));
        let shard = |d: &JobDirs| std::fs::read_to_string(d.checkpoint.join("shard")).unwrap();
        assert_eq!((shard(&n0), n0.resumed_from), ("rank 0".into(), Some(5)));
        assert_eq!((shard(&n1), n1.resumed_from), ("rank 1".into(), Some(6)));
        let env = |d: &JobDirs, l: &LeaseGrant| -> BTreeMap<String, String> {
            container_spec("n1", l, d, GpuAccess::None, "0.0.0.0")
                .env
                .into_iter()
                .collect()
        };
        let e0 = env(&n0, &member(0, 10));
        assert_eq!(
            (
                e0["NIGHTSHIFT_RESUMING"].as_str(),
                e0["NIGHTSHIFT_RESUMED_FROM_EPOCH"].as_str()
            ),
            ("1", "5")
        );
        // The ranks' directories stay apart: seeding one never touched the other's.
        assert_eq!((shard(&r0), shard(&r1)), ("rank 0".into(), "rank 1".into()));
    }

    /// The environment of the attempt of epoch `epoch` of job 3 on a host whose `work_dir` is
    /// `work_dir`, with checkpoints under `root`, once its directories are seeded.
    fn started(work_dir: &Path, root: &Path, epoch: u64) -> (JobDirs, BTreeMap<String, String>) {
        let mut dirs = JobDirs::attempt(work_dir, root, 3, epoch);
        dirs.seed().unwrap();
        dirs.create().unwrap();
        let mut l = lease();
        l.epoch = epoch;
        l.attempt = 1 + u32::from(epoch > 1);
        let spec = container_spec("n1", &l, &dirs, GpuAccess::None, "0.0.0.0");
        (dirs, spec.env.into_iter().collect())
    }

    #[test]
    fn resuming_is_said_only_when_a_checkpoint_is_there() {
        let (host_a, host_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b) = (host_a.path(), host_b.path());
        let (first, env) = started(a, a, 1);
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "0");
        std::fs::write(first.checkpoint.join("step-40"), "40").unwrap();
        // Local storage: the next attempt on another host finds nothing, and starts afresh.
        let (_, env) = started(b, b, 2);
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "0");
        assert!(!env.contains_key("NIGHTSHIFT_RESUMED_FROM_EPOCH"));
        // On the host that holds it, it resumes.
        let (again, env) = started(a, a, 3);
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "1");
        assert_eq!(env["NIGHTSHIFT_RESUMED_FROM_EPOCH"], "1");
        assert!(again.checkpoint.join("step-40").exists());
        // An earlier attempt that left an empty directory is nothing to resume from either.
        let (_, env) = started(b, b, 4);
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "0");
    }

    #[test]
    fn with_shared_storage_any_host_resumes_from_the_newest_attempt() {
        let (host_a, host_b, shared) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let (a, b, root) = (host_a.path(), host_b.path(), shared.path());
        let (on_a, env) = started(a, root, 5);
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "0");
        assert!(on_a.checkpoint.starts_with(root.join("jobs/3/checkpoints")));
        assert!(on_a.outputs.starts_with(a), "outputs stay on the host");
        std::fs::write(on_a.checkpoint.join("step-100"), "100").unwrap();

        let (on_b, env) = started(b, root, 9);
        assert_eq!(env["NIGHTSHIFT_RESUMING"], "1");
        assert_eq!(env["NIGHTSHIFT_RESUMED_FROM_EPOCH"], "5");
        assert_eq!(
            std::fs::read_to_string(on_b.checkpoint.join("step-100")).unwrap(),
            "100"
        );
        assert!(on_b.outputs.starts_with(b));
        assert!(
            !a.join("jobs/3/checkpoints").exists(),
            "nothing under work_dir"
        );

        // The attempt on A runs on, cut off from the coordinator: it writes its own, older
        // directory only, and the next attempt (back on A) resumes from B's.
        std::fs::write(on_a.checkpoint.join("step-100"), "stale").unwrap();
        std::fs::write(on_b.checkpoint.join("step-200"), "200").unwrap();
        let (back_on_a, env) = started(a, root, 12);
        assert_eq!(env["NIGHTSHIFT_RESUMED_FROM_EPOCH"], "9");
        assert_eq!(
            std::fs::read_to_string(back_on_a.checkpoint.join("step-100")).unwrap(),
            "100"
        );
        assert!(back_on_a.checkpoint.join("step-200").exists());
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
