-- Targeted wake-ups: `zhihui_append` as in V1, except that its notification names what was
-- appended ('<stream category> <event type>', the category being the stream id up to its first
-- '-', with a '-' added), so a subscription that follows other streams or other types is not
-- woken to read nothing. Listeners treat any other payload (the empty one of V1, from an
-- instance not yet upgraded) as "anything may have been appended".

CREATE OR REPLACE FUNCTION zhihui_append(
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
    v_category     text;
    v_event_type   text;
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
    -- The payload, '<category> <event type>' per type (the category is the stream id up to its
    -- first '-', inclusive), lets each subscription wake only for what it may want.
    v_category := split_part(p_stream_id, '-', 1) || '-';
    FOREACH v_event_type IN ARRAY p_event_types LOOP
        PERFORM pg_notify('zhihui_events', v_category || ' ' || v_event_type);
    END LOOP;
    status := 'appended';
    version := v_version + v_count;
END;
$$;
