//! The sender: what is due is sent, each attempt signed (Standard Webhooks) and logged in one
//! statement; a failure is rescheduled (the retry schedule with jitter, or the answer's
//! `Retry-After` when longer); a 410 or a long run of failures disables the endpoint.

use super::*;

impl Deliveries {
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
    pub(super) async fn attempt(&self, due: Due) -> anyhow::Result<Outcome> {
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
        let mut signatures = vec![crate::webhooks::signing::sign(
            &self.service.secret(due.endpoint_id, due.generation),
            &message_id,
            timestamp,
            &body,
        )];
        if due.generation > 1 && due.previous_until.is_some_and(|until| now < until) {
            signatures.push(crate::webhooks::signing::sign(
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
    pub(super) async fn disable(&self, endpoint_id: Uuid, reason: String) -> anyhow::Result<()> {
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
            Ok(_) | Err(crate::webhooks::WebhookError::NotFound) => {}
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
    pub(super) async fn post(
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
}

pub(super) enum Outcome {
    Delivered,
    Failed,
    Skipped,
}

pub(super) struct Answer {
    pub(super) status: u16,
    pub(super) head: String,
    pub(super) retry_after: Option<u64>,
}

/// `Retry-After` as milliseconds: delay-seconds or an HTTP date.
pub(super) fn retry_after_ms(value: &str, now: DateTime<Utc>) -> Option<u64> {
    if let Ok(seconds) = value.trim().parse::<u64>() {
        return Some(seconds.saturating_mul(1000));
    }
    let at = DateTime::parse_from_rfc2822(value.trim()).ok()?;
    u64::try_from((at.with_timezone(&Utc) - now).num_milliseconds()).ok()
}

#[cfg(test)]
pub(super) mod tests {
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
