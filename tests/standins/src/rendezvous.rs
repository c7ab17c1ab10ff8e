//! A gang's rendezvous and its per-step barrier, as torchrun's static rendezvous and NCCL's
//! collectives do them, over plain TCP (std only).
//!
//! Rank 0 listens on `MASTER_PORT` on all interfaces; every other rank connects to
//! `MASTER_ADDR:MASTER_PORT`, retrying with a bounded backoff until the rendezvous timeout. Rank 0
//! does not connect to itself: inside a container on a bridge network its own host's address is
//! often not reachable from within (no hairpin), and torchrun's rank 0 hosts the store anyway.
//!
//! The protocol is one text line per message, `key=value` fields separated by spaces:
//!
//! | from | message | meaning |
//! |---|---|---|
//! | rank r | `hello rank=r nnodes=n job=J attempt=A target=T every=E steps=100,200` | who it is, what it runs, the complete checkpoints it holds |
//! | rank 0 | `start step=S newest=300,200` | the gang resumes from step S (`none`: fresh); each rank's newest checkpoint, by rank (`-`: none) |
//! | rank 0 | `refused <reason>` | this hello cannot join (another job or attempt, a rank taken twice, other settings) |
//! | rank r | `ready step=N signal=G` | rank r finished step N; G is the stop signal it got, 0 for none |
//! | rank 0 | `go step=N` or `stop step=N signal=G by=R` | every rank advances to N + 1, or every rank checkpoints step N and exits |
//!
//! The start step is the newest checkpoint *every* rank holds (so no rank runs ahead of another),
//! and each round every rank waits for rank 0's word, so the gang advances in lock step and a
//! stop signal sent to any one member stops all of them at the same step. A peer that closes its
//! connection, resets it, or stays silent for the peer timeout fails every rank with an error
//! naming it, as a NCCL collective would.

use std::fmt;
use std::io::{self, BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// How long waits sleep before looking at the stop flag (and the clock) again.
const POLL: Duration = Duration::from_millis(20);
/// The first pause between two tries to reach rank 0; doubled after each failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest pause between two tries to reach rank 0.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// The longest one connection attempt may take (an address that drops SYNs).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long rank 0 waits for the hello of a connection it accepted.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// How this process takes part in its gang.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// This member's rank (`NODE_RANK`), below `nnodes`.
    pub rank: u32,
    /// The gang's size (`NNODES`), at least 2.
    pub nnodes: u32,
    /// Where the other ranks reach rank 0 (`MASTER_ADDR`): an IP address or a host name.
    pub master_addr: String,
    /// The port rank 0 listens on (`MASTER_PORT`).
    pub master_port: u16,
    /// How long the whole rendezvous may take.
    pub rendezvous_timeout: Duration,
    /// How long a peer may stay silent within a step before it counts as gone.
    pub peer_timeout: Duration,
}

impl Settings {
    /// `MASTER_ADDR:MASTER_PORT` as the other ranks dial it, for messages.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// Where rank 0 listens: all interfaces, of the family of `MASTER_ADDR`.
    pub fn listen_addr(&self) -> SocketAddr {
        let any = match self.master_addr.parse::<IpAddr>() {
            Ok(IpAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        };
        SocketAddr::new(any, self.master_port)
    }
}

/// What a member tells rank 0 about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub rank: u32,
    pub nnodes: u32,
    /// `NIGHTSHIFT_JOB_ID` and `NIGHTSHIFT_ATTEMPT`: only members of one attempt form a gang.
    pub job: String,
    pub attempt: String,
    /// The target step and the checkpoint interval, which every member must share to
    /// checkpoint at the same steps and finish together.
    pub target: u64,
    pub every: u64,
    /// The steps of the complete checkpoints this member holds, ascending.
    pub steps: Vec<u64>,
}

