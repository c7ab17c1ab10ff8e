//! The checks that need the whole workflow: names resolve, tasks do not depend on each other
//! in a circle, every `{{...}}` refers to something that exists where it is used, every
//! template input gets a value, and `depends`/`when` parse.

use std::collections::{BTreeMap, BTreeSet};

use crate::depends::Depends;
use crate::diagnostic::{Diagnostic, Diagnostics, Rule};
use crate::placeholder;
use crate::when;
use crate::workflow::*;

/// Global variables a workflow may use anywhere.
const WORKFLOW_VARIABLES: &[&str] = &[
    "workflow.name",
    "workflow.namespace",
    "workflow.uid",
    "workflow.status",
    "workflow.duration",
    "workflow.failures",
    "workflow.creationTimestamp",
    "workflow.mainEntrypoint",
];

pub fn lint(wf: &Workflow) -> Diagnostics {
    let mut l = Linter {
        wf,
        diags: Diagnostics::default(),
    };
    l.names();
    for t in &wf.templates {
        l.template(t);
    }
    l.recursion();
    l.diags.sorted()
}

struct Linter<'a> {
    wf: &'a Workflow,
    diags: Diagnostics,
}

/// What `{{...}}` may name at one place.
#[derive(Default)]
struct Scope<'a> {
    inputs: BTreeSet<&'a str>,
    input_artifacts: BTreeSet<&'a str>,
    /// Steps or tasks visible here, with the template each calls, and whether each loops.
    siblings: BTreeMap<&'a str, (&'a str, bool)>,
    /// `steps` or `tasks`.
    sibling_kind: &'static str,
    item: Option<&'a Loop>,
    retries: bool,
}

impl<'a> Linter<'a> {
    fn err(&mut self, line: usize, rule: Rule, message: impl Into<String>) {
        self.diags.push(Diagnostic::new(line, rule, message));
    }

    fn names(&mut self) {
        let mut seen = BTreeSet::new();
        for t in &self.wf.templates {
            if !seen.insert(t.name.text.as_str()) {
                self.err(
                    t.name.line,
                    Rule::DuplicateName,
                    format!("template {} is defined twice", t.name.text),
                );
            }
        }
        let ep = &self.wf.entrypoint;
        if self.wf.template(&ep.text).is_none() {
            self.err(
                ep.line,
                Rule::UnknownTemplate,
                format!("entrypoint {} is not a template of this workflow", ep.text),
            );
        } else if let Some(t) = self.wf.template(&ep.text) {
            for input in &t.inputs {
                let supplied = self
                    .wf
                    .arguments
                    .iter()
                    .any(|a| a.name.text == input.name.text);
                if !supplied && input.value.is_none() && input.default.is_none() {
                    self.err(input.name.line, Rule::MissingArgument, format!(
                        "entrypoint {} needs input {}: add it to spec.arguments.parameters or give it a default",
                        ep.text, input.name.text
                    ));
                }
            }
        }
        if let Some(on_exit) = &self.wf.on_exit
            && self.wf.template(&on_exit.text).is_none()
        {
            self.err(
                on_exit.line,
                Rule::UnknownTemplate,
                format!("onExit {} is not a template of this workflow", on_exit.text),
            );
        }
        for a in &self.wf.arguments {
            if a.value.is_none() {
                self.err(
                    a.name.line,
                    Rule::MissingArgument,
                    format!(
                        "workflow parameter {} needs a value (it can be overridden with -p)",
                        a.name.text
                    ),
                );
            }
            if let Some(v) = &a.value
                && !a.allowed.is_empty()
                && !a.allowed.contains(&v.text)
            {
                self.err(
                    v.line,
                    Rule::InvalidValue,
                    format!(
                        "parameter {} = {:?} is not one of its enum values",
                        a.name.text, v.text
                    ),
                );
            }
            self.strings(&Scope::default(), a.value.iter());
        }
    }

