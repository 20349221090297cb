//! The composition root: [`Application::build`] wires settings into pools, stores and the HTTP
//! server; `main` only parses the command line and calls it. Port 0 binds a free port (tests).

use crate::state::{AppState, Overrides};

use std::net::TcpListener;
use std::time::Duration;

use actix_web::{App, HttpServer, dev::Server, web};
use anyhow::Context;

use zhihui_projections::ProjectionName;

use crate::platform::configuration::Settings;
use crate::platform::projector::Projector;

/// The checks of the settings that need a feature's own code, run by every subcommand right
/// after the settings load: the mark's text against the compiled-in font's glyphs and its height
/// ratio, the networks webhooks may reach. `Settings::load` checks everything else.
/// Every projection's live runner on `state` (each leads through its advisory lock, so on two
/// processes one applies and the other waits). Aborted, a runner drops its connections and its
/// lead with them.
pub fn spawn_projections(
    state: &AppState,
    settings: &crate::platform::configuration::ProjectionSettings,
) -> Vec<tokio::task::JoinHandle<()>> {
    ProjectionName::ALL
        .into_iter()
        .map(|projection| {
            let projector = Projector::live(
                projection,
                state.pg_pool.clone(),
                state.event_store.clone(),
                settings.clone(),
            );
            let statuses = state.projection_statuses.clone();
            tokio::spawn(async move {
                if let Err(error) = projector.run(statuses).await {
                    tracing::error!(projection = projection.as_str(), error = %crate::platform::telemetry::error_chain(&error), "projection runner stopped");
                }
            })
        })
        .collect()
}

pub fn check_settings(settings: &Settings) -> anyhow::Result<()> {
    let labels = &settings.labels;
    crate::labels::mark::Mark::new(&labels.text, labels.corner, labels.height_ratio)?;
    for network in &settings.webhooks.allowed_networks {
        crate::webhooks::safety::Network::parse(network)
            .with_context(|| format!("webhooks.allowed_networks: {network:?}"))?;
    }
    Ok(())
}