impl Hello {
    fn encode(&self) -> String {
        format!(
            "hello rank={} nnodes={} job={} attempt={} target={} every={} steps={}",
            self.rank,
            self.nnodes,
            token(&self.job),
            token(&self.attempt),
            self.target,
            self.every,
            join(self.steps.iter().map(u64::to_string), "none"),
        )
    }

    fn decode(line: &str) -> Result<Hello, String> {
        let fields = Fields::parse(line, "hello")?;
        let steps = match fields.get("steps")? {
            "none" => Vec::new(),
            list => list
                .split(',')
                .map(|s| s.parse().map_err(|_| format!("bad step {s:?} in {line:?}")))
                .collect::<Result<_, _>>()?,
        };
        Ok(Hello {
            rank: fields.number("rank")?,
            nnodes: fields.number("nnodes")?,
            job: fields.get("job")?.to_owned(),
            attempt: fields.get("attempt")?.to_owned(),
            target: fields.number("target")?,
            every: fields.number("every")?,
            steps,
        })
    }

    /// Why `member` cannot join the gang whose rank 0 said `self`; `None` if it can.
    fn refusal(&self, member: &Hello) -> Option<String> {
        let (me, them) = (self.for_comparison(), member.for_comparison());
        if me.0 != them.0 || me.1 != them.1 {
            return Some(format!(
                "it runs job {:?} attempt {:?}, rank 0 runs job {:?} attempt {:?}",
                them.0, them.1, me.0, me.1
            ));
        }
        if member.nnodes != self.nnodes {
            return Some(format!(
                "it counts {} nodes, rank 0 counts {}",
                member.nnodes, self.nnodes
            ));
        }
        if member.rank == 0 || member.rank >= self.nnodes {
            return Some(format!(
                "rank {} is not a member's rank in a gang of {}",
                member.rank, self.nnodes
            ));
        }
        if (member.target, member.every) != (self.target, self.every) {
            return Some(format!(
                "it trains to step {} checkpointing every {}, rank 0 to step {} every {}",
                member.target, member.every, self.target, self.every
            ));
        }
        None
    }

    fn for_comparison(&self) -> (String, String) {
        (token(&self.job), token(&self.attempt))
    }
}

/// What the gang agreed on at its rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreement {
    /// The newest checkpoint every rank holds; `None`: the gang starts fresh.
    pub start: Option<u64>,
    /// Each rank's newest checkpoint, by rank.
    pub newest: Vec<Option<u64>>,
}

impl Agreement {
    fn from_hellos(hellos: &[&Hello]) -> Agreement {
        let mut by_rank: Vec<&Hello> = hellos.to_vec();
        by_rank.sort_by_key(|h| h.rank);
        let lists: Vec<&[u64]> = by_rank.iter().map(|h| h.steps.as_slice()).collect();
        Agreement {
            start: common_step(&lists),
            newest: by_rank.iter().map(|h| h.steps.last().copied()).collect(),
        }
    }

    fn encode(&self) -> String {
        format!(
            "start step={} newest={}",
            self.start.map_or("none".to_owned(), |s| s.to_string()),
            join(
                self.newest
                    .iter()
                    .map(|n| n.map_or("-".to_owned(), |s| s.to_string())),
                "-"
            )
        )
    }

    fn decode(line: &str) -> Result<Agreement, String> {
        let fields = Fields::parse(line, "start")?;
        let start = match fields.get("step")? {
            "none" => None,
            s => Some(
                s.parse()
                    .map_err(|_| format!("bad step {s:?} in {line:?}"))?,
            ),
        };
        let newest = fields
            .get("newest")?
            .split(',')
            .map(|s| match s {
                "-" => Ok(None),
                s => s
                    .parse()
                    .map(Some)
                    .map_err(|_| format!("bad step {s:?} in {line:?}")),
            })
            .collect::<Result<_, _>>()?;
        Ok(Agreement { start, newest })
    }
}

