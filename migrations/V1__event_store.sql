-- The event store: the ground truth of zhihui. Append-only; read models are derived from it.
--
-- Global order is (transaction_id, global_position): transaction_id is the xid8 of the writing
-- transaction, global_position a sequence. Readers of the global log only return rows whose
-- transaction_id is below pg_snapshot_xmin(pg_current_snapshot()), i.e. rows of transactions
-- that are finished, so no row can ever appear later *below* a position a reader has passed.
-- See ARCHITECTURE.md, "Gap-safe global order".

CREATE TABLE streams (
    stream_id           text PRIMARY KEY,
    -- Version of the last event (0-based); -1 = the stream does not exist yet.
    version             bigint NOT NULL,
    -- The transaction that last appended here. An append from an older transaction is re-queued
    -- into a newer one, so a stream's events are ordered the same way in the global log.
    last_transaction_id xid8   NOT NULL
);

CREATE TABLE events (
    global_position bigint      GENERATED ALWAYS AS IDENTITY,
    transaction_id  xid8        NOT NULL DEFAULT pg_current_xact_id(),
    event_id        uuid        NOT NULL,
    stream_id       text        NOT NULL,
    stream_version  bigint      NOT NULL CHECK (stream_version >= 0),
    event_type      text        NOT NULL,
    schema_version  integer     NOT NULL CHECK (schema_version >= 1),
    payload         jsonb       NOT NULL,
    metadata        jsonb       NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (global_position),
    CONSTRAINT events_event_id_unique UNIQUE (event_id),
    CONSTRAINT events_stream_version_unique UNIQUE (stream_id, stream_version)
);

CREATE INDEX events_global_order ON events (transaction_id, global_position);
CREATE INDEX events_type_order ON events (event_type, transaction_id, global_position);

-- Stored events are append-only: refuse UPDATE and DELETE at the database level.
CREATE FUNCTION zhihui_events_are_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events are append-only (% refused)', TG_OP;
END;
$$;

CREATE TRIGGER events_are_immutable
    BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION zhihui_events_are_immutable();

-- Append events to ONE stream. Never raises for an expected outcome (so a group-commit batch of
-- many appends in one transaction is never aborted by one of them); returns a status instead:
--   'appended'       the events were stored; version = new stream version
--   'duplicate'      these event ids were already stored by an identical earlier append; nothing
--                    stored; version = stream version after that earlier append
--   'conflict'       the expected version did not hold; version = actual version (-1 = none)
--   'id_reused'      an event id is already used by a different append
--   'retry'          a newer transaction already appended to this stream: retry in a new one
-- expected_kind: 0 = any, 1 = no stream, 2 = exactly expected_version, 3 = stream exists.
CREATE FUNCTION zhihui_append(
    p_stream_id        text,
    p_expected_kind    smallint,
    p_expected_version bigint,
    p_event_ids        uuid[],
    p_event_types      text[],
    p_schema_versions  integer[],
    p_payloads         jsonb[],
    p_metadata         jsonb[],
    OUT status         text,
    OUT version        bigint,
    OUT last_position  bigint,
    OUT last_transaction bigint
) LANGUAGE plpgsql AS $$
DECLARE
    v_version      bigint;
    v_last_xid     xid8;
    v_count        integer := cardinality(p_event_ids);
    v_first_stream text;
    v_first_ver    bigint;
    v_matching     integer;
BEGIN
    -- Idempotency: is the first event id already stored?
    SELECT e.stream_id, e.stream_version INTO v_first_stream, v_first_ver
      FROM events e WHERE e.event_id = p_event_ids[1];
    IF FOUND THEN
        SELECT count(*) INTO v_matching
          FROM unnest(p_event_ids) WITH ORDINALITY AS x(id, n)
          JOIN events e ON e.event_id = x.id
         WHERE e.stream_id = p_stream_id AND e.stream_version = v_first_ver + x.n - 1;
        IF v_first_stream = p_stream_id AND v_matching = v_count AND (
               p_expected_kind IN (0, 3)
            OR (p_expected_kind = 1 AND v_first_ver = 0)
            OR (p_expected_kind = 2 AND v_first_ver = p_expected_version + 1)) THEN
            status := 'duplicate';
            version := v_first_ver + v_count - 1;
            SELECT e.global_position, e.transaction_id::text::bigint
              INTO last_position, last_transaction
              FROM events e WHERE e.event_id = p_event_ids[v_count];
        ELSE
            status := 'id_reused';
            version := v_first_ver;
        END IF;
        RETURN;
    END IF;

    -- Lock the stream row (creating it first, so that two first appends serialize on it).
    INSERT INTO streams (stream_id, version, last_transaction_id)
         VALUES (p_stream_id, -1, '0'::xid8)
    ON CONFLICT (stream_id) DO NOTHING;
    SELECT s.version, s.last_transaction_id INTO v_version, v_last_xid
      FROM streams s WHERE s.stream_id = p_stream_id FOR UPDATE;

    IF (p_expected_kind = 1 AND v_version <> -1)
       OR (p_expected_kind = 2 AND v_version <> p_expected_version)
       OR (p_expected_kind = 3 AND v_version = -1) THEN
        status := 'conflict';
        version := v_version;
        RETURN;
    END IF;

    IF v_last_xid > pg_current_xact_id() THEN
        status := 'retry';
        version := v_version;
        RETURN;
    END IF;

    -- An event id may also be reused inside this very call or by a concurrent append; the unique
    -- constraint then raises, and the caller retries this append alone.
    INSERT INTO events (event_id, stream_id, stream_version, event_type, schema_version, payload, metadata)
    SELECT x.id, p_stream_id, v_version + x.n, x.event_type, x.schema_version, x.payload, x.metadata
      FROM unnest(p_event_ids, p_event_types, p_schema_versions, p_payloads, p_metadata)
           WITH ORDINALITY AS x(id, event_type, schema_version, payload, metadata, n)
     ORDER BY x.n;

    UPDATE streams s SET version = v_version + v_count, last_transaction_id = pg_current_xact_id()
     WHERE s.stream_id = p_stream_id;

    SELECT e.global_position INTO last_position
      FROM events e WHERE e.stream_id = p_stream_id AND e.stream_version = v_version + v_count;
    last_transaction := pg_current_xact_id()::text::bigint;
    -- Delivered on commit; identical notifications of one transaction are folded into one.
    PERFORM pg_notify('zhihui_events', '');
    status := 'appended';
    version := v_version + v_count;
END;
$$;
