//! The llama forward pass on the real SmolLM2-135M-Instruct Q4_1 model, against the independent numpy float32
//! reference in `fixtures/llama_reference.json` (written by `scripts/reference/llama_reference.py`), plus
//! self-consistency: chunked prefill vs one-shot, batched vs one-by-one, and input validation.

use pagoda_kernels::{Backend, CpuBackend, KvDtype, KvStorage};
use pagoda_worker::model::{
    ChatMessage, ChatTemplate, ForwardSeq, Gguf, LlamaModel, LogitsWanted, ModelError, Scratch, Tokenizer,
};
use serde_json::Value;

const BLOCK: usize = 16;

fn model_path() -> std::path::PathBuf {
    match std::env::var_os("PAGODA_MODEL") {
        Some(p) => p.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

fn fixture() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("read fixture")).expect("parse fixture")
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn backend() -> CpuBackend {
    CpuBackend::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
}

struct Setup {
    gguf: Gguf,
    model: LlamaModel,
}

fn setup() -> Setup {
    let gguf = Gguf::open(model_path()).expect("open model (set PAGODA_MODEL or put it in models/)");
    let model = LlamaModel::load(&gguf).expect("load model");
    Setup { gguf, model }
}

/// One sequence with contiguous blocks: table t of sequence slot `slot` owns blocks
/// `[(slot * n_tables + t) * per_table, ... + per_table)`.
struct Seq {
    tables: Vec<Vec<u32>>,
    lens: Vec<usize>,
    pos: u32,
}

impl Seq {
    fn new(model: &LlamaModel, slot: usize, max_tokens: usize) -> Seq {
        let n_tables = model.config().n_kv_tables();
        let per_table = max_tokens.div_ceil(BLOCK);
        let tables = (0..n_tables)
            .map(|t| {
                let base = (slot * n_tables + t) * per_table;
                (base..base + per_table).map(|b| b as u32).collect()
            })
            .collect();
        Seq { tables, lens: vec![0; n_tables], pos: 0 }
    }

    fn fwd<'a>(&'a self, tokens: &'a [u32], logits: LogitsWanted) -> ForwardSeq<'a> {
        ForwardSeq {
            tokens,
            start_pos: self.pos,
            tables: &self.tables,
            prior_lens: &self.lens,
            logits,
            capture_q: 0,
            attention_sums: None,
            lora: None,
        }
    }

    fn advance(&mut self, n: usize) {
        for l in &mut self.lens {
            *l += n;
        }
        self.pos += n as u32;
    }
}

fn kv_for(model: &LlamaModel, n_seqs: usize, max_tokens: usize) -> KvStorage {
    kv_of(model, n_seqs, max_tokens, KvDtype::F32)
}

fn kv_of(model: &LlamaModel, n_seqs: usize, max_tokens: usize, dtype: KvDtype) -> KvStorage {
    let blocks = n_seqs * model.config().n_kv_tables() * max_tokens.div_ceil(BLOCK);
    KvStorage::with_dtype(blocks, BLOCK, model.config().head_dim, dtype)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Prefill `prompt` in one shot then greedy-decode `n` tokens; returns (first-step logits, greedy tokens).
fn greedy(model: &LlamaModel, be: &dyn Backend, prompt: &[u32], n: usize, dtype: KvDtype) -> (Vec<f32>, Vec<u32>, f64) {
    let mut kv = kv_of(model, 1, prompt.len() + n, dtype);
    let mut seq = Seq::new(model, 0, prompt.len() + n);
    let mut scratch = Scratch::new();
    let mut logits = Vec::new();
    model.forward(be, &mut kv, &[seq.fwd(prompt, LogitsWanted::Last)], &mut scratch, &mut logits).unwrap();
    seq.advance(prompt.len());
    let first = logits.clone();
    let mut tokens = vec![argmax(&logits)];
    let t0 = std::time::Instant::now();
    while tokens.len() < n {
        let last = [*tokens.last().unwrap()];
        logits.clear();
        model.forward(be, &mut kv, &[seq.fwd(&last, LogitsWanted::Last)], &mut scratch, &mut logits).unwrap();
        seq.advance(1);
        tokens.push(argmax(&logits));
    }
    let tok_per_s = (n - 1) as f64 / t0.elapsed().as_secs_f64();
    (first, tokens, tok_per_s)
}

/// Greedy tokens and first-step logits of `model` for every fixture prompt. Returns per prompt:
/// (max |logit diff| over the reference's top 20, tokens, decode tok/s).
fn run_prompts(
    model: &LlamaModel,
    be: &dyn Backend,
    fx: &Value,
    check_prompt_text: bool,
    dtype: KvDtype,
) -> Vec<(f32, Vec<u32>, f64)> {
    let s = if check_prompt_text { Some(setup()) } else { None };
    let text = s.as_ref().map(|s| (Tokenizer::from_gguf(&s.gguf).unwrap(), ChatTemplate::from_gguf(&s.gguf).unwrap()));
    let n_greedy = fx["n_greedy"].as_u64().unwrap() as usize;
    let prompts = fx["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 3);
    prompts
        .iter()
        .enumerate()
        .map(|(pi, p)| {
            let prompt = u32s(&p["prompt_ids"]);
            if let Some((tok, tmpl)) = &text {
                // The whole text pipeline: messages -> chat template -> tokenizer gives the reference prompt ids.
                let messages: Vec<ChatMessage> = serde_json::from_value(p["messages"].clone()).unwrap();
                assert_eq!(tok.encode(&tmpl.render(&messages, true).unwrap(), false), prompt, "prompt {pi} ids");
            }
            let (first, tokens, tps) = greedy(model, be, &prompt, n_greedy, dtype);
            let ids = u32s(&p["first_step_top_ids"]);
            let vals = f32s(&p["first_step_top_logits"]);
            let diff = ids.iter().zip(&vals).map(|(&i, &v)| (first[i as usize] - v).abs()).fold(0.0, f32::max);
            (diff, tokens, tps)
        })
        .collect()
}

/// The model with every weight dequantised to F32 (no activation rounding in the matmuls).
fn f32_weight_model() -> LlamaModel {
    setup().model.to_f32_weights().unwrap()
}

/// How many greedy tokens of prompt `pi` agree with the reference `p`; panics if they part where the reference is
/// not a near-tie (its top-2 gap at that step is `tol` or more).
fn greedy_agreement(pi: usize, tokens: &[u32], p: &Value, tol: f32) -> usize {
    let want = u32s(&p["greedy"]);
    let gaps = f32s(&p["top2_gaps"]);
    let agree = tokens.iter().zip(&want).take_while(|(a, b)| a == b).count();
    if agree < want.len() {
        assert!(
            gaps[agree] < tol,
            "prompt {pi}: greedy diverges at step {agree} where the reference is not a near-tie (gap {}, bound {tol})\n want {want:?}\n got  {tokens:?}",
            gaps[agree]
        );
    }
    agree
}

/// With every weight dequantised to F32, matmuls do not quantise activations, so the forward pass itself (norms,
/// RoPE convention, GQA paged attention, tied LM head, KV through block tables) must reproduce the float32
/// reference: all 32 greedy tokens of every prompt exactly, and logits to float rounding.
#[test]
fn f32_weights_match_reference_exactly() {
    let m = f32_weight_model();
    let be = backend();
    let fx = fixture();
    let results = run_prompts(&m, &be, &fx, true, KvDtype::F32);
    let mut worst = 0.0f32;
    for (pi, ((diff, tokens, _), p)) in results.iter().zip(fx["prompts"].as_array().unwrap()).enumerate() {
        println!("F32 weights, prompt {pi}: first-step top-20 max |diff| {diff:.6}");
        worst = worst.max(*diff);
        assert_eq!(tokens, &u32s(&p["greedy"]), "prompt {pi}: greedy tokens with F32 weights");
    }
    println!("F32 weights: max |logit diff| {worst:.6}");
    assert!(worst < 1e-3, "F32-weight logits differ from the float32 reference by {worst}");
}

/// The serving default caches K and V in f16. With F32 weights (no activation rounding), that rounding alone moves
/// first-step logits by at most F16_KV_TOL, and greedy decoding follows the float32 reference except at a near-tie
/// of the reference (top-2 gap below the same bound).
const F16_KV_TOL: f32 = 0.05;

#[test]
fn f16_cache_tracks_reference() {
    let m = f32_weight_model();
    let be = backend();
    let fx = fixture();
    let results = run_prompts(&m, &be, &fx, false, KvDtype::F16);
    let mut worst = 0.0f32;
    for (pi, ((diff, tokens, _), p)) in results.iter().zip(fx["prompts"].as_array().unwrap()).enumerate() {
        let agree = greedy_agreement(pi, tokens, p, F16_KV_TOL);
        println!(
            "f16 cache, prompt {pi}: first-step top-20 max |diff| {diff:.5}; greedy agrees for {agree}/{}",
            tokens.len()
        );
        worst = worst.max(*diff);
    }
    assert!(worst < F16_KV_TOL, "f16-cache logits differ from the float32 reference by {worst}");
}

/// Logit tolerance for the quantised path. Q4_1/Q8_0 matmuls round their input activations to 8 bits per block
/// of 32 (as llama.cpp does), and this model is very sensitive to that rounding: in the numpy reference, the
/// 8-bit-activation forward moves first-step logits by up to 0.3 from float32, and perturbing its inputs by one
/// part in 10^6 (which flips a few roundings) moves them by another 0.35 and swaps the top two tokens of prompt 0.
/// Measured here: up to ~0.73. So the bound is 1.0, and a greedy divergence is accepted only at a near-tie, where
/// the reference's own top-2 gap is below the same bound.
const QUANT_TOL: f32 = 1.0;

/// The production path (Q4_1 weights, Q8_0 head, 8-bit activations) against the float32 reference.
#[test]
fn quantised_model_tracks_reference() {
    let s = setup();
    let be = backend();
    let fx = fixture();
    let results = run_prompts(&s.model, &be, &fx, true, KvDtype::F32);
    let mut worst = 0.0f32;
    let mut report = Vec::new();
    for (pi, ((diff, tokens, tps), p)) in results.iter().zip(fx["prompts"].as_array().unwrap()).enumerate() {
        worst = worst.max(*diff);
        let want = u32s(&p["greedy"]);
        let gaps = f32s(&p["top2_gaps"]);
        let agree = greedy_agreement(pi, tokens, p, QUANT_TOL);
        report.push(format!(
            "prompt {pi}: first-step top-20 max |diff| {diff:.4}; greedy agrees for {agree}/{} tokens{}; decode {tps:.1} tok/s",
            want.len(),
            if agree < want.len() { format!(" (reference top-2 gap at the divergence: {:.4})", gaps[agree]) } else { String::new() }
        ));
        // Teacher-forced: feed the reference tokens; every step must pick the reference token unless that step
        // is a near-tie in the reference.
        let prompt = u32s(&p["prompt_ids"]);
        let mut kv = kv_for(&s.model, 1, prompt.len() + want.len());
        let mut seq = Seq::new(&s.model, 0, prompt.len() + want.len());
        let mut scratch = Scratch::new();
        let mut logits = Vec::new();
        s.model.forward(&be, &mut kv, &[seq.fwd(&prompt, LogitsWanted::Last)], &mut scratch, &mut logits).unwrap();
        seq.advance(prompt.len());
        for step in 0..want.len() {
            let got = argmax(&logits);
            assert!(
                got == want[step] || gaps[step] < QUANT_TOL,
                "prompt {pi}, teacher-forced step {step}: got {got}, want {} (reference gap {})",
                want[step],
                gaps[step]
            );
            if step + 1 < want.len() {
                logits.clear();
                let t = [want[step]];
                s.model.forward(&be, &mut kv, &[seq.fwd(&t, LogitsWanted::Last)], &mut scratch, &mut logits).unwrap();
                seq.advance(1);
            }
        }
    }
    println!("{}\nquantised: max |logit diff| over prompts {worst:.4} (tolerance {QUANT_TOL})", report.join("\n"));
    assert!(worst < QUANT_TOL, "first-step logits differ from the reference by {worst}");
}

/// The bf16 path (`--bf16-matmuls`: every matmul in bf16, on AMX tiles or AVX-512 BF16 dot products, not over Q8_1
/// activations) against the same float32 reference and the same bounds as the default path. Its first-step logits
/// must also sit at least as close to the reference as the Q8_1 path's: bf16 keeps each activation within 2⁻⁹ of
/// its value, Q8_1 within 1/254 of its block's largest.
#[test]
fn bf16_path_tracks_reference_at_least_as_closely() {
    let be = backend().with_bf16_matmuls(true);
    if !be.bf16_matmuls() {
        eprintln!("skipped: neither AMX bf16 tiles nor AVX-512 BF16 on this CPU");
        return;
    }
    let s = setup();
    let fx = fixture();
    let prompts = fx["prompts"].as_array().unwrap();
    let tiles = run_prompts(&s.model, &be, &fx, false, KvDtype::F32);
    let q8 = run_prompts(&s.model, &backend(), &fx, false, KvDtype::F32);
    let (mut worst_tiles, mut worst_q8) = (0.0f32, 0.0f32);
    for (pi, p) in prompts.iter().enumerate() {
        let agree = greedy_agreement(pi, &tiles[pi].1, p, QUANT_TOL);
        println!(
            "prompt {pi} ({} tokens): first-step top-20 max |diff| bf16 {:.4}, Q8_1 {:.4}; bf16 greedy agrees for {agree}/{}",
            p["prompt_ids"].as_array().unwrap().len(),
            tiles[pi].0,
            q8[pi].0,
            tiles[pi].1.len()
        );
        worst_tiles = worst_tiles.max(tiles[pi].0);
        worst_q8 = worst_q8.max(q8[pi].0);
    }
    assert!(worst_tiles < QUANT_TOL, "bf16 first-step logits differ from the reference by {worst_tiles}");
    assert!(
        worst_tiles <= worst_q8,
        "bf16 logits ({worst_tiles}) are further from the float32 reference than Q8_1's ({worst_q8})"
    );
}

#[test]
fn chunked_prefill_then_decode_matches_one_shot() {
    let s = setup();
    let be = backend();
    let fx = fixture();
    let prompt = u32s(&fx["prompts"][2]["prompt_ids"]);
    let n_decode = 4;
    let (one_shot, tokens, _) = greedy(&s.model, &be, &prompt, n_decode, KvDtype::F32);

    let max = prompt.len() + n_decode;
    let mut kv = kv_for(&s.model, 1, max);
    let mut seq = Seq::new(&s.model, 0, max);
    let mut scratch = Scratch::new();
    let mut logits = Vec::new();
    // Chunks of uneven sizes that straddle block boundaries.
    let mut chunks = vec![5usize, 16, 11];
    chunks.push(prompt.len() - chunks.iter().sum::<usize>());
    let mut at = 0;
    for (i, &c) in chunks.iter().enumerate() {
        let want = if i + 1 == chunks.len() { LogitsWanted::Last } else { LogitsWanted::None };
        let before = logits.len();
        s.model.forward(&be, &mut kv, &[seq.fwd(&prompt[at..at + c], want)], &mut scratch, &mut logits).unwrap();
        if want == LogitsWanted::None {
            assert_eq!(logits.len(), before, "LogitsWanted::None appended logits");
        }
        seq.advance(c);
        at += c;
    }
    let d = max_abs_diff(&logits, &one_shot);
    println!("chunked vs one-shot prefill: max |diff| {d:.6}");
    assert!(d < 1e-3, "chunked prefill logits differ by {d}");
    // Decode on top of the chunked cache follows the same greedy path.
    let mut got = vec![argmax(&logits)];
    while got.len() < n_decode {
        let last = [*got.last().unwrap()];
        logits.clear();
        s.model.forward(&be, &mut kv, &[seq.fwd(&last, LogitsWanted::Last)], &mut scratch, &mut logits).unwrap();
        seq.advance(1);
        got.push(argmax(&logits));
    }
    assert_eq!(got, tokens);

    // LogitsWanted::All returns every row, and its last row is the Last row.
    let mut kv = kv_for(&s.model, 1, prompt.len());
    let seq = Seq::new(&s.model, 0, prompt.len());
    let mut all = Vec::new();
    s.model.forward(&be, &mut kv, &[seq.fwd(&prompt, LogitsWanted::All)], &mut scratch, &mut all).unwrap();
    let v = s.model.vocab_size();
    assert_eq!(all.len(), prompt.len() * v);
    let d = max_abs_diff(&all[(prompt.len() - 1) * v..], &one_shot);
    assert!(d < 1e-3, "All's last row differs from Last by {d}");
}

#[test]
fn batch_of_three_matches_one_by_one() {
    let s = setup();
    let be = backend();
    let fx = fixture();
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| u32s(&fx["prompts"][i]["prompt_ids"])).collect();
    let n_decode = 3;
    let singles: Vec<(Vec<f32>, Vec<u32>)> = prompts
        .iter()
        .map(|p| {
            let (l, t, _) = greedy(&s.model, &be, p, n_decode, KvDtype::F32);
            (l, t)
        })
        .collect();

    let max = prompts.iter().map(Vec::len).max().unwrap() + n_decode;
    let mut kv = kv_for(&s.model, 3, max);
    let mut seqs: Vec<Seq> = (0..3).map(|i| Seq::new(&s.model, i, max)).collect();
    let mut scratch = Scratch::new();
    let v = s.model.vocab_size();

    // Step 1: sequence 0 and 2 prefill whole; sequence 1 prefills a first chunk without logits.
    let split = 10;
    let mut logits = Vec::new();
    {
        let batch = [
            seqs[0].fwd(&prompts[0], LogitsWanted::Last),
            seqs[1].fwd(&prompts[1][..split], LogitsWanted::None),
            seqs[2].fwd(&prompts[2], LogitsWanted::Last),
        ];
        s.model.forward(&be, &mut kv, &batch, &mut scratch, &mut logits).unwrap();
    }
    assert_eq!(logits.len(), 2 * v);
    seqs[0].advance(prompts[0].len());
    seqs[1].advance(split);
    seqs[2].advance(prompts[2].len());
    let mut worst = max_abs_diff(&logits[..v], &singles[0].0).max(max_abs_diff(&logits[v..], &singles[2].0));
    let mut next = [argmax(&logits[..v]), 0, argmax(&logits[v..])];

    // Step 2: sequences 0 and 2 decode while sequence 1 finishes its prefill.
    logits.clear();
    {
        let t0 = [next[0]];
        let t2 = [next[2]];
        let batch = [
            seqs[0].fwd(&t0, LogitsWanted::Last),
            seqs[1].fwd(&prompts[1][split..], LogitsWanted::Last),
            seqs[2].fwd(&t2, LogitsWanted::Last),
        ];
        s.model.forward(&be, &mut kv, &batch, &mut scratch, &mut logits).unwrap();
    }
    seqs[0].advance(1);
    seqs[1].advance(prompts[1].len() - split);
    seqs[2].advance(1);
    worst = worst.max(max_abs_diff(&logits[v..2 * v], &singles[1].0));
    let mut got: Vec<Vec<u32>> = vec![vec![next[0]], vec![], vec![next[2]]];
    for i in 0..3 {
        next[i] = argmax(&logits[i * v..(i + 1) * v]);
        got[i].push(next[i]);
    }
    // Remaining steps: all three decode together.
    while got.iter().any(|g| g.len() < n_decode) {
        logits.clear();
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let batch: Vec<ForwardSeq<'_>> = (0..3).map(|i| seqs[i].fwd(&toks[i], LogitsWanted::Last)).collect();
        s.model.forward(&be, &mut kv, &batch, &mut scratch, &mut logits).unwrap();
        for (i, seq) in seqs.iter_mut().enumerate() {
            seq.advance(1);
            next[i] = argmax(&logits[i * v..(i + 1) * v]);
            got[i].push(next[i]);
        }
    }
    println!("batched vs single first-step logits: max |diff| {worst:.6}");
    assert!(worst < 1e-3, "batched logits differ by {worst}");
    for i in 0..3 {
        assert_eq!(got[i][..n_decode], singles[i].1[..], "sequence {i} greedy tokens");
    }
}

#[test]
fn forward_rejects_invalid_input() {
    let s = setup();
    let be = backend();
    let m = &s.model;
    let mut kv = kv_for(m, 1, 32);
    let seq = Seq::new(m, 0, 32);
    let mut scratch = Scratch::new();
    let mut out = Vec::new();
    let invalid = |r: Result<(), ModelError>| matches!(r, Err(ModelError::InvalidInput(_)));

    let bad_token = [m.vocab_size() as u32];
    assert!(invalid(m.forward(&be, &mut kv, &[seq.fwd(&bad_token, LogitsWanted::Last)], &mut scratch, &mut out)));
    assert!(invalid(m.forward(&be, &mut kv, &[seq.fwd(&[], LogitsWanted::Last)], &mut scratch, &mut out)));
    let long = vec![1u32; 33];
    assert!(invalid(m.forward(&be, &mut kv, &[seq.fwd(&long, LogitsWanted::Last)], &mut scratch, &mut out)));

    let mut few = seq.fwd(&[1, 2], LogitsWanted::Last);
    few.tables = &seq.tables[..5];
    assert!(invalid(m.forward(&be, &mut kv, &[few], &mut scratch, &mut out)));

    let mut far_tables = seq.tables.clone();
    far_tables[7][0] = kv.num_blocks() as u32;
    let mut far = seq.fwd(&[1, 2], LogitsWanted::Last);
    far.tables = &far_tables;
    assert!(invalid(m.forward(&be, &mut kv, &[far], &mut scratch, &mut out)));

    let mut beyond = seq.fwd(&[1, 2], LogitsWanted::Last);
    beyond.start_pos = m.config().ctx_len as u32 - 1;
    assert!(invalid(m.forward(&be, &mut kv, &[beyond], &mut scratch, &mut out)));

    let mut wrong_dim = KvStorage::new(kv.num_blocks(), BLOCK, 32);
    assert!(invalid(m.forward(&be, &mut wrong_dim, &[seq.fwd(&[1], LogitsWanted::Last)], &mut scratch, &mut out)));

    assert!(out.is_empty(), "a rejected step appended logits");
    // An empty batch is a no-op.
    m.forward(&be, &mut kv, &[], &mut scratch, &mut out).unwrap();
    assert!(out.is_empty());
}

#[test]
fn config_from_metadata() {
    let s = setup();
    let c = s.model.config();
    assert_eq!(
        (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden, c.ffn, c.vocab, c.ctx_len),
        (30, 9, 3, 64, 576, 1536, 49152, 8192)
    );
    assert_eq!(c.rope_theta, 100000.0);
    assert!((c.rms_eps - 1e-5).abs() < 1e-9);
    assert!(s.model.tied_embeddings());
}
