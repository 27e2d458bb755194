//! The host and disk KV tiers with the REAL model (SmolLM2-135M-Instruct Q4_1): a prompt's prefix is pushed out
//! of a tiny device pool, comes back from host and from disk (also after an engine restart on the same data
//! dir, and past a corrupted file), and the greedy output always equals the cold run's while the onboarded
//! tokens are not recomputed.

mod common;

use common::{BS, GROUP, greedy, greedy_request, model_path, run, run_request, wait_stats};
use std::path::{Path, PathBuf};

use pagoda_kernels::{Codec, KvDtype, KvStorage};
use pagoda_worker::cache::block_hashes;
use pagoda_worker::engine::{
    Engine, EngineConfig, EngineError, EngineHandle, EngineStats, ExportFrom, GenerateEvent, GenerateRequest,
};
use pagoda_worker::events::BlockChange;
use pagoda_worker::model::{Gguf, Tokenizer};
use pagoda_worker::placement::{AnswerHorizon, EvicPressConfig, ProfileScoring, TierPlacement};
use pagoda_worker::tiers::codec as tiers_codec;
use pagoda_worker::tiers::{EncodedGroup, GroupCodec, Tier, TierConfig};

fn engine(num_groups: usize, tiers: TierConfig) -> EngineHandle {
    engine_of(num_groups, tiers, KvDtype::default())
}

fn engine_of(num_groups: usize, tiers: TierConfig, kv_dtype: KvDtype) -> EngineHandle {
    let cfg =
        EngineConfig { num_blocks: num_groups * GROUP, threads: 2, tiers, kv_dtype, ..EngineConfig::new(model_path()) };
    Engine::start(cfg).expect("engine starts")
}

fn prompt() -> Vec<u32> {
    let g = Gguf::open(model_path()).expect("gguf");
    let t = Tokenizer::from_gguf(&g).expect("tokenizer");
    t.encode(
        "The library on the hill keeps three kinds of books: maps of rivers that no longer flow, recipes written \
         by sailors, and letters that were never sent. Every morning the librarian opens the windows, counts the \
         books, and writes the number on a slate by the door. Question: what does the librarian count?",
        false,
    )
}

/// Fills a pool of 8 groups with other tokens twice, so every idle group of earlier prompts is evicted.
fn push_out(h: &EngineHandle) {
    for start in [1000u32, 3000] {
        let filler: Vec<u32> = (start..start + 7 * BS as u32 - 4).collect();
        run(h, &filler, 2);
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pagoda-engine-tiers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn disk_only(dir: &Path) -> TierConfig {
    TierConfig { data_dir: Some(dir.to_path_buf()), host_bytes: 0, disk_bytes: 256 << 20 }
}

#[test]
fn prefix_comes_back_from_host_and_disk_with_identical_output() {
    let p = prompt();
    let matched = (p.len() - 1) / BS * BS;
    assert!(matched >= 3 * BS, "prompt spans several groups: {}", p.len());
    let expect_computed = |out: &[u32]| (p.len() - matched + out.len() - 1) as u64;

    // Host tier only.
    let h = engine(8, TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 });
    let (cold, cached, s) = run(&h, &p, 8);
    assert_eq!(cached, 0);
    assert_eq!(s.computed_tokens_total, (p.len() + cold.len() - 1) as u64);
    push_out(&h);
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold, "KV onboarded from host gives the same greedy output");
    assert_eq!(cached as usize, matched);
    assert_eq!(s.prefix_hit_tokens[Tier::Host.index()], matched as u64, "every group came from host: {s:?}");
    assert_eq!(s.computed_tokens_total, expect_computed(&warm), "onboarded tokens are not recomputed");
    let host = s.tier_usage.iter().find(|u| u.tier == Tier::Host).expect("host usage reported");
    assert!(host.used_bytes > 0 && host.capacity_bytes == 64 << 20 && host.codec == "f16", "{host:?}");
    assert!(s.offloaded_groups > 0);
    // What the router prices this worker with: its measured prefill speed, its group size in f16, and the host
    // tier's load bandwidth as measured by the onboard just now; it has no disk tier.
    assert!(s.prefill_tokens_per_s > 0.0, "{s:?}");
    let info = h.model_info();
    assert_eq!(s.kv_group_bytes, (GROUP * BS * info.head_dim * 2 * 2) as u64, "{s:?}");
    let prior = pagoda_worker::tiers::cost::PRIOR_LOAD_BYTES_PER_S[Tier::Host.index()];
    assert!(s.load_bytes_per_s[Tier::Host.index()] > 0.0 && s.load_bytes_per_s[Tier::Host.index()] != prior, "{s:?}");
    assert_eq!(s.load_bytes_per_s[Tier::Disk.index()], 0.0, "{s:?}");
    // One filler only: the prompt's first group stays on the device, older in the LRU than the filler's groups.
    // Onboarding the rest must not evict it (it is pinned while onboarding allocates).
    let filler: Vec<u32> = (5000..5000 + 7 * BS as u32 - 4).collect();
    run(&h, &filler, 2);
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold);
    assert_eq!(cached as usize, matched, "device head + host continuation: {s:?}");
    assert_eq!(s.prefix_hit_tokens[Tier::Device.index()], BS as u64, "{s:?}");
    assert_eq!(s.prefix_hit_tokens[Tier::Host.index()], (matched - BS) as u64, "{s:?}");
    assert_eq!(s.computed_tokens_total, expect_computed(&warm));
    h.shutdown();

    // Disk tier only (idle groups are written straight to disk).
    let dir = tmp("disk");
    let h = engine(8, disk_only(&dir));
    let (cold_d, _, _) = run(&h, &p, 8);
    assert_eq!(cold_d, cold);
    push_out(&h);
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold, "KV onboarded from disk gives the same greedy output");
    assert_eq!(cached as usize, matched);
    assert_eq!(s.prefix_hit_tokens[Tier::Disk.index()], matched as u64, "every group came from disk: {s:?}");
    assert_eq!(s.computed_tokens_total, expect_computed(&warm));
    // Dropped without `shutdown()`: the engine thread stops on its own and lets go of the directory a moment
    // later, and the next engine's open waits for it rather than refusing the directory as in use.
    drop(h);

    // Restart on the same data dir: the very first request is served from disk.
    let h = engine(8, disk_only(&dir));
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold, "after a restart");
    assert_eq!(cached as usize, matched);
    assert_eq!(s.prefix_hit_tokens[Tier::Disk.index()], matched as u64);
    assert_eq!(s.computed_tokens_total, expect_computed(&warm));
    let model_id = h.model_info().model_id.clone();
    h.shutdown();

    // Corrupt the second group's file: the first group still comes from disk, the rest is recomputed, the
    // output does not change, and the bad file is counted and gone.
    let hashes = block_hashes(&model_id, "", &p, BS);
    let second = dir.join("kv").join(format!("{:016x}.kv", hashes[1]));
    let mut bytes = std::fs::read(&second).expect("the second group is on disk");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&second, &bytes).unwrap();
    let h = engine(8, disk_only(&dir));
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold, "a corrupt file is never used");
    assert_eq!(cached as usize, BS, "only the group before the corrupt one is onboarded");
    assert_eq!(s.prefix_hit_tokens[Tier::Disk.index()], BS as u64);
    assert_eq!(s.disk_corrupted, 1);
    assert_eq!(s.computed_tokens_total, (p.len() - BS + warm.len() - 1) as u64);
    h.shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A peer group that has a known codec and the exact length but does not decode (an `int8` group of zeros: no block
/// header) is taken into host, and fails when onboarded. It is then dropped from the tier, and the drop reported,
/// so the prefix is recomputed and the group computed in its place is stored, and serves the next request. A
/// group of the wrong length is refused on import.
#[test]
fn a_tier_group_that_does_not_decode_is_dropped_after_the_failed_onboard() {
    let p = prompt();
    let matched = (p.len() - 1) / BS * BS;
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let h = engine(8, TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 });
    let mut events = h.report_events(1 << 16).unwrap();
    let info = h.model_info().clone();
    let hashes = block_hashes(&info.model_id, "", &p[..matched], BS);
    let len = GroupCodec::Kv(Codec::Int8).group_bytes(GROUP, BS, info.head_dim).unwrap();
    let group = |n: usize| EncodedGroup { codec: "int8".into(), bytes: vec![0; n] };
    assert_eq!(rt.block_on(h.import_groups(vec![(hashes[0], group(len - 1))])).unwrap(), 0, "wrong length");
    let unknown = EncodedGroup { codec: "zstd".into(), bytes: vec![0; len] };
    assert_eq!(rt.block_on(h.import_groups(vec![(hashes[0], unknown)])).unwrap(), 0, "unknown codec");
    assert_eq!(rt.block_on(h.import_groups(vec![(hashes[0], group(len))])).unwrap(), 1);
    assert_eq!(rt.block_on(h.probe_prefix(hashes.clone())).unwrap().local_blocks, 1);

    let (cold, cached, s) = run(&h, &p, 8);
    assert_eq!(cached, 0, "the bad group is not onboarded: {s:?}");
    let native = GroupCodec::Native(info.kv_dtype).name().into_owned();
    let snapshot = rt.block_on(h.residency_snapshot()).unwrap();
    let held: Vec<&str> = snapshot
        .blocks
        .iter()
        .filter_map(|c| match c {
            BlockChange::Stored { hash, tier: Tier::Host, codec, .. } if *hash == hashes[0] => Some(codec.as_ref()),
            _ => None,
        })
        .collect();
    assert_eq!(held, vec![native.as_str()], "the computed group replaced the bad one");
    let mut changes = Vec::new();
    while let Ok(batch) = events.try_recv() {
        changes.extend(batch.changes);
    }
    let removed = BlockChange::Removed { hash: hashes[0], tier: Tier::Host, codec: "int8".into() };
    assert!(changes.contains(&removed), "the drop is reported: {changes:?}");

    push_out(&h);
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold);
    assert_eq!(cached as usize, matched, "served from the recomputed groups: {s:?}");
    assert_eq!(s.prefix_hit_tokens[Tier::Host.index()], matched as u64);
    assert_eq!((s.refused_imports, s.undecodable_groups), (2, 1), "both are counted in the worker's stats");
    h.shutdown();
}

