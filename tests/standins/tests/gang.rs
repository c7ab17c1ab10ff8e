//! The toy trainer's gang mode, as real processes on 127.0.0.1 (no Docker): two ranks meet like
//! torchrun's rendezvous, train in lock step, checkpoint together on a stop signal sent to either
//! of them, resume from the step every rank holds, and fail with a named address when a peer is
//! missing or vanishes.

use std::env;
use std::fs;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Long enough for a loaded two-core machine; every wait ends as soon as its condition holds.
const PATIENCE: Duration = Duration::from_secs(30);

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let path = env::temp_dir().join(format!("toy-gang-{tag}-{}", std::process::id()));
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

/// A port nothing listens on now (the kernel's pick, released at once).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

/// One rank's files: its checkpoint and output directories and its stdout and stderr.
struct Rank {
    rank: u32,
    root: PathBuf,
}

impl Rank {
    fn new(dir: &TempDir, rank: u32) -> Rank {
        let root = dir.0.join(format!("rank{rank}"));
        fs::create_dir_all(&root).expect("create rank dir");
        Rank { rank, root }
    }

    fn checkpoints(&self) -> PathBuf {
        self.root.join("checkpoint")
    }

    fn outputs(&self) -> PathBuf {
        self.root.join("outputs")
    }

    fn output(&self, name: &str) -> u64 {
        let path = self.outputs().join(name);
        fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .trim()
            .parse()
            .expect("a number")
    }

    fn stdout(&self) -> String {
        fs::read_to_string(self.root.join("stdout")).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        fs::read_to_string(self.root.join("stderr")).unwrap_or_default()
    }

