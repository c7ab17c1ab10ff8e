//! `coordinator.toml`: the coordinator's typed configuration.
//!
//! Loaded from an optional TOML file, then `NIGHTSHIFT_COORDINATOR__*` environment variables
//! (`__` separates nested keys). Unknown keys are refused, so a typo is an error that names
//! the key instead of a default silently kept.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use nightshift_core::{CoreConfig, ScaleDown, ScaleUp, ServicePolicy};
use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub heartbeat_interval_ms: u64,
    pub lease_ttl_ms: u64,
    pub services: Vec<ServiceConfig>,
    /// HTTPS with agents' client certificates; plain HTTP when absent.
    pub tls: Option<TlsConfig>,
    /// What a job may ask for.
    pub policy: crate::policy::PolicyConfig,
}

/// The coordinator's TLS files (`nightshift-coordinator tls init` writes them).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The cluster CA: an agent's certificate must be signed by it.
    pub ca_file: PathBuf,
    /// The coordinator's certificate chain, PEM.
    pub cert_file: PathBuf,
    /// Its private key, PEM.
    pub key_file: PathBuf,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        let core = CoreConfig::default();
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7400)),
            data_dir: PathBuf::from("/var/lib/nightshift/coordinator"),
            heartbeat_interval_ms: core.heartbeat_interval_ms,
            lease_ttl_ms: core.lease_ttl_ms,
            services: vec![ServiceConfig::default()],
            tls: None,
            policy: crate::policy::PolicyConfig::default(),
        }
    }
}

/// One service's scaling policy; see [`ServicePolicy`] for what each field means.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServiceConfig {
    pub name: String,
    pub min_replicas: u32,
    pub cooldown_s: f64,
    pub gateway_signal_ttl_s: f64,
    pub scale_down: ScaleDownConfig,
    pub scale_up: ScaleUpConfig,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScaleDownConfig {
    pub max_waiting: f64,
    pub max_running_per_replica: f64,
    pub window_s: f64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScaleUpConfig {
    pub waiting_per_replica: f64,
    pub running_per_replica: f64,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        let p = ServicePolicy::default();
        Self {
            name: p.name,
            min_replicas: p.min_replicas,
            cooldown_s: p.cooldown_ms as f64 / 1000.0,
            gateway_signal_ttl_s: p.gateway_signal_ttl_ms as f64 / 1000.0,
            scale_down: ScaleDownConfig::default(),
            scale_up: ScaleUpConfig::default(),
        }
    }
}

impl Default for ScaleDownConfig {
    fn default() -> Self {
        let d = ScaleDown::default();
        Self {
            max_waiting: d.max_waiting,
            max_running_per_replica: d.max_running_per_replica,
            window_s: d.window_ms as f64 / 1000.0,
        }
    }
}

