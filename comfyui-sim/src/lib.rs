//! comfyui-sim: a faithful simulator of a ComfyUI 0.3.64 server (HTTP + WebSocket), so zhihui's
//! dispatcher can be tested against the real protocol, including its sharp edges (targeting by
//! client_id, partial validation, duplicate prompt ids, the duplicate-clientId bug, crashes that
//! lose the queue), without a GPU or model weights. Ground truth: the shared ComfyUI protocol notes and the recordings in `transcripts/`.

pub mod ojson;

mod engine;
mod nodes;
mod png;
mod server;
mod state;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use actix_web::dev::ServerHandle;
use actix_web::{App, HttpServer, web};
use anyhow::Context;
use tokio::task::JoinHandle;

use crate::engine::{Instance, Shared};
use crate::state::Outgoing;

/// How to start a simulator.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Where to listen; port 0 picks a free port (kept across crash/restart).
    pub bind: SocketAddr,
    /// ComfyUI's `--output-directory`; created if missing. Files here survive a crash.
    pub output_dir: PathBuf,
    /// The checkpoint names `CheckpointLoaderSimple.ckpt_name` accepts.
    pub models: Vec<String>,
    pub faults: Faults,
}

/// Failure injection, switchable at run time ([`Simulator::set_faults`], `POST /sim/faults`).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Faults {
    /// Sleep per sampler step / progress tick; 0 = as fast as possible.
    pub step_delay_ms: u64,
    /// Sleep when a checkpoint loader runs (its output not cached from the prompt before: a
    /// prompt of another checkpoint), as a GPU loading a model does; 0 = none.
    pub model_load_ms: u64,
    /// Raise a runtime error (`execution_error`) when a node of this class executes.
    pub fail_node_class: Option<String>,
    /// WebSockets stay open but receive nothing at all (no frames, no pongs); HTTP unaffected.
    pub silent: bool,
    /// SaveImage encodes with the fastest deflate instead of ComfyUI's level 4 (same pixels,
    /// bigger files): a benchmark's simulated GPU should not eat the CPU of what it measures.
    pub fast_png: bool,
    /// SaveImage reports one output more than it saved, outside the prefix it was given
    /// (`../../../etc/passwd`): what a compromised server could answer.
    pub hostile_outputs: bool,
    /// `/view` answers a damaged file: the PNG signature and the first quarter of the bytes
    /// (a download cut short on the server, a disk error): what a client cannot decode.
    pub corrupt_images: bool,
    /// The WebSocket endpoint answers 503 instead of upgrading while HTTP answers as usual: a
    /// ComfyUI starting up (its HTTP routes answer before its socket is served), on demand.
    pub refuse_sockets: bool,
    /// After every (re)start, refuse sockets this long (0: none), like `refuse_sockets` but
    /// timed: the order a restarted ComfyUI shows a client (HTTP first, the socket later).
    pub socket_start_delay_ms: u64,
}

/// One process lifetime of the simulated server.
struct Running {
    instance: Arc<Instance>,
    server: ServerHandle,
    server_task: JoinHandle<std::io::Result<()>>,
    worker: JoinHandle<()>,
}

/// A running simulated ComfyUI server.
pub struct Simulator {
    shared: Arc<Shared>,
    addr: SocketAddr,
    running: tokio::sync::Mutex<Option<Running>>,
    /// A per-simulator scratch directory holding `temp/` and `input/`.
    scratch: PathBuf,
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator")
            .field("addr", &self.addr)
            .field("output_dir", &self.shared.output_dir)
            .finish_non_exhaustive()
    }
}

/// A simulator dropped without `stop` (a test that ends, or panics) takes its scratch directory
/// with it too: each left one behind in the system's temporary directory.
impl Drop for Simulator {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

impl Simulator {
    /// Bind, start the HTTP/WS server and the prompt worker. Must run inside a tokio runtime.
    pub async fn start(config: SimConfig) -> anyhow::Result<Simulator> {
        std::fs::create_dir_all(&config.output_dir)
            .with_context(|| format!("creating output dir {}", config.output_dir.display()))?;
        let output_dir =
            std::fs::canonicalize(&config.output_dir).context("resolving the output dir")?;
        let scratch =
            std::env::temp_dir().join(format!("comfyui-sim-{}", uuid::Uuid::new_v4().simple()));
        let temp_dir = scratch.join("temp");
        let input_dir = scratch.join("input");
        std::fs::create_dir_all(&temp_dir).context("creating the temp dir")?;
        std::fs::create_dir_all(&input_dir).context("creating the input dir")?;
        let shared = Arc::new(Shared {
            output_dir,
            temp_dir,
            input_dir,
            catalog: nodes::Catalog::new(&config.models),
            faults: Mutex::new(config.faults),
            prompts_received: AtomicU64::new(0),
            history_lookups: AtomicU64::new(0),
            idle: std::sync::Mutex::new(engine::IdleClock::default()),
        });
        let listener =
            TcpListener::bind(config.bind).with_context(|| format!("binding {}", config.bind))?;
        let addr = listener.local_addr().context("reading the bound address")?;
        let running = launch(shared.clone(), listener)?;
        tracing::info!(%addr, "comfyui-sim listening");
        Ok(Simulator {
            shared,
            addr,
            running: tokio::sync::Mutex::new(Some(running)),
            scratch,
        })
    }

