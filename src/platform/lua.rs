//! How the Redis scripts of `lua/` are compiled into the binary. Each feature declares its own
//! scripts with [`redis_script!`] in its `scripts.rs`, beside the key names they touch.
//! `redis::Script` sends `EVALSHA` and falls back to `EVAL` (loading the script) when the server
//! does not know it yet, e.g. after a restart or `SCRIPT FLUSH`.

/// `redis_script!(NAME, "file.lua")`: a `static NAME: LazyLock<redis::Script>` of
/// `lua/file.lua`, read at compile time.
macro_rules! redis_script {
    ($name:ident, $file:literal) => {
        pub static $name: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/lua/",
                $file
            )))
        });
    };
}

pub(crate) use redis_script;
