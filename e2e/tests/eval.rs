//! `pagoda eval` at CI size through the real binary and the real model: every eviction policy runs on a
//! synthetic task and on teacher-forced prose, and every cell sits next to the full cache on the same items.

use std::process::Command;

use pagoda_e2e::serde_json::{self, Value};

const BIN: &str = env!("CARGO_BIN_EXE_pagoda");

#[test]
fn eval_reports_every_policy_next_to_full_cache() {
    let model = pagoda_e2e::require_model().unwrap();
    let out = std::env::temp_dir().join(format!("pagoda-eval-{}.json", std::process::id()));
    let status = Command::new(BIN)
        .args(["eval", "--model"])
        .arg(&model)
        .args([
            "--contexts",
            "512",
            "--tasks",
            "passkey",
            "--items",
            "1",
            "--policies",
            "all",
            "--budgets",
            "64,128",
            "--prose-docs",
            "1",
            "--prose-context",
            "512",
            "--prose-continuation",
            "24",
            "--pool-gib",
            "0.5",
            "--json",
        ])
        .arg(&out)
        .status()
        .expect("pagoda eval runs");
    assert!(status.success(), "pagoda eval failed: {status}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    merging_pools_items_and_refuses_a_report_twice(&model, &out, &report);
    let _ = std::fs::remove_file(&out);
    let cells = report["cells"].as_array().unwrap();
    let policies = ["streaming", "knorm", "keydiff", "paged_eviction", "sage", "snapkv", "h2o", "kv_compress"];
    for task in ["passkey", "prose"] {
        let full = cells.iter().find(|c| c["task"] == task && c["policy"] == "full").expect("full-cache cell");
        if task == "prose" {
            assert_eq!(full["score"], 1.0, "the full cache agrees with itself");
        }
        for p in policies {
            for b in [64, 128] {
                let c = cells
                    .iter()
                    .find(|c| c["task"] == task && c["policy"] == p && c["budget"] == b)
                    .unwrap_or_else(|| panic!("missing cell {task}/{p}/{b}"));
                let score = c["score"].as_f64().unwrap();
                assert!((0.0..=1.0).contains(&score), "{c}");
                assert_eq!(c["full_score"], full["score"], "{c}");
                if task == "prose" {
                    assert!(c["kl"].as_f64().unwrap() >= 0.0, "{c}");
                }
            }
        }
    }
    // The language-modelling score on the same prose: the full cache has a real accuracy of its own (the model
    // predicts some of Alice's next tokens, not all), and every policy cell sits next to it.
    let lm = |c: &&Value| c["task"] == "prose_next_token";
    let full = cells.iter().filter(lm).find(|c| c["policy"] == "full").expect("full-cache next-token cell");
    let full_accuracy = full["score"].as_f64().unwrap();
    assert!(full_accuracy > 0.0 && full_accuracy < 1.0, "{full}");
    assert!(full["nll"].as_f64().unwrap() > 0.0, "{full}");
    for p in policies {
        for b in [64, 128] {
            let c = cells
                .iter()
                .filter(lm)
                .find(|c| c["policy"] == p && c["budget"] == b)
                .unwrap_or_else(|| panic!("missing cell prose_next_token/{p}/{b}"));
            assert!((0.0..=1.0).contains(&c["score"].as_f64().unwrap()), "{c}");
            assert_eq!(c["full_score"], full["score"], "{c}");
            assert!(c["nll"].as_f64().unwrap() > 0.0, "{c}");
        }
    }
    // Evicting down to 64 of ~512 tokens changes the next-token distributions: some KL is measured.
    let kl_sum: f64 = cells.iter().filter(|c| c["task"] == "prose").filter_map(|c| c["kl"].as_f64()).sum();
    assert!(kl_sum > 0.01, "{kl_sum}");
}

/// `--from-json` with two reports: a second run on another item (`--seed`) pooled with `first`, each merged cell
/// over both items and next to the full cache on both; the same report twice is an error, not a doubled count.
fn merging_pools_items_and_refuses_a_report_twice(model: &std::path::Path, first: &std::path::Path, report: &Value) {
    let second = first.with_extension("second.json");
    let merged = first.with_extension("merged.json");
    let status = Command::new(BIN)
        .args(["eval", "--model"])
        .arg(model)
        .args(["--contexts", "512", "--tasks", "passkey", "--items", "1", "--seed", "8", "--policies", "snapkv"])
        .args(["--budgets", "64", "--prose-docs", "0", "--pool-gib", "0.5", "--json"])
        .arg(&second)
        .status()
        .expect("pagoda eval runs");
    assert!(status.success(), "pagoda eval failed: {status}");
    let sources = format!("{},{}", first.display(), second.display());
    let plot = first.with_extension("merged.png");
    let out = Command::new(BIN)
        .args(["eval", "--from-json", &sources, "--json"])
        .arg(&merged)
        .arg("--plot")
        .arg(&plot)
        .output()
        .expect("pagoda eval --from-json runs");
    assert!(out.status.success(), "merging failed: {}", String::from_utf8_lossy(&out.stderr));
    // The table names its item count and gives each score its standard error; the plot is drawn.
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("**passkey** — score ± standard error; 2 items"), "{table}");
    assert!(table.contains("| snapkv |") && table.contains(" ± "), "{table}");
    assert!(std::fs::read(&plot).unwrap().starts_with(b"\x89PNG"), "the merged plot is a PNG");
    let read = |p: &std::path::Path| -> Value { serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    let (two, pooled) = (read(&second), read(&merged));
    let cell = |r: &Value, policy: &str| -> Value {
        let cells = r["cells"].as_array().unwrap();
        cells
            .iter()
            .find(|c| {
                c["task"] == "passkey" && c["policy"] == policy && c["budget"] == if policy == "full" { 0 } else { 64 }
            })
            .unwrap()
            .clone()
    };
    let num = |v: &Value| v.as_f64().unwrap();
    let m = cell(&pooled, "snapkv");
    assert_eq!(m["items"], 2, "{m}");
    let mean = |k: &str| (num(&cell(report, "snapkv")[k]) + num(&cell(&two, "snapkv")[k])) / 2.0;
    assert!((num(&m["score"]) - mean("score")).abs() < 1e-9, "{m}");
    assert!((num(&m["full_score"]) - mean("full_score")).abs() < 1e-9, "{m}");
    // Two items: the standard error of their mean is half their difference.
    let half_diff = (num(&cell(report, "snapkv")["score"]) - num(&cell(&two, "snapkv")["score"])).abs() / 2.0;
    assert!((num(&m["score_se"]) - half_diff).abs() < 1e-9, "{m}");
    // Cells the second run did not have keep the first's items only.
    assert_eq!(cell(&pooled, "h2o")["items"], 1);
    let twice = format!("{},{}", first.display(), first.display());
    let out = Command::new(BIN).args(["eval", "--from-json", &twice]).output().expect("pagoda eval --from-json runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("more than one report"), "{err}");
    let _ = (std::fs::remove_file(&second), std::fs::remove_file(&merged), std::fs::remove_file(&plot));
}

/// `pagoda eval --codecs` with `--bf16-matmuls` through the real binary: an f32 lane (encode/decode as identity)
/// and an f32 pool lane, batched with an f16 and an int8 pool lane, must reproduce the full cache exactly, which
/// holds only if the bf16 matmuls (AMX tiles or AVX-512 BF16 dot products) give each row the same result whatever
/// shares its call; the f16 and int8 lanes must differ a little. On a CPU with neither, the flag is refused with an
/// error naming it.
#[test]
fn codec_eval_on_bf16_matmuls_is_exact_for_the_identity_codec() {
    let model = pagoda_e2e::require_model().unwrap();
    let out = std::env::temp_dir().join(format!("pagoda-eval-codecs-{}.json", std::process::id()));
    let run = Command::new(BIN)
        .args(["eval", "--model"])
        .arg(&model)
        .args([
            "--codecs",
            "f32,f16,pool:f32,pool:int8",
            "--bf16-matmuls",
            "--tasks",
            "passkey",
            "--contexts",
            "512",
            "--items",
            "1",
            "--codec-tokens",
            "16",
            "--prose-docs",
            "0",
            "--threads",
            "2",
            "--json",
        ])
        .arg(&out)
        .output()
        .expect("pagoda eval --codecs runs");
    let status = run.status;
    if !pagoda_kernels::cpu::bf16_matmuls_available() {
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!status.success() && stderr.contains("--bf16-matmuls"), "{status}: {stderr}");
        return;
    }
    assert!(status.success(), "pagoda eval --codecs failed: {status}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    let cell = |codec: &str| {
        report["cells"].as_array().unwrap().iter().find(|c| c["codec"] == codec).cloned().expect("codec cell")
    };
    let (f32_lane, f16_lane) = (cell("f32"), cell("f16"));
    assert!(f32_lane["positions"].as_u64().unwrap() > 0, "{f32_lane}");
    assert_eq!(f32_lane["agreement"], 1.0, "{f32_lane}");
    assert_eq!(f32_lane["kl"], 0.0, "{f32_lane}");
    let kl = f16_lane["kl"].as_f64().unwrap();
    assert!(kl > 0.0 && kl < 0.05, "{f16_lane}");
    // The device pools' lanes: an f32 pool is the identity too; an int8 pool rounds every slot.
    let (f32_pool, int8_pool) = (cell("pool:f32"), cell("pool:int8"));
    assert_eq!(f32_pool["agreement"], 1.0, "{f32_pool}");
    assert_eq!(f32_pool["kl"], 0.0, "{f32_pool}");
    let kl = int8_pool["kl"].as_f64().unwrap();
    assert!(kl > 0.0 && kl < 0.05, "{int8_pool}");
}
