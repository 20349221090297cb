//! A fake Ollama for the tests: answers `POST /api/chat` as Ollama does (`stream: false`), or
//! fails in the ways a real one can: an error status, an answer that is not a chat response, or
//! no answer within the client's timeout. Counts the calls it got.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use actix_web::{App, HttpResponse, HttpServer, web};
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OllamaMode {
    /// Answers `EN(<text>)`.
    Translate = 0,
    /// 500 with an error body.
    Error = 1,
    /// 200 with a body that is not a chat response.
    Garbage = 2,
    /// Answers only after 30 s (longer than any test's timeout).
    Slow = 3,
}

#[derive(Debug, Clone)]
pub struct FakeOllama {
    pub url: String,
    mode: Arc<AtomicU8>,
    calls: Arc<AtomicUsize>,
}

impl FakeOllama {
    pub async fn start() -> FakeOllama {
        let mode = Arc::new(AtomicU8::new(OllamaMode::Translate as u8));
        let calls = Arc::new(AtomicUsize::new(0));
        let (server_mode, server_calls) = (mode.clone(), calls.clone());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = HttpServer::new(move || {
            let mode = server_mode.clone();
            let calls = server_calls.clone();
            App::new().route(
                "/api/chat",
                web::post().to(move |body: web::Json<Value>| {
                    let mode = mode.load(Ordering::SeqCst);
                    calls.fetch_add(1, Ordering::SeqCst);
                    async move { answer(mode, &body).await }
                }),
            )
        })
        .workers(1)
        .listen(listener)
        .unwrap()
        .run();
        tokio::spawn(server);
        FakeOllama {
            url: format!("http://127.0.0.1:{port}"),
            mode,
            calls,
        }
    }

    pub fn set_mode(&self, mode: OllamaMode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
    }

    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

async fn answer(mode: u8, body: &Value) -> HttpResponse {
    match mode {
        1 => HttpResponse::InternalServerError().json(json!({"error": "model not loaded"})),
        2 => HttpResponse::Ok()
            .content_type("application/json")
            .body("{\"model\": \"qwen2.5:0.5b\", \"done\": tru"),
        3 => {
            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            HttpResponse::Ok().finish()
        }
        _ => {
            let text = body["messages"][1]["content"].as_str().unwrap_or("");
            HttpResponse::Ok().json(json!({
                "model": body["model"],
                "created_at": "2027-01-15T01:00:00Z",
                "message": {"role": "assistant", "content": format!("EN({text})")},
                "done_reason": "stop",
                "done": true
            }))
        }
    }
}
