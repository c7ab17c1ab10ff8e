//! Checkpoints in an S3-compatible bucket (`[checkpoints] storage = "object"`).
//!
//! Each attempt (lease) of a job keeps its checkpoint under its own fencing epoch:
//!
//! ```text
//! PREFIX jobs/JOB/checkpoints/EPOCH/STARTED        written when the attempt is about to start
//!                                                  (its node and attempt number, JSON)
//! PREFIX jobs/JOB/checkpoints/EPOCH/files/PATH     what the attempt's directory held, file by file
//! PREFIX jobs/JOB/checkpoints/EPOCH/MANIFEST.json  written last: the files and their sizes
//! ```
//!
//! `EPOCH` is written with 20 digits, so that keys sort by epoch. An attempt writes only
//! under its own epoch, so an older attempt that uploads late can never replace a newer
//! one's checkpoint. A checkpoint is complete once its manifest is there: a half-finished
//! upload (an agent that died meanwhile) has none and is never restored.
//!
//! Before an attempt starts, the agent restores the newest complete checkpoint of an epoch
//! below its own into the attempt's local directory ([`Bucket::restore`]). An epoch above
//! that one with `STARTED` but no manifest yet, of an earlier attempt, is one whose upload
//! may still be under way (a reclaimed job's upload runs after its GPUs were given back):
//! the restore waits for its manifest, up to `checkpoints.object.upload_wait_s`, then takes
//! the newest complete one, and never waits for an epoch that the same attempt started.
//!
//! A gang member's attempts are kept per rank, `PREFIX jobs/JOB/checkpoints/rank-R/EPOCH/...`
//! ([`Layout::rank`]): each member resumes from its own rank's newest checkpoint. After the attempt's container stops, its directory is uploaded
//! ([`Bucket::upload`]) in the background, the manifest last.
//!
//! Requests are signed with SigV4 (presigned URLs, `rusty-s3`) and sent over hyper with
//! rustls on ring. A presigned URL carries the access key's id and a signature: it is never
//! logged; errors name the endpoint, the bucket and the key only.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::TryStreamExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper::{Request, StatusCode};
use nightshift_common::net::HttpsClient;
use nightshift_planner::CheckpointLayout;
use rusty_s3::{Credentials, S3Action, UrlStyle};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

/// `[checkpoints.object]` of agent.toml: the bucket that holds every job's checkpoints.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ObjectConfig {
    /// The S3 endpoint, `https://s3.eu-west-1.amazonaws.com` or `http://10.0.0.5:9000`.
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    /// Put before every key (`team-a/` makes `team-a/jobs/...`); `/` is added when missing.
    pub prefix: String,
    /// Path-style requests (`ENDPOINT/BUCKET/KEY`), as MinIO and most S3-compatible servers
    /// want; false for virtual-host style (`BUCKET.ENDPOINT/KEY`).
    pub path_style: bool,
    /// A file in the AWS shared credentials format (`[default]`, `aws_access_key_id = ...`,
    /// `aws_secret_access_key = ...`, optionally `aws_session_token`). Never inline.
    pub credentials_file: Option<PathBuf>,
    /// The profile (section) of `credentials_file` to read.
    pub profile: String,
    /// PEM certificates to trust for an `https://` endpoint; the system's roots when unset.
    pub ca_file: Option<PathBuf>,
    /// How long a restore waits for the upload of a newer attempt that started and has no
    /// manifest yet, before it takes the newest complete checkpoint.
    pub upload_wait_s: f64,
}

impl Default for ObjectConfig {
    fn default() -> Self {
        Self {
            endpoint: String::new(),
            bucket: String::new(),
            region: "us-east-1".into(),
            prefix: String::new(),
            path_style: true,
            credentials_file: None,
            profile: "default".into(),
            ca_file: None,
            upload_wait_s: 120.0,
        }
    }
}

/// A bad `[checkpoints.object]`, with the key it is about.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct ObjectConfigError {
    pub key: &'static str,
    pub reason: String,
}

fn bad(key: &'static str, reason: impl ToString) -> ObjectConfigError {
    ObjectConfigError {
        key,
        reason: reason.to_string(),
    }
}

