//! `edl-runtime`: an elastic training job, its workers, teachers and plugin tools.

use std::process::ExitCode;

mod cli;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not a pipe or a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .without_time()
        .init();
    match cli::run(cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", edl_runtime::error_line(&e));
            // A setting refused before anything started: as clap's refusals.
            match e.chain().any(|c| c.is::<edl_runtime::job::config::Refused>()) {
                true => ExitCode::from(2),
                false => ExitCode::FAILURE,
            }
        }
    }
}
