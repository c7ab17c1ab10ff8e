//! A small parser for the Prometheus text exposition format, version 0.0.4.
//!
//! It is strict about each line and tolerant about the page: a line that breaks the grammar
//! becomes a [`LineError`] (line number and reason) and the other lines still count. It reads
//! `# HELP` and `# TYPE` lines, ignores other comments, blank lines and lines equal to `...`
//! (the cuts in documentation excerpts), and reads samples of the form
//! `name{label="value",...} value [timestamp]`. Label values have their `\\`, `\"` and `\n`
//! escapes decoded; values accept `NaN`, `+Inf` and `-Inf`. No input makes it panic.
//!
//! A [`Scrape`] borrows from the page text: names and label values are slices of it (a
//! label value with an escape is the only one copied), so parsing a 57 KB vLLM page costs a
//! few hundred small allocations, not thousands. Lines are found with `memchr`, names are
//! read and checked in one pass over a byte-class table, label values are cut at the next
//! quote or backslash with `memchr2`, plain integer values skip the general float parser,
//! and `# HELP` text is kept as written and decoded only when [`Scrape::help`] asks for it.
//!
//! It knows nothing of vLLM: `serving/vllm.rs` reads the metric families it needs from a
//! [`Scrape`].

use std::borrow::Cow;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::str::FromStr;

/// The maps' hasher: fast for short keys (SipHash was ~8 % of a parse). Its seed is random
/// per process, so a page cannot be crafted to collide.
type FastHash = foldhash::fast::RandomState;

/// Everything read from one page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape<'a> {
    /// The samples, in page order.
    pub samples: Vec<Sample<'a>>,
    /// Metric family name → the type its `# TYPE` line declared.
    pub types: HashMap<&'a str, MetricType, FastHash>,
    /// Metric family name → its first `# HELP` docstring as written; [`Scrape::help`]
    /// decodes it.
    help: HashMap<&'a str, &'a str, FastHash>,
    /// The lines that could not be read, in page order.
    pub errors: Vec<LineError>,
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// Label name → decoded value, in page order; names are unique within a sample.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
    /// Milliseconds since the Unix epoch, when the line carries one.
    pub timestamp_ms: Option<i64>,
}

/// The metric types of format 0.0.4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Untyped,
}

/// A line that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct LineError {
    /// 1-based.
    pub line: usize,
    pub reason: LineErrorKind,
}

/// Why a line could not be read. Quoted text is cut to a few dozen characters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineErrorKind {
    #[error("invalid metric name {0:?}")]
    MetricName(String),
    #[error("invalid label name {0:?}")]
    LabelName(String),
    #[error("label {0:?}: expected '=' after the label name")]
    MissingEquals(String),
    #[error("label {0:?}: the value must be in double quotes")]
    UnquotedLabelValue(String),
    #[error("label {0:?}: the value has no closing quote")]
    UnterminatedLabelValue(String),
    #[error("label {label:?}: invalid escape sequence \\{escape}")]
    InvalidEscape { label: String, escape: char },
    #[error("duplicate label {0:?}")]
    DuplicateLabel(String),
    #[error("label {0:?}: expected ',' or '}}' after the value")]
    ExpectedCommaOrBrace(String),
    #[error("missing sample value")]
    MissingValue,
    #[error("invalid sample value {0:?}")]
    Value(String),
    #[error("invalid timestamp {0:?}")]
    Timestamp(String),
    #[error("unexpected text after the timestamp: {0:?}")]
    TrailingText(String),
    #[error("# {0} line without a metric name")]
    MissingFamilyName(&'static str),
    #[error("# TYPE line for {0}: missing type")]
    MissingType(String),
    #[error("# TYPE line for {family}: unknown type {found:?}")]
    UnknownType { family: String, found: String },
    #[error("second # TYPE line for {0}")]
    DuplicateType(String),
}

/// Longest piece of the input quoted in an error message, in characters.
const SNIPPET_CHARS: usize = 48;

