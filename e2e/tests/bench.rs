//! The cluster benchmarks as commands through the real binary, at a size CI can afford: `pagoda bench routing`
//! and `pagoda bench disaggregation` start their own worker and router processes per strategy or deployment and
//! must report every one with nothing failed.

mod common;

use common::BIN;
use pagoda_e2e::require_model;
use pagoda_e2e::serde_json::{self, Value};

/// Runs `pagoda` with `args` (concatenated) plus `--json` and `--plot` into temporary files, checks that it
/// succeeded and drew a PNG, and returns its JSON report.
fn run_cluster_bench(args: &[&[&str]]) -> Value {
    let out = std::env::temp_dir().join(format!("pagoda-{}-{}.json", args[0][1], std::process::id()));
    let plot = out.with_extension("png");
    let output = std::process::Command::new(BIN)
        .args(args.concat())
        .arg("--json")
        .arg(&out)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let png = std::fs::read(&plot).unwrap();
    let _ = (std::fs::remove_file(&out), std::fs::remove_file(&plot));
    assert!(png.starts_with(b"\x89PNG"), "the plot is a PNG");
    v
}

#[test]
fn bench_routing_compares_strategies_on_fresh_workers() {
    require_model().unwrap();
    let v = run_cluster_bench(&[
        &["bench", "routing", "--workers", "2", "--conversations", "4", "--turns", "2", "--system-prompts", "2"],
        &["--max-tokens", "6", "--strategies", "round_robin,kv", "--deadline-secs", "120"],
        // Workers with a 4K-token pool each (the trace's four conversations fit), paced conversation starts.
        &["--worker-kv-tokens", "4096", "--conversation-gap-ms", "200"],
    ]);
    let results = v["results"].as_array().unwrap();
    let by = |s: &str| results.iter().find(|r| r["strategy"] == s).unwrap_or_else(|| panic!("no {s}: {v:#}"));
    for s in ["round_robin", "kv"] {
        let r = by(s);
        assert_eq!(r["requests"], 8, "{r:#}");
        assert_eq!(r["failed"], 0, "{r:#}");
        assert!(r["mean_ttft_s"].as_f64().unwrap() > 0.0 && r["decision_mean_us"].as_f64().unwrap() > 0.0, "{r:#}");
        let placed: u64 = r["per_worker"].as_array().unwrap().iter().filter_map(Value::as_u64).sum();
        assert_eq!(placed, 8, "every request placed once: {r:#}");
    }
    // Round robin alternates, so it spreads each conversation's turns; KV-aware placement sends a turn where its
    // history is cached, so its hit rate cannot be lower.
    let hit = |s: &str| by(s)["prefix_hit_rate"].as_f64().unwrap();
    assert!(hit("kv") >= hit("round_robin"), "{v:#}");
    assert_eq!(by("round_robin")["per_worker"], serde_json::json!([4, 4]), "round robin alternates");
    assert_eq!(v["options"]["worker_kv_tokens"], 4096);
}

/// The multi-LoRA trace at CI size: two adapters over two workers with one adapter slot each. KV-aware placement
/// charges a worker the adapter load it would need, so each adapter is loaded once, on its own worker, and never
/// evicted; round robin alternates the workers whatever the adapter and cannot need fewer loads.
#[test]
fn bench_routing_with_lora_adapters_keeps_each_adapter_where_it_is_loaded() {
    require_model().unwrap();
    let v = run_cluster_bench(&[
        &["bench", "routing", "--workers", "2", "--conversations", "4", "--turns", "2", "--system-prompts", "2"],
        &["--max-tokens", "6", "--strategies", "round_robin,kv", "--deadline-secs", "120"],
        &["--worker-kv-tokens", "4096", "--conversation-gap-ms", "200"],
        &["--lora-adapters", "2", "--lora-rank", "8", "--max-loras", "1"],
    ]);
    let results = v["results"].as_array().unwrap();
    let by = |s: &str| results.iter().find(|r| r["strategy"] == s).unwrap_or_else(|| panic!("no {s}: {v:#}"));
    for s in ["round_robin", "kv"] {
        assert_eq!((by(s)["requests"].as_u64(), by(s)["failed"].as_u64()), (Some(8), Some(0)), "{v:#}");
        assert!(by(s)["lora_loads"].as_u64().unwrap() >= 2, "each adapter is loaded somewhere: {v:#}");
    }
    assert_eq!((by("kv")["lora_loads"].as_u64(), by("kv")["lora_evictions"].as_u64()), (Some(2), Some(0)), "{v:#}");
    assert!(by("round_robin")["lora_loads"].as_u64() >= by("kv")["lora_loads"].as_u64(), "{v:#}");
}

