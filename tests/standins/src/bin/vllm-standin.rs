//! `vllm-standin`: a small, faithful stand-in for vLLM's OpenAI-compatible server.
//!
//! It behaves like `vllm serve` as far as nightshift can observe: the port stays closed while the
//! "model" loads (clients get connection refused, not 503), requests compete for a fixed number of
//! sequence slots with a FIFO queue behind them, tokens come out at a fixed latency, `/metrics`
//! speaks vLLM V1's Prometheus names, HELP texts and labels verbatim (copied from a real 0.19.1
//! scrape), the dev-mode sleep endpoints put the engine to sleep and wake it up, and SIGTERM drains
//! like `--shutdown-timeout`. It is built from std and libc only so that it links statically into
//! a `FROM scratch` image.
//!
//! # Configuration (environment variables)
//!
//! | Variable | Default | Meaning |
//! |---|---|---|
//! | `STANDIN_PORT` | `8000` | TCP port, bound once loading is done |
//! | `STANDIN_HOST` | `0.0.0.0` | the address it binds (an IP address, as vLLM's `--host`; on the host's network, `127.0.0.1` keeps it off the host's interfaces) |
//! | `STANDIN_MODEL` | `standin-model` | served model name (`model_name` label, `/v1/models`) |
//! | `STANDIN_LOAD_DELAY_MS` | `0` | model load time; the port is not bound until it has passed |
//! | `STANDIN_TOKEN_LATENCY_MS` | `20` | time per output token of one sequence |
//! | `STANDIN_MAX_NUM_SEQS` | `8` | concurrent sequences; more requests wait in a FIFO queue |
//! | `STANDIN_SHUTDOWN_TIMEOUT_S` | `30` | on SIGTERM/SIGINT: close the port, let queued and running requests finish for up to this long, abort the rest, exit 0 (`--shutdown-timeout`) |
//! | `STANDIN_KV_BLOCKS` | `1024` | KV-cache blocks of 16 tokens; `kv_cache_usage_perc` is the running sequences' blocks over this |
//! | `VLLM_SERVER_DEV_MODE` | unset | `1` mounts `/sleep`, `/wake_up` and `/is_sleeping` |
//!
//! The maximum model length is fixed at 4096 tokens (as in the real scrape's deployment).
//!
//! # Endpoints
//!
//! - `POST /v1/completions`, `POST /v1/chat/completions`: OpenAI-shaped JSON, `max_tokens`
//!   (default 16; `max_completion_tokens` too for chat), prompt tokens counted as whitespace-split
//!   words. `"stream": true` is answered with server-sent events, one chunk per token. The answer
//!   comes once the sequence got a slot and produced all its tokens; `finish_reason` is `length`.
//!   While the engine sleeps, or while a sleep is under way, they answer 503; a request aborted by
//!   `/sleep` (mode `abort`) or by the end of the shutdown timeout answers 503 too.
//! - `GET /health` and `GET|POST /ping`: 200 with an empty body (also while sleeping).
//! - `GET /version`: `{"version":"0.19.1-standin"}`. `GET /v1/models`. `GET /metrics`.
//! - Dev mode only (otherwise 404): `POST /sleep?level=1|2&mode=abort|wait|keep` (mode `abort`
//!   aborts queued and running requests, `wait` rejects new ones and waits for all in flight to
//!   finish, `keep` freezes them until `/wake_up`), `POST /wake_up` (any `tags` wake everything),
//!   `GET /is_sleeping`.
//!
//! Every connection is served by its own thread and closed after one response.
//! One line per state change goes to stderr: loading, listening, sleeping/awake, draining, exited.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use engine::{Engine, GenError, SleepLevel, SleepMode};
use json::{Value, quote};

/// The `version` field `GET /version` reports.
const VERSION: &str = "0.19.1-standin";
/// Maximum model length, in tokens (prompt plus output).
const MAX_MODEL_LEN: u64 = 4096;
/// Tokens per KV-cache block, vLLM's default on GPUs.
const BLOCK_SIZE: u64 = 16;
/// How often the accept loop and the load delay look at the shutdown flag.
const POLL: Duration = Duration::from_millis(20);

/// Set by the SIGTERM/SIGINT handler; read by the accept loop.
static SHUTDOWN: AtomicBool = AtomicBool::new(false);

fn main() {
    let cfg = match config::Config::from_env() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("vllm-standin: configuration error: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = signals::install() {
        eprintln!("vllm-standin: cannot install signal handlers: {e}");
        std::process::exit(1);
    }
    match run(cfg) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("vllm-standin: {e}");
            std::process::exit(1);
        }
    }
}

/// Loads, serves until SIGTERM/SIGINT, then drains and returns.
fn run(cfg: config::Config) -> io::Result<()> {
    eprintln!(
        "vllm-standin: loading model {} ({} ms)",
        cfg.model,
        cfg.load_delay.as_millis()
    );
    let loaded_at = Instant::now() + cfg.load_delay;
    while Instant::now() < loaded_at {
        if SHUTDOWN.load(Ordering::SeqCst) {
            eprintln!("vllm-standin: exited (signal during model load)");
            return Ok(());
        }
        thread::sleep(POLL.min(loaded_at.saturating_duration_since(Instant::now())));
    }

    // A literal address: no name resolution (getaddrinfo), which a static glibc binary avoids.
    let addr = SocketAddr::new(cfg.host, cfg.port);
    let listener = TcpListener::bind(addr)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot bind {addr}: {e}")))?;
    listener.set_nonblocking(true)?;
    let engine = Arc::new(Engine::new(cfg));
    let c = engine.config();
    eprintln!(
        "vllm-standin: listening on {addr} model={} max_num_seqs={} token_latency_ms={} kv_blocks={} dev_mode={}",
        c.model,
        c.max_num_seqs,
        c.token_latency.as_millis(),
        c.kv_blocks,
        c.dev_mode
    );

    while !SHUTDOWN.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let guard = engine.connection_opened();
                let engine = Arc::clone(&engine);
                thread::spawn(move || {
                    let _guard = guard;
                    if let Err(e) = http::serve_connection(&engine, stream) {
                        // A client that hangs up is routine; anything else is worth a line.
                        if !matches!(
                            e.kind(),
                            io::ErrorKind::BrokenPipe
                                | io::ErrorKind::ConnectionReset
                                | io::ErrorKind::UnexpectedEof
                        ) {
                            eprintln!("vllm-standin: connection error: {e}");
                        }
                    }
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("vllm-standin: accept failed: {e}");
                thread::sleep(POLL);
            }
        }
    }

    // Stop accepting: new connections are refused from here on.
    drop(listener);
    let timeout = engine.config().shutdown_timeout;
    eprintln!(
        "vllm-standin: draining: {} connection(s) in flight ({} waiting, {} running), shutdown timeout {} s",
        engine.open_connections(),
        engine.num_waiting(),
        engine.num_running(),
        timeout.as_secs()
    );
    let drained = engine.wait_connections_closed(timeout);
    let aborted = if drained {
        0
    } else {
        let n = engine.abort_all();
        // Give the handlers a moment to write their error responses.
        engine.wait_connections_closed(Duration::from_secs(2));
        n
    };
    eprintln!(
        "vllm-standin: exited (drained={drained}, aborted {aborted} request(s), {} succeeded in total)",
        engine.num_succeeded()
    );
    Ok(())
}

mod signals {
    //! SIGTERM/SIGINT handling: the handler only sets [`super::SHUTDOWN`] (async-signal-safe).

    use std::io;
    use std::sync::atomic::Ordering;

    extern "C" fn on_signal(_signum: libc::c_int) {
        super::SHUTDOWN.store(true, Ordering::SeqCst);
    }

