//! The job file: what a researcher submits.
//!
//! Field names follow the Kubernetes container spec that users already know (`image`,
//! `command`, `args`, `env` as `name`/`value` pairs), plus the few fields nightshift adds
//! (`gpus`, `priority`, `checkpoint`). YAML and JSON are both accepted.

use serde::{Deserialize, Serialize};

/// A job as submitted. Unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobSpec {
    /// A human name; need not be unique.
    pub name: String,
    /// The container image, e.g. `registry.example.com/team/trainer:1.4`.
    pub image: String,
    /// Replaces the image's entrypoint when set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Replaces the image's command when set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// GPUs on each node, all given to the container and numbered from 0 inside it.
    pub gpus: u32,
    /// Nodes of a gang job, placed all or nothing, each with `gpus` GPUs and the rendezvous
    /// variables torchrun expects. 1 for a single-node job.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub nodes: u32,
    /// Higher runs first. Within a priority, first submitted runs first.
    #[serde(default)]
    pub priority: i32,
    /// Team or user that owns the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default)]
    pub checkpoint: CheckpointPolicy,
    /// How often a failed job is run again. Preemptions never count against it.
    #[serde(default, skip_serializing_if = "RetryPolicy::is_default")]
    pub retry: RetryPolicy,
    /// What the agent reads back from the container after it exits (pipeline steps).
    #[serde(default, skip_serializing_if = "Capture::is_empty")]
    pub capture: Capture,
    /// Small files placed in the container before it starts (pipeline artifacts).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<JobFile>,
    /// Privileges beyond an unprivileged container, each refused unless policy allows it.
    #[serde(default, skip_serializing_if = "crate::sandbox::Sandbox::is_default")]
    pub sandbox: crate::sandbox::Sandbox,
    /// The most time the job may run, summed over its attempts (time preempted or queued
    /// does not count), like Slurm's `--time`: past it, the job is stopped (checkpoint signal,
    /// grace, kill) and fails without a retry. Set by the coordinator's policy when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_run_seconds: Option<u64>,
}

fn one() -> u32 {
    1
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

/// Retries after a failure (a non-zero exit, a container that cannot start), with
/// exponential backoff: `backoffSeconds × backoffFactor^(failures-1)`, at most
/// `maxBackoffSeconds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RetryPolicy {
    /// Retries after the first failure; 0 never retries.
    #[serde(default)]
    pub limit: u32,
    #[serde(default = "default_backoff")]
    pub backoff_seconds: u32,
    #[serde(default = "default_factor")]
    pub backoff_factor: u32,
    #[serde(default = "default_max_backoff")]
    pub max_backoff_seconds: u32,
}

fn default_backoff() -> u32 {
    10
}

fn default_factor() -> u32 {
    2
}

fn default_max_backoff() -> u32 {
    3600
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            limit: 0,
            backoff_seconds: default_backoff(),
            backoff_factor: default_factor(),
            max_backoff_seconds: default_max_backoff(),
        }
    }
}

impl RetryPolicy {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The wait before the retry that follows failure number `failures` (1-based).
    pub fn backoff_ms(&self, failures: u32) -> u64 {
        let factor = u64::from(self.backoff_factor.max(1));
        let exp = factor.saturating_pow(failures.saturating_sub(1));
        let secs = u64::from(self.backoff_seconds).saturating_mul(exp);
        secs.min(u64::from(self.max_backoff_seconds)) * 1000
    }
}

/// Most nodes a gang job may span.
pub const MAX_NODES: u32 = 256;
/// Most retries a job may ask for.
pub const MAX_RETRIES: u32 = 100;

/// A file given to a job's container at `path` (absolute).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    pub path: String,
    pub content: String,
}

/// Largest total size of a job's `files`, in bytes.
pub const MAX_JOB_FILES_BYTES: usize = 256 << 10;

/// Files and output a finished container leaves behind that its job reports as outputs:
/// each file under its name, and standard output under [`STDOUT_OUTPUT`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Capture {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<CaptureFile>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdout: bool,
}

impl Capture {
    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && !self.stdout
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaptureFile {
    /// The output's name, e.g. an Argo output parameter.
    pub name: String,
    /// An absolute path in the container.
    pub path: String,
}

/// The output key of a job's captured standard output. A `/` never appears in an output
/// parameter's name, so it cannot clash with one.
pub const STDOUT_OUTPUT: &str = "nightshift.io/stdout";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvVar {
    pub name: String,
    #[serde(default)]
    pub value: String,
}

/// How a job is told to save its work before its GPUs are taken back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointPolicy {
    /// The signal sent on reclaim, e.g. `SIGTERM` or `SIGUSR1`.
    #[serde(default = "default_signal")]
    pub signal: String,
    /// How long the job has, after the signal, to save and exit before it is killed.
    #[serde(default = "default_grace")]
    pub grace_period_seconds: u32,
}

fn default_signal() -> String {
    "SIGTERM".to_owned()
}

fn default_grace() -> u32 {
    30
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        Self {
            signal: default_signal(),
            grace_period_seconds: default_grace(),
        }
    }
}

