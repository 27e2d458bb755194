//! `pagoda eval --codecs`: next-token agreement of the real model when its KV cache goes through a codec, against
//! the full f32 cache on the same items.
//!
//! What it simulates: the device arena stays f32 in this step. Every time a block fills, it is encoded with the
//! codec and decoded back in place (quantise → dequantise into the f32 arena), which is numerically what the
//! dequantise-on-load kernel computes over the encoded block (`tests/codecs.rs` in the kernels crate checks that
//! equivalence). The block being filled stays f32 until it is full, like KIVI's full-precision residual. A
//! `pool:DTYPE` lane ([`LaneFormat::Pool`]) is instead the device pool of that dtype (`--kv-dtype`): every slot,
//! the block being filled included, is rounded by the pool's own rule as it is written (an 8-bit dtype's per-slot
//! scale, the rotated fp8's rotation), by writing it into a one-block pool of the dtype and reading it back.
//!
//! Method, per item: the full cache prefills the prompt once and produces the reference continuation (the item's
//! own forced tokens, or its greedy output) with its log-probabilities. Each codec lane then starts from a copy of
//! that prompt KV (one-shot prefill attends over f32 in both cases, so the copy is exact), round-trips its full
//! blocks, and is teacher-forced through the same continuation in one batch with the other lanes. A position
//! agrees when the lane's argmax equals the full cache's; the first prediction, made by the prefill itself, is the
//! same for every lane and is not scored.

use std::time::Instant;

use pagoda_kernels::{Codec, CpuBackend, KeyRounding, KvDtype, KvStorage};
use serde::{Deserialize, Serialize};

use crate::engine::{EngineError, cpu_backend};
use crate::model::{ChatTemplate, ForwardSeq, Gguf, LlamaModel, LogitsWanted, Scratch, Tokenizer};
use crate::sampling::argmax;
use crate::tiers::GroupCodec;

/// Slots per block, as the engine's default.
const BLOCK_SIZE: usize = 16;
/// Most tokens of one item (prompt + continuation): bounds the KV arena this harness allocates per lane.
pub const MAX_ITEM_TOKENS: usize = 8192;

/// How one lane keeps its KV: a codec's blocks, or a device pool's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneFormat {
    /// Each full block encoded with the codec and decoded back, rotated fp8 keys rounded for the model's queries
    /// as a worker stores them ([`crate::model::calibration`]).
    Codec(Codec),
    /// `fp8_e4m3_rotated` with every key rounded to its nearest code (`--fp8-key-rounding nearest`):
    /// `fp8_e4m3_rotated@nearest`.
    NearestKeys,
    /// Each slot rounded as a device pool of this dtype stores it.
    Pool(KvDtype),
    /// Each full block through its layer's codec of a layered KIVI format ([`GroupCodec::Layered`],
    /// `int2_kivi+int8@18/30`): how `--kivi-int8-layers` stores groups.
    Layered(GroupCodec),
}

impl LaneFormat {
    /// The codec's name, or `pool:` and the dtype's.
    pub fn name(self) -> String {
        match self {
            LaneFormat::Codec(c) => c.name().to_owned(),
            LaneFormat::NearestKeys => format!("{}@nearest", Codec::Fp8E4m3Rotated),
            LaneFormat::Pool(d) => format!("pool:{d}"),
            LaneFormat::Layered(g) => g.name().into_owned(),
        }
    }

    /// Stored bits per K or V element in a block of `block_size` × `head_dim` (scales and headers included).
    pub fn bits_per_element(self, block_size: usize, head_dim: usize) -> f64 {
        match self {
            LaneFormat::Codec(c) => c.bits_per_element(block_size, head_dim).unwrap_or(f64::NAN),
            LaneFormat::NearestKeys => LaneFormat::Codec(Codec::Fp8E4m3Rotated).bits_per_element(block_size, head_dim),
            LaneFormat::Pool(d) => d.slot_bytes(head_dim) as f64 * 8.0 / head_dim as f64,
            LaneFormat::Layered(g) => {
                // A group of one block per layer: the mean over layers is the mean over any whole number of heads.
                let layers = match g {
                    GroupCodec::Layered { int8, .. } => int8.n_layers(),
                    _ => 1,
                };
                let bytes = g.group_bytes(layers, block_size, head_dim).map_or(f64::NAN, |b| b as f64);
                bytes * 8.0 / (2 * layers * block_size * head_dim) as f64
            }
        }
    }
}

