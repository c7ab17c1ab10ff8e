//! Job policy: what a job may ask for, checked at submission. A refusal is a 403 that names
//! the rule (`policy.allowed_images`, `policy.max_gpus_per_job`, ...) and the job's field.
//!
//! The job file has no way to ask for a privileged container, host namespaces, added
//! capabilities, devices or host mounts, and unknown fields are refused anyway; a request
//! that tries (Kubernetes' field names) is answered with the rule instead of a bare
//! "unknown field", so that the researcher knows it is policy, not a typo.

use serde::Deserialize;

/// `[policy]` of coordinator.toml.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Image prefixes a job may use (`registry.example.com/research/`); empty allows any.
    pub allowed_images: Vec<String>,
    /// Most GPUs one job may ask for; 0 for no limit.
    pub max_gpus_per_job: u32,
    /// Most GPUs the unfinished jobs of one owner (team) may ask for together; 0 for no
    /// limit.
    pub max_gpus_per_team: u32,
}

/// A job that breaks a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{rule}: {message}")]
pub struct PolicyError {
    pub rule: &'static str,
    pub field: String,
    pub message: String,
}

/// Fields of a container spec that would escape the job's sandbox.
const ESCAPES: &[(&str, &str)] = &[
    ("privileged", "privileged containers"),
    (
        "securityContext",
        "security contexts (privileged, capabilities)",
    ),
    ("capabilities", "added capabilities"),
    ("hostNetwork", "the host's network namespace"),
    ("hostPID", "the host's PID namespace"),
    ("hostIPC", "the host's IPC namespace"),
    ("devices", "host devices"),
    ("volumes", "host mounts"),
    ("volumeMounts", "host mounts"),
    ("hostPath", "host mounts"),
];

/// Refuses a raw job that asks for anything of [`ESCAPES`].
pub fn check_escapes(raw: &serde_json::Value) -> Result<(), PolicyError> {
    let Some(fields) = raw.as_object() else {
        return Ok(());
    };
    for (field, what) in ESCAPES {
        if fields.contains_key(*field) {
            return Err(PolicyError {
                rule: "policy.sandbox",
                field: (*field).to_owned(),
                message: format!(
                    "{field}: jobs may not use {what}; they run unprivileged with only their \
                     leased GPUs and their checkpoint directory"
                ),
            });
        }
    }
    Ok(())
}

impl PolicyConfig {
    /// Checks a job asking for `gpus` GPUs with `image`, whose owner already has
    /// `owner_gpus` GPUs asked for by unfinished jobs.
    pub fn check(&self, image: &str, gpus: u32, owner_gpus: u32) -> Result<(), PolicyError> {
        if !self.allowed_images.is_empty()
            && !self
                .allowed_images
                .iter()
                .any(|p| image.starts_with(p.as_str()))
        {
            return Err(PolicyError {
                rule: "policy.allowed_images",
                field: "image".into(),
                message: format!(
                    "image {image} is not under an allowed prefix ({})",
                    self.allowed_images.join(", ")
                ),
            });
        }
        if self.max_gpus_per_job > 0 && gpus > self.max_gpus_per_job {
            return Err(PolicyError {
                rule: "policy.max_gpus_per_job",
                field: "gpus".into(),
                message: format!(
                    "{gpus} GPUs asked, at most {} per job",
                    self.max_gpus_per_job
                ),
            });
        }
        if self.max_gpus_per_team > 0 && owner_gpus + gpus > self.max_gpus_per_team {
            return Err(PolicyError {
                rule: "policy.max_gpus_per_team",
                field: "gpus".into(),
                message: format!(
                    "the owner's unfinished jobs already ask for {owner_gpus} GPUs; {gpus} more \
                     would pass the team limit of {}",
                    self.max_gpus_per_team
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_is_named() {
        let policy = PolicyConfig {
            allowed_images: vec!["registry.example.com/research/".into()],
            max_gpus_per_job: 4,
            max_gpus_per_team: 8,
        };
        assert_eq!(
            policy.check("registry.example.com/research/sft:1", 4, 4),
            Ok(())
        );
        let e = policy.check("docker.io/evil:1", 1, 0).unwrap_err();
        assert_eq!(
            (e.rule, e.field.as_str()),
            ("policy.allowed_images", "image")
        );
        assert_eq!(
            policy
                .check("registry.example.com/research/x", 5, 0)
                .unwrap_err()
                .rule,
            "policy.max_gpus_per_job"
        );
        let e = policy
            .check("registry.example.com/research/x", 2, 7)
            .unwrap_err();
        assert_eq!(e.rule, "policy.max_gpus_per_team");
        assert!(PolicyConfig::default().check("anything", 100, 100).is_ok());
    }

    #[test]
    fn a_privileged_job_is_refused_by_rule() {
        let raw = serde_json::json!({"name": "a", "image": "b", "gpus": 1, "privileged": true});
        let e = check_escapes(&raw).unwrap_err();
        assert_eq!((e.rule, e.field.as_str()), ("policy.sandbox", "privileged"));
        assert!(
            e.to_string()
                .starts_with("policy.sandbox: privileged: jobs may not use privileged containers")
        );
        assert!(check_escapes(&serde_json::json!({"name": "a"})).is_ok());
    }
}