    /// Installs the handler for SIGTERM and SIGINT with `sigaction`.
    pub fn install() -> io::Result<()> {
        for signum in [libc::SIGTERM, libc::SIGINT] {
            // SAFETY: `action` is fully initialised (zeroed, then the fields we need), and the
            // handler only performs an atomic store, which is async-signal-safe.
            #[allow(unsafe_code)]
            let rc = unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
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
}

mod config {
    //! Configuration from `STANDIN_*` environment variables (see the crate header).

    use std::env::{self, VarError};
    use std::fmt::Display;
    use std::net::IpAddr;
    use std::str::FromStr;
    use std::time::Duration;

    #[derive(Debug, Clone)]
    pub struct Config {
        pub host: IpAddr,
        pub port: u16,
        pub model: String,
        pub load_delay: Duration,
        pub token_latency: Duration,
        pub max_num_seqs: usize,
        pub shutdown_timeout: Duration,
        pub kv_blocks: u64,
        pub dev_mode: bool,
    }

    impl Default for Config {
        fn default() -> Self {
            Config {
                host: IpAddr::from([0, 0, 0, 0]),
                port: 8000,
                model: "standin-model".to_owned(),
                load_delay: Duration::ZERO,
                token_latency: Duration::from_millis(20),
                max_num_seqs: 8,
                shutdown_timeout: Duration::from_secs(30),
                kv_blocks: 1024,
                dev_mode: false,
            }
        }
    }

    impl Config {
        pub fn from_env() -> Result<Config, String> {
            let d = Config::default();
            let cfg = Config {
                host: var("STANDIN_HOST", d.host)?,
                port: var("STANDIN_PORT", d.port)?,
                model: var("STANDIN_MODEL", d.model)?,
                load_delay: Duration::from_millis(var("STANDIN_LOAD_DELAY_MS", 0)?),
                token_latency: Duration::from_millis(var("STANDIN_TOKEN_LATENCY_MS", 20)?),
                max_num_seqs: var("STANDIN_MAX_NUM_SEQS", d.max_num_seqs)?,
                shutdown_timeout: Duration::from_secs(var("STANDIN_SHUTDOWN_TIMEOUT_S", 30)?),
                kv_blocks: var("STANDIN_KV_BLOCKS", d.kv_blocks)?,
                dev_mode: var::<String>("VLLM_SERVER_DEV_MODE", String::new())? == "1",
            };
            if cfg.max_num_seqs == 0 {
                return Err("STANDIN_MAX_NUM_SEQS must be at least 1".to_owned());
            }
            if cfg.kv_blocks == 0 {
                return Err("STANDIN_KV_BLOCKS must be at least 1".to_owned());
            }
            Ok(cfg)
        }
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
}

mod engine {
    //! The scheduler: a FIFO waiting queue in front of `max_num_seqs` running slots, per-token
    //! timing, sleep/wake, aborts, connection accounting for the drain, and the live metrics.
    //!
    //! All state sits behind one mutex; every change is announced on one condition variable,
    //! and each request's thread waits on it for its slot, its next token or an abort.

    use std::collections::{HashMap, VecDeque};
    use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
    use std::time::{Duration, Instant};

    use crate::config::Config;
    use crate::metrics::{Gauges, Metrics};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum SleepLevel {
        /// Weights offloaded to CPU memory, KV cache discarded.
        One,
        /// Weights and KV cache discarded.
        Two,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum SleepMode {
        /// Abort queued and running requests, then sleep.
        Abort,
        /// Reject new requests, wait for queued and running ones to finish, then sleep.
        Wait,
        /// Sleep at once; queued and running requests freeze until wake-up.
        Keep,
    }

    /// Why a generation did not complete.
    impl std::fmt::Display for SleepLevel {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(match self {
                SleepLevel::One => "1",
                SleepLevel::Two => "2",
            })
        }
    }

    impl std::fmt::Display for SleepMode {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(match self {
                SleepMode::Abort => "abort",
                SleepMode::Wait => "wait",
                SleepMode::Keep => "keep",
            })
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum GenError {
        /// Rejected on arrival: the engine sleeps or is going to sleep.
        Unavailable(&'static str),
        /// Aborted while queued or running (sleep with mode abort, shutdown timeout).
        Aborted,
        /// The streaming client went away; the request was aborted.
        ClientGone,
    }

    /// What a completed generation reports back.
    #[derive(Debug, Clone, Copy)]
    pub struct GenOutcome {
        pub completion_tokens: u64,
    }

    struct Seq {
        prompt_tokens: u64,
        generated: u64,
    }

    struct State {
        next_id: u64,
        waiting: VecDeque<u64>,
        running: HashMap<u64, Seq>,
        sleeping: Option<SleepLevel>,
        /// A `/sleep` call is under way: new requests are rejected.
        sleep_in_progress: bool,
        /// Bumped by every abort-all; a request aborts when it differs from its own copy.
        abort_epoch: u64,
        connections: usize,
        metrics: Metrics,
    }

    pub struct Engine {
        cfg: Config,
        state: Mutex<State>,
        changed: Condvar,
    }

    /// Counts an open connection; dropping it (when the connection's thread ends) uncounts it.
    pub struct ConnectionGuard(Arc<Engine>);

    impl Drop for ConnectionGuard {
        fn drop(&mut self) {
            self.0.lock().connections -= 1;
            self.0.changed.notify_all();
        }
    }

    impl Engine {
        pub fn new(cfg: Config) -> Engine {
            Engine {
                cfg,
                state: Mutex::new(State {
                    next_id: 0,
                    waiting: VecDeque::new(),
                    running: HashMap::new(),
                    sleeping: None,
                    sleep_in_progress: false,
                    abort_epoch: 0,
                    connections: 0,
                    metrics: Metrics::new(crate::unix_now()),
                }),
                changed: Condvar::new(),
            }
        }

        pub fn config(&self) -> &Config {
            &self.cfg
        }

        fn lock(&self) -> MutexGuard<'_, State> {
            self.state.lock().unwrap_or_else(PoisonError::into_inner)
        }

        fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
            self.changed
                .wait(guard)
                .unwrap_or_else(PoisonError::into_inner)
        }

        fn wait_timeout<'a>(
            &self,
            guard: MutexGuard<'a, State>,
            timeout: Duration,
        ) -> MutexGuard<'a, State> {
            self.changed
                .wait_timeout(guard, timeout)
                .unwrap_or_else(PoisonError::into_inner)
                .0
        }

        /// Counts a newly accepted connection until the returned guard is dropped.
        pub fn connection_opened(self: &Arc<Self>) -> ConnectionGuard {
            self.lock().connections += 1;
            ConnectionGuard(Arc::clone(self))
        }

        pub fn open_connections(&self) -> usize {
            self.lock().connections
        }

        pub fn num_waiting(&self) -> usize {
            self.lock().waiting.len()
        }

        pub fn num_running(&self) -> usize {
            self.lock().running.len()
        }

        pub fn num_succeeded(&self) -> u64 {
            self.lock().metrics.succeeded()
        }

        pub fn is_sleeping(&self) -> bool {
            self.lock().sleeping.is_some()
        }

        /// Waits until no connection is open, or `timeout` passed; true when none is left.
        pub fn wait_connections_closed(&self, timeout: Duration) -> bool {
            let deadline = Instant::now() + timeout;
            let mut st = self.lock();
            while st.connections > 0 {
                let now = Instant::now();
                if now >= deadline {
                    return false;
                }
                st = self.wait_timeout(st, deadline - now);
            }
            true
        }

        /// Aborts every queued and running request; returns how many there were.
        pub fn abort_all(&self) -> usize {
            let mut st = self.lock();
            let n = st.waiting.len() + st.running.len();
            st.abort_epoch += 1;
            self.changed.notify_all();
            n
        }

        /// Queues one sequence, waits for a slot, produces `max_tokens` tokens at the configured
        /// latency (calling `on_token` with the token's 1-based index after each, outside the
        /// lock) and records its metrics.
        pub fn generate(
            &self,
            prompt_tokens: u64,
            max_tokens: u64,
            mut on_token: impl FnMut(u64) -> std::io::Result<()>,
        ) -> Result<GenOutcome, GenError> {
            let arrived = Instant::now();
            let mut st = self.lock();
            if st.sleeping.is_some() {
                return Err(GenError::Unavailable("the engine is sleeping"));
            }
            if st.sleep_in_progress {
                return Err(GenError::Unavailable("the engine is going to sleep"));
            }
            let id = st.next_id;
            st.next_id += 1;
            let epoch = st.abort_epoch;
            st.waiting.push_back(id);

            // Wait for a slot: first in line, a free slot, and awake.
            let max = self.cfg.max_num_seqs;
            while st.abort_epoch == epoch
                && !(st.sleeping.is_none()
                    && st.waiting.front() == Some(&id)
                    && st.running.len() < max)
            {
                st = self.wait(st);
            }
            if st.abort_epoch != epoch {
                st.waiting.retain(|&w| w != id);
                st.metrics.record_abort();
                self.changed.notify_all();
                return Err(GenError::Aborted);
            }
            st.waiting.pop_front();
            st.running.insert(
                id,
                Seq {
                    prompt_tokens,
                    generated: 0,
                },
            );
            let admitted = Instant::now();
            // The next in line may fit into another free slot.
            self.changed.notify_all();

            let latency = self.cfg.token_latency;
            let mut next_token_at = admitted + latency;
            let mut last_token_at = admitted;
            for n in 1..=max_tokens {
                loop {
                    if st.abort_epoch != epoch {
                        return Err(self.abort_running(st, id, GenError::Aborted));
                    }
                    if st.sleeping.is_some() {
                        // Sleep mode `keep`: frozen in place until wake-up.
                        st = self.wait(st);
                        next_token_at = Instant::now() + latency;
                        continue;
                    }
                    let now = Instant::now();
                    if now >= next_token_at {
                        break;
                    }
                    st = self.wait_timeout(st, next_token_at - now);
                }
                let now = Instant::now();
                if let Some(seq) = st.running.get_mut(&id) {
                    seq.generated = n;
                }
                if n == 1 {
                    st.metrics.record_prefill(prompt_tokens, now - arrived);
                } else {
                    st.metrics.record_decode_token(now - last_token_at);
                }
                last_token_at = now;
                next_token_at += latency;

                drop(st);
                let written = on_token(n);
                st = self.lock();
                if written.is_err() {
                    return Err(self.abort_running(st, id, GenError::ClientGone));
                }
            }

            st.running.remove(&id);
            let finished = Instant::now();
            st.metrics.record_success(
                prompt_tokens,
                max_tokens,
                admitted - arrived,
                finished - arrived,
            );
            self.changed.notify_all();
            Ok(GenOutcome {
                completion_tokens: max_tokens,
            })
        }

        fn abort_running(&self, mut st: MutexGuard<'_, State>, id: u64, why: GenError) -> GenError {
            st.running.remove(&id);
            st.metrics.record_abort();
            self.changed.notify_all();
            why
        }

        /// Puts the engine to sleep (a no-op when it already sleeps).
        pub fn sleep(&self, level: SleepLevel, mode: SleepMode) {
            let mut st = self.lock();
            while st.sleep_in_progress {
                st = self.wait(st);
            }
            if st.sleeping.is_some() {
                return;
            }
            st.sleep_in_progress = true;
            match mode {
                SleepMode::Abort => {
                    st.abort_epoch += 1;
                    self.changed.notify_all();
                    while !st.waiting.is_empty() || !st.running.is_empty() {
                        st = self.wait(st);
                    }
                }
                SleepMode::Wait => {
                    while !st.waiting.is_empty() || !st.running.is_empty() {
                        st = self.wait(st);
                    }
                }
                SleepMode::Keep => {}
            }
            st.sleeping = Some(level);
            st.sleep_in_progress = false;
            self.changed.notify_all();
        }

        /// Wakes the engine up (a no-op when it is awake); frozen requests resume.
        pub fn wake_up(&self) -> bool {
            let mut st = self.lock();
            let was_sleeping = st.sleeping.take().is_some();
            self.changed.notify_all();
            was_sleeping
        }

        /// Renders `/metrics` from the live state.
        pub fn render_metrics(&self) -> String {
            let st = self.lock();
            let used_blocks: u64 = st
                .running
                .values()
                .map(|s| (s.prompt_tokens + s.generated).div_ceil(crate::BLOCK_SIZE))
                .sum();
            let gauges = Gauges {
                running: st.running.len(),
                waiting: st.waiting.len(),
                kv_cache_usage: (used_blocks as f64 / self.cfg.kv_blocks as f64).min(1.0),
                sleeping: st.sleeping,
                num_gpu_blocks: self.cfg.kv_blocks,
            };
            crate::metrics::render(&self.cfg.model, &st.metrics, &gauges)
        }
    }
}

mod metrics {
    //! vLLM V1 Prometheus metrics: the counters and histograms, and the text rendering.
    //!
    //! Names, HELP texts, types, label names and order, bucket bounds and number formatting are
    //! those of a real vLLM 0.19.1 scrape (`prometheus_client`): every counter `X` is exposed as
    //! `X_total` plus an `X_created` gauge, every histogram as `_bucket`/`_count`/`_sum` plus
    //! `_created`, labels are sorted by name, and numbers are printed like Python floats.

