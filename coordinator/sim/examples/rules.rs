//! What one family of lending rules reaches on a trace, from the minutes' need alone, beside
//! the foresight figure (docs/BENCHMARKS.md, "One family of lending rules"). The rules are a
//! yardstick, not a bound: a policy outside the family (the core's learned headroom) can and
//! does beat them. Only the foresight figure bounds every policy that keeps each minute's
//! need ready.
//!
//! `cargo run --release -p nightshift-sim --example rules -- servegen:DIR [DAYS]
//! [--fill-trace-gaps] [--sleep]` (`--sleep`: the reclaim lead of lending by vLLM sleep).
//!
//! Lending and taking back are free and instant apart from the reclaim lead, jobs waste
//! nothing, and a rule's parameters may be chosen with hindsight. Figures are ratios to
//! `oracle_gpu_hours`, as `harvest_ratio` is.
//!
//! - **foresight**: the need of every coming minute is known exactly, but a node taken back
//!   serves only a reclaim lead later (the job's checkpoint save plus the replica's start),
//!   so each minute holds the highest need of the lead that follows it. No policy that keeps
//!   every minute's need ready lends more: an upper bound.
//! - **rule K+h**: a causal rule that sees the need up to one lead ago and holds the highest
//!   need of its last K minutes plus h spare replicas; for each K, the smallest h with no
//!   minute short over the whole run, and what it lends.
//! - per day, the best rule K+h chosen with hindsight for that day alone, and the largest
//!   rise of the need within one lead: what a policy that cannot see it coming must already
//!   hold.

use nightshift_sim::model::Release;
use nightshift_sim::{SimConfig, arrivals, baseline, scale_factor};

const RULE_WINDOWS_MIN: [usize; 5] = [1, 5, 10, 30, 60];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |args: &mut Vec<String>, name: &str| {
        let on = args.iter().any(|a| a == name);
        args.retain(|a| a != name);
        on
    };
    let fill = flag(&mut args, "--fill-trace-gaps");
    let sleep = flag(&mut args, "--sleep");
    let source = args
        .first()
        .ok_or("usage: rules KIND:PATH [DAYS] [--fill-trace-gaps] [--sleep]")?;
    let days: f64 = args.get(1).map_or(Ok(14.0), |d| d.parse())?;
    let mut cfg = SimConfig {
        days,
        ..SimConfig::default()
    };
    if sleep {
        cfg.lifecycle.release = Release::Sleep;
    }
    let mut trace = nightshift_cli::traces::load(source)?;
    if fill {
        let gaps = trace.fill_gaps();
        let windows: u64 = gaps.iter().map(|g| g.windows).sum();
        println!(
            "trace gaps filled: {windows} windows in {} stretches",
            gaps.len()
        );
    }
    let scale = scale_factor(&trace, &cfg)?;
    let arrivals = arrivals::per_second(&trace, scale, cfg.horizon_s(), cfg.seed);
    let need = baseline::need_per_minute(&arrivals, &cfg.replica, cfg.min_replicas);
    let lead_s = cfg.lifecycle.checkpoint_save_s + cfg.lifecycle.start_s();
    let lead = lead_s.div_ceil(60) as usize;
    let rules = Rules {
        need: &need,
        nodes: cfg.nodes,
        lead,
    };
    println!(
        "{} minutes, {} nodes, reclaim lead {lead_s} s ({lead} min)",
        need.len(),
        cfg.nodes
    );
    let all = 0..need.len();
    println!(
        "foresight (exact need, real reclaim lead; an upper bound): {:.4}",
        rules.foresight(all.clone())
    );
    let peaks: Vec<(usize, Vec<u32>)> = RULE_WINDOWS_MIN
        .iter()
        .map(|&k| (k, rules.seen_peaks(k)))
        .collect();
    for (k, p) in &peaks {
        if let Some((h, ratio)) = rules.cheapest_safe_rule(p, all.clone()) {
            println!(
                "rule K={k:>2} min: h = {h:>2} spare replicas keep every minute, ratio {ratio:.4}"
            );
        }
    }
    println!(
        "day  oracle GPU-h  foresight  best rule K+h, chosen with hindsight  largest rise in one lead"
    );
    let mut best_lent = 0.0;
    for start in (0..need.len()).step_by(1_440) {
        let day = start..(start + 1_440).min(need.len());
        let oracle = rules.oracle(day.clone());
        let best = peaks
            .iter()
            .filter_map(|(k, p)| {
                let (h, r) = rules.cheapest_safe_rule(p, day.clone())?;
                Some((r, *k, h))
            })
            .max_by(|a, b| a.0.total_cmp(&b.0));
        let Some((r, k, h)) = best else { continue };
        best_lent += r * oracle;
        println!(
            "{:>3}  {:>12.1}  {:>9.4}  {r:.4} (K={k}, h={h}){:>18}",
            start / 1_440 + 1,
            oracle * f64::from(cfg.gpus_per_node) / 60.0,
            rules.foresight(day.clone()),
            rules.largest_rise(day),
        );
    }
    println!(
        "each day's best rule K+h, chosen with hindsight (not a bound), over the whole run: {:.4}",
        best_lent / rules.oracle(all)
    );
    Ok(())
}

