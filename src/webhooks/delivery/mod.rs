//! The webhook process manager (one leader across processes, `webhooks`): the router follows the
//! log and turns each task end and each credit into one message per endpoint of its owner that
//! wants it (message id = the event's id), writing the messages, the endpoints it follows and its
//! checkpoint in one transaction; the sender sends what is due, signs each attempt, logs it, and
//! reschedules a failure (the retry schedule with jitter, or the answer's `Retry-After` when
//! longer). A 410 disables the endpoint; so does a long run of failures. Both are steps tests
//! can drive: [`Deliveries::route_once`], [`Deliveries::send_due_once`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use futures::StreamExt;
use rand::Rng;
use serde_json::Value;
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::AccountEvent;
use zhihui_domain::webhook::{
    ENDPOINT_EVENT_TYPES, Endpoint, EndpointCommand, EndpointState, WebhookEventType,
    endpoint_stream,
};

use super::WebhookService;
use crate::platform::clock::Clock;
use crate::platform::event_store::{
    AnyEventStore, Direction, EventFilter, EventMetadata, EventStore, Position, ReadFrom,
    RecordedEvent,
};

mod sender;

/// The leader lock and the router's checkpoint row.
pub const LEADER: &str = "webhooks";
/// The process manager's actor on the events it appends (disabling an endpoint).
const ACTOR: &str = "system:webhooks";

/// What the router made of one event: its type, its owner, its payload.
struct Made {
    event_type: WebhookEventType,
    owner: Uuid,
    body: Value,
}

/// One step of a routed page: an endpoint's state, or a message for its owner's endpoints.
enum Step {
    Endpoint {
        endpoint_id: Uuid,
        state: Box<EndpointState>,
        version: i64,
    },
    Message {
        source_id: Uuid,
        occurred_at: DateTime<Utc>,
        message: Made,
    },
}

/// One due message with its endpoint.
struct Due {
    endpoint_id: Uuid,
    message_id: Uuid,
    body: Value,
    attempts: i32,
    url: String,
    generation: u32,
    previous_until: Option<DateTime<Utc>>,
    disabled: bool,
    removed: bool,
    consecutive_failures: i32,
    failing_since: Option<DateTime<Utc>>,
}

/// What one round of the sender did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendReport {
    pub attempted: usize,
    pub delivered: usize,
    pub failed: usize,
    pub skipped: usize,
}

#[derive(Debug, Clone)]
pub struct Deliveries {
    service: WebhookService,
    store: AnyEventStore,
    pool: Pool,
    clock: Clock,
    client: reqwest::Client,
    wake: Arc<tokio::sync::Notify>,
    batch_size: usize,
}

fn filter() -> EventFilter {
    let mut types: Vec<String> = [
        "TaskSucceeded",
        "TaskFailed",
        "TaskCancelled",
        "PointsGranted",
        "PointsCredited",
    ]
    .map(str::to_owned)
    .to_vec();
    types.extend(ENDPOINT_EVENT_TYPES.map(str::to_owned));
    EventFilter::EventTypes(types)
}

