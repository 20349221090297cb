//! Errors as RFC 9457 problem details (`application/problem+json`).
//!
//! Split by who branches on them: the client needs to know whether to fix its input
//! (`Validation`, naming the field), look elsewhere (`NotFound`), retry or give up (`Conflict`), or
//! whether we failed (`Unexpected`, whose cause chain is logged but never sent).

use actix_web::{HttpResponse, ResponseError, http::StatusCode};
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::platform::postgres::sql_state_unavailable;
use zhihui_domain::rule::{Broken, Rule};

/// Every error an endpoint answers with. Variants with a `rule` name the rule that refused the
/// request; it becomes the problem type (`/problems/<rule>`) so clients can branch on it.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field broke a named rule: programs read its English sentence, pages say the rule in
    /// the reader's language.
    #[error("{field}: {broken}")]
    Validation { field: String, broken: Broken },
    /// Several fields are wrong: each is named with its problem (`errors` in the body).
    #[error("{}", .0.iter().map(|(field, broken)| format!("{field}: {broken}")).collect::<Vec<_>>().join("; "))]
    InvalidFields(Vec<(String, Broken)>),
    /// No valid credentials: a missing, unknown, expired or revoked token, or a failed login.
    #[error("{detail}")]
    Unauthorized { rule: &'static str, detail: String },
    /// Known caller, not allowed (e.g. a user on an admin endpoint). Never used to hide
    /// another user's resources: those are `NotFound`.
    #[error("{detail}")]
    Forbidden { rule: &'static str, detail: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{detail}")]
    Conflict { rule: &'static str, detail: String },
    /// A limit or lock: try again at `retry_at`.
    #[error("{detail}")]
    TooManyRequests {
        rule: &'static str,
        detail: String,
        retry_at: DateTime<Utc>,
        retry_after_s: u64,
    },
    /// A named rule refused the request with a status of its own (e.g. 422 `invalid-code`,
    /// 409 `code-not-valid-now` with the code's window).
    #[error("{detail}")]
    Refused {
        status: StatusCode,
        rule: &'static str,
        detail: String,
        window: Option<(DateTime<Utc>, DateTime<Utc>)>,
    },
    #[error("not ready: {} unavailable", .dependencies.join(", "))]
    Unavailable { dependencies: Vec<String> },
    /// The request ran past its deadline (`http.read_deadline_ms`, `http.write_deadline_ms`):
    /// a store stopped answering without closing its connections (a paused server, a network
    /// partition). Which one is not known here.
    #[error(
        "the request did not finish within {after_s} s: a store is slow to answer. It may still be done: send it again in a moment with the same Idempotency-Key, or look before sending one without a key again"
    )]
    Overdue { after_s: u64 },
    #[error(transparent)]
    Unexpected(anyhow::Error),
}

/// Failures of a dependency become 503 naming it (the client may retry later); everything else is
/// our bug (500).
impl From<anyhow::Error> for ApiError {
    fn from(error: anyhow::Error) -> ApiError {
        if error.chain().any(|cause| {
            cause
                .downcast_ref::<crate::identity::password::HasherBusy>()
                .is_some()
        }) {
            return ApiError::TooManyRequests {
                rule: "password-checks-busy",
                detail: "too many password checks are waiting; try again in a second".into(),
                retry_at: Utc::now() + chrono::Duration::seconds(1),
                retry_after_s: 1,
            };
        }
        let Some(dependency) = unavailable_dependency(&error) else {
            return ApiError::Unexpected(error);
        };
        tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), dependency, "dependency unavailable");
        ApiError::Unavailable {
            dependencies: vec![dependency.to_owned()],
        }
    }
}

