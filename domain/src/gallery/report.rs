//! One user's report of one work to the admins (`report-<work id>-<user id>`): once per user per
//! work, whatever the races (a double click reaching two processes appends at the same expected
//! version; the loser, decided again, finds the same report there and adds nothing).
//!
//! Rules:
//! - a work is reported only while others can see it (the application reads the work's latest
//!   version into the command), and never by its own creator;
//! - a report names one reason; "other" needs a note saying what is wrong;
//! - a user reports a work once: the same report again is a repeat, another one is refused;
//! - an admin dismisses a report (nothing wrong found); an admin who hides the work upholds it,
//!   told by the work's own `WorkHidden`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::work::WorkId;
use super::{InvalidText, checked_text};
use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::identity::UserId;

/// Longest note a reporter adds, in characters.
pub const REPORT_NOTE_LENGTH_MAX: usize = 200;

/// The stream of one user's report of one work.
pub fn report_stream(work_id: WorkId, reporter: UserId) -> String {
    format!("report-{work_id}-{reporter}")
}

/// What is wrong with a work, as the reporter sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportReason {
    /// Pornographic or vulgar.
    Sexual,
    /// Violent or gory.
    Violent,
    /// Against the law (including politically harmful content).
    Illegal,
    /// Someone else's work, likeness or trademark.
    Infringement,
    /// Advertising or spam.
    Spam,
    /// Something else: the note says what.
    Other,
}

impl ReportReason {
    pub const ALL: [ReportReason; 6] = [
        ReportReason::Sexual,
        ReportReason::Violent,
        ReportReason::Illegal,
        ReportReason::Infringement,
        ReportReason::Spam,
        ReportReason::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReportReason::Sexual => "sexual",
            ReportReason::Violent => "violent",
            ReportReason::Illegal => "illegal",
            ReportReason::Infringement => "infringement",
            ReportReason::Spam => "spam",
            ReportReason::Other => "other",
        }
    }

    pub fn parse(raw: &str) -> Option<ReportReason> {
        ReportReason::ALL
            .into_iter()
            .find(|reason| reason.as_str() == raw)
    }
}

/// What the reporter adds: one line, up to [`REPORT_NOTE_LENGTH_MAX`] characters; empty after
/// trimming is no note (`parse` answers `None`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReportNote(String);

