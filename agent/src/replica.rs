//! The vLLM replica's container: its spec from the configured template, and where it
//! answers. On the `bridge` network Docker publishes its port; on the `host` network the port
//! is the host's own, so that while vLLM loads it refuses connections rather than having
//! Docker's proxy accept and reset them (see docs/LOAD_BALANCER.md).

use std::collections::BTreeMap;

use nightshift_common::labels;

use crate::config::{AgentConfig, ReplicaNetwork};
use crate::engine::{Container, ContainerSpec, GpuAccess, PortPublish};

pub fn container_spec(cfg: &AgentConfig, node: &str, gpus: GpuAccess) -> ContainerSpec {
    let r = &cfg.replica;
    let env = r
        .env
        .iter()
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    ContainerSpec {
        name: cfg.replica_name(node),
        image: r.image.clone(),
        entrypoint: Vec::new(),
        args: r.args.clone(),
        env,
        labels: BTreeMap::from([
            (labels::MANAGED_BY.to_owned(), node.to_owned()),
            (labels::ROLE.to_owned(), labels::ROLE_REPLICA.to_owned()),
            (labels::SERVICE.to_owned(), cfg.service.clone()),
        ]),
        gpus,
        binds: Vec::new(),
        publish: (r.network == ReplicaNetwork::Bridge).then(|| PortPublish {
            container_port: r.port,
            host_ip: r.host_ip.clone(),
            host_port: r.host_port,
        }),
        files: Vec::new(),
        groups: Vec::new(),
        stop_signal: Some("SIGTERM".to_owned()),
        sandbox: nightshift_common::Sandbox {
            host_network: r.network == ReplicaNetwork::Host,
            ..Default::default()
        },
    }
}

/// The base URL of a running replica container, e.g. `http://127.0.0.1:32768`.
pub fn url(cfg: &AgentConfig, c: &Container) -> Option<String> {
    let port = match cfg.replica.network {
        ReplicaNetwork::Host => cfg.replica.port,
        ReplicaNetwork::Bridge => c
            .published_port
            .or((cfg.replica.host_port != 0).then_some(cfg.replica.host_port))?,
    };
    let host = match cfg.replica.host_ip.as_str() {
        "" | "0.0.0.0" => "127.0.0.1",
        "::" => "[::1]",
        ip => ip,
    };
    Some(format!("http://{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ContainerState;

    fn running(published_port: Option<u16>) -> Container {
        Container {
            id: "c1".into(),
            name: "nightshift-replica-n1".into(),
            image: "v:1".into(),
            image_id: None,
            labels: BTreeMap::new(),
            state: ContainerState::Running,
            published_port,
        }
    }

    #[test]
    fn bridge_publishes_the_port_and_answers_where_docker_bound_it() {
        let mut cfg = AgentConfig::default();
        cfg.replica.host_ip = "127.0.0.1".into();
        cfg.replica.host_port = 0;
        let spec = container_spec(&cfg, "n1", GpuAccess::None);
        assert!(!spec.sandbox.host_network);
        assert_eq!(
            spec.publish.map(|p| (p.container_port, p.host_port)),
            Some((8000, 0))
        );
        assert_eq!(
            url(&cfg, &running(Some(49153))).as_deref(),
            Some("http://127.0.0.1:49153")
        );
        assert_eq!(url(&cfg, &running(None)), None, "not bound yet");
    }

    #[test]
    fn host_network_publishes_nothing_and_answers_on_its_own_port() {
        let mut cfg = AgentConfig::default();
        cfg.replica.network = ReplicaNetwork::Host;
        cfg.replica.port = 8001;
        let spec = container_spec(&cfg, "n1", GpuAccess::None);
        assert!(spec.sandbox.host_network);
        assert_eq!(spec.publish, None);
        // Docker reports no published port on the host's network.
        assert_eq!(
            url(&cfg, &running(None)).as_deref(),
            Some("http://127.0.0.1:8001")
        );
        cfg.replica.host_ip = "10.0.0.11".into();
        assert_eq!(
            url(&cfg, &running(None)).as_deref(),
            Some("http://10.0.0.11:8001")
        );
    }
}