struct Rules<'a> {
    need: &'a [u32],
    nodes: u32,
    /// Minutes from taking a node back to its replica serving.
    lead: usize,
}

type Minutes = std::ops::Range<usize>;

impl Rules<'_> {
    /// Node-minutes lent over `minutes` when `held(m)` replicas serve in minute `m`, each
    /// minute at most what the oracle lends.
    fn lent(&self, minutes: Minutes, held: impl Fn(usize) -> u32) -> f64 {
        minutes
            .map(|m| f64::from(self.nodes.saturating_sub(held(m).max(self.need[m]))))
            .sum()
    }

    fn oracle(&self, minutes: Minutes) -> f64 {
        self.lent(minutes, |_| 0)
    }

    /// The highest need from minute `from` to `to`, both included and clipped to the run.
    fn peak(&self, from: usize, to: usize) -> u32 {
        let to = to.min(self.need.len() - 1);
        self.need[from..=to].iter().copied().max().unwrap_or(0)
    }

    /// Each minute holds the highest need of the lead that follows it.
    fn foresight(&self, minutes: Minutes) -> f64 {
        self.lent(minutes.clone(), |m| self.peak(m, m + self.lead)) / self.oracle(minutes)
    }

    /// Rule K+h before its `h`: the highest need of minutes `m-lead-k+1 ..= m-lead` for each
    /// minute `m`, or the whole fleet until the rule has seen a minute.
    fn seen_peaks(&self, k: usize) -> Vec<u32> {
        (0..self.need.len())
            .map(|m| match m.checked_sub(self.lead) {
                Some(seen) => self.peak((seen + 1).saturating_sub(k), seen),
                None => self.nodes,
            })
            .collect()
    }

    /// The smallest `h` with no minute of `minutes` short under rule K+h, and its ratio.
    fn cheapest_safe_rule(&self, peaks: &[u32], minutes: Minutes) -> Option<(u32, f64)> {
        let held = |h: u32| move |m: usize| (peaks[m] + h).min(self.nodes);
        (0..=self.nodes).find_map(|h| {
            let short = minutes.clone().any(|m| held(h)(m) < self.need[m]);
            (!short).then(|| {
                let ratio = self.lent(minutes.clone(), held(h)) / self.oracle(minutes.clone());
                (h, ratio)
            })
        })
    }

    /// The largest rise of the need within one lead over `minutes`: from a minute to the
    /// highest of the lead after it.
    fn largest_rise(&self, minutes: Minutes) -> u32 {
        minutes
            .map(|m| self.peak(m, m + self.lead).saturating_sub(self.need[m]))
            .max()
            .unwrap_or(0)
    }
}
