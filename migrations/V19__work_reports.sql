-- Reports of works to the admins, one row per reporter and work (the pair's stream decides that
-- there is one). `status`: 'open' until an admin looks; 'dismissed' when an admin found nothing
-- wrong (told on the report's own stream); 'upheld' when the work was hidden (told on the work's
-- stream: every report open at that moment, and any that reaches the work after it).
CREATE TABLE work_reports (
    work_id     uuid        NOT NULL,
    reporter    uuid        NOT NULL,
    reason      text        NOT NULL,
    note        text,
    reported_at timestamptz NOT NULL,
    status      text        NOT NULL DEFAULT 'open'
                CHECK (status IN ('open', 'dismissed', 'upheld')),
    resolved_by uuid,
    resolved_at timestamptz,
    PRIMARY KEY (work_id, reporter)
);
-- The admins' queue: the works with open reports.
CREATE INDEX work_reports_open ON work_reports (work_id, reported_at) WHERE status = 'open';
