//! `{{...}}` placeholders in workflow strings: finding them and filling them in.
//!
//! Only Argo's simple form is understood (`{{inputs.parameters.x}}`, spaces allowed inside
//! the braces); the expr-lang form `{{= ...}}` is reported as unsupported by lint.

/// One placeholder in a string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placeholder<'a> {
    /// The name inside the braces, trimmed: `inputs.parameters.x`.
    pub name: &'a str,
    /// Written `{{= ...}}`: an expr-lang expression.
    pub is_expression: bool,
}

/// Every placeholder of `text`, in order.
pub fn find(text: &str) -> Vec<Placeholder<'_>> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else { break };
        let inner = &after[..end];
        let is_expression = inner.starts_with('=');
        let name = inner.trim_start_matches('=').trim();
        out.push(Placeholder {
            name,
            is_expression,
        });
        rest = &after[end + 2..];
    }
    out
}

/// `text` with every placeholder replaced by `lookup(name)`. The first name that `lookup`
/// does not know is returned as the error.
pub fn fill(text: &str, mut lookup: impl FnMut(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else { break };
        out.push_str(&rest[..start]);
        let name = after[..end].trim();
        match lookup(name) {
            Some(v) => out.push_str(&v),
            None => return Err(name.to_owned()),
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_simple_and_expression_placeholders() {
        let found = find("a {{inputs.parameters.x}} b {{ item.y }} {{= 1 + 1}} {{unclosed");
        let names: Vec<_> = found.iter().map(|p| (p.name, p.is_expression)).collect();
        assert_eq!(
            names,
            [
                ("inputs.parameters.x", false),
                ("item.y", false),
                ("1 + 1", true)
            ]
        );
    }

    #[test]
    fn fills_or_names_the_unknown() {
        let filled = fill("{{a}}-{{ b }}!", |n| Some(n.to_uppercase())).unwrap();
        assert_eq!(filled, "A-B!");
        assert_eq!(fill("x {{nope}}", |_| None), Err("nope".to_owned()));
        assert_eq!(fill("no braces", |_| None).unwrap(), "no braces");
    }
}
