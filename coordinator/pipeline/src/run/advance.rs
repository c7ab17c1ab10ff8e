//! Moving the nodes of a run along: launching containers, running groups of steps in order
//! and DAG tasks as their `depends` allow, finishing loops, parents and the workflow.

use std::collections::BTreeMap;

use nightshift_common::UnixMillis;

use super::{
    ARTIFACT_PREFIX, Action, Kind, NodeId, Outcome, Phase, Run, RunNode, StepResult, StepSpec,
    bounded, fmt_ms, retry_after,
};
use crate::depends::{Depends, TaskResult};
use crate::scope::Scope;
use crate::workflow::{Body, ContinueOn, Located, OutputSource};

impl Run {
    pub(super) fn advance(&mut self, now: UnixMillis, id: NodeId, actions: &mut Vec<Action>) {
        let node = &self.nodes[id];
        if node.phase.is_finished() {
            if let (Some(hook), None) = (node.on_exit.clone(), node.hook) {
                let name = format!("{}.onExit", node.name);
                let step = node.step.clone();
                let parent = node.parent;
                let h = self.create(
                    now,
                    parent,
                    &name,
                    &step,
                    &hook,
                    &BTreeMap::new(),
                    ContinueOn::default(),
                    None,
                );
                self.nodes[id].hook = Some(h);
            }
            return;
        }
        match node.kind.clone() {
            Kind::Container => self.advance_container(now, id, actions),
            Kind::Steps { group, children } => self.advance_steps(now, id, group, children),
            Kind::Dag { tasks } => self.advance_dag(now, id, tasks),
            Kind::Loop => self.advance_loop(now, id),
        }
    }

    fn advance_container(&mut self, now: UnixMillis, id: NodeId, actions: &mut Vec<Action>) {
        let node = &self.nodes[id];
        if let Some(d) = node.deadline
            && now >= d
        {
            let reason = format!("timed out after {}", fmt_ms(d - node.created_at));
            self.fail(now, id, Phase::Failed, reason.clone(), actions);
            return;
        }
        if node.launched {
            if let (Some(ms), Some(started)) = (node.active_deadline_ms, node.started_at)
                && now >= started + ms
            {
                let reason = format!("exceeded activeDeadlineSeconds ({})", fmt_ms(ms));
                self.fail(now, id, Phase::Failed, reason, actions);
            }
            return;
        }
        if node.retry_at.is_some_and(|t| now < t) || !self.may_launch(id) {
            return;
        }
        let Some(Body::Container(c)) = self.wf.template(&node.template).map(|t| t.body.clone())
        else {
            return;
        };
        let Some(t) = self.wf.template(&node.template).cloned() else {
            return;
        };
        let mut scope = node.scope.clone();
        scope.set("retries", node.retries.to_string());
        let fill = |l: &Located| scope.fill(&l.text);
        let resolved = (|| -> Result<StepSpec, String> {
            Ok(StepSpec {
                image: fill(&c.image)?,
                command: c.command.iter().map(fill).collect::<Result<_, _>>()?,
                args: c.args.iter().map(fill).collect::<Result<_, _>>()?,
                env: c
                    .env
                    .iter()
                    .map(|(k, v)| Ok((k.clone(), fill(v)?)))
                    .collect::<Result<_, String>>()?,
                gpus: c.gpus,
                extras: t.extras.over(&self.wf.extras),
                output_paths: t
                    .outputs
                    .iter()
                    .filter_map(|o| match &o.source {
                        OutputSource::Path(p) => Some((o.name.text.clone(), p.clone())),
                        OutputSource::Parameter(_) => None,
                    })
                    .collect(),
                artifact_paths: t
                    .output_artifacts
                    .iter()
                    .filter_map(|a| {
                        let path = a.path.clone()?;
                        Some((format!("{ARTIFACT_PREFIX}{}", a.name.text), path))
                    })
                    .collect(),
                input_files: t
                    .input_artifacts
                    .iter()
                    .filter_map(|a| {
                        let path = a.path.clone()?;
                        let key = format!("inputs.artifacts.{}", a.name.text);
                        Some((path, scope.get(&key)?.to_owned()))
                    })
                    .collect(),
            })
        })();
        match resolved {
            Ok(spec) => {
                let spec = Box::new(spec);
                let node = &mut self.nodes[id];
                node.launched = true;
                node.retry_at = None;
                node.phase = Phase::Running;
                node.started_at = Some(now);
                actions.push(Action::Launch {
                    node: id,
                    retry: node.retries,
                    name: node.name.clone(),
                    spec,
                });
            }
            Err(e) => self.fail(
                now,
                id,
                Phase::Errored,
                format!("{{{{{e}}}}} is not known here"),
                actions,
            ),
        }
    }

