//! Disaggregated serving: a long prompt is computed on a prefill worker, and the worker chosen for the request pulls
//! its KV blocks (the `Transfer` service) and decodes, as llm-d's routing sidecar and Dynamo's disaggregated router
//! do. This module owns the decision ([`wants_remote_prefill`]) and the call to the prefill worker
//! ([`prefill_on`]); [`crate::generate`] uses both before it opens the decode stream, and the peer hint it then
//! sends ([`decode_hint`]) makes the decode worker pull instead of prefilling.
//!
//! Why the router drives it: the router already places requests by prefix and load, and already tells a worker
//! which peer holds a longer prefix (the peer tier). A remote prefill is that hint made true on purpose: the
//! prefill worker's engine has every full block of the prompt when its one-token answer ends, and serves them
//! from its device pool or tiers. Nothing new crosses the network, and a prefill that fails costs only the time
//! it took: the decode worker then prefills the prompt itself.

use std::time::Duration;

use pagoda_proto::trace_context;
use pagoda_proto::worker::{GenerateRequest, PeerHint as PbPeerHint, SamplingParams};
use tracing::Instrument as _;

use crate::spans;
use crate::workers::{InFlight, Worker};

/// How a remote prefill ended: the `outcome` label of `pagoda_router_remote_prefills_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillOutcome {
    /// The prefill worker holds the prompt's KV.
    Ok,
    /// Its admission queue was full.
    Busy,
    /// It answered with an error of its own, or ended the stream without finishing: it is alive.
    Failed,
    /// It could not be reached, or the connection broke under the call.
    Unreachable,
    /// It did not answer within the first-token timeout.
    Timeout,
    /// The client left while it ran.
    Cancelled,
}

impl PrefillOutcome {
    pub fn name(self) -> &'static str {
        match self {
            PrefillOutcome::Ok => "ok",
            PrefillOutcome::Busy => "busy",
            PrefillOutcome::Failed => "failed",
            PrefillOutcome::Unreachable => "unreachable",
            PrefillOutcome::Timeout => "timeout",
            PrefillOutcome::Cancelled => "cancelled",
        }
    }
}

/// Whether a request goes to a prefill worker first: its worker would compute at least `min_tokens` (> 0) of
/// the prompt, and its KV is the plain full cache that a prefix pull carries. A request under an eviction policy
/// keeps a pruned cache that no prefix holds, and one that scores its prompt computes every position itself.
pub fn wants_remote_prefill(uncached_tokens: u64, min_tokens: u64, kv_policy: &str, scores_prompt: bool) -> bool {
    let full_cache = kv_policy.is_empty() || kv_policy == "full";
    min_tokens > 0 && uncached_tokens >= min_tokens && full_cache && !scores_prompt
}

/// Conditional disaggregation: a prefill worker with `queued_tokens` prompt tokens sent and unanswered takes no
/// more when that reaches `max_queued_tokens` (> 0): the request's own worker prefills sooner than it would wait.
pub fn queue_full(queued_tokens: u64, max_queued_tokens: u64) -> bool {
    max_queued_tokens > 0 && queued_tokens >= max_queued_tokens
}

/// The request a prefill worker runs: the prompt, one greedy token (its logits are the last prompt position's
/// and the answer is dropped), in the request's namespace and with its adapter (so the blocks hash as the decode
/// worker's will, and hold the adapter's KV), and with its tier codec, priority and tenant weight (so that fair
/// scheduling on the prefill worker shares it out as the decode worker does).
pub fn prefill_request(
    request_id: &str,
    prompt: &[u32],
    namespace: &str,
    tenant_weight: u32,
    lora: Option<&str>,
    kv_codec: &str,
    priority: i32,
) -> GenerateRequest {
    GenerateRequest {
        request_id: format!("{request_id}-prefill"),
        prompt_token_ids: prompt.to_vec(),
        max_tokens: 1,
        sampling: Some(SamplingParams { temperature: 0.0, top_p: 1.0, ..Default::default() }),
        ignore_eos: true,
        namespace: namespace.to_string(),
        tenant_weight,
        lora: lora.unwrap_or_default().to_string(),
        kv_codec: kv_codec.to_string(),
        priority,
        ..Default::default()
    }
}

