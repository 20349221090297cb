//! Connections of an HTTP worker's own, driven on the worker's thread.
//!
//! actix-web runs each HTTP worker on a thread of its own (a single-threaded runtime), while a
//! PostgreSQL or Redis connection does its socket I/O in a driver task on the runtime that opened
//! it. A connection opened by the process's main runtime therefore hands every statement of a
//! request from the worker's thread to a thread of the main runtime and the answer back: two
//! wake-ups of another thread per round trip. That was a fifth of the process's CPU time on a
//! simple authenticated read (`GET /api/v1/account`), and the threads' hand-offs held its rate
//! below what the work needs (BENCHMARKS.md, "Third pass").
//!
//! So, with `http.worker_local_connections` on, a worker thread marks itself
//! ([`mark_http_worker`], from the app factory, which actix runs on each worker's thread) and the
//! request path then takes its connections from a twin of the shared pool or connection opened
//! on that thread ([`crate::postgres::checkout`], [`crate::redis_store::RedisStore::connection`]):
//! the driver task runs where the request runs.
//! Background work (projections, dispatch, process managers) runs on the main runtime and keeps
//! the shared ones. A twin is the same kind of connection to the same server with the same
//! settings, so nothing a request sees changes but the thread its I/O runs on; twins live as long
//! as their worker thread, and a twin whose original was dropped is never handed out again.
//!
//! It is off by default: a worker then also runs its requests' I/O, so one busy with CPU-heavy
//! requests (a submission renders and checks a workflow) delays the I/O of the cheap ones beside
//! it, and under such a mix their tail grew past the target of `GET /api/v1/tasks/{id}` (p99
//! 61–70 ms beside 42–54 ms, `bench_http 10 64`), while reads alone ran up to 1.5x faster.

use std::cell::Cell;

thread_local! {
    static HTTP_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as an HTTP worker's (it runs one single-threaded runtime for the
/// thread's whole life, so connections opened here are driven here).
pub fn mark_http_worker() {
    HTTP_WORKER.with(|flag| flag.set(true));
}

/// Whether the calling thread is an HTTP worker's.
pub fn on_http_worker() -> bool {
    HTTP_WORKER.with(Cell::get)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_a_marked_thread_is_a_worker() {
        let marked = std::thread::spawn(|| {
            mark_http_worker();
            on_http_worker()
        })
        .join()
        .unwrap();
        let unmarked = std::thread::spawn(on_http_worker).join().unwrap();
        assert!(marked);
        assert!(!unmarked);
    }
}
