//! A YAML document as a tree whose every node and key knows its line, so that every
//! diagnostic can name the line a user must fix.
//!
//! Built from yaml-rust2's marked events. Anchors and aliases are expanded; tags are ignored.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

use crate::diagnostic::{Diagnostic, Rule};

/// A node and the line (1-based) where it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub line: usize,
    pub value: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A scalar; `plain` is false when it was quoted or a block scalar (then it is always a
    /// string, never a number, boolean or null).
    Scalar {
        text: String,
        plain: bool,
    },
    Seq(Vec<Node>),
    Map(Vec<(Key, Node)>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub name: String,
    pub line: usize,
}

impl Node {
    pub fn is_null(&self) -> bool {
        matches!(&self.value, Value::Scalar { text, plain: true } if matches!(text.as_str(), "" | "~" | "null" | "Null" | "NULL"))
    }

    /// The scalar's text, whatever YAML type it would have.
    pub fn scalar(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar { text, .. } => Some(text),
            _ => None,
        }
    }

    pub fn map(&self) -> Option<&[(Key, Node)]> {
        match &self.value {
            Value::Map(m) => Some(m),
            _ => None,
        }
    }

    pub fn seq(&self) -> Option<&[Node]> {
        match &self.value {
            Value::Seq(s) => Some(s),
            _ => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match &self.value {
            Value::Scalar { .. } => "a scalar",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }

    /// The value as JSON: plain scalars become numbers, booleans or null where YAML 1.2's
    /// core schema says so; everything else is a string.
    pub fn to_json(&self) -> serde_json::Value {
        match &self.value {
            Value::Scalar { text, plain } => {
                if !plain {
                    return serde_json::Value::String(text.clone());
                }
                if self.is_null() {
                    return serde_json::Value::Null;
                }
                match text.as_str() {
                    "true" | "True" | "TRUE" => return serde_json::Value::Bool(true),
                    "false" | "False" | "FALSE" => return serde_json::Value::Bool(false),
                    _ => {}
                }
                if let Ok(i) = text.parse::<i64>() {
                    return serde_json::Value::from(i);
                }
                if let Ok(f) = text.parse::<f64>()
                    && f.is_finite()
                    && let Some(n) = serde_json::Number::from_f64(f)
                {
                    return serde_json::Value::Number(n);
                }
                serde_json::Value::String(text.clone())
            }
            Value::Seq(items) => items.iter().map(Node::to_json).collect(),
            Value::Map(entries) => entries
                .iter()
                .map(|(k, v)| (k.name.clone(), v.to_json()))
                .collect::<serde_json::Map<_, _>>()
                .into(),
        }
    }
}

enum Frame {
    Seq(usize, Vec<Node>, usize),
    /// line, entries, a key waiting for its value, anchor
    Map(usize, Vec<(Key, Node)>, Option<Key>, usize),
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    docs: Vec<Node>,
    anchors: HashMap<usize, Node>,
    errors: Vec<Diagnostic>,
}

impl Builder {
    fn finish(&mut self, node: Node, anchor: usize) {
        if anchor > 0 {
            self.anchors.insert(anchor, node.clone());
        }
        match self.stack.last_mut() {
            None => self.docs.push(node),
            Some(Frame::Seq(_, items, _)) => items.push(node),
            Some(Frame::Map(_, entries, pending, _)) => match pending.take() {
                Some(key) => entries.push((key, node)),
                None => match node.value {
                    Value::Scalar { text, .. } => {
                        *pending = Some(Key {
                            name: text,
                            line: node.line,
                        })
                    }
                    _ => {
                        self.errors.push(Diagnostic::new(
                            node.line,
                            Rule::YamlSyntax,
                            "a mapping key must be a plain string",
                        ));
                        *pending = Some(Key {
                            name: String::new(),
                            line: node.line,
                        });
                    }
                },
            },
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        let line = mark.line();
        match ev {
            Event::Scalar(text, style, anchor, _tag) => {
                let plain = style == TScalarStyle::Plain;
                self.finish(
                    Node {
                        line,
                        value: Value::Scalar { text, plain },
                    },
                    anchor,
                );
            }
            Event::Alias(id) => {
                let node = self.anchors.get(&id).cloned().unwrap_or(Node {
                    line,
                    value: Value::Scalar {
                        text: String::new(),
                        plain: true,
                    },
                });
                self.finish(Node { line, ..node }, 0);
            }
            Event::SequenceStart(anchor, _) => {
                self.stack.push(Frame::Seq(line, Vec::new(), anchor))
            }
            Event::MappingStart(anchor, _) => {
                self.stack.push(Frame::Map(line, Vec::new(), None, anchor))
            }
            Event::SequenceEnd | Event::MappingEnd => match self.stack.pop() {
                Some(Frame::Seq(l, items, anchor)) => self.finish(
                    Node {
                        line: l,
                        value: Value::Seq(items),
                    },
                    anchor,
                ),
                Some(Frame::Map(l, entries, _, anchor)) => self.finish(
                    Node {
                        line: l,
                        value: Value::Map(entries),
                    },
                    anchor,
                ),
                None => {}
            },
            _ => {}
        }
    }
}

/// The one place yaml-rust2 is stricter than libyaml (which Argo and kubectl use): the
/// continuation lines of a quoted scalar must be indented deeper than its parent.
const STRICT_QUOTED_INDENT: &str = "invalid indentation in quoted scalar";

/// Parses `text` into one document. More than one document, or none, is an error.
pub fn parse(text: &str) -> Result<Node, Diagnostic> {
    let mut text = std::borrow::Cow::Borrowed(text);
    // Each retry indents one more quoted scalar; a file has few of them.
    for _ in 0..1000 {
        match parse_once(&text) {
            Err(Err(e)) => {
                let Some(fixed) = indent_quoted(&text, e.marker().index()) else {
                    return Err(Diagnostic::new(
                        e.marker().line().max(1),
                        Rule::YamlSyntax,
                        e.info().to_owned(),
                    ));
                };
                text = std::borrow::Cow::Owned(fixed);
            }
            Err(Ok(d)) => return Err(d),
            Ok(node) => return Ok(node),
        }
    }
    Err(Diagnostic::new(1, Rule::YamlSyntax, STRICT_QUOTED_INDENT))
}

/// Indents the continuation lines of the quoted scalar starting at char `index`, which
/// changes neither its value (leading blanks of continuation lines are folded away) nor any
/// line number. `None` when there is no quoted scalar there.
fn indent_quoted(text: &str, index: usize) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    let quote = *chars.get(index).filter(|c| **c == '"' || **c == '\'')?;
    let mut out: String = chars[..=index].iter().collect();
    let mut i = index + 1;
    while i < chars.len() {
        let c = chars[i];
        out.push(c);
        i += 1;
        if quote == '"' && c == '\\' {
            if let Some(next) = chars.get(i) {
                out.push(*next);
                i += 1;
            }
        } else if c == quote {
            if quote == '\'' && chars.get(i) == Some(&'\'') {
                out.push('\'');
                i += 1;
            } else {
                out.extend(&chars[i..]);
                return Some(out);
            }
        } else if c == '\n' {
            out.push_str(&" ".repeat(index + 1));
        }
    }
    None
}

/// `Err(Err(_))` is a scanner error that [`indent_quoted`] may cure.
fn parse_once(text: &str) -> Result<Node, Result<Diagnostic, yaml_rust2::ScanError>> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text);
    if let Err(e) = parser.load(&mut builder, true) {
        if e.info() == STRICT_QUOTED_INDENT {
            return Err(Err(e));
        }
        return Err(Ok(Diagnostic::new(
            e.marker().line().max(1),
            Rule::YamlSyntax,
            e.info().to_owned(),
        )));
    }
    let builder_errors = std::mem::take(&mut builder.errors);
    let builder = Builder {
        errors: builder_errors,
        ..builder
    };
    parse_finish(builder).map_err(Ok)
}