/// A well-formed group whose values an f16 pool cannot hold (past 65504: an `int8` group with a huge scale, and a
/// native `f32` one) would onboard as infinities, and one infinite key turns attention into NaN. It is refused
/// like an undecodable group instead: dropped from the host tier and reported, the prefix recomputed, and the
/// output that of a cold run.
#[test]
fn a_tier_group_past_the_f16_pools_range_is_dropped_not_onboarded_as_infinity() {
    let p = prompt();
    let matched = (p.len() - 1) / BS * BS;
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let clean = engine_of(8, TierConfig::default(), KvDtype::F16);
    let (reference, _, _) = run(&clean, &p, 8);
    let info = clean.model_info().clone();
    clean.shutdown();
    let hashes = block_hashes(&info.model_id, "", &p[..matched], BS);
    let n = BS * info.head_dim;
    let mut huge = KvStorage::with_dtype(GROUP, BS, info.head_dim, KvDtype::F32);
    for b in 0..GROUP as u32 {
        let k: Vec<f32> = (0..n).map(|i| 1e6 + i as f32).collect();
        let v: Vec<f32> = (0..n).map(|i| -(i as f32) * 50.0).collect();
        huge.write_block(b, &k, &v);
    }
    let blocks: Vec<u32> = (0..GROUP as u32).collect();
    for codec in [GroupCodec::Kv(Codec::Int8), GroupCodec::Native(KvDtype::F32)] {
        let group = tiers_codec::encode(&huge, &blocks, codec).expect("f32 and int8 hold the values");
        let h = engine_of(8, TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 }, KvDtype::F16);
        let mut events = h.report_events(1 << 16).unwrap();
        assert_eq!(rt.block_on(h.import_groups(vec![(hashes[0], group.clone())])).unwrap(), 1, "{codec}");
        assert_eq!(rt.block_on(h.probe_prefix(hashes.clone())).unwrap().local_blocks, 1);
        let (out, cached, s) = run(&h, &p, 8);
        assert_eq!(cached, 0, "{codec}: the group is not onboarded: {s:?}");
        assert_eq!(s.undecodable_groups, 1, "{codec}: counted as undecodable");
        assert_eq!(out, reference, "{codec}: the prefix was recomputed");
        let mut changes = Vec::new();
        while let Ok(batch) = events.try_recv() {
            changes.extend(batch.changes);
        }
        let removed = BlockChange::Removed { hash: hashes[0], tier: Tier::Host, codec: group.codec.clone().into() };
        assert!(changes.contains(&removed), "{codec}: the drop is reported: {changes:?}");
        h.shutdown();
    }
}

