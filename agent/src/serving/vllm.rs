//! vLLM's metric families, across versions, read from a parsed `/metrics` page.
//!
//! One replica may run several engine cores (data parallelism); V1 labels each series with
//! `engine`, V0 has only `model_name`. Every series of a family is folded into one replica
//! value: queue lengths and counters are summed, KV-cache usage is the fullest engine's.
//! `vllm:kv_cache_usage_perc` (V1) is preferred over the older `vllm:gpu_cache_usage_perc`
//! (V0 up to 0.11). Families are matched by exact name, so the `_created` gauges that V1 adds
//! next to every counter and histogram are never read. A family that is absent, or holds a
//! `NaN` or infinite value, is `None`: unknown, never zero. A series repeated with the same
//! labels (a duplicate on a broken page) counts once, its last value winning.

use nightshift_common::ServingSignals;

use super::prometheus::{Sample, Scrape};

pub const REQUESTS_RUNNING: &str = "vllm:num_requests_running";
pub const REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
pub const KV_CACHE_USAGE: &str = "vllm:kv_cache_usage_perc";
/// The V0 name of [`KV_CACHE_USAGE`], removed in vLLM 0.12.
pub const GPU_CACHE_USAGE: &str = "vllm:gpu_cache_usage_perc";
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
pub const TTFT_BUCKETS: &str = "vllm:time_to_first_token_seconds_bucket";
pub const ENGINE_SLEEP_STATE: &str = "vllm:engine_sleep_state";

/// The `sleep_state` label values of `vllm:engine_sleep_state`, shallowest first.
pub const SLEEP_STATES: [&str; 3] = ["awake", "weights_offloaded", "discard_all"];

/// What one scrape of a vLLM replica says, engines folded together.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VllmSnapshot {
    /// Sum of `vllm:num_requests_running`.
    pub requests_running: Option<f64>,
    /// Sum of `vllm:num_requests_waiting`.
    pub requests_waiting: Option<f64>,
    /// Largest `vllm:kv_cache_usage_perc` (else `vllm:gpu_cache_usage_perc`), 0 to 1.
    pub kv_cache_usage: Option<f64>,
    /// Sum of the monotonic counter `vllm:prompt_tokens_total`.
    pub prompt_tokens_total: Option<f64>,
    /// Sum of the monotonic counter `vllm:generation_tokens_total`.
    pub generation_tokens_total: Option<f64>,
    /// Cumulative buckets of `vllm:time_to_first_token_seconds`, summed per `le` over
    /// engines, in increasing `le` order; `None` when the page has none.
    pub ttft_buckets: Option<Vec<Bucket>>,
    /// How many distinct `engine` label values the `vllm:` series carry; `None` on pages
    /// without the label (V0).
    pub engines: Option<u32>,
    /// The replica's sleep state from `vllm:engine_sleep_state`: the shallowest state any
    /// engine is in (the replica sleeps only when every engine does).
    pub sleep_state: Option<&'static str>,
}

/// One cumulative histogram bucket: `count` observations were at most `le`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Upper bound; `f64::INFINITY` for the `+Inf` bucket.
    pub le: f64,
    pub count: f64,
}

impl VllmSnapshot {
    pub fn from_scrape(scrape: &Scrape<'_>) -> Self {
        Self {
            requests_running: sum(scrape, REQUESTS_RUNNING),
            requests_waiting: sum(scrape, REQUESTS_WAITING),
            kv_cache_usage: max(scrape, KV_CACHE_USAGE).or_else(|| max(scrape, GPU_CACHE_USAGE)),
            prompt_tokens_total: sum(scrape, PROMPT_TOKENS),
            generation_tokens_total: sum(scrape, GENERATION_TOKENS),
            ttft_buckets: buckets(scrape, TTFT_BUCKETS),
            engines: engines(scrape),
            sleep_state: sleep_state(scrape),
        }
    }

    /// The part of the snapshot the agent reports in its heartbeat.
    pub fn signals(&self) -> ServingSignals {
        ServingSignals {
            requests_running: self.requests_running,
            requests_waiting: self.requests_waiting,
            kv_cache_usage: self.kv_cache_usage,
            engines: self.engines,
            sleep_state: self.sleep_state.map(str::to_owned),
            ..ServingSignals::default()
        }
    }
}

