//! Fault injection: slow steps with a mid-run interrupt, a failing node class, silent sockets,
//! and crash/restart (connection refused, abnormal WebSocket close, state lost).

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use comfyui_sim::Faults;
use common::Ended;
use serde_json::{Value, json};

fn sampler_prompt(steps: u64, prefix: &str) -> Value {
    json!({
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd_xl_base_1.0.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "x", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"seed": 7, "steps": steps, "cfg": 7.5, "sampler_name": "euler",
              "scheduler": "normal", "denoise": 1.0, "model": ["4", 0], "positive": ["6", 0], "negative": ["6", 0], "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}}
    })
}

async fn post(http: &reqwest::Client, base: &str, body: Value) -> Value {
    http.post(format!("{base}/prompt"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn is_done(f: &Value) -> bool {
    f["type"] == "executing" && f["data"]["node"].is_null()
}

#[tokio::test]
async fn step_delay_then_interrupt() {
    let sim = common::start(Faults {
        step_delay_ms: 100,
        ..Faults::default()
    })
    .await;
    let (base, http) = (sim.base_url(), common::http());
    let ws = common::Ws::connect(&common::ws_url(&base, Some("c")))
        .await
        .unwrap();
    let id = post(
        &http,
        &base,
        json!({"prompt": sampler_prompt(100, "slow"), "client_id": "c"}),
    )
    .await["prompt_id"]
        .clone();
    ws.wait_for("a progress tick", |f| f["type"] == "progress")
        .await;
    let resp = http
        .post(format!("{base}/interrupt"))
        .json(&json!({"prompt_id": id}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let frames = ws.wait_for("executing(null)", is_done).await;
    let interrupted = frames
        .iter()
        .find(|f| f["type"] == "execution_interrupted")
        .expect("interrupted");
    assert_eq!(interrupted["data"]["node_type"], "KSampler");
    let ticks = frames.iter().filter(|f| f["type"] == "progress").count();
    assert!(ticks < 10, "the step sleep is cut short: {ticks} ticks");
    assert!(!frames.iter().any(|f| f["type"] == "execution_success"));
    let history: Value = http
        .get(format!("{base}/history/{}", id.as_str().unwrap()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let status = &history[id.as_str().unwrap()]["status"];
    assert_eq!(
        (status["status_str"].as_str(), status["completed"].as_bool()),
        (Some("error"), Some(false))
    );
    sim.stop().await;
}

#[tokio::test]
async fn fail_node_class() {
    let sim = common::start(Faults {
        fail_node_class: Some("KSampler".into()),
        ..Faults::default()
    })
    .await;
    let (base, http) = (sim.base_url(), common::http());
    let ws = common::Ws::connect(&common::ws_url(&base, Some("c")))
        .await
        .unwrap();
    let id = post(
        &http,
        &base,
        json!({"prompt": sampler_prompt(3, "fail"), "client_id": "c"}),
    )
    .await["prompt_id"]
        .clone();
    let frames = ws.wait_for("executing(null)", is_done).await;
    let error = frames
        .iter()
        .find(|f| f["type"] == "execution_error")
        .expect("execution_error");
    assert_eq!(error["data"]["node_type"], "KSampler");
    assert_eq!(error["data"]["exception_type"], "RuntimeError");
    for key in [
        "prompt_id",
        "node_id",
        "executed",
        "exception_message",
        "traceback",
        "current_inputs",
        "current_outputs",
        "timestamp",
    ] {
        assert!(
            error["data"].get(key).is_some(),
            "execution_error has {key}"
        );
    }
    assert_eq!(common::types(&frames)[frames.len() - 2], "status");
    let history: Value = http
        .get(format!("{base}/history/{}", id.as_str().unwrap()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        history[id.as_str().unwrap()]["status"]["status_str"],
        "error"
    );
    // Faults switch at run time; without the fault the same graph succeeds.
    sim.set_faults(Faults::default());
    assert_eq!(sim.faults().fail_node_class, None);
    post(
        &http,
        &base,
        json!({"prompt": sampler_prompt(3, "fail"), "client_id": "c"}),
    )
    .await;
    ws.wait_for("success", |f| f["type"] == "execution_success")
        .await;
    sim.stop().await;
}

#[tokio::test]
async fn silent_sockets() {
    let sim = common::start(Faults {
        silent: true,
        ..Faults::default()
    })
    .await;
    let (base, http) = (sim.base_url(), common::http());
    let ws = common::Ws::connect(&common::ws_url(&base, Some("c")))
        .await
        .unwrap();
    ws.ping();
    let id = post(
        &http,
        &base,
        json!({"prompt": sampler_prompt(2, "silent"), "client_id": "c"}),
    )
    .await["prompt_id"]
        .clone();
    // HTTP still works and the prompt completes; the socket hears nothing, not even a pong.
    for _ in 0..300 {
        let h: Value = http
            .get(format!("{base}/history/{}", id.as_str().unwrap()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if h.get(id.as_str().unwrap()).is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        ws.snapshot().is_empty(),
        "silent socket got {:?}",
        common::types(&ws.snapshot())
    );
    assert_eq!(*ws.pongs.lock().unwrap(), 0);
    assert_eq!(ws.ended(), Ended::Open);
    // HTTP fault control works too (not a ComfyUI route).
    let faults: Value = http
        .get(format!("{base}/sim/faults"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(faults["silent"], true);
    http.post(format!("{base}/sim/faults"))
        .json(&json!({"silent": false}))
        .send()
        .await
        .unwrap();
    ws.ping();
    for _ in 0..200 {
        if *ws.pongs.lock().unwrap() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        *ws.pongs.lock().unwrap(),
        1,
        "pongs resume when the fault is lifted"
    );
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_and_restart_multi_thread() {
    crash_and_restart().await;
}

#[tokio::test]
async fn crash_and_restart_current_thread() {
    crash_and_restart().await;
}

async fn crash_and_restart() {
    let sim = common::start(Faults {
        step_delay_ms: 50,
        ..Faults::default()
    })
    .await;
    let (base, http) = (sim.base_url(), common::http());
    let ws = common::Ws::connect(&common::ws_url(&base, Some("c")))
        .await
        .unwrap();
    let running = post(
        &http,
        &base,
        json!({"prompt": sampler_prompt(200, "crash"), "client_id": "c"}),
    )
    .await["prompt_id"]
        .clone();
    let pending = post(
        &http,
        &base,
        json!({"prompt": sampler_prompt(2, "crash2"), "client_id": "c"}),
    )
    .await;
    assert_eq!(pending["number"], 1);
    ws.wait_for("a progress tick", |f| f["type"] == "progress")
        .await;

    sim.crash().await;
    for _ in 0..200 {
        if ws.ended() != Ended::Open {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ws.ended(), Ended::Abnormal, "no close frame on a crash");
    let err = http
        .get(format!("{base}/queue"))
        .send()
        .await
        .expect_err("refused while down");
    assert!(err.is_connect(), "{err:?}");
    assert!(
        common::Ws::connect(&common::ws_url(&base, Some("c")))
            .await
            .is_err()
    );

    sim.restart().await;
    assert_eq!(sim.base_url(), base);
    let queue: Value = http
        .get(format!("{base}/queue"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(queue, json!({"queue_running": [], "queue_pending": []}));
    for id in [
        running.as_str().unwrap(),
        pending["prompt_id"].as_str().unwrap(),
    ] {
        let h: Value = http
            .get(format!("{base}/history/{id}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(h, json!({}));
    }
    let ws = common::Ws::connect(&common::ws_url(&base, Some("c")))
        .await
        .unwrap();
    let first = ws.wait_for("status", |f| f["type"] == "status").await;
    assert_eq!(
        first[0]["data"]["status"]["exec_info"]["queue_remaining"],
        0
    );
    let again = post(
        &http,
        &base,
        json!({"prompt": sampler_prompt(2, "after"), "client_id": "c"}),
    )
    .await;
    assert_eq!(again["number"], 0, "the counter restarts at 0");
    ws.wait_for("done", is_done).await;
    assert_eq!(sim.prompts_received(), 3);
    sim.stop().await;
}

/// A ComfyUI starting up answers HTTP before it serves its socket: with a start delay (or
/// `refuse_sockets`) `/queue` answers while `/ws` is refused, after a restart too; the socket
/// opens once the delay is over or the fault is cleared.
#[tokio::test]
async fn http_answers_before_the_socket_after_a_start_or_a_restart() {
    let faults = Faults {
        socket_start_delay_ms: 60_000,
        ..Faults::default()
    };
    let sim = common::start(faults).await;
    let (base, http) = (sim.base_url(), common::http());
    for round in 0..2 {
        let queue = http.get(format!("{base}/queue")).send().await.unwrap();
        assert_eq!(queue.status(), 200, "round {round}");
        assert!(
            common::Ws::connect(&common::ws_url(&base, Some("c")))
                .await
                .is_err(),
            "round {round}: the socket opened during the start delay"
        );
        sim.crash().await;
        sim.restart().await;
    }
    sim.set_faults(Faults {
        refuse_sockets: true,
        ..Faults::default()
    });
    assert!(
        common::Ws::connect(&common::ws_url(&base, Some("c")))
            .await
            .is_err()
    );
    sim.set_faults(Faults::default());
    common::Ws::connect(&common::ws_url(&base, Some("c")))
        .await
        .unwrap();
}
