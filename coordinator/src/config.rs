//! `coordinator.toml`: the coordinator's typed configuration.
//!
//! Loaded from an optional TOML file, then `NIGHTSHIFT_COORDINATOR__*` environment variables
//! (`__` separates nested keys). Unknown keys are refused, so a typo is an error that names
//! the key instead of a default silently kept.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use nightshift_core::{CoreConfig, HarvestWindow, ScaleDown, ScaleUp, ServicePolicy};
use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub heartbeat_interval_ms: u64,
    pub lease_ttl_ms: u64,
    /// How long after a silent node's lease expired its job may start on another node while
    /// the old container may still run there; unset: until the agent's fail-safe has surely
    /// stopped it (the job's grace period and 10 s) or the node reports it gone.
    pub restart_elsewhere_after_s: Option<f64>,
    pub services: Vec<ServiceConfig>,
    /// A job that has run less than this is taken back only when no other lent node will do.
    pub preempt_exempt_s: f64,
    /// Fair-share weights of teams (a job's `owner`); a team not listed weighs 1.
    pub team_weights: BTreeMap<String, f64>,
    /// First port of gang rendezvous (`MASTER_PORT` = base + job id % 1000).
    pub rendezvous_port_base: u16,
    /// How long a gang's members may take to all have their image on their hosts before
    /// the attempt fails to start (and frees their GPUs).
    pub gang_start_timeout_s: f64,
    pub accounting: AccountingConfig,
    /// HTTPS with agents' client certificates; plain HTTP when absent.
    pub tls: Option<TlsConfig>,
    /// What may be served without `[tls]`.
    pub access: AccessConfig,
    /// What a job may ask for.
    pub policy: crate::policy::PolicyConfig,
    /// Where the state lives: `data_dir`'s SQLite file unless `url` says otherwise.
    pub store: StoreConfig,
}

/// `[store]`: the database that holds the coordinator's state.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `sqlite:///path/to/nightshift.db`, or `postgres://user:password@host:port/database`
    /// (libpq's URL; `?sslmode=disable` for plain TCP, else TLS). Unset: `data_dir`'s
    /// `nightshift.db`.
    pub url: Option<String>,
    /// The CA (PEM) a PostgreSQL server's certificate must chain to; the system's roots
    /// when unset.
    pub ca_file: Option<PathBuf>,
    /// With PostgreSQL, any number of coordinators may share the database: one leads, the
    /// others stand by and name the leader by this URL (how agents and the CLI reach this
    /// coordinator). Unset: `http://` (or `https://` with `[tls]`) and `listen`.
    pub advertise_url: Option<String>,
}

/// What a harvested GPU-hour is worth, for `nightshift report`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccountingConfig {
    pub price_per_gpu_hour: f64,
    pub currency: String,
}

impl Default for AccountingConfig {
    fn default() -> Self {
        Self {
            price_per_gpu_hour: 2.0,
            currency: "USD".to_owned(),
        }
    }
}

/// `[access]`: what the coordinator serves unauthenticated when told so.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccessConfig {
    /// Serve the agent routes (`/v1/agents/...`) over plain HTTP although API tokens are on.
    /// Only `[tls]` authenticates agents (each by its certificate): without it anyone who
    /// reaches the coordinator may speak for any node and read any node's desired state, its
    /// jobs' environment values included, while the API asks for a token. So a coordinator
    /// with API tokens and no `[tls]` refuses to start unless this is true, and warns at
    /// start when it is.
    pub agents_without_tls: bool,
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
            restart_elsewhere_after_s: None,
            services: vec![ServiceConfig::default()],
            preempt_exempt_s: core.preempt_exempt_ms as f64 / 1000.0,
            team_weights: BTreeMap::new(),
            rendezvous_port_base: core.rendezvous_port_base,
            gang_start_timeout_s: core.gang_start_timeout_ms as f64 / 1000.0,
            accounting: AccountingConfig::default(),
            tls: None,
            access: AccessConfig::default(),
            policy: crate::policy::PolicyConfig::default(),
            store: StoreConfig::default(),
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
    /// Most replicas the service needs; nodes beyond are lendable whatever the load.
    pub max_replicas: Option<u32>,
    /// Spare replicas kept beyond what the load needs.
    pub headroom: u32,
    /// When lending is allowed, e.g. `["Mon-Fri 20:00-08:00", "Sat-Sun 00:00-24:00"]`;
    /// empty means always.
    pub harvest_windows: Vec<String>,
    /// Local time's offset from UTC in minutes, for windows and load profiles.
    pub utc_offset_minutes: i32,
    /// Take nodes back ahead of the load the learned profile predicts.
    pub predictive: bool,
    /// The reclaim lead time until one is measured on the service's nodes.
    pub default_reclaim_lead_s: f64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScaleDownConfig {
    pub max_waiting: f64,
    pub max_running_per_replica: f64,
    pub window_s: f64,
    pub max_kv_cache_usage: f64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScaleUpConfig {
    pub waiting_per_replica: f64,
    pub running_per_replica: f64,
    pub kv_cache_usage: f64,
    /// TTFT p95 (seconds) of any replica at or above this takes a node back; off when unset.
    pub ttft_p95_s: Option<f64>,
    /// Generated tokens/s per replica at or above this takes a node back; off when unset.
    pub generation_tokens_per_s_per_replica: Option<f64>,
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
            max_replicas: p.max_replicas,
            headroom: p.headroom,
            harvest_windows: Vec::new(),
            utc_offset_minutes: p.utc_offset_minutes,
            predictive: p.predictive,
            default_reclaim_lead_s: p.default_reclaim_lead_ms as f64 / 1000.0,
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
            max_kv_cache_usage: d.max_kv_cache_usage,
        }
    }
}

