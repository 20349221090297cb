//! Conformance against the recordings of real ComfyUI 0.3.64 in comfyui-sim/transcripts:
//! replay each recording's HTTP requests (and WebSocket opens/closes, crash and restart) against
//! the simulator at the recorded pace, then compare status codes, response body shapes and every
//! socket's message-type sequence (progress runs collapsed, prompt ids mapped).

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use comfyui_sim::Faults;
use common::{Ended, Ws};
use serde_json::Value;

const TRANSCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/transcripts");

/// One line of a `.jsonl` recording.
#[derive(Debug, serde::Deserialize)]
struct Event {
    t: f64,
    who: String,
    kind: String,
    #[serde(default)]
    data: Value,
}

fn read_jsonl(name: &str) -> Option<Vec<Event>> {
    let path = Path::new(TRANSCRIPTS).join(format!("{name}.jsonl"));
    let text = std::fs::read_to_string(&path).ok()?;
    Some(
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).expect("jsonl line"))
            .collect(),
    )
}

/// What a replay learned: recorded id/filename → the simulator's.
#[derive(Default)]
struct Maps {
    ids: HashMap<String, String>,
    files: HashMap<String, String>,
}

/// Keys whose values must match exactly (after id mapping); everything else is compared by shape.
const EXACT: &[&str] = &[
    "type",
    "status_str",
    "completed",
    "class_type",
    "node_type",
    "node_id",
    "exception_type",
    "input_name",
    "message",
    "details",
    "dependent_outputs",
    "subfolder",
    "comfyui_version",
    "supports_preview_metadata",
    "max_upload_size",
    "output_node",
    "queue_remaining",
    "received_type",
];

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Compare `ours` against `rec`: same kinds, same key sets, same array lengths (tracebacks
/// aside), exact values for [`EXACT`] keys; learns id and filename mappings on the way.
fn compare(
    path: &str,
    key: &str,
    rec: &Value,
    ours: &Value,
    maps: &mut Maps,
    diffs: &mut Vec<String>,
) {
    if key == "prompt_id"
        && let (Value::String(r), Value::String(o)) = (rec, ours)
    {
        let mapped = maps.ids.entry(r.clone()).or_insert_with(|| o.clone());
        if mapped != o {
            diffs.push(format!("{path}: prompt_id {o} but {r} maps to {mapped}"));
        }
        return;
    }
    if key == "filename"
        && let (Value::String(r), Value::String(o)) = (rec, ours)
    {
        maps.files.insert(r.clone(), o.clone());
        return;
    }
    if kind(rec) != kind(ours) {
        diffs.push(format!(
            "{path}: kind {} vs ours {} ({rec} / {ours})",
            kind(rec),
            kind(ours)
        ));
        return;
    }
    match (rec, ours) {
        (Value::Object(r), Value::Object(o)) => {
            // Maps keyed by prompt id (history) are matched through the id mapping.
            let map_key = |k: &String| maps.ids.get(k).cloned().unwrap_or_else(|| k.clone());
            let mut rk: Vec<String> = r.keys().map(map_key).collect();
            let mut ok: Vec<String> = o.keys().cloned().collect();
            rk.sort();
            ok.sort();
            if rk != ok {
                // Unmapped prompt-id keys (first sight): pair them by position.
                if r.len() == o.len()
                    && r.keys().all(|k| k.len() >= 5)
                    && o.keys().all(|k| k.len() >= 5)
                    && path.ends_with("body")
                {
                    for ((rk, rv), (ok, ov)) in r.iter().zip(o.iter()) {
                        maps.ids.entry(rk.clone()).or_insert_with(|| ok.clone());
                        compare(&format!("{path}.{{id}}"), rk, rv, ov, maps, diffs);
                    }
                    return;
                }
                diffs.push(format!("{path}: keys {rk:?} vs ours {ok:?}"));
                return;
            }
            for (k, rv) in r {
                let ok_key = maps.ids.get(k).cloned().unwrap_or_else(|| k.clone());
                if let Some(ov) = o.get(&ok_key) {
                    compare(&format!("{path}.{k}"), k, rv, ov, maps, diffs);
                }
            }
        }
        (Value::Array(r), Value::Array(o)) => {
            // Tracebacks and argv describe the recording machine, not the protocol.
            if key == "traceback" || key == "argv" {
                return;
            }
            if r.len() != o.len() {
                diffs.push(format!(
                    "{path}: array length {} vs ours {}",
                    r.len(),
                    o.len()
                ));
                return;
            }
            // Validation errors come out of a Python set: compare them sorted by type.
            let sort = |a: &Vec<Value>| {
                let mut a = a.clone();
                if key == "errors" {
                    a.sort_by_key(|e| e["type"].as_str().unwrap_or_default().to_owned());
                }
                a
            };
            let exact = EXACT.contains(&key);
            for (i, (rv, ov)) in sort(r).iter().zip(sort(o).iter()).enumerate() {
                compare(
                    &format!("{path}[{i}]"),
                    if exact { key } else { "" },
                    rv,
                    ov,
                    maps,
                    diffs,
                );
            }
        }
        _ => {
            if EXACT.contains(&key) {
                let mapped = match rec {
                    Value::String(s) => {
                        Value::String(maps.ids.get(s).cloned().unwrap_or_else(|| s.clone()))
                    }
                    other => other.clone(),
                };
                if &mapped != ours {
                    diffs.push(format!("{path}: {rec} vs ours {ours}"));
                }
            }
        }
    }
}

/// A socket's message types with runs of progress/progress_state collapsed to one `PROG`.
fn sequence(frames: &[Value]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for f in frames {
        let t = f["type"].as_str().unwrap_or("?");
        let label = match t {
            "progress" | "progress_state" => "PROG".to_owned(),
            "executing" if f["data"]["node"].is_null() => "executing(null)".to_owned(),
            "executing" if f["data"].get("prompt_id").is_none() => {
                "executing(reconnect)".to_owned()
            }
            other => other.to_owned(),
        };
        if label == "PROG" && out.last().is_some_and(|l| l == "PROG") {
            continue;
        }
        out.push(label);
    }
    out
}

fn rewrite(s: &str, maps: &Maps) -> String {
    let mut s = s.to_owned();
    for (r, o) in maps.ids.iter().chain(maps.files.iter()) {
        if r != o && r.len() > 4 {
            s = s.replace(r.as_str(), o);
        }
    }
    s
}

/// Replays one recording; returns the list of differences (empty = conformant).
async fn replay(name: &str, skip_body: &[&str]) -> Vec<String> {
    let events = read_jsonl(name).unwrap_or_else(|| panic!("missing transcript {name}"));
    let sim = common::start(Faults::default()).await;
    let base = sim.base_url();
    let client = common::http();
    let mut maps = Maps::default();
    let mut diffs = Vec::new();
    let mut sockets: HashMap<String, Ws> = HashMap::new();
    let mut recorded: HashMap<String, Vec<Value>> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut pending: Option<(String, reqwest::Result<reqwest::Response>)> = None;
    let start = Instant::now();
    let mut skew = 0.0_f64;
    for ev in &events {
        // Keep the recorded pace: TestSleep runs in real time, so interrupts and reconnects
        // must land at the same point of the run.
        let due = Duration::from_secs_f64((ev.t - skew).max(0.0));
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        match ev.kind.as_str() {
            "ws_open" => {
                let url = ev.data["url"].as_str().unwrap();
                let path = &url[url.find("/ws").unwrap()..];
                let ws = Ws::connect(&format!("{}{}", base.replacen("http://", "ws://", 1), path))
                    .await
                    .expect("ws connect");
                ws.wait_for("the first status", |f| f["type"] == "status")
                    .await;
                sockets.insert(ev.who.clone(), ws);
                recorded.entry(ev.who.clone()).or_default();
                order.push(ev.who.clone());
            }
            "ws_send" => sockets[&ev.who].send_text(ev.data.to_string()),
            "ws_text" => {
                let list = recorded.entry(ev.who.clone()).or_default();
                list.push(ev.data.clone());
                let want = sequence(list).len();
                let t = ev.data["type"].as_str().unwrap_or_default();
                if t != "progress" && t != "progress_state" {
                    let ws = &sockets[&ev.who];
                    for _ in 0..1000 {
                        if sequence(&ws.snapshot()).len() >= want {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            "ws_close_sent" => {
                let ws = &sockets[&ev.who];
                ws.close();
                for _ in 0..200 {
                    if ws.ended() != Ended::ClosedByUs {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            "ws_closed" => {
                let ws = &sockets[&ev.who];
                for _ in 0..500 {
                    if ws.ended() == Ended::Abnormal {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                if ev.data["code"] == 1006 && ws.ended() != Ended::Abnormal {
                    diffs.push(format!(
                        "{}: expected an abnormal close (1006), got {:?}",
                        ev.who,
                        ws.ended()
                    ));
                }
            }
            "ws_connect_failed" => {
                let attempt = Ws::connect(&common::ws_url(&base, Some("retry"))).await;
                if attempt.is_ok() {
                    diffs.push("ws connect should fail while crashed".into());
                }
            }
            "case"
                if ev.data["case"]
                    .as_str()
                    .is_some_and(|c| c.contains("SIGKILL")) =>
            {
                sim.crash().await
            }
            "restart" => {
                sim.restart().await;
                // The real restart took seconds; don't wait for that.
                skew += ev.data["took_s"].as_f64().unwrap_or(0.0);
            }
            "http_req" => {
                let method = ev.data["method"].as_str().unwrap();
                let path = rewrite(ev.data["path"].as_str().unwrap(), &maps);
                let url = format!("{base}{path}");
                let mut req = match method {
                    "GET" => client.get(&url),
                    _ => client.post(&url),
                };
                if let Some(raw) = ev.data["raw"].as_str() {
                    req = req.body(raw.to_owned());
                } else if !ev.data["body"].is_null() {
                    let body = rewrite(&ev.data["body"].to_string(), &maps);
                    req = req.header("content-type", "application/json").body(body);
                }
                pending = Some((path, req.send().await));
            }
            "http_resp" | "http_exc" => {
                let Some((path, result)) = pending.take() else {
                    continue;
                };
                if ev.kind == "http_exc" {
                    if result.is_ok() {
                        diffs.push(format!(
                            "{path}: expected a connection error, got a response"
                        ));
                    }
                    continue;
                }
                let Ok(resp) = result else {
                    diffs.push(format!("{path}: request failed: {result:?}"));
                    continue;
                };
                let status = resp.status().as_u16();
                let ctype = resp
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                let bytes = resp.bytes().await.unwrap_or_default();
                if Some(u64::from(status)) != ev.data["status"].as_u64() {
                    diffs.push(format!(
                        "{path}: status {status} vs recorded {}",
                        ev.data["status"]
                    ));
                    continue;
                }
                let rec_ctype = ev.data["content_type"].as_str().unwrap_or("");
                let rec_body = &ev.data["body"];
                if rec_ctype.starts_with("application/json") {
                    if !ctype.starts_with("application/json") {
                        diffs.push(format!("{path}: content-type {ctype} vs {rec_ctype}"));
                    }
                    if skip_body.iter().any(|s| path.starts_with(s)) {
                        continue;
                    }
                    let ours: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                    compare(
                        &format!("{path} body"),
                        "",
                        rec_body,
                        &ours,
                        &mut maps,
                        &mut diffs,
                    );
                } else if let Some(n) = rec_body.get("bytes").and_then(Value::as_u64) {
                    if (n == 0) != bytes.is_empty() {
                        diffs.push(format!(
                            "{path}: body of {} bytes vs recorded {n}",
                            bytes.len()
                        ));
                    }
                    if let Some(magic) = rec_body["magic"].as_str().filter(|m| !m.is_empty()) {
                        let ours: String =
                            bytes.iter().take(4).map(|b| format!("{b:02x}")).collect();
                        if ours != magic {
                            diffs.push(format!("{path}: magic {ours} vs {magic}"));
                        }
                    }
                    if rec_ctype == "image/png" && ctype != "image/png" {
                        diffs.push(format!("{path}: content-type {ctype} vs image/png"));
                    }
                } else if let Some(text) = rec_body.as_str()
                    && (String::from_utf8_lossy(&bytes) != text || !ctype.starts_with("text/plain"))
                {
                    diffs.push(format!(
                        "{path}: body {:?} vs {text:?}",
                        String::from_utf8_lossy(&bytes)
                    ));
                }
            }
            _ => {}
        }
    }
    // Let trailing frames land, then compare each socket's sequence and ids.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for who in &order {
        let ours = sockets[who].snapshot();
        let rec = &recorded[who];
        // `status` is broadcast when the queue changes (a post from another socket, a prompt
        // taken off): where it falls among the running prompt's frames depends on when that
        // happened, in ComfyUI as here. So the other frames are compared in order, and the
        // `status` frames in their own order (count and queue sizes).
        let is_status = |f: &&Value| f["type"] == "status";
        let without_status = |v: &Vec<Value>| {
            v.iter()
                .filter(|f| !is_status(f))
                .cloned()
                .collect::<Vec<_>>()
        };
        let statuses = |v: &Vec<Value>| v.iter().filter(is_status).cloned().collect::<Vec<_>>();
        let (rs, os) = (
            sequence(&without_status(rec)),
            sequence(&without_status(&ours)),
        );
        let (rstatus, ostatus) = (statuses(rec), statuses(&ours));
        if rs != os || rstatus.len() != ostatus.len() {
            diffs.push(format!(
                "socket {who}: sequence differs ({} vs {} status frames)\n recorded {:?}\n ours     {:?}",
                rstatus.len(),
                ostatus.len(),
                sequence(rec),
                sequence(&ours)
            ));
            continue;
        }
        // Align the non-progress frames and compare their payloads (ids mapped): the others in
        // their order, then the `status` frames in theirs.
        let solid = |v: &Vec<Value>| {
            let mut frames: Vec<Value> = v
                .iter()
                .filter(|f| !matches!(f["type"].as_str(), Some("progress" | "progress_state")))
                .filter(|f| !is_status(f))
                .cloned()
                .collect();
            frames.extend(statuses(v));
            frames
        };
        for (r, o) in solid(rec).iter().zip(solid(&ours).iter()) {
            let t = r["type"].as_str().unwrap_or_default();
            if t == "executing" || t == "executed" {
                // Checked as a multiset below: ComfyUI's output order comes from a Python set.
                continue;
            }
            if t == "status" {
                // `sid` of an anonymous socket is random; queue sizes are compared exactly.
                compare(
                    &format!("{who} {t}"),
                    "",
                    &r["data"]["status"],
                    &o["data"]["status"],
                    &mut maps,
                    &mut diffs,
                );
                continue;
            }
            compare(&format!("{who} {t}"), "", r, o, &mut maps, &mut diffs);
        }
        // Which nodes ran and what they produced, regardless of the (set-ordered) output order.
        let nodes = |v: &Vec<Value>, ids: &HashMap<String, String>| {
            let mut n: Vec<String> = v
                .iter()
                .filter(|f| matches!(f["type"].as_str(), Some("executing" | "executed")))
                .map(|f| {
                    let pid = f["data"]["prompt_id"]
                        .as_str()
                        .map(|p| ids.get(p).cloned().unwrap_or_else(|| p.to_owned()));
                    let kinds: Vec<&str> = f["data"]["output"]["images"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|i| i["type"].as_str()).collect())
                        .unwrap_or_default();
                    format!("{} {} {:?} {:?}", f["type"], f["data"]["node"], pid, kinds)
                })
                .collect();
            n.sort();
            n
        };
        let ids = maps.ids.clone();
        let identity = HashMap::new();
        if nodes(rec, &ids) != nodes(&ours, &identity) {
            diffs.push(format!(
                "socket {who}: executing/executed differ\n recorded {:?}\n ours     {:?}",
                nodes(rec, &ids),
                nodes(&ours, &identity)
            ));
        }
    }
    sim.stop().await;
    diffs
}

async fn check(name: &str, skip_body: &[&str]) {
    let diffs = replay(name, skip_body).await;
    assert!(
        diffs.is_empty(),
        "{name}: {} difference(s):\n{}",
        diffs.len(),
        diffs.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success() {
    check("a_success", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b_runtime_error() {
    check("b_runtime_error", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_validation_rejected() {
    check("c_validation_rejected", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_interrupt() {
    check("d_interrupt", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f_client_supplied_prompt_id() {
    check("f_client_supplied_prompt_id", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g_ws_reconnect_midrun() {
    check("g_ws_reconnect_midrun", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h_broadcast_vs_targeted() {
    check("h_broadcast_vs_targeted", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_crash_restart() {
    check("j_crash_restart", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k_duplicate_clientid() {
    check("k_duplicate_clientid", &[]).await;
}

/// `/history?max_items=2` lists entries left by the recorder's earlier scenarios (state this
/// replay cannot have), and `/object_info` is a subset here; their bodies are not compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l_misc_endpoints() {
    check("l_misc_endpoints", &["/history?"]).await;
}

/// A queue's order by `number` and `front`, `GET /queue` listing it, and `POST /queue` with
/// `delete`: a pending prompt leaves, the running one is untouched (zhihui's cancel of a prompt
/// waiting on a server relies on exactly this).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_queue_priority_delete() {
    check("e_queue_priority_delete", &[]).await;
}
