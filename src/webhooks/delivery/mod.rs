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

    /// Send every message due now (a batch of them). Concurrently, within
    /// `webhooks.concurrency`.
    pub async fn send_due_once(&self) -> anyhow::Result<SendReport> {
        let settings = self.service.settings();
        let now = self.clock.now();
        let rows = {
            let client = self.pool.get().await.context("getting a connection")?;
            client
                .query(
                    "SELECT m.endpoint_id, m.message_id, m.payload, m.attempts, e.url, e.generation,
                            e.previous_until, e.disabled_reason IS NOT NULL, e.removed,
                            e.consecutive_failures, e.failing_since
                       FROM webhook_messages m JOIN webhook_endpoints e USING (endpoint_id)
                      WHERE m.status = 'pending' AND m.next_attempt_at <= $1
                      ORDER BY m.next_attempt_at LIMIT $2",
                    &[&now, &settings.batch],
                )
                .await
                .context("reading due messages")?
        };
        let due: Vec<Due> = rows
            .iter()
            .map(|row| Due {
                endpoint_id: row.get(0),
                message_id: row.get(1),
                body: row.get(2),
                attempts: row.get(3),
                url: row.get(4),
                generation: u32::try_from(row.get::<_, i32>(5)).unwrap_or(1),
                previous_until: row.get(6),
                disabled: row.get(7),
                removed: row.get(8),
                consecutive_failures: row.get(9),
                failing_since: row.get(10),
            })
            .collect();
        let mut report = SendReport::default();
        let outcomes: Vec<anyhow::Result<Outcome>> = futures::stream::iter(due)
            .map(|due| self.attempt(due))
            .buffer_unordered(settings.concurrency)
            .collect()
            .await;
        for outcome in outcomes {
            match outcome? {
                Outcome::Delivered => report.delivered += 1,
                Outcome::Failed => report.failed += 1,
                Outcome::Skipped => report.skipped += 1,
            }
            report.attempted += 1;
        }
        Ok(report)
    }

    /// One attempt at one message: send, log, reschedule or settle.
    async fn attempt(&self, due: Due) -> anyhow::Result<Outcome> {
        if due.disabled || due.removed {
            self.pool
                .get()
                .await
                .context("getting a connection")?
                .execute(
                    "UPDATE webhook_messages SET status = 'skipped', next_attempt_at = NULL
                      WHERE endpoint_id = $1 AND message_id = $2",
                    &[&due.endpoint_id, &due.message_id],
                )
                .await
                .context("skipping a message")?;
            return Ok(Outcome::Skipped);
        }
        let settings = self.service.settings();
        let now = self.clock.now();
        let body = serde_json::to_vec(&due.body).context("encoding a body")?;
        let timestamp = now.timestamp();
        let message_id = due.message_id.to_string();
        let mut signatures = vec![super::signing::sign(
            &self.service.secret(due.endpoint_id, due.generation),
            &message_id,
            timestamp,
            &body,
        )];
        if due.generation > 1 && due.previous_until.is_some_and(|until| now < until) {
            signatures.push(super::signing::sign(
                &self.service.secret(due.endpoint_id, due.generation - 1),
                &message_id,
                timestamp,
                &body,
            ));
        }
        let started = Instant::now();
        let answer = self
            .post(
                &due.url,
                &message_id,
                timestamp,
                &signatures.join(" "),
                body,
            )
            .await;
        let latency_ms = i32::try_from(started.elapsed().as_millis()).unwrap_or(i32::MAX);
        let attempt = due.attempts + 1;
        let (status, error, response, retry_after) = match &answer {
            Ok(answer) => (
                Some(i32::from(answer.status)),
                None,
                Some(answer.head.clone()),
                answer.retry_after,
            ),
            Err(error) => (None, Some(error.clone()), None, None),
        };
        let delivered = status.is_some_and(|status| (200..300).contains(&status));
        let gone = status == Some(410);
        let schedule = &settings.retry_schedule_ms;
        let exhausted = usize::try_from(attempt).unwrap_or(usize::MAX) > schedule.len();
        let next_attempt_at = if delivered || gone || exhausted {
            None
        } else {
            let pause = schedule[usize::try_from(attempt - 1).unwrap_or(0)];
            let jitter = settings.retry_jitter_ratio;
            let factor = if jitter > 0.0 {
                rand::rng().random_range((1.0 - jitter)..(1.0 + jitter))
            } else {
                1.0
            };
            let scheduled = (pause as f64 * factor) as u64;
            let waited = retry_after
                .map(|retry_after| retry_after.min(settings.retry_after_max_ms))
                .unwrap_or(0)
                .max(scheduled);
            Some(
                now + chrono::Duration::milliseconds(i64::try_from(waited).unwrap_or(i64::MAX / 4)),
            )
        };
        let message_status = if delivered {
            "delivered"
        } else if next_attempt_at.is_some() {
            "pending"
        } else {
            "failed"
        };
        // The attempt, the message's next step and the endpoint's run of failures: one
        // statement (one round trip, one transaction), so that the window between a send and its
        // record, where a crash makes a repeat, stays as short as it can be.
        self.pool
            .get()
            .await
            .context("getting a connection")?
            .execute(
                "WITH logged AS (
                    INSERT INTO webhook_attempts (endpoint_id, message_id, attempt, attempted_at,
                            status, latency_ms, error, response)
                    VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                    ON CONFLICT DO NOTHING
                 ), moved AS (
                    UPDATE webhook_messages
                       SET attempts = $3, status = $9, next_attempt_at = $10,
                           delivered_at = CASE WHEN $9 = 'delivered' THEN $4 ELSE delivered_at END
                     WHERE endpoint_id = $1 AND message_id = $2
                 )
                 UPDATE webhook_endpoints
                    SET consecutive_failures = CASE WHEN $11 THEN 0 ELSE consecutive_failures + 1 END,
                        failing_since = CASE WHEN $11 THEN NULL ELSE coalesce(failing_since, $4) END
                  WHERE endpoint_id = $1
                    -- A success on a healthy endpoint changes nothing: no write, no row lock.
                    AND NOT ($11 AND consecutive_failures = 0 AND failing_since IS NULL)",
                &[
                    &due.endpoint_id,
                    &due.message_id,
                    &attempt,
                    &now,
                    &status,
                    &latency_ms,
                    &error,
                    &response,
                    &message_status,
                    &next_attempt_at,
                    &delivered,
                ],
            )
            .await
            .context("recording an attempt")?;
        if gone {
            self.disable(
                due.endpoint_id,
                "the endpoint answered 410 Gone: it asked not to be called again".into(),
            )
            .await?;
        } else if !delivered {
            let failures = u32::try_from(due.consecutive_failures + 1).unwrap_or(u32::MAX);
            let failing_for = now - due.failing_since.unwrap_or(now);
            if failures >= settings.disable_after_failures
                && failing_for.num_milliseconds()
                    >= i64::try_from(settings.disable_after_failing_ms).unwrap_or(i64::MAX)
            {
                let last = status.map_or_else(
                    || error.clone().unwrap_or_default(),
                    |status| format!("HTTP {status}"),
                );
                self.disable(
                    due.endpoint_id,
                    format!(
                        "{failures} attempts in a row failed since {}; the last: {last}",
                        due.failing_since.unwrap_or(now)
                    ),
                )
                .await?;
            }
        }
        Ok(if delivered {
            Outcome::Delivered
        } else {
            Outcome::Failed
        })
    }

    /// Disable an endpoint (an event its owner sees), and skip what waits for it.
    async fn disable(&self, endpoint_id: Uuid, reason: String) -> anyhow::Result<()> {
        let metadata = EventMetadata {
            correlation_id: Uuid::now_v7(),
            causation_id: None,
            actor: ACTOR.into(),
        };
        match self
            .service
            .change(
                None,
                endpoint_id,
                EndpointCommand::Disable {
                    reason: reason.clone(),
                    at: self.clock.now(),
                },
                &metadata,
            )
            .await
        {
            Ok(_) | Err(super::WebhookError::NotFound) => {}
            Err(error) => return Err(anyhow::anyhow!("disabling an endpoint: {error}")),
        }
        // The router records the event's row soon; until then the sender must not go on.
        self.pool
            .get()
            .await
            .context("getting a connection")?
            .execute(
                "UPDATE webhook_endpoints SET disabled_reason = $2 WHERE endpoint_id = $1",
                &[&endpoint_id, &reason],
            )
            .await
            .context("marking an endpoint disabled")?;
        tracing::warn!(%endpoint_id, reason, "webhook endpoint disabled");
        Ok(())
    }

    /// POST one delivery; the answer's status, first bytes and `Retry-After`, or why there was
    /// none.
    async fn post(
        &self,
        url: &str,
        message_id: &str,
        timestamp: i64,
        signatures: &str,
        body: Vec<u8>,
    ) -> Result<Answer, String> {
        // An IP literal never meets the resolver: check it here, at every attempt.
        let parsed = reqwest::Url::parse(url).map_err(|error| error.to_string())?;
        let literal = match parsed.host() {
            Some(url::Host::Ipv4(v4)) => Some(std::net::IpAddr::V4(v4)),
            Some(url::Host::Ipv6(v6)) => Some(std::net::IpAddr::V6(v6)),
            _ => None,
        };
        if let Some(address) = literal
            && let Some(reason) = self.service.allowed().refuses(address)
        {
            return Err(format!(
                "not sent: {address} ({reason}) is where webhooks never go"
            ));
        }
        let response = self
            .client
            .post(parsed)
            .header("content-type", "application/json")
            .header("webhook-id", message_id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signatures)
            .body(body)
            .send()
            .await
            .map_err(|error| crate::platform::telemetry::error_chain(&anyhow::Error::new(error)))?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| retry_after_ms(value, self.clock.now()));
        // Read at most the cap: a receiver cannot make us hold its whole answer.
        let cap = self.service.settings().response_bytes_max;
        let mut head = Vec::with_capacity(cap.min(4096));
        let mut response = response;
        while head.len() < cap {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    let take = (cap - head.len()).min(chunk.len());
                    head.extend_from_slice(&chunk[..take]);
                }
                _ => break,
            }
        }
        Ok(Answer {
            status,
            head: String::from_utf8_lossy(&head).into_owned(),
            retry_after,
        })
    }

    // ---------------------------------------------------------------------------------------
    // Leading.

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

enum Outcome {
    Delivered,
    Failed,
    Skipped,
}

struct Answer {
    status: u16,
    head: String,
    retry_after: Option<u64>,
}

/// `Retry-After` as milliseconds: delay-seconds or an HTTP date.
fn retry_after_ms(value: &str, now: DateTime<Utc>) -> Option<u64> {
    if let Ok(seconds) = value.trim().parse::<u64>() {
        return Some(seconds.saturating_mul(1000));
    }
    let at = DateTime::parse_from_rfc2822(value.trim()).ok()?;
    u64::try_from((at.with_timezone(&Utc) - now).num_milliseconds()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_seconds_or_a_date() {
        let now = DateTime::parse_from_rfc3339("2027-01-15T01:00:00Z")
            .map(|at| at.with_timezone(&Utc))
            .unwrap_or_default();
        assert_eq!(retry_after_ms("120", now), Some(120_000));
        assert_eq!(
            retry_after_ms("Fri, 15 Jan 2027 01:02:00 GMT", now),
            Some(120_000)
        );
        assert_eq!(retry_after_ms("later", now), None);
        assert_eq!(retry_after_ms("Fri, 15 Jan 2027 00:00:00 GMT", now), None);
    }
}
