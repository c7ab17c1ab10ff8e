//! `GET /v1/openapi.json` against a real coordinator with API tokens: it is served without
//! a token, and every operation it describes is answered by a handler (never the router's own
//! 404 or 405), so that a path or method in the document that the router does not serve
//! fails here. (That every route served is in the document is `http::openapi`'s unit test.)

use nightshift_coordinator::auth::{Role, Tokens};
use nightshift_coordinator::config::{CoordinatorConfig, ServiceConfig};
use nightshift_coordinator::{http, policy::PolicyConfig, server};
use serde_json::Value;

#[tokio::test]
async fn every_operation_of_the_document_is_served() {
    let data = tempfile::tempdir().unwrap();
    let tokens = Tokens::open(data.path()).unwrap();
    let (_, admin) = tokens.create("ops", Role::Admin, None, 1).unwrap();
    let cfg = CoordinatorConfig {
        data_dir: data.path().to_owned(),
        services: vec![ServiceConfig {
            min_replicas: 0,
            ..ServiceConfig::default()
        }],
        ..CoordinatorConfig::default()
    };
    let cluster = server::open(&cfg).unwrap();
    let access = http::access_for(&cfg, cluster.clone()).unwrap();
    let app = http::app(cluster, access, PolicyConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();

    // The document needs no token; the API's calls do.
    let resp = client
        .get(format!("{url}/v1/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let doc: Value = resp.json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    let refused = client.get(format!("{url}/v1/jobs")).send().await.unwrap();
    assert_eq!(refused.status(), 401);

    let mut asked = 0;
    for (template, item) in doc["paths"].as_object().unwrap() {
        let path = template
            .replace("{id}", "1")
            .replace("{name}", "default")
            .replace("{node}", "gpu-01");
        for method in item.as_object().unwrap().keys() {
            let req = match method.as_str() {
                "get" => client.get(format!("{url}{path}")),
                "post" => client.post(format!("{url}{path}")).body("{}"),
                other => panic!("{template}: a method the API does not use: {other}"),
            };
            let resp = req.bearer_auth(&admin).send().await.unwrap();
            let status = resp.status().as_u16();
            let body = resp.text().await.unwrap();
            // The router's own refusals have an empty body; a handler's 404 names what.
            let unrouted = status == 405 || (status == 404 && body.is_empty());
            assert!(
                !unrouted,
                "{method} {template} is in the OpenAPI document, but the router answers \
                 {status} to {path}"
            );
            asked += 1;
        }
    }
    assert!(asked >= 20, "only {asked} operations in the document");
}