pub struct Application {
    port: u16,
    /// The metrics listener's port, when `http.metrics_port` gives it one of its own.
    metrics_port: Option<u16>,
    /// Its server (stopped with the API's).
    metrics_server: Option<Server>,
    server: Server,
    /// Projection runners of this process, stopped with the server.
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for Application {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Application")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl Application {
    /// Build everything and bind the listener; serving starts with [`Self::run_until_stopped`].
    /// Runs pending migrations first when `database.migrate_on_start` is set.
    pub async fn build(settings: &Settings) -> anyhow::Result<Application> {
        Self::build_with(settings, Overrides::default()).await
    }

    /// [`Self::build`] with a test's clock or code sender.
    pub async fn build_with(
        settings: &Settings,
        overrides: Overrides,
    ) -> anyhow::Result<Application> {
        let pg_pool = crate::platform::postgres::build_pool(&settings.database)?;
        if settings.database.migrate_on_start {
            let report = crate::platform::postgres::migrate(&pg_pool).await?;
            tracing::info!(applied = ?report.applied, "migrations up to date");
        }
        let state = web::Data::new(AppState::build(settings, pg_pool, overrides)?);
        // Installed before anything records: a counter registered at zero before the recorder
        // exists is lost (the dispatcher, on a thread of its own, follows its servers at once).
        crate::platform::metrics::handle();
        let repair_kinds: Vec<&'static str> = crate::points::settlements::RepairKind::ALL
            .iter()
            .map(|kind| kind.as_str())
            .collect();
        crate::platform::metrics::start_at_zero(state.event_store.kind(), &repair_kinds);
        let mut background = Vec::new();
        if settings.projections.enabled {
            background.extend(spawn_projections(&state, &settings.projections));
        }
        if settings.process_managers.enabled {
            let recorder = crate::points::revenue::RevenueRecorder::new(
                state.event_store.clone(),
                state.pg_pool.clone(),
                settings.projections.clone(),
            );
            background.push(tokio::spawn(async move {
                if let Err(error) = recorder.run().await {
                    tracing::error!(error = %crate::platform::telemetry::error_chain(&error), "revenue recorder stopped");
                }
            }));
            let reconciler = crate::points::settlements::SettlementReconciler::new(
                state.tasks.clone(),
                state.codes.clone(),
                state.checkins.clone(),
                state.promotions.clone(),
                state.pg_pool.clone(),
                state.clock.clone(),
            );
            background.push(tokio::spawn(reconciler.run()));
            if settings.promotions.consumer_enabled {
                // Every process consumes claims, under a name of its own (a restarted process is
                // a new consumer; its predecessor's pending claims are taken over).
                let consumer = format!("zhihui-{}", uuid::Uuid::now_v7());
                background.push(tokio::spawn(
                    state.promotions.clone().run_consumer(consumer),
                ));
            }
            if settings.webhooks.enabled {
                let deliveries = crate::webhooks::delivery::Deliveries::new(
                    state.webhooks.clone(),
                    state.event_store.clone(),
                    state.pg_pool.clone(),
                    state.clock.clone(),
                    settings.projections.batch_size,
                )?;
                background.push(tokio::spawn(deliveries.run()));
            }
            let gallery = crate::gallery::worker::GalleryWorker::new(
                state.gallery.clone(),
                settings.projections.clone(),
            );
            background.push(tokio::spawn(async move {
                if let Err(error) = gallery.run().await {
                    tracing::error!(error = %crate::platform::telemetry::error_chain(&error), "gallery worker stopped");
                }
            }));
            let issuer = crate::points::codes::issuer::CodeIssuer::new(state.codes.clone());
            background.push(tokio::spawn(issuer.run()));
            // The queue is derived: put it back from the events at start (Redis may have been
            // flushed or restarted), retrying until Redis answers; then sweep crashed requests.
            let tasks = state.tasks.clone();
            let retry = Duration::from_millis(settings.tasks.intent_sweep_interval_ms);
            background.push(tokio::spawn(async move {
                loop {
                    match tasks.rebuild_queue().await {
                        Ok(report) => {
                            tracing::info!(queued = report.queued, removed = report.removed, "task queue rebuilt from the events");
                            break;
                        }
                        Err(error) => {
                            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "task queue rebuild failed; retrying");
                            tokio::time::sleep(retry).await;
                        }
                    }
                }
                tasks.run_sweeper().await;
            }));
        }
        // Cached gallery cards are dropped here as soon as any process changes their work.
        background.push(tokio::spawn(
            state.gallery.clone().follow_changes(state.hub.clone()),
        ));
        {
            // The pool lives in its stream; the configuration seeds it once. Say at every start
            // how the configuration differs from it, so an edit is never dropped silently.
            let pool = state.dispatcher.backend_pool().clone();
            let configured = settings.dispatch.parsed_backends()?;
            background.push(tokio::spawn(async move {
                if let Err(error) = pool.warn_of_differences(&configured).await {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "could not compare dispatch.backends with the pool");
                }
            }));
        }
        if settings.dispatch.enabled {
            // Also with no server configured: admins may have added servers to the pool at run
            // time, and an empty pool costs the leader nothing but its lease.
            if settings.dispatch.backends.is_empty() {
                tracing::info!(
                    "dispatch.backends is empty: the pool is what admins add (`zhihui backends add`)"
                );
            }
            background.push(state.dispatcher.clone().spawn_run());
        }

        let address = format!("{}:{}", settings.http.host, settings.http.port);
        let listener =
            TcpListener::bind(&address).with_context(|| format!("binding http on {address}"))?;
        let port = listener
            .local_addr()
            .context("reading the bound port")?
            .port();