/// `pagoda bench disaggregation` at CI size: every deployment on fresh processes, nothing failed, every prompt of
/// the disaggregated deployments prefilled remotely and pulled whole, none in the colocated one.
#[test]
fn bench_disaggregation_compares_deployments_on_fresh_workers() {
    require_model().unwrap();
    let v = run_cluster_bench(&[
        &["bench", "disaggregation", "--requests", "4", "--rate", "2", "--min-prompt-words", "300"],
        &["--max-prompt-words", "400", "--max-tokens", "8", "--rounds", "1", "--deadline-secs", "120"],
        // A bound no queue reaches here: the conditional deployment runs, and sends every prompt away too.
        &["--remote-prefill-max-queued-tokens", "1000000"],
    ]);
    let rounds = v["rounds"].as_array().unwrap();
    let by = |d: &str| rounds.iter().find(|r| r["deployment"] == d).unwrap_or_else(|| panic!("no {d}: {v:#}"));
    for d in ["colocated", "disaggregated", "conditional"] {
        let r = by(d);
        assert_eq!((r["requests"].as_u64(), r["failed"].as_u64()), (Some(4), Some(0)), "{r:#}");
        assert!(r["p50_ttft_s"].as_f64().unwrap() > 0.0 && r["p50_itl_s"].as_f64().unwrap() > 0.0, "{r:#}");
        let remote = if d == "colocated" { serde_json::json!([]) } else { serde_json::json!([["ok", 4]]) };
        assert_eq!(r["remote_prefills"], remote, "{r:#}");
        let cached = r["cached_prompt_share"].as_f64().unwrap();
        assert!(if d == "colocated" { cached < 0.2 } else { cached > 0.9 }, "{d}: cached share {cached}");
    }
}

