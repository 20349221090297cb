//! Prometheus metrics. Code records through the `metrics` facade; the Prometheus exporter's
//! recorder, installed once per process, renders them at `GET /metrics` (`http::metrics`, which
//! also reads, at scrape time, what is a truth of the shared stores rather than of this process:
//! tasks by status, queue depth, points frozen, projection lag). Every name carries its
//! unit (`_seconds`, `_total` for counters); label values are bounded (route templates, backend
//! names from the configuration, catalog models, fixed kinds), never ids.
//!
//! Every metric is described here ([`METRICS`]: the `# HELP` line a Prometheus shows) in the
//! words of README.md's "Metrics" table (a test keeps the two the same). Counters and
//! histograms whose label values are known start at zero ([`start_at_zero`],
//! [`start_backend_at_zero`]), so `rate()` and `increase()` work from the first scrape.
//!
//! The gauges read from the shared stores are the same on every instance: a query aggregates
//! them with `max`, never `sum` (README, the dashboard).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Histogram buckets of durations, 1 ms to 10 min: HTTP answers and appends sit at the bottom,
/// tasks (seconds to minutes on a GPU) at the top.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

/// What kind of metric a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric: its name, kind, labels and meaning (README's table, word for word).
#[derive(Debug, Clone, Copy)]
pub struct Described {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

const fn described(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Described {
    Described {
        name,
        kind,
        labels,
        help,
    }
}

/// Every metric zhihui exports.
pub const METRICS: &[Described] = &[
    described(
        "zhihui_tasks",
        Kind::Gauge,
        &["status"],
        "tasks in the read model by status (every status, zero included)",
    ),
    described(
        "zhihui_queue_depth",
        Kind::Gauge,
        &[],
        "tasks waiting in the Redis queue",
    ),
    described(
        "zhihui_points_frozen",
        Kind::Gauge,
        &[],
        "points held by tasks not yet settled, over all accounts",
    ),
    described(
        "zhihui_gallery_works_reported",
        Kind::Gauge,
        &[],
        "works with reports no admin has handled yet",
    ),
    described(
        "zhihui_projection_lag_events",
        Kind::Gauge,
        &["projection"],
        "committed events the projection reads and has not applied (PostgreSQL event store)",
    ),
    described(
        "zhihui_projection_lag_seconds",
        Kind::Gauge,
        &["projection"],
        "age of the oldest committed event the projection has not applied (0 when caught up)",
    ),
    described(
        "zhihui_http_requests_total",
        Kind::Counter,
        &["method", "route", "status"],
        "requests answered",
    ),
    described(
        "zhihui_http_request_duration_seconds",
        Kind::Histogram,
        &["method", "route", "status"],
        "time to answer",
    ),
    described(
        "zhihui_event_store_append_duration_seconds",
        Kind::Histogram,
        &["store", "result"],
        "one append (`ok`, `wrong_expected_version`, `error`)",
    ),
    described(
        "zhihui_dispatch_gap_seconds",
        Kind::Histogram,
        &["staged"],
        "a GPU slot idle between one prompt's end and the next prompt's post (dispatcher leader)",
    ),
    described(
        "zhihui_task_duration_seconds",
        Kind::Histogram,
        &["backend", "model", "outcome"],
        "a task's time on its server, from its start to its end",
    ),
    described(
        "zhihui_backend_up",
        Kind::Gauge,
        &["backend"],
        "1 while the leader's socket to the server is open",
    ),
    described(
        "zhihui_backend_busy",
        Kind::Gauge,
        &["backend"],
        "prompts in flight there (leader)",
    ),
    described(
        "zhihui_backend_capacity",
        Kind::Gauge,
        &["backend"],
        "prompts it may hold at once",
    ),
    described(
        "zhihui_comfyui_socket_reconnects_total",
        Kind::Counter,
        &["backend"],
        "sockets opened again after the first",
    ),
    described(
        "zhihui_comfyui_errors_total",
        Kind::Counter,
        &["backend", "kind"],
        "errors of a ComfyUI server by kind: `socket_closed`, `unreachable`, `prompt_rejected`, `execution_error`, `interrupted`, `lost_prompt`, `inspect_failed`",
    ),
    described(
        "zhihui_backend_model_switches_total",
        Kind::Counter,
        &["backend"],
        "a prompt posted there for another model than the one before (a real GPU loads a checkpoint)",
    ),
    described(
        "zhihui_notifications_sent_total",
        Kind::Counter,
        &["kind"],
        "task notices published to their owners",
    ),
    described(
        "zhihui_gallery_cache_loads_total",
        Kind::Counter,
        &[],
        "gallery reads from PostgreSQL because no cache had them: works, creators' names (a visitor's page in the steady state makes none)",
    ),
    described(
        "zhihui_gallery_inbox_pushes_total",
        Kind::Counter,
        &[],
        "new works pushed into followers' inboxes (gallery worker leader)",
    ),
    described(
        "zhihui_postgres_fenced_total",
        Kind::Counter,
        &[],
        "connections refused to a PostgreSQL primary on an old timeline (an old primary started again after a failover)",
    ),
    described(
        "zhihui_settlement_repairs_total",
        Kind::Counter,
        &["kind"],
        "repairs made by the settlement reconciler",
    ),
];

/// The gauges read from the shared stores at each scrape: the same on every instance.
pub const SHARED_GAUGES: &[&str] = &[
    "zhihui_tasks",
    "zhihui_queue_depth",
    "zhihui_points_frozen",
    "zhihui_gallery_works_reported",
    "zhihui_projection_lag_events",
    "zhihui_projection_lag_seconds",
];

/// `zhihui_comfyui_errors_total`'s kinds.
pub const COMFYUI_ERROR_KINDS: &[&str] = &[
    "socket_closed",
    "unreachable",
    "prompt_rejected",
    "execution_error",
    "interrupted",
    "lost_prompt",
    "inspect_failed",
];

/// `zhihui_task_duration_seconds`'s outcomes.
pub const TASK_OUTCOMES: &[&str] = &[
    "succeeded",
    "failed",
    "cancelled",
    "timed_out",
    "interrupted",
    "lost",
];

/// The help text as the exporter writes it: the shared gauges say how to aggregate them.
fn help_of(metric: &Described) -> String {
    if SHARED_GAUGES.contains(&metric.name) {
        format!(
            "{}; read from the shared stores, the same on every instance: aggregate with max, not sum",
            metric.help
        )
    } else {
        metric.help.to_owned()
    }
}

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The process's recorder, installed on first use. Tests start many apps in one process: they
/// share it, as every part of one `zhihui serve` does.
pub fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .unwrap_or_else(|error| unreachable!("the buckets are not empty: {error}"))
            .build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("a metrics recorder was already installed: /metrics will be empty");
        }
        for metric in METRICS {
            let help = help_of(metric);
            match metric.kind {
                Kind::Counter => metrics::describe_counter!(metric.name, help),
                Kind::Gauge => metrics::describe_gauge!(metric.name, help),
                Kind::Histogram => metrics::describe_histogram!(metric.name, help),
            }
        }
        handle
    })
}

