//! A work: images of one task that succeeded, published by the task's owner with a title, an
//! optional description and the choice to show the prompt or not.
//!
//! Rules:
//! - only the owner of a task that succeeded publishes it, and only images that task made (at
//!   least one, each once);
//! - a publish repeated with the same content adds nothing; a published work is not published
//!   again with other content (unpublish it first);
//! - the creator unpublishes at any time and may publish again later, the work keeping the time
//!   it was first published;
//! - an admin hides a work with a reason; a hidden work stays hidden: its creator can neither
//!   publish it again nor make it visible;
//! - to anyone but its creator, a work that is not theirs to change does not exist (as a task).
//!
//! The application reads the task's latest version and puts what it found into the command
//! ([`SourceTask`]): the decider stays pure.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{InvalidText, checked_text};
use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::identity::UserId;
use crate::task::TaskId;

/// A work's id: derived from its task's ([`work_id_of_task`]).
pub type WorkId = Uuid;

/// Longest title, in characters: one line on a phone's card, in any language.
pub const TITLE_LENGTH_MAX: usize = 60;
/// Longest description, in characters.
pub const DESCRIPTION_LENGTH_MAX: usize = 1_000;
/// Longest reason an admin gives for hiding a work.
pub const HIDE_REASON_LENGTH_MAX: usize = 200;
/// Images of one work, at most (no task makes more).
pub const WORK_IMAGES_MAX: usize = 16;

/// The namespace of work ids (UUIDv5 of the task id).
const WORK_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_776f_726b_0001);

/// The stream of a work.
pub fn work_stream(work_id: WorkId) -> String {
    format!("work-{work_id}")
}

/// The one work a task can become: a publish retried, or sent from two tabs, names the same work.
pub fn work_id_of_task(task_id: TaskId) -> WorkId {
    Uuid::new_v5(&WORK_NAMESPACE, task_id.as_bytes())
}

/// A work's title: one line, 1 to [`TITLE_LENGTH_MAX`] characters after trimming.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkTitle(String);

