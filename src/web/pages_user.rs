//! A user's pages: generate (with the live task cards), history, points, check-in, redeem a
//! code, flash sales. Every action calls the operation the API calls; a refusal comes back as a
//! message in the reader's words that says what to do. One job, kept in one file: each page is
//! a short handler that calls an API operation and renders its view, and they share the
//! refusal-to-message mapping at the top.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, web};
use chrono::{Datelike, NaiveDate};
use minijinja::context;
use minijinja::value::Value;
use rust_decimal::Decimal;
use serde::Deserialize;
use uuid::Uuid;
use zhihui_domain::user::UserId;

use super::render::{Page, WebError, ser};
use crate::http::ApiError;
use crate::http::tasks::{TaskListQuery, TaskView};
use crate::tasks::catalog::RequestedTask;
use crate::tasks::service::TaskServiceError;

/// Task cards the generate page shows below its form (the newest).
const GENERATE_CARDS_MAX: i64 = 8;
/// Tasks per history page.
const HISTORY_PAGE: i64 = 12;
/// Ledger entries per points page.
const LEDGER_PAGE: i64 = 20;
/// Seeds a user may fix: JSON's exact integers (the API's rule).
const SEED_MAX: i64 = (1 << 53) - 1;

/// `/`: the generate page when signed in, else the public gallery (a visitor sees what zhihui
/// is before being asked to sign in).
pub async fn home(page: Page) -> HttpResponse {
    if page.member.is_some() {
        Page::see_other("/generate")
    } else {
        Page::see_other("/gallery")
    }
}

fn user_of(page: &Page) -> Result<UserId, WebError> {
    Ok(page.member()?.session.user_id)
}

/// The event metadata of the signed-in reader's action (the gallery's pages use it too).
pub(super) fn metadata(
    page: &Page,
) -> Result<crate::platform::event_store::EventMetadata, WebError> {
    let member = page.member()?;
    let actor = match member.session.role {
        zhihui_domain::user::Role::Admin => format!("admin:{}", member.session.user_id),
        zhihui_domain::user::Role::User => format!("user:{}", member.session.user_id),
    };
    Ok(crate::http::event_metadata(&page.request, actor))
}

/// What a task card needs besides the task: the fee of a prioritise and what may be done.
/// The gallery's side of succeeded tasks: task id → (its work's id, the work's status:
/// `published`, `unpublished` or `hidden`), for those ever published. One query for a page of
/// cards, none when no card succeeded.
async fn works_of(page: &Page, tasks: &[TaskView]) -> Result<Works, WebError> {
    let work_ids: Vec<Uuid> = tasks
        .iter()
        .filter(|task| task.status == "succeeded")
        .map(|task| zhihui_domain::gallery::work::work_id_of_task(task.task_id))
        .collect();
    if work_ids.is_empty() {
        return Ok(Works::new());
    }
    let rows = async {
        use anyhow::Context;
        let client = crate::platform::postgres::checkout(&page.state().pg_pool)
            .await
            .context("getting a connection")?;
        client
            .query(
                "SELECT task_id, work_id, status FROM works WHERE work_id = ANY($1)",
                &[&work_ids],
            )
            .await
            .context("reading the tasks' works")
    }
    .await
    .map_err(|error| page.unexpected(ApiError::from(error)))?;
    Ok(rows
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect())
}

type Works = std::collections::HashMap<Uuid, (Uuid, String)>;

fn card_context(page: &Page, task: &TaskView, works: &Works) -> Value {
    let settings = page.state().tasks.settings();
    let active = matches!(
        task.status.as_str(),
        "submitted" | "queued" | "dispatched" | "running"
    );
    let progress_percent = task.progress.as_ref().map(|progress| {
        (progress.value * 100)
            .checked_div(progress.max)
            .unwrap_or(0)
            .min(100)
    });
    context! {
        task => ser(task),
        work => works.get(&task.task_id).map(|(id, status)| context! { id => id.to_string(), status }),
        failure => task.failure_reason.as_deref().map(|reason| failure_text(page.lang, reason)),
        fee => settings.prioritise_fee.to_string(),
        can_cancel => active && !task.cancel_requested,
        can_prioritise => task.status == "queued" && task.position.is_some_and(|position| position > 1),
        progress_percent,
        prioritise_key => Uuid::new_v4().to_string(),
        again => (!active).then(|| again_query(task)),
    }
}

