//! Traffic traces and their parsers: a ServeGen folder of per-client 10-minute windows, the
//! Azure LLM inference 2023 CSV, the Mooncake JSONL and a plain `(timestamp, rate)` CSV.
//!
//! The simulator reads nothing: it parses the text its caller read. A trace source is
//! `KIND:PATH` ([`split_source`]); the caller reads the file at `PATH` and hands its text to
//! [`Trace::parse`], or for a ServeGen folder reads the files that [`is_servegen_file`] picks
//! and hands them to [`parse_servegen`] as `(path, text)` pairs (the CLI's
//! `nightshift_cli::traces::load` does both). Paths are only names here: they go into the
//! trace's name and into error messages, which say file and line. Files stay wherever the
//! caller points (the shared `traces/` folder); nothing is copied into the repository. Time 0
//! of a trace is midnight of its first day.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A file or folder could not be read: made by the callers that read them, never here.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Parse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{0}: no data")]
    Empty(PathBuf),
    #[error(
        "unknown trace source {0:?}: expected servegen:DIR, azure:FILE, mooncake:FILE or csv:FILE"
    )]
    UnknownSource(String),
}

/// How a trace is stored: a folder of files (ServeGen) or one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A folder of `chunk-<client>-trace.csv` files ([`parse_servegen`]).
    ServeGen,
    /// One file ([`Trace::parse`]).
    File(FileFormat),
}

/// The formats of a trace held in one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    /// Azure LLM inference 2023 CSV ([`parse_azure`]).
    Azure,
    /// Mooncake JSONL ([`parse_mooncake`]).
    Mooncake,
    /// `timestamp,rate` CSV ([`parse_rates`]).
    Csv,
}

/// Splits a trace source `KIND:PATH` (`servegen:DIR`, `azure:FILE`, `mooncake:FILE`,
/// `csv:FILE`) into its format and path. Reads nothing.
pub fn split_source(source: &str) -> Result<(Format, &Path), TraceError> {
    let (kind, path) = source
        .split_once(':')
        .ok_or_else(|| TraceError::UnknownSource(source.to_owned()))?;
    let format = match kind {
        "servegen" => Format::ServeGen,
        "azure" => Format::File(FileFormat::Azure),
        "mooncake" => Format::File(FileFormat::Mooncake),
        "csv" => Format::File(FileFormat::Csv),
        _ => return Err(TraceError::UnknownSource(source.to_owned())),
    };
    Ok((format, Path::new(path)))
}

/// The law of inter-arrival times inside one window, as ServeGen fitted it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Interarrival {
    /// Exponential (a Poisson process).
    Poisson,
    Gamma {
        shape: f64,
    },
    Weibull {
        shape: f64,
    },
}

/// One client's load during one window: a mean rate and the shape of its inter-arrivals.
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub start_s: u64,
    pub rate: f64,
    pub law: Interarrival,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TraceData {
    /// Per-client windows of `window_s` seconds (ServeGen).
    Windows {
        window_s: u64,
        clients: Vec<Vec<Window>>,
    },
    /// One arrival time (seconds from the start) per request, sorted (Azure, Mooncake).
    Requests(Vec<f64>),
    /// A step function of `(start_s, requests per second)`, Poisson inside each step.
    Rates(Vec<(f64, f64)>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub name: String,
    /// How long the trace covers, in seconds.
    pub span_s: u64,
    pub data: TraceData,
}

impl Trace {
    /// Parses the `text` of a one-file trace; `path` names it, in the trace's name and in
    /// errors.
    pub fn parse(format: FileFormat, path: &Path, text: &str) -> Result<Self, TraceError> {
        match format {
            FileFormat::Azure => parse_azure(path, text),
            FileFormat::Mooncake => parse_mooncake(path, text),
            FileFormat::Csv => parse_rates(path, text),
        }
    }

    /// The highest mean request rate over any `window_s`-second window (10 minutes for the
    /// scaling rule: the peak that `--peak-replicas` refers to).
    pub fn peak_rate(&self, window_s: u64) -> f64 {
        match &self.data {
            TraceData::Windows {
                window_s: w,
                clients,
            } => {
                let n = (self.span_s / w) as usize;
                let mut sum = vec![0.0; n.max(1)];
                for c in clients {
                    for win in c {
                        if let Some(s) = sum.get_mut((win.start_s / w) as usize) {
                            *s += win.rate;
                        }
                    }
                }
                sum.into_iter().fold(0.0, f64::max)
            }
            TraceData::Requests(times) => {
                let n = (self.span_s / window_s + 1) as usize;
                let mut count = vec![0u64; n];
                for t in times {
                    if let Some(c) = count.get_mut((*t as u64 / window_s) as usize) {
                        *c += 1;
                    }
                }
                count.into_iter().max().unwrap_or(0) as f64 / window_s as f64
            }
            TraceData::Rates(points) => points.iter().map(|p| p.1).fold(0.0, f64::max),
        }
    }
}

/// A stretch of a windowed trace in which no client sent anything, between windows with
/// load: a gap in the recording rather than a service with no traffic at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Gap {
    pub start_s: u64,
    pub windows: u64,
}

