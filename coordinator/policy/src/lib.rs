//! Job policy: what a job may ask for, checked at submission by one admission
//! ([`PolicyConfig::admit`]) for a job submitted alone and for each pipeline step. A refusal
//! names the rule (`policy.allowed_images`, `policy.allow_privileged`, ...) and the job's
//! field; the coordinator answers it with a 403.
//!
//! Pure rules on a [`JobSpec`]: no I/O, no clock. What the rules need of the cluster (the
//! GPUs a team's unfinished jobs ask for) is passed in.
//!
//! A job asks for privileges only through its `sandbox:` section ([`Sandbox`]): a privileged
//! container, the host's network or PID namespace, added capabilities, host devices, host
//! mounts. Each is refused unless `[policy]` allows it (a switch, or an allowlist of
//! capabilities, device and mount path prefixes), or an admin token submits the job (the
//! waiver is written to the audit log). Image prefixes and GPU limits hold for everyone. A request that uses Kubernetes' field names at the
//! top level is answered with the rule instead of a bare "unknown field", so that the
//! researcher knows it is policy, not a typo.
//!
//! Limits on GPUs hold per job and per team, and a limit on run time per job
//! (`max_run_seconds_per_job`, filled into a job that names none); `[policy.teams.NAME]`
//! overrides them for one team. The same rules admit a pipeline's steps.

use std::collections::BTreeMap;

use nightshift_common::JobSpec;
use nightshift_common::sandbox::{self, Sandbox};
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
    /// `sandbox.privileged`.
    pub allow_privileged: bool,
    /// `sandbox.hostNetwork`.
    pub allow_host_network: bool,
    /// `sandbox.hostPid`.
    pub allow_host_pid: bool,
    /// Capabilities a job may add (`IPC_LOCK`); `sandbox.capAdd` outside it is refused.
    pub allowed_capabilities: Vec<String>,
    /// Device path prefixes a job may be given (`/dev/infiniband`).
    pub allowed_devices: Vec<String>,
    /// Host path prefixes a job may mount (`/datasets`), compared by whole components after
    /// normalisation; `..` is refused. Symbolic links on the hosts are not resolved: list
    /// only trees that researchers cannot write links into.
    pub host_mount_allowlist: Vec<String>,
    /// Most seconds one job may run, summed over its attempts; 0 for no limit. A job that
    /// asks for no limit (`maxRunSeconds`) gets this one; one that asks for more is refused.
    pub max_run_seconds_per_job: u64,
    /// Per-team overrides of the GPU and run-time limits, by owner.
    pub teams: BTreeMap<String, TeamPolicy>,
}

/// `[policy.teams.NAME]`: limits for one team instead of the defaults.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeamPolicy {
    /// Replaces `max_gpus_per_team` for this team (0 for no limit).
    pub max_gpus: Option<u32>,
    /// Replaces `max_gpus_per_job` for this team's jobs (0 for no limit).
    pub max_gpus_per_job: Option<u32>,
    /// Replaces `max_run_seconds_per_job` for this team's jobs (0 for no limit).
    pub max_run_seconds: Option<u64>,
}

/// A job that breaks a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{rule}: {message}")]
pub struct PolicyError {
    pub rule: &'static str,
    pub field: String,
    pub message: String,
}

/// Who submits a job, as far as admission is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submitter<'a> {
    /// Submits as any owner, under every rule: the open API (no tokens yet), an operator's
    /// token, a pipeline's step.
    Anyone,
    /// Submits only as this team: a researcher's token (`None`: a researcher of no team,
    /// whose jobs have no owner).
    Team(Option<&'a str>),
    /// Submits as any owner and may be let past the sandbox's rules: an admin's token.
    Admin,
}

/// A job that admission let in: its spec as it is to be queued (its owner and run-time
/// limit filled in), and the sandbox rules an admin was let past.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub spec: JobSpec,
    pub waived: Vec<PolicyError>,
}

