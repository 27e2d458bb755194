//! The request-body extractor: reads the body under the configured size limit and parses it as JSON, turning
//! every failure (too large, invalid UTF-8, malformed JSON, wrong field types) into an OpenAI-style [`ApiError`];
//! and the client timeout that bounds every body read ([`within_client_timeout`]).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::de::DeserializeOwned;
use serde_json::error::Category;

use crate::error::ApiError;
use crate::server::AppState;

/// JSON body extractor whose rejections are [`ApiError`]s.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let limit = state.body_limit();
        let bytes = match within_client_timeout(state, Bytes::from_request(req, state)).await? {
            Ok(b) => b,
            Err(rejection) => {
                return Err(if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::payload_too_large(limit)
                } else {
                    let status = rejection.status();
                    let text = rejection.body_text();
                    drop(rejection.into_response());
                    ApiError { status, ..ApiError::invalid(format!("Could not read the request body: {text}")) }
                });
            }
        };
        if bytes.len() > limit {
            return Err(ApiError::payload_too_large(limit));
        }
        parse_json(&bytes).map(ApiJson)
    }
}

/// Runs `read`, a read of the request body, for at most the client timeout; past it the request is a JSON 408. A
/// client that stops sending would otherwise hold the handler (and any slot taken before the body is read) for as
/// long as it keeps the connection open. Every handler that reads a body reads it through this.
pub async fn within_client_timeout<F: Future>(state: &AppState, read: F) -> Result<F::Output, ApiError> {
    let timeout = state.client_timeout();
    tokio::time::timeout(timeout, read).await.map_err(|_| ApiError::request_timeout(timeout))
}

/// Parses a request body: UTF-8 first, then JSON into `T`, reporting the offending field as `param`.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        ApiError::invalid(format!(
            "Request body is not valid UTF-8 (invalid byte sequence at offset {}).",
            e.valid_up_to()
        ))
    })?;
    if text.trim().is_empty() {
        return Err(ApiError::invalid("Request body is empty; expected a JSON object."));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        match inner.classify() {
            Category::Data => {
                if path == "." || path.is_empty() {
                    ApiError::invalid(format!("Invalid request body: {inner}"))
                } else {
                    ApiError::invalid_param(path.clone(), format!("Invalid value for `{path}`: {inner}"))
                }
            }
            Category::Syntax | Category::Eof | Category::Io => {
                ApiError::invalid(format!("We could not parse the JSON body of your request: {inner}"))
            }
        }
    })?;
    de.end().map_err(|e| ApiError::invalid(format!("We could not parse the JSON body of your request: {e}")))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize, Debug)]
    #[allow(dead_code)]
    struct Body {
        n: u32,
        items: Vec<Item>,
    }
    #[derive(Deserialize, Debug)]
    #[allow(dead_code)]
    struct Item {
        name: String,
    }

    #[test]
    fn ok() {
        let b: Body = parse_json(br#"{"n": 1, "items": [{"name": "a"}]}"#).unwrap();
        assert_eq!(b.n, 1);
    }

    #[test]
    fn malformed() {
        let e = parse_json::<Body>(br#"{"n": 1,"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("parse the JSON"), "{}", e.message);
        let e = parse_json::<Body>(br#"{"n": 1, "items": []} xx"#).unwrap_err();
        assert!(e.message.contains("parse the JSON"), "{}", e.message);
        let e = parse_json::<Body>(b"   ").unwrap_err();
        assert!(e.message.contains("empty"));
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = parse_json::<Body>(br#"{"n": 1, "items": [{"name": 5}]}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("items[0].name"));
        let e = parse_json::<Body>(br#"{"n": "x", "items": []}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = parse_json::<Body>(br#"{"items": []}"#).unwrap_err();
        assert!(e.message.contains("missing field `n`"), "{}", e.message);
    }

    #[test]
    fn invalid_utf8() {
        let e = parse_json::<Body>(b"{\"n\": 1, \"items\": [{\"name\": \"\xff\xfe\"}]}").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("UTF-8"), "{}", e.message);
    }
}
