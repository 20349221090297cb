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
//! on that thread ([`crate::platform::postgres::checkout`], [`crate::platform::redis_store::RedisStore::connection`]):
//! the driver task runs where the request runs.
//! Background work (projections, dispatch, process managers) runs on the main runtime and keeps
//! the shared ones. A twin is the same kind of connection to the same server with the same
//! settings, so nothing a request sees changes but the thread its I/O runs on; twins live as long
//! as their worker thread, and a twin whose original was dropped is never handed out again.
//!
//! A worker then also runs its requests' I/O, so one busy with CPU-heavy requests would delay
//! the I/O of the cheap ones beside it: a submission renders and checks a workflow and appends
//! two events (about 900 µs of CPU), and under `bench_http`'s mix that grew the tail of
//! `GET /api/v1/tasks/{id}` past its target (p99 61–70 ms beside 42–54 ms). So the task commands
//! (submit, prioritise, cancel) run on the main runtime ([`off_worker`]) with the shared
//! connections, as every request did before, and a worker keeps to the cheap requests it answers
//! on its own connections.

use std::cell::RefCell;
use std::future::Future;

use tokio::runtime::Handle;

thread_local! {
    /// On an HTTP worker's thread: the main runtime, where [`off_worker`] sends work.
    static HTTP_WORKER: RefCell<Option<Handle>> = const { RefCell::new(None) };
}

/// Marks the calling thread as an HTTP worker's (it runs one single-threaded runtime for the
/// thread's whole life, so connections opened here are driven here); `main` is the process's
/// main runtime.
pub fn mark_http_worker(main: Handle) {
    HTTP_WORKER.with(|worker| *worker.borrow_mut() = Some(main));
}

/// Whether the calling thread is an HTTP worker's.
pub fn on_http_worker() -> bool {
    HTTP_WORKER.with(|worker| worker.borrow().is_some())
}

/// Run `work` on the main runtime when called on an HTTP worker, as a task of the calling
/// thread's runtime otherwise: for CPU-heavy request work, which would otherwise hold up the
/// socket I/O of the requests its worker shares a thread with, and for a request's steps that
/// must all happen once begun. Either way the work goes on to its end even if the request is
/// dropped (past its deadline, its client gone): one that goes away mid-submit leaves no less
/// done than one that waits.
pub async fn off_worker<F, T, E>(work: F) -> Result<T, E>
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: From<anyhow::Error> + Send + 'static,
{
    let spawned = match HTTP_WORKER.with(|worker| worker.borrow().clone()) {
        Some(main) => main.spawn(work),
        None => tokio::spawn(work),
    };
    match spawned.await {
        Ok(done) => done,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => Err(anyhow::anyhow!("the main runtime is shutting down: {error}").into()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_a_marked_thread_is_a_worker() {
        let main = tokio::runtime::Runtime::new().unwrap();
        let handle = main.handle().clone();
        let marked = std::thread::spawn(move || {
            mark_http_worker(handle);
            on_http_worker()
        })
        .join()
        .unwrap();
        let unmarked = std::thread::spawn(on_http_worker).join().unwrap();
        assert!(marked);
        assert!(!unmarked);
    }

    #[test]
    fn a_worker_runs_its_offloaded_work_on_the_main_runtime_and_others_on_their_own() {
        let main = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("main-runtime")
            .enable_all()
            .build()
            .unwrap();
        // The name of the thread `off_worker`'s work ran on, called on a new thread named
        // `name` with a runtime of its own, marked as a worker's when given the main runtime.
        let work_ran_on = |name: &str, main: Option<tokio::runtime::Handle>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    if let Some(main) = main {
                        mark_http_worker(main);
                    }
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap()
                        .block_on(off_worker(async {
                            Ok::<_, anyhow::Error>(std::thread::current().name().map(str::to_owned))
                        }))
                })
                .unwrap()
                .join()
                .unwrap()
                .unwrap()
        };
        let on_worker = work_ran_on("http-worker", Some(main.handle().clone()));
        let elsewhere = work_ran_on("elsewhere", None);
        assert_eq!(on_worker.as_deref(), Some("main-runtime"));
        assert_eq!(elsewhere.as_deref(), Some("elsewhere"));
    }
}
