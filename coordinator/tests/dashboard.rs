//! The Grafana dashboard under packaging/grafana/ is valid JSON that Grafana imports, has the
//! panels operators need, and reads exactly the metrics its README's table documents. That
//! those metrics exist, with the labels the queries use, and return data is proven against a
//! real Prometheus by `tests/tests/prometheus.rs`.

use std::collections::BTreeSet;

use serde_json::Value;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/grafana");

fn dashboard() -> Value {
    let text = std::fs::read_to_string(format!("{DIR}/nightshift.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The `nightshift_*` names in `text`, a histogram's series by the histogram's name.
fn metric_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("nightshift_"))
        .map(|w| w.strip_suffix("_bucket").unwrap_or(w).to_owned())
        .collect()
}

#[test]
fn the_dashboard_shows_what_operators_need_and_imports() {
    let dash = dashboard();
    let panels = dash["panels"].as_array().unwrap();
    let titles: Vec<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();
    for wanted in [
        "GPUs by state",
        "Harvested GPU-hours (range)",
        "Reclaim latency per phase (p95)",
        "Queue length and age",
        "Preemptions and completions",
        "Serving load (vLLM)",
    ] {
        assert!(
            titles.contains(&wanted),
            "no panel {wanted:?} in {titles:?}"
        );
    }
    let ids: BTreeSet<u64> = panels.iter().filter_map(|p| p["id"].as_u64()).collect();
    assert_eq!(ids.len(), panels.len(), "panel ids must be unique");
    // Every query runs on the data source chosen at import, and has an id and a query.
    let datasource = serde_json::json!({"type": "prometheus", "uid": "${DS_PROMETHEUS}"});
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or("?");
        assert_eq!(panel["datasource"], datasource, "panel {title:?}");
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert_eq!(t["datasource"], datasource, "panel {title:?}");
            assert!(
                refs.insert(t["refId"].as_str().unwrap()),
                "panel {title:?}: refId repeated"
            );
            assert!(
                !t["expr"].as_str().unwrap().trim().is_empty(),
                "panel {title:?}"
            );
        }
    }
    assert_eq!(dash["__inputs"][0]["name"], "DS_PROMETHEUS");
}

#[test]
fn the_readme_documents_every_metric_the_dashboard_reads_and_no_other() {
    let dash = dashboard();
    let mut used = BTreeSet::new();
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            used.extend(metric_names(t["expr"].as_str().unwrap()));
        }
    }
    for var in dash["templating"]["list"].as_array().unwrap() {
        used.extend(metric_names(var["query"].as_str().unwrap_or_default()));
    }
    let readme = std::fs::read_to_string(format!("{DIR}/README.md")).unwrap();
    // The first column of the table's rows.
    let documented: BTreeSet<String> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .flat_map(|l| metric_names(l.split(" |").next().unwrap_or_default()))
        .collect();
    assert!(!documented.is_empty(), "no metric table in the README");
    assert_eq!(
        used, documented,
        "the dashboard reads (left) what packaging/grafana/README.md documents (right)"
    );
}
