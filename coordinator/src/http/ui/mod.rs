//! The web UI under `/ui/`: server-rendered HTML pages (maud templates) with a little
//! vanilla script, for researchers and operators.
//!
//! It reads what the API reads, through the API's own handlers (`jobs::list`, `nodes::list`,
//! `report::report`, the log proxy, ...), and acts through them too: each button stands for
//! one API call, allowed or refused by the same rules ([`access::permit`]). It is behind the
//! same tokens and roles: a token given once on the login page is kept in an HttpOnly,
//! SameSite=Strict cookie (Secure over TLS), read on each request by [`gate`] as the API
//! reads its `Authorization` header. Its routes are a table of their own, outside the API's
//! OpenAPI document ([`super::served_routes`] lists the API only).
//!
//! Nothing is fetched from elsewhere: the stylesheet and script are embedded in the binary
//! and every chart is inline SVG drawn here. Live parts of a page (marked `data-live`) are
//! refreshed by the script from the same URL every two seconds; a job's log follows the
//! agent's output as server-sent events ([`jobs::events`]).

mod assets;
mod chart;
mod jobs;
mod nodes;
mod overview;
mod page;
mod pipelines;
mod report;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Extensions, HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Extension, Form};
use maud::html;
use serde::Deserialize;

use super::Routes;
use super::access::{self, AccessState};
use crate::auth::Principal;
use crate::cluster::Cluster;

/// The cookie that carries the API token of a logged-in browser.
pub const COOKIE: &str = "nightshift_token";

/// Who is looking at a page: the token's principal, or nobody in particular while the
/// coordinator has no tokens (the API is open then, and so is the UI).
#[derive(Debug, Clone)]
pub struct Viewer {
    pub principal: Option<Principal>,
}

impl Viewer {
    /// Whether the API would let this viewer call `method path` (a button is shown only
    /// then).
    fn may(&self, cluster: &Cluster, method: Method, path: &str) -> bool {
        match &self.principal {
            None => true,
            Some(p) => access::rule(cluster, p, &method, path).is_ok(),
        }
    }

    /// Authorises the API call `method path` that a button stands for, as the API would
    /// (a refusal, 403, if not), writing it to the audit log.
    #[allow(clippy::result_large_err)]
    fn act(&self, cluster: &Cluster, method: Method, path: &str) -> Result<(), Response> {
        match &self.principal {
            None => Ok(()),
            Some(p) => access::permit(cluster, p, &method, path),
        }
    }
}

/// The UI's routes, all under `/ui`, each a page (HTML), an embedded asset, a form's
/// target or a page's event stream: none is part of the JSON API.
pub(super) fn routes() -> Routes {
    Routes::new()
        .get("/ui", || async { Redirect::permanent("/ui/") })
        .get("/ui/", overview::page)
        .get("/ui/login", login_page)
        .post("/ui/login", login)
        .post("/ui/logout", logout)
        .get("/ui/assets/{file}", assets::serve)
        .get("/ui/jobs", jobs::list)
        .post("/ui/jobs", jobs::submit)
        .get("/ui/jobs/{id}", jobs::show)
        .post("/ui/jobs/{id}/cancel", jobs::cancel)
        .get("/ui/jobs/{id}/events", jobs::events)
        .get("/ui/pipelines", pipelines::list)
        .get("/ui/pipelines/{id}", pipelines::show)
        .post("/ui/pipelines/{id}/rerun", pipelines::rerun)
        .get("/ui/nodes", nodes::page)
        .get("/ui/report", report::page)
}

