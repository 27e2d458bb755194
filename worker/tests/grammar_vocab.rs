//! The grammar guide over the real model's 49,152-token vocabulary: the token masks of a JSON grammar admit every
//! token of real JSON text as the tokenizer splits it, cached masks equal fresh ones, and (ignored, run by hand)
//! what a mask costs, fresh and from the cache.

use std::time::Instant;

use pagoda_worker::grammar_guide::{Grammar, GrammarState, MaskCache};
use pagoda_worker::json_guide::TokenTable;
use pagoda_worker::model::{Gguf, Tokenizer};

fn model_path() -> std::path::PathBuf {
    match std::env::var_os("PAGODA_MODEL") {
        Some(p) => p.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

/// The table the engine builds: special tokens have no bytes.
fn load() -> (Tokenizer, TokenTable) {
    let g = Gguf::open(model_path()).expect("open model (set PAGODA_MODEL or put it in models/)");
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let table = TokenTable::new(
        (0..tok.vocab_size() as u32)
            .map(|t| if tok.is_special(t) { &[][..] } else { tok.token_bytes(t).unwrap_or_default() }),
    );
    (tok, table)
}

/// JSON values separated by commas, with no end (the grammar `scripts/bench-json-guide.py` guides with).
const JSON_VALUES: &str = include_str!("../../scripts/grammars/json-values.gbnf");

const TEXT: &str = r#"{"city": "Paris", "country": "France", "population": 2148000, "facts": ["The Eiffel Tower is 330 m tall.", "It lies on the Seine \u00e9 \"quoted\"", {"nested": [1, 2.5, true, null]}]}, [], "done""#;

fn has(bits: &[u64], t: u32) -> bool {
    bits[t as usize / 64] >> (t % 64) & 1 == 1
}

#[test]
fn masks_over_the_real_vocabulary_admit_real_json_and_the_cache_agrees() {
    let (tok, table) = load();
    let g = Grammar::compile(JSON_VALUES).unwrap();
    let ids = tok.encode(TEXT, false);
    assert!(ids.len() > 40, "{}", ids.len());
    let mut state = g.start();
    let mut cache = MaskCache::default();
    let mut fresh = Vec::new();
    for (i, &t) in ids.iter().enumerate() {
        let cached = cache.mask(&g, &mut state, &table).to_vec();
        assert!(has(&cached, t), "token {i} ({:?}) of the text is masked out", String::from_utf8_lossy(table.bytes(t)));
        if i % 4 == 0 {
            state.token_mask(&g, &table, &mut fresh);
            assert_eq!(cached, fresh, "cached mask differs from a fresh one at token {i}");
            // Every token the mask admits feeds; a sample of those it refuses do not.
            for c in (0..table.len() as u32).step_by(97) {
                let fits = !table.bytes(c).is_empty() && state.clone().feed(&g, table.bytes(c));
                assert_eq!(has(&fresh, c), fits, "token {c} at {i}");
            }
        }
        assert!(state.feed(&g, table.bytes(t)));
    }
    assert!(state.may_end());
}

/// What one mask costs on the real vocabulary along the tokens of [`TEXT`] (and of a sentence, for the regex's
/// language), three ways in one run: every token fed on its own, [`GrammarState::token_mask`], and through a
/// [`MaskCache`]. Medians and means in ms per step:
/// `cargo test --release -p pagoda-worker --test grammar_vocab mask_cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn mask_cost() {
    let (tok, table) = load();
    let sentence = "The Eiffel Tower is 330 m tall, and it lies on the Seine; people visit it.";
    let cases = [
        ("JSON values", JSON_VALUES, tok.encode(TEXT, false)),
        ("the regex's language", "root ::= [A-Za-z0-9 ,.;:'\\n-]+", tok.encode(sentence, false)),
    ];
    println!("| grammar | round | steps | each token fed | token_mask | through the cache | cache hits |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, text, ids) in cases {
        let g = Grammar::compile(text).unwrap();
        for round in 1..=3 {
            let mut state: GrammarState = g.start();
            let mut cache = MaskCache::default();
            let (mut naive, mut fresh) = (vec![0u64; table.len().div_ceil(64)], Vec::new());
            let (mut naive_s, mut fresh_s, mut cached_s, mut hits) = (Vec::new(), Vec::new(), Vec::new(), 0);
            for &t in &ids {
                let t0 = Instant::now();
                naive.fill(0);
                for c in 0..table.len() as u32 {
                    let b = table.bytes(c);
                    if !b.is_empty() && state.fits(&g, b) {
                        naive[c as usize / 64] |= 1 << (c % 64);
                    }
                }
                naive_s.push(t0.elapsed().as_secs_f64());
                let t0 = Instant::now();
                state.token_mask(&g, &table, &mut fresh);
                fresh_s.push(t0.elapsed().as_secs_f64());
                let t0 = Instant::now();
                let cached = cache.mask(&g, &mut state, &table).to_vec();
                let dt = t0.elapsed().as_secs_f64();
                // A hit is a key comparison, not a mask.
                hits += usize::from(dt < fresh_s[fresh_s.len() - 1] / 4.0);
                cached_s.push(dt);
                assert_eq!((&cached, &fresh), (&naive, &naive));
                assert!(state.feed(&g, table.bytes(t)));
            }
            let stats = |v: &[f64]| {
                let mut sorted = v.to_vec();
                sorted.sort_by(f64::total_cmp);
                let mean = v.iter().sum::<f64>() / v.len() as f64;
                format!("{:.3} / {:.3}", sorted[v.len() / 2] * 1e3, mean * 1e3)
            };
            println!(
                "| {name} | {round} | {} | {} | {} | {} | {hits} |",
                ids.len(),
                stats(&naive_s),
                stats(&fresh_s),
                stats(&cached_s)
            );
        }
        // What the answer's chart holds, committed token by token as the sampler does, and not.
        let (mut kept, mut whole) = (g.start(), g.start());
        for &t in &ids {
            assert!(kept.feed(&g, table.bytes(t)) && whole.feed(&g, table.bytes(t)));
            kept.commit(&g);
        }
        let per_byte = |s: &GrammarState| s.chart_items() as f64 / s.len() as f64;
        println!("{name}: {:.1} items per byte committed, {:.1} not", per_byte(&kept), per_byte(&whole));
    }
}