/// The store a failure says is away or failing over (`redis`, `event-store`, `postgres`,
/// `redis-replicas`), found anywhere in its cause chain; `None`: not a store's absence.
pub fn unavailable_dependency(error: &anyhow::Error) -> Option<&'static str> {
    let redis_down = error.chain().any(|cause| {
        cause
            .downcast_ref::<redis::RedisError>()
            .is_some_and(redis_unavailable)
    });
    let postgres_down = crate::platform::postgres::away(error);
    let event_store_down = error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<crate::platform::event_store::EventStoreError>(),
            Some(crate::platform::event_store::EventStoreError::Unavailable(
                _
            ))
        )
    });
    // Retries used up on a stream: the store is busier than it is sized for, not our bug.
    let contended = error.chain().any(|cause| {
        cause
            .downcast_ref::<crate::platform::command::StreamContended>()
            .is_some()
    });
    let replicas_behind = error.chain().any(|cause| {
        cause
            .downcast_ref::<crate::platform::redis_store::ReplicasBehind>()
            .is_some()
    });
    let dependency = if redis_down {
        "redis"
    } else if event_store_down || contended {
        "event-store"
    } else if postgres_down {
        "postgres"
    } else if replicas_behind {
        "redis-replicas"
    } else {
        return None;
    };
    Some(dependency)
}

impl ApiError {
    /// The `Retry-After` this answer carries, in seconds: a limit's wait, or a store failing over
    /// or restarting (the client may send the same request again, with its idempotency key,
    /// once it is back). Pages that answer such an error with a form again send it too.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            ApiError::TooManyRequests { retry_after_s, .. } => Some(*retry_after_s),
            ApiError::Unavailable { .. } | ApiError::Overdue { .. } => {
                Some(UNAVAILABLE_RETRY_AFTER_S)
            }
            _ => None,
        }
    }
}

/// How long a client should wait before retrying a 503: a Redis replica's promotion or a
/// PostgreSQL standby's takes a few seconds, a Redis reloading its data about as long.
pub const UNAVAILABLE_RETRY_AFTER_S: u64 = 2;

/// Whether a Redis error says the store is away or failing over, not that we misused it: the
/// connection is gone or timed out, no node serves the slot, or the server answers that it is
/// loading its data (LOADING), that the slot lives elsewhere on a node we cannot reach (MOVED,
/// ASK), that the cluster or the master is down (CLUSTERDOWN, MASTERDOWN, TRYAGAIN), that it
/// became a replica (READONLY), or that it has no room to write (OOM, MISCONF); also a pipeline
/// or transaction that failed for one of these.
pub fn redis_unavailable(error: &redis::RedisError) -> bool {
    fn failing_over(kind: redis::ServerErrorKind) -> bool {
        matches!(
            kind,
            redis::ServerErrorKind::BusyLoading
                | redis::ServerErrorKind::Moved
                | redis::ServerErrorKind::Ask
                | redis::ServerErrorKind::TryAgain
                | redis::ServerErrorKind::ClusterDown
                | redis::ServerErrorKind::MasterDown
                | redis::ServerErrorKind::ReadOnly
        )
    }
    // Out of room: memory at `maxmemory` with nothing to evict (OOM), or writes stopped because
    // the last save or append-only write failed, a full disk say (MISCONF). Both last until an
    // operator acts, and neither says the request was wrong.
    fn out_of_room(code: &str) -> bool {
        matches!(code, "OOM" | "MISCONF")
    }
    if crate::platform::redis_store::connection_failed(error) {
        return true;
    }
    match error.kind() {
        redis::ErrorKind::ClusterConnectionNotFound => true,
        redis::ErrorKind::Server(kind) if failing_over(kind) => true,
        _ if error.code().is_some_and(out_of_room) => true,
        _ => error.clone().into_server_errors().is_some_and(|errors| {
            errors.iter().any(|(_, server_error)| {
                server_error.kind().is_some_and(failing_over) || out_of_room(server_error.code())
            })
        }),
    }
}

/// Whether a PostgreSQL error says the server is away, shutting down, starting, or a standby
/// that cannot write (a failover under way), not that a statement was wrong.
///
/// Unlike the event store's retry, an error without a SQLSTATE counts only when the connection
/// is closed: a value that failed to convert is our bug, a 500.
pub fn postgres_unavailable(error: &tokio_postgres::Error) -> bool {
    error.is_closed() || error.code().is_some_and(sql_state_unavailable)
}

