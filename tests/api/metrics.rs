//! `GET /metrics` of a real `zhihui serve` process (its own recorder, as in production) while
//! tasks run on a ComfyUI simulator: the exposition parses, and the key series exist with the
//! values the run implies.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use comfyui_sim::{Faults, SimConfig, Simulator};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::helpers::spawn_app;
use crate::processes::{funded_user_via, serve};

/// Longest a wait may take (a hang, not a slow machine).
const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// The exposition's samples by series (`name{labels}` as written), checking every line's form.
fn parse(exposition: &str) -> HashMap<String, f64> {
    let mut samples = HashMap::new();
    for line in exposition.lines() {
        if line.is_empty() || line.starts_with('#') {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let kind = rest.split_whitespace().nth(1).unwrap();
                assert!(
                    ["counter", "gauge", "histogram", "summary"].contains(&kind),
                    "{line}"
                );
            }
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
        assert!(name.starts_with("zhihui_"), "{line}");
        samples.insert(series.to_owned(), value.parse::<f64>().unwrap());
    }
    samples
}

fn value(samples: &HashMap<String, f64>, series: &str) -> f64 {
    *samples
        .get(series)
        .unwrap_or_else(|| panic!("no series {series}"))
}

/// A scratch directory and a simulator in it offering the catalog's first model.
pub(crate) async fn one_model_sim() -> (std::path::PathBuf, Simulator) {
    let directory = std::env::temp_dir().join(format!("zhihui-metrics-{}", Uuid::now_v7()));
    let sim = Simulator::start(SimConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        output_dir: directory.join("sim"),
        models: vec!["majicmixRealistic_v7.safetensors".into()],
        faults: Faults::default(),
    })
    .await
    .unwrap();
    (directory, sim)
}