    /// The steps of the checkpoints in its directory, ascending.
    fn checkpoint_steps(&self) -> Vec<u64> {
        let mut steps: Vec<u64> = fs::read_dir(self.checkpoints())
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| {
                        let name = e.file_name().into_string().ok()?;
                        name.strip_prefix("step-")?
                            .strip_suffix(".ckpt")?
                            .parse()
                            .ok()
                    })
                    .collect()
            })
            .unwrap_or_default();
        steps.sort_unstable();
        steps
    }

    /// Starts this rank of a gang of `nnodes` whose rank 0 listens on `port`.
    fn start(&self, nnodes: u32, port: u16, env: &[(&str, &str)]) -> Running {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_toy-trainer"));
        cmd.env_clear()
            .env("NIGHTSHIFT_CHECKPOINT_DIR", self.checkpoints())
            .env("NIGHTSHIFT_OUTPUT_DIR", self.outputs())
            .env("NIGHTSHIFT_JOB_ID", "7")
            .env("NIGHTSHIFT_ATTEMPT", "1")
            .env("TRAINER_RENDEZVOUS", "1")
            .env("NNODES", nnodes.to_string())
            .env("NODE_RANK", self.rank.to_string())
            .env("NPROC_PER_NODE", "2")
            .env("WORLD_SIZE", (2 * nnodes).to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("TRAINER_RENDEZVOUS_TIMEOUT_SECS", "20")
            .env("TRAINER_PEER_TIMEOUT_SECS", "10")
            .env("TRAINER_STEPS_PER_SEC", "200")
            .env("TRAINER_CHECKPOINT_EVERY", "10");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let file = |name: &str| fs::File::create(self.root.join(name)).expect("create log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file("stdout"))
            .stderr(file("stderr"))
            .spawn()
            .expect("start toy-trainer");
        Running {
            child,
            rank: self.rank,
            root: self.root.clone(),
        }
    }
}

/// A running rank, killed on drop if it is still running.
struct Running {
    child: Child,
    rank: u32,
    root: PathBuf,
}

impl Running {
    /// Its exit code, waiting at most [`PATIENCE`].
    fn exit_code(&mut self) -> i32 {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return code(status, &self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "rank {} did not exit within {PATIENCE:?}:\n{}",
                self.rank,
                self.logs()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("wait").is_none()
    }

    fn signal(&self, signum: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: kill(2) takes no pointers. The pid is our own child's, and the tests signal
        // only children they have not reaped (by `exit_code`, `is_running` or drop) after they
        // exited, so it cannot name another process.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::kill(pid, signum) };
        assert_eq!(rc, 0, "kill rank {}", self.rank);
    }

    fn logs(&self) -> String {
        let read = |name: &str| fs::read_to_string(self.root.join(name)).unwrap_or_default();
        format!(
            "--- rank {} stdout\n{}--- stderr\n{}",
            self.rank,
            read("stdout"),
            read("stderr")
        )
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.is_running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn code(status: ExitStatus, logs: &str) -> i32 {
    status
        .code()
        .unwrap_or_else(|| panic!("killed by a signal: {status}\n{logs}"))
}

/// Waits until `cond` holds, at most [`PATIENCE`].
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_ranks_meet_and_train_in_lock_step() {
    let dir = TempDir::new("lockstep");
    let (r0, r1) = (Rank::new(&dir, 0), Rank::new(&dir, 1));
    let port = free_port();
    // Rank 0 could run its 60 steps in 60 ms; rank 1 takes 600 ms, and rank 0 keeps its pace.
    let target = [("TRAINER_TARGET_STEP", "60")];
    let mut p0 = r0.start(2, port, &[target[0], ("TRAINER_STEPS_PER_SEC", "1000")]);
    wait_until("rank 0 to listen", || r0.stdout().contains("listening on"));
    thread::sleep(Duration::from_millis(300));
    assert!(p0.is_running(), "rank 0 waits for rank 1:\n{}", p0.logs());
    assert!(
        r0.checkpoint_steps().is_empty(),
        "rank 0 takes no step alone"
    );
    let joined = Instant::now();
    let mut p1 = r1.start(2, port, &[target[0], ("TRAINER_STEPS_PER_SEC", "100")]);
    assert_eq!((p0.exit_code(), p1.exit_code()), (0, 0));
    let took = joined.elapsed();
    assert!(
        took >= Duration::from_millis(550),
        "rank 0 waited for the slow rank 1 every step ({took:?})"
    );
    for r in [&r0, &r1] {
        assert_eq!(r.output("final_step"), 60);
        assert_eq!(r.output("rounds"), 60);
        assert_eq!(r.output("resumed_from_step"), 0);
        assert_eq!(r.output("nnodes"), 2);
        assert_eq!(r.output("rank"), u64::from(r.rank));
        assert_eq!(r.checkpoint_steps(), [40, 50, 60]);
        assert!(r.stdout().contains("the gang of 2 met"), "{}", r.stdout());
    }
    assert!(
        r1.stdout()
            .contains(&format!("connected to rank 0 at 127.0.0.1:{port}"))
    );
    assert!(
        r0.stdout()
            .contains(&format!("listening on 0.0.0.0:{port}"))
    );
}

/// Starts a gang of two on a fresh port, waits until it has met and taken some steps.
fn start_gang(r0: &Rank, r1: &Rank, env: &[(&str, &str)]) -> (Running, Running) {
    let port = free_port();
    let p0 = r0.start(2, port, env);
    let p1 = r1.start(2, port, env);
    wait_until("the gang to meet", || {
        r0.stdout().contains("the gang of 2 met") && r1.stdout().contains("the gang of 2 met")
    });
    thread::sleep(Duration::from_millis(300));
    (p0, p1)
}

/// The single step both ranks checkpointed when stopped, checked to be the same.
fn common_stop_step(r0: &Rank, r1: &Rank, resumed_from: u64) -> u64 {
    let (s0, s1) = (r0.checkpoint_steps(), r1.checkpoint_steps());
    assert_eq!(s0, s1, "both ranks checkpointed the same steps");
    let step = *s0.last().expect("a checkpoint");
    assert!(step > resumed_from, "the gang made progress: {s0:?}");
    step
}

#[test]
fn a_signal_to_one_rank_checkpoints_the_gang_together_and_it_resumes_there() {
    let dir = TempDir::new("signal");
    let (r0, r1) = (Rank::new(&dir, 0), Rank::new(&dir, 1));
    // No periodic checkpoints: only the stop writes one.
    let slow = [
        ("TRAINER_TARGET_STEP", "1000000"),
        ("TRAINER_STEPS_PER_SEC", "100"),
        ("TRAINER_CHECKPOINT_EVERY", "1000000"),
    ];

    // SIGTERM to rank 1 only: both checkpoint the same step and exit 143.
    let (mut p0, mut p1) = start_gang(&r0, &r1, &slow);
    p1.signal(libc::SIGTERM);
    assert_eq!((p0.exit_code(), p1.exit_code()), (143, 143));
    let first = common_stop_step(&r0, &r1, 0);
    assert!(
        r0.stdout()
            .contains(&format!("rank 1 received SIGTERM at step {first}")),
        "{}",
        r0.stdout()
    );

    // Resumed, both start from it; SIGUSR1 to rank 0 stops them both again, with 138.
    let (mut p0, mut p1) = start_gang(&r0, &r1, &slow);
    p0.signal(libc::SIGUSR1);
    assert_eq!((p0.exit_code(), p1.exit_code()), (138, 138));
    for r in [&r0, &r1] {
        assert!(
            r.stdout()
                .contains(&format!("resumed from step {first}, the gang's common")),
            "{}",
            r.stdout()
        );
    }
    let second = common_stop_step(&r0, &r1, first);
    assert!(
        r1.stdout()
            .contains(&format!("rank 0 received SIGUSR1 at step {second}"))
    );

    // And a last start finishes 20 steps later, both from the common step.
    let target = (second + 20).to_string();
    let finish = [("TRAINER_TARGET_STEP", target.as_str())];
    let port = free_port();
    let (mut p0, mut p1) = (r0.start(2, port, &finish), r1.start(2, port, &finish));
    assert_eq!((p0.exit_code(), p1.exit_code()), (0, 0));
    for r in [&r0, &r1] {
        assert_eq!(r.output("resumed_from_step"), second);
        assert_eq!(r.output("final_step"), second + 20);
        assert_eq!(r.output("rounds"), 20);
    }
}

#[test]
fn the_gang_resumes_from_the_newest_checkpoint_every_rank_holds() {
    let dir = TempDir::new("common");
    let (r0, r1) = (Rank::new(&dir, 0), Rank::new(&dir, 1));
    // Rank 0 got one checkpoint further than rank 1 (say, rank 1 was killed mid-write).
    for (r, steps) in [(&r0, &[10, 20, 30][..]), (&r1, &[10, 20][..])] {
        fs::create_dir_all(r.checkpoints()).expect("mkdir");
        for step in steps {
            let path = r.checkpoints().join(format!("step-{step:08}.ckpt"));
            fs::write(path, step.to_string()).expect("write checkpoint");
        }
    }
    let port = free_port();
    let env = [("TRAINER_TARGET_STEP", "25")];
    let (mut p0, mut p1) = (r0.start(2, port, &env), r1.start(2, port, &env));
    assert_eq!((p0.exit_code(), p1.exit_code()), (0, 0));
    for r in [&r0, &r1] {
        assert_eq!(r.output("resumed_from_step"), 20);
        assert_eq!(r.output("rounds"), 5);
        assert_eq!(r.checkpoint_steps(), [10, 20, 25]);
        assert!(
            r.stdout().contains("newest checkpoints by rank: 30, 20"),
            "{}",
            r.stdout()
        );
    }
    assert!(
        r0.stdout()
            .contains("removed checkpoint step 30: not every rank reached it")
    );
}

#[test]
fn a_missing_rank_zero_times_out_naming_its_address() {
    let dir = TempDir::new("no-rank0");
    let r1 = Rank::new(&dir, 1);
    let port = free_port();
    let started = Instant::now();
    let mut p1 = r1.start(2, port, &[("TRAINER_RENDEZVOUS_TIMEOUT_SECS", "1")]);
    assert_eq!(p1.exit_code(), 1);
    assert!(started.elapsed() < Duration::from_secs(10));
    let err = r1.stderr();
    assert!(
        err.contains(&format!("could not reach rank 0 at 127.0.0.1:{port}"))
            && err.contains("timed out after 1 s")
            && err.contains("Connection refused"),
        "{err}"
    );
}

#[test]
fn rank_zero_alone_times_out_naming_the_ranks_that_never_came() {
    let dir = TempDir::new("no-rank1");
    let r0 = Rank::new(&dir, 0);
    let port = free_port();
    let mut p0 = r0.start(3, port, &[("TRAINER_RENDEZVOUS_TIMEOUT_SECS", "1")]);
    assert_eq!(p0.exit_code(), 1);
    let err = r0.stderr();
    assert!(
        err.contains(&format!("listened on 0.0.0.0:{port}"))
            && err.contains("1 of 3 ranks joined; rank(s) 1, 2 never came"),
        "{err}"
    );
}

#[test]
fn a_vanished_peer_fails_every_rank() {
    let dir = TempDir::new("vanish");
    let (r0, r1) = (Rank::new(&dir, 0), Rank::new(&dir, 1));
    let forever = [("TRAINER_TARGET_STEP", "1000000")];

    // Rank 1 dies: rank 0 fails at once, long before the peer timeout.
    let (mut p0, p1) = start_gang(&r0, &r1, &forever);
    p1.signal(libc::SIGKILL);
    let started = Instant::now();
    assert_eq!(p0.exit_code(), 1);
    assert!(started.elapsed() < Duration::from_secs(5));
    let err = r0.stderr();
    assert!(
        err.contains("lost rank 1 (from 127.0.0.1:")
            && err.contains("a member of the gang is gone"),
        "{err}"
    );

    // Rank 0 dies: rank 1 fails, naming the address it reached rank 0 at.
    let (p0, mut p1) = start_gang(&r0, &r1, &forever);
    p0.signal(libc::SIGKILL);
    assert_eq!(p1.exit_code(), 1);
    let err = r1.stderr();
    let master = format!(
        "lost rank 0 at 127.0.0.1:{}",
        r1.stdout()
            .lines()
            .rev()
            .find_map(|l| l.split("rank 0 at 127.0.0.1:").nth(1))
            .and_then(|rest| rest.split(' ').next())
            .expect("the connect line")
    );
    assert!(err.contains(&master), "{err}");
}

#[test]
fn a_silent_peer_fails_the_gang_after_the_peer_timeout() {
    let dir = TempDir::new("silent");
    let (r0, r1) = (Rank::new(&dir, 0), Rank::new(&dir, 1));
    let env = [
        ("TRAINER_TARGET_STEP", "1000000"),
        ("TRAINER_PEER_TIMEOUT_SECS", "1"),
    ];
    // A stopped process keeps its connection open but says nothing, like a hung host.
    let (mut p0, p1) = start_gang(&r0, &r1, &env);
    p1.signal(libc::SIGSTOP);
    assert_eq!(p0.exit_code(), 1);
    let err = r0.stderr();
    assert!(
        err.contains("lost rank 1 (from 127.0.0.1:") && err.contains("nothing arrived for 1"),
        "{err}"
    );
}

#[test]
fn rank_zero_refuses_a_member_of_another_attempt() {
    let dir = TempDir::new("stranger");
    let (r0, r1) = (Rank::new(&dir, 0), Rank::new(&dir, 1));
    let port = free_port();
    let timeout = ("TRAINER_RENDEZVOUS_TIMEOUT_SECS", "2");
    let mut p0 = r0.start(2, port, &[timeout]);
    let mut p1 = r1.start(2, port, &[timeout, ("NIGHTSHIFT_ATTEMPT", "2")]);
    assert_eq!((p1.exit_code(), p0.exit_code()), (1, 1));
    assert!(
        r1.stderr().contains(&format!(
            "rank 0 at 127.0.0.1:{port} refused rank 1: it runs job \"7\" attempt \"2\", rank 0 runs job \"7\" attempt \"1\""
        )),
        "{}",
        r1.stderr()
    );
    assert!(
        r0.stderr().contains("rank(s) 1 never came"),
        "{}",
        r0.stderr()
    );
}

#[test]
fn a_signal_during_the_rendezvous_exits_at_once() {
    let dir = TempDir::new("early-signal");
    let r1 = Rank::new(&dir, 1);
    let mut p1 = r1.start(2, free_port(), &[]);
    // The handlers are in place once it has printed its first line.
    wait_until("rank 1 to start", || {
        r1.stdout().contains("toy-trainer: job=")
    });
    thread::sleep(Duration::from_millis(300));
    p1.signal(libc::SIGTERM);
    assert_eq!(p1.exit_code(), 143);
    assert!(
        r1.stdout()
            .contains("received SIGTERM during the rendezvous"),
        "{}",
        r1.stdout()
    );
    assert!(r1.checkpoint_steps().is_empty());
}

#[test]
fn without_trainer_rendezvous_a_member_trains_alone() {
    let dir = TempDir::new("alone");
    let r1 = Rank::new(&dir, 1);
    let mut p1 = r1.start(
        2,
        free_port(),
        &[("TRAINER_RENDEZVOUS", ""), ("TRAINER_TARGET_STEP", "20")],
    );
    assert_eq!(p1.exit_code(), 0);
    assert_eq!(r1.output("final_step"), 20);
    assert!(!r1.outputs().join("rounds").exists());
    let out = r1.stdout();
    assert!(
        out.contains("starting fresh") && !out.contains("rendezvous"),
        "{out}"
    );
}

#[test]
fn gang_mode_needs_a_rank_below_nnodes() {
    let dir = TempDir::new("bad-rank");
    let r = Rank::new(&dir, 2);
    let mut p = r.start(2, free_port(), &[]);
    assert_eq!(p.exit_code(), 2);
    assert!(
        r.stderr()
            .contains("NODE_RANK must be set and below NNODES (2)")
    );
}
