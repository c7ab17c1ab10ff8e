//! Parsing a real vLLM 0.19.1 `/metrics` page (579 lines, 57 KB) into the agent's snapshot:
//! `Scrape::parse` then `VllmSnapshot::from_scrape`. Prints the median and the 10th/90th
//! percentiles over many runs. `cargo bench -p nightshift-agent --bench parse`.
//!
//! A plain timing loop (no criterion): the figure recorded in docs/BENCHMARKS.md is its
//! median; the target is 100 µs or less.

use std::hint::black_box;
use std::time::{Duration, Instant};

use nightshift_agent::serving::prometheus::Scrape;
use nightshift_agent::serving::vllm::VllmSnapshot;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/fixtures/vllm-metrics/kvwarden-vllm-0.19.1-llama3.1-8b-idle.prom"
);

fn main() {
    let page = match std::fs::read_to_string(FIXTURE) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cannot read {FIXTURE}: {e}");
            std::process::exit(1);
        }
    };
    let runs = 5_000;
    for _ in 0..500 {
        black_box(VllmSnapshot::from_scrape(&Scrape::parse(black_box(&page))));
    }
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            black_box(VllmSnapshot::from_scrape(&Scrape::parse(black_box(&page))));
            t.elapsed()
        })
        .collect();
    times.sort();
    let at = |q: f64| times[((runs as f64 - 1.0) * q) as usize];
    println!(
        "parse vLLM 0.19.1 scrape ({} bytes, {} lines): median {:?}, p10 {:?}, p90 {:?} over {runs} runs",
        page.len(),
        page.lines().count(),
        at(0.5),
        at(0.1),
        at(0.9)
    );
    let median = |mut f: Box<dyn FnMut() -> Duration>| {
        let mut t: Vec<Duration> = (0..runs).map(|_| f()).collect();
        t.sort();
        t[runs / 2]
    };
    let parse_only = median(Box::new(|| {
        let t = Instant::now();
        black_box(Scrape::parse(black_box(&page)));
        t.elapsed()
    }));
    let scrape = Scrape::parse(&page);
    let snapshot_only = median(Box::new(|| {
        let t = Instant::now();
        black_box(VllmSnapshot::from_scrape(black_box(&scrape)));
        t.elapsed()
    }));
    println!(
        "  of which Scrape::parse median {parse_only:?}, VllmSnapshot::from_scrape median {snapshot_only:?}"
    );
}
