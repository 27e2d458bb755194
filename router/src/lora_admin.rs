//! Run-time LoRA adapters across the cluster: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
//! (admin endpoints here), fanned out to every ready worker's `LoadLora` / `UnloadLora`. Workers load only from
//! under their own `--lora-dir`; those without one refuse, and the answer lists each worker's outcome. The workers
//! are probed again afterwards, so `/v1/models` and placement see the change at once.
//!
//! It also owns what the admin API has loaded ([`LoraIntents`]): a worker that was not ready for the call (starting,
//! restarting, or joining the fleet later) is given those adapters once a health round finds it ready
//! ([`replay`]), so a fleet converges on the adapters its operator loaded instead of serving them from whichever
//! workers happened to be up at the time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use pagoda_proto::worker::{LoadLoraRequest, UnloadLoraRequest};
use serde::{Deserialize, Serialize};
use tonic::Code;

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::server::AppState;
use crate::workers::Worker;

/// How long one worker may take to read and check an adapter.
const LOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest `lora_path` accepted (the worker's own bound).
const MAX_PATH_BYTES: usize = 4096;

/// Most adapter names the admin API's record keeps (a worker's own `--max-loras` is far below).
pub const MAX_LORA_INTENTS: usize = 256;

/// The record is full: a new name is refused rather than forgetting another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the router already tracks {MAX_LORA_INTENTS} run-time LoRA adapters; unload one first")]
pub struct TooManyIntents;

/// The adapters loaded through this router's admin API, by name, with the path each was loaded from. Kept by this
/// router, not replicated: another router replica, or this one after a restart, does not replay them.
#[derive(Debug, Default)]
pub struct LoraIntents {
    loaded: BTreeMap<String, String>,
}

impl LoraIntents {
    /// Records a load (`Some(path)`) or an unload (`None`) of `name`; returns what was recorded before.
    pub fn set(&mut self, name: &str, path: Option<String>) -> Result<Option<String>, TooManyIntents> {
        match path {
            Some(path) => {
                if !self.loaded.contains_key(name) && self.loaded.len() >= MAX_LORA_INTENTS {
                    return Err(TooManyIntents);
                }
                Ok(self.loaded.insert(name.to_string(), path))
            }
            None => Ok(self.loaded.remove(name)),
        }
    }

    pub fn list(&self) -> Vec<(String, String)> {
        self.loaded.iter().map(|(n, p)| (n.clone(), p.clone())).collect()
    }
}

/// Loads on `worker` each adapter of `intents` it does not hold, one at a time, then probes it so that
/// `/v1/models` and placement see them. A worker that refuses one (no `--lora-dir`, no such directory there, every
/// slot taken) keeps serving without it; the refusal is logged.
pub async fn replay(worker: Arc<Worker>, intents: Vec<(String, String)>) {
    let mut loaded = 0;
    for (name, path) in intents {
        if worker.with_status(|s| s.serves_lora(&name)) {
            continue;
        }
        let outcome = tokio::time::timeout(LOAD_TIMEOUT, load_on(worker.client(), name.clone(), path)).await;
        match outcome {
            Ok(Ok(())) => {
                loaded += 1;
                tracing::info!(worker = %worker.addr, adapter = name, "LoRA adapter loaded on a worker that was away");
            }
            // Loaded meanwhile (a request's on-demand load, or the admin call itself).
            Ok(Err(s)) if s.code() == Code::AlreadyExists => {}
            Ok(Err(s)) => tracing::warn!(worker = %worker.addr, adapter = name, error = s.message(),
                "a worker that was away refused a LoRA adapter the admin API loaded"),
            Err(_) => tracing::warn!(worker = %worker.addr, adapter = name,
                "a worker that was away did not load a LoRA adapter in time"),
        }
    }
    if loaded > 0 {
        worker.probe().await;
    }
}

/// vLLM's `LoadLoRAAdapterRequest`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadLoraBody {
    pub lora_name: String,
    /// A PEFT directory, relative to each worker's `--lora-dir`.
    pub lora_path: String,
    /// Replace an adapter already loaded under this name (vLLM's `load_inplace`).
    #[serde(default)]
    pub load_inplace: bool,
}