/// The bench's shared offline prefill: groups one engine computed, exported from its host tier in the native format
/// and written into another engine's device pool, serve there as a device hit with the cold run's greedy output and
/// nothing recomputed; writing them again changes nothing, and a group in a lossy format is refused.
#[test]
fn seeded_device_groups_serve_like_computed_ones() {
    let p = prompt();
    let matched = (p.len() - 1) / BS * BS;
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let source = engine(8, TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 });
    let (cold, _, _) = run(&source, &p, 8);
    let hashes = block_hashes(&source.model_info().model_id, "", &p[..matched], BS);
    let groups = rt.block_on(source.export_groups(hashes.clone(), u64::MAX, ExportFrom::Tiers)).unwrap();
    source.shutdown();
    assert_eq!(groups.len(), hashes.len(), "every group of the prompt was offloaded to host");
    assert!(groups.iter().all(|(_, g)| g.codec == "f16"), "native groups");

    let h = engine(8, TierConfig::default());
    let mut lossy = groups.clone();
    lossy[0].1.codec = "int8".into();
    assert_eq!(rt.block_on(h.seed_device(lossy)).unwrap(), 0, "a lossy group is never taken for a computed one");
    assert_eq!(rt.block_on(h.seed_device(groups.clone())).unwrap(), hashes.len());
    assert_eq!(rt.block_on(h.seed_device(groups)).unwrap(), hashes.len(), "already on the device");
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold, "seeded KV is what a prefill computes");
    assert_eq!(cached as usize, matched);
    assert_eq!(s.prefix_hit_tokens[Tier::Device.index()], matched as u64, "{s:?}");
    assert_eq!(s.computed_tokens_total, (p.len() - matched + warm.len() - 1) as u64, "nothing seeded is recomputed");
    h.shutdown();
}

/// KIVI's residual under the LRU placement: with `int2_kivi` offloads and a 32-token residual, the last two full
/// groups of the finished prompt go to host in the device's own format, byte for byte what a native LRU engine
/// stores for them, while the prompt's earlier groups and the group its answer filled are quantised; the warm
/// request is served from those groups. Without a residual every group is quantised.
#[test]
fn lru_offloads_keep_a_prompts_last_groups_native_under_kivi() {
    let p = prompt();
    let prompt_groups = p.len() / BS;
    assert!(prompt_groups >= 3, "the prompt spans a quantised group and the residual: {}", p.len());
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let host = TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 };
    let start = |placement: TierPlacement, residual: usize| {
        Engine::start(EngineConfig {
            num_blocks: 8 * GROUP,
            threads: 2,
            tiers: host.clone(),
            placement,
            kivi_residual_tokens: residual,
            ..EngineConfig::new(model_path())
        })
        .expect("engine starts")
    };
    // Prompt and answer: one more full group than the prompt's own.
    let (out, _, _) = run(&start(TierPlacement::Lru, 0), &p, 8);
    let computed_groups = (p.len() + out.len() - 1) / BS;
    assert_eq!(computed_groups, prompt_groups + 1, "the answer fills one more group");
    let stored = |placement: TierPlacement, residual: usize| {
        let h = start(placement, residual);
        run(&h, &p, 8);
        let hashes = block_hashes(&h.model_info().model_id, "", &[p.as_slice(), &out].concat(), BS);
        let groups =
            rt.block_on(h.export_groups(hashes[..computed_groups].to_vec(), u64::MAX, ExportFrom::Tiers)).unwrap();
        assert_eq!(groups.len(), computed_groups, "every computed group went to host");
        (h, groups)
    };
    let (native_engine, native) = stored(TierPlacement::Lru, 0);
    native_engine.shutdown();
    let (h, kivi) = stored(TierPlacement::LruCodec(Codec::Int2Kivi), 32);
    let codecs: Vec<&str> = kivi.iter().map(|(_, g)| g.codec.as_str()).collect();
    let mut expected = vec!["int2_kivi"; computed_groups];
    expected[prompt_groups - 2] = "f16";
    expected[prompt_groups - 1] = "f16";
    assert_eq!(codecs, expected, "the prompt's last 32 tokens stay native, the answer's group does not");
    for i in [prompt_groups - 2, prompt_groups - 1] {
        assert_eq!(kivi[i].1.bytes, native[i].1.bytes, "group {i} is the device's own bytes");
    }
    // A peer is served the device's exact copy while there is one, not the tier's quantised one.
    let hashes: Vec<u64> = kivi.iter().map(|(hash, _)| *hash).collect();
    let served = rt.block_on(h.export_groups(hashes, u64::MAX, ExportFrom::DeviceFirst)).unwrap();
    assert_eq!(served.len(), computed_groups);
    for ((_, got), (_, want)) in served.iter().zip(&native) {
        assert_eq!((got.codec.as_str(), &got.bytes), ("f16", &want.bytes), "the device's own bytes");
    }
    push_out(&h);
    let (_, cached, s) = run(&h, &p, 8);
    assert_eq!(cached as usize, (p.len() - 1) / BS * BS, "the prefix is onboarded, residual and all");
    assert!(s.prefix_hit_tokens[Tier::Host.index()] > 0, "{s:?}");
    h.shutdown();
    let (h, all) = stored(TierPlacement::LruCodec(Codec::Int2Kivi), 0);
    assert!(all.iter().all(|(_, g)| g.codec == "int2_kivi"), "no residual: every group quantised");
    h.shutdown();

    // Groups that reached the host before they ended a prompt (seeded KV goes idle, and is offloaded, before any
    // request reads it) take the residual's format once a finished prompt ends on them.
    let h = start(TierPlacement::LruCodec(Codec::Int2Kivi), 32);
    let seeded = native[..prompt_groups].to_vec();
    let hashes: Vec<u64> = seeded.iter().map(|(hash, _)| *hash).collect();
    assert_eq!(rt.block_on(h.seed_device(seeded)).unwrap(), prompt_groups);
    wait_stats(&h, "the seeded groups offloaded", |s| s.offloaded_groups >= prompt_groups as u64);
    let before = rt.block_on(h.export_groups(hashes.clone(), u64::MAX, ExportFrom::Tiers)).unwrap();
    assert!(before.iter().all(|(_, g)| g.codec == "int2_kivi"), "idle seeded groups are offloaded quantised");
    run(&h, &p, 8);
    let after = rt.block_on(h.export_groups(hashes, u64::MAX, ExportFrom::Tiers)).unwrap();
    let codecs: Vec<&str> = after.iter().map(|(_, g)| g.codec.as_str()).collect();
    assert_eq!(codecs, expected[..prompt_groups], "the prompt's tail was stored again natively");
    assert_eq!(after[prompt_groups - 1].1.bytes, native[prompt_groups - 1].1.bytes);
    h.shutdown();
}

