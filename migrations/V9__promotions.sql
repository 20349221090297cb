-- Flash-sale promotions (issue: flash-sale promotions). Read models of projection `promotions`,
-- from the promotion streams (`promotion-<id>`) and the claim credits on the accounts.

CREATE TABLE promotions (
    promotion_id   uuid          PRIMARY KEY,
    title          text          NOT NULL,
    points         numeric(20,2) NOT NULL,
    price          numeric(20,2) NOT NULL,
    stock          integer       NOT NULL,
    taken          integer       NOT NULL DEFAULT 0,
    granted        integer       NOT NULL DEFAULT 0,
    starts_at      timestamptz   NOT NULL,
    ends_at        timestamptz   NOT NULL,
    ended_at       timestamptz,
    created_at     timestamptz   NOT NULL,
    stream_version bigint        NOT NULL
);
CREATE INDEX promotions_by_end ON promotions (ends_at);

-- One row per claim persisted: reserved, then granted or refused; then its credit.
CREATE TABLE promotion_claims (
    claim_id     uuid        PRIMARY KEY,
    promotion_id uuid        NOT NULL,
    user_id      uuid        NOT NULL,
    status       text        NOT NULL CHECK (status IN ('reserved', 'granted', 'refused')),
    reason       text,
    accepted_at  timestamptz NOT NULL,
    decided_at   timestamptz,
    credited_at  timestamptz
);
CREATE INDEX promotion_claims_by_user ON promotion_claims (promotion_id, user_id, accepted_at);
-- The repair pass: claims left reserved, or granted and not credited.
CREATE INDEX promotion_claims_unsettled ON promotion_claims (accepted_at)
    WHERE status = 'reserved' OR (status = 'granted' AND credited_at IS NULL);

-- Claims a consumer could not persist after `promotions.deliveries_max` deliveries: kept with
-- their reason for admins (written by the consumer, not a projection).
CREATE TABLE promotion_parked_claims (
    claim_id     uuid        PRIMARY KEY,
    promotion_id uuid,
    user_id      uuid,
    entry        text        NOT NULL,
    reason       text        NOT NULL,
    deliveries   bigint      NOT NULL,
    parked_at    timestamptz NOT NULL
);

-- The reconciler also settles claims whose stream entry was lost (a Redis flush) midway.
ALTER TABLE settlement_repairs DROP CONSTRAINT settlement_repairs_kind_check;
ALTER TABLE settlement_repairs ADD CONSTRAINT settlement_repairs_kind_check
    CHECK (kind IN ('hold_settled', 'hold_released', 'fee_refunded', 'code_credited',
                    'bonus_credited', 'claim_settled'));
ALTER TABLE settlement_repairs ADD COLUMN claim_id uuid;
