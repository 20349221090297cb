use super::recover::adopted_time_left;
use super::settle::failure_reason;
use super::*;

#[test]
fn a_servers_error_text_is_cut_and_never_shows_its_paths() {
    let reason = failure_reason(
        "CheckpointLoaderSimple",
        "FileNotFoundError: /opt/ComfyUI/models/checkpoints/x.safetensors not found in C:\\models\nTraceback (most recent call last): ...",
    );
    assert_eq!(
        reason,
        "generation failed on the image server at CheckpointLoaderSimple: FileNotFoundError: <path> not found in <path>"
    );
    let long = failure_reason(&"N".repeat(500), &"word ".repeat(500));
    assert!(long.chars().count() < 320, "{}", long.len());
}

fn at(seconds: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::UNIX_EPOCH + chrono::Duration::seconds(seconds)
}

#[test]
fn an_adopted_running_task_has_its_limit_from_its_start() {
    let state = zhihui_domain::task::TaskState {
        dispatched_at: Some(at(100)),
        started_at: Some(at(700)),
        ..Default::default()
    };
    // Dispatched 600 s before it started (it waited behind another prompt): the 600 s limit
    // counts from the start, so 100 s are left at 1,200.
    assert_eq!(
        adopted_time_left(&state, Duration::from_secs(600), 1, at(1_200)),
        Duration::from_secs(100)
    );
    assert_eq!(
        adopted_time_left(&state, Duration::from_secs(600), 1, at(1_400)),
        Duration::ZERO
    );
}

#[test]
fn an_adopted_task_not_started_may_wait_behind_the_prompts_posted_before_it() {
    let state = zhihui_domain::task::TaskState {
        dispatched_at: Some(at(100)),
        ..Default::default()
    };
    assert_eq!(
        adopted_time_left(&state, Duration::from_secs(600), 1, at(200)),
        Duration::from_secs(1_100)
    );
    assert_eq!(
        adopted_time_left(&state, Duration::from_secs(600), 0, at(200)),
        Duration::from_secs(500)
    );
    assert_eq!(
        adopted_time_left(
            &zhihui_domain::task::TaskState::default(),
            Duration::from_secs(600),
            1,
            at(200)
        ),
        Duration::from_secs(600)
    );
}