impl<'a> Scrape<'a> {
    /// Parses a whole page. Never fails: bad lines are listed in [`Scrape::errors`].
    pub fn parse(text: &'a str) -> Self {
        // About one sample per 100 bytes and one family per 650 on vLLM's pages: few
        // reallocations.
        let families = text.len() / 512;
        let mut scrape = Self {
            samples: Vec::with_capacity(text.len() / 100),
            types: HashMap::with_capacity_and_hasher(families, FastHash::default()),
            help: HashMap::with_capacity_and_hasher(families, FastHash::default()),
            errors: Vec::new(),
        };
        let ends = memchr::memchr_iter(b'\n', text.as_bytes()).chain([text.len()]);
        let mut start = 0;
        for (index, end) in ends.enumerate() {
            // `\n` is ASCII, so both cuts are on character boundaries.
            let raw = &text[start..end];
            start = end + 1;
            let line = raw.strip_suffix('\r').unwrap_or(raw);
            if let Err(reason) = scrape.parse_line(line) {
                scrape.errors.push(LineError {
                    line: index + 1,
                    reason,
                });
            }
        }
        scrape
    }

    /// The `# HELP` docstring of `family` (the first, if the page repeats it), with `\\`
    /// and `\n` decoded.
    pub fn help(&self, family: &str) -> Option<Cow<'a, str>> {
        self.help.get(family).map(|text| decode_help(text))
    }

    /// The samples named exactly `name`.
    pub fn series<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'s Sample<'a>> + 's {
        self.samples
            .iter()
            .filter(move |sample| sample.name == name)
    }

    /// The declared type of the family a sample name belongs to: the exact name first, then
    /// a histogram or summary whose `_bucket`, `_sum` or `_count` series it is. `Untyped`
    /// when nothing was declared.
    pub fn type_of(&self, sample_name: &str) -> MetricType {
        if let Some(declared) = self.types.get(sample_name) {
            return *declared;
        }
        ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| sample_name.strip_suffix(suffix))
            .filter_map(|family| self.types.get(family))
            .find(|declared| matches!(declared, MetricType::Histogram | MetricType::Summary))
            .copied()
            .unwrap_or(MetricType::Untyped)
    }

    fn parse_line(&mut self, line: &'a str) -> Result<(), LineErrorKind> {
        let line = &line[skip_blanks(line.as_bytes(), 0)..];
        match line.as_bytes().first() {
            None => Ok(()),
            Some(b'#') => self.parse_comment(&line[1..]),
            Some(_) if line.trim_end_matches(is_blank) == "..." => Ok(()),
            Some(_) => {
                self.samples.push(parse_sample(line)?);
                Ok(())
            }
        }
    }

    fn parse_comment(&mut self, comment: &'a str) -> Result<(), LineErrorKind> {
        let mut cursor = Cursor::new(comment);
        cursor.skip_blanks();
        let keyword = cursor.take_while(|b| !blank(b));
        let kind = match keyword {
            "HELP" => "HELP",
            "TYPE" => "TYPE",
            _ => return Ok(()),
        };
        cursor.skip_blanks();
        let family = cursor.take_while(|b| !blank(b));
        if family.is_empty() {
            return Err(LineErrorKind::MissingFamilyName(kind));
        }
        if !is_metric_name(family) {
            return Err(LineErrorKind::MetricName(snippet(family)));
        }
        cursor.skip_blanks();
        let rest = cursor.rest();
        if kind == "HELP" {
            self.help.entry(family).or_insert(rest);
            return Ok(());
        }
        self.declare_type(family, rest.trim_end_matches(is_blank))
    }

    fn declare_type(&mut self, family: &'a str, type_name: &str) -> Result<(), LineErrorKind> {
        if type_name.is_empty() {
            return Err(LineErrorKind::MissingType(family.to_owned()));
        }
        let declared =
            type_name
                .parse()
                .map_err(|UnknownMetricType| LineErrorKind::UnknownType {
                    family: family.to_owned(),
                    found: snippet(type_name),
                })?;
        match self.types.entry(family) {
            Entry::Occupied(_) => Err(LineErrorKind::DuplicateType(family.to_owned())),
            Entry::Vacant(slot) => {
                slot.insert(declared);
                Ok(())
            }
        }
    }
}

impl Sample<'_> {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| *label == name)
            .map(|(_, value)| value.as_ref())
    }
}

/// A `# TYPE` line named a type outside format 0.0.4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("unknown metric type")]
pub struct UnknownMetricType;

impl FromStr for MetricType {
    type Err = UnknownMetricType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "counter" => Ok(Self::Counter),
            "gauge" => Ok(Self::Gauge),
            "histogram" => Ok(Self::Histogram),
            "summary" => Ok(Self::Summary),
            "untyped" => Ok(Self::Untyped),
            _ => Err(UnknownMetricType),
        }
    }
}

