//! The gallery's Redis keys and scripts. Every key is derived from events and rebuilt from them
//! (`GalleryWorker`), so losing any of them loses nothing.
//!
//! - one work's tag `{w:<work>}`: `likes` (a sorted set: liker -> when, in ms: its size is the
//!   count, its first members the first likers), `likev` (the like stream's version last applied
//!   per liker), `view` (the cached work, with its logical expiry) and `view_lock`;
//! - one user's tag `{u:<user>}`: `following` and `followers` (sorted sets: user -> since, ms),
//!   `followv`/`followerv` (versions applied per pair), `blocked`/`blockedv` (the creators they
//!   blocked -> since, ms, and the versions applied), `works` (their visible works -> published,
//!   ms: what followers pull), `inbox` (works pushed to them -> published, ms) and `inbox_live`
//!   (present while they read their feed lately);
//! - the gallery's tag `{gallery}`: `hot` (work -> hot score), `famous` (creators pulled at read
//!   time), `new` (work -> published, ms), `through` (how far the worker applied the log) and
//!   `masters` (the masters' replication ids `through` was last checked against).
//!
//! No script spans two tags: a like touches its work's tag, then the ranking's, in two steps.

use uuid::Uuid;
use zhihui_domain::user::UserId;

use crate::platform::lua::redis_script;
use crate::platform::redis_store::{RedisStore, user_tag};

redis_script!(PAIR_APPLY, "gallery_pair.lua");
redis_script!(INBOX_STORE, "gallery_inbox_store.lua");
redis_script!(HOT_REPLACE, "gallery_hot_replace.lua");
redis_script!(CACHE_CLOCK, "gallery_cache_clock.lua");
redis_script!(CACHE_FORGET, "gallery_cache_forget.lua");
redis_script!(CACHE_STORE, "gallery_cache_store.lua");

/// The tag of one work's keys.
pub fn work_tag(work_id: Uuid) -> String {
    format!("w:{work_id}")
}

pub const GALLERY_TAG: &str = "gallery";

#[derive(Debug, Clone)]
pub struct Keys {
    redis: RedisStore,
}

impl Keys {
    pub fn new(redis: RedisStore) -> Keys {
        Keys { redis }
    }

    pub fn likes(&self, work_id: Uuid) -> String {
        self.redis.tagged(&work_tag(work_id), "gallery:likes")
    }

    pub fn like_versions(&self, work_id: Uuid) -> String {
        self.redis.tagged(&work_tag(work_id), "gallery:likev")
    }

    pub fn view(&self, work_id: Uuid) -> String {
        self.redis.tagged(&work_tag(work_id), "gallery:view")
    }

    pub fn view_lock(&self, work_id: Uuid) -> String {
        self.redis.tagged(&work_tag(work_id), "gallery:view_lock")
    }

    pub fn following(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:following")
    }

    pub fn following_versions(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:followv")
    }

    pub fn followers(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:followers")
    }

    pub fn follower_versions(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:followerv")
    }

    pub fn blocked(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:blocked")
    }

    pub fn blocked_versions(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:blockedv")
    }

    pub fn creator_works(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:works")
    }

    pub fn inbox(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:inbox")
    }

    pub fn inbox_live(&self, user: UserId) -> String {
        self.redis.tagged(&user_tag(user), "gallery:inbox_live")
    }

    pub fn hot(&self) -> String {
        self.redis.tagged(GALLERY_TAG, "hot")
    }

    pub fn famous(&self) -> String {
        self.redis.tagged(GALLERY_TAG, "famous")
    }

    pub fn through(&self) -> String {
        self.redis.tagged(GALLERY_TAG, "through")
    }

    /// The masters' replication ids when `through` was last known to hold.
    pub fn masters(&self) -> String {
        self.redis.tagged(GALLERY_TAG, "masters")
    }

    /// The new list: work -> published (ms), the newest `hot_max`.
    pub fn newest(&self) -> String {
        self.redis.tagged(GALLERY_TAG, "new")
    }

    /// Where the hot ranking is recomputed before it replaces `hot`.
    pub fn hot_next(&self) -> String {
        self.redis.tagged(GALLERY_TAG, "hot_next")
    }
}
