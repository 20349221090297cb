#![allow(clippy::unwrap_used)]

use super::*;
use crate::decider::given;

fn at() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2027-01-15T01:00:00Z")
        .unwrap()
        .into()
}

fn alice() -> UserId {
    UserId::from_uuid(Uuid::from_u128(1))
}

fn bob() -> UserId {
    UserId::from_uuid(Uuid::from_u128(2))
}

/// Alice's task 10 (one image, 1 point), submitted at 01:00; other modules' tests use it.
pub(crate) fn submitted() -> Box<TaskSubmitted> {
    Box::new(TaskSubmitted {
        task_id: Uuid::from_u128(10),
        user_id: alice(),
        spec: TaskSpec {
            model: "majicmixRealistic_v7.safetensors".into(),
            width: 512,
            height: 512,
            steps: 20,
            cfg: Decimal::new(70, 1),
            sampler: "euler".into(),
            scheduler: "karras".into(),
            seed: 42,
            images: 1,
        },
        prompt: PromptText::parse("a cat", 100, false).unwrap(),
        negative_prompt: PromptText::parse("", 100, true).unwrap(),
        prompt_used: "(8k),a cat".into(),
        negative_prompt_used: ",bad face".into(),
        price: Amount::whole(1),
        workflow: serde_json::json!({}).into(),
        request_digest: "d".into(),
        at: at(),
    })
}

fn queued_at(score: i64) -> Vec<TaskEvent> {
    vec![
        TaskEvent::Submitted(submitted()),
        TaskEvent::Queued(TaskQueued { score, at: at() }),
    ]
}

fn dispatched() -> Vec<TaskEvent> {
    let mut events = queued_at(100);
    events.push(TaskEvent::Dispatched(TaskDispatched {
        backend: "gpu-1".into(),
        prompt_id: Uuid::from_u128(99),
        fencing_token: 5,
        at: at(),
    }));
    events
}

#[test]
fn a_submission_is_recorded_and_queued_once() {
    given::<Task>(&[])
        .when(TaskCommand::Submit {
            submitted: submitted(),
            score: 100,
        })
        .then(&queued_at(100));
    given::<Task>(&queued_at(100))
        .when(TaskCommand::Submit {
            submitted: submitted(),
            score: 100,
        })
        .then_error(TaskError::AlreadySubmitted);
}

#[test]
fn abandon_fences_only_a_task_that_was_never_recorded() {
    let abandoned = TaskEvent::Abandoned(TaskAbandoned {
        reason: "crashed".into(),
        at: at(),
    });
    given::<Task>(&[])
        .when(TaskCommand::Abandon {
            reason: "crashed".into(),
            at: at(),
        })
        .then(std::slice::from_ref(&abandoned));
    given::<Task>(&queued_at(100))
        .when(TaskCommand::Abandon {
            reason: "crashed".into(),
            at: at(),
        })
        .then(&[]);
    // After the fence the submission can no longer be recorded.
    given::<Task>(&[abandoned])
        .when(TaskCommand::Submit {
            submitted: submitted(),
            score: 100,
        })
        .then_error(TaskError::AlreadySubmitted);
}

fn prioritise(by: UserId, operation: u128, to_score: i64) -> TaskCommand {
    TaskCommand::Prioritise {
        by,
        operation_id: Uuid::from_u128(operation),
        fee: Amount::whole(5),
        to_score,
        at: at(),
    }
}

#[test]
fn prioritise_moves_a_queued_task_ahead_once_per_operation() {
    let moved = TaskEvent::Prioritised(TaskPrioritised {
        operation_id: Uuid::from_u128(7),
        fee: Amount::whole(5),
        from_score: 100,
        to_score: 50,
        at: at(),
    });
    given::<Task>(&queued_at(100))
        .when(prioritise(alice(), 7, 50))
        .then(std::slice::from_ref(&moved));
    let mut past = queued_at(100);
    past.push(moved);
    // A retry of the same operation changes nothing (and is not charged again).
    given::<Task>(&past)
        .when(prioritise(alice(), 7, 20))
        .then(&[]);
    let state = Task::fold(&past);
    assert_eq!(state.score, Some(50));
}

#[test]
fn prioritise_is_refused_for_others_not_queued_or_not_ahead() {
    given::<Task>(&queued_at(100))
        .when(prioritise(bob(), 7, 50))
        .then_error(TaskError::NotOwner);
    given::<Task>(&[])
        .when(prioritise(alice(), 7, 50))
        .then_error(TaskError::NotFound);
    given::<Task>(&queued_at(100))
        .when(prioritise(alice(), 7, 100))
        .then_error(TaskError::NotAhead {
            current: 100,
            requested: 100,
        });
    given::<Task>(&dispatched())
        .when(prioritise(alice(), 7, 50))
        .then_error(TaskError::NotQueued {
            status: TaskStatus::Dispatched,
        });
}

