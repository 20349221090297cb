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

#[tokio::test]
async fn metrics_parse_and_follow_tasks_through_a_real_process() {
    let app = spawn_app().await;
    let directory = std::env::temp_dir().join(format!("zhihui-metrics-{}", Uuid::now_v7()));
    let sim = Simulator::start(SimConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        output_dir: directory.join("sim"),
        models: vec!["majicmixRealistic_v7.safetensors".into()],
        faults: Faults::default(),
    })
    .await
    .unwrap();
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
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
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
