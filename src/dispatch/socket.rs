//! One WebSocket per ComfyUI server: a fresh clientId for every connection (a reused one can be
//! silently unregistered by the server: comfyui-sim/transcripts/k_duplicate_clientid), client pings (the server sends
//! none), a silence limit that declares a half-open socket dead, and reconnection with capped
//! exponential backoff. Everything it hears goes to the saga as [`SocketEvent`]s.

use std::time::Duration;

use async_tungstenite::tungstenite::Message;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use uuid::Uuid;

use crate::dispatch::comfy::{ComfyClient, ComfyMessage};

#[derive(Debug, Clone, PartialEq)]
pub enum SocketEvent {
    /// Connected under this clientId: posts must name it to get their events here.
    Opened {
        client_id: String,
    },
    Message(ComfyMessage),
    /// Closed, refused, or silent too long. Events of the gap are lost: reconcile.
    Closed {
        reason: String,
    },
}

#[derive(Debug, Clone, Copy)]
pub struct SocketTimings {
    pub ping_interval: Duration,
    pub silence_max: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

/// Keep a socket open to `client`'s server until `events` is dropped.
pub async fn run(
    backend: usize,
    client: ComfyClient,
    timings: SocketTimings,
    events: mpsc::UnboundedSender<(usize, SocketEvent)>,
) {
    let mut backoff = timings.backoff_min;
    let mut was_open = true;
    loop {
        let client_id = Uuid::new_v4().simple().to_string();
        let url = client.socket_url(&client_id);
        let connected = tokio::time::timeout(
            timings.silence_max,
            async_tungstenite::tokio::connect_async(url.as_str()),
        )
        .await;
        let reason = match connected {
            Ok(Ok((socket, _response))) => {
                backoff = timings.backoff_min;
                was_open = true;
                if events
                    .send((backend, SocketEvent::Opened { client_id }))
                    .is_err()
                {
                    return;
                }
                follow(backend, socket, timings, &events).await
            }
            Ok(Err(error)) => format!("connecting: {error}"),
            Err(_) => "connecting: timed out".to_owned(),
        };
        // Tell the saga once per outage, not once per failed attempt.
        if was_open {
            was_open = false;
            if events
                .send((backend, SocketEvent::Closed { reason }))
                .is_err()
            {
                return;
            }
        }
        if events.is_closed() {
            return;
        }
        // Jitter: servers restarting together are not reconnected to in lockstep.
        let jitter = rand::random_range(0..=backoff.as_millis() as u64 / 4);
        tokio::time::sleep(backoff + Duration::from_millis(jitter)).await;
        backoff = (backoff * 2).min(timings.backoff_max);
    }
}

/// Read one connection until it ends; returns why it ended.
async fn follow<S>(
    backend: usize,
    mut socket: async_tungstenite::WebSocketStream<S>,
    timings: SocketTimings,
    events: &mpsc::UnboundedSender<(usize, SocketEvent)>,
) -> String
where
    S: futures::AsyncRead + futures::AsyncWrite + Unpin,
{
    let mut pings = tokio::time::interval(timings.ping_interval);
    pings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_heard = Instant::now();
    loop {
        tokio::select! {
            frame = socket.next() => match frame {
                Some(Ok(Message::Text(text))) => {
                    last_heard = Instant::now();
                    let message = ComfyMessage::parse(text.as_str());
                    if message != ComfyMessage::Other
                        && events.send((backend, SocketEvent::Message(message))).is_err()
                    {
                        return "dispatcher stopped".into();
                    }
                }
                Some(Ok(Message::Close(frame))) => return format!("closed by the server: {frame:?}"),
                Some(Ok(_)) => last_heard = Instant::now(),
                Some(Err(error)) => return format!("socket error: {error}"),
                None => return "socket ended".into(),
            },
            _ = pings.tick() => {
                if last_heard.elapsed() > timings.silence_max {
                    // Half-open or a server that stopped sending: drop it without a handshake.
                    return format!("silent for {} ms", timings.silence_max.as_millis());
                }
                if let Err(error) = socket.send(Message::Ping(Vec::new().into())).await {
                    return format!("ping failed: {error}");
                }
            }
        }
        if events.is_closed() {
            return "dispatcher stopped".into();
        }
    }
}