impl Trace {
    /// The windows of a windowed trace in which no client has load, between windows that
    /// have some, as runs of consecutive windows. Other traces have none.
    pub fn gaps(&self) -> Vec<Gap> {
        let TraceData::Windows { window_s, clients } = &self.data else {
            return Vec::new();
        };
        let n = (self.span_s / window_s) as usize;
        let mut busy = vec![false; n];
        for w in clients.iter().flatten() {
            if let Some(b) = busy.get_mut((w.start_s / window_s) as usize) {
                *b |= w.rate > 0.0;
            }
        }
        let (Some(first), Some(last)) =
            (busy.iter().position(|&b| b), busy.iter().rposition(|&b| b))
        else {
            return Vec::new();
        };
        let mut gaps: Vec<Gap> = Vec::new();
        for i in (first..last).filter(|&i| !busy[i]) {
            let start_s = i as u64 * window_s;
            match gaps.last_mut() {
                Some(g) if g.start_s + g.windows * window_s == start_s => g.windows += 1,
                _ => gaps.push(Gap {
                    start_s,
                    windows: 1,
                }),
            }
        }
        gaps
    }

    /// Fills each gap ([`Trace::gaps`]) client by client: the rate runs in a straight line
    /// from the client's window before the gap to its window after it (an idle neighbour
    /// counts as rate 0), and each filled window takes the inter-arrival law of the nearer
    /// neighbour that had one. Returns the gaps filled.
    pub fn fill_gaps(&mut self) -> Vec<Gap> {
        let gaps = self.gaps();
        let TraceData::Windows { window_s, clients } = &mut self.data else {
            return gaps;
        };
        let w = *window_s;
        for client in clients.iter_mut() {
            let at = |s: u64| client.iter().find(|x| x.start_s == s);
            let mut filled = Vec::new();
            for g in &gaps {
                let before = g.start_s - w;
                let after = g.start_s + g.windows * w;
                let (b, a) = (at(before), at(after));
                let (rb, ra) = (b.map_or(0.0, |x| x.rate), a.map_or(0.0, |x| x.rate));
                let span = (g.windows + 1) as f64;
                for k in 1..=g.windows {
                    let f = k as f64 / span;
                    let nearer = if f <= 0.5 { b.or(a) } else { a.or(b) };
                    let (Some(near), rate) = (nearer, rb + (ra - rb) * f) else {
                        continue;
                    };
                    if rate > 0.0 {
                        filled.push(Window {
                            start_s: before + k * w,
                            rate,
                            law: near.law,
                        });
                    }
                }
            }
            client.extend(filled);
            client.sort_by_key(|x| x.start_s);
        }
        gaps
    }
}

fn parse_err(path: &Path, line: usize, message: impl Into<String>) -> TraceError {
    TraceError::Parse {
        path: path.to_owned(),
        line: line + 1,
        message: message.into(),
    }
}

fn num(path: &Path, line: usize, field: &str, text: &str) -> Result<f64, TraceError> {
    text.trim()
        .parse::<f64>()
        .map_err(|_| parse_err(path, line, format!("{field}: {text:?} is not a number")))
}

/// Whether a file of a ServeGen folder holds a client's windows: `chunk-<client>-trace.csv`.
/// The others (notes, metadata) are not part of the trace.
pub fn is_servegen_file(name: &str) -> bool {
    name.starts_with("chunk-") && name.ends_with("-trace.csv")
}

