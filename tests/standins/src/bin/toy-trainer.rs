//! `toy-trainer`: a toy training job that follows nightshift's job container contract.
//!
//! It counts "steps" at a fixed rate, checkpoints every N steps and when told to stop, resumes
//! from its newest complete checkpoint when started again, and on reaching its target step writes
//! output parameter files. It is what the integration tests lend GPUs to: it shows whether a
//! reclaim checkpointed in time, whether a requeued job resumed, and whether a job that ignores
//! the checkpoint signal is killed after the grace period. std and libc only, so it links
//! statically into a `FROM scratch` image.
//!
//! # Environment
//!
//! | Variable | Default | Meaning |
//! |---|---|---|
//! | `NIGHTSHIFT_CHECKPOINT_DIR` | `/nightshift/checkpoint` | checkpoints and the start counter |
//! | `NIGHTSHIFT_OUTPUT_DIR` | `/nightshift/outputs` | output parameter files |
//! | `NIGHTSHIFT_JOB_ID` | empty | logged only |
//! | `NIGHTSHIFT_ATTEMPT` | empty | logged only |
//! | `NIGHTSHIFT_EPOCH` | `0` | this attempt's fencing epoch: logged, and the output `epoch` |
//! | `NIGHTSHIFT_RESUMED_FROM_EPOCH` | `0` | whose checkpoint the agent copied in: the output `resumed_from_epoch` |
//! | `TRAINER_TARGET_STEP` | `1000` | the step at which the job is finished |
//! | `TRAINER_STEPS_PER_SEC` | `100` | step rate (a positive number, fractions allowed) |
//! | `TRAINER_CHECKPOINT_EVERY` | `100` | checkpoint every this many steps |
//! | `TRAINER_CHECKPOINT_DELAY_MS` | `0` | how long writing one checkpoint takes |
//! | `TRAINER_IGNORE_SIGTERM` | unset | `1`: ignore SIGTERM, SIGINT and SIGUSR1 entirely |
//! | `TRAINER_RENDEZVOUS` | unset | `1`: train as a gang when `NNODES` > 1 (see [Gang mode](#gang-mode)) |
//! | `NNODES`, `NODE_RANK` | | the gang's size and this member's rank (`WORLD_SIZE`, `RANK` when unset) |
//! | `MASTER_ADDR`, `MASTER_PORT` | | where the other ranks reach rank 0 |
//! | `TRAINER_RENDEZVOUS_TIMEOUT_SECS` | `300` | how long the gang may take to meet |
//! | `TRAINER_PEER_TIMEOUT_SECS` | `60` | how long a peer may stay silent in a step (more than a checkpoint takes) |
//!
//! # Checkpoints
//!
//! A checkpoint is `step-XXXXXXXX.ckpt` (eight or more digits) whose content is the step number.
//! It is written as `step-XXXXXXXX.tmp`, synced, then renamed, so a kill mid-checkpoint leaves at
//! most a stale `.tmp` (removed at the next start). Only the newest three are kept. The start
//! counter is the file `attempts` in the same directory.
//!
//! # Behaviour and exit codes
//!
//! - Start: prints `resumed from step N` (newest complete checkpoint) or `starting fresh`.
//! - Every `TRAINER_CHECKPOINT_EVERY` steps: writes a checkpoint and prints a line.
//! - SIGTERM, SIGINT or SIGUSR1: checkpoints the current step, then exits with 128 + the signal
//!   number (143, 130, 138: "not finished").
//! - Target step: writes the final checkpoint and, in the output directory, `final_step`,
//!   `resumed_from_step` (where this last start resumed from, 0 when fresh), `attempts_seen`
//!   (starts counted so far), `epoch` and `resumed_from_epoch`, each holding just the number;
//!   exits 0.
//!
//! The checkpoint directory is this attempt's own: the agent copies the newest earlier
//! attempt's checkpoint into it before the start, so resuming needs nothing more than reading
//! it, and an earlier attempt still running elsewhere cannot overwrite it.
//! - Any I/O error: a message on stderr and exit 1. Bad configuration: exit 2.
//!
//! # Gang mode
//!
//! With `TRAINER_RENDEZVOUS=1` and `NNODES` > 1 the trainer is one member of a gang, like one
//! node's torchrun agent (the gang's size is `NNODES`, not `WORLD_SIZE`, which counts processes:
//! `NNODES` × `NPROC_PER_NODE`). Rank 0 listens on `MASTER_PORT` on all interfaces, the others
//! connect to `MASTER_ADDR:MASTER_PORT` (retrying with a backoff of up to 2 s), and the gang
//! resumes from the newest checkpoint every rank holds; checkpoints newer than that are removed
//! (they belong to steps the gang takes again). Each step ends in a barrier at rank 0, so the
//! ranks advance in lock step, checkpoint at the same steps, and a stop signal sent to any one of
//! them makes all of them checkpoint the same step and exit with 128 + that signal. A signal during
//! the rendezvous exits at once (nothing to save). A rank that does not come within the
//! rendezvous timeout, or a peer that vanishes later, fails every rank with exit 1 and an error
//! naming it (as NCCL would). Outputs add `rank`, `nnodes` and `rounds` (steps taken in lock step
//! by this start). The protocol is in `src/rendezvous.rs`. Without `TRAINER_RENDEZVOUS=1` the
//! rendezvous variables are ignored and every member trains alone, as before: the agent's
//! one-engine gang test gives its members addresses they cannot reach.