/// vLLM's `UnloadLoRAAdapterRequest` (`lora_int_id` is accepted and ignored: adapters are named, not numbered).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnloadLoraBody {
    pub lora_name: String,
    #[serde(default)]
    pub lora_int_id: Option<i64>,
}

/// What each worker did.
#[derive(Debug, Serialize)]
pub struct LoraUpdate {
    pub object: &'static str,
    pub lora_name: String,
    pub workers: Vec<WorkerOutcome>,
}

#[derive(Debug, Serialize)]
pub struct WorkerOutcome {
    pub address: String,
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn check_name(name: &str) -> Result<(), ApiError> {
    pagoda_worker::model::lora::check_lora_name(name).map_err(|e| ApiError::invalid_param("lora_name", e))
}

/// `POST /v1/load_lora_adapter`.
pub async fn load(
    State(st): State<AppState>,
    ApiJson(body): ApiJson<LoadLoraBody>,
) -> Result<Json<LoraUpdate>, ApiError> {
    check_name(&body.lora_name)?;
    if body.lora_path.is_empty() || body.lora_path.len() > MAX_PATH_BYTES {
        return Err(ApiError::invalid_param("lora_path", format!("lora_path must be 1 to {MAX_PATH_BYTES} bytes.")));
    }
    if body.lora_name == st.base_model_id() {
        return Err(ApiError::invalid_param("lora_name", "An adapter cannot take the base model's name."));
    }
    let (name, path, inplace) = (body.lora_name, body.lora_path, body.load_inplace);
    let shown = name.clone();
    // A load names a path, so a worker's NotFound is about the path, not about the adapter the client named.
    let not_found = |s: &tonic::Status| ApiError::invalid_param("lora_path", s.message().to_string());
    // Recorded before the fan-out, so that a worker a health round finds ready meanwhile is given it too.
    let before = st.pool().set_lora_intent(&shown, Some(path.clone())).map_err(|e| ApiError::invalid(e.to_string()))?;
    let result = fan_out(&st, &shown, "lora_adapter.load", not_found, move |client| {
        let (name, path) = (name.clone(), path.clone());
        async move { if inplace { replace(client, name, path).await } else { load_on(client, name, path).await } }
    })
    .await;
    if result.is_err() {
        let _ = st.pool().set_lora_intent(&shown, before);
    }
    result
}

type Client = pagoda_proto::worker::worker_client::WorkerClient<tonic::transport::Channel>;

async fn load_on(mut client: Client, name: String, path: String) -> Result<(), tonic::Status> {
    client.load_lora(LoadLoraRequest { name, path, replace: false }).await.map(|_| ())
}

/// `load_inplace` on one worker: one call, which the worker carries out as one swap (the new adapter is checked
/// before it takes the old one's slot). Replacing through separate unload and load calls could be cut off between
/// them and leave the worker with neither adapter.
async fn replace(mut client: Client, name: String, path: String) -> Result<(), tonic::Status> {
    match client.load_lora(LoadLoraRequest { name: name.clone(), path, replace: true }).await {
        Ok(_) => Ok(()),
        // Only a worker that ignores `replace` refuses a loaded name here; falling back to unload-then-load on it
        // would bring back the gap this call closes.
        Err(s) if s.code() == Code::AlreadyExists => Err(tonic::Status::failed_precondition(format!(
            "cannot replace LoRA adapter {name:?} in place: this worker does not support in-place replacement \
             (upgrade it, or unload the adapter and load it again)"
        ))),
        Err(s) => Err(s),
    }
}

/// `POST /v1/unload_lora_adapter`.
pub async fn unload(
    State(st): State<AppState>,
    ApiJson(body): ApiJson<UnloadLoraBody>,
) -> Result<Json<LoraUpdate>, ApiError> {
    check_name(&body.lora_name)?;
    let _ = body.lora_int_id;
    let (name, shown) = (body.lora_name.clone(), body.lora_name);
    let not_found = |_: &tonic::Status| ApiError::model_not_found(&shown);
    let before = st.pool().set_lora_intent(&shown, None).map_err(|e| ApiError::invalid(e.to_string()))?;
    let result = fan_out(&st, &shown, "lora_adapter.unload", not_found, move |mut client| {
        let name = name.clone();
        async move { client.unload_lora(UnloadLoraRequest { name }).await.map(|_| ()) }
    })
    .await;
    if result.is_err() {
        let _ = st.pool().set_lora_intent(&shown, before);
    }
    result
}

/// Runs `call` on every ready worker at once, then probes them again. Succeeds when at least one worker did;
/// otherwise the first worker's refusal is the answer (503 when no worker is ready), a NotFound as `not_found`
/// says.
async fn fan_out<F, Fut>(
    st: &AppState,
    name: &str,
    object: &'static str,
    not_found: impl Fn(&tonic::Status) -> ApiError,
    call: F,
) -> Result<Json<LoraUpdate>, ApiError>
where
    F: Fn(Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), tonic::Status>> + Send + 'static,
{
    let workers: Vec<_> = st.pool().workers().into_iter().filter(|w| w.is_ready()).collect();
    if workers.is_empty() {
        return Err(crate::generate::no_ready_worker());
    }
    // A task of its own, so that a client that hangs up does not cut the update off with some workers done and
    // others not, nor skip the probe that makes `/v1/models` and placement see it.
    let calls = workers.clone();
    let task = tokio::spawn(async move {
        let results = futures::future::join_all(calls.iter().map(|w| {
            let fut = call(w.client());
            async move {
                match tokio::time::timeout(LOAD_TIMEOUT, fut).await {
                    Ok(r) => r,
                    Err(_) => Err(tonic::Status::deadline_exceeded("the worker did not answer in time")),
                }
            }
        }))
        .await;
        futures::future::join_all(calls.iter().map(|w| w.probe())).await;
        results
    });
    let results = task.await.map_err(|e| ApiError::internal(format!("the LoRA update task failed: {e}")))?;
    let outcomes: Vec<WorkerOutcome> = workers
        .iter()
        .zip(&results)
        .map(|(w, r)| WorkerOutcome {
            address: w.addr.clone(),
            ok: r.is_ok(),
            error: r.as_ref().err().map(|s| s.message().to_string()),
        })
        .collect();
    for o in &outcomes {
        tracing::info!(object, adapter = name, worker = %o.address, ok = o.ok, error = o.error.as_deref(), "LoRA update");
    }
    if outcomes.iter().any(|o| o.ok) {
        return Ok(Json(LoraUpdate { object, lora_name: name.to_string(), workers: outcomes }));
    }
    let first = results.into_iter().find_map(Result::err).unwrap_or_else(|| tonic::Status::unknown("no worker"));
    Err(match first.code() {
        Code::NotFound => not_found(&first),
        Code::InvalidArgument | Code::AlreadyExists | Code::FailedPrecondition | Code::ResourceExhausted => {
            ApiError::invalid(first.message().to_string())
        }
        _ => ApiError::from_status(&first),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intents_record_loads_and_unloads_and_stay_bounded() {
        let mut intents = LoraIntents::default();
        assert_eq!(intents.set("sql", Some("sql".into())), Ok(None));
        assert_eq!(intents.set("sql", Some("sql-v2".into())), Ok(Some("sql".into())), "an in-place load replaces");
        assert_eq!(intents.list(), [("sql".to_string(), "sql-v2".to_string())]);
        assert_eq!(intents.set("sql", None), Ok(Some("sql-v2".into())));
        assert!(intents.list().is_empty());
        // A failed call puts back what was there: here, nothing.
        assert_eq!(intents.set("sql", None), Ok(None));
        for i in 0..MAX_LORA_INTENTS {
            assert!(intents.set(&format!("a{i}"), Some("p".into())).is_ok());
        }
        assert_eq!(intents.set("one-more", Some("p".into())), Err(TooManyIntents));
        assert_eq!(intents.set("a0", Some("q".into())), Ok(Some("p".into())), "a known name is not a new one");
        assert_eq!(intents.set("a1", None), Ok(Some("p".into())));
        assert_eq!(intents.set("one-more", Some("p".into())), Ok(None), "room again after an unload");
    }
}
