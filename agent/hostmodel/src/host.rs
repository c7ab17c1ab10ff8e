//! The host itself: its container engine, GPUs, vLLM replica and job containers, each change
//! timed on the virtual clock. It does what the agent's ports would make a real host do
//! (`Engine`, `Gpus`, `Serving` in `agent/src`), and reports what they would read back as
//! the planner's [`Observation`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use nightshift_common::{CheckpointStorage, GpuInfo, LeaseGrant, UnixMillis, labels};
use nightshift_planner::{Container, ContainerState, Health, Moment, Observation, ReplicaProbe};

/// How long the host's transitions take, and what they hold of each GPU's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Timings {
    /// From the replica's container start to `/health` answering 200 (the model's load).
    pub replica_start: Duration,
    /// From the replica's SIGTERM to its exit (vLLM's shutdown).
    pub replica_stop: Duration,
    /// vLLM's `/sleep` call, until it answers with the memory released.
    pub sleep: Duration,
    /// vLLM's `/wake_up` call, until it answers.
    pub wake: Duration,
    /// Memory the replica holds on each GPU while its container runs awake.
    pub replica_memory: u64,
    /// Memory it keeps on each GPU asleep (its CUDA context).
    pub asleep_memory: u64,
    /// Memory a job container holds on each of its GPUs.
    pub job_memory: u64,
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
        }
    }
}

/// What the jobs do, which the host does not know by itself: when a job's container would
/// finish its work, how long its checkpoint takes once signalled, and who keeps the books
/// when it exits.
pub trait Workload {
    /// When the job's container started at `started` ends its work on its own; `None`:
    /// not before it is stopped.
    fn ends_at(&self, job: u64, started: Moment) -> Option<Moment>;
    /// How long the job takes, once signalled, to save its checkpoint and exit.
    fn save(&self, job: u64) -> Duration;
    /// A job container exited.
    fn exited(&mut self, exit: &Exit);
    /// The code a job's container exits with when its work ends on its own.
    fn exit_code(&self, _job: u64) -> i64 {
        0
    }
    /// When the job last wrote a checkpoint (the newest file the agent finds in its
    /// checkpoint directory); `None`: not known.
    fn last_checkpoint_at(&self, _job: u64) -> Option<UnixMillis> {
        None
    }
}

/// What pulling an image the host lacks does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pull {
    /// It arrives after this long.
    Takes(Duration),
    /// It does not arrive while the model runs (a slow registry).
    Hangs,
    /// The registry refuses it after this long, for this reason.
    Fails(Duration, String),
}

/// A pull under way.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pulling {
    image: String,
    /// When the engine's pull returns; `None`: not while the model runs.
    ends_at: Option<Moment>,
    /// The registry's refusal, if it refuses.
    refused: Option<String>,
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
}

/// The replica's container, and its vLLM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vllm {
    /// Loading the model: `/health` refuses until then.
    Loading {
        healthy_at: Moment,
    },
    /// Healthy and awake.
    Up,
    /// Told to sleep: it answers then, its memory released.
    FallingAsleep {
        at: Moment,
    },
    Asleep,
    /// Told to wake: it answers then, awake.
    Waking {
        at: Moment,
    },
    /// Signalled: its container exits then (asleep, it holds only its context until then).
    Stopping {
        exits_at: Moment,
        asleep: bool,
    },
    Exited,
}

#[derive(Debug, Clone, PartialEq)]
struct Replica {
    id: String,
    vllm: Vllm,
}

/// A job container's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Running,
    /// Signalled at `at`: it exits at `exits_at` with `code` (143 once its checkpoint is
    /// saved, 137 when its grace ran out first and it was killed).
    Signalled {
        at: Moment,
        exits_at: Moment,
        code: i64,
    },
    Exited,
}

#[derive(Debug, Clone, PartialEq)]
struct Job {
    container: Container,
    lease: LeaseGrant,
    started: Moment,
    /// When its work is done, as the workload last said.
    ends_at: Option<Moment>,
    run: Run,
}

