//! The job file: what a researcher submits.
//!
//! Field names follow the Kubernetes container spec that users already know (`image`,
//! `command`, `args`, `env` as `name`/`value` pairs), plus the few fields nightshift adds
//! (`gpus`, `priority`, `checkpoint`). YAML and JSON are both accepted.

use serde::{Deserialize, Serialize};

use crate::sandbox::container_path;

/// A job as submitted. Unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
/// Most GPUs a job may ask for on each node.
pub const MAX_GPUS: u32 = 64;
/// Highest priority; the lowest is its negative.
pub const MAX_PRIORITY: i32 = 1_000_000;
/// Most retries a job may ask for.
pub const MAX_RETRIES: u32 = 100;
/// Longest wait between retries (`backoffSeconds`, `maxBackoffSeconds`): a day.
pub const MAX_BACKOFF_SECONDS: u32 = 86_400;
/// Largest `backoffFactor`.
pub const MAX_BACKOFF_FACTOR: u32 = 100;
/// Longest `maxRunSeconds`: a year.
pub const MAX_RUN_SECONDS: u64 = 365 * 86_400;

/// A file given to a job's container at `path` (absolute).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EnvVar {
    pub name: String,
    #[serde(default)]
    pub value: String,
}

/// How a job is told to save its work before its GPUs are taken back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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

/// The variables that choose a container's GPUs, or the driver features and host devices
/// that come with them: read by the NVIDIA container toolkit's hook as it sets the container
/// up, and by the CUDA and ROCm runtimes inside it. They are the agent's alone (it gives a job
/// the GPUs of its lease, and nothing else): a job that sets one is refused, and an agent
/// never passes a job's own value on. With Docker device requests a job's
/// `NVIDIA_VISIBLE_DEVICES=all` beside the request could otherwise reach every GPU of the
/// host, depending on the toolkit's settings.
pub const GPU_VARIABLES: &[&str] = &[
    // The toolkit: which GPUs, which driver libraries, which checks, which MIG devices.
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "NVIDIA_DISABLE_REQUIRE",
    "NVIDIA_MIG_CONFIG_DEVICES",
    "NVIDIA_MIG_MONITOR_DEVICES",
    // The toolkit's features that mount more host devices or create them.
    "NVIDIA_IMEX_CHANNELS",
    "NVIDIA_GDS",
    "NVIDIA_GDRCOPY",
    "NVIDIA_MOFED",
    "NVIDIA_NVSWITCH",
    "NVIDIA_ALLOW_ADDITIONAL_GIDS",
    // The runtimes inside the container, and AMD's container toolkit.
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "AMD_VISIBLE_DEVICES",
];

/// Whether `name` is one of the [`GPU_VARIABLES`], or an `NVIDIA_REQUIRE_*` constraint the
/// toolkit checks the driver against.
pub fn is_gpu_variable(name: &str) -> bool {
    GPU_VARIABLES.contains(&name) || name.starts_with("NVIDIA_REQUIRE_")
}