/// The problem+json body.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Problem {
    /// A stable identifier of the rule that failed, e.g. `/problems/validation`.
    #[serde(rename = "type")]
    pub problem_type: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// For validation errors: the field that was wrong.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// For validation errors: the name of the rule the field broke (e.g. `length_at_most`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// For 503: the dependencies that failed their check.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dependencies: Option<Vec<String>>,
    /// For validation errors of several fields: each field and what is wrong with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<FieldProblem>>,
    /// For 429: when the limit or lock ends.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<DateTime<Utc>>,
    /// For `code-not-valid-now`: when the code can be redeemed (from included, until excluded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub valid_from: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub valid_until: Option<DateTime<Utc>>,
}

/// One wrong field.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct FieldProblem {
    pub field: String,
    /// The name of the rule the field broke.
    pub rule: String,
    pub message: String,
}

impl ApiError {
    /// `field` broke `broken`.
    pub fn invalid(field: impl Into<String>, broken: Broken) -> ApiError {
        ApiError::Validation {
            field: field.into(),
            broken,
        }
    }

    /// `field` broke `rule`, whose sentence names no value.
    pub fn invalid_by(field: impl Into<String>, rule: Rule) -> ApiError {
        ApiError::invalid(field, Broken::new(rule))
    }

    pub fn problem(&self) -> Problem {
        let status = self.status_code().as_u16();
        let (problem_type, title) = match self {
            ApiError::Validation { .. } | ApiError::InvalidFields(_) => {
                ("validation", "Invalid request")
            }
            ApiError::Unauthorized { rule, .. } => (*rule, "Not authenticated"),
            ApiError::Forbidden { rule, .. } => (*rule, "Forbidden"),
            ApiError::NotFound(_) => ("not-found", "Not found"),
            ApiError::Conflict { rule, .. } => (*rule, "Conflict"),
            ApiError::TooManyRequests { rule, .. } => (*rule, "Too many requests"),
            ApiError::Refused { rule, .. } => (*rule, "Refused"),
            ApiError::Unavailable { .. } => ("unavailable", "Dependency unavailable"),
            ApiError::Overdue { .. } => ("request-overdue", "Request overdue"),
            ApiError::Unexpected(_) => ("internal", "Internal error"),
        };
        let detail = match self {
            // Never leak internals: the cause chain goes to the log, not to the client.
            ApiError::Unexpected(_) => "an unexpected error occurred; it has been logged".into(),
            other => other.to_string(),
        };
        Problem {
            problem_type: format!("/problems/{problem_type}"),
            title: title.into(),
            status,
            detail,
            field: match self {
                ApiError::Validation { field, .. } => Some(field.clone()),
                ApiError::InvalidFields(fields) => fields.first().map(|(field, _)| field.clone()),
                _ => None,
            },
            rule: match self {
                ApiError::Validation { broken, .. } => Some(broken.rule.key().to_owned()),
                ApiError::InvalidFields(fields) => fields
                    .first()
                    .map(|(_, broken)| broken.rule.key().to_owned()),
                _ => None,
            },
            errors: match self {
                ApiError::InvalidFields(fields) => Some(
                    fields
                        .iter()
                        .map(|(field, broken)| FieldProblem {
                            field: field.clone(),
                            rule: broken.rule.key().to_owned(),
                            message: broken.to_string(),
                        })
                        .collect(),
                ),
                _ => None,
            },
            dependencies: match self {
                ApiError::Unavailable { dependencies } => Some(dependencies.clone()),
                _ => None,
            },
            retry_at: match self {
                ApiError::TooManyRequests { retry_at, .. } => Some(*retry_at),
                _ => None,
            },
            valid_from: match self {
                ApiError::Refused {
                    window: Some((from, _)),
                    ..
                } => Some(*from),
                _ => None,
            },
            valid_until: match self {
                ApiError::Refused {
                    window: Some((_, until)),
                    ..
                } => Some(*until),
                _ => None,
            },
        }
    }
}

