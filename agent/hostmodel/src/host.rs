//! The host itself: its container engine, GPUs, vLLM replica and job containers, each change
//! timed on the virtual clock. It does what the agent's ports would make a real host do
//! (`Engine`, `Gpus`, `ServingMetrics` in `agent/src`): the agent's unit tests see it through
//! those ports (`agent/src/fake`), the model [`crate::Agent`] through the planner's
//! [`Observation`].
//!
//! A container is the replica (its role label says so), whose vLLM loads, serves, sleeps,
//! wakes and stops on [`Timings`]; or any other container, a job's when its labels name its
//! lease, which runs until its work ends, takes its checkpoint signal or ignores it until the
//! kill, as the [`Workload`] says. A GPU's memory is held by the containers on it, and
//! shows free [`Timings::frees_after`] after one ends.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use nightshift_common::{CheckpointStorage, GpuInfo, LeaseGrant, UnixMillis, labels};
use nightshift_planner::{Container, ContainerState, Moment, Observation};

use crate::images::{Image, Images, Pull};
use crate::vllm::{Load, Vllm};

/// How long the host's transitions take, and what they hold of each GPU's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Timings {
    /// From the replica's container start to `/health` answering 200 (the model's load).
    pub replica_start: Duration,
    /// From the replica's SIGTERM to its exit (vLLM's shutdown).
    pub replica_stop: Duration,
    /// vLLM's `/sleep` call, once its requests are done, until it answers with the memory
    /// released.
    pub sleep: Duration,
    /// vLLM's `/wake_up` call, until it answers.
    pub wake: Duration,
    /// Memory the replica holds on each GPU while its container runs awake.
    pub replica_memory: u64,
    /// Memory it keeps on each GPU asleep (its CUDA context).
    pub asleep_memory: u64,
    /// Memory a job container holds on each of its GPUs, unless its workload says otherwise.
    pub job_memory: u64,
    /// How long the driver still shows a GPU's memory held after its container ended.
    pub frees_after: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            replica_start: Duration::from_secs(225),
            replica_stop: Duration::from_secs(10),
            sleep: Duration::from_secs(6),
            wake: Duration::from_secs(6),
            replica_memory: 70 << 30,
            asleep_memory: 1 << 29,
            job_memory: 60 << 30,
            frees_after: Duration::ZERO,
        }
    }
}

/// A container as its workload knows it: the job it runs (0 for none) and its image (the
/// tag a pinned reference was pulled for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc<'a> {
    pub job: u64,
    pub image: &'a str,
}

/// What the containers do, which the host does not know by itself: when one would finish
/// its work, how long its checkpoint takes once signalled, and who keeps the books when a
/// job's container exits.
pub trait Workload {
    /// When the container started at `started` ends its work on its own; `None`: not
    /// before it is stopped.
    fn ends_at(&self, p: Proc<'_>, started: Moment) -> Option<Moment>;
    /// How long it takes, once signalled, to save its checkpoint and exit;
    /// [`Duration::MAX`]: it ignores the signal and runs on until the kill.
    fn save(&self, p: Proc<'_>) -> Duration;
    /// A job's container exited.
    fn exited(&mut self, exit: &Exit);
    /// The code it exits with when its work ends on its own.
    fn exit_code(&self, _p: Proc<'_>) -> i64 {
        0
    }
    /// The code it exits with after its signal.
    fn signal_code(&self, _p: Proc<'_>) -> i64 {
        143
    }
    /// Memory it holds on each of its GPUs; `None`: [`Timings::job_memory`].
    fn memory(&self, _p: Proc<'_>) -> Option<u64> {
        None
    }
    /// When the job last wrote a checkpoint (the newest file the agent finds in its
    /// checkpoint directory); `None`: not known.
    fn last_checkpoint_at(&self, _job: u64) -> Option<UnixMillis> {
        None
    }
}

/// A job container's exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exit {
    pub job: u64,
    pub lease: u64,
    pub epoch: u64,
    pub gpus: Vec<u32>,
    pub started: Moment,
    /// When the agent sent its checkpoint signal, if it did.
    pub signalled: Option<Moment>,
    pub at: Moment,
    pub exit_code: i64,
    /// Its work ended on its own (signalled or not), rather than on the signal or the kill.
    pub finished: bool,
}

/// What the engine is asked to run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Launch {
    pub name: String,
    pub image: String,
    pub labels: BTreeMap<String, String>,
    /// The host GPUs it is given.
    pub gpus: Vec<u32>,
    /// Files it starts with (absolute path, content).
    pub files: Vec<(String, Vec<u8>)>,
    /// The host port its server is published on; `Some(0)`: one the engine picks.
    pub publish: Option<u16>,
}