/// The rule a job's environment variable `name` breaks when it is a GPU variable.
pub fn gpu_variable_rule(name: &str) -> String {
    format!("{name} is the agent's to set: it gives a job the GPUs of its lease, and no others")
}

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

    /// The team the job counts against (fair share, quotas, the report): its owner, or
    /// `default` when it has none.
    pub fn team(&self) -> &str {
        self.owner.as_deref().unwrap_or("default")
    }

    /// Checks every rule that needs no knowledge of the cluster.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.name.trim().is_empty() {
            return Err(SpecError::new("name", "must not be empty"));
        }
        if self.name.len() > 128 {
            return Err(SpecError::new("name", "must be at most 128 characters"));
        }
        // People tell jobs apart by their names and teams: no character a display hides
        // (zero-width, bidi controls, ...), nor a control character (it is the container's
        // NIGHTSHIFT_JOB_NAME: a NUL stops the container from starting).
        crate::hidden::check(&self.name).map_err(|rule| SpecError::new("name", rule))?;
        if let Some(owner) = &self.owner {
            crate::hidden::check(owner).map_err(|rule| SpecError::new("owner", rule))?;
        }
        if self.image.trim().is_empty() {
            return Err(SpecError::new("image", "must not be empty"));
        }
        if self.image.chars().any(char::is_whitespace) {
            return Err(SpecError::new("image", "must not contain whitespace"));
        }
        image_reference(&self.image).map_err(|rule| SpecError::new("image", rule))?;
        if self.gpus == 0 {
            return Err(SpecError::new("gpus", "must be at least 1"));
        }
        if self.gpus > MAX_GPUS {
            return Err(SpecError::new(
                "gpus",
                format!("must be at most {MAX_GPUS}"),
            ));
        }
        if !(-MAX_PRIORITY..=MAX_PRIORITY).contains(&self.priority) {
            return Err(SpecError::new(
                "priority",
                format!("must be between -{MAX_PRIORITY} and {MAX_PRIORITY}"),
            ));
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
        // u64::MAX seconds overflowed the run deadline (start + limit): the job failed at once.
        if self
            .max_run_seconds
            .is_some_and(|s| !(1..=MAX_RUN_SECONDS).contains(&s))
        {
            return Err(SpecError::new(
                "maxRunSeconds",
                format!("must be between 1 and {MAX_RUN_SECONDS} (a year)"),
            ));
        }
        if !(1..=MAX_BACKOFF_FACTOR).contains(&self.retry.backoff_factor) {
            return Err(SpecError::new(
                "retry.backoffFactor",
                format!("must be between 1 and {MAX_BACKOFF_FACTOR}"),
            ));
        }
        let waits = [
            ("retry.backoffSeconds", self.retry.backoff_seconds),
            ("retry.maxBackoffSeconds", self.retry.max_backoff_seconds),
        ];
        for (field, secs) in waits {
            if secs > MAX_BACKOFF_SECONDS {
                return Err(SpecError::new(
                    field,
                    format!("must be at most {MAX_BACKOFF_SECONDS} (a day)"),
                ));
            }
        }
        // The engine refuses a NUL in the environment and cuts an argument short at one; an
        // empty entrypoint cannot be executed.
        if self.command.first().is_some_and(String::is_empty) {
            return Err(SpecError::new("command[0]", "must not be empty"));
        }
        let words = [("command", &self.command), ("args", &self.args)];
        for (list, words) in words {
            if let Some(i) = words.iter().position(|w| w.contains('\0')) {
                return Err(SpecError::new(
                    format!("{list}[{i}]"),
                    "must not contain a NUL byte",
                ));
            }
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
            if is_gpu_variable(&var.name) {
                return Err(SpecError::new(
                    format!("env[{i}].name"),
                    gpu_variable_rule(&var.name),
                ));
            }
            if var.value.contains('\0') {
                return Err(SpecError::new(
                    format!("env[{i}].value"),
                    "must not contain a NUL byte",
                ));
            }
        }
        let mut paths = Vec::with_capacity(self.files.len());
        for (i, f) in self.files.iter().enumerate() {
            let field = format!("files[{i}].path");
            let path = container_path(&f.path).map_err(|rule| SpecError::new(&field, rule))?;
            if path == "/" || f.path.ends_with('/') {
                return Err(SpecError::new(field, "must be an absolute file path"));
            }
            paths.push(path);
        }
        // Docker cannot place a file inside another file. Each directory above a file is
        // looked up once, so this is linear in the paths' length.
        let mut placed = std::collections::HashMap::with_capacity(paths.len());
        for (i, path) in paths.iter().enumerate() {
            placed.entry(path.as_str()).or_insert(i);
        }
        for (i, path) in paths.iter().enumerate() {
            let mut directories = path.match_indices('/').skip(1).map(|(at, _)| &path[..at]);
            if let Some((directory, j)) = directories.find_map(|d| Some((d, *placed.get(d)?))) {
                return Err(SpecError::new(
                    format!("files[{i}].path"),
                    format!("must not be inside files[{j}].path ({directory}), a file"),
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
            container_path(&f.path)
                .map_err(|rule| SpecError::new(format!("capture.files[{i}].path"), rule))?;
            if f.name.is_empty() || f.name.contains('/') {
                return Err(SpecError::new(
                    format!("capture.files[{i}].name"),
                    "must be a non-empty name without '/'",
                ));
            }
            crate::hidden::check(&f.name)
                .map_err(|rule| SpecError::new(format!("capture.files[{i}].name"), rule))?;
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

/// Whether `image` is a reference Docker accepts: `[host[:port]/]path[:tag][@digest]`, as
/// distribution's reference grammar says, each path component in lower case.
fn image_reference(image: &str) -> Result<(), &'static str> {
    const FORM: &str =
        "must be an image reference, [registry/]name[:tag][@digest], its name in lower case";
    let (rest, digest) = match image.split_once('@') {
        Some((rest, digest)) => (rest, Some(digest)),
        None => (image, None),
    };
    if let Some(digest) = digest {
        let (hex, digits) = match digest.split_once(':') {
            Some(("sha256", hex)) => (hex, 64),
            Some(("sha384", hex)) => (hex, 96),
            Some(("sha512", hex)) => (hex, 128),
            _ => return Err("must end in a digest of sha256, sha384 or sha512, if any"),
        };
        if hex.len() != digits || !hex.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')) {
            return Err("must end in a digest such as @sha256: and 64 lower-case hex digits");
        }
    }
    let (name, tag) = match rest.rfind(':') {
        Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
        _ => (rest, None),
    };
    if let Some(tag) = tag {
        let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
        if tag.is_empty()
            || tag.len() > 128
            || !tag.starts_with(word)
            || !tag.chars().all(|c| word(c) || c == '.' || c == '-')
        {
            return Err("must have a tag of at most 128 letters, digits, '_', '.' and '-'");
        }
    }
    if name.len() > 255 {
        return Err("must have a name of at most 255 characters");
    }
    let mut parts = name.split('/').peekable();
    let first = parts.next().unwrap_or_default();
    let is_host = parts.peek().is_some() && (first.contains(['.', ':']) || first == "localhost");
    let path_start = if is_host {
        if !host(first) {
            return Err(FORM);
        }
        None
    } else {
        Some(first)
    };
    if path_start.into_iter().chain(parts).all(path_component) {
        Ok(())
    } else {
        Err(FORM)
    }
}

/// `host[:port]` of a registry: DNS labels (Docker lets `_` pass too), or an IPv6 address in
/// brackets.
fn host(text: &str) -> bool {
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, Some(port)),
        _ => (text, None),
    };
    if port.is_some_and(|p| p.is_empty() || !p.chars().all(|c| c.is_ascii_digit())) {
        return false;
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return !v6.is_empty() && v6.chars().all(|c| c.is_ascii_hexdigit() || c == ':');
    }
    !host.is_empty()
        && host.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

/// Lower-case letters and digits, joined by `.`, `_`, `__` or a run of `-`.
fn path_component(text: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    if !text.starts_with(alnum) || !text.ends_with(alnum) {
        return false;
    }
    text.split(alnum)
        .filter(|sep| !sep.is_empty())
        .all(|sep| matches!(sep, "." | "_" | "__") || sep.chars().all(|c| c == '-'))
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
    fn gpu_variables_are_the_agents_alone() {
        for name in [
            "NVIDIA_VISIBLE_DEVICES",
            "CUDA_VISIBLE_DEVICES",
            "NVIDIA_DRIVER_CAPABILITIES",
            "NVIDIA_REQUIRE_CUDA",
            "NVIDIA_REQUIRE_ARCH",
            "NVIDIA_DISABLE_REQUIRE",
            "NVIDIA_MIG_CONFIG_DEVICES",
            "NVIDIA_MIG_MONITOR_DEVICES",
            "NVIDIA_IMEX_CHANNELS",
            "ROCR_VISIBLE_DEVICES",
            "HIP_VISIBLE_DEVICES",
            "GPU_DEVICE_ORDINAL",
        ] {
            let mut s = spec();
            s.env = vec![env("HF_HOME", "/data"), env(name, "all")];
            assert_eq!(
                s.validate().unwrap_err().to_string(),
                format!(
                    "env[1].name: {name} is the agent's to set: it gives a job the GPUs of \
                     its lease, and no others"
                )
            );
        }
        // Variables of the same families that choose nothing stay the job's.
        for name in [
            "CUDA_DEVICE_ORDER",
            "NVIDIA_TF32_OVERRIDE",
            "CUDA_LAUNCH_BLOCKING",
            "NCCL_DEBUG",
            "NVIDIA_VISIBLE_DEVICES_X",
        ] {
            let mut s = spec();
            s.env = vec![env(name, "1")];
            assert_eq!(s.validate(), Ok(()), "{name}");
        }
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

    /// A change to a valid spec.
    type Change = fn(&mut JobSpec);

    fn env(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: value.into(),
        }
    }

    fn file(path: &str) -> JobFile {
        JobFile {
            path: path.into(),
            content: "x".into(),
        }
    }

    /// The field `change` makes `validate` refuse, or `None` when it accepts.
    fn refused_field(change: Change) -> Option<String> {
        let mut s = spec();
        change(&mut s);
        s.validate().err().map(|e| e.field)
    }

    #[test]
    fn every_number_is_bounded_naming_its_field() {
        // u64::MAX seconds was accepted, then the job failed at start ("limit reached").
        let past: [(&str, Change); 9] = [
            ("maxRunSeconds", |s| s.max_run_seconds = Some(u64::MAX)),
            ("maxRunSeconds", |s| {
                s.max_run_seconds = Some(MAX_RUN_SECONDS + 1)
            }),
            ("gpus", |s| s.gpus = u32::MAX),
            ("gpus", |s| s.gpus = MAX_GPUS + 1),
            ("priority", |s| s.priority = i32::MAX),
            ("priority", |s| s.priority = i32::MIN),
            ("retry.backoffSeconds", |s| {
                s.retry.backoff_seconds = u32::MAX
            }),
            ("retry.maxBackoffSeconds", |s| {
                s.retry.max_backoff_seconds = u32::MAX
            }),
            ("retry.backoffFactor", |s| s.retry.backoff_factor = u32::MAX),
        ];
        for (field, change) in past {
            assert_eq!(refused_field(change).as_deref(), Some(field));
        }
        let at_the_bounds: [Change; 7] = [
            |s| s.max_run_seconds = Some(MAX_RUN_SECONDS),
            |s| s.gpus = MAX_GPUS,
            |s| s.priority = MAX_PRIORITY,
            |s| s.priority = -MAX_PRIORITY,
            |s| s.retry.backoff_seconds = MAX_BACKOFF_SECONDS,
            |s| s.retry.max_backoff_seconds = MAX_BACKOFF_SECONDS,
            |s| s.retry.backoff_factor = MAX_BACKOFF_FACTOR,
        ];
        for change in at_the_bounds {
            assert_eq!(refused_field(change), None);
        }
        let mut s = spec();
        s.max_run_seconds = Some(u64::MAX);
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "maxRunSeconds: must be between 1 and 31536000 (a year)"
        );
    }

    #[test]
    fn what_the_engine_would_refuse_is_refused_at_submit() {
        // Docker refuses these when it creates or starts the container, or (NUL in an
        // argument) cuts the argument short.
        let refused: [(&str, Change); 20] = [
            ("env[0].value", (|s| s.env = vec![env("A", "x\0y")])),
            ("env[0].name", (|s| s.env = vec![env("A=B", "x")])),
            ("env[0].name", (|s| s.env = vec![env("", "x")])),
            ("env[0].name", (|s| s.env = vec![env("A\0", "x")])),
            ("name", (|s| s.name = "train\0".into())),
            ("command[0]", (|s| s.command = vec!["".into()])),
            (
                "command[1]",
                (|s| s.command = vec!["sh".into(), "a\0b".into()]),
            ),
            ("args[0]", (|s| s.args = vec!["\0".into()])),
            ("image", (|s| s.image = "Trainer:1".into())),
            ("image", (|s| s.image = "trainer:1\0".into())),
            ("image", (|s| s.image = "trainer:".into())),
            ("image", (|s| s.image = "trainer@sha256:abc".into())),
            ("image", (|s| s.image = format!("{}:1", "a".repeat(256)))),
            ("files[0].path", (|s| s.files = vec![file("etc/x")])),
            ("files[0].path", (|s| s.files = vec![file("/etc/../x")])),
            ("files[0].path", (|s| s.files = vec![file("/x\0")])),
            ("files[0].path", (|s| s.files = vec![file("/")])),
            (
                "files[1].path",
                (|s| s.files = vec![file("/a/x"), file("/a/x/y")]),
            ),
            (
                "files[0].path",
                (|s| s.files = vec![file("/a/x/y"), file("/a//x")]),
            ),
            (
                "capture.files[0].path",
                (|s| {
                    s.capture.files = vec![CaptureFile {
                        name: "out".into(),
                        path: "/out/../x".into(),
                    }]
                }),
            ),
        ];
        for (field, change) in refused {
            assert_eq!(refused_field(change).as_deref(), Some(field));
        }
        let accepted: [Change; 6] = [
            |s| s.image = "registry.example.com:5000/team/trainer:1.4".into(),
            |s| s.image = "localhost/a_b__c-d.e/f".into(),
            |s| s.image = format!("trainer@sha256:{}", "a".repeat(64)),
            |s| {
                s.image = format!(
                    "ghcr.io/org/trainer:v1.2.3-rc.1@sha256:{}",
                    "0123456789abcdef".repeat(4)
                )
            },
            |s| s.args = vec!["".into(), "--lr=1e-5".into()],
            |s| {
                s.files = vec![
                    JobFile {
                        path: "/a/x:y,z".into(),
                        content: "\0".into(),
                    },
                    JobFile {
                        path: "/a/xy".into(),
                        content: String::new(),
                    },
                ]
            },
        ];
        for change in accepted {
            assert_eq!(refused_field(change), None);
        }
        // As many files as a 1 MiB body holds are checked at once, not pair by pair.
        let mut s = spec();
        s.files = (0..30_000).map(|i| file(&format!("/d/{i}/f"))).collect();
        let started = std::time::Instant::now();
        assert_eq!(s.validate(), Ok(()));
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn names_people_read_refuse_characters_a_display_hides() {
        let capture = |name: &str| Capture {
            files: vec![CaptureFile {
                name: name.into(),
                path: "/out/x".into(),
            }],
            stdout: false,
        };
        let cases: [(&str, &str, JobSpec); 6] = [
            ("name", "U+200B (zero width space)", {
                let mut s = spec();
                s.name = "bobjob\u{200b}".into();
                s
            }),
            ("name", "U+202E (right-to-left override)", {
                let mut s = spec();
                s.name = "eval-\u{202e}nur".into();
                s
            }),
            ("name", "U+2066 (left-to-right isolate)", {
                let mut s = spec();
                s.name = "\u{2066}train".into();
                s
            }),
            ("name", "U+0009 (tab)", {
                let mut s = spec();
                s.name = "a\tb".into();
                s
            }),
            ("owner", "U+FEFF (zero width no-break space)", {
                let mut s = spec();
                s.owner = Some("\u{feff}nlp".into());
                s
            }),
            ("capture.files[0].name", "U+200D (zero width joiner)", {
                let mut s = spec();
                s.capture = capture("lo\u{200d}ss");
                s
            }),
        ];
        for (field, what, s) in cases {
            assert_eq!(
                s.validate().unwrap_err().to_string(),
                format!("{field}: {what} is not allowed")
            );
        }
        let mut s = spec();
        s.name = "Training run: llama-7B, é 日本".into();
        s.owner = Some("vision team".into());
        s.capture = capture("loss");
        assert_eq!(s.validate(), Ok(()));
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
