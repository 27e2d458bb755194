//! Synthetic-weights llama models ([`SyntheticSpec`]): any llama shape, with deterministic pseudo-random weights
//! generated in memory, for throughput benchmarks of shapes whose real weights cannot be brought to the machine.
//!
//! **Their outputs are meaningless.** Only the work is real: the same tensors, shapes, weight formats and forward
//! pass as a GGUF model of that shape, so tokens/s, memory and kernel timings are representative; text and
//! quality are not. Every name a synthetic model reports starts with `synthetic-` so that no report can pass one
//! off as a real model.
//!
//! Weights are written straight in their storage format (GGUF Q4_1 / Q8_0 blocks, or F16) from a counter-based
//! generator, one row at a time in parallel, so a 8B-parameter model is built in seconds and the same spec always
//! gives the same bytes. Each element is zero-mean with standard deviation `1/sqrt(fan_in)`, so activations keep
//! their scale through the layers; norm weights are 1.

use std::fmt;
use std::str::FromStr;

use half::f16;
use pagoda_kernels::{QMatrix, WeightType};
use rayon::prelude::*;

use super::config::ModelConfig;
use super::error::ModelError;
use super::llama::{Layer, LlamaModel};

/// Largest synthetic model accepted, in parameters (bounds what a typo can ask the machine to allocate).
pub const MAX_SYNTHETIC_PARAMS: u64 = 100_000_000_000;
/// Largest context length a synthetic shape may declare.
pub const MAX_SYNTHETIC_CONTEXT: usize = 1 << 20;

/// A llama shape and the weight format to fill it with. Parsed from a preset name (`smollm2-135m`, `llama-1b`,
/// `llama-8b`) or a `key=value` list (`layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1024`; optional
/// `ctx`, `theta`, `tied`), with [`SyntheticSpec::with_weights`] for the format.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    /// The preset's name, or `custom`.
    pub shape_name: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub ctx_len: usize,
    pub rope_theta: f32,
    /// The LM head shares the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
    /// Storage format of every matrix.
    pub weights: WeightType,
    /// Seed of the generator.
    pub seed: u64,
}

/// A named llama shape.
struct Preset {
    name: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    vocab: usize,
    rope_theta: f32,
    tied: bool,
}

const PRESETS: &[Preset] = &[
    // SmolLM2-135M: the real model's shape, to compare a synthetic run with the real one.
    Preset {
        name: "smollm2-135m",
        layers: 30,
        hidden: 576,
        heads: 9,
        kv_heads: 3,
        ffn: 1536,
        vocab: 49152,
        rope_theta: 100_000.0,
        tied: true,
    },
    // Llama 3.2 1B.
    Preset {
        name: "llama-1b",
        layers: 16,
        hidden: 2048,
        heads: 32,
        kv_heads: 8,
        ffn: 8192,
        vocab: 128_256,
        rope_theta: 500_000.0,
        tied: true,
    },
    // Llama 3.1 8B.
    Preset {
        name: "llama-8b",
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        ffn: 14336,
        vocab: 128_256,
        rope_theta: 500_000.0,
        tied: false,
    },
];

/// Context length of the presets: RoPE here has no long-context scaling, so the presets stop at 8K.
const PRESET_CONTEXT: usize = 8192;

impl SyntheticSpec {
    /// The same shape stored as `weights` (F16, Q4_1 or Q8_0).
    pub fn with_weights(mut self, weights: WeightType) -> Result<SyntheticSpec, ModelError> {
        if !SYNTHETIC_WEIGHTS.contains(&weights) {
            return Err(ModelError::InvalidInput("synthetic weights are f16, q4_1 or q8_0".into()));
        }
        self.weights = weights;
        self.validate()?;
        Ok(self)
    }

    /// The model's name as reports show it: `synthetic-<shape>-<format>`.
    pub fn model_name(&self) -> String {
        format!("synthetic-{}-{}", self.shape_name, weight_name(self.weights))
    }

    /// The hyper-parameters of the shape.
    pub fn config(&self) -> ModelConfig {
        ModelConfig {
            arch: "llama".into(),
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.hidden / self.n_heads,
            hidden: self.hidden,
            ffn: self.ffn,
            vocab: self.vocab,
            ctx_len: self.ctx_len,
            rope_theta: self.rope_theta,
            rms_eps: 1e-5,
        }
    }