    /// Whether the workflow's and every enclosing template's `parallelism` leave room.
    fn may_launch(&self, id: NodeId) -> bool {
        let running = |root: Option<NodeId>| {
            self.nodes
                .iter()
                .filter(|n| n.launched && root.is_none_or(|r| self.is_under(n.id, r)))
                .count() as u32
        };
        if let Some(p) = self.wf.parallelism
            && running(None) >= p
        {
            return false;
        }
        let mut at = self.nodes[id].parent;
        while let Some(a) = at {
            let limit = self
                .wf
                .template(&self.nodes[a].template)
                .and_then(|t| t.parallelism);
            if let Some(p) = limit
                && !matches!(self.nodes[a].kind, Kind::Loop)
                && running(Some(a)) >= p
            {
                return false;
            }
            at = self.nodes[a].parent;
        }
        true
    }

    fn is_under(&self, mut id: NodeId, root: NodeId) -> bool {
        loop {
            if id == root {
                return true;
            }
            match self.nodes[id].parent {
                Some(p) => id = p,
                None => return false,
            }
        }
    }

    fn fail(
        &mut self,
        now: UnixMillis,
        id: NodeId,
        phase: Phase,
        reason: String,
        actions: &mut Vec<Action>,
    ) {
        let node = &mut self.nodes[id];
        if node.launched {
            actions.push(Action::Cancel {
                node: id,
                reason: reason.clone(),
            });
            node.launched = false;
        }
        node.phase = phase;
        node.message = Some(reason);
        node.finished_at = Some(now);
    }

    /// The `{{steps.*}}`/`{{tasks.*}}` values of the children `visible` of a node.
    fn sibling_scope(&self, base: &Scope, kind: &str, visible: &[NodeId]) -> Scope {
        let mut scope = base.clone();
        for &c in visible {
            let n = &self.nodes[c];
            let prefix = format!("{kind}.{}", n.step);
            scope.set(format!("{prefix}.status"), n.phase.as_str());
            scope.set(format!("{prefix}.id"), n.name.clone());
            if let Some(r) = &n.result {
                scope.set(format!("{prefix}.outputs.result"), r.clone());
            }
            for (k, v) in &n.outputs {
                scope.set(format!("{prefix}.outputs.parameters.{k}"), v.clone());
            }
            for (k, v) in &n.artifacts {
                scope.set(format!("{prefix}.outputs.artifacts.{k}"), v.clone());
            }
            if matches!(n.kind, Kind::Loop) {
                let children: Vec<&RunNode> = n.children.iter().map(|&i| &self.nodes[i]).collect();
                let maps: Vec<serde_json::Value> = children
                    .iter()
                    .filter(|c| c.phase == Phase::Succeeded)
                    .map(|c| serde_json::json!(c.outputs))
                    .collect();
                scope.set(
                    format!("{prefix}.outputs.parameters"),
                    serde_json::Value::from(maps).to_string(),
                );
                let results: Vec<&str> = children
                    .iter()
                    .filter(|c| c.phase == Phase::Succeeded)
                    .filter_map(|c| c.result.as_deref())
                    .collect();
                scope.set(
                    format!("{prefix}.outputs.result"),
                    serde_json::json!(results).to_string(),
                );
                let mut names: Vec<&String> =
                    children.iter().flat_map(|c| c.outputs.keys()).collect();
                names.sort();
                names.dedup();
                for name in names {
                    let values: Vec<&str> = children
                        .iter()
                        .filter_map(|c| c.outputs.get(name).map(String::as_str))
                        .collect();
                    scope.set(
                        format!("{prefix}.outputs.parameters.{name}"),
                        serde_json::json!(values).to_string(),
                    );
                }
            }
        }
        scope
    }

