//! Who may call the API (jobs, nodes, gateway signals): a bearer token and its role.
//!
//! Once the coordinator has any token (`nightshift-coordinator token create`), every API
//! call needs one (401 without, or with an unknown one). Until then the API is open, as in
//! tests and the demo, and the coordinator warns at start. Reading is open to every role;
//! a researcher submits jobs (as its team: the submit handler's admission sees to that,
//! [`crate::policy::Submitter`]) and cancels only its team's jobs (403); everything else
//! that changes something is for operators and admins. The request is passed on as it came:
//! this layer only authenticates and authorises, and never reads a body. Every call that changes
//! something is written to the audit log (target `nightshift::audit`), by token name and
//! role, never by token. Each token is held to a rate limit ([`RateLimiter`], 429 beyond),
//! and so is each client address's failed authentications: past
//! [`crate::ratelimit::FAILED_AUTH_BURST`] failures, at most
//! [`crate::ratelimit::FAILED_AUTH_PER_S`] a second, and calls from it beyond that are
//! refused (429, with `Retry-After`) before any token is looked at, so that tokens cannot be
//! guessed at line rate. Behind a proxy every client shares the proxy's address: one client
//! failing fast slows the others' calls too, never opens anything.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{Extensions, HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::HttpError;
use crate::auth::{Principal, Role, Tokens};
use crate::cluster::Cluster;
use crate::ratelimit::RateLimiter;

#[derive(Clone)]
pub struct AccessState {
    pub tokens: Arc<Tokens>,
    pub cluster: Arc<Cluster>,
    pub limiter: Arc<RateLimiter>,
    /// Failed authentications per client address.
    pub auth_failures: Arc<RateLimiter<IpAddr>>,
}

/// The client's address, where the server recorded it among a request's extensions
/// (without one, all share a bucket).
pub(crate) fn client_ip(extensions: &Extensions) -> IpAddr {
    extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), |c| c.0.ip())
}

/// 401 for `why`, counted against `ip`'s failed authentications.
fn unauthorized(s: &AccessState, ip: IpAddr, why: &str) -> Response {
    s.auth_failures.allow(ip, Instant::now());
    HttpError::new(StatusCode::UNAUTHORIZED, why, None).into_response()
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// How refusals name the caller: `alice (role researcher, team nlp)`.
pub(super) fn who(p: &Principal) -> String {
    match &p.team {
        Some(team) => format!("{} (role {}, team {team})", p.name, p.role.as_str()),
        None => format!("{} (role {})", p.name, p.role.as_str()),
    }
}

fn forbidden(p: &Principal, what: impl Into<String>, field: Option<&str>) -> Response {
    HttpError::new(
        StatusCode::FORBIDDEN,
        format!("{} {}", who(p), what.into()),
        field,
    )
    .into_response()
}

pub async fn check(State(s): State<AccessState>, req: Request, next: Next) -> Response {
    let ip = client_ip(req.extensions());
    let principal = match authenticate(&s, ip, bearer(req.headers())) {
        Ok(Some(principal)) => principal,
        // The open API: no token yet, none given.
        Ok(None) => return next.run(req).await,
        Err(refusal) => return refusal,
    };
    if let Err(refusal) = permit(&s.cluster, &principal, req.method(), req.uri().path()) {
        return refusal;
    }
    // The handlers see who is calling (admission: a researcher's team, an admin's waiver).
    let mut req = req;
    req.extensions_mut().insert(principal);
    next.run(req).await
}

/// Who `token` stands for, as the API and the web UI ([`crate::ui`]) see a caller: `None`
/// while the coordinator has no token and none is given (the open API); a refusal (401,
/// or 429 past the rate limits) otherwise.
// A refusal is the answer itself, built only on the rare refused call.
#[allow(clippy::result_large_err)]
pub(crate) fn authenticate(
    s: &AccessState,
    ip: IpAddr,
    token: Option<&str>,
) -> Result<Option<Principal>, Response> {
    if token.is_none() && s.tokens.is_empty() {
        return Ok(None);
    }
    let wait = s.auth_failures.wait(&ip, Instant::now());
    if !wait.is_zero() {
        let retry_after = wait.as_secs_f64().ceil().max(1.0) as u64;
        tracing::debug!(client = %ip, retry_after, "authentication refused: too many failures");
        let mut refusal = HttpError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("too many failed authentications from {ip}; try again in {retry_after} s"),
            None,
        )
        .into_response();
        refusal
            .headers_mut()
            .insert(header::RETRY_AFTER, retry_after.into());
        return Err(refusal);
    }
    let principal = match token {
        Some(token) => match s.tokens.verify(token) {
            Some(p) => p,
            None => return Err(unauthorized(s, ip, "unknown API token")),
        },
        None => {
            return Err(unauthorized(
                s,
                ip,
                "an API token is required: set NIGHTSHIFT_TOKEN \
                 (nightshift-coordinator token create --role ROLE)",
            ));
        }
    };
    if !s.limiter.allow(principal.token_id, Instant::now()) {
        return Err(HttpError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "token {} sends more than {} requests per second; slow down",
                principal.name,
                s.limiter.rate()
            ),
            None,
        )
        .into_response());
    }
    Ok(Some(principal))
}

/// Whether `principal` may call `method path` of the API (a refusal, 403, if not); a call
/// that changes something is written to the audit log. The web UI asks this for the API
/// call each of its actions stands for, so that both follow one set of rules.
// A refusal is the answer itself, built only on the rare refused call.
#[allow(clippy::result_large_err)]
pub(crate) fn permit(
    cluster: &Cluster,
    principal: &Principal,
    method: &Method,
    path: &str,
) -> Result<(), Response> {
    if method == Method::GET || method == Method::HEAD {
        return Ok(());
    }
    rule(cluster, principal, method, path).map_err(|why| forbidden(principal, why, None))?;
    tracing::info!(
        target: "nightshift::audit",
        token_id = principal.token_id,
        token_name = %principal.name,
        role = principal.role.as_str(),
        team = principal.team.as_deref().unwrap_or(""),
        %method,
        %path,
        "api call"
    );
    Ok(())
}

/// [`permit`]'s decision without the audit: whether `principal` may call `method path`
/// (the UI shows a button only where this says yes), and, if not, why.
pub(crate) fn rule(
    cluster: &Cluster,
    principal: &Principal,
    method: &Method,
    path: &str,
) -> Result<(), String> {
    if method == Method::GET || method == Method::HEAD {
        return Ok(());
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (principal.role, segments.as_slice()) {
        (Role::Admin | Role::Operator, _) | (Role::Researcher, ["v1", "jobs"]) => Ok(()),
        (Role::Researcher, ["v1", "jobs", id, "cancel"]) => {
            let owner = id
                .parse::<u64>()
                .ok()
                .and_then(|id| cluster.read(|core, _| core.job(id)))
                .map(|job| job.spec.owner);
            match owner {
                // An unknown job: the handler answers 404.
                None => Ok(()),
                Some(owner) if owner.is_some() && owner == principal.team => Ok(()),
                Some(owner) => Err(format!(
                    "may cancel only its team's jobs; job {id} belongs to {}",
                    owner.as_deref().unwrap_or("no team")
                )),
            }
        }
        (Role::Researcher, _) => Err(format!("may not {method} {path}")),
    }
}