    fn template(&mut self, t: &'a Template) {
        let mut base = Scope {
            inputs: t.inputs.iter().map(|p| p.name.text.as_str()).collect(),
            input_artifacts: t
                .input_artifacts
                .iter()
                .map(|a| a.name.text.as_str())
                .collect(),
            ..Scope::default()
        };
        for p in &t.inputs {
            self.strings(&Scope::default(), p.value.iter().chain(&p.default));
        }
        self.strings(&base, t.timeout.iter().chain(&t.active_deadline_seconds));
        match &t.body {
            Body::Container(c) => {
                base.retries = true;
                let env = c.env.iter().map(|(_, v)| v);
                let all = std::iter::once(&c.image)
                    .chain(&c.command)
                    .chain(&c.args)
                    .chain(env);
                self.strings(&base, all);
                for o in &t.outputs {
                    if let OutputSource::Parameter(p) = &o.source {
                        self.err(
                            p.line,
                            Rule::InvalidValue,
                            format!(
                                "output {} of container template {}: use valueFrom.path",
                                o.name.text, t.name.text
                            ),
                        );
                    }
                }
                for a in &t.output_artifacts {
                    if a.path.is_none() {
                        self.err(
                            a.name.line,
                            Rule::MissingField,
                            format!(
                                "output artifact {} of container template {} needs a path",
                                a.name.text, t.name.text
                            ),
                        );
                    }
                }
                for a in &t.input_artifacts {
                    if a.path.is_none() {
                        self.err(
                            a.name.line,
                            Rule::MissingField,
                            format!(
                                "input artifact {} of container template {} needs a path",
                                a.name.text, t.name.text
                            ),
                        );
                    }
                }
            }
            Body::Steps(groups) => {
                base.sibling_kind = "steps";
                let mut names = BTreeSet::new();
                for group in groups {
                    for s in group {
                        if !names.insert(s.name.text.as_str()) {
                            self.err(
                                s.name.line,
                                Rule::DuplicateName,
                                format!(
                                    "step {} appears twice in template {}",
                                    s.name.text, t.name.text
                                ),
                            );
                        }
                    }
                }
                // A step sees the steps of earlier groups.
                for group in groups {
                    for s in group {
                        self.step(s, &base);
                    }
                    for s in group {
                        base.siblings
                            .insert(&s.name.text, (&s.template.text, s.loop_over.is_some()));
                    }
                }
                self.outputs_of_parent(t, &base);
            }
            Body::Dag(tasks) => {
                base.sibling_kind = "tasks";
                self.dag(t, tasks, &base);
                for s in tasks {
                    base.siblings
                        .insert(&s.name.text, (&s.template.text, s.loop_over.is_some()));
                }
                self.outputs_of_parent(t, &base);
            }
        }
    }

    fn outputs_of_parent(&mut self, t: &'a Template, scope: &Scope<'a>) {
        for o in &t.outputs {
            match &o.source {
                OutputSource::Path(_) => self.err(o.name.line, Rule::InvalidValue, format!(
                    "output {} of template {}: valueFrom.path needs a container template; use valueFrom.parameter",
                    o.name.text, t.name.text
                )),
                OutputSource::Parameter(p) => self.strings(scope, std::iter::once(p)),
            }
        }
        for a in &t.output_artifacts {
            match &a.from {
                Some(from) => self.artifact_ref(scope, from),
                None => self.err(
                    a.name.line,
                    Rule::MissingField,
                    format!(
                        "output artifact {} of template {} needs `from`",
                        a.name.text, t.name.text
                    ),
                ),
            }
        }
    }