    use std::fmt::Write;
    use std::time::Duration;

    use crate::engine::SleepLevel;

    /// `vllm:time_to_first_token_seconds` buckets (V1).
    const TTFT_BUCKETS: &[f64] = &[
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ];
    /// `vllm:inter_token_latency_seconds` buckets (V1).
    const ITL_BUCKETS: &[f64] = &[
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ];
    /// Request latency buckets (`e2e_request_latency`, `request_queue_time`) (V1).
    const REQUEST_LATENCY_BUCKETS: &[f64] = &[
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0,
    ];
    /// Token-count buckets: 1-2-5 up to the maximum model length of 4096.
    const TOKEN_BUCKETS: &[f64] = &[
        1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0,
    ];
    /// `finished_reason` label values, in the scrape's order.
    const FINISHED_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];
    const LENGTH: usize = 1;
    const ABORT: usize = 2;

    #[derive(Debug, Clone)]
    pub struct Histogram {
        bounds: &'static [f64],
        /// Per-bucket (not cumulative) counts; the last one is `+Inf`.
        counts: Vec<u64>,
        sum: f64,
    }

    impl Histogram {
        fn new(bounds: &'static [f64]) -> Histogram {
            Histogram {
                bounds,
                counts: vec![0; bounds.len() + 1],
                sum: 0.0,
            }
        }

        pub fn observe(&mut self, v: f64) {
            let i = self
                .bounds
                .iter()
                .position(|&b| v <= b)
                .unwrap_or(self.bounds.len());
            self.counts[i] += 1;
            self.sum += v;
        }

        fn count(&self) -> u64 {
            self.counts.iter().sum()
        }
    }

    /// Cumulative counters and histograms (gauges come from the engine's state, see [`Gauges`]).
    #[derive(Debug, Clone)]
    pub struct Metrics {
        /// Unix time the families were created (`_created` values).
        created: f64,
        prompt_tokens: u64,
        generation_tokens: u64,
        finished: [u64; 5],
        request_prompt_tokens: Histogram,
        request_generation_tokens: Histogram,
        ttft: Histogram,
        itl: Histogram,
        e2e: Histogram,
        queue_time: Histogram,
    }

