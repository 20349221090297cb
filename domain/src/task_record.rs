//! A task as its owner and the admins see it: the `tasks` read model's row, folded from the
//! task's stream. One fold serves the projection (which stores the record) and the API (which
//! folds the stream itself when the projection has not reached a just-submitted task yet), so
//! the two can never tell a task's story differently.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::points::Amount;
use crate::task::{TaskEvent, TaskId, TaskImage, TaskSpec, TaskStatus};
use crate::user::UserId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRecord {
    pub task_id: TaskId,
    pub user_id: UserId,
    pub status: TaskStatus,
    /// As the user typed them.
    pub prompt: String,
    pub negative_prompt: String,
    pub spec: TaskSpec,
    pub price: Amount,
    /// Queue order while queued (lower first); `None` once the task left the queue.
    pub queue_score: Option<i64>,
    pub cancel_requested: bool,
    /// How many prioritise operations were recorded.
    pub prioritised: u32,
    pub backend: Option<String>,
    pub prompt_id: Option<Uuid>,
    pub images: Vec<TaskImage>,
    pub failure_reason: Option<String>,
    pub submitted_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Stream version of the last event folded in: an event at or below it is not applied again.
    pub version: u64,
}

impl TaskRecord {
    /// Folds the event recorded at `version` of task `task_id`'s stream into `record`.
    ///
    /// A task exists from its `Submitted` event: any other event before it leaves `None` (a
    /// stream with only `Abandoned` never had a task). An event at or below the record's version
    /// was folded already and changes nothing, so replaying a batch twice is harmless.
    pub fn evolve(
        record: Option<TaskRecord>,
        task_id: TaskId,
        event: &TaskEvent,
        version: u64,
    ) -> Option<TaskRecord> {
        let Some(mut record) = record else {
            let TaskEvent::Submitted(e) = event else {
                return None;
            };
            return Some(TaskRecord {
                task_id,
                user_id: e.user_id,
                status: TaskStatus::Submitted,
                prompt: e.prompt.as_str().into(),
                negative_prompt: e.negative_prompt.as_str().into(),
                spec: e.spec.clone(),
                price: e.price,
                queue_score: None,
                cancel_requested: false,
                prioritised: 0,
                backend: None,
                prompt_id: None,
                images: vec![],
                failure_reason: None,
                submitted_at: e.at,
                finished_at: None,
                version,
            });
        };
        if version <= record.version {
            return Some(record);
        }
        record.version = version;
        match event {
            // A second submission cannot be recorded (the decider refuses it): nothing to fold.
            TaskEvent::Submitted(_) => {}
            TaskEvent::Queued(e) => {
                record.status = TaskStatus::Queued;
                record.queue_score = Some(e.score);
            }
            TaskEvent::Prioritised(e) => {
                record.queue_score = Some(e.to_score);
                record.prioritised += 1;
            }
            // Money and fencing: nothing the task's view shows.
            TaskEvent::PrioritisationAbandoned(_)
            | TaskEvent::Abandoned(_)
            | TaskEvent::Adopted(_) => {}
            TaskEvent::CancelRequested(_) => record.cancel_requested = true,
            TaskEvent::Cancelled(e) => {
                record.status = TaskStatus::Cancelled;
                record.queue_score = None;
                record.finished_at = Some(e.at);
            }
            TaskEvent::Dispatched(e) => {
                record.status = TaskStatus::Dispatched;
                record.queue_score = None;
                record.backend = Some(e.backend.clone());
                record.prompt_id = Some(e.prompt_id);
            }
            TaskEvent::Started(_) => record.status = TaskStatus::Running,
            TaskEvent::Succeeded(e) => {
                record.status = TaskStatus::Succeeded;
                record.images = e.images.clone();
                record.finished_at = Some(e.at);
            }
            TaskEvent::Failed(e) => {
                record.status = TaskStatus::Failed;
                record.failure_reason = Some(e.reason.clone());
                record.finished_at = Some(e.at);
            }
        }
        Some(record)
    }