    fn advance_steps(
        &mut self,
        now: UnixMillis,
        id: NodeId,
        group: usize,
        children: Vec<Vec<NodeId>>,
    ) {
        let Some(Body::Steps(groups)) = self
            .wf
            .template(&self.nodes[id].template)
            .map(|t| t.body.clone())
        else {
            return;
        };
        if group >= groups.len() {
            let visible: Vec<NodeId> = children.iter().flatten().copied().collect();
            self.complete_parent(now, id, "steps", &visible, Phase::Succeeded, None);
            return;
        }
        if children.len() <= group {
            let earlier: Vec<NodeId> = children.iter().flatten().copied().collect();
            let scope = self.sibling_scope(&self.nodes[id].scope, "steps", &earlier);
            let started: Vec<NodeId> = groups[group]
                .iter()
                .map(|s| self.start_step(now, id, s, &scope))
                .collect();
            if let Kind::Steps { children, .. } = &mut self.nodes[id].kind {
                children.push(started);
            }
            return;
        }
        let current = &children[group];
        if !current.iter().all(|&c| self.nodes[c].settled(self)) {
            return;
        }
        let failed = current.iter().find(|&&c| {
            let n = &self.nodes[c];
            (n.phase == Phase::Failed && !n.continue_on.failed)
                || (n.phase == Phase::Errored && !n.continue_on.error)
        });
        if let Some(&f) = failed {
            let visible: Vec<NodeId> = children.iter().flatten().copied().collect();
            let message = format!(
                "step {} {}",
                self.nodes[f].name,
                self.nodes[f].phase.as_str().to_lowercase()
            );
            self.complete_parent(now, id, "steps", &visible, Phase::Failed, Some(message));
            return;
        }
        if let Kind::Steps { group, .. } = &mut self.nodes[id].kind {
            *group += 1;
        }
    }

