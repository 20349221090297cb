-- `zhihui_append_batch`: a group-commit batch of appends to distinct streams in one call.
--
-- The group-commit writer used to send a batch as one `zhihui_append` per append, pipelined in
-- one transaction: per append, a statement to parse and start, a plpgsql call, and its four or
-- five statements inside (the idempotency probe, the stream's row, its update, the events). Here
-- a batch is three statements whatever its size: the idempotency probe for every append at once,
-- one upsert that creates or locks and moves every stream's row, and one insert of every event.
--
-- It answers, per append (`n`, 1-based, in the order given), exactly what `zhihui_append` would
-- have answered had the appends been made one after the other in this transaction, in the
-- order given (the writer sorts them by stream: its lock order). Where that is not plainly so,
-- it makes them one after the other through `zhihui_append`:
-- - two appends to one stream (the second's expectation depends on the first);
-- - an append without events;
-- - an append whose first event id is already stored (a retry, answered `duplicate`, or a reuse,
--   `id_reused`: `zhihui_append`'s own rules).
-- An event id reused inside the call, or stored meanwhile by a concurrent transaction, raises
-- on the events' unique key, as it does in `zhihui_append`; the writer then appends one by one.
--
-- The upsert takes the streams' rows in stream order, one row at a time, as the one-by-one
-- appends did: a row that exists is locked whether or not its append goes ahead
-- (`ON CONFLICT DO UPDATE ... WHERE` locks the rows it does not update), a missing one is
-- created (at once at its final version when the append may create it; at -1 when the append
-- expects an existing stream, as `zhihui_append` leaves it).

CREATE FUNCTION zhihui_append_batch(
    p_streams           text[],
    p_expected_kinds    smallint[],
    p_expected_versions bigint[],
    p_counts            integer[],
    p_event_ids         uuid[],
    p_event_types       text[],
    p_schema_versions   integer[],
    p_payloads          jsonb[],
    p_metadata          jsonb[]
) RETURNS TABLE (n integer, status text, version bigint, last_position bigint, last_transaction bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_count  integer := coalesce(cardinality(p_streams), 0);
    v_xid    xid8 := pg_current_xact_id();
    v_firsts integer[];
    v_offset integer := 0;
    v_done   bigint;
    i        integer;
BEGIN
    -- Where each append's events start in the event arrays.
    FOR i IN 1..v_count LOOP
        v_firsts[i] := v_offset + 1;
        v_offset := v_offset + p_counts[i];
    END LOOP;

    IF v_count < 2
       OR 0 = ANY(p_counts)
       OR (SELECT count(DISTINCT s) FROM unnest(p_streams) AS s) <> v_count
       OR EXISTS (SELECT 1 FROM events e
                   WHERE e.event_id = ANY (ARRAY(SELECT p_event_ids[f] FROM unnest(v_firsts) AS f))) THEN
        FOR i IN 1..v_count LOOP
            RETURN QUERY
            SELECT i, a.status, a.version, a.last_position, a.last_transaction
              FROM zhihui_append(p_streams[i], p_expected_kinds[i], p_expected_versions[i],
                                 p_event_ids[v_firsts[i]:v_firsts[i] + p_counts[i] - 1],
                                 p_event_types[v_firsts[i]:v_firsts[i] + p_counts[i] - 1],
                                 p_schema_versions[v_firsts[i]:v_firsts[i] + p_counts[i] - 1],
                                 p_payloads[v_firsts[i]:v_firsts[i] + p_counts[i] - 1],
                                 p_metadata[v_firsts[i]:v_firsts[i] + p_counts[i] - 1]) AS a;
        END LOOP;
        RETURN;
    END IF;

    -- The appends whose stream's row this transaction now holds at their new version (created,
    -- or moved on because the expectation held and no newer transaction appended there), then
    -- their events, in the order given: positions are drawn in the insert's order.
    RETURN QUERY
    WITH input AS (
        SELECT x.stream_id, x.k::integer AS k, p_counts[x.k] AS events, v_firsts[x.k] AS first
          FROM unnest(p_streams) WITH ORDINALITY AS x(stream_id, k)
    ),
    moved AS (
        INSERT INTO streams AS s (stream_id, version, last_transaction_id)
        SELECT i.stream_id,
               CASE WHEN p_expected_kinds[i.k] IN (0, 1) THEN i.events - 1 ELSE -1 END,
               CASE WHEN p_expected_kinds[i.k] IN (0, 1) THEN v_xid ELSE '0'::xid8 END
          FROM input i
         ORDER BY i.stream_id
        ON CONFLICT (stream_id) DO UPDATE
           SET version = s.version + p_counts[array_position(p_streams, excluded.stream_id)],
               last_transaction_id = v_xid
         WHERE s.last_transaction_id <= v_xid
           AND CASE p_expected_kinds[array_position(p_streams, excluded.stream_id)]
                   WHEN 0 THEN true
                   WHEN 1 THEN s.version = -1
                   WHEN 2 THEN s.version = p_expected_versions[array_position(p_streams, excluded.stream_id)]
                   ELSE s.version <> -1
               END
        RETURNING s.stream_id, s.version, s.last_transaction_id
    ),
    appended AS (
        SELECT i.k, i.stream_id, i.events, i.first, m.version
          FROM input i JOIN moved m ON m.stream_id = i.stream_id
         WHERE m.last_transaction_id = v_xid
    ),
    inserted AS (
        INSERT INTO events (event_id, stream_id, stream_version, event_type, schema_version, payload, metadata)
        SELECT e.id, a.stream_id, a.version - a.events + 1 + (e.j - a.first)::bigint,
               e.event_type, e.schema_version, e.payload, e.metadata
          FROM unnest(p_event_ids, p_event_types, p_schema_versions, p_payloads, p_metadata)
               WITH ORDINALITY AS e(id, event_type, schema_version, payload, metadata, j)
          JOIN appended a ON e.j >= a.first AND e.j < a.first + a.events
         ORDER BY e.j
        RETURNING events.stream_id, events.global_position
    )
    SELECT a.k, 'appended'::text, a.version, max(ins.global_position), v_xid::text::bigint
      FROM appended a JOIN inserted ins ON ins.stream_id = a.stream_id
     GROUP BY a.k, a.version;
    GET DIAGNOSTICS v_done = ROW_COUNT;

    -- The others: their rows are locked (created at -1, or left as they were), so read now they
    -- are what the append met. The expectation is checked before the newer writer, as in
    -- `zhihui_append`.
    IF v_done < v_count THEN
        RETURN QUERY
        SELECT x.k::integer,
               CASE WHEN (p_expected_kinds[x.k] = 1 AND s.version <> -1)
                      OR (p_expected_kinds[x.k] = 2 AND s.version <> p_expected_versions[x.k])
                      OR (p_expected_kinds[x.k] = 3 AND s.version = -1)
                    THEN 'conflict' ELSE 'retry' END,
               s.version, NULL::bigint, NULL::bigint
          FROM unnest(p_streams) WITH ORDINALITY AS x(stream_id, k)
          JOIN streams s ON s.stream_id = x.stream_id
         WHERE s.last_transaction_id <> v_xid;
    END IF;
END;
$$;