#[test]
fn an_abandoned_prioritisation_can_never_be_recorded() {
    let mut past = queued_at(100);
    past.push(TaskEvent::PrioritisationAbandoned(
        PrioritisationAbandoned {
            operation_id: Uuid::from_u128(7),
            at: at(),
        },
    ));
    given::<Task>(&past)
        .when(prioritise(alice(), 7, 50))
        .then_error(TaskError::PrioritisationAbandoned(Uuid::from_u128(7)));
    // Abandoning a prioritisation that moved the task changes nothing: it was paid for.
    let mut moved = queued_at(100);
    moved.push(TaskEvent::Prioritised(TaskPrioritised {
        operation_id: Uuid::from_u128(8),
        fee: Amount::whole(5),
        from_score: 100,
        to_score: 50,
        at: at(),
    }));
    given::<Task>(&moved)
        .when(TaskCommand::AbandonPrioritisation {
            operation_id: Uuid::from_u128(8),
            at: at(),
        })
        .then(&[]);
}

#[test]
fn cancel_of_a_queued_task_cancels_it_and_a_running_one_asks_the_dispatcher() {
    let by_alice = TaskCommand::Cancel {
        by: Canceller::User(alice()),
        at: at(),
    };
    let cancelled = TaskEvent::Cancelled(TaskCancelled {
        by: Some(alice()),
        at: at(),
    });
    given::<Task>(&queued_at(100))
        .when(by_alice.clone())
        .then(std::slice::from_ref(&cancelled));
    let mut past = queued_at(100);
    past.push(cancelled);
    given::<Task>(&past).when(by_alice.clone()).then(&[]);
    let state = Task::fold(&past);
    assert_eq!(state.hold_outcome(), HoldOutcome::Release);

    let request = TaskEvent::CancelRequested(TaskCancelRequested {
        by: alice(),
        at: at(),
    });
    given::<Task>(&dispatched())
        .when(by_alice.clone())
        .then(std::slice::from_ref(&request));
    let mut running = dispatched();
    running.push(request);
    given::<Task>(&running).when(by_alice).then(&[]);
    given::<Task>(&running)
        .when(TaskCommand::Cancel {
            by: Canceller::Dispatcher { fencing_token: 5 },
            at: at(),
        })
        .then(&[TaskEvent::Cancelled(TaskCancelled { by: None, at: at() })]);
}

#[test]
fn cancel_is_refused_for_others_and_for_finished_tasks() {
    given::<Task>(&queued_at(100))
        .when(TaskCommand::Cancel {
            by: Canceller::User(bob()),
            at: at(),
        })
        .then_error(TaskError::NotOwner);
    let mut succeeded = dispatched();
    succeeded.push(TaskEvent::Succeeded(TaskSucceeded {
        images: vec![],
        at: at(),
    }));
    given::<Task>(&succeeded)
        .when(TaskCommand::Cancel {
            by: Canceller::User(alice()),
            at: at(),
        })
        .then_error(TaskError::Finished {
            status: TaskStatus::Succeeded,
        });
    assert_eq!(Task::fold(&succeeded).hold_outcome(), HoldOutcome::Settle);
}

#[test]
fn the_dispatcher_moves_a_task_to_exactly_one_end() {
    let cancelled = {
        let mut past = queued_at(100);
        past.push(TaskEvent::Cancelled(TaskCancelled {
            by: Some(alice()),
            at: at(),
        }));
        past
    };
    let dispatch = TaskCommand::Dispatch {
        backend: "gpu-1".into(),
        prompt_id: Uuid::from_u128(99),
        fencing_token: 5,
        at: at(),
    };
    given::<Task>(&cancelled)
        .when(dispatch.clone())
        .then_error(TaskError::NotQueued {
            status: TaskStatus::Cancelled,
        });
    // The same dispatch again (a retried append) is a repeat.
    given::<Task>(&dispatched()).when(dispatch).then(&[]);
    let mut failed = dispatched();
    failed.push(TaskEvent::Failed(TaskFailed {
        reason: "out of memory".into(),
        at: at(),
    }));
    given::<Task>(&failed)
        .when(TaskCommand::Succeed {
            images: vec![],
            fencing_token: 5,
            at: at(),
        })
        .then_error(TaskError::InvalidTransition {
            status: TaskStatus::Failed,
            action: "succeed",
        });
    given::<Task>(&dispatched())
        .when(TaskCommand::Start {
            fencing_token: 5,
            at: at(),
        })
        .then(&[TaskEvent::Started(TaskStarted { at: at() })]);
}

