//! The `zhihui` binary: parse the command line, load settings, hand over to [`zhihui::cli`].

use clap::Parser;

fn main() -> std::process::ExitCode {
    zhihui::platform::allocator::tune();
    let cli = zhihui::cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => return fail(&anyhow::Error::new(error).context("starting the runtime")),
    };
    match runtime.block_on(Box::pin(zhihui::cli::run(cli))) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => fail(&error),
    }
}

fn fail(error: &anyhow::Error) -> std::process::ExitCode {
    // Tracing may not be set up yet (bad settings), so print the whole chain directly.
    #[allow(clippy::print_stderr)]
    {
        eprintln!("error: {error:#}");
    }
    std::process::ExitCode::FAILURE
}
