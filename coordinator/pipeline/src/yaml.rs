//! A YAML document as a tree whose every node and key knows its line, so that every
//! diagnostic can name the line a user must fix.
//!
//! Built from yaml-rust2's marked events, read by [`nightshift_common::yaml::load`] within its
//! limits. Anchors and aliases are expanded; tags are ignored.

use std::collections::HashMap;

use nightshift_common::yaml;
use yaml_rust2::parser::{Event, MarkedEventReceiver};
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

/// Parses `text` into one document. More than one document, or none, is an error, and so is
/// a document past the limits every YAML file is held to ([`nightshift_common::yaml`]):
/// nesting, and what its aliases expand to.
pub fn parse(text: &str) -> Result<Node, Diagnostic> {
    let events = yaml::load(text).map_err(|e| {
        let rule = if e.is_limit() {
            Rule::YamlLimit
        } else {
            Rule::YamlSyntax
        };
        Diagnostic::new(e.line(), rule, e.message())
    })?;
    let mut builder = Builder::default();
    for (event, mark) in events {
        builder.on_event(event, mark);
    }
    parse_finish(builder)
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

#[cfg(test)]
mod limits {
    use super::*;

    fn refused(text: &str) -> Diagnostic {
        match parse(text) {
            Ok(_) => panic!("accepted a document of {} bytes", text.len()),
            Err(e) => e,
        }
    }

    /// Nine of `lol` under `&a`, nine aliases of the level below under each next level.
    fn alias_bomb(levels: usize) -> String {
        let mut text = format!("x-l1: &l1 [{}]\n", ["lol"; 9].join(", "));
        for l in 2..=levels {
            let below = vec![format!("*l{}", l - 1); 9].join(", ");
            text.push_str(&format!("x-l{l}: &l{l} [{below}]\n"));
        }
        text
    }

    #[test]
    fn an_alias_bomb_is_refused_naming_the_limit() {
        // Six levels: 597,870 nodes from 295 bytes. Eight took the coordinator down.
        for levels in [6, 8] {
            let err = refused(&alias_bomb(levels));
            assert_eq!((err.line, err.rule), (6, Rule::YamlLimit), "{err}");
            assert!(
                err.message.contains("limit of 100000 nodes"),
                "{}",
                err.message
            );
        }
        // Five levels (66,430 nodes) are within it, and expanded as before.
        let doc = parse(&alias_bomb(5)).unwrap();
        let l5 = &doc.map().unwrap()[4].1;
        assert_eq!(l5.seq().unwrap()[8].seq().unwrap().len(), 9);
    }

    #[test]
    fn long_scalars_repeated_by_aliases_are_refused() {
        let text = format!(
            "a: &s '{}'\nb: [{}]\n",
            "x".repeat(100_000),
            vec!["*s"; 100].join(", ")
        );
        let err = refused(&text);
        assert_eq!((err.line, err.rule), (2, Rule::YamlLimit), "{err}");
        assert!(err.message.contains("bytes of text"), "{}", err.message);
    }

    #[test]
    fn deep_nesting_is_refused_naming_the_limit() {
        // Block nesting: yaml-rust2's own loader recursed once per level.
        let mut block = String::new();
        for depth in 0..100 {
            block.push_str(&format!("{}k{depth}:\n", " ".repeat(depth)));
        }
        let flow = format!("a: {}1{}\n", "[".repeat(100), "]".repeat(100));
        for text in [block, flow] {
            let err = refused(&text);
            assert_eq!(err.rule, Rule::YamlLimit, "{err}");
            assert!(
                err.message.contains("limit of 64 levels"),
                "{}",
                err.message
            );
        }
        // An alias of a tall collection counts as tall as what it names.
        let tall = format!("a: &t {}1{}\nb: [[[*t]]]\n", "[".repeat(62), "]".repeat(62));
        assert_eq!(refused(&tall).line, 2);
        parse(&format!("a: {}1{}\n", "[".repeat(63), "]".repeat(63))).unwrap();
    }

    #[test]
    fn an_alias_inside_its_own_anchor_is_refused() {
        let err = refused("a: &a [1, *a]\n");
        assert_eq!(err.rule, Rule::YamlLimit, "{err}");
    }
}
