//! The Redis scripts of `lua/`, compiled into the binary. `redis::Script` sends `EVALSHA` and
//! falls back to `EVAL` (loading the script) when the server does not know it yet, e.g. after a
//! restart or `SCRIPT FLUSH`.

use std::sync::LazyLock;

use redis::Script;

macro_rules! script {
    ($name:ident, $file:literal) => {
        pub static $name: LazyLock<Script> = LazyLock::new(|| {
            Script::new(include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/lua/",
                $file
            )))
        });
    };
}

script!(SESSION_CREATE, "session_create.lua");
script!(SESSION_TOUCH, "session_touch.lua");
script!(SESSION_REVOKE, "session_revoke.lua");
script!(SESSIONS_REVOKE_USER, "sessions_revoke_user.lua");
script!(PHONE_CODE_SEND, "phone_code_send.lua");
script!(PHONE_CODE_VERIFY, "phone_code_verify.lua");
script!(LOGIN_FAILURES, "login_failures.lua");
script!(QUEUE_TICKET, "queue_ticket.lua");
script!(QUEUE_ENQUEUE, "queue_enqueue.lua");
script!(QUEUE_PRIORITISE_TARGET, "queue_prioritise_target.lua");
script!(QUEUE_CLAIM, "queue_claim.lua");
script!(QUEUE_REQUEUE, "queue_requeue.lua");
script!(QUEUE_SCORES_AFTER, "queue_scores_after.lua");
script!(QUEUE_RANKS, "queue_ranks.lua");
script!(RATE_WINDOW, "rate_window.lua");
script!(DISPATCH_LEADER_ACQUIRE, "dispatch_leader_acquire.lua");
script!(DISPATCH_LEADER_RENEW, "dispatch_leader_renew.lua");
script!(DISPATCH_LEADER_RESIGN, "dispatch_leader_resign.lua");
script!(DISPATCH_FILL, "dispatch_fill.lua");
script!(DISPATCH_HOLD, "dispatch_hold.lua");
script!(DISPATCH_SLOTS_RENEW, "dispatch_slots_renew.lua");
script!(TASK_PROGRESS, "task_progress.lua");
script!(CODE_LIMIT, "code_limit.lua");
script!(CODE_REDEEM, "code_redeem.lua");
script!(CODE_BATCH_LOAD, "code_batch_load.lua");
script!(CODE_FAILURE, "code_failure.lua");
script!(PROMO_CLAIM, "promo_claim.lua");
script!(PROMO_LOAD, "promo_load.lua");
script!(PROMO_ADJUST, "promo_adjust.lua");