impl ObjectConfig {
    /// Checks every setting and reads the credentials file; the error names the key.
    pub fn check(&self) -> Result<(), ObjectConfigError> {
        self.endpoint_url()?;
        if !valid_bucket(&self.bucket) {
            return Err(bad(
                "checkpoints.object.bucket",
                format!(
                    "{:?} is not a bucket name (3 to 63 of a-z, 0-9, '.', '-')",
                    self.bucket
                ),
            ));
        }
        if self.region.trim().is_empty() {
            return Err(bad("checkpoints.object.region", "must not be empty"));
        }
        if self.prefix.starts_with('/') || self.prefix.contains("//") {
            return Err(bad(
                "checkpoints.object.prefix",
                format!("{:?} must not start with '/' nor hold '//'", self.prefix),
            ));
        }
        if !(self.upload_wait_s.is_finite() && self.upload_wait_s >= 0.0) {
            return Err(bad(
                "checkpoints.object.upload_wait_s",
                "must be a duration in seconds >= 0",
            ));
        }
        self.credentials()?;
        if let Some(ca) = &self.ca_file {
            load_roots(Some(ca))?;
        }
        Ok(())
    }

    fn endpoint_url(&self) -> Result<url::Url, ObjectConfigError> {
        let key = "checkpoints.object.endpoint";
        let url = url::Url::parse(&self.endpoint)
            .map_err(|e| bad(key, format!("{:?} is not a URL: {e}", self.endpoint)))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(bad(
                key,
                format!("{:?} is not an http:// or https:// URL", self.endpoint),
            ));
        }
        Ok(url)
    }

    /// The credentials from `credentials_file`, profile `profile`.
    pub fn credentials(&self) -> Result<Credentials, ObjectConfigError> {
        let key = "checkpoints.object.credentials_file";
        let Some(path) = &self.credentials_file else {
            return Err(bad(
                key,
                "is needed: a file holding the bucket's access key (AWS credentials format)",
            ));
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad(key, format!("{}: {e}", path.display())))?;
        parse_credentials(&text, &self.profile)
            .map_err(|reason| bad(key, format!("{}: {reason}", path.display())))
    }

    /// The key prefix, ending in `/` when not empty.
    pub fn key_prefix(&self) -> String {
        match self.prefix.as_str() {
            "" => String::new(),
            p if p.ends_with('/') => p.to_owned(),
            p => format!("{p}/"),
        }
    }
}

/// S3's rules for a bucket name, in short.
fn valid_bucket(name: &str) -> bool {
    (3..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric()
}

/// Reads profile `profile` of an AWS shared credentials file. The reason never quotes the
/// file's values.
pub fn parse_credentials(text: &str, profile: &str) -> Result<Credentials, String> {
    let (mut section, mut found) = (None::<String>, false);
    let (mut id, mut secret, mut token) = (None, None, None);
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = Some(name.trim().to_owned());
            found |= name.trim() == profile;
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            return Err(format!("line {}: not KEY = VALUE nor [profile]", n + 1));
        };
        if section.as_deref() != Some(profile) {
            continue;
        }
        let v = v.trim().to_owned();
        match k.trim() {
            "aws_access_key_id" => id = Some(v),
            "aws_secret_access_key" => secret = Some(v),
            "aws_session_token" => token = Some(v),
            _ => {}
        }
    }
    if !found {
        return Err(format!("no [{profile}] profile"));
    }
    match (
        id.filter(|v| !v.is_empty()),
        secret.filter(|v| !v.is_empty()),
    ) {
        (Some(id), Some(secret)) => Ok(match token {
            Some(t) => Credentials::new_with_token(id, secret, t),
            None => Credentials::new(id, secret),
        }),
        (None, _) => Err(format!("[{profile}] has no aws_access_key_id")),
        (_, None) => Err(format!("[{profile}] has no aws_secret_access_key")),
    }
}

fn load_roots(ca_file: Option<&Path>) -> Result<rustls::RootCertStore, ObjectConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let key = "checkpoints.object.ca_file";
            let certs = nightshift_common::tls::load_certs(key, path)
                .map_err(|e| bad(key, e.to_string()))?;
            for cert in certs {
                roots.add(cert).map_err(|e| {
                    bad(
                        key,
                        format!("{}: not a CA certificate: {e}", path.display()),
                    )
                })?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
        }
    }
    Ok(roots)
}

// ---------------------------------------------------------------------------------------
// The key layout

/// The keys of jobs' checkpoints, under the configured prefix, where [`CheckpointLayout`]
/// puts them; those of one rank of a gang ([`Layout::rank`]) apart from the other ranks'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    prefix: String,
    rank: Option<u32>,
}

pub const STARTED: &str = "STARTED";
pub const MANIFEST: &str = "MANIFEST.json";

