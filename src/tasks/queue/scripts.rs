//! The Redis scripts of the queue and of the dispatcher's leases, which share the queue's hash
//! tag so that one script may take a task off the queue onto a server's slot: scores, enqueue,
//! prioritise, claim, requeue, ranks; the leader lease, the filler, the held servers, slot
//! renewals; a task's progress.

use crate::platform::lua::redis_script;

redis_script!(QUEUE_TICKET, "queue_ticket.lua");
redis_script!(QUEUE_ENQUEUE, "queue_enqueue.lua");
redis_script!(QUEUE_PRIORITISE_TARGET, "queue_prioritise_target.lua");
redis_script!(QUEUE_CLAIM, "queue_claim.lua");
redis_script!(QUEUE_REMOVE, "queue_remove.lua");
redis_script!(QUEUE_REQUEUE, "queue_requeue.lua");
redis_script!(QUEUE_SCORES_AFTER, "queue_scores_after.lua");
redis_script!(QUEUE_RANKS, "queue_ranks.lua");
redis_script!(DISPATCH_LEADER_ACQUIRE, "dispatch_leader_acquire.lua");
redis_script!(DISPATCH_LEADER_RENEW, "dispatch_leader_renew.lua");
redis_script!(DISPATCH_LEADER_RESIGN, "dispatch_leader_resign.lua");
redis_script!(DISPATCH_FILL, "dispatch_fill.lua");
redis_script!(DISPATCH_HOLD, "dispatch_hold.lua");
redis_script!(DISPATCH_SLOTS_RENEW, "dispatch_slots_renew.lua");
redis_script!(TASK_PROGRESS, "task_progress.lua");
