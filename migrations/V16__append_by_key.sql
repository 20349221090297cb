-- The appends find rows by key only (an event by its id, a stream by its name): an index lookup
-- is right at every size. PL/pgSQL keeps a statement's plan for the session, and a plan made
-- while `events` was nearly empty (a new database, its first seconds) is a sequential scan that
-- stays one as the table grows: every append of that session then reads the whole log to probe
-- its event ids (measured: 10,000 likes on a fresh database spent a tenth of the machine's time
-- in that scan). Without sequential scans the planner takes the unique indexes whatever the
-- table's size when the plan was made.

ALTER FUNCTION zhihui_append(text, smallint, bigint, uuid[], text[], integer[], jsonb[], jsonb[])
    SET enable_seqscan = off;

ALTER FUNCTION zhihui_append_batch(text[], smallint[], bigint[], integer[], uuid[], text[],
                                   integer[], jsonb[], jsonb[])
    SET enable_seqscan = off;