/// Why the engine did not run a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunError {
    /// The engine does not answer.
    EngineDown,
    /// The image is not on the host.
    Missing,
    /// The engine refused it, saying why.
    Refused(String),
}

/// The container engine did not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineDown;

/// What every container has.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ctr {
    pub(crate) container: Container,
    pub(crate) gpus: Vec<u32>,
    started: Moment,
    pub(crate) ended: Option<Moment>,
    files: BTreeMap<String, Vec<u8>>,
    stdout: String,
}

impl Ctr {
    /// Still shows its memory held at `now` (it ended less than `frees_after` ago).
    pub(crate) fn lingers(&self, now: Moment, frees_after: Duration) -> bool {
        self.ended.is_some_and(|e| now < e + frees_after)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Replica {
    pub(crate) ctr: Ctr,
    pub(crate) vllm: Vllm,
}

/// A container's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Running,
    /// Signalled at `at`: it exits at `exits_at` with `code` (after saving its checkpoint,
    /// or killed when its grace ran out first), unless its work ends before.
    Signalled {
        at: Moment,
        exits_at: Moment,
        code: i64,
    },
    Exited,
}

/// Any container but the replica: a job's when its labels name its lease.
#[derive(Debug, Clone, PartialEq)]
struct Job {
    ctr: Ctr,
    /// The job it runs; 0 for none.
    job: u64,
    /// Its lease and epoch, when it is a job's.
    lease: Option<(u64, u64)>,
    /// The tag its image was pulled for.
    tag: String,
    /// What it holds on each of its GPUs while it runs.
    memory: u64,
    /// When its work is done, as the workload last said.
    ends_at: Option<Moment>,
    run: Run,
}

impl Job {
    fn live(&self) -> bool {
        self.run != Run::Exited
    }

    fn proc(&self) -> Proc<'_> {
        Proc {
            job: self.job,
            image: &self.tag,
        }
    }
}

/// One GPU host in virtual time.
#[derive(Debug, Clone, PartialEq)]
pub struct Host {
    pub name: String,
    gpus: u32,
    pub timings: Timings,
    pub(crate) replica: Option<Replica>,
    jobs: Vec<Job>,
    /// Containers created so far.
    created: u64,
    /// The latest moment the host was moved to.
    pub(crate) clock: Moment,
    /// The traffic the caller sends the replica.
    pub(crate) load: Load,
    /// The container engine does not answer until then (it is restarting).
    engine_down_until: Option<Moment>,
    /// The container engine is stopped until started again.
    engine_stopped: bool,
    /// The checkpoint volume reads full until then.
    disk_full_until: Option<Moment>,
    /// vLLM's `/sleep` answers an error until then.
    pub(crate) sleep_fails_until: Option<Moment>,
    /// vLLM's `/wake_up` answers an error.
    pub wake_fails: bool,
    /// vLLM answers `/is_sleeping` (its dev mode).
    pub vllm_dev_mode: bool,
    /// The highest lease epoch a job container was started with, per GPU: the host's own
    /// record, against which every start is checked (ARCHITECTURE.md, invariant 3).
    started_epochs: BTreeMap<u32, u64>,
    /// Starts under an epoch older than one already started on the GPU.
    stale_starts: Vec<String>,
    job_starts: u64,
    pub images: Images,
    /// Memory removed containers still show held: GPUs, bytes, until when.
    ghosts: Vec<(Vec<u32>, u64, Moment)>,
    /// GPUs NVML reports unhealthy, and why.
    pub unhealthy: BTreeMap<u32, String>,
    /// Where the host keeps checkpoints (its facts report storage other than its own disk).
    pub storage: CheckpointStorage,
    /// Something outside the agent changed what it observes (the engine restarted, the disk
    /// filled, an image went missing): the agent, which looks every second, sees it at its
    /// next look.
    touched: bool,
}

