//! Logs: human-readable by default, JSON on request; `PGHERD_LOG` overrides the level filter.

use pgherd_config::{LogFormat, ProxySettings};
use tracing_subscriber::EnvFilter;

pub fn init(settings: &ProxySettings) {
    let level = &settings.log_level;
    let filter = std::env::var("PGHERD_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new(format!("warn,pgherd={level},pgherd_proxy={level}")));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // A second init (tests, embedded use) keeps the first subscriber.
    let _ = match settings.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Human => builder.try_init(),
    };
}