/// The newest step present in every list; `None` when they share none.
pub fn common_step(lists: &[&[u64]]) -> Option<u64> {
    let (first, rest) = lists.split_first()?;
    first
        .iter()
        .rev()
        .copied()
        .find(|step| rest.iter().all(|list| list.contains(step)))
}

/// Why the rendezvous or a round ended without an agreement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Abort {
    /// A stop signal came during the rendezvous: nothing was agreed, nothing needs saving.
    Signal(i32),
    /// The gang cannot form or went on without this rank.
    Failed(String),
}

impl fmt::Display for Abort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Abort::Signal(signum) => write!(f, "stopped by signal {signum}"),
            Abort::Failed(reason) => f.write_str(reason),
        }
    }
}

/// What the gang does after a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// Every rank advances one step.
    Go,
    /// Every rank checkpoints the current step and exits: `by` got `signal` (rank 0's own
    /// signal wins, then the lowest rank's).
    Stop { signal: i32, by: u32 },
}

/// One connection of the gang.
struct Peer {
    rank: u32,
    addr: SocketAddr,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

/// Why a message did not arrive.
#[derive(Debug)]
enum Recv {
    Closed,
    TimedOut(Duration),
    Signal(i32),
    Io(io::Error),
}

impl fmt::Display for Recv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recv::Closed => f.write_str("the connection was closed"),
            Recv::TimedOut(d) => write!(f, "nothing arrived for {}", secs(*d)),
            Recv::Signal(signum) => write!(f, "stopped by signal {signum}"),
            Recv::Io(e) => write!(f, "{e}"),
        }
    }
}

impl Peer {
    fn new(rank: u32, stream: TcpStream, addr: SocketAddr, timeout: Duration) -> io::Result<Peer> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(timeout.max(POLL)))?;
        Ok(Peer {
            rank,
            addr,
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    fn send(&mut self, line: &str) -> io::Result<()> {
        self.writer.write_all(format!("{line}\n").as_bytes())
    }

    /// The next line, waiting until `deadline`; with `stop`, a stop signal ends the wait.
    fn recv(&mut self, deadline: Instant, stop: Option<&AtomicI32>) -> Result<String, Recv> {
        let started = Instant::now();
        let mut buf = Vec::new();
        loop {
            if let Some(signum) = stop.map(|s| s.load(Ordering::SeqCst)).filter(|&s| s != 0) {
                return Err(Recv::Signal(signum));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Recv::TimedOut(now - started));
            }
            // Short slices when a signal may end the wait; otherwise up to the deadline.
            let slice = if stop.is_some() {
                (deadline - now).min(POLL * 5)
            } else {
                deadline - now
            };
            self.reader
                .get_ref()
                .set_read_timeout(Some(slice.max(Duration::from_millis(1))))
                .map_err(Recv::Io)?;
            // `read_until` keeps what it read before a timeout in `buf`, so a line split
            // across slices is still read whole.
            match self.reader.read_until(b'\n', &mut buf) {
                Ok(_) if buf.ends_with(b"\n") => {
                    buf.pop();
                    return String::from_utf8(buf).map_err(|_| {
                        Recv::Io(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "a message that is not UTF-8",
                        ))
                    });
                }
                Ok(_) => return Err(Recv::Closed),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Recv::Io(e)),
            }
        }
    }
}

enum Role {
    /// Rank 0 with its members, by rank.
    Leader(Vec<Peer>),
    /// A member with its connection to rank 0 (dialled at `master`).
    Member { leader: Peer, master: String },
}

/// A gang that has met: [`Gang::barrier`] once per step keeps it in lock step.
pub struct Gang {
    rank: u32,
    role: Role,
    peer_timeout: Duration,
    stop: &'static AtomicI32,
}