impl ApiError {
    /// An `Unexpected` made before its cause was looked at, whose cause says a store is away:
    /// the 503 it is.
    fn reclassified(&self) -> Option<ApiError> {
        match self {
            ApiError::Unexpected(error) => {
                unavailable_dependency(error).map(|dependency| ApiError::Unavailable {
                    dependencies: vec![dependency.to_owned()],
                })
            }
            _ => None,
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        if let Some(unavailable) = self.reclassified() {
            return unavailable.status_code();
        }
        match self {
            ApiError::Validation { .. } | ApiError::InvalidFields(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            ApiError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict { .. } => StatusCode::CONFLICT,
            ApiError::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Refused { status, .. } => *status,
            ApiError::Unavailable { .. } | ApiError::Overdue { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Unexpected(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        if let Some(unavailable) = self.reclassified() {
            return unavailable.error_response();
        }
        if let ApiError::Unexpected(error) = self {
            tracing::error!(error = %crate::platform::telemetry::error_chain(error), "request failed");
        }
        let mut response = HttpResponse::build(self.status_code());
        response.content_type("application/problem+json");
        // RFC 6750: a 401 names the scheme the client should use.
        if let ApiError::Unauthorized { rule, .. } = self {
            response.insert_header((
                actix_web::http::header::WWW_AUTHENTICATE,
                format!("Bearer error=\"{rule}\""),
            ));
        }
        if let Some(seconds) = self.retry_after_s() {
            response.insert_header((actix_web::http::header::RETRY_AFTER, seconds.to_string()));
        }
        response.json(self.problem())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platform::command::CommandError;
    use crate::platform::event_store::EventStoreError;

    fn retry_after(response: &HttpResponse) -> Option<&str> {
        response
            .headers()
            .get(actix_web::http::header::RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
    }

    fn store_away() -> anyhow::Error {
        anyhow::Error::new(EventStoreError::Unavailable(anyhow::anyhow!(
            "connection closed"
        )))
    }

    #[test]
    fn a_command_that_met_a_store_away_or_stayed_contended_is_a_503_however_it_was_wrapped() {
        // As the accounts' actor answers: the store's error with no context of its own.
        let away: CommandError<std::convert::Infallible> = CommandError::Store(store_away());
        let wrapped = away.into_anyhow("a task command").context("submitting");
        assert!(matches!(
            ApiError::from(wrapped),
            ApiError::Unavailable { .. }
        ));
        let contended: CommandError<std::convert::Infallible> = CommandError::Contended {
            stream: "account-1".into(),
            attempts: 5,
        };
        assert!(matches!(
            ApiError::from(contended.into_anyhow("granting")),
            ApiError::Unavailable { .. }
        ));
        // What `anyhow::Error::new(command_error)` did: `Store` is transparent, so the store's
        // error left the chain and the answer was a 500.
        let hidden =
            anyhow::Error::new(CommandError::<std::convert::Infallible>::Store(store_away()));
        assert!(matches!(ApiError::from(hidden), ApiError::Unexpected(_)));
    }

    #[test]
    fn an_unexpected_error_whose_cause_is_a_store_away_is_answered_503_with_retry_after() {
        let redis_away = anyhow::Error::new(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no answer within 1s",
        )));
        let api = ApiError::Unexpected(redis_away.context("opening a pub/sub connection"));
        assert_eq!(api.status_code(), StatusCode::SERVICE_UNAVAILABLE);
        let response = api.error_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry_after(&response), Some("2"));
        // A bug stays a bug.
        let bug = ApiError::Unexpected(anyhow::anyhow!("index out of range"));
        assert_eq!(bug.status_code(), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn a_busy_hasher_is_a_429_with_retry_after_not_a_500() {
        let error = anyhow::Error::new(crate::identity::password::HasherBusy).context("logging in");
        let api = ApiError::from(error);
        assert_eq!(api.status_code(), StatusCode::TOO_MANY_REQUESTS);
        let response = api.error_response();
        assert_eq!(retry_after(&response), Some("1"));
    }

    fn status_of(error: anyhow::Error) -> StatusCode {
        ApiError::from(error.context("touching a session")).status_code()
    }

    #[test]
    fn a_redis_failing_over_or_loading_is_a_503_with_retry_after_never_a_500() {
        for (kind, text) in [
            (
                redis::ServerErrorKind::BusyLoading,
                "Redis is loading the dataset in memory",
            ),
            (redis::ServerErrorKind::Moved, "13011 127.0.0.1:47003"),
            (redis::ServerErrorKind::Ask, "13011 127.0.0.1:47003"),
            (
                redis::ServerErrorKind::TryAgain,
                "multiple keys request during rehashing",
            ),
            (redis::ServerErrorKind::ClusterDown, "The cluster is down"),
            (
                redis::ServerErrorKind::MasterDown,
                "Link with MASTER is down",
            ),
            (
                redis::ServerErrorKind::ReadOnly,
                "You can't write against a read only replica.",
            ),
        ] {
            let error = redis::RedisError::from((
                redis::ErrorKind::Server(kind),
                "server",
                text.to_owned(),
            ));
            assert!(redis_unavailable(&error), "{kind:?}");
            let api = ApiError::from(anyhow::Error::new(error).context("allocating a queue score"));
            assert_eq!(
                api.status_code(),
                StatusCode::SERVICE_UNAVAILABLE,
                "{kind:?}"
            );
            let response = api.error_response();
            assert_eq!(
                response
                    .headers()
                    .get(actix_web::http::header::RETRY_AFTER)
                    .and_then(|value| value.to_str().ok()),
                Some("2")
            );
        }
        let gone =
            redis::RedisError::from((redis::ErrorKind::ClusterConnectionNotFound, "no node"));
        assert_eq!(
            status_of(anyhow::Error::new(gone)),
            StatusCode::SERVICE_UNAVAILABLE
        );
        // No room to write: out of memory, or writes stopped after a failed save (full disk).
        for (code, detail) in [
            ("OOM", "command not allowed when used memory > 'maxmemory'."),
            (
                "MISCONF",
                "Errors writing to the AOF file: No space left on device",
            ),
        ] {
            let error = redis::make_extension_error(code.to_owned(), Some(detail.to_owned()));
            assert_eq!(
                status_of(anyhow::Error::new(error)),
                StatusCode::SERVICE_UNAVAILABLE,
                "{code}"
            );
        }
        // Other refusals are ours to fix.
        let unknown = redis::make_extension_error("WRONGPASS".to_owned(), None);
        assert_eq!(
            status_of(anyhow::Error::new(unknown)),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    /// Between a primary's death and its standby's promotion, the pool cannot open a connection
    /// (every server refuses, or says it takes no writes, with no SQLSTATE): a 503.
    #[tokio::test]
    async fn a_pool_that_cannot_open_a_connection_is_a_503_not_a_500() {
        let Err(refused) = tokio_postgres::connect(
            "host=127.0.0.1 port=1 user=nobody connect_timeout=2",
            tokio_postgres::NoTls,
        )
        .await
        else {
            panic!("a connection to port 1 was accepted");
        };
        assert_eq!(refused.code(), None);
        let error = anyhow::Error::new(deadpool_postgres::PoolError::Backend(refused))
            .context("getting a connection");
        assert_eq!(
            ApiError::from(error).status_code(),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    #[test]
    fn a_redis_error_of_ours_stays_a_500() {
        for kind in [
            redis::ServerErrorKind::ResponseError,
            redis::ServerErrorKind::CrossSlot,
            redis::ServerErrorKind::NoScript,
        ] {
            let error =
                redis::RedisError::from((redis::ErrorKind::Server(kind), "server", "x".to_owned()));
            assert!(!redis_unavailable(&error), "{kind:?}");
            assert_eq!(
                status_of(anyhow::Error::new(error)),
                StatusCode::INTERNAL_SERVER_ERROR
            );
        }
        let typed =
            redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "not a number"));
        assert_eq!(
            status_of(anyhow::Error::new(typed)),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn postgres_states_of_a_server_away_or_read_only_are_unavailable_and_others_are_not() {
        use tokio_postgres::error::SqlState;
        for state in [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::READ_ONLY_SQL_TRANSACTION,
            SqlState::CONNECTION_FAILURE,
            SqlState::CONNECTION_EXCEPTION,
            SqlState::SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
            SqlState::DISK_FULL,
            SqlState::OUT_OF_MEMORY,
        ] {
            assert!(sql_state_unavailable(&state), "{state:?}");
        }
        for state in [
            SqlState::UNIQUE_VIOLATION,
            SqlState::SYNTAX_ERROR,
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::UNDEFINED_TABLE,
            SqlState::CONFIGURATION_LIMIT_EXCEEDED,
        ] {
            assert!(!sql_state_unavailable(&state), "{state:?}");
        }
    }
}