/// Why admission refused a job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A researcher's job owned by another team than its token's.
    #[error("submits only as its team: owner must be {team}, not {owner}")]
    NotItsTeam { team: String, owner: String },
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl Refusal {
    /// The job's field the refusal is about.
    pub fn field(&self) -> &str {
        match self {
            Self::NotItsTeam { .. } => "owner",
            Self::Policy(e) => &e.field,
        }
    }
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

/// Refuses a job whose top-level fields (`fields`, as sent, whether or not they are a
/// [`JobSpec`]'s) ask for anything of [`ESCAPES`].
pub fn check_escapes<'a>(fields: impl IntoIterator<Item = &'a str>) -> Result<(), PolicyError> {
    let fields: Vec<&str> = fields.into_iter().collect();
    for (field, what) in ESCAPES {
        if fields.contains(field) {
            return Err(PolicyError {
                rule: "policy.sandbox",
                field: (*field).to_owned(),
                message: format!(
                    "{field}: jobs may not use {what} this way; ask for it under `sandbox:` \
                     (privileged, hostNetwork, hostPid, capAdd, devices, mounts), which \
                     policy refuses unless an admin allows it"
                ),
            });
        }
    }
    Ok(())
}

fn refusal(rule: &'static str, field: impl Into<String>, message: String) -> PolicyError {
    PolicyError {
        rule,
        field: field.into(),
        message,
    }
}

