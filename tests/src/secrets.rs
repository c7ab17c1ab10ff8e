//! No secret in the logs of a whole test run.
//!
//! Every test that logs writes its log lines under one run directory ([`run_dir`]): the
//! harness's [`crate::init_tracing`] tees the in-process subscriber there and
//! [`crate::CoordinatorProcess`] sends its child's output there. Every test that creates a
//! secret (an API token, a private key) records it with [`record`]. After `cargo test`,
//! `tests/run.sh` runs `nightshift-logscan`, which [`scan`]s every `*.log` file for every
//! recorded secret and fails the run naming the file and line (never the secret).
//!
//! The layout, for tests outside this crate that write there themselves
//! (`coordinator/tests/auth.rs`): `$NIGHTSHIFT_TEST_LOGS`, else `test-logs/` beside the
//! target profile's `deps/`; log files end in `.log`; secrets are one per line in files under
//! `secrets/`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The environment variable that names the run directory.
pub const RUN_DIR_ENV: &str = "NIGHTSHIFT_TEST_LOGS";

/// A recorded secret shorter than this is not scanned for: it would match by chance.
pub const MIN_SECRET_LEN: usize = 12;

/// The run directory, created when missing.
pub fn run_dir() -> PathBuf {
    let dir = match std::env::var_os(RUN_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().expect("current exe");
            // target/debug/deps/<test> or target/debug/<bin>: beside the profile's deps/.
            let mut profile = exe.parent().expect("exe dir").to_owned();
            if profile.ends_with("deps") {
                profile.pop();
            }
            profile.join("test-logs")
        }
    };
    std::fs::create_dir_all(dir.join("secrets")).expect("create the test log directory");
    dir
}

/// A new log file in the run directory, named after `name` and this process.
pub fn log_file(name: &str) -> (PathBuf, File) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = run_dir().join(format!("{name}-{}-{n}.log", std::process::id()));
    let file = File::create(&path).expect("create a test log file");
    (path, file)
}

/// Records `secret` (a token, or the text of a private key: each of its PEM body lines is
/// recorded) for the scan at the end of the run.
pub fn record(secret: &str) {
    let path = run_dir()
        .join("secrets")
        .join(format!("{}.txt", std::process::id()));
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .expect("open the secrets file");
    for value in values(secret) {
        writeln!(file, "{value}").expect("record a secret");
    }
}

/// The values to look for: a PEM's body lines, or the secret itself.
fn values(secret: &str) -> Vec<&str> {
    if secret.contains("-----BEGIN") {
        secret
            .lines()
            .map(str::trim)
            .filter(|l| !l.starts_with("-----") && l.len() >= MIN_SECRET_LEN)
            .collect()
    } else {
        vec![secret.trim()]
    }
}

/// A recorded secret found in a log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leak {
    pub log: PathBuf,
    pub line: usize,
    /// Where the secret was recorded (`secrets/FILE:LINE`), so that the message never holds
    /// the secret itself.
    pub secret: String,
}

impl std::fmt::Display for Leak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}: holds the secret recorded at {}",
            self.log.display(),
            self.line,
            self.secret
        )
    }
}

/// What [`scan`] looked at.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Scan {
    pub logs: usize,
    pub log_bytes: u64,
    pub secrets: usize,
    pub leaks: Vec<Leak>,
}

/// Every line of every `*.log` under `dir` that holds a secret recorded under
/// `dir/secrets/`.
pub fn scan(dir: &Path) -> std::io::Result<Scan> {
    let mut secrets = Vec::new();
    let secrets_dir = dir.join("secrets");
    if secrets_dir.is_dir() {
        for entry in sorted(&secrets_dir)? {
            let text = std::fs::read_to_string(&entry)?;
            let name = entry.file_name().unwrap_or_default().to_string_lossy();
            for (i, value) in text.lines().enumerate() {
                if value.trim().len() >= MIN_SECRET_LEN {
                    secrets.push((value.trim().to_owned(), format!("secrets/{name}:{}", i + 1)));
                }
            }
        }
    }
    let mut scan = Scan {
        secrets: secrets.len(),
        ..Scan::default()
    };
    for log in sorted(dir)? {
        if log.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let bytes = std::fs::read(&log)?;
        scan.logs += 1;
        scan.log_bytes += bytes.len() as u64;
        let text = String::from_utf8_lossy(&bytes);
        for (i, line) in text.lines().enumerate() {
            for (value, at) in &secrets {
                if line.contains(value.as_str()) {
                    scan.leaks.push(Leak {
                        log: log.clone(),
                        line: i + 1,
                        secret: at.clone(),
                    });
                }
            }
        }
    }
    Ok(scan)
}

fn sorted(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut paths = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()?;
    paths.retain(|p| p.is_file());
    paths.sort();
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir.join(name).parent().unwrap()).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn a_planted_secret_is_found_by_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let token = "nst_3f9a0c1d2e4b5a6978c0ffee";
        let key = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg\nshort\n\
                   -----END PRIVATE KEY-----\n";
        write(dir.path(), "secrets/100.txt", &format!("{token}\n"));
        write(dir.path(), "secrets/200.txt", &values(key).join("\n"));
        write(
            dir.path(),
            "clean.log",
            "INFO job submitted job.id=1\nINFO token=<redacted>\n",
        );
        write(
            dir.path(),
            "leaky.log",
            &format!(
                "INFO start\nDEBUG authorization: Bearer {token}\nINFO key MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg\n"
            ),
        );
        // Not a log: never scanned.
        write(dir.path(), "notes.txt", token);

        let scan = scan(dir.path()).unwrap();
        assert_eq!((scan.logs, scan.secrets), (2, 2));
        let found: Vec<String> = scan.leaks.iter().map(ToString::to_string).collect();
        let leaky = dir.path().join("leaky.log").display().to_string();
        assert_eq!(
            found,
            [
                format!("{leaky}:2: holds the secret recorded at secrets/100.txt:1"),
                format!("{leaky}:3: holds the secret recorded at secrets/200.txt:1"),
            ]
        );
        assert!(found.iter().all(|f| !f.contains(token)));
    }

    #[test]
    fn clean_logs_pass_and_short_values_are_not_secrets() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "secrets/1.txt", "abc\n");
        write(dir.path(), "a.log", "abc abc abc\n");
        let scan = scan(dir.path()).unwrap();
        assert_eq!((scan.logs, scan.secrets), (1, 0));
        assert!(scan.leaks.is_empty());
    }

    #[test]
    fn a_key_is_recorded_by_its_body_lines() {
        let key = "-----BEGIN PRIVATE KEY-----\nAAAABBBBCCCCDDDD\nEEEE\n-----END PRIVATE KEY-----";
        assert_eq!(values(key), ["AAAABBBBCCCCDDDD"]);
        assert_eq!(values(" nst_abcdef123456 \n"), ["nst_abcdef123456"]);
    }
}