    /// Point-in-time values read from the scheduler.
    #[derive(Debug, Clone)]
    pub struct Gauges {
        pub running: usize,
        pub waiting: usize,
        pub kv_cache_usage: f64,
        pub sleeping: Option<SleepLevel>,
        pub num_gpu_blocks: u64,
    }

    impl Metrics {
        pub fn new(created: f64) -> Metrics {
            Metrics {
                created,
                prompt_tokens: 0,
                generation_tokens: 0,
                finished: [0; 5],
                request_prompt_tokens: Histogram::new(TOKEN_BUCKETS),
                request_generation_tokens: Histogram::new(TOKEN_BUCKETS),
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
                queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            }
        }

        /// The first token: the prompt was prefilled; TTFT is queue wait plus one token.
        pub fn record_prefill(&mut self, prompt_tokens: u64, ttft: Duration) {
            self.prompt_tokens += prompt_tokens;
            self.generation_tokens += 1;
            self.ttft.observe(ttft.as_secs_f64());
        }

        /// Every later token.
        pub fn record_decode_token(&mut self, inter_token: Duration) {
            self.generation_tokens += 1;
            self.itl.observe(inter_token.as_secs_f64());
        }

        /// A request that ran to `max_tokens` (`finished_reason="length"`).
        pub fn record_success(
            &mut self,
            prompt_tokens: u64,
            generation_tokens: u64,
            queue_time: Duration,
            e2e: Duration,
        ) {
            self.finished[LENGTH] += 1;
            self.request_prompt_tokens.observe(prompt_tokens as f64);
            self.request_generation_tokens
                .observe(generation_tokens as f64);
            self.queue_time.observe(queue_time.as_secs_f64());
            self.e2e.observe(e2e.as_secs_f64());
        }

        /// An aborted request (`finished_reason="abort"`).
        pub fn record_abort(&mut self) {
            self.finished[ABORT] += 1;
        }

        pub fn succeeded(&self) -> u64 {
            self.finished[LENGTH]
        }
    }

    /// Renders the Prometheus text exposition for `model`.
    pub fn render(model: &str, m: &Metrics, g: &Gauges) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let r = &mut Renderer {
            out: &mut out,
            model: escape_label(model),
            created: m.created,
        };
        r.gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            g.running as f64,
        );
        r.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            g.waiting as f64,
        );
        r.header(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "gauge",
        );
        for (state, on) in [
            ("awake", g.sleeping.is_none()),
            ("weights_offloaded", g.sleeping == Some(SleepLevel::One)),
            ("discard_all", g.sleeping == Some(SleepLevel::Two)),
        ] {
            r.sample(
                "vllm:engine_sleep_state",
                Some(("sleep_state", state)),
                f64::from(u8::from(on)),
            );
        }
        r.gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            g.kv_cache_usage,
        );
        r.counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            m.prompt_tokens as f64,
        );
        r.counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            0.0,
        );
        r.counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            0.0,
        );
        r.counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            m.prompt_tokens as f64,
        );
        r.counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            m.generation_tokens as f64,
        );
        let success_help = "Count of successfully processed requests.";
        r.header("vllm:request_success_total", success_help, "counter");
        for (reason, n) in FINISHED_REASONS.iter().zip(m.finished) {
            r.sample(
                "vllm:request_success_total",
                Some(("finished_reason", reason)),
                n as f64,
            );
        }
        r.header("vllm:request_success_created", success_help, "gauge");
        for reason in FINISHED_REASONS {
            r.sample(
                "vllm:request_success_created",
                Some(("finished_reason", reason)),
                m.created,
            );
        }
        r.histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &m.request_prompt_tokens,
        );
        r.histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &m.request_generation_tokens,
        );
        r.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &m.ttft,
        );
        r.histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &m.itl,
        );
        r.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &m.e2e,
        );
        r.histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &m.queue_time,
        );
        r.header(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            "gauge",
        );
        let _ = writeln!(
            r.out,
            "vllm:cache_config_info{{_block_size_resolved=\"True\",block_size=\"{BLOCK}\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_kvcache_space_bytes=\"None\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",kv_cache_dtype_skip_layers=\"[]\",kv_cache_memory_bytes=\"None\",kv_offloading_backend=\"native\",kv_offloading_size=\"None\",kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",mamba_cache_dtype=\"auto\",mamba_cache_mode=\"none\",mamba_page_size_padded=\"None\",mamba_ssm_cache_dtype=\"auto\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",user_specified_block_size=\"False\"}} 1.0",
            g.num_gpu_blocks,
            BLOCK = crate::BLOCK_SIZE,
        );
        out
    }

    struct Renderer<'a> {
        out: &'a mut String,
        /// The escaped `model_name` label value.
        model: String,
        created: f64,
    }

    impl Renderer<'_> {
        fn header(&mut self, name: &str, help: &str, kind: &str) {
            let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        }

        /// One sample with `engine` and `model_name` plus an optional extra label, sorted by
        /// label name as `prometheus_client` prints them.
        fn sample(&mut self, name: &str, extra: Option<(&str, &str)>, value: f64) {
            let mut labels = vec![("engine", "0"), ("model_name", self.model.as_str())];
            labels.extend(extra);
            labels.sort_by_key(|&(k, _)| k);
            let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
            let _ = writeln!(
                self.out,
                "{name}{{{}}} {}",
                labels.join(","),
                go_float(value)
            );
        }

        fn gauge(&mut self, name: &str, help: &str, value: f64) {
            self.header(name, help, "gauge");
            self.sample(name, None, value);
        }

        /// A counter family `name` as `name_total` plus `name_created`.
        fn counter(&mut self, name: &str, help: &str, value: f64) {
            let total = format!("{name}_total");
            self.header(&total, help, "counter");
            self.sample(&total, None, value);
            self.created(name, help);
        }

        fn created(&mut self, name: &str, help: &str) {
            let created = format!("{name}_created");
            self.header(&created, help, "gauge");
            self.sample(&created, None, self.created);
        }

        fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
            self.header(name, help, "histogram");
            let bucket = format!("{name}_bucket");
            let mut cumulative = 0;
            for (i, n) in h.counts.iter().enumerate() {
                cumulative += n;
                let le = h.bounds.get(i).map_or("+Inf".to_owned(), |&b| go_float(b));
                self.sample(&bucket, Some(("le", &le)), cumulative as f64);
            }
            self.sample(&format!("{name}_count"), None, h.count() as f64);
            self.sample(&format!("{name}_sum"), None, h.sum);
            self.created(name, help);
        }
    }

    /// Escapes a label value for the text format.
    fn escape_label(v: &str) -> String {
        v.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    }

    /// Python's `repr(float)`: shortest round-trip digits, `.0` on integral values, exponent
    /// form (`1e-05`, `1e+16`) outside [1e-4, 1e16).
    pub fn py_repr(d: f64) -> String {
        if d.is_nan() {
            return "nan".to_owned();
        }
        if d.is_infinite() {
            return if d > 0.0 { "inf" } else { "-inf" }.to_owned();
        }
        let a = d.abs();
        if a == 0.0 || (1e-4..1e16).contains(&a) {
            let s = format!("{d}");
            if s.contains('.') { s } else { s + ".0" }
        } else {
            let s = format!("{d:e}");
            let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
            let exp: i32 = exp.parse().unwrap_or(0);
            let sign = if exp < 0 { '-' } else { '+' };
            format!("{mantissa}e{sign}{:02}", exp.abs())
        }
    }

    /// `prometheus_client`'s `floatToGoString`: Python's repr, except that positive values with
    /// more than six integer digits switch to Go's exponent form (`1.777757996204774e+09`).
    pub fn go_float(d: f64) -> String {
        if d == f64::INFINITY {
            return "+Inf".to_owned();
        }
        if d == f64::NEG_INFINITY {
            return "-Inf".to_owned();
        }
        if d.is_nan() {
            return "NaN".to_owned();
        }
        let s = py_repr(d);
        match s.find('.') {
            Some(dot) if d > 0.0 && dot > 6 => {
                let digits = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
                let mantissa = digits.trim_end_matches(['0', '.']);
                // Sic: prometheus_client writes `e+0` and then the exponent, so 10 is `e+010`.
                format!("{mantissa}e+0{}", dot - 1)
            }
            _ => s,
        }
    }
}

