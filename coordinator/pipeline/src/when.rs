//! `when` conditions, in the govaluate form Argo documents:
//! `{{inputs.parameters.x}} == true`, `{{workflow.status}} != Succeeded`, `a < 5 && !(b == c)`.
//!
//! Placeholders are filled first; the result is parsed and evaluated. A bare word is a
//! string (`even`), `true`/`false` are booleans, numbers compare as numbers when both sides
//! are numbers.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WhenError(pub String);

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Word(String),
    Quoted(String),
    Op(&'static str),
    Open,
    Close,
}

const OPS: &[&str] = &["&&", "||", "==", "!=", "<=", ">=", "<", ">", "!"];

fn tokenize(text: &str) -> Result<Vec<Tok>, WhenError> {
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        if rest.starts_with("=~") || rest.starts_with("!~") {
            return Err(WhenError(
                "regular expression matches (=~, !~) are not supported".into(),
            ));
        }
        if let Some(op) = OPS.iter().find(|op| rest.starts_with(**op)) {
            out.push(Tok::Op(op));
            rest = &rest[op.len()..];
        } else if let Some(r) = rest.strip_prefix('(') {
            out.push(Tok::Open);
            rest = r;
        } else if let Some(r) = rest.strip_prefix(')') {
            out.push(Tok::Close);
            rest = r;
        } else if let Some(q) = rest.chars().next().filter(|c| *c == '\'' || *c == '"') {
            let body = &rest[1..];
            let end = body
                .find(q)
                .ok_or_else(|| WhenError(format!("unterminated string in {text:?}")))?;
            out.push(Tok::Quoted(body[..end].to_owned()));
            rest = &body[end + 1..];
        } else {
            let end = rest
                .find(|c: char| c.is_whitespace() || "()!=<>&|'\"".contains(c))
                .unwrap_or(rest.len());
            if end == 0 {
                return Err(WhenError(format!(
                    "unexpected {:?} in {text:?}",
                    &rest[..1]
                )));
            }
            out.push(Tok::Word(rest[..end].to_owned()));
            rest = &rest[end..];
        }
        rest = rest.trim_start();
    }
    Ok(out)
}

#[derive(Debug, Clone, PartialEq)]
enum Val {
    Bool(bool),
    Text(String),
}

impl Val {
    fn text(&self) -> String {
        match self {
            Self::Bool(b) => b.to_string(),
            Self::Text(t) => t.clone(),
        }
    }

    fn truth(&self) -> Result<bool, WhenError> {
        match self {
            Self::Bool(b) => Ok(*b),
            Self::Text(t) => Err(WhenError(format!("{t:?} is not true or false"))),
        }
    }
}

struct Eval<'a> {
    toks: &'a [Tok],
    pos: usize,
}

impl Eval<'_> {
    fn peek_op(&self) -> Option<&'static str> {
        match self.toks.get(self.pos) {
            Some(Tok::Op(op)) => Some(op),
            _ => None,
        }
    }

    fn or(&mut self) -> Result<Val, WhenError> {
        let mut v = self.and()?;
        while self.peek_op() == Some("||") {
            self.pos += 1;
            let r = self.and()?;
            v = Val::Bool(v.truth()? || r.truth()?);
        }
        Ok(v)
    }

    fn and(&mut self) -> Result<Val, WhenError> {
        let mut v = self.cmp()?;
        while self.peek_op() == Some("&&") {
            self.pos += 1;
            let r = self.cmp()?;
            v = Val::Bool(v.truth()? && r.truth()?);
        }
        Ok(v)
    }

    fn cmp(&mut self) -> Result<Val, WhenError> {
        let left = self.unary()?;
        let Some(op) = self
            .peek_op()
            .filter(|op| !matches!(*op, "&&" | "||" | "!"))
        else {
            return Ok(left);
        };
        self.pos += 1;
        let right = self.unary()?;
        let (l, r) = (left.text(), right.text());
        let ord = match (l.trim().parse::<f64>(), r.trim().parse::<f64>()) {
            (Ok(a), Ok(b)) => a.partial_cmp(&b),
            _ => Some(l.cmp(&r)),
        };
        use std::cmp::Ordering::*;
        let result = match op {
            "==" => ord == Some(Equal),
            "!=" => ord != Some(Equal),
            "<" => ord == Some(Less),
            "<=" => matches!(ord, Some(Less | Equal)),
            ">" => ord == Some(Greater),
            ">=" => matches!(ord, Some(Greater | Equal)),
            _ => return Err(WhenError(format!("unexpected `{op}`"))),
        };
        Ok(Val::Bool(result))
    }

    fn unary(&mut self) -> Result<Val, WhenError> {
        let tok = self.toks.get(self.pos).cloned();
        self.pos += 1;
        match tok {
            Some(Tok::Op("!")) => Ok(Val::Bool(!self.unary()?.truth()?)),
            Some(Tok::Open) => {
                let v = self.or()?;
                match self.toks.get(self.pos) {
                    Some(Tok::Close) => {
                        self.pos += 1;
                        Ok(v)
                    }
                    _ => Err(WhenError("missing `)`".into())),
                }
            }
            Some(Tok::Word(w)) => Ok(match w.as_str() {
                "true" => Val::Bool(true),
                "false" => Val::Bool(false),
                _ => Val::Text(w),
            }),
            Some(Tok::Quoted(q)) => Ok(Val::Text(q)),
            Some(t) => Err(WhenError(format!("expected a value, found {t:?}"))),
            None => Err(WhenError("expected a value, found the end".into())),
        }
    }
}