/// The process's counters and histograms whose label values are all known, at zero.
/// `repair_kinds`: every kind of repair the settlement reconciler records.
pub fn start_at_zero(store_kind: &'static str, repair_kinds: &[&'static str]) {
    for kind in repair_kinds {
        metrics::counter!("zhihui_settlement_repairs_total", "kind" => *kind).increment(0);
    }
    metrics::counter!("zhihui_gallery_cache_loads_total").increment(0);
    metrics::counter!("zhihui_gallery_inbox_pushes_total").increment(0);
    metrics::counter!("zhihui_postgres_fenced_total").increment(0);
    for kind in crate::platform::notify::TaskNotice::KINDS {
        metrics::counter!("zhihui_notifications_sent_total", "kind" => *kind).increment(0);
    }
    // Recorded by whichever process leads the dispatcher: every process has the series.
    for staged in ["true", "false"] {
        drop(metrics::histogram!("zhihui_dispatch_gap_seconds", "staged" => staged));
    }
    for result in ["ok", "wrong_expected_version", "error"] {
        // A histogram is registered by asking for it: it shows with a count of 0.
        drop(metrics::histogram!(
            "zhihui_event_store_append_duration_seconds",
            "store" => store_kind,
            "result" => result
        ));
    }
}

/// A server the dispatcher leader follows: its counters and histograms at zero.
pub fn start_backend_at_zero(backend: &str, models: &[String]) {
    let backend = backend.to_owned();
    metrics::counter!("zhihui_backend_model_switches_total", "backend" => backend.clone())
        .increment(0);
    metrics::counter!("zhihui_comfyui_socket_reconnects_total", "backend" => backend.clone())
        .increment(0);
    for kind in COMFYUI_ERROR_KINDS {
        metrics::counter!("zhihui_comfyui_errors_total", "backend" => backend.clone(), "kind" => *kind)
            .increment(0);
    }
    for model in models {
        for outcome in TASK_OUTCOMES {
            drop(metrics::histogram!(
                "zhihui_task_duration_seconds",
                "backend" => backend.clone(),
                "model" => model.clone(),
                "outcome" => *outcome
            ));
        }
    }
}
