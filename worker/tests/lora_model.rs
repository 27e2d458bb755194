//! LoRA adapters on the real SmolLM2-135M-Instruct model: served unmerged they compute what their merged f32
//! weights compute; in a mixed batch each sequence gets only its own adapter; through the engine an adapter's
//! answers differ from the base model's, its KV is cached apart from the base model's and another adapter's, and
//! an unknown adapter is refused. The adapters are synthetic (`write_synthetic_peft`: random weights in PEFT
//! format), which is all these checks need.

mod common;

use pagoda_kernels::{CpuBackend, KvDtype, KvStorage};
use pagoda_worker::adapters::AdapterError;
use pagoda_worker::engine::{
    Engine, EngineConfig, EngineError, EngineHandle, GenerateRequest, LoraSpec, TierPlacement,
};
use pagoda_worker::model::lora::{cache_namespace, write_synthetic_peft};
use pagoda_worker::model::{
    ForwardSeq, Gguf, LlamaModel, LogitsWanted, LoraAdapter, LoraTarget, Scratch, SyntheticLora,
};
use pagoda_worker::placement::EvicPressConfig;
use std::path::{Path, PathBuf};

const BLOCK: usize = 16;

fn model_path() -> PathBuf {
    match std::env::var_os("PAGODA_MODEL") {
        Some(p) => p.into(),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

fn load_model() -> LlamaModel {
    let gguf = Gguf::open(model_path()).expect("open model (set PAGODA_MODEL or put it in models/)");
    LlamaModel::load(&gguf).expect("load model")
}

/// A synthetic adapter for `model` in a fresh directory named by `tag`.
fn adapter_dir(model: &LlamaModel, tag: &str, spec: &SyntheticLora) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagoda-lora-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_synthetic_peft(&dir, model.config(), spec).expect("write adapter");
    dir
}

fn backend() -> CpuBackend {
    CpuBackend::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 200 + (i * 37 + seed * 101) % 4000).collect()
}

/// Every logits row of `tokens` run as sequence slot `slot` of its own step, under `lora`.
fn logits_alone(model: &LlamaModel, tokens: &[u32], lora: Option<&LoraAdapter>) -> Vec<f32> {
    logits_batch(model, &[(tokens, lora)]).remove(0)
}