impl ReportNote {
    pub fn parse(raw: &str) -> Result<Option<ReportNote>, InvalidText> {
        let text = checked_text(raw, 0, REPORT_NOTE_LENGTH_MAX, false)?;
        Ok((!text.is_empty()).then_some(ReportNote(text)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportCommand {
    Report {
        work_id: WorkId,
        reporter: UserId,
        /// Whether the work was published and not hidden, on its stream's latest version.
        work_visible: bool,
        /// Whether the reporter is the work's creator.
        own_work: bool,
        reason: ReportReason,
        note: Option<ReportNote>,
        at: DateTime<Utc>,
    },
    Dismiss {
        admin: UserId,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkReported {
    pub work_id: WorkId,
    pub reporter: UserId,
    pub reason: ReportReason,
    pub note: Option<ReportNote>,
    pub reported_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportDismissed {
    pub work_id: WorkId,
    pub reporter: UserId,
    pub admin: UserId,
    pub dismissed_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportEvent {
    Reported(WorkReported),
    Dismissed(ReportDismissed),
}

/// The pair's report, if any, and whether an admin dismissed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportState {
    None,
    Open(WorkReported),
    Dismissed(WorkReported),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("no such work")]
    NoSuchWork,
    #[error("a creator cannot report their own work")]
    OwnWork,
    #[error("a note saying what is wrong is required with the reason \"other\"")]
    NoteRequired,
    #[error("this work was reported by you already")]
    AlreadyReported,
}

#[derive(Debug)]
pub struct Report;

impl Decider for Report {
    type State = ReportState;
    type Command = ReportCommand;
    type Event = ReportEvent;
    type Error = ReportError;

    fn initial_state() -> ReportState {
        ReportState::None
    }

    fn decide(
        state: &ReportState,
        command: &ReportCommand,
    ) -> Result<Vec<ReportEvent>, ReportError> {
        match command {
            ReportCommand::Report {
                work_id,
                reporter,
                work_visible,
                own_work,
                reason,
                note,
                at,
            } => match state {
                ReportState::Open(made) | ReportState::Dismissed(made) => {
                    if made.reason == *reason && made.note == *note {
                        Ok(vec![])
                    } else {
                        Err(ReportError::AlreadyReported)
                    }
                }
                ReportState::None => {
                    if !work_visible {
                        return Err(ReportError::NoSuchWork);
                    }
                    if *own_work {
                        return Err(ReportError::OwnWork);
                    }
                    if *reason == ReportReason::Other && note.is_none() {
                        return Err(ReportError::NoteRequired);
                    }
                    Ok(vec![ReportEvent::Reported(WorkReported {
                        work_id: *work_id,
                        reporter: *reporter,
                        reason: *reason,
                        note: note.clone(),
                        reported_at: *at,
                    })])
                }
            },
            ReportCommand::Dismiss { admin, at } => match state {
                ReportState::Open(made) => Ok(vec![ReportEvent::Dismissed(ReportDismissed {
                    work_id: made.work_id,
                    reporter: made.reporter,
                    admin: *admin,
                    dismissed_at: *at,
                })]),
                ReportState::None | ReportState::Dismissed(_) => Ok(vec![]),
            },
        }
    }

    fn evolve(state: ReportState, event: &ReportEvent) -> ReportState {
        match (state, event) {
            (_, ReportEvent::Reported(made)) => ReportState::Open(made.clone()),
            (ReportState::Open(made) | ReportState::Dismissed(made), ReportEvent::Dismissed(_)) => {
                ReportState::Dismissed(made)
            }
            (ReportState::None, ReportEvent::Dismissed(_)) => ReportState::None,
        }
    }
}

impl DomainEvent for ReportEvent {
    fn event_type(&self) -> &'static str {
        match self {
            ReportEvent::Reported(_) => "WorkReported",
            ReportEvent::Dismissed(_) => "ReportDismissed",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            ReportEvent::Reported(payload) => payload_of(payload),
            ReportEvent::Dismissed(payload) => payload_of(payload),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<ReportEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "WorkReported" => Ok(ReportEvent::Reported(parse_payload(event_type, payload)?)),
            "ReportDismissed" => Ok(ReportEvent::Dismissed(parse_payload(event_type, payload)?)),
            other => Err(DecodeError::UnknownType {
                event_type: other.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::decider::given;
    use uuid::Uuid;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn work() -> WorkId {
        Uuid::from_u128(7)
    }

    fn reporter() -> UserId {
        UserId::from_uuid(Uuid::from_u128(1))
    }

    fn admin() -> UserId {
        UserId::from_uuid(Uuid::from_u128(9))
    }

    fn note(text: &str) -> Option<ReportNote> {
        ReportNote::parse(text).unwrap()
    }

    fn report(reason: ReportReason, text: &str, seconds: i64) -> ReportCommand {
        ReportCommand::Report {
            work_id: work(),
            reporter: reporter(),
            work_visible: true,
            own_work: false,
            reason,
            note: note(text),
            at: at(seconds),
        }
    }

    fn reported(reason: ReportReason, text: &str, seconds: i64) -> ReportEvent {
        ReportEvent::Reported(WorkReported {
            work_id: work(),
            reporter: reporter(),
            reason,
            note: note(text),
            reported_at: at(seconds),
        })
    }

    fn dismissed(seconds: i64) -> ReportEvent {
        ReportEvent::Dismissed(ReportDismissed {
            work_id: work(),
            reporter: reporter(),
            admin: admin(),
            dismissed_at: at(seconds),
        })
    }

    #[test]
    fn a_report_is_made_once_and_the_same_report_again_is_a_repeat() {
        given::<Report>(&[])
            .when(report(ReportReason::Sexual, "画面低俗", 0))
            .then(&[reported(ReportReason::Sexual, "画面低俗", 0)]);
        // The second of a double click, decided again after losing the race: nothing new.
        given::<Report>(&[reported(ReportReason::Sexual, "画面低俗", 0)])
            .when(report(ReportReason::Sexual, "画面低俗", 1))
            .then(&[]);
        // Another reason or note is another report: refused, also after a dismissal.
        given::<Report>(&[reported(ReportReason::Sexual, "画面低俗", 0)])
            .when(report(ReportReason::Spam, "", 2))
            .then_error(ReportError::AlreadyReported);
        given::<Report>(&[reported(ReportReason::Sexual, "", 0), dismissed(5)])
            .when(report(ReportReason::Sexual, "再看看", 6))
            .then_error(ReportError::AlreadyReported);
    }

    #[test]
    fn only_a_visible_work_of_someone_else_is_reported_and_other_needs_a_note() {
        let hidden = ReportCommand::Report {
            work_id: work(),
            reporter: reporter(),
            work_visible: false,
            own_work: false,
            reason: ReportReason::Spam,
            note: None,
            at: at(0),
        };
        given::<Report>(&[])
            .when(hidden)
            .then_error(ReportError::NoSuchWork);
        let own = ReportCommand::Report {
            work_id: work(),
            reporter: reporter(),
            work_visible: true,
            own_work: true,
            reason: ReportReason::Spam,
            note: None,
            at: at(0),
        };
        given::<Report>(&[])
            .when(own)
            .then_error(ReportError::OwnWork);
        given::<Report>(&[])
            .when(report(ReportReason::Other, "  ", 0))
            .then_error(ReportError::NoteRequired);
        given::<Report>(&[])
            .when(report(ReportReason::Other, "盗用了我的头像", 0))
            .then(&[reported(ReportReason::Other, "盗用了我的头像", 0)]);
    }

    #[test]
    fn an_admin_dismisses_an_open_report_once() {
        let dismiss = |seconds| ReportCommand::Dismiss {
            admin: admin(),
            at: at(seconds),
        };
        given::<Report>(&[reported(ReportReason::Violent, "", 0)])
            .when(dismiss(3))
            .then(&[dismissed(3)]);
        given::<Report>(&[reported(ReportReason::Violent, "", 0), dismissed(3)])
            .when(dismiss(4))
            .then(&[]);
        given::<Report>(&[]).when(dismiss(4)).then(&[]);
        assert_eq!(
            Report::fold(&[reported(ReportReason::Violent, "", 0), dismissed(3)]),
            ReportState::Dismissed(WorkReported {
                work_id: work(),
                reporter: reporter(),
                reason: ReportReason::Violent,
                note: None,
                reported_at: at(0),
            })
        );
    }

    #[test]
    fn reasons_and_notes_read_back_as_themselves() {
        for reason in ReportReason::ALL {
            assert_eq!(ReportReason::parse(reason.as_str()), Some(reason));
        }
        assert_eq!(ReportReason::parse("rude"), None);
        assert!(ReportNote::parse(&"字".repeat(REPORT_NOTE_LENGTH_MAX + 1)).is_err());
        assert!(ReportNote::parse("一行\n两行").is_err());
        for event in [reported(ReportReason::Other, "盗图", 0), dismissed(5)] {
            let read = ReportEvent::from_stored(
                event.event_type(),
                event.schema_version(),
                &event.to_payload(),
            )
            .unwrap();
            assert_eq!(read, event);
        }
        assert_eq!(
            report_stream(work(), reporter()),
            format!("report-{}-{}", work(), reporter())
        );
    }
}
