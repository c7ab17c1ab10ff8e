//! The web UI over plain HTTP, served in-process on an ephemeral port with API tokens: a
//! page without a token goes to the login page; logging in keeps the token in an HttpOnly,
//! SameSite=Strict cookie; every page renders; a researcher sees no cancel button on
//! another team's job and is refused (403) if it posts the form anyway, but cancels its
//! team's own; a form from another origin is refused, the login's included. The browser test (tests/tests/ui.rs)
//! drives the same pages in headless Chromium against a real agent.

use std::net::SocketAddr;

use nightshift_common::JobState;
use nightshift_coordinator::auth::{Role, Tokens};
use nightshift_coordinator::config::{CoordinatorConfig, ServiceConfig};
use nightshift_coordinator::policy::PolicyConfig;
use nightshift_coordinator::{http, server};

struct Ui {
    url: String,
    http: reqwest::Client,
    cluster: std::sync::Arc<nightshift_coordinator::cluster::Cluster>,
    _dir: tempfile::TempDir,
}

impl Ui {
    async fn start() -> (Self, String, String, String) {
        let dir = tempfile::tempdir().unwrap();
        let tokens = Tokens::open(dir.path()).unwrap();
        let (_, admin) = tokens.create("ops", Role::Admin, None, 1).unwrap();
        let (_, alice) = tokens
            .create("alice", Role::Researcher, Some("nlp"), 1)
            .unwrap();
        let (_, bob) = tokens
            .create("bob", Role::Researcher, Some("vision"), 1)
            .unwrap();
        let cfg = CoordinatorConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_dir: dir.path().to_owned(),
            services: vec![ServiceConfig {
                min_replicas: 0,
                ..ServiceConfig::default()
            }],
            ..CoordinatorConfig::default()
        };
        let cluster = server::open(&cfg).unwrap();
        let access = http::access_for(&cfg, cluster.clone()).unwrap();
        let app = http::app(cluster.clone(), access, PolicyConfig::default());
        let listener = tokio::net::TcpListener::bind(cfg.listen).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let c = cluster.clone();
        tokio::spawn(async move {
            let _ = server::serve_app(listener, c, app, std::future::pending()).await;
        });
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let ui = Self {
            url,
            http,
            cluster,
            _dir: dir,
        };
        (ui, admin, alice, bob)
    }

    async fn get(
        &self,
        path: &str,
        token: Option<&str>,
    ) -> (u16, String, reqwest::header::HeaderMap) {
        let mut req = self.http.get(format!("{}{path}", self.url));
        if let Some(t) = token {
            req = req.header("cookie", format!("nightshift_token={t}"));
        }
        let resp = req.send().await.unwrap();
        let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
        (status, resp.text().await.unwrap(), headers)
    }

    async fn post(
        &self,
        path: &str,
        token: Option<&str>,
        form: &[(&str, &str)],
    ) -> (u16, String, reqwest::header::HeaderMap) {
        self.post_with(path, token, form, &[]).await
    }

    /// [`Ui::post`] with these headers added (`Origin`, `Referer`).
    async fn post_with(
        &self,
        path: &str,
        token: Option<&str>,
        form: &[(&str, &str)],
        headers: &[(&str, &str)],
    ) -> (u16, String, reqwest::header::HeaderMap) {
        let body: String = form
            .iter()
            .map(|(k, v)| format!("{k}={}", url_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        let mut req = self
            .http
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        if let Some(t) = token {
            req = req.header("cookie", format!("nightshift_token={t}"));
        }
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let resp = req.send().await.unwrap();
        let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
        (status, resp.text().await.unwrap(), headers)
    }

    /// Submits a job through the UI's form; its id.
    async fn submit(&self, token: &str, name: &str, owner: &str) -> u64 {
        let spec = format!(
            r#"{{"name":"{name}","image":"busybox","command":["true"],"gpus":1,"owner":"{owner}"}}"#
        );
        let (status, body, headers) = self.post("/ui/jobs", Some(token), &[("spec", &spec)]).await;
        assert_eq!(status, 303, "{body}");
        let to = headers["location"].to_str().unwrap();
        to.strip_prefix("/ui/jobs/").unwrap().parse().unwrap()
    }
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test]
async fn pages_follow_the_apis_tokens_and_roles() {
    let (ui, admin, alice, bob) = Ui::start().await;

    // No cookie, or an unknown token: to the login page.
    for token in [None, Some("nst_unknown")] {
        let (status, _, headers) = ui.get("/ui/jobs", token).await;
        assert_eq!(status, 303, "{token:?}");
        assert_eq!(headers["location"], "/ui/login");
    }
    let (status, page, headers) = ui.get("/ui/login", None).await;
    assert_eq!(status, 200);
    assert!(page.contains("name=\"token\""), "{page}");
    assert!(
        headers["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("default-src 'none'")
    );

    // Logging in checks the token and keeps it in the cookie.
    let (status, _, headers) = ui.post("/ui/login", None, &[("token", &alice)]).await;
    assert_eq!(status, 303);
    assert_eq!(
        headers["set-cookie"],
        format!("nightshift_token={alice}; Path=/ui; HttpOnly; SameSite=Strict")
    );
    let (_, _, headers) = ui.post("/ui/login", None, &[("token", "nst_wrong")]).await;
    assert!(
        headers["location"]
            .to_str()
            .unwrap()
            .starts_with("/ui/login?error=")
    );
    assert!(!headers.contains_key("set-cookie"));

    // Every page renders for a researcher, with the embedded script and stylesheet.
    for page in [
        "/ui/",
        "/ui/jobs",
        "/ui/pipelines",
        "/ui/nodes",
        "/ui/report",
    ] {
        let (status, body, _) = ui.get(page, Some(&alice)).await;
        assert_eq!(status, 200, "{page}: {body}");
        assert!(
            body.contains("alice · researcher · team nlp"),
            "{page}: {body}"
        );
    }
    for asset in ["/ui/assets/ui.js", "/ui/assets/ui.css"] {
        let (status, body, _) = ui.get(asset, None).await;
        assert_eq!(status, 200);
        assert!(body.len() > 500, "{asset}");
    }

    // Each researcher submits as its team; the form refuses another team's job as the API does.
    let nlp_job = ui.submit(&alice, "nlp-train", "nlp").await;
    let vision_job = ui.submit(&bob, "vision-eval", "vision").await;
    let spec = r#"{"name":"x","image":"busybox","gpus":1,"owner":"vision"}"#;
    let (status, body, _) = ui.post("/ui/jobs", Some(&alice), &[("spec", spec)]).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("id=\"submit-error\""), "{body}");
    let (status, body, _) = ui
        .post("/ui/jobs", Some(&alice), &[("spec", "{\"name\":1}")])
        .await;
    assert_eq!(status, 400, "{body}");

    // Alice's page of bob's job has no cancel button, and posting the form anyway is refused.
    let (_, own, _) = ui.get(&format!("/ui/jobs/{nlp_job}"), Some(&alice)).await;
    assert!(own.contains("id=\"cancel\""), "{own}");
    let (_, other, _) = ui
        .get(&format!("/ui/jobs/{vision_job}"), Some(&alice))
        .await;
    assert!(other.contains("vision-eval"), "{other}");
    assert!(!other.contains("id=\"cancel\""), "{other}");
    let (status, body, _) = ui
        .post(&format!("/ui/jobs/{vision_job}/cancel"), Some(&alice), &[])
        .await;
    assert_eq!(status, 403, "{body}");
    let state = |id| ui.cluster.read(|core, _| core.job(id).unwrap().state);
    assert_eq!(state(vision_job), JobState::Queued);

    // A form from another site is refused, even with the cookie.
    let resp = ui
        .http
        .post(format!("{}/ui/jobs/{nlp_job}/cancel", ui.url))
        .header("cookie", format!("nightshift_token={alice}"))
        .header("origin", "https://elsewhere.example")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 403);
    assert_eq!(state(nlp_job), JobState::Queued);

    // Her own job she cancels; the admin cancels any.
    let (status, _, _) = ui
        .post(&format!("/ui/jobs/{nlp_job}/cancel"), Some(&alice), &[])
        .await;
    assert_eq!(status, 303);
    assert_eq!(state(nlp_job), JobState::Cancelled);
    let (_, page, _) = ui
        .get(&format!("/ui/jobs/{vision_job}"), Some(&admin))
        .await;
    assert!(page.contains("id=\"cancel\""), "{page}");
    let (status, _, _) = ui
        .post(&format!("/ui/jobs/{vision_job}/cancel"), Some(&admin), &[])
        .await;
    assert_eq!(status, 303);
    assert_eq!(state(vision_job), JobState::Cancelled);
    let (_, page, _) = ui
        .get(&format!("/ui/jobs/{vision_job}"), Some(&admin))
        .await;
    assert!(
        !page.contains("id=\"cancel\""),
        "a finished job has no cancel button"
    );

    // The list filters by team and state.
    let (_, page, _) = ui
        .get("/ui/jobs?team=vision&state=cancelled", Some(&alice))
        .await;
    assert!(
        page.contains("vision-eval") && !page.contains("nlp-train"),
        "{page}"
    );

    // A job that never ran has no logs yet: the event stream says to wait.
    let (status, body, headers) = ui
        .get(&format!("/ui/jobs/{vision_job}/events"), Some(&alice))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["content-type"], "text/event-stream");
    assert!(body.starts_with("event: wait\n"), "{body}");

    // Logging out forgets the cookie.
    let (status, _, headers) = ui.post("/ui/logout", Some(&alice), &[]).await;
    assert_eq!(status, 303);
    assert!(
        headers["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
}

/// Login CSRF: another site's page posting the login form with the attacker's own token
/// would log the victim's browser into the attacker's account (no cookie is needed for
/// that, so SameSite does not help). A login from another site, by its `Origin` or, without
/// one, its `Referer`, is refused with no cookie set; one from the UI's own page, or with
/// neither header, logs in as before.
#[tokio::test]
async fn a_login_from_another_site_is_refused() {
    let (ui, _, alice, _) = Ui::start().await;
    let here = ui.url.clone();
    let login_page = format!("{here}/ui/login");
    for headers in [
        [("origin", "http://evil.example")].as_slice(),
        &[("origin", "null")],
        &[("referer", "http://evil.example/trap.html")],
        &[("origin", "http://evil.example"), ("referer", &login_page)],
    ] {
        let (status, body, got) = ui
            .post_with("/ui/login", None, &[("token", &alice)], headers)
            .await;
        assert_eq!(status, 403, "{headers:?}: {body}");
        assert!(
            body.contains("a form sent from another site is refused"),
            "{headers:?}: {body}"
        );
        assert!(!got.contains_key("set-cookie"), "{headers:?}: {got:?}");
    }
    let cookie = format!("nightshift_token={alice}; Path=/ui; HttpOnly; SameSite=Strict");
    for headers in [
        [("origin", here.as_str())].as_slice(),
        &[("referer", &login_page)],
        &[],
    ] {
        let (status, body, got) = ui
            .post_with("/ui/login", None, &[("token", &alice)], headers)
            .await;
        assert_eq!(status, 303, "{headers:?}: {body}");
        assert_eq!(got["set-cookie"], cookie.as_str(), "{headers:?}");
    }

    // The same rule holds for the forms of a logged-in browser: a cross-site Referer
    // without an Origin is refused there too.
    let (status, body, _) = ui
        .post_with(
            "/ui/logout",
            Some(&alice),
            &[],
            &[("referer", "http://evil.example/")],
        )
        .await;
    assert_eq!(status, 403, "{body}");
}
