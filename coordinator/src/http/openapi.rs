//! `GET /v1/openapi.json`: the HTTP API as an OpenAPI 3.1 document, generated from the
//! handlers' `#[utoipa::path]` attributes and the wire types of `nightshift_common` (their
//! `ToSchema`, behind its `openapi` feature), never written by hand.
//!
//! It is served without a token, like `/healthz`: it describes the API's shape, which the
//! source already tells, and nothing of the cluster's state. Which calls need a token is in
//! the document itself (`security`), from the same route tables the router and its access
//! control are built from ([`super::served_routes`]).
//!
//! Every 4xx and 5xx answer carries an [`ApiError`] (the `default` response of each
//! operation) unless the operation says otherwise.

use std::sync::OnceLock;

use axum::http::{Method, header};
use axum::response::{IntoResponse, Response};
use nightshift_common::ApiError;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi as Document, Ref, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use super::{agents, jobs, logs, nodes, pipelines, report, services};

/// The security scheme of the API tokens (`nightshift-coordinator token create`).
pub const TOKEN_SCHEME: &str = "token";
/// The security scheme of the agents' client certificates, over HTTPS.
pub const AGENT_CERT_SCHEME: &str = "agent_certificate";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "nightshift coordinator",
        description = "The coordinator's HTTP API: jobs, pipeline runs, nodes, reports and \
            service discovery for the CLI, operators and load balancers; the agent protocol \
            under /v1/agents."
    ),
    paths(
        super::healthz,
        serve,
        super::metrics,
        jobs::submit,
        jobs::list,
        jobs::show,
        jobs::cancel,
        logs::logs,
        pipelines::submit,
        pipelines::list,
        pipelines::show,
        pipelines::rerun,
        nodes::list,
        nodes::gateway,
        services::nodes_http_sd,
        services::list,
        services::http_sd,
        report::report,
        agents::register,
        agents::heartbeat,
        agents::desired,
    ),
    components(schemas(ApiError)),
    modifiers(&Conventions),
)]
pub struct ApiDoc;

/// The document as served, built once.
pub fn document() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let mut doc = serde_json::to_value(ApiDoc::openapi()).expect("the document serialises");
        strict_flatten(&mut doc);
        serde_json::to_string_pretty(&doc).expect("the document serialises")
    })
}

/// A type that refuses unknown fields (`additionalProperties: false`) flattened into
/// another (`#[serde(flatten)]`, an `allOf` of both) would refuse the other's fields: each
/// `allOf` member is checked alone. So such a member is inlined without it, and the whole
/// refuses what none of its members names (`unevaluatedProperties: false`, JSON Schema
/// 2020-12, which OpenAPI 3.1 uses). The report's totals are one.
fn strict_flatten(doc: &mut serde_json::Value) {
    let Some(schemas) = doc
        .pointer_mut("/components/schemas")
        .and_then(|s| s.as_object_mut())
    else {
        return;
    };
    let strict: serde_json::Map<String, serde_json::Value> = schemas
        .iter()
        .filter(|(_, s)| s["additionalProperties"] == false)
        .map(|(name, s)| (format!("#/components/schemas/{name}"), s.clone()))
        .collect();
    for schema in schemas.values_mut() {
        let Some(members) = schema.get_mut("allOf").and_then(|a| a.as_array_mut()) else {
            continue;
        };
        let mut any = false;
        for member in members.iter_mut() {
            let target = member["$ref"].as_str().and_then(|r| strict.get(r));
            if let Some(target) = target {
                let mut open = target.clone();
                open.as_object_mut()
                    .expect("a schema object")
                    .remove("additionalProperties");
                *member = open;
                any = true;
            }
        }
        if any {
            schema["unevaluatedProperties"] = false.into();
        }
    }
}

/// The API's OpenAPI 3.1 document.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "meta",
    security(()),
    responses((status = 200, description = "This document.", body = Object))
)]
pub async fn serve() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], document()).into_response()
}

/// What every operation shares, added to the generated document: the `default` (error)
/// answer and who may call it.
struct Conventions;