/// A task's failure in the reader's words. The reasons are the dispatcher's own sentences (with
/// the image server's detail after a colon, which is the server's and stays as it said it):
/// each known one has its words in the catalog; one not known is shown as recorded.
fn failure_text(lang: crate::web::i18n::Lang, reason: &str) -> String {
    const AT_SERVER: &str = "generation failed on the image server";
    const REFUSED: &str = "the image server refused the workflow: ";
    const KNOWN: [(&str, &str); 5] = [
        (
            "the image server finished without producing an image",
            "failure.no_image",
        ),
        (
            "the image server returned an image that cannot be read",
            "failure.unreadable_image",
        ),
        (
            "the images could not be fetched from the image server",
            "failure.not_fetched",
        ),
        (
            "its image server was removed from service",
            "failure.server_removed",
        ),
        (
            "the image server named an output outside the task's own files",
            "failure.foreign_output",
        ),
    ];
    let said = |key: &str, args: &[(&str, String)]| lang.text(key, args);
    if let Some((_, key)) = KNOWN.iter().find(|(text, _)| *text == reason) {
        return said(key, &[]);
    }
    if let Some(detail) = reason.strip_prefix(REFUSED) {
        return said("failure.refused", &[("detail", detail.to_owned())]);
    }
    if let Some(rest) = reason.strip_prefix(AT_SERVER) {
        return match rest.strip_prefix(" at ") {
            Some(at) => match at.split_once(": ") {
                Some((node, detail)) => said(
                    "failure.at_node_detail",
                    &[("node", node.to_owned()), ("detail", detail.to_owned())],
                ),
                None => said("failure.at_node", &[("node", at.to_owned())]),
            },
            None => match rest.strip_prefix(": ") {
                Some(detail) => said("failure.detail", &[("detail", detail.to_owned())]),
                None => said("failure.generic", &[]),
            },
        };
    }
    if reason.starts_with("the image server returned ") && reason.ends_with(" were asked for") {
        return said("failure.too_many_images", &[]);
    }
    reason.to_owned()
}

/// A task's parameters for the "again" link (and the form it fills).
fn again_query(task: &TaskView) -> String {
    format!("/generate?again={}", task.task_id)
}

#[derive(Debug, Deserialize)]
pub struct GenerateQuery {
    again: Option<String>,
    /// A published work whose settings (and prompt, when shown) fill the form.
    from_work: Option<String>,
}

/// The generate page: the form (the catalog's choices, only models the pool offers, the price
/// beside the balance) and the newest tasks as live cards.
pub async fn generate_page(
    page: Page,
    query: web::Query<GenerateQuery>,
) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let state = page.state();
    let settings = state.tasks.settings();
    // The stream's latest version: what the submit will check.
    let pool = state.dispatcher.backend_pool().load().await?;
    let models: Vec<String> = settings
        .models
        .iter()
        .filter(|model| pool.may_run(model))
        .cloned()
        .collect();
    let no_models = models.is_empty();
    let again = match query.again.as_deref() {
        Some(raw) => match crate::http::tasks::parse_task_id(raw) {
            Ok(task_id) => crate::http::tasks::task_view(state, user, task_id)
                .await
                .ok(),
            Err(_) => None,
        },
        None => None,
    };
    let tasks = crate::http::tasks::task_page(
        state,
        user,
        &TaskListQuery {
            limit: Some(GENERATE_CARDS_MAX),
            cursor: None,
            status: None,
        },
    )
    .await
    .map_err(|error| page.unexpected(error))?;
    let works = works_of(&page, &tasks.tasks).await?;
    let cards: Vec<Value> = tasks
        .tasks
        .iter()
        .map(|task| card_context(&page, task, &works))
        .collect();
    let from_work = match query.from_work.as_deref().map(Uuid::parse_str) {
        Some(Ok(work_id)) => state.gallery.card(work_id).await?,
        _ => None,
    };
    let form = match (&again, &from_work) {
        (None, Some(card)) => context! {
            prompt => card.prompt.clone().unwrap_or_default(),
            negative_prompt => card.negative_prompt.clone().unwrap_or_default(),
            model => card.settings.model.clone(),
            resolution => format!("{}x{}", card.settings.width, card.settings.height),
            steps => card.settings.steps,
            images => 1,
            cfg => card.settings.cfg.clone(),
            sampler => card.settings.sampler.clone(),
            scheduler => card.settings.scheduler.clone(),
            seed => "",
            seed_fixed => false,
        },
        _ => match &again {
            Some(task) => context! {
                prompt => task.prompt.clone(),
                negative_prompt => task.negative_prompt.clone(),
                model => task.model.clone(),
                resolution => format!("{}x{}", task.width, task.height),
                steps => task.steps,
                images => task.image_count,
                cfg => task.cfg.normalize().to_string(),
                sampler => task.sampler.clone(),
                scheduler => task.scheduler.clone(),
                seed => task.seed,
                seed_fixed => true,
            },
            None => context! {
                prompt => "",
                negative_prompt => "",
                model => models.first().cloned().unwrap_or_default(),
                resolution => settings.default_resolution.clone(),
                steps => settings.default_steps,
                images => 1,
                cfg => settings.default_cfg.normalize().to_string(),
                sampler => settings.default_sampler.clone(),
                scheduler => settings.default_scheduler.clone(),
                seed => "",
                seed_fixed => false,
            },
        },
    };
    let images: Vec<u32> = (1..=settings.images_per_task_max).collect();
    // Told before pressing 生成, not after: where one image is more than the points there are.
    let available = crate::http::accounts::balance_of(state, user)
        .await
        .map_err(|error| page.unexpected(error))?
        .available;
    let short_of_points =
        (available < settings.price_per_image).then(|| two_places(available).to_string());
    page.render(
        "generate.html",
        context! {
            form,
            short_of_points,
            again => again.is_some(),
            from_work => from_work.as_ref().map(|card| card.title.clone()),
            models,
            no_models,
            resolutions => settings.resolution_presets.clone(),
            samplers => settings.samplers.clone(),
            schedulers => settings.schedulers.clone(),
            images,
            steps_min => settings.steps_min,
            steps_max => settings.steps_max,
            cfg_min => settings.cfg_min.normalize().to_string(),
            cfg_max => settings.cfg_max.normalize().to_string(),
            prompt_max => settings.prompt_length_max,
            negative_max => settings.negative_prompt_length_max,
            price_per_image => settings.price_per_image.normalize().to_string(),
            price_per_image_shown => two_places(settings.price_per_image),
            seed_max => SEED_MAX,
            request_id => Uuid::new_v4().to_string(),
            cards,
        },
    )
    .await
}