impl PolicyConfig {
    /// The rules of the configuration itself: `(key, rule)` of the first one broken.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let lists = [
            ("host_mount_allowlist", &self.host_mount_allowlist),
            ("allowed_devices", &self.allowed_devices),
        ];
        for (key, list) in lists {
            for (i, prefix) in list.iter().enumerate() {
                sandbox::normal_path(prefix)
                    .map_err(|rule| (format!("policy.{key}[{i}]"), rule.to_owned()))?;
            }
        }
        let run_limits = self.teams.iter().filter_map(|(team, t)| {
            Some((
                format!("policy.teams.{team}.max_run_seconds"),
                t.max_run_seconds?,
            ))
        });
        let run_limits = [(
            "policy.max_run_seconds_per_job".to_owned(),
            self.max_run_seconds_per_job,
        )]
        .into_iter()
        .chain(run_limits);
        for (key, secs) in run_limits {
            if secs > nightshift_common::MAX_RUN_SECONDS {
                let most = nightshift_common::MAX_RUN_SECONDS;
                return Err((
                    key,
                    format!("must be at most {most} (a year), the most a job may ask for"),
                ));
            }
        }
        Ok(())
    }

    /// The GPU limits for jobs of `owner`: (per job, per team); 0 for no limit.
    fn gpu_limits(&self, owner: Option<&str>) -> (u32, u32) {
        let team = owner.and_then(|o| self.teams.get(o));
        (
            team.and_then(|t| t.max_gpus_per_job)
                .unwrap_or(self.max_gpus_per_job),
            team.and_then(|t| t.max_gpus)
                .unwrap_or(self.max_gpus_per_team),
        )
    }

    /// Admits a job submitted by `who`: the one admission of every job, whether submitted
    /// alone (`POST /v1/jobs`) or launched as a pipeline's step. In order: the submitter's
    /// team ([`Submitter::Team`]: the job's owner is set to it, and refused when another),
    /// the rules that hold for everyone (images, GPU limits; `owner_gpus` tells the GPUs an
    /// owner's unfinished jobs already ask for, and is asked only under a team limit), the
    /// run-time limit (filled in when the job names none), then the sandbox, which only an
    /// admin may be let past: each rule waived is in [`Admitted::waived`], for the audit log.
    /// A refused job is not queued; the rule refused first is returned.
    pub fn admit(
        &self,
        who: Submitter<'_>,
        mut spec: JobSpec,
        owner_gpus: impl FnOnce(Option<&str>) -> u32,
    ) -> Result<Admitted, Refusal> {
        if let Submitter::Team(team) = who {
            match (&spec.owner, team) {
                (Some(owner), Some(team)) if owner != team => {
                    return Err(Refusal::NotItsTeam {
                        team: team.to_owned(),
                        owner: owner.clone(),
                    });
                }
                _ => spec.owner = team.map(str::to_owned),
            }
        }
        let owner = spec.owner.as_deref();
        let owner_gpus = if self.gpu_limits(owner).1 > 0 {
            owner_gpus(owner)
        } else {
            0
        };
        self.check(&spec.image, spec.gpus, owner, owner_gpus)?;
        spec.max_run_seconds = self.run_limit(owner, spec.max_run_seconds)?;
        let mut broken = self.check_sandbox(&spec.sandbox);
        if !broken.is_empty() && who != Submitter::Admin {
            return Err(broken.swap_remove(0).into());
        }
        Ok(Admitted {
            spec,
            waived: broken,
        })
    }

    /// The run-time limit a job of `owner` that asks for `asked` runs under.
    fn run_limit(
        &self,
        owner: Option<&str>,
        asked: Option<u64>,
    ) -> Result<Option<u64>, PolicyError> {
        let team = owner.and_then(|o| self.teams.get(o).map(|t| (o, t)));
        let (limit, scope) = match team.and_then(|(o, t)| Some((o, t.max_run_seconds?))) {
            Some((o, limit)) => (limit, format!("the limit of team {o} (max_run_seconds)")),
            None => (self.max_run_seconds_per_job, "the limit".to_owned()),
        };
        match asked {
            _ if limit == 0 => Ok(asked),
            None => Ok(Some(limit)),
            Some(asked) if asked > limit => Err(refusal(
                "policy.max_run_seconds_per_job",
                "maxRunSeconds",
                format!("{asked} s of run time asked, at most {limit} s per job ({scope})"),
            )),
            Some(asked) => Ok(Some(asked)),
        }
    }

    /// Checks a job of `owner` asking for `gpus` GPUs with `image`, whose owner already has
    /// `owner_gpus` GPUs asked for by unfinished jobs.
    pub fn check(
        &self,
        image: &str,
        gpus: u32,
        owner: Option<&str>,
        owner_gpus: u32,
    ) -> Result<(), PolicyError> {
        if !self.allowed_images.is_empty()
            && !self
                .allowed_images
                .iter()
                .any(|p| image.starts_with(p.as_str()))
        {
            return Err(refusal(
                "policy.allowed_images",
                "image",
                format!(
                    "image {image} is not under an allowed prefix ({})",
                    self.allowed_images.join(", ")
                ),
            ));
        }
        let (per_job, per_team) = self.gpu_limits(owner);
        let scope = |key: &str| match owner {
            Some(o) if self.teams.contains_key(o) => format!("the limit of team {o} ({key})"),
            _ => "the limit".to_owned(),
        };
        if per_job > 0 && gpus > per_job {
            return Err(refusal(
                "policy.max_gpus_per_job",
                "gpus",
                format!(
                    "{gpus} GPUs asked, at most {per_job} per job ({})",
                    scope("max_gpus_per_job")
                ),
            ));
        }
        if per_team > 0 && owner_gpus + gpus > per_team {
            return Err(refusal(
                "policy.max_gpus_per_team",
                "gpus",
                format!(
                    "the owner's unfinished jobs already ask for {owner_gpus} GPUs; {gpus} more \
                     would pass {} of {per_team}",
                    scope("max_gpus")
                ),
            ));
        }
        Ok(())
    }

    /// Checks what a job's `sandbox:` asks for. Every broken rule, in the order of the
    /// section's fields (an admin's waiver names them all in the audit log).
    pub fn check_sandbox(&self, sandbox: &Sandbox) -> Vec<PolicyError> {
        let mut refused = Vec::new();
        let switches = [
            (
                sandbox.privileged,
                self.allow_privileged,
                "policy.allow_privileged",
                "sandbox.privileged",
                "a privileged container",
            ),
            (
                sandbox.host_network,
                self.allow_host_network,
                "policy.allow_host_network",
                "sandbox.hostNetwork",
                "the host's network namespace",
            ),
            (
                sandbox.host_pid,
                self.allow_host_pid,
                "policy.allow_host_pid",
                "sandbox.hostPid",
                "the host's PID namespace",
            ),
        ];
        for (asked, allowed, rule, field, what) in switches {
            if asked && !allowed {
                refused.push(refusal(
                    rule,
                    field,
                    format!("{field}: {what} is not allowed (an admin may set {rule} = true)"),
                ));
            }
        }
        for (i, cap) in sandbox.cap_add.iter().enumerate() {
            let name = sandbox::capability(cap);
            if !self
                .allowed_capabilities
                .iter()
                .any(|a| sandbox::capability(a) == name)
            {
                refused.push(refusal(
                    "policy.allowed_capabilities",
                    format!("sandbox.capAdd[{i}]"),
                    format!(
                        "sandbox.capAdd[{i}]: capability {name} is not in \
                         policy.allowed_capabilities ({})",
                        shown(&self.allowed_capabilities)
                    ),
                ));
            }
        }
        let paths = sandbox
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                (
                    d,
                    format!("sandbox.devices[{i}]"),
                    "policy.allowed_devices",
                    &self.allowed_devices,
                )
            })
            .chain(sandbox.mounts.iter().enumerate().map(|(i, m)| {
                (
                    &m.host,
                    format!("sandbox.mounts[{i}].host"),
                    "policy.host_mount_allowlist",
                    &self.host_mount_allowlist,
                )
            }));
        for (path, field, rule, allowed) in paths {
            let normal = match sandbox::normal_path(path) {
                Ok(p) => p,
                Err(why) => {
                    refused.push(refusal(rule, field.clone(), format!("{field}: {why}")));
                    continue;
                }
            };
            let covered = allowed.iter().any(|prefix| {
                sandbox::normal_path(prefix).is_ok_and(|prefix| sandbox::is_under(&normal, &prefix))
            });
            if !covered {
                refused.push(refusal(
                    rule,
                    field.clone(),
                    format!("{field}: {normal} is outside {rule} ({})", shown(allowed)),
                ));
            }
        }
        refused
    }
}

