//! Tidy: the decision crates stay pure.
//!
//! The core, the simulator, the pipeline engine, the job policy and the agent's planner decide
//! from their inputs alone: they take `now` and events and return decisions, so that a simulated clock can drive them and a run
//! can be replayed. This test reads the sources of every crate in [`PURE_CRATES`] and fails,
//! naming file and line, on any of:
//!
//! - **I/O**: `std::fs`, `std::net`, `std::process`, `std::os`, `std::env`, the standard
//!   streams (`io::stdin`, `io::stdout`, `io::stderr`), `File::`, `OpenOptions`, the I/O crates
//!   (tokio, reqwest, axum, hyper, rusqlite, bollard, nvml-wrapper) and the printing macros
//!   (`print!`, `println!`, `eprint!`, `eprintln!`, `dbg!`). Writing into a `fmt::Write` or
//!   an `io::Write` the caller hands in is allowed: the caller owns that I/O. Naming the type
//!   `std::io::Error` is allowed too: it reads nothing.
//! - **threads**: `std::thread`, `thread::spawn`, `thread::scope`, `thread::Builder`,
//!   `thread::sleep`, rayon and crossbeam;
//! - **clock reads**: `Instant::now`, `SystemTime::now`, `.elapsed()`, chrono, `Utc::now`,
//!   `Local::now`, `OffsetDateTime::now`. Holding an `Instant` a caller passed in is fine;
//!   reading the clock is not.
//!
//! and the crates' `[dependencies]` (also per target) must name none of
//! [`FORBIDDEN_DEPENDENCIES`], and no workspace crate but the pure ones and
//! [`SHARED_CRATES`].
//!
//! What is scanned, and why:
//!
//! - `src/` only. `examples/` are programs that time and print (the profiling examples), and
//!   `tests/` are tests; neither is part of what the library does.
//! - Comments, doc comments and the insides of string and char literals are ignored: a doc
//!   that says "no `std::fs` here" or an error message that says "stdin" is not I/O.
//! - Items under `#[cfg(test)]` (and files under `#![cfg(test)]` or a `#[cfg(test)] mod x;`)
//!   are ignored: they are not compiled into the library, and a unit test may print or time
//!   itself. Any other `cfg` is scanned.
//! - Grouped imports are expanded, so `use std::{fs, thread};` is caught as `std::fs` and
//!   `std::thread`.
//!
//! It is a lint, not a proof: an alias (`use std::time::Instant as Clock; Clock::now()`) or a
//! macro from another crate can hide a clock read. It catches the plain spellings, which is
//! how such reads creep in.
//!
//! An exception is an entry of [`ALLOW`]: a file, the exact patterns allowed there and the
//! reason. An entry that no longer matches anything fails the test, so the list only shrinks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The pure crates, as folders relative to the workspace root. A crate that joins them (the
/// pipeline driver, the job policy, the agent's planner) is one more line here.
const PURE_CRATES: &[&str] = &[
    "coordinator/core",
    "coordinator/sim",
    "coordinator/pipeline",
    "coordinator/policy",
    "agent/planner",
    "agent/hostmodel",
];

/// Workspace crates outside [`PURE_CRATES`] that a pure crate may depend on, and why.
const SHARED_CRATES: &[(&str, &str)] = &[(
    "nightshift-common",
    "the wire and domain types; its I/O (logging, tls) is behind features, which a pure crate \
     must not turn on (checked)",
)];

/// Crates that do I/O, spawn threads or read the clock.
const FORBIDDEN_DEPENDENCIES: &[&str] = &[
    "tokio",
    "reqwest",
    "axum",
    "hyper",
    "rusqlite",
    "bollard",
    "nvml-wrapper",
    "rayon",
    "crossbeam",
    "chrono",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Io,
    Thread,
    Clock,
}

impl Kind {
    fn says(self) -> &'static str {
        match self {
            Kind::Io => "i/o",
            Kind::Thread => "a thread",
            Kind::Clock => "a clock read",
        }
    }
}