#[derive(Debug, Deserialize)]
pub struct GenerateForm {
    prompt: String,
    #[serde(default)]
    negative_prompt: String,
    model: Option<String>,
    resolution: Option<String>,
    steps: Option<String>,
    images: Option<String>,
    #[serde(default)]
    seed_mode: String,
    seed: Option<String>,
    cfg: Option<String>,
    sampler: Option<String>,
    scheduler: Option<String>,
    /// One per rendering of the form: a second click on submit is the same request.
    request_id: Option<String>,
}

/// A form's whole number, or the field's message.
fn whole_number(
    page: &Page,
    field: &'static str,
    value: Option<&str>,
    errors: &mut Vec<String>,
) -> Option<i64> {
    let text = value.map(str::trim).filter(|text| !text.is_empty())?;
    match text.parse::<i64>() {
        Ok(number) => Some(number),
        Err(_) => {
            errors.push(page.t(
                "error.field",
                &[
                    ("field", page.t(&format!("field.{field}"), &[])),
                    ("message", page.t("error.not_a_whole_number", &[])),
                ],
            ));
            None
        }
    }
}

/// A submit's refusal in the reader's words: what is wrong and what to do.
fn submit_refusal(page: &Page, error: &TaskServiceError) -> String {
    match error {
        TaskServiceError::InsufficientPoints {
            available,
            required,
        } => {
            let missing = required.as_decimal() - available.as_decimal();
            page.t(
                "generate.insufficient",
                &[
                    ("missing", two_places(missing)),
                    ("required", two_places(required.as_decimal())),
                    ("available", two_places(available.as_decimal())),
                ],
            )
        }
        TaskServiceError::QueueLimit { max } => {
            page.t("generate.queue_limit", &[("max", max.to_string())])
        }
        TaskServiceError::ModelUnavailable { model } => {
            page.t("generate.model_unavailable", &[("model", model.clone())])
        }
        TaskServiceError::Invalid(fields) => {
            page.fields_message(fields.iter().map(|field| (field.field, &field.broken)))
        }
        other => page.message_of(&crate::http::tasks::task_error(clone_refusal(other))),
    }
}

/// The refusals `task_error` maps (the unexpected one is handled before).
fn clone_refusal(error: &TaskServiceError) -> TaskServiceError {
    match error {
        TaskServiceError::NotFound => TaskServiceError::NotFound,
        TaskServiceError::IdempotencyKeyReused => TaskServiceError::IdempotencyKeyReused,
        TaskServiceError::RolledBack => TaskServiceError::RolledBack,
        TaskServiceError::NotQueued { status } => TaskServiceError::NotQueued { status },
        TaskServiceError::AlreadyFirst => TaskServiceError::AlreadyFirst,
        TaskServiceError::NoRoom => TaskServiceError::NoRoom,
        TaskServiceError::PrioritiseUnderWay => TaskServiceError::PrioritiseUnderWay,
        TaskServiceError::Finished { status } => TaskServiceError::Finished { status },
        other => TaskServiceError::Unexpected(anyhow::anyhow!("{other}")),
    }
}

fn two_places(mut value: Decimal) -> String {
    value.rescale(zhihui_domain::points::POINTS_SCALE);
    value.to_string()
}

