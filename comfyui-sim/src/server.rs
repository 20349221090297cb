//! The HTTP and WebSocket surface of ComfyUI 0.3.64 (server.py), every route also under `/api`.
//! Handlers run on actix worker threads; they only touch the `Instance` behind a mutex and wake
//! the worker, so the simulator runs inside any tokio runtime (current-thread test runtimes too).

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header;
use actix_web::middleware::Next;
use actix_web::{HttpRequest, HttpResponse, web};
use futures_util::StreamExt as _;
use tokio::sync::mpsc;

use crate::Faults;
use crate::engine::Instance;
use crate::nodes::{Validation, validate_prompt};
use crate::obj;
use crate::ojson::{OMap, OValue, PyNum, to_string};
use crate::state::{Number, Outgoing, QueueItem, Socket, message};

/// Routes are registered with the instance of the current process lifetime.
pub type Inst = web::Data<Arc<Instance>>;

const JSON: &str = "application/json; charset=utf-8";

fn json(body: &impl serde::Serialize) -> HttpResponse {
    HttpResponse::Ok().content_type(JSON).body(to_string(body))
}

fn json_status(status: StatusCode, body: &impl serde::Serialize) -> HttpResponse {
    HttpResponse::build(status)
        .content_type(JSON)
        .body(to_string(body))
}

/// aiohttp's answer to an unhandled exception in a handler (e.g. a body that is not JSON).
fn internal_error() -> HttpResponse {
    HttpResponse::InternalServerError()
        .content_type("text/plain; charset=utf-8")
        .body("500 Internal Server Error\n\nServer got itself in trouble")
}

fn empty_ok() -> HttpResponse {
    HttpResponse::Ok().finish()
}

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/ws", web::get().to(websocket))
        .route("/prompt", web::post().to(post_prompt))
        .route("/prompt", web::get().to(get_prompt))
        .route("/queue", web::get().to(get_queue))
        .route("/queue", web::post().to(post_queue))
        .route("/interrupt", web::post().to(post_interrupt))
        .route("/history", web::get().to(get_history))
        .route("/history", web::post().to(post_history))
        .route("/history/{id}", web::get().to(get_history_item))
        .route("/view", web::get().to(view))
        .route("/object_info", web::get().to(object_info))
        .route("/object_info/{class}", web::get().to(object_info_class))
        .route("/system_stats", web::get().to(system_stats))
        .route("/features", web::get().to(features))
        .route("/free", web::post().to(free))
        .route("/models", web::get().to(models))
        .route("/models/{folder}", web::get().to(models_folder))
        .route("/embeddings", web::get().to(embeddings))
        .route("/sim/faults", web::get().to(get_faults))
        .route("/sim/faults", web::post().to(post_faults));
}

/// server.py `create_origin_only_middleware`: a loopback Host with a foreign Origin → 403.
pub async fn origin_check(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<actix_web::body::BoxBody>, actix_web::Error> {
    let header = |name: header::HeaderName| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_lowercase)
    };
    if let (Some(host), Some(origin)) = (header(header::HOST), header(header::ORIGIN)) {
        let origin_netloc = origin
            .split_once("://")
            .map_or("", |(_, rest)| rest)
            .split('/')
            .next()
            .unwrap_or("");
        let hostname = if let Some(rest) = host.strip_prefix('[') {
            rest.split(']').next().unwrap_or("").to_owned()
        } else {
            host.rsplit_once(':')
                .map_or(host.as_str(), |(h, _)| h)
                .to_owned()
        };
        let loopback =
            hostname == "localhost" || hostname.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
        if loopback && host != origin_netloc {
            tracing::warn!(%host, %origin, "origin check failed; 403 like ComfyUI");
            return Ok(req.into_response(HttpResponse::Forbidden().finish()));
        }
    }
    Ok(next.call(req).await?.map_into_boxed_body())
}

/// Unknown routes: aiohttp's 404 (no body).
pub async fn not_found() -> HttpResponse {
    HttpResponse::NotFound()
        .content_type("application/octet-stream")
        .finish()
}

