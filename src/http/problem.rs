//! Errors as RFC 9457 problem details (`application/problem+json`).
//!
//! Split by who branches on them: the client needs to know whether to fix its input
//! (`Validation`, naming the field), look elsewhere (`NotFound`), retry or give up (`Conflict`), or
//! whether we failed (`Unexpected`, whose cause chain is logged but never sent).

use actix_web::{HttpResponse, ResponseError, http::StatusCode};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{field}: {message}")]
    Validation { field: String, message: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("not ready: {} unavailable", .dependencies.join(", "))]
    Unavailable { dependencies: Vec<String> },
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

/// The problem+json body.
#[derive(Debug, Serialize)]
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
    /// For 503: the dependencies that failed their check.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dependencies: Option<Vec<String>>,
}

impl ApiError {
    fn problem(&self) -> Problem {
        let status = self.status_code().as_u16();
        let (problem_type, title) = match self {
            ApiError::Validation { .. } => ("validation", "Invalid request"),
            ApiError::NotFound(_) => ("not-found", "Not found"),
            ApiError::Conflict(_) => ("conflict", "Conflict"),
            ApiError::Unavailable { .. } => ("unavailable", "Dependency unavailable"),
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
                _ => None,
            },
            dependencies: match self {
                ApiError::Unavailable { dependencies } => Some(dependencies.clone()),
                _ => None,
            },
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Validation { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Unexpected(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        if let ApiError::Unexpected(error) = self {
            tracing::error!(error = %crate::telemetry::error_chain(error), "request failed");
        }
        HttpResponse::build(self.status_code())
            .content_type("application/problem+json")
            .json(self.problem())
    }
}
