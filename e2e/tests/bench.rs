//! The cluster benchmarks as commands through the real binary, at a size CI can afford: `pagoda bench routing`
//! starts its own worker and router processes per strategy and must report every strategy with nothing failed.

mod common;

use common::BIN;
use pagoda_e2e::require_model;
use pagoda_e2e::serde_json::{self, Value};

#[test]
fn bench_routing_compares_strategies_on_fresh_workers() {
    require_model().unwrap();
    let out = std::env::temp_dir().join(format!("pagoda-bench-routing-{}.json", std::process::id()));
    let plot = out.with_extension("png");
    let output = std::process::Command::new(BIN)
        .args(["bench", "routing", "--workers", "2", "--conversations", "4", "--turns", "2", "--system-prompts", "2"])
        .args(["--max-tokens", "6", "--strategies", "round_robin,kv", "--deadline-secs", "120"])
        // Workers with a 4K-token pool each (the trace's four conversations fit), paced conversation starts.
        .args(["--worker-kv-tokens", "4096", "--conversation-gap-ms", "200", "--json"])
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
