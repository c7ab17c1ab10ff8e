//! Rate limits: a token bucket per key, refilled with time. Keys are API tokens (requests
//! each token may send) or client addresses (failed authentications each address may make,
//! so that tokens cannot be guessed at line rate).
//!
//! Pure: the caller passes the time, so tests need no clock.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Requests per second each token may sustain.
pub const RATE_PER_S: f64 = 20.0;
/// Requests a token may send at once after a quiet spell.
pub const BURST: f64 = 60.0;

/// Failed authentications (no token, or an unknown one) per second a client address may
/// sustain; beyond, its calls are refused (429) before any token is looked at.
pub const FAILED_AUTH_PER_S: f64 = 1.0;
/// Failed authentications a client address may make at once (a mistyped token, a retry).
pub const FAILED_AUTH_BURST: f64 = 10.0;

/// Buckets kept before the full ones (keys quiet long enough to have refilled) are dropped.
const MAX_KEYS: usize = 65_536;

pub struct RateLimiter<K = u64> {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<K, (f64, Instant)>>,
}

impl<K: Hash + Eq> Default for RateLimiter<K> {
    fn default() -> Self {
        Self::new(RATE_PER_S, BURST)
    }
}

impl<K: Hash + Eq> RateLimiter<K> {
    pub fn new(rate: f64, burst: f64) -> Self {
        Self {
            rate,
            burst,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// The limiter of failed authentications per client address.
    pub fn failed_auth() -> Self {
        Self::new(FAILED_AUTH_PER_S, FAILED_AUTH_BURST)
    }

    /// `key`'s bucket refilled to `now`.
    fn refilled(&self, bucket: (f64, Instant), now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(bucket.1).as_secs_f64();
        (bucket.0 + elapsed * self.rate).min(self.burst)
    }

    /// Takes one request from `key`'s bucket at `now`; false when it is empty.
    pub fn allow(&self, key: K, now: Instant) -> bool {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= MAX_KEYS && !buckets.contains_key(&key) {
            buckets.retain(|_, b| self.refilled(*b, now) < self.burst);
            if buckets.len() >= MAX_KEYS {
                // Every key busy: forget them all rather than grow without bound.
                buckets.clear();
            }
        }
        let bucket = buckets.entry(key).or_insert((self.burst, now));
        let tokens = self.refilled(*bucket, now);
        let allowed = tokens >= 1.0;
        *bucket = (if allowed { tokens - 1.0 } else { tokens }, now);
        allowed
    }

    /// How long until `key` may make a request, at `now`: zero when it may now. Takes
    /// nothing from its bucket.
    pub fn wait(&self, key: &K, now: Instant) -> Duration {
        let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        match buckets.get(key) {
            Some(b) => {
                let tokens = self.refilled(*b, now);
                if tokens >= 1.0 {
                    Duration::ZERO
                } else {
                    Duration::from_secs_f64((1.0 - tokens) / self.rate)
                }
            }
            None => Duration::ZERO,
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

    #[test]
    fn wait_says_when_an_empty_bucket_refills_and_takes_nothing() {
        let limiter = RateLimiter::<&str>::new(2.0, 2.0);
        let t0 = Instant::now();
        assert_eq!(limiter.wait(&"a", t0), Duration::ZERO);
        assert!(limiter.allow("a", t0) && limiter.allow("a", t0));
        assert_eq!(limiter.wait(&"a", t0), Duration::from_millis(500));
        let later = limiter.wait(&"a", t0 + Duration::from_millis(200));
        assert_eq!((later.as_secs_f64() * 1000.0).round(), 300.0);
        // Looking took nothing.
        assert!(limiter.allow("a", t0 + Duration::from_millis(500)));
    }

    #[test]
    fn keys_stay_bounded() {
        let limiter = RateLimiter::<u32>::new(1.0, 1.0);
        let t0 = Instant::now();
        for k in 0..(MAX_KEYS as u32 + 10) {
            assert!(limiter.allow(k, t0));
        }
        assert!(limiter.buckets.lock().unwrap().len() <= MAX_KEYS);
    }
}