fn shown(list: &[String]) -> String {
    if list.is_empty() {
        "empty".to_owned()
    } else {
        list.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nightshift_common::Mount;

    #[test]
    fn each_rule_is_named() {
        let policy = PolicyConfig {
            allowed_images: vec!["registry.example.com/research/".into()],
            max_gpus_per_job: 4,
            max_gpus_per_team: 8,
            ..PolicyConfig::default()
        };
        let image = "registry.example.com/research/sft:1";
        assert_eq!(policy.check(image, 4, Some("nlp"), 4), Ok(()));
        let e = policy.check("docker.io/evil:1", 1, None, 0).unwrap_err();
        assert_eq!(
            (e.rule, e.field.as_str()),
            ("policy.allowed_images", "image")
        );
        assert_eq!(
            policy.check(image, 5, None, 0).unwrap_err().rule,
            "policy.max_gpus_per_job"
        );
        let e = policy.check(image, 2, Some("nlp"), 7).unwrap_err();
        assert_eq!(e.rule, "policy.max_gpus_per_team");
        assert!(
            PolicyConfig::default()
                .check("anything", 100, None, 100)
                .is_ok()
        );
    }

    #[test]
    fn a_team_section_overrides_the_gpu_limits_for_that_team_only() {
        let policy = policy_from(serde_json::json!({
            "max_gpus_per_job": 4,
            "max_gpus_per_team": 8,
            "teams": {"vision": {"max_gpus": 32, "max_gpus_per_job": 16}},
        }));
        let image = "trainer:1";
        assert_eq!(policy.check(image, 16, Some("vision"), 16), Ok(()));
        let e = policy.check(image, 17, Some("vision"), 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "policy.max_gpus_per_job: 17 GPUs asked, at most 16 per job (the limit of team \
             vision (max_gpus_per_job))"
        );
        let e = policy.check(image, 8, Some("vision"), 30).unwrap_err();
        assert_eq!(e.rule, "policy.max_gpus_per_team");
        assert!(
            e.message
                .contains("the limit of team vision (max_gpus) of 32")
        );
        // Other teams keep the defaults.
        assert_eq!(
            policy.check(image, 5, Some("nlp"), 0).unwrap_err().rule,
            "policy.max_gpus_per_job"
        );
        assert_eq!(
            policy.check(image, 4, Some("nlp"), 6).unwrap_err().rule,
            "policy.max_gpus_per_team"
        );
    }

    #[test]
    fn the_run_time_limit_is_filled_in_or_enforced_per_team() {
        let policy = policy_from(serde_json::json!({
            "max_run_seconds_per_job": 3600,
            "teams": {"vision": {"max_run_seconds": 86400}, "infra": {"max_run_seconds": 0}},
        }));
        let job = |owner: Option<&str>, asked: Option<u64>| {
            let mut spec = JobSpec::new("j", "trainer:1", 1);
            spec.owner = owner.map(str::to_owned);
            spec.max_run_seconds = asked;
            spec
        };
        let admitted = |spec: JobSpec| {
            policy
                .admit(Submitter::Anyone, spec, |_| 0)
                .map(|a| a.spec.max_run_seconds)
                .map_err(|e| match e {
                    Refusal::Policy(e) => e,
                    e => panic!("{e}"),
                })
        };
        // A job that names no limit runs under the policy's; one that asks less keeps it.
        assert_eq!(admitted(job(None, None)), Ok(Some(3600)));
        assert_eq!(admitted(job(None, Some(600))), Ok(Some(600)));
        let e = admitted(job(Some("nlp"), Some(7200))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "policy.max_run_seconds_per_job: 7200 s of run time asked, at most 3600 s per job \
             (the limit)"
        );
        assert_eq!(e.field, "maxRunSeconds");
        // A team's own limit, and a team with none.
        assert_eq!(admitted(job(Some("vision"), None)), Ok(Some(86400)));
        assert_eq!(admitted(job(Some("vision"), Some(7200))), Ok(Some(7200)));
        let e = admitted(job(Some("vision"), Some(90000))).unwrap_err();
        assert!(
            e.message
                .ends_with("at most 86400 s per job (the limit of team vision (max_run_seconds))"),
            "{e}"
        );
        assert_eq!(admitted(job(Some("infra"), None)), Ok(None));
        assert_eq!(
            admitted(job(Some("infra"), Some(1 << 40))),
            Ok(Some(1 << 40))
        );
        // No policy, no limit.
        let spec = job(None, None);
        let a = PolicyConfig::default().admit(Submitter::Anyone, spec.clone(), |_| 0);
        assert_eq!(a.map(|a| a.spec), Ok(spec));
        // The other rules come first.
        let mut spec = job(None, None);
        spec.gpus = 9;
        let strict = PolicyConfig {
            max_gpus_per_job: 8,
            ..policy.clone()
        };
        let e = strict.admit(Submitter::Anyone, spec, |_| 0).unwrap_err();
        assert_eq!(
            (e.to_string().split(':').next(), e.field()),
            (Some("policy.max_gpus_per_job"), "gpus")
        );
    }

    #[test]
    fn a_team_submits_as_itself_and_only_an_admin_passes_the_sandbox() {
        let policy = PolicyConfig {
            max_gpus_per_team: 4,
            ..PolicyConfig::default()
        };
        let job = |owner: Option<&str>| {
            let mut spec = JobSpec::new("j", "trainer:1", 2);
            spec.owner = owner.map(str::to_owned);
            spec
        };
        let asked = |owner: Option<&str>| if owner == Some("nlp") { 2 } else { 0 };
        // A researcher's job is its team's: the owner filled in, or refused when another.
        let a = policy
            .admit(Submitter::Team(Some("nlp")), job(None), asked)
            .unwrap();
        assert_eq!(a.spec.owner.as_deref(), Some("nlp"));
        let e = policy
            .admit(Submitter::Team(Some("nlp")), job(Some("vision")), asked)
            .unwrap_err();
        assert_eq!(
            (e.to_string().as_str(), e.field()),
            (
                "submits only as its team: owner must be nlp, not vision",
                "owner"
            )
        );
        let a = policy
            .admit(Submitter::Team(None), job(Some("vision")), asked)
            .unwrap();
        assert_eq!(
            a.spec.owner, None,
            "a researcher of no team submits for no team"
        );
        // The team's GPUs are counted for the team the job was given.
        let e = policy
            .admit(
                Submitter::Team(Some("nlp")),
                JobSpec::new("j", "t:1", 3),
                asked,
            )
            .unwrap_err();
        assert_eq!(e.field(), "gpus");
        // Anyone else submits as any owner.
        let a = policy
            .admit(Submitter::Anyone, job(Some("vision")), asked)
            .unwrap();
        assert_eq!(a.spec.owner.as_deref(), Some("vision"));

        let mut privileged = job(None);
        privileged.sandbox.privileged = true;
        privileged.sandbox.host_pid = true;
        let e = policy
            .admit(Submitter::Anyone, privileged.clone(), asked)
            .unwrap_err();
        assert_eq!(e.field(), "sandbox.privileged");
        let a = policy.admit(Submitter::Admin, privileged, asked).unwrap();
        let waived: Vec<&str> = a.waived.iter().map(|e| e.rule).collect();
        assert_eq!(waived, ["policy.allow_privileged", "policy.allow_host_pid"]);
        assert!(a.spec.sandbox.privileged);
    }

    /// `[policy]` as a file sets it (the coordinator's config tests read the TOML itself).
    fn policy_from(section: serde_json::Value) -> PolicyConfig {
        serde_json::from_value(section).unwrap()
    }

    fn rules(policy: &PolicyConfig, sandbox: &Sandbox) -> Vec<(&'static str, String)> {
        policy
            .check_sandbox(sandbox)
            .into_iter()
            .map(|e| (e.rule, e.field))
            .collect()
    }

    fn mount(host: &str) -> Mount {
        Mount {
            host: host.into(),
            path: "/data".into(),
            read_only: true,
        }
    }

    #[test]
    fn every_sandbox_field_is_refused_by_default_naming_its_rule() {
        let everything = Sandbox {
            privileged: true,
            host_network: true,
            host_pid: true,
            cap_add: vec!["SYS_ADMIN".into()],
            devices: vec!["/dev/fuse".into()],
            mounts: vec![mount("/datasets/a")],
        };
        let policy = PolicyConfig::default();
        assert_eq!(
            rules(&policy, &everything),
            [
                ("policy.allow_privileged", "sandbox.privileged".to_owned()),
                ("policy.allow_host_network", "sandbox.hostNetwork".into()),
                ("policy.allow_host_pid", "sandbox.hostPid".into()),
                ("policy.allowed_capabilities", "sandbox.capAdd[0]".into()),
                ("policy.allowed_devices", "sandbox.devices[0]".into()),
                (
                    "policy.host_mount_allowlist",
                    "sandbox.mounts[0].host".into()
                ),
            ]
        );
        assert_eq!(
            policy.check_sandbox(&everything)[0].to_string(),
            "policy.allow_privileged: sandbox.privileged: a privileged container is not \
             allowed (an admin may set policy.allow_privileged = true)"
        );
        assert!(policy.check_sandbox(&Sandbox::default()).is_empty());
    }

    #[test]
    fn allowed_switches_and_lists_let_a_sandbox_through() {
        let policy = PolicyConfig {
            allow_privileged: true,
            allow_host_network: true,
            allow_host_pid: true,
            allowed_capabilities: vec!["CAP_IPC_LOCK".into()],
            allowed_devices: vec!["/dev/infiniband".into()],
            host_mount_allowlist: vec!["/datasets/".into(), "/scratch".into()],
            ..PolicyConfig::default()
        };
        let sandbox = Sandbox {
            privileged: true,
            host_network: true,
            host_pid: true,
            cap_add: vec!["IPC_LOCK".into()],
            devices: vec!["/dev/infiniband/uverbs0".into()],
            mounts: vec![mount("/datasets/imagenet"), mount("/scratch//run/./1")],
        };
        assert!(policy.check_sandbox(&sandbox).is_empty());

        // Outside the lists: another capability, a sibling directory with the same prefix,
        // a `..` escape, another device.
        let outside = Sandbox {
            cap_add: vec!["SYS_ADMIN".into()],
            mounts: vec![mount("/datasets-private"), mount("/datasets/../etc")],
            devices: vec!["/dev/fuse".into()],
            ..Sandbox::default()
        };
        let errors = policy.check_sandbox(&outside);
        let shown: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "policy.allowed_capabilities: sandbox.capAdd[0]: capability SYS_ADMIN is not in \
                 policy.allowed_capabilities (CAP_IPC_LOCK)",
                "policy.allowed_devices: sandbox.devices[0]: /dev/fuse is outside \
                 policy.allowed_devices (/dev/infiniband)",
                "policy.host_mount_allowlist: sandbox.mounts[0].host: /datasets-private is \
                 outside policy.host_mount_allowlist (/datasets/, /scratch)",
                "policy.host_mount_allowlist: sandbox.mounts[1].host: must not contain '..'",
            ]
        );
    }

    #[test]
    fn a_bad_allowlist_entry_is_a_configuration_error() {
        let policy = PolicyConfig {
            host_mount_allowlist: vec!["/datasets".into(), "scratch".into()],
            ..PolicyConfig::default()
        };
        assert_eq!(
            policy.validate(),
            Err((
                "policy.host_mount_allowlist[1]".to_owned(),
                "must be an absolute path".to_owned()
            ))
        );
        assert_eq!(PolicyConfig::default().validate(), Ok(()));
    }

    #[test]
    fn a_run_time_limit_no_job_could_ask_for_is_a_configuration_error() {
        // Filled into every job that names none, it would get each refused at submit.
        let mut policy = PolicyConfig {
            max_run_seconds_per_job: nightshift_common::MAX_RUN_SECONDS + 1,
            ..PolicyConfig::default()
        };
        let rule = "must be at most 31536000 (a year), the most a job may ask for".to_owned();
        assert_eq!(
            policy.validate(),
            Err(("policy.max_run_seconds_per_job".to_owned(), rule.clone()))
        );
        policy.max_run_seconds_per_job = nightshift_common::MAX_RUN_SECONDS;
        policy.teams.insert(
            "nlp".into(),
            TeamPolicy {
                max_run_seconds: Some(u64::MAX),
                ..TeamPolicy::default()
            },
        );
        assert_eq!(
            policy.validate(),
            Err(("policy.teams.nlp.max_run_seconds".to_owned(), rule))
        );
    }

    #[test]
    fn a_kubernetes_field_at_the_top_level_is_refused_by_rule() {
        let e = check_escapes(["name", "image", "gpus", "privileged"]).unwrap_err();
        assert_eq!((e.rule, e.field.as_str()), ("policy.sandbox", "privileged"));
        assert!(
            e.to_string()
                .starts_with("policy.sandbox: privileged: jobs may not use privileged containers")
        );
        assert!(e.message.contains("under `sandbox:`"));
        assert!(check_escapes(["name"]).is_ok());
    }
}