async fn post_prompt(inst: Inst, body: web::Bytes) -> HttpResponse {
    let Ok(json_data) = serde_json::from_slice::<OValue>(&body) else {
        return internal_error();
    };
    let empty = OMap::new();
    let data = json_data.as_object().unwrap_or(&empty);
    let number = match data.get("number") {
        Some(n) => {
            let f = match n {
                OValue::Number(n) => PyNum::from_number(n).as_f64(),
                OValue::String(s) => match s.trim().parse::<f64>() {
                    Ok(f) => f,
                    Err(_) => return internal_error(),
                },
                OValue::Bool(b) => f64::from(u8::from(*b)),
                _ => return internal_error(),
            };
            Number::Float(f)
        }
        None => {
            let mut st = inst.lock();
            let n = st.number;
            st.number += 1;
            if data.get("front").is_some_and(OValue::truthy) {
                Number::Int(-n)
            } else {
                Number::Int(n)
            }
        }
    };
    let Some(prompt) = data.get("prompt") else {
        let error = obj![
            ("type", "no_prompt"),
            ("message", "No prompt provided"),
            ("details", "No prompt provided"),
            ("extra_info", obj![])
        ];
        return json_status(
            StatusCode::BAD_REQUEST,
            &obj![("error", error), ("node_errors", obj![])],
        );
    };
    let Some(prompt) = prompt.as_object() else {
        return internal_error();
    };
    let mut prompt = prompt.clone();
    let prompt_id = data
        .get("prompt_id")
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), OValue::py_str);
    let partial: Option<Vec<String>> = data
        .get("partial_execution_targets")
        .and_then(OValue::as_array)
        .map(|a| a.iter().map(OValue::py_str).collect());
    let validation = validate_prompt(&inst.shared.catalog, &mut prompt, partial.as_deref());
    let mut extra_data = data
        .get("extra_data")
        .and_then(OValue::as_object)
        .cloned()
        .unwrap_or_default();
    if let Some(client_id) = data.get("client_id") {
        extra_data.insert("client_id", client_id.clone());
    }
    match validation {
        Validation::Valid {
            outputs,
            node_errors,
        } => {
            {
                let mut st = inst.lock();
                st.seq += 1;
                let item = QueueItem {
                    number,
                    prompt_id: prompt_id.clone(),
                    prompt: Arc::new(prompt),
                    extra_data: Arc::new(extra_data),
                    outputs,
                    seq: st.seq,
                };
                st.put(item);
            }
            inst.shared.prompts_received.fetch_add(1, Ordering::SeqCst);
            inst.wake.notify_one();
            json(&obj![
                ("prompt_id", prompt_id),
                ("number", number.to_value()),
                ("node_errors", OValue::Object(node_errors))
            ])
        }
        Validation::Invalid { error, node_errors } => {
            tracing::warn!(error = %to_string(&error), "invalid prompt");
            json_status(
                StatusCode::BAD_REQUEST,
                &obj![
                    ("error", error),
                    ("node_errors", OValue::Object(node_errors))
                ],
            )
        }
    }
}

async fn get_prompt(inst: Inst) -> HttpResponse {
    let n = inst.lock().queue_remaining() as u64;
    json(&obj![("exec_info", obj![("queue_remaining", n)])])
}

async fn get_queue(inst: Inst) -> HttpResponse {
    let st = inst.lock();
    let running: Vec<OValue> = st.running.iter().map(|(_, i)| i.to_value()).collect();
    let pending: Vec<OValue> = st.queue.0.iter().map(QueueItem::to_value).collect();
    json(&obj![
        ("queue_running", OValue::Array(running)),
        ("queue_pending", OValue::Array(pending))
    ])
}

fn parse_body(body: &[u8]) -> Option<OMap<OValue>> {
    serde_json::from_slice::<OValue>(body)
        .ok()
        .map(|v| v.as_object().cloned().unwrap_or_default())
}

async fn post_queue(inst: Inst, body: web::Bytes) -> HttpResponse {
    let Some(data) = parse_body(&body) else {
        return internal_error();
    };
    let mut st = inst.lock();
    if data.get("clear").is_some_and(OValue::truthy) {
        st.wipe_queue();
    }
    if let Some(OValue::Array(ids)) = data.get("delete") {
        for id in ids {
            st.delete_pending(&id.py_str());
        }
    }
    empty_ok()
}

