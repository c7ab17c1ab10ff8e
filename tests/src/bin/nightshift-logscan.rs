//! `nightshift-logscan [DIR]`: fails when a log of the test run holds a secret a test
//! recorded (see `nightshift_tests::secrets`). `tests/run.sh` runs it after `cargo test`.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(nightshift_tests::secrets::run_dir);
    let scan = match nightshift_tests::secrets::scan(&dir) {
        Ok(scan) => scan,
        Err(e) => {
            eprintln!("nightshift-logscan: {}: {e}", dir.display());
            return ExitCode::from(2);
        }
    };
    for leak in &scan.leaks {
        eprintln!("nightshift-logscan: {leak}");
    }
    eprintln!(
        "nightshift-logscan: {} log files ({} bytes) in {}, {} recorded secrets, {} leaks",
        scan.logs,
        scan.log_bytes,
        dir.display(),
        scan.secrets,
        scan.leaks.len()
    );
    if scan.leaks.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
