//! The `zhihui` binary: parse the command line, load settings, hand over to [`zhihui::cli`].

use clap::Parser;

fn main() -> std::process::ExitCode {
    tune_allocator();
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

/// Fix glibc malloc's thresholds instead of letting it adapt them. By default glibc gives the
/// free top of each thread's heap back to the kernel once it exceeds a threshold that starts at
/// 128 KiB: under load a request's buffers (a rendered workflow, a page of events, response
/// bodies) were returned and faulted in again on every few requests (`madvise`, page faults and
/// page clearing were 8–10 % of the server's CPU under `POST /tasks`). Keeping up to 32 MiB of free
/// top per heap, and serving blocks under 4 MiB from the heaps rather than from fresh mappings,
/// cut the server's CPU per submission by about a fifth with peak resident memory unchanged
/// (BENCHMARKS.md, "Fifth pass"). An operator's own `GLIBC_TUNABLES` for malloc win.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const TRIM_THRESHOLD: libc::c_int = 32 << 20;
        const MMAP_THRESHOLD: libc::c_int = 4 << 20;
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|tunables| tunables.contains("glibc.malloc")) {
            return;
        }
        // SAFETY: `mallopt` only changes the allocator's parameters, which glibc reads under
        // its own locks; it is called here before any other thread exists. Its answer (0 when a
        // value is refused) leaves the defaults, which are correct, only slower.
        #[allow(unsafe_code)]
        unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        }
    }
}
