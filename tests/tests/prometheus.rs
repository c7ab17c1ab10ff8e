//! The Grafana dashboard (`packaging/grafana/nightshift.json`) proven against a real
//! Prometheus. Debian's `prometheus`, a throwaway process on its own loopback port with its
//! own configuration and storage, scrapes a real `nightshift-coordinator` and two real
//! `nightshift-agent`s every second; it finds the agents through the coordinator's
//! `/v1/nodes/http_sd` and reaches the coordinator with an API token, as an operator would
//! configure it. A short scenario runs on the real Docker engine: the nodes serve, one is
//! lent, a job succeeds, another runs and is preempted by a reclaim, then cancelled. Then
//! every PromQL expression of the dashboard (each panel's targets, each variable's query) is
//! evaluated over the scenario's time range: each must return data, and name only metrics
//! and labels that the scrapes hold; each legend's labels must be on its series. Last,
//! `promtool check metrics` must find nothing to say about any `/metrics` page.
//!
//! `tests/run.sh` installs the `prometheus` package (which brings `promtool`) when missing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nightshift_cli::client::Client;
use nightshift_common::{GatewaySignals, JobState, ReplicaState};
use nightshift_tests::*;
use serde_json::Value;

const STARTUP: Duration = Duration::from_secs(60);
/// Prometheus scrapes (and refreshes its service discovery) this often, in seconds.
const SCRAPE_S: u64 = 1;
/// Grafana's `$__rate_interval` at that scrape interval and a step of one scrape:
/// max(`$__interval` + scrape interval, 4 × scrape interval).
const RATE_INTERVAL_S: u64 = 4 * SCRAPE_S;
const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../packaging/grafana/nightshift.json"
);

/// A child process killed (after SIGTERM, and a wait) when dropped.
struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn spawn(name: &'static str, command: &mut Command) -> Self {
        let (log, file) = secrets::log_file(name);
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        Self { name, child, log }
    }

    /// Panics, with the end of its log, if it has exited.
    fn check_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!("{} exited ({status}):\n{}", self.name, tail.join("\n"));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: signals our own child, by its id.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `nightshift-agent run` on 2 fake GPUs, every port on loopback.
fn spawn_agent(dir: &Path, coordinator: &str, node: &str) -> (Process, String) {
    let work = dir.join(node);
    std::fs::create_dir_all(&work).unwrap();
    let (readiness, api) = (free_port(), free_port());
    let quoted = |s: &str| serde_json::to_string(s).unwrap();
    let config = work.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            r#"coordinator = {coordinator}
node = {node}
work_dir = {work}
readiness_listen = "127.0.0.1:{readiness}"
api_listen = "127.0.0.1:{api}"
readiness_grace_s = 0.3
drain_timeout_s = 60.0
free_timeout_s = 5.0
health_timeout_s = 60.0

[gpus]
fake = 2

[replica]
image = "{VLLM_IMAGE}"
host_ip = "127.0.0.1"
host_port = 0
shutdown_timeout_s = 30.0
env = ["STANDIN_TOKEN_LATENCY_MS=10", "STANDIN_MAX_NUM_SEQS=4", "STANDIN_SHUTDOWN_TIMEOUT_S=30"]
"#,
            coordinator = quoted(coordinator),
            node = quoted(node),
            work = quoted(&work.to_string_lossy()),
        ),
    )
    .unwrap();
    let process = Process::spawn(
        "nightshift-agent",
        Command::new(workspace_bin("nightshift-agent"))
            .args(["run", "--config"])
            .arg(&config)
            .env("RUST_LOG", "info"),
    );
    (process, format!("http://127.0.0.1:{readiness}/metrics"))
}

/// `nightshift-coordinator token create`: the token it prints, recorded for the log scan.
fn create_token(data: &Path, role: &str, name: &str) -> String {
    let mut command = Command::new(workspace_bin("nightshift-coordinator"));
    command.args(["token", "create", "--role", role, "--name", name]);
    if role == "researcher" {
        command.args(["--team", "monitoring"]);
    }
    let out = command.arg("--data-dir").arg(data).output().unwrap();
    assert!(out.status.success(), "token create: {out:?}");
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    secrets::record(&token);
    token
}