/// The most blocks a decode worker pulls for one request, as it caps them itself
/// ([`pagoda_worker::transfer::pull_host_budget`]): half its host tier, in groups of its device format, when it
/// reports both (`host_capacity_bytes`, `group_bytes`); otherwise pulls go straight into its device pool and only
/// one `Fetch`'s bound applies.
pub fn pull_cap_blocks(host_capacity_bytes: u64, group_bytes: u64) -> usize {
    use pagoda_worker::transfer::{MAX_FETCH_HASHES, groups_within, pull_host_budget};
    if host_capacity_bytes > 0 && group_bytes > 0 {
        groups_within(pull_host_budget(host_capacity_bytes), group_bytes)
    } else {
        MAX_FETCH_HASHES
    }
}

/// The hint the decode worker gets after a remote prefill on `prefill_addr`: every full block of the prompt (the
/// worker itself leaves out the one holding the last prompt token, which it computes), pulled without asking its
/// cost model. Also the prompt tokens the decode worker is then expected not to compute: those of the blocks it
/// pulls, at most `pull_cap` ([`pull_cap_blocks`]; it prefills the rest).
pub fn decode_hint(prefill_addr: &str, prompt_tokens: usize, block_size: usize, pull_cap: usize) -> (PbPeerHint, u64) {
    let block_size = block_size.max(1);
    let blocks = prompt_tokens / block_size;
    let pulled = (prompt_tokens.saturating_sub(1) / block_size).min(pull_cap) * block_size;
    let hint = PbPeerHint {
        address: prefill_addr.to_string(),
        blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        remote_prefill: true,
    };
    (hint, pulled as u64)
}

/// Whether `status` was made on this side from a transport error (connection refused or reset, the process
/// died: such a status carries its source) or says the call never got an answer, rather than sent by the worker.
pub fn is_transport_failure(status: &tonic::Status) -> bool {
    use tonic::Code;
    std::error::Error::source(status).is_some()
        || matches!(status.code(), Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded)
}

