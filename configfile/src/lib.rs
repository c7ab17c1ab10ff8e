//! Checking a TOML configuration file against its typed struct, with every problem reported
//! as `FILE: line N: KEY: message`.
//!
//! The binaries load their configuration with the `config` crate (file, then
//! `NIGHTSHIFT_*` environment overrides). Its errors name the key but not the line, and it
//! stops at the first. So the file is first checked on its own here: a syntax error, a
//! wrong type or an unknown key is reported with its line, all of them at once (after each
//! problem the offending key is set aside and the rest checked again). [`KeyLines`] then
//! gives the line of a key for the rules checked after loading.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_path_to_error::Segment;
use toml::de::{DeTable, DeValue};

/// At most this many problems are reported for one file.
const MAX_PROBLEMS: usize = 50;

/// One problem of a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// 1-based; absent when the problem has no place in the file (a key that is not there).
    pub line: Option<usize>,
    /// The key's dotted path, e.g. `replica.port` or `services[0].name`.
    pub key: Option<String>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ": line {line}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": {key}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for Problem {}

/// Every problem found in a file, one per line when displayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problems(pub Vec<Problem>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Problems {}

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Problems(Problems),
}

/// Where each key of a TOML document is: its dotted path (`services[0].scale_up.running_per_replica`)
/// to its 1-based line.
#[derive(Debug, Clone, Default)]
pub struct KeyLines {
    file: PathBuf,
    lines: HashMap<String, usize>,
}

impl KeyLines {
    /// The line of `key`, or of its nearest enclosing table that the file has.
    pub fn line(&self, key: &str) -> Option<usize> {
        let mut key = key;
        loop {
            if let Some(line) = self.lines.get(key) {
                return Some(*line);
            }
            key = &key[..key.rfind(['.', '['])?];
        }
    }

    /// A problem of `key` found after loading, placed at its line when the file has it.
    pub fn problem(&self, key: &str, message: impl Into<String>) -> Problem {
        Problem {
            file: self.file.clone(),
            line: self.lines.get(key).copied(),
            key: Some(key.to_owned()),
            message: message.into(),
        }
    }

    fn index(file: &Path, text: &str, doc: &DeTable<'_>) -> Self {
        let mut lines = HashMap::new();
        walk_table(text, doc, "", &mut lines);
        Self {
            file: file.to_owned(),
            lines,
        }
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

fn walk_table(text: &str, table: &DeTable<'_>, prefix: &str, lines: &mut HashMap<String, usize>) {
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.get_ref().to_string()
        } else {
            format!("{prefix}.{}", key.get_ref())
        };
        lines
            .entry(path.clone())
            .or_insert_with(|| line_of(text, key.span().start));
        walk_value(text, value.get_ref(), &path, lines);
    }
}

fn walk_value(text: &str, value: &DeValue<'_>, path: &str, lines: &mut HashMap<String, usize>) {
    match value {
        DeValue::Table(t) => walk_table(text, t, path, lines),
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let item_path = format!("{path}[{i}]");
                lines
                    .entry(item_path.clone())
                    .or_insert_with(|| line_of(text, item.span().start));
                walk_value(text, item.get_ref(), &item_path, lines);
            }
        }
        _ => {}
    }
}

/// A binary's configuration: `file` checked against `T` first (every syntax error, wrong
/// type and unknown key with its line), then read with the environment's overrides on top
/// (`ENV_PREFIX__KEY`, `__` between nested keys, values parsed as TOML scalars), then given
/// to `validate` with where each of the file's keys is, so that a rule it finds broken can be
/// reported at its key's line ([`KeyLines::problem`]). Without `file`, the environment
/// alone.
pub fn load<T, E>(
    file: Option<&Path>,
    env_prefix: &str,
    validate: impl FnOnce(&T, Option<&KeyLines>) -> Result<(), E>,
) -> Result<T, E>
where
    T: DeserializeOwned,
    E: From<FileError> + From<config::ConfigError>,
{
    let lines = file.map(check_file::<T>).transpose()?;
    let mut builder = config::Config::builder();
    if let Some(file) = file {
        builder = builder.add_source(config::File::from(file).required(true));
    }
    let loaded: T = builder
        .add_source(
            config::Environment::with_prefix(env_prefix)
                .separator("__")
                .try_parsing(true),
        )
        .build()?
        .try_deserialize()?;
    validate(&loaded, lines.as_ref())?;
    Ok(loaded)
}

/// Reads `file` and checks it against `T`; see [`check_text`].
pub fn check_file<T: DeserializeOwned>(file: &Path) -> Result<KeyLines, FileError> {
    let text = std::fs::read_to_string(file).map_err(|source| FileError::Read {
        path: file.to_owned(),
        source,
    })?;
    check_text::<T>(file, &text).map_err(FileError::Problems)
}

