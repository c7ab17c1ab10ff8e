//! From the YAML tree to a [`Workflow`], field by field: every field is either understood,
//! or refused with its line, as an unknown field or as an Argo feature nightshift does not
//! run.

use std::collections::BTreeMap;

use nightshift_common::{CHECKPOINT_SIGNALS, MAX_GRACE_SECONDS};

use crate::diagnostic::{Diagnostic, Diagnostics, Rule};
use crate::duration;
use crate::workflow::*;
use crate::yaml::{Key, Node};

mod unsupported;

use unsupported::*;

/// The annotation prefix of nightshift's own settings.
pub const EXTRAS_PREFIX: &str = "nightshift.io/";

/// The fields of one mapping, looked up by name.
struct Fields<'a> {
    line: usize,
    entries: BTreeMap<&'a str, (&'a Key, &'a Node)>,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Node> {
        self.entries
            .get(name)
            .map(|(_, n)| *n)
            .filter(|n| !n.is_null())
    }

    fn key_line(&self, name: &str) -> usize {
        self.entries.get(name).map_or(self.line, |(k, _)| k.line)
    }
}

#[derive(Default)]
struct Decoder {
    diags: Diagnostics,
}

/// Decodes a parsed document. Every problem found is reported, not only the first.
pub fn decode(doc: &Node) -> Result<Workflow, Diagnostics> {
    let mut d = Decoder::default();
    let wf = d.workflow(doc);
    match wf {
        Some(wf) if d.diags.is_empty() => Ok(wf),
        _ => Err(d.diags.sorted()),
    }
}

impl Decoder {
    fn err(&mut self, line: usize, rule: Rule, message: impl Into<String>) {
        self.diags.push(Diagnostic::new(line, rule, message));
    }

    /// A name people read (the workflow's, a template's, a step's, an output's) holds no
    /// character a display hides ([`nightshift_common::hidden`]), as a job's name does not.
    fn visible(&mut self, name: &Located, what: &str) {
        if let Err(rule) = nightshift_common::hidden::check(&name.text) {
            self.err(name.line, Rule::InvalidValue, format!("{what}: {rule}"));
        }
    }

