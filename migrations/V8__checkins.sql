-- Daily check-in (issue: daily check-in and daily active users). Read model of projection
-- `checkins`, from the check-in streams (`checkin-<user>`) and the bonus credits on the accounts.

-- One row per user and day checked in, then the bonus's credit.
CREATE TABLE checkins (
    user_id       uuid          NOT NULL,
    day           date          NOT NULL,
    streak        integer       NOT NULL,
    bonus         numeric(20,2) NOT NULL,
    checked_in_at timestamptz   NOT NULL,
    credited_at   timestamptz,
    PRIMARY KEY (user_id, day)
);
-- The repair pass: checked in and not credited (the request died between the two appends).
CREATE INDEX checkins_uncredited ON checkins (checked_in_at) WHERE credited_at IS NULL;

-- The reconciler also repairs check-in bonuses: such a repair names a user and a day.
ALTER TABLE settlement_repairs DROP CONSTRAINT settlement_repairs_kind_check;
ALTER TABLE settlement_repairs ADD CONSTRAINT settlement_repairs_kind_check
    CHECK (kind IN ('hold_settled', 'hold_released', 'fee_refunded', 'code_credited',
                    'bonus_credited'));
ALTER TABLE settlement_repairs ADD COLUMN checkin_day date;