    /// Parameters of the shape (weights of every matrix and norm).
    pub fn params(&self) -> u64 {
        let c = self.config();
        let (h, q, kv, f, v) = (c.hidden as u64, c.q_dim() as u64, c.kv_dim() as u64, c.ffn as u64, c.vocab as u64);
        let per_layer = h * q * 2 + h * kv * 2 + 3 * h * f + 2 * h;
        let head = if self.tied_embeddings { 0 } else { v * h };
        v * h + head + h + per_layer * c.n_layers as u64
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |why: String| Err(ModelError::InvalidInput(format!("synthetic shape {}: {why}", self.shape_name)));
        let dims = [
            ("layers", self.n_layers, 1024),
            ("hidden", self.hidden, 65_536),
            ("heads", self.n_heads, 1024),
            ("kv_heads", self.n_kv_heads, 1024),
            ("ffn", self.ffn, 262_144),
            ("vocab", self.vocab, 1 << 20),
            ("ctx", self.ctx_len, MAX_SYNTHETIC_CONTEXT),
        ];
        for (name, v, max) in dims {
            if v == 0 || v > max {
                return bad(format!("{name} = {v} is outside 1..={max}"));
            }
        }
        if !self.hidden.is_multiple_of(self.n_heads) || !(self.hidden / self.n_heads).is_multiple_of(2) {
            return bad(format!("hidden {} must split into {} heads of an even width", self.hidden, self.n_heads));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!("{} heads do not group over {} kv heads", self.n_heads, self.n_kv_heads));
        }
        // Every matrix's input width is hidden (q, k, v, gate, up; o's is heads × head_dim = hidden) or ffn (down).
        let block = self.weights.block_len();
        for (name, cols) in [("hidden", self.hidden), ("ffn", self.ffn)] {
            if !cols.is_multiple_of(block) {
                return bad(format!("{name} = {cols} is not a multiple of the {block}-weight quantisation block"));
            }
        }
        if !self.rope_theta.is_finite() || self.rope_theta <= 1.0 {
            return bad(format!("theta = {} must be a finite number above 1", self.rope_theta));
        }
        if self.params() > MAX_SYNTHETIC_PARAMS {
            return bad(format!("{} parameters exceed the limit of {MAX_SYNTHETIC_PARAMS}", self.params()));
        }
        Ok(())
    }
}

fn weight_name(w: WeightType) -> &'static str {
    match w {
        WeightType::F32 => "f32",
        WeightType::F16 => "f16",
        WeightType::Q4_1 => "q4_1",
        WeightType::Q8_0 => "q8_0",
    }
}

/// The formats a synthetic model can be stored in.
const SYNTHETIC_WEIGHTS: [WeightType; 3] = [WeightType::F16, WeightType::Q4_1, WeightType::Q8_0];

/// Parses a weight format name: `f16`, `q4_1` or `q8_0`.
pub fn parse_synthetic_weights(s: &str) -> Result<WeightType, ModelError> {
    let s = s.to_ascii_lowercase();
    SYNTHETIC_WEIGHTS
        .into_iter()
        .find(|&w| weight_name(w) == s)
        .ok_or_else(|| ModelError::InvalidInput(format!("synthetic weights {s:?}: expected f16, q4_1 or q8_0")))
}

impl fmt::Display for SyntheticSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} layers, hidden {}, {}/{} heads, ffn {}, vocab {}, {:.2}B params, {} weights; SYNTHETIC: random \
             weights, outputs meaningless)",
            self.model_name(),
            self.n_layers,
            self.hidden,
            self.n_heads,
            self.n_kv_heads,
            self.ffn,
            self.vocab,
            self.params() as f64 / 1e9,
            weight_name(self.weights)
        )
    }
}

