//! Logs: human-readable by default, JSON on request, the journal's own fields when systemd
//! connects standard error to the journal; `PGHERD_LOG` overrides the level filter.

use std::os::unix::fs::MetadataExt;

use pgherd_config::{LogFormat, ProxySettings};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

pub fn init(settings: &ProxySettings) {
    let level = &settings.log_level;
    let filter = || {
        std::env::var("PGHERD_LOG")
            .ok()
            .and_then(|f| EnvFilter::try_new(f).ok())
            .unwrap_or_else(|| EnvFilter::new(format!("warn,pgherd={level},pgherd_proxy={level}")))
    };
    if stderr_is_journal() {
        // Native journal entries keep each event's level as its priority (`journalctl -p
        // warning`) and its fields as PGHERD_* fields, which a line on standard error loses.
        match tracing_journald::layer() {
            Ok(journal) => {
                let journal = journal
                    .with_field_prefix(Some("PGHERD".to_owned()))
                    .with_syslog_identifier("pgherd".to_owned());
                let _ = tracing_subscriber::registry()
                    .with(filter())
                    .with(journal)
                    .try_init();
                return;
            }
            Err(e) => {
                eprintln!("pgherd: cannot log to the journal ({e}); logging to standard error")
            }
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter())
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // A second init (tests, embedded use) keeps the first subscriber.
    let _ = match settings.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Human => builder.try_init(),
    };
}

/// systemd sets `JOURNAL_STREAM` to the device and inode of the stream it connected standard
/// error to; a child that inherited the variable but not the stream must not take it as its own.
fn stderr_is_journal() -> bool {
    let Ok(stream) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.split_once(':') else {
        return false;
    };
    let Ok(stderr) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    dev.parse() == Ok(stderr.dev()) && ino.parse() == Ok(stderr.ino())
}