impl std::str::FromStr for LaneFormat {
    type Err = String;

    /// `pool:DTYPE` (`pool:int8`, `pool:fp8_e4m3`, `pool:fp8_e4m3_rotated`, ...), a layered KIVI format
    /// (`int2_kivi+int8@18/30`), a codec name, or `fp8_e4m3_rotated@nearest`.
    fn from_str(s: &str) -> Result<LaneFormat, String> {
        if let Some(c) = s.strip_suffix("@nearest") {
            return match c.parse::<Codec>() {
                Ok(Codec::Fp8E4m3Rotated) => Ok(LaneFormat::NearestKeys),
                _ => Err(format!("{s:?}: only fp8_e4m3_rotated rounds its keys another way (@nearest)")),
            };
        }
        if s.contains('+') {
            return match s.parse::<GroupCodec>() {
                Ok(g @ GroupCodec::Layered { .. }) => Ok(LaneFormat::Layered(g)),
                _ => Err(format!("{s:?} is not a layered KIVI format (BASE+int8@L:L/N)")),
            };
        }
        match s.strip_prefix("pool:") {
            Some(d) => d.parse().map(LaneFormat::Pool),
            None => s.parse::<Codec>().map(LaneFormat::Codec).map_err(|e| e.to_string()),
        }
    }
}

/// One item: a prompt and either the continuation to force or how many greedy tokens the full cache generates.
#[derive(Debug, Clone)]
pub struct CodecItem {
    pub name: String,
    pub prompt: Vec<u32>,
    pub continuation: Continuation,
}

#[derive(Debug, Clone)]
pub enum Continuation {
    /// Force these tokens (prose).
    Forced(Vec<u32>),
    /// The full cache's greedy output, at most this many tokens (stops at EOS).
    Greedy(usize),
}

/// One codec on one item.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CodecResult {
    pub item: String,
    pub codec: String,
    /// Scored positions.
    pub positions: usize,
    /// Positions whose argmax equals the full cache's.
    pub agree: usize,
    /// Mean KL(full ‖ codec) over the scored positions, nats.
    pub kl: f64,
}

/// One codec over every item.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CodecCell {
    pub codec: String,
    pub bits_per_element: f64,
    pub items: usize,
    pub positions: usize,
    /// Agreeing positions / scored positions (pooled over items).
    pub agreement: f64,
    pub kl: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CodecReport {
    pub items: Vec<CodecResult>,
    pub cells: Vec<CodecCell>,
    pub seconds: f64,
}

/// The model on the CPU backend, driven directly (no scheduler: every lane owns fixed block tables).
pub struct CodecEvaluator {
    model: LlamaModel,
    /// Per table, how rotated fp8 keys are rounded (the engine's calibration).
    key_rounding: Vec<KeyRounding>,
    backend: CpuBackend,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    eos: Vec<u32>,
    scratch: Scratch,
    logits: Vec<f32>,
    logp: Vec<f32>,
}

