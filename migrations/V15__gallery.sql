-- The creators' gallery: read models of projection `gallery`, folded from the work streams
-- (`work-<id>`), the like streams (`like-<work>-<user>`) and the follow streams
-- (`follow-<follower>-<creator>`). Redis holds the fast copies (like sets, the hot ranking,
-- inboxes); these rows are what pages beyond the cached ones, audits and rebuilds read.

-- One row per work ever published, whatever became of it.
CREATE TABLE works (
    work_id       uuid        PRIMARY KEY,
    creator       uuid        NOT NULL,
    task_id       uuid        NOT NULL,
    images        text[]      NOT NULL,
    title         text        NOT NULL,
    description   text,
    prompt_shown  boolean     NOT NULL,
    -- published, unpublished or hidden.
    status        text        NOT NULL,
    hidden_reason text,
    published_at  timestamptz NOT NULL,
    like_count    bigint      NOT NULL DEFAULT 0,
    -- Stream version of the last applied work event.
    stream_version bigint     NOT NULL
);
-- The new list, newest first, by keyset (published_at, work_id).
CREATE INDEX works_newest ON works (published_at DESC, work_id DESC) WHERE status = 'published';
-- A creator's page.
CREATE INDEX works_by_creator ON works (creator, published_at DESC, work_id DESC);

-- Who likes what, since when.
CREATE TABLE work_likes (
    work_id  uuid        NOT NULL,
    user_id  uuid        NOT NULL,
    liked_at timestamptz NOT NULL,
    PRIMARY KEY (work_id, user_id)
);
-- "Works I liked", newest like first; the first likers of a work come from the primary key's
-- table order by liked_at (a work's likes are read whole only when rebuilding).
CREATE INDEX work_likes_by_user ON work_likes (user_id, liked_at DESC, work_id DESC);

-- Who follows whom, since when.
CREATE TABLE follows (
    follower    uuid        NOT NULL,
    creator     uuid        NOT NULL,
    followed_at timestamptz NOT NULL,
    PRIMARY KEY (follower, creator)
);
CREATE INDEX follows_by_creator ON follows (creator, followed_at, follower);