/// A ServeGen folder `dir`, as the `(path, text)` of its files: `chunk-<client>-trace.csv`
/// files without header, each row `window_start_s,rate,cv,pattern,shape,scale`; an empty
/// pattern is an idle window. Files whose name [`is_servegen_file`] rejects are ignored, and
/// the order of `files` does not matter: clients are taken in the order of their number.
pub fn parse_servegen(dir: &Path, files: Vec<(PathBuf, String)>) -> Result<Trace, TraceError> {
    let name = |p: &Path| p.file_name().and_then(|n| n.to_str()).map(str::to_owned);
    let mut files: Vec<(PathBuf, String)> = files
        .into_iter()
        .filter(|(p, _)| name(p).is_some_and(|n| is_servegen_file(&n)))
        .collect();
    // Sorted by client number, so that the random streams do not depend on directory order.
    files.sort_by_key(|(p, _)| {
        let n = name(p).unwrap_or_default();
        let id = n
            .trim_start_matches("chunk-")
            .trim_end_matches("-trace.csv")
            .parse::<u64>()
            .unwrap_or(u64::MAX);
        (id, n)
    });
    if files.is_empty() {
        return Err(TraceError::Empty(dir.to_owned()));
    }
    let mut clients = Vec::with_capacity(files.len());
    let mut span_s = 0;
    let mut window_s = 600;
    for (file, text) in &files {
        let mut windows = Vec::new();
        for (i, row) in text.lines().enumerate() {
            if row.trim().is_empty() {
                continue;
            }
            let f: Vec<&str> = row.split(',').collect();
            if f.len() < 6 {
                return Err(parse_err(file, i, "expected 6 fields"));
            }
            let start = num(file, i, "window_start", f[0])? as u64;
            let rate = num(file, i, "rate", f[1])?;
            let law = match f[3].trim() {
                "" => continue,
                "Gamma" => Interarrival::Gamma {
                    shape: num(file, i, "shape", f[4])?,
                },
                "Weibull" => Interarrival::Weibull {
                    shape: num(file, i, "shape", f[4])?,
                },
                "Exponential" | "Poisson" => Interarrival::Poisson,
                other => return Err(parse_err(file, i, format!("unknown pattern {other:?}"))),
            };
            if rate <= 0.0 {
                continue;
            }
            windows.push(Window {
                start_s: start,
                rate,
                law,
            });
        }
        let starts: Vec<u64> = text
            .lines()
            .filter_map(|l| l.split(',').next()?.trim().parse::<u64>().ok())
            .collect();
        if let [a, b, ..] = starts[..] {
            window_s = b.saturating_sub(a).max(1);
        }
        if let Some(last) = starts.last() {
            span_s = span_s.max(last + window_s);
        }
        clients.push(windows);
    }
    Ok(Trace {
        name: format!("servegen:{}", dir.display()),
        span_s,
        data: TraceData::Windows { window_s, clients },
    })
}

/// Azure LLM inference 2023: `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like
/// `2023-11-16 18:17:03.9799600`. Arrival times are taken relative to midnight of the first.
pub fn parse_azure(path: &Path, text: &str) -> Result<Trace, TraceError> {
    let mut times = Vec::new();
    for (i, row) in text.lines().enumerate().skip(1) {
        let Some(ts) = row.split(',').next().filter(|t| !t.trim().is_empty()) else {
            continue;
        };
        let clock = ts
            .trim()
            .split_once(' ')
            .map(|(_, c)| c)
            .ok_or_else(|| parse_err(path, i, format!("timestamp {ts:?}")))?;
        let parts: Vec<&str> = clock.split(':').collect();
        if parts.len() != 3 {
            return Err(parse_err(path, i, format!("timestamp {ts:?}")));
        }
        let s = num(path, i, "hour", parts[0])? * 3600.0
            + num(path, i, "minute", parts[1])? * 60.0
            + num(path, i, "second", parts[2])?;
        times.push(s);
    }
    requests(path, times)
}

/// Mooncake: one JSON object per line with `timestamp` in milliseconds from the start.
pub fn parse_mooncake(path: &Path, text: &str) -> Result<Trace, TraceError> {
    let mut times = Vec::new();
    for (i, row) in text.lines().enumerate() {
        if row.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(row).map_err(|e| parse_err(path, i, e.to_string()))?;
        let ms = v
            .get("timestamp")
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| parse_err(path, i, "no numeric timestamp"))?;
        times.push(ms / 1000.0);
    }
    requests(path, times)
}

fn requests(path: &Path, mut times: Vec<f64>) -> Result<Trace, TraceError> {
    if times.is_empty() {
        return Err(TraceError::Empty(path.to_owned()));
    }
    times.sort_by(f64::total_cmp);
    let first = times[0];
    // Keep the time of day when the trace carries one (Azure); Mooncake starts at 0.
    let day_start = (first / 86_400.0).floor() * 86_400.0;
    for t in &mut times {
        *t -= day_start;
    }
    let span_s = times.last().map_or(0, |t| *t as u64 + 1);
    Ok(Trace {
        name: path.display().to_string(),
        span_s,
        data: TraceData::Requests(times),
    })
}

/// A plain CSV of `timestamp_s,rate` (requests per second from that time on); a header row
/// and `#` comments are skipped.
pub fn parse_rates(path: &Path, text: &str) -> Result<Trace, TraceError> {
    let mut points = Vec::new();
    for (i, row) in text.lines().enumerate() {
        let row = row.trim();
        if row.is_empty() || row.starts_with('#') {
            continue;
        }
        let Some((t, r)) = row.split_once(',') else {
            return Err(parse_err(path, i, "expected timestamp,rate"));
        };
        if i == 0 && t.trim().parse::<f64>().is_err() {
            continue;
        }
        let (t, r) = (num(path, i, "timestamp", t)?, num(path, i, "rate", r)?);
        if r < 0.0 {
            return Err(parse_err(path, i, "rate is negative"));
        }
        points.push((t, r));
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(&(last, _)) = points.last() else {
        return Err(TraceError::Empty(path.to_owned()));
    };
    let step = match points[..] {
        [(a, _), (b, _), ..] => b - a,
        _ => 60.0,
    };
    Ok(Trace {
        name: path.display().to_string(),
        span_s: (last + step.max(1.0)) as u64,
        data: TraceData::Rates(points),
    })
}