#[tokio::test]
async fn metrics_parse_and_follow_tasks_through_a_real_process() {
    let app = spawn_app().await;
    let (directory, sim) = one_model_sim().await;
    let server = serve(
        &app,
        &format!("gpu-a {} 2", sim.base_url()),
        &directory.join("images"),
    )
    .await;
    let http = reqwest::Client::new();
    let url = |path: &str| format!("{}{path}", server.address);
    let (_, token) = funded_user_via(&app, &http, &server.address, "watcher", "10").await;

    // The leader publishes its servers' gauges each tick once it leads (after it read the pool).
    let started = tokio::time::Instant::now();
    let before = loop {
        let samples = parse(
            &http
                .get(url("/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap(),
        );
        if samples.contains_key("zhihui_backend_capacity{backend=\"gpu-a\"}") {
            break samples;
        }
        assert!(
            started.elapsed() < WAIT_LIMIT,
            "no leader ever published its servers"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(value(&before, "zhihui_tasks{status=\"succeeded\"}"), 0.0);
    // Counters and histograms of known labels are there at zero before anything happened, so
    // `rate()` works from the first scrape.
    for series in [
        "zhihui_backend_model_switches_total{backend=\"gpu-a\"}",
        "zhihui_comfyui_socket_reconnects_total{backend=\"gpu-a\"}",
        "zhihui_comfyui_errors_total{backend=\"gpu-a\",kind=\"lost_prompt\"}",
        "zhihui_dispatch_gap_seconds_count{staged=\"true\"}",
        "zhihui_dispatch_gap_seconds_count{staged=\"false\"}",
        "zhihui_settlement_repairs_total{kind=\"hold_released\"}",
        "zhihui_notifications_sent_total{kind=\"cancelled\"}",
        "zhihui_event_store_append_duration_seconds_count{store=\"postgres\",result=\"error\"}",
    ] {
        assert_eq!(value(&before, series), 0.0, "{series}");
    }
    assert_eq!(
        value(
            &before,
            "zhihui_task_duration_seconds_count{backend=\"gpu-a\",model=\"majicmixRealistic_v7.safetensors\",outcome=\"failed\"}"
        ),
        0.0
    );
    assert_eq!(
        value(&before, "zhihui_backend_capacity{backend=\"gpu-a\"}"),
        2.0
    );

    let mut tasks = Vec::new();
    for _ in 0..3 {
        let submitted = http
            .post(url("/api/v1/tasks"))
            .bearer_auth(&token)
            .json(&json!({"prompt": "a lighthouse", "steps": 5}))
            .send()
            .await
            .unwrap();
        assert_eq!(submitted.status(), 201);
        let submitted: Value = submitted.json().await.unwrap();
        tasks.push(submitted["task_id"].as_str().unwrap().to_owned());
    }
    // Until the read model counts all three as succeeded and their holds as settled (each
    // charge is recorded after its task's end, and its projection may trail: bounded).
    let started = tokio::time::Instant::now();
    let samples = loop {
        let response = http.get(url("/metrics")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain; version=0.0.4")
        );
        let samples = parse(&response.text().await.unwrap());
        if samples.get("zhihui_tasks{status=\"succeeded\"}") == Some(&3.0)
            && samples.get("zhihui_points_frozen") == Some(&0.0)
        {
            break samples;
        }
        assert!(
            started.elapsed() < WAIT_LIMIT,
            "tasks never succeeded and settled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Everything settled: nothing queued, nothing frozen.
    assert_eq!(value(&samples, "zhihui_queue_depth"), 0.0);
    assert_eq!(value(&samples, "zhihui_points_frozen"), 0.0);
    assert_eq!(value(&samples, "zhihui_tasks{status=\"failed\"}"), 0.0);
    assert_eq!(value(&samples, "zhihui_backend_up{backend=\"gpu-a\"}"), 1.0);
    // Route templates, never ids.
    assert_eq!(
        value(
            &samples,
            "zhihui_http_requests_total{method=\"POST\",route=\"/api/v1/tasks\",status=\"201\"}"
        ),
        3.0
    );
    assert!(samples.keys().all(|series| !series.contains(&tasks[0])));
    assert!(
        value(
            &samples,
            "zhihui_http_request_duration_seconds_count{method=\"POST\",route=\"/api/v1/tasks\",status=\"201\"}"
        ) == 3.0
    );
    let model = "majicmixRealistic_v7.safetensors";
    assert_eq!(
        value(
            &samples,
            &format!(
                "zhihui_task_duration_seconds_count{{backend=\"gpu-a\",model=\"{model}\",outcome=\"succeeded\"}}"
            )
        ),
        3.0
    );
    let run_time = value(
        &samples,
        &format!(
            "zhihui_task_duration_seconds_sum{{backend=\"gpu-a\",model=\"{model}\",outcome=\"succeeded\"}}"
        ),
    );
    assert!(run_time > 0.0 && run_time < 60.0, "{run_time}");
    assert!(
        value(
            &samples,
            "zhihui_notifications_sent_total{kind=\"succeeded\"}"
        ) == 3.0
    );
    let appends = value(
        &samples,
        "zhihui_event_store_append_duration_seconds_count{store=\"postgres\",result=\"ok\"}",
    );
    // At least submitted + queued + dispatched + started + succeeded per task, and the money.
    assert!(appends >= 15.0, "{appends}");
    // The buckets are cumulative and end at +Inf with the count.
    let inf = value(
        &samples,
        "zhihui_event_store_append_duration_seconds_bucket{store=\"postgres\",result=\"ok\",le=\"+Inf\"}",
    );
    assert_eq!(inf, appends);
    for projection in ["ledger", "tasks", "users"] {
        let lag = value(
            &samples,
            &format!("zhihui_projection_lag_events{{projection=\"{projection}\"}}"),
        );
        assert!(lag >= 0.0, "{projection}: {lag}");
        let seconds = value(
            &samples,
            &format!("zhihui_projection_lag_seconds{{projection=\"{projection}\"}}"),
        );
        assert!((0.0..60.0).contains(&seconds), "{projection}: {seconds}");
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&directory);
}

/// With `http.metrics_port`, `/metrics` answers there and no longer beside the API: the API can
/// face users while the metrics stay internal.
#[tokio::test]
async fn metrics_on_a_port_of_their_own_leave_the_api_port() {
    let port = crate::helpers::free_port();
    let app = crate::helpers::spawn_app_with(move |settings| {
        settings.http.metrics_port = Some(port);
    })
    .await;
    let on_api = app.get("/metrics").await;
    assert_eq!(on_api.status(), 404);
    let scraped = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap();
    assert_eq!(scraped.status(), 200);
    let samples = parse(&scraped.text().await.unwrap());
    assert_eq!(value(&samples, "zhihui_queue_depth"), 0.0);
    // Nothing else is served there.
    let other = reqwest::get(format!("http://127.0.0.1:{port}/api/v1/account"))
        .await
        .unwrap();
    assert_eq!(other.status(), 404);
}

/// `promtool check metrics` (Prometheus's own linter) on an exposition: it must find nothing.
fn promtool_finds_nothing(exposition: &str) {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool runs (Debian's prometheus package; scripts/test.sh installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success() && said.trim().is_empty(),
        "promtool: {said}"
    );
}

/// A real Prometheus on loopback.
struct Prometheus {
    child: std::process::Child,
    address: String,
    _directory: crate::dispatch::TempDirectory,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

impl Prometheus {
    /// Scrape `targets` (host:port) every second.
    async fn start(targets: &[String]) -> Prometheus {
        let directory = std::env::temp_dir().join(format!("zhihui-prometheus-{}", Uuid::now_v7()));
        std::fs::create_dir_all(&directory).unwrap();
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: zhihui\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        );
        let config_file = directory.join("prometheus.yml");
        std::fs::write(&config_file, config).unwrap();
        let port = crate::helpers::free_port();
        let address = format!("127.0.0.1:{port}");
        let child = std::process::Command::new("prometheus")
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                directory.join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("prometheus runs (Debian's prometheus package; scripts/test.sh installs it)");
        let prometheus = Prometheus {
            child,
            address: format!("http://{address}"),
            _directory: crate::dispatch::TempDirectory(directory),
        };
        let started = tokio::time::Instant::now();
        loop {
            if let Ok(response) = reqwest::get(format!("{}/-/ready", prometheus.address)).await
                && response.status() == 200
            {
                return prometheus;
            }
            assert!(started.elapsed() < WAIT_LIMIT, "prometheus never got ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// An instant query's vector: each sample's labels (as `k=v,...`, sorted) and value.
    async fn query(&self, expression: &str) -> Vec<(String, f64)> {
        let answer: Value = reqwest::Client::new()
            .get(format!("{}/api/v1/query", self.address))
            .query(&[("query", expression)])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(answer["status"], "success", "{expression}: {answer}");
        let mut samples: Vec<(String, f64)> = answer["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|sample| {
                let mut labels: Vec<String> = sample["metric"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(name, value)| format!("{name}={}", value.as_str().unwrap()))
                    .collect();
                labels.sort();
                let value: f64 = sample["value"][1].as_str().unwrap().parse().unwrap();
                (labels.join(","), value)
            })
            .collect();
        samples.sort_by(|a, b| a.0.cmp(&b.0));
        samples
    }

    /// Query until `expression` gives `expected` (scrapes come every second).
    async fn wait_for(&self, expression: &str, expected: &[(&str, f64)]) {
        let expected: Vec<(String, f64)> = expected
            .iter()
            .map(|(labels, value)| ((*labels).to_owned(), *value))
            .collect();
        let started = tokio::time::Instant::now();
        loop {
            let got = self.query(expression).await;
            if got == expected {
                return;
            }
            assert!(
                started.elapsed() < WAIT_LIMIT,
                "{expression}: {got:?}, not {expected:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A real Prometheus scrapes two `zhihui serve` processes; every query of the
/// Grafana dashboard evaluates and answers for the platform once, not once per instance (the
/// shared-store gauges are the same on both: the dashboard takes their `max`; a former leader
/// reports its servers at zero), and `promtool check metrics` finds nothing in either
/// exposition.
#[tokio::test]
async fn a_real_prometheus_reads_the_dashboard_right_over_two_instances() {
    let app = spawn_app().await;
    let (directory, sim) = one_model_sim().await;
    let backends = format!("gpu-a {} 2", sim.base_url());
    let images = directory.join("images");
    let first = serve(&app, &backends, &images).await;
    let second = serve(&app, &backends, &images).await;
    // No connection kept between requests: the Prometheus queries in between can outlast the
    // server's keep-alive, and a request sent on a connection the server is closing fails.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let (_, token) = funded_user_via(&app, &http, &first.address, "scraped", "10").await;
    let prometheus = Prometheus::start(&[
        first.address.trim_start_matches("http://").to_owned(),
        second.address.trim_start_matches("http://").to_owned(),
    ])
    .await;
    prometheus.wait_for("count(up == 1)", &[("", 2.0)]).await;

    for round in 0..3 {
        let via = if round % 2 == 0 { &first } else { &second };
        let submitted = http
            .post(format!("{}/api/v1/tasks", via.address))
            .bearer_auth(&token)
            .json(&json!({"prompt": "一座雪中的灯塔", "steps": 3}))
            .send()
            .await
            .unwrap();
        assert_eq!(submitted.status(), 201);
    }

    // The dashboard's own queries, as Grafana sends them.
    let dashboard: Value =
        serde_json::from_str(include_str!("../../docker/grafana/dashboards/zhihui.json")).unwrap();
    let expressions: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|panel| panel["targets"].as_array().unwrap().clone())
        .map(|target| target["expr"].as_str().unwrap().to_owned())
        .collect();
    let panel = |metric: &str| {
        expressions
            .iter()
            .find(|expression| expression.contains(metric))
            .unwrap_or_else(|| panic!("no panel queries {metric}"))
            .clone()
    };
    let statuses = zhihui_domain::task::TaskStatus::RECORDED;
    let mut by_status: Vec<(String, f64)> = statuses
        .iter()
        .map(|status| {
            (
                format!("status={}", status.as_str()),
                if status.as_str() == "succeeded" {
                    3.0
                } else {
                    0.0
                },
            )
        })
        .collect();
    by_status.sort_by(|a, b| a.0.cmp(&b.0));
    let by_status: Vec<(&str, f64)> = by_status.iter().map(|(l, v)| (l.as_str(), *v)).collect();
    prometheus
        .wait_for(&panel("zhihui_tasks"), &by_status)
        .await;
    prometheus
        .wait_for(&panel("zhihui_points_frozen"), &[("", 0.0)])
        .await;
    prometheus
        .wait_for(&panel("zhihui_queue_depth"), &[("", 0.0)])
        .await;
    prometheus
        .wait_for(&panel("zhihui_backend_capacity"), &[("backend=gpu-a", 2.0)])
        .await;
    prometheus
        .wait_for(&panel("zhihui_backend_up"), &[("backend=gpu-a", 1.0)])
        .await;
    prometheus
        .wait_for(&panel("zhihui_backend_busy"), &[("backend=gpu-a", 0.0)])
        .await;
    // Both instances are scraped and report the shared gauges: a plain sum counts twice.
    prometheus
        .wait_for("sum(zhihui_tasks{status=\"succeeded\"})", &[("", 6.0)])
        .await;
    // A counter that never moved is a series at zero, so its rate panel shows 0, not nothing.
    prometheus
        .wait_for(
            &panel("zhihui_backend_model_switches_total"),
            &[("backend=gpu-a", 0.0)],
        )
        .await;
    let notices = prometheus
        .query(&panel("zhihui_notifications_sent_total"))
        .await;
    assert_eq!(
        notices.len(),
        zhihui::platform::notify::TaskNotice::KINDS.len(),
        "{notices:?}"
    );
    // Every panel's query evaluates and has series to draw.
    for expression in &expressions {
        assert!(
            !prometheus.query(expression).await.is_empty(),
            "the panel query {expression} has no series"
        );
    }
    for server in [&first, &second] {
        let exposition = http
            .get(format!("{}/metrics", server.address))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        promtool_finds_nothing(&exposition);
        // Every metric there is described, in README's words.
        for metric in zhihui::platform::metrics::METRICS {
            if exposition.contains(&format!("\n{}", metric.name)) {
                assert!(
                    exposition.contains(&format!("# HELP {} {}", metric.name, metric.help)),
                    "{} has no help text",
                    metric.name
                );
            }
        }
    }
    drop((first, second));
    let _ = std::fs::remove_dir_all(&directory);
}

/// README's metrics table says what each metric is in the words its `# HELP` line uses.
#[test]
fn the_readme_table_and_the_help_texts_agree() {
    let readme = include_str!("../../README.md");
    let rows: Vec<(String, String)> = readme
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            (name.starts_with("zhihui_") && cells.len() == 6)
                .then(|| (name.to_owned(), cells[4].to_owned()))
        })
        .collect();
    let described: Vec<(String, String)> = zhihui::platform::metrics::METRICS
        .iter()
        .map(|metric| (metric.name.to_owned(), metric.help.to_owned()))
        .collect();
    assert_eq!(rows, described);
}
