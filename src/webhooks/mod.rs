//! Webhooks: a user's program is called back when its tasks end and when points are credited to
//! it, as the Standard Webhooks specification says (`signing.rs`), only at addresses that are not
//! the platform's own or anyone's inner network (`safety.rs`), retried on a schedule until it
//! answers, and logged attempt by attempt (`delivery.rs`).
//!
//! Endpoints are events (`webhook-<id>` streams, `domain/src/webhook.rs`), changed here on their
//! owner's word. Delivery is driven from the event log by one process manager at a time (the
//! router turns events into messages in the same transaction as its checkpoint; the sender sends
//! what is due), so a crash, a restart or a Redis flush loses no message, and a new leader sends
//! again at most what its predecessor sent without recording (at least once; the `webhook-id`
//! lets a receiver drop a repeat).

pub mod delivery;
pub mod safety;
pub mod signing;

use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use secrecy::ExposeSecret;
use serde::Serialize;
use uuid::Uuid;
use zhihui_domain::user::UserId;
use zhihui_domain::webhook::{
    Endpoint, EndpointCommand, EndpointError, EndpointState, WebhookEventType, endpoint_stream,
};
use zhihui_domain::webhook_slots::{EndpointSlots, SlotCommand, SlotError, slots_stream};

use crate::platform::clock::Clock;
use crate::platform::command::{self, CommandError, RetryPolicy};
use crate::platform::configuration::WebhookSettings;
use crate::platform::event_store::{AnyEventStore, EventMetadata};

/// An endpoint as its owner sees it (never its secret).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct EndpointView {
    pub endpoint_id: Uuid,
    pub url: String,
    #[schema(value_type = Vec<String>)]
    pub event_types: Vec<WebhookEventType>,
    /// The secret generation that signs now (a rotation adds one).
    pub secret_generation: u32,
    /// Until then the previous generation signs too.
    pub previous_secret_until: Option<DateTime<Utc>>,
    /// Why it is disabled, if it is: no message is sent to it until it is enabled again.
    pub disabled_reason: Option<String>,
    /// Failed attempts in a row, and since when.
    pub consecutive_failures: i32,
    pub failing_since: Option<DateTime<Utc>>,
    pub created_at: Option<DateTime<Utc>>,
}

/// An endpoint with its secret: the answer of a registration or a rotation, shown once.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct EndpointWithSecret {
    #[serde(flatten)]
    pub endpoint: EndpointView,
    /// `whsec_...`: load it into a Standard Webhooks library to verify deliveries.
    pub secret: String,
}

/// One message to an endpoint, with its attempts.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DeliveryView {
    /// The `webhook-id` (stable across retries and redeliveries).
    pub message_id: Uuid,
    pub event_type: String,
    /// `pending`, `delivered`, `failed` (retries exhausted) or `skipped` (the endpoint was
    /// disabled or removed).
    pub status: String,
    pub occurred_at: DateTime<Utc>,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub attempts: Vec<AttemptView>,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct AttemptView {
    pub attempt: i32,
    pub attempted_at: DateTime<Utc>,
    /// The answer's status; absent when there was none.
    pub status: Option<i32>,
    pub latency_ms: i32,
    pub error: Option<String>,
    /// The answer's first bytes.
    pub response: Option<String>,
}

/// The body of a `task.succeeded`, `task.failed` or `task.cancelled` delivery: the task as of
/// its end (image URLs absolute: fetch them with a key that has `tasks:read`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TaskMessage {
    /// `task.succeeded`, `task.failed` or `task.cancelled`.
    #[serde(rename = "type")]
    pub kind: String,
    /// When the task ended.
    pub timestamp: DateTime<Utc>,
    pub data: crate::tasks::view::TaskView,
}

