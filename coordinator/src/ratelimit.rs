//! Per-token rate limits: a token bucket per API token, refilled with time.
//!
//! Pure: the caller passes the time, so tests need no clock.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// Requests per second each token may sustain.
pub const RATE_PER_S: f64 = 20.0;
/// Requests a token may send at once after a quiet spell.
pub const BURST: f64 = 60.0;

pub struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<u64, (f64, Instant)>>,
}

impl Default for RateLimiter {
    fn default() -> Self {
        Self::new(RATE_PER_S, BURST)
    }
}

impl RateLimiter {
    pub fn new(rate: f64, burst: f64) -> Self {
        Self {
            rate,
            burst,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request from `key`'s bucket at `now`; false when it is empty.
    pub fn allow(&self, key: u64, now: Instant) -> bool {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (tokens, last) = buckets.entry(key).or_insert((self.burst, now));
        let elapsed = now.saturating_duration_since(*last).as_secs_f64();
        *tokens = (*tokens + elapsed * self.rate).min(self.burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_burst_then_the_sustained_rate_per_token() {
        let limiter = RateLimiter::new(10.0, 3.0);
        let t0 = Instant::now();
        let allowed = (0..5).filter(|_| limiter.allow(1, t0)).count();
        assert_eq!(allowed, 3);
        // Another token has its own bucket.
        assert!(limiter.allow(2, t0));
        // 100 ms refill one request at 10/s.
        assert!(limiter.allow(1, t0 + Duration::from_millis(100)));
        assert!(!limiter.allow(1, t0 + Duration::from_millis(100)));
        // A long quiet spell refills only up to the burst.
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..10).filter(|_| limiter.allow(1, later)).count(), 3);
    }
}
