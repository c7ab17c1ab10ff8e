//! The limits every YAML document nightshift reads is held to (job files, Argo workflow
//! files), and the one reader that enforces them.
//!
//! Aliases let a short document stand for a huge one: nine `lol`s under `&a`, nine `*a`s
//! under `&b`, and so on eight levels deep is 43 million nodes from under a kilobyte. Deep
//! nesting makes a tree builder recurse, and libyaml's scanner (under `yaml_serde`) takes time
//! that grows with the square of it. [`load`] reads a document's events with yaml-rust2, which
//! is linear and never recurses, counting the document as it would be with every alias
//! written out, and stops at the first event past a limit: before anything is built and
//! before any other parser sees the text.

use std::borrow::Cow;
use std::collections::HashMap;

use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::{Marker, ScanError};

/// Most collections (mappings and lists) nested in one another. A job file needs 4, an Argo
/// workflow rarely more than 15.
pub const MAX_DEPTH: usize = 64;
/// Most nodes (scalars, mappings, lists) a document may hold with its aliases expanded.
pub const MAX_NODES: usize = 100_000;
/// Most bytes of scalar text a document may hold with its aliases expanded.
pub const MAX_TEXT_BYTES: usize = 8 << 20;

/// Most quoted scalars [`load`] re-indents (see [`STRICT_QUOTED_INDENT`]). Each costs a
/// re-read of the whole document, so fewer in a long one: at most [`MAX_REREAD_BYTES`] are
/// re-read in all (a quarter of a second), whatever the document.
const MAX_REINDENTS: usize = 100;
const MAX_REREAD_BYTES: usize = 8 << 20;

/// A document that is not YAML, or is past one of the limits. Each names its line (1-based)
/// and, for a limit, the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum YamlError {
    #[error("line {line}: {info}")]
    Syntax { line: usize, info: String },
    #[error("line {line}: nested deeper than the limit of {MAX_DEPTH} levels")]
    TooDeep { line: usize },
    #[error("line {line}: more than the limit of {MAX_NODES} nodes with its aliases expanded")]
    TooManyNodes { line: usize },
    #[error(
        "line {line}: more than the limit of {MAX_TEXT_BYTES} bytes of text with its aliases expanded"
    )]
    TooMuchText { line: usize },
    #[error("line {line}: an alias refers to the collection that holds it")]
    RecursiveAlias { line: usize },
}

impl YamlError {
    pub fn line(&self) -> usize {
        match self {
            Self::Syntax { line, .. }
            | Self::TooDeep { line }
            | Self::TooManyNodes { line }
            | Self::TooMuchText { line }
            | Self::RecursiveAlias { line } => *line,
        }
    }

    /// Whether the document is YAML but past a limit (or refers to itself).
    pub fn is_limit(&self) -> bool {
        !matches!(self, Self::Syntax { .. })
    }

    /// The message without its line.
    pub fn message(&self) -> String {
        let text = self.to_string();
        match text.split_once(": ") {
            Some((_, rest)) => rest.to_owned(),
            None => text,
        }
    }
}

/// Every event of `text` with its mark, once the whole document is known to be within the
/// limits. Lines are those of `text`.
pub fn load(text: &str) -> Result<Vec<(Event, Marker)>, YamlError> {
    read(text, true)
}

/// Checks `text` against the limits (and yaml-rust2's syntax) without keeping anything: the
/// guard to run before a parser that has no limits of its own.
pub fn check(text: &str) -> Result<(), YamlError> {
    read(text, false).map(drop)
}

/// The one place yaml-rust2 is stricter than libyaml (which Argo, kubectl and `yaml_serde`
/// use): the continuation lines of a quoted scalar must be indented deeper than its parent.
/// [`load`] indents them, which changes neither the scalar's value nor any line.
pub const STRICT_QUOTED_INDENT: &str = "invalid indentation in quoted scalar";

fn read(text: &str, keep: bool) -> Result<Vec<(Event, Marker)>, YamlError> {
    let reindents = reindents_for(text.len());
    let mut text = Cow::Borrowed(text);
    let mut reindented = 0;
    loop {
        let e = match read_once(&text, keep) {
            Ok(events) => return Ok(events),
            Err(Read::Refused(e)) => return Err(e),
            Err(Read::Scan(e)) => e,
        };
        if e.info() != STRICT_QUOTED_INDENT {
            return Err(syntax(&e));
        }
        if reindented == reindents {
            return Err(YamlError::Syntax {
                line: e.marker().line().max(1),
                info: format!(
                    "{STRICT_QUOTED_INDENT}: indent its lines deeper than its key (only \
                     {reindents} such scalars are re-indented in a document this long)"
                ),
            });
        }
        match indent_quoted(&text, e.marker().index(), e.marker().col()) {
            Some(fixed) => text = Cow::Owned(fixed),
            None => return Err(syntax(&e)),
        }
        reindented += 1;
    }
}