impl Default for ScaleUpConfig {
    fn default() -> Self {
        let u = ScaleUp::default();
        Self {
            waiting_per_replica: u.waiting_per_replica,
            running_per_replica: u.running_per_replica,
            kv_cache_usage: u.kv_cache_usage,
            ttft_p95_s: u.ttft_p95_s,
            generation_tokens_per_s_per_replica: u.generation_tokens_per_s_per_replica,
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
    /// API tokens on, and nothing to authenticate agents with.
    #[error(
        "{} holds API tokens, but there is no [tls]: the agent routes would authenticate \
         nobody, and anyone who reaches the coordinator could read every job's environment \
         from them; set [tls] (nightshift-coordinator tls init), or accept that with \
         [access] agents_without_tls = true",
        tokens.display()
    )]
    AgentsWithoutTls { tokens: PathBuf },
}

fn ms(seconds: f64) -> u64 {
    (seconds * 1000.0).round() as u64
}

impl CoordinatorConfig {
    /// Reads `file` (when given) and the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        nightshift_configfile::load(file, "NIGHTSHIFT_COORDINATOR", |cfg: &Self, lines| {
            cfg.validate().map_err(|e| match (e, lines) {
                (ConfigError::Invalid { key, rule }, Some(lines)) => {
                    ConfigError::Located(lines.problem(&key, rule))
                }
                (e, _) => e,
            })
        })
    }

    /// With API tokens on (the token file `tokens` holds one), the agent routes must be
    /// guarded too: by `[tls]`, or left open only where `[access] agents_without_tls` says
    /// so. True when they are served without TLS by that setting, which the caller warns of.
    pub fn agent_routes_without_tls(
        &self,
        tokens: &Path,
        tokens_on: bool,
    ) -> Result<bool, ConfigError> {
        if self.tls.is_some() {
            return Ok(false);
        }
        if self.access.agents_without_tls {
            return Ok(true);
        }
        if tokens_on {
            return Err(ConfigError::AgentsWithoutTls {
                tokens: tokens.to_owned(),
            });
        }
        Ok(false)
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
        if let Some(v) = self.restart_elsewhere_after_s
            && !(v.is_finite() && v >= 0.0)
        {
            return invalid(
                "restart_elsewhere_after_s".into(),
                "must be a duration in seconds >= 0",
            );
        }
        if !(self.preempt_exempt_s.is_finite() && self.preempt_exempt_s >= 0.0) {
            return invalid("preempt_exempt_s".into(), "must be a duration >= 0");
        }
        if !(self.gang_start_timeout_s.is_finite() && self.gang_start_timeout_s > 0.0) {
            return invalid("gang_start_timeout_s".into(), "must be a duration > 0");
        }
        if let Some((team, _)) = self
            .team_weights
            .iter()
            .find(|(_, w)| !(w.is_finite() && **w > 0.0))
        {
            return invalid(format!("team_weights.{team}"), "must be a number > 0");
        }
        if !(self.accounting.price_per_gpu_hour.is_finite()
            && self.accounting.price_per_gpu_hour >= 0.0)
        {
            return invalid(
                "accounting.price_per_gpu_hour".into(),
                "must be a number >= 0",
            );
        }
        if let Some(url) = &self.store.url
            && let Err(e) = crate::store::StoreUrl::parse(url)
        {
            let rule = match e {
                crate::store::StoreError::Url { reason, .. } => reason,
                e => e.to_string(),
            };
            return invalid("store.url".into(), &rule);
        }
        if let Err((key, rule)) = self.policy.validate() {
            return invalid(key, &rule);
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
            if s.scale_up.running_per_replica <= s.scale_down.max_running_per_replica {
                return invalid(
                    format!("services[{i}].scale_up.running_per_replica"),
                    "must be above scale_down.max_running_per_replica, or the service flaps",
                );
            }
            let kv = [
                ("scale_up.kv_cache_usage", s.scale_up.kv_cache_usage),
                (
                    "scale_down.max_kv_cache_usage",
                    s.scale_down.max_kv_cache_usage,
                ),
            ];
            for (key, v) in kv {
                if !(0.0..=1.0).contains(&v) {
                    return invalid(format!("services[{i}].{key}"), "must be between 0 and 1");
                }
            }
            let optional = [
                ("scale_up.ttft_p95_s", s.scale_up.ttft_p95_s),
                (
                    "scale_up.generation_tokens_per_s_per_replica",
                    s.scale_up.generation_tokens_per_s_per_replica,
                ),
            ];
            for (key, v) in optional {
                if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                    return invalid(format!("services[{i}].{key}"), "must be a number > 0");
                }
            }
            if s.scale_up.kv_cache_usage <= s.scale_down.max_kv_cache_usage {
                return invalid(
                    format!("services[{i}].scale_up.kv_cache_usage"),
                    "must be above scale_down.max_kv_cache_usage, or the service flaps",
                );
            }
            if let Some(max) = s.max_replicas
                && max < s.min_replicas
            {
                return invalid(
                    format!("services[{i}].max_replicas"),
                    &format!("{max} is below min_replicas {}", s.min_replicas),
                );
            }
            if !(s.default_reclaim_lead_s.is_finite() && s.default_reclaim_lead_s >= 0.0) {
                return invalid(
                    format!("services[{i}].default_reclaim_lead_s"),
                    "must be a duration >= 0",
                );
            }
            if s.utc_offset_minutes.abs() > 14 * 60 {
                return invalid(
                    format!("services[{i}].utc_offset_minutes"),
                    "must be within ±840",
                );
            }
            for (j, text) in s.harvest_windows.iter().enumerate() {
                let key = format!("services[{i}].harvest_windows[{j}]");
                let w: HarvestWindow =
                    text.parse().map_err(|e: nightshift_core::WindowError| {
                        ConfigError::Invalid {
                            key: key.clone(),
                            rule: e.to_string(),
                        }
                    })?;
                let length_min = if w.end > w.start {
                    w.end - w.start
                } else {
                    24 * 60 - w.start + w.end
                };
                if f64::from(length_min) * 60.0 <= s.default_reclaim_lead_s {
                    return invalid(
                        key,
                        &format!(
                            "{text:?} is shorter than the reclaim lead time ({} s), so it never opens",
                            s.default_reclaim_lead_s
                        ),
                    );
                }
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
                        max_kv_cache_usage: s.scale_down.max_kv_cache_usage,
                    },
                    scale_up: ScaleUp {
                        waiting_per_replica: s.scale_up.waiting_per_replica,
                        running_per_replica: s.scale_up.running_per_replica,
                        kv_cache_usage: s.scale_up.kv_cache_usage,
                        ttft_p95_s: s.scale_up.ttft_p95_s,
                        generation_tokens_per_s_per_replica: s
                            .scale_up
                            .generation_tokens_per_s_per_replica,
                    },
                    cooldown_ms: ms(s.cooldown_s),
                    gateway_signal_ttl_ms: ms(s.gateway_signal_ttl_s),
                    max_replicas: s.max_replicas,
                    headroom: s.headroom,
                    // Checked by `validate`.
                    harvest_windows: s
                        .harvest_windows
                        .iter()
                        .filter_map(|w| w.parse().ok())
                        .collect(),
                    utc_offset_minutes: s.utc_offset_minutes,
                    predictive: s.predictive,
                    default_reclaim_lead_ms: ms(s.default_reclaim_lead_s),
                })
                .collect(),
            restart_elsewhere_after_ms: self.restart_elsewhere_after_s.map(ms),
            preempt_exempt_ms: ms(self.preempt_exempt_s),
            team_weights: self.team_weights.clone(),
            rendezvous_port_base: self.rendezvous_port_base,
            gang_start_timeout_ms: ms(self.gang_start_timeout_s),
            max_placements_per_decision: CoreConfig::default().max_placements_per_decision,
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
    fn api_tokens_without_tls_need_the_operators_word() {
        let tokens = Path::new("/var/lib/nightshift/coordinator/tokens.json");
        let plain = CoordinatorConfig::default();
        assert_eq!(
            plain.agent_routes_without_tls(tokens, false).ok(),
            Some(false)
        );
        let err = plain.agent_routes_without_tls(tokens, true).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("/var/lib/nightshift/coordinator/tokens.json holds API tokens, but there is no [tls]"), "{text}");
        assert!(
            text.ends_with("[access] agents_without_tls = true"),
            "{text}"
        );

        let (_d, path) = write("[access]\nagents_without_tls = true\n");
        let allowed = CoordinatorConfig::load(Some(&path)).unwrap();
        assert_eq!(
            allowed.agent_routes_without_tls(tokens, true).ok(),
            Some(true)
        );
        assert_eq!(
            allowed.agent_routes_without_tls(tokens, false).ok(),
            Some(true)
        );

        let with_tls = CoordinatorConfig {
            tls: Some(TlsConfig {
                ca_file: "ca.pem".into(),
                cert_file: "c.pem".into(),
                key_file: "c.key".into(),
            }),
            ..allowed
        };
        assert_eq!(
            with_tls.agent_routes_without_tls(tokens, true).ok(),
            Some(false)
        );
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
    fn restart_elsewhere_after_s_reaches_the_core_and_must_not_be_negative() {
        assert_eq!(
            CoordinatorConfig::default()
                .core()
                .restart_elsewhere_after_ms,
            None
        );
        let (_d, path) = write("restart_elsewhere_after_s = 0\n");
        let core = CoordinatorConfig::load(Some(&path)).unwrap().core();
        assert_eq!(core.restart_elsewhere_after_ms, Some(0));
        let (_d, path) = write("restart_elsewhere_after_s = -1\n");
        let err = CoordinatorConfig::load(Some(&path))
            .unwrap_err()
            .to_string();
        assert!(err.contains("restart_elsewhere_after_s"), "{err}");
    }

    #[test]
    fn gang_start_timeout_s_reaches_the_core_and_must_be_positive() {
        assert_eq!(
            CoordinatorConfig::default().core().gang_start_timeout_ms,
            900_000
        );
        let (_d, path) = write("gang_start_timeout_s = 120\n");
        let core = CoordinatorConfig::load(Some(&path)).unwrap().core();
        assert_eq!(core.gang_start_timeout_ms, 120_000);
        let (_d, path) = write("gang_start_timeout_s = 0\n");
        let err = CoordinatorConfig::load(Some(&path))
            .unwrap_err()
            .to_string();
        assert!(err.contains("gang_start_timeout_s"), "{err}");
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
                 `scale_up`, `max_replicas`, `headroom`, `harvest_windows`, `utc_offset_minutes`, \
                 `predictive`, `default_reclaim_lead_s`"
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

    #[test]
    fn a_relative_mount_allowlist_entry_is_refused_at_its_line() {
        let (_d, path) = write(
            "[policy]\nallow_host_network = true\nhost_mount_allowlist = [\"/datasets\", \"scratch\"]\n\
             [policy.teams.vision]\nmax_gpus = 32\n",
        );
        let err = CoordinatorConfig::load(Some(&path))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "{}: line 3: policy.host_mount_allowlist[1]: must be an absolute path",
                path.display()
            )
        );
        let (_d, path) = write("[policy.teams.vision]\nmax_gpu = 32\n");
        let err = CoordinatorConfig::load(Some(&path))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 2") && err.contains("unknown field `max_gpu`"),
            "{err}"
        );
    }

    #[test]
    fn policies_that_cannot_hold_are_refused_by_name() {
        let cases = [
            (
                "min_replicas = 3\nmax_replicas = 2\n",
                "services[0].max_replicas: 2 is below min_replicas 3",
            ),
            (
                "harvest_windows = [\"Mon 20:00-20:05\"]\n",
                "services[0].harvest_windows[0]: \"Mon 20:00-20:05\" is shorter than the reclaim lead time (600 s), so it never opens",
            ),
            (
                "harvest_windows = [\"Mon 20:00\"]\n",
                "services[0].harvest_windows[0]: \"Mon 20:00\": times must be HH:MM-HH:MM",
            ),
            (
                "[services.scale_up]\nrunning_per_replica = 2\n",
                "services[0].scale_up.running_per_replica: must be above scale_down.max_running_per_replica, or the service flaps",
            ),
            (
                "[services.scale_down]\nmax_kv_cache_usage = 0.95\n",
                "services[0].scale_up.kv_cache_usage: must be above scale_down.max_kv_cache_usage, or the service flaps",
            ),
        ];
        for (service, expected) in cases {
            let (_d, path) = write(&format!("[[services]]\nname = \"chat\"\n{service}"));
            let err = CoordinatorConfig::load(Some(&path))
                .unwrap_err()
                .to_string();
            // The error names the file and the line too: the rule is what this test checks.
            assert!(
                err.ends_with(&format!(": {expected}")),
                "{err}\n  should end with {expected}"
            );
        }
        let (_d, path) = write(
            "[[services]]\nname = \"chat\"\nharvest_windows = [\"Mon-Fri 20:00-08:00\"]\nmax_replicas = 4\n",
        );
        let core = CoordinatorConfig::load(Some(&path)).unwrap().core();
        assert_eq!(core.services[0].harvest_windows.len(), 1);
        assert_eq!(core.services[0].max_replicas, Some(4));
    }
}