use std::env::{self, VarError};
use std::fmt::Display;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use nightshift_standins::rendezvous::{self, Abort, Gang, Hello, Round, Settings};

/// How many complete checkpoints are kept.
const KEEP_CHECKPOINTS: usize = 3;
/// The start counter's file name, in the checkpoint directory.
const ATTEMPTS_FILE: &str = "attempts";
/// The longest the step loop sleeps before looking at the signal flag again.
const POLL: Duration = Duration::from_millis(20);

/// The first stop signal received (0: none yet); set by the signal handler.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

#[derive(Debug, Clone)]
struct Config {
    checkpoint_dir: PathBuf,
    output_dir: PathBuf,
    job_id: String,
    attempt: String,
    epoch: u64,
    resumed_from_epoch: u64,
    target_step: u64,
    steps_per_sec: f64,
    checkpoint_every: u64,
    checkpoint_delay: Duration,
    ignore_signals: bool,
    /// Set in gang mode.
    gang: Option<Settings>,
}

impl Config {
    fn from_env() -> Result<Config, String> {
        let cfg = Config {
            checkpoint_dir: var("NIGHTSHIFT_CHECKPOINT_DIR", "/nightshift/checkpoint".into())?,
            output_dir: var("NIGHTSHIFT_OUTPUT_DIR", "/nightshift/outputs".into())?,
            job_id: var("NIGHTSHIFT_JOB_ID", String::new())?,
            attempt: var("NIGHTSHIFT_ATTEMPT", String::new())?,
            epoch: var("NIGHTSHIFT_EPOCH", 0)?,
            resumed_from_epoch: var("NIGHTSHIFT_RESUMED_FROM_EPOCH", 0)?,
            target_step: var("TRAINER_TARGET_STEP", 1000)?,
            steps_per_sec: var("TRAINER_STEPS_PER_SEC", 100.0)?,
            checkpoint_every: var("TRAINER_CHECKPOINT_EVERY", 100)?,
            checkpoint_delay: Duration::from_millis(var("TRAINER_CHECKPOINT_DELAY_MS", 0)?),
            ignore_signals: var::<String>("TRAINER_IGNORE_SIGTERM", String::new())? == "1",
            gang: gang_settings()?,
        };
        if !(cfg.steps_per_sec.is_finite() && cfg.steps_per_sec > 0.0) {
            return Err("TRAINER_STEPS_PER_SEC must be a positive number".to_owned());
        }
        if cfg.checkpoint_every == 0 {
            return Err("TRAINER_CHECKPOINT_EVERY must be at least 1".to_owned());
        }
        Ok(cfg)
    }
}