/// The program `name` answers `--version`, or the test fails saying how to get it.
fn require_program(name: &str) {
    let ok = Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "{name} is missing: install Debian's prometheus package (tests/run.sh does)"
    );
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The Prometheus HTTP API at `base`.
struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    /// `GET path?params`: the `data` of a successful answer, or the error Prometheus gave.
    async fn get(&self, path: &str, params: &[(&str, String)]) -> Result<Value, String> {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.base), params)
            .map_err(|e| e.to_string())?;
        let reply: Value = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        if reply["status"] != "success" {
            return Err(format!("{}: {}", reply["errorType"], reply["error"]));
        }
        Ok(reply["data"].clone())
    }

    async fn instant(&self, query: &str) -> Vec<Value> {
        self.get("/api/v1/query", &[("query", query.to_owned())])
            .await
            .map(|d| d["result"].as_array().cloned().unwrap_or_default())
            .unwrap_or_default()
    }

    /// The label values of `label` on the series `matcher` selects over `range`.
    async fn label_values(
        &self,
        label: &str,
        matcher: &str,
        range: (f64, f64),
    ) -> Result<Vec<String>, String> {
        let data = self
            .get(
                &format!("/api/v1/label/{label}/values"),
                &[
                    ("match[]", matcher.to_owned()),
                    ("start", range.0.to_string()),
                    ("end", range.1.to_string()),
                ],
            )
            .await?;
        Ok(strings(&data))
    }

    /// The label sets of the series `selector` selects over `range`.
    async fn series(
        &self,
        selector: &str,
        range: (f64, f64),
    ) -> Result<Vec<BTreeMap<String, String>>, String> {
        let data = self
            .get(
                "/api/v1/series",
                &[
                    ("match[]", selector.to_owned()),
                    ("start", range.0.to_string()),
                    ("end", range.1.to_string()),
                ],
            )
            .await?;
        Ok(data
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(labels_of)
            .collect())
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn labels_of(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// What a PromQL expression names: its vector selectors (each with its source text) and
/// the label names it uses (in matchers and in `by`, `without`, `on`, `ignoring`,
/// `group_left` and `group_right` lists).
#[derive(Debug, Default, PartialEq)]
struct Names {
    selectors: Vec<(String, String)>,
    labels: BTreeSet<String>,
}

const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
const KEYWORDS: &[&str] = &[
    "bool", "and", "or", "unless", "offset", "atan2", "inf", "nan",
];

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Str,
    Other(char),
}

/// PromQL's tokens, each with its byte offset; numbers and durations are dropped.
fn tokens(expr: &str) -> Vec<(usize, usize, Token)> {
    let bytes = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i] as char;
        let start = i;
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c == '"' || c == '\'' || c == '`' {
            i += 1;
            while i < bytes.len() && bytes[i] as char != c {
                i += if bytes[i] == b'\\' && c != '`' { 2 } else { 1 };
            }
            i += 1;
            out.push((start, i.min(bytes.len()), Token::Str));
        } else if c.is_ascii_digit()
            || (c == '.' && i + 1 < bytes.len() && bytes[i + 1].is_ascii_digit())
        {
            // A number or a duration (`4s`, `1h30m`, `1e3`).
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || b"_:".contains(&bytes[i]))
            {
                i += 1;
            }
            out.push((start, i, Token::Ident(expr[start..i].to_owned())));
        } else {
            i += 1;
            out.push((start, i, Token::Other(c)));
        }
    }
    out
}

fn names(expr: &str) -> Names {
    let toks = tokens(expr);
    let mut names = Names::default();
    let mut k = 0;
    while k < toks.len() {
        let (start, _, ref tok) = toks[k];
        let next = toks.get(k + 1).map(|t| &t.2);
        match tok {
            Token::Ident(word) if LABEL_LISTS.contains(&word.as_str()) => {
                // `by (a, b)`: label names up to the closing parenthesis.
                k += 1;
                if next == Some(&Token::Other('(')) {
                    k += 1;
                    while let Some((_, _, t)) = toks.get(k) {
                        match t {
                            Token::Other(')') => break,
                            Token::Ident(label) => {
                                names.labels.insert(label.clone());
                            }
                            _ => {}
                        }
                        k += 1;
                    }
                }
                k += 1;
            }
            Token::Ident(word)
                if next == Some(&Token::Other('('))
                    || AGGREGATIONS.contains(&word.as_str())
                    || KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) =>
            {
                k += 1;
            }
            Token::Ident(_) | Token::Other('{') => {
                // A vector selector: a metric name, matchers, or both.
                let metric = match tok {
                    Token::Ident(word) => word.clone(),
                    _ => String::new(),
                };
                let mut end = toks[k].1;
                k += 1;
                let braces = if metric.is_empty() {
                    Some(k - 1)
                } else if toks.get(k).map(|t| &t.2) == Some(&Token::Other('{')) {
                    k += 1;
                    Some(k - 1)
                } else {
                    None
                };
                if braces.is_some() {
                    // Matchers: `label op "value"`, comma-separated, up to `}`.
                    let mut expect_label = true;
                    while let Some((_, e, t)) = toks.get(k) {
                        end = *e;
                        k += 1;
                        match t {
                            Token::Other('}') => break,
                            Token::Other(',') => expect_label = true,
                            Token::Ident(label) if expect_label => {
                                names.labels.insert(label.clone());
                                expect_label = false;
                            }
                            _ => {}
                        }
                    }
                }
                names.selectors.push((metric, expr[start..end].to_owned()));
            }
            _ => k += 1,
        }
    }
    names
}