impl Layout {
    /// `prefix` ends in `/` or is empty ([`ObjectConfig::key_prefix`]).
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            rank: None,
        }
    }

    /// The keys of gang rank `rank`'s attempts (`None`: a single-node job's): each member of
    /// a gang resumes from its own rank's newest checkpoint, never another rank's, as with
    /// the other storages (`crate::job::JobDirs::for_lease`).
    pub fn rank(&self, rank: Option<u32>) -> Self {
        Self {
            prefix: self.prefix.clone(),
            rank,
        }
    }

    /// Where every attempt of `job` (of this layout's rank) keeps its checkpoint.
    pub fn job(&self, job: u64) -> String {
        CheckpointLayout::new(job, self.rank).attempts_key(&self.prefix)
    }

    /// Where the attempt of `epoch` keeps it.
    pub fn epoch(&self, job: u64, epoch: u64) -> String {
        CheckpointLayout::new(job, self.rank).attempt_key(&self.prefix, epoch)
    }

    pub fn started(&self, job: u64, epoch: u64) -> String {
        format!("{}{STARTED}", self.epoch(job, epoch))
    }

    pub fn manifest(&self, job: u64, epoch: u64) -> String {
        format!("{}{MANIFEST}", self.epoch(job, epoch))
    }

    /// The key of the file at `path` (relative, `/`-separated) of the attempt's directory.
    pub fn file(&self, job: u64, epoch: u64, path: &str) -> String {
        format!("{}files/{path}", self.epoch(job, epoch))
    }

    /// What `keys` (a listing under [`Layout::job`]) say of the epochs below `below`.
    pub fn epochs(&self, job: u64, keys: &[String], below: u64) -> Epochs {
        let root = self.job(job);
        let mut seen: std::collections::BTreeMap<u64, (bool, bool)> = Default::default();
        for key in keys {
            let Some(rest) = key.strip_prefix(&root) else {
                continue;
            };
            let Some((epoch, what)) = rest.split_once('/') else {
                continue;
            };
            let Ok(epoch) = epoch.parse::<u64>() else {
                continue;
            };
            if epoch >= below {
                continue;
            }
            let e = seen.entry(epoch).or_default();
            e.0 |= what == STARTED;
            e.1 |= what == MANIFEST;
        }
        let complete: Vec<u64> = seen
            .iter()
            .rev()
            .filter(|(_, s)| s.1)
            .map(|(e, _)| *e)
            .collect();
        let newest_complete = complete.first().copied();
        let pending = seen
            .iter()
            .rev()
            .filter(|(e, s)| s.0 && !s.1 && newest_complete.is_none_or(|c| **e > c))
            .map(|(e, _)| *e)
            .collect();
        Epochs { complete, pending }
    }
}

/// The epochs of a job below an attempt's own, as the bucket holds them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Epochs {
    /// With a manifest, newest first: restorable.
    pub complete: Vec<u64>,
    /// Newer than every complete one, started, and with no manifest yet (newest first): an
    /// upload that may still be under way, or an attempt whose agent died.
    pub pending: Vec<u64>,
}

/// The content of `STARTED`: who started the epoch, and as which attempt of the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    pub node: String,
    pub attempt: u32,
}

/// What an attempt uploaded: written last, so that its presence means complete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub job_id: u64,
    pub epoch: u64,
    /// The node that uploaded it.
    pub node: String,
    pub files: Vec<ManifestFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Relative to the attempt's directory, `/`-separated.
    pub path: String,
    pub size: u64,
}

impl Manifest {
    /// Checks that every path stays inside the directory it is restored into.
    pub fn check(&self) -> Result<(), String> {
        for f in &self.files {
            let p = Path::new(&f.path);
            let inside = !f.path.is_empty()
                && p.components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside {
                return Err(format!("manifest path {:?} leaves the directory", f.path));
            }
        }
        Ok(())
    }
}

/// The regular files under `dir` (relative, `/`-separated, sorted) with their sizes.
/// Symbolic links, pipes and sockets are left out.
pub fn files_of(dir: &Path) -> std::io::Result<Vec<ManifestFile>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<ManifestFile>) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                walk(root, &entry.path(), out)?;
            } else if kind.is_file() {
                let rel = entry.path();
                let rel = rel.strip_prefix(root).unwrap_or(&rel);
                let Some(path) = rel.to_str() else {
                    tracing::warn!(file = %rel.display(), "checkpoint file name is not UTF-8; not uploaded");
                    continue;
                };
                out.push(ManifestFile {
                    path: path.to_owned(),
                    size: entry.metadata()?.len(),
                });
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    match walk(dir, dir, &mut out) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// The client

#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    #[error("s3 {endpoint} bucket {bucket}: {what} {key}: {reason}")]
    Request {
        endpoint: String,
        bucket: String,
        what: &'static str,
        key: String,
        reason: String,
    },
    #[error("checkpoint directory {path}: {source}")]
    Local {
        path: String,
        source: std::io::Error,
    },
}

type Body = BoxBody<Bytes, std::io::Error>;

