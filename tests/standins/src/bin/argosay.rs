//! `argosay`: a stand-in for the `argoproj/argosay` images that Argo's examples run, for sites
//! (and tests) that cannot pull them. One static binary, chosen by the name it is called by:
//!
//! - `argosay [COMMAND ARGS...]` (the image's entrypoint), commands as in argosay v2:
//!   `echo [TEXT [FILE]]` prints TEXT (default `hello argo`) or writes it to FILE;
//!   `cat FILE...`; `sleep DURATION` (`10`, `10s`, `2m`, `1h`, `1d`); `exit [CODE]`;
//!   `assert_exist FILE`; `assert_contains FILE TEXT`. No command is `echo`.
//! - `cowsay TEXT...` (argosay v1 / whalesay): TEXT in a speech bubble over a cow.
//! - `bash ARGS...`: the image's busybox `sh` with the same arguments (the examples call
//!   `bash -c "..."`; busybox has no bash).
//!
//! Exit codes: 0 success, the code asked for by `exit`, 1 a failed assertion or I/O error,
//! 2 a usage error. std only, so it links statically into a `FROM scratch` image.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};
use std::time::Duration;

/// Where the image keeps busybox.
const BUSYBOX: &str = "/bin/busybox";

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().collect();
    let called = args
        .first()
        .map(|a| a.rsplit('/').next().unwrap_or(a).to_owned())
        .unwrap_or_default();
    args.remove(0);
    match called.as_str() {
        "bash" => {
            let err = Command::new(BUSYBOX).arg("sh").args(&args).exec();
            eprintln!("bash: cannot run {BUSYBOX} sh: {err}");
            ExitCode::from(127)
        }
        "cowsay" => {
            print!("{}", cow(&args.join(" ")));
            ExitCode::SUCCESS
        }
        _ => argosay(&args),
    }
}

fn argosay(args: &[String]) -> ExitCode {
    let (command, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => ("echo", &[][..]),
    };
    let result = match (command, rest) {
        ("echo", []) => say("hello argo"),
        ("echo", [text]) => say(text),
        ("echo", [text, file]) => write_file(file, text),
        ("cat", files) if !files.is_empty() => files.iter().try_for_each(|f| {
            let content = std::fs::read(f).map_err(|e| format!("cat: {f}: {e}"))?;
            std::io::stdout()
                .write_all(&content)
                .map_err(|e| format!("cat: {e}"))
        }),
        ("sleep", [d]) => match parse_duration(d) {
            Some(d) => {
                std::thread::sleep(d);
                Ok(())
            }
            None => return usage(&format!("sleep: bad duration {d:?}")),
        },
        ("exit", []) => return ExitCode::SUCCESS,
        ("exit", [code]) => match code.parse::<u8>() {
            Ok(c) => return ExitCode::from(c),
            Err(_) => return usage(&format!("exit: bad code {code:?}")),
        },
        ("assert_exist", [f]) => std::fs::metadata(f)
            .map(|_| ())
            .map_err(|e| format!("assert_exist: {f}: {e}")),
        ("assert_contains", [f, text]) => match std::fs::read_to_string(f) {
            Ok(c) if c.contains(text.as_str()) => Ok(()),
            Ok(_) => Err(format!("assert_contains: {f} does not contain {text:?}")),
            Err(e) => Err(format!("assert_contains: {f}: {e}")),
        },
        _ => return usage(&format!("unknown command {:?}", args.join(" "))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("argosay: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!(
        "argosay: {why}\nusage: argosay [echo [TEXT [FILE]] | cat FILE... | sleep DURATION | \
         exit [CODE] | assert_exist FILE | assert_contains FILE TEXT]"
    );
    ExitCode::from(2)
}

fn say(text: &str) -> Result<(), String> {
    println!("{text}");
    Ok(())
}

fn write_file(path: &str, text: &str) -> Result<(), String> {
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("echo: {}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("echo: {path}: {e}"))
}

/// `10` (seconds), `1.5s`, `500ms`, `2m`, `1h`, `1d`.
fn parse_duration(text: &str) -> Option<Duration> {
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: f64 = number.parse().ok()?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86_400.0,
        _ => return None,
    };
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs))
}

fn cow(text: &str) -> String {
    let bar = "_".repeat(text.chars().count() + 2);
    let low = "-".repeat(text.chars().count() + 2);
    format!(
        " {bar}\n< {text} >\n {low}\n        \\   ^__^\n         \\  (oo)\\_______\n            (__)\\       )\\/\\\n                ||----w |\n                ||     ||\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10"), Some(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("1d"), Some(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("soon"), None);
    }

    #[test]
    fn the_cow_says_its_text() {
        let c = cow("hello");
        assert!(c.starts_with(" _______\n< hello >\n"), "{c}");
        assert!(c.contains("(oo)"));
    }
}
