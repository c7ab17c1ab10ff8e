//! The agent's side of the agent protocol: register, heartbeat, and the long-poll for the
//! node's desired state.

use std::time::Duration;

use nightshift_common::{ApiError, DesiredNode, Heartbeat, RegisterReply, RegisterRequest};
use reqwest::StatusCode;

/// How long a long-poll waits on the coordinator before it answers unchanged.
pub const LONG_POLL: Duration = Duration::from_secs(25);

#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    #[error("coordinator at {url} unreachable: {source}")]
    Unreachable { url: String, source: reqwest::Error },
    #[error("coordinator does not know node {0}; registering again")]
    UnknownNode(String),
    #[error("coordinator refused: {status}: {error}")]
    Refused { status: StatusCode, error: String },
}

#[derive(Clone)]
pub struct Uplink {
    base: String,
    node: String,
    client: reqwest::Client,
}

impl Uplink {
    pub fn new(base: &str, node: &str) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .timeout(LONG_POLL + Duration::from_secs(10))
            .build()?;
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            node: node.to_owned(),
            client,
        })
    }

    pub async fn register(&self, req: &RegisterRequest) -> Result<RegisterReply, UplinkError> {
        let url = format!("{}/v1/agents/register", self.base);
        self.send(
            self.client
                .post(&url)
                .json(req)
                .timeout(Duration::from_secs(10)),
            &url,
        )
        .await
    }

    pub async fn heartbeat(&self, beat: &Heartbeat) -> Result<DesiredNode, UplinkError> {
        let url = format!("{}/v1/agents/{}/heartbeat", self.base, self.node);
        self.send(
            self.client
                .post(&url)
                .json(beat)
                .timeout(Duration::from_secs(10)),
            &url,
        )
        .await
    }

    /// Answers as soon as the desired version moves past `after`, or after [`LONG_POLL`].
    pub async fn desired(&self, after: u64) -> Result<DesiredNode, UplinkError> {
        let url = format!(
            "{}/v1/agents/{}/desired?after={after}&wait_ms={}",
            self.base,
            self.node,
            LONG_POLL.as_millis()
        );
        self.send(self.client.get(&url), &url).await
    }

    async fn send<T: serde::de::DeserializeOwned>(
        &self,
        req: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<T, UplinkError> {
        let unreachable = |source| UplinkError::Unreachable {
            url: url.to_owned(),
            source,
        };
        let resp = req.send().await.map_err(unreachable)?;
        let status = resp.status();
        if status.is_success() {
            return resp.json().await.map_err(unreachable);
        }
        let error = resp
            .json::<ApiError>()
            .await
            .map_or_else(|e| format!("unreadable error body: {e}"), |e| e.error);
        if status == StatusCode::NOT_FOUND && error.contains("not registered") {
            return Err(UplinkError::UnknownNode(self.node.clone()));
        }
        Err(UplinkError::Refused { status, error })
    }
}