mod json {
    //! A minimal JSON reader (enough for OpenAI request bodies) and string quoting for output.

    #[derive(Debug, Clone, PartialEq)]
    pub enum Value {
        Null,
        Bool(bool),
        Num(f64),
        Str(String),
        Arr(Vec<Value>),
        Obj(Vec<(String, Value)>),
    }

    impl Value {
        /// The member `key` of an object (`None` for absent keys and non-objects).
        pub fn get(&self, key: &str) -> Option<&Value> {
            match self {
                Value::Obj(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
                _ => None,
            }
        }
    }

    pub fn parse(text: &str) -> Result<Value, String> {
        let mut p = Parser {
            s: text.as_bytes(),
            i: 0,
        };
        let v = p.value(0)?;
        p.ws();
        if p.i != p.s.len() {
            return Err(format!("trailing characters at byte {}", p.i));
        }
        Ok(v)
    }

    /// `s` as a JSON string literal, quotes included.
    pub fn quote(s: &str) -> String {
        let mut out = String::with_capacity(s.len() + 2);
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
        out
    }

    const MAX_DEPTH: usize = 128;

    struct Parser<'a> {
        s: &'a [u8],
        i: usize,
    }

    impl Parser<'_> {
        fn ws(&mut self) {
            while matches!(self.s.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
                self.i += 1;
            }
        }

        fn err<T>(&self, what: &str) -> Result<T, String> {
            Err(format!("{what} at byte {}", self.i))
        }

        fn eat(&mut self, lit: &str) -> bool {
            if self.s[self.i..].starts_with(lit.as_bytes()) {
                self.i += lit.len();
                true
            } else {
                false
            }
        }

        fn value(&mut self, depth: usize) -> Result<Value, String> {
            if depth > MAX_DEPTH {
                return self.err("nesting too deep");
            }
            self.ws();
            match self.s.get(self.i) {
                None => self.err("unexpected end of input"),
                Some(b'{') => {
                    self.i += 1;
                    let mut members = Vec::new();
                    self.ws();
                    if self.eat("}") {
                        return Ok(Value::Obj(members));
                    }
                    loop {
                        self.ws();
                        if self.s.get(self.i) != Some(&b'"') {
                            return self.err("expected a string key");
                        }
                        let key = self.string()?;
                        self.ws();
                        if !self.eat(":") {
                            return self.err("expected ':'");
                        }
                        let v = self.value(depth + 1)?;
                        members.push((key, v));
                        self.ws();
                        if self.eat(",") {
                            continue;
                        }
                        if self.eat("}") {
                            return Ok(Value::Obj(members));
                        }
                        return self.err("expected ',' or '}'");
                    }
                }
                Some(b'[') => {
                    self.i += 1;
                    let mut items = Vec::new();
                    self.ws();
                    if self.eat("]") {
                        return Ok(Value::Arr(items));
                    }
                    loop {
                        items.push(self.value(depth + 1)?);
                        self.ws();
                        if self.eat(",") {
                            continue;
                        }
                        if self.eat("]") {
                            return Ok(Value::Arr(items));
                        }
                        return self.err("expected ',' or ']'");
                    }
                }
                Some(b'"') => Ok(Value::Str(self.string()?)),
                Some(b't') if self.eat("true") => Ok(Value::Bool(true)),
                Some(b'f') if self.eat("false") => Ok(Value::Bool(false)),
                Some(b'n') if self.eat("null") => Ok(Value::Null),
                Some(b'-' | b'0'..=b'9') => self.number(),
                Some(_) => self.err("unexpected character"),
            }
        }

        fn number(&mut self) -> Result<Value, String> {
            let start = self.i;
            while matches!(
                self.s.get(self.i),
                Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
            ) {
                self.i += 1;
            }
            let text = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
            match text.parse::<f64>() {
                Ok(n) if n.is_finite() => Ok(Value::Num(n)),
                _ => Err(format!("invalid number {text:?} at byte {start}")),
            }
        }

        fn hex4(&mut self) -> Result<u32, String> {
            let digits = self.s.get(self.i..self.i + 4).unwrap_or(b"");
            let text = std::str::from_utf8(digits).unwrap_or("");
            match u32::from_str_radix(text, 16) {
                Ok(v) if text.len() == 4 => {
                    self.i += 4;
                    Ok(v)
                }
                _ => self.err("invalid \\u escape"),
            }
        }

        /// A string literal; `self.i` is on the opening quote.
        fn string(&mut self) -> Result<String, String> {
            self.i += 1;
            let mut out = Vec::new();
            loop {
                match self.s.get(self.i) {
                    None => return self.err("unterminated string"),
                    Some(b'"') => {
                        self.i += 1;
                        return String::from_utf8(out).map_err(|_| "invalid UTF-8".to_owned());
                    }
                    Some(b'\\') => {
                        self.i += 1;
                        let esc = self.s.get(self.i).copied();
                        self.i += 1;
                        let c = match esc {
                            Some(b'"') => '"',
                            Some(b'\\') => '\\',
                            Some(b'/') => '/',
                            Some(b'b') => '\u{8}',
                            Some(b'f') => '\u{c}',
                            Some(b'n') => '\n',
                            Some(b'r') => '\r',
                            Some(b't') => '\t',
                            Some(b'u') => {
                                let hi = self.hex4()?;
                                let code = if (0xD800..0xDC00).contains(&hi) && self.eat("\\u") {
                                    let lo = self.hex4()?;
                                    0x10000
                                        + ((hi - 0xD800) << 10)
                                        + (lo.wrapping_sub(0xDC00) & 0x3FF)
                                } else {
                                    hi
                                };
                                char::from_u32(code).unwrap_or('\u{FFFD}')
                            }
                            _ => return self.err("invalid escape"),
                        };
                        let mut buf = [0; 4];
                        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                    Some(&b) if b < 0x20 => return self.err("control character in string"),
                    Some(&b) => {
                        out.push(b);
                        self.i += 1;
                    }
                }
            }
        }
    }
}

mod http {
    //! HTTP/1.1 on a blocking `TcpStream`: one request per connection (`Connection: close`),
    //! `Content-Length` bodies, `Expect: 100-continue`, and the route table.

    use super::*;

    const MAX_HEAD: usize = 64 * 1024;
    const MAX_BODY: usize = 16 * 1024 * 1024;
    const IO_TIMEOUT: Duration = Duration::from_secs(30);

    pub struct Request {
        pub method: String,
        pub path: String,
        pub query: String,
        pub body: Vec<u8>,
    }

