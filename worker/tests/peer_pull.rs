//! Peer pulls with the REAL model (SmolLM2-135M-Instruct Q4_1): one engine serves `Transfer` on a local port,
//! another pulls a prompt's prefix from it into its host tier and onboards it.

mod common;

use common::{BS, GROUP, model_path, run};
use std::sync::Arc;

use pagoda_proto::worker::PeerHint;
use pagoda_worker::cache::block_hashes;
use pagoda_worker::engine::{Engine, EngineConfig, EngineHandle};
use pagoda_worker::events::BlockChange;
use pagoda_worker::tiers::{Tier, TierConfig, native};
use pagoda_worker::transfer::{PeerFetchConfig, PeerFetcher, TransferService};
use tracing::Span;

fn engine(num_groups: usize, tiers: TierConfig) -> EngineHandle {
    let cfg = EngineConfig { num_blocks: num_groups * GROUP, threads: 2, tiers, ..EngineConfig::new(model_path()) };
    Engine::start(cfg).expect("engine starts")
}

async fn serve(svc: TransferService) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr").to_string();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(tonic::transport::Server::builder().add_service(svc.into_server()).serve_with_incoming(incoming));
    addr
}

/// A host tier that holds `N` groups, and a peer hint for `2N`: imported in order, the second half of the pull
/// would evict the first from the LRU, and onboarding (which needs the group right after the device prefix)
/// would find nothing. The pull brings only the leading groups that fit, so the first stays in the host tier and
/// the request after it onboards from there.
#[test]
fn a_pull_larger_than_the_host_tier_keeps_its_first_groups_for_onboarding() {
    const N: usize = 4;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    // Not a sentence: KV reuse only needs the same tokens on both sides.
    let p: Vec<u32> = (200..200 + (2 * N * BS + 5) as u32).collect();
    let want = (p.len() - 1) / BS;
    assert!(want >= 2 * N, "the prompt spans 2N groups: {want}");

    let peer = engine(32, TierConfig::default());
    run(&peer, &p, 1);
    let addr = rt.block_on(serve(TransferService::new(peer.clone(), Arc::default())));

    let info = peer.model_info().clone();
    let group_bytes = native::group_bytes(GROUP, BS, info.head_dim, info.kv_dtype) as u64;
    let local = engine(32, TierConfig { data_dir: None, host_bytes: N as u64 * group_bytes, disk_bytes: 0 });
    let fetcher = PeerFetcher::new(local.clone(), Arc::default(), PeerFetchConfig::default());
    // A remote prefill, so the pull is not weighed against prefilling (the outcome must not hang on timing).
    let hint = PeerHint { address: addr, blocks: (2 * N) as u32, remote_prefill: true };
    let stored = rt.block_on(fetcher.pull_prefix(&p, "", &hint, &Span::none()));

    let hashes = block_hashes(&info.model_id, "", &p[..2 * N * BS], BS);
    let probe = rt.block_on(local.probe_prefix(hashes.clone())).expect("engine answers");
    let snapshot = rt.block_on(local.residency_snapshot()).expect("engine answers");
    let in_host = |h: u64| {
        snapshot.blocks.iter().any(|c| matches!(c, BlockChange::Stored { hash, tier: Tier::Host, .. } if *hash == h))
    };
    assert!(in_host(hashes[0]), "the first missing group is in the host tier (pulled {stored})");
    let (_, cached, s) = run(&local, &p, 1);
    let from_host = s.prefix_hit_tokens[Tier::Host.index()];
    assert!(from_host >= BS as u64, "the next request onboards from the pulled groups: {s:?}");
    assert_eq!(cached as u64, from_host, "{s:?}");
    assert!((1..=N).contains(&stored), "the pull brought at most what the host tier holds: {stored}");
    assert_eq!(probe.local_blocks, stored, "every pulled group was still held after the import");
    local.shutdown();
    peer.shutdown();
}