/// The signals a job may choose as its checkpoint signal.
pub const CHECKPOINT_SIGNALS: &[&str] = &[
    "SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT",
];

/// Longest grace period a job may ask for: one hour.
pub const MAX_GRACE_SECONDS: u32 = 3600;

/// A job file that breaks a rule. `field` is the path of the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {rule}")]
pub struct SpecError {
    pub field: String,
    pub rule: String,
}

impl SpecError {
    pub fn new(field: impl Into<String>, rule: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            rule: rule.into(),
        }
    }
}

impl JobSpec {
    /// A single-node job with every optional field at its default.
    pub fn new(name: impl Into<String>, image: impl Into<String>, gpus: u32) -> Self {
        Self {
            name: name.into(),
            image: image.into(),
            command: Vec::new(),
            args: Vec::new(),
            env: Vec::new(),
            gpus,
            nodes: 1,
            priority: 0,
            owner: None,
            checkpoint: CheckpointPolicy::default(),
            retry: RetryPolicy::default(),
            capture: Capture::default(),
            files: Vec::new(),
            sandbox: Default::default(),
            max_run_seconds: None,
        }
    }

    /// Checks every rule that needs no knowledge of the cluster.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.name.trim().is_empty() {
            return Err(SpecError::new("name", "must not be empty"));
        }
        if self.name.len() > 128 {
            return Err(SpecError::new("name", "must be at most 128 characters"));
        }
        if self.image.trim().is_empty() {
            return Err(SpecError::new("image", "must not be empty"));
        }
        if self.image.chars().any(char::is_whitespace) {
            return Err(SpecError::new("image", "must not contain whitespace"));
        }
        if self.gpus == 0 {
            return Err(SpecError::new("gpus", "must be at least 1"));
        }
        if self.nodes == 0 || self.nodes > MAX_NODES {
            return Err(SpecError::new(
                "nodes",
                format!("must be between 1 and {MAX_NODES}"),
            ));
        }
        if self.retry.limit > MAX_RETRIES {
            return Err(SpecError::new(
                "retry.limit",
                format!("must be at most {MAX_RETRIES}"),
            ));
        }
        self.sandbox.validate()?;
        if self.max_run_seconds == Some(0) {
            return Err(SpecError::new("maxRunSeconds", "must be at least 1"));
        }
        if self.retry.backoff_factor == 0 {
            return Err(SpecError::new("retry.backoffFactor", "must be at least 1"));
        }
        for (i, var) in self.env.iter().enumerate() {
            let valid = !var.name.is_empty()
                && !var.name.starts_with(|c: char| c.is_ascii_digit())
                && var
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(SpecError::new(
                    format!("env[{i}].name"),
                    "must be letters, digits and '_', not starting with a digit",
                ));
            }
            if var.name.starts_with("NIGHTSHIFT_") {
                return Err(SpecError::new(
                    format!("env[{i}].name"),
                    "the NIGHTSHIFT_ prefix is reserved for variables the agent sets",
                ));
            }
        }
        for (i, f) in self.files.iter().enumerate() {
            if !f.path.starts_with('/') || f.path.ends_with('/') {
                return Err(SpecError::new(
                    format!("files[{i}].path"),
                    "must be an absolute file path",
                ));
            }
        }
        if self.files.iter().map(|f| f.content.len()).sum::<usize>() > MAX_JOB_FILES_BYTES {
            return Err(SpecError::new(
                "files",
                format!("must hold at most {MAX_JOB_FILES_BYTES} bytes in all"),
            ));
        }
        for (i, f) in self.capture.files.iter().enumerate() {
            if !f.path.starts_with('/') {
                return Err(SpecError::new(
                    format!("capture.files[{i}].path"),
                    "must be an absolute path",
                ));
            }
            if f.name.is_empty() || f.name.contains('/') {
                return Err(SpecError::new(
                    format!("capture.files[{i}].name"),
                    "must be a non-empty name without '/'",
                ));
            }
        }
        if !CHECKPOINT_SIGNALS.contains(&self.checkpoint.signal.as_str()) {
            return Err(SpecError::new(
                "checkpoint.signal",
                format!("must be one of {}", CHECKPOINT_SIGNALS.join(", ")),
            ));
        }
        if self.checkpoint.grace_period_seconds > MAX_GRACE_SECONDS {
            return Err(SpecError::new(
                "checkpoint.gracePeriodSeconds",
                format!("must be at most {MAX_GRACE_SECONDS}"),
            ));
        }
        Ok(())
    }

    /// Parses a job file (YAML, of which JSON is a subset) and validates it.
    pub fn from_yaml(text: &str) -> Result<Self, SpecError> {
        let spec: JobSpec = yaml_from_str(text)?;
        spec.validate()?;
        Ok(spec)
    }
}