fn parse_finish(builder: Builder) -> Result<Node, Diagnostic> {
    if let Some(e) = builder.errors.into_iter().next() {
        return Err(e);
    }
    let mut docs = builder.docs.into_iter();
    let doc = docs
        .next()
        .ok_or_else(|| Diagnostic::new(1, Rule::NotAWorkflow, "the file is empty"))?;
    if let Some(second) = docs.next() {
        return Err(Diagnostic::new(
            second.line,
            Rule::NotAWorkflow,
            "one workflow per file: a second YAML document starts here",
        ));
    }
    Ok(doc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_of_keys_and_values() {
        let doc = parse("a: 1\nb:\n  - x\n  - {c: 'd'}\n").unwrap();
        let m = doc.map().unwrap();
        assert_eq!((m[0].0.name.as_str(), m[0].0.line), ("a", 1));
        assert_eq!(m[1].0.line, 2);
        let items = m[1].1.seq().unwrap();
        assert_eq!((items[0].line, items[1].line), (3, 4));
        assert_eq!(items[1].to_json(), serde_json::json!({"c": "d"}));
    }

    #[test]
    fn plain_scalars_have_types_quoted_ones_are_strings() {
        let doc = parse("[1, '1', true, \"true\", 1.5, ~, x]").unwrap();
        assert_eq!(
            doc.to_json(),
            serde_json::json!([1, "1", true, "true", 1.5, null, "x"])
        );
    }

    #[test]
    fn syntax_errors_name_the_line() {
        let err = parse("a: 1\nb: [1, 2\nc: 3\n").unwrap_err();
        assert_eq!(err.rule, Rule::YamlSyntax);
        assert!(err.line >= 2, "{err}");
    }

    #[test]
    fn a_second_document_is_refused() {
        let err = parse("a: 1\n---\nb: 2\n").unwrap_err();
        assert_eq!((err.line, err.rule), (3, Rule::NotAWorkflow));
    }

    #[test]
    fn quoted_scalars_indented_like_libyaml_accepts_them_parse() {
        // As in Argo's nested-workflow example: the closing quote at the key's own column.
        let text = "- a:\n    b: [\"\n      x \\\" y\n    \"]\n    c: 'p\n  q'\n";
        let doc = parse(text).unwrap();
        assert_eq!(
            doc.to_json(),
            serde_json::json!([{"a": {"b": [" x \" y "], "c": "p q"}}])
        );
        let c = &doc.seq().unwrap()[0].map().unwrap()[0].1.map().unwrap()[1];
        assert_eq!((c.0.name.as_str(), c.0.line), ("c", 5));
    }

    #[test]
    fn aliases_are_expanded() {
        let doc = parse("a: &x {b: 1}\nc: *x\n").unwrap();
        assert_eq!(
            doc.to_json(),
            serde_json::json!({"a": {"b": 1}, "c": {"b": 1}})
        );
    }
}