/// What is looked for. A pattern made of identifiers and `::` is a path: it also matches
/// inside a grouped import. The others (ending in `!`, `(` or `::`) match the text.
const PATTERNS: &[(Kind, &str)] = &[
    (Kind::Io, "std::fs"),
    (Kind::Io, "std::net"),
    (Kind::Io, "std::process"),
    (Kind::Io, "std::os"),
    (Kind::Io, "std::env"),
    (Kind::Io, "io::stdin"),
    (Kind::Io, "io::stdout"),
    (Kind::Io, "io::stderr"),
    (Kind::Io, "File::"),
    (Kind::Io, "OpenOptions"),
    (Kind::Io, "tokio"),
    (Kind::Io, "reqwest"),
    (Kind::Io, "axum"),
    (Kind::Io, "hyper"),
    (Kind::Io, "rusqlite"),
    (Kind::Io, "bollard"),
    (Kind::Io, "nvml_wrapper"),
    (Kind::Io, "print!"),
    (Kind::Io, "println!"),
    (Kind::Io, "eprint!"),
    (Kind::Io, "eprintln!"),
    (Kind::Io, "dbg!"),
    (Kind::Thread, "std::thread"),
    (Kind::Thread, "thread::spawn"),
    (Kind::Thread, "thread::scope"),
    (Kind::Thread, "thread::Builder"),
    (Kind::Thread, "thread::sleep"),
    (Kind::Thread, "rayon"),
    (Kind::Thread, "crossbeam"),
    (Kind::Clock, "Instant::now"),
    (Kind::Clock, "SystemTime::now"),
    (Kind::Clock, ".elapsed()"),
    (Kind::Clock, "chrono"),
    (Kind::Clock, "Utc::now"),
    (Kind::Clock, "Local::now"),
    (Kind::Clock, "OffsetDateTime::now"),
];

/// An exception: in `file` (relative to the workspace root), these patterns are allowed.
struct Allow {
    file: &'static str,
    patterns: &'static [&'static str],
    reason: &'static str,
}

const ALLOW: &[Allow] = &[Allow {
    file: "coordinator/sim/src/par.rs",
    patterns: &["std::thread", "thread::scope"],
    reason: "the simulator's documented pool: independent pieces of a run (policies, \
             clients' arrivals) on scoped threads, each a pure function of its index, \
             joined before returning, results in index order or summed; the output is \
             the same on one core as on many",
}];