/// A workload of no jobs: its containers run until stopped and exit at once (a host that
/// runs no job yet, the replica's start).
pub struct Idle;

impl Workload for Idle {
    fn ends_at(&self, _p: Proc<'_>, _started: Moment) -> Option<Moment> {
        None
    }

    fn save(&self, _p: Proc<'_>) -> Duration {
        Duration::ZERO
    }

    fn exited(&mut self, _exit: &Exit) {}
}

impl Host {
    /// A host with nothing running.
    pub fn new(name: &str, gpus: u32, timings: Timings) -> Self {
        Self {
            name: name.to_owned(),
            gpus,
            timings,
            replica: None,
            jobs: Vec::new(),
            created: 0,
            clock: Moment::ZERO,
            load: Load::Until(Moment::ZERO),
            engine_down_until: None,
            engine_stopped: false,
            disk_full_until: None,
            sleep_fails_until: None,
            wake_fails: false,
            vllm_dev_mode: true,
            started_epochs: BTreeMap::new(),
            stale_starts: Vec::new(),
            job_starts: 0,
            images: Images::default(),
            ghosts: Vec::new(),
            unhealthy: BTreeMap::new(),
            storage: CheckpointStorage::Local,
            touched: false,
        }
    }

    /// A host whose replica serves already (started long before `now`): the fleet at the
    /// start of a simulation.
    pub fn serving(name: &str, gpus: u32, timings: Timings) -> Self {
        let mut host = Self::new(name, gpus, timings);
        let launch = host.replica_launch();
        let id = host.new_id(&launch);
        host.replica = Some(Replica {
            ctr: host.ctr(id, launch, Moment::ZERO),
            vllm: Vllm::Up,
        });
        host
    }

    /// The host's GPUs by index.
    pub fn gpu_indices(&self) -> Vec<u32> {
        (0..self.gpus).collect()
    }

