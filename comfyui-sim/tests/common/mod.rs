//! Shared test helpers: start a simulator in a fresh output directory, an HTTP client without
//! connection pooling (a crash must surface as ECONNREFUSED, not a stale pooled socket), and a
//! WebSocket client that records every frame and how the connection ended.

#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use comfyui_sim::{Faults, SimConfig, Simulator};
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

/// Under the target directory (Cargo's scratch space for integration tests), not the system's
/// temp directory: the output files stay after a test, and `cargo clean` takes them.
pub fn output_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "comfyui-sim-test-{}",
        uuid::Uuid::new_v4().simple()
    ))
}

pub async fn start(faults: Faults) -> Simulator {
    Simulator::start(SimConfig {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        output_dir: output_dir(),
        models: vec![
            "sd_xl_base_1.0.safetensors".into(),
            "v1-5-pruned-emaonly.safetensors".into(),
        ],
        faults,
    })
    .await
    .expect("simulator starts")
}

pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("http client")
}

/// How a WebSocket ended, as the client saw it.
#[derive(Clone, Debug, PartialEq)]
pub enum Ended {
    Open,
    /// The server sent a close frame.
    Closed,
    /// Reset / EOF without a close frame (what a client reports as 1006).
    Abnormal,
    /// We closed it.
    ClosedByUs,
}

/// A recording WebSocket client.
pub struct Ws {
    pub frames: Arc<Mutex<Vec<Value>>>,
    pub pongs: Arc<Mutex<usize>>,
    pub ended: Arc<Mutex<Ended>>,
    tx: mpsc::UnboundedSender<Message>,
}

impl Ws {
    pub async fn connect(url: &str) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
        let (stream, _) = tokio_tungstenite::connect_async(url).await?;
        let (mut sink, mut read) = stream.split();
        let frames = Arc::new(Mutex::new(Vec::new()));
        let pongs = Arc::new(Mutex::new(0));
        let ended = Arc::new(Mutex::new(Ended::Open));
        let (tx, mut rx) = mpsc::unbounded_channel::<Message>();
        let (f, p, e) = (frames.clone(), pongs.clone(), ended.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    out = rx.recv() => match out {
                        Some(Message::Close(frame)) => {
                            *e.lock().unwrap() = Ended::ClosedByUs;
                            let _ = sink.send(Message::Close(frame)).await;
                        }
                        Some(m) => { let _ = sink.send(m).await; }
                        None => break,
                    },
                    msg = read.next() => match msg {
                        Some(Ok(Message::Text(t))) => f.lock().unwrap().push(serde_json::from_str(&t).unwrap()),
                        Some(Ok(Message::Pong(_))) => *p.lock().unwrap() += 1,
                        Some(Ok(Message::Close(_))) => {
                            let mut ended = e.lock().unwrap();
                            if *ended == Ended::Open { *ended = Ended::Closed; }
                        }
                        Some(Ok(_)) => {}
                        Some(Err(_)) | None => {
                            let mut ended = e.lock().unwrap();
                            if *ended == Ended::Open { *ended = Ended::Abnormal; }
                            break;
                        }
                    },
                }
            }
        });
        Ok(Ws {
            frames,
            pongs,
            ended,
            tx,
        })
    }

    pub fn send_text(&self, text: String) {
        let _ = self.tx.send(Message::Text(text.into()));
    }

    pub fn ping(&self) {
        let _ = self.tx.send(Message::Ping(b"hi".to_vec().into()));
    }

    pub fn close(&self) {
        let _ = self.tx.send(Message::Close(None));
    }

    pub fn snapshot(&self) -> Vec<Value> {
        self.frames.lock().unwrap().clone()
    }

    /// Wait (bounded) until a frame matching `pred` has arrived; returns all frames so far.
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Vec<Value> {
        for _ in 0..3000 {
            let frames = self.snapshot();
            if frames.iter().any(&pred) {
                return frames;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "timed out waiting for {what}; got {:#?}",
            types(&self.snapshot())
        );
    }

    pub fn ended(&self) -> Ended {
        self.ended.lock().unwrap().clone()
    }
}

pub fn types(frames: &[Value]) -> Vec<String> {
    frames
        .iter()
        .map(|f| f["type"].as_str().unwrap_or("?").to_owned())
        .collect()
}

pub fn ws_url(base: &str, client_id: Option<&str>) -> String {
    let base = base.replacen("http://", "ws://", 1);
    match client_id {
        Some(id) => format!("{base}/ws?clientId={id}"),
        None => format!("{base}/ws"),
    }
}