/// The gang this member belongs to: `None` unless `TRAINER_RENDEZVOUS=1` and `NNODES` > 1.
fn gang_settings() -> Result<Option<Settings>, String> {
    match var::<String>("TRAINER_RENDEZVOUS", String::new())?.as_str() {
        "" | "0" => return Ok(None),
        "1" => {}
        other => return Err(format!("TRAINER_RENDEZVOUS must be 0 or 1, not {other:?}")),
    }
    let nnodes: u32 = var("NNODES", var("WORLD_SIZE", 1)?)?;
    if nnodes <= 1 {
        return Ok(None);
    }
    let rank: u32 = var("NODE_RANK", var("RANK", u32::MAX)?)?;
    if rank >= nnodes {
        return Err(format!(
            "NODE_RANK must be set and below NNODES ({nnodes}) in gang mode"
        ));
    }
    let master_addr: String = var("MASTER_ADDR", String::new())?;
    let master_port: u16 = var("MASTER_PORT", 0)?;
    if master_addr.is_empty() || master_port == 0 {
        return Err("gang mode needs MASTER_ADDR and a non-zero MASTER_PORT".to_owned());
    }
    let seconds = |name: &str, default: f64| -> Result<Duration, String> {
        let s: f64 = var(name, default)?;
        Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| format!("{name} must be a positive number of seconds"))
    };
    Ok(Some(Settings {
        rank,
        nnodes,
        master_addr,
        master_port,
        rendezvous_timeout: seconds("TRAINER_RENDEZVOUS_TIMEOUT_SECS", 300.0)?,
        peer_timeout: seconds("TRAINER_PEER_TIMEOUT_SECS", 60.0)?,
    }))
}

/// Reads and parses one variable; unset or blank means `default`.
fn var<T>(name: &str, default: T) -> Result<T, String>
where
    T: FromStr,
    T::Err: Display,
{
    match env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(default),
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|e| format!("invalid {name}={v:?}: {e}")),
        Err(VarError::NotPresent) => Ok(default),
        Err(VarError::NotUnicode(_)) => Err(format!("{name} is not valid UTF-8")),
    }
}

fn main() -> ExitCode {
    let cfg = match Config::from_env() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("toy-trainer: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = install_signal_handlers(cfg.ignore_signals) {
        eprintln!("toy-trainer: cannot install signal handlers: {e}");
        return ExitCode::FAILURE;
    }
    match run(&cfg) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("toy-trainer: {e}");
            ExitCode::FAILURE
        }
    }
}

extern "C" fn on_stop_signal(signum: libc::c_int) {
    // Async-signal-safe: one atomic operation. The first signal wins.
    let _ = SIGNAL.compare_exchange(0, signum, Ordering::SeqCst, Ordering::SeqCst);
}

/// Handles (or, with `ignore`, ignores) SIGTERM, SIGINT and SIGUSR1.
fn install_signal_handlers(ignore: bool) -> io::Result<()> {
    let handler = if ignore {
        libc::SIG_IGN
    } else {
        on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t
    };
    for signum in [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1] {
        // SAFETY: `action` is zeroed and then filled in; the handler only does an atomic store.
        #[allow(unsafe_code)]
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handler;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signum, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn signal_name(signum: i32) -> &'static str {
    match signum {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGUSR1 => "SIGUSR1",
        _ => "signal",
    }
}

/// Trains to the target or to a stop signal; returns the exit code.
fn run(cfg: &Config) -> Result<u8, String> {
    let dir = &cfg.checkpoint_dir;
    create_dir(dir)?;
    create_dir(&cfg.output_dir)?;
    remove_stale_tmp(dir)?;
    let attempts_seen = bump_attempts(dir)?;

    println!(
        "toy-trainer: job={:?} attempt={:?} epoch={} target_step={} steps_per_sec={} checkpoint_every={} start={attempts_seen}",
        cfg.job_id,
        cfg.attempt,
        cfg.epoch,
        cfg.target_step,
        cfg.steps_per_sec,
        cfg.checkpoint_every
    );
    let (resumed, gang) = match &cfg.gang {
        None => {
            let resumed = latest_checkpoint(dir)?;
            match resumed {
                Some(step) => println!(
                    "resumed from step {step} (the checkpoint of epoch {})",
                    cfg.resumed_from_epoch
                ),
                None => println!("starting fresh"),
            }
            (resumed, None)
        }
        Some(settings) => match meet(cfg, settings)? {
            Met::Gang(start, gang) => (start, Some(gang)),
            Met::Stopped(code) => return Ok(code),
        },
    };
    let resumed_from = resumed.unwrap_or(0);
    let mut training = Training {
        step: resumed_from,
        last_checkpoint: resumed,
        rounds: 0,
    };
    let finished = match gang {
        None => train_alone(cfg, &mut training)?,
        Some(mut gang) => train_in_gang(cfg, &mut gang, &mut training)?,
    };
    if let Some(code) = finished {
        return Ok(code);
    }
    let step = training.step;

    if training.last_checkpoint != Some(step) {
        write_checkpoint(dir, step, cfg.checkpoint_delay)?;
    }
    write_output(&cfg.output_dir, "final_step", step)?;
    write_output(&cfg.output_dir, "resumed_from_step", resumed_from)?;
    write_output(&cfg.output_dir, "attempts_seen", attempts_seen)?;
    write_output(&cfg.output_dir, "epoch", cfg.epoch)?;
    write_output(
        &cfg.output_dir,
        "resumed_from_epoch",
        cfg.resumed_from_epoch,
    )?;
    if let Some(settings) = &cfg.gang {
        write_output(&cfg.output_dir, "rank", settings.rank.into())?;
        write_output(&cfg.output_dir, "nnodes", settings.nnodes.into())?;
        write_output(&cfg.output_dir, "rounds", training.rounds)?;
    }
    println!(
        "finished at step {step} (resumed from step {resumed_from}, start {attempts_seen}); outputs in {}",
        cfg.output_dir.display()
    );
    Ok(0)
}

/// Where training stands.
struct Training {
    step: u64,
    last_checkpoint: Option<u64>,
    /// Steps taken in lock step with the gang by this start.
    rounds: u64,
}

/// Trains alone until the target (`None`) or a stop signal (`Some(exit code)`).
fn train_alone(cfg: &Config, t: &mut Training) -> Result<Option<u8>, String> {
    let dir = &cfg.checkpoint_dir;
    let resumed_from = t.step;
    let started = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / cfg.steps_per_sec);
    while t.step < cfg.target_step {
        let signum = SIGNAL.load(Ordering::SeqCst);
        if signum != 0 {
            if t.last_checkpoint != Some(t.step) {
                write_checkpoint(dir, t.step, cfg.checkpoint_delay)?;
            }
            let code = 128 + signum as u8;
            println!(
                "received {} at step {}: checkpointed, exiting with {code} (not finished)",
                signal_name(signum),
                t.step
            );
            return Ok(Some(code));
        }
        // Steps are due on a fixed schedule from the start, so checkpoints do not slow the rate.
        let due = started + interval.mul_f64((t.step - resumed_from + 1) as f64);
        let now = Instant::now();
        if now < due {
            thread::sleep((due - now).min(POLL));
            continue;
        }
        t.step += 1;
        if t.step.is_multiple_of(cfg.checkpoint_every) && t.step < cfg.target_step {
            write_checkpoint(dir, t.step, cfg.checkpoint_delay)?;
            t.last_checkpoint = Some(t.step);
        }
    }
    Ok(None)
}

