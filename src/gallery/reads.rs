//! The gallery's lists: hot, new, a creator's works, a user's likes and feed, each read by
//! cursor (never by an offset into the whole list).
//!
//! The sorted-set lists (hot, new, the feed) use a "max score + offset" cursor: the page's last
//! score and how many entries of that very score were already shown. Entries of one score are
//! ordered by their id, so a page ending inside a run of equal scores goes on exactly after it:
//! none skipped, none repeated, and a page whose entries all share one score moves on (its offset
//! grows) instead of reading itself again.
//!
//! Every list is filtered through the cards: a work that is no longer visible (unpublished,
//! hidden) has none, so it leaves every list the moment its card is dropped, whatever a sorted
//! set still says.

use std::collections::HashSet;
use std::sync::Arc;

use anyhow::Context;
use chrono::{DateTime, Utc};
use redis::AsyncCommands;
use uuid::Uuid;
use zhihui_domain::gallery::work::WorkId;
use zhihui_domain::user::UserId;

use super::{GalleryService, WorkCard};

/// Longest page.
pub const PAGE_MAX: usize = 48;
/// Members of a following set read for common follows, at most.
const FOLLOWING_READ_MAX: isize = 5_000;

/// Where a sorted-set page starts: below or at `max`, skipping `offset` entries of score `max`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cursor {
    pub max: f64,
    pub offset: usize,
}

/// The most entries of one score a cursor may skip: more than any list holds of one score (the
/// hot list keeps a thousand works; the others are scored by the millisecond), and a bound on
/// what one page reads (a page reads `offset + limit` entries of each source).
pub const CURSOR_OFFSET_MAX: usize = 100_000; // the API document's cursor pattern states it

/// How many pages a read moves past when every work on them is filtered out for the reader
/// (hidden since, blocked, a creator no longer followed), before it answers an empty page with
/// the cursor after them.
const FILTERED_PAGES_MAX: usize = 8;

impl Cursor {
    /// `<max>:<offset>`, as pages and the API pass it.
    pub fn parse(text: &str) -> Option<Cursor> {
        let (max, offset) = text.split_once(':')?;
        let max: f64 = max.parse().ok()?;
        (max.is_finite()).then_some(())?;
        let offset: usize = offset.parse().ok()?;
        (offset <= CURSOR_OFFSET_MAX).then_some(())?;
        Some(Cursor { max, offset })
    }

    pub fn render(&self) -> String {
        format!("{}:{}", self.max, self.offset)
    }
}

/// Where a page of a user's likes ends (when liked, which work), as a cursor's text.
pub fn render_like_cursor((at, work_id): (DateTime<Utc>, Uuid)) -> String {
    format!("{}:{work_id}", at.timestamp_micros())
}

/// A cursor of [`render_like_cursor`] read back.
pub fn parse_like_cursor(text: &str) -> Option<(DateTime<Utc>, Uuid)> {
    let (micros, work_id) = text.split_once(':')?;
    Some((
        DateTime::from_timestamp_micros(micros.parse().ok()?)?,
        Uuid::parse_str(work_id).ok()?,
    ))
}

/// One page of works and where the next starts (`None`: the end).
#[derive(Debug, Clone)]
pub struct WorkPage {
    pub works: Vec<ListedWork>,
    pub next: Option<String>,
}

/// A work on a list page.
#[derive(Debug, Clone)]
pub struct ListedWork {
    pub card: Arc<WorkCard>,
    pub likes: u64,
    pub liked_by_viewer: Option<bool>,
}

/// Entries `(member, score)` in list order: score descending, then member descending (as
/// `ZREVRANGEBYSCORE` orders equal scores).
fn order(entries: &mut [(String, f64)]) {
    entries.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| b.0.cmp(&a.0)));
}