/// `POST /generate` (htmx): submit, then the new task's card on top of the list.
pub async fn generate(page: Page, form: web::Form<GenerateForm>) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let form = form.into_inner();
    let mut errors = Vec::new();
    let steps = whole_number(&page, "steps", form.steps.as_deref(), &mut errors);
    let images = whole_number(&page, "images", form.images.as_deref(), &mut errors);
    let seed = if form.seed_mode == "fixed" {
        let seed = whole_number(&page, "seed", form.seed.as_deref(), &mut errors);
        if seed.is_none() && errors.is_empty() {
            errors.push(page.t("generate.seed_needed", &[]));
        }
        seed
    } else {
        None
    };
    let cfg = match form
        .cfg
        .as_deref()
        .map(str::trim)
        .filter(|cfg| !cfg.is_empty())
    {
        None => None,
        Some(text) => match text.parse::<Decimal>() {
            Ok(cfg) => Some(cfg),
            Err(_) => {
                errors.push(page.t(
                    "error.field",
                    &[
                        ("field", page.t("field.cfg", &[])),
                        ("message", page.t("error.not_a_number", &[])),
                    ],
                ));
                None
            }
        },
    };
    if !errors.is_empty() {
        return page.alert("#generate-messages", "error", &errors.join("；"));
    }
    let requested = RequestedTask {
        prompt: form.prompt,
        negative_prompt: Some(form.negative_prompt).filter(|text| !text.trim().is_empty()),
        images,
        model: form.model,
        resolution: form.resolution,
        steps,
        cfg,
        sampler: form.sampler,
        scheduler: form.scheduler,
        seed,
    };
    // The form's id makes a double submit one task (the API's Idempotency-Key).
    let key = form
        .request_id
        .as_deref()
        .and_then(|id| Uuid::parse_str(id).ok())
        .map(|id| format!("web-generate-{id}"));
    let outcome = match crate::http::tasks::submit_and_tell(
        page.state(),
        user,
        &requested,
        key.as_deref(),
        &metadata(&page)?,
    )
    .await
    {
        Ok(outcome) => outcome,
        Err(TaskServiceError::Unexpected(error)) => return Err(WebError::from(error)),
        Err(error @ TaskServiceError::InsufficientPoints { .. }) => {
            return page
                .alert_short_of_points("#generate-messages", &submit_refusal(&page, &error));
        }
        Err(error) => {
            return page.alert(
                "#generate-messages",
                "error",
                &submit_refusal(&page, &error),
            );
        }
    };
    let mut task = crate::http::tasks::task_view_from_stream(page.state(), user, outcome.task_id)
        .await
        .map_err(|error| page.unexpected(error))?;
    if task.status == "queued" && task.position.is_none() {
        // Claimed by a server in the moment between the two reads: its place as submitted.
        task.position = outcome.position;
    }
    let card = context! {
        ..card_context(&page, &task, &Works::new()),
        ..context! { new_request_id => Uuid::new_v4().to_string() },
    };
    let mut response = page.fragment("_task_card.html", context! { card })?;
    response.headers_mut().insert(
        actix_web::http::header::HeaderName::from_static("hx-trigger"),
        actix_web::http::header::HeaderValue::from_static("balance-changed"),
    );
    Ok(response)
}

/// The reader's task `raw_id` as its card's context, read from its stream; another's task is as
/// missing as one that never was.
async fn own_card(page: &Page, raw_id: &str) -> Result<Value, WebError> {
    let user = user_of(page)?;
    let task_id = crate::http::tasks::parse_task_id(raw_id)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    match crate::http::tasks::task_view_from_stream(page.state(), user, task_id).await {
        Ok(task) => {
            let works = works_of(page, std::slice::from_ref(&task)).await?;
            Ok(context! { card => card_context(page, &task, &works) })
        }
        Err(ApiError::NotFound(_)) => Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found")),
        Err(error) => Err(page.unexpected(error)),
    }
}

/// `GET /tasks/{id}/card`: one card, fresh (the live module asks when a task ends).
pub async fn task_card(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let card = own_card(&page, &path).await?;
    page.fragment("_task_card.html", card)
}

/// `/tasks/{id}`: one task of the reader's, wherever it is in their history (ledger rows link
/// here).
pub async fn task_page(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let card = own_card(&page, &path).await?;
    page.render("task.html", card).await
}

#[derive(Debug, Deserialize)]
pub struct KeyForm {
    key: Option<String>,
}