/// How a gang's rendezvous ended.
enum Met {
    /// The gang met and resumes from this checkpoint (`None`: fresh).
    Gang(Option<u64>, Gang),
    /// A stop signal came first: exit with this code.
    Stopped(u8),
}

/// Meets the gang and agrees on the step to resume from.
fn meet(cfg: &Config, settings: &Settings) -> Result<Met, String> {
    let dir = &cfg.checkpoint_dir;
    let steps = complete_checkpoint_steps(dir)?;
    let hello = Hello {
        rank: settings.rank,
        nnodes: settings.nnodes,
        job: cfg.job_id.clone(),
        attempt: cfg.attempt.clone(),
        target: cfg.target_step,
        every: cfg.checkpoint_every,
        steps: steps.clone(),
    };
    let (gang, agreed) = match rendezvous::rendezvous(settings, &hello, &SIGNAL) {
        Ok(met) => met,
        Err(Abort::Signal(signum)) => {
            let code = 128 + signum as u8;
            println!(
                "received {} during the rendezvous: exiting with {code} (not finished)",
                signal_name(signum)
            );
            return Ok(Met::Stopped(code));
        }
        Err(Abort::Failed(e)) => return Err(e),
    };
    let newest: Vec<String> = agreed
        .newest
        .iter()
        .map(|n| n.map_or("none".to_owned(), |s| s.to_string()))
        .collect();
    println!(
        "rendezvous: the gang of {} met; newest checkpoints by rank: {}",
        settings.nnodes,
        newest.join(", ")
    );
    // Steps past the common one belong to steps the gang takes again: drop them, so that the
    // next start does not mistake them for this run's.
    for step in steps.into_iter().filter(|s| Some(*s) > agreed.start) {
        let path = dir.join(checkpoint_name(step));
        fs::remove_file(&path).map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
        println!("removed checkpoint step {step}: not every rank reached it",);
    }
    match agreed.start {
        Some(step) => println!(
            "resumed from step {step}, the gang's common checkpoint (the checkpoint of epoch {})",
            cfg.resumed_from_epoch
        ),
        None => println!("starting fresh: the gang shares no checkpoint"),
    }
    Ok(Met::Gang(agreed.start, gang))
}

