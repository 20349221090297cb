//! The admins' pages of what brings points in: redeem-code batches (create, progress, CSV
//! export, revoke) and promotions (create, what is left at the gate, add stock, end), with the
//! forms' one-time keys and the platform-offset times their fields show.

use super::*;

pub(super) async fn batches(page: &Page) -> Result<Vec<Value>, WebError> {
    let ids: Vec<Uuid> = {
        let client = crate::platform::postgres::checkout(&page.state().pg_pool)
            .await
            .map_err(anyhow::Error::new)?;
        client
            .query(
                "SELECT batch_id FROM code_batches ORDER BY created_at DESC LIMIT $1",
                &[&ADMIN_LIST_MAX],
            )
            .await
            .map_err(anyhow::Error::new)?
            .iter()
            .map(|row| row.get(0))
            .collect()
    };
    let mut views = Vec::new();
    for batch_id in ids {
        match crate::http::codes::batch_view(page.state(), batch_id).await {
            Ok(view) => views.push(batch_context(page, &view)),
            Err(ApiError::NotFound(_)) => {}
            Err(error) => return Err(page.unexpected(error)),
        }
    }
    Ok(views)
}

pub(super) fn batch_context(page: &Page, view: &crate::http::codes::BatchView) -> Value {
    // Past its window, a batch's codes redeem no more: said beside its status (the API's
    // status stays what the batch's events made it).
    let expired = view.status != "revoked" && view.valid_until <= page.state().clock.now();
    let percent = if view.count == 0 {
        100
    } else {
        u64::from(view.issued) * 100 / u64::from(view.count)
    };
    context! { batch => ser(view), percent, expired, issuing => view.status == "issuing" }
}

/// Redeem-code batches: create, progress, CSV export, revoke.
pub async fn codes(page: Page) -> Result<HttpResponse, WebError> {
    let _ = admin_of(&page)?;
    let listed = batches(&page).await?;
    let now = page.state().clock.now();
    page.render(
        "admin/codes.html",
        context! {
            batches => listed,
            form_key => Uuid::new_v4().to_string(),
            default_from => local_value(&page, now),
            default_until => local_value(&page, now + chrono::Duration::days(30)),
        },
    )
    .await
}

#[derive(Debug, Deserialize)]
pub struct BatchForm {
    pub(super) count: String,
    pub(super) points: String,
    pub(super) valid_from: String,
    pub(super) valid_until: String,
    #[serde(default)]
    pub(super) note: String,
    pub(super) key: Option<String>,
}

/// A time as a `datetime-local` field's value, in the reader's zone (the one the page draws
/// every other time in, and [`local_input`] reads it back in).
pub(super) fn local_value(page: &Page, at: DateTime<Utc>) -> String {
    chrono::FixedOffset::east_opt(page.reader_offset_minutes() * 60)
        .map(|offset| {
            at.with_timezone(&offset)
                .format("%Y-%m-%dT%H:%M")
                .to_string()
        })
        .unwrap_or_default()
}

/// A `datetime-local` field (the reader's zone) as a time.
pub(super) fn local_input(page: &Page, text: &str) -> Option<DateTime<Utc>> {
    let naive = chrono::NaiveDateTime::parse_from_str(text.trim(), "%Y-%m-%dT%H:%M")
        .or_else(|_| chrono::NaiveDateTime::parse_from_str(text.trim(), "%Y-%m-%dT%H:%M:%S"))
        .ok()?;
    let offset = chrono::FixedOffset::east_opt(page.reader_offset_minutes() * 60)?;
    naive
        .and_local_timezone(offset)
        .single()
        .map(|at| at.with_timezone(&Utc))
}

/// The id a form's one-time key derives (the API's idempotency: a repeated submit of the same
/// rendering is the same request), or a fresh one for a form without a key.
pub(super) fn id_of_form(key: Option<&str>, derive: fn(&str) -> Uuid) -> Uuid {
    match key.and_then(|key| Uuid::parse_str(key).ok()) {
        Some(key) => derive(&format!("web-{key}")),
        None => Uuid::now_v7(),
    }
}