/// Checks `text` (the contents of `file`) against `T`: every syntax error, or else every
/// wrong type and unknown key, each with its line. On success, where each key is.
pub fn check_text<T: DeserializeOwned>(file: &Path, text: &str) -> Result<KeyLines, Problems> {
    let (doc, errors) = DeTable::parse_recoverable(text);
    if !errors.is_empty() {
        return Err(Problems(
            errors
                .iter()
                .take(MAX_PROBLEMS)
                .map(|e| Problem {
                    file: file.to_owned(),
                    line: e.span().map(|s| line_of(text, s.start)),
                    key: None,
                    message: e.message().trim().to_owned(),
                })
                .collect(),
        ));
    }
    let lines = KeyLines::index(file, text, doc.get_ref());
    let mut table: toml::Table = toml::from_str(text).map_err(|e| {
        Problems(vec![Problem {
            file: file.to_owned(),
            line: e.span().map(|s| line_of(text, s.start)),
            key: None,
            message: e.message().trim().to_owned(),
        }])
    })?;
    let mut problems = Vec::new();
    while problems.len() < MAX_PROBLEMS {
        let err = match serde_path_to_error::deserialize::<_, T>(toml::Value::Table(table.clone()))
        {
            Ok(_) => break,
            Err(err) => err,
        };
        let segments: Vec<Segment> = err.path().iter().cloned().collect();
        let key = err.path().to_string();
        let known = key != ".";
        problems.push(Problem {
            file: file.to_owned(),
            line: known.then(|| lines.line(&key)).flatten(),
            key: known.then_some(key),
            message: err.into_inner().message().trim().to_owned(),
        });
        // Set the key aside and look for the next problem; stop when that is impossible.
        if !remove(&mut table, &segments) {
            break;
        }
    }
    problems.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
    if problems.is_empty() {
        Ok(lines)
    } else {
        Err(Problems(problems))
    }
}

/// Removes the value at `path` from `table`; false when there is none.
fn remove(table: &mut toml::Table, path: &[Segment]) -> bool {
    let Some((last, parents)) = path.split_last() else {
        return false;
    };
    let mut here = TableOrArray::Table(table);
    for segment in parents {
        here = match (here, segment) {
            (TableOrArray::Table(t), Segment::Map { key }) => match t.get_mut(key) {
                Some(v) => TableOrArray::from(v),
                None => return false,
            },
            (TableOrArray::Array(a), Segment::Seq { index }) => match a.get_mut(*index) {
                Some(v) => TableOrArray::from(v),
                None => return false,
            },
            _ => return false,
        };
    }
    match (here, last) {
        (TableOrArray::Table(t), Segment::Map { key }) => t.remove(key).is_some(),
        (TableOrArray::Array(a), Segment::Seq { index }) if *index < a.len() => {
            a.remove(*index);
            true
        }
        _ => false,
    }
}

enum TableOrArray<'a> {
    Table(&'a mut toml::Table),
    Array(&'a mut Vec<toml::Value>),
    Other,
}

impl<'a> From<&'a mut toml::Value> for TableOrArray<'a> {
    fn from(v: &'a mut toml::Value) -> Self {
        match v {
            toml::Value::Table(t) => Self::Table(t),
            toml::Value::Array(a) => Self::Array(a),
            _ => Self::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    #[allow(dead_code)]
    struct Cfg {
        port: u16,
        name: String,
        inner: Inner,
        services: Vec<Service>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    #[allow(dead_code)]
    struct Inner {
        timeout_s: f64,
        enabled: bool,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    #[allow(dead_code)]
    struct Service {
        name: String,
        min_replicas: u32,
    }

    impl Default for Cfg {
        fn default() -> Self {
            Self {
                port: 1,
                name: "x".into(),
                inner: Inner::default(),
                services: Vec::new(),
            }
        }
    }

    fn check(text: &str) -> Result<KeyLines, Vec<String>> {
        check_text::<Cfg>(Path::new("/etc/x.toml"), text)
            .map_err(|p| p.0.iter().map(ToString::to_string).collect())
    }

    #[test]
    fn every_wrong_type_and_unknown_key_is_named_with_its_line() {
        let text = "\
port = 70000
name = \"ok\"

[inner]
timeout_s = \"soon\"
enabeld = true

[[services]]
name = \"a\"

[[services]]
name = \"b\"
min_replicas = -1
";
        let problems = check(text).unwrap_err();
        assert_eq!(
            problems,
            vec![
                "/etc/x.toml: line 1: port: invalid value: integer `70000`, expected u16",
                "/etc/x.toml: line 5: inner.timeout_s: invalid type: string \"soon\", expected f64",
                "/etc/x.toml: line 6: inner.enabeld: unknown field `enabeld`, expected `timeout_s` or `enabled`",
                "/etc/x.toml: line 13: services[1].min_replicas: invalid value: integer `-1`, expected u32",
            ]
        );
    }

    #[test]
    fn syntax_errors_name_the_line() {
        let problems = check("port = 1\nname = \"a\"\nname = \"b\"\n").unwrap_err();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("/etc/x.toml: line 3: ") && problems[0].contains("duplicate"),
            "{problems:?}"
        );
    }

    #[test]
    fn a_valid_file_maps_keys_to_lines() {
        let lines =
            check("port = 8\n\n[inner]\nenabled = true\n[[services]]\nname = \"a\"\n").unwrap();
        assert_eq!(lines.line("port"), Some(1));
        assert_eq!(lines.line("inner.enabled"), Some(4));
        assert_eq!(lines.line("services[0].name"), Some(6));
        // A key the file lacks falls back to its table.
        assert_eq!(lines.line("inner.timeout_s"), Some(3));
        assert_eq!(lines.line("absent"), None);
        assert_eq!(
            lines.problem("inner.enabled", "must be off").to_string(),
            "/etc/x.toml: line 4: inner.enabled: must be off"
        );
    }

    #[test]
    fn an_unreadable_file_is_named() {
        let err = check_file::<Cfg>(Path::new("/nonexistent/x.toml")).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("cannot read /nonexistent/x.toml: "),
            "{err}"
        );
    }
}