/// Trains in lock step with the gang until the target (`None`) or a stop signal that any rank
/// got (`Some(exit code)`).
fn train_in_gang(cfg: &Config, gang: &mut Gang, t: &mut Training) -> Result<Option<u8>, String> {
    let dir = &cfg.checkpoint_dir;
    let resumed_from = t.step;
    let started = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / cfg.steps_per_sec);
    while t.step < cfg.target_step {
        // This rank's share of the step; a stop signal cuts it short, so the gang hears at once.
        let due = started + interval.mul_f64((t.step - resumed_from + 1) as f64);
        loop {
            let now = Instant::now();
            if now >= due || SIGNAL.load(Ordering::SeqCst) != 0 {
                break;
            }
            thread::sleep((due - now).min(POLL));
        }
        match gang.barrier(t.step)? {
            Round::Go => {
                t.step += 1;
                t.rounds += 1;
                if t.step.is_multiple_of(cfg.checkpoint_every) && t.step < cfg.target_step {
                    write_checkpoint(dir, t.step, cfg.checkpoint_delay)?;
                    t.last_checkpoint = Some(t.step);
                }
            }
            Round::Stop { signal, by } => {
                if t.last_checkpoint != Some(t.step) {
                    write_checkpoint(dir, t.step, cfg.checkpoint_delay)?;
                }
                let code = 128 + signal as u8;
                let who = if by == gang.rank() {
                    "this rank".to_owned()
                } else {
                    format!("rank {by}")
                };
                println!(
                    "{who} received {} at step {}: the gang checkpointed step {} together, exiting with {code} (not finished)",
                    signal_name(signal),
                    t.step,
                    t.step
                );
                return Ok(Some(code));
            }
        }
    }
    Ok(None)
}

fn create_dir(dir: &Path) -> Result<(), String> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// The file name of the checkpoint for `step`.
fn checkpoint_name(step: u64) -> String {
    format!("step-{step:08}.ckpt")
}

/// The step of a complete checkpoint's file name (`step-00000100.ckpt` → 100).
fn parse_checkpoint_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?.strip_suffix(".ckpt")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Steps of the complete checkpoints in `dir`, ascending.
fn checkpoint_steps(dir: &Path) -> Result<Vec<u64>, String> {
    let entries = fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut steps = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        if let Some(step) = entry.file_name().to_str().and_then(parse_checkpoint_name) {
            steps.push(step);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// Steps of the checkpoints whose content matches their name, ascending.
fn complete_checkpoint_steps(dir: &Path) -> Result<Vec<u64>, String> {
    let mut complete = Vec::new();
    for step in checkpoint_steps(dir)? {
        let path = dir.join(checkpoint_name(step));
        match fs::read_to_string(&path).map(|s| s.trim().parse::<u64>()) {
            Ok(Ok(content)) if content == step => complete.push(step),
            _ => eprintln!(
                "toy-trainer: ignoring unreadable checkpoint {}",
                path.display()
            ),
        }
    }
    Ok(complete)
}

/// The newest checkpoint whose content matches its name; unreadable ones are skipped.
fn latest_checkpoint(dir: &Path) -> Result<Option<u64>, String> {
    for step in checkpoint_steps(dir)?.into_iter().rev() {
        let path = dir.join(checkpoint_name(step));
        match fs::read_to_string(&path).map(|s| s.trim().parse::<u64>()) {
            Ok(Ok(content)) if content == step => return Ok(Some(step)),
            _ => eprintln!(
                "toy-trainer: ignoring unreadable checkpoint {}",
                path.display()
            ),
        }
    }
    Ok(None)
}

/// Removes `*.tmp` files a killed predecessor left behind.
fn remove_stale_tmp(dir: &Path) -> Result<(), String> {
    let entries = fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|ext| ext == "tmp") {
            fs::remove_file(&path)
                .map_err(|e| format!("cannot remove stale {}: {e}", path.display()))?;
            println!("removed stale {}", path.display());
        }
    }
    Ok(())
}