        // `/metrics` on a listener of its own when configured (one worker: a scrape is cheap),
        // else beside the API.
        let (metrics_port, metrics_server) = match settings.http.metrics_port {
            Some(wanted) => {
                let address = format!("{}:{wanted}", settings.http.host);
                let listener = TcpListener::bind(&address)
                    .with_context(|| format!("binding metrics on {address}"))?;
                let bound = listener
                    .local_addr()
                    .context("reading the metrics port")?
                    .port();
                let state = state.clone();
                let server = HttpServer::new(move || {
                    App::new()
                        .app_data(state.clone())
                        .route("/metrics", web::get().to(crate::http::metrics::exposition))
                })
                .workers(1)
                .disable_signals()
                .listen(listener)
                .context("listening for metrics")?
                .run();
                tracing::info!(%address, port = bound, "metrics listening");
                (Some(bound), Some(server))
            }
            None => (None, None),
        };
        let metrics_here = metrics_port.is_none();
        let pages = web::Data::new(crate::web::Web::new(settings)?);
        let pages_enabled = settings.web.enabled;
        let form_body_bytes_max = crate::web::form_body_bytes_max(&settings.tasks);
        let worker_local_connections = settings.http.worker_local_connections;
        let main_runtime = tokio::runtime::Handle::current();
        let mut server = HttpServer::new(move || {
            // actix calls this factory on each worker's thread as the worker starts: its
            // requests then take connections driven on this thread (`worker_local`).
            if worker_local_connections {
                crate::platform::worker_local::mark_http_worker(main_runtime.clone());
            }
            let app = App::new();
            let app = if metrics_here {
                app.route("/metrics", web::get().to(crate::http::metrics::exposition))
            } else {
                app
            };
            let app = app
                .app_data(pages.clone())
                .app_data(crate::http::form_config(form_body_bytes_max))
                .configure(crate::http::routes)
                .configure(|config| {
                    if pages_enabled {
                        crate::web::routes(config);
                    }
                });
            // Pages, scripts, styles and JSON compressed when the client accepts it (images are
            // marked identity and left alone); every answer with its security headers; the
            // API's problems in the client's language when it asks for one.
            app.wrap(actix_web::middleware::from_fn(
                crate::web::i18n::localise_api_problems,
            ))
            .wrap(actix_web::middleware::from_fn(
                crate::web::translate_failures,
            ))
            .wrap(actix_web::middleware::from_fn(crate::web::security_headers))
            .wrap(actix_web::middleware::Compress::default())
            .wrap(actix_web::middleware::from_fn(
                crate::http::metrics::record_http,
            ))
            .wrap(
                // The request line with secrets in its query redacted (a browser's socket
                // sends its bearer token as `?token=`).
                actix_web::middleware::Logger::new("%{request}xi %s %Dms")
                    .custom_request_replace("request", |request| {
                        crate::http::redacted_request_line(
                            request.method().as_str(),
                            request.path(),
                            request.query_string(),
                            request.version(),
                        )
                    })
                    .log_target("zhihui::http"),
            )
            .app_data(state.clone())
            .default_service(web::to(crate::web::fallback))
        })
        .shutdown_timeout(Duration::from_millis(settings.http.shutdown_timeout_ms).as_secs())
        .listen(listener)
        .context("listening")?;
        if let Some(workers) = settings.http.workers {
            server = server.workers(workers);
        }
        // actix-web stops gracefully on SIGINT and SIGTERM by itself (its `signals` feature):
        // it stops accepting, lets in-flight requests finish within `shutdown_timeout`, then returns.
        let server = server.run();
        tracing::info!(%address, port, "http listening");
        Ok(Application {
            port,
            metrics_port,
            metrics_server,
            server,
            background,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The metrics listener's port, when it has one of its own.
    pub fn metrics_port(&self) -> Option<u16> {
        self.metrics_port
    }

    /// Serve until SIGINT/SIGTERM (or until the server handle is stopped).
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        // The metrics listener ignores signals and stops with the API's server.
        let metrics = self.metrics_server.map(|server| {
            let handle = server.handle();
            (tokio::spawn(server), handle)
        });
        let served = self.server.await.context("http server failed");
        if let Some((task, handle)) = metrics {
            handle.stop(true).await;
            drop(task.await);
        }
        for task in self.background {
            task.abort();
        }
        served
    }
}