/// A group onboarded from a lossy copy is never stored again under a lossless name. Prompt A's first groups go
/// down in `int4_kivi`; prompt B, A's first four groups and one more token, onboards them from host, and its
/// residual tail (B's last two groups) would take the native format once B finishes. Re-encoding the device
/// blocks would store int4's values as `f16`, later onboarded as exact and served to peers as exact: the int4
/// copy stays instead.
#[test]
fn a_group_onboarded_from_a_lossy_copy_is_not_stored_again_as_native() {
    let p = prompt();
    // Six full groups: four quantised, then the 32-token residual.
    let a: Vec<u32> = p.iter().chain(&p).copied().take(100).collect();
    let (a_groups, k) = (a.len() / BS, 4);
    assert_eq!(a_groups, 6);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let h = Engine::start(EngineConfig {
        num_blocks: 8 * GROUP,
        threads: 2,
        tiers: TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 },
        placement: TierPlacement::LruCodec(Codec::Int4Kivi),
        kivi_residual_tokens: 32,
        ..EngineConfig::new(model_path())
    })
    .expect("engine starts");
    run(&h, &a, 8);
    let hashes = block_hashes(&h.model_info().model_id, "", &a, BS);
    let codecs = |h: &EngineHandle| -> Vec<String> {
        let got = rt.block_on(h.export_groups(hashes[..a_groups].to_vec(), u64::MAX, ExportFrom::Tiers)).unwrap();
        assert_eq!(got.len(), a_groups, "every group of A is on host");
        got.into_iter().map(|(_, g)| g.codec).collect()
    };
    let mut expected = vec!["int4_kivi"; a_groups];
    expected[a_groups - 2..].fill("f16");
    assert_eq!(codecs(&h), expected, "A's first four groups quantised, its residual native");
    push_out(&h);
    let b = &a[..k * BS + 1];
    let (_, cached, s) = run(&h, b, 8);
    assert_eq!(cached as usize, k * BS, "B's groups come back from host");
    assert_eq!(s.prefix_hit_tokens[Tier::Host.index()], (k * BS) as u64, "onboarded from the int4 copies: {s:?}");
    assert_eq!(codecs(&h), expected, "B's tail (A's groups 2 and 3) keeps its int4 copy, not an f16 relabelling");
    h.shutdown();
}

/// The `kv.codec` request extension under LRU placement: a request's groups go down to host in the codec it named,
/// the next request's in the worker's; a request can insist on the device's own format where the worker
/// compresses; its prefix comes back from host and serves. Under EvicPress the named codec is the only one the
/// request's context may be stored in (a context beside it, naming none, is stored as the utility chooses), and a
/// codec EvicPress does not offer is refused.
#[test]
fn a_request_names_the_codec_its_groups_are_stored_in() {
    let p = prompt();
    let other: Vec<u32> = p.iter().map(|&t| (t + 7) % 49_000).collect();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let host = TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 };
    let start = |placement: TierPlacement| {
        let cfg = EngineConfig {
            num_blocks: 8 * GROUP,
            threads: 2,
            tiers: host.clone(),
            placement,
            ..EngineConfig::new(model_path())
        };
        Engine::start(cfg).expect("engine starts")
    };
    let naming = |prompt: &[u32], codec: Option<GroupCodec>| GenerateRequest { tier_codec: codec, ..greedy(prompt, 8) };
    let stored = |h: &EngineHandle, prompt: &[u32], out: &[u32]| -> Vec<String> {
        let groups = (prompt.len() + out.len() - 1) / BS;
        let hashes = block_hashes(&h.model_info().model_id, "", &[prompt, out].concat(), BS);
        let got = rt.block_on(h.export_groups(hashes[..groups].to_vec(), u64::MAX, ExportFrom::Tiers)).unwrap();
        assert_eq!(got.len(), groups, "every computed group went to host");
        got.into_iter().map(|(_, g)| g.codec).collect()
    };

    let h = start(TierPlacement::Lru);
    let (cold, _, _) = run_request(&h, naming(&p, Some(GroupCodec::Kv(Codec::Int8))));
    assert!(stored(&h, &p, &cold).iter().all(|c| c == "int8"), "the named codec");
    let (out, _, _) = run(&h, &other, 8);
    assert!(stored(&h, &other, &out).iter().all(|c| c == "f16"), "the worker's codec for a request naming none");
    // The int8 copy serves the prefix once the device has lost it.
    push_out(&h);
    let (warm, cached, s) = run(&h, &p, 8);
    assert!(cached > 0 && s.prefix_hit_tokens[Tier::Host.index()] > 0, "{s:?}");
    assert_eq!(warm.len(), cold.len());
    h.shutdown();

    // A request insists on the device's own format where the worker stores int2.
    let h = start(TierPlacement::LruCodec(Codec::Int2Kivi));
    let native = "native".parse::<GroupCodec>().unwrap();
    let (out, _, _) = run_request(&h, naming(&p, Some(native)));
    assert!(stored(&h, &p, &out).iter().all(|c| c == "f16"), "native: the arena's f16");
    let (out, _, _) = run(&h, &other, 8);
    assert!(stored(&h, &other, &out).iter().all(|c| c == "int2_kivi"));
    h.shutdown();

    let ep = EvicPressConfig { codecs: vec![Codec::Int8, Codec::Int4Kivi], ..EvicPressConfig::default() };
    let h = start(TierPlacement::EvicPress(ep));
    match h.submit(naming(&p, Some(GroupCodec::Kv(Codec::Int2Kivi)))) {
        Err(EngineError::InvalidRequest(m)) => assert!(m.contains("EvicPress") && m.contains("int4_kivi"), "{m}"),
        other => panic!("a codec EvicPress does not offer: {other:?}"),
    }
    let placed =
        |n: u64| wait_stats(&h, "placed", |s| s.evicpress.as_ref().is_some_and(|e| e.pending == 0 && e.placed[1] == n));
    let context_codecs = |prompt: &[u32]| -> Vec<String> {
        // The context is the prompt's full groups before its last token.
        let groups = (prompt.len() - 1) / BS;
        let hashes = block_hashes(&h.model_info().model_id, "", prompt, BS);
        let got = rt.block_on(h.export_groups(hashes[..groups].to_vec(), u64::MAX, ExportFrom::Tiers)).unwrap();
        assert_eq!(got.len(), groups, "the whole context is on host");
        got.into_iter().map(|(_, g)| g.codec).collect()
    };
    // Contexts of at least four groups (EvicPressConfig::min_context_groups).
    let (p, other): (Vec<u32>, Vec<u32>) =
        (p.iter().chain(&p).copied().take(100).collect(), other.iter().chain(&other).copied().take(100).collect());
    run_request(&h, naming(&p, Some(GroupCodec::Kv(Codec::Int4Kivi))));
    placed(1);
    run(&h, &other, 8);
    placed(2);
    assert!(context_codecs(&p).iter().all(|c| c == "int4_kivi"), "the named codec: {:?}", context_codecs(&p));
    let free = context_codecs(&other);
    assert!(free.iter().all(|c| c == &free[0]) && free[0] != "int4_kivi", "the utility's choice: {free:?}");
    h.shutdown();
}