    /// The host's GPUs as NVML lists them when the agent registers (80 GiB each).
    pub fn inventory(&self) -> Vec<GpuInfo> {
        (0..self.gpus)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{}-{i}", self.name),
                name: "sim-h100".into(),
                memory_total_bytes: 80 << 30,
            })
            .collect()
    }

    /// Job containers started on the host so far: a caller that checks something of every
    /// start need look again only when this moved.
    pub fn job_starts(&self) -> u64 {
        self.job_starts
    }

    fn new_id(&mut self, launch: &Launch) -> String {
        self.created += 1;
        let what = if is_replica(&launch.labels) {
            "replica"
        } else {
            "job"
        };
        format!("{}-{what}-{}", self.name, self.created)
    }

    fn ctr(&self, id: String, launch: Launch, now: Moment) -> Ctr {
        let published_port = launch.publish.map(|p| match p {
            0 => 30_000 + (self.created % 30_000) as u16,
            p => p,
        });
        Ctr {
            container: Container {
                name: if launch.name.is_empty() {
                    id.clone()
                } else {
                    launch.name
                },
                image_id: self.images.id(&launch.image),
                image: launch.image,
                id,
                labels: launch.labels,
                state: ContainerState::Running,
                published_port,
            },
            gpus: launch.gpus,
            started: now,
            ended: None,
            files: launch.files.into_iter().collect(),
            stdout: String::new(),
        }
    }

    /// What the agent runs as the replica: every GPU, labelled as the agent labels it.
    fn replica_launch(&self) -> Launch {
        Launch {
            name: String::new(),
            image: "vllm".into(),
            labels: BTreeMap::from([
                (labels::MANAGED_BY.to_owned(), self.name.clone()),
                (labels::ROLE.to_owned(), labels::ROLE_REPLICA.to_owned()),
            ]),
            gpus: self.gpu_indices(),
            ..Launch::default()
        }
    }

    /// The earliest moment after which one of the host's own timers has turned (a container
    /// exits, the replica turns healthy, falls asleep or wakes): before it, nothing the agent
    /// observes changes by itself. `None`: no timer is set.
    pub fn next_event(&self) -> Option<Moment> {
        let replica = self.replica.as_ref().and_then(|r| match r.vllm {
            Vllm::Loading { healthy_at } => Some(healthy_at),
            Vllm::FallingAsleep { at } | Vllm::Waking { at } => Some(at),
            Vllm::Stopping { exits_at, .. } => Some(exits_at),
            Vllm::Up | Vllm::Asleep | Vllm::Exited { .. } => None,
        });
        let jobs = self.jobs.iter().filter_map(|j| match j.run {
            Run::Running => j.ends_at,
            Run::Signalled { exits_at, .. } => {
                Some(j.ends_at.map_or(exits_at, |e| e.min(exits_at)))
            }
            Run::Exited => None,
        });
        let recoveries = [self.engine_down_until, self.disk_full_until];
        let ghosts = self.ghosts.iter().map(|(_, _, until)| *until);
        replica
            .into_iter()
            .chain(jobs)
            .chain(recoveries.into_iter().flatten())
            .chain(self.images.next_event())
            .chain(ghosts)
            .min()
    }

    /// Turns every timer due by `now`; true when anything changed. Job exits are told to
    /// the workload, in the order they happened.
    pub fn advance(&mut self, now: Moment, workload: &mut dyn Workload) -> bool {
        self.clock = self.clock.max(now);
        let mut changed = std::mem::take(&mut self.touched);
        for until in [&mut self.engine_down_until, &mut self.disk_full_until] {
            if until.is_some_and(|t| t <= now) {
                *until = None;
                changed = true;
            }
        }
        if let Some(r) = &mut self.replica {
            let next = match r.vllm {
                Vllm::Loading { healthy_at: t } | Vllm::Waking { at: t } if t <= now => {
                    Some(Vllm::Up)
                }
                Vllm::FallingAsleep { at } if at <= now => Some(Vllm::Asleep),
                Vllm::Stopping { exits_at, asleep } if exits_at <= now => {
                    r.ctr.ended = Some(exits_at);
                    r.ctr.container.state = ContainerState::Exited { exit_code: 0 };
                    Some(Vllm::Exited { asleep })
                }
                _ => None,
            };
            if let Some(v) = next {
                r.vllm = v;
                changed = true;
            }
        }
        changed |= self.images.advance(now);
        if !self.ghosts.is_empty() {
            let before = self.ghosts.len();
            self.ghosts.retain(|(_, _, until)| now < *until);
            changed |= self.ghosts.len() != before;
        }
        let mut exits = Vec::new();
        for j in &mut self.jobs {
            let natural = j.ends_at.filter(|t| *t <= now);
            let exit = match j.run {
                Run::Running => natural.map(|t| (t, None, workload.exit_code(j.proc()), true)),
                Run::Signalled { at, exits_at, code } => match natural {
                    Some(t) if t < exits_at => {
                        Some((t, Some(at), workload.exit_code(j.proc()), true))
                    }
                    _ => (exits_at <= now).then_some((exits_at, Some(at), code, false)),
                },
                Run::Exited => None,
            };
            let Some((at, signalled, code, finished)) = exit else {
                continue;
            };
            j.run = Run::Exited;
            j.ctr.ended = Some(at);
            j.ctr.container.state = ContainerState::Exited { exit_code: code };
            changed = true;
            if let Some((lease, epoch)) = j.lease {
                exits.push(Exit {
                    job: j.job,
                    lease,
                    epoch,
                    gpus: j.ctr.gpus.clone(),
                    started: j.ctr.started,
                    signalled,
                    at,
                    exit_code: code,
                    finished,
                });
            }
        }
        exits.sort_by_key(|e| (e.at, e.lease));
        for e in &exits {
            workload.exited(e);
        }
        changed
    }

    /// Asks the workload again when each running container ends (another run of the job
    /// elsewhere may have saved progress since).
    pub fn refresh(&mut self, workload: &dyn Workload) {
        for j in self.jobs.iter_mut().filter(|j| j.run == Run::Running) {
            j.ends_at = workload.ends_at(j.proc(), j.ctr.started);
        }
    }

    /// Whether the container engine answers.
    pub fn engine_answers(&self) -> bool {
        self.engine_down_until.is_none() && !self.engine_stopped
    }

    /// Every container, as the engine lists it: the replica first.
    pub fn containers(&self) -> Vec<Container> {
        let replica = self.replica.as_ref().map(|r| r.ctr.container.clone());
        replica
            .into_iter()
            .chain(self.jobs.iter().map(|j| j.ctr.container.clone()))
            .collect()
    }

    /// The container `id`, as the engine inspects it.
    pub fn inspect(&self, id: &str) -> Option<Container> {
        self.ctr_of(id).map(|c| c.container.clone())
    }

    fn ctr_of(&self, id: &str) -> Option<&Ctr> {
        self.replica
            .iter()
            .map(|r| &r.ctr)
            .chain(self.jobs.iter().map(|j| &j.ctr))
            .find(|c| c.container.id == id)
    }

    fn ctr_mut(&mut self, id: &str) -> Option<&mut Ctr> {
        self.replica
            .iter_mut()
            .map(|r| &mut r.ctr)
            .chain(self.jobs.iter_mut().map(|j| &mut j.ctr))
            .find(|c| c.container.id == id)
    }

    /// What the agent's ports read from the host at `now`; the replica's vLLM is asked only
    /// when `ask` (as the executor's `observe`).
    pub fn observe(&self, now: Moment, ask: bool) -> Result<Observation, EngineDown> {
        if !self.engine_answers() {
            return Err(EngineDown);
        }
        let replica = self
            .replica
            .as_ref()
            .filter(|r| !matches!(r.vllm, Vllm::Exited { .. }))
            .map(|r| self.probe(r, now, ask));
        Ok(Observation {
            containers: self.containers(),
            gpus: self.gpu_indices(),
            gpu_memory: Some(self.gpu_memory()),
            replica,
            checkpoint_free_bytes: Some(if self.disk_full_until.is_some() {
                0
            } else {
                u64::MAX
            }),
            missing_images: self.images.missing().clone(),
            unrestored: BTreeSet::new(),
        })
    }

    /// From `now`, the host lacks `image` and pulling it does what `pull` says; a pull of it
    /// under way ends as `pull` says, counted from `now`.
    pub fn lack(&mut self, image: &str, pull: Pull, now: Moment) {
        self.images.lack(image, pull);
        self.images.restart(image, now);
        self.touched = true;
    }

    /// The image `image` is gone from the host (`docker rmi`).
    pub fn lose_image(&mut self, image: &str) {
        self.images.lose(image);
        self.touched = true;
    }

    /// The engine starts pulling `image`, unless that is under way.
    pub fn start_pull(&mut self, image: &str, now: Moment) {
        self.images.start(image, None, now);
    }

    /// The engine's pull of `image` as `user` with `password`: returns when it returns
    /// (`None`: not while the model runs); [`Host::take_pull`] says what it ended in.
    pub fn pull(&mut self, image: &str, auth: Option<(&str, &str)>, now: Moment) -> Option<Moment> {
        self.images.start(image, auth, now)
    }

    /// What the pull of `image` ended in, once it returned.
    pub fn take_pull(&mut self, image: &str) -> Option<Result<Image, String>> {
        self.images.take_one(image)
    }

    /// The pulls that returned since the last call: each image, with the registry's
    /// refusal when it refused.
    pub fn take_pulled(&mut self) -> Vec<(String, Option<String>)> {
        self.images
            .take_returned()
            .into_iter()
            .map(|(image, r)| {
                let refused = r.err().map(|why| format!("pulling {image} failed: {why}"));
                (image, refused)
            })
            .collect()
    }

    /// Whether a container (running or not) uses the image `id`.
    pub fn image_in_use(&self, id: &str) -> bool {
        self.replica
            .iter()
            .map(|r| &r.ctr)
            .chain(self.jobs.iter().map(|j| &j.ctr))
            .any(|c| c.container.image_id.as_deref() == Some(id))
    }

    /// Removes the image `id` unless a container uses it; true when it did.
    pub fn remove_image(&mut self, id: &str) -> bool {
        if self.image_in_use(id) {
            return false;
        }
        self.images.remove(id);
        true
    }

    /// Memory in use on each GPU.
    pub fn gpu_memory(&self) -> BTreeMap<u32, u64> {
        (0..self.gpus).map(|g| (g, self.gpu_used(g))).collect()
    }

    /// Memory in use on GPU `g`, as the driver shows it now (the latest moment the host
    /// was moved to).
    pub fn gpu_used(&self, g: u32) -> u64 {
        let (t, now) = (&self.timings, self.clock);
        let replica = self
            .replica
            .as_ref()
            .filter(|r| r.ctr.gpus.contains(&g))
            .map_or(0, |r| self.replica_holds(r, now));
        let jobs: u64 = self
            .jobs
            .iter()
            .filter(|j| j.ctr.gpus.contains(&g))
            .filter(|j| j.live() || j.ctr.lingers(now, t.frees_after))
            .map(|j| j.memory)
            .sum();
        let ghosts: u64 = self
            .ghosts
            .iter()
            .filter(|(gpus, _, until)| gpus.contains(&g) && now < *until)
            .map(|(_, bytes, _)| bytes)
            .sum();
        replica + jobs + ghosts
    }

    /// A job container runs (or is saving on its signal): the host is lent.
    pub fn lent(&self) -> bool {
        self.jobs.iter().any(Job::live)
    }

    /// Sends the container `id` its stop signal, the kill following after `grace`; returns
    /// when it will have exited (the engine's stop returns then).
    pub fn stop(
        &mut self,
        id: &str,
        grace: Duration,
        now: Moment,
        workload: &dyn Workload,
    ) -> Moment {
        self.clock = self.clock.max(now);
        if let Some(r) = self.replica.as_mut().filter(|r| r.ctr.container.id == id) {
            return match r.vllm {
                Vllm::Exited { .. } => now,
                Vllm::Stopping { exits_at, .. } => exits_at,
                v => {
                    let exits_at = now + self.timings.replica_stop.min(grace);
                    r.vllm = Vllm::Stopping {
                        exits_at,
                        asleep: v == Vllm::Asleep,
                    };
                    exits_at
                }
            };
        }
        let Some(j) = self.jobs.iter_mut().find(|j| j.ctr.container.id == id) else {
            return now;
        };
        let killed = now + grace;
        let (exits_at, signalled) = match j.run {
            Run::Exited => return now,
            Run::Signalled { at, exits_at, code } if exits_at <= killed => {
                (exits_at, Run::Signalled { at, exits_at, code })
            }
            Run::Signalled { at, .. } => (
                killed,
                Run::Signalled {
                    at,
                    exits_at: killed,
                    code: 137,
                },
            ),
            Run::Running => {
                let save = workload.save(j.proc());
                let (exits_at, code) = if save <= grace {
                    (now + save, workload.signal_code(j.proc()))
                } else {
                    (killed, 137)
                };
                (
                    exits_at,
                    Run::Signalled {
                        at: now,
                        exits_at,
                        code,
                    },
                )
            }
        };
        j.run = signalled;
        j.ends_at.map_or(exits_at, |e| e.max(now).min(exits_at))
    }

    /// Sends the container `id` its checkpoint signal alone (no kill follows); false when
    /// there is no such container.
    pub fn signal(&mut self, id: &str, now: Moment, workload: &dyn Workload) -> bool {
        self.clock = self.clock.max(now);
        let Some(j) = self.jobs.iter_mut().find(|j| j.ctr.container.id == id) else {
            return self.ctr_of(id).is_some();
        };
        if j.run == Run::Running {
            let save = workload.save(j.proc());
            if save != Duration::MAX {
                j.run = Run::Signalled {
                    at: now,
                    exits_at: now + save,
                    code: workload.signal_code(j.proc()),
                };
            }
        }
        true
    }

    /// Starts the replica's container (replacing an exited one); returns its id.
    pub fn start_replica(&mut self, now: Moment) -> Result<String, RunError> {
        let launch = self.replica_launch();
        self.run(launch, now, &Idle)
    }

    /// Starts `lease`'s job container, labelled as the agent labels it.
    pub fn start_job(
        &mut self,
        lease: &LeaseGrant,
        now: Moment,
        workload: &dyn Workload,
    ) -> Result<String, RunError> {
        let launch = Launch {
            name: format!("{}-lease-{}-{}", self.name, lease.lease_id, lease.epoch),
            image: lease.job.image.clone(),
            labels: nightshift_planner::job_labels(&self.name, lease),
            gpus: lease.gpus.clone(),
            ..Launch::default()
        };
        self.run(launch, now, workload)
    }

    /// The engine runs `launch` at `now`: a running container of its name is the one; a
    /// stopped one is removed first. Returns the container's id.
    pub fn run(
        &mut self,
        launch: Launch,
        now: Moment,
        workload: &dyn Workload,
    ) -> Result<String, RunError> {
        self.clock = self.clock.max(now);
        if !self.engine_answers() {
            return Err(RunError::EngineDown);
        }
        if !self.images.has(&launch.image) {
            return Err(RunError::Missing);
        }
        if let Some(why) = self.images.refusal(&launch.image) {
            return Err(RunError::Refused(why.to_owned()));
        }
        if !launch.name.is_empty()
            && let Some(c) = self
                .replica
                .iter()
                .map(|r| &r.ctr)
                .chain(self.jobs.iter().map(|j| &j.ctr))
                .find(|c| c.container.name == launch.name)
        {
            let id = c.container.id.clone();
            if c.container.state == ContainerState::Running {
                return Ok(id);
            }
            self.remove(&id);
        }
        let id = self.new_id(&launch);
        if is_replica(&launch.labels) {
            if let Some(old) = self.replica.take() {
                self.bury(&old.ctr, self.replica_holds(&old, now));
            }
            let healthy_at = now + self.timings.replica_start;
            self.replica = Some(Replica {
                ctr: self.ctr(id.clone(), launch, now),
                vllm: Vllm::Loading { healthy_at },
            });
            return Ok(id);
        }
        let number = |key: &str| launch.labels.get(key).and_then(|v| v.parse::<u64>().ok());
        let job = number(labels::JOB_ID).unwrap_or(0);
        let lease = number(labels::LEASE_ID).zip(number(labels::EPOCH));
        if let Some((lease_id, epoch)) = lease {
            self.fence(lease_id, epoch, &launch.gpus);
        }
        let tag = self.images.tag_of(&launch.image).to_owned();
        let p = Proc { job, image: &tag };
        let memory = workload.memory(p).unwrap_or(self.timings.job_memory);
        let ends_at = workload.ends_at(p, now);
        let ctr = self.ctr(id.clone(), launch, now);
        self.jobs.push(Job {
            ctr,
            job,
            lease,
            tag,
            memory,
            ends_at,
            run: Run::Running,
        });
        Ok(id)
    }

    /// Checks a job start under `epoch` on `gpus` against the epochs started there before.
    fn fence(&mut self, lease_id: u64, epoch: u64, gpus: &[u32]) {
        for g in gpus {
            let seen = self.started_epochs.entry(*g).or_default();
            if epoch < *seen {
                self.stale_starts.push(format!(
                    "node {} gpu {g}: lease {lease_id} started under epoch {epoch}, after epoch {} ran there",
                    self.name, *seen
                ));
            }
            *seen = (*seen).max(epoch);
        }
        self.job_starts += 1;
    }

    /// A removed container's memory, still shown held for a while.
    fn bury(&mut self, ctr: &Ctr, held: u64) {
        let frees_after = self.timings.frees_after;
        if held > 0 && !frees_after.is_zero() {
            let until = ctr.ended.unwrap_or(self.clock) + frees_after;
            self.ghosts.push((ctr.gpus.clone(), held, until));
        }
    }

    /// Removes the container `id`.
    pub fn remove(&mut self, id: &str) {
        if let Some(i) = self.jobs.iter().position(|j| j.ctr.container.id == id) {
            let j = self.jobs.remove(i);
            let held = if j.live() || j.ctr.lingers(self.clock, self.timings.frees_after) {
                j.memory
            } else {
                0
            };
            self.bury(&j.ctr, held);
        } else if self
            .replica
            .as_ref()
            .is_some_and(|r| r.ctr.container.id == id)
            && let Some(r) = self.replica.take()
        {
            self.bury(&r.ctr, self.replica_holds(&r, self.clock));
        }
    }

    /// One owner per GPU: the replica (awake) or a single live job container, never two;
    /// an asleep replica keeps only its context and may share. And no job container was
    /// ever started under an epoch older than one started on its GPUs before. `Err` names
    /// the GPU and the owners, or the stale start.
    pub fn check_owners(&self) -> Result<(), String> {
        if let Some(stale) = self.stale_starts.first() {
            return Err(stale.clone());
        }
        let replica_holds = self.replica.as_ref().is_some_and(|r| {
            !matches!(
                r.vllm,
                Vllm::Asleep | Vllm::Exited { .. } | Vllm::Stopping { asleep: true, .. }
            )
        });
        let holds = |j: &&Job, g: u32| j.live() && j.ctr.gpus.contains(&g);
        for g in 0..self.gpus {
            let jobs = self.jobs.iter().filter(|j| holds(j, g)).count();
            if jobs + usize::from(replica_holds) <= 1 {
                continue;
            }
            let mut owners: Vec<String> = self
                .jobs
                .iter()
                .filter(|j| holds(j, g))
                .map(|j| match j.lease {
                    Some((lease, epoch)) => format!("lease {lease} (epoch {epoch})"),
                    None => format!("container {}", j.ctr.container.name),
                })
                .collect();
            if replica_holds {
                owners.insert(0, "the replica".to_owned());
            }
            return Err(format!(
                "node {} gpu {g}: held by {}",
                self.name,
                owners.join(" and ")
            ));
        }
        Ok(())
    }

    /// The container engine restarts at `now` and answers again after `down`: every
    /// container stops with it (the jobs on the engine's SIGTERM, at once), as `dockerd` stops
    /// its containers when it restarts without live-restore.
    pub fn restart_engine(&mut self, now: Moment, down: Duration, workload: &mut dyn Workload) {
        self.engine_down_until = Some(now + down);
        self.stop_all(now, workload);
    }

    /// The engine stops (`systemctl stop docker`): every container stops with it, and the
    /// engine answers nothing until [`Host::start_engine`].
    pub fn stop_engine(&mut self, now: Moment, workload: &mut dyn Workload) {
        self.engine_stopped = true;
        self.stop_all(now, workload);
    }

    /// The engine answers again, its containers as they were left.
    pub fn start_engine(&mut self) {
        self.engine_stopped = false;
        self.touched = true;
    }

    fn stop_all(&mut self, now: Moment, workload: &mut dyn Workload) {
        if let Some(r) = &mut self.replica
            && !matches!(r.vllm, Vllm::Exited { .. })
        {
            let asleep = matches!(r.vllm, Vllm::Asleep | Vllm::Stopping { asleep: true, .. });
            r.vllm = Vllm::Exited { asleep };
            r.ctr.ended = Some(now);
            r.ctr.container.state = ContainerState::Exited { exit_code: 0 };
        }
        for j in self.jobs.iter_mut().filter(|j| j.run == Run::Running) {
            j.run = Run::Signalled {
                at: now,
                exits_at: now,
                code: 143,
            };
        }
        self.advance(now, workload);
        self.touched = true;
    }

    /// The checkpoint volume reads full until `until`.
    pub fn fill_disk(&mut self, until: Moment) {
        self.disk_full_until = Some(until);
        self.touched = true;
    }

    /// The live job containers' runs: (job, GPUs, started).
    pub fn live_runs(&self) -> impl Iterator<Item = (u64, &[u32], Moment)> {
        self.jobs
            .iter()
            .filter(|j| j.live() && j.lease.is_some())
            .map(|j| (j.job, &j.ctr.gpus[..], j.ctr.started))
    }

    /// Writes `content` at `path` in container `id`'s file system.
    pub fn write_file(&mut self, id: &str, path: &str, content: &[u8]) {
        if let Some(c) = self.ctr_mut(id) {
            c.files.insert(path.to_owned(), content.to_vec());
        }
    }

    /// The file at `path` in container `id`; `None` when there is no such container.
    pub fn read_file(&self, id: &str, path: &str) -> Option<Option<&[u8]>> {
        let c = self.ctr_of(id)?;
        Some(c.files.get(path).map(Vec::as_slice))
    }

    /// What container `id` wrote to its standard output.
    pub fn stdout(&self, id: &str) -> Option<&str> {
        self.ctr_of(id).map(|c| c.stdout.as_str())
    }

    /// Container `id` writes `text` to its standard output.
    pub fn print(&mut self, id: &str, text: &str) {
        if let Some(c) = self.ctr_mut(id) {
            c.stdout.push_str(text);
        }
    }
}

fn is_replica(labels: &BTreeMap<String, String>) -> bool {
    labels.get(labels::ROLE).map(String::as_str) == Some(labels::ROLE_REPLICA)
}
