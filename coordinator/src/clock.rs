//! The coordinator's clock: Unix milliseconds that follow the wall clock's rate but never
//! its steps.
//!
//! Leases, liveness and straggler holds are deadlines that the core compares with the time
//! it is given (ARCHITECTURE.md, invariant 4: a lease runs out only once its node has been silent for
//! the TTL). Were that time the wall clock, one step of it (an NTP step, a VM
//! resumed, an operator's `date -s`) would move every deadline at once: forward, every lease
//! would look expired while its agents still heartbeat and each job would start a second
//! time elsewhere; backward, a dead node would stay reachable, its job held, for the size
//! of the step.
//!
//! So the process reads the wall clock once, at its first reading, and counts from there on
//! the monotonic clock (`Instant`: `CLOCK_MONOTONIC`, which NTP slews at most 0.05 % but
//! never steps). The time handed out is still Unix milliseconds (stored, shown, and
//! compared with what other processes recorded), equal to the wall clock until it steps.
//! After a step, [`wall_offset_ms`] says by how much the wall clock has moved away; the
//! ticker logs it ([`note_step`]) and `/metrics` shows it. A restart takes up the wall
//! clock again: a restarted core renews every lease it finds, so nothing runs twice across
//! it either.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use nightshift_common::UnixMillis;

/// The wall clock and the monotonic clock, read together once.
struct Anchor {
    wall_ms: UnixMillis,
    at: Instant,
}

fn anchor() -> &'static Anchor {
    static ANCHOR: OnceLock<Anchor> = OnceLock::new();
    ANCHOR.get_or_init(|| Anchor {
        wall_ms: wall_ms(),
        at: Instant::now(),
    })
}

/// The wall clock as it reads now, in Unix milliseconds.
fn wall_ms() -> UnixMillis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The coordinator's time in Unix milliseconds: the wall clock at the first reading, plus
/// the monotonic time since. Never goes back, never jumps.
pub fn now_ms() -> UnixMillis {
    let a = anchor();
    a.wall_ms + a.at.elapsed().as_millis() as u64
}

/// How far the wall clock has stepped away from [`now_ms`] since the first reading, in
/// milliseconds (positive: the wall clock is ahead).
pub fn wall_offset_ms() -> i64 {
    // The anchor first, so that a first reading here measures 0, not the time to take it.
    anchor();
    let wall = wall_ms();
    let ours = now_ms();
    (wall as i128 - ours as i128).clamp(i64::MIN.into(), i64::MAX.into()) as i64
}

/// A wall-clock step smaller than this is left unsaid (a slewing NTP daemon and the two
/// readings' distance stay far below it).
pub const STEP_NOTED_MS: i64 = 1_000;

/// Logs a step of the wall clock once, when [`wall_offset_ms`] has moved by
/// [`STEP_NOTED_MS`] or more since the last step logged; returns the offset.
pub fn note_step() -> i64 {
    static LOGGED: AtomicI64 = AtomicI64::new(0);
    let offset = wall_offset_ms();
    let logged = LOGGED.load(Ordering::Relaxed);
    if (offset - logged).abs() >= STEP_NOTED_MS {
        LOGGED.store(offset, Ordering::Relaxed);
        tracing::warn!(
            wall_clock_ahead_ms = offset,
            "the wall clock stepped; leases, liveness and holds keep the coordinator's \
             monotonic time, and the times it records stay that far from the wall clock \
             until it restarts"
        );
    }
    offset
}
