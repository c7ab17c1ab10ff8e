//! The web UI in a real browser: headless Chromium driven over WebDriver (Debian's
//! `chromium` and `chromium-driver`, installed by tests/run.sh when missing; chromedriver a
//! throwaway process on its own port) against a coordinator with API tokens and a real
//! agent on the Docker engine. A researcher logs in with a token, submits a job through the
//! UI's form, watches it go from queued to running with its log lines appearing (the page
//! never reloads), cancels it; sees no cancel button on another team's job; sees a
//! pipeline run's graph drawn with each step's state. Screenshots of the pages go to
//! `target/ui-screenshots/` (docs/UI.md shows copies).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use nightshift_cli::client::Client as Api;
use nightshift_common::{JobSpec, PipelineSubmit};
use nightshift_coordinator::auth::{Role, Tokens};
use nightshift_coordinator::{http, server};
use nightshift_tests::*;

const STARTUP: Duration = Duration::from_secs(90);

/// chromedriver, killed when dropped; its sessions' temporary folders stay in `dir`.
struct Driver {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Driver {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        // Its log joins the run's, which tests/run.sh scans for the tokens typed into pages.
        let (_, log) = secrets::log_file("chromedriver");
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .env("TMPDIR", dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("chromedriver: {e} (tests/run.sh installs chromium and chromium-driver)")
            });
        let url = format!("http://127.0.0.1:{port}");
        wait_for(
            "chromedriver to listen",
            Duration::from_secs(20),
            || async {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .ok()
                    .map(|_| ())
            },
        )
        .await;
        Self {
            child,
            url,
            _dir: dir,
        }
    }

    async fn browser(&self) -> Client {
        let caps = serde_json::json!({
            "goog:chromeOptions": {"args": [
                "--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1360,1100", "--hide-scrollbars",
            ]}
        });
        let serde_json::Value::Object(caps) = caps else {
            unreachable!()
        };
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&self.url)
            .await
            .expect("a Chromium session")
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn shots() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/ui-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(c: &Client, name: &str) {
    let png = c.screenshot().await.expect("screenshot");
    std::fs::write(shots().join(format!("{name}.png")), png).unwrap();
}