impl CodecEvaluator {
    /// The model on `threads` threads, with its matmuls in bf16 when `bf16_matmuls`
    /// ([`crate::engine::EngineConfig::bf16_matmuls`]).
    pub fn load(
        model_path: &std::path::Path,
        threads: usize,
        bf16_matmuls: bool,
    ) -> Result<CodecEvaluator, EngineError> {
        let err = |e: crate::model::ModelError| EngineError::Model(e.to_string());
        let g = Gguf::open(model_path).map_err(err)?;
        let tokenizer = Tokenizer::from_gguf(&g).map_err(err)?;
        let template = ChatTemplate::from_gguf(&g).map_err(err)?;
        let model = LlamaModel::load(&g).map_err(err)?;
        let backend = cpu_backend(threads, bf16_matmuls)?;
        let key_rounding = crate::engine::calibrate_fp8_keys(&tokenizer, &model, &backend)?;
        Ok(CodecEvaluator {
            eos: tokenizer.eos_token_ids().to_vec(),
            model,
            key_rounding,
            backend,
            tokenizer,
            template,
            scratch: Scratch::default(),
            logits: Vec::new(),
            logp: Vec::new(),
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat prompt for a user message, tokenized.
    pub fn chat_tokens(&self, user: &str) -> Result<Vec<u32>, EngineError> {
        super::chat_tokens(&self.template, &self.tokenizer, user)
    }

    /// Runs one item under the full cache and every codec in `codecs`; one result per codec.
    pub fn run_item(&mut self, item: &CodecItem, codecs: &[LaneFormat]) -> Result<Vec<CodecResult>, EngineError> {
        let c = self.model.config().clone();
        let vocab = c.vocab;
        let n_cont = match &item.continuation {
            Continuation::Forced(t) => t.len(),
            Continuation::Greedy(n) => *n,
        };
        let total = item.prompt.len() + n_cont;
        if item.prompt.is_empty() || n_cont < 2 || total > MAX_ITEM_TOKENS.min(c.ctx_len) {
            return Err(EngineError::InvalidRequest(format!(
                "item {}: needs a prompt, at least 2 continuation tokens and at most {} tokens in all, got {} + {}",
                item.name,
                MAX_ITEM_TOKENS.min(c.ctx_len),
                item.prompt.len(),
                n_cont
            )));
        }
        if let Some(bad) = codecs.iter().find_map(|f| match f {
            LaneFormat::Layered(GroupCodec::Layered { int8, .. }) if int8.n_layers() != c.n_layers => Some(f.name()),
            _ => None,
        }) {
            return Err(EngineError::InvalidRequest(format!(
                "{bad} is for another model: this one has {} layers",
                c.n_layers
            )));
        }
        let n_tables = c.n_layers * c.n_kv_heads;
        let per_table = total.div_ceil(BLOCK_SIZE);
        let lane_blocks = n_tables * per_table;
        let lanes = 1 + codecs.len();
        let mut kv = KvStorage::new(lane_blocks * lanes, BLOCK_SIZE, c.head_dim);
        let tables: Vec<Vec<Vec<u32>>> = (0..lanes)
            .map(|l| {
                (0..n_tables)
                    .map(|t| {
                        let first = (l * lane_blocks + t * per_table) as u32;
                        (first..first + per_table as u32).collect()
                    })
                    .collect()
            })
            .collect();

        // Reference: prefill, then the continuation one token at a time, recording log-probabilities of the
        // predictions after the first.
        let mut cont: Vec<u32> = match &item.continuation {
            Continuation::Forced(t) => t.clone(),
            Continuation::Greedy(_) => Vec::new(),
        };
        let mut reference: Vec<f32> = Vec::new();
        let mut lens = vec![0usize; n_tables];
        self.step(&mut kv, &[(&item.prompt[..], 0, &tables[0][..], &lens[..])])?;
        lens.fill(item.prompt.len());
        let mut next = argmax(&self.logits[..vocab]);
        for j in 0..n_cont {
            let tok = match &item.continuation {
                Continuation::Forced(t) => t[j],
                Continuation::Greedy(_) => {
                    if self.eos.contains(&next) {
                        break;
                    }
                    cont.push(next);
                    next
                }
            };
            if j + 1 == n_cont {
                break;
            }
            let pos = (item.prompt.len() + j) as u32;
            self.step(&mut kv, &[(&[tok][..], pos, &tables[0][..], &lens[..])])?;
            lens.iter_mut().for_each(|l| *l += 1);
            log_softmax(&self.logits[..vocab], &mut self.logp);
            reference.extend_from_slice(&self.logp);
            next = argmax(&self.logits[..vocab]);
        }
        let scored = reference.len() / vocab;
        let cont = &cont[..(scored + 1).min(cont.len())];

        // Codec lanes: copy the prompt KV, then teacher-force the continuation in one batch.
        let block_len = BLOCK_SIZE * c.head_dim;
        let mut bytes = Vec::new();
        let (mut dk, mut dv) = (vec![0.0f32; block_len], vec![0.0f32; block_len]);
        let prompt_blocks = item.prompt.len().div_ceil(BLOCK_SIZE);
        for lane in &tables[1..] {
            for (src, dst) in tables[0].iter().zip(lane) {
                for (&s, &d) in src[..prompt_blocks].iter().zip(&dst[..prompt_blocks]) {
                    kv.copy_block(s, d);
                }
            }
        }
        let mut coded = vec![0usize; lanes];
        // Each lane's rounding: its codec, or a one-block pool of its dtype that a slot is written into and read back.
        let mut rounding: Vec<Rounding> = codecs
            .iter()
            .map(|f| match *f {
                LaneFormat::Codec(codec) => Rounding::Codec(GroupCodec::Kv(codec), true),
                LaneFormat::NearestKeys => Rounding::Codec(GroupCodec::Kv(Codec::Fp8E4m3Rotated), false),
                LaneFormat::Layered(g) => Rounding::Codec(g, true),
                LaneFormat::Pool(d) => Rounding::Pool(KvStorage::with_dtype(1, BLOCK_SIZE, c.head_dim, d)),
            })
            .collect();
        let (mut sk, mut sv) = (vec![0.0f32; c.head_dim], vec![0.0f32; c.head_dim]);
        let mut agree = vec![0usize; codecs.len()];
        let mut kl = vec![0.0f64; codecs.len()];
        for j in 0..=scored {
            let len = item.prompt.len() + j;
            // Encode and decode back every block that is full now (the prompt's, then one per BLOCK_SIZE steps); a
            // pool lane rounds every slot written since the last step.
            for (li, lane) in rounding.iter_mut().enumerate() {
                let l = li + 1;
                match lane {
                    Rounding::Codec(group, for_queries) => {
                        for (t, table) in tables[l].iter().enumerate() {
                            let codec = group.block_codec(t, n_tables).ok_or_else(|| {
                                EngineError::InvalidRequest(format!("{group} does not fit this model's layers"))
                            })?;
                            let keys = self.key_rounding.get(t).filter(|_| *for_queries);
                            for &b in &table[coded[l]..len / BLOCK_SIZE] {
                                round_trip(codec, keys, &mut kv, b, &mut bytes, &mut dk, &mut dv)?;
                            }
                        }
                        coded[l] = len / BLOCK_SIZE;
                    }
                    Rounding::Pool(pool) => {
                        for table in &tables[l] {
                            for slot in coded[l]..len {
                                let (b, s) = (table[slot / BLOCK_SIZE], slot % BLOCK_SIZE);
                                kv.read_slot(b, s, &mut sk, &mut sv);
                                pool.write_slot(0, 0, &sk, &sv);
                                pool.read_slot(0, 0, &mut sk, &mut sv);
                                kv.write_slot(b, s, &sk, &sv);
                            }
                        }
                        coded[l] = len;
                    }
                }
            }
            if j == scored {
                break;
            }
            let lens = vec![len; n_tables];
            let tok = [cont[j]];
            let batch: Vec<Lane<'_>> = (1..lanes).map(|l| (&tok[..], len as u32, &tables[l][..], &lens[..])).collect();
            self.step(&mut kv, &batch)?;
            let r = &reference[j * vocab..(j + 1) * vocab];
            let r_top = argmax(r);
            for li in 0..codecs.len() {
                let row = &self.logits[li * vocab..(li + 1) * vocab];
                agree[li] += usize::from(argmax(row) == r_top);
                log_softmax(row, &mut self.logp);
                kl[li] += kl_div(r, &self.logp);
            }
        }
        Ok(codecs
            .iter()
            .enumerate()
            .map(|(li, format)| CodecResult {
                item: item.name.clone(),
                codec: format.name(),
                positions: scored,
                agree: agree[li],
                kl: kl[li] / scored.max(1) as f64,
            })
            .collect())
    }

    /// One forward step over `(tokens, start_pos, tables, prior_lens)` per lane, last-token logits each.
    fn step(&mut self, kv: &mut KvStorage, lanes: &[Lane<'_>]) -> Result<(), EngineError> {
        let seqs: Vec<ForwardSeq<'_>> = lanes
            .iter()
            .map(|&(tokens, start_pos, tables, prior_lens)| ForwardSeq {
                tokens,
                start_pos,
                tables,
                prior_lens,
                logits: LogitsWanted::Last,
                capture_q: 0,
                attention_sums: None,
                lora: None,
            })
            .collect();
        self.logits.clear();
        self.model
            .forward(&self.backend, kv, &seqs, &mut self.scratch, &mut self.logits)
            .map_err(|e| EngineError::Forward(e.to_string()))
    }
}

/// How a lane rounds its KV ([`LaneFormat`], with the pool a `Pool` lane rounds through).
enum Rounding {
    /// Each table's blocks through the group codec's codec for that table (`layer * n_kv_heads + head`); rotated
    /// fp8 keys rounded for the queries when the flag is set.
    Codec(GroupCodec, bool),
    Pool(KvStorage),
}

/// One lane of a step: tokens, RoPE position of the first, block tables, cache lengths before the step.
type Lane<'a> = (&'a [u32], u32, &'a [Vec<u32>], &'a [usize]);

/// Encodes block `b` with `codec` and decodes it back into the arena.
fn round_trip(
    codec: Codec,
    keys: Option<&KeyRounding>,
    kv: &mut KvStorage,
    b: u32,
    bytes: &mut Vec<u8>,
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<(), EngineError> {
    let fail = |e: pagoda_kernels::CodecError| EngineError::Forward(format!("{codec} on block {b}: {e}"));
    bytes.resize(codec.encoded_len(kv.block_size(), kv.head_dim()).map_err(fail)?, 0);
    codec.encode_block_with(kv.block_size(), kv.head_dim(), kv.block_k(b), kv.block_v(b), bytes, keys).map_err(fail)?;
    pagoda_kernels::decode_block(bytes, dk, dv).map_err(fail)?;
    kv.block_k_mut(b).copy_from_slice(dk);
    kv.block_v_mut(b).copy_from_slice(dv);
    Ok(())
}

/// `out = log softmax(x)`.
fn log_softmax(x: &[f32], out: &mut Vec<f32>) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| f64::from((v - max).exp())).sum();
    let lse = max + sum.ln() as f32;
    out.clear();
    out.extend(x.iter().map(|&v| v - lse));
}

/// KL(p ‖ q) from log-probabilities.
fn kl_div(logp: &[f32], logq: &[f32]) -> f64 {
    logp.iter().zip(logq).map(|(&a, &b)| f64::from(a.exp()) * f64::from(a - b)).sum::<f64>().max(0.0)
}

/// Pools item results per codec (in the order of `codecs`).
pub fn summarize(items: &[CodecResult], codecs: &[LaneFormat]) -> Vec<CodecCell> {
    codecs
        .iter()
        .map(|c| {
            let rs: Vec<&CodecResult> = items.iter().filter(|r| r.codec == c.name()).collect();
            let positions: usize = rs.iter().map(|r| r.positions).sum();
            let agree: usize = rs.iter().map(|r| r.agree).sum();
            let kl = rs.iter().map(|r| r.kl * r.positions as f64).sum::<f64>() / positions.max(1) as f64;
            CodecCell {
                codec: c.name(),
                bits_per_element: c.bits_per_element(BLOCK_SIZE, 64),
                items: rs.len(),
                positions,
                agreement: agree as f64 / positions.max(1) as f64,
                kl,
            }
        })
        .collect()
}

/// Runs every item under every codec, the matmuls in bf16 when `bf16_matmuls`.
pub fn run(
    model_path: &std::path::Path,
    threads: usize,
    bf16_matmuls: bool,
    codecs: &[LaneFormat],
    make_items: &dyn Fn(&CodecEvaluator) -> Result<Vec<CodecItem>, EngineError>,
) -> Result<CodecReport, EngineError> {
    let t0 = Instant::now();
    let mut ev = CodecEvaluator::load(model_path, threads, bf16_matmuls)?;
    let items = make_items(&ev)?;
    let mut results = Vec::new();
    for item in &items {
        let rs = ev.run_item(item, codecs)?;
        tracing::info!(item = %item.name, "codec eval item done");
        results.extend(rs);
    }
    let cells = summarize(&results, codecs);
    Ok(CodecReport { items: results, cells, seconds: t0.elapsed().as_secs_f64() })
}

/// Markdown table: one row per codec.
pub fn render_markdown(report: &CodecReport) -> String {
    use std::fmt::Write;
    let mut s = String::from(
        "| codec | bits/element (16x64 block) | items | scored positions | top-1 agreement with full cache | mean KL (nats) |\n\
         |---|---|---|---|---|---|\n",
    );
    for c in &report.cells {
        let _ = writeln!(
            s,
            "| {} | {:.2} | {} | {} | {:.4} | {:.5} |",
            c.codec, c.bits_per_element, c.items, c.positions, c.agreement, c.kl
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rounding_lanes_parse_for_rotated_fp8_only() {
        let lane: LaneFormat = "fp8_e4m3_rotated@nearest".parse().unwrap();
        assert_eq!(lane, LaneFormat::NearestKeys);
        assert_eq!(lane.name(), "fp8_e4m3_rotated@nearest");
        assert_eq!(lane.bits_per_element(16, 64), LaneFormat::Codec(Codec::Fp8E4m3Rotated).bits_per_element(16, 64));
        for other in ["fp8_e4m3@nearest", "int8@nearest", "nope@nearest"] {
            assert!(other.parse::<LaneFormat>().is_err(), "{other}");
        }
    }
}
