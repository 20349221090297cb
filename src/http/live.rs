//! What users watch and fetch live: `GET /api/v1/ws` (notifications about their own tasks) and
//! `GET /api/v1/images/{id}` (their images, served by zhihui; never a ComfyUI address).
//!
//! The socket listens to this process's [`crate::platform::notify::NotificationHub`], so it hears what any
//! process publishes, and passes on only what concerns its user. Queue positions come from the
//! process's [`crate::tasks::positions::PositionBoard`]: one Redis read per queue change for all sockets.

use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use uuid::Uuid;
use zhihui_domain::task::TaskId;
use zhihui_domain::user::UserId;

use crate::http::ApiError;
use crate::http::extract::{Authenticated, bearer_token, session_of};
use crate::platform::notify::{Envelope, SocketPlace, TaskNotice};
use crate::state::AppState;

/// Queued tasks followed per socket, at most (the per-user queue limit is far below).
pub const WATCHED_TASKS_MAX: usize = 256;

#[derive(Debug, Deserialize)]
pub struct SocketQuery {
    /// A one-time ticket from `POST /api/v1/ws/ticket`: how a browser should open the socket.
    pub ticket: Option<String>,
    /// The bearer token: a fallback for clients that can neither set a header nor get a ticket
    /// (a token in a URL can end up in proxies' logs and histories).
    pub token: Option<String>,
}

/// A one-time ticket to open one socket (`GET /api/v1/ws?ticket=`), so that a browser, which
/// cannot set headers on a WebSocket, never puts its bearer token in a URL.
#[utoipa::path(
    post, path = "/api/v1/ws/ticket", tag = "tasks", security(("bearer" = [])),
    responses(
        (status = 201, description = "`{ticket, expires_at}`: opens one socket of this session, once, within `auth.ws_ticket_ttl_ms` (30 s)"),
        (status = 401, description = "`missing-token` or `invalid-token`", body = crate::http::problem::Problem),
    )
)]
pub async fn ticket(
    state: web::Data<AppState>,
    caller: Authenticated,
) -> Result<HttpResponse, ApiError> {
    let ttl = Duration::from_millis(state.auth_settings.ws_ticket_ttl_ms);
    let (ticket, expires_at) = state.sessions.issue_ticket(&caller.0, ttl).await?;
    Ok(HttpResponse::Created()
        .insert_header(("Cache-Control", "no-store"))
        .json(json!({"ticket": ticket, "expires_at": expires_at})))
}

/// Notifications about the caller's tasks. Authenticate with `?ticket=<one-time ticket>` (from
/// `POST /api/v1/ws/ticket`), `Authorization: Bearer <token>`, or, as a fallback, `?token=`.
/// Messages are JSON: `{"type": "position" | "left_queue" | "dispatched" | "progress" |
/// "succeeded" | "failed" | "cancelled", "task_id", ...}`; `succeeded` carries image URLs;
/// `left_queue` says a task followed in the queue is no longer there (its state says why, and
/// may have been told before it was followed).
pub async fn socket(
    state: web::Data<AppState>,
    request: HttpRequest,
    query: crate::http::extract::Query<SocketQuery>,
    body: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let session =
        if let Some(ticket) = &query.ticket {
            let session = state.sessions.redeem_ticket(ticket).await?.ok_or_else(|| {
                ApiError::Unauthorized {
                    rule: "invalid-ticket",
                    detail:
                        "the ticket is unknown, used, expired, or its session ended; get a new one"
                            .into(),
                }
            })?;
            state.active_users.seen(session.user_id.as_uuid()).await;
            session
        } else {
            let token = match (&query.token, bearer_token(&request)) {
                (_, Ok(token)) => token,
                (Some(token), Err(_)) => token.clone(),
                (None, Err(error)) => return Err(error),
            };
            session_of(&state, &token).await?
        };
    let place = state
        .user_sockets
        .take(session.user_id)
        .ok_or_else(|| ApiError::Refused {
            status: actix_web::http::StatusCode::TOO_MANY_REQUESTS,
            rule: "too-many-sockets",
            detail: format!(
                "this user has {} sockets open here already, the most allowed; close one",
                state.http_settings.sockets_per_user_max
            ),
            window: None,
        })?;
    // Subscribed before answering: nothing published after the upgrade is missed.
    let notifications = state.hub.subscribe().await?;
    let snapshots = state.positions.subscribe(&state.hub).await?;
    let watched = queued_tasks(&state, session.user_id).await?;
    let (response, user_socket, messages) = actix_ws::handle(&request, body)
        .map_err(|error| anyhow::anyhow!("WebSocket upgrade failed: {error}"))?;
    actix_web::rt::spawn(follow(
        state.into_inner(),
        session,
        place,
        user_socket,
        messages,
        notifications,
        snapshots,
        watched,
    ));
    Ok(response)
}