/// Runs `req` on the prefill worker `worker` to its end, within `timeout`, counting `uncached_tokens` as queued
/// prefill work on it meanwhile. Returns early with `Cancelled` when `client_gone` resolves first.
pub async fn prefill_on(
    worker: &Worker,
    req: GenerateRequest,
    uncached_tokens: u64,
    timeout: Duration,
    client_gone: impl std::future::Future<Output = ()>,
) -> PrefillOutcome {
    let adapter = (!req.lora.is_empty()).then_some(req.lora.as_str());
    let _in_flight = InFlight::with_adapter(worker.load().clone(), uncached_tokens, adapter);
    let call = spans::remote_prefill_span(&worker.addr, req.prompt_token_ids.len());
    let mut request = tonic::Request::new(req);
    trace_context::inject_into_metadata(&call, request.metadata_mut());
    let mut client = worker.client();
    let run = async {
        let mut stream = client.generate(request).await?.into_inner();
        while let Some(msg) = stream.message().await? {
            if msg.finished.is_some() {
                return Ok(true);
            }
        }
        Ok::<bool, tonic::Status>(false)
    };
    let ended = tokio::select! {
        biased;
        _ = client_gone => return PrefillOutcome::Cancelled,
        r = tokio::time::timeout(timeout, run.instrument(call.clone())) => r,
    };
    match ended {
        Ok(Ok(true)) => PrefillOutcome::Ok,
        Ok(Ok(false)) => {
            call.record("otel.status_code", "ERROR");
            PrefillOutcome::Failed
        }
        Ok(Err(status)) => {
            spans::call_failed(&call, &status);
            match status.code() {
                tonic::Code::ResourceExhausted => PrefillOutcome::Busy,
                _ if is_transport_failure(&status) => PrefillOutcome::Unreachable,
                _ => PrefillOutcome::Failed,
            }
        }
        Err(_) => {
            call.record("otel.status_code", "ERROR");
            PrefillOutcome::Timeout
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_long_full_cache_prompts_go_to_a_prefill_worker() {
        assert!(wants_remote_prefill(256, 256, "", false));
        assert!(wants_remote_prefill(4000, 256, "full", false));
        assert!(!wants_remote_prefill(255, 256, "", false), "short enough to prefill in place");
        assert!(!wants_remote_prefill(4000, 0, "", false), "0 turns it off");
        assert!(!wants_remote_prefill(4000, 256, "snapkv", false), "a pruned cache is no prefix to pull");
        assert!(!wants_remote_prefill(4000, 256, "", true), "scoring the prompt computes every position");
    }

    #[test]
    fn a_bounded_prefill_queue_turns_remote_prefills_away_once_full() {
        assert!(!queue_full(1 << 40, 0), "0: no bound");
        assert!(!queue_full(4095, 4096));
        assert!(queue_full(4096, 4096));
    }

    #[test]
    fn the_decode_hint_names_every_full_block_and_leaves_the_last_token_to_compute() {
        let no_cap = pull_cap_blocks(0, 0);
        let (hint, pulled) = decode_hint("p:1", 40 * 16, 16, no_cap);
        assert_eq!((hint.address.as_str(), hint.blocks, hint.remote_prefill), ("p:1", 40, true));
        // The last prompt token's block (here a full one) is computed by the decode worker.
        assert_eq!(pulled, 39 * 16);
        let (hint, pulled) = decode_hint("p:1", 40 * 16 + 5, 16, no_cap);
        assert_eq!((hint.blocks, pulled), (40, 40 * 16));
        let (hint, pulled) = decode_hint("p:1", 3, 16, no_cap);
        assert_eq!((hint.blocks, pulled), (0, 0));
    }

    /// A decode worker pulls at most half its host tier: the router expects it to prefill the rest, so counts
    /// that as its queued work.
    #[test]
    fn the_decode_hint_expects_no_more_pulled_than_half_the_host_tier() {
        // 10 groups of 737,280 bytes in a 20-group host tier.
        let group = 737_280;
        let cap = pull_cap_blocks(20 * group, group);
        assert_eq!(cap, 10);
        let (hint, pulled) = decode_hint("p:1", 40 * 16, 16, cap);
        assert_eq!((hint.blocks, pulled), (40, 10 * 16), "the hint still names every block; 10 are expected");
        let (_, pulled) = decode_hint("p:1", 5 * 16 + 1, 16, cap);
        assert_eq!(pulled, 5 * 16, "a prompt within the cap is pulled whole");
        assert_eq!(pull_cap_blocks(group, group), 0, "half a group's tier holds none: all prefilled");
        assert_eq!(
            pull_cap_blocks(0, group),
            pagoda_worker::transfer::MAX_FETCH_HASHES,
            "no host tier: into the device"
        );
        assert_eq!(pull_cap_blocks(20 * group, 0), pagoda_worker::transfer::MAX_FETCH_HASHES, "group size unknown");
    }

    #[test]
    fn the_prefill_request_is_one_greedy_token_in_the_request_namespace() {
        let r = prefill_request("chatcmpl-1", &[5, 6, 7], "tenant-a", 3, Some("sql"), "int8", -1);
        assert_eq!(r.request_id, "chatcmpl-1-prefill");
        assert_eq!((r.prompt_token_ids.as_slice(), r.max_tokens, r.ignore_eos), ([5, 6, 7].as_slice(), 1, true));
        assert_eq!((r.namespace.as_str(), r.kv_codec.as_str(), r.priority), ("tenant-a", "int8", -1));
        assert_eq!((r.lora.as_str(), r.tenant_weight), ("sql", 3));
        let s = r.sampling.unwrap();
        assert_eq!((s.temperature, s.top_p), (0.0, 1.0));
        assert!(r.peer_hint.is_none() && !r.logprobs && !r.prompt_logprobs);
    }
}
