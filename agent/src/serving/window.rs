//! Signals derived from successive scrapes of one replica: token rates and TTFT quantiles
//! over a sliding window.
//!
//! A [`LoadWindow`] keeps the counters and the TTFT histogram of each scrape for the last
//! `span` (plus the one sample just before it, so a rate covers the whole span). Rates are
//! the sum of the increases between consecutive samples divided by the time they cover; a
//! counter that went down means vLLM restarted, and the new value counts as the increase
//! since the restart, as Prometheus' `rate()` does. TTFT p50/p95 come from the bucket deltas
//! over the window, interpolated linearly inside the bucket as `histogram_quantile` does.
//! No sample, or no observation in the window, gives `None`: unknown, never zero.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::vllm::{Bucket, VllmSnapshot};

/// The window the agent reports over unless told otherwise.
pub const DEFAULT_SPAN: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
struct Point {
    at: Instant,
    prompt_tokens: Option<f64>,
    generation_tokens: Option<f64>,
    ttft: Option<Vec<Bucket>>,
}

/// What the window says now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Derived {
    pub prompt_tokens_per_s: Option<f64>,
    pub generation_tokens_per_s: Option<f64>,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p95_s: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct LoadWindow {
    span: Duration,
    points: VecDeque<Point>,
}

impl LoadWindow {
    pub fn new(span: Duration) -> Self {
        Self {
            span,
            points: VecDeque::new(),
        }
    }

    /// Adds a scrape taken at `at` (times must not go backwards) and answers the window's
    /// signals.
    pub fn push(&mut self, at: Instant, snapshot: &VllmSnapshot) -> Derived {
        if self.points.back().is_some_and(|last| at < last.at) {
            self.points.clear();
        }
        self.points.push_back(Point {
            at,
            prompt_tokens: snapshot.prompt_tokens_total,
            generation_tokens: snapshot.generation_tokens_total,
            ttft: snapshot.ttft_buckets.clone(),
        });
        // Keep one point at or before the window's start.
        while self.points.len() > 2 && at.duration_since(self.points[1].at) >= self.span {
            self.points.pop_front();
        }
        self.derived()
    }

    /// Forgets every scrape (the replica stopped, or a page was unreadable).
    pub fn clear(&mut self) {
        self.points.clear();
    }

    pub fn derived(&self) -> Derived {
        let ttft = self.ttft_delta();
        Derived {
            prompt_tokens_per_s: self.rate(|p| p.prompt_tokens),
            generation_tokens_per_s: self.rate(|p| p.generation_tokens),
            ttft_p50_s: ttft.as_deref().and_then(|b| quantile(0.5, b)),
            ttft_p95_s: ttft.as_deref().and_then(|b| quantile(0.95, b)),
        }
    }

    /// Per-second increase of a counter over the window, resets counted as restarts from 0.
    /// `None` unless every point in the window has the counter.
    fn rate(&self, counter: impl Fn(&Point) -> Option<f64>) -> Option<f64> {
        let (first, last) = (self.points.front()?, self.points.back()?);
        let seconds = last.at.duration_since(first.at).as_secs_f64();
        if seconds <= 0.0 {
            return None;
        }
        let values = self
            .points
            .iter()
            .map(&counter)
            .collect::<Option<Vec<f64>>>()?;
        let increase: f64 = values.windows(2).map(|w| increase(w[0], w[1])).sum();
        Some(increase / seconds)
    }

    /// The observations added to each cumulative bucket over the window.
    fn ttft_delta(&self) -> Option<Vec<Bucket>> {
        if self.points.len() < 2 {
            return None;
        }
        let all = self
            .points
            .iter()
            .map(|p| p.ttft.as_ref())
            .collect::<Option<Vec<&Vec<Bucket>>>>()?;
        let mut delta: Vec<Bucket> = all[0].iter().map(|b| Bucket { count: 0.0, ..*b }).collect();
        for pair in all.windows(2) {
            let (before, after) = (pair[0], pair[1]);
            let same_layout = before.len() == after.len()
                && before.iter().zip(after.iter()).all(|(a, b)| a.le == b.le);
            let restarted =
                !same_layout || before.iter().zip(after).any(|(a, b)| b.count < a.count);
            if !same_layout {
                // A restart with other buckets: only what came after it can be read.
                delta = after.iter().map(|b| Bucket { count: 0.0, ..*b }).collect();
            }
            for (i, d) in delta.iter_mut().enumerate() {
                d.count += if restarted {
                    after[i].count
                } else {
                    after[i].count - before[i].count
                };
            }
        }
        Some(delta)
    }
}

fn increase(before: f64, after: f64) -> f64 {
    if after >= before {
        after - before
    } else {
        after
    }
}

