//! The process's allocator settings: `zhihui`'s `main` applies them first thing, and so does each
//! benchmark program that runs zhihui's code in its own process (its figures are then the
//! binary's). The workspace's one `unsafe` block.

/// Fix glibc malloc's thresholds instead of letting it adapt them. By default glibc gives the
/// free top of each thread's heap back to the kernel once it exceeds a threshold that starts at
/// 128 KiB: under load a request's buffers (a rendered workflow, a page of events, response
/// bodies) were returned and faulted in again on every few requests (`madvise`, page faults and
/// page clearing were 8–10 % of the server's CPU under `POST /tasks`). Keeping up to 32 MiB of
/// free top per heap, and serving blocks under 4 MiB from the heaps rather than from fresh
/// mappings, cut the server's CPU per submission by about a fifth with peak resident memory
/// unchanged (BENCHMARKS.md, "Fifth pass"). An operator's own `GLIBC_TUNABLES` for malloc win.
/// Does nothing elsewhere than glibc on Linux.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const TRIM_THRESHOLD: libc::c_int = 32 << 20;
        const MMAP_THRESHOLD: libc::c_int = 4 << 20;
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|tunables| tunables.contains("glibc.malloc")) {
            return;
        }
        // SAFETY: `mallopt` only changes the allocator's parameters, under glibc's own lock;
        // `zhihui`'s `main` calls it before any other thread exists, and a thread of a
        // benchmark that allocates meanwhile sees the old threshold or the new, both correct.
        // A refused value (answer 0) leaves the default, which is correct, only slower.
        #[allow(unsafe_code)]
        unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        }
    }
}