impl fmt::Display for MetricType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
            Self::Summary => "summary",
            Self::Untyped => "untyped",
        })
    }
}

/// `name[{labels}] value [timestamp]`, leading blanks already removed.
fn parse_sample(line: &str) -> Result<Sample<'_>, LineErrorKind> {
    let bytes = line.as_bytes();
    let name = parse_metric_name(line)?;
    let mut pos = skip_blanks(bytes, name.len());
    let labels = if bytes.get(pos) == Some(&b'{') {
        let (labels, end) = parse_labels(line, pos + 1)?;
        pos = end;
        labels
    } else {
        Vec::new()
    };
    // Every cut below is at a blank, a `}` or the end: character boundaries.
    pos = skip_blanks(bytes, pos);
    let value_end = token_end(bytes, pos);
    let value = parse_value(&line[pos..value_end])?;
    pos = skip_blanks(bytes, value_end);
    let timestamp_end = token_end(bytes, pos);
    let timestamp_ms = parse_timestamp(&line[pos..timestamp_end])?;
    pos = skip_blanks(bytes, timestamp_end);
    if pos < bytes.len() {
        return Err(LineErrorKind::TrailingText(snippet(&line[pos..])));
    }
    Ok(Sample {
        name,
        labels,
        value,
        timestamp_ms,
    })
}

/// The metric name at the start of `line`: the text up to the first blank or `{` must be
/// `[a-zA-Z_:][a-zA-Z0-9_:]*`.
fn parse_metric_name(line: &str) -> Result<&str, LineErrorKind> {
    let bytes = line.as_bytes();
    let len = run(bytes, METRIC);
    let valid = bytes.first().is_some_and(|&b| class(b) & METRIC_START != 0)
        && bytes.get(len).is_none_or(|&b| blank(b) || b == b'{');
    if !valid {
        let token = bytes
            .iter()
            .position(|&b| blank(b) || b == b'{')
            .unwrap_or(bytes.len());
        return Err(LineErrorKind::MetricName(snippet(&line[..token])));
    }
    Ok(&line[..len])
}

type Labels<'a> = Vec<(&'a str, Cow<'a, str>)>;

/// The label list from `pos`, just after its `{`, up to and including the `}`; returns the
/// labels and the position after the `}`.
fn parse_labels(line: &str, mut pos: usize) -> Result<(Labels<'_>, usize), LineErrorKind> {
    let bytes = line.as_bytes();
    let mut labels: Labels<'_> = Vec::with_capacity(4);
    loop {
        pos = skip_blanks(bytes, pos);
        if bytes.get(pos) == Some(&b'}') {
            return Ok((labels, pos + 1));
        }
        let name = parse_label_name(&line[pos..])?;
        pos = skip_blanks(bytes, pos + name.len());
        if bytes.get(pos) != Some(&b'=') {
            return Err(LineErrorKind::MissingEquals(snippet(name)));
        }
        pos = skip_blanks(bytes, pos + 1);
        if bytes.get(pos) != Some(&b'"') {
            return Err(LineErrorKind::UnquotedLabelValue(snippet(name)));
        }
        let (value, end) = parse_quoted(line, pos + 1, name)?;
        if labels.iter().any(|(existing, _)| *existing == name) {
            return Err(LineErrorKind::DuplicateLabel(snippet(name)));
        }
        labels.push((name, value));
        pos = skip_blanks(bytes, end);
        match bytes.get(pos) {
            Some(b',') => pos += 1,
            Some(b'}') => return Ok((labels, pos + 1)),
            _ => return Err(LineErrorKind::ExpectedCommaOrBrace(snippet(name))),
        }
    }
}

/// The label name at the start of `rest`: the text up to the first blank, `=`, `,`, `}` or
/// `"` must be `[a-zA-Z_][a-zA-Z0-9_]*`.
fn parse_label_name(rest: &str) -> Result<&str, LineErrorKind> {
    let bytes = rest.as_bytes();
    let ends_name = |b: u8| blank(b) || matches!(b, b'=' | b',' | b'}' | b'"');
    let len = run(bytes, LABEL);
    let valid = bytes.first().is_some_and(|&b| class(b) & LABEL_START != 0)
        && bytes.get(len).is_none_or(|&b| ends_name(b));
    if !valid {
        let token = bytes
            .iter()
            .position(|&b| ends_name(b))
            .unwrap_or(bytes.len());
        let shown = if token == 0 { rest } else { &rest[..token] };
        return Err(LineErrorKind::LabelName(snippet(shown)));
    }
    Ok(&rest[..len])
}

