//! A zhihui-style text-to-image workflow end to end: progress, executed images, history, and
//! real PNG files served by `/view`. Also: two simulators side by side in one process.

#![allow(clippy::unwrap_used)]

mod common;

use comfyui_sim::Faults;
use serde_json::{Value, json};

fn t2i(prefix: &str, seed: u64) -> Value {
    json!({
        "3": {"class_type": "KSampler", "inputs": {"seed": seed, "steps": 4, "cfg": 7, "sampler_name": "dpmpp_2m",
              "scheduler": "karras", "denoise": 1, "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd_xl_base_1.0.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 2}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}}
    })
}

fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG magic");
    assert_eq!(&bytes[12..16], b"IHDR");
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    (w, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zhihui_workflow_end_to_end() {
    let sim = common::start(Faults::default()).await;
    let base = sim.base_url();
    let http = common::http();
    let client_id = "zhihui-test-1";
    let ws = common::Ws::connect(&common::ws_url(&base, Some(client_id)))
        .await
        .unwrap();
    let task = uuid::Uuid::new_v4().to_string();
    let prompt_id = uuid::Uuid::new_v4().to_string();
    let resp: Value = http
        .post(format!("{base}/prompt"))
        .json(&json!({"prompt": t2i(&format!("zhihui/{task}"), 42), "client_id": client_id, "prompt_id": prompt_id}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(resp["prompt_id"], prompt_id.as_str());
    assert_eq!(resp["node_errors"], json!({}));
    let frames = ws
        .wait_for("executing(null)", |f| {
            f["type"] == "executing" && f["data"]["node"].is_null()
        })
        .await;

    let progress: Vec<(u64, u64)> = frames
        .iter()
        .filter(|f| f["type"] == "progress")
        .map(|f| {
            (
                f["data"]["value"].as_u64().unwrap(),
                f["data"]["max"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(progress, vec![(1, 4), (2, 4), (3, 4), (4, 4)]);
    let executed: Vec<&Value> = frames.iter().filter(|f| f["type"] == "executed").collect();
    assert_eq!(executed.len(), 1);
    let images = executed[0]["data"]["output"]["images"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(images.len(), 2);
    // ComfyUI splits the prefix at its last '/': subfolder "zhihui", file "<task>_00001_.png".
    assert_eq!(
        images[0],
        json!({"filename": format!("{task}_00001_.png"), "subfolder": "zhihui", "type": "output"})
    );
    assert_eq!(images[1]["filename"], format!("{task}_00002_.png"));
    let types = common::types(&frames);
    let success = types.iter().position(|t| t == "execution_success").unwrap();
    assert_eq!(types.last().unwrap(), "executing");
    assert_eq!(types[success + 1], "status");

    let history: Value = http
        .get(format!("{base}/history/{prompt_id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let entry = &history[prompt_id.as_str()];
    assert_eq!(
        entry["outputs"]["9"]["images"],
        Value::Array(images.clone())
    );
    assert_eq!(entry["status"]["status_str"], "success");
    assert_eq!(entry["prompt"][4], json!(["9"]));

    let mut bodies = Vec::new();
    for image in &images {
        let resp = http
            .get(format!(
                "{base}/view?filename={}&subfolder=zhihui&type=output",
                image["filename"].as_str().unwrap()
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "image/png");
        let bytes = resp.bytes().await.unwrap();
        assert_eq!(png_size(&bytes), (512, 512));
        bodies.push(bytes);
    }
    assert_ne!(
        bodies[0], bodies[1],
        "each image of a batch has its own seed"
    );

    // An identical resubmission is fully cached and points at the old files.
    ws.frames.lock().unwrap().clear();
    let again: Value = http
        .post(format!("{base}/prompt"))
        .json(&json!({"prompt": t2i(&format!("zhihui/{task}"), 42), "client_id": client_id}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let frames = ws
        .wait_for("second executing(null)", |f| {
            f["type"] == "executing" && f["data"]["node"].is_null()
        })
        .await;
    let cached = frames
        .iter()
        .find(|f| f["type"] == "execution_cached")
        .unwrap();
    assert_eq!(cached["data"]["nodes"].as_array().unwrap().len(), 7);
    assert_eq!(cached["data"]["prompt_id"], again["prompt_id"]);
    let executed = frames.iter().find(|f| f["type"] == "executed").unwrap();
    assert_eq!(executed["data"]["output"]["images"], Value::Array(images));
    assert!(!frames.iter().any(|f| f["type"] == "progress"));
    assert_eq!(sim.prompts_received(), 2);

    // A missing model is a 400 value_not_in_list, like a real server without the file.
    let mut bad = t2i("x", 1);
    bad["4"]["inputs"]["ckpt_name"] = json!("nope.safetensors");
    let resp = http
        .post(format!("{base}/api/prompt"))
        .json(&json!({"prompt": bad}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(
        body["node_errors"]["4"]["errors"][0]["type"],
        "value_not_in_list"
    );
    sim.stop().await;
}

/// Two simulators in one current-thread runtime: independent ports, state and counters.
#[tokio::test]
async fn two_simulators_in_one_process() {
    let a = common::start(Faults::default()).await;
    let b = common::start(Faults::default()).await;
    assert_ne!(a.base_url(), b.base_url());
    let http = common::http();
    let ws = common::Ws::connect(&common::ws_url(&a.base_url(), Some("c1")))
        .await
        .unwrap();
    let resp: Value = http
        .post(format!("{}/prompt", a.base_url()))
        .json(&json!({"prompt": t2i("two/a", 1), "client_id": "c1"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(resp["number"], 0);
    ws.wait_for("done", |f| {
        f["type"] == "executing" && f["data"]["node"].is_null()
    })
    .await;
    let queue: Value = http
        .get(format!("{}/prompt", b.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(queue, json!({"exec_info": {"queue_remaining": 0}}));
    let history: Value = http
        .get(format!("{}/history", b.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(history, json!({}));
    assert_eq!((a.prompts_received(), b.prompts_received()), (1, 0));
    let info: Value = http
        .get(format!("{}/object_info/KSampler", b.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let samplers = info["KSampler"]["input"]["required"]["sampler_name"][0]
        .as_array()
        .unwrap();
    assert!(samplers.contains(&json!("dpmpp_3m_sde")));
    a.stop().await;
    b.stop().await;
}
