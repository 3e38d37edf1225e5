//! Log lines in FreeToken's format (REFERENCES 4.11), so existing log readers keep working:
//!
//! ```text
//! [2026-04-01|12:34:56|pid=4242|core|rank=0] INFO     API server is ready to serve on 127.0.0.1:1919
//! ```
//!
//! Level names are Python's (`WARNING`), padded to 8 like `%(levelname)-8s`; time is local.

use std::fmt;
use std::sync::OnceLock;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The FreeToken line prefix formatter.
#[derive(Clone, Debug, Default)]
pub struct FreeTokenFormat;

impl<S, N> FormatEvent<S, N> for FreeTokenFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        write!(writer, "{} ", line_prefix(*event.metadata().level()))?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// `[YYYY-MM-DD|HH:MM:SS|pid=N|core|rank=0] LEVEL   ` (without the message).
pub fn line_prefix(level: Level) -> String {
    let name = match level {
        Level::ERROR => "ERROR",
        Level::WARN => "WARNING",
        Level::INFO => "INFO",
        Level::DEBUG => "DEBUG",
        Level::TRACE => "TRACE",
    };
    format!("[{}|pid={}|core|rank=0] {:<8}", local_timestamp(), std::process::id(), name)
}

/// `YYYY-MM-DD|HH:MM:SS` in local time.
fn local_timestamp() -> String {
    // SAFETY: `localtime_r` writes only into the `tm` we own.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return "0000-00-00|00:00:00".into();
        }
        format!(
            "{:04}-{:02}-{:02}|{:02}:{:02}:{:02}",
            tm.tm_year + 1900,
            tm.tm_mon + 1,
            tm.tm_mday,
            tm.tm_hour,
            tm.tm_min,
            tm.tm_sec
        )
    }
}

/// Installs the global subscriber at `level` (`trace|debug|info|warning|warn|error`, or any `tracing`
/// filter directive; `RUST_LOG` wins when set). Later calls do nothing.
pub fn init_logging(level: &str) {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        let level = match level.to_ascii_lowercase().as_str() {
            "warning" => "warn".to_string(),
            "critical" | "fatal" => "error".to_string(),
            other => other.to_string(),
        };
        let filter = EnvFilter::try_from_default_env()
            .or_else(|_| EnvFilter::try_new(&level))
            .unwrap_or_else(|_| EnvFilter::new("info"));
        // Another subscriber may already be installed (tests, embedding): keep it.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .event_format(FreeTokenFormat)
            .with_writer(std::io::stderr)
            .try_init();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_shape() {
        let p = line_prefix(Level::INFO);
        // [YYYY-MM-DD|HH:MM:SS|pid=N|core|rank=0] INFO_____
        assert!(p.starts_with('['));
        assert_eq!(&p[5..6], "-");
        assert_eq!(&p[11..12], "|");
        assert!(p.contains(&format!("|pid={}|core|rank=0] ", std::process::id())));
        assert!(p.ends_with("] INFO    "));
        assert!(line_prefix(Level::WARN).ends_with("] WARNING "));
        init_logging("debug");
        init_logging("info"); // idempotent
        tracing::info!("logging works");
    }
}
