-- Read models and projection checkpoints. Everything here is derived from the events and can be
-- rebuilt by `zhihui replay`.

-- One row per projection: how far it has applied the global log. Written in the same transaction
-- as the read-model rows, so a batch is applied exactly once whatever crashes.
CREATE TABLE projection_checkpoints (
    projection        text PRIMARY KEY,
    commit_position   bigint,
    prepare_position  bigint,
    events_applied    bigint      NOT NULL DEFAULT 0,
    -- recorded_at of the last applied event and when it was applied: the lag in time.
    last_recorded_at  timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    -- Set when the projection stopped on a poison event; it does not run again until cleared.
    stopped_reason    text
);

-- Balances, one row per account.
CREATE TABLE accounts (
    user_id        uuid PRIMARY KEY,
    available      numeric(20, 2) NOT NULL CHECK (available >= 0),
    frozen         numeric(20, 2) NOT NULL CHECK (frozen >= 0),
    -- Stream version of the last applied event: a second guard against applying one twice.
    stream_version bigint      NOT NULL,
    updated_at     timestamptz NOT NULL
);

-- One row per movement of points.
CREATE TABLE ledger_entries (
    user_id         uuid           NOT NULL,
    stream_version  bigint         NOT NULL,
    event_id        uuid           NOT NULL UNIQUE,
    occurred_at     timestamptz    NOT NULL,
    kind            text           NOT NULL,
    amount          numeric(20, 2) NOT NULL CHECK (amount > 0),
    available_after numeric(20, 2) NOT NULL,
    frozen_after    numeric(20, 2) NOT NULL,
    -- The hold (= task) or the operation the movement belongs to.
    task_id         uuid,
    operation_id    uuid,
    reason          text,
    actor           text           NOT NULL,
    correlation_id  uuid           NOT NULL,
    PRIMARY KEY (user_id, stream_version)
);
-- Newest first, per user: the ledger page query.
CREATE INDEX ledger_entries_by_user_newest ON ledger_entries (user_id, stream_version DESC);

-- Users, for admin lookups and listings. Login reads the claim streams (consistent), not this.
CREATE TABLE users (
    user_id        uuid PRIMARY KEY,
    username       text UNIQUE,
    phone          text UNIQUE,
    role           text        NOT NULL,
    registered_at  timestamptz NOT NULL,
    stream_version bigint      NOT NULL,
    updated_at     timestamptz NOT NULL
);
