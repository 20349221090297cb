-- The settlement reconciler: what finished tasks and abandoned prioritises still owe, and the
-- repairs it made.

-- Read model (projection `settlements`, from account and task events): one row per hold (kind
-- 'hold', id = task id) and per prioritise fee (kind 'fee', id = the prioritise's operation id)
-- that is not settled yet. A hold row opens with its freeze and goes when the hold is settled or
-- released; a fee row opens with its charge and goes when the move is recorded or the fee is
-- refunded. `due_since` is when the task ended (or the prioritise was abandoned): from then on
-- the row should go within moments; a row still `opened` well after it is owed money.
CREATE TABLE open_settlements (
    kind       text        NOT NULL CHECK (kind IN ('hold', 'fee')),
    id         uuid        NOT NULL,
    task_id    uuid,
    -- The account, from the freeze or charge.
    user_id    uuid,
    opened     boolean     NOT NULL DEFAULT false,
    due_since  timestamptz,
    PRIMARY KEY (kind, id)
);
-- The reconciler's query: open rows that are owed, oldest first.
CREATE INDEX open_settlements_due ON open_settlements (due_since)
    WHERE opened AND due_since IS NOT NULL;

-- Every account movement the reconciler made itself (the request or dispatcher that owned it had
-- died or failed): the operator's list of repairs (`zhihui audit repairs`). Not a read model.
CREATE TABLE settlement_repairs (
    repair_id    uuid        PRIMARY KEY,
    kind         text        NOT NULL CHECK (kind IN ('hold_settled', 'hold_released', 'fee_refunded')),
    task_id      uuid        NOT NULL,
    operation_id uuid,
    user_id      uuid        NOT NULL,
    due_since    timestamptz NOT NULL,
    repaired_at  timestamptz NOT NULL
);
CREATE INDEX settlement_repairs_by_time ON settlement_repairs (repaired_at);