/// How many quoted scalars [`read`] re-indents in a document of `len` bytes.
fn reindents_for(len: usize) -> usize {
    (MAX_REREAD_BYTES / len.max(1)).min(MAX_REINDENTS)
}

fn syntax(e: &ScanError) -> YamlError {
    let line = e.marker().line().max(1);
    if e.info() == FLOW_TOO_DEEP {
        return YamlError::TooDeep { line };
    }
    YamlError::Syntax {
        line,
        info: e.info().to_owned(),
    }
}

/// Yaml-rust2's scanner reads ahead of the events, and refuses flow collections nested past
/// 255 before they reach [`Budget`]: the same limit, met sooner.
const FLOW_TOO_DEEP: &str = "recursion limit exceeded";

enum Read {
    /// Yaml-rust2 refused it, perhaps curably ([`indent_quoted`]).
    Scan(ScanError),
    Refused(YamlError),
}

fn read_once(text: &str, keep: bool) -> Result<Vec<(Event, Marker)>, Read> {
    let mut parser = Parser::new_from_str(text);
    let mut budget = Budget::default();
    let mut events = Vec::new();
    loop {
        let (event, mark) = parser.next_token().map_err(Read::Scan)?;
        budget
            .event(&event, mark.line().max(1))
            .map_err(Read::Refused)?;
        let end = event == Event::StreamEnd;
        if keep {
            events.push((event, mark));
        }
        if end {
            return Ok(events);
        }
    }
}

/// Indents the continuation lines of the quoted scalar starting at char `index` (column
/// `col`) one deeper than its quote, which changes neither its value (leading blanks of
/// continuation lines are folded away) nor any line number. `None` when there is no quoted
/// scalar there, or when the text would grow by more than its own length.
fn indent_quoted(text: &str, index: usize, col: usize) -> Option<String> {
    let (start, _) = text.char_indices().nth(index)?;
    let quote = text[start..]
        .chars()
        .next()
        .filter(|c| *c == '"' || *c == '\'')?;
    let most = text.len().saturating_mul(2).saturating_add(4096);
    let mut out = String::with_capacity(text.len() + 64);
    out.push_str(&text[..=start]);
    let mut rest = text[start + 1..].char_indices();
    while let Some((i, c)) = rest.next() {
        out.push(c);
        if quote == '"' && c == '\\' {
            if let Some((_, next)) = rest.next() {
                out.push(next);
            }
        } else if c == quote {
            let after = start + 1 + i + 1;
            if quote == '\'' && text[after..].starts_with('\'') {
                out.push('\'');
                rest.next();
            } else {
                out.push_str(&text[after..]);
                return Some(out);
            }
        } else if c == '\n' {
            if out.len() + col + 1 > most {
                return None;
            }
            out.extend(std::iter::repeat_n(' ', col + 1));
        }
    }
    None
}

/// What a node amounts to with its aliases expanded.
#[derive(Debug, Clone, Copy)]
struct Size {
    nodes: usize,
    text: usize,
    /// Collections nested in it, itself included: 0 for a scalar.
    height: usize,
}

/// A collection not yet ended.
struct Open {
    anchor: usize,
    /// The document's counts when it started.
    nodes: usize,
    text: usize,
    /// The tallest of its children so far.
    below: usize,
}

/// The document as it would be with every alias written out, counted event by event.
#[derive(Default)]
struct Budget {
    open: Vec<Open>,
    anchors: HashMap<usize, Size>,
    nodes: usize,
    text: usize,
}