impl Default for ScaleUpConfig {
    fn default() -> Self {
        let u = ScaleUp::default();
        Self {
            waiting_per_replica: u.waiting_per_replica,
            running_per_replica: u.running_per_replica,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Load(#[from] config::ConfigError),
    /// The file on its own: every syntax error, wrong type and unknown key, with its line.
    #[error("{0}")]
    File(#[from] nightshift_configfile::FileError),
    /// A rule broken by a key of the file, at its line.
    #[error("{0}")]
    Located(nightshift_configfile::Problem),
    #[error("{key}: {rule}")]
    Invalid { key: String, rule: String },
}

fn ms(seconds: f64) -> u64 {
    (seconds * 1000.0).round() as u64
}

impl CoordinatorConfig {
    /// Reads `file` (when given) and the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let lines = file
            .map(nightshift_configfile::check_file::<Self>)
            .transpose()?;
        let mut builder = config::Config::builder();
        if let Some(file) = file {
            builder = builder.add_source(config::File::from(file).required(true));
        }
        let cfg: Self = builder
            .add_source(
                config::Environment::with_prefix("NIGHTSHIFT_COORDINATOR")
                    .separator("__")
                    .try_parsing(true),
            )
            .build()?
            .try_deserialize()?;
        cfg.validate().map_err(|e| match (e, &lines) {
            (ConfigError::Invalid { key, rule }, Some(lines)) => {
                ConfigError::Located(lines.problem(&key, rule))
            }
            (e, _) => e,
        })?;
        Ok(cfg)
    }

    /// Every rule that serde's types do not already enforce.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: String, rule: &str| {
            Err(ConfigError::Invalid {
                key,
                rule: rule.into(),
            })
        };
        if self.heartbeat_interval_ms == 0 {
            return invalid("heartbeat_interval_ms".into(), "must be at least 1");
        }
        if self.lease_ttl_ms < 2 * self.heartbeat_interval_ms {
            return invalid(
                "lease_ttl_ms".into(),
                "must be at least twice heartbeat_interval_ms",
            );
        }
        if self.services.is_empty() {
            return invalid("services".into(), "at least one service is needed");
        }
        for (i, s) in self.services.iter().enumerate() {
            if s.name.trim().is_empty() {
                return invalid(format!("services[{i}].name"), "must not be empty");
            }
            if self.services.iter().filter(|o| o.name == s.name).count() > 1 {
                return invalid(format!("services[{i}].name"), "names must be unique");
            }
            let times = [
                ("cooldown_s", s.cooldown_s),
                ("gateway_signal_ttl_s", s.gateway_signal_ttl_s),
                ("scale_down.window_s", s.scale_down.window_s),
            ];
            for (key, v) in times {
                if !(v.is_finite() && v >= 0.0) {
                    return invalid(format!("services[{i}].{key}"), "must be a duration >= 0");
                }
            }
            let thresholds = [
                ("scale_down.max_waiting", s.scale_down.max_waiting),
                (
                    "scale_down.max_running_per_replica",
                    s.scale_down.max_running_per_replica,
                ),
                (
                    "scale_up.waiting_per_replica",
                    s.scale_up.waiting_per_replica,
                ),
                (
                    "scale_up.running_per_replica",
                    s.scale_up.running_per_replica,
                ),
            ];
            for (key, v) in thresholds {
                if !(v.is_finite() && v >= 0.0) {
                    return invalid(format!("services[{i}].{key}"), "must be a number >= 0");
                }
            }
            if s.scale_up.waiting_per_replica <= s.scale_down.max_waiting {
                return invalid(
                    format!("services[{i}].scale_up.waiting_per_replica"),
                    "must be above scale_down.max_waiting, or the service flaps",
                );
            }
        }
        Ok(())
    }

    pub fn core(&self) -> CoreConfig {
        CoreConfig {
            heartbeat_interval_ms: self.heartbeat_interval_ms,
            lease_ttl_ms: self.lease_ttl_ms,
            services: self
                .services
                .iter()
                .map(|s| ServicePolicy {
                    name: s.name.clone(),
                    min_replicas: s.min_replicas,
                    scale_down: ScaleDown {
                        max_waiting: s.scale_down.max_waiting,
                        max_running_per_replica: s.scale_down.max_running_per_replica,
                        window_ms: ms(s.scale_down.window_s),
                    },
                    scale_up: ScaleUp {
                        waiting_per_replica: s.scale_up.waiting_per_replica,
                        running_per_replica: s.scale_up.running_per_replica,
                    },
                    cooldown_ms: ms(s.cooldown_s),
                    gateway_signal_ttl_ms: ms(s.gateway_signal_ttl_s),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("coordinator.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn defaults_are_valid() {
        CoordinatorConfig::default().validate().unwrap();
    }

    #[test]
    fn a_file_sets_nested_service_policy() {
        let (_d, path) = write(
            "lease_ttl_ms = 10000\n[[services]]\nname = \"chat\"\nmin_replicas = 2\n\
             [services.scale_down]\nwindow_s = 60\n",
        );
        let cfg = CoordinatorConfig::load(Some(&path)).unwrap();
        let core = cfg.core();
        assert_eq!(core.lease_ttl_ms, 10_000);
        assert_eq!(core.services[0].name, "chat");
        assert_eq!(core.services[0].min_replicas, 2);
        assert_eq!(core.services[0].scale_down.window_ms, 60_000);
    }

    #[test]
    fn an_unknown_key_is_named() {
        let (_d, path) = write("lease_ttl_msec = 5\n");
        let err = CoordinatorConfig::load(Some(&path))
            .unwrap_err()
            .to_string();
        assert!(err.contains("lease_ttl_msec"), "{err}");
    }

    #[test]
    fn a_wrong_type_names_the_key_and_the_file() {
        let (_d, path) = write("heartbeat_interval_ms = \"often\"\n");
        let err = CoordinatorConfig::load(Some(&path))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("heartbeat_interval_ms") && err.contains("coordinator.toml"),
            "{err}"
        );
    }

    #[test]
    fn every_problem_of_the_file_is_named_with_its_line() {
        let (_d, path) = write(
            "listen = \"127.0.0.1:7400\"\nheartbeat_interval_ms = \"often\"\n\
             [[services]]\nname = \"chat\"\nmin_replica = 2\n",
        );
        let err = CoordinatorConfig::load(Some(&path))
            .unwrap_err()
            .to_string();
        let file = path.display();
        assert_eq!(
            err,
            format!(
                "{file}: line 2: heartbeat_interval_ms: invalid type: string \"often\", expected u64\n\
                 {file}: line 5: services[0].min_replica: unknown field `min_replica`, expected one \
                 of `name`, `min_replicas`, `cooldown_s`, `gateway_signal_ttl_s`, `scale_down`, \
                 `scale_up`"
            )
        );
    }

    #[test]
    fn a_short_lease_is_refused() {
        let (_d, path) = write("heartbeat_interval_ms = 1000\nlease_ttl_ms = 1500\n");
        let err = CoordinatorConfig::load(Some(&path))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "{}: line 2: lease_ttl_ms: must be at least twice heartbeat_interval_ms",
                path.display()
            )
        );
    }
}