/// The UI's access control: finds the viewer from the cookie, as the API's
/// [`access::check`] does from the `Authorization` header, and sends one without a good
/// token to the login page. The login page and the assets are open. Every answer carries
/// headers that keep it from being framed, cached or given scripts from elsewhere.
pub(super) async fn gate(
    State(access): State<Option<AccessState>>,
    req: Request,
    next: Next,
) -> Response {
    let mut response = admit(access.as_ref(), req, next).await;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

async fn admit(access: Option<&AccessState>, mut req: Request, next: Next) -> Response {
    if req.method() != Method::GET
        && req.method() != Method::HEAD
        && let Err(why) = same_origin(req.headers())
    {
        return page::error(StatusCode::FORBIDDEN, why);
    }
    let path = req.uri().path();
    if path == "/ui/login" || path.starts_with("/ui/assets/") {
        return next.run(req).await;
    }
    let principal = match access {
        None => None,
        Some(s) => {
            let token = cookie(req.headers(), COOKIE);
            match access::authenticate(s, access::client_ip(req.extensions()), token.as_deref()) {
                Ok(p) => p,
                Err(refusal) if refusal.status() == StatusCode::UNAUTHORIZED => {
                    return to_login(&req);
                }
                Err(refusal) => return refusal,
            }
        }
    };
    req.extensions_mut().insert(Viewer { principal });
    next.run(req).await
}

/// A page asked for without a good token goes to the login page; the script's requests
/// (live parts, events) get a 401 that it turns into the same.
fn to_login(req: &Request) -> Response {
    if req.method() == Method::GET && !req.headers().contains_key("x-nightshift-live") {
        return Redirect::to("/ui/login").into_response();
    }
    page::error(
        StatusCode::UNAUTHORIZED,
        "log in again: the token is not known",
    )
}

/// Every form, the login's included, must come from this server's own pages: its `Origin`,
/// where the browser sends one, must be this server, and without an `Origin` so must its
/// `Referer`, where there is one. SameSite=Strict already keeps the cookie off requests from
/// other sites; this refuses them outright, and keeps another site from logging a browser in
/// with a token of its choosing (login CSRF), where no cookie is needed. A form with neither
/// header (an old browser, a script) is let through. (Pages are sent with
/// `Referrer-Policy: same-origin`: under `no-referrer` a browser sends its own forms with
/// `Origin: null`.)
fn same_origin(headers: &HeaderMap) -> Result<(), &'static str> {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let text = |name| headers.get(name).map(|v| v.to_str().unwrap_or(""));
    // `scheme://host[:port]...`: the host and port must be the ones this request was sent to.
    let here = |url: &str| {
        let authority = url
            .split_once("://")
            .map(|(_, rest)| rest.split(['/', '?', '#']).next().unwrap_or(""));
        authority.is_some() && authority == host
    };
    if let Some(origin) = text(header::ORIGIN) {
        if !here(origin) {
            return Err("a form sent from another site is refused: its Origin is not this server");
        }
    } else if let Some(referer) = text(header::REFERER)
        && !here(referer)
    {
        return Err("a form sent from another site is refused: its Referer is not this server");
    }
    Ok(())
}