/// `--kivi-int8-layers` through the real engine: a KIVI group goes down with the listed layer's blocks in int8,
/// byte for byte the blocks an int8 worker stores for that layer, and every other block byte for byte the plain
/// KIVI worker's. It serves a warm request from host; a request naming a KIVI codec and EvicPress's KIVI variants
/// are stored layered too; a layer the model does not have stops the engine from starting.
#[test]
fn kivi_int8_layers_keep_the_listed_layers_in_int8() {
    let p = prompt();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let host = TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 };
    let cfg = |placement: TierPlacement, layers: Vec<usize>| EngineConfig {
        num_blocks: 8 * GROUP,
        threads: 2,
        tiers: host.clone(),
        placement,
        kivi_int8_layers: layers,
        ..EngineConfig::new(model_path())
    };
    let start = |placement: TierPlacement, layers: Vec<usize>| Engine::start(cfg(placement, layers)).expect("starts");
    let groups = (p.len() - 1) / BS;
    let stored = |h: &EngineHandle, req: GenerateRequest| {
        run_request(h, req);
        let hashes = block_hashes(&h.model_info().model_id, "", &p, BS);
        let got = rt.block_on(h.export_groups(hashes[..groups].to_vec(), u64::MAX, ExportFrom::Tiers)).unwrap();
        assert_eq!(got.len(), groups, "the prompt's groups went to host");
        got.into_iter().map(|(_, g)| g).collect::<Vec<_>>()
    };
    let plain = |codec: Codec| {
        let h = start(TierPlacement::LruCodec(codec), vec![]);
        let g = stored(&h, greedy(&p, 8));
        h.shutdown();
        g
    };
    let (int4, int8) = (plain(Codec::Int4Kivi), plain(Codec::Int8));
    let h = start(TierPlacement::LruCodec(Codec::Int4Kivi), vec![18]);
    let layered = stored(&h, greedy(&p, 8));
    let (len4, len8) = (Codec::Int4Kivi.encoded_len(BS, 64).unwrap(), Codec::Int8.encoded_len(BS, 64).unwrap());
    // Blocks are in `layer * 3 + head` order: layer 18 is blocks 54..57.
    let (before, int8_part) = (54 * len4, 3 * len8);
    for (i, g) in layered.iter().enumerate() {
        assert_eq!(g.codec, "int4_kivi+int8@18/30");
        assert_eq!(g.bytes.len(), 87 * len4 + 3 * len8, "group {i}");
        assert_eq!(g.bytes[..before], int4[i].bytes[..before], "layers 0..18 as int4_kivi stores them");
        assert_eq!(g.bytes[before..before + int8_part], int8[i].bytes[54 * len8..57 * len8], "layer 18 in int8");
        assert_eq!(g.bytes[before + int8_part..], int4[i].bytes[57 * len4..], "layers 19..30 as int4_kivi");
    }
    push_out(&h);
    let (_, cached, s) = run(&h, &p, 8);
    assert_eq!(cached as usize, groups * BS, "the prefix comes back from the layered copy");
    assert!(s.prefix_hit_tokens[Tier::Host.index()] > 0, "{s:?}");
    h.shutdown();

    // A request naming int2_kivi on a native worker: layered as well.
    let h = start(TierPlacement::Lru, vec![17, 18]);
    let named = stored(&h, GenerateRequest { tier_codec: Some(GroupCodec::Kv(Codec::Int2Kivi)), ..greedy(&p, 8) });
    assert!(named.iter().all(|g| g.codec == "int2_kivi+int8@17:18/30"), "{:?}", named[0].codec);
    h.shutdown();

    // EvicPress offers its KIVI variants layered: a context whose request names int4_kivi is stored in it.
    let ep = EvicPressConfig { codecs: vec![Codec::Int8, Codec::Int4Kivi], ..EvicPressConfig::default() };
    let h = start(TierPlacement::EvicPress(ep), vec![18]);
    let long: Vec<u32> = p.iter().chain(&p).copied().take(100).collect();
    run_request(&h, GenerateRequest { tier_codec: Some(GroupCodec::Kv(Codec::Int4Kivi)), ..greedy(&long, 8) });
    wait_stats(&h, "placed", |s| s.evicpress.as_ref().is_some_and(|e| e.pending == 0 && e.placed[1] == 1));
    let context = (long.len() - 1) / BS;
    let hashes = block_hashes(&h.model_info().model_id, "", &long, BS);
    let got = rt.block_on(h.export_groups(hashes[..context].to_vec(), u64::MAX, ExportFrom::Tiers)).unwrap();
    assert_eq!(got.len(), context);
    assert!(got.iter().all(|(_, g)| g.codec == "int4_kivi+int8@18/30"), "{:?}", got[0].1.codec);
    h.shutdown();

    match Engine::start(cfg(TierPlacement::LruCodec(Codec::Int4Kivi), vec![30])) {
        Err(EngineError::Config(m)) => assert!(m.contains("--kivi-int8-layers") && m.contains("30"), "{m}"),
        other => panic!("layer 30 of a 30-layer model: {:?}", other.map(|_| ())),
    }
}

/// An 8-bit device cache through the real engine: it serves, its idle groups go to host and disk in their own
/// format (codes and slot scales as stored, `native-int8` / `native-fp8_e4m3` / `native-fp8_e4m3_rotated`), and they
/// come back bit-exactly, so the warm greedy output equals the cold one and nothing onboarded is recomputed.
fn eight_bit_device_cache_serves_and_round_trips_through_host_and_disk(dtype: KvDtype) {
    let p = prompt();
    let matched = (p.len() - 1) / BS * BS;
    let native = format!("native-{dtype}");
    let h = engine_of(8, TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 }, dtype);
    let (cold, _, s) = run(&h, &p, 8);
    assert_eq!(cold.len(), 8);
    let device = s.tier_usage.iter().find(|u| u.tier == Tier::Device).expect("device usage reported");
    assert_eq!(device.codec, native);
    assert_eq!(device.capacity_bytes, (8 * GROUP * 2 * BS * (64 + 4)) as u64, "8-bit blocks: codes + slot scales");
    push_out(&h);
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold, "{dtype} KV onboarded from host gives the same greedy output");
    assert_eq!(cached as usize, matched);
    assert_eq!(s.prefix_hit_tokens[Tier::Host.index()], matched as u64, "{s:?}");
    let host = s.tier_usage.iter().find(|u| u.tier == Tier::Host).expect("host usage reported");
    assert_eq!(host.codec, native);
    h.shutdown();

    let dir = tmp(dtype.name());
    let h = engine_of(8, disk_only(&dir), dtype);
    run(&h, &p, 8);
    h.shutdown();
    let h = engine_of(8, disk_only(&dir), dtype);
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold, "{dtype} KV from disk after a restart");
    assert_eq!(s.prefix_hit_tokens[Tier::Disk.index()], matched as u64);
    assert_eq!(cached as usize, matched);
    h.shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn int8_device_cache_serves_and_round_trips_through_host_and_disk() {
    eight_bit_device_cache_serves_and_round_trips_through_host_and_disk(KvDtype::Int8);
}

#[test]
fn fp8_device_cache_serves_and_round_trips_through_host_and_disk() {
    eight_bit_device_cache_serves_and_round_trips_through_host_and_disk(KvDtype::Fp8);
}

#[test]
fn rotated_fp8_device_cache_serves_and_round_trips_through_host_and_disk() {
    eight_bit_device_cache_serves_and_round_trips_through_host_and_disk(KvDtype::Fp8Rotated);
}