/// Cancel or prioritise, then the card again (a refusal goes into the card's message area).
async fn act_on_task(
    page: &Page,
    raw_id: &str,
    action: TaskAction,
) -> Result<HttpResponse, WebError> {
    let user = user_of(page)?;
    let task_id = crate::http::tasks::parse_task_id(raw_id)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    let metadata = metadata(page)?;
    let done = match &action {
        TaskAction::Cancel => {
            crate::http::tasks::cancel_and_tell(page.state(), user, task_id, &metadata)
                .await
                .map(|_| ())
        }
        TaskAction::Prioritise { key } => crate::http::tasks::prioritise_and_tell(
            page.state(),
            user,
            task_id,
            key.as_deref(),
            &metadata,
        )
        .await
        .map(|_| ()),
    };
    let target = format!("#task-{task_id}-messages");
    match done {
        Ok(()) => {}
        Err(TaskServiceError::Unexpected(error)) => return Err(WebError::from(error)),
        Err(TaskServiceError::NotFound) => {
            return Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found"));
        }
        Err(TaskServiceError::InsufficientPoints { .. }) => {
            let message = page.t(
                "card.prioritise_insufficient",
                &[(
                    "fee",
                    page.state().tasks.settings().prioritise_fee.to_string(),
                )],
            );
            return page.alert_short_of_points(&target, &message);
        }
        Err(error) => return page.alert(&target, "error", &submit_refusal(page, &error)),
    }
    let task = crate::http::tasks::task_view_from_stream(page.state(), user, task_id)
        .await
        .map_err(|error| page.unexpected(error))?;
    let mut response = page.fragment(
        "_task_card.html",
        context! { card => card_context(page, &task, &Works::new()) },
    )?;
    response.headers_mut().insert(
        actix_web::http::header::HeaderName::from_static("hx-trigger"),
        actix_web::http::header::HeaderValue::from_static("balance-changed"),
    );
    Ok(response)
}

enum TaskAction {
    Cancel,
    Prioritise { key: Option<String> },
}

pub async fn cancel(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    act_on_task(&page, &path, TaskAction::Cancel).await
}

pub async fn prioritise(
    page: Page,
    path: web::Path<String>,
    form: web::Form<KeyForm>,
) -> Result<HttpResponse, WebError> {
    // One key per rendering of the card: a repeated click moves and charges once.
    let key = form
        .key
        .as_deref()
        .and_then(|key| Uuid::parse_str(key).ok())
        .map(|key| format!("web-prioritise-{key}"));
    act_on_task(&page, &path, TaskAction::Prioritise { key }).await
}

#[derive(Debug, Deserialize)]
pub struct HistoryQuery {
    status: Option<String>,
    cursor: Option<String>,
}

/// The statuses the history filters by.
const HISTORY_STATUSES: [&str; 5] = ["queued", "running", "succeeded", "failed", "cancelled"];

/// The user's tasks, newest first, paged, by status; each with its parameters, seed, images
/// (as served: labelled), downloads, and "again".
pub async fn history(
    page: Page,
    query: web::Query<HistoryQuery>,
) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let status = query
        .status
        .as_deref()
        .filter(|status| HISTORY_STATUSES.contains(status));
    let listed = crate::http::tasks::task_page(
        page.state(),
        user,
        &TaskListQuery {
            limit: Some(HISTORY_PAGE),
            cursor: query.cursor.clone(),
            status: status.map(str::to_owned),
        },
    )
    .await;
    let listed = match listed {
        Ok(listed) => listed,
        // A cursor that is not ours: the first page.
        Err(ApiError::Validation { .. }) => {
            return Ok(Page::see_other(&match status {
                Some(status) => format!("/history?status={status}"),
                None => "/history".to_owned(),
            }));
        }
        Err(error) => return Err(page.unexpected(error)),
    };
    let works = works_of(&page, &listed.tasks).await?;
    let tasks: Vec<Value> = listed
        .tasks
        .iter()
        .map(|task| card_context(&page, task, &works))
        .collect();
    page.render(
        "history.html",
        context! {
            tasks,
            statuses => HISTORY_STATUSES,
            status,
            first_page => query.cursor.is_none(),
            next_cursor => listed.next_cursor,
        },
    )
    .await
}

#[derive(Debug, Deserialize)]
pub struct CursorQuery {
    cursor: Option<String>,
}

/// Balance and the ledger, paged, each movement named in words.
pub async fn points(page: Page, query: web::Query<CursorQuery>) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let ledger = match crate::http::accounts::ledger_page(
        page.state(),
        user,
        Some(LEDGER_PAGE),
        query.cursor.as_deref(),
    )
    .await
    {
        Ok(ledger) => ledger,
        Err(ApiError::Validation { .. }) => return Ok(Page::see_other("/points")),
        Err(error) => return Err(page.unexpected(error)),
    };
    let prompts = task_prompts(&page, user, &ledger.entries).await?;
    let entries: Vec<Value> = ledger
        .entries
        .iter()
        .map(|entry| {
            let task = ledger_task(entry);
            let task_prompt = task
                .and_then(|task| prompts.get(&task))
                .map(|prompt| shortened(prompt, LEDGER_PROMPT_CHARS));
            context! {
                ..context! {
                    note => ledger_note(page.lang, entry),
                    task_prompt,
                    task_id => task.map(|task| task.to_string()),
                },
                ..ser(entry),
            }
        })
        .collect();
    page.render(
        "points.html",
        context! {
            entries,
            next_cursor => ledger.next_cursor,
            first_page => query.cursor.is_none(),
        },
    )
    .await
}