/// The value of cookie `name`.
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// The cookie that keeps `token` (empty: the one that forgets it): HttpOnly, so no script
/// reads it; SameSite=Strict, so no other site's page sends it; Secure over TLS; for `/ui`
/// only, so the JSON API never sees it.
fn token_cookie(token: &str, tls: bool) -> HeaderValue {
    let secure = if tls { "; Secure" } else { "" };
    let max_age = if token.is_empty() { "; Max-Age=0" } else { "" };
    HeaderValue::from_str(&format!(
        "{COOKIE}={token}; Path=/ui; HttpOnly; SameSite=Strict{secure}{max_age}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("nightshift_token=; Path=/ui; Max-Age=0"))
}

#[derive(Deserialize)]
struct LoginQuery {
    error: Option<String>,
}

async fn login_page(
    Extension(access): Extension<Option<AccessState>>,
    axum::extract::Query(q): axum::extract::Query<LoginQuery>,
) -> Response {
    let open = access.as_ref().is_none_or(|a| a.tokens.is_empty());
    let body = html! {
        div.login {
            h1 { "nightshift" }
            @if open {
                p.note { "This coordinator has no API tokens yet: its API and this UI are open to anyone who reaches them. " a href="/ui/" { "Open the overview" } "." }
            }
            form method="post" action="/ui/login" {
                label for="token" { "API token" }
                input #token type="password" name="token" autocomplete="current-password" placeholder="nst_..." required;
                button type="submit" { "Log in" }
            }
            @if let Some(e) = &q.error {
                p.error #login-error { (e) }
            }
            p.hint { "A token comes from " code { "nightshift-coordinator token create --role ROLE" } "; the browser keeps it in a cookie that scripts cannot read." }
        }
    };
    page::bare("Log in", body).into_response()
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

/// Checks the token as the API would and keeps it in the cookie.
async fn login(
    Extension(access): Extension<Option<AccessState>>,
    tls: Option<Extension<crate::https::PeerNode>>,
    extensions: Extensions,
    Form(form): Form<LoginForm>,
) -> Response {
    let token = form.token.trim();
    if let Some(s) = &access {
        match access::authenticate(s, access::client_ip(&extensions), Some(token)) {
            Ok(_) => {}
            Err(refusal) => {
                let why = if refusal.status() == StatusCode::UNAUTHORIZED {
                    "unknown API token"
                } else {
                    "too many attempts; wait a little"
                };
                let to = format!(
                    "/ui/login?error={}",
                    why.replace(' ', "+").replace(';', "%3B")
                );
                return Redirect::to(&to).into_response();
            }
        }
    }
    let mut response = Redirect::to("/ui/").into_response();
    response
        .headers_mut()
        .insert(header::SET_COOKIE, token_cookie(token, tls.is_some()));
    response
}

async fn logout(tls: Option<Extension<crate::https::PeerNode>>) -> Response {
    let mut response = Redirect::to("/ui/login").into_response();
    response
        .headers_mut()
        .insert(header::SET_COOKIE, token_cookie("", tls.is_some()));
    response
}

/// The cluster the pages read.
type Shared = State<Arc<Cluster>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cookie_is_http_only_strict_and_secure_over_tls() {
        let c = token_cookie("nst_abc", true);
        assert_eq!(
            c.to_str().unwrap(),
            "nightshift_token=nst_abc; Path=/ui; HttpOnly; SameSite=Strict; Secure"
        );
        let c = token_cookie("nst_abc", false);
        assert!(!c.to_str().unwrap().contains("Secure"));
        assert!(
            token_cookie("", false)
                .to_str()
                .unwrap()
                .ends_with("Max-Age=0")
        );
    }

    #[test]
    fn cookies_are_found_by_name() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; nightshift_token=nst_x; b=2"),
        );
        assert_eq!(cookie(&h, COOKIE).as_deref(), Some("nst_x"));
        assert_eq!(cookie(&h, "c"), None);
    }

    #[test]
    fn a_form_from_another_origin_is_refused() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("coord:7400"));
        assert!(
            same_origin(&h).is_ok(),
            "neither Origin nor Referer: an old browser or a script"
        );
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://coord:7400"),
        );
        assert!(same_origin(&h).is_ok());
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert!(same_origin(&h).unwrap_err().contains("Origin"));
        h.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(same_origin(&h).is_err());
    }

    #[test]
    fn without_an_origin_the_referer_decides() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("coord:7400"));
        for (referer, ok) in [
            ("http://coord:7400/ui/login", true),
            ("http://coord:7400", true),
            ("https://coord:7400?x=1", true),
            ("http://coord:7400.evil.example/ui/login", false),
            ("http://evil.example/coord:7400/", false),
            ("http://coord:7401/ui/login", false),
            ("/ui/login", false),
        ] {
            h.insert(header::REFERER, HeaderValue::from_static(referer));
            assert_eq!(same_origin(&h).is_ok(), ok, "{referer}");
        }
        // An Origin, when sent, is what counts.
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://coord:7400"),
        );
        assert!(same_origin(&h).is_ok());
    }
}