/// `pagoda bench engine` on a synthetic-weights model through the real binary: no GGUF is read, every report
/// says the weights are synthetic, and the decode phases count the tokens they were asked for.
#[test]
fn bench_engine_runs_a_synthetic_model_and_labels_it() {
    let out = std::env::temp_dir().join(format!("pagoda-bench-engine-synthetic-{}.json", std::process::id()));
    let output = std::process::Command::new(BIN)
        .args(["bench", "engine", "--threads", "2", "--model", "/nonexistent/model.gguf"])
        .args(["--synthetic-model", "layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1024"])
        .args(["--synthetic-weights", "q8_0", "--prefill-tokens", "96", "--max-step-tokens", "64"])
        .args(["--decode-prompt-tokens", "32", "--decode-new-tokens", "9", "--concurrency", "1,4", "--json"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    assert!(stdout.contains("SYNTHETIC WEIGHTS"), "{stdout}");
    assert_eq!(v["synthetic"], true, "{v:#}");
    assert_eq!(v["model"], "synthetic-custom-q8_0", "{v:#}");
    assert!(v["model_path"].as_str().unwrap().contains("outputs meaningless"), "{v:#}");
    assert_eq!(v["backend"], "cpu");
    assert_eq!(v["prefill"]["prompt_tokens"], 96);
    assert!(v["prefill"]["tokens_per_s"].as_f64().unwrap() > 0.0, "{v:#}");
    let decode = v["decode"].as_array().unwrap();
    assert_eq!(decode.len(), 2);
    for (d, c) in decode.iter().zip([1u64, 4]) {
        assert_eq!(d["concurrency"], c);
        // The first of each sequence's 9 tokens comes from its prefill step.
        assert_eq!(d["decode_tokens"].as_u64().unwrap(), c * 8, "{d:#}");
        assert!(d["tokens_per_s"].as_f64().unwrap() > 0.0, "{d:#}");
    }
}

/// Bad synthetic shapes and a device this binary cannot drive are refused with a message, not a panic.
#[test]
fn bench_engine_refuses_bad_shapes_and_devices_clearly() {
    for (args, want) in [
        (vec!["--synthetic-model", "llama-70x"], "expected one of smollm2-135m, llama-1b, llama-8b"),
        (vec!["--synthetic-model", "layers=2,hidden=64,heads=4,kv_heads=3,ffn=64,vocab=9"], "do not group"),
        (vec!["--synthetic-model", "llama-1b", "--synthetic-weights", "q5_k"], "expected f16, q4_1 or q8_0"),
        (vec!["--synthetic-weights", "q8_0"], "--synthetic-model"),
        (vec!["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    ] {
        let output =
            std::process::Command::new(BIN).args(["bench", "engine", "--threads", "1"]).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // A tiny synthetic model on a GPU: refused by name on a CPU-only build, or for want of a device on a CUDA
    // build without a GPU; on a machine with both it runs.
    let output = std::process::Command::new(BIN)
        .args(["bench", "engine", "--device", "cuda", "--prefill-tokens", "32", "--decode-new-tokens", "4"])
        .args(["--decode-prompt-tokens", "16", "--concurrency", "1"])
        .args(["--synthetic-model", "layers=1,hidden=128,heads=2,ffn=128,vocab=256"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    if !output.status.success() {
        assert!(
            stderr.contains("built without the CUDA backend") || stderr.contains("cannot start the CUDA backend"),
            "{stderr}"
        );
    }
}

/// `pagoda bench tiers --workload zipf --from-json` prints a saved report's tables and draws it without running
/// anything (no model needed); a file that is not such a report is refused with a clear error.
#[test]
fn bench_tiers_zipf_reprints_a_saved_report() {
    let saved = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/bench-tiers-zipf-full-offline.json");
    let plot = std::env::temp_dir().join(format!("pagoda-bench-tiers-replot-{}.png", std::process::id()));
    // Reprints a saved report and redraws its plot; returns the printed tables.
    let replot = |saved: &std::path::Path| {
        let out = std::process::Command::new(BIN)
            .args(["bench", "tiers", "--workload", "zipf", "--from-json"])
            .arg(saved)
            .arg("--plot")
            .arg(&plot)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(std::fs::read(&plot).unwrap().starts_with(b"\x89PNG"), "the redrawn plot is a PNG");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let table = replot(&saved);
    assert!(table.contains("| lru+fp8_e4m3 | 946.7 |") && table.contains("| evicpress | 84.1 |"), "{table}");
    assert!(table.contains("104, 51 ms, 17.8, 0.550"), "the pruned requests' breakdown: {table}");
    // A run under arrivals: its overloaded recompute puts the plot's TTFT axis on a log scale.
    let table = replot(&saved.with_file_name("bench-tiers-zipf-full-arrivals.json"));
    assert!(table.contains("Poisson process of 1 per second") && table.contains("is 2.83x lower"), "{table}");
    let garbage = plot.with_extension("json");
    std::fs::write(&garbage, b"{\"model\": 3}").unwrap();
    let bad = std::process::Command::new(BIN)
        .args(["bench", "tiers", "--workload", "zipf", "--from-json"])
        .arg(&garbage)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&bad.stderr);
    let _ = (std::fs::remove_file(&plot), std::fs::remove_file(&garbage));
    assert!(!bad.status.success() && stderr.contains("is not a") && !stderr.contains("panicked"), "{stderr}");
}

/// `pagoda bench tiers` (the 2K workload, at 512 tokens): a prefix pushed out of the device pool comes back from
/// host (native and in each `--onboard-codecs` codec) and from disk, is onboarded rather than recomputed, and
/// beats recomputing it; a native or unknown codec is refused clearly.
#[test]
fn bench_tiers_onboards_a_prefix_from_every_tier_and_codec() {
    let model = require_model().unwrap();
    let out = std::env::temp_dir().join(format!("pagoda-bench-tiers-2k-{}.json", std::process::id()));
    let data = out.with_extension("d");
    let run = |codecs: &str| {
        std::process::Command::new(BIN)
            .args(["bench", "tiers", "--threads", "2", "--repeats", "1", "--context-tokens", "512"])
            .args(["--host-tier-mib", "64", "--onboard-codecs", codecs, "--model"])
            .arg(&model)
            .arg("--data-dir")
            .arg(&data)
            .arg("--json")
            .arg(&out)
            .output()
            .unwrap()
    };
    let output = run("int4_kivi,int8");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = (std::fs::remove_file(&out), std::fs::remove_dir_all(&data));
    let runs = v["runs"].as_array().unwrap();
    let rows: Vec<(&str, &str)> =
        runs.iter().map(|r| (r["tier"].as_str().unwrap(), r["stored_as"].as_str().unwrap())).collect();
    assert_eq!(rows, [("host", "f16"), ("host", "int4_kivi"), ("host", "int8"), ("disk", "f16")], "{v:#}");
    for r in runs {
        // The prefix's first group may stay on the device and its last partial one is computed: the rest is
        // onboarded, and the request computes at most its last two groups.
        assert!(r["onboarded_tokens"].as_u64().unwrap() >= 512 - 64, "{r:#}");
        assert!(r["computed_tokens"].as_u64().unwrap() <= 32, "{r:#}");
        assert!(r["seconds"].as_f64().unwrap() < r["recompute_seconds"].as_f64().unwrap(), "{r:#}");
    }
    for (codecs, want) in [("f16", "native format"), ("zstd", "zstd")] {
        let bad = run(codecs);
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success() && stderr.contains(want) && !stderr.contains("panicked"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&data);
}

/// `pagoda bench kernels` through the real binary at a tiny grid: every (format, batch, context) point is
/// reported with the bytes it read, and bad grids are refused.
#[test]
fn bench_kernels_reports_every_point() {
    let out = std::env::temp_dir().join(format!("pagoda-bench-kernels-{}.json", std::process::id()));
    let output = std::process::Command::new(BIN)
        .args(["bench", "kernels", "--threads", "2", "--kv-formats", "f16,pool:int8,int4_kivi"])
        .args(["--batches", "1,3", "--contexts", "100,512", "--budget-ms", "5", "--json"])
        .arg(&out)
        .arg("--plot")
        .arg(out.with_extension("png"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let png = std::fs::read(out.with_extension("png")).unwrap();
    // The saved report, printed and drawn again without measuring (as for a run on a GPU machine).
    let replot = out.with_extension("replot.png");
    let again = std::process::Command::new(BIN)
        .args(["bench", "kernels", "--from-json"])
        .arg(&out)
        .arg("--plot")
        .arg(&replot)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&again.stdout);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert!(table.contains("| int4_kivi | 3 | 512 |") && table.contains("| f16 | 1 | 100 |"), "{table}");
    assert!(std::fs::read(&replot).unwrap().starts_with(b"\x89PNG"), "the redrawn plot is a PNG");
    let garbage = out.with_extension("garbage.json");
    std::fs::write(&garbage, b"{\"device\": 3}").unwrap();
    let bad = std::process::Command::new(BIN).args(["bench", "kernels", "--from-json"]).arg(&garbage).output().unwrap();
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && stderr.contains("report lacks device") && !stderr.contains("panicked"),
        "{stderr}"
    );
    for f in [&out, &out.with_extension("png"), &replot, &garbage] {
        let _ = std::fs::remove_file(f);
    }
    assert!(png.starts_with(b"\x89PNG"), "the plot is a PNG");
    assert!(v["copy_bytes_per_s"].as_f64().unwrap() > 1e8, "{v:#}");
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 3 * 2 * 2, "{v:#}");
    for p in points {
        assert!(p["seconds"].as_f64().unwrap() > 0.0 && p["bytes_per_s"].as_f64().unwrap() > 0.0, "{p:#}");
    }
    // 3 sequences x 3 kv-heads x 32 blocks of 16 x 64 f16 slots, K and V.
    let f16 = points.iter().find(|p| p["format"] == "f16" && p["batch"] == 3 && p["context"] == 512).unwrap();
    assert_eq!(f16["kv_bytes"], 3 * 3 * 32 * 4096, "{f16:#}");
    let int4 = points.iter().find(|p| p["format"] == "int4_kivi" && p["batch"] == 3 && p["context"] == 512).unwrap();
    assert!(int4["kv_bytes"].as_u64().unwrap() < f16["kv_bytes"].as_u64().unwrap() / 2, "{int4:#}");

    for (args, want) in [
        (vec!["--kv-formats", "int3"], "--kv-formats"),
        (vec!["--batches", "0"], "outside 1..=256"),
        (vec!["--contexts", "1000000"], "outside 1..=131072"),
        (vec!["--shape", "llama-70b"], "expected smollm2 or llama-8b"),
    ] {
        let output = std::process::Command::new(BIN).args(["bench", "kernels"]).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