/// Every logits row of each sequence, all in one step.
fn logits_batch(model: &LlamaModel, seqs: &[(&[u32], Option<&LoraAdapter>)]) -> Vec<Vec<f32>> {
    let cfg = model.config();
    let n_tables = cfg.n_kv_tables();
    let per_table = seqs.iter().map(|(t, _)| t.len()).max().unwrap_or(1).div_ceil(BLOCK);
    let mut kv = KvStorage::with_dtype(seqs.len() * n_tables * per_table, BLOCK, cfg.head_dim, KvDtype::F32);
    let tables: Vec<Vec<Vec<u32>>> = (0..seqs.len())
        .map(|s| {
            (0..n_tables)
                .map(|t| {
                    let base = (s * n_tables + t) * per_table;
                    (base..base + per_table).map(|b| b as u32).collect()
                })
                .collect()
        })
        .collect();
    let lens = vec![0usize; n_tables];
    let batch: Vec<ForwardSeq<'_>> = seqs
        .iter()
        .zip(&tables)
        .map(|(&(tokens, lora), tables)| ForwardSeq {
            tokens,
            start_pos: 0,
            tables,
            prior_lens: &lens,
            logits: LogitsWanted::All,
            capture_q: 0,
            attention_sums: None,
            lora,
        })
        .collect();
    let mut out = Vec::new();
    model.forward(&backend(), &mut kv, &batch, &mut Scratch::new(), &mut out).expect("forward");
    let vocab = cfg.vocab;
    let mut rows = out.chunks(vocab);
    seqs.iter().map(|(t, _)| rows.by_ref().take(t.len()).flatten().copied().collect()).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn an_adapter_served_unmerged_computes_what_its_merged_weights_compute() {
    let model = load_model().to_f32_weights().expect("f32 weights");
    let dir = adapter_dir(&model, "merge", &SyntheticLora { rank: 8, alpha: 16.0, ..SyntheticLora::default() });
    let adapter = LoraAdapter::load("merge", &dir, model.config(), 64).expect("load adapter");
    assert_eq!(adapter.targets(), &LoraTarget::ALL[..]);
    let merged = model.merged_with(&adapter).expect("merge");
    let tokens = prompt(1, 37);
    let served = logits_alone(&model, &tokens, Some(&adapter));
    let reference = logits_alone(&merged, &tokens, None);
    let base = logits_alone(&model, &tokens, None);
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = max_abs_diff(&served, &reference);
    // The same sums in another order: float rounding only.
    assert!(err <= 2e-4 * scale, "unmerged vs merged: max |diff| {err} (logits up to {scale})");
    // And the adapter does change the model, so the comparison above could fail.
    let moved = max_abs_diff(&served, &base);
    assert!(moved > 100.0 * err.max(1e-4), "the adapter barely moved the logits: {moved}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn in_a_mixed_batch_each_sequence_gets_only_its_own_adapter() {
    let model = load_model();
    let spec =
        SyntheticLora { rank: 4, targets: vec![LoraTarget::Q, LoraTarget::V, LoraTarget::Down], ..Default::default() };
    let (da, db) =
        (adapter_dir(&model, "mix-a", &spec), adapter_dir(&model, "mix-b", &SyntheticLora { seed: 9, ..spec }));
    let a = LoraAdapter::load("a", &da, model.config(), 64).unwrap();
    let b = LoraAdapter::load("b", &db, model.config(), 64).unwrap();
    let prompts: Vec<Vec<u32>> = (0..5).map(|s| prompt(s, 9 + 4 * s as usize)).collect();
    // a, a (one run of rows), base, b, a.
    let loras = [Some(&a), Some(&a), None, Some(&b), Some(&a)];
    let seqs: Vec<(&[u32], Option<&LoraAdapter>)> = prompts.iter().map(Vec::as_slice).zip(loras).collect();
    let together = logits_batch(&model, &seqs);
    for (i, ((tokens, lora), got)) in seqs.iter().zip(&together).enumerate() {
        let alone = logits_alone(&model, tokens, *lora);
        let err = max_abs_diff(got, &alone);
        assert!(err < 1e-4, "sequence {i}: batched vs alone differ by {err}");
    }
    // The two adapters and the base model give different logits for the same tokens.
    let same: Vec<(&[u32], Option<&LoraAdapter>)> =
        vec![(&prompts[0], None), (&prompts[0], Some(&a)), (&prompts[0], Some(&b))];
    let rows = logits_batch(&model, &same);
    assert!(max_abs_diff(&rows[0], &rows[1]) > 1e-2 && max_abs_diff(&rows[1], &rows[2]) > 1e-2);
    let _ = (std::fs::remove_dir_all(&da), std::fs::remove_dir_all(&db));
}

fn engine_with(adapters: &[(&str, &Path)]) -> EngineHandle {
    let cfg = EngineConfig {
        kv_cache_tokens: 4096,
        threads: 2,
        lora: adapters.iter().map(|(n, d)| LoraSpec { name: n.to_string(), dir: d.to_path_buf() }).collect(),
        ..EngineConfig::new(model_path())
    };
    Engine::start(cfg).expect("start engine")
}

#[test]
fn the_engine_serves_adapters_with_their_own_cache_and_refuses_unknown_ones() {
    let model = load_model();
    let spec = SyntheticLora { rank: 8, b_std: 0.3, ..Default::default() };
    let (da, db) =
        (adapter_dir(&model, "eng-a", &spec), adapter_dir(&model, "eng-b", &SyntheticLora { seed: 5, ..spec }));
    let h = engine_with(&[("sql", &da), ("chat", &db)]);
    let names: Vec<String> = h.lora_adapters().iter().map(|a| a.name().to_string()).collect();
    assert_eq!(names, ["chat", "sql"]);
    let p = prompt(3, 70);
    let with = |name: Option<&str>| GenerateRequest { lora: name.map(str::to_owned), ..common::greedy(&p, 12) };

    let (base, base_cached, _) = common::run_request(&h, with(None));
    let (sql, sql_cached, _) = common::run_request(&h, with(Some("sql")));
    assert_eq!((base_cached, sql_cached), (0, 0), "the adapter must not adopt the base model's cached prompt");
    assert_ne!(base, sql, "the adapter did not change the answer");
    // Again: now its own prompt is cached, and the answer is the same.
    let (sql_again, cached, _) = common::run_request(&h, with(Some("sql")));
    assert_eq!(sql_again, sql);
    assert!(cached >= 64, "the adapter's own prefix was not reused: {cached}");
    // A base-model request cannot name the adapter's salted namespace (its cache id is public in Health) to write
    // the base model's KV under the adapter's hashes.
    let sql_id = h.lora_registry().get("sql").unwrap().cache_id().to_string();
    let spoof = GenerateRequest { namespace: cache_namespace("", &sql_id), ..with(None) };
    match h.submit(spoof) {
        Err(EngineError::InvalidRequest(m)) => assert!(m.contains("namespace"), "{m}"),
        other => panic!("a namespace spelling the adapter's salt was not refused: {other:?}"),
    }
    let (sql_still, _, _) = common::run_request(&h, with(Some("sql")));
    assert_eq!(sql_still, sql);
    // Another adapter shares neither.
    let (chat, chat_cached, _) = common::run_request(&h, with(Some("chat")));
    assert_eq!(chat_cached, 0);
    assert_ne!(chat, sql);
    // The base model still finds its own.
    let (base_again, cached, _) = common::run_request(&h, with(None));
    assert_eq!(base_again, base);
    assert!(cached >= 64);

    match h.submit(with(Some("nope"))) {
        Err(EngineError::Lora(AdapterError::Unknown(name))) => assert_eq!(name, "nope"),
        other => panic!("an unknown adapter was not refused: {other:?}"),
    }
    h.shutdown();
    let _ = (std::fs::remove_dir_all(&da), std::fs::remove_dir_all(&db));
}

#[test]
fn adapters_that_do_not_fit_the_model_or_the_configuration_stop_the_start() {
    let model = load_model();
    let dir = adapter_dir(&model, "bad", &SyntheticLora { rank: 16, ..Default::default() });
    let low_rank = EngineConfig { max_lora_rank: 8, ..EngineConfig::new(model_path()) };
    let cfg = |c: EngineConfig| EngineConfig { lora: vec![LoraSpec { name: "x".into(), dir: dir.clone() }], ..c };
    let err = Engine::start(cfg(low_rank)).unwrap_err().to_string();
    assert!(err.contains("rank 16") && err.contains("--max-lora-rank"), "{err}");
    let missing = EngineConfig {
        lora: vec![LoraSpec { name: "x".into(), dir: dir.join("missing") }],
        ..EngineConfig::new(model_path())
    };
    assert!(Engine::start(missing).unwrap_err().to_string().contains("adapter_config.json"));
    let twice = EngineConfig {
        lora: vec![LoraSpec { name: "x".into(), dir: dir.clone() }, LoraSpec { name: "x".into(), dir: dir.clone() }],
        ..EngineConfig::new(model_path())
    };
    assert!(Engine::start(twice).unwrap_err().to_string().contains("given twice"));
    let base_name = EngineConfig {
        // The model id is the GGUF's file stem.
        lora: vec![LoraSpec { name: model_path().file_stem().unwrap().to_string_lossy().into(), dir: dir.clone() }],
        max_lora_rank: 16,
        ..EngineConfig::new(model_path())
    };
    assert!(Engine::start(base_name).unwrap_err().to_string().contains("base model's name"));
    let evicpress = EngineConfig {
        placement: TierPlacement::EvicPress(EvicPressConfig::default()),
        ..EngineConfig::new(model_path())
    };
    assert!(Engine::start(cfg(evicpress)).unwrap_err().to_string().contains("evicpress"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn adapters_load_and_unload_at_run_time_only_from_under_the_lora_dir() {
    let model = load_model();
    let root = std::env::temp_dir().join(format!("pagoda-lora-runtime-{}", std::process::id()));
    let outside = std::env::temp_dir().join(format!("pagoda-lora-outside-{}", std::process::id()));
    for d in [&root, &outside] {
        let _ = std::fs::remove_dir_all(d);
    }
    let spec = SyntheticLora { rank: 8, b_std: 0.3, ..Default::default() };
    write_synthetic_peft(&root.join("sql"), model.config(), &spec).unwrap();
    write_synthetic_peft(&outside, model.config(), &spec).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();

    let off =
        Engine::start(EngineConfig { kv_cache_tokens: 2048, threads: 2, ..EngineConfig::new(model_path()) }).unwrap();
    assert!(matches!(off.load_lora("sql", "sql"), Err(EngineError::Lora(AdapterError::RuntimeOff))));
    off.shutdown();

    let h = Engine::start(EngineConfig {
        kv_cache_tokens: 4096,
        threads: 2,
        lora_dir: Some(root.clone()),
        max_loras: 2,
        ..EngineConfig::new(model_path())
    })
    .unwrap();
    let p = prompt(4, 40);
    let with = |name: Option<&str>| GenerateRequest { lora: name.map(str::to_owned), ..common::greedy(&p, 8) };
    let (base, _, _) = common::run_request(&h, with(None));
    let loaded = h.load_lora("sql", "sql").expect("load");
    assert_eq!((loaded.name(), loaded.rank()), ("sql", 8));
    assert_eq!(h.lora_adapters().len(), 1);
    let (sql, _, _) = common::run_request(&h, with(Some("sql")));
    assert_ne!(sql, base);
    let refused = |r: Result<_, EngineError>| match r {
        Err(EngineError::Lora(e)) => e,
        other => panic!("not refused: {other:?}"),
    };
    assert_eq!(refused(h.load_lora("sql", "sql")), AdapterError::Exists("sql".into()));
    for (path, why) in
        [("../x", "without `..`"), ("/etc", "without `..`"), ("link", "outside"), ("nope", "cannot open")]
    {
        let e = refused(h.load_lora("x", path));
        assert!(e.to_string().contains(why), "{path}: {e}");
    }
    assert!(refused(h.load_lora("bad name", "sql")).to_string().contains("adapter name"));
    // The same weights under a second name; a third is past --max-loras.
    h.load_lora("sql2", "./sql").expect("load a second name");
    assert_eq!(refused(h.load_lora("sql3", "sql")), AdapterError::Full(2));
    // The name is part of the cache id: the second name computes its own prompt, and answers the same.
    let (sql2, cached, _) = common::run_request(&h, with(Some("sql2")));
    assert_eq!((sql2, cached), (sql.clone(), 0));

    h.unload_lora("sql").unwrap();
    assert!(matches!(h.submit(with(Some("sql"))), Err(EngineError::Lora(AdapterError::Unknown(_)))));
    assert_eq!(h.unload_lora("sql"), Err(EngineError::Lora(AdapterError::Unknown("sql".into()))));
    // Loaded again, it answers as before and finds its blocks still cached under its salted hashes.
    h.load_lora("sql", "sql").unwrap();
    let (again, cached, _) = common::run_request(&h, with(Some("sql")));
    assert_eq!(again, sql);
    assert!(cached >= 32, "{cached}");
    h.shutdown();
    for d in [&root, &outside] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Admin loads of one name at once read its files once: the rest wait for that load and are refused as existing,
/// instead of each reading up to 2 GiB only to lose the race for the map.
#[test]
fn concurrent_admin_loads_of_one_name_read_it_once() {
    let model = load_model();
    let root = std::env::temp_dir().join(format!("pagoda-lora-concurrent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let spec = SyntheticLora { rank: 8, b_std: 0.3, ..Default::default() };
    write_synthetic_peft(&root.join("sql"), model.config(), &spec).unwrap();
    let h = Engine::start(EngineConfig {
        kv_cache_tokens: 2048,
        threads: 2,
        lora_dir: Some(root.clone()),
        max_loras: 4,
        ..EngineConfig::new(model_path())
    })
    .unwrap();
    const LOADERS: usize = 8;
    let start = std::sync::Barrier::new(LOADERS);
    let (start, engine) = (&start, &h);
    let results: Vec<Result<_, EngineError>> = std::thread::scope(|s| {
        let loaders: Vec<_> = (0..LOADERS)
            .map(move |_| {
                s.spawn(move || {
                    start.wait();
                    engine.load_lora("sql", "sql")
                })
            })
            .collect();
        loaders.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let loaded = results.iter().filter(|r| r.is_ok()).count();
    let existing = results.iter().filter(|r| matches!(r, Err(EngineError::Lora(AdapterError::Exists(_))))).count();
    assert_eq!((loaded, existing), (1, LOADERS - 1), "{results:?}");
    let c = h.lora_registry().counters();
    assert_eq!((c.reads, c.loads), (1, 1), "{c:?}");
    h.shutdown();
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn adapters_load_on_demand_and_the_least_recently_used_idle_one_gives_way() {
    let model = load_model();
    let root = std::env::temp_dir().join(format!("pagoda-lora-on-demand-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let spec = SyntheticLora { rank: 8, b_std: 0.3, seed: 10 + i as u64, ..Default::default() };
        write_synthetic_peft(&root.join(name), model.config(), &spec).unwrap();
    }
    std::fs::create_dir_all(root.join("not-an-adapter")).unwrap();
    std::fs::create_dir_all(root.join("broken")).unwrap();
    std::fs::write(root.join("broken/adapter_config.json"), b"{not json").unwrap();
    let pinned = adapter_dir(&model, "pinned", &SyntheticLora { rank: 8, b_std: 0.3, seed: 3, ..Default::default() });

    let h = Engine::start(EngineConfig {
        kv_cache_tokens: 4096,
        threads: 2,
        lora: vec![LoraSpec { name: "pinned".into(), dir: pinned.clone() }],
        lora_dir: Some(root.clone()),
        lora_on_demand: true,
        max_loras: 3,
        ..EngineConfig::new(model_path())
    })
    .unwrap();
    let reg = h.lora_registry();
    assert!(reg.on_demand());
    assert_eq!(*reg.available(), vec!["a", "b", "broken", "c"], "directories with an adapter_config.json");
    let p = prompt(7, 40);
    let with = |name: &str| GenerateRequest { lora: Some(name.to_owned()), ..common::greedy(&p, 8) };
    let names = |h: &EngineHandle| h.lora_adapters().iter().map(|a| a.name().to_string()).collect::<Vec<_>>();

    // `a` and `b` load on their first request; `submit` alone never loads.
    assert!(matches!(h.submit(with("a")), Err(EngineError::Lora(AdapterError::Unknown(_)))));
    h.resolve_lora("a").unwrap();
    let (a_first, _, _) = common::run_request(&h, with("a"));
    h.resolve_lora("b").unwrap();
    let (b_first, _, _) = common::run_request(&h, with("b"));
    assert_ne!(a_first, b_first);
    assert_eq!(names(&h), vec!["a", "b", "pinned"]);
    // Full: `c` takes the slot of the least recently used idle on-demand adapter (`a`), never the pinned one.
    h.resolve_lora("b").unwrap();
    h.resolve_lora("c").unwrap();
    assert_eq!(names(&h), vec!["b", "c", "pinned"]);
    let c = reg.counters();
    assert_eq!((c.loads, c.on_demand_loads, c.evictions), (3, 3, 1));
    assert!(c.load_seconds > 0.0 && reg.mean_load_seconds() > 0.0);

    // While requests hold `b` and `c`, nothing can give way: busy, not unknown.
    let (held_b, held_c) = (h.resolve_lora("b").unwrap(), h.resolve_lora("c").unwrap());
    assert_eq!(h.resolve_lora("a").unwrap_err(), EngineError::Lora(AdapterError::AllInUse(3, "a".into())));
    drop(held_b);
    // Loaded again, `a` answers as before and finds its blocks still cached under its salted hashes.
    h.resolve_lora("a").unwrap();
    let (a_again, cached, _) = common::run_request(&h, with("a"));
    assert_eq!(a_again, a_first);
    assert!(cached >= 32, "{cached}");
    assert_eq!(names(&h), vec!["a", "c", "pinned"]);
    drop(held_c);

    // What the directory lacks, or what is not an adapter, is unknown; a broken adapter is invalid.
    for missing in ["zzz", "not-an-adapter/..", "../a", "pinned2"] {
        assert!(matches!(h.resolve_lora(missing), Err(EngineError::Lora(AdapterError::Unknown(_)))), "{missing}");
    }
    assert!(matches!(h.resolve_lora("not-an-adapter"), Err(EngineError::Lora(AdapterError::Invalid(_)))));
    assert!(matches!(h.resolve_lora("broken"), Err(EngineError::Lora(AdapterError::Invalid(_)))));
    h.shutdown();

    // Without --lora-on-demand nothing loads by name, and nothing is announced.
    let off = Engine::start(EngineConfig {
        kv_cache_tokens: 2048,
        threads: 2,
        lora_dir: Some(root.clone()),
        ..EngineConfig::new(model_path())
    })
    .unwrap();
    assert!(off.lora_registry().available().is_empty());
    assert!(matches!(off.resolve_lora("a"), Err(EngineError::Lora(AdapterError::Unknown(_)))));
    off.shutdown();
    let err = Engine::start(EngineConfig { lora_on_demand: true, ..EngineConfig::new(model_path()) }).unwrap_err();
    assert!(err.to_string().contains("--lora-dir"), "{err}");
    let _ = (std::fs::remove_dir_all(&root), std::fs::remove_dir_all(&pinned));
}