    impl Request {
        /// The first value of query parameter `name` (no percent-decoding needed here).
        pub fn query_param(&self, name: &str) -> Option<&str> {
            self.query
                .split('&')
                .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v)
        }
    }

    pub struct Response {
        pub status: u16,
        pub content_type: &'static str,
        pub body: Vec<u8>,
    }

    impl Response {
        pub fn json(status: u16, body: String) -> Response {
            Response {
                status,
                content_type: "application/json",
                body: body.into_bytes(),
            }
        }

        pub fn empty(status: u16) -> Response {
            Response {
                status,
                content_type: "text/plain; charset=utf-8",
                body: Vec::new(),
            }
        }

        /// FastAPI's `{"detail": ...}` body (unknown routes, wrong methods).
        pub fn detail(status: u16, detail: &str) -> Response {
            Response::json(status, format!("{{\"detail\":{}}}", quote(detail)))
        }

        /// vLLM's `ErrorResponse` body.
        pub fn error(status: u16, kind: &str, message: &str) -> Response {
            Response::json(
                status,
                format!(
                    "{{\"error\":{{\"message\":{},\"type\":{},\"param\":null,\"code\":{status}}}}}",
                    quote(message),
                    quote(kind)
                ),
            )
        }
    }

    fn reason(status: u16) -> &'static str {
        match status {
            100 => "Continue",
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            411 => "Length Required",
            413 => "Content Too Large",
            431 => "Request Header Fields Too Large",
            500 => "Internal Server Error",
            503 => "Service Unavailable",
            _ => "Unknown",
        }
    }

    /// Writes a status line and headers; `content_length` None means "until the connection
    /// closes" (used for event streams).
    pub fn write_head(
        stream: &mut TcpStream,
        status: u16,
        content_type: &str,
        content_length: Option<usize>,
    ) -> io::Result<()> {
        let mut head = format!(
            "HTTP/1.1 {status} {}\r\nserver: uvicorn\r\ncontent-type: {content_type}\r\nconnection: close\r\n",
            reason(status)
        );
        if let Some(n) = content_length {
            head.push_str(&format!("content-length: {n}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes())
    }

    pub fn write_response(stream: &mut TcpStream, r: &Response) -> io::Result<()> {
        write_head(stream, r.status, r.content_type, Some(r.body.len()))?;
        stream.write_all(&r.body)?;
        stream.flush()
    }

    /// Reads one request; `Err(response)` for requests we refuse to read any further.
    fn read_request(stream: &mut TcpStream) -> io::Result<Result<Option<Request>, Response>> {
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(Ok(None));
        }
        let mut parts = line.split_whitespace();
        let (Some(method), Some(target)) = (parts.next(), parts.next()) else {
            return Ok(Err(Response::detail(400, "Invalid HTTP request line")));
        };
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let (method, path, query) = (method.to_owned(), path.to_owned(), query.to_owned());

        let mut head_len = line.len();
        let mut content_length = 0usize;
        let mut expect_continue = false;
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside the request head",
                ));
            }
            head_len += line.len();
            if head_len > MAX_HEAD {
                return Ok(Err(Response::detail(
                    431,
                    "Request header fields too large",
                )));
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            let Some((name, value)) = header.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => match value.parse() {
                    Ok(n) if n <= MAX_BODY => content_length = n,
                    Ok(_) => return Ok(Err(Response::detail(413, "Request body too large"))),
                    Err(_) => return Ok(Err(Response::detail(400, "Invalid Content-Length"))),
                },
                "transfer-encoding" => {
                    return Ok(Err(Response::detail(
                        411,
                        "Chunked bodies are not supported",
                    )));
                }
                "expect" => expect_continue = value.eq_ignore_ascii_case("100-continue"),
                _ => {}
            }
        }
        if expect_continue && content_length > 0 {
            stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        let mut body = vec![0; content_length];
        reader.read_exact(&mut body)?;
        Ok(Ok(Some(Request {
            method,
            path,
            query,
            body,
        })))
    }

    /// Serves one request on `stream`, then closes it.
    pub fn serve_connection(engine: &Engine, mut stream: TcpStream) -> io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        let _ = stream.set_nodelay(true);
        match read_request(&mut stream)? {
            Ok(Some(req)) => crate::api::handle(engine, &req, &mut stream)?,
            Ok(None) => {}
            Err(refusal) => write_response(&mut stream, &refusal)?,
        }
        let _ = stream.shutdown(Shutdown::Write);
        Ok(())
    }
}

mod api {
    //! The routes: OpenAI completions and chat completions, health, models, version, metrics,
    //! and the dev-mode sleep endpoints.

    use super::*;
    use crate::http::{Request, Response, write_head, write_response};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Kind {
        Completion,
        Chat,
    }