/// How long each request may take to answer (its body aside).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a presigned URL is valid: past the longest upload of one file.
const URL_VALID: Duration = Duration::from_secs(6 * 3600);
/// Tries of each request: a connection that fails or a 5xx answer is tried again.
const TRIES: u32 = 3;
/// How often a restore that waits for an upload looks again.
const WAIT_POLL: Duration = Duration::from_millis(500);

/// The bucket of `[checkpoints.object]`, with its credentials and client.
pub struct Bucket {
    bucket: rusty_s3::Bucket,
    credentials: Credentials,
    client: HttpsClient<Body>,
    layout: Layout,
    endpoint: String,
    upload_wait: Duration,
}

/// What a restore found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// The epoch whose checkpoint now fills the attempt's directory; `None`: nothing.
    pub from_epoch: Option<u64>,
    pub files: usize,
    pub bytes: u64,
    /// How long it waited for a newer attempt's upload.
    pub waited: Duration,
}

/// Maps an I/O error at `path` on the host to [`BucketError::Local`], naming the path.
fn local(path: &Path) -> impl FnOnce(std::io::Error) -> BucketError {
    let path = path.display().to_string();
    move |source| BucketError::Local { path, source }
}

impl Bucket {
    pub fn new(cfg: &ObjectConfig) -> Result<Self, ObjectConfigError> {
        cfg.check()?;
        let endpoint = cfg.endpoint_url()?;
        let style = if cfg.path_style {
            UrlStyle::Path
        } else {
            UrlStyle::VirtualHost
        };
        let bucket = rusty_s3::Bucket::new(endpoint, style, cfg.bucket.clone(), cfg.region.clone())
            .map_err(|e| bad("checkpoints.object.endpoint", e))?;
        let roots = load_roots(cfg.ca_file.as_deref())?;
        let tls = rustls::ClientConfig::builder_with_provider(nightshift_common::tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("checkpoints.object.endpoint", e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            bucket,
            credentials: cfg.credentials()?,
            client: nightshift_common::net::https_client(tls, Duration::from_secs(5)),
            layout: Layout::new(&cfg.key_prefix()),
            endpoint: cfg.endpoint.clone(),
            upload_wait: Duration::from_secs_f64(cfg.upload_wait_s),
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn error(&self, what: &'static str, key: &str, reason: impl ToString) -> BucketError {
        BucketError::Request {
            endpoint: self.endpoint.clone(),
            bucket: self.bucket.name().to_owned(),
            what,
            key: key.to_owned(),
            reason: reason.to_string(),
        }
    }

    /// Sends a request built by `make` (called once per try), answering the response when
    /// its status is a success, `None` on 404.
    async fn send(
        &self,
        what: &'static str,
        key: &str,
        make: impl Fn() -> Result<Request<Body>, BucketError>,
    ) -> Result<Option<hyper::Response<hyper::body::Incoming>>, BucketError> {
        let mut last = String::new();
        for attempt in 0..TRIES {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
            }
            let req = make()?;
            match tokio::time::timeout(ANSWER_TIMEOUT, self.client.request(req)).await {
                Err(_) => last = format!("no answer within {ANSWER_TIMEOUT:?}"),
                Ok(Err(e)) => last = format!("{e}"),
                Ok(Ok(resp)) if resp.status().is_success() => return Ok(Some(resp)),
                Ok(Ok(resp)) if resp.status() == StatusCode::NOT_FOUND => return Ok(None),
                Ok(Ok(resp)) => {
                    let status = resp.status();
                    let body = resp.into_body().collect().await.map(|b| b.to_bytes());
                    let text = body
                        .map(|b| String::from_utf8_lossy(&b[..b.len().min(300)]).into_owned())
                        .unwrap_or_default();
                    last = format!("{status}: {}", s3_error(&text));
                    if !status.is_server_error() {
                        break;
                    }
                }
            }
        }
        Err(self.error(what, key, last))
    }

    fn request(method: hyper::Method, url: url::Url, body: Body) -> Request<Body> {
        let mut req = Request::new(body);
        *req.method_mut() = method;
        // A URL from `rusty_s3` always parses as a URI.
        *req.uri_mut() = url.as_str().parse().unwrap_or_default();
        req
    }

    fn empty() -> Body {
        Empty::<Bytes>::new()
            .map_err(|never| match never {})
            .boxed()
    }

    /// Writes `bytes` at `key`.
    pub async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<(), BucketError> {
        let bytes = Bytes::from(bytes);
        self.send("put", key, || {
            let url = self
                .bucket
                .put_object(Some(&self.credentials), key)
                .sign(URL_VALID);
            let body = http_body_util::Full::new(bytes.clone())
                .map_err(|never| match never {})
                .boxed();
            let mut req = Self::request(hyper::Method::PUT, url, body);
            req.headers_mut()
                .insert(hyper::header::CONTENT_LENGTH, bytes.len().into());
            Ok(req)
        })
        .await?;
        Ok(())
    }

    /// Streams the file at `path` to `key`.
    async fn put_file(&self, key: &str, path: &Path) -> Result<u64, BucketError> {
        let local = |source| BucketError::Local {
            path: path.display().to_string(),
            source,
        };
        let size = tokio::fs::metadata(path).await.map_err(local)?.len();
        self.send("put", key, || {
            let file = tokio::fs::File::from_std(std::fs::File::open(path).map_err(local)?);
            let stream = tokio_util::io::ReaderStream::new(file).map_ok(Frame::data);
            let url = self
                .bucket
                .put_object(Some(&self.credentials), key)
                .sign(URL_VALID);
            let mut req = Self::request(
                hyper::Method::PUT,
                url,
                BodyExt::boxed(StreamBody::new(stream)),
            );
            req.headers_mut()
                .insert(hyper::header::CONTENT_LENGTH, size.into());
            Ok(req)
        })
        .await?;
        Ok(size)
    }

    /// The object at `key`, `None` when there is none.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, BucketError> {
        let resp = self
            .send("get", key, || {
                let url = self
                    .bucket
                    .get_object(Some(&self.credentials), key)
                    .sign(URL_VALID);
                Ok(Self::request(hyper::Method::GET, url, Self::empty()))
            })
            .await?;
        let Some(resp) = resp else {
            return Ok(None);
        };
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| self.error("get", key, e))?;
        Ok(Some(body.to_bytes().to_vec()))
    }

