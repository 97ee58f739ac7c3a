//! `zrun`: see `zrun --help`. All the work is in the library; this only reports.

use std::process::ExitCode;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ZRUN_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match zrun::run() {
        Ok(code) => code,
        Err(e) => {
            zrun::shout!("zrun: error: {e:#}");
            ExitCode::from(zrun::exit_code_of(&e))
        }
    }
}
