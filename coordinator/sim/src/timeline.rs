//! What a run looked like minute by minute (for the charts of `nightshift simulate --html`)
//! and the queue waits its users felt: each second's wait, the worst of each day and each
//! minute's 99th percentile (docs/SIMULATOR.md, "Figures").

/// One simulated minute of one policy's run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MinuteSample {
    /// Requests that arrived in the minute.
    pub arrivals: f64,
    /// The fewest replicas ready at any second of the minute.
    pub min_ready: u32,
    /// The most replicas serving or starting at any second of the minute.
    pub max_up: u32,
    /// The most hosts with a job on their GPUs at any second of the minute.
    pub max_lent: u32,
    /// Fewer replicas were ready than the minute's need at some second (a capacity minute).
    pub capacity_short: bool,
    /// The minute violates the SLO: its requests waited longer than the target on average,
    /// or one found no ready replica.
    pub slo_violated: bool,
    /// Job containers stopped before finishing in the minute.
    pub preemptions: u32,
}

/// The queue wait of the requests that arrived in each second, and its summaries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Waits {
    /// Seconds each second's last request waited (the fluid queue serves a second's arrivals
    /// in order, so the last waits longest); dropped once summarised.
    per_second: Vec<f32>,
    /// Per simulated day, the longest wait of any second's arrivals, in seconds.
    pub worst_s_per_day: Vec<f64>,
    /// Per minute, the 99th percentile of its requests' wait, in seconds (0 without
    /// arrivals).
    pub minute_p99_s: Vec<f32>,
    /// The 99th percentile over the minutes that had arrivals of `minute_p99_s`.
    pub p99_of_minute_p99_s: f64,
}

/// The `q`-quantile (0 < q ≤ 1) of `values` by nearest rank; 0 for none.
fn nearest_rank(values: &mut [f32], q: f64) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f32::total_cmp);
    let rank = (q * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// The `q`-quantile of a wait over requests, from `(wait, requests)` per second: the least
/// wait that at least a share `q` of the requests did not exceed; 0 for no requests.
pub fn weighted_quantile(seconds: &mut [(f32, u32)], q: f64) -> f32 {
    let total: u64 = seconds.iter().map(|&(_, n)| u64::from(n)).sum();
    if total == 0 {
        return 0.0;
    }
    seconds.sort_by(|a, b| a.0.total_cmp(&b.0));
    let want = q * total as f64;
    let mut seen = 0u64;
    for &(wait, n) in seconds.iter() {
        seen += u64::from(n);
        if seen as f64 >= want {
            return wait;
        }
    }
    seconds.last().map_or(0.0, |s| s.0)
}

impl Waits {
    pub fn new(seconds: usize) -> Self {
        Self {
            per_second: vec![0.0; seconds],
            ..Self::default()
        }
    }

    /// The requests of second `s` waited `wait_s` (the last of them).
    pub fn set(&mut self, s: u64, wait_s: f64) {
        if let Some(w) = self.per_second.get_mut(s as usize) {
            *w = wait_s as f32;
        }
    }

    /// The worst wait per day and each minute's 99th percentile, from the seconds' waits
    /// weighted by their `arrivals`; frees the per-second record.
    pub fn summarise(&mut self, arrivals: &[u32]) {
        let per_second = std::mem::take(&mut self.per_second);
        self.worst_s_per_day = arrivals
            .chunks(86_400)
            .zip(per_second.chunks(86_400))
            .map(|(a, w)| {
                let worst = a
                    .iter()
                    .zip(w)
                    .filter(|(a, _)| **a > 0)
                    .map(|(_, &w)| w)
                    .fold(0.0f32, f32::max);
                f64::from(worst)
            })
            .collect();
        let mut minute = Vec::with_capacity(60);
        let mut busy = Vec::new();
        self.minute_p99_s = arrivals
            .chunks(60)
            .zip(per_second.chunks(60))
            .map(|(a, w)| {
                minute.clear();
                minute.extend(w.iter().zip(a).map(|(&w, &a)| (w, a)));
                let p99 = weighted_quantile(&mut minute, 0.99);
                if a.iter().any(|&a| a > 0) {
                    busy.push(p99);
                }
                p99
            })
            .collect();
        self.p99_of_minute_p99_s = f64::from(nearest_rank(&mut busy, 0.99));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_count_requests_not_seconds() {
        // 98 requests waited 0 s, one 1 s, one 5 s: the 99th percentile of the requests is
        // the 99th request, 1 s; the 100th percentile is 5 s.
        let mut s = vec![(5.0, 1), (0.0, 98), (1.0, 1)];
        assert_eq!(weighted_quantile(&mut s, 0.99), 1.0);
        assert_eq!(weighted_quantile(&mut s, 1.0), 5.0);
        assert_eq!(weighted_quantile(&mut s, 0.5), 0.0);
        assert_eq!(weighted_quantile(&mut [(3.0, 0)], 0.99), 0.0);
        let mut v = (1..=200).map(|i| i as f32).collect::<Vec<_>>();
        assert_eq!(nearest_rank(&mut v, 0.99), 198.0);
        assert_eq!(nearest_rank(&mut [], 0.99), 0.0);
    }

    #[test]
    fn seconds_without_arrivals_do_not_count() {
        // Two days of one-second waits; day 2's worst second had no arrivals.
        let mut arrivals = vec![1u32; 2 * 86_400];
        let mut w = Waits::new(arrivals.len());
        w.set(100, 7.0);
        w.set(86_400 + 5, 9.0);
        arrivals[86_400 + 5] = 0;
        w.set(86_400 + 6, 3.0);
        w.summarise(&arrivals);
        assert_eq!(w.worst_s_per_day, vec![7.0, 3.0]);
        // Minute 1 of the run: one second of 60 waited 7 s, so its p99 is 7 s (each second
        // holds 1/60 of its requests, more than 1 %); every other minute's is 0.
        assert_eq!(w.minute_p99_s[1], 7.0);
        assert_eq!(w.minute_p99_s[0], 0.0);
        assert_eq!(w.minute_p99_s.len(), 2 * 1_440);
        assert_eq!(w.p99_of_minute_p99_s, 0.0);
    }
}