    /// A validated generation request.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct GenRequest {
        pub kind: Kind,
        pub prompt_tokens: u64,
        pub max_tokens: u64,
        pub stream: bool,
        pub include_usage: bool,
    }

    const DEFAULT_MAX_TOKENS: u64 = 16;
    const WORDS: [&str; 8] = [
        " the",
        " night",
        " shift",
        " lends",
        " idle",
        " GPUs",
        " to",
        " research",
    ];

    /// Dispatches one request and writes its response.
    pub fn handle(engine: &Engine, req: &Request, stream: &mut TcpStream) -> io::Result<()> {
        let dev = engine.config().dev_mode;
        let response = match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/health") | ("GET" | "POST", "/ping") => Response::empty(200),
            ("GET", "/version") => {
                Response::json(200, format!("{{\"version\":{}}}", quote(VERSION)))
            }
            ("GET", "/v1/models") => models(engine),
            ("GET", "/metrics") => Response {
                status: 200,
                content_type: "text/plain; version=0.0.4; charset=utf-8",
                body: engine.render_metrics().into_bytes(),
            },
            ("POST", "/v1/completions") => return generate(engine, Kind::Completion, req, stream),
            ("POST", "/v1/chat/completions") => return generate(engine, Kind::Chat, req, stream),
            ("POST", "/sleep") if dev => sleep(engine, req),
            ("POST", "/wake_up") if dev => {
                if engine.wake_up() {
                    eprintln!("vllm-standin: awake");
                }
                Response::empty(200)
            }
            ("GET", "/is_sleeping") if dev => {
                Response::json(200, format!("{{\"is_sleeping\":{}}}", engine.is_sleeping()))
            }
            (_, path) if known_path(path, dev) => Response::detail(405, "Method Not Allowed"),
            _ => Response::detail(404, "Not Found"),
        };
        write_response(stream, &response)
    }

    fn known_path(path: &str, dev: bool) -> bool {
        matches!(
            path,
            "/health"
                | "/ping"
                | "/version"
                | "/v1/models"
                | "/metrics"
                | "/v1/completions"
                | "/v1/chat/completions"
        ) || (dev && matches!(path, "/sleep" | "/wake_up" | "/is_sleeping"))
    }

    fn models(engine: &Engine) -> Response {
        let model = quote(&engine.config().model);
        let created = unix_now() as u64;
        Response::json(
            200,
            format!(
                "{{\"object\":\"list\",\"data\":[{{\"id\":{model},\"object\":\"model\",\"created\":{created},\"owned_by\":\"vllm\",\"root\":{model},\"parent\":null,\"max_model_len\":{MAX_MODEL_LEN},\"permission\":[{{\"id\":\"modelperm-{}\",\"object\":\"model_permission\",\"created\":{created},\"allow_create_engine\":false,\"allow_sampling\":true,\"allow_logprobs\":true,\"allow_search_indices\":false,\"allow_view\":true,\"allow_fine_tuning\":false,\"organization\":\"*\",\"group\":null,\"is_blocking\":false}}]}}]}}",
                request_id()
            ),
        )
    }

    fn sleep(engine: &Engine, req: &Request) -> Response {
        let level = match req.query_param("level").unwrap_or("1") {
            "1" => SleepLevel::One,
            "2" => SleepLevel::Two,
            other => {
                return Response::error(
                    400,
                    "BadRequestError",
                    &format!("invalid sleep level {other:?}: expected 1 or 2"),
                );
            }
        };
        let mode = match req.query_param("mode").unwrap_or("abort") {
            "abort" => SleepMode::Abort,
            "wait" => SleepMode::Wait,
            "keep" => SleepMode::Keep,
            other => {
                return Response::error(
                    400,
                    "BadRequestError",
                    &format!("invalid sleep mode {other:?}: expected abort, wait or keep"),
                );
            }
        };
        if engine.is_sleeping() {
            return Response::empty(200);
        }
        eprintln!("vllm-standin: going to sleep (level {level}, mode {mode})");
        engine.sleep(level, mode);
        eprintln!("vllm-standin: sleeping (level {level})");
        Response::empty(200)
    }

    /// Counts prompt tokens as whitespace-separated words (at least one).
    fn words(s: &str) -> u64 {
        s.split_whitespace().count() as u64
    }

    /// Validates a completions or chat completions body.
    pub fn parse_gen_request(kind: Kind, model: &str, body: &[u8]) -> Result<GenRequest, Response> {
        let bad = |msg: &str| Response::error(400, "BadRequestError", msg);
        let text = std::str::from_utf8(body).map_err(|_| bad("request body is not UTF-8"))?;
        let v = json::parse(text).map_err(|e| bad(&format!("invalid JSON body: {e}")))?;
        if !matches!(v, Value::Obj(_)) {
            return Err(bad("request body must be a JSON object"));
        }
        match v.get("model") {
            None | Some(Value::Null) => {}
            Some(Value::Str(m)) if m == model => {}
            Some(Value::Str(m)) => {
                return Err(Response::error(
                    404,
                    "NotFoundError",
                    &format!("The model `{m}` does not exist."),
                ));
            }
            Some(_) => return Err(bad("model must be a string")),
        }
        let prompt_tokens = match kind {
            Kind::Completion => match v.get("prompt") {
                Some(Value::Str(s)) => words(s),
                Some(Value::Arr(items)) => {
                    let mut n = 0;
                    for item in items {
                        n += match item {
                            Value::Str(s) => words(s),
                            Value::Num(_) => 1,
                            Value::Arr(ids) => ids.len() as u64,
                            _ => {
                                return Err(bad(
                                    "prompt must be a string, a list of strings or token ids",
                                ));
                            }
                        };
                    }
                    n
                }
                _ => {
                    return Err(bad(
                        "prompt is required (a string, a list of strings or token ids)",
                    ));
                }
            },
            Kind::Chat => {
                let Some(Value::Arr(messages)) = v.get("messages") else {
                    return Err(bad("messages is required (a list of messages)"));
                };
                let mut n = 0;
                for m in messages {
                    n += match m.get("content") {
                        Some(Value::Str(s)) => words(s),
                        Some(Value::Arr(parts)) => parts
                            .iter()
                            .filter_map(|p| match p.get("text") {
                                Some(Value::Str(s)) => Some(words(s)),
                                _ => None,
                            })
                            .sum(),
                        None | Some(Value::Null) => 0,
                        Some(_) => {
                            return Err(bad("message content must be a string or a list of parts"));
                        }
                    };
                }
                n
            }
        }
        .max(1);
        let max_tokens = match v.get("max_tokens").or_else(|| {
            (kind == Kind::Chat)
                .then(|| v.get("max_completion_tokens"))
                .flatten()
        }) {
            None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
            Some(Value::Num(n)) if *n >= 1.0 && n.fract() == 0.0 && *n <= u32::MAX as f64 => {
                *n as u64
            }
            Some(_) => return Err(bad("max_tokens must be a positive integer")),
        };
        if prompt_tokens + max_tokens > MAX_MODEL_LEN {
            return Err(bad(&format!(
                "This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
                prompt_tokens + max_tokens
            )));
        }
        let stream = matches!(v.get("stream"), Some(Value::Bool(true)));
        let include_usage = matches!(
            v.get("stream_options").and_then(|o| o.get("include_usage")),
            Some(Value::Bool(true))
        );
        Ok(GenRequest {
            kind,
            prompt_tokens,
            max_tokens,
            stream,
            include_usage,
        })
    }

    fn request_id() -> String {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{n:016x}", (unix_now() * 1e6) as u64)
    }

    fn token_text(n: u64) -> &'static str {
        WORDS[((n - 1) % WORDS.len() as u64) as usize]
    }

    fn usage(prompt: u64, completion: u64) -> String {
        format!(
            "{{\"prompt_tokens\":{prompt},\"total_tokens\":{},\"completion_tokens\":{completion},\"prompt_tokens_details\":null}}",
            prompt + completion
        )
    }

    fn gen_error(e: GenError) -> Response {
        match e {
            GenError::Unavailable(why) => Response::error(503, "ServiceUnavailableError", why),
            GenError::Aborted | GenError::ClientGone => {
                Response::error(503, "ServiceUnavailableError", "the request was aborted")
            }
        }
    }

    /// `POST /v1/completions` and `POST /v1/chat/completions`.
    fn generate(
        engine: &Engine,
        kind: Kind,
        req: &Request,
        stream: &mut TcpStream,
    ) -> io::Result<()> {
        let model = engine.config().model.clone();
        let g = match parse_gen_request(kind, &model, &req.body) {
            Ok(g) => g,
            Err(refusal) => return write_response(stream, &refusal),
        };
        let (id, object) = match kind {
            Kind::Completion => (format!("cmpl-{}", request_id()), "text_completion"),
            Kind::Chat => (format!("chatcmpl-{}", request_id()), "chat.completion"),
        };
        let created = unix_now() as u64;
        let model = quote(&model);
        if g.stream {
            return generate_stream(engine, &g, &id, created, &model, stream);
        }
        let outcome = match engine.generate(g.prompt_tokens, g.max_tokens, |_| Ok(())) {
            Ok(o) => o,
            Err(e) => return write_response(stream, &gen_error(e)),
        };
        let text: String = (1..=outcome.completion_tokens).map(token_text).collect();
        let usage = usage(g.prompt_tokens, outcome.completion_tokens);
        let choice = match kind {
            Kind::Completion => format!(
                "{{\"index\":0,\"text\":{},\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null,\"prompt_logprobs\":null}}",
                quote(&text)
            ),
            Kind::Chat => format!(
                "{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":{},\"refusal\":null,\"annotations\":null,\"audio\":null,\"function_call\":null,\"tool_calls\":[],\"reasoning_content\":null}},\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}}",
                quote(&text)
            ),
        };
        let body = format!(
            "{{\"id\":{},\"object\":\"{object}\",\"created\":{created},\"model\":{model},\"choices\":[{choice}],\"usage\":{usage},\"prompt_logprobs\":null,\"kv_transfer_params\":null}}",
            quote(&id)
        );
        write_response(stream, &Response::json(200, body))
    }

    /// The `"stream": true` variant: one server-sent event per token, then `[DONE]`.
    fn generate_stream(
        engine: &Engine,
        g: &GenRequest,
        id: &str,
        created: u64,
        model: &str,
        stream: &mut TcpStream,
    ) -> io::Result<()> {
        let id = quote(id);
        let object = match g.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        let prefix = format!(
            "data: {{\"id\":{id},\"object\":\"{object}\",\"created\":{created},\"model\":{model},\"choices\":["
        );
        let mut head_written = false;
        let result = engine.generate(g.prompt_tokens, g.max_tokens, |n| {
            if !head_written {
                write_head(stream, 200, "text/event-stream; charset=utf-8", None)?;
                head_written = true;
                if g.kind == Kind::Chat {
                    let role = format!(
                        "{prefix}{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
                    );
                    stream.write_all(role.as_bytes())?;
                }
            }
            let finish = if n == g.max_tokens { "\"length\"" } else { "null" };
            let text = quote(token_text(n));
            let choice = match g.kind {
                Kind::Completion => format!(
                    "{{\"index\":0,\"text\":{text},\"logprobs\":null,\"finish_reason\":{finish},\"stop_reason\":null}}"
                ),
                Kind::Chat => format!(
                    "{{\"index\":0,\"delta\":{{\"content\":{text}}},\"logprobs\":null,\"finish_reason\":{finish},\"stop_reason\":null}}"
                ),
            };
            stream.write_all(format!("{prefix}{choice}]}}\n\n").as_bytes())?;
            stream.flush()
        });
        match result {
            Ok(outcome) => {
                if g.include_usage {
                    let usage = usage(g.prompt_tokens, outcome.completion_tokens);
                    let chunk = format!(
                        "data: {{\"id\":{id},\"object\":\"{object}\",\"created\":{created},\"model\":{model},\"choices\":[],\"usage\":{usage}}}\n\n"
                    );
                    stream.write_all(chunk.as_bytes())?;
                }
                stream.write_all(b"data: [DONE]\n\n")?;
                stream.flush()
            }
            Err(GenError::ClientGone) => Ok(()),
            Err(e) if !head_written => write_response(stream, &gen_error(e)),
            Err(_) => {
                let err = "data: {\"error\":{\"message\":\"the request was aborted\",\"type\":\"ServiceUnavailableError\",\"param\":null,\"code\":503}}\n\ndata: [DONE]\n\n";
                stream.write_all(err.as_bytes())?;
                stream.flush()
            }
        }
    }
}