/// A label value from `pos`, just after its opening quote, up to and including the closing
/// quote; returns the value and the position after the closing quote.
fn parse_quoted<'a>(
    line: &'a str,
    pos: usize,
    label: &str,
) -> Result<(Cow<'a, str>, usize), LineErrorKind> {
    // Most values have no escape: borrow them whole.
    let rest = &line[pos..];
    match memchr::memchr2(b'"', b'\\', rest.as_bytes()) {
        None => return Err(LineErrorKind::UnterminatedLabelValue(snippet(label))),
        Some(end) if rest.as_bytes()[end] == b'"' => {
            return Ok((Cow::Borrowed(&rest[..end]), pos + end + 1));
        }
        Some(_) => {}
    }
    let mut cursor = Cursor::new(rest);
    let mut value = String::new();
    loop {
        match cursor.bump() {
            None => return Err(LineErrorKind::UnterminatedLabelValue(snippet(label))),
            Some('"') => return Ok((Cow::Owned(value), pos + cursor.pos)),
            Some('\\') => match cursor.bump() {
                Some('\\') => value.push('\\'),
                Some('"') => value.push('"'),
                Some('n') => value.push('\n'),
                Some(escape) => {
                    return Err(LineErrorKind::InvalidEscape {
                        label: snippet(label),
                        escape,
                    });
                }
                None => return Err(LineErrorKind::UnterminatedLabelValue(snippet(label))),
            },
            Some(c) => value.push(c),
        }
    }
}

/// A float as Go's `strconv.ParseFloat` reads it in decimal: digits, `NaN`, `+Inf`, `-Inf`.
fn parse_value(token: &str) -> Result<f64, LineErrorKind> {
    if token.is_empty() {
        return Err(LineErrorKind::MissingValue);
    }
    if let Some(value) = plain_integer(token) {
        return Ok(value);
    }
    token
        .parse::<f64>()
        .map_err(|_| LineErrorKind::Value(snippet(token)))
}

/// Up to 15 digits with no fraction or a fraction of zeros (`917`, `0.0`, `115898.0`),
/// most of a vLLM page's values: exact in an `f64`, so no need for the general parser.
fn plain_integer(token: &str) -> Option<f64> {
    let bytes = token.as_bytes();
    let digits = bytes
        .iter()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(bytes.len());
    let fraction = &bytes[digits..];
    let zero_fraction = match fraction.split_first() {
        None => true,
        Some((b'.', zeros)) => zeros.iter().all(|&b| b == b'0'),
        Some(_) => false,
    };
    if digits == 0 || digits > 15 || !zero_fraction {
        return None;
    }
    let integer = bytes[..digits]
        .iter()
        .fold(0_u64, |n, &b| n * 10 + u64::from(b - b'0'));
    // At most 15 digits: below 2^53, so the conversion is exact.
    Some(integer as f64)
}

fn parse_timestamp(token: &str) -> Result<Option<i64>, LineErrorKind> {
    if token.is_empty() {
        return Ok(None);
    }
    token
        .parse::<i64>()
        .map(Some)
        .map_err(|_| LineErrorKind::Timestamp(snippet(token)))
}

