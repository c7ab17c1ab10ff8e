//! Time as the planner sees it: a [`Moment`] handed in, never a clock read.

use std::ops::Add;
use std::time::Duration;

/// A point on the agent's monotonic clock, as the time since the executor's origin (the
/// instant it began counting, when the agent started).
///
/// The planner takes `now` as a `Moment` and keeps the ones it is given (when a wait began),
/// but it never reads a clock: the executor reads tokio's and converts, a test or a
/// simulator makes them up (`Moment::ZERO + Duration::from_secs(5)`). It is a value, not
/// `std::time::Instant`, because an `Instant` can only be had by reading the clock: a pure
/// test could not build one, and nothing that runs on simulated time could drive the
/// planner. Nanoseconds, as `Instant`, so no wait is rounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Moment(Duration);

impl Moment {
    /// The executor's origin.
    pub const ZERO: Self = Self(Duration::ZERO);

    /// The moment `since` after the origin.
    pub const fn from_origin(since: Duration) -> Self {
        Self(since)
    }

    /// How long after the origin this is.
    pub const fn since_origin(self) -> Duration {
        self.0
    }

    /// How long after `earlier` this is; zero when `earlier` is later (as
    /// `Instant::duration_since`).
    pub fn duration_since(self, earlier: Self) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Moment {
    type Output = Self;

    fn add(self, d: Duration) -> Self {
        Self(self.0 + d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_between_moments_saturate_at_zero() {
        let t = Moment::ZERO + Duration::from_secs(3);
        assert_eq!(t.since_origin(), Duration::from_secs(3));
        assert_eq!(t.duration_since(Moment::ZERO), Duration::from_secs(3));
        assert_eq!(Moment::ZERO.duration_since(t), Duration::ZERO);
        assert_eq!(Moment::from_origin(Duration::from_secs(3)), t);
    }
}
