//! The redeem codes' Redis scripts: the redemption fast path, a batch loaded on a miss, the
//! per-user failure count and the forged-code limit.

use crate::platform::lua::redis_script;

redis_script!(CODE_LIMIT, "code_limit.lua");
redis_script!(CODE_REDEEM, "code_redeem.lua");
redis_script!(CODE_BATCH_LOAD, "code_batch_load.lua");
redis_script!(CODE_FAILURE, "code_failure.lua");