/// `text` with Grafana's variables replaced: `$name` and `${name}` from `vars`.
fn substitute(text: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = text.to_owned();
    // Longest names first, so that `$__range` is not read as `$__r` + `ange`.
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for name in names {
        out = out
            .replace(&format!("${{{name}}}"), &vars[name])
            .replace(&format!("${name}"), &vars[name]);
    }
    out
}

/// A Grafana multi-value variable with "All" selected, as Grafana writes it for Prometheus:
/// the values, regex-escaped, as one alternation.
fn all_of(values: &[String]) -> String {
    let escaped: Vec<String> = values
        .iter()
        .map(|v| {
            v.chars()
                .flat_map(|c| {
                    let special = "\\.+*?()|[]{}^$".contains(c);
                    special.then_some('\\').into_iter().chain([c])
                })
                .collect()
        })
        .collect();
    format!("({})", escaped.join("|"))
}

/// One dashboard query to evaluate: where it is, its expression and its legend.
struct Query {
    place: String,
    expr: String,
    legend: Option<String>,
}

/// Every panel target of the dashboard.
fn dashboard_queries(dash: &Value) -> Vec<Query> {
    let mut out = Vec::new();
    let mut panels: Vec<&Value> = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        panels.push(p);
        // A row's collapsed panels.
        panels.extend(p["panels"].as_array().into_iter().flatten());
    }
    for panel in panels {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push(Query {
                place: format!(
                    "panel {:?} target {}",
                    panel["title"].as_str().unwrap_or("?"),
                    target["refId"].as_str().unwrap_or("?")
                ),
                expr: target["expr"].as_str().expect("a target's expr").to_owned(),
                legend: target["legendFormat"].as_str().map(str::to_owned),
            });
        }
    }
    out
}

