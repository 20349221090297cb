//! The promotions' Redis scripts: the gate (window, one claim per user, stock, the claim
//! appended to the claims stream, in one step), a promotion loaded on a miss, stock adjusted.

use crate::platform::lua::redis_script;

redis_script!(PROMO_CLAIM, "promo_claim.lua");
redis_script!(PROMO_LOAD, "promo_load.lua");
redis_script!(PROMO_ADJUST, "promo_adjust.lua");
