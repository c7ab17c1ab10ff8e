//! Logging setup and error printing shared by the three binaries (agent, coordinator, CLI),
//! behind the `logging` feature.
//!
//! Where stderr goes decides the format:
//! - a terminal: tracing's usual coloured lines with a timestamp (no colours with `NO_COLOR`);
//! - the journal (systemd sets `JOURNAL_STREAM` to stderr's device and inode): plain lines
//!   without a timestamp of our own (journald stamps each entry), each starting with the
//!   sd-daemon priority prefix `<N>` so that journald records the level as `PRIORITY`
//!   (`SyslogLevelPrefix=`, on by default) and `journalctl -p warning` finds our warnings;
//! - anything else (a file, a pipe, `docker logs`): plain lines with a timestamp.
//!
//! We write sd-daemon prefixes to stderr rather than speak journald's native protocol
//! (`tracing-journald`): no new dependency, no second channel whose lines could interleave
//! with what the process writes to stderr (panics, error exits), and the same output works
//! under any supervisor that understands the prefixes (and reads fine under one that does not).

use std::error::Error;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::registry::LookupSpan;

/// How log lines and errors are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// A terminal: colours and a timestamp.
    Terminal,
    /// A file or a pipe: no colours, a timestamp.
    Plain,
    /// systemd's journal: no colours, no timestamp, an sd-daemon `<N>` priority prefix on each line.
    Journal,
}

impl Style {
    /// The style for this process's stderr.
    pub fn of_stderr() -> Style {
        let stderr = std::io::stderr();
        if is_journal_stream(
            std::env::var_os("JOURNAL_STREAM").as_deref(),
            stderr.as_fd(),
        ) {
            Style::Journal
        } else if stderr.is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
        {
            Style::Terminal
        } else {
            Style::Plain
        }
    }
}

/// Whether `fd` is the stream systemd connected to the journal: `JOURNAL_STREAM` holds its
/// `DEVICE:INODE` (in decimal). A child that inherited the variable but whose stderr was
/// redirected elsewhere does not match.
pub fn is_journal_stream(journal_stream: Option<&std::ffi::OsStr>, fd: BorrowedFd<'_>) -> bool {
    let Some((dev, ino)) = journal_stream
        .and_then(|v| v.to_str())
        .and_then(|v| v.split_once(':'))
        .and_then(|(d, i)| Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?)))
    else {
        return false;
    };
    // fstat through a duplicate of the descriptor: std offers no fstat on a borrowed fd.
    let Ok(meta) = fd
        .try_clone_to_owned()
        .map(std::fs::File::from)
        .and_then(|f| f.metadata())
    else {
        return false;
    };
    meta.dev() == dev && meta.ino() == ino
}

/// The sd-daemon priority of a tracing level (sd-daemon.h: `SD_ERR` 3 ... `SD_DEBUG` 7).
pub fn priority(level: Level) -> u8 {
    match level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// Installs the global tracing subscriber writing to stderr in the style of [`Style::of_stderr`].
/// `RUST_LOG` overrides `default_filter`. A second call does nothing.
pub fn init(default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match Style::of_stderr() {
        Style::Terminal => builder.with_ansi(true).try_init(),
        Style::Plain => builder.with_ansi(false).try_init(),
        Style::Journal => builder
            .with_ansi(false)
            .event_format(JournalFormat::default())
            .try_init(),
    };
}

/// tracing's full format without colours or timestamp, every line prefixed with the event's
/// sd-daemon priority (a message of several lines becomes several journal entries, each with
/// the right `PRIORITY`).
#[derive(Debug)]
pub struct JournalFormat {
    inner: format::Format<format::Full, ()>,
}

impl Default for JournalFormat {
    fn default() -> Self {
        JournalFormat {
            inner: format::format().without_time().with_ansi(false),
        }
    }
}

impl<S, N> FormatEvent<S, N> for JournalFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let mut text = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut text), event)?;
        write_prefixed(&mut writer, priority(*event.metadata().level()), &text)
    }
}

fn write_prefixed(out: &mut impl std::fmt::Write, priority: u8, text: &str) -> std::fmt::Result {
    for line in text.lines() {
        writeln!(out, "<{priority}>{line}")?;
    }
    Ok(())
}