impl Gang {
    /// This member's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Waits until every rank has finished `step`, then returns what all of them do next.
    /// Each rank reports the stop signal it got (read from the flag); rank 0 decides.
    pub fn barrier(&mut self, step: u64) -> Result<Round, String> {
        let deadline = Instant::now() + self.peer_timeout;
        let stop = self.stop;
        match &mut self.role {
            Role::Leader(members) => {
                let mut asked: Option<Round> = None;
                for m in members.iter_mut() {
                    let line = m
                        .recv(deadline, None)
                        .map_err(|e| lost(&member_name(m), step, &e))?;
                    let fields = Fields::parse(&line, "ready")
                        .map_err(|e| format!("{}: {e}", member_name(m)))?;
                    let (theirs, signal) =
                        (fields.number::<u64>("step")?, fields.number("signal")?);
                    if theirs != step {
                        return Err(format!(
                            "{} is at step {theirs} and rank 0 at step {step}: the gang is out of step",
                            member_name(m)
                        ));
                    }
                    if signal != 0 && asked.is_none() {
                        asked = Some(Round::Stop { signal, by: m.rank });
                    }
                }
                let own = stop.load(Ordering::SeqCst);
                let round = if own != 0 {
                    Round::Stop { signal: own, by: 0 }
                } else {
                    asked.unwrap_or(Round::Go)
                };
                let word = match round {
                    Round::Go => format!("go step={step}"),
                    Round::Stop { signal, by } => {
                        format!("stop step={step} signal={signal} by={by}")
                    }
                };
                for m in members.iter_mut() {
                    m.send(&word)
                        .map_err(|e| lost(&member_name(m), step, &Recv::Io(e)))?;
                }
                Ok(round)
            }
            Role::Member { leader, master } => {
                let name = format!("rank 0 at {master}");
                let signal = stop.load(Ordering::SeqCst);
                leader
                    .send(&format!("ready step={step} signal={signal}"))
                    .map_err(|e| lost(&name, step, &Recv::Io(e)))?;
                let line = leader
                    .recv(deadline, None)
                    .map_err(|e| lost(&name, step, &e))?;
                let (kind, fields) = match line.split_once(' ') {
                    Some(("go", _)) => ("go", Fields::parse(&line, "go")?),
                    Some(("stop", _)) => ("stop", Fields::parse(&line, "stop")?),
                    _ => return Err(format!("{name} sent {line:?} at step {step}")),
                };
                let theirs: u64 = fields.number("step")?;
                if theirs != step {
                    return Err(format!(
                        "{name} is at step {theirs} and this rank at step {step}: the gang is out of step"
                    ));
                }
                Ok(match kind {
                    "go" => Round::Go,
                    _ => Round::Stop {
                        signal: fields.number("signal")?,
                        by: fields.number("by")?,
                    },
                })
            }
        }
    }
}

fn member_name(m: &Peer) -> String {
    format!("rank {} (from {})", m.rank, m.addr)
}

fn lost(name: &str, step: u64, why: &Recv) -> String {
    format!("lost {name} at step {step}: {why}; a member of the gang is gone, so every rank stops")
}

/// Meets the rest of the gang: rank 0 waits for every other rank's hello, the others connect to
/// it. Returns the gang and the step it resumes from. A stop signal on `stop` (set by the
/// signal handler) ends the wait.
pub fn rendezvous(
    settings: &Settings,
    hello: &Hello,
    stop: &'static AtomicI32,
) -> Result<(Gang, Agreement), Abort> {
    let deadline = Instant::now() + settings.rendezvous_timeout;
    let role_and_agreement = if settings.rank == 0 {
        lead(settings, hello, stop, deadline)?
    } else {
        join_leader(settings, hello, stop, deadline)?
    };
    let (role, agreement) = role_and_agreement;
    Ok((
        Gang {
            rank: settings.rank,
            role,
            peer_timeout: settings.peer_timeout,
            stop,
        },
        agreement,
    ))
}