/// Checks one expression over `range`; what is wrong with it, if anything.
async fn check_query(
    api: &Api,
    known: &BTreeSet<String>,
    query: &Query,
    vars: &BTreeMap<String, String>,
    range: (f64, f64),
) -> Vec<String> {
    let mut problems = Vec::new();
    let expr = substitute(&query.expr, vars);
    let say = |what: String| format!("{}: {what}\n    expr: {expr}", query.place);
    if expr.contains('$') {
        return vec![say("a variable this test does not know".into())];
    }
    let names = names(&expr);
    if names.selectors.is_empty() {
        problems.push(say("selects no metric".into()));
    }
    let mut labels: BTreeSet<String> = BTreeSet::new();
    for (metric, selector) in &names.selectors {
        if !metric.is_empty() && !known.contains(metric) {
            problems.push(say(format!("metric {metric} was never scraped")));
            continue;
        }
        // The labels its series have, whatever the matchers select.
        let all = if metric.is_empty() { selector } else { metric };
        match api.series(all, range).await {
            Ok(series) => labels.extend(series.into_iter().flat_map(|s| s.into_keys())),
            Err(e) => problems.push(say(format!("series of {all}: {e}"))),
        }
        match api.series(selector, range).await {
            Ok(series) if series.is_empty() => {
                problems.push(say(format!("{selector} selects no series")));
            }
            Ok(_) => {}
            Err(e) => problems.push(say(format!("series {selector}: {e}"))),
        }
    }
    for label in names.labels.difference(&labels) {
        problems.push(say(format!(
            "label {label:?} is on none of its metrics' series (they have {labels:?})"
        )));
    }
    let data = api
        .get(
            "/api/v1/query_range",
            &[
                ("query", expr.clone()),
                ("start", range.0.to_string()),
                ("end", range.1.to_string()),
                ("step", SCRAPE_S.to_string()),
            ],
        )
        .await;
    let result = match data {
        Ok(d) => d["result"].as_array().cloned().unwrap_or_default(),
        Err(e) => {
            problems.push(say(format!("query_range: {e}")));
            return problems;
        }
    };
    let finite = result.iter().any(|s| {
        s["values"].as_array().into_iter().flatten().any(|v| {
            v[1].as_str()
                .and_then(|x| x.parse::<f64>().ok())
                .is_some_and(f64::is_finite)
        })
    });
    if result.is_empty() {
        problems.push(say("no series over the scenario".into()));
    } else if !finite {
        problems.push(say(format!(
            "{} series, but no finite value over the scenario",
            result.len()
        )));
    }
    // A legend's `{{label}}` must be on every series it names.
    let legend_labels: Vec<String> = query
        .legend
        .as_deref()
        .unwrap_or_default()
        .split("{{")
        .skip(1)
        .filter_map(|s| s.split_once("}}").map(|(l, _)| l.trim().to_owned()))
        .collect();
    for s in &result {
        let metric = labels_of(&s["metric"]);
        for l in &legend_labels {
            if !metric.contains_key(l) {
                problems.push(say(format!(
                    "legend {:?} names {l:?}, not on series {metric:?}",
                    query.legend.as_deref().unwrap_or_default()
                )));
            }
        }
    }
    problems
}

/// `promtool check metrics` on the page at `url` (fetched as curl would, without asking for
/// OpenMetrics): what it said, if anything.
async fn promtool_check(http: &reqwest::Client, url: &str, token: Option<&str>) -> Option<String> {
    let mut request = http.get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("fetch /metrics");
    assert!(
        response.status().is_success(),
        "{url}: {}",
        response.status()
    );
    let page = response.text().await.expect("the page");
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(page.as_bytes()).expect("feed promtool");
    }
    let out = child.wait_with_output().expect("promtool");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (!out.status.success() || !said.trim().is_empty())
        .then(|| format!("{url}: promtool exited {}:\n{said}", out.status))
}