impl FromStr for SyntheticSpec {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<SyntheticSpec, ModelError> {
        let s = s.trim();
        if s.len() > 256 {
            return Err(ModelError::InvalidInput("synthetic shape: longer than 256 characters".into()));
        }
        let mut spec = SyntheticSpec {
            shape_name: "custom".into(),
            n_layers: 0,
            hidden: 0,
            n_heads: 0,
            n_kv_heads: 0,
            ffn: 0,
            vocab: 0,
            ctx_len: PRESET_CONTEXT,
            rope_theta: 10_000.0,
            tied_embeddings: true,
            weights: WeightType::Q4_1,
            seed: 0x5EED_CAFE,
        };
        if let Some(p) = PRESETS.iter().find(|p| p.name.eq_ignore_ascii_case(s)) {
            spec.shape_name = p.name.into();
            (spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads) = (p.layers, p.hidden, p.heads, p.kv_heads);
            (spec.ffn, spec.vocab, spec.rope_theta, spec.tied_embeddings) = (p.ffn, p.vocab, p.rope_theta, p.tied);
            spec.validate()?;
            return Ok(spec);
        }
        let presets: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        let unknown = || {
            ModelError::InvalidInput(format!(
                "synthetic shape {s:?}: expected one of {} or a list like \
                 layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1024",
                presets.join(", ")
            ))
        };
        if !s.contains('=') {
            return Err(unknown());
        }
        let mut seen = Vec::new();
        for part in s.split(',') {
            let (key, value) = part.split_once('=').ok_or_else(unknown)?;
            let key = key.trim();
            let value = value.trim();
            if seen.contains(&key) {
                return Err(ModelError::InvalidInput(format!("synthetic shape: {key} given twice")));
            }
            seen.push(key);
            let bad = || ModelError::InvalidInput(format!("synthetic shape: {key} = {value:?} is not valid"));
            let num = || value.parse::<usize>().map_err(|_| bad());
            match key {
                "layers" => spec.n_layers = num()?,
                "hidden" => spec.hidden = num()?,
                "heads" => spec.n_heads = num()?,
                "kv_heads" => spec.n_kv_heads = num()?,
                "ffn" => spec.ffn = num()?,
                "vocab" => spec.vocab = num()?,
                "ctx" => spec.ctx_len = num()?,
                "theta" => spec.rope_theta = value.parse().map_err(|_| bad())?,
                "tied" => spec.tied_embeddings = value.parse().map_err(|_| bad())?,
                "seed" => spec.seed = value.parse().map_err(|_| bad())?,
                _ => return Err(unknown()),
            }
        }
        for required in ["layers", "hidden", "heads", "ffn", "vocab"] {
            if !seen.contains(&required) {
                return Err(ModelError::InvalidInput(format!("synthetic shape: {required} is missing")));
            }
        }
        if !seen.contains(&"kv_heads") {
            spec.n_kv_heads = spec.n_heads;
        }
        spec.validate()?;
        Ok(spec)
    }
}

