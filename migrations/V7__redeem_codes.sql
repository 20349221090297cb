-- Redeem codes (issue: redeem codes). Read models of projection `codes`, from the batch streams
-- (`codebatch-<id>`), the code streams (`code-<serial>`) and the code credits on the accounts.

-- One row per batch: its range of serials, how far it is issued, its window, revocation.
CREATE TABLE code_batches (
    batch_id       uuid          PRIMARY KEY,
    first_serial   integer       NOT NULL,
    count          integer       NOT NULL,
    issued         integer       NOT NULL DEFAULT 0,
    points         numeric(20,2) NOT NULL,
    valid_from     timestamptz   NOT NULL,
    valid_until    timestamptz   NOT NULL,
    note           text          NOT NULL,
    key_slot       smallint      NOT NULL,
    created_at     timestamptz   NOT NULL,
    created_by     text          NOT NULL,
    revoked_at     timestamptz,
    revoke_reason  text,
    stream_version bigint        NOT NULL
);
-- A serial finds its batch by range (the last batch starting at or before it).
CREATE INDEX code_batches_by_first_serial ON code_batches (first_serial);
-- The generator's query: batches still being issued.
CREATE INDEX code_batches_issuing ON code_batches (created_at)
    WHERE issued < count AND revoked_at IS NULL;

-- One row per issued code (written a page at a time), then its redemption and its credit.
CREATE TABLE redeem_codes (
    serial       integer     PRIMARY KEY,
    batch_id     uuid        NOT NULL,
    issued_at    timestamptz NOT NULL,
    redeemed_by  uuid,
    redeemed_at  timestamptz,
    credited_at  timestamptz
);
CREATE INDEX redeem_codes_by_batch ON redeem_codes (batch_id, serial);
-- The repair pass: redeemed and not credited (the request died between the two appends).
CREATE INDEX redeem_codes_uncredited ON redeem_codes (redeemed_at)
    WHERE redeemed_by IS NOT NULL AND credited_at IS NULL;

-- The reconciler also repairs code credits: such a repair names a code, not a task.
ALTER TABLE settlement_repairs DROP CONSTRAINT settlement_repairs_kind_check;
ALTER TABLE settlement_repairs ADD CONSTRAINT settlement_repairs_kind_check
    CHECK (kind IN ('hold_settled', 'hold_released', 'fee_refunded', 'code_credited'));
ALTER TABLE settlement_repairs ALTER COLUMN task_id DROP NOT NULL;
ALTER TABLE settlement_repairs ADD COLUMN code_serial integer;