/// The page of `limit` entries after `cursor` from entries read at or below its max (each
/// source read with `offset + limit` entries from the max down, so the page is covered), and
/// the cursor after it.
fn page_after(
    mut entries: Vec<(String, f64)>,
    cursor: Option<Cursor>,
    limit: usize,
) -> (Vec<(String, f64)>, Option<Cursor>) {
    order(&mut entries);
    entries.dedup_by(|a, b| a.0 == b.0);
    let skip = cursor.map_or(0, |cursor| {
        entries
            .iter()
            .take_while(|entry| entry.1 == cursor.max)
            .count()
            .min(cursor.offset)
    });
    let page: Vec<(String, f64)> = entries.into_iter().skip(skip).take(limit).collect();
    if page.len() < limit {
        return (page, None);
    }
    let last = page[page.len() - 1].1;
    let same = page.iter().filter(|entry| entry.1 == last).count();
    let offset = match cursor {
        Some(cursor) if cursor.max == last => cursor.offset + same,
        _ => same,
    };
    (page, Some(Cursor { max: last, offset }))
}

async fn read_from(
    connection: &mut crate::platform::redis_store::RedisConnection,
    key: &str,
    cursor: Option<Cursor>,
    count: usize,
) -> anyhow::Result<Vec<(String, f64)>> {
    let max = cursor.map_or_else(|| "+inf".to_owned(), |cursor| cursor.max.to_string());
    redis::cmd("ZREVRANGEBYSCORE")
        .arg(key)
        .arg(max)
        .arg("-inf")
        .arg("WITHSCORES")
        .arg("LIMIT")
        .arg(0)
        .arg(count)
        .query_async(connection)
        .await
        .with_context(|| format!("reading a page of {key}"))
}

impl GalleryService {
    /// Cards and like counts of `ids`, in order, leaving out what is not visible.
    async fn listed(
        &self,
        ids: &[WorkId],
        viewer: Option<UserId>,
        creators: Option<&HashSet<Uuid>>,
    ) -> anyhow::Result<Vec<ListedWork>> {
        // A viewer never sees the works of a creator they blocked.
        let blocked = match viewer {
            Some(viewer) => self.blocked_by(viewer).await?,
            None => std::collections::HashSet::new(),
        };
        let mut cards = Vec::with_capacity(ids.len());
        for work_id in ids {
            if let Some(card) = self.card(*work_id).await?
                && !blocked.contains(&card.creator)
                && creators.is_none_or(|creators| creators.contains(&card.creator))
            {
                cards.push(card);
            }
        }
        let visible: Vec<WorkId> = cards.iter().map(|card| card.work_id).collect();
        let likes = self.like_counts(&visible).await?;
        let liked = match viewer {
            Some(viewer) => self.liked_among(viewer, &visible).await?,
            None => Vec::new(),
        };
        Ok(cards
            .into_iter()
            .zip(likes)
            .enumerate()
            .map(|(index, (card, likes))| ListedWork {
                card,
                likes,
                liked_by_viewer: viewer.map(|_| liked.get(index).copied().unwrap_or(false)),
            })
            .collect())
    }

    /// A page of `sources` merged; with `creators`, only their works are listed (the page's
    /// cursor still moves past the others).
    async fn sorted_set_page(
        &self,
        sources: &[String],
        cursor: Option<Cursor>,
        limit: usize,
        viewer: Option<UserId>,
        creators: Option<&HashSet<Uuid>>,
    ) -> anyhow::Result<WorkPage> {
        let limit = limit.clamp(1, PAGE_MAX);
        let mut connection = self.redis().connection().await?;
        let mut cursor = cursor;
        let mut rounds = 0;
        loop {
            rounds += 1;
            let mut entries = Vec::new();
            let want = cursor.map_or(0, |cursor| cursor.offset) + limit;
            for source in sources {
                entries.extend(read_from(&mut connection, source, cursor, want).await?);
            }
            let (page, next) = page_after(entries, cursor, limit);
            let ids: Vec<WorkId> = page
                .iter()
                .filter_map(|(member, _)| Uuid::parse_str(member).ok())
                .collect();
            let works = self.listed(&ids, viewer, creators).await?;
            // A page whose every work was filtered out would read as the list's end to a
            // person (an empty page has no "more" to press): read on, a bounded number of pages.
            if works.is_empty()
                && let Some(after) = next
                && rounds < FILTERED_PAGES_MAX
            {
                cursor = Some(after);
                continue;
            }
            return Ok(WorkPage {
                works,
                next: next.map(|cursor| cursor.render()),
            });
        }
    }