/// Writes `content` to `dir/name` atomically: a synced `.tmp` renamed over the target.
/// `delay` is spent between writing and renaming, like a slow checkpoint.
fn write_atomically(dir: &Path, name: &str, content: &str, delay: Duration) -> io::Result<()> {
    let tmp = dir.join(format!("{}.tmp", name.trim_end_matches(".ckpt")));
    let mut file = fs::File::create(&tmp)?;
    file.write_all(content.as_bytes())?;
    if !delay.is_zero() {
        thread::sleep(delay);
    }
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, dir.join(name))?;
    // Make the rename itself durable.
    fs::File::open(dir)?.sync_all()
}

/// Writes the checkpoint for `step` and keeps only the newest [`KEEP_CHECKPOINTS`].
fn write_checkpoint(dir: &Path, step: u64, delay: Duration) -> Result<(), String> {
    let name = checkpoint_name(step);
    write_atomically(dir, &name, &step.to_string(), delay)
        .map_err(|e| format!("cannot write checkpoint {}: {e}", dir.join(&name).display()))?;
    println!(
        "checkpoint step {step} written to {}",
        dir.join(&name).display()
    );
    let steps = checkpoint_steps(dir)?;
    for old in &steps[..steps.len().saturating_sub(KEEP_CHECKPOINTS)] {
        let path = dir.join(checkpoint_name(*old));
        fs::remove_file(&path).map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Increments the start counter in `dir` and returns the new value.
fn bump_attempts(dir: &Path) -> Result<u64, String> {
    let path = dir.join(ATTEMPTS_FILE);
    let seen = match fs::read_to_string(&path) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .map_err(|e| format!("corrupt start counter {}: {e}", path.display()))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let now = seen + 1;
    write_atomically(dir, ATTEMPTS_FILE, &now.to_string(), Duration::ZERO)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(now)
}

/// Writes one output parameter file holding just `value`.
fn write_output(dir: &Path, name: &str, value: u64) -> Result<(), String> {
    write_atomically(dir, name, &value.to_string(), Duration::ZERO)
        .map_err(|e| format!("cannot write output {}: {e}", dir.join(name).display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh, empty directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let path =
                env::temp_dir().join(format!("toy-trainer-test-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).expect("create temp dir");
            TempDir(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn checkpoint_names_round_trip() {
        assert_eq!(checkpoint_name(100), "step-00000100.ckpt");
        assert_eq!(checkpoint_name(123_456_789), "step-123456789.ckpt");
        assert_eq!(parse_checkpoint_name("step-00000100.ckpt"), Some(100));
        assert_eq!(
            parse_checkpoint_name("step-123456789.ckpt"),
            Some(123_456_789)
        );
        assert_eq!(parse_checkpoint_name("step-00000100.tmp"), None);
        assert_eq!(parse_checkpoint_name("step-100.ckpt"), None);
        assert_eq!(parse_checkpoint_name("step-0000010a.ckpt"), None);
        assert_eq!(parse_checkpoint_name("attempts"), None);
    }

    #[test]
    fn resumes_from_the_newest_complete_checkpoint() {
        let dir = TempDir::new("resume");
        assert_eq!(latest_checkpoint(&dir.0), Ok(None));
        for step in [100, 300, 200] {
            write_checkpoint(&dir.0, step, Duration::ZERO).expect("write");
        }
        // A half-written newer one and a corrupt newer one do not count.
        fs::write(dir.0.join("step-00000400.tmp"), "400").expect("write tmp");
        fs::write(dir.0.join(checkpoint_name(500)), "").expect("write corrupt");
        assert_eq!(latest_checkpoint(&dir.0), Ok(Some(300)));
        remove_stale_tmp(&dir.0).expect("remove tmp");
        assert!(!dir.0.join("step-00000400.tmp").exists());
    }

    #[test]
    fn keeps_only_the_last_three_checkpoints() {
        let dir = TempDir::new("retention");
        for step in (1..=6).map(|i| i * 10) {
            write_checkpoint(&dir.0, step, Duration::ZERO).expect("write");
        }
        assert_eq!(checkpoint_steps(&dir.0), Ok(vec![40, 50, 60]));
        assert_eq!(
            fs::read_to_string(dir.0.join(checkpoint_name(60)))
                .ok()
                .as_deref(),
            Some("60")
        );
    }

    #[test]
    fn counts_starts() {
        let dir = TempDir::new("attempts");
        assert_eq!(bump_attempts(&dir.0), Ok(1));
        assert_eq!(bump_attempts(&dir.0), Ok(2));
        assert_eq!(checkpoint_steps(&dir.0), Ok(vec![]));
    }
}
