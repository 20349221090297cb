//! Reports of works to the admins, and the admins' queue of them.
//!
//! A report is decided on its pair's stream (`report-<work>-<user>`, `zhihui_domain::gallery::
//! report`): once per user per work under any race. The queue is the `work_reports` read model:
//! an admin dismisses the reports open on a work (each on its own stream, so a report that
//! arrives meanwhile stays open for the next look) or hides the work, which upholds them.

use anyhow::Context;
use chrono::{DateTime, Utc};
use uuid::Uuid;
use zhihui_domain::gallery::report::{
    Report, ReportCommand, ReportNote, ReportReason, report_stream,
};
use zhihui_domain::gallery::work::{Work, WorkId, WorkStatus, work_stream};
use zhihui_domain::rule::{Broken, Rule};
use zhihui_domain::user::UserId;

use super::{GalleryError, GalleryService, from_command};
use crate::platform::command;
use crate::platform::event_store::EventMetadata;

/// The reports of one work that no admin has looked at yet.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportedWork {
    pub work_id: WorkId,
    pub title: String,
    pub creator: Uuid,
    /// The work's status now (`published`, `unpublished`): a creator may take a reported work
    /// down before an admin looks.
    pub status: String,
    /// The first image, for a thumbnail; none once the work is taken down (nobody sees it
    /// any more, nor is it in a hurry to be hidden).
    pub cover: Option<String>,
    pub reports: u64,
    /// How many open reports give each reason, the most given first.
    pub reasons: Vec<(ReportReason, u64)>,
    /// The reporters' notes, the earliest first.
    pub notes: Vec<String>,
    pub first_reported_at: DateTime<Utc>,
}

/// The longest admins' queue one read gives.
pub const REPORTED_WORKS_MAX: i64 = 100;

impl GalleryService {
    /// The caller reports a work that others can see (not their own). Sending the same report
    /// again is a repeat, not a second report.
    pub async fn report(
        &self,
        reporter: UserId,
        work_id: WorkId,
        reason: &str,
        note: &str,
        metadata: &EventMetadata,
    ) -> Result<(), GalleryError> {
        let reason = ReportReason::parse(reason).ok_or_else(|| GalleryError::Invalid {
            field: "reason",
            broken: Broken::new(Rule::OneOf)
                .with("value", zhihui_domain::text::echoed(reason))
                .with(
                    "allowed",
                    ReportReason::ALL
                        .iter()
                        .map(|reason| reason.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
        })?;
        let note = ReportNote::parse(note).map_err(|error| GalleryError::Invalid {
            field: "note",
            broken: error.0,
        })?;
        // A cached card says the work is visible and whose it is; without one, the work's own
        // stream decides: a cache never refuses a report.
        let creator = match self.card(work_id).await? {
            Some(card) => Some(card.creator),
            None => {
                let work = command::load::<Work>(&self.store, &work_stream(work_id)).await?;
                work.state
                    .last
                    .filter(|_| work.state.status.is_visible())
                    .map(|last| last.creator.as_uuid())
            }
        };
        let command = ReportCommand::Report {
            work_id,
            reporter,
            work_visible: creator.is_some(),
            own_work: creator == Some(reporter.as_uuid()),
            reason,
            note,
            at: self.clock.now(),
        };
        command::execute_on::<Report>(
            &self.store,
            &report_stream(work_id, reporter),
            command::unwritten::<Report>(),
            &command,
            metadata,
            self.policy,
        )
        .await
        .map_err(from_command)?;
        Ok(())
    }

    /// An admin found nothing wrong with a work: its open reports are dismissed. Answers how
    /// many were (those the queue held when asked).
    pub async fn dismiss_reports(
        &self,
        admin: UserId,
        work_id: WorkId,
        metadata: &EventMetadata,
    ) -> Result<u64, GalleryError> {
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let reporters: Vec<Uuid> = client
            .query(
                "SELECT reporter FROM work_reports WHERE work_id = $1 AND status = 'open'",
                &[&work_id],
            )
            .await
            .context("reading a work's open reports")?
            .iter()
            .map(|row| row.get(0))
            .collect();
        drop(client);
        let mut dismissed = 0;
        for reporter in reporters {
            let command = ReportCommand::Dismiss {
                admin,
                at: self.clock.now(),
            };
            let executed = self
                .execute::<Report>(
                    &report_stream(work_id, UserId::from_uuid(reporter)),
                    &command,
                    metadata,
                )
                .await?;
            if !executed.new_events.is_empty() {
                dismissed += 1;
            }
        }
        Ok(dismissed)
    }

    /// The works with open reports, the most reported first (then the longest waiting), as they
    /// are now: the read model trails the works' events by a projection's batch, and an admin who
    /// has just hidden a work must not find it in the queue again. A work's cached card (dropped
    /// on every process when the work changes) says it is still published; without one, its
    /// stream says what became of it, and a hidden work leaves the queue.
    pub async fn reported_works(&self) -> anyhow::Result<Vec<ReportedWork>> {
        let mut current = Vec::new();
        for mut work in self.reported_works_projected().await? {
            let published = match self.card(work.work_id).await? {
                Some(_) => true,
                None => {
                    let loaded =
                        command::load::<Work>(&self.store, &work_stream(work.work_id)).await?;
                    match loaded.state.status {
                        WorkStatus::Hidden => continue,
                        status => status.is_visible(),
                    }
                }
            };
            if !published {
                work.status = "unpublished".to_owned();
                work.cover = None;
            }
            current.push(work);
        }
        Ok(current)
    }

    /// `reported_works` as the read model has them.
    async fn reported_works_projected(&self) -> anyhow::Result<Vec<ReportedWork>> {
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let rows = client
            .query(
                "SELECT r.work_id, w.title, w.creator, w.status, w.images[1], count(*),
                        array_agg(r.reason ORDER BY r.reported_at),
                        array_agg(r.note ORDER BY r.reported_at)
                            FILTER (WHERE r.note IS NOT NULL),
                        min(r.reported_at)
                   FROM work_reports r JOIN works w ON w.work_id = r.work_id
                  WHERE r.status = 'open'
                  GROUP BY r.work_id, w.title, w.creator, w.status, w.images[1]
                  ORDER BY count(*) DESC, min(r.reported_at), r.work_id
                  LIMIT $1",
                &[&REPORTED_WORKS_MAX],
            )
            .await
            .context("reading the reported works")?;
        rows.iter()
            .map(|row| {
                let reasons: Vec<String> = row.get(6);
                let mut counted: Vec<(ReportReason, u64)> = Vec::new();
                for reason in reasons {
                    let reason = ReportReason::parse(&reason)
                        .with_context(|| format!("an unknown report reason {reason:?}"))?;
                    match counted.iter_mut().find(|(seen, _)| *seen == reason) {
                        Some((_, count)) => *count += 1,
                        None => counted.push((reason, 1)),
                    }
                }
                // Most given first; among equals, the one given first.
                counted.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
                Ok(ReportedWork {
                    work_id: row.get(0),
                    title: row.get(1),
                    creator: row.get(2),
                    status: row.get(3),
                    cover: row.get(4),
                    reports: u64::try_from(row.get::<_, i64>(5))?,
                    reasons: counted,
                    notes: row.get::<_, Option<Vec<String>>>(7).unwrap_or_default(),
                    first_reported_at: row.get(8),
                })
            })
            .collect()
    }
}