/// A 240-token prompt whose 14-group context fits a 4 MiB host tier only as EvicPress's pruned copy (half its
/// tokens, native format), on an engine with room for the context and three 11-group fillers.
fn pruned_copy_engine(
    scoring: ProfileScoring,
    horizon: AnswerHorizon,
    paragraph: &[u32],
) -> (EngineHandle, Vec<u32>, usize) {
    pruned_copy_engine_stepping(scoring, horizon, paragraph, EngineConfig::new(model_path()).max_step_tokens)
}

/// [`pruned_copy_engine`] with at most `max_step_tokens` tokens in a step.
fn pruned_copy_engine_stepping(
    scoring: ProfileScoring,
    horizon: AnswerHorizon,
    paragraph: &[u32],
    max_step_tokens: usize,
) -> (EngineHandle, Vec<u32>, usize) {
    let p: Vec<u32> = std::iter::repeat_n(paragraph, 5).flatten().copied().take(240).collect();
    assert_eq!(p.len(), 240, "paragraph of {} tokens", paragraph.len());
    let context = (p.len() - 1) / BS * BS;
    assert_eq!(context, 14 * BS);
    let ep = EvicPressConfig {
        // Recomputing 224 tokens is always worth less than a lossy copy here: only the keep ratio is tested.
        alpha: 0.01,
        codecs: vec![],
        keep_ratios: vec![0.5],
        // The fillers below (11 groups) are not contexts.
        min_context_groups: 12,
        scoring,
        horizon,
        ..EvicPressConfig::default()
    };
    let cfg = EngineConfig {
        num_blocks: 26 * GROUP,
        threads: 2,
        // 4 MiB: 14 native groups take 5.2 MB, the 7 groups of half of them 2.6 MB.
        tiers: TierConfig { data_dir: None, host_bytes: 4 << 20, disk_bytes: 0 },
        placement: TierPlacement::EvicPress(ep),
        max_step_tokens,
        ..EngineConfig::new(model_path())
    };
    (Engine::start(cfg).expect("engine starts"), p, context)
}

/// Pushes every group of the context out of the device pool.
fn run_fillers(h: &EngineHandle) {
    for start in [1000u32, 3000, 5000] {
        let filler: Vec<u32> = (start..start + 11 * BS as u32).collect();
        run(h, &filler, 2);
    }
}

/// EvicPress's keep-ratio dimension through the real engine: a host tier too small for a 14-group context whole
/// but big enough for half of it gets KeyDiff's pruned copy (the profiler measured it first). After the device
/// forgets the context, the next request starts from that copy: its prompt tokens up to the context's end count
/// as served from host and are not recomputed, the sequence runs over half the slots, and its blocks all return
/// to the pool (a pruned cache is never published, so the request after it onboards the copy again).
#[test]
fn evicpress_serves_a_context_from_its_pruned_copy() {
    let (h, p, context) = pruned_copy_engine(ProfileScoring::TeacherForced, AnswerHorizon::Fixed, &prompt());
    let (cold, cached, _) = run(&h, &p, 8);
    assert_eq!((cold.len(), cached), (8, 0));
    let placed = wait_stats(&h, "the context's placement", |s| {
        s.evicpress.as_ref().is_some_and(|e| e.pending == 0 && e.placed[1] == 1)
    });
    let e = placed.evicpress.expect("EvicPress stats");
    assert_eq!(e.variants, ["f16", "f16@0.5"]);
    assert_eq!(e.profiles, 1, "{e:?}");
    assert!(e.mean_quality[1].is_some_and(|q| (0.0..=1.0).contains(&q)), "the pruned copy was profiled: {e:?}");
    assert!(e.planned_bytes[1] <= 4 << 20 && e.planned_bytes[1] > 0, "{e:?}");
    run_fillers(&h);
    for round in 1..=2u64 {
        let (warm, cached, s) = run(&h, &p, 8);
        assert_eq!(warm.len(), 8);
        assert_eq!(cached as usize, context, "round {round}: the pruned copy stands for the context");
        assert_eq!(s.prefix_hit_tokens[Tier::Host.index()], context as u64, "round {round}: {s:?}");
        assert_eq!(s.computed_tokens_total, (p.len() - context + warm.len() - 1) as u64, "round {round}");
        assert_eq!(s.evicpress.as_ref().map(|e| e.pruned_onboards), Some(round), "{s:?}");
        assert_eq!(s.blocks_used, 0, "round {round}: every block of the pruned sequence came back: {s:?}");
    }
    h.shutdown();
}

/// A pruned copy is decoded only for a step that can admit it. While another request's prefill takes every step's
/// budget, the request whose context has a pruned copy waits; decoding the copy for it in each of those steps
/// would hand it back to the pool unadmitted every time. It is decoded once, when the long prefill is done, and the
/// request still starts from it.
#[test]
fn a_pruned_copy_waits_for_a_step_that_can_admit_it() {
    let (h, p, context) =
        pruned_copy_engine_stepping(ProfileScoring::TeacherForced, AnswerHorizon::Fixed, &prompt(), 2 * BS);
    let (cold, _, _) = run(&h, &p, 8);
    wait_stats(&h, "the context's placement", |s| {
        s.evicpress.as_ref().is_some_and(|e| e.pending == 0 && e.placed[1] == 1)
    });
    run_fillers(&h);
    // Six steps of a 2-group budget: the first five are the long prompt's alone.
    let long: Vec<u32> = (7000..7000 + 11 * BS as u32).collect();
    let mut long_rx = h.submit(greedy_request("long", &long, 2, true)).expect("long request");
    let mut rx = h.submit(greedy_request("from-copy", &p, 8, true)).expect("request from the copy");
    let mut warm = Vec::new();
    let cached = loop {
        match rx.blocking_recv() {
            Some(GenerateEvent::Token { id, .. }) => warm.push(id),
            Some(GenerateEvent::Finished { cached_tokens, .. }) => break cached_tokens,
            other => panic!("unexpected event {other:?}"),
        }
    };
    while let Some(e) = long_rx.blocking_recv() {
        assert!(!matches!(e, GenerateEvent::Failed(_)), "{e:?}");
    }
    let s = wait_stats(&h, "the engine to go idle", |s| s.running == 0 && s.waiting == 0);
    assert_eq!(warm.len(), cold.len());
    assert_eq!(cached as usize, context, "the request started from the pruned copy: {s:?}");
    assert_eq!(s.evicpress.as_ref().map(|e| e.pruned_onboards), Some(1), "decoded once: {s:?}");
    assert_eq!(s.blocks_used, 0, "{s:?}");
    h.shutdown();
}