fn lead(
    settings: &Settings,
    own: &Hello,
    stop: &AtomicI32,
    deadline: Instant,
) -> Result<(Role, Agreement), Abort> {
    let bind = settings.listen_addr();
    let listener = TcpListener::bind(bind)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| {
            Abort::Failed(format!(
                "rank 0 cannot listen on {bind} for the rendezvous: {e}"
            ))
        })?;
    println!(
        "rendezvous: rank 0 of {} listening on {bind} (the others dial MASTER_ADDR:MASTER_PORT = {})",
        settings.nnodes,
        settings.master()
    );
    let mut joined: Vec<(Peer, Hello)> = Vec::new();
    while joined.len() + 1 < settings.nnodes as usize {
        let signum = stop.load(Ordering::SeqCst);
        if signum != 0 {
            return Err(Abort::Signal(signum));
        }
        if Instant::now() >= deadline {
            let missing: Vec<String> = (1..settings.nnodes)
                .filter(|r| !joined.iter().any(|(p, _)| p.rank == *r))
                .map(|r| r.to_string())
                .collect();
            return Err(Abort::Failed(format!(
                "rendezvous timed out after {}: rank 0 listened on {bind} (MASTER_ADDR:MASTER_PORT = {}) and {} of {} ranks joined; rank(s) {} never came",
                secs(settings.rendezvous_timeout),
                settings.master(),
                joined.len() + 1,
                settings.nnodes,
                missing.join(", ")
            )));
        }
        let (stream, addr) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(POLL);
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(Abort::Failed(format!(
                    "rank 0 cannot accept on {bind}: {e}"
                )));
            }
        };
        let mut peer = match Peer::new(u32::MAX, stream, addr, settings.peer_timeout) {
            Ok(peer) => peer,
            Err(e) => {
                eprintln!("rendezvous: dropping the connection from {addr}: {e}");
                continue;
            }
        };
        let line = match peer.recv((Instant::now() + HELLO_TIMEOUT).min(deadline), Some(stop)) {
            Ok(line) => line,
            Err(Recv::Signal(signum)) => return Err(Abort::Signal(signum)),
            Err(e) => {
                eprintln!("rendezvous: no hello from {addr}: {e}; dropping it");
                continue;
            }
        };
        let refusal = match Hello::decode(&line) {
            Err(e) => Some(format!("not a hello: {e}")),
            Ok(h) => match own.refusal(&h) {
                Some(why) => Some(why),
                None if joined.iter().any(|(p, _)| p.rank == h.rank) => {
                    Some(format!("rank {} has joined already", h.rank))
                }
                None => {
                    peer.rank = h.rank;
                    println!(
                        "rendezvous: rank {} joined from {addr} ({} of {})",
                        h.rank,
                        joined.len() + 2,
                        settings.nnodes
                    );
                    joined.push((peer, h));
                    continue;
                }
            },
        };
        let why = refusal.unwrap_or_default();
        eprintln!("rendezvous: refused {addr}: {why}");
        let _ = peer.send(&format!("refused {why}"));
    }
    joined.sort_by_key(|(p, _)| p.rank);
    let hellos: Vec<&Hello> = std::iter::once(own)
        .chain(joined.iter().map(|(_, h)| h))
        .collect();
    let agreement = Agreement::from_hellos(&hellos);
    let word = agreement.encode();
    let mut members = Vec::new();
    for (mut peer, _) in joined {
        peer.send(&word)
            .map_err(|e| Abort::Failed(lost(&member_name(&peer), 0, &Recv::Io(e))))?;
        members.push(peer);
    }
    Ok((Role::Leader(members), agreement))
}