#[test]
fn pure_crates_do_no_io_spawn_no_threads_and_read_no_clock() {
    let root = workspace_root();
    let mut failures = Vec::new();
    let mut used: BTreeSet<(&str, &str)> = BTreeSet::new();
    let mut scanned = 0;
    for krate in PURE_CRATES {
        let src = root.join(krate).join("src");
        assert!(
            src.is_dir(),
            "{krate}/src is not a folder: update PURE_CRATES"
        );
        let files = rust_files(&src);
        let mut analysed = BTreeMap::new();
        let mut test_only: Vec<PathBuf> = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
            let a = analyse(&text);
            for module in &a.test_modules {
                let dir = module_dir(file);
                test_only.push(dir.join(format!("{module}.rs")));
                test_only.push(dir.join(module));
            }
            analysed.insert(file.clone(), (text, a));
        }
        for (file, (text, a)) in &analysed {
            if a.whole_file_is_test || test_only.iter().any(|t| file.starts_with(t)) {
                continue;
            }
            scanned += 1;
            let rel = relative(&root, file);
            let lines: Vec<&str> = text.lines().collect();
            for (line, hits) in findings(&a.code) {
                for (kind, pattern) in hits {
                    if let Some(allow) = ALLOW
                        .iter()
                        .find(|x| x.file == rel && x.patterns.contains(&pattern))
                    {
                        used.insert((allow.file, pattern));
                        continue;
                    }
                    failures.push(format!(
                        "{rel}:{line}: {} in a pure crate: `{pattern}`\n    {}",
                        kind.says(),
                        lines.get(line - 1).map_or("", |l| l.trim())
                    ));
                }
            }
        }
    }
    assert!(scanned > 0, "no source file was scanned");
    for allow in ALLOW {
        for pattern in allow.patterns {
            if !used.contains(&(allow.file, *pattern)) {
                failures.push(format!(
                    "{}: ALLOW lists `{pattern}`, which is no longer there: remove it \
                     (it was allowed because {})",
                    allow.file, allow.reason
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "the pure crates ({}) must do no i/o, spawn no thread and read no clock \
         (coordinator/core/tests/tidy.rs says why and how to allow an exception):\n{}",
        PURE_CRATES.join(", "),
        failures.join("\n")
    );
}

#[test]
fn pure_crates_depend_on_no_io_crate() {
    let root = workspace_root();
    let names: Vec<String> = PURE_CRATES
        .iter()
        .map(|k| package_name(&root.join(k).join("Cargo.toml")))
        .collect();
    let mut failures = Vec::new();
    for krate in PURE_CRATES {
        let manifest = root.join(krate).join("Cargo.toml");
        let text = std::fs::read_to_string(&manifest)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", manifest.display()));
        let rel = relative(&root, &manifest);
        for dep in dependencies(&text) {
            if FORBIDDEN_DEPENDENCIES.contains(&dep.package.as_str()) {
                failures.push(format!(
                    "{rel}:{}: depends on `{}`, which does i/o, threads or clock reads",
                    dep.line, dep.package
                ));
            } else if dep.package.starts_with("nightshift-") && !names.contains(&dep.package) {
                match SHARED_CRATES.iter().find(|(n, _)| *n == dep.package) {
                    None => failures.push(format!(
                        "{rel}:{}: depends on `{}`, a workspace crate that is neither pure \
                         (PURE_CRATES) nor shared (SHARED_CRATES)",
                        dep.line, dep.package
                    )),
                    Some(_) if dep.features => failures.push(format!(
                        "{rel}:{}: turns on features of `{}`, whose features are its i/o",
                        dep.line, dep.package
                    )),
                    Some(_) => {}
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- the scanner ----------------------------------------------------------------------------

struct Analysis {
    /// The source with comments, literals' insides and `#[cfg(test)]` items blanked; the
    /// same length in chars and the same lines as the source.
    code: Vec<char>,
    /// Modules declared `#[cfg(test)] mod NAME;`: their files are test code.
    test_modules: Vec<String>,
    /// The file starts with `#![cfg(test)]`.
    whole_file_is_test: bool,
}

fn analyse(src: &str) -> Analysis {
    let mut code = strip(src);
    let whole_file_is_test = (0..code.len()).any(|i| cfg_test_attr(&code, i, true).is_some());
    let test_modules = blank_test_items(&mut code);
    Analysis {
        code,
        test_modules,
        whole_file_is_test,
    }
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn blank(code: &mut [char], from: usize, to: usize) {
    let to = to.min(code.len());
    for c in &mut code[from.min(to)..to] {
        if *c != '\n' {
            *c = ' ';
        }
    }
}

/// The source with comments and string and char literals blanked, newlines kept.
fn strip(src: &str) -> Vec<char> {
    let c: Vec<char> = src.chars().collect();
    let mut out = c.clone();
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            let end = c[i..]
                .iter()
                .position(|&x| x == '\n')
                .map_or(c.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '/' && next == Some('*') {
            let mut depth = 0usize;
            let mut j = i;
            while j < c.len() {
                if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if let Some(end) = raw_string_end(&c, i) {
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                if c[j] == '\\' {
                    j += 1;
                }
                j += 1;
            }
            let end = (j + 1).min(c.len());
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '\'' && next == Some('\\') {
            // An escaped char literal: '\n', '\'', '\u{1F600}'.
            let mut j = i + 3;
            while j < c.len() && c[j] != '\'' {
                j += 1;
            }
            let end = (j + 1).min(c.len());
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '\'' && c.get(i + 2) == Some(&'\'') {
            blank(&mut out, i, i + 3);
            i += 3;
        } else {
            // Anything else, a lifetime or a label included.
            i += 1;
        }
    }
    out
}

/// Where a raw string (`r"…"`, `r#"…"#`, `br"…"`, `cr"…"`) starting at `i` ends.
fn raw_string_end(c: &[char], i: usize) -> Option<usize> {
    if c[i] != 'r' {
        return None;
    }
    let starts_token = i == 0
        || !is_ident(c[i - 1])
        || (matches!(c[i - 1], 'b' | 'c') && (i < 2 || !is_ident(c[i - 2])));
    if !starts_token {
        return None;
    }
    let mut j = i + 1;
    while c.get(j) == Some(&'#') {
        j += 1;
    }
    let hashes = j - i - 1;
    if c.get(j) != Some(&'"') {
        return None; // a raw identifier (`r#match`) or a plain one
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (1..=hashes).all(|k| c.get(j + k) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
}

/// If `#[cfg(test)]` (or `#![cfg(test)]` when `inner`) starts at `i`, where it ends.
fn cfg_test_attr(code: &[char], i: usize, inner: bool) -> Option<usize> {
    if code.get(i) != Some(&'#') {
        return None;
    }
    let mut j = i + 1;
    let mut expect = |s: &str| -> bool {
        while code.get(j).is_some_and(|c| c.is_whitespace()) {
            j += 1;
        }
        let ok = s
            .chars()
            .enumerate()
            .all(|(k, x)| code.get(j + k) == Some(&x));
        if ok {
            j += s.chars().count();
        }
        ok
    };
    if inner && !expect("!") {
        return None;
    }
    let ok = ["[", "cfg", "(", "test", ")", "]"]
        .iter()
        .all(|s| expect(s));
    ok.then_some(j)
}

/// Blanks every item under `#[cfg(test)]`; returns the names of out-of-line test modules.
fn blank_test_items(code: &mut [char]) -> Vec<String> {
    let mut modules = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let Some(after) = cfg_test_attr(code, i, false) else {
            i += 1;
            continue;
        };
        // The item runs to the first `;` or to the brace matching the first `{`.
        let mut j = after;
        while j < code.len() && code[j] != ';' && code[j] != '{' {
            j += 1;
        }
        let end = if code.get(j) == Some(&'{') {
            let mut depth = 0usize;
            let mut k = j;
            loop {
                match code.get(k) {
                    None => break code.len(),
                    Some('{') => depth += 1,
                    Some('}') => {
                        depth -= 1;
                        if depth == 0 {
                            break k + 1;
                        }
                    }
                    Some(_) => {}
                }
                k += 1;
            }
        } else {
            let item: String = code[after..j.min(code.len())].iter().collect();
            let words: Vec<&str> = item.split_whitespace().collect();
            if let [.., "mod", name] = words.as_slice() {
                modules.push((*name).to_owned());
            }
            (j + 1).min(code.len())
        };
        blank(code, i, end);
        i = end;
    }
    modules
}

/// For each line (1-based) that has any, the patterns found on it.
fn findings(code: &[char]) -> BTreeMap<usize, BTreeSet<(Kind, &'static str)>> {
    let text: String = code.iter().collect();
    let mut found: BTreeMap<usize, BTreeSet<(Kind, &'static str)>> = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let chars: Vec<char> = line.chars().collect();
        for &(kind, pattern) in PATTERNS {
            if contains_token(&chars, pattern) {
                found.entry(n + 1).or_default().insert((kind, pattern));
            }
        }
    }
    for (path, line) in imported_paths(code) {
        let segments: Vec<&str> = path.split("::").collect();
        for &(kind, pattern) in PATTERNS {
            if !is_path(pattern) {
                continue;
            }
            let want: Vec<&str> = pattern.split("::").collect();
            if segments.windows(want.len()).any(|w| w == want.as_slice()) {
                found.entry(line).or_default().insert((kind, pattern));
            }
        }
    }
    found
}

fn is_path(pattern: &str) -> bool {
    pattern
        .split("::")
        .all(|s| !s.is_empty() && s.chars().all(is_ident))
}

/// `pattern` occurs in `line` as a whole token: no identifier character just before it, and
/// none just after it when it ends in one.
fn contains_token(line: &[char], pattern: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    if p.len() > line.len() {
        return false;
    }
    (0..=line.len() - p.len()).any(|i| {
        line[i..i + p.len()] == p[..]
            && (!is_ident(p[0]) || i == 0 || !is_ident(line[i - 1]))
            && (!is_ident(p[p.len() - 1]) || line.get(i + p.len()).is_none_or(|&c| !is_ident(c)))
    })
}

/// Every path a `use` declaration brings in, grouped imports expanded, with the line (1-based)
/// of its last segment: `use std::{fs, io::{self, Write}};` gives `std::fs`, `std::io::self`
/// and `std::io::Write`.
fn imported_paths(code: &[char]) -> Vec<(String, usize)> {
    let mut tokens: Vec<(String, usize)> = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < code.len() {
        let c = code[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if is_ident(c) {
            let start = i;
            while i < code.len() && is_ident(code[i]) {
                i += 1;
            }
            tokens.push((code[start..i].iter().collect(), line));
        } else if c == ':' && code.get(i + 1) == Some(&':') {
            tokens.push(("::".to_owned(), line));
            i += 2;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            tokens.push((c.to_string(), line));
            i += 1;
        }
    }
    let mut paths = Vec::new();
    let mut t = 0;
    while t < tokens.len() {
        if tokens[t].0 == "use" {
            let mut cursor = t + 1;
            use_tree(&tokens, &mut cursor, Vec::new(), &mut paths);
            t = cursor;
        } else {
            t += 1;
        }
    }
    paths
}

/// Reads one use tree at `cursor` below `prefix`, pushing the paths it names.
fn use_tree(
    tokens: &[(String, usize)],
    cursor: &mut usize,
    mut prefix: Vec<String>,
    paths: &mut Vec<(String, usize)>,
) {
    let mut line = tokens.get(*cursor).map_or(0, |t| t.1);
    loop {
        let Some((tok, l)) = tokens.get(*cursor) else {
            return;
        };
        match tok.as_str() {
            "::" => *cursor += 1,
            "{" => {
                *cursor += 1;
                loop {
                    match tokens.get(*cursor).map(|t| t.0.as_str()) {
                        None => return,
                        Some("}") => {
                            *cursor += 1;
                            return;
                        }
                        Some(",") => *cursor += 1,
                        Some(_) => {
                            let before = *cursor;
                            use_tree(tokens, cursor, prefix.clone(), paths);
                            if *cursor == before {
                                *cursor += 1; // not a use tree: step over it
                            }
                        }
                    }
                }
            }
            "as" => *cursor += 2,
            _ if tok.chars().all(is_ident) || tok == "*" => {
                prefix.push(tok.clone());
                line = *l;
                *cursor += 1;
            }
            _ => {
                // `,`, `}` or `;`: the end of this tree.
                if !prefix.is_empty() {
                    paths.push((prefix.join("::"), line));
                }
                if tok == ";" {
                    *cursor += 1;
                }
                return;
            }
        }
    }
}

// ---- files and manifests --------------------------------------------------------------------

fn workspace_root() -> PathBuf {
    let core = Path::new(env!("CARGO_MANIFEST_DIR"));
    core.join("../..")
        .canonicalize()
        .expect("the workspace root is two folders above coordinator/core")
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .to_string_lossy()
        .replace('\\', "/")
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.expect("a folder entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    out
}

/// The folder that holds the files of the modules `file` declares.
fn module_dir(file: &Path) -> PathBuf {
    let parent = file.parent().expect("a source file has a folder");
    match file.file_name().and_then(|n| n.to_str()) {
        Some("lib.rs" | "main.rs" | "mod.rs") => parent.to_owned(),
        _ => parent.join(file.file_stem().expect("a source file has a name")),
    }
}

fn package_name(manifest: &Path) -> String {
    let text = std::fs::read_to_string(manifest)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", manifest.display()));
    let mut in_package = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package && let Some(value) = line.strip_prefix("name") {
            let value = value.trim_start();
            if let Some(value) = value.strip_prefix('=') {
                return value.trim().trim_matches('"').to_owned();
            }
        }
    }
    panic!("{} has no package name", manifest.display())
}

struct Dependency {
    /// The package depended on (`package = "…"` when renamed).
    package: String,
    line: usize,
    /// It turns on features.
    features: bool,
}

/// The normal dependencies of a manifest: `[dependencies]`, `[target.….dependencies]` and
/// their `[dependencies.NAME]` tables. Dev- and build-dependencies are not the library's.
fn dependencies(manifest: &str) -> Vec<Dependency> {
    enum Section {
        Other,
        List,
        Table(usize),
    }
    let mut deps: Vec<Dependency> = Vec::new();
    let mut section = Section::Other;
    for (n, raw) in manifest.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        if line.starts_with('[') {
            let header = line.trim_matches(['[', ']']).trim();
            let (table, name) = match header.rsplit_once("dependencies.") {
                Some((before, name)) => (before.to_owned() + "dependencies", Some(name)),
                None => (header.to_owned(), None),
            };
            let normal = table == "dependencies"
                || (table.starts_with("target.") && table.ends_with(".dependencies"));
            section = match (normal, name) {
                (false, _) => Section::Other,
                (true, None) => Section::List,
                (true, Some(name)) => {
                    deps.push(Dependency {
                        package: name.trim_matches('"').to_owned(),
                        line: n + 1,
                        features: false,
                    });
                    Section::Table(deps.len() - 1)
                }
            };
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim();
        match section {
            Section::Other => {}
            Section::List => {
                let name = key
                    .split('.')
                    .next()
                    .unwrap_or(key)
                    .trim()
                    .trim_matches('"');
                deps.push(Dependency {
                    package: renamed(value).unwrap_or_else(|| name.to_owned()),
                    line: n + 1,
                    features: value.contains("features"),
                });
            }
            Section::Table(d) => {
                if key == "package" {
                    deps[d].package = value.trim().trim_matches('"').to_owned();
                } else if key == "features" {
                    deps[d].features = true;
                }
            }
        }
    }
    deps
}

/// The `package = "…"` of an inline dependency table.
fn renamed(value: &str) -> Option<String> {
    let after = value.split("package").nth(1)?;
    let after = after.trim_start().strip_prefix('=')?.trim_start();
    let name = after.strip_prefix('"')?.split('"').next()?;
    Some(name.to_owned())
}

// ---- the scanner's own tests ----------------------------------------------------------------

fn patterns_in(src: &str) -> Vec<(usize, &'static str)> {
    let a = analyse(src);
    findings(&a.code)
        .into_iter()
        .flat_map(|(line, hits)| hits.into_iter().map(move |(_, p)| (line, p)))
        .collect()
}

#[test]
fn the_scanner_finds_plain_spellings() {
    assert_eq!(
        patterns_in("fn f() {\n    let t = std::time::Instant::now();\n}"),
        [(2, "Instant::now")]
    );
    assert_eq!(
        patterns_in("fn f() { let s = std::fs::read_to_string(p); }"),
        [(1, "std::fs")]
    );
    assert_eq!(
        patterns_in("fn f() { eprintln!(\"x\"); }"),
        [(1, "eprintln!")]
    );
    assert_eq!(patterns_in("fn f() { println!() }"), [(1, "println!")]);
    assert_eq!(patterns_in("fn f() { print!(\"\") }"), [(1, "print!")]);
    assert_eq!(patterns_in("let d = start.elapsed();"), [(1, ".elapsed()")]);
    assert_eq!(patterns_in("let f = File::open(p);"), [(1, "File::")]);
    assert_eq!(
        patterns_in("use std::{\n    collections::HashMap,\n    thread,\n};"),
        [(3, "std::thread")]
    );
    assert_eq!(
        patterns_in("use std::io::{stdout, Write};"),
        [(1, "io::stdout")]
    );
    assert_eq!(
        patterns_in("std::thread::scope(|s| {});"),
        [(1, "std::thread"), (1, "thread::scope")]
    );
    assert_eq!(
        patterns_in("async fn f() { tokio::spawn(x); }"),
        [(1, "tokio")]
    );
}

#[test]
fn the_scanner_ignores_comments_literals_test_code_and_look_alikes() {
    let clean = [
        "// std::fs::read\nfn f() {}",
        "/// Never calls `Instant::now()`.\nfn f() {}",
        "/* outer /* inner std::thread */ still a comment println!() */ fn f() {}",
        "const S: &str = \"std::fs and println!\";",
        "const S: &str = r#\"a \"quoted\" Instant::now()\"#;",
        "const B: &[u8] = br\"std::net\";",
        "fn f<'a>(x: &'a str) -> &'a str { x }",
        "let e: std::io::Error = e;",
        "use std::io::{self, Write};",
        "writeln!(out, \"x\")?;",
        "let s = self.elapsed_s + result.stdout.len();",
        "let t = TraceFile::new(); let p = my_std::fs::x;",
        "let r#match = 1;",
    ];
    for src in clean {
        assert_eq!(patterns_in(src), [], "{src}");
    }
    // A char literal holding a quote does not open a string.
    assert_eq!(
        patterns_in("let q = '\"'; std::fs::write(p, b)?;"),
        [(1, "std::fs")]
    );
    assert_eq!(
        patterns_in("let q = '\\''; std::fs::write(p, b)?;"),
        [(1, "std::fs")]
    );
    // A test module is skipped, and the code after it is not.
    let src =
        "#[cfg(test)]\nmod tests {\n    fn t() { if x { println!(); } }\n}\nfn g() { dbg!(1); }";
    assert_eq!(patterns_in(src), [(5, "dbg!")]);
    let a = analyse("#[cfg(test)]\nmod fixtures;\nfn f() {}");
    assert_eq!(a.test_modules, ["fixtures"]);
    assert!(analyse("#![cfg(test)]\nfn f() { println!() }").whole_file_is_test);
    // Another cfg is scanned.
    assert_eq!(
        patterns_in("#[cfg(feature = \"x\")]\nfn f() { println!() }"),
        [(2, "println!")]
    );
}

#[test]
fn the_manifest_reader_sees_every_normal_dependency() {
    let manifest = r#"
[package]
name = "x"

[dependencies]
nightshift-common = { workspace = true, features = ["logging"] }
serde.workspace = true
rt = { package = "tokio", version = "1" }

[dependencies.bollard]
version = "0.19"

[target.'cfg(unix)'.dependencies]
rusqlite = "0.37"

[dev-dependencies]
reqwest = "0.12"
"#;
    let deps: Vec<(String, usize, bool)> = dependencies(manifest)
        .into_iter()
        .map(|d| (d.package, d.line, d.features))
        .collect();
    let want = [
        ("nightshift-common", 6, true),
        ("serde", 7, false),
        ("tokio", 8, false),
        ("bollard", 10, false),
        ("rusqlite", 14, false),
    ];
    let want: Vec<(String, usize, bool)> = want
        .into_iter()
        .map(|(p, l, f)| (p.to_owned(), l, f))
        .collect();
    assert_eq!(deps, want);
}