/// Free-running profiling measures what a request served from the variant gets: the pruned copy's profiled
/// quality is, position by position, the agreement between the answer of a request that starts from that copy and
/// the cold request's answer (both `answer` greedy tokens after the same prompt, the profiler's horizon: its fixed
/// 16, or the requests' own output length when observed). The context is real prose (240 tokens of *Alice in Wonderland* when `data/prose`
/// is fetched), where half the tokens do not carry every answer token.
fn free_running_profile_matches_a_request_from_the_copy(answer: usize, horizon: AnswerHorizon) {
    let g = Gguf::open(model_path()).expect("gguf");
    let tokenizer = Tokenizer::from_gguf(&g).expect("tokenizer");
    let alice = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/prose/alice29.txt");
    let text = std::fs::read_to_string(&alice).unwrap_or_default();
    let mut paragraph = tokenizer.encode(text.get(4000..8000).unwrap_or_default(), false);
    if paragraph.len() < 240 {
        paragraph = prompt();
    }
    let (h, p, context) = pruned_copy_engine(ProfileScoring::FreeRunning, horizon, &paragraph);
    let (cold, _, _) = run(&h, &p, answer as u32);
    let placed = wait_stats(&h, "the context's placement", |s| {
        s.evicpress.as_ref().is_some_and(|e| e.pending == 0 && e.placed[1] == 1)
    });
    let e = placed.evicpress.expect("EvicPress stats");
    assert_eq!(e.answer_horizon, answer as u64, "{e:?}");
    let profiled = e.mean_quality[1].expect("the pruned copy was profiled");
    run_fillers(&h);
    let (warm, cached, _) = run(&h, &p, answer as u32);
    assert_eq!(cached as usize, context, "served from the pruned copy");
    let observed = cold.iter().zip(&warm).filter(|(a, b)| a == b).count() as f64 / answer as f64;
    println!("{answer} tokens: profiled {profiled}, observed {observed}");
    assert_eq!(
        profiled, observed,
        "profiled {profiled}, a request from the copy agreed on {observed}:\n{cold:?}\n{warm:?}"
    );
    h.shutdown();
}

#[test]
fn free_running_profile_is_the_agreement_a_request_from_the_copy_gets() {
    free_running_profile_matches_a_request_from_the_copy(16, AnswerHorizon::Fixed);
}

/// With the observed horizon, requests that answer in 6 tokens are profiled over 6: the fixed 16 would rate the copy
/// by tokens no request reads.
#[test]
fn free_running_profile_scores_as_many_tokens_as_requests_generate() {
    free_running_profile_matches_a_request_from_the_copy(6, AnswerHorizon::Observed);
}

/// An engine of 26 groups whose one tier is a disk under `dir`, placed by EvicPress over whole native copies. Its
/// contexts are at least 12 groups, so the fillers of [`run_fillers`] (11) are not contexts.
fn evicpress_disk_engine(dir: &Path) -> EngineHandle {
    let ep =
        EvicPressConfig { codecs: vec![], keep_ratios: vec![], min_context_groups: 12, ..EvicPressConfig::default() };
    let cfg = EngineConfig {
        num_blocks: 26 * GROUP,
        threads: 2,
        tiers: disk_only(dir),
        placement: TierPlacement::EvicPress(ep),
        ..EngineConfig::new(model_path())
    };
    Engine::start(cfg).expect("engine starts")
}

/// Waits until EvicPress has placed everything pending and holds one context on disk.
fn placed_on_disk(h: &EngineHandle, what: &str) -> EngineStats {
    wait_stats(h, what, |s| s.evicpress.as_ref().is_some_and(|e| e.pending == 0 && e.placed[2] == 1))
}

/// Flips one bit in the middle of the disk tier's file for group `hash`.
fn corrupt_disk_group(dir: &Path, hash: u64) {
    let file = dir.join("kv").join(format!("{hash:016x}.kv"));
    let mut bytes = std::fs::read(&file).expect("the group is on disk");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
}

/// A 240-token prompt whose context (14 groups) `evicpress_disk_engine` has stored on disk, then the file of its
/// group `bad` corrupted and the device emptied: the engine, its disk directory, the prompt and its cold answer.
fn context_on_disk_then_corrupt(name: &str, bad: usize) -> (EngineHandle, PathBuf, Vec<u32>, Vec<u32>) {
    let p: Vec<u32> = std::iter::repeat_n(prompt(), 5).flatten().take(240).collect();
    let dir = tmp(name);
    let h = evicpress_disk_engine(&dir);
    let (cold, _, _) = run(&h, &p, 8);
    placed_on_disk(&h, "the context on disk");
    let hashes = block_hashes(&h.model_info().model_id, "", &p, BS);
    corrupt_disk_group(&dir, hashes[bad]);
    run_fillers(&h);
    (h, dir, p, cold)
}

/// After the device forgets it, `p`'s context comes back whole from disk and gives the `cold` answer.
fn served_whole_from_disk(h: &EngineHandle, p: &[u32], cold: &[u32]) -> EngineStats {
    let context = (p.len() - 1) / BS * BS;
    run_fillers(h);
    let (warm, cached, s) = run(h, p, 8);
    assert_eq!(warm, cold);
    assert_eq!(cached as usize, context, "the copy placed again serves the whole context: {s:?}");
    assert_eq!(s.prefix_hit_tokens[Tier::Disk.index()], context as u64, "{s:?}");
    s
}