/// The user's tasks waiting in the queue (from the read model; new ones arrive as notices).
async fn queued_tasks(state: &AppState, user_id: UserId) -> Result<Vec<TaskId>, ApiError> {
    let client = crate::platform::postgres::checkout(&state.pg_pool)
        .await
        .map_err(anyhow::Error::new)?;
    let rows = client
        .query(
            "SELECT task_id FROM tasks WHERE user_id = $1 AND status IN ('submitted', 'queued')
              ORDER BY submitted_at LIMIT $2",
            &[&user_id.as_uuid(), &(WATCHED_TASKS_MAX as i64)],
        )
        .await
        .map_err(anyhow::Error::new)?;
    Ok(rows.iter().map(|row| row.get(0)).collect())
}

fn notice_json(task_id: TaskId, notice: &TaskNotice) -> Value {
    match notice {
        TaskNotice::Position {
            position,
            estimated_start_at,
            estimated_end_at,
        } => json!({
            "type": "position",
            "task_id": task_id,
            "position": position,
            "estimated_start_at": estimated_start_at,
            "estimated_end_at": estimated_end_at,
        }),
        TaskNotice::Dispatched => json!({"type": "dispatched", "task_id": task_id}),
        TaskNotice::Progress { value, max } => {
            json!({"type": "progress", "task_id": task_id, "value": value, "max": max})
        }
        TaskNotice::Succeeded { images } => json!({
            "type": "succeeded",
            "task_id": task_id,
            "images": images.iter().map(|id| format!("/api/v1/images/{id}")).collect::<Vec<_>>(),
        }),
        TaskNotice::Failed { reason } => {
            json!({"type": "failed", "task_id": task_id, "reason": reason})
        }
        TaskNotice::ServerLost => json!({"type": "server_lost", "task_id": task_id}),
        TaskNotice::Cancelled => json!({"type": "cancelled", "task_id": task_id}),
    }
}

/// Why the server closes a user socket (the close frame's reason).
fn closing(description: &str) -> Option<actix_ws::CloseReason> {
    Some(actix_ws::CloseReason {
        code: actix_ws::CloseCode::Policy,
        description: Some(description.to_owned()),
    })
}