/// `yaml_serde` stops only at 128 levels and at a count of alias jumps, not at what they
/// expand to, and its scanner's time grows with the square of the nesting: the shared limits
/// are checked first ([`crate::yaml::check`]).
fn yaml_from_str(text: &str) -> Result<JobSpec, SpecError> {
    crate::yaml::check(text).map_err(|e| SpecError::new("job file", e.to_string()))?;
    yaml_serde::from_str(text).map_err(|e| SpecError::new("job file", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> JobSpec {
        JobSpec {
            name: "train".into(),
            image: "trainer:1".into(),
            command: vec![],
            args: vec![],
            env: vec![],
            gpus: 2,
            nodes: 1,
            priority: 0,
            owner: None,
            checkpoint: CheckpointPolicy::default(),
            retry: RetryPolicy::default(),
            capture: Default::default(),
            files: Vec::new(),
            sandbox: Default::default(),
            max_run_seconds: None,
        }
    }

    #[test]
    fn a_plain_spec_is_valid() {
        assert_eq!(spec().validate(), Ok(()));
    }

    #[test]
    fn empty_image_names_the_field() {
        let mut s = spec();
        s.image = " ".into();
        assert_eq!(s.validate().unwrap_err().field, "image");
    }

    #[test]
    fn zero_gpus_is_refused() {
        let mut s = spec();
        s.gpus = 0;
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "gpus: must be at least 1"
        );
    }

    #[test]
    fn reserved_env_prefix_is_refused() {
        let mut s = spec();
        s.env.push(EnvVar {
            name: "NIGHTSHIFT_JOB_ID".into(),
            value: "x".into(),
        });
        assert_eq!(s.validate().unwrap_err().field, "env[0].name");
    }

    #[test]
    fn unknown_field_is_refused_with_its_name() {
        let err = serde_json::from_str::<JobSpec>(r#"{"name":"a","image":"b","gpus":1,"gpu":3}"#)
            .unwrap_err();
        assert!(err.to_string().contains("unknown field `gpu`"), "{err}");
    }

    #[test]
    fn yaml_job_file_parses_and_unknown_keys_name_the_line() {
        let s =
            JobSpec::from_yaml("name: a\nimage: b\ngpus: 1\nenv:\n  - name: X\n    value: \"1\"\n")
                .unwrap();
        assert_eq!(s.env[0].value, "1");
        let err = JobSpec::from_yaml("name: a\nimage: b\ngpus: 1\nimagePullPolicy: Always\n")
            .unwrap_err();
        assert!(err.rule.contains("imagePullPolicy"), "{err}");
        assert!(err.rule.contains("line 4"), "{err}");
    }

    fn refused(text: &str) -> SpecError {
        match JobSpec::from_yaml(text) {
            Ok(_) => panic!("accepted a job file of {} bytes", text.len()),
            Err(e) => e,
        }
    }

    #[test]
    fn a_job_file_whose_aliases_expand_past_the_limit_is_refused() {
        // 100 aliases of a 100 kB string: 10 MB of arguments from a 100 kB file.
        let text = format!(
            "name: a\nimage: b\ngpus: 1\ncommand: [&s '{}']\nargs: [{}]\n",
            "x".repeat(100_000),
            vec!["*s"; 100].join(", ")
        );
        let err = refused(&text);
        assert_eq!(err.field, "job file");
        assert!(
            err.rule.starts_with("line 5: more than the limit of"),
            "{err}"
        );
        assert!(err.rule.contains("bytes of text"), "{err}");
        // The classic bomb is refused for its size, not for its unknown keys.
        let mut bomb = format!("x-l1: &l1 [{}]\n", ["lol"; 9].join(", "));
        for l in 2..=8 {
            let below = vec![format!("*l{}", l - 1); 9].join(", ");
            bomb.push_str(&format!("x-l{l}: &l{l} [{below}]\n"));
        }
        let err = refused(&bomb);
        assert!(err.rule.contains("limit of 100000 nodes"), "{err}");
    }

    #[test]
    fn a_deeply_nested_job_file_is_refused_at_once() {
        // 200 kB of brackets: libyaml's scanner, which yaml_serde uses, spent 25 s of CPU
        // on such a file, time that grows with the square of the depth.
        let depth = 100_000;
        let text = format!(
            "name: a\nimage: b\ngpus: 1\ncommand: {}x{}\n",
            "[".repeat(depth),
            "]".repeat(depth)
        );
        let started = std::time::Instant::now();
        let err = refused(&text);
        assert_eq!(
            err.to_string(),
            "job file: line 4: nested deeper than the limit of 64 levels"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }

    #[test]
    fn retry_backoff_grows_and_is_capped() {
        let r = RetryPolicy {
            limit: 5,
            backoff_seconds: 10,
            backoff_factor: 3,
            max_backoff_seconds: 60,
        };
        assert_eq!(
            [r.backoff_ms(1), r.backoff_ms(2), r.backoff_ms(3)],
            [10_000, 30_000, 60_000]
        );
    }

    #[test]
    fn a_gang_of_zero_nodes_is_refused() {
        let mut s = spec();
        s.nodes = 0;
        assert_eq!(s.validate().unwrap_err().field, "nodes");
    }

    #[test]
    fn defaults_fill_checkpoint_policy() {
        let s: JobSpec = serde_json::from_str(r#"{"name":"a","image":"b","gpus":1}"#).unwrap();
        assert_eq!(s.checkpoint.signal, "SIGTERM");
        assert_eq!(s.checkpoint.grace_period_seconds, 30);
    }
}