impl Modify for Conventions {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            TOKEN_SCHEME,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "An API token (`nightshift-coordinator token create`), needed once the \
                         coordinator has any.",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            AGENT_CERT_SCHEME,
            SecurityScheme::MutualTls {
                description: Some(
                    "Over HTTPS, the client certificate the cluster CA issued to the node the \
                     call speaks for."
                        .to_owned(),
                ),
                deprecated: None,
                extensions: None,
            },
        );
        let error = ResponseBuilder::new()
            .description("The error: 4xx for the request, 5xx for the coordinator.")
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ApiError")))
                    .build(),
            )
            .build();
        let open: Vec<_> = super::open_routes().served;
        let agents: Vec<_> = super::agent_routes().served;
        for (path, item) in doc.paths.paths.iter_mut() {
            let operations = [
                (Method::GET, &mut item.get),
                (Method::POST, &mut item.post),
                (Method::PUT, &mut item.put),
                (Method::DELETE, &mut item.delete),
                (Method::PATCH, &mut item.patch),
            ];
            for (method, operation) in operations {
                let Some(op) = operation else { continue };
                op.responses
                    .responses
                    .entry("default".to_owned())
                    .or_insert_with(|| error.clone().into());
                let route = (method, path.as_str());
                let scheme = if open.iter().any(|(m, p)| (m, *p) == (&route.0, route.1)) {
                    continue;
                } else if agents.iter().any(|(m, p)| (m, *p) == (&route.0, route.1)) {
                    AGENT_CERT_SCHEME
                } else {
                    TOKEN_SCHEME
                };
                op.security = Some(vec![SecurityRequirement::new::<_, _, &str>(scheme, [])]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// Each (method, path) the document describes.
    fn documented() -> BTreeSet<(String, String)> {
        let doc: serde_json::Value = serde_json::from_str(document()).unwrap();
        let mut out = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                out.insert((method.to_uppercase(), path.clone()));
            }
        }
        out
    }

    #[test]
    fn the_document_describes_every_route_served_and_no_other() {
        let served: BTreeSet<(String, String)> = super::super::served_routes()
            .into_iter()
            .map(|(m, p)| (m.to_string(), p.to_owned()))
            .collect();
        let documented = documented();
        let undocumented: Vec<_> = served.difference(&documented).collect();
        let unserved: Vec<_> = documented.difference(&served).collect();
        assert!(
            undocumented.is_empty() && unserved.is_empty(),
            "served but not in the OpenAPI document (add #[utoipa::path] and list it in \
             ApiDoc): {undocumented:?}; in the document but not served: {unserved:?}"
        );
        assert!(served.len() >= 20, "{served:?}");
    }

    /// The web UI's routes are left out of the document by being in a table of their own:
    /// that table may hold nothing but `/ui` pages, and the API's nothing under `/ui`, so
    /// that no API route escapes the check above by being listed as the UI's.
    #[test]
    fn the_ui_routes_are_all_under_ui_and_no_api_route_is() {
        let under_ui = |p: &str| p == "/ui" || p.starts_with("/ui/");
        let ui = super::super::ui_routes();
        let strays: Vec<_> = ui.iter().filter(|(_, p)| !under_ui(p)).collect();
        assert!(strays.is_empty(), "UI routes outside /ui: {strays:?}");
        let api = super::super::served_routes();
        let hidden: Vec<_> = api.iter().filter(|(_, p)| under_ui(p)).collect();
        assert!(hidden.is_empty(), "API routes under /ui: {hidden:?}");
        assert!(ui.len() >= 10, "{ui:?}");
        let documented = documented();
        assert!(
            documented.iter().all(|(_, p)| !under_ui(p)),
            "{documented:?}"
        );
    }

    #[test]
    fn the_document_is_openapi_3_1_with_schemas_and_security() {
        let doc: serde_json::Value = serde_json::from_str(document()).unwrap();
        assert_eq!(doc["openapi"], "3.1.0");
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        for name in ["JobSpec", "JobView", "NodeList", "ApiError", "Heartbeat"] {
            assert!(schemas.contains_key(name), "no schema {name}");
        }
        let op = |path: &str, method: &str| doc["paths"][path][method].clone();
        assert_eq!(
            op("/v1/jobs", "post")["security"][0][TOKEN_SCHEME],
            json_empty()
        );
        assert_eq!(
            op("/v1/agents/register", "post")["security"][0][AGENT_CERT_SCHEME],
            json_empty()
        );
        assert_eq!(
            op("/v1/openapi.json", "get")["security"],
            serde_json::json!([{}])
        );
        // The report's totals are flattened into it: strict as a whole, not member by member.
        let report = &schemas["Report"];
        assert_eq!(report["unevaluatedProperties"], false);
        assert!(
            report["allOf"][0]["properties"]["savings"].is_object(),
            "{report}"
        );
        assert!(
            report["allOf"][0].get("additionalProperties").is_none(),
            "{report}"
        );
        assert_eq!(
            op("/v1/jobs/{id}", "get")["responses"]["default"]["content"]["application/json"]["schema"]
                ["$ref"],
            "#/components/schemas/ApiError"
        );
    }

    fn json_empty() -> serde_json::Value {
        serde_json::json!([])
    }
}