fn join_leader(
    settings: &Settings,
    own: &Hello,
    stop: &AtomicI32,
    deadline: Instant,
) -> Result<(Role, Agreement), Abort> {
    let master = settings.master();
    let mut backoff = FIRST_BACKOFF;
    let mut tries = 0u32;
    let mut last_error = "no try was made".to_owned();
    let (stream, addr) = loop {
        tries += 1;
        match connect(settings, deadline) {
            Ok(connected) => break connected,
            Err(Some(e)) => last_error = e,
            Err(None) => tries -= 1,
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Abort::Failed(format!(
                "rendezvous timed out after {}: rank {} could not reach rank 0 at {master} (MASTER_ADDR:MASTER_PORT) in {tries} tries; the last said: {last_error}",
                secs(settings.rendezvous_timeout),
                settings.rank
            )));
        }
        let wake = (now + backoff).min(deadline);
        while Instant::now() < wake {
            let signum = stop.load(Ordering::SeqCst);
            if signum != 0 {
                return Err(Abort::Signal(signum));
            }
            thread::sleep(POLL.min(wake.saturating_duration_since(Instant::now())));
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    };
    let mut leader = Peer::new(0, stream, addr, settings.peer_timeout)
        .map_err(|e| Abort::Failed(format!("rendezvous with rank 0 at {master}: {e}")))?;
    leader
        .send(&own.encode())
        .map_err(|e| Abort::Failed(format!("rendezvous with rank 0 at {master}: {e}")))?;
    println!(
        "rendezvous: rank {} of {} connected to rank 0 at {master} ({addr}); waiting for the others",
        settings.rank, settings.nnodes
    );
    let line = match leader.recv(deadline, Some(stop)) {
        Ok(line) => line,
        Err(Recv::Signal(signum)) => return Err(Abort::Signal(signum)),
        Err(e) => {
            return Err(Abort::Failed(format!(
                "rendezvous with rank 0 at {master} failed before the gang formed: {e}"
            )));
        }
    };
    if let Some(why) = line.strip_prefix("refused ") {
        return Err(Abort::Failed(format!(
            "rank 0 at {master} refused rank {}: {why}",
            settings.rank
        )));
    }
    let agreement =
        Agreement::decode(&line).map_err(|e| Abort::Failed(format!("rank 0 at {master}: {e}")))?;
    Ok((Role::Member { leader, master }, agreement))
}

/// One try to reach rank 0 at each address `MASTER_ADDR` resolves to: the last error, or
/// `None` when the deadline passed before any try.
fn connect(
    settings: &Settings,
    deadline: Instant,
) -> Result<(TcpStream, SocketAddr), Option<String>> {
    if Instant::now() >= deadline {
        return Err(None);
    }
    let addrs: Vec<SocketAddr> = (settings.master_addr.as_str(), settings.master_port)
        .to_socket_addrs()
        .map_err(|e| Some(format!("cannot resolve {}: {e}", settings.master_addr)))?
        .collect();
    let mut last = format!("{} resolves to no address", settings.master_addr);
    for addr in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&addr, left.min(CONNECT_TIMEOUT)) {
            Ok(stream) => return Ok((stream, addr)),
            Err(e) => last = format!("{addr}: {e}"),
        }
    }
    Err(Some(last))
}

/// The `key=value` fields of one message after its leading word.
struct Fields<'a> {
    line: &'a str,
    pairs: Vec<(&'a str, &'a str)>,
}