/// A `# HELP` docstring: `\\` and `\n` decoded, any other backslash kept as written.
fn decode_help(text: &str) -> Cow<'_, str> {
    if !text.contains('\\') {
        return Cow::Borrowed(text);
    }
    let mut decoded = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            decoded.push(c);
            continue;
        }
        match chars.next() {
            Some('\\') => decoded.push('\\'),
            Some('n') => decoded.push('\n'),
            Some(other) => {
                decoded.push('\\');
                decoded.push(other);
            }
            None => decoded.push('\\'),
        }
    }
    Cow::Owned(decoded)
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*` (bytes: any non-ASCII byte fails, as it should)
fn is_metric_name(s: &str) -> bool {
    let bytes = s.as_bytes();
    bytes.first().is_some_and(|&b| class(b) & METRIC_START != 0) && run(bytes, METRIC) == s.len()
}

/// Byte classes of the name grammar, as bits of [`CLASSES`].
const LABEL: u8 = 1; // [a-zA-Z0-9_]
const LABEL_START: u8 = 2; // [a-zA-Z_]
const METRIC: u8 = 4; // [a-zA-Z0-9_:]
const METRIC_START: u8 = 8; // [a-zA-Z_:]

/// The classes of every byte; non-ASCII bytes are in none.
static CLASSES: [u8; 256] = {
    let mut classes = [0_u8; 256];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        let letter = c.is_ascii_alphabetic() || c == b'_';
        if letter {
            classes[b] |= LABEL | LABEL_START | METRIC | METRIC_START;
        } else if c.is_ascii_digit() {
            classes[b] |= LABEL | METRIC;
        } else if c == b':' {
            classes[b] |= METRIC | METRIC_START;
        }
        b += 1;
    }
    classes
};

fn class(b: u8) -> u8 {
    CLASSES[usize::from(b)]
}

/// How many bytes at the start of `bytes` are in `class_bits`.
fn run(bytes: &[u8], class_bits: u8) -> usize {
    bytes
        .iter()
        .position(|&b| class(b) & class_bits == 0)
        .unwrap_or(bytes.len())
}

/// The position of the first non-blank byte at or after `pos`.
fn skip_blanks(bytes: &[u8], pos: usize) -> usize {
    let rest = bytes.get(pos..).unwrap_or_default();
    pos + rest.iter().take_while(|&&b| blank(b)).count()
}

/// The position of the first blank at or after `pos`, or the end.
fn token_end(bytes: &[u8], pos: usize) -> usize {
    let rest = bytes.get(pos..).unwrap_or_default();
    pos + rest.iter().position(|&b| blank(b)).unwrap_or(rest.len())
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

fn blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// At most [`SNIPPET_CHARS`] characters of `s`, for an error message.
fn snippet(s: &str) -> String {
    match s.char_indices().nth(SNIPPET_CHARS) {
        Some((end, _)) => format!("{}...", &s[..end]),
        None => s.to_owned(),
    }
}

/// A position in one line; every move keeps it on a character boundary.
struct Cursor<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(text: &'a str) -> Self {
        Self { text, pos: 0 }
    }

    fn rest(&self) -> &'a str {
        self.text.get(self.pos..).unwrap_or("")
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.rest().chars().next()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn skip_blanks(&mut self) {
        let blanks = self.rest().bytes().take_while(|b| blank(*b)).count();
        self.pos += blanks;
    }

    /// The text up to the first byte where `end` holds, without moving. Every delimiter is
    /// ASCII, which no byte of a multi-byte character equals, so the cut is on a character
    /// boundary.
    fn peek_token(&self, end: impl Fn(u8) -> bool) -> &'a str {
        let rest = self.rest();
        let len = rest.bytes().position(end).unwrap_or(rest.len());
        &rest[..len]
    }

    fn take_while(&mut self, keep: impl Fn(u8) -> bool) -> &'a str {
        let token = self.peek_token(|b| !keep(b));
        self.pos += token.len();
        token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURES: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/fixtures/vllm-metrics"
    );

    fn fixture_names() -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(FIXTURES)
            .expect("fixture directory")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|name| name.ends_with(".prom"))
            .collect();
        names.sort();
        names
    }

    fn fixture(name: &str) -> String {
        std::fs::read_to_string(format!("{FIXTURES}/{name}")).expect("fixture readable")
    }

    fn one(line: &str) -> Sample<'_> {
        let scrape = Scrape::parse(line);
        assert_eq!(scrape.errors, vec![], "errors in {line:?}");
        assert_eq!(scrape.samples.len(), 1, "samples in {line:?}");
        scrape.samples.into_iter().next().expect("one sample")
    }

    fn error_of(line: &str) -> LineErrorKind {
        let scrape = Scrape::parse(line);
        assert!(scrape.samples.is_empty(), "unexpected samples in {line:?}");
        assert_eq!(
            scrape.errors.len(),
            1,
            "errors in {line:?}: {:?}",
            scrape.errors
        );
        scrape.errors.into_iter().next().expect("one error").reason
    }

    fn labels<'a>(pairs: &[(&'a str, &'a str)]) -> Vec<(&'a str, Cow<'a, str>)> {
        pairs.iter().map(|(k, v)| (*k, Cow::Borrowed(*v))).collect()
    }

    #[test]
    fn every_fixture_parses_without_errors() {
        let names = fixture_names();
        assert_eq!(names.len(), 5, "fixtures: {names:?}");
        for name in names {
            let text = fixture(&name);
            let scrape = Scrape::parse(&text);
            assert_eq!(scrape.errors, vec![], "{name}");
            let sample_lines = text
                .lines()
                .filter(|l| !l.trim().is_empty() && !l.starts_with('#') && l.trim() != "...")
                .count();
            assert_eq!(scrape.samples.len(), sample_lines, "{name}");
        }
    }

    #[test]
    fn full_scrape_counts_and_types() {
        let page = fixture("kvwarden-vllm-0.19.1-llama3.1-8b-idle.prom");
        let scrape = Scrape::parse(&page);
        assert_eq!(scrape.samples.len(), 405);
        assert_eq!(scrape.types.len(), 87);
        assert_eq!(scrape.types["vllm:num_requests_running"], MetricType::Gauge);
        assert_eq!(
            scrape.types["vllm:prompt_tokens_total"],
            MetricType::Counter
        );
        assert_eq!(scrape.types["http_request_size_bytes"], MetricType::Summary);
        assert_eq!(
            scrape.type_of("vllm:time_to_first_token_seconds_bucket"),
            MetricType::Histogram
        );
        assert_eq!(
            scrape.type_of("http_request_size_bytes_sum"),
            MetricType::Summary
        );
        assert_eq!(scrape.type_of("no_such_metric"), MetricType::Untyped);
        assert_eq!(
            scrape.help("vllm:kv_cache_usage_perc").as_deref(),
            Some("KV-cache usage. 1 means 100 percent usage.")
        );
        assert_eq!(scrape.help("no_such_metric"), None);
        let running: Vec<_> = scrape.series("vllm:num_requests_running").collect();
        assert_eq!(running.len(), 1);
        assert_eq!(
            running[0].labels,
            labels(&[
                ("engine", "0"),
                ("model_name", "meta-llama/Llama-3.1-8B-Instruct")
            ])
        );
        let virtual_memory = scrape
            .series("process_virtual_memory_bytes")
            .next()
            .expect("sample");
        assert_eq!(virtual_memory.value, 3.110516736e10);
        assert!(virtual_memory.labels.is_empty());
    }

    #[test]
    fn empty_label_values_and_many_labels() {
        let page = fixture("aibrix-runtime-doc-vllm-v0-engine.prom");
        let scrape = Scrape::parse(&page);
        let lora = scrape
            .series("vllm:lora_requests_info")
            .next()
            .expect("lora sample");
        assert_eq!(
            lora.labels,
            labels(&[
                ("max_lora", "0"),
                ("running_lora_adapters", ""),
                ("waiting_lora_adapters", "")
            ])
        );
        assert_eq!(lora.value, 1.7382173358407154e9);
        let config = scrape
            .series("vllm:cache_config_info")
            .next()
            .expect("config sample");
        assert_eq!(config.labels.len(), 12);
        assert_eq!(config.label("num_gpu_blocks"), Some("81767"));
    }

    #[test]
    fn doc_elisions_and_blank_lines_are_skipped() {
        let scrape = Scrape::parse("a 1\n\n...\n   \n  ...  \r\nb 2\r\n");
        assert_eq!(scrape.errors, vec![]);
        let names: Vec<_> = scrape.samples.iter().map(|s| s.name).collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn special_values() {
        assert!(one("m NaN").value.is_nan());
        assert_eq!(one("m +Inf").value, f64::INFINITY);
        assert_eq!(one("m -Inf").value, f64::NEG_INFINITY);
        assert_eq!(one("m 1.5e-3").value, 0.0015);
        assert_eq!(one("m -7").value, -7.0);
        assert_eq!(one("m{le=\"+Inf\"} 3").label("le"), Some("+Inf"));
    }

    #[test]
    fn timestamps() {
        let sample = one("http_requests_total{method=\"post\",code=\"200\"} 1027 1395066363000");
        assert_eq!(sample.value, 1027.0);
        assert_eq!(sample.timestamp_ms, Some(1_395_066_363_000));
        assert_eq!(one("m 1 -5").timestamp_ms, Some(-5));
        assert_eq!(one("m 1").timestamp_ms, None);
        assert_eq!(
            error_of("m 1 12.5"),
            LineErrorKind::Timestamp("12.5".into())
        );
        assert_eq!(error_of("m 1 2 3"), LineErrorKind::TrailingText("3".into()));
    }

    #[test]
    fn label_escapes_are_decoded() {
        let sample = one(
            r#"msdos_file_access_time_seconds{path="C:\\DIR\\FILE.TXT",error="Cannot find file:\n\"FILE.TXT\""} 1.458255915e9"#,
        );
        assert_eq!(sample.label("path"), Some(r"C:\DIR\FILE.TXT"));
        assert_eq!(
            sample.label("error"),
            Some("Cannot find file:\n\"FILE.TXT\"")
        );
    }

    #[test]
    fn label_values_may_hold_separators_and_unicode() {
        let sample = one("m{a=\"x,y}z = # ü\"} 1");
        assert_eq!(sample.label("a"), Some("x,y}z = # ü"));
    }

    #[test]
    fn blanks_between_tokens_and_trailing_comma() {
        let sample = one("\t m  { a = \"1\" ,\tb=\"2\", }  4   17 ");
        assert_eq!(sample.labels, labels(&[("a", "1"), ("b", "2")]));
        assert_eq!(sample.value, 4.0);
        assert_eq!(sample.timestamp_ms, Some(17));
        assert!(one("m{} 1").labels.is_empty());
    }

    #[test]
    fn help_and_type_lines() {
        let scrape = Scrape::parse(
            "# HELP m A \\\\ help\\nline \\x\n# TYPE m counter\n# a comment\n# EOF\n#\nm_total 1",
        );
        assert_eq!(scrape.errors, vec![]);
        assert_eq!(scrape.help("m").as_deref(), Some("A \\ help\nline \\x"));
        assert_eq!(scrape.types["m"], MetricType::Counter);
    }

    #[test]
    fn bad_comment_lines() {
        assert_eq!(error_of("# TYPE"), LineErrorKind::MissingFamilyName("TYPE"));
        assert_eq!(
            error_of("# HELP   "),
            LineErrorKind::MissingFamilyName("HELP")
        );
        assert_eq!(error_of("# TYPE m"), LineErrorKind::MissingType("m".into()));
        assert_eq!(
            error_of("# TYPE m gaugeish"),
            LineErrorKind::UnknownType {
                family: "m".into(),
                found: "gaugeish".into()
            }
        );
        assert_eq!(
            error_of("# TYPE 9m gauge"),
            LineErrorKind::MetricName("9m".into())
        );
        let scrape = Scrape::parse("# TYPE m gauge\n# TYPE m counter");
        assert_eq!(scrape.types["m"], MetricType::Gauge);
        assert_eq!(
            scrape.errors,
            vec![LineError {
                line: 2,
                reason: LineErrorKind::DuplicateType("m".into())
            }]
        );
    }

    #[test]
    fn bad_sample_lines() {
        use LineErrorKind as E;
        assert_eq!(error_of("9abc 1"), E::MetricName("9abc".into()));
        assert_eq!(error_of("foo-bar 1"), E::MetricName("foo-bar".into()));
        assert_eq!(error_of("{a=\"1\"} 1"), E::MetricName("".into()));
        assert_eq!(error_of("m"), E::MissingValue);
        assert_eq!(error_of("m{a=\"1\"}"), E::MissingValue);
        assert_eq!(error_of("m one"), E::Value("one".into()));
        assert_eq!(error_of("m{a:b=\"1\"} 1"), E::LabelName("a:b".into()));
        assert_eq!(error_of("m{,} 1"), E::LabelName(",} 1".into()));
        assert_eq!(error_of("m{a} 1"), E::MissingEquals("a".into()));
        assert_eq!(error_of("m{a=1} 1"), E::UnquotedLabelValue("a".into()));
        assert_eq!(
            error_of("m{a=\"1} 1"),
            E::UnterminatedLabelValue("a".into())
        );
        assert_eq!(error_of("m{a=\"1\\"), E::UnterminatedLabelValue("a".into()));
        assert_eq!(
            error_of("m{a=\"\\t\"} 1"),
            E::InvalidEscape {
                label: "a".into(),
                escape: 't'
            }
        );
        assert_eq!(
            error_of("m{a=\"1\",a=\"2\"} 1"),
            E::DuplicateLabel("a".into())
        );
        assert_eq!(
            error_of("m{a=\"1\" b=\"2\"} 1"),
            E::ExpectedCommaOrBrace("a".into())
        );
        assert_eq!(error_of("m{a=\"1\""), E::ExpectedCommaOrBrace("a".into()));
    }

    #[test]
    fn a_bad_line_does_not_fail_the_page() {
        let scrape = Scrape::parse("good 1\nbad{ 2\n# TYPE x nope\nalso_good{a=\"b\"} 3\n");
        let names: Vec<_> = scrape.samples.iter().map(|s| s.name).collect();
        assert_eq!(names, ["good", "also_good"]);
        let lines: Vec<_> = scrape.errors.iter().map(|e| e.line).collect();
        assert_eq!(lines, [2, 3]);
        assert_eq!(
            scrape.errors[0].to_string(),
            "line 2: invalid label name \"2\""
        );
    }

    #[test]
    fn long_garbage_is_cut_in_messages() {
        let garbage = "x".repeat(500) + "-";
        let LineErrorKind::MetricName(shown) = error_of(&format!("{garbage} 1")) else {
            panic!("expected a metric name error");
        };
        assert_eq!(shown.chars().count(), SNIPPET_CHARS + 3);
        assert!(shown.ends_with("..."));
    }

    /// A small xorshift generator, so the fuzz-ish tests are reproducible without a crate.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn no_panic_on_truncated_lines() {
        for name in fixture_names() {
            for line in fixture(&name).lines() {
                for (cut, _) in line.char_indices() {
                    let _ = Scrape::parse(&line[..cut]);
                    let _ = Scrape::parse(&line[cut..]);
                }
            }
        }
    }

    #[test]
    fn no_panic_on_truncations_and_mutations_of_the_fixtures() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let alphabet = b"{}\",=\\ \t\n\r#.+-eE0123456789:_aZnN\xc3\xbc\xff";
        for name in fixture_names() {
            let bytes = fixture(&name).into_bytes();
            for _ in 0..50 {
                let cut = rng.below(bytes.len() + 1);
                let _ = Scrape::parse(&String::from_utf8_lossy(&bytes[..cut]));
            }
            for _ in 0..50 {
                let mut mutated = bytes.clone();
                for _ in 0..1 + rng.below(16) {
                    let at = rng.below(mutated.len());
                    mutated[at] = alphabet[rng.below(alphabet.len())];
                }
                let _ = Scrape::parse(&String::from_utf8_lossy(&mutated));
            }
        }
    }

    proptest::proptest! {
        /// Arbitrary bytes never panic the parser, and what it returns is consistent: every
        /// line is a sample, an error or nothing, and every sample name is a valid name.
        #[test]
        fn arbitrary_bytes_parse_without_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let text = String::from_utf8_lossy(&bytes);
            let scrape = Scrape::parse(&text);
            let lines = text.split('\n').count();
            proptest::prop_assert!(scrape.samples.len() + scrape.errors.len() <= lines);
            for sample in &scrape.samples {
                proptest::prop_assert!(is_metric_name(sample.name), "{:?}", sample.name);
            }
            for error in &scrape.errors {
                proptest::prop_assert!((1..=lines).contains(&error.line));
            }
        }

        /// Lines made of the grammar's own punctuation, where the edge cases are.
        #[test]
        fn grammar_soup_parses_without_panic(text in "[a-z_:{}=,\"\\\\ \t#.+\\-eEInfNa0-9\n]{0,200}") {
            let scrape = Scrape::parse(&text);
            for sample in &scrape.samples {
                proptest::prop_assert!(is_metric_name(sample.name), "{:?}", sample.name);
                for (name, _) in &sample.labels {
                    proptest::prop_assert!(!name.is_empty());
                }
            }
        }
    }

    #[test]
    fn plain_integers_match_the_float_parser() {
        for token in [
            "0",
            "0.0",
            "917.0",
            "115898",
            "1.",
            "000012.000",
            "999999999999999",
        ] {
            assert_eq!(plain_integer(token), token.parse::<f64>().ok(), "{token}");
        }
        for token in [
            "",
            ".0",
            "1.5",
            "1e3",
            "-1",
            "+1",
            "1.0.0",
            "9999999999999999",
            "NaN",
        ] {
            assert_eq!(plain_integer(token), None, "{token}");
        }
    }

    #[test]
    fn no_panic_on_random_bytes() {
        let mut rng = Rng(0xD1B5_4A32_D192_ED03);
        for _ in 0..2000 {
            let len = rng.below(256);
            let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let _ = Scrape::parse(&String::from_utf8_lossy(&bytes));
        }
    }
}
