//! `depends` expressions of DAG tasks: `A && (B.Failed || !C.Succeeded)`.
//!
//! A bare task name means `(A.Succeeded || A.Skipped || A.Daemoned)`, as in Argo. A task's
//! expression is evaluated once every task it names has finished; false omits the task.

use std::fmt;

/// What a finished task turned out to be, as `depends` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TaskResult {
    Succeeded,
    Failed,
    Errored,
    Skipped,
    Omitted,
    Daemoned,
    /// At least one expanded child succeeded (`withItems`/`withParam`).
    AnySucceeded,
    /// Every expanded child failed.
    AllFailed,
}

impl TaskResult {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "Succeeded" => Self::Succeeded,
            "Failed" => Self::Failed,
            "Errored" => Self::Errored,
            "Skipped" => Self::Skipped,
            "Omitted" => Self::Omitted,
            "Daemoned" => Self::Daemoned,
            "AnySucceeded" => Self::AnySucceeded,
            "AllFailed" => Self::AllFailed,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Depends {
    /// `task` (no result: the compatible meaning) or `task.Result`.
    Task(String, Option<TaskResult>),
    Not(Box<Depends>),
    And(Box<Depends>, Box<Depends>),
    Or(Box<Depends>, Box<Depends>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

impl Depends {
    pub fn parse(text: &str) -> Result<Self, ParseError> {
        let tokens = tokenize(text)?;
        let mut p = Parser { tokens, pos: 0 };
        let e = p.or()?;
        match p.tokens.get(p.pos) {
            None => Ok(e),
            Some(t) => Err(ParseError(format!("unexpected {t} in {text:?}"))),
        }
    }

    /// The tasks named, each once, in order of appearance.
    pub fn tasks(&self) -> Vec<&str> {
        let mut out = Vec::new();
        self.collect(&mut out);
        out
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a str>) {
        match self {
            Self::Task(t, _) => {
                if !out.contains(&t.as_str()) {
                    out.push(t)
                }
            }
            Self::Not(e) => e.collect(out),
            Self::And(a, b) | Self::Or(a, b) => {
                a.collect(out);
                b.collect(out);
            }
        }
    }

    /// Tasks whose failure this expression handles: named with an explicit result other
    /// than `Succeeded` (e.g. `C.Failed`), so that their failure does not fail the DAG.
    pub fn handles_failure_of(&self) -> Vec<&str> {
        let mut out = Vec::new();
        self.collect_handled(&mut out);
        out
    }

    fn collect_handled<'a>(&'a self, out: &mut Vec<&'a str>) {
        match self {
            Self::Task(t, Some(r)) if *r != TaskResult::Succeeded => out.push(t),
            Self::Task(..) => {}
            Self::Not(e) => e.collect_handled(out),
            Self::And(a, b) | Self::Or(a, b) => {
                a.collect_handled(out);
                b.collect_handled(out);
            }
        }
    }

    /// Evaluates with `has(task, result)` telling whether a finished task has that result.
    pub fn eval(&self, has: &impl Fn(&str, TaskResult) -> bool) -> bool {
        match self {
            Self::Task(t, Some(r)) => has(t, *r),
            Self::Task(t, None) => {
                has(t, TaskResult::Succeeded)
                    || has(t, TaskResult::Skipped)
                    || has(t, TaskResult::Daemoned)
            }
            Self::Not(e) => !e.eval(has),
            Self::And(a, b) => a.eval(has) && b.eval(has),
            Self::Or(a, b) => a.eval(has) || b.eval(has),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Name(String),
    And,
    Or,
    Not,
    Open,
    Close,
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Name(n) => write!(f, "`{n}`"),
            Self::And => f.write_str("`&&`"),
            Self::Or => f.write_str("`||`"),
            Self::Not => f.write_str("`!`"),
            Self::Open => f.write_str("`(`"),
            Self::Close => f.write_str("`)`"),
        }
    }
}

fn tokenize(text: &str) -> Result<Vec<Token>, ParseError> {
    let mut out = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            ' ' | '\t' | '\n' | '\r' => i += 1,
            '(' => {
                out.push(Token::Open);
                i += 1
            }
            ')' => {
                out.push(Token::Close);
                i += 1
            }
            '!' => {
                out.push(Token::Not);
                i += 1
            }
            '&' | '|' => {
                if chars.get(i + 1) != Some(&c) {
                    return Err(ParseError(format!("`{c}` must be doubled (`{c}{c}`)")));
                }
                out.push(if c == '&' { Token::And } else { Token::Or });
                i += 2
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '-' | '_' | '.'))
                {
                    i += 1;
                }
                out.push(Token::Name(chars[start..i].iter().collect()));
            }
            other => return Err(ParseError(format!("unexpected character {other:?}"))),
        }
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
}