#[test]
fn a_new_leader_adopts_a_task_and_the_old_one_is_refused() {
    let adopt = |fencing_token| TaskCommand::Adopt {
        fencing_token,
        at: at(),
    };
    let adopted = TaskEvent::Adopted(TaskAdopted {
        fencing_token: 6,
        at: at(),
    });
    given::<Task>(&dispatched())
        .when(adopt(6))
        .then(std::slice::from_ref(&adopted));
    let mut past = dispatched();
    past.push(adopted);
    // Adopting again with the same token is a repeat; an older leader cannot adopt back.
    given::<Task>(&past).when(adopt(6)).then(&[]);
    given::<Task>(&past)
        .when(adopt(5))
        .then_error(TaskError::StaleDispatcher { token: 5, fence: 6 });
    // Every dispatcher command of the old leader is refused; the new leader's are not.
    for stale in [
        TaskCommand::Start {
            fencing_token: 5,
            at: at(),
        },
        TaskCommand::Succeed {
            images: vec![],
            fencing_token: 5,
            at: at(),
        },
        TaskCommand::Fail {
            reason: "lost".into(),
            fencing_token: 5,
            at: at(),
        },
        TaskCommand::Cancel {
            by: Canceller::Dispatcher { fencing_token: 5 },
            at: at(),
        },
    ] {
        given::<Task>(&past)
            .when(stale)
            .then_error(TaskError::StaleDispatcher { token: 5, fence: 6 });
    }
    given::<Task>(&past)
        .when(TaskCommand::Fail {
            reason: "lost".into(),
            fencing_token: 6,
            at: at(),
        })
        .then(&[TaskEvent::Failed(TaskFailed {
            reason: "lost".into(),
            at: at(),
        })]);
    // A user's cancel carries no token: it is a request, carried out by the leader.
    given::<Task>(&past)
        .when(TaskCommand::Cancel {
            by: Canceller::User(alice()),
            at: at(),
        })
        .then(&[TaskEvent::CancelRequested(TaskCancelRequested {
            by: alice(),
            at: at(),
        })]);
    // A queued task cannot be adopted, and a dispatch with an older token than recorded
    // elsewhere on the task is refused.
    given::<Task>(&queued_at(100))
        .when(adopt(6))
        .then_error(TaskError::InvalidTransition {
            status: TaskStatus::Queued,
            action: "be adopted",
        });
}

#[test]
fn prompts_are_trimmed_bounded_and_free_of_control_characters() {
    assert_eq!(
        PromptText::parse("  a cat \n", 10, false).unwrap().as_str(),
        "a cat"
    );
    assert!(PromptText::parse("   ", 10, false).is_err());
    assert!(PromptText::parse("", 10, true).is_ok());
    assert!(PromptText::parse("abcdefghijk", 10, false).is_err());
    assert!(PromptText::parse("a\u{0}b", 10, false).is_err());
    assert!(PromptText::parse("line\nbreak\t\"quote\"", 30, false).is_ok());
    // Characters that draw nothing make no prompt; inside one they are kept (an emoji's joiner).
    for blank in ["\u{200B}", "\u{FEFF}", " \u{200B}\u{2060} "] {
        let refused = PromptText::parse(blank, 10, false).unwrap_err();
        assert_eq!(refused.0.rule, crate::rule::Rule::NotEmpty, "{blank:?}");
    }
    assert!(PromptText::parse("👩\u{200D}🎨 画家", 10, false).is_ok());
    // A direction control would show the prompt in another order than it was written in.
    let refused = PromptText::parse("雪中\u{202E}狐狸", 10, false).unwrap_err();
    assert_eq!(refused.0.rule, crate::rule::Rule::NoControlCharacter);
}

#[test]
fn every_event_survives_storage() {
    let mut events = dispatched();
    events.extend([
        TaskEvent::Prioritised(TaskPrioritised {
            operation_id: Uuid::from_u128(7),
            fee: Amount::whole(5),
            from_score: 100,
            to_score: 50,
            at: at(),
        }),
        TaskEvent::PrioritisationAbandoned(PrioritisationAbandoned {
            operation_id: Uuid::from_u128(8),
            at: at(),
        }),
        TaskEvent::Abandoned(TaskAbandoned {
            reason: "r".into(),
            at: at(),
        }),
        TaskEvent::CancelRequested(TaskCancelRequested {
            by: alice(),
            at: at(),
        }),
        TaskEvent::Cancelled(TaskCancelled { by: None, at: at() }),
        TaskEvent::Adopted(TaskAdopted {
            fencing_token: 6,
            at: at(),
        }),
        TaskEvent::Started(TaskStarted { at: at() }),
        TaskEvent::Succeeded(TaskSucceeded {
            images: vec![TaskImage {
                image_id: "abc".into(),
                content_type: "image/png".into(),
            }],
            at: at(),
        }),
        TaskEvent::Failed(TaskFailed {
            reason: "r".into(),
            at: at(),
        }),
    ]);
    for event in events {
        let stored = TaskEvent::from_stored(
            event.event_type(),
            event.schema_version(),
            &event.to_payload(),
        )
        .unwrap();
        assert_eq!(stored, event);
    }
}