impl Job {
    fn live(&self) -> bool {
        self.run != Run::Exited
    }
}

/// One GPU host in virtual time.
#[derive(Debug, Clone, PartialEq)]
pub struct Host {
    pub name: String,
    gpus: u32,
    pub timings: Timings,
    replica: Option<Replica>,
    jobs: Vec<Job>,
    /// Containers created so far.
    created: u64,
    /// vLLM has requests in flight until then (the traffic the caller sends it).
    busy_until: Moment,
    /// The container engine does not answer until then (it is restarting).
    engine_down_until: Option<Moment>,
    /// The checkpoint volume reads full until then.
    disk_full_until: Option<Moment>,
    /// vLLM's `/sleep` answers an error until then.
    sleep_fails_until: Option<Moment>,
    /// The highest lease epoch a job container was started with, per GPU: the host's own
    /// record, against which every start is checked (ARCHITECTURE.md, invariant 3).
    started_epochs: BTreeMap<u32, u64>,
    /// Starts under an epoch older than one already started on the GPU.
    stale_starts: Vec<String>,
    job_starts: u64,
    /// The images the host lacks, and what pulling each does; every other image is there.
    lacks: BTreeMap<String, Pull>,
    pulls: Vec<Pulling>,
    /// Pulls that returned, for the agent to take in: the image, and the registry's refusal.
    pulled: Vec<(String, Option<String>)>,
    /// GPUs NVML reports unhealthy, and why.
    pub unhealthy: BTreeMap<u32, String>,
    /// Where the host keeps checkpoints (its facts report storage other than its own disk).
    pub storage: CheckpointStorage,
    /// Something outside the agent changed what it observes (the engine restarted, the disk
    /// filled, an image went missing): the agent, which looks every second, sees it at its
    /// next look.
    touched: bool,
}

/// The container engine did not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineDown;