/// Characters of a task's prompt a ledger row shows: enough to know the task by.
const LEDGER_PROMPT_CHARS: usize = 16;

/// The prompts of the reader's tasks the ledger rows name, in one read of the tasks' read model
/// (a task it has not caught up with yet is named by the word "task" alone).
async fn task_prompts(
    page: &Page,
    user: UserId,
    entries: &[crate::http::accounts::LedgerEntryView],
) -> Result<std::collections::HashMap<Uuid, String>, WebError> {
    let tasks: Vec<Uuid> = entries.iter().filter_map(ledger_task).collect();
    if tasks.is_empty() {
        return Ok(Default::default());
    }
    let read = async {
        let client = crate::platform::postgres::checkout(&page.state().pg_pool).await?;
        let rows = client
            .query(
                "SELECT task_id, prompt FROM tasks WHERE user_id = $1 AND task_id = ANY($2)",
                &[&user.as_uuid(), &tasks],
            )
            .await?;
        anyhow::Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
    };
    Ok(anyhow::Context::context(
        read.await,
        "reading the prompts of the ledger's tasks",
    )?)
}

/// The task a ledger row belongs to: a hold's own, or the one a prioritise fee (or its refund)
/// moved, which its recorded reason names.
fn ledger_task(entry: &crate::http::accounts::LedgerEntryView) -> Option<Uuid> {
    entry.task_id.or_else(|| {
        let reason = entry.reason.as_deref()?;
        let rest = reason
            .strip_prefix("prioritise task ")
            .or_else(|| reason.strip_prefix("prioritise of task "))?;
        Uuid::parse_str(rest.split(' ').next()?).ok()
    })
}

/// `text` cut to `chars` characters, with an ellipsis where it was cut.
fn shortened(text: &str, chars: usize) -> String {
    match text.char_indices().nth(chars) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// What a ledger row is for, in the reader's words where the recorded reason is the server's own
/// sentence (a prioritise fee and its refund, a flash sale's price), the admin's reason for a
/// grant as written; nothing where the kind says it all.
fn ledger_note(
    lang: crate::web::i18n::Lang,
    entry: &crate::http::accounts::LedgerEntryView,
) -> Option<String> {
    let reason = entry.reason.as_deref()?;
    match entry.kind.as_str() {
        "grant" => Some(reason.to_owned()),
        "charge" if reason.starts_with("prioritise task ") => {
            Some(lang.text("points.prioritise_fee", &[]))
        }
        "charge" if reason.starts_with("promotion:") => Some(lang.text("points.sale_price", &[])),
        "refund" => Some(lang.text("points.refunded", &[])),
        _ => None,
    }
}

#[derive(Deserialize)]
pub struct BalanceQuery {
    #[serde(default)]
    with_name: Option<String>,
}

/// `GET /balance`: the header's balance, fresh (after anything that moved points). With
/// `with_name`, also the reader's name: a page drawn without a database read (an error page)
/// loads both into its header after it is shown.
pub async fn balance(
    page: Page,
    query: web::Query<BalanceQuery>,
) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let balance = crate::http::accounts::balance_of(page.state(), user)
        .await
        .map_err(|error| page.unexpected(error))?;
    if query.with_name.is_none() {
        return page.fragment("_balance.html", context! { balance => ser(&balance) });
    }
    let name = page
        .state()
        .users
        .get(user)
        .await?
        .as_ref()
        .map_or_else(String::new, crate::web::render::display_name);
    page.fragment("_balance.html", context! { balance => ser(&balance), name })
}

/// One month as weeks of seven cells (Monday first), each a day of the month or empty.
fn calendar(month: NaiveDate, checked: &[NaiveDate], today: NaiveDate) -> Vec<Vec<Value>> {
    let first = month.with_day(1).unwrap_or(month);
    let lead = first.weekday().num_days_from_monday() as usize;
    let mut cells: Vec<Value> = vec![Value::from(()); lead];
    let mut day = first;
    while day.month() == first.month() {
        cells.push(context! {
            day => day.day(),
            date => day.to_string(),
            checked => checked.contains(&day),
            today => day == today,
            future => day > today,
        });
        match day.succ_opt() {
            Some(next) => day = next,
            None => break,
        }
    }
    while !cells.len().is_multiple_of(7) {
        cells.push(Value::from(()));
    }
    cells.chunks(7).map(<[Value]>::to_vec).collect()
}