impl<'a> Fields<'a> {
    fn parse(line: &'a str, word: &str) -> Result<Fields<'a>, String> {
        let mut parts = line.split(' ');
        if parts.next() != Some(word) {
            return Err(format!("expected a {word:?} message, got {line:?}"));
        }
        let pairs = parts
            .map(|p| {
                p.split_once('=')
                    .ok_or_else(|| format!("bad field {p:?} in {line:?}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Fields { line, pairs })
    }

    fn get(&self, key: &str) -> Result<&'a str, String> {
        self.pairs
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .ok_or_else(|| format!("no {key} in {:?}", self.line))
    }

    fn number<T: std::str::FromStr>(&self, key: &str) -> Result<T, String> {
        let v = self.get(key)?;
        v.parse()
            .map_err(|_| format!("bad {key}={v:?} in {:?}", self.line))
    }
}

/// `s` as one field value: no spaces, never empty.
fn token(s: &str) -> String {
    if s.is_empty() {
        "-".to_owned()
    } else {
        s.chars()
            .map(|c| {
                if c.is_whitespace() || c == '=' {
                    '_'
                } else {
                    c
                }
            })
            .collect()
    }
}

fn join(items: impl Iterator<Item = String>, empty: &str) -> String {
    let items: Vec<String> = items.collect();
    if items.is_empty() {
        empty.to_owned()
    } else {
        items.join(",")
    }
}

/// A duration in seconds, to the millisecond, for messages: `1.5 s`.
fn secs(d: Duration) -> String {
    format!("{} s", d.as_millis() as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(rank: u32, steps: &[u64]) -> Hello {
        Hello {
            rank,
            nnodes: 2,
            job: "7".into(),
            attempt: "2".into(),
            target: 100,
            every: 10,
            steps: steps.to_vec(),
        }
    }

    #[test]
    fn hellos_and_agreements_round_trip() {
        for h in [
            hello(1, &[10, 20, 30]),
            hello(1, &[]),
            Hello {
                job: String::new(),
                ..hello(0, &[0])
            },
        ] {
            let decoded = Hello::decode(&h.encode()).unwrap();
            assert_eq!(decoded.for_comparison(), h.for_comparison());
            assert_eq!((decoded.rank, &decoded.steps), (h.rank, &h.steps));
        }
        let a = Agreement {
            start: Some(20),
            newest: vec![Some(30), Some(20), None],
        };
        assert_eq!(a.encode(), "start step=20 newest=30,20,-");
        assert_eq!(Agreement::decode(&a.encode()), Ok(a));
        let fresh = Agreement {
            start: None,
            newest: vec![None, None],
        };
        assert_eq!(Agreement::decode(&fresh.encode()), Ok(fresh));
    }

    #[test]
    fn the_gang_starts_from_the_newest_checkpoint_every_rank_holds() {
        assert_eq!(common_step(&[&[10, 20, 30], &[10, 20]]), Some(20));
        assert_eq!(
            common_step(&[&[10, 20, 30], &[20, 30, 40], &[30]]),
            Some(30)
        );
        assert_eq!(common_step(&[&[10, 20], &[]]), None);
        assert_eq!(common_step(&[&[10, 30], &[20, 40]]), None);
        assert_eq!(common_step(&[]), None);
        let a = Agreement::from_hellos(&[&hello(1, &[10, 20]), &hello(0, &[20, 30])]);
        assert_eq!(
            a,
            Agreement {
                start: Some(20),
                newest: vec![Some(30), Some(20)]
            }
        );
    }

    #[test]
    fn rank_zero_refuses_strangers() {
        let leader = hello(0, &[]);
        assert_eq!(leader.refusal(&hello(1, &[5])), None);
        let other_attempt = Hello {
            attempt: "1".into(),
            ..hello(1, &[])
        };
        assert!(leader.refusal(&other_attempt).unwrap().contains("attempt"));
        assert!(leader.refusal(&hello(2, &[])).unwrap().contains("rank 2"));
        assert!(leader.refusal(&hello(0, &[])).unwrap().contains("rank 0"));
        let other_target = Hello {
            target: 50,
            ..hello(1, &[])
        };
        assert!(leader.refusal(&other_target).unwrap().contains("step 50"));
    }

    #[test]
    fn master_and_listen_addresses() {
        let mut s = Settings {
            rank: 0,
            nnodes: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            rendezvous_timeout: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(1),
        };
        assert_eq!(s.master(), "10.0.0.1:29500");
        assert_eq!(s.listen_addr().to_string(), "0.0.0.0:29500");
        s.master_addr = "fd00::1".into();
        assert_eq!(s.master(), "[fd00::1]:29500");
        assert_eq!(s.listen_addr().to_string(), "[::]:29500");
    }
}
