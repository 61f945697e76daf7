//! A minimal stderr logger: `UDM_LOG=error|warn|info|debug|trace` (default info).

use log::{Level, LevelFilter, Log, Metadata, Record};

struct StderrLogger(LevelFilter);

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= self.0
    }

    fn log(&self, record: &Record) {
        if self.enabled(record.metadata()) {
            let level = match record.level() {
                Level::Error => "error",
                Level::Warn => "warning",
                Level::Info => "info",
                Level::Debug => "debug",
                Level::Trace => "trace",
            };
            // One event, one line: a message that spans lines (a table, an error chain)
            // would read as several events, or as a line of no event at all.
            let message = record.args().to_string().replace('\n', "; ");
            eprintln!("udm[{}]: {level}: {message}", std::process::id());
        }
    }

    fn flush(&self) {}
}

pub fn init() {
    let level = std::env::var("UDM_LOG")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(LevelFilter::Info);
    let _ = log::set_boxed_logger(Box::new(StderrLogger(level)));
    log::set_max_level(level);
}
