//! The coordinator's state behind its HTTP shell: the decision core, the durable store, and a
//! version channel per node that wakes agents long-polling for their desired state.
//!
//! [`Cluster::apply`] is the only way in: it runs one core call with the current time,
//! writes every change the core reports to the store, and only then answers and publishes new
//! desired versions, so an agent never acts on a decision that a crash could forget.
//!
//! Writes are group-committed: a call queues its changes under the core's lock and lets go
//! of it; the first call to find no write in progress writes everything queued in one
//! transaction (one fsync), and each call answers once its own batch is on disk. Calls that
//! arrive during a write share the next one, so the fsync rate stays flat as calls grow.
//!
//! A failed write takes its changes back: the core is rebuilt from the store, its id counters
//! kept where they had reached, so that no id names two things. Reads answer from what is
//! saved only ([`Cluster::read`]); only what monitors read peeks at memory ([`Cluster::peek`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use nightshift_common::UnixMillis;
use nightshift_core::{Core, CoreConfig, CoreError, CoreSnapshot, Effect};
use tokio::sync::{Notify, watch};

use crate::config::AccountingConfig;
use crate::pipelines::Pipelines;
use crate::policy::PolicyConfig;
use crate::store::{Changes, ImageRecord, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Core(#[from] CoreError),
    /// Shared: one failed commit fails every call whose changes it carried.
    #[error("state not saved: {0}")]
    Store(Arc<StoreError>),
    #[error("pipelines cannot be rebuilt from the store: {0}")]
    Pipelines(String),
    /// Shutdown has begun: this coordinator decides nothing more (its successor may be up).
    #[error("the coordinator is shutting down; try again in a moment")]
    ShuttingDown,
}

impl From<StoreError> for ApplyError {
    fn from(e: StoreError) -> Self {
        Self::Store(Arc::new(e))
    }
}

struct Inner {
    core: Core,
    pipelines: Pipelines,
    /// The job policy: what admits a job submitted alone and each pipeline step.
    policy: Arc<PolicyConfig>,
}

/// Changes staged by calls, in the order the core made them, not yet written.
#[derive(Default)]
struct Queue {
    pending: Vec<Changes>,
    /// The sequence number of the last batch staged (batches count from 1).
    staged: u64,
}

/// What the commits have settled so far.
#[derive(Default)]
struct Settled {
    /// Every batch up to this one is written (or failed, see `failures`).
    upto: u64,
    /// A call is writing the queue now; the others wait for it.
    committing: bool,
    /// Recent failed commits: the batches `from..=to` they carried, and why.
    failures: VecDeque<(u64, u64, Arc<StoreError>)>,
}

/// Heartbeats decide at most this often; the reports in between wait for the next decision
/// (the ticker makes it within about this time), so that a fleet's worth of reports costs a
/// few decisions a second, not one each.
pub const DECISION_INTERVAL_MS: u64 = 20;

/// When one decision takes long (a big fleet, a deep queue), heartbeats space decisions
/// further: this many times its duration, so that deciding never takes more than about a
/// tenth of a core.
const DECISION_SPACING: u64 = 10;

/// Failed commits remembered for the callers still waiting on them.
const FAILURES_KEPT: usize = 64;

pub struct Cluster {
    inner: Mutex<Inner>,
    /// Lock order: `store`, then `inner`, then `queue`, then `settled`, which is never held
    /// while another is taken.
    store: Mutex<Store>,
    queue: Mutex<Queue>,
    settled: Mutex<Settled>,
    /// Wakes blocking callers waiting on `settled`.
    settled_cv: Condvar,
    /// Wakes async callers waiting on `settled`.
    settled_notify: Notify,
    config: CoreConfig,
    /// What a GPU-hour is worth, for reports.
    pub accounting: AccountingConfig,
    pub metrics: crate::metrics::Metrics,
    /// The last day of each service, sampled by the ticker, for the web UI's overview.
    pub timeline: crate::timeline::Timeline,
    versions: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// Each agent's base URL, as it last said (register, heartbeats): an address book of the
    /// shell, not a decision, so the core does not hold it.
    agent_urls: Mutex<HashMap<String, String>>,
    /// Where each agent's metrics answer, as it last said: Prometheus' targets
    /// (`/v1/nodes/http_sd`).
    metrics_urls: Mutex<HashMap<String, String>>,
    /// The CA and the coordinator's certificate (`[tls]`), with which the log proxy reaches
    /// agents over HTTPS; none on plain HTTP.
    agent_tls: Mutex<Option<crate::config::TlsConfig>>,
    /// The highest attempt of each job whose image ID is in the store: every heartbeat
    /// repeats it, and only a new attempt's needs the store.
    images_recorded: Mutex<HashMap<u64, u32>>,
    /// How long the last decision a heartbeat made took, in microseconds.
    decision_us: AtomicU64,
    /// Set once shutdown begins (under the core's lock): from then on nothing is decided,
    /// changed or written, and long-polls end.
    stopping: watch::Sender<bool>,
    /// How the last writes went: for `/healthz`, and to log a repeating failure sparingly.
    health: Mutex<crate::health::StoreHealth>,
}

/// One call's changes on their way to disk: its batch (or the last batch staged before it,
/// if it changed nothing) and the desired versions to publish once that batch is written.
struct Staged {
    seq: u64,
    moved: Vec<(String, u64)>,
}

/// Unix milliseconds that never step ([`crate::clock`]): the only clock the core is given.
pub fn now_ms() -> UnixMillis {
    crate::clock::now_ms()
}

/// Runs `f`, which blocks (a write and its fsync), on this thread; on a multi-threaded
/// runtime its other tasks move to another thread meanwhile, so that their calls keep
/// arriving and join the next commit.
fn in_place<T>(f: impl FnOnce() -> T) -> T {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Keeps `snapshot`'s id counters (job ids, lease ids, fencing epochs) at least where `lost`'s
/// had reached, for the core rebuilt from it after a failed write: the lost core may have
/// given ids the store never saved, and no id may name two things.
fn keep_counters(snapshot: &mut CoreSnapshot, lost: &Core) {
    let (job, lease, epoch) = lost.next_ids();
    snapshot.next_job_id = snapshot.next_job_id.max(job);
    snapshot.next_lease_id = snapshot.next_lease_id.max(lease);
    snapshot.next_epoch = snapshot.next_epoch.max(epoch);
}

impl Cluster {
    /// Opens the store and rebuilds the core from it.
    pub fn open(
        config: CoreConfig,
        accounting: AccountingConfig,
        store: Store,
    ) -> Result<Self, StoreError> {
        let snapshot = store.load()?;
        let core = Core::restore(config.clone(), snapshot, now_ms());
        let pipelines = Pipelines::restore(store.load_pipelines()?).map_err(|reason| {
            StoreError::Pipelines {
                db: store.location().to_owned(),
                reason,
            }
        })?;
        let versions = core
            .node_names()
            .filter_map(|n| {
                Some((
                    n.to_owned(),
                    watch::channel(core.node(n)?.desired_version).0,
                ))
            })
            .collect();
        Ok(Self {
            inner: Mutex::new(Inner {
                core,
                pipelines,
                policy: Arc::default(),
            }),
            store: Mutex::new(store),
            queue: Mutex::new(Queue::default()),
            settled: Mutex::new(Settled::default()),
            settled_cv: Condvar::new(),
            settled_notify: Notify::new(),
            config,
            accounting,
            metrics: crate::metrics::Metrics::default(),
            timeline: crate::timeline::Timeline::default(),
            versions: Mutex::new(versions),
            agent_urls: Mutex::new(HashMap::new()),
            metrics_urls: Mutex::new(HashMap::new()),
            agent_tls: Mutex::new(None),
            images_recorded: Mutex::new(HashMap::new()),
            decision_us: AtomicU64::new(0),
            stopping: watch::channel(false).0,
            health: Mutex::new(crate::health::StoreHealth::default()),
        })
    }

    /// Decides now if an observation waits for a decision and the last one is older than
    /// [`DECISION_INTERVAL_MS`], or ten times the last decision's duration if that is longer.
    /// For the heartbeat path, inside [`Cluster::apply_async`].
    pub fn decide_if_due(&self, core: &mut Core, now: UnixMillis) {
        let interval = self.decision_interval_ms();
        if core.decision_pending() && core.decided_at().is_none_or(|t| now >= t + interval) {
            self.decide(core, now);
        }
    }

    /// Makes the core's decisions now, timing them: the time spaces the next ones and goes
    /// to the `decision_duration_seconds` histogram.
    pub fn decide(&self, core: &mut Core, now: UnixMillis) {
        let started = std::time::Instant::now();
        core.tick(now);
        let took = started.elapsed();
        self.decision_us
            .store(took.as_micros() as u64, Ordering::Relaxed);
        self.metrics.observe_decision(took.as_secs_f64());
    }

    /// Admits every job submitted and each pipeline step launched by `policy` from now on.
    pub fn set_job_policy(&self, policy: PolicyConfig) {
        lock(&self.inner).policy = Arc::new(policy);
    }

    /// The job policy jobs and pipeline steps are admitted by ([`PolicyConfig::admit`]).
    pub fn job_policy(&self) -> Arc<PolicyConfig> {
        lock(&self.inner).policy.clone()
    }

    /// Queues the image IDs of job attempts that `node`'s heartbeat reports for the first
    /// time, to be written with the next commit (so before the heartbeat that reported them
    /// is answered, which waits for every batch queued before its own). Every heartbeat
    /// repeats them; an attempt already queued costs a map lookup, and none a read of the
    /// store or a transaction of its own.
    pub fn record_images(&self, node: &str, beat: &nightshift_common::Heartbeat) {
        // Shutting down: the heartbeat is refused, and its successor will record them.
        if self.is_stopping() {
            return;
        }
        let now = now_ms();
        let images: Vec<ImageRecord> = {
            let mut recorded = lock(&self.images_recorded);
            beat.jobs
                .iter()
                .filter_map(|r| {
                    let image_id = r.image_id.clone()?;
                    if recorded.get(&r.job_id).is_some_and(|a| *a >= r.attempt) {
                        return None;
                    }
                    recorded.insert(r.job_id, r.attempt);
                    Some(ImageRecord {
                        job: r.job_id,
                        attempt: r.attempt,
                        node: node.to_owned(),
                        image_id,
                        image_digest: r.image_digest.clone(),
                        at: now,
                    })
                })
                .collect()
        };
        if images.is_empty() {
            return;
        }
        tracing::debug!(
            node,
            images = images.len(),
            "launched images queued for the store"
        );
        self.enqueue(Changes {
            images,
            ..Changes::default()
        });
    }

    /// Queues a batch of changes for the next commit; returns its sequence number.
    fn enqueue(&self, changes: Changes) -> u64 {
        let mut queue = lock(&self.queue);
        queue.pending.push(changes);
        queue.staged += 1;
        queue.staged
    }

    /// Notes where `node`'s agent answers.
    pub fn note_agent_url(&self, node: &str, url: &str) {
        let mut urls = lock(&self.agent_urls);
        if urls.get(node).map(String::as_str) != Some(url) {
            urls.insert(node.to_owned(), url.to_owned());
        }
    }

    /// Notes where `node`'s agent serves its metrics.
    pub fn note_metrics_url(&self, node: &str, url: &str) {
        let mut urls = lock(&self.metrics_urls);
        if urls.get(node).map(String::as_str) != Some(url) {
            urls.insert(node.to_owned(), url.to_owned());
        }
    }

    /// Where `node`'s agent serves its metrics, once it has said.
    pub fn metrics_url(&self, node: &str) -> Option<String> {
        lock(&self.metrics_urls).get(node).cloned()
    }

    /// Reach agents over HTTPS with these files (`[tls]` of coordinator.toml).
    pub fn set_agent_tls(&self, tls: Option<crate::config::TlsConfig>) {
        *lock(&self.agent_tls) = tls;
    }

    /// The files the log proxy reaches agents with; none on plain HTTP.
    pub fn agent_tls(&self) -> Option<crate::config::TlsConfig> {
        lock(&self.agent_tls).clone()
    }

    /// Where `node`'s agent answers, once it has said.
    pub fn agent_url(&self, node: &str) -> Option<String> {
        lock(&self.agent_urls).get(node).cloned()
    }

    /// Runs `f` on the core at the current time, persists what changed, then wakes the agents
    /// whose desired state moved. If saving fails, the core is rebuilt from the store, so
    /// memory never runs ahead of disk for long, and no caller is answered with state that
    /// was not saved.
    ///
    /// Blocks the thread while the changes are written; async handlers on the hot path use
    /// [`Cluster::apply_async`].
    pub fn apply<T>(
        &self,
        f: impl FnOnce(&mut Core, UnixMillis) -> Result<T, CoreError>,
    ) -> Result<T, ApplyError> {
        self.apply_with_pipelines(|core, _, now| f(core, now))
    }

    /// [`Cluster::apply`] that waits for the write without blocking the thread, so that the
    /// changes of many calls share one commit.
    pub async fn apply_async<T>(
        &self,
        f: impl FnOnce(&mut Core, UnixMillis) -> Result<T, CoreError>,
    ) -> Result<T, ApplyError> {
        let (result, staged) = self.stage(|core, _, now| f(core, now))?;
        self.durable_async(staged.seq).await?;
        self.publish(staged.moved);
        Ok(result?)
    }

    /// [`Cluster::apply`] with the pipeline runs at hand too. After `f`, every run is fed the
    /// jobs that ended and the time, and the steps it decides to start are submitted, all in
    /// the same batch of changes.
    pub fn apply_with_pipelines<T>(
        &self,
        f: impl FnOnce(&mut Core, &mut Pipelines, UnixMillis) -> Result<T, CoreError>,
    ) -> Result<T, ApplyError> {
        let (result, staged) = self.stage(f)?;
        // On a multi-threaded runtime, let its other tasks move to another thread while this
        // one waits, so that their calls join the same commit.
        in_place(|| self.durable_blocking(staged.seq))?;
        self.publish(staged.moved);
        Ok(result?)
    }

    /// Runs `f` under the core's lock and queues what changed for the next commit. The time
    /// under the lock is the core call and the copying of changed records, nothing more.
    /// Once shutdown has begun, runs nothing.
    fn stage<T>(
        &self,
        f: impl FnOnce(&mut Core, &mut Pipelines, UnixMillis) -> Result<T, CoreError>,
    ) -> Result<(Result<T, CoreError>, Staged), ApplyError> {
        let now = now_ms();
        let mut guard = lock(&self.inner);
        if *self.stopping.borrow() {
            return Err(ApplyError::ShuttingDown);
        }
        let inner = &mut *guard;
        let result = f(&mut inner.core, &mut inner.pipelines, now);
        let mut steps = crate::pipelines::AdmittedSteps {
            core: &mut inner.core,
            policy: &inner.policy,
        };
        inner.pipelines.drive(&mut steps, now);
        let effects = inner.core.poll_effects();
        let pipeline_changes = inner.pipelines.take_changes();
        let mut moved = Vec::new();
        if effects.is_empty() && pipeline_changes.is_empty() {
            // Nothing to write, but what `f` read may come from calls still being written.
            let seq = lock(&self.queue).staged;
            return Ok((result, Staged { seq, moved }));
        }
        let mut changes = Changes {
            counters: Some(inner.core.next_ids()),
            pipelines: pipeline_changes,
            ..Default::default()
        };
        for effect in &effects {
            match effect {
                Effect::JobChanged(id) => changes.jobs.extend(inner.core.job(*id)),
                Effect::LeaseEnded(usage) => changes.usage.push(usage.clone()),
                Effect::ProfileChanged(service) => {
                    if let Some(p) = inner.core.profile(service) {
                        changes.profiles.push((service.clone(), p.clone()));
                    }
                }
                Effect::NodeChanged(name) => {
                    if let Some(n) = inner.core.node_snapshot(name) {
                        moved.push((name.clone(), n.desired_version));
                        changes.nodes.push(n);
                    }
                }
            }
        }
        let seq = self.enqueue(changes);
        Ok((result, Staged { seq, moved }))
    }

    /// Begins shutdown: from now on the core decides nothing (no ticks, no lease expiry, no
    /// new desired states), every change is refused with [`ApplyError::ShuttingDown`], and
    /// long-polls end. A call already inside the core finishes first (the flag is set under
    /// its lock), and its changes are written as usual.
    pub fn begin_shutdown(&self) {
        let _inner = lock(&self.inner);
        if !self.stopping.send_replace(true) {
            tracing::info!("shutting down: no more decisions; ending long-polls");
        }
    }

    /// Whether shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Completes once shutdown has begun.
    pub async fn stopped(&self) {
        let mut rx = self.stopping.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Why this coordinator is not healthy, if it is not: shutting down, or its store
    /// failing to save (the last write failed).
    pub fn unhealthy(&self) -> Option<String> {
        if self.is_stopping() {
            return Some("shutting down".to_owned());
        }
        lock(&self.health).failure(std::time::Instant::now())
    }

    /// How batch `seq` ended, once it has.
    fn outcome(settled: &Settled, seq: u64) -> Option<Result<(), ApplyError>> {
        if settled.upto < seq {
            return None;
        }
        Some(
            match settled
                .failures
                .iter()
                .find(|(from, to, _)| (*from..=*to).contains(&seq))
            {
                Some((_, _, e)) => Err(ApplyError::Store(e.clone())),
                None => Ok(()),
            },
        )
    }

    /// Waits, blocking the thread, until batch `seq` is written (or failed). When no other
    /// call is writing, this one writes everything queued.
    fn durable_blocking(&self, seq: u64) -> Result<(), ApplyError> {
        let mut settled = lock(&self.settled);
        loop {
            if let Some(outcome) = Self::outcome(&settled, seq) {
                return outcome;
            }
            if !settled.committing {
                settled.committing = true;
                drop(settled);
                self.commit();
                settled = lock(&self.settled);
                continue;
            }
            settled = self
                .settled_cv
                .wait(settled)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// [`Cluster::durable_blocking`] for async callers: while another call writes, this one
    /// yields, so that the calls arriving meanwhile queue up for the next commit.
    async fn durable_async(&self, seq: u64) -> Result<(), ApplyError> {
        loop {
            let notified = self.settled_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut settled = lock(&self.settled);
                if let Some(outcome) = Self::outcome(&settled, seq) {
                    return outcome;
                }
                if !settled.committing {
                    settled.committing = true;
                    drop(settled);
                    in_place(|| self.commit());
                    continue;
                }
            }
            notified.await;
        }
    }

    /// Writes every queued batch in one transaction, then settles them. The caller has set
    /// `committing`; this clears it.
    fn commit(&self) {
        let mut store = lock(&self.store);
        self.write_queued(&mut store, None, true);
    }

    /// Writes every queued batch in one transaction and settles them, before the caller lets
    /// go of the store (so that no later write settles first). If the write fails, the core
    /// is rebuilt from the store and every batch staged since (built on the lost changes)
    /// fails too. `inner`: the core, when the caller holds it already; `committer`: whether
    /// the caller set `committing`, which this then clears.
    fn write_queued(&self, store: &mut Store, inner: Option<&mut Inner>, committer: bool) {
        let (batch, upto) = {
            let mut queue = lock(&self.queue);
            (std::mem::take(&mut queue.pending), queue.staged)
        };
        let mut failed = None;
        let mut settled_upto = upto;
        let written = if batch.is_empty() {
            Ok(())
        } else {
            store.write_all(&batch)
        };
        match written {
            Ok(()) if !batch.is_empty() => self.note_saved(),
            Ok(()) => {}
            Err(e) => {
                let logged = self.note_failed(&e);
                let from = upto + 1 - batch.len() as u64;
                let mut held;
                let inner = match inner {
                    Some(inner) => inner,
                    None => {
                        held = lock(&self.inner);
                        &mut *held
                    }
                };
                {
                    let mut queue = lock(&self.queue);
                    queue.pending.clear();
                    settled_upto = queue.staged;
                }
                if let StoreError::Deposed { ours, current, .. } = &e {
                    // Another coordinator leads: this one decides nothing more (its core
                    // is dropped with it by the leadership, crate::leader).
                    if !self.stopping.send_replace(true) {
                        tracing::error!(
                            term = ours,
                            current,
                            "deposed: another coordinator leads; stepping down"
                        );
                    }
                } else {
                    self.reload(inner, store, logged);
                }
                failed = Some((from, settled_upto, Arc::new(e)));
            }
        }
        let mut settled = lock(&self.settled);
        settled.upto = settled.upto.max(settled_upto);
        if committer {
            settled.committing = false;
        }
        if let Some(f) = failed {
            settled.failures.push_back(f);
            if settled.failures.len() > FAILURES_KEPT {
                settled.failures.pop_front();
            }
        }
        drop(settled);
        self.settled_cv.notify_all();
        self.settled_notify.notify_waiters();
    }

    /// Logs a failed write: the first of a run of them at once, then a summary every
    /// [`crate::health::SUMMARY_EVERY`]. True when this one was logged.
    fn note_failed(&self, e: &StoreError) -> bool {
        use crate::health::FailureLog;
        let log = lock(&self.health).failed(std::time::Instant::now(), e.to_string());
        match log {
            FailureLog::First => {
                tracing::error!(
                    error = %e,
                    repeats_summarised_every_s = crate::health::SUMMARY_EVERY.as_secs(),
                    "saving state failed; reloading the core from the store"
                );
                true
            }
            FailureLog::Summary {
                failures,
                failing_for,
            } => {
                tracing::error!(
                    error = %e,
                    failures,
                    failing_for_s = failing_for.as_secs(),
                    "saving state still fails; each failure reloads the core from the store"
                );
                true
            }
            FailureLog::Quiet => false,
        }
    }

    /// A write worked: says so if writes were failing.
    fn note_saved(&self) {
        if let Some(r) = lock(&self.health).succeeded(std::time::Instant::now()) {
            tracing::info!(
                failures = r.failures,
                failed_for_s = r.failed_for.as_secs(),
                "saving state works again"
            );
        }
    }

    /// Rebuilds the core and the pipeline runs from what the store holds, their id counters
    /// kept where they had reached (the lost changes may have given ids the store never
    /// saved, and an id names one thing only); `log` says whether a failure to do so is
    /// logged (a run of them is summarised with the failed writes).
    fn reload(&self, inner: &mut Inner, store: &Store, log: bool) {
        // Image records queued since the last good commit may be lost with it: forget them,
        // so that the heartbeats repeating them queue them again.
        lock(&self.images_recorded).clear();
        let rebuilt = store.load().and_then(|snapshot| {
            let pipelines = store.load_pipelines()?;
            Ok((snapshot, pipelines))
        });
        match rebuilt {
            Ok((mut snapshot, pipelines)) => {
                keep_counters(&mut snapshot, &inner.core);
                inner.core = Core::restore(self.config.clone(), snapshot, now_ms());
                match Pipelines::restore(pipelines) {
                    Ok(mut p) => {
                        p.continue_ids_from(inner.pipelines.next_id());
                        inner.pipelines = p;
                    }
                    Err(reason) if log => {
                        tracing::error!(%reason, "pipelines cannot be rebuilt from the store")
                    }
                    Err(_) => {}
                }
            }
            Err(e) if log => {
                tracing::error!(error = %e, "reloading the core from the store failed")
            }
            Err(_) => {}
        }
    }

    /// Wakes the agents whose desired state moved. A version only ever rises, whatever order
    /// concurrent calls publish in.
    fn publish(&self, moved: Vec<(String, u64)>) {
        if moved.is_empty() {
            return;
        }
        let mut versions = lock(&self.versions);
        for (node, version) in moved {
            versions
                .entry(node)
                .and_modify(|tx| {
                    tx.send_if_modified(|v| {
                        let newer = version > *v;
                        if newer {
                            *v = version;
                        }
                        newer
                    });
                })
                .or_insert_with(|| watch::channel(version).0);
        }
    }

    /// Reads the core at the current time. What it reads was saved: if calls before it are
    /// still being written, it waits for them, and if their write fails (which takes their
    /// changes back), it reads again what the store holds. (A write refused because another
    /// coordinator leads takes nothing back: the leadership drops this core instead.)
    pub fn read<T>(&self, f: impl Fn(&Core, UnixMillis) -> T) -> T {
        self.read_saved(|inner| f(&inner.core, now_ms()))
    }

    /// Reads the core and the pipeline runs; what it reads was saved, as with
    /// [`Cluster::read`]. So what the store holds beside them (the images a finished step's
    /// jobs ran, written in the same batch as their end) is there to be read after.
    pub fn read_pipelines<T>(&self, f: impl Fn(&Core, &Pipelines) -> T) -> T {
        self.read_saved(|inner| f(&inner.core, &inner.pipelines))
    }

    /// Reads the core as it is in memory, which may run ahead of the store by the batch
    /// being written, or by one whose write is failing and is about to be taken back: for
    /// what monitors read (`/metrics`, Prometheus' targets), which must not wait for commits.
    /// Nothing a client acts on reads this way.
    pub fn peek<T>(&self, f: impl FnOnce(&Core) -> T) -> T {
        f(&lock(&self.inner).core)
    }

    /// Reads what the core holds once the batches staged before the read are written. The
    /// usual way reads first and then waits; if a batch it waited for failed, the core has
    /// been rebuilt from the store since, and the read is made again by [`Cluster::with_saved`],
    /// once: however long writes keep failing, a read reads at most twice.
    fn read_saved<T>(&self, f: impl Fn(&Inner) -> T) -> T {
        let (value, seq) = {
            let inner = lock(&self.inner);
            let seq = lock(&self.queue).staged;
            (f(&inner), seq)
        };
        match self.durable_blocking(seq) {
            Ok(()) => value,
            // What `f` read may be a change taken back.
            Err(_) => in_place(|| self.with_saved(|_, inner| f(inner))),
        }
    }

    /// Runs `f` on the store and a core that matches it: holding both, so that nothing is
    /// written or staged meanwhile, it writes what is queued (or, if that fails, rebuilds the
    /// core from the store) first. For reads that must not show a change a failed write
    /// takes back, whatever the writes do; it holds up the core's callers for one write.
    fn with_saved<T>(&self, f: impl FnOnce(&Store, &Inner) -> T) -> T {
        let mut store = lock(&self.store);
        let mut inner = lock(&self.inner);
        self.write_queued(&mut store, Some(&mut inner), false);
        f(&store, &inner)
    }

    /// A receiver of `node`'s desired-state version, or `None` for an unknown node.
    pub fn watch(&self, node: &str) -> Option<watch::Receiver<u64>> {
        lock(&self.versions).get(node).map(|tx| tx.subscribe())
    }

    /// Queries the store alone, without holding up the core's callers.
    pub fn query_store<T>(&self, f: impl FnOnce(&Store) -> T) -> T {
        f(&lock(&self.store))
    }

    /// Reads the store beside the core (accounting queries: the ended leases the store holds
    /// and the running ones the core does), both as saved.
    pub fn read_store<T>(&self, f: impl FnOnce(&Store, &Core, UnixMillis) -> T) -> T {
        in_place(|| self.with_saved(|store, inner| f(store, &inner.core, now_ms())))
    }

    /// When the core next wants a tick.
    pub fn next_deadline(&self) -> Option<UnixMillis> {
        let inner = lock(&self.inner);
        let core = &inner.core;
        // Observations waiting for a decision: once the heartbeats' spacing has passed.
        let pending = core
            .decision_pending()
            .then(|| core.decided_at().unwrap_or_default() + self.decision_interval_ms());
        core.next_decision_deadline()
            .into_iter()
            .chain(pending)
            .chain(inner.pipelines.next_deadline())
            .min()
    }

    fn decision_interval_ms(&self) -> u64 {
        let spacing_ms = self.decision_us.load(Ordering::Relaxed) * DECISION_SPACING / 1_000;
        DECISION_INTERVAL_MS.max(spacing_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A coordinator told to stop (SIGTERM) may have a successor up on the same data at
    /// once: from that moment it decides nothing (the ticker ends: no lease expiry, no new
    /// desired state) and changes nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn once_shutdown_begins_nothing_is_decided_or_changed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let cluster = Arc::new(
            Cluster::open(CoreConfig::default(), AccountingConfig::default(), store).unwrap(),
        );
        let spec: nightshift_common::JobSpec =
            serde_json::from_str(r#"{"name": "a", "image": "trainer:1", "gpus": 1}"#).unwrap();
        cluster
            .apply(|core, now| core.submit(now, spec.clone()))
            .unwrap();
        let ticker = tokio::spawn(crate::server::tick(cluster.clone()));
        assert_eq!(cluster.unhealthy(), None);

        cluster.begin_shutdown();
        tokio::time::timeout(std::time::Duration::from_secs(2), ticker)
            .await
            .expect("the ticker still decides after shutdown began")
            .unwrap();
        let refused = cluster.apply(|core, now| core.submit(now, spec.clone()));
        assert!(
            matches!(refused, Err(ApplyError::ShuttingDown)),
            "{refused:?}"
        );
        let heartbeat = cluster
            .apply_async(|core, now| {
                cluster.decide(core, now);
                Ok(())
            })
            .await;
        assert!(matches!(heartbeat, Err(ApplyError::ShuttingDown)));
        assert_eq!(cluster.read(|core, _| core.jobs().len()), 1);
        // Long-polls waiting on it end at once; `/healthz` says why.
        tokio::time::timeout(std::time::Duration::from_millis(100), cluster.stopped())
            .await
            .unwrap();
        assert_eq!(cluster.unhealthy().as_deref(), Some("shutting down"));
    }

    /// A write that fails takes back the changes it carried, but not the ids they were
    /// given: the job id, lease id, fencing epoch and pipeline run id handed out by the lost
    /// changes are never handed out again, though the store never saved them. The write
    /// fails for real: another connection holds the database's write lock for longer than
    /// the store waits for it (its busy timeout, 5 s).
    #[test]
    fn a_failed_write_hands_out_no_id_twice() {
        use nightshift_common::{
            GpuInfo, Heartbeat, JobRun, JobRunState, JobSpec, LeaseGrant, ReplicaState,
            ReplicaStatus,
        };
        use nightshift_core::{ScaleDown, ServicePolicy};
        const WORKFLOW: &str = "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  \
            name: w\nspec:\n  entrypoint: main\n  templates:\n  - name: main\n    dag:\n      \
            tasks:\n      - {name: A, template: echo}\n  - name: echo\n    container:\n      \
            image: busybox\n";
        let dir = tempfile::tempdir().unwrap();
        let config = CoreConfig {
            services: vec![ServicePolicy {
                name: "chat".into(),
                min_replicas: 0,
                cooldown_ms: 0,
                scale_down: ScaleDown {
                    window_ms: 200,
                    ..ScaleDown::default()
                },
                ..ServicePolicy::default()
            }],
            ..CoreConfig::default()
        };
        let store = Store::open(dir.path()).unwrap();
        let cluster = Cluster::open(config, AccountingConfig::default(), store).unwrap();
        let spec = |name: &str| -> JobSpec {
            serde_json::from_value(
                serde_json::json!({"name": name, "image": "trainer:1", "gpus": 1}),
            )
            .unwrap()
        };
        let gpus = (0..4)
            .map(|index| GpuInfo {
                index,
                uuid: format!("GPU-{index}"),
                name: "t".into(),
                memory_total_bytes: 1,
            })
            .collect();
        cluster
            .apply(|core, now| core.register(now, "n1", "chat", gpus))
            .unwrap();
        cluster
            .apply(|core, now| core.submit(now, spec("first")))
            .unwrap();
        // The idle node is lent; once its replica is stopped, the job is leased to it.
        let beat = |replica, applied, lease: Option<&LeaseGrant>| {
            let runs = lease.map(|l| JobRun {
                job_id: l.job_id,
                attempt: l.attempt,
                lease_id: l.lease_id,
                epoch: l.epoch,
                gpus: l.gpus.clone(),
                state: JobRunState::Running,
                last_checkpoint_at: None,
                outputs: Default::default(),
                image_id: None,
                image_digest: None,
                ready: false,
            });
            Heartbeat::report(
                ReplicaStatus::idle(replica),
                runs.into_iter().collect(),
                applied,
            )
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut applied = 0;
        let first = loop {
            let replica = if applied == 0 {
                ReplicaState::Serving
            } else {
                ReplicaState::Stopped
            };
            let desired = cluster
                .apply(|core, now| {
                    core.heartbeat(now, "n1", beat(replica, applied, None))?;
                    Ok(core.desired("n1").unwrap())
                })
                .unwrap();
            if !desired.serve {
                applied = desired.version;
            }
            if let Some(l) = desired.leases.first() {
                break l.clone();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no lease: {desired:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        // One more job, leased at once, and a pipeline run, in one batch of changes: the ids
        // each was given.
        let give = |core: &mut Core,
                    pipelines: &mut Pipelines,
                    now: UnixMillis,
                    name: &str|
         -> Result<[u64; 4], CoreError> {
            core.heartbeat(
                now,
                "n1",
                beat(ReplicaState::Stopped, applied, Some(&first)),
            )?;
            let job = core.submit(now, spec(name))?;
            cluster.decide(core, now);
            let lease = core
                .job(job)
                .and_then(|j| j.leases.first().cloned())
                .expect("the job is leased at once");
            let run = pipelines
                .submit(now, "wf.yaml", WORKFLOW, Default::default())
                .unwrap();
            Ok([job, lease.lease_id, lease.epoch, run])
        };

        let blocker = rusqlite::Connection::open(dir.path().join("nightshift.db")).unwrap();
        blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
        let mut lost = None;
        let failed = cluster.apply_with_pipelines(|core, pipelines, now| {
            lost = Some(give(core, pipelines, now, "lost")?);
            Ok(())
        });
        assert!(matches!(failed, Err(ApplyError::Store(_))), "{failed:?}");
        let lost = lost.unwrap();
        assert_eq!(cluster.read(|core, _| core.job(lost[0])), None);
        drop(blocker);

        let saved = cluster
            .apply_with_pipelines(|core, pipelines, now| give(core, pipelines, now, "saved"))
            .unwrap();
        let names = ["job id", "lease id", "epoch", "pipeline run id"];
        for ((name, lost), saved) in names.iter().zip(lost).zip(saved) {
            assert!(
                saved > lost,
                "{name} {saved} handed out again: the failed write had given it"
            );
        }
    }

    #[test]
    fn a_read_of_the_pipelines_waits_for_what_was_queued_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let cluster =
            Cluster::open(CoreConfig::default(), AccountingConfig::default(), store).unwrap();
        let image = |store: &Store| store.image_ids(&[7]).unwrap().get(&7).cloned();
        // A heartbeat's image record, queued for the next commit, as a step's end would be
        // staged beside it.
        cluster.enqueue(Changes {
            images: vec![ImageRecord {
                job: 7,
                attempt: 1,
                node: "a".into(),
                image_id: "sha256:aa".into(),
                image_digest: None,
                at: 1,
            }],
            ..Changes::default()
        });
        assert_eq!(cluster.query_store(image), None, "not written yet");
        // What a pipeline view reads is saved, so the images read beside it are there.
        cluster.read_pipelines(|_, _| ());
        assert_eq!(cluster.query_store(image), Some("sha256:aa".into()));
        // `/metrics` reads without waiting.
        cluster.enqueue(Changes {
            images: vec![ImageRecord {
                job: 7,
                attempt: 2,
                node: "a".into(),
                image_id: "sha256:bb".into(),
                image_digest: None,
                at: 2,
            }],
            ..Changes::default()
        });
        cluster.peek(|_| ());
        assert_eq!(cluster.query_store(image), Some("sha256:aa".into()));
    }
}
