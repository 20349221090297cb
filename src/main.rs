//! The `zhihui` binary: parse the command line, load settings, hand over to [`zhihui::cli`].

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = zhihui::cli::Cli::parse();
    match Box::pin(zhihui::cli::run(cli)).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // Tracing may not be set up yet (bad settings), so print the whole chain directly.
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {error:#}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