/// The replica container's URL: the model binds no port, so any fixed string serves.
const REPLICA_URL: &str = "http://replica.model";

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
            busy_until: Moment::ZERO,
            engine_down_until: None,
            disk_full_until: None,
            sleep_fails_until: None,
            started_epochs: BTreeMap::new(),
            stale_starts: Vec::new(),
            job_starts: 0,
            lacks: BTreeMap::new(),
            pulls: Vec::new(),
            pulled: Vec::new(),
            unhealthy: BTreeMap::new(),
            storage: CheckpointStorage::Local,
            touched: false,
        }
    }

    /// A host whose replica serves already (started long before `now`): the fleet at the
    /// start of a simulation.
    pub fn serving(name: &str, gpus: u32, timings: Timings) -> Self {
        let mut host = Self::new(name, gpus, timings);
        let id = host.new_id("replica");
        host.replica = Some(Replica { id, vllm: Vllm::Up });
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

    /// The replica has requests in flight until `until` (its share of the traffic, and how
    /// long the last of them takes).
    pub fn load(&mut self, until: Moment) {
        self.busy_until = until;
    }

    fn new_id(&mut self, what: &str) -> String {
        self.created += 1;
        format!("{}-{what}-{}", self.name, self.created)
    }

    /// The earliest moment after which one of the host's own timers has turned (a container
    /// exits, the replica turns healthy, falls asleep or wakes): before it, nothing the agent
    /// observes changes by itself. `None`: no timer is set.
    pub fn next_event(&self) -> Option<Moment> {
        let replica = self.replica.as_ref().and_then(|r| match r.vllm {
            Vllm::Loading { healthy_at } => Some(healthy_at),
            Vllm::FallingAsleep { at } | Vllm::Waking { at } => Some(at),
            Vllm::Stopping { exits_at, .. } => Some(exits_at),
            Vllm::Up | Vllm::Asleep | Vllm::Exited => None,
        });
        let jobs = self.jobs.iter().filter_map(|j| match j.run {
            Run::Running => j.ends_at,
            Run::Signalled { exits_at, .. } => Some(exits_at),
            Run::Exited => None,
        });
        let recoveries = [self.engine_down_until, self.disk_full_until];
        let pulls = self.pulls.iter().filter_map(|p| p.ends_at);
        replica
            .into_iter()
            .chain(jobs)
            .chain(recoveries.into_iter().flatten())
            .chain(pulls)
            .min()
    }

    /// Turns every timer due by `now`; true when anything changed. Job exits are told to
    /// the workload, in the order they happened.
    pub fn advance(&mut self, now: Moment, workload: &mut dyn Workload) -> bool {
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
                Vllm::Stopping { exits_at, .. } if exits_at <= now => Some(Vllm::Exited),
                _ => None,
            };
            if let Some(v) = next {
                r.vllm = v;
                changed = true;
            }
        }
        let (done, pulling) = std::mem::take(&mut self.pulls)
            .into_iter()
            .partition(|p| p.ends_at.is_some_and(|t| t <= now));
        self.pulls = pulling;
        for p in done {
            if p.refused.is_none() {
                self.lacks.remove(&p.image);
            }
            self.pulled.push((p.image, p.refused));
            changed = true;
        }
        let mut exits = Vec::new();
        for j in &mut self.jobs {
            let exit = match j.run {
                Run::Running => j
                    .ends_at
                    .filter(|t| *t <= now)
                    .map(|t| (t, None, workload.exit_code(j.lease.job_id))),
                Run::Signalled { at, exits_at, code } if exits_at <= now => {
                    Some((exits_at, Some(at), code))
                }
                _ => None,
            };
            if let Some((at, signalled, code)) = exit {
                j.run = Run::Exited;
                j.container.state = ContainerState::Exited { exit_code: code };
                exits.push(Exit {
                    job: j.lease.job_id,
                    lease: j.lease.lease_id,
                    epoch: j.lease.epoch,
                    gpus: j.lease.gpus.clone(),
                    started: j.started,
                    signalled,
                    at,
                    exit_code: code,
                });
            }
        }
        exits.sort_by_key(|e| (e.at, e.lease));
        for e in &exits {
            workload.exited(e);
        }
        changed || !exits.is_empty()
    }

    /// Asks the workload again when each running job ends (another run of the job elsewhere
    /// may have saved progress since).
    pub fn refresh(&mut self, workload: &dyn Workload) {
        for j in self.jobs.iter_mut().filter(|j| j.run == Run::Running) {
            j.ends_at = workload.ends_at(j.lease.job_id, j.started);
        }
    }

    /// What the agent's ports read from the host at `now`; the replica's vLLM is asked only
    /// when `ask` (as the executor's `observe`).
    pub fn observe(&self, now: Moment, ask: bool) -> Result<Observation, EngineDown> {
        if self.engine_down_until.is_some() {
            return Err(EngineDown);
        }
        let mut containers = Vec::with_capacity(self.jobs.len() + 1);
        let mut replica = None;
        if let Some(r) = &self.replica {
            let running = r.vllm != Vllm::Exited;
            containers.push(Container {
                id: r.id.clone(),
                name: r.id.clone(),
                image: "vllm".into(),
                image_id: None,
                labels: BTreeMap::from([
                    (labels::MANAGED_BY.to_owned(), self.name.clone()),
                    (labels::ROLE.to_owned(), labels::ROLE_REPLICA.to_owned()),
                ]),
                state: if running {
                    ContainerState::Running
                } else {
                    ContainerState::Exited { exit_code: 0 }
                },
                published_port: None,
            });
            if running {
                replica = Some(self.probe(r, now, ask));
            }
        }
        containers.extend(self.jobs.iter().map(|j| j.container.clone()));
        Ok(Observation {
            containers,
            gpus: self.gpu_indices(),
            gpu_memory: Some(self.gpu_memory()),
            replica,
            checkpoint_free_bytes: Some(if self.disk_full_until.is_some() {
                0
            } else {
                u64::MAX
            }),
            missing_images: self.lacks.keys().cloned().collect(),
            unrestored: BTreeSet::new(),
        })
    }

    /// From `now`, the host lacks `image` and pulling it does what `pull` says; a pull of it
    /// under way ends as `pull` says, counted from `now`.
    pub fn lack(&mut self, image: &str, pull: Pull, now: Moment) {
        self.lacks.insert(image.to_owned(), pull);
        self.touched = true;
        if let Some(i) = self.pulls.iter().position(|p| p.image == image) {
            self.pulls.remove(i);
            self.start_pull(image, now);
        }
    }

    /// The engine starts pulling `image`, unless that is under way or the host has it.
    pub fn start_pull(&mut self, image: &str, now: Moment) {
        if self.pulls.iter().any(|p| p.image == image) {
            return;
        }
        let Some(pull) = self.lacks.get(image) else {
            return;
        };
        let (ends_at, refused) = match pull {
            Pull::Takes(d) => (Some(now + *d), None),
            Pull::Hangs => (None, None),
            Pull::Fails(d, why) => (
                Some(now + *d),
                Some(format!("pulling {image} failed: {why}")),
            ),
        };
        self.pulls.push(Pulling {
            image: image.to_owned(),
            ends_at,
            refused,
        });
    }

    /// The pulls that returned since the last call: each image, with the registry's
    /// refusal when it refused.
    pub fn take_pulled(&mut self) -> Vec<(String, Option<String>)> {
        std::mem::take(&mut self.pulled)
    }

    fn probe(&self, r: &Replica, now: Moment, ask: bool) -> ReplicaProbe {
        let mut probe = ReplicaProbe {
            container_id: r.id.clone(),
            url: Some(REPLICA_URL.to_owned()),
            health: None,
            requests_running: None,
            requests_waiting: None,
            is_sleeping: None,
            sleep_state: None,
        };
        if !ask {
            return probe;
        }
        let (health, asleep) = match r.vllm {
            Vllm::Loading { .. } | Vllm::Stopping { .. } => (Health::Unreachable, None),
            Vllm::Up | Vllm::FallingAsleep { .. } => (Health::Healthy, Some(false)),
            Vllm::Asleep | Vllm::Waking { .. } => (Health::Healthy, Some(true)),
            Vllm::Exited => (Health::Unreachable, None),
        };
        probe.health = Some(health);
        probe.is_sleeping = asleep;
        if health == Health::Healthy {
            let running = if now < self.busy_until { 1.0 } else { 0.0 };
            probe.requests_running = Some(running);
            probe.requests_waiting = Some(0.0);
        }
        probe
    }

    /// Memory in use on each GPU.
    pub fn gpu_memory(&self) -> BTreeMap<u32, u64> {
        (0..self.gpus).map(|g| (g, self.gpu_used(g))).collect()
    }

    /// Memory in use on GPU `g`.
    pub fn gpu_used(&self, g: u32) -> u64 {
        let t = &self.timings;
        let replica = self.replica.as_ref().map_or(0, |r| match r.vllm {
            Vllm::Exited => 0,
            Vllm::Asleep | Vllm::Stopping { asleep: true, .. } => t.asleep_memory,
            _ => t.replica_memory,
        });
        let jobs = self
            .jobs
            .iter()
            .filter(|j| j.live() && j.lease.gpus.contains(&g))
            .count() as u64;
        replica + jobs * t.job_memory
    }

    /// The replica's container runs and its vLLM is awake (loading, serving, or on its way
    /// to sleep or out): it counts towards the serving floor.
    pub fn replica_up(&self) -> bool {
        self.replica.as_ref().is_some_and(|r| {
            matches!(
                r.vllm,
                Vllm::Loading { .. } | Vllm::Up | Vllm::FallingAsleep { .. }
            )
        })
    }

    /// The replica's vLLM is healthy and awake.
    pub fn replica_serving(&self) -> bool {
        self.replica.as_ref().is_some_and(|r| r.vllm == Vllm::Up)
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
        if let Some(r) = self.replica.as_mut().filter(|r| r.id == id) {
            return match r.vllm {
                Vllm::Exited => now,
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
        let Some(j) = self.jobs.iter_mut().find(|j| j.container.id == id) else {
            return now;
        };
        match j.run {
            Run::Exited => now,
            Run::Signalled { exits_at, .. } => exits_at,
            Run::Running => {
                let save = workload.save(j.lease.job_id);
                let (took, code) = if save <= grace {
                    (save, 143)
                } else {
                    (grace, 137)
                };
                let exits_at = now + took;
                j.run = Run::Signalled {
                    at: now,
                    exits_at,
                    code,
                };
                exits_at
            }
        }
    }

    /// Starts the replica's container (replacing an exited one); returns its id.
    pub fn start_replica(&mut self, now: Moment) -> String {
        let id = self.new_id("replica");
        self.replica = Some(Replica {
            id: id.clone(),
            vllm: Vllm::Loading {
                healthy_at: now + self.timings.replica_start,
            },
        });
        id
    }

    /// Starts `lease`'s job container, labelled as the agent labels it.
    pub fn start_job(&mut self, lease: &LeaseGrant, now: Moment, workload: &dyn Workload) {
        for g in &lease.gpus {
            let seen = self.started_epochs.entry(*g).or_default();
            if lease.epoch < *seen {
                self.stale_starts.push(format!(
                    "node {} gpu {g}: lease {} started under epoch {}, after epoch {} ran there",
                    self.name, lease.lease_id, lease.epoch, *seen
                ));
            }
            *seen = (*seen).max(lease.epoch);
        }
        self.job_starts += 1;
        let id = self.new_id("job");
        self.jobs.push(Job {
            container: Container {
                id: id.clone(),
                name: id,
                image: lease.job.image.clone(),
                image_id: None,
                labels: nightshift_planner::job_labels(&self.name, lease),
                state: ContainerState::Running,
                published_port: None,
            },
            lease: lease.clone(),
            started: now,
            ends_at: workload.ends_at(lease.job_id, now),
            run: Run::Running,
        });
    }

    /// Removes the container `id`.
    pub fn remove(&mut self, id: &str) {
        self.jobs.retain(|j| j.container.id != id);
        if self.replica.as_ref().is_some_and(|r| r.id == id) {
            self.replica = None;
        }
    }

    /// vLLM's `/sleep`: returns when it answers; `None` when no replica is awake or
    /// `/sleep` fails.
    pub fn sleep(&mut self, now: Moment) -> Option<Moment> {
        if self.sleep_fails_until.is_some_and(|t| now < t) {
            return None;
        }
        let r = self.replica.as_mut().filter(|r| r.vllm == Vllm::Up)?;
        let at = now + self.timings.sleep;
        r.vllm = Vllm::FallingAsleep { at };
        Some(at)
    }

    /// vLLM's `/wake_up`: returns when it answers; `None` when no replica is asleep.
    pub fn wake(&mut self, now: Moment) -> Option<Moment> {
        let r = self.replica.as_mut().filter(|r| r.vllm == Vllm::Asleep)?;
        let at = now + self.timings.wake;
        r.vllm = Vllm::Waking { at };
        Some(at)
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
                Vllm::Asleep | Vllm::Exited | Vllm::Stopping { asleep: true, .. }
            )
        });
        let holds = |j: &&Job, g: u32| j.live() && j.lease.gpus.contains(&g);
        for g in 0..self.gpus {
            let jobs = self.jobs.iter().filter(|j| holds(j, g)).count();
            if jobs + usize::from(replica_holds) <= 1 {
                continue;
            }
            let mut owners: Vec<String> = self
                .jobs
                .iter()
                .filter(|j| holds(j, g))
                .map(|j| format!("lease {} (epoch {})", j.lease.lease_id, j.lease.epoch))
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
        if let Some(r) = &mut self.replica {
            r.vllm = Vllm::Exited;
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

    /// vLLM's `/sleep` answers an error until `until` (a vLLM started without
    /// `--enable-sleep-mode`, a failing CUDA call).
    pub fn fail_sleeps(&mut self, until: Moment) {
        self.sleep_fails_until = Some(until);
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
            .filter(|j| j.live())
            .map(|j| (j.lease.job_id, &j.lease.gpus[..], j.started))
    }
}