    /// Streams the object at `key` into a new file at `path`; its size.
    async fn get_file(&self, key: &str, path: &Path) -> Result<u64, BucketError> {
        let local = |source| BucketError::Local {
            path: path.display().to_string(),
            source,
        };
        let resp = self
            .send("get", key, || {
                let url = self
                    .bucket
                    .get_object(Some(&self.credentials), key)
                    .sign(URL_VALID);
                Ok(Self::request(hyper::Method::GET, url, Self::empty()))
            })
            .await?
            .ok_or_else(|| self.error("get", key, "listed in the manifest but not there"))?;
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent).await.map_err(local)?;
        }
        let mut file = tokio::fs::File::create(path).await.map_err(local)?;
        let mut body = resp.into_body();
        let mut size = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| self.error("get", key, e))?;
            if let Ok(data) = frame.into_data() {
                size += data.len() as u64;
                file.write_all(&data).await.map_err(local)?;
            }
        }
        file.flush().await.map_err(local)?;
        Ok(size)
    }

    /// Every key under `prefix`.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, BucketError> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let resp = self
                .send("list", prefix, || {
                    let mut action = self.bucket.list_objects_v2(Some(&self.credentials));
                    action.with_prefix(prefix);
                    if let Some(t) = &token {
                        action.with_continuation_token(t.clone());
                    }
                    Ok(Self::request(
                        hyper::Method::GET,
                        action.sign(URL_VALID),
                        Self::empty(),
                    ))
                })
                .await?
                .ok_or_else(|| self.error("list", prefix, "no such bucket"))?;
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| self.error("list", prefix, e))?
                .to_bytes();
            let text = String::from_utf8_lossy(&body);
            let page = rusty_s3::actions::ListObjectsV2::parse_response(&text)
                .map_err(|e| self.error("list", prefix, format!("unreadable answer: {e}")))?;
            keys.extend(page.contents.into_iter().map(|c| c.key));
            match page.next_continuation_token {
                Some(t) => token = Some(t),
                None => return Ok(keys),
            }
        }
    }

    /// Fills `dir` (which must not exist) with the newest complete checkpoint of `job` (of
    /// gang rank `rank`) below `epoch`, waiting up to `upload_wait` for a newer attempt's
    /// upload, then marks the attempt of `epoch` started. Files go to `dir` with `.partial` appended first and
    /// are renamed into place, so a restore cut short leaves nothing to start from.
    pub async fn restore(
        &self,
        job: u64,
        rank: Option<u32>,
        epoch: u64,
        attempt: u32,
        node: &str,
        dir: &Path,
    ) -> Result<Restored, BucketError> {
        let layout = self.layout.rank(rank);
        let began = tokio::time::Instant::now();
        let mut logged = false;
        // Epochs started by this same attempt (a gang's other members): never waited for.
        let mut same_attempt = std::collections::BTreeSet::new();
        let epochs = loop {
            let keys = self.list(&layout.job(job)).await?;
            let mut epochs = layout.epochs(job, &keys, epoch);
            for e in epochs.pending.clone() {
                if same_attempt.contains(&e) {
                    continue;
                }
                let started = self.get(&layout.started(job, e)).await?;
                let theirs = started.and_then(|b| serde_json::from_slice::<Started>(&b).ok());
                if theirs.is_some_and(|s| s.attempt >= attempt) {
                    same_attempt.insert(e);
                }
            }
            epochs.pending.retain(|e| !same_attempt.contains(e));
            if epochs.pending.is_empty() || began.elapsed() >= self.upload_wait {
                if !epochs.pending.is_empty() {
                    tracing::warn!(
                        job.id = job, lease.epoch = epoch, pending = ?epochs.pending,
                        complete = ?epochs.complete, waited_s = began.elapsed().as_secs_f64(),
                        "a newer attempt's checkpoint upload did not finish in time; restoring the newest complete one"
                    );
                }
                break epochs;
            }
            if !logged {
                tracing::info!(
                    job.id = job, lease.epoch = epoch, pending = ?epochs.pending,
                    "waiting for a newer attempt's checkpoint upload before restoring"
                );
                logged = true;
            }
            tokio::time::sleep(WAIT_POLL).await;
        };
        let waited = began.elapsed();
        let partial = dir.with_extension("partial");
        if tokio::fs::try_exists(&partial).await.unwrap_or(false) {
            tokio::fs::remove_dir_all(&partial)
                .await
                .map_err(local(&partial))?;
        }
        let mut restored = Restored {
            from_epoch: None,
            files: 0,
            bytes: 0,
            waited,
        };
        for from in epochs.complete {
            let key = layout.manifest(job, from);
            let Some(bytes) = self.get(&key).await? else {
                continue;
            };
            let manifest: Manifest = serde_json::from_slice(&bytes)
                .map_err(|e| self.error("get", &key, format!("unreadable manifest: {e}")))?;
            manifest.check().map_err(|e| self.error("get", &key, e))?;
            if manifest.files.is_empty() {
                // That attempt saved nothing: an older one may have.
                continue;
            }
            tokio::fs::create_dir_all(&partial)
                .await
                .map_err(local(&partial))?;
            for f in &manifest.files {
                let size = self
                    .get_file(&layout.file(job, from, &f.path), &partial.join(&f.path))
                    .await?;
                if size != f.size {
                    return Err(self.error(
                        "get",
                        &layout.file(job, from, &f.path),
                        format!("{size} bytes where the manifest says {}", f.size),
                    ));
                }
                restored.files += 1;
                restored.bytes += size;
            }
            restored.from_epoch = Some(from);
            break;
        }
        if restored.from_epoch.is_some() {
            tokio::fs::rename(&partial, dir).await.map_err(local(dir))?;
        } else {
            tokio::fs::create_dir_all(dir).await.map_err(local(dir))?;
        }
        let started = Started {
            node: node.to_owned(),
            attempt,
        };
        self.put(
            &layout.started(job, epoch),
            serde_json::to_vec(&started).unwrap_or_default(),
        )
        .await?;
        Ok(restored)
    }

    /// Uploads what the attempt of `epoch` left in `dir`, under its own epoch, the manifest
    /// last; the manifest. An epoch is uploaded once: when its manifest is there already
    /// (an agent restarted after the upload, whose local copy is gone), it is left as it is.
    pub async fn upload(
        &self,
        job: u64,
        rank: Option<u32>,
        epoch: u64,
        node: &str,
        dir: &Path,
    ) -> Result<Manifest, BucketError> {
        let layout = self.layout.rank(rank);
        let key = layout.manifest(job, epoch);
        if let Some(bytes) = self.get(&key).await? {
            return serde_json::from_slice(&bytes)
                .map_err(|e| self.error("get", &key, format!("unreadable manifest: {e}")));
        }
        let owned = dir.to_owned();
        let files = tokio::task::spawn_blocking(move || files_of(&owned))
            .await
            .map_err(|e| BucketError::Local {
                path: dir.display().to_string(),
                source: std::io::Error::other(e),
            })?
            .map_err(|source| BucketError::Local {
                path: dir.display().to_string(),
                source,
            })?;
        let mut uploaded = Vec::with_capacity(files.len());
        for f in files {
            let size = self
                .put_file(&layout.file(job, epoch, &f.path), &dir.join(&f.path))
                .await?;
            uploaded.push(ManifestFile { path: f.path, size });
        }
        let manifest = Manifest {
            job_id: job,
            epoch,
            node: node.to_owned(),
            files: uploaded,
        };
        let bytes = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
        self.put(&layout.manifest(job, epoch), bytes).await?;
        Ok(manifest)
    }

    /// Restores into `dir`, the directory of an attempt no container has used yet: any
    /// leftover of an earlier try removed first, its parent made, the newest complete
    /// checkpoint below `epoch` written in ([`Bucket::restore`]) and the directory opened to
    /// the job's group.
    pub async fn restore_fresh(
        &self,
        job: u64,
        rank: Option<u32>,
        epoch: u64,
        attempt: u32,
        node: &str,
        dir: &Path,
    ) -> Result<Restored, BucketError> {
        if tokio::fs::try_exists(dir).await.unwrap_or(false) {
            tokio::fs::remove_dir_all(dir).await.map_err(local(dir))?;
        }
        if let Some(parent) = dir.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(local(parent))?;
        }
        let restored = self.restore(job, rank, epoch, attempt, node, dir).await?;
        crate::job::open_to_group(dir).map_err(local(dir))?;
        Ok(restored)
    }

    /// Uploads `dir` ([`Bucket::upload`]), the whole upload tried again on the planner's
    /// schedule ([`nightshift_planner::upload_retry`]: the bucket may be back), then removes
    /// `dir` from the host: the bucket holds it, and a later attempt, here or elsewhere,
    /// restores from there. The manifest and the tries it took, or the last error and the
    /// tries; a directory that could not be uploaded stays.
    pub async fn upload_retrying(
        &self,
        job: u64,
        rank: Option<u32>,
        epoch: u64,
        node: &str,
        dir: &Path,
    ) -> Result<(Manifest, u32), (BucketError, u32)> {
        let mut tries = 0;
        let manifest = loop {
            tries += 1;
            match self.upload(job, rank, epoch, node, dir).await {
                Ok(manifest) => break manifest,
                Err(e) => match nightshift_planner::upload_retry(tries) {
                    Some(wait) => {
                        tracing::warn!(
                            node, job.id = job, lease.epoch = epoch, error = %e,
                            retry_in_s = wait.as_secs(), "checkpoint upload failed; trying again"
                        );
                        tokio::time::sleep(wait).await;
                    }
                    None => return Err((e, tries)),
                },
            }
        };
        if let Err(e) = tokio::fs::remove_dir_all(dir).await
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(
                node, dir = %dir.display(), error = %e,
                "removing an uploaded checkpoint directory failed"
            );
        }
        Ok((manifest, tries))
    }
}

