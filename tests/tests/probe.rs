//! `nightshift-agent probe --output json` against every saved vLLM scrape: each file of
//! `../shared/fixtures/vllm-metrics/` is served over HTTP and the real binary's `vllm` object
//! is checked against the values in the file.

use std::path::{Path, PathBuf};

use axum::Router;
use axum::routing::get;
use nightshift_tests::*;
use serde_json::{Value, json};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/fixtures/vllm-metrics"
);

/// Serves `page` as `/metrics` (and a 200 `/health`) and returns the base URL.
async fn serve_page(page: String) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = Router::new()
        .route("/health", get(|| async { "" }))
        .route("/metrics", get(move || async move { page }));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    format!("http://{addr}")
}

async fn probe(url: &str, node: &str) -> Value {
    let out = tokio::process::Command::new(workspace_bin("nightshift-agent"))
        .args([
            "probe",
            "--vllm-url",
            url,
            "--output",
            "json",
            "--node",
            node,
        ])
        .env_remove("NIGHTSHIFT_AGENT__GPUS__FAKE")
        .output()
        .await
        .expect("run probe");
    assert!(
        out.status.success(),
        "probe failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "probe printed no json ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The values a reader of the file finds, by hand, for the fields probe reports.
fn expected(name: &str) -> Value {
    match name {
        // 579-line scrape of vLLM 0.19.1, one engine ("0"), idle after 917 requests.
        "kvwarden-vllm-0.19.1-llama3.1-8b-idle.prom" => json!({
            "requests_running": 0.0,          // l.57
            "requests_waiting": 0.0,          // l.60
            "kv_cache_usage": 0.0,            // l.68
            "prompt_tokens_total": 115898.0,  // l.113
            "generation_tokens_total": 18488.0, // l.141
            "engines": 1,
            "sleep_state": "awake",           // l.63-65
        }),
        // V0 engine (about 0.7): model_name only, gpu_cache_usage_perc, no sleep gauge.
        "aibrix-runtime-doc-vllm-v0-engine.prom" => json!({
            "requests_running": 0.0,
            "requests_waiting": 0.0,
            "kv_cache_usage": 0.0,
            "prompt_tokens_total": 148.0,
            "generation_tokens_total": 955.0,
            "engines": null,
            "sleep_state": null,
        }),
        // The design doc's example, with "..." cuts: only these two families are in it.
        "vllm-docs-design-metrics-example-partial.prom" => json!({
            "requests_running": 8.0,
            "requests_waiting": null,
            "kv_cache_usage": null,
            "prompt_tokens_total": null,
            "generation_tokens_total": 27453.0,
            "engines": null,
            "sleep_state": null,
        }),
        // Excerpts with none of the families: every field unknown, never 0.
        "vllm-docs-design-metrics-http-grep-partial.prom"
        | "vllm-docs-usage-metrics-iteration-tokens-partial.prom" => json!({
            "requests_running": null,
            "requests_waiting": null,
            "kv_cache_usage": null,
            "prompt_tokens_total": null,
            "generation_tokens_total": null,
            "engines": null,
            "sleep_state": null,
        }),
        other => panic!("fixture {other} has no expectation: add one"),
    }
}

/// An independent reading of the file: the sum (or max) of the plain sample lines of a
/// family, `None` when the file has none. It cross-checks the hand-written table above.
fn scan(text: &str, family: &str, fold: fn(f64, f64) -> f64) -> Option<f64> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(fold)
}

fn fixtures() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(FIXTURES)
        .expect("fixture directory ../shared/fixtures/vllm-metrics")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "prom"))
        .collect();
    files.sort();
    files
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_reports_each_fixture_as_the_file_says() {
    let files = fixtures();
    assert_eq!(files.len(), 5, "{files:?}");
    for path in files {
        let name = file_name(&path);
        let text = std::fs::read_to_string(&path).expect("fixture readable");
        let url = serve_page(text.clone()).await;
        let report = probe(&url, &unique_node("probe")).await;
        let vllm = &report["vllm"];
        assert!(vllm.is_object(), "{name}: {report:#}");
        let want = expected(&name);
        for (key, value) in want.as_object().expect("object") {
            assert_eq!(&vllm[key], value, "{name}: {key}");
        }

        let sum = |a: f64, b: f64| a + b;
        let kv = scan(&text, "vllm:kv_cache_usage_perc", f64::max)
            .or_else(|| scan(&text, "vllm:gpu_cache_usage_perc", f64::max));
        for (key, from_file) in [
            (
                "requests_running",
                scan(&text, "vllm:num_requests_running", sum),
            ),
            (
                "requests_waiting",
                scan(&text, "vllm:num_requests_waiting", sum),
            ),
            ("kv_cache_usage", kv),
            (
                "prompt_tokens_total",
                scan(&text, "vllm:prompt_tokens_total", sum),
            ),
            (
                "generation_tokens_total",
                scan(&text, "vllm:generation_tokens_total", sum),
            ),
        ] {
            assert_eq!(
                vllm[key].as_f64(),
                from_file,
                "{name}: {key} against the file"
            );
        }
        assert_eq!(vllm["health"], "healthy", "{name}");
        assert!(report["docker"]["version"].is_string(), "{report:#}");
        assert!(
            report["gpus"]["available"] == true
                || report["gpus"]["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("libnvidia-ml")),
            "gpus listed, or which library was looked for: {report:#}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_without_vllm_says_why() {
    let closed = format!("http://127.0.0.1:{}", free_port());
    let report = probe(&closed, &unique_node("probe")).await;
    assert!(report["vllm"].is_null(), "{report:#}");
    let error = report["vllm_error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&closed) && error.contains("unreachable"),
        "{error}"
    );
}

/// A Docker socket the agent cannot use is reported with the operating system's reason
/// ("connection refused", "permission denied"), not only bollard's "client error (Connect)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_names_why_the_docker_socket_cannot_be_used() {
    // A file that is not a socket: connecting to it is refused.
    let not_a_socket = tempfile::NamedTempFile::new().expect("temp file");
    let host = format!("unix://{}", not_a_socket.path().display());
    let out = tokio::process::Command::new(workspace_bin("nightshift-agent"))
        .args(["probe", "--output", "json", "--node", &unique_node("probe")])
        .env("DOCKER_HOST", &host)
        .output()
        .await
        .expect("run nightshift-agent probe");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "probe printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let error = report["docker"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&host) && error.contains("Connection refused"),
        "{report:#}"
    );
}