    fn advance_dag(&mut self, now: UnixMillis, id: NodeId, tasks: BTreeMap<String, NodeId>) {
        let Some(t) = self.wf.template(&self.nodes[id].template).cloned() else {
            return;
        };
        let Body::Dag(defs) = &t.body else { return };
        let result_of = |run: &Run, task: &str, r: TaskResult| -> bool {
            let Some(&n) = tasks.get(task) else {
                return false;
            };
            let node = &run.nodes[n];
            let children: Vec<Phase> = node.children.iter().map(|&c| run.nodes[c].phase).collect();
            match r {
                TaskResult::Succeeded => node.phase == Phase::Succeeded,
                TaskResult::Failed => node.phase == Phase::Failed,
                TaskResult::Errored => node.phase == Phase::Errored,
                TaskResult::Skipped => node.phase == Phase::Skipped,
                TaskResult::Omitted => node.phase == Phase::Omitted,
                TaskResult::Daemoned => false,
                TaskResult::AnySucceeded => children.contains(&Phase::Succeeded),
                TaskResult::AllFailed => {
                    !children.is_empty() && children.iter().all(|p| p.is_failure())
                }
            }
        };
        let handled: Vec<&str> = defs
            .iter()
            .filter_map(|d| d.depends.as_ref())
            .filter_map(|d| Depends::parse(&d.text).ok())
            .flat_map(|d| {
                d.handles_failure_of()
                    .into_iter()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .map(|s| {
                defs.iter()
                    .find(|d| d.name.text == s)
                    .map_or("", |d| d.name.text.as_str())
            })
            .collect();
        let unhandled_failure = |run: &Run| {
            tasks.iter().any(|(name, &n)| {
                let node = &run.nodes[n];
                let failed = (node.phase == Phase::Failed && !node.continue_on.failed)
                    || (node.phase == Phase::Errored && !node.continue_on.error);
                failed && !handled.contains(&name.as_str())
            })
        };
        let stop_starting = t.fail_fast && unhandled_failure(self);
        let mut started = tasks.clone();
        if !stop_starting {
            for def in defs {
                if started.contains_key(&def.name.text) {
                    continue;
                }
                let expr = match def.depends.as_ref().map(|d| Depends::parse(&d.text)) {
                    None => None,
                    Some(Ok(e)) => Some(e),
                    Some(Err(e)) => {
                        let name = format!("{}.{}", self.nodes[id].name, def.name.text);
                        let n = self.create_final(
                            now,
                            id,
                            &name,
                            def,
                            Phase::Errored,
                            Some(format!("depends: {e}")),
                        );
                        started.insert(def.name.text.clone(), n);
                        continue;
                    }
                };
                let deps = expr.as_ref().map(|e| e.tasks()).unwrap_or_default();
                let ready = deps.iter().all(|d| {
                    started
                        .get(*d)
                        .is_some_and(|&n| self.nodes[n].settled(self))
                });
                if !ready {
                    continue;
                }
                let go = expr
                    .as_ref()
                    .is_none_or(|e| e.eval(&|task, r| result_of(self, task, r)));
                let node = if go {
                    let visible: Vec<NodeId> = deps
                        .iter()
                        .filter_map(|d| started.get(*d).copied())
                        .collect();
                    let scope = self.sibling_scope(&self.nodes[id].scope, "tasks", &visible);
                    self.start_step(now, id, def, &scope)
                } else {
                    let name = format!("{}.{}", self.nodes[id].name, def.name.text);
                    let message = def
                        .depends
                        .as_ref()
                        .map(|d| format!("depends {:?} was false", d.text));
                    self.create_final(now, id, &name, def, Phase::Omitted, message)
                };
                started.insert(def.name.text.clone(), node);
            }
        }
        if let Kind::Dag { tasks } = &mut self.nodes[id].kind {
            *tasks = started.clone();
        }
        let all_settled = started.values().all(|&n| self.nodes[n].settled(self));
        let done = all_settled && (started.len() == defs.len() || stop_starting);
        if !done {
            return;
        }
        let visible: Vec<NodeId> = started.values().copied().collect();
        let tasks_now = started;
        let failure = tasks_now.iter().find(|(name, n)| {
            let node = &self.nodes[**n];
            let failed = (node.phase == Phase::Failed && !node.continue_on.failed)
                || (node.phase == Phase::Errored && !node.continue_on.error);
            failed && !handled.contains(&name.as_str())
        });
        match failure {
            Some((name, _)) => {
                let message = Some(format!("task {name} failed"));
                self.complete_parent(now, id, "tasks", &visible, Phase::Failed, message)
            }
            None => self.complete_parent(now, id, "tasks", &visible, Phase::Succeeded, None),
        }
    }

    fn advance_loop(&mut self, now: UnixMillis, id: NodeId) {
        let children = self.nodes[id].children.clone();
        if !children.iter().all(|&c| self.nodes[c].settled(self)) {
            return;
        }
        let failed = children.iter().find(|&&c| {
            let n = &self.nodes[c];
            (n.phase == Phase::Failed && !n.continue_on.failed)
                || (n.phase == Phase::Errored && !n.continue_on.error)
        });
        let node = &mut self.nodes[id];
        node.finished_at = Some(now);
        match failed {
            Some(_) => {
                node.phase = Phase::Failed;
                node.message = Some("an item failed".to_owned());
            }
            None => node.phase = Phase::Succeeded,
        }
    }

    /// Finishes a steps or DAG node: its outputs come from its children.
    fn complete_parent(
        &mut self,
        now: UnixMillis,
        id: NodeId,
        kind: &str,
        visible: &[NodeId],
        phase: Phase,
        message: Option<String>,
    ) {
        let scope = self.sibling_scope(&self.nodes[id].scope, kind, visible);
        let mut outputs = BTreeMap::new();
        let mut phase = phase;
        let mut message = message;
        if phase == Phase::Succeeded
            && let Some(t) = self.wf.template(&self.nodes[id].template)
        {
            for o in &t.outputs {
                if let OutputSource::Parameter(p) = &o.source {
                    match scope.fill(&p.text) {
                        Ok(v) => {
                            outputs.insert(o.name.text.clone(), v);
                        }
                        Err(_) if o.default.is_some() => {
                            outputs
                                .insert(o.name.text.clone(), o.default.clone().unwrap_or_default());
                        }
                        Err(e) => {
                            phase = Phase::Failed;
                            message =
                                Some(format!("output {}: {{{{{e}}}}} has no value", o.name.text));
                        }
                    }
                }
            }
        }
        let mut artifacts = BTreeMap::new();
        if phase == Phase::Succeeded
            && let Some(t) = self.wf.template(&self.nodes[id].template)
        {
            for a in &t.output_artifacts {
                let Some(from) = &a.from else { continue };
                match scope.fill(&from.text) {
                    Ok(v) => {
                        artifacts.insert(a.name.text.clone(), v);
                    }
                    Err(e) => {
                        phase = Phase::Failed;
                        message = Some(format!(
                            "artifact {}: {{{{{e}}}}} has no value",
                            a.name.text
                        ));
                    }
                }
            }
        }
        let node = &mut self.nodes[id];
        node.outputs = outputs;
        node.artifacts = artifacts;
        node.phase = phase;
        node.message = message;
        node.finished_at = Some(now);
    }

    pub(super) fn finished(&mut self, now: UnixMillis, id: NodeId, retry: u32, result: StepResult) {
        let Some(node) = self.nodes.get(id) else {
            return;
        };
        // A result for an attempt that was cancelled or superseded changes nothing.
        if !node.launched || node.retries != retry {
            return;
        }
        let Some(t) = self.wf.template(&node.template).cloned() else {
            return;
        };
        let node = &mut self.nodes[id];
        node.launched = false;
        node.result = result.stdout.map(|s| bounded(s.trim_end_matches('\n')));
        let (phase, message) = match result.outcome {
            Outcome::Succeeded => {
                let mut outputs = BTreeMap::new();
                let mut missing = None;
                for o in &t.outputs {
                    if let OutputSource::Path(p) = &o.source {
                        match result
                            .files
                            .get(&o.name.text)
                            .cloned()
                            .or_else(|| o.default.clone())
                        {
                            Some(v) => {
                                outputs.insert(
                                    o.name.text.clone(),
                                    v.trim_end_matches('\n').to_owned(),
                                );
                            }
                            None => missing = Some((o.name.text.clone(), p.clone())),
                        }
                    }
                }
                node.outputs = outputs;
                for a in &t.output_artifacts {
                    let Some(path) = &a.path else { continue };
                    match result
                        .files
                        .get(&format!("{ARTIFACT_PREFIX}{}", a.name.text))
                    {
                        Some(v) => {
                            node.artifacts.insert(a.name.text.clone(), v.clone());
                        }
                        None => missing = Some((format!("artifact {}", a.name.text), path.clone())),
                    }
                }
                match missing {
                    None => (Phase::Succeeded, None),
                    Some((name, path)) => (
                        Phase::Failed,
                        Some(format!(
                            "output {name}: {path} was not found in the container, or is a \
                             directory or larger than 64 KiB (outputs and artifacts pass between \
                             steps as one file of at most 64 KiB, through the coordinator)"
                        )),
                    ),
                }
            }
            Outcome::Failed { exit_code } => {
                (Phase::Failed, Some(format!("exited with code {exit_code}")))
            }
            Outcome::Errored { message } => (Phase::Errored, Some(message)),
        };
        if phase != Phase::Succeeded
            && let Some(retry_at) = retry_after(&t, node, phase, now)
        {
            node.retries += 1;
            node.retry_at = Some(retry_at);
            node.phase = Phase::Pending;
            node.message = message
                .map(|m| format!("{m}; retry {} at +{}", node.retries, fmt_ms(retry_at - now)));
            return;
        }
        node.phase = phase;
        node.message = message;
        node.finished_at = Some(now);
    }

    pub(super) fn workflow_deadline(&mut self, now: UnixMillis, actions: &mut Vec<Action>) {
        let Some(secs) = self.wf.active_deadline_seconds else {
            return;
        };
        if now < self.started_at + secs * 1000 || self.status.is_some() {
            return;
        }
        let reason = format!("workflow exceeded activeDeadlineSeconds ({secs}s)");
        for id in 0..self.nodes.len() {
            if !self.nodes[id].phase.is_finished() {
                self.fail(now, id, Phase::Failed, reason.clone(), actions);
            }
        }
    }

    pub(super) fn advance_workflow(&mut self, now: UnixMillis) {
        let Some(root) = self.nodes.first() else {
            return;
        };
        if !root.settled(self) {
            return;
        }
        if self.status.is_none() {
            let phase = if root.phase.is_failure() {
                root.phase
            } else {
                Phase::Succeeded
            };
            self.status = Some(phase);
            if let Some(on_exit) = self.wf.on_exit.clone() {
                let name = format!("{}.onExit", self.wf.name);
                let n = self.create(
                    now,
                    None,
                    &name,
                    "onExit",
                    &on_exit.text,
                    &BTreeMap::new(),
                    ContinueOn::default(),
                    None,
                );
                self.exit_node = Some(n);
            }
        }
        if let Some(e) = self.exit_node
            && !self.nodes[e].settled(self)
        {
            return;
        }
        let exit_failed = self
            .exit_node
            .is_some_and(|e| self.nodes[e].phase.is_failure());
        self.phase = match self.status {
            Some(Phase::Succeeded) if exit_failed => Phase::Failed,
            Some(p) => p,
            None => Phase::Failed,
        };
        self.finished_at = Some(now);
    }
}