async fn job_state(client: &Client, id: u64) -> Option<JobState> {
    client.job(id).await.ok().map(|j| j.state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    init_tracing();
    require_images();
    require_program("prometheus");
    require_program("promtool");
    let began = Instant::now();
    let nodes = [unique_node("prom-a"), unique_node("prom-b")];
    let _cleanup = nodes.clone().map(Cleanup);
    let dir = tempfile::tempdir().unwrap();

    // The coordinator, closed by API tokens: one for the test (an operator), one for
    // Prometheus (a researcher: it reads only).
    let (coordinator, _) = CoordinatorProcess::start_in(dir.path()).await;
    let data = dir.path().join("state");
    let operator = create_token(&data, "operator", "prometheus-test");
    let reader = create_token(&data, "researcher", "prometheus");
    let client = Client::new(&coordinator.url)
        .unwrap()
        .with_token(Some(operator.clone()));
    let http = reqwest::Client::new();
    let open = http
        .get(format!("{}/metrics", coordinator.url))
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), 401, "/metrics needs a token once one exists");

    let mut agents = Vec::new();
    let mut agent_metrics = Vec::new();
    for node in &nodes {
        let (process, metrics) = spawn_agent(dir.path(), &coordinator.url, node);
        agents.push(process);
        agent_metrics.push(metrics);
    }
    wait_for("both replicas to serve", STARTUP, || async {
        let list = client.nodes().await.ok()?;
        let serving = list
            .nodes
            .iter()
            .filter(|n| nodes.contains(&n.name))
            .filter(|n| n.replica.as_ref().map(|r| r.state) == Some(ReplicaState::Serving))
            .count();
        (serving == nodes.len()).then_some(())
    })
    .await;

    // Service discovery: each agent's metrics, labelled with its node and service.
    let sd: Value = http
        .get(format!("{}/v1/nodes/http_sd", coordinator.url))
        .bearer_auth(&reader)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for (node, metrics) in nodes.iter().zip(&agent_metrics) {
        let target = metrics
            .trim_start_matches("http://")
            .trim_end_matches("/metrics");
        let group = sd
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["labels"]["node"] == node.as_str())
            .unwrap_or_else(|| panic!("{node} not in /v1/nodes/http_sd: {sd}"));
        assert_eq!(group["targets"], serde_json::json!([target]), "{sd}");
        assert_eq!(group["labels"]["service"], "default", "{sd}");
        assert_eq!(group["labels"]["__metrics_path__"], "/metrics", "{sd}");
    }

    // Prometheus, with its own port, configuration and storage. `type: Bearer` is spelled
    // out for the discovery: Prometheus 2.42 does not default it there and sends the bare
    // token (prometheus/docs#2377), which the coordinator refuses.
    let token_file = dir.path().join("prometheus.token");
    std::fs::write(&token_file, &reader).unwrap();
    let coordinator_addr = coordinator.url.trim_start_matches("http://");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: {SCRAPE_S}s\n  scrape_timeout: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n\
             scrape_configs:\n\
             - job_name: nightshift-coordinator\n  authorization:\n    credentials_file: {token}\n  static_configs:\n  - targets: [\"{coordinator_addr}\"]\n\
             - job_name: nightshift-agents\n  http_sd_configs:\n  - url: {url}/v1/nodes/http_sd\n    refresh_interval: {SCRAPE_S}s\n    authorization:\n      type: Bearer\n      credentials_file: {token}\n",
            token = token_file.display(),
            url = coordinator.url,
        ),
    )
    .unwrap();
    let storage = dir.path().join("prometheus-data");
    let port = free_port();
    let mut prometheus = Process::spawn(
        "prometheus",
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", storage.display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn"),
    );
    let api = Api {
        base: format!("http://127.0.0.1:{port}"),
        http: http.clone(),
    };
    let prom_started = Instant::now();
    loop {
        prometheus.check_running();
        let up = api.instant("up == 1").await;
        let agents: BTreeSet<String> = up
            .iter()
            .filter(|s| s["metric"]["job"] == "nightshift-agents")
            .filter(|s| s["metric"]["service"] == "default")
            .filter_map(|s| s["metric"]["node"].as_str().map(str::to_owned))
            .collect();
        let coordinator_up = up
            .iter()
            .any(|s| s["metric"]["job"] == "nightshift-coordinator");
        if coordinator_up && agents.len() == nodes.len() {
            break;
        }
        assert!(
            prom_started.elapsed() < STARTUP,
            "Prometheus did not scrape the coordinator and both agents within {STARTUP:?}: up = {up:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "prometheus scraped all three targets {:?} after it started",
        prom_started.elapsed()
    );

    // The scenario: a lend and a job that succeeds; another job, preempted by a reclaim.
    let start = unix_now();
    let short = client
        .submit(&trainer_job("short", 2, 20, 20, 10))
        .await
        .unwrap();
    wait_for("the short job to succeed", STARTUP, || async {
        (job_state(&client, short.id).await == Some(JobState::Succeeded)).then_some(())
    })
    .await;
    let long = client
        .submit(&trainer_job("long", 2, 1_000_000, 20, 20))
        .await
        .unwrap();
    wait_for("the long job to run", STARTUP, || async {
        (job_state(&client, long.id).await == Some(JobState::Running)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reclaim = http
        .post(format!("{}/v1/services/default/gateway", coordinator.url))
        .bearer_auth(&operator)
        .json(&GatewaySignals { waiting: 5 })
        .send()
        .await
        .unwrap();
    assert!(reclaim.status().is_success(), "{}", reclaim.status());
    wait_for("the long job to be preempted", STARTUP, || async {
        let j = client.job(long.id).await.ok()?;
        (j.preemptions == 1).then_some(())
    })
    .await;
    client.cancel(long.id).await.unwrap();
    wait_for("the long job to be cancelled", STARTUP, || async {
        (job_state(&client, long.id).await == Some(JobState::Cancelled)).then_some(())
    })
    .await;
    // Long enough for the last changes to be scraped and to fall inside a rate window.
    tokio::time::sleep(Duration::from_secs(RATE_INTERVAL_S + 2 * SCRAPE_S)).await;
    let end = unix_now();
    let range = (start, end);
    for agent in &mut agents {
        agent.check_running();
    }
    prometheus.check_running();

    // Every metric name Prometheus holds.
    let known: BTreeSet<String> = api
        .get("/api/v1/label/__name__/values", &[])
        .await
        .map(|d| strings(&d).into_iter().collect())
        .unwrap_or_default();
    assert!(
        known.contains("nightshift_gpus") && known.contains("nightshift_agent_ready"),
        "the coordinator's and the agents' metrics were scraped: {known:?}"
    );

    // The dashboard's variables, then its queries.
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let mut problems = Vec::new();
    let mut vars = BTreeMap::from([
        (
            "__range".to_owned(),
            format!("{}s", (end - start).ceil() as u64),
        ),
        ("__rate_interval".to_owned(), format!("{RATE_INTERVAL_S}s")),
        ("__interval".to_owned(), format!("{SCRAPE_S}s")),
    ]);
    let mut checked = 0;
    for var in dash["templating"]["list"].as_array().expect("templating") {
        let name = var["name"].as_str().expect("a variable's name");
        match var["type"].as_str() {
            Some("datasource") => continue,
            Some("query") => {}
            other => {
                problems.push(format!("variable {name}: type {other:?} is not checked"));
                continue;
            }
        }
        checked += 1;
        let query = var["query"]
            .as_str()
            .or_else(|| var["query"]["query"].as_str())
            .unwrap_or_default();
        let Some((metric, label)) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .and_then(|q| q.split_once(','))
            .map(|(m, l)| (m.trim(), l.trim()))
        else {
            problems.push(format!(
                "variable {name}: {query:?} is not label_values(metric, label)"
            ));
            continue;
        };
        if !known.contains(metric) {
            problems.push(format!(
                "variable {name}: metric {metric} was never scraped"
            ));
            continue;
        }
        match api.label_values(label, metric, range).await {
            Ok(values) if values.is_empty() => {
                problems.push(format!("variable {name}: {query} has no values"));
            }
            Ok(values) => {
                println!("variable {name} = {values:?}");
                vars.insert(name.to_owned(), all_of(&values));
            }
            Err(e) => problems.push(format!("variable {name}: {e}")),
        }
    }
    let queries = dashboard_queries(&dash);
    for query in &queries {
        problems.extend(check_query(&api, &known, query, &vars, range).await);
        checked += 1;
    }
    println!(
        "{checked} dashboard queries checked over {:.0} s of scenario",
        end - start
    );
    assert!(
        queries.len() >= 10,
        "the dashboard's targets: {}",
        queries.len()
    );

    // promtool's lint on every page, as an operator's curl fetches it.
    problems.extend(
        promtool_check(
            &http,
            &format!("{}/metrics", coordinator.url),
            Some(&reader),
        )
        .await,
    );
    for url in &agent_metrics {
        problems.extend(promtool_check(&http, url, None).await);
    }
    drop(prometheus);
    println!("the test took {:?}", began.elapsed());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_promql_reader_finds_selectors_and_labels() {
    let n = names(
        r#"histogram_quantile(0.95, sum by (le, phase) (rate(x_bucket{sequence="reclaim",a=~"b|c"}[4s]))) / on(node) group_left(service) y offset 5m"#,
    );
    assert_eq!(
        n.selectors,
        vec![
            (
                "x_bucket".to_owned(),
                r#"x_bucket{sequence="reclaim",a=~"b|c"}"#.to_owned()
            ),
            ("y".to_owned(), "y".to_owned()),
        ]
    );
    let labels: Vec<&str> = n.labels.iter().map(String::as_str).collect();
    assert_eq!(labels, ["a", "le", "node", "phase", "sequence", "service"]);
    let n = names(r#"sum(increase(z_total{service=~"(default)"}[75s])) / 3600 + {__name__="w"}"#);
    assert_eq!(
        n.selectors,
        vec![
            (
                "z_total".to_owned(),
                r#"z_total{service=~"(default)"}"#.to_owned()
            ),
            (String::new(), r#"{__name__="w"}"#.to_owned()),
        ]
    );
    let vars = BTreeMap::from([
        (
            "service".to_owned(),
            all_of(&["a.b".to_owned(), "c".to_owned()]),
        ),
        ("__range".to_owned(), "75s".to_owned()),
        ("__rate_interval".to_owned(), "4s".to_owned()),
    ]);
    assert_eq!(
        substitute(
            "x{s=~\"$service\"}[$__rate_interval] ${service} [$__range]",
            &vars
        ),
        r#"x{s=~"(a\.b|c)"}[4s] (a\.b|c) [75s]"#
    );
}
