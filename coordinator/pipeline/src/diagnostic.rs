//! What lint and submit say about a workflow file: a rule broken at a line.

use std::fmt;

/// The rule a workflow breaks. Each has a stable kebab-case name for scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    /// The file is not YAML.
    YamlSyntax,
    /// The file nests deeper, or its aliases expand to more, than nightshift reads
    /// (`nightshift_common::yaml`'s limits).
    YamlLimit,
    /// Not an Argo `Workflow` of `argoproj.io/v1alpha1`.
    NotAWorkflow,
    /// A field nightshift does not know at all (often a typo).
    UnknownField,
    /// An Argo feature that nightshift does not run.
    UnsupportedFeature,
    /// A field that must be present is not.
    MissingField,
    /// A field holds a value of the wrong type or out of range.
    InvalidValue,
    /// Two templates, steps or parameters share a name.
    DuplicateName,
    /// A step, task, entrypoint or exit handler names a template that does not exist.
    UnknownTemplate,
    /// A `depends`/`dependencies` entry names a task that does not exist.
    UnknownTask,
    /// Tasks depend on each other in a circle, or templates call each other in a circle.
    Cycle,
    /// `{{...}}` refers to a parameter, step or output that does not exist here.
    UndefinedReference,
    /// A template input gets no value.
    MissingArgument,
    /// A `depends` or `when` expression does not parse.
    MalformedExpression,
}

impl Rule {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::YamlSyntax => "yaml-syntax",
            Self::YamlLimit => "yaml-limit",
            Self::NotAWorkflow => "not-a-workflow",
            Self::UnknownField => "unknown-field",
            Self::UnsupportedFeature => "unsupported-feature",
            Self::MissingField => "missing-field",
            Self::InvalidValue => "invalid-value",
            Self::DuplicateName => "duplicate-name",
            Self::UnknownTemplate => "unknown-template",
            Self::UnknownTask => "unknown-task",
            Self::Cycle => "cycle",
            Self::UndefinedReference => "undefined-reference",
            Self::MissingArgument => "missing-argument",
            Self::MalformedExpression => "malformed-expression",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One finding: the line (1-based), the rule, and what exactly is wrong.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Diagnostic {
    pub line: usize,
    pub rule: Rule,
    pub message: String,
}

impl Diagnostic {
    pub fn new(line: usize, rule: Rule, message: impl Into<String>) -> Self {
        Self {
            line,
            rule,
            message: message.into(),
        }
    }

    /// `FILE:LINE: RULE: MESSAGE`, the form compilers use, which editors can jump to.
    pub fn display_in(&self, file: &str) -> String {
        format!("{file}:{}: {}: {}", self.line, self.rule, self.message)
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}: {}", self.line, self.rule, self.message)
    }
}

impl From<&Diagnostic> for nightshift_common::LintFinding {
    fn from(d: &Diagnostic) -> Self {
        Self {
            line: d.line,
            rule: d.rule.as_str().to_owned(),
            message: d.message.clone(),
        }
    }
}

/// Every finding of one file, in line order. Empty means the workflow can run.
#[derive(Debug, Clone, Default, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.summary())]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    pub fn push(&mut self, d: Diagnostic) {
        self.0.push(d);
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn sorted(mut self) -> Self {
        self.0.sort();
        self.0.dedup();
        self
    }

    fn summary(&self) -> String {
        self.0
            .iter()
            .map(Diagnostic::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }
}
