//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.
//! Every refusal the server makes (bad JSON, bad sampling values, body too large, engine busy or down) goes
//! through [`ApiError`], so clients always get the same shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }

    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 `invalid_request_error` about one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(param)
    }

    /// The prompt leaves no room for output; `param` names the field that holds it (`messages`, `prompt`).
    pub fn context_length_exceeded(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(param).with_code("context_length_exceeded")
    }

    /// A request names a model this server does not serve (OpenAI's and vLLM's answer).
    pub fn model_not_found(name: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("The model `{name}` does not exist"))
            .with_param("model")
            .with_code("model_not_found")
    }

    /// A route called with the wrong method.
    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed on this route")
            .with_code("method_not_allowed")
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body is larger than the server's limit of {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "server_overloaded", message).with_code("server_overloaded")
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", message).with_code("service_unavailable")
    }

    /// 408: the request ran past `--request-timeout` and was aborted.
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", message).with_code("request_timeout")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message).with_code("internal_error")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).with_code("not_found")
    }

    pub fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid or missing API key")
            .with_code("invalid_api_key")
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body, also used inside an SSE `data:` event when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl From<crate::backend::SubmitError> for ApiError {
    fn from(e: crate::backend::SubmitError) -> Self {
        use crate::backend::SubmitError;
        use ft_core::request::AdmissionError;
        match e {
            SubmitError::Admission(a @ AdmissionError::ContextLengthExceeded { .. }) => {
                ApiError::context_length_exceeded("messages", a.to_string())
            }
            SubmitError::Admission(a @ AdmissionError::TooLargeForCache { .. }) => {
                ApiError::invalid(a.to_string()).with_code("context_length_exceeded")
            }
            SubmitError::Admission(a) => ApiError::invalid(a.to_string()),
            SubmitError::Overloaded(m) => ApiError::overloaded(m),
            SubmitError::Unavailable(m) => ApiError::unavailable(m),
        }
    }
}
