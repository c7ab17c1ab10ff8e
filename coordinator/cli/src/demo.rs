//! `nightshift demo`: hands over to `nightshift-demo` (the dev cluster, crate
//! `nightshift-devcluster`), which starts a coordinator and an agent as processes on this
//! machine and tells the harvest story. The CLI does not link any of that: it looks for the
//! program next to its own executable, then on `PATH`, and replaces itself with it (so the
//! process id, which names the demo's node, stays the same).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The dev cluster's program.
pub const DEMO_BIN: &str = "nightshift-demo";

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(
        "`nightshift demo` runs {DEMO_BIN}, which is neither next to this program (in {}) \
         nor on PATH; from a nightshift source checkout, run \
         `cargo run -p nightshift-devcluster --bin nightshift-demo`",
        .looked_in.display()
    )]
    NotFound { looked_in: PathBuf },

    #[error("cannot run {}: {source}", .path.display())]
    Exec {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Finds `nightshift-demo` and runs it with `--output json|table` in place of this process;
/// returns only when that fails.
pub fn run(json: bool) -> Result<i32, DemoError> {
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_owned))
        .unwrap_or_default();
    let path = find(&exe_dir, std::env::var_os("PATH"))
        .ok_or(DemoError::NotFound { looked_in: exe_dir })?;
    let mut command = std::process::Command::new(&path);
    command
        .arg("--output")
        .arg(if json { "json" } else { "table" });
    exec(command, path)
}

#[cfg(unix)]
fn exec(mut command: std::process::Command, path: PathBuf) -> Result<i32, DemoError> {
    use std::os::unix::process::CommandExt;
    let source = command.exec();
    Err(DemoError::Exec { path, source })
}

#[cfg(not(unix))]
fn exec(mut command: std::process::Command, path: PathBuf) -> Result<i32, DemoError> {
    let status = command
        .status()
        .map_err(|source| DemoError::Exec { path, source })?;
    Ok(status.code().unwrap_or(1))
}

/// `nightshift-demo` in `exe_dir`, else in the first directory of `path` (a `PATH` value)
/// that has it.
fn find(exe_dir: &Path, path: Option<OsString>) -> Option<PathBuf> {
    let beside = exe_dir.join(DEMO_BIN);
    if beside.is_file() {
        return Some(beside);
    }
    std::env::split_paths(&path?)
        .map(|dir| dir.join(DEMO_BIN))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_is_found_beside_the_cli_first_then_on_path() {
        let (beside, on_path) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let path = std::env::join_paths([on_path.path()]).unwrap();
        assert_eq!(find(beside.path(), Some(path.clone())), None);
        std::fs::write(on_path.path().join(DEMO_BIN), "").unwrap();
        assert_eq!(
            find(beside.path(), Some(path.clone())),
            Some(on_path.path().join(DEMO_BIN))
        );
        std::fs::write(beside.path().join(DEMO_BIN), "").unwrap();
        assert_eq!(
            find(beside.path(), Some(path)),
            Some(beside.path().join(DEMO_BIN))
        );
    }

    #[test]
    fn a_missing_demo_says_where_it_looked_and_what_to_run() {
        let err = DemoError::NotFound {
            looked_in: "/usr/bin".into(),
        };
        let msg = err.to_string();
        assert!(
            msg.contains("nightshift-demo, which is neither next to this program (in /usr/bin)")
                && msg.contains("cargo run -p nightshift-devcluster --bin nightshift-demo"),
            "{msg}"
        );
    }
}
