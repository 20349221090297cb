-- Webhooks. The endpoints as the webhook router follows their streams (it writes these rows in
-- the same transaction as its checkpoint and the messages it makes, so they always agree with
-- where it stands in the log), the messages to deliver (one per endpoint and source event: the
-- message id is the event's id, stable across retries and redeliveries), and every attempt.
CREATE TABLE webhook_endpoints (
    endpoint_id          uuid        PRIMARY KEY,
    user_id              uuid        NOT NULL,
    url                  text        NOT NULL,
    event_types          text[]      NOT NULL,
    generation           integer     NOT NULL,
    previous_until       timestamptz,
    disabled_reason      text,
    removed              boolean     NOT NULL DEFAULT false,
    -- The sender's count of failed attempts in a row, and since when (reset by a success).
    consecutive_failures integer     NOT NULL DEFAULT 0,
    failing_since        timestamptz,
    created_at           timestamptz NOT NULL,
    stream_version       bigint      NOT NULL
);
CREATE INDEX webhook_endpoints_by_user ON webhook_endpoints (user_id);

CREATE TABLE webhook_messages (
    endpoint_id     uuid        NOT NULL,
    message_id      uuid        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    -- When what it tells of happened (the source event's record time).
    occurred_at     timestamptz NOT NULL,
    created_at      timestamptz NOT NULL,
    -- pending, delivered, failed (retries exhausted), skipped (endpoint disabled or removed).
    status          text        NOT NULL,
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,
    delivered_at    timestamptz,
    PRIMARY KEY (endpoint_id, message_id)
);
CREATE INDEX webhook_messages_due ON webhook_messages (next_attempt_at) WHERE status = 'pending';
CREATE INDEX webhook_messages_by_time ON webhook_messages (endpoint_id, occurred_at);

CREATE TABLE webhook_attempts (
    endpoint_id  uuid        NOT NULL,
    message_id   uuid        NOT NULL,
    attempt      integer     NOT NULL,
    attempted_at timestamptz NOT NULL,
    -- The answer's status; NULL when there was none (refused, timed out, unsafe address).
    status       integer,
    latency_ms   integer     NOT NULL,
    error        text,
    -- The answer's first bytes (webhooks.response_bytes_max).
    response     text,
    PRIMARY KEY (endpoint_id, message_id, attempt)
);