    /// The hot list: likes weighed by age.
    pub async fn hot(
        &self,
        cursor: Option<Cursor>,
        limit: usize,
        viewer: Option<UserId>,
    ) -> anyhow::Result<WorkPage> {
        self.whole_list(self.keys().hot(), "hot", cursor, limit, viewer)
            .await
    }

    /// The new list: newest first.
    pub async fn newest(
        &self,
        cursor: Option<Cursor>,
        limit: usize,
        viewer: Option<UserId>,
    ) -> anyhow::Result<WorkPage> {
        self.whole_list(self.keys().newest(), "new", cursor, limit, viewer)
            .await
    }

    /// A list of the whole gallery (the sorted set `key`); its first page as visitors see it
    /// is kept in memory under `name`.
    async fn whole_list(
        &self,
        key: String,
        name: &str,
        cursor: Option<Cursor>,
        limit: usize,
        viewer: Option<UserId>,
    ) -> anyhow::Result<WorkPage> {
        let sources = [key];
        if cursor.is_none() && viewer.is_none() {
            return Box::pin(self.public_page(format!("{name}:{limit}"), || {
                self.sorted_set_page(&sources, None, limit, None, None)
            }))
            .await;
        }
        self.sorted_set_page(&sources, cursor, limit, viewer, None)
            .await
    }

    /// A creator's visible works, newest first (from the read model; the cursor is the last
    /// work's publication time in ms and how many of that time were shown).
    pub async fn creator_works(
        &self,
        creator: UserId,
        cursor: Option<Cursor>,
        limit: usize,
        viewer: Option<UserId>,
    ) -> anyhow::Result<WorkPage> {
        self.sorted_set_page(
            &[self.keys().creator_works(creator)],
            cursor,
            limit,
            viewer,
            None,
        )
        .await
    }

    /// The works a user liked, latest like first (from the read model, by keyset).
    pub async fn liked_by(
        &self,
        user: UserId,
        before: Option<(DateTime<Utc>, Uuid)>,
        limit: usize,
    ) -> anyhow::Result<(Vec<ListedWork>, Option<(DateTime<Utc>, Uuid)>)> {
        let limit = limit.clamp(1, PAGE_MAX);
        let client = self.pool().get().await.context("getting a connection")?;
        let mut before = before;
        let mut rounds = 0;
        loop {
            rounds += 1;
            let (at, after_id) = before.unwrap_or((DateTime::<Utc>::MAX_UTC, Uuid::max()));
            let rows = client
                .query(
                    "SELECT work_id, liked_at FROM work_likes
                      WHERE user_id = $1 AND (liked_at, work_id) < ($2, $3)
                      ORDER BY liked_at DESC, work_id DESC LIMIT $4",
                    &[&user.as_uuid(), &at, &after_id, &(limit as i64)],
                )
                .await
                .context("reading a user's likes")?;
            let next = (rows.len() == limit).then(|| {
                let last = &rows[rows.len() - 1];
                (last.get::<_, DateTime<Utc>>(1), last.get::<_, Uuid>(0))
            });
            let ids: Vec<WorkId> = rows.iter().map(|row| row.get(0)).collect();
            let works = self.listed(&ids, Some(user), None).await?;
            // Every liked work of this page hidden since: read on (see `sorted_set_page`).
            if works.is_empty() && next.is_some() && rounds < FILTERED_PAGES_MAX {
                before = next;
                continue;
            }
            return Ok((works, next));
        }
    }

    /// How many follow `user` and whom `user` follows.
    pub async fn follow_counts(&self, user: UserId) -> anyhow::Result<(u64, u64)> {
        let mut connection = self.redis().connection().await?;
        let (followers, following): (u64, u64) = redis::pipe()
            .zcard(self.keys().followers(user))
            .zcard(self.keys().following(user))
            .query_async(&mut connection)
            .await
            .context("counting follows")?;
        Ok((followers, following))
    }

