#![allow(clippy::unwrap_used)]
use super::*;
use crate::decider::given;
use chrono::TimeZone;

fn at() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2027, 1, 1, 0, 0, 0).unwrap()
}

fn gpu(name: &str) -> NewBackend {
    NewBackend::parse(name, &format!("http://{name}:8188/"), 2).unwrap()
}

fn added_event(name: &str) -> PoolEvent {
    added(&gpu(name), at())
}

#[test]
fn the_configuration_seeds_an_empty_pool_once() {
    given::<BackendPool>(&[])
        .when(PoolCommand::Seed {
            backends: vec![gpu("a"), gpu("b")],
            at: at(),
        })
        .then(&[added_event("a"), added_event("b")]);
    // A pool whose last server was removed stays empty: the configuration does not come back.
    given::<BackendPool>(&[added_event("a"), PoolEvent::Removed(named("a", at()))])
        .when(PoolCommand::Seed {
            backends: vec![gpu("a")],
            at: at(),
        })
        .then(&[]);
}

#[test]
fn a_name_is_taken_once_and_a_repeated_add_is_done() {
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Add {
            backend: gpu("a"),
            at: at(),
        })
        .then(&[]);
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Add {
            backend: NewBackend::parse("a", "http://elsewhere:8188", 2).unwrap(),
            at: at(),
        })
        .then_error(PoolError::NameTaken("a".into()));
}

#[test]
fn drain_and_resume_are_idempotent_and_name_a_server() {
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Drain {
            name: "a".into(),
            at: at(),
        })
        .then(&[PoolEvent::Drained(named("a", at()))]);
    given::<BackendPool>(&[added_event("a"), PoolEvent::Drained(named("a", at()))])
        .when(PoolCommand::Drain {
            name: "a".into(),
            at: at(),
        })
        .then(&[]);
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Resume {
            name: "a".into(),
            at: at(),
        })
        .then(&[]);
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Drain {
            name: "b".into(),
            at: at(),
        })
        .then_error(PoolError::NotFound("b".into()));
}

#[test]
fn a_server_is_removed_only_when_nothing_runs_there() {
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Remove {
            name: "a".into(),
            prompts_in_flight: 1,
            at: at(),
        })
        .then_error(PoolError::Busy {
            name: "a".into(),
            prompts_in_flight: 1,
        });
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Remove {
            name: "a".into(),
            prompts_in_flight: 0,
            at: at(),
        })
        .then(&[PoolEvent::Removed(named("a", at()))]);
}

#[test]
fn an_inspection_is_recorded_when_it_says_something_new() {
    let inspected = PoolEvent::Inspected(BackendInspected {
        name: "a".into(),
        models: vec!["x.safetensors".into(), "y.safetensors".into()],
        version: "0.3.64".into(),
        at: at(),
    });
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Inspect {
            name: "a".into(),
            models: vec![
                "y.safetensors".into(),
                "x.safetensors".into(),
                "x.safetensors".into(),
            ],
            version: "0.3.64".into(),
            at: at(),
        })
        .then(std::slice::from_ref(&inspected));
    given::<BackendPool>(&[added_event("a"), inspected])
        .when(PoolCommand::Inspect {
            name: "a".into(),
            models: vec!["x.safetensors".into(), "y.safetensors".into()],
            version: "0.3.64".into(),
            at: at(),
        })
        .then(&[]);
}

#[test]
fn a_model_may_run_where_a_server_offers_it_or_has_not_said() {
    assert!(
        BackendPool::initial_state().may_run("x"),
        "an empty pool waits for servers"
    );
    let mut state = BackendPool::fold(&[added_event("a"), added_event("b")]);
    assert!(state.may_run("anything"), "nothing read yet: it might");
    state = BackendPool::evolve(
        state,
        &PoolEvent::Inspected(BackendInspected {
            name: "a".into(),
            models: vec!["x".into()],
            version: "v".into(),
            at: at(),
        }),
    );
    state = BackendPool::evolve(
        state,
        &PoolEvent::Inspected(BackendInspected {
            name: "b".into(),
            models: vec!["y".into()],
            version: "v".into(),
            at: at(),
        }),
    );
    assert!(state.may_run("x") && state.may_run("y"));
    assert!(!state.may_run("z"));
}

#[test]
fn new_servers_are_checked() {
    assert_eq!(
        NewBackend::parse("a b", "http://x", 1),
        Err(PoolError::InvalidName("a b".into()))
    );
    assert_eq!(
        NewBackend::parse("a", "ftp://x", 1),
        Err(PoolError::InvalidUrl("ftp://x".into()))
    );
    assert_eq!(
        NewBackend::parse("a", "http://x", 0),
        Err(PoolError::InvalidCapacity(0))
    );
    assert_eq!(
        NewBackend::parse("a", "http://x:8188/", 1).unwrap().url(),
        "http://x:8188"
    );
}