async fn checkin_context(page: &Page, user: UserId) -> Result<Value, WebError> {
    let checkins = &page.state().checkins;
    let today = checkins.today();
    let view = checkins
        .month(user, crate::points::checkins::month_of(today))
        .await?;
    let rule = checkins.rule();
    // Checked in today: tomorrow continues the streak; not yet: today does (a broken streak is
    // 0, so the next day is its first).
    let next_bonus = rule.bonus_for(view.streak + 1);
    let rewards: Vec<Value> = rule
        .rewards
        .iter()
        .map(|reward| {
            context! {
                every_days => reward.every_days,
                bonus => two_places(reward.bonus.as_decimal()),
            }
        })
        .collect();
    Ok(context! {
        year => view.month.year(),
        month => view.month.month(),
        weeks => calendar(view.month, &view.days, today),
        streak => view.streak,
        checked_in_today => view.checked_in_today,
        days_this_month => view.days.len(),
        base_bonus => two_places(rule.base.as_decimal()),
        next_bonus => two_places(next_bonus.as_decimal()),
        rewards,
    })
}

pub async fn checkin_page(page: Page) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let context = checkin_context(&page, user).await?;
    page.render("checkin.html", context).await
}

/// `POST /checkin` (htmx): check in, then the panel again with what was credited.
pub async fn check_in(page: Page) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let done = page
        .state()
        .checkins
        .check_in(user, &metadata(&page)?)
        .await?;
    let result = context! {
        checked_in_now => done.checked_in_now,
        bonus => two_places(done.bonus.as_decimal()),
        day_streak => done.streak,
    };
    let context = checkin_context(&page, user).await?;
    let mut response = page.fragment(
        "_checkin_panel.html",
        context! { ..context, ..context! { result } },
    )?;
    response.headers_mut().insert(
        actix_web::http::header::HeaderName::from_static("hx-trigger"),
        actix_web::http::header::HeaderValue::from_static("balance-changed"),
    );
    Ok(response)
}

pub async fn redeem_page(page: Page) -> Result<HttpResponse, WebError> {
    let _ = user_of(&page)?;
    page.render("redeem.html", context! {}).await
}

#[derive(Debug, Deserialize)]
pub struct RedeemForm {
    code: String,
}

/// `POST /redeem` (htmx): redeem, then what it brought (or why not).
pub async fn redeem(page: Page, form: web::Form<RedeemForm>) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let redeemed = page
        .state()
        .codes
        .redeem(user, &form.code, &metadata(&page)?)
        .await;
    match redeemed {
        Ok(redemption) => {
            let key = if redemption.redeemed_now {
                "redeem.done"
            } else {
                "redeem.already_yours"
            };
            let message = page.t(
                key,
                &[("points", two_places(redemption.points.as_decimal()))],
            );
            let mut response = page.alert("#redeem-messages", "success", &message)?;
            response.headers_mut().insert(
                actix_web::http::header::HeaderName::from_static("hx-trigger"),
                actix_web::http::header::HeaderValue::from_static("balance-changed"),
            );
            Ok(response)
        }
        Err(error) => {
            let error = crate::http::codes::redeem_error(error, page.state());
            // A store away is a 503 to try again, not a refusal of the code.
            if matches!(
                error,
                ApiError::Unexpected(_) | ApiError::Unavailable { .. }
            ) {
                return Err(WebError::from(error));
            }
            let message = match &error {
                ApiError::Refused {
                    rule: "code-not-valid-now",
                    window: Some((from, until)),
                    ..
                } => page.t(
                    "error.code-not-valid-now",
                    &[("from", from.to_rfc3339()), ("until", until.to_rfc3339())],
                ),
                ApiError::NotFound(_) => page.t("redeem.unknown", &[]),
                other => page.message_of(other),
            };
            page.alert("#redeem-messages", "error", &message)
        }
    }
}

/// One promotion's card context, with the reader's claim on it.
async fn sale_context(
    page: &Page,
    user: UserId,
    promotion: &crate::http::promotions::PromotionView,
    upcoming: bool,
) -> Result<Value, WebError> {
    let claim = page
        .state()
        .promotions
        .my_claim(user, promotion.promotion_id)
        .await?;
    Ok(context! {
        promotion => ser(promotion),
        upcoming,
        claim => claim.map(|claim| context! { status => claim.status, reason => claim.reason }),
    })
}

/// Flash sales: open ones (what is left, claim) and upcoming ones (a countdown to the start).
pub async fn sales(page: Page) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let open = crate::http::promotions::open_promotions(page.state())
        .await
        .map_err(|error| page.unexpected(error))?;
    let upcoming = crate::http::promotions::upcoming_promotions(page.state())
        .await
        .map_err(|error| page.unexpected(error))?;
    let mut open_cards = Vec::new();
    for promotion in &open {
        open_cards.push(sale_context(&page, user, promotion, false).await?);
    }
    let mut upcoming_cards = Vec::new();
    for promotion in &upcoming {
        upcoming_cards.push(sale_context(&page, user, promotion, true).await?);
    }
    page.render(
        "sales.html",
        context! { open => open_cards, upcoming => upcoming_cards },
    )
    .await
}