impl Budget {
    fn event(&mut self, event: &Event, line: usize) -> Result<(), YamlError> {
        match event {
            Event::DocumentStart => self.anchors.clear(),
            Event::Scalar(text, _, anchor, _) => {
                let size = Size {
                    nodes: 1,
                    text: text.len(),
                    height: 0,
                };
                self.add(size, line)?;
                if *anchor > 0 {
                    self.anchors.insert(*anchor, size);
                }
            }
            Event::Alias(id) => match self.anchors.get(id) {
                Some(size) => self.add(*size, line)?,
                None if self.open.iter().any(|o| o.anchor == *id) => {
                    return Err(YamlError::RecursiveAlias { line });
                }
                None => {
                    return Err(YamlError::Syntax {
                        line,
                        info: "an alias names no anchor before it".to_owned(),
                    });
                }
            },
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                let size = Size {
                    nodes: 1,
                    text: 0,
                    height: 1,
                };
                self.add(size, line)?;
                self.open.push(Open {
                    anchor: *anchor,
                    nodes: self.nodes - 1,
                    text: self.text,
                    below: 0,
                });
            }
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some(open) = self.open.pop() {
                    let size = Size {
                        nodes: self.nodes - open.nodes,
                        text: self.text - open.text,
                        height: open.below + 1,
                    };
                    if open.anchor > 0 {
                        self.anchors.insert(open.anchor, size);
                    }
                    if let Some(parent) = self.open.last_mut() {
                        parent.below = parent.below.max(size.height);
                    }
                }
            }
            Event::Nothing | Event::StreamStart | Event::StreamEnd | Event::DocumentEnd => {}
        }
        Ok(())
    }

    /// Places a node of `size` in the innermost open collection. A collection's own node is
    /// counted when it starts; its height is passed up when it ends.
    fn add(&mut self, size: Size, line: usize) -> Result<(), YamlError> {
        if self.open.len() + size.height > MAX_DEPTH {
            return Err(YamlError::TooDeep { line });
        }
        self.nodes = self.nodes.saturating_add(size.nodes);
        if self.nodes > MAX_NODES {
            return Err(YamlError::TooManyNodes { line });
        }
        self.text = self.text.saturating_add(size.text);
        if self.text > MAX_TEXT_BYTES {
            return Err(YamlError::TooMuchText { line });
        }
        if let Some(parent) = self.open.last_mut() {
            parent.below = parent.below.max(size.height);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bomb(levels: usize) -> String {
        let mut text = format!("l1: &l1 [{}]\n", ["lol"; 9].join(", "));
        for l in 2..=levels {
            let below = vec![format!("*l{}", l - 1); 9].join(", ");
            text.push_str(&format!("l{l}: &l{l} [{below}]\n"));
        }
        text
    }

    #[test]
    fn aliases_count_as_what_they_expand_to() {
        // Level n holds 9 of level n-1 and itself: 66,430 nodes at five, 597,870 at six.
        assert_eq!(check(&bomb(5)), Ok(()));
        assert_eq!(check(&bomb(6)), Err(YamlError::TooManyNodes { line: 6 }));
        assert_eq!(
            check(&bomb(8)).unwrap_err().to_string(),
            "line 6: more than the limit of 100000 nodes with its aliases expanded"
        );
    }

    #[test]
    fn depth_counts_collections_and_aliases_of_them() {
        let nested = |n: usize| format!("{}x{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(check(&nested(MAX_DEPTH)), Ok(()));
        assert_eq!(
            check(&nested(MAX_DEPTH + 1)),
            Err(YamlError::TooDeep { line: 1 })
        );
        // Past yaml-rust2's own flow limit (255), the same error.
        assert_eq!(check(&nested(1000)), Err(YamlError::TooDeep { line: 1 }));
        let tall = format!("a: &t {}\nb: [*t]\n", nested(MAX_DEPTH - 1));
        assert_eq!(check(&tall), Err(YamlError::TooDeep { line: 2 }));
    }

    #[test]
    fn an_anchor_used_inside_itself_is_refused() {
        assert_eq!(
            check("a: &a {b: *a}\n"),
            Err(YamlError::RecursiveAlias { line: 1 })
        );
    }

    #[test]
    fn syntax_errors_name_their_line_and_are_no_limit() {
        let err = check("a: 1\nb: [1, 2\nc: 3\n").unwrap_err();
        assert!(!err.is_limit());
        assert!(err.line() >= 2, "{err}");
    }

    #[test]
    fn load_keeps_every_event_with_its_line() {
        let events = load("a: &x [1]\nb: *x\n").unwrap();
        let lines: Vec<usize> = events
            .iter()
            .filter(|(e, _)| matches!(e, Event::Alias(_)))
            .map(|(_, m)| m.line())
            .collect();
        assert_eq!(lines, [2]);
        assert_eq!(events.last().map(|(e, _)| e), Some(&Event::StreamEnd));
    }

    #[test]
    fn quoted_scalars_are_reindented_but_never_grown_without_bound() {
        // libyaml accepts continuation lines at the key's column; yaml-rust2 does not.
        let events = load("a:\n  b: [\"x\ny\"]\n").unwrap();
        assert!(
            events
                .iter()
                .any(|(e, _)| matches!(e, Event::Scalar(t, ..) if t == "x y"))
        );
        // A quote 90,000 columns in with 20,000 lines after it: indenting each line one
        // deeper than the quote would be 1.8 GB. Refused as written instead.
        let text = format!(
            "a:\n  b: [{}\"x{}\"]\n",
            "1, ".repeat(30_000),
            "\nz".repeat(20_000)
        );
        let err = check(&text).unwrap_err();
        assert_eq!(
            err,
            YamlError::Syntax {
                line: 2,
                info: STRICT_QUOTED_INDENT.to_owned()
            }
        );
    }

    #[test]
    fn a_long_document_gets_fewer_reindents() {
        // Each re-indent re-reads the whole document: 8 MiB in all, at most.
        assert_eq!(reindents_for(1 << 20), 8);
        assert_eq!(reindents_for(10_000), MAX_REINDENTS);
        let bad = "  k: [\"x\ny\"]\n";
        let ok = format!("a:\n{}", bad.repeat(MAX_REINDENTS));
        assert_eq!(check(&ok), Ok(()));
        let err = check(&format!("{ok}{bad}")).unwrap_err();
        assert_eq!(err.line(), 2 * MAX_REINDENTS + 2);
        assert!(
            err.to_string()
                .ends_with("(only 100 such scalars are re-indented in a document this long)"),
            "{err}"
        );
    }
}