/// Evaluates a `when` whose placeholders are already filled.
pub fn evaluate(text: &str) -> Result<bool, WhenError> {
    let toks = tokenize(text)?;
    let mut e = Eval {
        toks: &toks,
        pos: 0,
    };
    let v = e.or()?;
    if e.pos < toks.len() {
        return Err(WhenError(format!(
            "unexpected {:?} in {text:?}",
            toks[e.pos]
        )));
    }
    v.truth()
}

/// Checks the syntax of a `when` before its placeholders are known: each is replaced by a
/// neutral word.
pub fn check_syntax(text: &str) -> Result<(), WhenError> {
    let filled = crate::placeholder::fill(text, |_| Some("x".to_owned()))
        .map_err(|e| WhenError(format!("cannot read placeholder {e}")))?;
    let toks = tokenize(&filled)?;
    // Values are unknown, so only the shape is checked.
    shape(&toks)
}

/// The grammar without values: operands and operators alternate, parentheses balance.
fn shape(toks: &[Tok]) -> Result<(), WhenError> {
    let mut depth = 0i32;
    let mut want_value = true;
    for t in toks {
        match t {
            Tok::Open if want_value => depth += 1,
            Tok::Close if !want_value => {
                depth -= 1;
                if depth < 0 {
                    return Err(WhenError("unbalanced `)`".into()));
                }
            }
            Tok::Op("!") if want_value => {}
            Tok::Op(_) if !want_value => want_value = true,
            Tok::Word(_) | Tok::Quoted(_) if want_value => want_value = false,
            other => return Err(WhenError(format!("unexpected {other:?}"))),
        }
    }
    if want_value {
        return Err(WhenError("ends where a value is expected".into()));
    }
    if depth != 0 {
        return Err(WhenError("missing `)`".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argo_example_conditions() {
        assert_eq!(evaluate("true == true"), Ok(true));
        assert_eq!(evaluate("false == true"), Ok(false));
        assert_eq!(evaluate("even == even"), Ok(true));
        assert_eq!(evaluate("odd == even"), Ok(false));
        assert_eq!(evaluate("Succeeded != Succeeded"), Ok(false));
        assert_eq!(evaluate("Failed != Succeeded"), Ok(true));
        assert_eq!(evaluate("10 > 9"), Ok(true));
        assert_eq!(evaluate("'a b' == \"a b\" && !(1 >= 2)"), Ok(true));
        assert_eq!(evaluate("true"), Ok(true));
    }

    #[test]
    fn bad_conditions_say_why() {
        assert!(evaluate("heads").is_err());
        assert!(evaluate("a ==").is_err());
        assert!(check_syntax("{{x}} == ").is_err());
        assert!(check_syntax("({{x}} == y").is_err());
        assert!(check_syntax("{{x}} =~ y").is_err());
        assert!(check_syntax("{{inputs.parameters.a}} == true && {{b}} != c").is_ok());
    }
}