/// `POST /sales/{id}/claim` (htmx): the gate answers at once; the result follows on the socket.
pub async fn claim(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let promotion_id = crate::http::promotions::parse_id(&path)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    let target = format!("#sale-{promotion_id}-messages");
    match crate::http::promotions::claim_for(page.state(), user, promotion_id).await {
        Ok(_) => claim_state(page, path).await,
        Err(error @ (ApiError::Unexpected(_) | ApiError::Unavailable { .. })) => {
            Err(WebError::from(error))
        }
        Err(ApiError::NotFound(_)) => Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found")),
        Err(error) => {
            let message = page.message_of(&error);
            page.alert(&target, "error", &message)
        }
    }
}

/// `GET /sales/{id}/claim`: the reader's claim on one promotion, as its card shows it.
pub async fn claim_state(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let user = user_of(&page)?;
    let promotion_id = crate::http::promotions::parse_id(&path)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    let Some(promotion) = page.state().promotions.load(promotion_id).await? else {
        return Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found"));
    };
    let left = page
        .state()
        .promotions
        .left_in_redis(promotion_id)
        .await
        .ok()
        .flatten();
    let view = crate::http::promotions::PromotionView::of(&promotion, left);
    let upcoming = page.state().clock.now() < view.starts_at;
    let sale = sale_context(&page, user, &view, upcoming).await?;
    page.fragment("_sale.html", context! { sale })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prioritise_fee_and_its_refund_link_to_the_task_they_moved() {
        let task = Uuid::from_u128(7);
        let entry =
            |kind: &str, reason: Option<String>, task_id| crate::http::accounts::LedgerEntryView {
                occurred_at: chrono::DateTime::UNIX_EPOCH,
                kind: kind.into(),
                amount: Decimal::ONE,
                available_after: Decimal::ONE,
                frozen_after: Decimal::ZERO,
                task_id,
                operation_id: None,
                reason,
                correlation_id: Uuid::nil(),
            };
        let fee = entry("charge", Some(format!("prioritise task {task}")), None);
        let refund = entry(
            "refund",
            Some(format!("prioritise of task {task} did not happen")),
            None,
        );
        let hold = entry("freeze", None, Some(task));
        let grant = entry("grant", Some("prioritise task 活动".into()), None);
        assert_eq!(ledger_task(&fee), Some(task));
        assert_eq!(ledger_task(&refund), Some(task));
        assert_eq!(ledger_task(&hold), Some(task));
        assert_eq!(ledger_task(&grant), None);
    }

    #[test]
    fn a_month_is_weeks_of_seven_monday_first() {
        let month = NaiveDate::from_ymd_opt(2026, 11, 1).unwrap_or_default();
        let today = NaiveDate::from_ymd_opt(2026, 11, 25).unwrap_or_default();
        let checked = [NaiveDate::from_ymd_opt(2026, 11, 24).unwrap_or_default()];
        let weeks = calendar(month, &checked, today);
        // 1 November 2026 is a Sunday: six empty cells, then the 1st.
        assert!(weeks.iter().all(|week| week.len() == 7));
        assert!(weeks[0][5].is_none());
        assert_eq!(weeks[0][6].get_attr("day").ok(), Some(Value::from(1)));
        let days: usize = weeks
            .iter()
            .flatten()
            .filter(|cell| !cell.is_none())
            .count();
        assert_eq!(days, 30);
    }

    #[test]
    fn a_failure_the_dispatcher_records_is_said_in_chinese_with_the_servers_detail_as_it_was() {
        use crate::web::i18n::Lang;
        let refused = crate::dispatch::comfy::rejection_reason(&serde_json::json!({
            "error": {"message": "Prompt outputs failed validation"}
        }));
        for (reason, said) in [
            (
                "generation failed on the image server",
                "图像服务器生成失败",
            ),
            (
                "generation failed on the image server at KSampler: CUDA out of memory",
                "图像服务器在节点 KSampler 生成失败：CUDA out of memory",
            ),
            (
                "generation failed on the image server at VAEDecode",
                "图像服务器在节点 VAEDecode 生成失败",
            ),
            (
                "generation failed on the image server: 显存不足",
                "图像服务器生成失败：显存不足",
            ),
            (
                refused.as_str(),
                "图像服务器拒绝了这个工作流：Prompt outputs failed validation",
            ),
            (
                "its image server was removed from service",
                "运行这个任务的图像服务器已被移出服务",
            ),
            (
                "the image server returned 3 images where 1 were asked for",
                "图像服务器返回的图片比要求的多",
            ),
            // Not one of ours: as recorded.
            ("停电了", "停电了"),
        ] {
            assert_eq!(failure_text(Lang::Zh, reason), said);
        }
        // English says what was recorded.
        let recorded = "generation failed on the image server at KSampler: CUDA out of memory";
        assert_eq!(failure_text(Lang::En, recorded), recorded);
    }
}