impl Deliveries {
    pub fn new(
        service: WebhookService,
        store: AnyEventStore,
        pool: Pool,
        clock: Clock,
        batch_size: usize,
    ) -> anyhow::Result<Deliveries> {
        let settings = service.settings();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_millis(settings.connect_timeout_ms))
            .timeout(Duration::from_millis(settings.timeout_ms))
            .dns_resolver(Arc::new(super::safety::SafeResolver {
                allowed: service.allowed().clone(),
            }))
            .no_proxy()
            .user_agent("zhihui-webhooks/1")
            .build()
            .context("building the webhook client")?;
        Ok(Deliveries {
            service,
            store,
            pool,
            clock,
            client,
            wake: Arc::new(tokio::sync::Notify::new()),
            batch_size,
        })
    }

    // ---------------------------------------------------------------------------------------
    // The router.

    /// Route one page of the log after the checkpoint. Returns the messages made (`None` when
    /// caught up).
    pub async fn route_once(&self) -> anyhow::Result<Option<usize>> {
        let after = crate::platform::projector::stored_position(&self.pool, LEADER).await?;
        let slice = self
            .store
            .read_all(after, self.batch_size, &filter())
            .await
            .context("reading the log")?;
        let Some(scanned_to) = slice.scanned_to.filter(|to| Some(*to) != after) else {
            return Ok(None);
        };
        Ok(Some(self.route(&slice.events, scanned_to).await?))
    }

    /// Route until caught up; the messages made.
    pub async fn route_all(&self) -> anyhow::Result<usize> {
        let mut made = 0;
        while let Some(count) = self.route_once().await? {
            made += count;
        }
        Ok(made)
    }

    /// Turn `events` (a page of the log ending at `scanned_to`) into endpoints, messages and the
    /// checkpoint, in one transaction, in the log's order: an endpoint is sent what happened
    /// after it was registered, while it was enabled (what happened while it was disabled is
    /// kept, skipped).
    async fn route(&self, events: &[RecordedEvent], scanned_to: Position) -> anyhow::Result<usize> {
        let mut steps: Vec<Step> = Vec::new();
        for recorded in events {
            if ENDPOINT_EVENT_TYPES.contains(&recorded.event_type.as_str()) {
                let Some(endpoint_id) = recorded
                    .stream
                    .strip_prefix("webhook-")
                    .and_then(|id| Uuid::parse_str(id).ok())
                else {
                    continue;
                };
                let state = self
                    .endpoint_at(endpoint_id, recorded.stream_version)
                    .await?;
                steps.push(Step::Endpoint {
                    endpoint_id,
                    state: Box::new(state),
                    version: i64::try_from(recorded.stream_version).unwrap_or(i64::MAX),
                });
            } else if let Some(message) = self.message_of(recorded).await? {
                steps.push(Step::Message {
                    source_id: recorded.id,
                    occurred_at: recorded.recorded_at,
                    message,
                });
            }
        }
        let mut client = self.pool.get().await.context("getting a connection")?;
        let transaction = client.transaction().await.context("beginning")?;
        let now = self.clock.now();
        let mut count = 0;
        for step in &steps {
            match step {
                Step::Endpoint {
                    endpoint_id,
                    state,
                    version,
                } => {
                    let Some(user_id) = state.user_id else {
                        continue;
                    };
                    let types: Vec<&str> =
                        state.event_types.iter().map(|kind| kind.as_str()).collect();
                    transaction
                        .execute(
                            "INSERT INTO webhook_endpoints AS e (endpoint_id, user_id, url,
                                    event_types, generation, previous_until, disabled_reason,
                                    removed, created_at, stream_version)
                             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
                             ON CONFLICT (endpoint_id) DO UPDATE SET
                                url = EXCLUDED.url, event_types = EXCLUDED.event_types,
                                generation = EXCLUDED.generation,
                                previous_until = EXCLUDED.previous_until,
                                disabled_reason = EXCLUDED.disabled_reason,
                                removed = EXCLUDED.removed,
                                stream_version = EXCLUDED.stream_version,
                                consecutive_failures = CASE WHEN EXCLUDED.disabled_reason IS NULL
                                    AND e.disabled_reason IS NOT NULL THEN 0
                                    ELSE e.consecutive_failures END,
                                failing_since = CASE WHEN EXCLUDED.disabled_reason IS NULL
                                    AND e.disabled_reason IS NOT NULL THEN NULL
                                    ELSE e.failing_since END
                             WHERE e.stream_version < EXCLUDED.stream_version",
                            &[
                                endpoint_id,
                                &user_id.as_uuid(),
                                &state.url,
                                &types,
                                &i32::try_from(state.generation).unwrap_or(i32::MAX),
                                &state.previous_until,
                                &state.disabled,
                                &state.removed,
                                &now,
                                version,
                            ],
                        )
                        .await
                        .context("recording an endpoint")?;
                }
                Step::Message {
                    source_id,
                    occurred_at,
                    message,
                } => {
                    let rows = transaction
                        .query(
                            "SELECT endpoint_id, disabled_reason IS NOT NULL
                               FROM webhook_endpoints
                              WHERE user_id = $1 AND NOT removed AND $2 = ANY(event_types)",
                            &[&message.owner, &message.event_type.as_str()],
                        )
                        .await
                        .context("finding endpoints")?;
                    for row in &rows {
                        let endpoint_id: Uuid = row.get(0);
                        let disabled: bool = row.get(1);
                        // A disabled endpoint's messages are kept (skipped): a redelivery of
                        // the time it was off sends them.
                        let (status, next): (&str, Option<DateTime<Utc>>) = if disabled {
                            ("skipped", None)
                        } else {
                            ("pending", Some(now))
                        };
                        count += transaction
                            .execute(
                                "INSERT INTO webhook_messages (endpoint_id, message_id,
                                        event_type, payload, occurred_at, created_at, status,
                                        next_attempt_at)
                                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                                 ON CONFLICT (endpoint_id, message_id) DO NOTHING",
                                &[
                                    &endpoint_id,
                                    source_id,
                                    &message.event_type.as_str(),
                                    &message.body,
                                    occurred_at,
                                    &now,
                                    &status,
                                    &next,
                                ],
                            )
                            .await
                            .context("recording a message")?;
                    }
                }
            }
        }
        let (commit, prepare) = crate::platform::projector::position_to_sql(Some(scanned_to))?;
        transaction
            .execute(
                "INSERT INTO projection_checkpoints AS c (projection, commit_position, prepare_position)
                 VALUES ($1, $2, $3)
                 ON CONFLICT (projection) DO UPDATE
                    SET commit_position = EXCLUDED.commit_position,
                        prepare_position = EXCLUDED.prepare_position, updated_at = now()",
                &[&LEADER, &commit, &prepare],
            )
            .await
            .context("storing the router's checkpoint")?;
        transaction.commit().await.context("committing")?;
        if count > 0 {
            self.wake.notify_one();
        }
        Ok(usize::try_from(count).unwrap_or(usize::MAX))
    }

    /// An endpoint as of `version` of its stream (the state the router records with that event).
    async fn endpoint_at(&self, endpoint_id: Uuid, version: u64) -> anyhow::Result<EndpointState> {
        let events = self
            .store
            .read_stream(
                &endpoint_stream(endpoint_id),
                Direction::Forwards,
                ReadFrom::Start,
                crate::platform::command::STREAM_READ_PAGE_MAX,
            )
            .await
            .context("reading an endpoint")?;
        let mut state = <Endpoint as zhihui_domain::Decider>::initial_state();
        for recorded in events
            .iter()
            .take_while(|event| event.stream_version <= version)
        {
            let event = <Endpoint as zhihui_domain::Decider>::Event::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .context("decoding an endpoint event")?;
            state = <Endpoint as zhihui_domain::Decider>::evolve(state, &event);
        }
        Ok(state)
    }

    /// The message an event makes, if it makes one: a task's end (with its view), a credit.
    async fn message_of(&self, recorded: &RecordedEvent) -> anyhow::Result<Option<Made>> {
        let kind = match recorded.event_type.as_str() {
            "TaskSucceeded" => WebhookEventType::TaskSucceeded,
            "TaskFailed" => WebhookEventType::TaskFailed,
            "TaskCancelled" => WebhookEventType::TaskCancelled,
            "PointsGranted" | "PointsCredited" => WebhookEventType::PointsCredited,
            _ => return Ok(None),
        };
        let (owner, body) = if kind == WebhookEventType::PointsCredited {
            let Some(owner) = recorded
                .stream
                .strip_prefix("account-")
                .and_then(|id| Uuid::parse_str(id).ok())
            else {
                return Ok(None);
            };
            let event = AccountEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .context("decoding an account event")?;
            let balance = event.balance_after();
            let message = super::CreditMessage {
                kind: kind.as_str().to_owned(),
                timestamp: recorded.recorded_at,
                data: super::Credit {
                    user_id: owner,
                    kind: zhihui_projections::accounts::kind_of(&event).to_owned(),
                    amount: event.amount().to_string(),
                    reason: zhihui_projections::accounts::reason_of(&event),
                    available: balance.available.to_string(),
                    frozen: balance.frozen.to_string(),
                    at: event.at(),
                },
            };
            (
                owner,
                serde_json::to_value(message).context("encoding a credit")?,
            )
        } else {
            let Some(task_id) = recorded
                .stream
                .strip_prefix("task-")
                .and_then(|id| Uuid::parse_str(id).ok())
            else {
                return Ok(None);
            };
            // The task as of this end (its stream up to the event: a replay says the same).
            let record =
                crate::tasks::view::record_at(&self.store, task_id, Some(recorded.stream_version))
                    .await?;
            let Some(record) = record else {
                return Ok(None);
            };
            let owner = record.user_id.as_uuid();
            let base = self
                .service
                .settings()
                .public_base_url
                .trim_end_matches('/');
            let mut view = crate::tasks::view::view_of(record);
            for image in &mut view.images {
                image.url = format!("{base}{}", image.url);
            }
            let message = super::TaskMessage {
                kind: kind.as_str().to_owned(),
                timestamp: recorded.recorded_at,
                data: view,
            };
            (
                owner,
                serde_json::to_value(message).context("encoding a task view")?,
            )
        };
        Ok(Some(Made {
            event_type: kind,
            owner,
            body,
        }))
    }

    // ---------------------------------------------------------------------------------------
    // The sender.

    /// Run forever: lead when possible; route from the log and send what is due.
    pub async fn run(self) {
        let retry = Duration::from_millis(1000);
        loop {
            let lock = match crate::platform::leader::try_lead(&self.pool, LEADER).await {
                Ok(Some(lock)) => lock,
                Ok(None) => {
                    tokio::time::sleep(retry).await;
                    continue;
                }
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "cannot reach PostgreSQL to lead the webhooks");
                    tokio::time::sleep(retry).await;
                    continue;
                }
            };
            tracing::info!("leading the webhooks");
            let outcome = tokio::select! {
                routed = self.lead_router(&lock) => routed,
                sent = self.lead_sender() => sent,
            };
            if let Err(error) = outcome {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "webhooks restart");
            }
            crate::platform::leader::resign(lock);
            tokio::time::sleep(retry).await;
        }
    }

    async fn lead_router(&self, lock: &crate::platform::leader::LeaderLock) -> anyhow::Result<()> {
        let after = crate::platform::projector::stored_position(&self.pool, LEADER).await?;
        let mut subscription = self.store.subscribe_all(after, filter());
        let mut position = after;
        loop {
            let batch = crate::platform::leader::next_batch(
                &mut subscription,
                lock,
                Duration::from_millis(1000),
                self.batch_size,
            )
            .await?;
            if let Some(scanned_to) = batch.scanned_to.filter(|to| Some(*to) > position) {
                self.route(&batch.events, scanned_to).await?;
                position = Some(scanned_to);
            }
        }
    }

    async fn lead_sender(&self) -> anyhow::Result<()> {
        loop {
            let report = self.send_due_once().await?;
            if report.attempted > 0 {
                continue;
            }
            // Nothing due: until the router makes something, or the next retry is due (at most
            // a second: a retry scheduled by another leader is found too).
            let next: Option<DateTime<Utc>> = self
                .pool
                .get()
                .await
                .context("getting a connection")?
                .query_one(
                    "SELECT min(next_attempt_at) FROM webhook_messages WHERE status = 'pending'",
                    &[],
                )
                .await
                .context("reading the next retry")?
                .get(0);
            let wait = next
                .map(|next| (next - self.clock.now()).num_milliseconds().max(0))
                .map_or(1000, |ms| ms.min(1000));
            let _ = tokio::time::timeout(
                Duration::from_millis(u64::try_from(wait).unwrap_or(1000)),
                self.wake.notified(),
            )
            .await;
        }
    }
}
