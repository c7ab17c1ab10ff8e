//! The store's health as the last write left it: what `/healthz` reports, and how a failure
//! that repeats is logged: its first occurrence at once, then one summary every
//! [`SUMMARY_EVERY`] while it lasts, and one line when writing works again. A store that
//! cannot be written (a full disk) fails every write, several a second; one line each would
//! bury everything else in the log.
//!
//! Pure: the caller passes the time.

use std::time::{Duration, Instant};

/// How often a failure that goes on is summarised in the log.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
pub struct StoreHealth {
    failing: Option<Failing>,
}

#[derive(Debug)]
struct Failing {
    since: Instant,
    reason: String,
    /// Failures since writing last worked.
    count: u64,
    /// Failures since the last line logged.
    unlogged: u64,
    logged_at: Instant,
}

/// What the log should say about a failed write.
#[derive(Debug, PartialEq, Eq)]
pub enum FailureLog {
    /// The first failure since writing last worked: log it.
    First,
    /// Still failing: `failures` more since the last line, failing for `failing_for`.
    Summary {
        failures: u64,
        failing_for: Duration,
    },
    /// Still failing, summarised later.
    Quiet,
}

/// Writing works again after `failures` failed writes over `failed_for`.
#[derive(Debug, PartialEq, Eq)]
pub struct Recovered {
    pub failures: u64,
    pub failed_for: Duration,
}

impl StoreHealth {
    /// A write failed at `now` because of `reason`.
    pub fn failed(&mut self, now: Instant, reason: String) -> FailureLog {
        let Some(f) = &mut self.failing else {
            self.failing = Some(Failing {
                since: now,
                reason,
                count: 1,
                unlogged: 0,
                logged_at: now,
            });
            return FailureLog::First;
        };
        f.reason = reason;
        f.count += 1;
        f.unlogged += 1;
        if now.saturating_duration_since(f.logged_at) < SUMMARY_EVERY {
            return FailureLog::Quiet;
        }
        let failures = std::mem::take(&mut f.unlogged);
        f.logged_at = now;
        FailureLog::Summary {
            failures,
            failing_for: now.saturating_duration_since(f.since),
        }
    }

    /// A write worked at `now`; says so when writes were failing.
    pub fn succeeded(&mut self, now: Instant) -> Option<Recovered> {
        let f = self.failing.take()?;
        Some(Recovered {
            failures: f.count,
            failed_for: now.saturating_duration_since(f.since),
        })
    }

    /// Why the last write failed, and for how long writes have failed, while they do.
    pub fn failure(&self, now: Instant) -> Option<String> {
        self.failing.as_ref().map(|f| {
            format!(
                "state not saved: the last {} write(s) failed, for {} s: {}",
                f.count,
                now.saturating_duration_since(f.since).as_secs(),
                f.reason
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeating_failure_is_logged_once_then_summarised_until_it_ends() {
        let mut h = StoreHealth::default();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        assert_eq!(h.failure(t0), None);
        assert_eq!(h.failed(t0, "disk full".into()), FailureLog::First);
        // Seven a second for the rest of the window: nothing logged.
        let quiet = (1..210)
            .filter(|i| h.failed(ms(i * 140), "disk full".into()) != FailureLog::Quiet)
            .count();
        assert_eq!(quiet, 0);
        assert_eq!(
            h.failed(ms(30_000), "disk full".into()),
            FailureLog::Summary {
                failures: 210,
                failing_for: Duration::from_secs(30)
            }
        );
        assert_eq!(h.failed(ms(30_100), "disk full".into()), FailureLog::Quiet);
        let why = h.failure(ms(31_000)).unwrap();
        assert_eq!(
            why,
            "state not saved: the last 212 write(s) failed, for 31 s: disk full"
        );
        assert_eq!(
            h.succeeded(ms(32_000)),
            Some(Recovered {
                failures: 212,
                failed_for: Duration::from_secs(32)
            })
        );
        assert_eq!(h.failure(ms(32_000)), None);
        assert_eq!(h.succeeded(ms(33_000)), None);
        // A new failure is news again.
        assert_eq!(h.failed(ms(40_000), "disk full".into()), FailureLog::First);
    }
}