#[allow(clippy::too_many_arguments)]
async fn follow(
    state: std::sync::Arc<AppState>,
    session: crate::identity::sessions::Session,
    _place: SocketPlace,
    mut user_socket: actix_ws::Session,
    mut messages: actix_ws::MessageStream,
    mut notifications: broadcast::Receiver<Envelope>,
    mut snapshots: broadcast::Receiver<std::sync::Arc<crate::tasks::positions::Snapshot>>,
    watched: Vec<TaskId>,
) {
    let user_id = session.user_id;
    // The queued tasks followed, with the place last told of each.
    let mut following = crate::tasks::positions::Following::new(state.positions.clone());
    for task_id in watched {
        following.add(task_id);
    }
    let ping_interval = Duration::from_millis(state.http_settings.socket_ping_interval_ms);
    let mut pings = tokio::time::interval(ping_interval);
    pings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Anything from the peer (a pong above all) proves it is there.
    let mut heard_at = tokio::time::Instant::now();
    let mut send_positions = true;
    let close_reason = loop {
        if send_positions {
            // The first places: read for this socket alone, once.
            send_positions = false;
            match state.positions.read(&following.tasks()).await {
                Ok(snapshot) => {
                    if tell_positions(&mut user_socket, &mut following, &snapshot)
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Err(error) => {
                    tracing::debug!(error = %crate::platform::telemetry::error_chain(&error), "queue positions unavailable");
                }
            }
        }
        let outgoing = tokio::select! {
            snapshot = snapshots.recv() => match snapshot {
                Ok(snapshot) => {
                    if tell_positions(&mut user_socket, &mut following, &snapshot)
                        .await
                        .is_err()
                    {
                        return;
                    }
                    continue;
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    state.positions.refresh();
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => break None,
            },
            message = messages.recv() => {
                heard_at = tokio::time::Instant::now();
                match message {
                    Some(Ok(actix_ws::Message::Ping(bytes))) => {
                        if user_socket.pong(&bytes).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Some(Ok(actix_ws::Message::Close(_))) | Some(Err(_)) | None => break None,
                    // Clients have nothing to say; anything else (pongs) is ignored.
                    Some(Ok(_)) => continue,
                }
            }
            _ = pings.tick() => {
                if heard_at.elapsed() > 2 * ping_interval {
                    break closing("no answer to pings");
                }
                // The session may have expired or been revoked (a missed announcement): a
                // socket does not outlive its session. Checked without sliding its expiry.
                match state.sessions.is_valid(&session).await {
                    Ok(false) => break closing("session ended"),
                    Ok(true) => {}
                    Err(error) => {
                        tracing::debug!(error = %crate::platform::telemetry::error_chain(&error), "session check failed; checked again at the next ping");
                    }
                }
                if user_socket.ping(b"").await.is_err() {
                    return;
                }
                continue;
            }
            envelope = notifications.recv() => match envelope {
                Ok(Envelope::SessionsEnded { user_id: owner, token_digest })
                    if owner == user_id.as_uuid()
                        && token_digest.as_ref().is_none_or(|digest| *digest == session.token_digest) =>
                {
                    break closing("session ended");
                }
                Ok(Envelope::SessionsEnded { .. }) => continue,
                Ok(Envelope::Task { user_id: owner, task_id, notice }) if owner == user_id.as_uuid() => {
                    match &notice {
                        TaskNotice::Position { .. } => {
                            // A task submitted since the socket opened (through this page, another
                            // tab, or a program's key): the board reads its place with everyone
                            // else's, and a page listing the newest tasks shows its card.
                            let new = following.len() < WATCHED_TASKS_MAX && following.add(task_id);
                            state.positions.refresh();
                            if !new {
                                continue;
                            }
                            serde_json::json!({"type": "submitted", "task_id": task_id})
                        }
                        _ => {
                            following.remove(task_id);
                            notice_json(task_id, &notice)
                        }
                    }
                }
                Ok(Envelope::Task { .. }) => continue,
                Ok(Envelope::Claim { user_id: owner, promotion_id, claim_id, granted, reason })
                    if owner == user_id.as_uuid() =>
                {
                    if granted {
                        serde_json::json!({"type": "claim_granted", "promotion_id": promotion_id, "claim_id": claim_id})
                    } else {
                        serde_json::json!({"type": "claim_refused", "promotion_id": promotion_id, "claim_id": claim_id, "reason": reason})
                    }
                }
                Ok(Envelope::Claim { .. }
                    | Envelope::GalleryChanged { .. }
                    | Envelope::UserRenamed { .. }) => continue,
                Ok(Envelope::Credited { user_id: owner, amount, reason }) if owner == user_id.as_uuid() => {
                    serde_json::json!({"type": "points_credited", "amount": amount, "reason": reason})
                }
                Ok(Envelope::Credited { .. }) => continue,
                // The board reads the places after a queue change, once for every socket.
                Ok(Envelope::QueueMoved) => continue,
                // Fell behind, or the process's subscription was opened again: positions are
                // read again; other notices of the gap are lost (the tasks' states say the rest).
                // A lost one may have ended this session: it is checked now, not at the next
                // ping (minutes, maybe).
                Ok(Envelope::Resubscribed) | Err(broadcast::error::RecvError::Lagged(_)) => {
                    state.positions.refresh();
                    if let Ok(false) = state.sessions.is_valid(&session).await {
                        break closing("session ended");
                    }
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => break None,
            },
        };
        if user_socket.text(outgoing.to_string()).await.is_err() {
            return;
        }
    };
    drop(user_socket.close(close_reason).await);
}

/// Tell the places that changed, and the tasks that left the queue (then forgotten).
async fn tell_positions(
    user_socket: &mut actix_ws::Session,
    following: &mut crate::tasks::positions::Following,
    snapshot: &crate::tasks::positions::Snapshot,
) -> Result<(), actix_ws::Closed> {
    let (moved, left) = following.changes(snapshot);
    for task_id in left {
        let message = json!({"type": "left_queue", "task_id": task_id});
        user_socket.text(message.to_string()).await?;
    }
    for (task_id, place) in moved {
        let (estimated_start_at, estimated_end_at) = match place.estimate {
            Some(crate::tasks::pool::WaitEstimate::At { start, end }) => (Some(start), Some(end)),
            _ => (None, None),
        };
        let notice = TaskNotice::Position {
            position: place.position,
            estimated_start_at,
            estimated_end_at,
        };
        let message = notice_json(task_id, &notice);
        user_socket.text(message.to_string()).await?;
    }
    Ok(())
}

/// An image of one of the caller's tasks (404 for anyone else's, as for a missing one).
#[utoipa::path(
    get, path = "/api/v1/images/{id}", tag = "tasks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "image id, from a task's `images`")),
    responses(
        (status = 200, description = "the image bytes (PNG, JPEG or WebP, from the file's own bytes), labelled as AI-generated (a visible mark and the AIGC metadata; `X-AIGC-Label: 1`), with a strong `ETag`, `Cache-Control: private, no-cache` (revalidated on every use, so a logged-out browser shows none from its cache) and `X-Content-Type-Options: nosniff`", content_type = "image/png"),
        (status = 304, description = "`If-None-Match` names the image's `ETag`"),
        (status = 401, body = crate::http::problem::Problem),
        (status = 404, body = crate::http::problem::Problem),
    )
)]
pub async fn image(
    state: web::Data<AppState>,
    request: actix_web::HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let not_found = || ApiError::NotFound("no such image".into());
    let image_id = Uuid::parse_str(&path).map_err(|_| not_found())?;
    let Some((record, file)) = state.images.open(image_id).await? else {
        return Err(not_found());
    };
    if record.owner != caller.user_id().as_uuid() {
        return Err(not_found());
    }
    // Content-addressed: the digest is a strong validator.
    let etag = format!("\"{}\"", record.sha256);
    let matches = request
        .headers()
        .get(actix_web::http::header::IF_NONE_MATCH)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim() == "*" || value.split(',').any(|tag| tag.trim() == etag));
    let mut response = if matches {
        HttpResponse::NotModified()
    } else {
        HttpResponse::Ok()
    };
    response
        .insert_header((actix_web::http::header::ETAG, etag))
        // Private: the URL is the same for everyone, the answer depends on the token. No-cache:
        // the browser asks again on every use (a 304 while the session holds, by the strong
        // ETag), so after a logout a shared computer's cache shows none of these images.
        .insert_header(("Cache-Control", "private, no-cache"))
        .insert_header(("X-Content-Type-Options", "nosniff"))
        // Every stored image carries both labels (`crate::labels`); this says so beside it.
        .insert_header(("X-AIGC-Label", "1"))
        // Already compressed: the compression layer leaves it alone.
        .insert_header(actix_web::http::header::ContentEncoding::Identity);
    if request
        .query_string()
        .split('&')
        .any(|pair| pair == "download=1")
    {
        // The web app's download link: a file name of ours, never the server's.
        let extension = match record.content_type.as_str() {
            "image/jpeg" => "jpg",
            "image/webp" => "webp",
            _ => "png",
        };
        response.insert_header((
            actix_web::http::header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"zhihui-{image_id}.{extension}\""),
        ));
    }
    if matches {
        return Ok(response.finish());
    }
    // Streamed from disk, 64 KiB at a time: a large image never sits whole in memory.
    let chunks = futures::stream::try_unfold(file, |mut file| async move {
        use tokio::io::AsyncReadExt;
        let mut buffer = vec![0u8; 64 * 1024];
        let read = file.read(&mut buffer).await?;
        if read == 0 {
            return Ok::<_, std::io::Error>(None);
        }
        buffer.truncate(read);
        Ok(Some((actix_web::web::Bytes::from(buffer), file)))
    });
    Ok(response
        .content_type(record.content_type)
        .no_chunking(record.bytes)
        .streaming(chunks))
}

/// An image as the image server produced it, before its labels: admins only, and only when
/// `labels.keep_original` kept it (404 otherwise).
#[utoipa::path(
    get, path = "/api/v1/admin/images/{id}/original", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "image id")),
    responses(
        (status = 200, description = "the unlabelled original (kept only with `labels.keep_original`)", content_type = "image/png"),
        (status = 401, body = crate::http::problem::Problem),
        (status = 403, body = crate::http::problem::Problem),
        (status = 404, body = crate::http::problem::Problem),
    )
)]
pub async fn original_image(
    state: web::Data<AppState>,
    _admin: crate::http::extract::Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let not_found = || ApiError::NotFound("no original kept for this image".into());
    let image_id = Uuid::parse_str(&path).map_err(|_| not_found())?;
    let Some(bytes) = state.images.original(image_id).await? else {
        return Err(not_found());
    };
    let content_type =
        crate::labels::image_content_type(&bytes).unwrap_or("application/octet-stream");
    Ok(HttpResponse::Ok()
        .content_type(content_type)
        .insert_header(("X-Content-Type-Options", "nosniff"))
        .insert_header(("Cache-Control", "private, no-store"))
        .body(bytes))
}