    /// The record of a whole stream, its events in order from version 0 (the store's first).
    pub fn fold<'a>(
        task_id: TaskId,
        events: impl IntoIterator<Item = &'a TaskEvent>,
    ) -> Option<TaskRecord> {
        events
            .into_iter()
            .zip(0u64..)
            .fold(None, |record, (event, version)| {
                TaskRecord::evolve(record, task_id, event, version)
            })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::task::{
        TaskAbandoned, TaskCancelRequested, TaskCancelled, TaskDispatched, TaskFailed,
        TaskPrioritised, TaskQueued, TaskStarted, TaskSucceeded,
    };

    fn at(second: u32) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(&format!("2027-01-15T01:00:{second:02}Z"))
            .unwrap()
            .into()
    }

    fn task_id() -> TaskId {
        Uuid::from_u128(10)
    }

    fn submitted() -> TaskEvent {
        TaskEvent::Submitted(crate::task::tests::submitted())
    }

    fn queued(score: i64) -> TaskEvent {
        TaskEvent::Queued(TaskQueued { score, at: at(1) })
    }

    fn dispatched() -> TaskEvent {
        TaskEvent::Dispatched(TaskDispatched {
            backend: "gpu-1".into(),
            prompt_id: Uuid::from_u128(99),
            fencing_token: 5,
            at: at(3),
        })
    }

    #[test]
    fn given_no_submission_when_any_event_then_there_is_no_task() {
        let abandoned = TaskEvent::Abandoned(TaskAbandoned {
            reason: "crashed".into(),
            at: at(0),
        });
        assert_eq!(TaskRecord::fold(task_id(), [&abandoned, &queued(5)]), None);
    }

    #[test]
    fn given_a_submission_then_the_record_shows_what_the_user_typed_and_its_price() {
        let record = TaskRecord::fold(task_id(), [&submitted()]).unwrap();
        assert_eq!(record.status, TaskStatus::Submitted);
        assert_eq!(record.prompt, "a cat");
        assert_eq!(record.negative_prompt, "");
        assert_eq!(record.price, Amount::whole(1));
        assert_eq!(record.submitted_at, at(0));
        assert_eq!(record.version, 0);
    }

    #[test]
    fn given_a_queued_task_when_prioritised_twice_then_it_carries_the_last_score_and_the_count() {
        let prioritised = |to_score| {
            TaskEvent::Prioritised(TaskPrioritised {
                operation_id: Uuid::new_v4(),
                fee: Amount::whole(1),
                from_score: 100,
                to_score,
                at: at(2),
            })
        };
        let record = TaskRecord::fold(
            task_id(),
            [
                &submitted(),
                &queued(100),
                &prioritised(50),
                &prioritised(20),
            ],
        )
        .unwrap();
        assert_eq!(record.status, TaskStatus::Queued);
        assert_eq!(record.queue_score, Some(20));
        assert_eq!(record.prioritised, 2);
    }

    #[test]
    fn given_a_dispatched_task_when_it_succeeds_then_it_has_left_the_queue_with_its_images() {
        let succeeded = TaskEvent::Succeeded(TaskSucceeded {
            images: vec![TaskImage {
                image_id: "abc".into(),
                content_type: "image/png".into(),
            }],
            at: at(9),
        });
        let record = TaskRecord::fold(
            task_id(),
            [
                &submitted(),
                &queued(100),
                &dispatched(),
                &TaskEvent::Started(TaskStarted { at: at(4) }),
                &succeeded,
            ],
        )
        .unwrap();
        assert_eq!(record.status, TaskStatus::Succeeded);
        assert_eq!(record.queue_score, None);
        assert_eq!(record.backend.as_deref(), Some("gpu-1"));
        assert_eq!(record.prompt_id, Some(Uuid::from_u128(99)));
        assert_eq!(record.images.len(), 1);
        assert_eq!(record.finished_at, Some(at(9)));
        assert_eq!(record.failure_reason, None);
    }

    #[test]
    fn given_a_cancel_request_when_cancelled_then_the_record_is_finished_and_out_of_the_queue() {
        let user = UserId::from_uuid(Uuid::from_u128(1));
        let record = TaskRecord::fold(
            task_id(),
            [
                &submitted(),
                &queued(100),
                &TaskEvent::CancelRequested(TaskCancelRequested {
                    by: user,
                    at: at(2),
                }),
                &TaskEvent::Cancelled(TaskCancelled {
                    by: Some(user),
                    at: at(3),
                }),
            ],
        )
        .unwrap();
        assert!(record.cancel_requested);
        assert_eq!(record.status, TaskStatus::Cancelled);
        assert_eq!(record.queue_score, None);
        assert_eq!(record.finished_at, Some(at(3)));
    }

    #[test]
    fn given_a_failed_task_then_the_reason_is_kept_as_said() {
        let failed = TaskEvent::Failed(TaskFailed {
            reason: "the image server lost the task".into(),
            at: at(7),
        });
        let record = TaskRecord::fold(
            task_id(),
            [&submitted(), &queued(1), &dispatched(), &failed],
        )
        .unwrap();
        assert_eq!(record.status, TaskStatus::Failed);
        assert_eq!(
            record.failure_reason.as_deref(),
            Some("the image server lost the task")
        );
    }

    #[test]
    fn given_a_record_when_an_event_at_or_below_its_version_comes_again_then_nothing_changes() {
        let record = TaskRecord::fold(task_id(), [&submitted(), &queued(100), &dispatched()]);
        // Version 1 again (a replayed batch): the task must not go back to the queue.
        let again = TaskRecord::evolve(record.clone(), task_id(), &queued(100), 1);
        assert_eq!(again, record);
        assert_eq!(again.unwrap().status, TaskStatus::Dispatched);
    }

    #[test]
    fn every_status_reads_back_from_the_name_the_read_model_stores() {
        for name in [
            "unknown",
            "submitted",
            "queued",
            "dispatched",
            "running",
            "succeeded",
            "failed",
            "cancelled",
            "abandoned",
        ] {
            assert_eq!(TaskStatus::parse(name).unwrap().as_str(), name);
        }
        assert_eq!(TaskStatus::parse("done"), None);
    }
}
