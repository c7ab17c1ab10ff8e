//! Times the phases of a simulation (arrivals, then each policy) for profiling:
//! `cargo run --release -p nightshift-sim --example phases -- servegen:DIR DAYS [POLICY..]`.

use std::time::Instant;

use nightshift_sim::{Policy, SimConfig, arrivals, scale_factor, simulate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let source = args
        .first()
        .ok_or("usage: phases KIND:PATH DAYS [POLICY..]")?;
    let days: f64 = args.get(1).map_or(Ok(1.0), |d| d.parse())?;
    let cfg = SimConfig {
        days,
        ..SimConfig::default()
    };
    let t = Instant::now();
    let trace = nightshift_cli::traces::load(source)?;
    eprintln!("load {:.2}s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let scale = scale_factor(&trace, &cfg)?;
    let a = arrivals::per_second(&trace, scale, cfg.horizon_s(), cfg.seed);
    eprintln!(
        "arrivals {:.2}s ({} requests)",
        t.elapsed().as_secs_f64(),
        a.iter().map(|&x| u64::from(x)).sum::<u64>()
    );
    for p in args.iter().skip(2) {
        let p: Policy = p.parse()?;
        let t = Instant::now();
        let r = simulate(&trace, &cfg, &[p])?;
        eprintln!(
            "{} {:.2}s (incl. arrivals) ratio {} slo {} per day {:?} capacity {} wait {} preemptions {} lost {}",
            p.name(),
            t.elapsed().as_secs_f64(),
            r.policies[0].harvest_ratio,
            r.policies[0].slo_violation_minutes,
            r.policies[0].slo_violation_minutes_per_day,
            r.policies[0].capacity_minutes,
            r.policies[0].queue_wait_minutes,
            r.policies[0].preemptions,
            r.policies[0].lost_gpu_hours,
        );
    }
    Ok(())
}
