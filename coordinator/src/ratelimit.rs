//! Rate limits: a token bucket per key, refilled with time. Keys are API tokens (requests
//! each token may send) or client addresses (failed authentications each address may make,
//! so that tokens cannot be guessed at line rate). An IPv6 client counts by its /64
//! ([`client_prefix`]): one host usually owns a whole /64 and could otherwise change its
//! address for every guess.
//!
//! Pure: the caller passes the time, so tests need no clock.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr};
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
    /// The bucket a key counts in, when not its own (client addresses: their prefix).
    bucket_of: Option<fn(&K) -> K>,
}

/// The part of a client address that one client owns: an IPv4 address whole (an IPv4 client
/// of a dual-stack listener, seen as `::ffff:a.b.c.d`, too), an IPv6 address's /64.
pub fn client_prefix(ip: &IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => *ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !((1u128 << 64) - 1))),
        },
    }
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
            bucket_of: None,
        }
    }

    /// `key`'s bucket refilled to `now`.
    fn refilled(&self, bucket: (f64, Instant), now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(bucket.1).as_secs_f64();
        (bucket.0 + elapsed * self.rate).min(self.burst)
    }

    /// Takes one request from `key`'s bucket at `now`; false when it is empty.
    pub fn allow(&self, key: K, now: Instant) -> bool {
        let key = match self.bucket_of {
            Some(bucket_of) => bucket_of(&key),
            None => key,
        };
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
        let bucket = self.bucket_of.map(|bucket_of| bucket_of(key));
        let key = bucket.as_ref().unwrap_or(key);
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

impl RateLimiter<IpAddr> {
    /// The limiter of failed authentications per client ([`client_prefix`]).
    pub fn failed_auth() -> Self {
        Self {
            bucket_of: Some(client_prefix),
            ..Self::new(FAILED_AUTH_PER_S, FAILED_AUTH_BURST)
        }
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
    fn failed_authentications_count_per_ipv6_64_and_per_ipv4_address() {
        let limiter = RateLimiter::failed_auth();
        let t0 = Instant::now();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        // A host hopping through its /64 empties one bucket, then waits like any client.
        let burst = FAILED_AUTH_BURST as u32;
        for i in 0..burst {
            let hop = ip(&format!("2001:db8:1:2:{i:x}:abcd:0:1"));
            assert!(limiter.allow(hop, t0), "hop {i}");
        }
        let next = ip("2001:db8:1:2:ffff:ffff:ffff:ffff");
        assert!(!limiter.allow(next, t0));
        assert!(!limiter.wait(&next, t0).is_zero());
        // The next /64 over, and IPv4 clients (mapped ones too), have their own buckets.
        let neighbour = ip("2001:db8:1:3::1");
        assert!(limiter.wait(&neighbour, t0).is_zero());
        assert!(limiter.allow(neighbour, t0));
        for i in 0..burst {
            assert!(limiter.allow(ip("192.0.2.1"), t0), "192.0.2.1 #{i}");
        }
        assert!(!limiter.allow(ip("::ffff:192.0.2.1"), t0));
        assert!(limiter.allow(ip("::ffff:192.0.2.2"), t0));
        assert!(limiter.allow(ip("192.0.2.3"), t0));

        assert_eq!(
            client_prefix(&ip("2001:db8:1:2:3:4:5:6")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(client_prefix(&ip("::ffff:10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(client_prefix(&ip("10.0.0.7")), ip("10.0.0.7"));
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