#[test]
fn a_server_is_reconfigured_only_when_nothing_runs_there_and_forgets_its_models_on_a_move() {
    let moved = NewBackend::parse("a", "http://a2:8188", 3).unwrap();
    let reconfigured = PoolEvent::Reconfigured(BackendReconfigured {
        name: "a".into(),
        url: "http://a2:8188".into(),
        capacity: 3,
        at: at(),
    });
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Reconfigure {
            backend: moved.clone(),
            prompts_in_flight: 1,
            at: at(),
        })
        .then_error(PoolError::Busy {
            name: "a".into(),
            prompts_in_flight: 1,
        });
    given::<BackendPool>(&[added_event("a")])
        .when(PoolCommand::Reconfigure {
            backend: moved.clone(),
            prompts_in_flight: 0,
            at: at(),
        })
        .then(std::slice::from_ref(&reconfigured));
    given::<BackendPool>(&[added_event("a"), reconfigured.clone()])
        .when(PoolCommand::Reconfigure {
            backend: moved,
            prompts_in_flight: 5,
            at: at(),
        })
        .then(&[]);
    given::<BackendPool>(&[])
        .when(PoolCommand::Reconfigure {
            backend: gpu("b"),
            prompts_in_flight: 0,
            at: at(),
        })
        .then_error(PoolError::NotFound("b".into()));
    let inspected = PoolEvent::Inspected(BackendInspected {
        name: "a".into(),
        models: vec!["m".into()],
        version: "v".into(),
        at: at(),
    });
    let state = BackendPool::fold(&[added_event("a"), inspected.clone(), reconfigured]);
    let backend = state.backend("a").unwrap();
    assert_eq!(
        (backend.url.as_str(), backend.capacity),
        ("http://a2:8188", 3)
    );
    assert_eq!(backend.models, None, "another address: not inspected yet");
    // Only the capacity changed: the same server, what it offers stays known.
    let resized = PoolEvent::Reconfigured(BackendReconfigured {
        name: "a".into(),
        url: "http://a:8188".into(),
        capacity: 4,
        at: at(),
    });
    let state = BackendPool::fold(&[added_event("a"), inspected, resized]);
    assert_eq!(state.backend("a").unwrap().models, Some(vec!["m".into()]));
}

#[test]
fn differences_name_each_server_and_the_command_that_applies_it() {
    let state = BackendPool::fold(&[added_event("a"), added_event("b"), added_event("c")]);
    let configured = vec![
        gpu("a"),
        NewBackend::parse("b", "http://b:8188", 4).unwrap(),
        gpu("d"),
    ];
    let found = differences(&state, &configured);
    assert_eq!(found.len(), 3);
    assert_eq!(
        found[0].to_string(),
        "b is http://b:8188 with capacity 2 in the pool, http://b:8188 with capacity 4 in the configuration"
    );
    assert_eq!(
        found[0].command(),
        "zhihui backends reconfigure b http://b:8188 --capacity 4"
    );
    assert_eq!(
        found[1].to_string(),
        "d (http://d:8188, capacity 2) is configured but not in the pool"
    );
    assert_eq!(
        found[1].command(),
        "zhihui backends add d http://d:8188 --capacity 2"
    );
    assert_eq!(found[2].to_string(), "c is in the pool but not configured");
    assert_eq!(found[2].command(), "zhihui backends remove c");
    assert!(differences(&state, &[gpu("a"), gpu("b"), gpu("c")]).is_empty());
}

#[test]
fn every_event_round_trips_through_its_payload() {
    let events = [
        added_event("a"),
        PoolEvent::Drained(named("a", at())),
        PoolEvent::Resumed(named("a", at())),
        PoolEvent::Removed(named("a", at())),
        PoolEvent::Inspected(BackendInspected {
            name: "a".into(),
            models: vec!["m".into()],
            version: "v".into(),
            at: at(),
        }),
        PoolEvent::Reconfigured(BackendReconfigured {
            name: "a".into(),
            url: "http://x".into(),
            capacity: 2,
            at: at(),
        }),
    ];
    for event in events {
        let back = PoolEvent::from_stored(event.event_type(), 1, &event.to_payload()).unwrap();
        assert_eq!(back, event);
        assert!(POOL_EVENT_TYPES.contains(&event.event_type()));
    }
}