/// Waits for `check` on the page; on a timeout saves a screenshot and shows the page's text.
async fn until<T, F, Fut>(c: &Client, what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if started.elapsed() > timeout {
            screenshot(c, "failure").await;
            let text = match c.find(Locator::Css("main")).await {
                Ok(main) => main.text().await.unwrap_or_default(),
                Err(e) => e.to_string(),
            };
            panic!(
                "timed out after {timeout:?} waiting for {what}; the page ({}) says:\n{text}",
                c.current_url()
                    .await
                    .map(|u| u.to_string())
                    .unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn attr(c: &Client, css: &str, name: &str) -> Option<String> {
    c.find(Locator::Css(css))
        .await
        .ok()?
        .attr(name)
        .await
        .ok()?
}

async fn text(c: &Client, css: &str) -> Option<String> {
    c.find(Locator::Css(css)).await.ok()?.text().await.ok()
}

async fn click(c: &Client, css: &str) {
    c.find(Locator::Css(css))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

async fn type_into(c: &Client, css: &str, keys: &str) {
    c.find(Locator::Css(css))
        .await
        .unwrap()
        .send_keys(keys)
        .await
        .unwrap();
}

/// Waits for attribute `name` of `css` to read `want` (a state the page shows live).
async fn until_attr(c: &Client, css: &str, name: &str, want: &str) {
    until(c, &format!("{css} to be {want}"), STARTUP, || async {
        attr(c, css, name).await.filter(|v| v == want)
    })
    .await;
}

fn conformance(file: &str) -> String {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|a| a.join("shared/conformance/argo-workflows"))
        .find(|p| p.is_dir())
        .expect("shared/conformance/argo-workflows above the tests crate");
    std::fs::read_to_string(dir.join(file)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_researcher_follows_a_job_and_a_pipeline_in_the_browser() {
    init_tracing();
    require_images();
    let started = Instant::now();
    let node = unique_node("ui");
    let _cleanup = Cleanup(node.clone());
    let dir = tempfile::tempdir().unwrap();

    // A coordinator with tokens: an admin, and researchers of two teams.
    let cfg = coordinator_config(&dir.path().join("state"));
    std::fs::create_dir_all(&cfg.data_dir).unwrap();
    let tokens = Tokens::open(&cfg.data_dir).unwrap();
    let (_, admin) = tokens.create("ops", Role::Admin, None, 1).unwrap();
    let (_, alice) = tokens
        .create("alice", Role::Researcher, Some("nlp"), 1)
        .unwrap();
    let (_, bob) = tokens
        .create("bob", Role::Researcher, Some("vision"), 1)
        .unwrap();
    for token in [&admin, &alice, &bob] {
        secrets::record(token);
    }
    let cluster = server::open(&cfg).unwrap();
    let access = http::access_for(&cfg, cluster.clone()).unwrap();
    let app = http::app(cluster.clone(), access, cfg.policy.clone());
    let listener = tokio::net::TcpListener::bind(cfg.listen).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let serving = tokio::spawn(server::serve_app(
        listener,
        cluster,
        app,
        std::future::pending(),
    ));
    let agent_cfg = agent_config(&url, &node, &dir.path().join("work"), 4);
    let (_agent, _) = start_agent(agent_cfg, 4).await;
    let as_admin = Api::new(&url).unwrap().with_token(Some(admin.clone()));
    let as_bob = Api::new(&url).unwrap().with_token(Some(bob.clone()));

    let driver = Driver::start().await;
    let c = driver.browser().await;

    // Without a token: the login page. With alice's: the overview, her name on it.
    c.goto(&format!("{url}/ui/jobs")).await.unwrap();
    assert!(c.current_url().await.unwrap().path().ends_with("/ui/login"));
    type_into(&c, "#token", "nst_not_a_token").await;
    click(&c, "form button").await;
    until(&c, "an unknown token to be refused", STARTUP, || async {
        text(&c, "#login-error")
            .await
            .filter(|t| t.contains("unknown"))
    })
    .await;
    type_into(&c, "#token", &alice).await;
    click(&c, "form button").await;
    let who = until(&c, "alice to be logged in", STARTUP, || async {
        text(&c, "#who").await
    })
    .await;
    assert_eq!(who, "alice · researcher · team nlp");
    until(&c, "the node to show on the overview", STARTUP, || async {
        text(&c, "#nodes-total").await.filter(|n| n == "1")
    })
    .await;

    // She submits a job through the form, and follows it to running, its log lines
    // appearing, without the page reloading.
    c.goto(&format!("{url}/ui/jobs")).await.unwrap();
    click(&c, "#submit > summary").await;
    let spec = JobSpec {
        owner: Some("nlp".into()),
        ..trainer_job("ui-train", 4, 1_000_000, 20, 100)
    };
    let spec = serde_json::to_string_pretty(&spec).unwrap();
    c.execute(
        "document.getElementById('spec').value = arguments[0]",
        vec![serde_json::json!(spec)],
    )
    .await
    .unwrap();
    click(&c, "#submit-job").await;
    let first = until(&c, "the job's page", STARTUP, || async {
        attr(&c, "#job-state", "data-state").await
    })
    .await;
    let job: u64 = c
        .current_url()
        .await
        .unwrap()
        .path()
        .rsplit('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        first == "queued" || first == "starting",
        "a job just submitted is queued or starting, not {first}"
    );
    c.execute("window.nightshiftStayed = true", vec![])
        .await
        .unwrap();
    until_attr(&c, "#job-state", "data-state", "running").await;
    let log = until(&c, "the job's log lines", STARTUP, || async {
        text(&c, "#log")
            .await
            .filter(|l| l.contains("starting fresh"))
    })
    .await;
    assert!(log.starts_with("toy-trainer: job="), "{log}");
    until(&c, "the attempt's row", STARTUP, || async {
        text(&c, "#attempts").await.filter(|t| t.contains(&node))
    })
    .await;
    let stayed = c
        .execute("return window.nightshiftStayed === true", vec![])
        .await
        .unwrap();
    assert_eq!(stayed, serde_json::json!(true), "the page reloaded");
    screenshot(&c, "job").await;

    // Bob's job (another team) shows her no cancel button; her own has one.
    let theirs = as_bob
        .submit(&JobSpec {
            owner: Some("vision".into()),
            ..trainer_job("ui-vision-eval", 4, 1_000_000, 20, 100)
        })
        .await
        .unwrap();
    c.goto(&format!("{url}/ui/jobs/{}", theirs.id))
        .await
        .unwrap();
    until(&c, "bob's job's page", STARTUP, || async {
        text(&c, "main").await.filter(|t| t.contains("vision"))
    })
    .await;
    assert!(
        c.find(Locator::Css("#cancel")).await.is_err(),
        "a researcher sees no cancel button on another team's job"
    );
    c.goto(&format!("{url}/ui/jobs/{job}")).await.unwrap();
    until(&c, "the cancel button", STARTUP, || async {
        c.find(Locator::Css("#cancel")).await.ok()
    })
    .await
    .click()
    .await
    .unwrap();
    until_attr(&c, "#job-state", "data-state", "cancelled").await;
    assert!(c.find(Locator::Css("#cancel")).await.is_err());
    as_admin.cancel(theirs.id).await.unwrap();

    // A pipeline run's graph: the diamond, each step's state, updated live.
    let run = as_admin
        .submit_pipeline(&PipelineSubmit {
            file: "dag-diamond.yaml".into(),
            text: conformance("dag-diamond.yaml"),
            parameters: Default::default(),
        })
        .await
        .unwrap();
    c.goto(&format!("{url}/ui/pipelines/{}", run.id))
        .await
        .unwrap();
    until_attr(&c, "#run-phase", "data-phase", "Succeeded").await;
    let steps = c.find_all(Locator::Css("#dag g.step")).await.unwrap();
    let mut drawn = Vec::new();
    for s in &steps {
        drawn.push((
            s.attr("data-step").await.unwrap().unwrap_or_default(),
            s.attr("data-phase").await.unwrap().unwrap_or_default(),
        ));
    }
    drawn.sort();
    let want: Vec<(String, String)> = ["A", "B", "C", "D", "dag-diamond"]
        .iter()
        .map(|s| (s.to_string(), "Succeeded".to_string()))
        .collect();
    assert_eq!(drawn.len(), 5, "{drawn:?}");
    assert_eq!(
        drawn.iter().filter(|d| d.1 == "Succeeded").count(),
        5,
        "{drawn:?}"
    );
    assert_eq!(drawn[..4], want[..4], "{drawn:?}");
    let edges = c.find_all(Locator::Css("#dag path.edge")).await.unwrap();
    assert_eq!(edges.len(), 5, "the root to A, A to B and C, both to D");
    // A step's logs: D's job echoed its name.
    let d = c
        .find(Locator::Css("#dag g.step[data-step='D']"))
        .await
        .unwrap();
    d.click().await.unwrap();
    until(&c, "step D's logs", STARTUP, || async {
        text(&c, "#log").await.filter(|l| l.trim() == "D")
    })
    .await;
    screenshot(&c, "pipeline").await;

    // The other pages, for the docs; each must render its live parts.
    for (page, css, name) in [
        ("/ui/", "#live-queue", "overview"),
        ("/ui/report", "#by-day", "report"),
        ("/ui/nodes", "#live-nodes", "nodes"),
        ("/ui/jobs", "#jobs", "jobs"),
    ] {
        c.goto(&format!("{url}{page}")).await.unwrap();
        until(&c, page, STARTUP, || async {
            c.find(Locator::Css(css)).await.ok()
        })
        .await;
        screenshot(&c, name).await;
    }
    c.close().await.unwrap();
    serving.abort();
    eprintln!(
        "the browser test took {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