    fn dag(&mut self, t: &'a Template, tasks: &'a [Step], base: &Scope<'a>) {
        let mut names = BTreeSet::new();
        for s in tasks {
            if !names.insert(s.name.text.as_str()) {
                self.err(
                    s.name.line,
                    Rule::DuplicateName,
                    format!(
                        "task {} appears twice in template {}",
                        s.name.text, t.name.text
                    ),
                );
            }
        }
        let mut edges: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for s in tasks {
            let deps = match &s.depends {
                None => Vec::new(),
                Some(d) => match Depends::parse(&d.text) {
                    Ok(expr) => {
                        let mut deps = Vec::new();
                        for name in expr.tasks() {
                            if names.contains(name) {
                                if let Some(n) = tasks.iter().find(|x| x.name.text == name) {
                                    deps.push(n.name.text.as_str());
                                }
                            } else {
                                self.err(d.line, Rule::UnknownTask, format!("task {} depends on {name}, which is not a task of template {}", s.name.text, t.name.text));
                            }
                        }
                        deps
                    }
                    Err(e) => {
                        self.err(
                            d.line,
                            Rule::MalformedExpression,
                            format!("depends of task {}: {e}", s.name.text),
                        );
                        Vec::new()
                    }
                },
            };
            edges.insert(&s.name.text, deps);
        }
        if let Some(cycle) = find_cycle(&edges) {
            let line = tasks
                .iter()
                .find(|s| s.name.text == cycle[0])
                .map_or(t.name.line, |s| s.name.line);
            self.err(
                line,
                Rule::Cycle,
                format!(
                    "tasks of template {} depend on each other in a circle: {}",
                    t.name.text,
                    cycle.join(" -> ")
                ),
            );
            return;
        }
        // A task sees the tasks it depends on, directly or not.
        for s in tasks {
            let mut scope = Scope {
                inputs: base.inputs.clone(),
                input_artifacts: base.input_artifacts.clone(),
                sibling_kind: "tasks",
                ..Scope::default()
            };
            for anc in ancestors(&edges, &s.name.text) {
                if let Some(x) = tasks.iter().find(|x| x.name.text == anc) {
                    scope
                        .siblings
                        .insert(&x.name.text, (&x.template.text, x.loop_over.is_some()));
                }
            }
            self.step(s, &scope);
        }
    }

    fn step(&mut self, s: &'a Step, scope: &Scope<'a>) {
        let Some(callee) = self.wf.template(&s.template.text) else {
            self.err(
                s.template.line,
                Rule::UnknownTemplate,
                format!(
                    "{} calls template {}, which does not exist",
                    s.name.text, s.template.text
                ),
            );
            return;
        };
        if let Some(on_exit) = &s.on_exit
            && self.wf.template(&on_exit.text).is_none()
        {
            self.err(
                on_exit.line,
                Rule::UnknownTemplate,
                format!(
                    "onExit of {}: template {} does not exist",
                    s.name.text, on_exit.text
                ),
            );
        }
        if let Some(Loop::Param(p)) = &s.loop_over {
            self.strings(scope, std::iter::once(p));
        }
        let inner = Scope {
            inputs: scope.inputs.clone(),
            input_artifacts: scope.input_artifacts.clone(),
            siblings: scope.siblings.clone(),
            sibling_kind: scope.sibling_kind,
            item: s.loop_over.as_ref(),
            retries: false,
        };
        for a in &s.arguments {
            if !callee.inputs.iter().any(|i| i.name.text == a.name.text) {
                self.err(
                    a.name.line,
                    Rule::UndefinedReference,
                    format!(
                        "{} passes parameter {}, which template {} does not take as input",
                        s.name.text, a.name.text, callee.name.text
                    ),
                );
            }
            match &a.value {
                Some(v) => self.strings(&inner, std::iter::once(v)),
                None => self.err(
                    a.name.line,
                    Rule::MissingArgument,
                    format!("argument {} of {} needs a value", a.name.text, s.name.text),
                ),
            }
        }
        for i in &callee.inputs {
            let passed = s.arguments.iter().any(|a| a.name.text == i.name.text);
            if !passed && i.value.is_none() && i.default.is_none() {
                self.err(
                    s.name.line,
                    Rule::MissingArgument,
                    format!(
                        "{} calls template {} without its input parameter {}",
                        s.name.text, callee.name.text, i.name.text
                    ),
                );
            }
        }
        for a in &s.artifacts {
            if !callee
                .input_artifacts
                .iter()
                .any(|i| i.name.text == a.name.text)
            {
                self.err(
                    a.name.line,
                    Rule::UndefinedReference,
                    format!(
                        "{} passes artifact {}, which template {} does not take as input",
                        s.name.text, a.name.text, callee.name.text
                    ),
                );
            }
            if let Some(from) = &a.from {
                self.artifact_ref(&inner, from);
            }
        }
        for i in &callee.input_artifacts {
            if !s.artifacts.iter().any(|a| a.name.text == i.name.text) {
                self.err(
                    s.name.line,
                    Rule::MissingArgument,
                    format!(
                        "{} calls template {} without its input artifact {}",
                        s.name.text, callee.name.text, i.name.text
                    ),
                );
            }
        }
        if let Some(w) = &s.when {
            self.strings(&inner, std::iter::once(w));
            if !placeholder::find(&w.text).iter().any(|p| p.is_expression)
                && let Err(e) = when::check_syntax(&w.text)
            {
                self.err(
                    w.line,
                    Rule::MalformedExpression,
                    format!("when of {}: {e}", s.name.text),
                );
            }
        }
    }