    fn fields<'a>(
        &mut self,
        node: &'a Node,
        what: &str,
        known: &[&str],
        unsupported: &[(&str, &str)],
    ) -> Option<Fields<'a>> {
        let Some(map) = node.map() else {
            self.err(
                node.line,
                Rule::InvalidValue,
                format!("{what} must be a mapping, not {}", node.kind()),
            );
            return None;
        };
        let mut entries = BTreeMap::new();
        for (key, value) in map {
            if let Some((_, hint)) = unsupported.iter().find(|(k, _)| *k == key.name) {
                self.err(
                    key.line,
                    Rule::UnsupportedFeature,
                    format!("`{}` in {what}: {hint}", key.name),
                );
            } else if !known.contains(&key.name.as_str()) {
                self.err(
                    key.line,
                    Rule::UnknownField,
                    format!(
                        "`{}` is not a field of {what} (known: {})",
                        key.name,
                        known.join(", ")
                    ),
                );
            } else if entries.insert(key.name.as_str(), (key, value)).is_some() {
                self.err(
                    key.line,
                    Rule::DuplicateName,
                    format!("`{}` appears twice in {what}", key.name),
                );
            }
        }
        Some(Fields {
            line: node.line,
            entries,
        })
    }

    fn string(&mut self, node: &Node, what: &str) -> Option<Located> {
        match node.scalar() {
            Some(s) => Some(Located::new(s, node.line)),
            None => {
                self.err(
                    node.line,
                    Rule::InvalidValue,
                    format!("{what} must be a string, not {}", node.kind()),
                );
                None
            }
        }
    }

    fn required(&mut self, f: &Fields<'_>, name: &str, what: &str) -> Option<Located> {
        match f.get(name) {
            Some(n) => self.string(n, &format!("{what}.{name}")),
            None => {
                self.err(f.line, Rule::MissingField, format!("{what} needs `{name}`"));
                None
            }
        }
    }

    fn optional(&mut self, f: &Fields<'_>, name: &str, what: &str) -> Option<Located> {
        f.get(name)
            .and_then(|n| self.string(n, &format!("{what}.{name}")))
    }

    fn strings(&mut self, node: &Node, what: &str) -> Vec<Located> {
        match node.seq() {
            Some(items) => items
                .iter()
                .filter_map(|n| self.string(n, &format!("each of {what}")))
                .collect(),
            None => {
                self.err(
                    node.line,
                    Rule::InvalidValue,
                    format!("{what} must be a list of strings"),
                );
                Vec::new()
            }
        }
    }

    fn seq<'a>(&mut self, node: &'a Node, what: &str) -> &'a [Node] {
        match node.seq() {
            Some(items) => items,
            None => {
                self.err(
                    node.line,
                    Rule::InvalidValue,
                    format!("{what} must be a list, not {}", node.kind()),
                );
                &[]
            }
        }
    }

    fn number(&mut self, node: &Node, what: &str) -> Option<u64> {
        let parsed = node.scalar().and_then(|s| s.trim().parse::<u64>().ok());
        if parsed.is_none() {
            self.err(
                node.line,
                Rule::InvalidValue,
                format!("{what} must be a whole number"),
            );
        }
        parsed
    }

    fn boolean(&mut self, node: &Node, what: &str) -> bool {
        match node.scalar() {
            Some("true" | "True" | "TRUE") => true,
            Some("false" | "False" | "FALSE") => false,
            _ => {
                self.err(
                    node.line,
                    Rule::InvalidValue,
                    format!("{what} must be true or false"),
                );
                false
            }
        }
    }

    fn workflow(&mut self, doc: &Node) -> Option<Workflow> {
        let top = self.fields(
            doc,
            "the workflow",
            &["apiVersion", "kind", "metadata", "spec", "status"],
            &[],
        )?;
        match top.get("apiVersion").and_then(Node::scalar) {
            Some("argoproj.io/v1alpha1") => {}
            other => self.err(
                top.key_line("apiVersion"),
                Rule::NotAWorkflow,
                format!(
                    "apiVersion must be argoproj.io/v1alpha1, not {}",
                    other.unwrap_or("missing")
                ),
            ),
        }
        match top.get("kind").and_then(Node::scalar) {
            Some("Workflow") => {}
            other => self.err(
                top.key_line("kind"),
                if matches!(
                    other,
                    Some("WorkflowTemplate" | "CronWorkflow" | "ClusterWorkflowTemplate")
                ) {
                    Rule::UnsupportedFeature
                } else {
                    Rule::NotAWorkflow
                },
                format!("kind must be Workflow, not {}", other.unwrap_or("missing")),
            ),
        }
        if top.get("status").is_some() {
            self.err(
                top.key_line("status"),
                Rule::InvalidValue,
                "a submitted workflow has no status; remove it",
            );
        }
        let (name, extras) = match top.get("metadata") {
            Some(m) => self.metadata(m)?,
            None => {
                self.err(
                    top.line,
                    Rule::MissingField,
                    "the workflow needs `metadata`",
                );
                return None;
            }
        };
        let Some(spec_node) = top.get("spec") else {
            self.err(top.line, Rule::MissingField, "the workflow needs `spec`");
            return None;
        };
        let spec = self.fields(
            spec_node,
            "spec",
            &[
                "entrypoint",
                "arguments",
                "templates",
                "onExit",
                "parallelism",
                "activeDeadlineSeconds",
            ],
            UNSUPPORTED_SPEC,
        )?;
        let entrypoint = self.required(&spec, "entrypoint", "spec");
        let arguments = match spec.get("arguments") {
            Some(n) => self.arguments(n, "spec.arguments", false).0,
            None => Vec::new(),
        };
        let templates = match spec.get("templates") {
            Some(n) => self
                .seq(n, "spec.templates")
                .iter()
                .filter_map(|t| self.template(t))
                .collect(),
            None => {
                self.err(spec.line, Rule::MissingField, "spec needs `templates`");
                Vec::new()
            }
        };
        let on_exit = self.optional(&spec, "onExit", "spec");
        let parallelism = spec
            .get("parallelism")
            .and_then(|n| self.number(n, "spec.parallelism"))
            .map(|n| n.min(u64::from(u32::MAX)) as u32);
        let active_deadline_seconds = spec
            .get("activeDeadlineSeconds")
            .and_then(|n| self.number(n, "spec.activeDeadlineSeconds"));
        Some(Workflow {
            name,
            entrypoint: entrypoint?,
            arguments,
            templates,
            on_exit,
            parallelism,
            active_deadline_seconds,
            extras,
        })
    }

    /// The workflow's name and nightshift settings.
    fn metadata(&mut self, node: &Node) -> Option<(String, Extras)> {
        let m = self.fields(
            node,
            "metadata",
            &["name", "generateName", "namespace", "labels", "annotations"],
            &[],
        )?;
        let name = match self.optional(&m, "name", "metadata") {
            Some(n) => Some((n, "metadata.name")),
            None => self
                .optional(&m, "generateName", "metadata")
                .map(|n| (n, "metadata.generateName")),
        };
        if let Some((n, field)) = &name {
            self.visible(n, field);
        }
        let name = name
            .map(|(n, _)| n.text.trim_end_matches('-').to_owned())
            .unwrap_or_default();
        if name.is_empty() {
            self.err(
                m.line,
                Rule::MissingField,
                "metadata needs `name` or `generateName`",
            );
        }
        if let Some(labels) = m.get("labels") {
            self.string_map(labels, "metadata.labels");
        }
        let extras = match m.get("annotations") {
            Some(a) => self.extras(a, "metadata.annotations"),
            None => Extras::default(),
        };
        Some((name, extras))
    }

    fn string_map(&mut self, node: &Node, what: &str) -> Vec<(Key, Located)> {
        let Some(map) = node.map() else {
            self.err(
                node.line,
                Rule::InvalidValue,
                format!("{what} must be a mapping"),
            );
            return Vec::new();
        };
        map.iter()
            .filter_map(|(k, v)| {
                let value = self.string(v, &format!("{what}.{}", k.name))?;
                Some((k.clone(), value))
            })
            .collect()
    }

    fn extras(&mut self, node: &Node, what: &str) -> Extras {
        let mut extras = Extras::default();
        for (key, value) in self.string_map(node, what) {
            let Some(setting) = key.name.strip_prefix(EXTRAS_PREFIX) else {
                continue;
            };
            let text = value.text.trim();
            let bad = |rule: &str| {
                Diagnostic::new(
                    value.line,
                    Rule::InvalidValue,
                    format!("annotation {}: {rule}", key.name),
                )
            };
            match setting {
                "priority" => match text.parse() {
                    Ok(p) => extras.priority = Some(p),
                    Err(_) => self.diags.push(bad("must be a whole number")),
                },
                "owner" => match nightshift_common::hidden::check(text) {
                    Ok(()) => extras.owner = Some(text.to_owned()),
                    Err(rule) => self.diags.push(bad(&rule)),
                },
                "checkpoint-signal" => {
                    if CHECKPOINT_SIGNALS.contains(&text) {
                        extras.checkpoint_signal = Some(text.to_owned());
                    } else {
                        self.diags.push(bad(&format!(
                            "must be one of {}",
                            CHECKPOINT_SIGNALS.join(", ")
                        )));
                    }
                }
                "grace-period-seconds" => match text.parse::<u32>() {
                    Ok(g) if g <= MAX_GRACE_SECONDS => extras.grace_period_seconds = Some(g),
                    _ => self.diags.push(bad(&format!(
                        "must be a whole number of seconds up to {MAX_GRACE_SECONDS}"
                    ))),
                },
                _ => self.err(
                    key.line,
                    Rule::UnknownField,
                    format!(
                        "unknown nightshift annotation {} (known: {EXTRAS_PREFIX}priority, \
                         {EXTRAS_PREFIX}owner, {EXTRAS_PREFIX}checkpoint-signal, \
                         {EXTRAS_PREFIX}grace-period-seconds)",
                        key.name
                    ),
                ),
            }
        }
        extras
    }

    /// `arguments` of the workflow or of a step: parameters (and artifacts, for steps).
    fn arguments(
        &mut self,
        node: &Node,
        what: &str,
        artifacts_allowed: bool,
    ) -> (Vec<Parameter>, Vec<Artifact>) {
        let known: &[&str] = if artifacts_allowed {
            &["parameters", "artifacts"]
        } else {
            &["parameters"]
        };
        let unsupported: &[(&str, &str)] = if artifacts_allowed {
            &[]
        } else {
            &[(
                "artifacts",
                "workflow-level artifacts are not supported; produce them in a step",
            )]
        };
        let Some(f) = self.fields(node, what, known, unsupported) else {
            return (Vec::new(), Vec::new());
        };
        let params = match f.get("parameters") {
            Some(n) => self.parameters(n, &format!("{what}.parameters"), true),
            None => Vec::new(),
        };
        let artifacts = match f.get("artifacts") {
            Some(n) => self.artifacts(n, &format!("{what}.artifacts"), ArtifactKind::Argument),
            None => Vec::new(),
        };
        (params, artifacts)
    }

    fn parameters(&mut self, node: &Node, what: &str, is_argument: bool) -> Vec<Parameter> {
        let mut out: Vec<Parameter> = Vec::new();
        for p in self.seq(node, what) {
            let Some(f) = self.fields(
                p,
                &format!("a parameter of {what}"),
                &["name", "value", "default", "enum", "description"],
                &[
                    (
                        "valueFrom",
                        "parameters from config maps or files are not supported; give a value",
                    ),
                    ("globalName", "global output parameters are not supported"),
                ],
            ) else {
                continue;
            };
            let Some(name) = self.required(&f, "name", &format!("a parameter of {what}")) else {
                continue;
            };
            let value = self.optional(&f, "value", "the parameter");
            let default = self.optional(&f, "default", "the parameter");
            if is_argument && default.is_some() {
                self.err(
                    f.key_line("default"),
                    Rule::InvalidValue,
                    "an argument has a value, not a default",
                );
            }
            let allowed = match f.get("enum") {
                Some(n) => self
                    .strings(n, "enum")
                    .into_iter()
                    .map(|l| l.text)
                    .collect(),
                None => Vec::new(),
            };
            if out.iter().any(|o| o.name.text == name.text) {
                self.err(
                    name.line,
                    Rule::DuplicateName,
                    format!("parameter {} appears twice in {what}", name.text),
                );
            }
            out.push(Parameter {
                name,
                value,
                default,
                allowed,
            });
        }
        out
    }

    fn template(&mut self, node: &Node) -> Option<Template> {
        let named = node
            .map()
            .and_then(|m| m.iter().find(|(k, _)| k.name == "name"))
            .and_then(|(_, v)| v.scalar())
            .map_or_else(|| "a template".to_owned(), |n| format!("template {n}"));
        let f = self.fields(
            node,
            &named,
            &[
                "name",
                "inputs",
                "outputs",
                "container",
                "steps",
                "dag",
                "retryStrategy",
                "activeDeadlineSeconds",
                "timeout",
                "parallelism",
                "metadata",
            ],
            UNSUPPORTED_TEMPLATE,
        )?;
        let name = self.required(&f, "name", "a template")?;
        self.visible(&name, "a template's name");
        let what = format!("template {}", name.text);
        let (inputs, input_artifacts) = match f.get("inputs") {
            Some(n) => self.inputs(n, &what),
            None => (Vec::new(), Vec::new()),
        };
        let (outputs, output_artifacts) = match f.get("outputs") {
            Some(n) => self.outputs(n, &what),
            None => (Vec::new(), Vec::new()),
        };
        let bodies: Vec<&str> = ["container", "steps", "dag"]
            .into_iter()
            .filter(|k| f.get(k).is_some())
            .collect();
        let body = match bodies.as_slice() {
            ["container"] => Body::Container(self.container(f.get("container")?, &what)?),
            ["steps"] => Body::Steps(self.steps(f.get("steps")?, &what)),
            ["dag"] => Body::Dag(self.dag(f.get("dag")?, &what)),
            [] => {
                self.err(
                    name.line,
                    Rule::MissingField,
                    format!("{what} needs one of container, steps or dag"),
                );
                return None;
            }
            _ => {
                self.err(
                    name.line,
                    Rule::InvalidValue,
                    format!("{what} has {}: give only one", bodies.join(" and ")),
                );
                return None;
            }
        };
        // `dag.failFast`, read here because it belongs to the template's behaviour.
        let fail_fast = f
            .get("dag")
            .and_then(Node::map)
            .and_then(|m| m.iter().find(|(k, _)| k.name == "failFast"))
            .is_none_or(|(_, v)| self.boolean(v, "dag.failFast"));
        let retry = f.get("retryStrategy").and_then(|n| self.retry(n, &what));
        let active_deadline_seconds = self.optional(&f, "activeDeadlineSeconds", &what);
        if let Some(a) = &active_deadline_seconds
            && !a.text.contains("{{")
            && a.text.trim().parse::<u64>().is_err()
        {
            self.err(
                a.line,
                Rule::InvalidValue,
                format!("{what}.activeDeadlineSeconds must be a whole number of seconds"),
            );
        }
        let timeout = self.optional(&f, "timeout", &what);
        if let Some(t) = &timeout
            && !t.text.contains("{{")
            && duration::parse_ms(&t.text).is_none()
        {
            self.err(
                t.line,
                Rule::InvalidValue,
                format!("{what}.timeout must be a duration such as \"30s\" or \"2h\""),
            );
        }
        let parallelism = f
            .get("parallelism")
            .and_then(|n| self.number(n, &format!("{what}.parallelism")))
            .map(|n| n.min(u64::from(u32::MAX)) as u32);
        let extras = match f.get("metadata") {
            Some(m) => {
                let mf = self.fields(
                    m,
                    &format!("{what}.metadata"),
                    &["labels", "annotations"],
                    &[],
                );
                match mf.as_ref().and_then(|mf| mf.get("annotations")) {
                    Some(a) => self.extras(a, &format!("{what}.metadata.annotations")),
                    None => Extras::default(),
                }
            }
            None => Extras::default(),
        };
        Some(Template {
            name,
            inputs,
            input_artifacts,
            outputs,
            output_artifacts,
            body,
            retry,
            active_deadline_seconds,
            timeout,
            parallelism,
            fail_fast,
            extras,
        })
    }

    fn inputs(&mut self, node: &Node, what: &str) -> (Vec<Parameter>, Vec<Artifact>) {
        let Some(f) = self.fields(
            node,
            &format!("{what}.inputs"),
            &["parameters", "artifacts"],
            &[],
        ) else {
            return (Vec::new(), Vec::new());
        };
        let params = match f.get("parameters") {
            Some(n) => self.parameters(n, &format!("{what}.inputs.parameters"), false),
            None => Vec::new(),
        };
        let artifacts = match f.get("artifacts") {
            Some(n) => self.artifacts(n, &format!("{what}.inputs.artifacts"), ArtifactKind::Input),
            None => Vec::new(),
        };
        (params, artifacts)
    }

    fn outputs(&mut self, node: &Node, what: &str) -> (Vec<OutputParameter>, Vec<Artifact>) {
        let Some(f) = self.fields(
            node,
            &format!("{what}.outputs"),
            &["parameters", "artifacts"],
            &[(
                "result",
                "outputs.result is set by nightshift from the step's standard output",
            )],
        ) else {
            return (Vec::new(), Vec::new());
        };
        let mut params: Vec<OutputParameter> = Vec::new();
        if let Some(n) = f.get("parameters") {
            let list = format!("{what}.outputs.parameters");
            for p in self.seq(n, &list) {
                let Some(pf) = self.fields(
                    p,
                    &format!("an output parameter of {what}"),
                    &["name", "valueFrom", "description"],
                    &[("globalName", "global output parameters are not supported")],
                ) else {
                    continue;
                };
                let Some(name) = self.required(&pf, "name", "an output parameter") else {
                    continue;
                };
                self.visible(&name, "an output parameter's name");
                let Some(vf) = pf.get("valueFrom") else {
                    self.err(
                        pf.line,
                        Rule::MissingField,
                        format!("output parameter {} needs valueFrom", name.text),
                    );
                    continue;
                };
                let Some(vf) = self.fields(
                    vf,
                    &format!("valueFrom of output parameter {}", name.text),
                    &["path", "parameter", "default"],
                    &[
                        (
                            "jsonPath",
                            "only valueFrom.path and valueFrom.parameter are supported",
                        ),
                        (
                            "jqFilter",
                            "only valueFrom.path and valueFrom.parameter are supported",
                        ),
                        (
                            "expression",
                            "only valueFrom.path and valueFrom.parameter are supported",
                        ),
                        (
                            "event",
                            "only valueFrom.path and valueFrom.parameter are supported",
                        ),
                        (
                            "supplied",
                            "only valueFrom.path and valueFrom.parameter are supported",
                        ),
                        ("configMapKeyRef", "config maps are Kubernetes objects"),
                    ],
                ) else {
                    continue;
                };
                let default = self.optional(&vf, "default", "valueFrom").map(|l| l.text);
                let source = match (
                    self.optional(&vf, "path", "valueFrom"),
                    self.optional(&vf, "parameter", "valueFrom"),
                ) {
                    (Some(path), None) => OutputSource::Path(path.text),
                    (None, Some(param)) => OutputSource::Parameter(param),
                    _ => {
                        self.err(vf.line, Rule::InvalidValue, format!("valueFrom of output parameter {} needs exactly one of path or parameter", name.text));
                        continue;
                    }
                };
                if params.iter().any(|o| o.name.text == name.text) {
                    self.err(
                        name.line,
                        Rule::DuplicateName,
                        format!("output parameter {} appears twice", name.text),
                    );
                }
                params.push(OutputParameter {
                    name,
                    source,
                    default,
                });
            }
        }
        let artifacts = match f.get("artifacts") {
            Some(n) => self.artifacts(
                n,
                &format!("{what}.outputs.artifacts"),
                ArtifactKind::Output,
            ),
            None => Vec::new(),
        };
        (params, artifacts)
    }

    fn artifacts(&mut self, node: &Node, what: &str, kind: ArtifactKind) -> Vec<Artifact> {
        let mut out: Vec<Artifact> = Vec::new();
        for a in self.seq(node, what) {
            let Some(f) = self.fields(
                a,
                &format!("an artifact of {what}"),
                &["name", "path", "from"],
                UNSUPPORTED_ARTIFACT,
            ) else {
                continue;
            };
            let Some(name) = self.required(&f, "name", "an artifact") else {
                continue;
            };
            self.visible(&name, "an artifact's name");
            let path = self.optional(&f, "path", "the artifact").map(|p| p.text);
            let from = self.optional(&f, "from", "the artifact");
            match kind {
                ArtifactKind::Argument if from.is_none() => self.err(
                    name.line,
                    Rule::MissingField,
                    format!("artifact argument {} needs `from`", name.text),
                ),
                ArtifactKind::Argument if path.is_some() => self.err(
                    f.key_line("path"),
                    Rule::InvalidValue,
                    format!(
                        "artifact argument {}: the path belongs to the template's input",
                        name.text
                    ),
                ),
                ArtifactKind::Input if from.is_some() => self.err(
                    f.key_line("from"),
                    Rule::InvalidValue,
                    format!(
                        "input artifact {}: `from` belongs to the step's arguments",
                        name.text
                    ),
                ),
                _ => {}
            }
            if let Some(p) = &path
                && !p.starts_with('/')
            {
                self.err(
                    f.key_line("path"),
                    Rule::InvalidValue,
                    format!("artifact {}: path must be absolute", name.text),
                );
            }
            if out.iter().any(|o| o.name.text == name.text) {
                self.err(
                    name.line,
                    Rule::DuplicateName,
                    format!("artifact {} appears twice in {what}", name.text),
                );
            }
            out.push(Artifact { name, path, from });
        }
        out
    }

    fn container(&mut self, node: &Node, what: &str) -> Option<Container> {
        let what = format!("{what}.container");
        let f = self.fields(
            node,
            &what,
            &[
                "image",
                "command",
                "args",
                "env",
                "resources",
                "imagePullPolicy",
                "name",
            ],
            UNSUPPORTED_CONTAINER,
        )?;
        let image = self.required(&f, "image", &what)?;
        let command = match f.get("command") {
            Some(n) => self.strings(n, &format!("{what}.command")),
            None => Vec::new(),
        };
        let args = match f.get("args") {
            Some(n) => self.strings(n, &format!("{what}.args")),
            None => Vec::new(),
        };
        let mut env = Vec::new();
        if let Some(n) = f.get("env") {
            for e in self.seq(n, &format!("{what}.env")) {
                let Some(ef) = self.fields(
                    e,
                    &format!("an env entry of {what}"),
                    &["name", "value"],
                    &[(
                        "valueFrom",
                        "secrets and config maps are Kubernetes objects; give a value",
                    )],
                ) else {
                    continue;
                };
                let Some(name) = self.required(&ef, "name", "an env entry") else {
                    continue;
                };
                let value = self
                    .optional(&ef, "value", "an env entry")
                    .unwrap_or_else(|| Located::new("", name.line));
                let valid = !name.text.is_empty()
                    && !name.text.starts_with(|c: char| c.is_ascii_digit())
                    && name
                        .text
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_');
                if !valid {
                    self.err(name.line, Rule::InvalidValue, format!("env name {:?} must be letters, digits and '_', not starting with a digit", name.text));
                } else if name.text.starts_with("NIGHTSHIFT_") {
                    self.err(
                        name.line,
                        Rule::InvalidValue,
                        "the NIGHTSHIFT_ prefix is reserved for variables the agent sets",
                    );
                } else if nightshift_common::is_gpu_variable(&name.text) {
                    self.err(
                        name.line,
                        Rule::InvalidValue,
                        format!("env: {}", nightshift_common::gpu_variable_rule(&name.text)),
                    );
                }
                env.push((name.text, value));
            }
        }
        let gpus = match f.get("resources") {
            Some(n) => self.gpus(n, &what),
            None => 0,
        };
        if let Some(p) = f.get("imagePullPolicy")
            && !matches!(p.scalar(), Some("Always" | "IfNotPresent" | "Never"))
        {
            self.err(p.line, Rule::InvalidValue, "imagePullPolicy must be Always, IfNotPresent or Never (the agent pulls an image its host lacks, whatever the policy)");
        }
        Some(Container {
            line: f.line,
            image,
            command,
            args,
            env,
            gpus,
        })
    }

    /// `resources.limits["nvidia.com/gpu"]` (or `requests`, which must then agree).
    fn gpus(&mut self, node: &Node, what: &str) -> u32 {
        let what = format!("{what}.resources");
        let Some(f) = self.fields(
            node,
            &what,
            &["limits", "requests"],
            &[("claims", "resource claims are not supported")],
        ) else {
            return 0;
        };
        let mut found = Vec::new();
        for part in ["limits", "requests"] {
            let Some(n) = f.get(part) else { continue };
            for (key, value) in self.string_map(n, &format!("{what}.{part}")) {
                match key.name.as_str() {
                    "nvidia.com/gpu" => match value.text.trim().parse::<u32>() {
                        Ok(g) => found.push((g, value.line)),
                        Err(_) => self.err(
                            value.line,
                            Rule::InvalidValue,
                            "nvidia.com/gpu must be a whole number of GPUs",
                        ),
                    },
                    // CPU and memory are not reserved: a step gets its GPUs' host.
                    "cpu" | "memory" | "ephemeral-storage" => {}
                    other => self.err(
                        key.line,
                        Rule::UnsupportedFeature,
                        format!(
                            "resource {other} is not supported; only nvidia.com/gpu is reserved"
                        ),
                    ),
                }
            }
        }
        if let [(a, _), (b, line)] = found.as_slice()
            && a != b
        {
            self.err(
                *line,
                Rule::InvalidValue,
                "GPU requests must equal GPU limits",
            );
        }
        found.first().map_or(0, |(g, _)| *g)
    }

    fn retry(&mut self, node: &Node, what: &str) -> Option<RetryStrategy> {
        let what = format!("{what}.retryStrategy");
        let f = self.fields(
            node,
            &what,
            &["limit", "retryPolicy", "backoff"],
            &[
                ("affinity", "retry affinity is not supported"),
                ("expression", "retry expressions are not supported"),
            ],
        )?;
        let limit = match f.get("limit") {
            Some(n) => Some(self.number(n, &format!("{what}.limit"))?.min(1000) as u32),
            None => None,
        };
        let policy = match f.get("retryPolicy").and_then(Node::scalar) {
            None => RetryPolicy::OnFailure,
            Some("OnFailure") => RetryPolicy::OnFailure,
            Some("OnError") => RetryPolicy::OnError,
            Some("OnTransientError") => RetryPolicy::OnTransientError,
            Some("Always") => RetryPolicy::Always,
            Some(other) => {
                self.err(
                    f.key_line("retryPolicy"),
                    Rule::InvalidValue,
                    format!("retryPolicy {other:?} must be Always, OnFailure, OnError or OnTransientError"),
                );
                RetryPolicy::OnFailure
            }
        };
        let backoff = match f.get("backoff") {
            Some(b) => {
                let bf = self.fields(
                    b,
                    &format!("{what}.backoff"),
                    &["duration", "factor", "maxDuration", "cap"],
                    &[],
                )?;
                let mut dur = |name: &str| -> Option<u64> {
                    let l = self.optional(&bf, name, "backoff")?;
                    let ms = duration::parse_ms(&l.text);
                    if ms.is_none() {
                        self.err(
                            l.line,
                            Rule::InvalidValue,
                            format!("backoff.{name} must be a duration such as \"10\" or \"2m\""),
                        );
                    }
                    ms
                };
                let duration_ms = dur("duration").unwrap_or(0);
                let max_duration_ms = dur("maxDuration");
                let cap_ms = dur("cap");
                let factor = match self.optional(&bf, "factor", "backoff") {
                    Some(l) => match l.text.trim().parse::<f64>() {
                        Ok(x) if x >= 1.0 && x.is_finite() => x,
                        _ => {
                            self.err(
                                l.line,
                                Rule::InvalidValue,
                                "backoff.factor must be a number of at least 1",
                            );
                            1.0
                        }
                    },
                    None => 1.0,
                };
                Some(Backoff {
                    duration_ms,
                    factor,
                    max_duration_ms,
                    cap_ms,
                })
            }
            None => None,
        };
        Some(RetryStrategy {
            limit,
            policy,
            backoff,
        })
    }

    fn steps(&mut self, node: &Node, what: &str) -> Vec<Vec<Step>> {
        let mut groups = Vec::new();
        for group in self.seq(node, &format!("{what}.steps")) {
            let Some(items) = group.seq() else {
                self.err(group.line, Rule::InvalidValue, format!("{what}.steps is a list of lists: each inner list runs in parallel (write `- - name: ...`)"));
                continue;
            };
            groups.push(
                items
                    .iter()
                    .filter_map(|s| self.step(s, what, false))
                    .collect(),
            );
        }
        groups
    }

    fn dag(&mut self, node: &Node, what: &str) -> Vec<Step> {
        let Some(f) = self.fields(
            node,
            &format!("{what}.dag"),
            &["tasks", "failFast", "target"],
            &[],
        ) else {
            return Vec::new();
        };
        if f.get("target").is_some() {
            self.err(
                f.key_line("target"),
                Rule::UnsupportedFeature,
                "dag.target is not supported; every task runs",
            );
        }
        match f.get("tasks") {
            Some(n) => self
                .seq(n, &format!("{what}.dag.tasks"))
                .iter()
                .filter_map(|s| self.step(s, what, true))
                .collect(),
            None => {
                self.err(
                    f.line,
                    Rule::MissingField,
                    format!("{what}.dag needs `tasks`"),
                );
                Vec::new()
            }
        }
    }

    fn step(&mut self, node: &Node, what: &str, dag: bool) -> Option<Step> {
        let kind = if dag { "a task" } else { "a step" };
        let mut known = vec![
            "name",
            "template",
            "arguments",
            "withItems",
            "withParam",
            "when",
            "continueOn",
            "onExit",
        ];
        if dag {
            known.extend(["depends", "dependencies"]);
        }
        let f = self.fields(node, &format!("{kind} of {what}"), &known, UNSUPPORTED_STEP)?;
        let name = self.required(&f, "name", kind)?;
        self.visible(&name, &format!("{kind}'s name"));
        let template = self.required(&f, "template", &format!("{kind} {}", name.text))?;
        let (arguments, artifacts) = match f.get("arguments") {
            Some(n) => self.arguments(n, &format!("arguments of {}", name.text), true),
            None => (Vec::new(), Vec::new()),
        };
        let loop_over = match (f.get("withItems"), f.get("withParam")) {
            (Some(_), Some(_)) => {
                self.err(
                    name.line,
                    Rule::InvalidValue,
                    "give withItems or withParam, not both",
                );
                None
            }
            (Some(items), None) => {
                let list = self
                    .seq(items, "withItems")
                    .iter()
                    .map(Node::to_json)
                    .collect();
                Some(Loop::Items(list, items.line))
            }
            (None, Some(p)) => self.string(p, "withParam").map(Loop::Param),
            (None, None) => None,
        };
        let when = self.optional(&f, "when", kind);
        let continue_on = match f.get("continueOn") {
            Some(n) => {
                let cf = self.fields(n, "continueOn", &["failed", "error"], &[])?;
                ContinueOn {
                    failed: cf
                        .get("failed")
                        .is_some_and(|v| self.boolean(v, "continueOn.failed")),
                    error: cf
                        .get("error")
                        .is_some_and(|v| self.boolean(v, "continueOn.error")),
                }
            }
            None => ContinueOn::default(),
        };
        let on_exit = self.optional(&f, "onExit", kind);
        let depends = match (f.get("depends"), f.get("dependencies")) {
            (Some(_), Some(_)) => {
                self.err(
                    name.line,
                    Rule::InvalidValue,
                    "give depends or dependencies, not both",
                );
                None
            }
            (Some(d), None) => self.string(d, "depends"),
            (None, Some(list)) => {
                let names = self.strings(list, "dependencies");
                (!names.is_empty()).then(|| {
                    Located::new(
                        names
                            .iter()
                            .map(|n| n.text.as_str())
                            .collect::<Vec<_>>()
                            .join(" && "),
                        list.line,
                    )
                })
            }
            (None, None) => None,
        };
        Some(Step {
            name,
            template,
            arguments,
            artifacts,
            loop_over,
            when,
            continue_on,
            on_exit,
            depends,
        })
    }
}

#[derive(Clone, Copy)]
enum ArtifactKind {
    Input,
    Output,
    Argument,
}