/// `<Code>` and `<Message>` of an S3 error body, else the start of the body.
fn s3_error(body: &str) -> String {
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let start = body.find(&open)? + open.len();
        let end = body[start..].find('<')? + start;
        Some(body[start..end].to_owned())
    };
    match (tag("Code"), tag("Message")) {
        (Some(code), Some(msg)) => format!("{code}: {msg}"),
        (Some(code), None) => code,
        _ => body.chars().take(200).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> Vec<String> {
        list.iter().map(|k| (*k).to_owned()).collect()
    }

    #[test]
    fn keys_name_the_job_and_the_epoch_and_sort_by_epoch() {
        let l = Layout::new("team/");
        assert_eq!(l.job(7), "team/jobs/7/checkpoints/");
        assert_eq!(
            l.manifest(7, 42),
            "team/jobs/7/checkpoints/00000000000000000042/MANIFEST.json"
        );
        assert_eq!(
            l.file(7, 42, "sub/step-1.ckpt"),
            "team/jobs/7/checkpoints/00000000000000000042/files/sub/step-1.ckpt"
        );
        assert!(
            l.epoch(7, 9) < l.epoch(7, 10),
            "lexical order is epoch order"
        );
        let r1 = l.rank(Some(1));
        assert_eq!(
            r1.manifest(7, 42),
            "team/jobs/7/checkpoints/rank-1/00000000000000000042/MANIFEST.json"
        );
        // A single-node listing never mistakes a rank's keys for its epochs, nor a rank
        // another's.
        let keys = vec![r1.manifest(7, 42), l.rank(Some(0)).manifest(7, 40)];
        assert_eq!(l.epochs(7, &keys, 100), Epochs::default());
        assert_eq!(r1.epochs(7, &keys, 100).complete, vec![42]);
        assert_eq!(
            Layout::new("").started(1, 2),
            "jobs/1/checkpoints/00000000000000000002/STARTED"
        );
        let cfg = |p: &str| ObjectConfig {
            prefix: p.into(),
            ..ObjectConfig::default()
        };
        assert_eq!(cfg("team").key_prefix(), "team/");
        assert_eq!(cfg("team/").key_prefix(), "team/");
        assert_eq!(cfg("").key_prefix(), "");
    }

    #[test]
    fn the_newest_complete_epoch_below_the_attempt_is_restored_and_newer_started_ones_waited_for() {
        let l = Layout::new("");
        let listing = keys(&[
            // 3: complete.
            "jobs/1/checkpoints/00000000000000000003/STARTED",
            "jobs/1/checkpoints/00000000000000000003/files/a",
            "jobs/1/checkpoints/00000000000000000003/MANIFEST.json",
            // 5: started, half uploaded (no manifest): never restored.
            "jobs/1/checkpoints/00000000000000000005/STARTED",
            "jobs/1/checkpoints/00000000000000000005/files/a",
            // 8: complete.
            "jobs/1/checkpoints/00000000000000000008/STARTED",
            "jobs/1/checkpoints/00000000000000000008/MANIFEST.json",
            // 9: started, uploading.
            "jobs/1/checkpoints/00000000000000000009/STARTED",
            // 12: the attempt itself and above: not its to read.
            "jobs/1/checkpoints/00000000000000000012/MANIFEST.json",
            "jobs/1/checkpoints/00000000000000000013/MANIFEST.json",
            // Another job, and a key that is none of the layout's.
            "jobs/2/checkpoints/00000000000000000011/MANIFEST.json",
            "jobs/1/checkpoints/junk",
        ]);
        let e = l.epochs(1, &listing, 12);
        assert_eq!(e.complete, vec![8, 3]);
        assert_eq!(
            e.pending,
            vec![9],
            "5 is older than the complete 8: not waited for"
        );
        // Once 9's manifest is there, nothing is pending and 9 is the newest.
        let mut later = listing.clone();
        later.push("jobs/1/checkpoints/00000000000000000009/MANIFEST.json".into());
        let e = l.epochs(1, &later, 12);
        assert_eq!((e.complete[0], e.pending.len()), (9, 0));
        // A late upload of an older epoch never outranks a newer complete one.
        let e = l.epochs(1, &later, 12);
        assert!(e.complete.iter().all(|c| *c <= 9));
        assert_eq!(l.epochs(1, &[], 12), Epochs::default());
        assert_eq!(l.epochs(1, &listing, 3).complete, Vec::<u64>::new());
    }

    #[test]
    fn a_manifest_cannot_reach_outside_the_directory() {
        let m = |path: &str| Manifest {
            job_id: 1,
            epoch: 2,
            node: "n".into(),
            files: vec![ManifestFile {
                path: path.into(),
                size: 1,
            }],
        };
        assert!(m("a/b.ckpt").check().is_ok());
        for bad in ["../x", "/etc/passwd", "a/../../x", ""] {
            assert!(m(bad).check().is_err(), "{bad}");
        }
    }

    #[test]
    fn files_are_listed_relative_and_sorted_without_links() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/b"), "bb").unwrap();
        std::fs::write(dir.path().join("a"), "a").unwrap();
        std::os::unix::fs::symlink("a", dir.path().join("link")).unwrap();
        let files = files_of(dir.path()).unwrap();
        let got: Vec<(&str, u64)> = files.iter().map(|f| (f.path.as_str(), f.size)).collect();
        assert_eq!(got, vec![("a", 1), ("sub/b", 2)]);
        assert!(files_of(&dir.path().join("missing")).unwrap().is_empty());
    }

    #[test]
    fn credentials_come_from_the_named_profile_and_errors_never_quote_them() {
        let text = "# comment\n[default]\naws_access_key_id = AKID\naws_secret_access_key = s3cr3t\n\
                    [other]\naws_access_key_id=B\naws_secret_access_key=C\naws_session_token=T\n";
        let c = parse_credentials(text, "default").unwrap();
        assert_eq!((c.key(), c.secret(), c.token()), ("AKID", "s3cr3t", None));
        let c = parse_credentials(text, "other").unwrap();
        assert_eq!((c.key(), c.token()), ("B", Some("T")));
        assert_eq!(
            parse_credentials(text, "missing").unwrap_err(),
            "no [missing] profile"
        );
        let e = parse_credentials("[default]\naws_access_key_id = AKID\n", "default").unwrap_err();
        assert_eq!(e, "[default] has no aws_secret_access_key");
        let e = parse_credentials("[default]\ns3cr3t\n", "default").unwrap_err();
        assert!(!e.contains("s3cr3t"), "{e}");
    }

    #[test]
    fn bucket_names_and_s3_errors() {
        assert!(valid_bucket("nightshift-ckpt"));
        for name in ["ab", "Upper", "-lead", "trail-", "a_b"] {
            assert!(!valid_bucket(name), "{name}");
        }
        assert_eq!(
            s3_error("<Error><Code>NoSuchBucket</Code><Message>gone</Message></Error>"),
            "NoSuchBucket: gone"
        );
    }
}
