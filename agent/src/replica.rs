//! The vLLM replica's container: its spec from the configured template, and where it
//! answers.

use std::collections::BTreeMap;

use nightshift_common::labels;

use crate::config::AgentConfig;
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
        publish: Some(PortPublish {
            container_port: r.port,
            host_ip: r.host_ip.clone(),
            host_port: r.host_port,
        }),
        files: Vec::new(),
        groups: Vec::new(),
        stop_signal: Some("SIGTERM".to_owned()),
        sandbox: Default::default(),
    }
}

/// The base URL of a running replica container, e.g. `http://127.0.0.1:32768`.
pub fn url(cfg: &AgentConfig, c: &Container) -> Option<String> {
    let port = c
        .published_port
        .or((cfg.replica.host_port != 0).then_some(cfg.replica.host_port))?;
    let host = match cfg.replica.host_ip.as_str() {
        "" | "0.0.0.0" => "127.0.0.1",
        "::" => "[::1]",
        ip => ip,
    };
    Some(format!("http://{host}:{port}"))
}