/// The current Unix time in seconds, as a float.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::api::{GenRequest, Kind, parse_gen_request};
    use super::engine::{Engine, SleepLevel, SleepMode};
    use super::metrics::{Gauges, Metrics, go_float, render};
    use super::*;

    fn gauges() -> Gauges {
        Gauges {
            running: 3,
            waiting: 5,
            kv_cache_usage: 0.25,
            sleeping: None,
            num_gpu_blocks: 1024,
        }
    }

    #[test]
    fn floats_print_like_prometheus_client() {
        assert_eq!(go_float(0.0), "0.0");
        assert_eq!(go_float(917.0), "917.0");
        assert_eq!(go_float(234.6708381175995), "234.6708381175995");
        assert_eq!(go_float(0.01639297604560852), "0.01639297604560852");
        assert_eq!(go_float(1.777757996204774e9), "1.777757996204774e+09");
        assert_eq!(go_float(1.7777579962062e9), "1.7777579962062e+09");
        // The scrape's own quirk for exponents of ten and more.
        assert_eq!(go_float(31105167360.0), "3.110516736e+010");
        assert_eq!(go_float(1.6e-5), "1.6e-05");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn metrics_use_vllm_v1_names_help_and_labels() {
        let mut m = Metrics::new(1.777757996204774e9);
        m.record_prefill(7, Duration::from_millis(30));
        m.record_decode_token(Duration::from_millis(20));
        m.record_success(7, 2, Duration::ZERO, Duration::from_millis(50));
        let text = render("meta-llama/Llama-3.1-8B-Instruct", &m, &gauges());
        // Lines copied verbatim from the real vLLM 0.19.1 scrape (values where they agree).
        for line in [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "vllm:engine_sleep_state{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",sleep_state=\"awake\"} 1.0",
            "vllm:engine_sleep_state{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",sleep_state=\"weights_offloaded\"} 0.0",
            "vllm:engine_sleep_state{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",sleep_state=\"discard_all\"} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            "# HELP vllm:prompt_tokens_created Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_created gauge",
            "vllm:prompt_tokens_created{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 1.777757996204774e+09",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            "vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"2560.0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 1.0",
            "# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds_created gauge",
            "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
            "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"7680.0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 1.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing line: {line}");
        }
        // Live values.
        let sample = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_owned)
        };
        assert_eq!(sample("vllm:num_requests_running{").as_deref(), Some("3.0"));
        assert_eq!(sample("vllm:num_requests_waiting{").as_deref(), Some("5.0"));
        assert_eq!(sample("vllm:kv_cache_usage_perc{").as_deref(), Some("0.25"));
        assert_eq!(sample("vllm:prompt_tokens_total{").as_deref(), Some("7.0"));
        assert_eq!(
            sample("vllm:generation_tokens_total{").as_deref(),
            Some("2.0")
        );
        assert_eq!(
            sample("vllm:time_to_first_token_seconds_count{").as_deref(),
            Some("1.0")
        );
        // TTFT 30 ms: not in the 0.02 bucket, in the 0.04 one.
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.02\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.04\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 1.0"));
        assert!(text.contains(
            "finished_reason=\"length\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 1.0"
        ));
    }

    #[test]
    fn sleep_state_gauge_follows_the_level() {
        let m = Metrics::new(0.0);
        let g = Gauges {
            sleeping: Some(SleepLevel::Two),
            ..gauges()
        };
        let text = render("m", &m, &g);
        assert!(text.contains("sleep_state=\"awake\"} 0.0"));
        assert!(text.contains("sleep_state=\"weights_offloaded\"} 0.0"));
        assert!(text.contains("sleep_state=\"discard_all\"} 1.0"));
    }

    #[test]
    fn parses_openai_bodies() {
        let g = parse_gen_request(
            Kind::Completion,
            "m",
            br#"{"model":"m","prompt":"one two  three","max_tokens":5}"#,
        )
        .ok();
        assert_eq!(
            g,
            Some(GenRequest {
                kind: Kind::Completion,
                prompt_tokens: 3,
                max_tokens: 5,
                stream: false,
                include_usage: false,
            })
        );
        let g = parse_gen_request(
            Kind::Chat,
            "m",
            br#"{"messages":[{"role":"user","content":"hi \u00e9 there"}],"stream":true}"#,
        )
        .ok()
        .map(|g| (g.prompt_tokens, g.max_tokens, g.stream));
        assert_eq!(g, Some((3, 16, true)));
        let status = |kind, body: &[u8]| parse_gen_request(kind, "m", body).err().map(|r| r.status);
        assert_eq!(
            status(Kind::Completion, br#"{"prompt":"x","model":"other"}"#),
            Some(404)
        );
        assert_eq!(status(Kind::Completion, br#"{"max_tokens":3}"#), Some(400));
        assert_eq!(
            status(Kind::Completion, br#"{"prompt":"x","max_tokens":0}"#),
            Some(400)
        );
        assert_eq!(
            status(Kind::Completion, br#"{"prompt":"x","max_tokens":5000}"#),
            Some(400)
        );
        assert_eq!(status(Kind::Chat, br#"{"messages":[}"#), Some(400));
    }

    #[test]
    fn queue_slots_and_sleep_abort() {
        let cfg = config::Config {
            max_num_seqs: 1,
            token_latency: Duration::from_millis(5),
            ..config::Config::default()
        };
        let engine = Arc::new(Engine::new(cfg));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let e = Arc::clone(&engine);
                thread::spawn(move || e.generate(2, 4, |_| Ok(())))
            })
            .collect();
        for h in handles {
            let outcome = h
                .join()
                .map_err(|_| "panicked")
                .and_then(|r| r.map_err(|_| "failed"));
            assert_eq!(outcome.map(|o| o.completion_tokens), Ok(4));
        }
        assert_eq!(engine.num_succeeded(), 3);

        // A long request is aborted by sleep(mode=abort); new ones are refused while asleep.
        let e = Arc::clone(&engine);
        let long = thread::spawn(move || e.generate(2, 1000, |_| Ok(())).err());
        while engine.num_running() == 0 {
            thread::sleep(Duration::from_millis(1));
        }
        engine.sleep(SleepLevel::One, SleepMode::Abort);
        assert_eq!(long.join().ok().flatten(), Some(GenError::Aborted));
        assert!(engine.is_sleeping());
        assert!(matches!(
            engine.generate(1, 1, |_| Ok(())),
            Err(GenError::Unavailable(_))
        ));
        assert!(engine.wake_up());
        assert_eq!(
            engine
                .generate(1, 1, |_| Ok(()))
                .ok()
                .map(|o| o.completion_tokens),
            Some(1)
        );
    }
}