async fn post_interrupt(inst: Inst, body: web::Bytes) -> HttpResponse {
    let data = parse_body(&body).unwrap_or_default();
    match data.get("prompt_id").filter(|v| v.truthy()) {
        Some(id) => {
            let id = id.py_str();
            let running = inst.lock().running.iter().any(|(_, i)| i.prompt_id == id);
            if running {
                tracing::info!(prompt_id = %id, "interrupting prompt");
                inst.set_interrupt();
            } else {
                tracing::info!(prompt_id = %id, "prompt is not currently running, skipping interrupt");
            }
        }
        None => inst.set_interrupt(),
    }
    empty_ok()
}

async fn get_history(inst: Inst, query: web::Query<Vec<(String, String)>>) -> HttpResponse {
    let param = |name: &str| {
        query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim().parse::<i64>())
    };
    let max_items = match param("max_items") {
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => return internal_error(),
        None => None,
    };
    let mut offset = match param("offset") {
        Some(Ok(n)) => n,
        Some(Err(_)) => return internal_error(),
        None => -1,
    };
    let st = inst.lock();
    if offset < 0
        && let Some(max) = max_items
    {
        offset = st.history.len() as i64 - max;
    }
    let mut out = OMap::new();
    for (i, (k, v)) in st.history.iter().enumerate() {
        if i as i64 >= offset {
            out.insert(k.clone(), &**v);
            if max_items.is_some_and(|m| out.len() as i64 >= m) {
                break;
            }
        }
    }
    json(&out)
}

async fn get_history_item(inst: Inst, id: web::Path<String>) -> HttpResponse {
    inst.shared
        .history_lookups
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let st = inst.lock();
    let mut out = OMap::new();
    if let Some(entry) = st.history.get(id.as_str()) {
        out.insert(id.into_inner(), &**entry);
    }
    json(&out)
}

async fn post_history(inst: Inst, body: web::Bytes) -> HttpResponse {
    let Some(data) = parse_body(&body) else {
        return internal_error();
    };
    let mut st = inst.lock();
    if data.get("clear").is_some_and(OValue::truthy) {
        st.history = OMap::new();
    }
    if let Some(OValue::Array(ids)) = data.get("delete") {
        for id in ids {
            st.history.remove(&id.py_str());
        }
    }
    empty_ok()
}