/// The planner's view of the stores never outlives the stores: when a stored copy turns out incomplete (here a
/// corrupt disk file, which the tier detects and deletes), the request that found it recomputes the context, and
/// EvicPress releases the lost copy and places the context again, so the request after that is served whole from
/// disk. (Before, the planner went on counting the lost copy as stored and never placed the context again: every
/// later request recomputed it.)
#[test]
fn evicpress_places_a_context_again_after_the_stores_lose_its_copy() {
    let (h, dir, p, cold) = context_on_disk_then_corrupt("evicpress-lost", 1);
    let (warm, cached, s) = run(&h, &p, 8);
    assert_eq!(warm, cold, "a corrupt file is never used");
    assert_eq!(cached as usize, BS, "only the group before the corrupt one is onboarded: {s:?}");
    let s = placed_on_disk(&h, "the context placed again");
    let e = s.evicpress.expect("EvicPress stats");
    assert_eq!(e.lost_copies, 1, "{e:?}");
    served_whole_from_disk(&h, &p, &cold);
    h.shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two prompts that share a prefix (a system prompt, a task's instructions) and then differ: a request for the
/// second goes through the first's context only partly, and leaves only the shared groups on the device. When the
/// first's copy turns out lost on that request, EvicPress releases it and places nothing from the groups at hand:
/// one lost copy, not a second one from trying to store the context from groups that are not there. The next
/// request for the first prompt computes it and stores it whole again.
#[test]
fn evicpress_places_nothing_from_a_request_that_went_only_partly_through_a_context() {
    // The copy's fourth group, inside the shared prefix, goes bad: the second prompt's request finds it.
    let (h, dir, a, cold) = context_on_disk_then_corrupt("evicpress-partial", 3);
    // The second prompt's own groups (4) are too few to make a context.
    let b: Vec<u32> = a[..10 * BS].iter().copied().chain(7000..7080).collect();
    let (_, cached, s) = run(&h, &b, 8);
    assert_eq!(cached as usize, 3 * BS, "the groups before the corrupt one are onboarded: {s:?}");
    let s = wait_stats(&h, "the lost copy released", |s| {
        s.evicpress.as_ref().is_some_and(|e| e.pending == 0 && e.lost_copies > 0)
    });
    let e = s.evicpress.expect("EvicPress stats");
    assert_eq!(e.lost_copies, 1, "nothing stored from a partial pass: {e:?}");
    assert_eq!(e.placed, [0, 0, 0], "{e:?}");

    run_fillers(&h);
    let (warm, _, _) = run(&h, &a, 8);
    assert_eq!(warm, cold);
    placed_on_disk(&h, "the first prompt's context placed again");
    let s = served_whole_from_disk(&h, &a, &cold);
    assert_eq!(s.evicpress.expect("EvicPress stats").lost_copies, 1);
    h.shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// EvicPress recomputes a context it has been serving from a lossy copy once the utility says so
/// (`EvicPressConfig::upgrade`): the host tier holds one of two contexts whole and the other in 2 bits. The context
/// asked for more often ends up whole: the request that recomputes it answers exactly as the cold run did, the
/// placement that follows stores it from its full-precision KV (compressing the other one instead), and after the
/// device forgets it, it comes back from host whole and exact.
#[test]
fn evicpress_recomputes_a_hot_context_served_from_a_lossy_copy() {
    let g = Gguf::open(model_path()).expect("gguf");
    let tokenizer = Tokenizer::from_gguf(&g).expect("tokenizer");
    let alice = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/prose/alice29.txt");
    let text = std::fs::read_to_string(&alice).expect("data/prose (scripts/fetch-prose.sh)");
    let window = |from: usize| -> Vec<u32> {
        let tokens = tokenizer.encode(text.get(from..from + 2000).expect("prose"), false);
        assert!(tokens.len() >= 240, "{} tokens", tokens.len());
        tokens[..240].to_vec()
    };
    let (a, b) = (window(4000), window(20000));
    let context = (b.len() - 1) / BS * BS;
    let ep = EvicPressConfig {
        // The 2-bit copy's loss, α · (1 − q) = 0.2 · 0.31-0.34 = 62-68 ms at the profiled q of 0.66-0.69, has to
        // sit between two measured costs (the test prints both). Above what the whole copy takes to load over the
        // 2-bit one: the host tier loads and decodes into device blocks at 128-188 MB/s of stored bytes, so 5.2 MB
        // against 1.1 MB is 22-32 ms more. Below what recomputing the context costs over loading the 2-bit copy:
        // 224 tokens at the 690-870 prompt tokens/s of dev builds are 260-320 ms, at release's 1,640 137 ms. Then
        // the new context is stored in 2 bits, and once it has been asked for several times more than the other,
        // storing it whole pays and recomputing it pays. The margins are 2x on either side. (α = 0.1 put the loss
        // at 31-34 ms, within a slow load's reach: at 159 MB/s the planner kept the context in 2 bits however
        // often it was asked for; α = 0.6 put it at 206 ms, within the recompute's, and release builds dropped the
        // context instead.)
        alpha: 0.2,
        codecs: vec![pagoda_kernels::Codec::Int2Kivi],
        keep_ratios: vec![],
        min_context_groups: 12,
        upgrade: true,
        ..EvicPressConfig::default()
    };
    let cfg = EngineConfig {
        num_blocks: 26 * GROUP,
        threads: 2,
        // One 14-group context whole (5.2 MB) and the other in 2 bits (1.1 MB); not both whole.
        tiers: TierConfig { data_dir: None, host_bytes: 6_500_000, disk_bytes: 0 },
        placement: TierPlacement::EvicPress(ep),
        ..EngineConfig::new(model_path())
    };
    let h = Engine::start(cfg).expect("engine starts");
    let settled = |h: &EngineHandle, what: &str, placed: u64| {
        wait_stats(h, what, |s| s.evicpress.as_ref().is_some_and(|e| e.pending == 0 && e.placed[1] == placed))
    };
    // (compressions, drops, upgrades) once both contexts are placed in host.
    let changes = |h: &EngineHandle, what: &str| {
        let e = settled(h, what, 2).evicpress.expect("EvicPress stats");
        println!("{what}: {e:?}");
        (e.compressed, e.dropped, e.upgrades)
    };
    // Once the device forgot it, the context comes back from host whole.
    let from_host = |h: &EngineHandle| {
        run_fillers(h);
        let (out, cached, s) = run(h, &b, 4);
        assert_eq!(cached as usize, context, "{s:?}");
        assert_eq!(s.prefix_hit_tokens[Tier::Host.index()], context as u64, "{s:?}");
        (out, s)
    };
    run(&h, &a, 4);
    run(&h, &a, 4);
    settled(&h, "the first context", 1);
    let (cold_b, _, _) = run(&h, &b, 4);
    assert_eq!(changes(&h, "both contexts"), (1, 0, 0), "the new context is compressed");
    from_host(&h);
    // The costs the plan weighs, as the engine measured them (shown with `-- --nocapture`).
    let probe = futures::executor::block_on(h.probe_prefix(Vec::new())).expect("engine answers");
    println!(
        "host tier loads {:.0} MB/s of stored bytes; prefill {:.0} tokens/s ({:.0} ms for the context at that rate)",
        probe.host_load_bytes_per_s / 1e6,
        probe.prefill_tokens_per_s,
        context as f64 / probe.prefill_tokens_per_s * 1e3
    );
    let mut upgraded_at = None;
    // Recomputing pays once the reuses times the loss exceed the prefill's price: after 1 reuse in release builds,
    // 3-4 in dev, 10-12 with the whole suite beside two busy loops on its two cores (the engine prices the prefill
    // it times). The bound leaves five times that.
    for i in 0..60 {
        let (out, cached, s) = run(&h, &b, 4);
        if s.evicpress.as_ref().is_some_and(|e| e.upgrades == 1) {
            assert_eq!(cached, 0, "the upgrading request computes the context: {s:?}");
            assert_eq!(out, cold_b, "at full precision");
            upgraded_at = Some(i);
            break;
        }
        assert_eq!(cached as usize, context, "request {i}: the device's decoded copy serves it until then");
    }
    println!("recomputed after {upgraded_at:?} reuses from the device's decoded copy");
    assert!(upgraded_at.is_some(), "the hot context was never recomputed");
    assert_eq!(changes(&h, "the context placed again"), (2, 0, 1), "the other context is compressed now");
    let (warm, s) = from_host(&h);
    assert_eq!(warm, cold_b, "the copy stored after the upgrade is whole");
    assert_eq!(s.evicpress.map(|e| e.upgrades), Some(1), "a whole copy is never recomputed");
    h.shutdown();
}