pub(super) fn field_error(page: &Page, field: &str, message_key: &str) -> String {
    page.t(
        "error.field",
        &[
            ("field", page.t(&format!("field.{field}"), &[])),
            ("message", page.t(message_key, &[])),
        ],
    )
}

/// `POST /admin/codes`: create a batch (issued in the background; its row shows progress).
pub async fn create_codes(
    page: Page,
    form: web::Form<BatchForm>,
) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let Ok(count) = form.count.trim().parse::<u32>() else {
        return page.alert(
            "#codes-messages",
            "error",
            &field_error(&page, "count", "error.not_a_whole_number"),
        );
    };
    let Ok(points) = form.points.trim().parse::<Decimal>() else {
        return page.alert(
            "#codes-messages",
            "error",
            &field_error(&page, "points", "error.not_a_number"),
        );
    };
    let (Some(valid_from), Some(valid_until)) = (
        local_input(&page, &form.valid_from),
        local_input(&page, &form.valid_until),
    ) else {
        return page.alert(
            "#codes-messages",
            "error",
            &field_error(&page, "valid_until", "error.not_a_time"),
        );
    };
    let batch_id = id_of_form(form.key.as_deref(), crate::http::codes::batch_id_of_key);
    let request = crate::http::codes::BatchRequest {
        count,
        points,
        valid_from,
        valid_until,
        note: form.note.clone(),
    };
    let metadata = metadata(&page, &admin);
    match crate::http::codes::create_batch_of(page.state(), &admin, batch_id, &request, &metadata)
        .await
    {
        // With a fresh key for the form: the next batch is another request, not this one again.
        Ok(view) => page.fragment(
            "admin/_batch.html",
            context! { new_form_key => Uuid::new_v4().to_string(), ..batch_context(&page, &view) },
        ),
        Err(error) => page.refused("#codes-messages", error),
    }
}

/// `GET /admin/codes/{id}`: one batch's row, fresh (polled while it is issued).
pub async fn code_batch(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let _ = admin_of(&page)?;
    let batch_id = crate::http::codes::parse_batch_id(&path)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    match crate::http::codes::batch_view(page.state(), batch_id).await {
        Ok(view) => page.fragment("admin/_batch.html", batch_context(&page, &view)),
        Err(ApiError::NotFound(_)) => Err(page.refusal(StatusCode::NOT_FOUND, "error.not_found")),
        Err(error) => Err(page.unexpected(error)),
    }
}

#[derive(Debug, Deserialize)]
pub struct ReasonForm {
    pub(super) reason: String,
}

/// `POST /admin/codes/{id}/revoke` (with a reason, after a confirmation).
pub async fn revoke_codes(
    page: Page,
    path: web::Path<String>,
    form: web::Form<ReasonForm>,
) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let batch_id = crate::http::codes::parse_batch_id(&path)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    let metadata = metadata(&page, &admin);
    match crate::http::codes::revoke_batch(page.state(), &admin, batch_id, &form.reason, &metadata)
        .await
    {
        Ok(view) => page.fragment("admin/_batch.html", batch_context(&page, &view)),
        Err(error) => page.refused(&format!("#batch-{batch_id}-messages"), error),
    }
}

/// Promotions: create, live state (what is left at the gate), add stock, end.
pub async fn promotions(page: Page) -> Result<HttpResponse, WebError> {
    let _ = admin_of(&page)?;
    let listed = crate::http::promotions::recent_promotions(page.state(), ADMIN_LIST_MAX)
        .await
        .map_err(|error| page.unexpected(error))?;
    let now = page.state().clock.now();
    let promotions: Vec<Value> = listed
        .iter()
        .map(|promotion| promotion_context(promotion, now))
        .collect();
    page.render(
        "admin/promotions.html",
        context! {
            promotions,
            form_key => Uuid::new_v4().to_string(),
            default_from => local_value(&page, now),
            default_until => local_value(&page, now + chrono::Duration::days(1)),
        },
    )
    .await
}

pub(super) fn promotion_context(
    promotion: &crate::http::promotions::PromotionView,
    now: DateTime<Utc>,
) -> Value {
    let phase = if promotion.ended_at.is_some() || now >= promotion.ends_at {
        "ended"
    } else if now < promotion.starts_at {
        "upcoming"
    } else {
        "open"
    };
    context! { promotion => ser(promotion), phase }
}

