//! Arrivals per second of simulated time, drawn once per run and shared by every policy.
//!
//! ServeGen windows: each client's arrivals inside a window follow the renewal process with
//! the inter-arrival law the file fitted (Gamma or Weibull, its shape as given), its scale set
//! so that the mean rate is the window's rate times the scale factor. Scaling stretches time
//! and keeps each window's burstiness (its coefficient of variation). When a client sends
//! many requests per second relative to its burstiness (rate ≥ `EXACT_LIMIT` × max(1, CV²)
//! per second), the count in each second is drawn from the renewal process's normal limit
//! (mean r, variance r·CV²) instead of one draw per request; bursty or slow clients are always
//! drawn request by request. Request traces (Azure, Mooncake) are thinned (or replicated) by
//! the scale factor; a rate CSV gives Poisson arrivals. A trace shorter than the run repeats.

use crate::par;
use crate::rng::{Rng, gamma_fn};
use crate::trace::{Interarrival, Trace, TraceData};

/// Above this many arrivals per second per unit of CV², a second's count is drawn at once.
pub const EXACT_LIMIT: f64 = 20.0;

/// Arrivals in each second `0..horizon_s`, the trace scaled by `scale`.
pub fn per_second(trace: &Trace, scale: f64, horizon_s: u64, seed: u64) -> Vec<u32> {
    let mut counts = vec![0u32; horizon_s as usize];
    let span = trace.span_s.max(1);
    match &trace.data {
        TraceData::Windows { window_s, clients } => {
            let client = |counts: &mut Vec<u32>, c: usize| {
                let mut rng = Rng::stream(seed, 1_000 + c as u64);
                let mut offset = 0;
                while offset < horizon_s {
                    for w in &clients[c] {
                        let start = offset + w.start_s;
                        if start >= horizon_s {
                            break;
                        }
                        let end = (start + window_s).min(horizon_s);
                        window(counts, &mut rng, start, end, w.rate * scale, w.law);
                    }
                    offset += span;
                }
            };
            // Each client draws from its own stream and a sum does not depend on its order,
            // so the total is the same on any number of cores. The costliest clients start
            // first, so that no core is left with a long one at the end.
            let cost = |c: usize| -> f64 {
                clients[c]
                    .iter()
                    .map(|w| draws(w.rate * scale, w.law, *window_s))
                    .sum()
            };
            let mut order: Vec<(f64, usize)> = (0..clients.len()).map(|c| (cost(c), c)).collect();
            order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let parts = par::fold(
                order.len(),
                || vec![0u32; horizon_s as usize],
                |counts, k| client(counts, order[k].1),
            );
            for part in parts {
                for (total, n) in counts.iter_mut().zip(part) {
                    *total += n;
                }
            }
        }
        TraceData::Requests(times) => {
            let mut rng = Rng::stream(seed, 2);
            let mut offset = 0.0;
            while (offset as u64) < horizon_s {
                for t in times {
                    let keep = scale.floor() as u32 + u32::from(rng.uniform() < scale.fract());
                    if let Some(c) = counts.get_mut((offset + t) as usize) {
                        *c += keep;
                    }
                }
                offset += span as f64;
            }
        }
        TraceData::Rates(points) => {
            let mut rng = Rng::stream(seed, 3);
            for (s, c) in counts.iter_mut().enumerate() {
                let t = (s as u64 % span) as f64;
                let i = points.partition_point(|p| p.0 <= t);
                let rate = if i == 0 { 0.0 } else { points[i - 1].1 };
                *c = rng.poisson(rate * scale) as u32;
            }
        }
    }
    counts
}

/// The squared coefficient of variation of a law's inter-arrival times.
pub fn cv2(law: Interarrival) -> f64 {
    match law {
        Interarrival::Poisson => 1.0,
        Interarrival::Gamma { shape } => 1.0 / shape,
        Interarrival::Weibull { shape } => {
            let m = gamma_fn(1.0 + 1.0 / shape);
            gamma_fn(1.0 + 2.0 / shape) / (m * m) - 1.0
        }
    }
}