    /// `from: "{{steps.x.outputs.artifacts.y}}"` or `"{{inputs.artifacts.y}}"`.
    fn artifact_ref(&mut self, scope: &Scope<'a>, from: &Located) {
        let found = placeholder::find(&from.text);
        let [p] = found.as_slice() else {
            self.err(
                from.line,
                Rule::InvalidValue,
                format!(
                    "artifact from {:?} must be one {{{{...}}}} reference",
                    from.text
                ),
            );
            return;
        };
        let parts: Vec<&str> = p.name.split('.').collect();
        let ok = match parts.as_slice() {
            ["inputs", "artifacts", name] => scope.input_artifacts.contains(name),
            [kind, sib, "outputs", "artifacts", name] if *kind == scope.sibling_kind => scope
                .siblings
                .get(sib)
                .and_then(|(tpl, _)| self.wf.template(tpl))
                .is_some_and(|t| t.output_artifacts.iter().any(|a| a.name.text == *name)),
            _ => false,
        };
        if !ok {
            self.err(
                from.line,
                Rule::UndefinedReference,
                format!("artifact {{{{{}}}}} does not exist here", p.name),
            );
        }
    }

    /// Checks every placeholder of `strings` against `scope`.
    fn strings(&mut self, scope: &Scope<'a>, strings: impl Iterator<Item = &'a Located>) {
        for s in strings {
            for p in placeholder::find(&s.text) {
                if p.is_expression {
                    self.err(s.line, Rule::UnsupportedFeature, format!(
                        "expr-lang expressions ({{{{= {}}}}}) are not supported; use the simple {{{{...}}}} form and a govaluate `when`",
                        p.name
                    ));
                    continue;
                }
                if let Err(why) = self.resolves(scope, p.name) {
                    self.err(
                        s.line,
                        Rule::UndefinedReference,
                        format!("{{{{{}}}}}: {why}", p.name),
                    );
                }
            }
        }
    }

