//! Why a `nightshift` command failed, and the exit code and blamed field each failure maps to.

use std::io;

use nightshift_common::SpecError;

use crate::client::ClientError;

/// The field `JobSpec::from_yaml` names when the file does not parse at all.
const WHOLE_FILE_FIELD: &str = "job file";

/// Why a command failed, with the exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("cannot read job file {path}: {source}")]
    ReadJobFile {
        path: String,
        #[source]
        source: io::Error,
    },

    #[error("job file {path}: {}", display_spec_error(.source))]
    JobFile {
        path: String,
        #[source]
        source: SpecError,
    },

    #[error("cannot read workflow file {path}: {source}")]
    ReadWorkflowFile {
        path: String,
        #[source]
        source: io::Error,
    },

    #[error("-p {0}: parameters are NAME=VALUE, and only workflows take them")]
    Parameter(String),

    #[error(transparent)]
    Client(#[from] ClientError),

    #[error(transparent)]
    Demo(#[from] crate::demo::DemoError),

    #[error(transparent)]
    Simulate(#[from] nightshift_sim::SimError),

    #[error("cannot write output: {0}")]
    Output(#[from] io::Error),

    #[error("{0}")]
    Usage(String),
}

fn display_spec_error(err: &SpecError) -> String {
    if err.field == WHOLE_FILE_FIELD {
        err.rule.clone()
    } else {
        err.to_string()
    }
}

impl CliError {
    /// 2 for bad input from the user (job file, coordinator URL), 1 for everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::ReadJobFile { .. }
            | Self::ReadWorkflowFile { .. }
            | Self::Parameter(_)
            | Self::JobFile { .. }
            | Self::Usage(_)
            | Self::Simulate(_)
            | Self::Client(ClientError::InvalidUrl { .. }) => 2,
            Self::Client(_) | Self::Demo(_) | Self::Output(_) => 1,
        }
    }

    /// The field to blame, if one is: of the job file, or named by the coordinator.
    pub fn field(&self) -> Option<String> {
        match self {
            Self::JobFile { source, .. } if source.field == WHOLE_FILE_FIELD => {
                parse_error_field(&source.rule)
            }
            Self::JobFile { source, .. } => Some(source.field.clone()),
            Self::Client(err) => err.field().map(str::to_owned),
            _ => None,
        }
    }
}

/// The field a YAML parse error is about, read from the parser's message: it starts with the
/// path of the offending value (`env[0]: ...`) and names unknown or missing keys in backticks
/// (``unknown field `valu` ``). `None` for syntax errors.
pub(crate) fn parse_error_field(rule: &str) -> Option<String> {
    let is_path = |p: &str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._[]".contains(c))
    };
    let (path, rest) = match rule.split_once(": ") {
        Some((path, rest)) if is_path(path) => (Some(path), rest),
        _ => (None, rule),
    };
    let key = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|prefix| {
            rest.strip_prefix(prefix)?
                .split_once('`')
                .map(|(key, _)| key)
        });
    match (path, key) {
        (Some(path), Some(key)) => Some(format!("{path}.{key}")),
        (Some(path), None) => Some(path.to_owned()),
        (None, Some(key)) => Some(key.to_owned()),
        (None, None) => None,
    }
}