impl From<&VllmSnapshot> for ServingSignals {
    fn from(snapshot: &VllmSnapshot) -> Self {
        snapshot.signals()
    }
}

/// The finite values of every series named `name`; `None` when there is no series or one
/// of them is `NaN` or infinite.
fn values(scrape: &Scrape<'_>, name: &str) -> Option<Vec<f64>> {
    let values: Vec<f64> = distinct(scrape, name)
        .iter()
        .map(|sample| sample.value)
        .collect();
    let usable = !values.is_empty() && values.iter().all(|value| value.is_finite());
    usable.then_some(values)
}

/// The series named `name`, one per label set (the last of duplicates wins).
fn distinct<'s, 'a>(scrape: &'s Scrape<'a>, name: &'s str) -> Vec<&'s Sample<'a>> {
    let mut kept: Vec<&Sample<'_>> = Vec::new();
    for sample in scrape.series(name) {
        match kept.iter_mut().find(|k| same_labels(k, sample)) {
            Some(slot) => *slot = sample,
            None => kept.push(sample),
        }
    }
    kept
}

fn same_labels(a: &Sample<'_>, b: &Sample<'_>) -> bool {
    a.labels.len() == b.labels.len() && a.labels.iter().all(|(k, v)| b.label(k) == Some(v.as_ref()))
}

/// Distinct `engine` label values over every `vllm:` series.
fn engines(scrape: &Scrape<'_>) -> Option<u32> {
    let mut seen: Vec<&str> = scrape
        .samples
        .iter()
        .filter(|s| s.name.starts_with("vllm:"))
        .filter_map(|s| s.label("engine"))
        .collect();
    seen.sort_unstable();
    seen.dedup();
    (!seen.is_empty()).then_some(seen.len() as u32)
}