/// The random draws `window` makes for a window of `window_s` seconds at `rate`: one per
/// request, or one per second above the exact limit.
fn draws(rate: f64, law: Interarrival, window_s: u64) -> f64 {
    if rate <= 0.0 {
        0.0
    } else if rate >= EXACT_LIMIT * cv2(law).max(1.0) {
        window_s as f64
    } else {
        rate * window_s as f64
    }
}

fn window(counts: &mut [u32], rng: &mut Rng, start: u64, end: u64, rate: f64, law: Interarrival) {
    if rate <= 0.0 || end <= start {
        return;
    }
    let cv2 = cv2(law);
    if rate >= EXACT_LIMIT * cv2.max(1.0) {
        let sd = (rate * cv2).sqrt();
        for c in &mut counts[start as usize..end as usize] {
            *c += (rate + sd * rng.normal()).round().max(0.0) as u32;
        }
        return;
    }
    let mean = 1.0 / rate;
    let mut draw: Box<dyn FnMut(&mut Rng) -> f64> = match law {
        Interarrival::Poisson => Box::new(move |r: &mut Rng| -mean * r.uniform().ln()),
        Interarrival::Gamma { shape } => {
            let scale = mean / shape;
            Box::new(move |r: &mut Rng| scale * r.gamma(shape))
        }
        Interarrival::Weibull { shape } => {
            let scale = mean / gamma_fn(1.0 + 1.0 / shape);
            Box::new(move |r: &mut Rng| scale * r.weibull(shape))
        }
    };
    let mut t = start as f64 + draw(rng);
    while t < end as f64 {
        counts[t as usize] += 1;
        t += draw(rng);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Window;

    fn one_client(rate: f64, law: Interarrival) -> Trace {
        Trace {
            name: "t".into(),
            span_s: 3_600,
            data: TraceData::Windows {
                window_s: 600,
                clients: vec![
                    (0..6)
                        .map(|i| Window {
                            start_s: i * 600,
                            rate,
                            law,
                        })
                        .collect(),
                ],
            },
        }
    }

    #[test]
    fn scaled_mean_rate_is_kept_and_bursty_laws_are_burstier() {
        let calm = per_second(
            &one_client(4.0, Interarrival::Gamma { shape: 4.0 }),
            0.5,
            3_600,
            1,
        );
        let bursty = per_second(
            &one_client(4.0, Interarrival::Weibull { shape: 0.3 }),
            0.5,
            3_600,
            1,
        );
        let stats = |v: &[u32]| {
            let m = v.iter().map(|&c| c as f64).sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|&c| (c as f64 - m).powi(2)).sum::<f64>() / v.len() as f64;
            (m, var)
        };
        let (m1, v1) = stats(&calm);
        let (m2, v2) = stats(&bursty);
        assert!((m1 - 2.0).abs() < 0.1, "calm mean {m1}");
        assert!((m2 - 2.0).abs() < 0.4, "bursty mean {m2}");
        assert!(v2 > 3.0 * v1, "bursty variance {v2} vs calm {v1}");
    }

    #[test]
    fn fast_clients_use_the_normal_limit_with_the_same_mean() {
        let v = per_second(
            &one_client(500.0, Interarrival::Gamma { shape: 2.0 }),
            1.0,
            3_600,
            3,
        );
        let m = v.iter().map(|&c| c as f64).sum::<f64>() / v.len() as f64;
        assert!((m - 500.0).abs() < 2.0, "mean {m}");
    }

    #[test]
    fn request_traces_repeat_and_thin() {
        let t = Trace {
            name: "r".into(),
            span_s: 10,
            data: TraceData::Requests(vec![0.5, 1.5, 1.7, 9.9]),
        };
        let v = per_second(&t, 1.0, 20, 0);
        assert_eq!(
            v,
            vec![1, 2, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 0, 0, 0, 0, 0, 0, 0, 1]
        );
        let doubled = per_second(&t, 2.0, 10, 0);
        assert_eq!(doubled.iter().sum::<u32>(), 8);
    }
}