    /// Whether `follower` follows `creator`.
    pub async fn follows(&self, follower: UserId, creator: UserId) -> anyhow::Result<bool> {
        let mut connection = self.redis().connection().await?;
        let score: Option<f64> = connection
            .zscore(self.keys().following(follower), creator.to_string())
            .await
            .context("reading a follow")?;
        Ok(score.is_some())
    }

    /// The people both `viewer` and `creator` follow (their names; the sets live under two
    /// users' tags, so they are intersected here, not by one Redis command).
    pub async fn common_follows(
        &self,
        viewer: UserId,
        creator: UserId,
    ) -> anyhow::Result<Vec<(Uuid, String)>> {
        let mut connection = self.redis().connection().await?;
        let mine: Vec<String> = connection
            .zrange(self.keys().following(viewer), 0, FOLLOWING_READ_MAX - 1)
            .await
            .context("reading whom a user follows")?;
        let theirs: Vec<String> = connection
            .zrange(self.keys().following(creator), 0, FOLLOWING_READ_MAX - 1)
            .await
            .context("reading whom a creator follows")?;
        let mine: HashSet<String> = mine.into_iter().collect();
        let mut common = Vec::new();
        for id in theirs.into_iter().filter(|id| mine.contains(id)) {
            if let Ok(id) = Uuid::parse_str(&id) {
                common.push((id, self.name_of(id).await?.to_string()));
            }
        }
        Ok(common)
    }

    /// The user's feed: the works of the creators they follow now, newest first. Creators with few
    /// followers were pushed into the user's inbox when they published; those with many are
    /// read from their own works here (pull).
    pub async fn feed(
        &self,
        user: UserId,
        cursor: Option<Cursor>,
        limit: usize,
    ) -> anyhow::Result<WorkPage> {
        self.ensure_inbox(user).await?;
        let mut connection = self.redis().connection().await?;
        let following: Vec<String> = connection
            .zrange(self.keys().following(user), 0, -1)
            .await
            .context("reading whom a user follows")?;
        let famous: HashSet<String> = connection
            .smembers(self.keys().famous())
            .await
            .context("reading the pulled creators")?;
        let mut sources = vec![self.keys().inbox(user)];
        for creator in following.iter().filter(|id| famous.contains(*id)) {
            if let Ok(id) = Uuid::parse_str(creator) {
                sources.push(self.keys().creator_works(UserId::from_uuid(id)));
            }
        }
        // An inbox keeps what was pushed while the user followed; only the creators they follow
        // now are listed (an unfollow takes a creator's works out of the feed at once).
        let followed: HashSet<Uuid> = following
            .iter()
            .filter_map(|id| Uuid::parse_str(id).ok())
            .collect();
        self.sorted_set_page(&sources, cursor, limit, Some(user), Some(&followed))
            .await
    }