/// Per engine, the state whose gauge is 1; then the shallowest of them.
fn sleep_state(scrape: &Scrape<'_>) -> Option<&'static str> {
    distinct(scrape, ENGINE_SLEEP_STATE)
        .into_iter()
        .filter(|s| s.value == 1.0)
        .filter_map(|s| {
            let state = s.label("sleep_state")?;
            SLEEP_STATES.iter().position(|known| *known == state)
        })
        .min()
        .map(|i| SLEEP_STATES[i])
}

fn sum(scrape: &Scrape<'_>, name: &str) -> Option<f64> {
    values(scrape, name).map(|values| values.iter().sum())
}

fn max(scrape: &Scrape<'_>, name: &str) -> Option<f64> {
    values(scrape, name).map(|values| values.into_iter().fold(f64::NEG_INFINITY, f64::max))
}

/// Histogram buckets summed per `le` across series. A bucket without a readable `le`, or
/// with a non-finite count, makes the whole histogram unknown.
fn buckets(scrape: &Scrape<'_>, name: &str) -> Option<Vec<Bucket>> {
    let mut buckets = distinct(scrape, name)
        .into_iter()
        .map(bucket)
        .collect::<Option<Vec<_>>>()?;
    if buckets.is_empty() {
        return None;
    }
    buckets.sort_by(|a, b| a.le.total_cmp(&b.le));
    buckets.dedup_by(|later, kept| {
        let same = later.le == kept.le;
        if same {
            kept.count += later.count;
        }
        same
    });
    Some(buckets)
}

fn bucket(sample: &Sample<'_>) -> Option<Bucket> {
    let le = sample
        .label("le")?
        .parse::<f64>()
        .ok()
        .filter(|le| !le.is_nan())?;
    sample.value.is_finite().then_some(Bucket {
        le,
        count: sample.value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURES: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/fixtures/vllm-metrics"
    );

    fn snapshot_of_fixture(name: &str) -> VllmSnapshot {
        let text = std::fs::read_to_string(format!("{FIXTURES}/{name}")).expect("fixture readable");
        let scrape = Scrape::parse(&text);
        assert_eq!(scrape.errors, vec![], "{name}");
        VllmSnapshot::from_scrape(&scrape)
    }

    fn snapshot(text: &str) -> VllmSnapshot {
        VllmSnapshot::from_scrape(&Scrape::parse(text))
    }

    fn buckets(pairs: &[(f64, f64)]) -> Option<Vec<Bucket>> {
        Some(
            pairs
                .iter()
                .map(|&(le, count)| Bucket { le, count })
                .collect(),
        )
    }

    #[test]
    fn every_fixture_is_covered() {
        let mut names: Vec<String> = std::fs::read_dir(FIXTURES)
            .expect("fixture directory")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|name| name.ends_with(".prom"))
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "aibrix-runtime-doc-vllm-v0-engine.prom",
                "kvwarden-vllm-0.19.1-llama3.1-8b-idle.prom",
                "vllm-docs-design-metrics-example-partial.prom",
                "vllm-docs-design-metrics-http-grep-partial.prom",
                "vllm-docs-usage-metrics-iteration-tokens-partial.prom",
            ],
            "a fixture was added or removed: give it a test below"
        );
    }

    #[test]
    fn vllm_0_19_1_idle_scrape() {
        let snapshot = snapshot_of_fixture("kvwarden-vllm-0.19.1-llama3.1-8b-idle.prom");
        let inf = f64::INFINITY;
        assert_eq!(
            snapshot,
            VllmSnapshot {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                prompt_tokens_total: Some(115_898.0),
                generation_tokens_total: Some(18_488.0),
                ttft_buckets: buckets(&[
                    (0.001, 0.0),
                    (0.005, 0.0),
                    (0.01, 0.0),
                    (0.02, 16.0),
                    (0.04, 732.0),
                    (0.06, 801.0),
                    (0.08, 805.0),
                    (0.1, 805.0),
                    (0.25, 808.0),
                    (0.5, 818.0),
                    (0.75, 827.0),
                    (1.0, 837.0),
                    (2.5, 878.0),
                    (5.0, 917.0),
                    (7.5, 917.0),
                    (10.0, 917.0),
                    (20.0, 917.0),
                    (40.0, 917.0),
                    (80.0, 917.0),
                    (160.0, 917.0),
                    (640.0, 917.0),
                    (2560.0, 917.0),
                    (inf, 917.0),
                ]),
                engines: Some(1),
                sleep_state: Some("awake"),
            }
        );
        assert_eq!(
            snapshot.signals(),
            ServingSignals {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                engines: Some(1),
                sleep_state: Some("awake".into()),
                ..ServingSignals::default()
            }
        );
    }

    #[test]
    fn v0_engine_scrape_uses_gpu_cache_usage() {
        let snapshot = snapshot_of_fixture("aibrix-runtime-doc-vllm-v0-engine.prom");
        assert_eq!(
            snapshot,
            VllmSnapshot {
                requests_running: Some(0.0),
                requests_waiting: Some(0.0),
                kv_cache_usage: Some(0.0),
                prompt_tokens_total: Some(148.0),
                generation_tokens_total: Some(955.0),
                ttft_buckets: None,
                engines: None,
                sleep_state: None,
            }
        );
    }

    #[test]
    fn design_doc_example_with_elisions() {
        let snapshot = snapshot_of_fixture("vllm-docs-design-metrics-example-partial.prom");
        assert_eq!(
            snapshot,
            VllmSnapshot {
                requests_running: Some(8.0),
                requests_waiting: None,
                kv_cache_usage: None,
                prompt_tokens_total: None,
                generation_tokens_total: Some(27_453.0),
                ttft_buckets: buckets(&[
                    (0.001, 0.0),
                    (0.005, 0.0),
                    (0.01, 0.0),
                    (0.02, 13.0),
                    (0.04, 97.0),
                    (0.06, 123.0),
                    (0.08, 138.0),
                    (0.1, 140.0),
                ]),
                engines: None,
                sleep_state: None,
            }
        );
    }

    #[test]
    fn partial_excerpts_without_vllm_signals() {
        for name in [
            "vllm-docs-design-metrics-http-grep-partial.prom",
            "vllm-docs-usage-metrics-iteration-tokens-partial.prom",
        ] {
            assert_eq!(snapshot_of_fixture(name), VllmSnapshot::default(), "{name}");
        }
    }

    #[test]
    fn missing_metric_is_none_not_zero() {
        let snapshot = snapshot("vllm:num_requests_running{engine=\"0\"} 3\n");
        assert_eq!(snapshot.requests_running, Some(3.0));
        assert_eq!(snapshot.requests_waiting, None);
        assert_eq!(snapshot.kv_cache_usage, None);
        assert_eq!(snapshot.prompt_tokens_total, None);
        assert_eq!(snapshot.ttft_buckets, None);
    }

    #[test]
    fn engines_are_folded_into_one_replica() {
        let snapshot = snapshot(
            r#"
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="m"} 4.0
"#,
        );
        assert_eq!(snapshot.requests_running, Some(7.0));
        assert_eq!(snapshot.requests_waiting, Some(3.0));
        assert_eq!(snapshot.kv_cache_usage, Some(0.75));
        assert_eq!(snapshot.prompt_tokens_total, Some(150.0));
        assert_eq!(
            snapshot.ttft_buckets,
            buckets(&[(0.1, 5.0), (f64::INFINITY, 7.0)])
        );
    }

    #[test]
    fn engines_and_sleep_state() {
        let page = r#"
vllm:num_requests_running{engine="0",model_name="m"} 1
vllm:num_requests_running{engine="1",model_name="m"} 1
vllm:engine_sleep_state{engine="0",sleep_state="awake"} 0.0
vllm:engine_sleep_state{engine="0",sleep_state="weights_offloaded"} 1.0
vllm:engine_sleep_state{engine="0",sleep_state="discard_all"} 0.0
vllm:engine_sleep_state{engine="1",sleep_state="awake"} 0.0
vllm:engine_sleep_state{engine="1",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="1",sleep_state="discard_all"} 1.0
"#;
        let s = snapshot(page);
        assert_eq!(s.engines, Some(2));
        assert_eq!(s.sleep_state, Some("weights_offloaded"));
        let one_awake = page.replace(
            "engine=\"1\",sleep_state=\"awake\"} 0.0",
            "engine=\"1\",sleep_state=\"awake\"} 1.0",
        );
        assert_eq!(snapshot(&one_awake).sleep_state, Some("awake"));
        let unknown_state = "vllm:engine_sleep_state{engine=\"0\",sleep_state=\"dozing\"} 1\n";
        assert_eq!(snapshot(unknown_state).sleep_state, None);
    }

    #[test]
    fn duplicate_series_count_once() {
        let page = "\
vllm:num_requests_waiting{engine=\"0\"} 2
vllm:num_requests_waiting{engine=\"0\"} 3
vllm:num_requests_waiting{engine=\"1\"} 1
vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\"} 4
vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",engine=\"0\"} 4
";
        let s = snapshot(page);
        assert_eq!(s.requests_waiting, Some(4.0));
        assert_eq!(s.ttft_buckets, buckets(&[(f64::INFINITY, 4.0)]));
    }

    #[test]
    fn kv_cache_usage_prefers_the_v1_name() {
        let both = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.4\n";
        assert_eq!(snapshot(both).kv_cache_usage, Some(0.4));
        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9\n";
        assert_eq!(snapshot(old).kv_cache_usage, Some(0.9));
    }

    #[test]
    fn created_families_are_ignored() {
        let page = "\
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine=\"0\"} 10.0
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine=\"0\"} 1.7777579962e+09
vllm:time_to_first_token_seconds_created{engine=\"0\"} 1.7777579962e+09
";
        let snapshot = snapshot(page);
        assert_eq!(snapshot.prompt_tokens_total, Some(10.0));
        assert_eq!(snapshot.ttft_buckets, None);
    }

    #[test]
    fn non_finite_values_are_unknown() {
        let page = "\
vllm:num_requests_running{engine=\"0\"} 1
vllm:num_requests_running{engine=\"1\"} NaN
vllm:kv_cache_usage_perc{engine=\"0\"} +Inf
vllm:time_to_first_token_seconds_bucket{le=\"0.1\"} NaN
";
        assert_eq!(
            snapshot(page),
            VllmSnapshot {
                engines: Some(2),
                ..VllmSnapshot::default()
            }
        );
        let no_le = "vllm:time_to_first_token_seconds_bucket{engine=\"0\"} 1\n";
        assert_eq!(snapshot(no_le).ttft_buckets, None);
    }

    #[test]
    fn garbage_page_is_all_none() {
        for page in [
            "",
            "<html><body>502 Bad Gateway</body></html>",
            "{\"error\": \"not found\"}",
            "vllm:num_requests_running{engine=\"0\" 3\nvllm:num_requests_waiting one\n",
            "\u{0}\u{1}\u{fffd}\u{fffd}",
        ] {
            assert_eq!(snapshot(page), VllmSnapshot::default(), "{page:?}");
            assert_eq!(
                snapshot(page).signals(),
                ServingSignals::default(),
                "{page:?}"
            );
        }
    }
}
