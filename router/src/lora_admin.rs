//! Run-time LoRA adapters across the cluster: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
//! (admin endpoints here), fanned out to every ready worker's `LoadLora` / `UnloadLora`. Workers load only from
//! under their own `--lora-dir`; those without one refuse, and the answer lists each worker's outcome. The workers
//! are probed again afterwards, so `/v1/models` and placement see the change at once.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use pagoda_proto::worker::{LoadLoraRequest, UnloadLoraRequest};
use serde::{Deserialize, Serialize};
use tonic::Code;

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::server::AppState;

/// How long one worker may take to read and check an adapter.
const LOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest `lora_path` accepted (the worker's own bound).
const MAX_PATH_BYTES: usize = 4096;

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
    fan_out(&st, &shown, "lora_adapter.load", not_found, move |client| {
        let (name, path) = (name.clone(), path.clone());
        async move { if inplace { replace(client, name, path).await } else { load_on(client, name, path).await } }
    })
    .await
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
    fan_out(&st, &shown, "lora_adapter.unload", not_found, move |mut client| {
        let name = name.clone();
        async move { client.unload_lora(UnloadLoraRequest { name }).await.map(|_| ()) }
    })
    .await
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
