//! The gallery half of `audit verify`: the work, like, follow, block and report streams folded
//! again and compared with `works`, `work_likes`, `follows` and `work_reports`.
//!
//! What is checked:
//! - no like, follow, block or report recorded twice in a row on its pair's stream (once per
//!   pair);
//! - each like and follow event names the pair its stream is for;
//! - every work's row has the status, title and images its events give, and a like count equal
//!   to the likes its pairs' streams hold now;
//! - `work_likes` and `follows` hold exactly the pairs whose streams say "yes" now;
//! - `work_reports` holds exactly one row per report stream, with its reason, and the status its
//!   stream and its work give: dismissed when the stream says so, else upheld when the work is
//!   hidden, else open.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Context;
use chrono::{DateTime, Utc};
use uuid::Uuid;
use zhihui_domain::gallery::block::{Block, BlockEvent, block_stream};
use zhihui_domain::gallery::follow::{Follow, FollowEvent, follow_stream};
use zhihui_domain::gallery::like::{Like, LikeEvent, like_stream};
use zhihui_domain::gallery::report::{Report, ReportEvent, ReportState, report_stream};
use zhihui_domain::gallery::work::{Work, WorkEvent, WorkState, WorkStatus};
use zhihui_domain::{Decider, DomainEvent};

use super::Difference;
use crate::platform::event_store::RecordedEvent;

#[derive(Default)]
pub(super) struct GalleryFold {
    works: BTreeMap<Uuid, WorkState>,
    likes: BTreeMap<(Uuid, Uuid), Option<DateTime<Utc>>>,
    follows: BTreeMap<(Uuid, Uuid), Option<DateTime<Utc>>>,
    /// Blocks are only checked for their pairs (no read model holds them: Redis is rebuilt from
    /// the streams).
    blocks: BTreeMap<(Uuid, Uuid), Option<DateTime<Utc>>>,
    reports: BTreeMap<(Uuid, Uuid), ReportState>,
    twice: Vec<(String, u64)>,
    misfiled: Vec<(String, u64)>,
}

fn status_name(status: WorkStatus) -> &'static str {
    match status {
        WorkStatus::NotPublished => "not_published",
        WorkStatus::Published => "published",
        WorkStatus::Unpublished => "unpublished",
        WorkStatus::Hidden => "hidden",
    }
}