#[derive(Debug, Deserialize)]
pub struct PromotionForm {
    pub(super) title: String,
    pub(super) points: String,
    pub(super) price: String,
    pub(super) stock: String,
    pub(super) starts_at: String,
    pub(super) ends_at: String,
    pub(super) key: Option<String>,
}

/// `POST /admin/promotions`.
pub async fn create_promotion(
    page: Page,
    form: web::Form<PromotionForm>,
) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let target = "#promotions-messages";
    let Ok(points) = form.points.trim().parse::<Decimal>() else {
        return page.alert(
            target,
            "error",
            &field_error(&page, "points", "error.not_a_number"),
        );
    };
    let price = match form.price.trim() {
        "" => Decimal::ZERO,
        text => match text.parse::<Decimal>() {
            Ok(price) => price,
            Err(_) => {
                return page.alert(
                    target,
                    "error",
                    &field_error(&page, "price", "error.not_a_number"),
                );
            }
        },
    };
    let Ok(stock) = form.stock.trim().parse::<u32>() else {
        return page.alert(
            target,
            "error",
            &field_error(&page, "stock", "error.not_a_whole_number"),
        );
    };
    let (Some(starts_at), Some(ends_at)) = (
        local_input(&page, &form.starts_at),
        local_input(&page, &form.ends_at),
    ) else {
        return page.alert(
            target,
            "error",
            &field_error(&page, "ends_at", "error.not_a_time"),
        );
    };
    let promotion_id = id_of_form(
        form.key.as_deref(),
        crate::http::promotions::promotion_id_of_key,
    );
    let request = crate::http::promotions::PromotionRequest {
        title: form.title.clone(),
        points,
        price,
        stock,
        starts_at,
        ends_at,
    };
    let metadata = metadata(&page, &admin);
    match crate::http::promotions::create_promotion(
        page.state(),
        &admin,
        promotion_id,
        &request,
        metadata,
    )
    .await
    {
        Ok(view) => page.fragment(
            "admin/_promotion.html",
            context! {
                new_form_key => Uuid::new_v4().to_string(),
                ..promotion_context(&view, page.state().clock.now())
            },
        ),
        Err(error) => page.refused(target, error),
    }
}

#[derive(Debug, Deserialize)]
pub struct StockForm {
    pub(super) add: String,
}

/// `POST /admin/promotions/{id}/stock`.
pub async fn raise_stock(
    page: Page,
    path: web::Path<String>,
    form: web::Form<StockForm>,
) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let promotion_id = crate::http::promotions::parse_id(&path)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    let target = format!("#promotion-{promotion_id}-messages");
    let Ok(add) = form.add.trim().parse::<u32>() else {
        return page.alert(
            &target,
            "error",
            &field_error(&page, "add", "error.not_a_whole_number"),
        );
    };
    change_promotion(
        &page,
        &admin,
        promotion_id,
        crate::http::promotions::PromotionChange::RaiseStock(add),
        &target,
    )
    .await
}

/// `POST /admin/promotions/{id}/end` (after a confirmation).
pub async fn end_promotion(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let promotion_id = crate::http::promotions::parse_id(&path)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    let target = format!("#promotion-{promotion_id}-messages");
    change_promotion(
        &page,
        &admin,
        promotion_id,
        crate::http::promotions::PromotionChange::End,
        &target,
    )
    .await
}

pub(super) async fn change_promotion(
    page: &Page,
    admin: &Admin,
    promotion_id: Uuid,
    change: crate::http::promotions::PromotionChange,
    target: &str,
) -> Result<HttpResponse, WebError> {
    let metadata = metadata(page, admin);
    match crate::http::promotions::change_promotion(
        page.state(),
        admin,
        promotion_id,
        change,
        metadata,
    )
    .await
    {
        Ok(_) => {
            // The gate's count after the change.
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
            page.fragment(
                "admin/_promotion.html",
                promotion_context(&view, page.state().clock.now()),
            )
        }
        Err(error) => page.refused(target, error),
    }
}