/// The `q` quantile of cumulative buckets ending in `+Inf`, as Prometheus'
/// `histogram_quantile` computes it; `None` with no observation or no `+Inf` bucket.
pub fn quantile(q: f64, buckets: &[Bucket]) -> Option<f64> {
    let last = buckets.last()?;
    if last.le != f64::INFINITY || last.count <= 0.0 {
        return None;
    }
    let rank = q * last.count;
    let mut lower = (0.0, 0.0); // (le, count) of the bucket below
    for b in buckets {
        if b.count >= rank {
            if b.le == f64::INFINITY {
                return Some(lower.0);
            }
            let in_bucket = b.count - lower.1;
            if in_bucket <= 0.0 {
                return Some(b.le);
            }
            return Some(lower.0 + (b.le - lower.0) * (rank - lower.1) / in_bucket);
        }
        lower = (b.le, b.count);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(prompt: f64, generation: f64, ttft: &[(f64, f64)]) -> VllmSnapshot {
        VllmSnapshot {
            prompt_tokens_total: Some(prompt),
            generation_tokens_total: Some(generation),
            ttft_buckets: (!ttft.is_empty()).then(|| {
                ttft.iter()
                    .map(|&(le, count)| Bucket { le, count })
                    .collect()
            }),
            ..VllmSnapshot::default()
        }
    }

    const INF: f64 = f64::INFINITY;

    #[test]
    fn one_scrape_says_nothing() {
        let mut w = LoadWindow::new(DEFAULT_SPAN);
        let d = w.push(
            Instant::now(),
            &snap(100.0, 10.0, &[(0.1, 1.0), (INF, 1.0)]),
        );
        assert_eq!(d, Derived::default());
    }

    #[test]
    fn rates_over_the_window() {
        let t0 = Instant::now();
        let mut w = LoadWindow::new(Duration::from_secs(10));
        w.push(t0, &snap(100.0, 10.0, &[]));
        w.push(t0 + Duration::from_secs(1), &snap(150.0, 30.0, &[]));
        let d = w.push(t0 + Duration::from_secs(2), &snap(300.0, 50.0, &[]));
        assert_eq!(d.prompt_tokens_per_s, Some(100.0));
        assert_eq!(d.generation_tokens_per_s, Some(20.0));
        assert_eq!(d.ttft_p50_s, None, "no histogram, no ttft");
    }

    #[test]
    fn a_counter_reset_counts_from_zero() {
        let t0 = Instant::now();
        let mut w = LoadWindow::new(Duration::from_secs(10));
        w.push(t0, &snap(1000.0, 0.0, &[]));
        w.push(t0 + Duration::from_secs(1), &snap(1100.0, 0.0, &[]));
        // vLLM restarted: the counter starts again from 0 and reached 50.
        let d = w.push(t0 + Duration::from_secs(2), &snap(50.0, 0.0, &[]));
        assert_eq!(d.prompt_tokens_per_s, Some(75.0));
        assert!(d.prompt_tokens_per_s.is_some_and(|r| r >= 0.0));
    }

    #[test]
    fn old_points_leave_the_window() {
        let t0 = Instant::now();
        let mut w = LoadWindow::new(Duration::from_secs(2));
        for (i, total) in [0.0, 1000.0, 1010.0, 1020.0, 1030.0].iter().enumerate() {
            w.push(t0 + Duration::from_secs(i as u64), &snap(*total, 0.0, &[]));
        }
        // The burst between 0 s and 1 s is older than the window.
        assert_eq!(w.derived().prompt_tokens_per_s, Some(10.0));
    }

    #[test]
    fn ttft_quantiles_from_bucket_deltas() {
        let t0 = Instant::now();
        let mut w = LoadWindow::new(Duration::from_secs(60));
        // 917 observations before the window, mostly fast.
        w.push(
            t0,
            &snap(0.0, 0.0, &[(0.1, 800.0), (1.0, 900.0), (INF, 917.0)]),
        );
        // In the window: 10 new observations, all between 0.1 s and 1 s.
        let d = w.push(
            t0 + Duration::from_secs(5),
            &snap(0.0, 0.0, &[(0.1, 800.0), (1.0, 910.0), (INF, 927.0)]),
        );
        let p50 = d.ttft_p50_s.expect("p50");
        let p95 = d.ttft_p95_s.expect("p95");
        assert!((p50 - 0.55).abs() < 1e-9, "{p50}");
        assert!((p95 - 0.955).abs() < 1e-9, "{p95}");
    }

    #[test]
    fn ttft_with_no_new_observation_is_unknown() {
        let t0 = Instant::now();
        let mut w = LoadWindow::new(Duration::from_secs(60));
        let h = [(0.1, 5.0), (INF, 5.0)];
        w.push(t0, &snap(0.0, 0.0, &h));
        let d = w.push(t0 + Duration::from_secs(1), &snap(0.0, 0.0, &h));
        assert_eq!((d.ttft_p50_s, d.ttft_p95_s), (None, None));
    }

    #[test]
    fn ttft_survives_a_restart() {
        let t0 = Instant::now();
        let mut w = LoadWindow::new(Duration::from_secs(60));
        w.push(t0, &snap(0.0, 0.0, &[(0.1, 100.0), (INF, 100.0)]));
        // Restarted: 4 observations since, all above 0.1 s.
        let d = w.push(
            t0 + Duration::from_secs(1),
            &snap(0.0, 0.0, &[(0.1, 0.0), (INF, 4.0)]),
        );
        assert_eq!(
            d.ttft_p50_s,
            Some(0.1),
            "the +Inf bucket answers its lower bound"
        );
    }

    #[test]
    fn quantile_edge_cases() {
        assert_eq!(quantile(0.5, &[]), None);
        assert_eq!(
            quantile(
                0.5,
                &[Bucket {
                    le: 1.0,
                    count: 3.0
                }]
            ),
            None
        );
        let b = [
            Bucket {
                le: 1.0,
                count: 2.0,
            },
            Bucket {
                le: 2.0,
                count: 4.0,
            },
            Bucket {
                le: INF,
                count: 4.0,
            },
        ];
        assert_eq!(quantile(0.5, &b), Some(1.0));
        assert_eq!(quantile(0.75, &b), Some(1.5));
    }
}