/// The body of a `points.credited` delivery.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CreditMessage {
    /// `points.credited`.
    #[serde(rename = "type")]
    pub kind: String,
    /// When the points were credited.
    pub timestamp: DateTime<Utc>,
    pub data: Credit,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Credit {
    pub user_id: Uuid,
    /// `grant`, `redeem_code`, `check_in_bonus` or `promotion`.
    pub kind: String,
    /// Points credited (a decimal string, two places at most).
    pub amount: String,
    /// The grant's reason, or what was redeemed or claimed.
    pub reason: Option<String>,
    /// The balance after the credit.
    pub available: String,
    pub frozen: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error(transparent)]
    Unsafe(#[from] safety::UnsafeUrl),
    #[error(transparent)]
    Rejected(EndpointError),
    #[error("no such webhook endpoint")]
    NotFound,
    #[error("this user has {max} webhook endpoints, the most: remove one first")]
    TooMany { max: i64 },
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

impl From<CommandError<EndpointError>> for WebhookError {
    fn from(error: CommandError<EndpointError>) -> WebhookError {
        match error {
            CommandError::Rejected(EndpointError::NotFound) => WebhookError::NotFound,
            CommandError::Rejected(rejected) => WebhookError::Rejected(rejected),
            other => WebhookError::Unexpected(other.into_anyhow("a command on an endpoint")),
        }
    }
}

/// A slot command's failure (its refusal is handled where it is asked): the store's error as it
/// is, so that a store away stays a 503.
fn slot_error(error: CommandError<SlotError>) -> WebhookError {
    match error {
        CommandError::Store(error) => WebhookError::Unexpected(error),
        other => WebhookError::Unexpected(anyhow::Error::new(other)),
    }
}

#[derive(Debug, Clone)]
pub struct WebhookService {
    store: AnyEventStore,
    pool: Pool,
    clock: Clock,
    settings: WebhookSettings,
    allowed: safety::Allowed,
}

impl WebhookService {
    pub fn new(
        store: AnyEventStore,
        pool: Pool,
        clock: Clock,
        settings: WebhookSettings,
    ) -> anyhow::Result<WebhookService> {
        let allowed = safety::Allowed::parse(&settings.allowed_networks)?;
        Ok(WebhookService {
            store,
            pool,
            clock,
            settings,
            allowed,
        })
    }

    pub fn settings(&self) -> &WebhookSettings {
        &self.settings
    }

    pub fn allowed(&self) -> &safety::Allowed {
        &self.allowed
    }

    /// The secret bytes of an endpoint's `generation`.
    pub fn secret(&self, endpoint_id: Uuid, generation: u32) -> [u8; 32] {
        signing::secret_bytes(
            self.settings.signing_key.expose_secret().as_bytes(),
            endpoint_id,
            generation,
        )
    }

    async fn execute(
        &self,
        endpoint_id: Uuid,
        command: EndpointCommand,
        metadata: &EventMetadata,
    ) -> Result<EndpointState, WebhookError> {
        Ok(command::execute::<Endpoint>(
            &self.store,
            &endpoint_stream(endpoint_id),
            &command,
            metadata,
            RetryPolicy::default(),
        )
        .await?
        .state)
    }

    /// The endpoint on its stream's latest version, if it is `owner`'s (`None` for anyone's
    /// else: 404, as for a task).
    pub async fn owned(
        &self,
        owner: Option<UserId>,
        endpoint_id: Uuid,
    ) -> Result<EndpointState, WebhookError> {
        let state = command::load::<Endpoint>(&self.store, &endpoint_stream(endpoint_id))
            .await?
            .state;
        if !state.exists() || owner.is_some_and(|owner| state.user_id != Some(owner)) {
            return Err(WebhookError::NotFound);
        }
        Ok(state)
    }

    fn view_of(state: &EndpointState) -> EndpointView {
        EndpointView {
            endpoint_id: state.endpoint_id.unwrap_or_default(),
            url: state.url.clone(),
            event_types: state.event_types.clone(),
            secret_generation: state.generation,
            previous_secret_until: state.previous_until,
            disabled_reason: state.disabled.clone(),
            consecutive_failures: 0,
            failing_since: None,
            created_at: None,
        }
    }

    /// Register an endpoint for `user_id`: its URL checked (every address it resolves to),
    /// recorded, and its secret returned once.
    pub async fn register(
        &self,
        user_id: UserId,
        url: &str,
        event_types: Vec<WebhookEventType>,
        metadata: &EventMetadata,
    ) -> Result<EndpointWithSecret, WebhookError> {
        // Kept as parsed (scheme and host in lower case, a name in punycode): `HTTP://Shop.example`
        // is the same endpoint as `http://shop.example`, and the domain's rules read it so.
        let checked = safety::check_url(url.trim(), &self.allowed).await?;
        let url = checked.as_str();
        let endpoint_id = Uuid::now_v7();
        // Its slot first, decided on the user's slots stream: registrations sent at once pass
        // there one at a time, so the limit holds whatever the race.
        self.take_slot(user_id, endpoint_id, metadata).await?;
        let registered = self
            .execute(
                endpoint_id,
                EndpointCommand::Register {
                    endpoint_id,
                    user_id,
                    url: url.to_owned(),
                    event_types,
                    at: self.clock.now(),
                },
                metadata,
            )
            .await;
        let state = match registered {
            Ok(state) => state,
            Err(error) => {
                // Not made: its slot back (one a crash left taken is freed by a later refusal).
                if let Err(freeing) = self.free_slot(user_id, endpoint_id, metadata).await {
                    tracing::warn!(error = %freeing, %endpoint_id, "a slot of an endpoint never made was not freed");
                }
                return Err(error);
            }
        };
        let mut endpoint = Self::view_of(&state);
        endpoint.created_at = Some(self.clock.now());
        Ok(EndpointWithSecret {
            endpoint,
            secret: signing::secret_text(&self.secret(endpoint_id, state.generation)),
        })
    }

    /// Take a slot for `endpoint_id` among the user's at most `endpoints_per_user_max`, counting
    /// the endpoints listed for the user as well (those made before slots were recorded hold
    /// none). Refused once: slots whose endpoint is gone are freed, and it is asked again.
    async fn take_slot(
        &self,
        user_id: UserId,
        endpoint_id: Uuid,
        metadata: &EventMetadata,
    ) -> Result<(), WebhookError> {
        let max = self.settings.endpoints_per_user_max;
        for first in [true, false] {
            let take = SlotCommand::Take {
                endpoint_id,
                listed: self.listed_ids(user_id).await?,
                max: u32::try_from(max).unwrap_or(u32::MAX),
                at: self.clock.now(),
            };
            match command::execute::<EndpointSlots>(
                &self.store,
                &slots_stream(user_id),
                &take,
                metadata,
                RetryPolicy::default(),
            )
            .await
            {
                Ok(_) => return Ok(()),
                Err(CommandError::Rejected(SlotError::TooMany { .. })) => {
                    if !first || !self.free_stale_slots(user_id, metadata).await? {
                        break;
                    }
                }
                Err(other) => return Err(slot_error(other)),
            }
        }
        Err(WebhookError::TooMany { max })
    }

    /// Free the slots whose endpoint is not there (a process died between a slot and its
    /// registration, or between a removal and its slot's freeing), once a minute old: a younger
    /// one's registration may be under way. Whether any was freed.
    async fn free_stale_slots(
        &self,
        user_id: UserId,
        metadata: &EventMetadata,
    ) -> Result<bool, WebhookError> {
        let slots = command::load::<EndpointSlots>(&self.store, &slots_stream(user_id))
            .await?
            .state;
        let settled_before = self.clock.now() - chrono::Duration::minutes(1);
        let mut freed = false;
        for (endpoint_id, taken_at) in slots {
            if taken_at > settled_before {
                continue;
            }
            let endpoint = command::load::<Endpoint>(&self.store, &endpoint_stream(endpoint_id))
                .await?
                .state;
            if !endpoint.exists() {
                self.free_slot(user_id, endpoint_id, metadata).await?;
                freed = true;
            }
        }
        Ok(freed)
    }

    async fn free_slot(
        &self,
        user_id: UserId,
        endpoint_id: Uuid,
        metadata: &EventMetadata,
    ) -> Result<(), WebhookError> {
        command::execute::<EndpointSlots>(
            &self.store,
            &slots_stream(user_id),
            &SlotCommand::Free {
                endpoint_id,
                at: self.clock.now(),
            },
            metadata,
            RetryPolicy::default(),
        )
        .await
        .map_err(slot_error)?;
        Ok(())
    }

    /// The user's endpoints the router's table lists as not removed.
    async fn listed_ids(&self, user_id: UserId) -> Result<Vec<Uuid>, WebhookError> {
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let rows = client
            .query(
                "SELECT endpoint_id FROM webhook_endpoints WHERE user_id = $1 AND NOT removed",
                &[&user_id.as_uuid()],
            )
            .await
            .context("listing endpoints")?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// A user's endpoints (as the router last recorded them), newest first.
    pub async fn list(&self, user_id: UserId) -> anyhow::Result<Vec<EndpointView>> {
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let rows = client
            .query(
                "SELECT endpoint_id, url, event_types, generation, previous_until, disabled_reason,
                        consecutive_failures, failing_since, created_at
                   FROM webhook_endpoints WHERE user_id = $1 AND NOT removed
                  ORDER BY created_at DESC",
                &[&user_id.as_uuid()],
            )
            .await
            .context("reading endpoints")?;
        Ok(rows
            .iter()
            .map(|row| EndpointView {
                endpoint_id: row.get(0),
                url: row.get(1),
                event_types: row
                    .get::<_, Vec<String>>(2)
                    .iter()
                    .filter_map(|text| WebhookEventType::parse(text))
                    .collect(),
                secret_generation: u32::try_from(row.get::<_, i32>(3)).unwrap_or(1),
                previous_secret_until: row.get(4),
                disabled_reason: row.get(5),
                consecutive_failures: row.get(6),
                failing_since: row.get(7),
                created_at: Some(row.get(8)),
            })
            .collect())
    }

    /// Start a new secret; the previous one keeps signing for `webhooks.rotation_overlap_ms`.
    pub async fn rotate(
        &self,
        owner: UserId,
        endpoint_id: Uuid,
        metadata: &EventMetadata,
    ) -> Result<EndpointWithSecret, WebhookError> {
        self.owned(Some(owner), endpoint_id).await?;
        let now = self.clock.now();
        let overlap = chrono::Duration::milliseconds(
            i64::try_from(self.settings.rotation_overlap_ms).unwrap_or(i64::MAX / 2),
        );
        let state = self
            .execute(
                endpoint_id,
                EndpointCommand::RotateSecret {
                    previous_until: now + overlap,
                    at: now,
                },
                metadata,
            )
            .await?;
        Ok(EndpointWithSecret {
            endpoint: Self::view_of(&state),
            secret: signing::secret_text(&self.secret(endpoint_id, state.generation)),
        })
    }

    /// Disable (`owner` `None`: the sender, on a 410 or a run of failures), enable, remove.
    pub async fn change(
        &self,
        owner: Option<UserId>,
        endpoint_id: Uuid,
        command: EndpointCommand,
        metadata: &EventMetadata,
    ) -> Result<EndpointView, WebhookError> {
        let before = self.owned(owner, endpoint_id).await?;
        let removing = matches!(command, EndpointCommand::Remove { .. });
        let state = self.execute(endpoint_id, command, metadata).await?;
        if removing && let Some(user_id) = before.user_id {
            // A slot left taken here is freed by a later refusal (its endpoint is gone).
            if let Err(error) = self.free_slot(user_id, endpoint_id, metadata).await {
                tracing::warn!(error = %error, %endpoint_id, "a removed endpoint's slot was not freed");
            }
        }
        Ok(Self::view_of(&state))
    }

    /// An endpoint's messages, newest first, each with its attempts.
    pub async fn deliveries(
        &self,
        owner: UserId,
        endpoint_id: Uuid,
        limit: i64,
    ) -> Result<Vec<DeliveryView>, WebhookError> {
        self.owned(Some(owner), endpoint_id).await?;
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let messages = client
            .query(
                "SELECT message_id, event_type, status, occurred_at, next_attempt_at, delivered_at
                   FROM webhook_messages WHERE endpoint_id = $1
                  ORDER BY occurred_at DESC, message_id DESC LIMIT $2",
                &[&endpoint_id, &limit],
            )
            .await
            .context("reading deliveries")?;
        let ids: Vec<Uuid> = messages.iter().map(|row| row.get(0)).collect();
        let attempts = client
            .query(
                "SELECT message_id, attempt, attempted_at, status, latency_ms, error, response
                   FROM webhook_attempts WHERE endpoint_id = $1 AND message_id = ANY($2)
                  ORDER BY attempt",
                &[&endpoint_id, &ids],
            )
            .await
            .context("reading attempts")?;
        Ok(messages
            .iter()
            .map(|row| {
                let message_id: Uuid = row.get(0);
                DeliveryView {
                    message_id,
                    event_type: row.get(1),
                    status: row.get(2),
                    occurred_at: row.get(3),
                    next_attempt_at: row.get(4),
                    delivered_at: row.get(5),
                    attempts: attempts
                        .iter()
                        .filter(|attempt| attempt.get::<_, Uuid>(0) == message_id)
                        .map(|attempt| AttemptView {
                            attempt: attempt.get(1),
                            attempted_at: attempt.get(2),
                            status: attempt.get(3),
                            latency_ms: attempt.get(4),
                            error: attempt.get(5),
                            response: attempt.get(6),
                        })
                        .collect(),
                }
            })
            .collect())
    }

    /// Send messages again: one (`message_id`), or every one that happened in `[since, until)`.
    /// Same `webhook-id`s; their attempts continue where they were. Returns how many.
    pub async fn redeliver(
        &self,
        owner: UserId,
        endpoint_id: Uuid,
        message_id: Option<Uuid>,
        range: Option<(DateTime<Utc>, DateTime<Utc>)>,
    ) -> Result<u64, WebhookError> {
        self.owned(Some(owner), endpoint_id).await?;
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let now = self.clock.now();
        let changed = match (message_id, range) {
            (Some(message_id), _) => client
                .execute(
                    "UPDATE webhook_messages SET status = 'pending', next_attempt_at = $3
                      WHERE endpoint_id = $1 AND message_id = $2",
                    &[&endpoint_id, &message_id, &now],
                )
                .await
                .context("redelivering a message")?,
            (None, Some((since, until))) => client
                .execute(
                    "UPDATE webhook_messages SET status = 'pending', next_attempt_at = $4
                      WHERE endpoint_id = $1 AND occurred_at >= $2 AND occurred_at < $3",
                    &[&endpoint_id, &since, &until, &now],
                )
                .await
                .context("redelivering messages")?,
            (None, None) => 0,
        };
        if message_id.is_some() && changed == 0 {
            return Err(WebhookError::NotFound);
        }
        Ok(changed)
    }
}
