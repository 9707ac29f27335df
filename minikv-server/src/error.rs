//! Errors as the OpenAI API sends them: a status and
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An HTTP error with an OpenAI-style body.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 invalid_request_error.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 400 naming the field at fault.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            ..Self::invalid(message)
        }
    }

    /// With a machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// Another status.
    pub fn with_status(mut self, status: StatusCode, kind: &'static str) -> Self {
        self.status = status;
        self.kind = kind;
        self
    }

    /// 503: the engine is gone or shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::invalid(message).with_status(StatusCode::SERVICE_UNAVAILABLE, "server_error")
    }

    /// 500: a sequence failed while running.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::invalid(message).with_status(StatusCode::INTERNAL_SERVER_ERROR, "server_error")
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<minikv_core::Error> for ApiError {
    fn from(e: minikv_core::Error) -> Self {
        match &e {
            minikv_core::Error::ContextOverflow { .. } => {
                ApiError::invalid(e.to_string()).with_code("context_length_exceeded")
            }
            minikv_core::Error::Config { field, .. } => ApiError::param(field, e.to_string()),
            _ => ApiError::invalid(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
