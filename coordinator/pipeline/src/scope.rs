//! What `{{...}}` resolves to at one node of a run: its inputs, the workflow's parameters
//! and globals, the outputs of earlier steps or tasks, and the loop item.

use std::collections::BTreeMap;

/// Values visible at one place, by their full placeholder name
/// (`inputs.parameters.x`, `steps.a.outputs.result`, `item`, `item.num`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scope {
    values: BTreeMap<String, String>,
}

impl Scope {
    pub fn set(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.values.insert(name.into(), value.into());
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// The bytes of its names and values: what a copy of it holds.
    pub fn bytes(&self) -> usize {
        self.values.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    /// Adds `item` and, for an object, `item.FIELD` for each field.
    pub fn set_item(&mut self, item: &serde_json::Value) {
        self.set("item", json_text(item));
        if let serde_json::Value::Object(fields) = item {
            for (k, v) in fields {
                self.set(format!("item.{k}"), json_text(v));
            }
        }
    }

    /// `text` with its placeholders filled; the name of the first unknown one on failure.
    pub fn fill(&self, text: &str) -> Result<String, String> {
        crate::placeholder::fill(text, |name| self.get(name).map(str::to_owned))
    }
}

/// A JSON value as a parameter string: strings bare, everything else as JSON.
pub fn json_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_expose_their_fields() {
        let mut s = Scope::default();
        s.set_item(&serde_json::json!({"num": "4", "evenness": "even", "n": 2}));
        assert_eq!(
            s.fill("{{item.num}}/{{item.n}} {{item.evenness}}").unwrap(),
            "4/2 even"
        );
        s.set_item(&serde_json::json!(3));
        assert_eq!(s.fill("{{item}}").unwrap(), "3");
        assert_eq!(s.fill("{{nope}}"), Err("nope".to_owned()));
    }
}
