//! Creating the nodes of a run: a template called with arguments, a step unfolded over its
//! loop items, or a node that never runs (skipped by `when`, omitted by `depends`).

use std::collections::BTreeMap;

use nightshift_common::UnixMillis;

use super::{
    ARTIFACT_PREFIX, Kind, MAX_LOOP_SCOPE_BYTES, MAX_RUN_NODES, NodeId, Phase, Run, RunNode,
};
use crate::duration;
use crate::scope::{Scope, json_text};
use crate::when;
use crate::workflow::{Body, ContinueOn, Loop, Step};

impl Run {
    /// Creates the node of template `template` called with `args`, under `parent`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn create(
        &mut self,
        now: UnixMillis,
        parent: Option<NodeId>,
        name: &str,
        step: &str,
        template: &str,
        args: &BTreeMap<String, String>,
        continue_on: ContinueOn,
        on_exit: Option<String>,
    ) -> NodeId {
        let id = self.nodes.len();
        let mut node = RunNode {
            id,
            parent,
            name: name.to_owned(),
            step: step.to_owned(),
            template: template.to_owned(),
            kind: Kind::Container,
            phase: Phase::Pending,
            message: None,
            children: Vec::new(),
            scope: Scope::default(),
            outputs: BTreeMap::new(),
            artifacts: BTreeMap::new(),
            result: None,
            continue_on,
            retries: 0,
            launched: false,
            retry_at: None,
            deadline: None,
            active_deadline_ms: None,
            created_at: now,
            started_at: None,
            finished_at: None,
            on_exit,
            hook: None,
        };
        if let Some(p) = parent {
            self.nodes[p].children.push(id);
        }
        let Some(t) = self.wf.template(template).cloned() else {
            node.phase = Phase::Errored;
            node.message = Some(format!("template {template} does not exist"));
            node.finished_at = Some(now);
            self.nodes.push(node);
            return id;
        };
        let mut scope = self.globals(now);
        let mut missing = None;
        for input in &t.inputs {
            let value = args
                .get(&input.name.text)
                .cloned()
                .or_else(|| input.value.as_ref().map(|v| v.text.clone()))
                .or_else(|| input.default.as_ref().map(|v| v.text.clone()));
            match value {
                Some(v) => scope.set(format!("inputs.parameters.{}", input.name.text), v),
                None => missing = Some(format!("parameter {}", input.name.text)),
            }
        }
        for a in &t.input_artifacts {
            match args.get(&format!("{ARTIFACT_PREFIX}{}", a.name.text)) {
                Some(v) => scope.set(format!("inputs.artifacts.{}", a.name.text), v.clone()),
                None => missing = Some(format!("artifact {}", a.name.text)),
            }
        }
        node.kind = match &t.body {
            Body::Container(_) => Kind::Container,
            Body::Steps(_) => Kind::Steps {
                group: 0,
                children: Vec::new(),
            },
            Body::Dag(_) => Kind::Dag {
                tasks: BTreeMap::new(),
            },
        };
        if let Some(m) = missing {
            node.phase = Phase::Errored;
            node.message = Some(format!("input {m} has no value"));
            node.finished_at = Some(now);
        } else {
            let timeout = t.timeout.as_ref().map(|l| scope.fill(&l.text));
            let active = t
                .active_deadline_seconds
                .as_ref()
                .map(|l| scope.fill(&l.text));
            match (timeout, active) {
                (Some(Ok(text)), _) if duration::parse_ms(&text).is_none() => {
                    node.phase = Phase::Errored;
                    node.message = Some(format!("timeout {text:?} is not a duration"));
                }
                (Some(Err(e)), _) | (_, Some(Err(e))) => {
                    node.phase = Phase::Errored;
                    node.message = Some(format!("{{{{{e}}}}} is not known here"));
                }
                (timeout, active) => {
                    node.deadline = timeout
                        .and_then(|t| t.ok())
                        .and_then(|t| duration::parse_ms(&t))
                        .map(|ms| now + ms);
                    node.active_deadline_ms = active
                        .and_then(|a| a.ok())
                        .and_then(|a| a.trim().parse::<u64>().ok())
                        .map(|s| s * 1000);
                }
            }
            if node.phase == Phase::Errored {
                node.finished_at = Some(now);
            } else {
                node.phase = Phase::Running;
                node.started_at = Some(now);
            }
        }
        node.scope = scope;
        if matches!(node.kind, Kind::Container) && node.phase == Phase::Running {
            node.phase = Phase::Pending;
            node.started_at = None;
        }
        self.nodes.push(node);
        id
    }

    /// A node that never runs: skipped by `when`, omitted by `depends`, or broken.
    pub(super) fn create_final(
        &mut self,
        now: UnixMillis,
        parent: NodeId,
        name: &str,
        step: &Step,
        phase: Phase,
        message: Option<String>,
    ) -> NodeId {
        let id = self.nodes.len();
        self.nodes[parent].children.push(id);
        self.nodes.push(RunNode {
            id,
            parent: Some(parent),
            name: name.to_owned(),
            step: step.name.text.clone(),
            template: step.template.text.clone(),
            kind: Kind::Container,
            phase,
            message,
            children: Vec::new(),
            scope: Scope::default(),
            outputs: BTreeMap::new(),
            artifacts: BTreeMap::new(),
            result: None,
            continue_on: step.continue_on,
            retries: 0,
            launched: false,
            retry_at: None,
            deadline: None,
            active_deadline_ms: None,
            created_at: now,
            started_at: None,
            finished_at: Some(now),
            on_exit: None,
            hook: None,
        });
        id
    }

    /// Starts step `s` of the steps or DAG node `parent`, seeing `scope`.
    pub(super) fn start_step(
        &mut self,
        now: UnixMillis,
        parent: NodeId,
        s: &Step,
        scope: &Scope,
    ) -> NodeId {
        let name = format!("{}.{}", self.nodes[parent].name, s.name.text);
        let items = match &s.loop_over {
            None => return self.start_one(now, parent, &name, s, scope),
            Some(Loop::Items(items, _)) => Ok(items.clone()),
            Some(Loop::Param(p)) => scope
                .fill(&p.text)
                .map_err(|e| format!("withParam: {{{{{e}}}}} is not known here"))
                .and_then(
                    |text| match serde_json::from_str::<serde_json::Value>(&text) {
                        Ok(serde_json::Value::Array(items)) => Ok(items),
                        _ => Err(format!("withParam {text:?} is not a JSON list")),
                    },
                ),
        };
        let items = items.and_then(|items| {
            // 300 kB of withParam once unfolded into 100,000 nodes and 24 GB.
            let scopes = items.len().saturating_mul(scope.bytes());
            if self.nodes.len() + items.len() >= MAX_RUN_NODES || scopes > MAX_LOOP_SCOPE_BYTES {
                return Err(format!(
                    "{} items would take the run past its limits of {MAX_RUN_NODES} steps and \
                     {MAX_LOOP_SCOPE_BYTES} bytes of their parameters ({scopes} bytes)",
                    items.len()
                ));
            }
            Ok(items)
        });
        let items = match items {
            Ok(items) => items,
            Err(message) => {
                return self.create_final(now, parent, &name, s, Phase::Errored, Some(message));
            }
        };
        let group = self.nodes.len();
        self.nodes[parent].children.push(group);
        self.nodes.push(RunNode {
            kind: Kind::Loop,
            phase: Phase::Running,
            started_at: Some(now),
            finished_at: None,
            message: None,
            ..self.blank(group, parent, &name, s, now)
        });
        for (i, item) in items.iter().enumerate() {
            let mut item_scope = scope.clone();
            item_scope.set_item(item);
            let child = format!("{name}({i}:{})", json_text(item));
            self.start_one(now, group, &child, s, &item_scope);
        }
        group
    }

    pub(super) fn blank(
        &self,
        id: NodeId,
        parent: NodeId,
        name: &str,
        s: &Step,
        now: UnixMillis,
    ) -> RunNode {
        RunNode {
            id,
            parent: Some(parent),
            name: name.to_owned(),
            step: s.name.text.clone(),
            template: s.template.text.clone(),
            kind: Kind::Container,
            phase: Phase::Pending,
            message: None,
            children: Vec::new(),
            scope: Scope::default(),
            outputs: BTreeMap::new(),
            artifacts: BTreeMap::new(),
            result: None,
            continue_on: s.continue_on,
            retries: 0,
            launched: false,
            retry_at: None,
            deadline: None,
            active_deadline_ms: None,
            created_at: now,
            started_at: None,
            finished_at: None,
            on_exit: None,
            hook: None,
        }
    }

    pub(super) fn start_one(
        &mut self,
        now: UnixMillis,
        parent: NodeId,
        name: &str,
        s: &Step,
        scope: &Scope,
    ) -> NodeId {
        if let Some(w) = &s.when {
            let verdict = scope
                .fill(&w.text)
                .map_err(|e| format!("when: {{{{{e}}}}} is not known here"))
                .and_then(|text| when::evaluate(&text).map_err(|e| format!("when {text:?}: {e}")));
            match verdict {
                Ok(true) => {}
                Ok(false) => {
                    let message = Some(format!("when {:?} was false", w.text));
                    return self.create_final(now, parent, name, s, Phase::Skipped, message);
                }
                Err(message) => {
                    return self.create_final(now, parent, name, s, Phase::Errored, Some(message));
                }
            }
        }
        let mut args = BTreeMap::new();
        for a in &s.arguments {
            let value = a
                .value
                .as_ref()
                .map_or(Ok(String::new()), |v| scope.fill(&v.text));
            match value {
                Ok(v) => {
                    args.insert(a.name.text.clone(), v);
                }
                Err(e) => {
                    let message = Some(format!(
                        "argument {}: {{{{{e}}}}} is not known here",
                        a.name.text
                    ));
                    return self.create_final(now, parent, name, s, Phase::Errored, message);
                }
            }
        }
        for a in &s.artifacts {
            let from = a
                .from
                .as_ref()
                .map_or(Ok(String::new()), |f| scope.fill(&f.text));
            match from {
                Ok(content) => {
                    args.insert(format!("{ARTIFACT_PREFIX}{}", a.name.text), content);
                }
                Err(e) => {
                    let message = Some(format!(
                        "artifact {}: {{{{{e}}}}} is not known here",
                        a.name.text
                    ));
                    return self.create_final(now, parent, name, s, Phase::Errored, message);
                }
            }
        }
        let on_exit = s.on_exit.as_ref().map(|l| l.text.clone());
        self.create(
            now,
            Some(parent),
            name,
            &s.name.text,
            &s.template.text,
            &args,
            s.continue_on,
            on_exit,
        )
    }

    pub(super) fn globals(&self, now: UnixMillis) -> Scope {
        let mut s = Scope::default();
        s.set("workflow.name", self.wf.name.clone());
        s.set("workflow.uid", self.id.clone());
        s.set("workflow.namespace", "nightshift");
        s.set("workflow.mainEntrypoint", self.wf.entrypoint.text.clone());
        s.set("workflow.creationTimestamp", self.started_at.to_string());
        s.set(
            "workflow.status",
            self.status.map_or("Running", Phase::as_str),
        );
        s.set(
            "workflow.duration",
            format!("{:.3}", now.saturating_sub(self.started_at) as f64 / 1000.0),
        );
        let failures: Vec<serde_json::Value> = self
            .nodes
            .iter()
            .filter(|n| n.phase.is_failure() && matches!(n.kind, Kind::Container))
            .map(|n| {
                serde_json::json!({
                    "displayName": n.step,
                    "message": n.message.clone().unwrap_or_default(),
                    "templateName": n.template,
                    "phase": n.phase.as_str(),
                })
            })
            .collect();
        s.set(
            "workflow.failures",
            serde_json::Value::from(failures).to_string(),
        );
        for (k, v) in &self.parameters {
            s.set(format!("workflow.parameters.{k}"), v.clone());
        }
        s
    }
}