    fn resolves(&self, scope: &Scope<'a>, name: &str) -> Result<(), String> {
        if WORKFLOW_VARIABLES.contains(&name) {
            return Ok(());
        }
        let parts: Vec<&str> = name.split('.').collect();
        match parts.as_slice() {
            ["retries"] if scope.retries => Ok(()),
            ["retries"] => Err("{{retries}} is only known in container templates".into()),
            ["workflow", "parameters", p] => {
                if self.wf.arguments.iter().any(|a| a.name.text == *p) {
                    Ok(())
                } else {
                    Err(format!(
                        "the workflow has no parameter {p} in spec.arguments.parameters"
                    ))
                }
            }
            ["inputs", "parameters", p] => {
                if scope.inputs.contains(p) {
                    Ok(())
                } else {
                    Err(format!("no input parameter {p} is declared here"))
                }
            }
            ["item", ..] => match scope.item {
                None => Err("{{item}} is only known in a step with withItems or withParam".into()),
                Some(Loop::Items(items, _)) if parts.len() == 2 => {
                    let field = parts[1];
                    if items.iter().all(|i| i.get(field).is_some()) {
                        Ok(())
                    } else {
                        Err(format!("not every item of withItems has a field {field}"))
                    }
                }
                Some(_) => Ok(()),
            },
            [kind, sib, rest @ ..] if *kind == "steps" || *kind == "tasks" => {
                if *kind != scope.sibling_kind {
                    return Err(format!(
                        "{{{{{kind}.*}}}} is only known in a {} template",
                        if *kind == "steps" { "steps" } else { "dag" }
                    ));
                }
                let Some((tpl, loops)) = scope.siblings.get(sib) else {
                    return Err(if kind == &"tasks" {
                        format!("{sib} is not a task this one depends on")
                    } else {
                        format!("{sib} is not a step of an earlier group")
                    });
                };
                let callee = self.wf.template(tpl);
                match rest {
                    ["status"] | ["id"] | ["startedAt"] | ["finishedAt"] | ["exitCode"] => Ok(()),
                    ["outputs", "result"] => match callee.map(|t| &t.body) {
                        Some(Body::Container(_)) | None => Ok(()),
                        Some(_) => Err(format!(
                            "{sib} runs a steps or dag template, which has no result"
                        )),
                    },
                    ["outputs", "parameters"] if *loops => Ok(()),
                    ["outputs", "parameters"] => Err(format!(
                        "{sib} does not loop; name one of its output parameters"
                    )),
                    ["outputs", "parameters", p] => match callee {
                        Some(t) if t.outputs.iter().any(|o| o.name.text == *p) => Ok(()),
                        Some(t) => Err(format!(
                            "template {} has no output parameter {p}",
                            t.name.text
                        )),
                        None => Ok(()),
                    },
                    _ => Err(format!("unknown field of {kind}.{sib}")),
                }
            }
            _ => Err("not a variable nightshift knows".into()),
        }
    }

    /// A template that calls itself must stop somewhere: some call on the circle has a
    /// `when`.
    fn recursion(&mut self) {
        let graph = call_graph(self.wf);
        let edges: BTreeMap<&str, Vec<&str>> = graph
            .iter()
            .map(|(k, v)| {
                (
                    *k,
                    v.iter()
                        .map(|l| l.text.as_str())
                        .filter(|n| graph.contains_key(n))
                        .collect(),
                )
            })
            .collect();
        let Some(cycle) = find_cycle(&edges) else {
            return;
        };
        let guarded = cycle.windows(2).any(|w| {
            self.wf.template(w[0]).is_some_and(|t| match &t.body {
                Body::Steps(g) => g
                    .iter()
                    .flatten()
                    .any(|s| s.template.text == w[1] && s.when.is_some()),
                Body::Dag(ts) => ts
                    .iter()
                    .any(|s| s.template.text == w[1] && s.when.is_some()),
                Body::Container(_) => false,
            })
        });
        if !guarded {
            let line = self.wf.template(cycle[0]).map_or(1, |t| t.name.line);
            self.err(
                line,
                Rule::Cycle,
                format!(
                    "templates call each other without end (no `when` on the way): {}",
                    cycle.join(" -> ")
                ),
            );
        }
    }
}

/// A circle in `edges` (node → what it depends on or calls), as a path that returns to its
/// start, or `None`.
fn find_cycle<'a>(edges: &BTreeMap<&'a str, Vec<&'a str>>) -> Option<Vec<&'a str>> {
    fn visit<'a>(
        n: &'a str,
        edges: &BTreeMap<&'a str, Vec<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<&'a str>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let start = path.iter().position(|p| *p == n).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(n);
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(n, 1);
        path.push(n);
        for next in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, edges, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(n, 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if let Some(c) = visit(n, edges, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

fn ancestors<'a>(edges: &BTreeMap<&'a str, Vec<&'a str>>, of: &str) -> BTreeSet<&'a str> {
    let mut out = BTreeSet::new();
    let mut todo: Vec<&str> = edges.get(of).cloned().unwrap_or_default();
    while let Some(n) = todo.pop() {
        if out.insert(n) {
            todo.extend(edges.get(n).into_iter().flatten());
        }
    }
    out
}
