//! The HTTP transport the agent, the CLI and the coordinator share (one copy, not three):
//!
//! - behind the `client` feature, the client: hyper over rustls on ring, HTTP/1, `http://`
//!   and `https://` URLs, a connect timeout ([`https_client`]); a trust store of no one for
//!   plain HTTP ([`trust_nobody`]); and the failover among coordinators sharing a PostgreSQL
//!   database, of which one leads and the others answer 503 ([`Failover`]);
//! - behind the `server` feature, the TLS accept loop of an axum router ([`serve_tls`]), which
//!   hands each request what the connection's client certificate says about its peer.

#[cfg(feature = "client")]
pub use client::*;
#[cfg(feature = "server")]
pub use server::*;

#[cfg(feature = "client")]
mod client {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use hyper_rustls::HttpsConnector;
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;

    /// A pooled HTTP client for `http://` and `https://` URLs, with request bodies of type `B`.
    pub type HttpsClient<B> = Client<HttpsConnector<HttpConnector>, B>;

    /// A client whose TCP connections are made within `connect` and whose TLS is as `config`
    /// says (whom it trusts, what certificate it presents).
    pub fn https_client<B>(config: rustls::ClientConfig, connect: Duration) -> HttpsClient<B>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
    {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(connect));
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Client::builder(TokioExecutor::new()).build(connector)
    }

    /// A TLS configuration that trusts no certificate and presents none: a client for plain
    /// `http://` only, which never trusts an `https://` peer.
    pub fn trust_nobody() -> Result<rustls::ClientConfig, rustls::Error> {
        Ok(
            rustls::ClientConfig::builder_with_provider(crate::tls::provider())
                .with_safe_default_protocol_versions()?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
        )
    }

    /// The coordinators' URLs in a `coordinator` setting (agent.toml, `--coordinator`,
    /// `NIGHTSHIFT_URL`): one, or several separated by commas.
    pub fn coordinator_urls(coordinator: &str) -> Vec<&str> {
        coordinator
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect()
    }

    /// Several coordinators, of which one is asked first: the last that answered. Cheap to
    /// clone; clones share which one that is, so that a whole program follows the leader
    /// once any of its calls found it.
    #[derive(Debug)]
    pub struct Failover<T> {
        peers: Arc<[T]>,
        first: Arc<AtomicUsize>,
    }

    impl<T> Clone for Failover<T> {
        fn clone(&self) -> Self {
            Self {
                peers: self.peers.clone(),
                first: self.first.clone(),
            }
        }
    }

    impl<T: std::fmt::Display> Failover<T> {
        /// `None` when `peers` is empty.
        pub fn new(peers: Vec<T>) -> Option<Self> {
            (!peers.is_empty()).then(|| Self {
                peers: peers.into(),
                first: Default::default(),
            })
        }

        /// The peer asked first now.
        pub fn first(&self) -> &T {
            &self.peers[self.first.load(Ordering::Relaxed) % self.peers.len()]
        }

        /// Calls `call` on the peer asked first and, while its outcome `fails_over` (the
        /// peer unreachable, or a standby's 503), on the next ones in turn; the peer whose
        /// outcome does not fail over is asked first from then on. When every outcome fails
        /// over, the first that `informs` (an answer, such as a standby's naming the leader,
        /// says more than a refused connection) is returned, or else the last.
        pub async fn call<'a, R, F, Fut>(
            &'a self,
            mut call: F,
            fails_over: impl Fn(&R) -> bool,
            informs: impl Fn(&R) -> bool,
        ) -> R
        where
            F: FnMut(&'a T) -> Fut,
            Fut: Future<Output = R>,
        {
            let n = self.peers.len();
            let start = self.first.load(Ordering::Relaxed) % n;
            let mut kept: Option<R> = None;
            for i in 0..n {
                let at = (start + i) % n;
                let outcome = call(&self.peers[at]).await;
                if n > 1 && fails_over(&outcome) {
                    if kept.as_ref().is_none_or(|k| !informs(k)) {
                        kept = Some(outcome);
                    }
                    continue;
                }
                if i > 0 {
                    self.first.store(at, Ordering::Relaxed);
                    tracing::info!(coordinator = %self.peers[at], "following the coordinator that answers");
                }
                return outcome;
            }
            kept.expect("one peer at least")
        }
    }

    /// A short cause for a failed connection or exchange: the innermost error, in plain words
    /// where the OS error has a well-known meaning ("connection refused" rather than "os
    /// error 111").
    pub fn describe_transport(err: &(dyn std::error::Error + 'static)) -> String {
        let mut innermost: &dyn std::error::Error = err;
        let mut io_kind = None;
        while let Some(next) = innermost.source() {
            if let Some(io) = next.downcast_ref::<std::io::Error>() {
                io_kind = Some(io.kind());
            }
            innermost = next;
        }
        match io_kind {
            Some(std::io::ErrorKind::ConnectionRefused) => "connection refused".to_owned(),
            Some(std::io::ErrorKind::ConnectionReset) => "connection reset".to_owned(),
            Some(std::io::ErrorKind::ConnectionAborted) => "connection aborted".to_owned(),
            Some(std::io::ErrorKind::HostUnreachable) => "host unreachable".to_owned(),
            Some(std::io::ErrorKind::NetworkUnreachable) => "network unreachable".to_owned(),
            _ => innermost.to_string(),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn failover(peers: &[&'static str]) -> Failover<&'static str> {
            Failover::new(peers.to_vec()).expect("peers")
        }

        /// Outcomes: `Ok(peer)` answers, `Err(true)` a standby's 503, `Err(false)` unreachable.
        async fn ask(
            f: &Failover<&'static str>,
            up: &[&str],
            standby: &[&str],
        ) -> Result<String, bool> {
            f.call(
                |peer| {
                    let outcome = if up.contains(peer) {
                        Ok(peer.to_string())
                    } else {
                        Err(standby.contains(peer))
                    };
                    std::future::ready(outcome)
                },
                Result::is_err,
                |r| matches!(r, Err(true)),
            )
            .await
        }

        #[tokio::test]
        async fn the_peer_that_answers_is_asked_first_from_then_on() {
            let f = failover(&["a", "b", "c"]);
            assert_eq!(ask(&f, &["c"], &["a"]).await, Ok("c".into()));
            assert_eq!(*f.first(), "c");
            // A clone follows too.
            assert_eq!(*f.clone().first(), "c");
            assert_eq!(ask(&f, &["a"], &[]).await, Ok("a".into()));
            assert_eq!(*f.first(), "a");
        }

        #[tokio::test]
        async fn when_none_answers_a_standbys_answer_is_kept_over_a_refusal() {
            let f = failover(&["a", "b", "c"]);
            assert_eq!(ask(&f, &[], &["b"]).await, Err(true));
            assert_eq!(ask(&f, &[], &[]).await, Err(false));
            assert_eq!(*f.first(), "a", "nothing answered: the first stays first");
        }

        #[tokio::test]
        async fn one_peer_is_asked_once_whatever_it_answers() {
            let f = failover(&["a"]);
            let mut asked = 0;
            let outcome: Result<(), bool> = f
                .call(
                    |_| {
                        asked += 1;
                        std::future::ready(Err(false))
                    },
                    Result::is_err,
                    |_| false,
                )
                .await;
            assert_eq!((outcome, asked), (Err(false), 1));
        }

        #[test]
        fn coordinator_urls_split_on_commas_and_drop_blanks() {
            assert_eq!(
                coordinator_urls(" http://a:7400 ,,http://b:7400,"),
                ["http://a:7400", "http://b:7400"]
            );
            assert!(Failover::<&str>::new(coordinator_urls(" , ")).is_none());
        }
    }
}

#[cfg(feature = "server")]
mod server {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::Duration;

    use hyper_util::rt::TokioIo;
    use hyper_util::service::TowerToHyperService;
    use rustls::pki_types::CertificateDer;
    use tokio::net::TcpListener;
    use tokio_rustls::TlsAcceptor;

    /// Longest a TLS handshake may take before the connection is dropped.
    pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

    /// Serves `app` over TLS on `listener` until `shutdown` completes. Each connection's
    /// requests carry two extensions: `ConnectInfo<SocketAddr>` (the peer's address) and what
    /// `peer` makes of the client certificate chain the handshake verified (`None` without
    /// one). A handshake that fails or takes longer than [`HANDSHAKE_TIMEOUT`] ends the
    /// connection, logged as `what`'s.
    pub async fn serve_tls<P, X>(
        what: &'static str,
        listener: TcpListener,
        app: axum::Router,
        config: Arc<rustls::ServerConfig>,
        peer: P,
        shutdown: impl Future<Output = ()> + Send,
    ) where
        P: Fn(Option<&[CertificateDer<'static>]>) -> X + Clone + Send + 'static,
        X: Clone + Send + Sync + 'static,
    {
        let acceptor = TlsAcceptor::from(config);
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let (tcp, addr): (_, SocketAddr) = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "{what}: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let (acceptor, app, peer) = (acceptor.clone(), app.clone(), peer.clone());
            tokio::spawn(async move {
                let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        tracing::info!(peer = %addr, error = %e, "{what}: tls handshake refused");
                        return;
                    }
                    Err(_) => {
                        tracing::info!(peer = %addr, "{what}: tls handshake timed out");
                        return;
                    }
                };
                let who = peer(tls.get_ref().1.peer_certificates());
                let app = app
                    .layer(axum::Extension(who))
                    .layer(axum::Extension(axum::extract::ConnectInfo(addr)));
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app))
                    .await
                {
                    tracing::debug!(peer = %addr, error = %e, "{what}: connection ended with an error");
                }
            });
        }
    }
}