/// SplitMix64: a counter-based generator, so every row is generated on its own from (seed, tensor, row).
#[inline]
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills one row's bytes in `ty`'s GGUF layout with zero-mean values of standard deviation `std`.
fn fill_row(ty: WeightType, std: f32, mut state: u64, row: &mut [u8]) {
    let mut next = move || {
        state = splitmix(state);
        state
    };
    match ty {
        WeightType::Q4_1 => {
            // Nibbles uniform on 0..=15 have standard deviation sqrt(255/12) ≈ 4.61 steps; centring needs
            // min = -7.5 d.
            let d = f16::from_f32(std / (255.0f32 / 12.0).sqrt());
            let m = f16::from_f32(-7.5 * d.to_f32());
            for block in row.chunks_exact_mut(pagoda_kernels::quant::Q4_1_BLOCK_BYTES) {
                block[0..2].copy_from_slice(&d.to_bits().to_le_bytes());
                block[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
                block[4..12].copy_from_slice(&next().to_le_bytes());
                block[12..20].copy_from_slice(&next().to_le_bytes());
            }
        }
        WeightType::Q8_0 => {
            // i8 uniform on -127..=127 has standard deviation sqrt((255² - 1) / 12) ≈ 73.6 steps.
            let d = f16::from_f32(std / ((255.0f32 * 255.0 - 1.0) / 12.0).sqrt());
            for block in row.chunks_exact_mut(pagoda_kernels::quant::Q8_0_BLOCK_BYTES) {
                block[0..2].copy_from_slice(&d.to_bits().to_le_bytes());
                for q in block[2..].chunks_mut(8) {
                    let r = next();
                    for (i, b) in q.iter_mut().enumerate() {
                        // 0..=254 shifted to -127..=127: never -128, which Q8_0 does not produce either.
                        *b = ((((r >> (8 * i)) & 0xFF) as u32 * 255 / 256) as i32 - 127) as i8 as u8;
                    }
                }
            }
        }
        WeightType::F16 | WeightType::F32 => {
            // Uniform on [-a, a] with a = sqrt(3) std.
            let a = std * 3.0f32.sqrt();
            let width = if ty == WeightType::F16 { 2 } else { 4 };
            for v in row.chunks_exact_mut(width) {
                let u = (next() >> 40) as f32 / (1u64 << 24) as f32;
                let x = (2.0 * u - 1.0) * a;
                if width == 2 {
                    v.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
                } else {
                    v.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
    }
}

/// A `rows x cols` matrix of `ty`, tensor number `tensor` of the model.
fn matrix(spec: &SyntheticSpec, tensor: u64, rows: usize, cols: usize, std: f32) -> Result<QMatrix, ModelError> {
    let ty = spec.weights;
    let too_large = || ModelError::InvalidInput(format!("synthetic matrix {rows}x{cols} is too large"));
    let row_bytes = ty.byte_len(1, cols).ok_or_else(too_large)?;
    let total = row_bytes.checked_mul(rows).ok_or_else(too_large)?;
    let mut bytes = vec![0u8; total];
    let base = splitmix(spec.seed ^ splitmix(tensor));
    bytes.par_chunks_exact_mut(row_bytes).enumerate().for_each(|(r, row)| {
        fill_row(ty, std, splitmix(base ^ (r as u64).wrapping_mul(0xA24B_AED4_963E_E407)), row);
    });
    QMatrix::from_gguf(ty, rows, cols, &bytes).map_err(|e| ModelError::Kernel(format!("synthetic tensor: {e}")))
}

impl LlamaModel {
    /// Builds a model of `spec`'s shape with pseudo-random weights (see the module docs: outputs are meaningless).
    pub fn synthetic(spec: &SyntheticSpec) -> Result<LlamaModel, ModelError> {
        spec.validate()?;
        let c = spec.config();
        let inv_sqrt = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        let mut tensor = 0u64;
        let mut next = |rows: usize, cols: usize, std: f32| {
            tensor += 1;
            matrix(spec, tensor, rows, cols, std)
        };
        let embed = next(c.vocab, c.hidden, 1.0)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            layers.push(Layer {
                attn_norm: vec![1.0; c.hidden],
                wq: next(c.q_dim(), c.hidden, inv_sqrt(c.hidden))?,
                wk: next(c.kv_dim(), c.hidden, inv_sqrt(c.hidden))?,
                wv: next(c.kv_dim(), c.hidden, inv_sqrt(c.hidden))?,
                wo: next(c.hidden, c.q_dim(), inv_sqrt(c.q_dim()))?,
                ffn_norm: vec![1.0; c.hidden],
                w_gate: next(c.ffn, c.hidden, inv_sqrt(c.hidden))?,
                w_up: next(c.ffn, c.hidden, inv_sqrt(c.hidden))?,
                w_down: next(c.hidden, c.ffn, inv_sqrt(c.ffn))?,
            });
        }
        let output = if spec.tied_embeddings { None } else { Some(next(c.vocab, c.hidden, inv_sqrt(c.hidden))?) };
        Ok(LlamaModel::from_parts(c, embed, layers, vec![1.0; spec.hidden], output))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ForwardSeq, LogitsWanted, Scratch};
    use pagoda_kernels::{CpuBackend, KvStorage};

    fn tiny(weights: &str) -> SyntheticSpec {
        let spec: SyntheticSpec = "layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=96".parse().unwrap();
        spec.with_weights(parse_synthetic_weights(weights).unwrap()).unwrap()
    }

    #[test]
    fn presets_have_the_published_shapes() {
        let one: SyntheticSpec = "llama-1b".parse().unwrap();
        assert_eq!((one.n_layers, one.hidden, one.n_heads, one.n_kv_heads, one.ffn), (16, 2048, 32, 8, 8192));
        assert!((1.2e9..1.3e9).contains(&(one.params() as f64)), "{}", one.params());
        let eight: SyntheticSpec = "LLAMA-8B".parse().unwrap();
        assert_eq!(eight.config().head_dim, 128);
        assert!((7.9e9..8.1e9).contains(&(eight.params() as f64)), "{}", eight.params());
        let small: SyntheticSpec = "smollm2-135m".parse().unwrap();
        assert!((1.3e8..1.4e8).contains(&(small.params() as f64)), "{}", small.params());
        assert_eq!(small.model_name(), "synthetic-smollm2-135m-q4_1");
        assert!(small.to_string().contains("SYNTHETIC"));
    }

    #[test]
    fn bad_shapes_are_clear_errors() {
        for (s, want) in [
            ("llama-70x", "expected one of"),
            ("layers=2,hidden=64,heads=4,ffn=128", "vocab is missing"),
            ("layers=2,hidden=64,heads=3,ffn=128,vocab=9", "heads of an even width"),
            ("layers=2,hidden=64,heads=4,kv_heads=3,ffn=128,vocab=9", "do not group"),
            ("layers=2,hidden=48,heads=4,ffn=128,vocab=9", "quantisation block"),
            ("layers=0,hidden=64,heads=4,ffn=128,vocab=9", "layers = 0"),
            ("layers=x,hidden=64,heads=4,ffn=128,vocab=9", "layers = \"x\""),
            ("layers=2,layers=2,hidden=64,heads=4,ffn=128,vocab=9", "given twice"),
            ("layers=1000,hidden=65536,heads=512,ffn=262144,vocab=9", "exceed the limit"),
        ] {
            let err = s.parse::<SyntheticSpec>().unwrap_err().to_string();
            assert!(err.contains(want), "{s}: {err}");
        }
        let f32_weights = tiny("q4_1").with_weights(WeightType::F32).unwrap_err().to_string();
        assert!(f32_weights.contains("f16, q4_1 or q8_0"), "{f32_weights}");
        assert!(parse_synthetic_weights("q5_k").is_err());
    }

    #[test]
    fn weights_are_deterministic_and_scaled() {
        for fmt in ["q4_1", "q8_0", "f16"] {
            let spec = tiny(fmt);
            let a = LlamaModel::synthetic(&spec).unwrap();
            let b = LlamaModel::synthetic(&spec).unwrap();
            let (mut ra, mut rb) = (vec![0.0f32; 64], vec![0.0f32; 64]);
            let mut sum_sq = 0.0f64;
            let mut sum = 0.0f64;
            for r in 0..a.layers[0].wq.rows() {
                a.layers[0].wq.dequantize_row(r, &mut ra);
                b.layers[0].wq.dequantize_row(r, &mut rb);
                assert_eq!(ra, rb, "{fmt}: row {r} differs between two builds");
                sum += ra.iter().map(|&x| x as f64).sum::<f64>();
                sum_sq += ra.iter().map(|&x| (x * x) as f64).sum::<f64>();
            }
            let n = (a.layers[0].wq.rows() * 64) as f64;
            let std = (sum_sq / n - (sum / n).powi(2)).sqrt();
            // 1/sqrt(64) = 0.125, within the sampling error of 4,096 values and the f16 rounding of d.
            assert!((std - 0.125).abs() < 0.01, "{fmt}: std {std}");
            assert!((sum / n).abs() < 0.01, "{fmt}: mean {}", sum / n);
            // Different tensors differ.
            a.layers[0].wk.dequantize_row(0, &mut rb);
            a.layers[0].wq.dequantize_row(0, &mut ra);
            assert_ne!(ra, rb);
        }
        let reseeded: SyntheticSpec = "layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=96,seed=7".parse().unwrap();
        let (a, b) = (LlamaModel::synthetic(&tiny("q4_1")).unwrap(), LlamaModel::synthetic(&reseeded).unwrap());
        let (mut ra, mut rb) = (vec![0.0f32; 64], vec![0.0f32; 64]);
        a.embed.dequantize_row(3, &mut ra);
        b.embed.dequantize_row(3, &mut rb);
        assert_ne!(ra, rb, "the seed must change the weights");
    }

    #[test]
    fn forward_runs_and_gives_finite_varied_logits() {
        let spec = tiny("q4_1");
        let model = LlamaModel::synthetic(&spec).unwrap();
        let c = model.config().clone();
        let bs = 16;
        let mut kv = KvStorage::new(c.n_kv_tables() * 2, bs, c.head_dim);
        let tables: Vec<Vec<u32>> = (0..c.n_kv_tables() as u32).map(|t| vec![2 * t, 2 * t + 1]).collect();
        let prior = vec![0usize; c.n_kv_tables()];
        let tokens: Vec<u32> = (0..20).map(|i| (i * 7 % 96) as u32).collect();
        let seq = ForwardSeq {
            tokens: &tokens,
            start_pos: 0,
            tables: &tables,
            prior_lens: &prior,
            logits: LogitsWanted::All,
            capture_q: 0,
            attention_sums: None,
            lora: None,
        };
        let mut logits = Vec::new();
        model.forward(&CpuBackend::new(1), &mut kv, &[seq], &mut Scratch::new(), &mut logits).unwrap();
        assert_eq!(logits.len(), 20 * 96);
        assert!(logits.iter().all(|x| x.is_finite()));
        let argmaxes: std::collections::HashSet<usize> = logits
            .chunks_exact(96)
            .map(|row| row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap())
            .collect();
        assert!(argmaxes.len() > 3, "random weights should not collapse onto one token: {argmaxes:?}");
    }
}