impl WorkTitle {
    pub fn parse(raw: &str) -> Result<WorkTitle, InvalidText> {
        checked_text(raw, 1, TITLE_LENGTH_MAX, false).map(WorkTitle)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A work's description: up to [`DESCRIPTION_LENGTH_MAX`] characters, line breaks allowed.
/// Empty after trimming is no description (`parse` answers `None`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkDescription(String);

impl WorkDescription {
    pub fn parse(raw: &str) -> Result<Option<WorkDescription>, InvalidText> {
        let text = checked_text(raw, 0, DESCRIPTION_LENGTH_MAX, true)?;
        Ok((!text.is_empty()).then_some(WorkDescription(text)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Why an admin hid a work: one line, 1 to [`HIDE_REASON_LENGTH_MAX`] characters. The creator
/// sees it; the audit log keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct HideReason(String);

impl HideReason {
    pub fn parse(raw: &str) -> Result<HideReason, InvalidText> {
        checked_text(raw, 1, HIDE_REASON_LENGTH_MAX, false).map(HideReason)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What the application read of the task a publish names, on its stream's latest version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceTask {
    pub task_id: TaskId,
    pub owner: UserId,
    pub succeeded: bool,
    /// The ids of the images it made, in its order.
    pub images: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkCommand {
    Publish {
        creator: UserId,
        source: SourceTask,
        /// The images to show, in this order: some or all of the task's.
        images: Vec<String>,
        title: WorkTitle,
        description: Option<WorkDescription>,
        prompt_shown: bool,
        at: DateTime<Utc>,
    },
    Unpublish {
        by: UserId,
        at: DateTime<Utc>,
    },
    Hide {
        admin: UserId,
        reason: HideReason,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkPublished {
    pub work_id: WorkId,
    pub creator: UserId,
    pub task_id: TaskId,
    pub images: Vec<String>,
    pub title: WorkTitle,
    pub description: Option<WorkDescription>,
    pub prompt_shown: bool,
    pub published_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkUnpublished {
    pub work_id: WorkId,
    pub by: UserId,
    pub unpublished_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkHidden {
    pub work_id: WorkId,
    pub admin: UserId,
    pub reason: HideReason,
    pub hidden_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkEvent {
    Published(WorkPublished),
    Unpublished(WorkUnpublished),
    Hidden(WorkHidden),
}

/// Where a work stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkStatus {
    /// No event yet.
    NotPublished,
    Published,
    Unpublished,
    Hidden,
}

impl WorkStatus {
    /// Whether others may see it, like it and find it in lists and feeds.
    pub fn is_visible(self) -> bool {
        self == WorkStatus::Published
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkState {
    pub status: WorkStatus,
    /// The last publication (kept when unpublished or hidden: the creator still sees it).
    pub last: Option<WorkPublished>,
    /// Why it was hidden, while it is.
    pub hidden_reason: Option<HideReason>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkError {
    /// Not the caller's, or not there: the same answer, so ids cannot be probed.
    #[error("no such work")]
    NoSuchWork,
    #[error("only the owner of a task can publish it")]
    NotYourTask,
    #[error("only a task that succeeded can be published")]
    TaskNotSucceeded,
    #[error("a work shows at least one image")]
    NoImages,
    #[error("a work shows at most {WORK_IMAGES_MAX} images")]
    TooManyImages,
    #[error("image {0} is not one this task made")]
    UnknownImage(String),
    #[error("image {0} is named twice")]
    ImageTwice(String),
    #[error("this task is published already with other content: unpublish it first")]
    AlreadyPublished,
    #[error("this work was hidden by an admin: {reason}")]
    HiddenByAdmin { reason: String },
}

#[derive(Debug)]
pub struct Work;

impl Work {
    fn check_publish(
        creator: UserId,
        source: &SourceTask,
        images: &[String],
    ) -> Result<(), WorkError> {
        if source.owner != creator {
            return Err(WorkError::NotYourTask);
        }
        if !source.succeeded {
            return Err(WorkError::TaskNotSucceeded);
        }
        if images.is_empty() {
            return Err(WorkError::NoImages);
        }
        if images.len() > WORK_IMAGES_MAX {
            return Err(WorkError::TooManyImages);
        }
        for (place, image) in images.iter().enumerate() {
            if !source.images.contains(image) {
                return Err(WorkError::UnknownImage(image.clone()));
            }
            if images[..place].contains(image) {
                return Err(WorkError::ImageTwice(image.clone()));
            }
        }
        Ok(())
    }
}

impl Decider for Work {
    type State = WorkState;
    type Command = WorkCommand;
    type Event = WorkEvent;
    type Error = WorkError;

    fn initial_state() -> WorkState {
        WorkState {
            status: WorkStatus::NotPublished,
            last: None,
            hidden_reason: None,
        }
    }

    fn decide(state: &WorkState, command: &WorkCommand) -> Result<Vec<WorkEvent>, WorkError> {
        match command {
            WorkCommand::Publish {
                creator,
                source,
                images,
                title,
                description,
                prompt_shown,
                at,
            } => {
                Work::check_publish(*creator, source, images)?;
                let published = WorkPublished {
                    work_id: work_id_of_task(source.task_id),
                    creator: *creator,
                    task_id: source.task_id,
                    images: images.clone(),
                    title: title.clone(),
                    description: description.clone(),
                    prompt_shown: *prompt_shown,
                    // Published again, a work keeps its first time: unpublishing and publishing
                    // again does not bring it back to the top of the new list, nor make it young
                    // in the hot one.
                    published_at: state.last.as_ref().map_or(*at, |last| last.published_at),
                };
                match state.status {
                    WorkStatus::NotPublished | WorkStatus::Unpublished => {
                        Ok(vec![WorkEvent::Published(published)])
                    }
                    WorkStatus::Published => {
                        let same = state.last.as_ref().is_some_and(|last| {
                            WorkPublished {
                                published_at: last.published_at,
                                ..published.clone()
                            } == *last
                        });
                        if same {
                            Ok(vec![])
                        } else {
                            Err(WorkError::AlreadyPublished)
                        }
                    }
                    WorkStatus::Hidden => Err(WorkError::HiddenByAdmin {
                        reason: state
                            .hidden_reason
                            .as_ref()
                            .map(|reason| reason.as_str().to_owned())
                            .unwrap_or_default(),
                    }),
                }
            }
            WorkCommand::Unpublish { by, at } => {
                let last = state
                    .last
                    .as_ref()
                    .filter(|last| last.creator == *by)
                    .ok_or(WorkError::NoSuchWork)?;
                match state.status {
                    WorkStatus::Published => Ok(vec![WorkEvent::Unpublished(WorkUnpublished {
                        work_id: last.work_id,
                        by: *by,
                        unpublished_at: *at,
                    })]),
                    // Not visible already: nothing to do.
                    WorkStatus::Unpublished | WorkStatus::Hidden | WorkStatus::NotPublished => {
                        Ok(vec![])
                    }
                }
            }
            WorkCommand::Hide { admin, reason, at } => {
                let last = state.last.as_ref().ok_or(WorkError::NoSuchWork)?;
                match state.status {
                    WorkStatus::Hidden => Ok(vec![]),
                    _ => Ok(vec![WorkEvent::Hidden(WorkHidden {
                        work_id: last.work_id,
                        admin: *admin,
                        reason: reason.clone(),
                        hidden_at: *at,
                    })]),
                }
            }
        }
    }

    fn evolve(state: WorkState, event: &WorkEvent) -> WorkState {
        match event {
            WorkEvent::Published(published) => WorkState {
                status: WorkStatus::Published,
                last: Some(published.clone()),
                hidden_reason: None,
            },
            WorkEvent::Unpublished(_) => WorkState {
                status: WorkStatus::Unpublished,
                ..state
            },
            WorkEvent::Hidden(hidden) => WorkState {
                status: WorkStatus::Hidden,
                hidden_reason: Some(hidden.reason.clone()),
                ..state
            },
        }
    }
}

impl DomainEvent for WorkEvent {
    fn event_type(&self) -> &'static str {
        match self {
            WorkEvent::Published(_) => "WorkPublished",
            WorkEvent::Unpublished(_) => "WorkUnpublished",
            WorkEvent::Hidden(_) => "WorkHidden",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            WorkEvent::Published(payload) => payload_of(payload),
            WorkEvent::Unpublished(payload) => payload_of(payload),
            WorkEvent::Hidden(payload) => payload_of(payload),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<WorkEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "WorkPublished" => Ok(WorkEvent::Published(parse_payload(event_type, payload)?)),
            "WorkUnpublished" => Ok(WorkEvent::Unpublished(parse_payload(event_type, payload)?)),
            "WorkHidden" => Ok(WorkEvent::Hidden(parse_payload(event_type, payload)?)),
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

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn user(n: u128) -> UserId {
        UserId::from_uuid(Uuid::from_u128(n))
    }

    fn task() -> TaskId {
        Uuid::from_u128(0x0192_3456_789a_7bcd_8ef0_0000_0000_0001)
    }

    fn source() -> SourceTask {
        SourceTask {
            task_id: task(),
            owner: user(1),
            succeeded: true,
            images: vec!["img-a".into(), "img-b".into()],
        }
    }

    fn publish(images: &[&str], title: &str) -> WorkCommand {
        WorkCommand::Publish {
            creator: user(1),
            source: source(),
            images: images.iter().map(|image| (*image).to_owned()).collect(),
            title: WorkTitle::parse(title).unwrap(),
            description: WorkDescription::parse("雨后的西湖，断桥边。").unwrap(),
            prompt_shown: false,
            at: at(0),
        }
    }

    fn published(images: &[&str], title: &str, seconds: i64) -> WorkEvent {
        WorkEvent::Published(WorkPublished {
            work_id: work_id_of_task(task()),
            creator: user(1),
            task_id: task(),
            images: images.iter().map(|image| (*image).to_owned()).collect(),
            title: WorkTitle::parse(title).unwrap(),
            description: WorkDescription::parse("雨后的西湖，断桥边。").unwrap(),
            prompt_shown: false,
            published_at: at(seconds),
        })
    }

    fn hidden() -> WorkEvent {
        WorkEvent::Hidden(WorkHidden {
            work_id: work_id_of_task(task()),
            admin: user(9),
            reason: HideReason::parse("含有他人肖像").unwrap(),
            hidden_at: at(20),
        })
    }

    fn unpublished() -> WorkEvent {
        WorkEvent::Unpublished(WorkUnpublished {
            work_id: work_id_of_task(task()),
            by: user(1),
            unpublished_at: at(10),
        })
    }

    #[test]
    fn the_owner_publishes_some_images_of_a_task_that_succeeded() {
        given::<Work>(&[])
            .when(publish(&["img-b"], "西湖雨景"))
            .then(&[published(&["img-b"], "西湖雨景", 0)]);
    }

    #[test]
    fn a_publish_is_refused_for_another_users_task_a_failed_one_and_images_it_did_not_make() {
        let mut command = publish(&["img-a"], "西湖");
        if let WorkCommand::Publish { creator, .. } = &mut command {
            *creator = user(2);
        }
        given::<Work>(&[])
            .when(command)
            .then_error(WorkError::NotYourTask);
        let mut command = publish(&["img-a"], "西湖");
        if let WorkCommand::Publish { source, .. } = &mut command {
            source.succeeded = false;
        }
        given::<Work>(&[])
            .when(command)
            .then_error(WorkError::TaskNotSucceeded);
        given::<Work>(&[])
            .when(publish(&[], "西湖"))
            .then_error(WorkError::NoImages);
        given::<Work>(&[])
            .when(publish(&["img-c"], "西湖"))
            .then_error(WorkError::UnknownImage("img-c".into()));
        given::<Work>(&[])
            .when(publish(&["img-a", "img-a"], "西湖"))
            .then_error(WorkError::ImageTwice("img-a".into()));
    }

    #[test]
    fn a_publish_repeated_adds_nothing_other_content_waits_for_an_unpublish_and_keeps_the_first_time()
     {
        let first = published(&["img-a"], "西湖", 0);
        given::<Work>(std::slice::from_ref(&first))
            .when(publish(&["img-a"], "西湖"))
            .then(&[]);
        given::<Work>(std::slice::from_ref(&first))
            .when(publish(&["img-a"], "断桥"))
            .then_error(WorkError::AlreadyPublished);
        // Published again later: the first time is kept.
        let mut later = publish(&["img-a"], "断桥");
        if let WorkCommand::Publish { at: when, .. } = &mut later {
            *when = at(30);
        }
        given::<Work>(&[first, unpublished()])
            .when(later)
            .then(&[published(&["img-a"], "断桥", 0)]);
    }

    #[test]
    fn only_the_creator_unpublishes_and_to_anyone_else_the_work_does_not_exist() {
        let first = published(&["img-a"], "西湖", 0);
        given::<Work>(std::slice::from_ref(&first))
            .when(WorkCommand::Unpublish {
                by: user(1),
                at: at(10),
            })
            .then(&[unpublished()]);
        given::<Work>(std::slice::from_ref(&first))
            .when(WorkCommand::Unpublish {
                by: user(2),
                at: at(10),
            })
            .then_error(WorkError::NoSuchWork);
        given::<Work>(&[first, unpublished()])
            .when(WorkCommand::Unpublish {
                by: user(1),
                at: at(11),
            })
            .then(&[]);
        given::<Work>(&[])
            .when(WorkCommand::Unpublish {
                by: user(1),
                at: at(11),
            })
            .then_error(WorkError::NoSuchWork);
    }

    #[test]
    fn a_hidden_work_stays_hidden_and_its_creator_is_told_why() {
        let first = published(&["img-a"], "西湖", 0);
        given::<Work>(std::slice::from_ref(&first))
            .when(WorkCommand::Hide {
                admin: user(9),
                reason: HideReason::parse("含有他人肖像").unwrap(),
                at: at(20),
            })
            .then(&[hidden()]);
        given::<Work>(&[first.clone(), hidden()])
            .when(publish(&["img-a"], "西湖"))
            .then_error(WorkError::HiddenByAdmin {
                reason: "含有他人肖像".into(),
            });
        given::<Work>(&[first.clone(), hidden()])
            .when(WorkCommand::Hide {
                admin: user(9),
                reason: HideReason::parse("again").unwrap(),
                at: at(30),
            })
            .then(&[]);
        let state = Work::fold(&[first, hidden()]);
        assert!(!state.status.is_visible());
        assert_eq!(state.hidden_reason.unwrap().as_str(), "含有他人肖像");
    }

    #[test]
    fn texts_are_counted_in_characters_and_their_rules_named() {
        assert!(WorkTitle::parse(&"雨".repeat(TITLE_LENGTH_MAX)).is_ok());
        assert_eq!(
            WorkTitle::parse(&"雨".repeat(TITLE_LENGTH_MAX + 1))
                .unwrap_err()
                .to_string(),
            "must be at most 60 characters long"
        );
        assert_eq!(
            WorkTitle::parse("   ").unwrap_err().0.rule,
            crate::rule::Rule::NotEmpty
        );
        assert!(WorkTitle::parse("两行\n标题").is_err());
        // Nothing to see is empty: zero-width spaces, joiners, soft hyphens, fillers.
        for blank in [
            "\u{200B}\u{200B}",
            "\u{2060}\u{FEFF}",
            "\u{00AD}",
            "\u{3164}",
            " \u{200D} ",
        ] {
            assert_eq!(
                WorkTitle::parse(blank).unwrap_err().0.rule,
                crate::rule::Rule::NotEmpty,
                "{blank:?}"
            );
        }
        assert_eq!(WorkDescription::parse("\u{200B}\n\u{FEFF}").unwrap(), None);
        // Line and paragraph separators break a line; direction overrides are refused.
        for broken in [
            "上\u{2028}下",
            "上\u{2029}下",
            "abc\u{202E}fed",
            "\u{2066}标题\u{2069}",
        ] {
            assert_eq!(
                WorkTitle::parse(broken).unwrap_err().0.rule,
                crate::rule::Rule::OneLine,
                "{broken:?}"
            );
        }
        assert!(
            WorkDescription::parse("第一段\u{2029}第二段")
                .unwrap()
                .is_some()
        );
        // Joiners and variation selectors inside what is seen are kept.
        let family = "👨\u{200D}👩\u{200D}👧 ❤\u{FE0F}";
        assert_eq!(WorkTitle::parse(family).unwrap().as_str(), family);
        assert_eq!(WorkDescription::parse("  ").unwrap(), None);
        assert!(WorkDescription::parse("第一行\n第二行").unwrap().is_some());
        assert!(HideReason::parse("").is_err());
    }

    #[test]
    fn a_task_is_one_work_whoever_publishes_it() {
        assert_eq!(work_id_of_task(task()), work_id_of_task(task()));
        assert_ne!(work_id_of_task(task()), work_id_of_task(Uuid::from_u128(2)));
        assert_eq!(
            work_stream(work_id_of_task(task())),
            format!("work-{}", work_id_of_task(task()))
        );
    }

    #[test]
    fn stored_events_read_back_as_themselves() {
        for event in [published(&["img-a"], "西湖", 0), unpublished(), hidden()] {
            let payload = event.to_payload();
            let read = WorkEvent::from_stored(event.event_type(), event.schema_version(), &payload)
                .unwrap();
            assert_eq!(read, event);
        }
    }
}
