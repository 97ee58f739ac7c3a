//! `zworker`: started by `zrun` (or `srun`) with the job in its environment.

use std::io::Write;
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("sample") => zworker::sample::run(&args[1..]),
        // zrun asks before launching a job that needs one.
        Some("--features") => {
            println!("{}", zworker::features().join(" "));
            Ok(())
        }
        // zrun asks before launching a `device: cuda` job.
        Some("--cuda-probe") => {
            println!("{}", zworker::gpu::host_report());
            Ok(())
        }
        _ => zworker::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "zworker: {e:#}");
            ExitCode::from(1)
        }
    }
}