impl Parser {
    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.pos).cloned();
        self.pos += 1;
        t
    }

    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos)
    }

    fn or(&mut self) -> Result<Depends, ParseError> {
        let mut left = self.and()?;
        while self.peek() == Some(&Token::Or) {
            self.pos += 1;
            left = Depends::Or(Box::new(left), Box::new(self.and()?));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Depends, ParseError> {
        let mut left = self.unary()?;
        while self.peek() == Some(&Token::And) {
            self.pos += 1;
            left = Depends::And(Box::new(left), Box::new(self.unary()?));
        }
        Ok(left)
    }

    fn unary(&mut self) -> Result<Depends, ParseError> {
        match self.next() {
            Some(Token::Not) => Ok(Depends::Not(Box::new(self.unary()?))),
            Some(Token::Open) => {
                let e = self.or()?;
                match self.next() {
                    Some(Token::Close) => Ok(e),
                    _ => Err(ParseError("missing `)`".to_owned())),
                }
            }
            Some(Token::Name(n)) => {
                // `task.Result`, where the task name itself may contain dots.
                if let Some((task, result)) = n.rsplit_once('.')
                    && let Some(r) = TaskResult::parse(result)
                {
                    return Ok(Depends::Task(task.to_owned(), Some(r)));
                }
                if let Some((_, result)) = n.rsplit_once('.')
                    && result.starts_with(|c: char| c.is_ascii_uppercase())
                {
                    return Err(ParseError(format!(
                        "unknown task result .{result} (known: Succeeded, Failed, Errored, \
                         Skipped, Omitted, Daemoned, AnySucceeded, AllFailed)"
                    )));
                }
                Ok(Depends::Task(n, None))
            }
            Some(t) => Err(ParseError(format!("expected a task name, found {t}"))),
            None => Err(ParseError("expected a task name, found the end".to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(expr: &str, facts: &[(&str, TaskResult)]) -> bool {
        Depends::parse(expr)
            .unwrap()
            .eval(&|t, r| facts.contains(&(t, r)))
    }

    #[test]
    fn enhanced_depends_of_the_argo_example() {
        use TaskResult::*;
        let facts = [("A", Succeeded), ("B", Succeeded), ("C", Failed)];
        assert!(eval("A && (C.Succeeded || C.Failed)", &facts));
        assert!(eval("B || C", &facts));
        assert!(!eval("B && C", &facts));
        assert!(eval("should-execute-2.Succeeded || B", &facts));
        assert!(eval("!C.Succeeded", &facts));
        assert!(eval("A && B", &[("A", Succeeded), ("B", Skipped)]));
    }

    #[test]
    fn names_and_handled_failures() {
        let d = Depends::parse("A && (C.Succeeded || C.Failed) || !D.Errored").unwrap();
        assert_eq!(d.tasks(), ["A", "C", "D"]);
        assert_eq!(d.handles_failure_of(), ["C", "D"]);
    }

    #[test]
    fn malformed_expressions_say_why() {
        for (text, why) in [
            ("A &", "must be doubled"),
            ("A && ", "found the end"),
            ("(A || B", "missing `)`"),
            ("A B", "unexpected `B`"),
            ("A.Sucess", "unknown task result .Sucess"),
            ("A == B", "unexpected character '='"),
        ] {
            let err = Depends::parse(text).unwrap_err().to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
    }
}
