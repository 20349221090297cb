//! User notifications across zhihui processes: whoever learns something about a task (the
//! dispatcher, a submit, a cancel) publishes it on one Redis pub/sub channel; every process runs
//! one [`NotificationHub`] that listens there and hands each notification to the WebSockets of
//! that user connected to it. So a user connected to process A hears about a task dispatched by
//! process B.
//!
//! Pub/sub delivers at most once and keeps nothing: a notification is a hint that something
//! changed, never the only record of it (the task's state is in its events and read model).

use std::time::Duration;

use anyhow::Context;
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use tokio::sync::{OnceCell, broadcast};
use uuid::Uuid;
use zhihui_domain::task::TaskId;
use zhihui_domain::user::UserId;

use crate::platform::redis_store::RedisStore;

/// Notifications buffered per process for slow sockets; a socket that falls further behind skips
/// ahead (and re-reads what it cares about).
pub const HUB_BUFFER_MAX: usize = 4_096;
/// Pause before the hub subscribes again after losing Redis.
const HUB_RETRY: Duration = Duration::from_millis(500);

/// What happened to a task, for its owner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TaskNotice {
    /// 1-based place in the queue, with its wait estimate when there is one.
    Position {
        position: u64,
        #[serde(default)]
        estimated_start_at: Option<chrono::DateTime<chrono::Utc>>,
        #[serde(default)]
        estimated_end_at: Option<chrono::DateTime<chrono::Utc>>,
    },
    /// Posted to an image server.
    Dispatched,
    Progress {
        value: f64,
        max: f64,
    },
    /// The image server it was posted to stopped answering: what became of it is asked once the
    /// server is back (or it fails at its timeout).
    ServerLost,
    /// Image ids (served at `/api/v1/images/{id}`).
    Succeeded {
        images: Vec<Uuid>,
    },
    Failed {
        reason: String,
    },
    Cancelled,
}

impl TaskNotice {
    /// Every `kind`.
    pub const KINDS: &'static [&'static str] = &[
        "position",
        "dispatched",
        "progress",
        "server_lost",
        "succeeded",
        "failed",
        "cancelled",
    ];

    /// Its `kind` as sent (a bounded metrics label).
    pub fn kind(&self) -> &'static str {
        match self {
            TaskNotice::Position { .. } => "position",
            TaskNotice::Dispatched => "dispatched",
            TaskNotice::Progress { .. } => "progress",
            TaskNotice::ServerLost => "server_lost",
            TaskNotice::Succeeded { .. } => "succeeded",
            TaskNotice::Failed { .. } => "failed",
            TaskNotice::Cancelled => "cancelled",
        }
    }
}

/// One message on the channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Envelope {
    Task {
        user_id: Uuid,
        task_id: TaskId,
        notice: TaskNotice,
    },
    /// The queue's order changed (a claim, a cancel, a prioritise): sockets re-read the places
    /// of their users' queued tasks.
    QueueMoved,
    /// A user's sessions ended (logout: the one of `token_digest`; a password or role change:
    /// all, `None`): their sockets close.
    SessionsEnded {
        user_id: Uuid,
        token_digest: Option<String>,
    },
    /// Points were credited to a user by someone else (an admin's grant): their pages show the
    /// new balance at once.
    Credited {
        user_id: Uuid,
        amount: String,
        reason: String,
    },
    /// A promotion claim was persisted: granted, or refused with its reason.
    Claim {
        user_id: Uuid,
        promotion_id: Uuid,
        claim_id: Uuid,
        granted: bool,
        reason: Option<String>,
    },
    /// A work was published, unpublished or hidden (`None`: the lists changed): every process
    /// drops its cached copy at once.
    GalleryChanged { work_id: Option<Uuid> },
    /// A user changed their display name: every process drops its copies that show it.
    UserRenamed { user_id: Uuid },
    /// Never published: this process's subscription was opened again after it ended, and what
    /// was sent meanwhile is lost. Whoever keeps copies that notifications invalidate drops
    /// them all.
    Resubscribed,
}

/// Publishes notifications (cheap to clone).
#[derive(Debug, Clone)]
pub struct Notifier {
    redis: RedisStore,
}

impl Notifier {
    pub fn new(redis: RedisStore) -> Notifier {
        Notifier { redis }
    }

    fn channel(redis: &RedisStore) -> String {
        redis.key("notifications")
    }

    pub async fn publish(&self, envelope: &Envelope) -> anyhow::Result<()> {
        let payload = serde_json::to_string(envelope).context("encoding a notification")?;
        let mut connection = self.redis.connection().await?;
        let _receivers: i64 = connection
            .publish(Self::channel(&self.redis), payload)
            .await
            .context("publishing a notification")?;
        Ok(())
    }