impl GalleryFold {
    /// Whether the stream is the gallery's; folds its event if so.
    pub(super) fn event(&mut self, recorded: &RecordedEvent) -> anyhow::Result<bool> {
        let stream = recorded.stream.as_str();
        if let Some(id) = stream.strip_prefix("work-") {
            let Ok(work_id) = Uuid::parse_str(id) else {
                return Ok(false);
            };
            let event = WorkEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )?;
            let state = self
                .works
                .remove(&work_id)
                .unwrap_or_else(Work::initial_state);
            self.works.insert(work_id, Work::evolve(state, &event));
            return Ok(true);
        }
        if stream.starts_with("like-") {
            let event = LikeEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )?;
            let (work_id, user_id, liked) = match &event {
                LikeEvent::Liked(e) => (e.work_id, e.user_id, true),
                LikeEvent::Unliked(e) => (e.work_id, e.user_id, false),
            };
            if like_stream(work_id, user_id) != stream {
                self.misfiled
                    .push((stream.to_owned(), recorded.stream_version));
            }
            let state = self.likes.entry((work_id, user_id.as_uuid())).or_default();
            if liked && state.is_some() {
                self.twice
                    .push((stream.to_owned(), recorded.stream_version));
            }
            *state = Like::evolve(*state, &event);
            return Ok(true);
        }
        if stream.starts_with("report-") {
            let event = ReportEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )?;
            let (work_id, reporter) = match &event {
                ReportEvent::Reported(e) => (e.work_id, e.reporter),
                ReportEvent::Dismissed(e) => (e.work_id, e.reporter),
            };
            if report_stream(work_id, reporter) != stream {
                self.misfiled
                    .push((stream.to_owned(), recorded.stream_version));
            }
            let state = self
                .reports
                .remove(&(work_id, reporter.as_uuid()))
                .unwrap_or_else(Report::initial_state);
            if matches!(event, ReportEvent::Reported(_)) && state != ReportState::None {
                self.twice
                    .push((stream.to_owned(), recorded.stream_version));
            }
            self.reports
                .insert((work_id, reporter.as_uuid()), Report::evolve(state, &event));
            return Ok(true);
        }
        if stream.starts_with("block-") {
            let event = BlockEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )?;
            let (user, creator, blocking) = match &event {
                BlockEvent::Blocked(e) => (e.user, e.creator, true),
                BlockEvent::Unblocked(e) => (e.user, e.creator, false),
            };
            if block_stream(user, creator) != stream {
                self.misfiled
                    .push((stream.to_owned(), recorded.stream_version));
            }
            let state = self
                .blocks
                .entry((user.as_uuid(), creator.as_uuid()))
                .or_default();
            if blocking && state.is_some() {
                self.twice
                    .push((stream.to_owned(), recorded.stream_version));
            }
            *state = Block::evolve(*state, &event);
            return Ok(true);
        }
        if stream.starts_with("follow-") {
            let event = FollowEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )?;
            let (follower, creator, followed) = match &event {
                FollowEvent::Followed(e) => (e.follower, e.creator, true),
                FollowEvent::Unfollowed(e) => (e.follower, e.creator, false),
            };
            if follow_stream(follower, creator) != stream {
                self.misfiled
                    .push((stream.to_owned(), recorded.stream_version));
            }
            let state = self
                .follows
                .entry((follower.as_uuid(), creator.as_uuid()))
                .or_default();
            if followed && state.is_some() {
                self.twice
                    .push((stream.to_owned(), recorded.stream_version));
            }
            *state = Follow::evolve(*state, &event);
            return Ok(true);
        }
        Ok(false)
    }

    pub(super) async fn compare(
        &self,
        client: &tokio_postgres::Client,
        differences: &mut Vec<Difference>,
    ) -> anyhow::Result<()> {
        let difference = |read_model, key: String, detail: String| Difference {
            read_model,
            key,
            detail,
        };
        for (stream, version) in &self.twice {
            differences.push(difference(
                "gallery",
                format!("{stream}@{version}"),
                "recorded twice in a row: a pair is once".into(),
            ));
        }
        for (stream, version) in &self.misfiled {
            differences.push(difference(
                "gallery",
                format!("{stream}@{version}"),
                "the event names another pair than its stream".into(),
            ));
        }
        let mut like_counts: BTreeMap<Uuid, i64> = BTreeMap::new();
        for ((work_id, _), since) in &self.likes {
            if since.is_some() {
                *like_counts.entry(*work_id).or_default() += 1;
            }
        }
        let rows = client
            .query(
                "SELECT work_id, status, title, images, like_count FROM works",
                &[],
            )
            .await
            .context("reading works")?;
        let mut seen = BTreeSet::new();
        for row in rows {
            let work_id: Uuid = row.get(0);
            seen.insert(work_id);
            let status: String = row.get(1);
            let title: String = row.get(2);
            let images: Vec<String> = row.get(3);
            let like_count: i64 = row.get(4);
            let Some(state) = self.works.get(&work_id) else {
                differences.push(difference(
                    "works",
                    work_id.to_string(),
                    "a row without events".into(),
                ));
                continue;
            };
            let folded_status = status_name(state.status);
            if status != folded_status {
                differences.push(difference(
                    "works",
                    work_id.to_string(),
                    format!("status {status}, the events say {folded_status}"),
                ));
            }
            if let Some(last) = &state.last
                && (last.title.as_str() != title || last.images != images)
            {
                differences.push(difference(
                    "works",
                    work_id.to_string(),
                    "title or images differ from the last publication".into(),
                ));
            }
            let folded_likes = like_counts.get(&work_id).copied().unwrap_or(0);
            if like_count != folded_likes {
                differences.push(difference(
                    "works",
                    work_id.to_string(),
                    format!("like_count {like_count}, the like streams hold {folded_likes}"),
                ));
            }
        }
        for (work_id, state) in &self.works {
            if state.last.is_some() && !seen.contains(work_id) {
                differences.push(difference(
                    "works",
                    work_id.to_string(),
                    "published in the events, missing from the read model".into(),
                ));
            }
        }
        let liked: BTreeSet<(Uuid, Uuid)> = client
            .query("SELECT work_id, user_id FROM work_likes", &[])
            .await
            .context("reading work_likes")?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        let folded_liked: BTreeSet<(Uuid, Uuid)> = self
            .likes
            .iter()
            .filter(|(_, since)| since.is_some())
            .map(|(pair, _)| *pair)
            .collect();
        for pair in liked.symmetric_difference(&folded_liked) {
            differences.push(difference(
                "work_likes",
                format!("{}/{}", pair.0, pair.1),
                if liked.contains(pair) {
                    "a like the events do not hold".into()
                } else {
                    "a like of the events is missing".into()
                },
            ));
        }
        self.compare_reports(client, differences).await?;
        let followed: BTreeSet<(Uuid, Uuid)> = client
            .query("SELECT follower, creator FROM follows", &[])
            .await
            .context("reading follows")?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        let folded_followed: BTreeSet<(Uuid, Uuid)> = self
            .follows
            .iter()
            .filter(|(_, since)| since.is_some())
            .map(|(pair, _)| *pair)
            .collect();
        for pair in followed.symmetric_difference(&folded_followed) {
            differences.push(difference(
                "follows",
                format!("{}/{}", pair.0, pair.1),
                if followed.contains(pair) {
                    "a follow the events do not hold".into()
                } else {
                    "a follow of the events is missing".into()
                },
            ));
        }
        Ok(())
    }

    async fn compare_reports(
        &self,
        client: &tokio_postgres::Client,
        differences: &mut Vec<Difference>,
    ) -> anyhow::Result<()> {
        let rows = client
            .query(
                "SELECT work_id, reporter, reason, status FROM work_reports",
                &[],
            )
            .await
            .context("reading work_reports")?;
        let mut seen = BTreeSet::new();
        for row in rows {
            let pair: (Uuid, Uuid) = (row.get(0), row.get(1));
            let key = format!("{}/{}", pair.0, pair.1);
            seen.insert(pair);
            let reason: String = row.get(2);
            let status: String = row.get(3);
            let made = match self.reports.get(&pair) {
                Some(ReportState::Open(made)) => (made, "open"),
                Some(ReportState::Dismissed(made)) => (made, "dismissed"),
                Some(ReportState::None) | None => {
                    differences.push(Difference {
                        read_model: "work_reports",
                        key,
                        detail: "a report the events do not hold".into(),
                    });
                    continue;
                }
            };
            let hidden = self
                .works
                .get(&pair.0)
                .is_some_and(|work| work.status == WorkStatus::Hidden);
            let folded_status = match made.1 {
                "open" if hidden => "upheld",
                other => other,
            };
            if made.0.reason.as_str() != reason || folded_status != status {
                differences.push(Difference {
                    read_model: "work_reports",
                    key,
                    detail: format!(
                        "{reason}, {status}; the events say {}, {folded_status}",
                        made.0.reason.as_str()
                    ),
                });
            }
        }
        for (pair, state) in &self.reports {
            if *state != ReportState::None && !seen.contains(pair) {
                differences.push(Difference {
                    read_model: "work_reports",
                    key: format!("{}/{}", pair.0, pair.1),
                    detail: "a report of the events is missing".into(),
                });
            }
        }
        Ok(())
    }
}
