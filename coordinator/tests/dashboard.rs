//! The Grafana dashboard under packaging/grafana/ is valid JSON, has the panels operators
//! need, and asks only for the metric names its README promises.

use std::collections::BTreeSet;

/// The metric names of packaging/grafana/README.md.
const METRICS: &[&str] = &[
    "nightshift_gpus",
    "nightshift_harvested_gpu_seconds_total",
    "nightshift_phase_duration_seconds_bucket",
    "nightshift_jobs",
    "nightshift_queue_oldest_age_seconds",
    "nightshift_job_preemptions_total",
    "nightshift_jobs_finished_total",
    "nightshift_vllm_requests_waiting",
    "nightshift_vllm_requests_running",
];

#[test]
fn the_dashboard_shows_what_operators_need_with_known_metrics() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../packaging/grafana/nightshift.json"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let panels = dash["panels"].as_array().unwrap();
    let titles: Vec<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();
    for wanted in [
        "GPUs by state",
        "Harvested GPU-hours (range)",
        "Reclaim latency per phase (p95)",
        "Queue length and age",
    ] {
        assert!(
            titles.contains(&wanted),
            "no panel {wanted:?} in {titles:?}"
        );
    }
    let mut used = BTreeSet::new();
    for panel in panels {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("nightshift_") {
                    assert!(METRICS.contains(&word), "{word} is not a documented metric");
                    used.insert(word);
                }
            }
        }
    }
    assert_eq!(used.len(), METRICS.len(), "documented but unused: {used:?}");
    let ids: BTreeSet<u64> = panels.iter().filter_map(|p| p["id"].as_u64()).collect();
    assert_eq!(ids.len(), panels.len(), "panel ids must be unique");
}