    /// Publish, logging a failure: a lost hint must never fail the work that produced it.
    pub async fn tell(&self, user_id: UserId, task_id: TaskId, notice: TaskNotice) {
        let kind = notice.kind();
        let envelope = Envelope::Task {
            user_id: user_id.as_uuid(),
            task_id,
            notice,
        };
        match self.publish(&envelope).await {
            Ok(()) => {
                metrics::counter!("zhihui_notifications_sent_total", "kind" => kind).increment(1)
            }
            Err(error) => {
                tracing::warn!(%task_id, error = %crate::platform::telemetry::error_chain(&error), "notification not sent");
            }
        }
    }

    pub async fn queue_moved(&self) {
        if let Err(error) = self.publish(&Envelope::QueueMoved).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "queue notification not sent");
        }
    }
}

/// This process's listener on the channel (started on first use, by the first WebSocket).
#[derive(Debug, Clone)]
pub struct NotificationHub {
    redis: RedisStore,
    sender: broadcast::Sender<Envelope>,
    started: std::sync::Arc<OnceCell<()>>,
}

impl NotificationHub {
    pub fn new(redis: RedisStore) -> NotificationHub {
        let (sender, _) = broadcast::channel(HUB_BUFFER_MAX);
        NotificationHub {
            redis,
            sender,
            started: std::sync::Arc::new(OnceCell::new()),
        }
    }

    /// A receiver of every notification this process hears from now on. The first call
    /// subscribes to Redis and returns once the subscription is confirmed.
    pub async fn subscribe(&self) -> anyhow::Result<broadcast::Receiver<Envelope>> {
        let receiver = self.sender.subscribe();
        self.started
            .get_or_try_init(|| async {
                let pubsub = self.open().await?;
                let hub = self.clone();
                tokio::spawn(async move { hub.listen(pubsub).await });
                anyhow::Ok(())
            })
            .await?;
        Ok(receiver)
    }

    async fn open(&self) -> anyhow::Result<redis::aio::PubSub> {
        let mut pubsub = self.redis.pubsub().await?;
        pubsub
            .subscribe(Notifier::channel(&self.redis))
            .await
            .context("subscribing to notifications")?;
        Ok(pubsub)
    }

    async fn listen(self, first: redis::aio::PubSub) {
        use futures::StreamExt;
        let mut pubsub = Some(first);
        loop {
            let connection = match pubsub.take() {
                Some(connection) => connection,
                None => match self.open().await {
                    Ok(connection) => {
                        // No receivers is fine: nobody of this process keeps such copies.
                        drop(self.sender.send(Envelope::Resubscribed));
                        connection
                    }
                    Err(error) => {
                        tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "notification hub cannot subscribe; retrying");
                        tokio::time::sleep(HUB_RETRY).await;
                        continue;
                    }
                },
            };
            let mut messages = connection.into_on_message();
            while let Some(message) = messages.next().await {
                let Ok(payload) = message.get_payload::<String>() else {
                    continue;
                };
                match serde_json::from_str::<Envelope>(&payload) {
                    // No receivers is fine: nobody of this process is connected.
                    Ok(envelope) => drop(self.sender.send(envelope)),
                    Err(error) => tracing::warn!(%error, "undecodable notification skipped"),
                }
            }
            tracing::warn!("notification subscription ended; subscribing again");
            tokio::time::sleep(HUB_RETRY).await;
        }
    }
}

/// The user sockets open in this process, counted per user: a user opens at most
/// `http.sockets_per_user_max` (each costs a task, a subscription and Redis reads).
#[derive(Debug, Clone)]
pub struct UserSockets {
    open: std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<zhihui_domain::user::UserId, usize>>,
    >,
    per_user_max: usize,
}

/// One open socket's place in [`UserSockets`], given back when dropped.
#[derive(Debug)]
pub struct SocketPlace {
    open: std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<zhihui_domain::user::UserId, usize>>,
    >,
    user_id: zhihui_domain::user::UserId,
}

impl UserSockets {
    pub fn new(per_user_max: usize) -> UserSockets {
        UserSockets {
            open: std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new())),
            per_user_max,
        }
    }

    /// A place for one more socket of `user_id`, `None` when the user has the most already.
    pub fn take(&self, user_id: zhihui_domain::user::UserId) -> Option<SocketPlace> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(user_id).or_insert(0);
        if *count >= self.per_user_max {
            return None;
        }
        *count += 1;
        Some(SocketPlace {
            open: self.open.clone(),
            user_id,
        })
    }

    /// Sockets of `user_id` open in this process.
    pub fn count(&self, user_id: zhihui_domain::user::UserId) -> usize {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.get(&user_id).copied().unwrap_or(0)
    }
}

impl Drop for SocketPlace {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.user_id) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.user_id);
            }
        }
    }
}
