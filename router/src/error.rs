//! OpenAI-style API errors: every failure the router returns is `{"error": {"message", "type", "param", "code"}}`
//! with a matching HTTP status, never axum's plain-text rejections.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error as the client sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Sent as `Retry-After` (seconds): the refusal is transient and the client should come back then.
    pub retry_after_secs: Option<u64>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
            retry_after_secs: None,
        }
    }

    /// 400 `invalid_request_error` about one request field.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError { param: Some(param.into()), ..ApiError::invalid(message) }
    }

    /// 404 for a model this router does not serve.
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist or you do not have access to it."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after_secs: None,
        }
    }

    /// 404 for an unknown path.
    pub fn route_not_found(method: &str, path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("Unknown request URL: {method} {path}."),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
            retry_after_secs: None,
        }
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed() -> ApiError {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "Method not allowed for this URL.".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
            retry_after_secs: None,
        }
    }

    /// 413 for a body over the configured limit.
    pub fn payload_too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("Request body is larger than the limit of {limit} bytes."),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
            retry_after_secs: None,
        }
    }

    /// 408 for a client that did not send its whole body within `timeout`.
    pub fn request_timeout(timeout: std::time::Duration) -> ApiError {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!("The request body did not arrive within {} ms.", timeout.as_millis()),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
            retry_after_secs: None,
        }
    }

    /// 503 when no worker can take the request. Always transient: a worker coming back, or another one
    /// taking over, makes the next attempt succeed.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("unavailable"),
            retry_after_secs: Some(1),
        }
    }

    /// 503 when the cluster is at capacity (the router's in-flight cap, or every worker's admission queue is
    /// full): load shedding, so that a burst costs the excess requests a quick refusal instead of costing every
    /// request its latency (or the process its memory).
    pub fn saturated(message: impl Into<String>, retry_after_secs: u64) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("server_overloaded"),
            retry_after_secs: Some(retry_after_secs.max(1)),
        }
    }

    /// 429 when the worker cannot hold the request now.
    pub fn overloaded(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("resource_exhausted"),
            retry_after_secs: None,
        }
    }

    /// 401 for a missing, malformed or unknown API key.
    pub fn invalid_api_key(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after_secs: None,
        }
    }

    /// 403 for a valid key that may not use this endpoint.
    pub fn permission_denied(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::FORBIDDEN,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("permission_denied"),
            retry_after_secs: None,
        }
    }

    /// 429 when a key is over its request rate or concurrency limit.
    pub fn rate_limited(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "requests",
            param: None,
            code: Some("rate_limit_exceeded"),
            retry_after_secs: None,
        }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after_secs: None,
        }
    }

    /// Maps a worker's gRPC status to the client-facing error.
    pub fn from_status(status: &tonic::Status) -> ApiError {
        use tonic::Code;
        let msg = status.message().to_string();
        match status.code() {
            Code::InvalidArgument | Code::OutOfRange => ApiError::invalid(msg),
            Code::ResourceExhausted => ApiError::overloaded(msg),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
                ApiError::unavailable(format!("worker unavailable: {msg}"))
            }
            _ => ApiError::internal(format!("worker error: {msg}")),
        }
    }

    /// The JSON body, as bytes (also used inside SSE streams).
    pub fn body_json(&self) -> String {
        let body = ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| String::from("{\"error\":{\"message\":\"error\"}}"))
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, self.body_json()).into_response();
        let headers = resp.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(secs) = self.retry_after_secs {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if matches!(self.status, StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT) {
            // The rest of the body is not read: tell the client not to reuse this connection.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape() {
        let e = ApiError::invalid_param("messages", "empty");
        let v: serde_json::Value = serde_json::from_str(&e.body_json()).unwrap();
        assert_eq!(v["error"]["message"], "empty");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "messages");
        assert!(v["error"]["code"].is_null());
        let e = ApiError::model_not_found("x");
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(e.code, Some("model_not_found"));
    }

    #[test]
    fn grpc_status_mapping() {
        assert_eq!(ApiError::from_status(&tonic::Status::invalid_argument("x")).status, StatusCode::BAD_REQUEST);
        assert_eq!(
            ApiError::from_status(&tonic::Status::resource_exhausted("x")).status,
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(ApiError::from_status(&tonic::Status::unavailable("x")).status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(ApiError::from_status(&tonic::Status::internal("x")).status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