    /// `http://IP:PORT` of the server (the same across crash/restart).
    pub fn base_url(&self) -> String {
        let ip = if self.addr.ip().is_unspecified() {
            "127.0.0.1".to_owned()
        } else {
            self.addr.ip().to_string()
        };
        format!("http://{ip}:{}", self.addr.port())
    }

    pub fn set_faults(&self, faults: Faults) {
        *self.shared.faults.lock().unwrap_or_else(|e| e.into_inner()) = faults;
    }

    pub fn faults(&self) -> Faults {
        self.shared.faults()
    }

    /// Like SIGKILL: stop listening, drop every WebSocket without a close frame, forget the
    /// queue, the running prompt, history and the `number` counter. Output files stay.
    pub async fn crash(&self) {
        let Some(running) = self.running.lock().await.take() else {
            return;
        };
        tracing::info!(addr = %self.addr, "simulated crash");
        running.worker.abort();
        {
            let st = running.instance.lock();
            for tx in st.connections.values() {
                let _ = tx.send(Outgoing::Kill);
            }
        }
        running.server.stop(false).await;
        let _ = running.server_task.await;
        let _ = running.worker.await;
    }

    /// Listen again on the same port with empty state, as a restarted ComfyUI would. Temp files
    /// are wiped (ComfyUI's `cleanup_temp`). Does nothing if the simulator is running.
    pub async fn restart(&self) {
        let mut running = self.running.lock().await;
        if running.is_some() {
            return;
        }
        let _ = std::fs::remove_dir_all(&self.shared.temp_dir);
        let _ = std::fs::create_dir_all(&self.shared.temp_dir);
        // The port was just released; retry briefly in case the kernel is still letting go.
        for attempt in 0..100 {
            match TcpListener::bind(self.addr) {
                Ok(listener) => match launch(self.shared.clone(), listener) {
                    Ok(r) => {
                        *running = Some(r);
                        tracing::info!(addr = %self.addr, "simulated restart");
                        return;
                    }
                    Err(error) => tracing::error!(%error, "restart failed"),
                },
                Err(error) => {
                    if attempt == 99 {
                        tracing::error!(%error, addr = %self.addr, "restart could not bind");
                    }
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Shut down for good and remove the scratch directory (output files stay).
    pub async fn stop(self) {
        self.crash().await;
        // The scratch directory goes with `self` (Drop).
    }

    /// The GPU's idle spells so far (taken): each from a prompt's end to the start of the next
    /// (near zero when the next was waiting in the queue). The dispatcher's "idle gap", measured
    /// where it happens. Idle time before the call is not a gap: after it, the next prompt's
    /// start closes no spell.
    pub fn take_idle_gaps(&self) -> Vec<std::time::Duration> {
        let mut clock = self.shared.idle_clock();
        clock.since = None;
        std::mem::take(&mut clock.gaps)
    }

    /// Accepted `POST /prompt`s (200s) since start, across restarts.
    pub fn history_lookups(&self) -> u64 {
        self.shared
            .history_lookups
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn prompts_received(&self) -> u64 {
        self.shared.prompts_received.load(Ordering::SeqCst)
    }
}

/// Start the HTTP server and the worker for a fresh process lifetime.
fn launch(shared: Arc<Shared>, listener: TcpListener) -> anyhow::Result<Running> {
    let instance = Arc::new(Instance::new(shared));
    let data = web::Data::new(instance.clone());
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .app_data(web::PayloadConfig::new(256 * 1024 * 1024))
            .wrap(actix_web::middleware::from_fn(server::origin_check))
            .service(web::scope("/api").configure(server::routes))
            .configure(server::routes)
            .default_service(web::to(server::not_found))
    })
    .workers(2)
    .disable_signals()
    .shutdown_timeout(0)
    .listen(listener)
    .context("listening")?
    .run();
    let handle = server.handle();
    let server_task = tokio::spawn(server);
    let worker = tokio::spawn(engine::run_worker(instance.clone()));
    Ok(Running {
        instance,
        server: handle,
        server_task,
        worker,
    })
}

/// Logging for the binary: `RUST_LOG` or `info`. Libraries and tests install their own.
#[doc(hidden)]
pub fn install_default_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,actix_server=warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();
}