    /// An inbox that expired (its owner was away) is rebuilt: the newest works of the creators
    /// they follow, from each creator's own list in Redis (written by the publishing request at
    /// once). Not from the read models: a work published while its projection lags would be
    /// missed, and the worker's push, which skips an inbox that is not live, would not bring it
    /// back. Creators pulled at read time are left out (the feed reads them anyway). Reading an
    /// inbox keeps it live.
    async fn ensure_inbox(&self, user: UserId) -> anyhow::Result<()> {
        let keys = self.keys();
        let idle_ms = i64::from(self.settings().inbox_idle_days) * 86_400_000;
        let inbox_max = self.settings().inbox_max as usize;
        let mut connection = self.redis().connection().await?;
        let refreshed: bool = redis::cmd("PEXPIRE")
            .arg(keys.inbox_live(user))
            .arg(idle_ms)
            .query_async(&mut connection)
            .await
            .context("keeping an inbox live")?;
        if refreshed {
            let _: bool = connection
                .pexpire(keys.inbox(user), idle_ms)
                .await
                .context("keeping an inbox")?;
            return Ok(());
        }
        let following: Vec<String> = connection
            .zrange(keys.following(user), 0, -1)
            .await
            .context("reading whom a user follows")?;
        let famous: HashSet<String> = connection
            .smembers(keys.famous())
            .await
            .context("reading the pulled creators")?;
        let creators: Vec<UserId> = following
            .iter()
            .filter(|id| !famous.contains(*id))
            .filter_map(|id| Uuid::parse_str(id).ok().map(UserId::from_uuid))
            .collect();
        let lists: Vec<Vec<(String, f64)>> = super::each(
            &connection,
            creators.iter().map(|creator| {
                let mut command = redis::cmd("ZREVRANGE");
                command
                    .arg(keys.creator_works(*creator))
                    .arg(0)
                    .arg(inbox_max.saturating_sub(1))
                    .arg("WITHSCORES");
                command
            }),
        )
        .await
        .context("reading the followed creators' works")?;
        let mut newest: Vec<(String, f64)> = lists.into_iter().flatten().collect();
        newest.sort_by(|a, b| b.1.total_cmp(&a.1));
        newest.truncate(inbox_max);
        let mut invocation = super::keys::INBOX_STORE.key(keys.inbox(user));
        invocation.key(keys.inbox_live(user)).arg(idle_ms);
        for (work_id, published_ms) in &newest {
            invocation.arg(work_id).arg(*published_ms);
        }
        let _stored: i64 = invocation
            .invoke_async(&mut connection)
            .await
            .context("storing a rebuilt inbox")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(scores: &[(&str, f64)]) -> Vec<(String, f64)> {
        scores
            .iter()
            .map(|(member, score)| ((*member).to_owned(), *score))
            .collect()
    }

    /// Reads a whole list page by page as a client would, from the entries at or below each
    /// cursor (as Redis answers), and returns the members in the order shown.
    fn scroll(all: &[(String, f64)], limit: usize) -> Vec<String> {
        let mut shown = Vec::new();
        let mut cursor = None;
        for _ in 0..100 {
            let below: Vec<(String, f64)> = all
                .iter()
                .filter(|entry| cursor.is_none_or(|cursor: Cursor| entry.1 <= cursor.max))
                .cloned()
                .collect();
            let (page, next) = page_after(below, cursor, limit);
            shown.extend(page.into_iter().map(|entry| entry.0));
            match next {
                Some(next) => cursor = Some(next),
                None => return shown,
            }
        }
        panic!("the scroll did not end: {shown:?}");
    }

    #[test]
    fn equal_scores_are_neither_skipped_nor_repeated_and_a_page_of_one_score_moves_on() {
        let all = entries(&[
            ("a", 5.0),
            ("b", 4.0),
            ("c", 4.0),
            ("d", 4.0),
            ("e", 4.0),
            ("f", 4.0),
            ("g", 3.0),
            ("h", 3.0),
            ("i", 1.0),
        ]);
        for limit in 1..=10 {
            let shown = scroll(&all, limit);
            let mut expected = all.clone();
            order(&mut expected);
            let expected: Vec<String> = expected.into_iter().map(|entry| entry.0).collect();
            assert_eq!(shown, expected, "page size {limit}");
        }
    }

    #[test]
    fn a_cursor_reads_back_as_itself_and_nonsense_is_refused() {
        let cursor = Cursor {
            max: 1_764_000_000_123.0,
            offset: 3,
        };
        assert_eq!(Cursor::parse(&cursor.render()), Some(cursor));
        assert_eq!(Cursor::parse("inf:1"), None);
        assert_eq!(Cursor::parse("12"), None);
        assert_eq!(Cursor::parse("x:1"), None);
        // An offset no list can need is refused, not read as "skip that many".
        assert!(Cursor::parse(&format!("5:{CURSOR_OFFSET_MAX}")).is_some());
        assert_eq!(Cursor::parse(&format!("5:{}", CURSOR_OFFSET_MAX + 1)), None);
        assert_eq!(Cursor::parse("5:18446744073709551615"), None);
    }
}