async fn view(
    inst: Inst,
    req: HttpRequest,
    query: web::Query<Vec<(String, String)>>,
) -> HttpResponse {
    let param = |name: &str| {
        query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let Some(mut filename) = param("filename") else {
        return HttpResponse::NotFound().finish();
    };
    // folder_paths.annotated_filepath: "name.png [output]" picks the directory.
    let mut dir = None;
    for (suffix, kind) in [
        (" [output]", "output"),
        (" [input]", "input"),
        (" [temp]", "temp"),
    ] {
        if let Some(stripped) = filename.strip_suffix(suffix) {
            filename = stripped.to_owned();
            dir = Some(kind.to_owned());
        }
    }
    if filename.is_empty() || filename.starts_with('/') || filename.contains("..") {
        return HttpResponse::BadRequest().finish();
    }
    let kind = dir.unwrap_or_else(|| param("type").unwrap_or_else(|| "output".into()));
    let base = match kind.as_str() {
        "output" => inst.shared.output_dir.clone(),
        "temp" => inst.shared.temp_dir.clone(),
        "input" => inst.shared.input_dir.clone(),
        _ => return HttpResponse::BadRequest().finish(),
    };
    let mut dir = base.clone();
    if let Some(sub) = param("subfolder") {
        let joined = if sub.starts_with('/') {
            std::path::PathBuf::from(&sub)
        } else {
            base.join(&sub)
        };
        let norm = std::path::PathBuf::from(crate::engine::normpath(&joined.to_string_lossy()));
        if !norm.starts_with(&base) {
            return HttpResponse::Forbidden().finish();
        }
        dir = norm;
    }
    let name = filename.rsplit('/').next().unwrap_or(&filename).to_owned();
    let path = dir.join(&name);
    if !path.is_file() {
        return HttpResponse::NotFound().finish();
    }
    let read_path = path.clone();
    match web::block(move || std::fs::read(read_path))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
    {
        Ok(mut bytes) => {
            if inst.shared.faults().corrupt_images {
                bytes.truncate(bytes.len() / 4);
            }
            let content_type = match path
                .extension()
                .and_then(|e| e.to_str())
                .map(str::to_lowercase)
                .as_deref()
            {
                Some("png") => "image/png",
                Some("jpg" | "jpeg") => "image/jpeg",
                Some("webp") => "image/webp",
                Some("gif") => "image/gif",
                Some("json") => "application/json",
                _ => "application/octet-stream",
            };
            let _ = &req;
            HttpResponse::Ok()
                .content_type(content_type)
                .insert_header((header::CONTENT_DISPOSITION, format!("filename=\"{name}\"")))
                .body(bytes)
        }
        Err(error) => {
            tracing::warn!(%error, path = %path.display(), "reading a file for /view");
            HttpResponse::NotFound().finish()
        }
    }
}

async fn object_info(inst: Inst) -> HttpResponse {
    json(&inst.shared.catalog.object_info())
}

async fn object_info_class(inst: Inst, class: web::Path<String>) -> HttpResponse {
    let mut out = OMap::new();
    if let Some(def) = inst.shared.catalog.get(&class) {
        out.insert(def.name, def.object_info());
    }
    json(&out)
}

async fn system_stats() -> HttpResponse {
    let argv: Vec<OValue> = std::env::args().map(OValue::from).collect();
    let ram: u64 = 25_274_793_984;
    let free: u64 = 24_192_368_640;
    json(&obj![
        (
            "system",
            obj![
                ("os", "posix"),
                ("ram_total", ram),
                ("ram_free", free),
                ("comfyui_version", "0.3.64"),
                ("required_frontend_version", "1.27.10"),
                ("installed_templates_version", "0.1.95"),
                ("required_templates_version", "0.1.95"),
                ("python_version", "3.11.7 (comfyui-sim)"),
                ("pytorch_version", "2.8.0+cpu (comfyui-sim)"),
                ("embedded_python", false),
                ("argv", OValue::Array(argv))
            ]
        ),
        (
            "devices",
            OValue::Array(vec![obj![
                ("name", "cpu"),
                ("type", "cpu"),
                ("index", OValue::Null),
                ("vram_total", ram),
                ("vram_free", free),
                ("torch_vram_total", ram),
                ("torch_vram_free", free)
            ]])
        )
    ])
}

fn server_features() -> OValue {
    obj![
        ("supports_preview_metadata", true),
        ("max_upload_size", 104_857_600u64)
    ]
}

async fn features() -> HttpResponse {
    json(&server_features())
}

async fn free() -> HttpResponse {
    empty_ok()
}

async fn models() -> HttpResponse {
    json(&OValue::from(vec![
        "checkpoints",
        "loras",
        "vae",
        "embeddings",
    ]))
}

async fn models_folder(inst: Inst, folder: web::Path<String>) -> HttpResponse {
    match folder.as_str() {
        "checkpoints" => {
            let names = inst
                .shared
                .catalog
                .get("CheckpointLoaderSimple")
                .and_then(|d| d.input("ckpt_name"))
                .map(|i| match &i.ty {
                    crate::nodes::InputType::Combo(items) => items.clone(),
                    _ => vec![],
                });
            json(&OValue::from(names.unwrap_or_default()))
        }
        "loras" | "vae" | "embeddings" => json(&OValue::Array(vec![])),
        _ => HttpResponse::NotFound().finish(),
    }
}

async fn embeddings() -> HttpResponse {
    json(&OValue::Array(vec![]))
}

/// Not ComfyUI: the simulator's fault switches, for the `comfyui-sim` binary.
async fn get_faults(inst: Inst) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(JSON)
        .body(serde_json::to_string(&inst.shared.faults()).unwrap_or_default())
}