/// An error and its causes on one line, `outer: cause: cause`, leaving out a cause whose text
/// the line already holds (an error that displays its source as well as returning it from
/// [`Error::source`] would otherwise print the same message nested in itself).
pub fn error_message(error: &(dyn Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            let _ = write!(text, ": {more}");
        }
        source = cause.source();
    }
    text
}

/// The text a binary prints on stderr when it exits with `error`: `error: ...`, with the
/// error priority on each line in the journal style.
pub fn error_report(style: Style, error: &(dyn Error + 'static)) -> String {
    let text = format!("error: {}", error_message(error));
    if style != Style::Journal {
        return text + "\n";
    }
    let mut out = String::new();
    let _ = write_prefixed(&mut out, priority(Level::ERROR), &text);
    out
}

/// Prints [`error_report`] for this process's stderr.
pub fn print_error(error: &(dyn Error + 'static)) {
    eprint!("{}", error_report(Style::of_stderr(), error));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        // The pattern that printed config errors twice: displays its source and returns it.
        #[error("{0}")]
        Nested(#[from] Inner),
        #[error("cannot load")]
        Wrapping(#[source] Inner),
    }
    #[derive(Debug, thiserror::Error)]
    #[error("agent.toml: line 3: drain_timeout_s: invalid type")]
    struct Inner;

    #[test]
    fn an_error_that_displays_its_source_is_printed_once() {
        assert_eq!(
            error_message(&Outer::Nested(Inner)),
            "agent.toml: line 3: drain_timeout_s: invalid type"
        );
        assert_eq!(
            error_message(&Outer::Wrapping(Inner)),
            "cannot load: agent.toml: line 3: drain_timeout_s: invalid type"
        );
    }

    #[test]
    fn journal_errors_carry_the_error_priority_on_every_line() {
        #[derive(Debug, thiserror::Error)]
        #[error("a.toml: line 1: x: bad\na.toml: line 2: y: bad")]
        struct Two;
        assert_eq!(
            error_report(Style::Journal, &Two),
            "<3>error: a.toml: line 1: x: bad\n<3>a.toml: line 2: y: bad\n"
        );
        assert_eq!(
            error_report(Style::Plain, &Two),
            "error: a.toml: line 1: x: bad\na.toml: line 2: y: bad\n"
        );
    }

    #[test]
    fn journal_stream_matches_only_the_device_and_inode_of_the_fd() {
        let file = tempfile_in_tmp();
        let meta = file.metadata().unwrap();
        let right = format!("{}:{}", meta.dev(), meta.ino());
        let wrong = format!("{}:{}", meta.dev(), meta.ino() + 1);
        assert!(is_journal_stream(Some(right.as_ref()), file.as_fd()));
        assert!(!is_journal_stream(Some(wrong.as_ref()), file.as_fd()));
        assert!(!is_journal_stream(Some("garbage".as_ref()), file.as_fd()));
        assert!(!is_journal_stream(None, file.as_fd()));
    }

    fn tempfile_in_tmp() -> std::fs::File {
        let path = std::env::temp_dir().join(format!("nightshift-logging-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        file
    }

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn journal_lines_carry_the_level_as_priority_without_colour_or_timestamp() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(Level::TRACE)
            .with_ansi(true) // the format must not colour even where the writer would allow it
            .event_format(JournalFormat::default())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(node = "gpu-01", "store unwritable");
            tracing::error!("two\nlines");
            tracing::info!("listening");
            tracing::debug!("details");
        });
        let out = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 5, "{out}");
        assert!(lines[0].starts_with("<4> WARN "), "{out}");
        assert!(
            lines[0].ends_with("store unwritable node=\"gpu-01\""),
            "{out}"
        );
        assert!(
            lines[1].starts_with("<3>ERROR ") && lines[1].ends_with("two"),
            "{out}"
        );
        assert_eq!(lines[2], "<3>lines", "{out}");
        assert!(lines[3].starts_with("<6> INFO "), "{out}");
        assert!(lines[4].starts_with("<7>DEBUG "), "{out}");
        // No timestamp of our own: the checks above find the level right after the prefix.
        assert!(!out.contains('\x1b'), "ANSI escape in {out:?}");
    }
}