async fn post_faults(inst: Inst, body: web::Bytes) -> HttpResponse {
    match serde_json::from_slice::<Faults>(&body) {
        Ok(faults) => {
            tracing::info!(?faults, "faults changed");
            *inst.shared.faults.lock().unwrap_or_else(|e| e.into_inner()) = faults.clone();
            HttpResponse::Ok()
                .content_type(JSON)
                .body(serde_json::to_string(&faults).unwrap_or_default())
        }
        Err(error) => HttpResponse::BadRequest().body(error.to_string()),
    }
}

/// server.py `websocket_handle`, duplicate-clientId bug included.
async fn websocket(
    inst: Inst,
    req: HttpRequest,
    body: web::Payload,
) -> actix_web::Result<HttpResponse> {
    let faults = inst.shared.faults();
    let starting =
        inst.started.elapsed() < std::time::Duration::from_millis(faults.socket_start_delay_ms);
    if faults.refuse_sockets || starting {
        return Ok(HttpResponse::ServiceUnavailable().finish());
    }
    let (response, mut session, stream) = actix_ws::handle(&req, body)?;
    let query = web::Query::<Vec<(String, String)>>::from_query(req.query_string())
        .map(|q| q.into_inner())
        .unwrap_or_default();
    let sid = query
        .iter()
        .find(|(k, _)| k == "clientId")
        .map(|(_, v)| v.clone())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
    let conn = {
        let mut st = inst.lock();
        st.next_conn += 1;
        let conn = st.next_conn;
        // A second socket with the same clientId silently replaces the first one's entry.
        st.sockets.insert(sid.clone(), Socket { tx: tx.clone() });
        st.connections.insert(conn, tx.clone());
        let mut status = st.status_data();
        if let OValue::Object(m) = &mut status {
            m.insert("sid", OValue::from(sid.as_str()));
        }
        let _ = tx.send(Outgoing::Text(message("status", &status)));
        if st.client_id.as_deref() == Some(sid.as_str())
            && let Some(node) = &st.last_node_id
        {
            let _ = tx.send(Outgoing::Text(message(
                "executing",
                &obj![("node", node.as_str())],
            )));
        }
        conn
    };
    let inst = inst.into_inner();
    actix_web::rt::spawn(async move {
        let mut stream = stream.max_frame_size(64 * 1024 * 1024);
        let mut first_message = true;
        let mut killed = false;
        loop {
            tokio::select! {
                out = rx.recv() => match out {
                    Some(Outgoing::Text(text)) => {
                        if !inst.shared.faults().silent && session.text(text).await.is_err() {
                            break;
                        }
                    }
                    Some(Outgoing::Kill) | None => {
                        killed = true;
                        break;
                    }
                },
                msg = stream.next() => match msg {
                    Some(Ok(actix_ws::Message::Ping(bytes))) => {
                        if !inst.shared.faults().silent && session.pong(&bytes).await.is_err() {
                            break;
                        }
                    }
                    Some(Ok(actix_ws::Message::Text(text))) => {
                        // Only the first parsed text frame is looked at, and only for feature_flags.
                        if let Ok(value) = serde_json::from_str::<OValue>(&text) {
                            if first_message && value.get("type").and_then(OValue::as_str) == Some("feature_flags") {
                                let reply = message("feature_flags", &server_features());
                                let st = inst.lock();
                                if let Some(socket) = st.sockets.get(&sid) {
                                    let _ = socket.tx.send(Outgoing::Text(reply));
                                }
                            }
                            first_message = false;
                        }
                    }
                    Some(Ok(actix_ws::Message::Close(reason))) => {
                        if !inst.shared.faults().silent {
                            let _ = session.clone().close(reason).await;
                        }
                        break;
                    }
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break,
                },
            }
        }
        let mut st = inst.lock();
        st.connections.remove(&conn);
        if !killed {
            // server.py's `finally: self.sockets.pop(sid)`, whichever socket holds that id now.
            st.sockets.remove(&sid);
        }
        drop(st);
        // After a crash the session is dropped without a close frame: the client sees a reset.
        drop(session);
    });
    Ok(response)
}
