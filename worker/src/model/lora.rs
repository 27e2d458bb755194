//! LoRA adapters: [`LoraAdapter`] (low-rank weight deltas `ΔW = (α/r)·B·A` on a llama model's projections, loaded
//! from a PEFT directory), their application inside a batched forward step ([`apply_lora`]), and
//! [`write_synthetic_peft`], which writes a clearly labelled random adapter for tests and benchmarks.
//!
//! An adapter serves many requests beside the base model and beside other adapters in one step, as vLLM's
//! multi-LoRA and S-LoRA do: the base matmul runs once over the whole batch, then each run of rows that share an
//! adapter adds `B·(A·x)` (the backend's `lora_add` kernel). The weights are never merged, so any mix of adapters
//! costs one base matmul per projection.
//!
//! The format is PEFT's (`adapter_config.json` + `adapter_model.safetensors`), which is what vLLM's
//! `--lora-modules` and SGLang's `--lora-paths` load. Tensors use Hugging Face's row order; the GGUF converter
//! permuted the rows of Wq and Wk for llama.cpp's interleaved RoPE, so the rows of `B` for `q_proj` and `k_proj` are
//! permuted the same way here. Every input is bounded and checked: file sizes, rank, shapes, dtypes, finite values,
//! and PEFT options that would change the math (DoRA, `fan_in_fan_out`, biases, per-module ranks) are refused by
//! name rather than ignored.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::Path;

use pagoda_kernels::{Backend, LoraSegment};
use serde_json::Value;

use super::config::ModelConfig;
use super::error::ModelError;
use super::llama::ForwardSeq;

/// The largest `adapter_config.json` read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The largest `adapter_model.safetensors` read.
const MAX_WEIGHTS_BYTES: u64 = 2 << 30;
/// The highest rank any worker accepts (`--max-lora-rank` is checked against it): the kernel's bound.
pub const MAX_LORA_RANK: usize = pagoda_kernels::cpu::lora::MAX_LORA_RANK;
/// Longest adapter name.
pub const MAX_LORA_NAME: usize = 128;

/// A projection of a llama block that an adapter may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LoraTarget {
    /// Every target, in [`LoraTarget::index`] order.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// PEFT's module name (`target_modules`).
    pub fn module(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    fn parent(self) -> &'static str {
        match self {
            LoraTarget::Q | LoraTarget::K | LoraTarget::V | LoraTarget::O => "self_attn",
            _ => "mlp",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// The target named `module` (PEFT's name).
    pub fn from_module(module: &str) -> Option<LoraTarget> {
        LoraTarget::ALL.into_iter().find(|t| t.module() == module)
    }

    /// (input width, output width) of the projection in `cfg`.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        match self {
            LoraTarget::Q => (cfg.hidden, cfg.q_dim()),
            LoraTarget::K | LoraTarget::V => (cfg.hidden, cfg.kv_dim()),
            LoraTarget::O => (cfg.q_dim(), cfg.hidden),
            LoraTarget::Gate | LoraTarget::Up => (cfg.hidden, cfg.ffn),
            LoraTarget::Down => (cfg.ffn, cfg.hidden),
        }
    }

    /// PEFT's tensor name of this target's `A` (`B` when `b`) in block `layer`.
    pub fn tensor_name(self, layer: usize, b: bool) -> String {
        let ab = if b { "B" } else { "A" };
        format!("base_model.model.model.layers.{layer}.{}.{}.lora_{ab}.weight", self.parent(), self.module())
    }
}

/// A tensor of the safetensors file, as read.
struct Tensor {
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// One projection's delta: `A` (`[rank][input]`) and `B` transposed (`[rank][output]`), scaled by α/r and with its
/// output columns in the GGUF's row order, as f16 bits: the layout the backend's `lora_add` reads. (PEFT adapters
/// are trained and shipped in 16-bit floats; f16 keeps α/r·B's small values to 11 significant bits.)
struct LoraPair {
    a: Vec<u16>,
    bt: Vec<u16>,
}

/// `values` as f16 bits, or an error naming `tensor` when one is not finite in f16.
fn f16_finite(tensor: &str, values: impl Iterator<Item = f32>) -> Result<Vec<u16>, String> {
    values
        .map(|v| {
            let h = half::f16::from_f32(v);
            if h.is_finite() {
                Ok(h.to_bits())
            } else {
                Err(format!("{tensor}: value {v} is not finite in f16 once scaled by lora_alpha / r"))
            }
        })
        .collect()
}

fn f16_value(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// A loaded LoRA adapter. Cheap to share (`Arc`); immutable once loaded.
pub struct LoraAdapter {
    name: String,
    cache_id: String,
    rank: usize,
    scale: f32,
    targets: Vec<LoraTarget>,
    /// `[layer][LoraTarget::index]`.
    layers: Vec<[Option<LoraPair>; 7]>,
}

impl fmt::Debug for LoraAdapter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoraAdapter")
            .field("name", &self.name)
            .field("cache_id", &self.cache_id)
            .field("rank", &self.rank)
            .field("scale", &self.scale)
            .field("targets", &self.targets)
            .finish()
    }
}

fn lora_err(msg: impl Into<String>) -> ModelError {
    ModelError::Lora(msg.into())
}

/// Whether `name` may name an adapter: 1 to [`MAX_LORA_NAME`] characters of `[A-Za-z0-9._:/-]`, so that it is a
/// valid OpenAI model id and never contains the separator [`cache_namespace`] uses. The error says so; the CLI,
/// the worker's registry and the router's admin endpoint all give it.
pub fn check_lora_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= MAX_LORA_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'/' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(format!("adapter name {name:?}: expected 1 to {MAX_LORA_NAME} characters of [A-Za-z0-9._:/-]"))
    }
}

/// The namespace a request of `namespace` hashes its blocks in when it runs with the adapter `cache_id`: the
/// adapter's KV differs from the base model's for the same tokens, so its chain must too. The separator (a NUL)
/// appears in no tenant name and no adapter name, so no two pairs give the same string. Routers compute the same.
pub fn cache_namespace(namespace: &str, cache_id: &str) -> String {
    crate::cache::salted_namespace(namespace, "lora", cache_id)
}

impl LoraAdapter {
    /// Loads the PEFT adapter in `dir` for a model of shape `cfg`, refusing ranks above `max_rank`. The files may
    /// lead anywhere (an operator's `--lora NAME=DIR`, e.g. a Hugging Face cache snapshot whose files link to its
    /// blobs), but must be regular files.
    pub fn load(name: &str, dir: &Path, cfg: &ModelConfig, max_rank: usize) -> Result<LoraAdapter, ModelError> {
        LoraAdapter::load_within(name, dir, None, cfg, max_rank)
    }

    /// [`LoraAdapter::load`], and with `root` (canonical) the files must also lie inside it once symlinks are
    /// resolved: run-time loads name directories under `--lora-dir`, and a link inside one must not lead out.
    pub fn load_within(
        name: &str,
        dir: &Path,
        root: Option<&Path>,
        cfg: &ModelConfig,
        max_rank: usize,
    ) -> Result<LoraAdapter, ModelError> {
        check_lora_name(name).map_err(lora_err)?;
        let config_bytes = read_bounded(&dir.join("adapter_config.json"), root, MAX_CONFIG_BYTES)?;
        let config: Value = serde_json::from_slice(&config_bytes)
            .map_err(|e| lora_err(format!("{name}: adapter_config.json is not JSON: {e}")))?;
        let options = PeftOptions::parse(&config, max_rank).map_err(|e| lora_err(format!("{name}: {e}")))?;
        let weights = read_bounded(&dir.join("adapter_model.safetensors"), root, MAX_WEIGHTS_BYTES)?;
        let tensors = safetensors::SafeTensors::deserialize(&weights)
            .map_err(|e| lora_err(format!("{name}: adapter_model.safetensors: {e}")))?;
        let mut found: HashMap<String, Tensor> = HashMap::new();
        for (tensor_name, view) in tensors.tensors() {
            let values = tensor_values(&tensor_name, &view).map_err(|e| lora_err(format!("{name}: {e}")))?;
            found.insert(tensor_name.clone(), Tensor { shape: view.shape().to_vec(), values });
        }
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&weights);
        hasher.update(&options.scale.to_le_bytes());
        let cache_id = format!("{name}@{:016x}", hasher.digest());
        LoraAdapter::from_tensors(name, cache_id, cfg, &options, found).map_err(|e| lora_err(format!("{name}: {e}")))
    }

    fn from_tensors(
        name: &str,
        cache_id: String,
        cfg: &ModelConfig,
        options: &PeftOptions,
        mut found: HashMap<String, Tensor>,
    ) -> Result<LoraAdapter, String> {
        let rank = options.rank;
        let mut layers: Vec<[Option<LoraPair>; 7]> = (0..cfg.n_layers).map(|_| Default::default()).collect();
        let mut pairs = 0;
        for (li, layer) in layers.iter_mut().enumerate() {
            for &target in &options.targets {
                let (a_name, b_name) = (target.tensor_name(li, false), target.tensor_name(li, true));
                let (a, b) = match (found.remove(&a_name), found.remove(&b_name)) {
                    (Some(a), Some(b)) => (a, b),
                    (None, None) => continue, // PEFT's layers_to_transform leaves blocks out.
                    _ => return Err(format!("{a_name} and {b_name} must both be present")),
                };
                let (input, output) = target.dims(cfg);
                // The element counts alone would take a transposed matrix (`[in, r]` for `A`) and compute garbage.
                if a.shape != [rank, input] {
                    return Err(format!("{a_name}: shape {:?}, expected [{rank}, {input}] ([r, in])", a.shape));
                }
                if b.shape != [output, rank] {
                    return Err(format!("{b_name}: shape {:?}, expected [{output}, {rank}] ([out, r])", b.shape));
                }
                // Checked after scaling and in f16, the form the kernel reads: a value finite in the file can
                // still overflow f16 (65504) once multiplied by α/r, and an infinity there makes every logit NaN.
                let a = f16_finite(&a_name, a.values.into_iter())?;
                let mut b: Vec<f32> = b.values.into_iter().map(|x| x * options.scale).collect();
                match target {
                    LoraTarget::Q => b = permute_rope_rows(&b, cfg.n_heads, cfg.head_dim, rank),
                    LoraTarget::K => b = permute_rope_rows(&b, cfg.n_kv_heads, cfg.head_dim, rank),
                    _ => {}
                }
                let b = f16_finite(&b_name, b.into_iter())?;
                let mut bt = vec![0u16; rank * output];
                for (o, row) in b.chunks_exact(rank).enumerate() {
                    for (j, &v) in row.iter().enumerate() {
                        bt[j * output + o] = v;
                    }
                }
                layer[target.index()] = Some(LoraPair { a, bt });
                pairs += 1;
            }
        }
        if let Some(extra) = found.keys().min() {
            return Err(format!(
                "tensor {extra:?} is not a LoRA A/B of a target module of this {}-layer model",
                cfg.n_layers
            ));
        }
        if pairs == 0 {
            return Err("no LoRA tensors".into());
        }
        Ok(LoraAdapter {
            name: name.to_string(),
            cache_id,
            rank,
            scale: options.scale,
            targets: options.targets.clone(),
            layers,
        })
    }

    /// The name requests use.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Name and weight hash: salts the adapter's block hashes ([`cache_namespace`]).
    pub fn cache_id(&self) -> &str {
        &self.cache_id
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// α/r (α/√r under rsLoRA).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The projections it changes.
    pub fn targets(&self) -> &[LoraTarget] {
        &self.targets
    }

    fn pair(&self, layer: usize, target: LoraTarget) -> Option<&LoraPair> {
        self.layers.get(layer).and_then(|l| l[target.index()].as_ref())
    }

    /// `ΔW` of `target` in block `layer` as a dense `[output][input]` matrix (in the GGUF's row order), or `None`
    /// when the adapter leaves it alone. Merging adapters into f32 weights (the reference tests) uses it.
    pub fn delta(&self, layer: usize, target: LoraTarget, cfg: &ModelConfig) -> Option<Vec<f32>> {
        let pair = self.pair(layer, target)?;
        let (input, output) = target.dims(cfg);
        let mut out = vec![0.0f32; output * input];
        for (o, row) in out.chunks_exact_mut(input).enumerate() {
            for j in 0..self.rank {
                let bj = f16_value(pair.bt[j * output + o]);
                for (w, &aj) in row.iter_mut().zip(&pair.a[j * input..(j + 1) * input]) {
                    *w += bj * f16_value(aj);
                }
            }
        }
        Some(out)
    }
}

/// Reorders the rows of a Hugging Face q/k projection's `B` (`[heads·head_dim][rank]`) the way llama.cpp's converter
/// reordered Wq and Wk: within each head, row `half·(head_dim/2) + j` moves to `2j + half`.
fn permute_rope_rows(b: &[f32], heads: usize, head_dim: usize, rank: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0f32; b.len()];
    for h in 0..heads {
        for side in 0..2 {
            for j in 0..half {
                let from = h * head_dim + side * half + j;
                let to = h * head_dim + 2 * j + side;
                out[to * rank..(to + 1) * rank].copy_from_slice(&b[from * rank..(from + 1) * rank]);
            }
        }
    }
    out
}

/// The bytes of the regular file `path`, which with `root` must lie inside it once symlinks are resolved, and at
/// most `limit` of them. The type is checked before opening, since opening a FIFO blocks until a writer comes (with
/// the registry's one-load lock held) and a device such as /dev/zero reports length 0 but never ends; the read is
/// bounded too, for a file that grows or is swapped after the check.
fn read_bounded(path: &Path, root: Option<&Path>, limit: u64) -> Result<Vec<u8>, ModelError> {
    let io = |source| ModelError::Io { path: path.display().to_string(), source };
    let canonical = path.canonicalize().map_err(io)?;
    if let Some(root) = root
        && !canonical.starts_with(root)
    {
        return Err(lora_err(format!("{}: leads outside the worker's --lora-dir", path.display())));
    }
    let not_regular = || lora_err(format!("{}: not a regular file", path.display()));
    let checked = std::fs::metadata(&canonical).map_err(io)?;
    if !checked.is_file() {
        return Err(not_regular());
    }
    let too_large = |len: u64| lora_err(format!("{}: {len} bytes, more than the {limit} allowed", path.display()));
    if checked.len() > limit {
        return Err(too_large(checked.len()));
    }
    let file = open_nonblocking(&canonical).map_err(io)?;
    // The file opened must be the one checked: a swap in between (by whoever can write the directory) could
    // otherwise substitute another file, and a FIFO swapped in would block a plain open until a writer came.
    let opened = file.metadata().map_err(io)?;
    if !opened.is_file() || !same_file(&checked, &opened) {
        return Err(not_regular());
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Opens `path` for reading without waiting on it: a FIFO opens at once instead of blocking until a writer comes
/// (the caller then refuses it); a regular file reads as it would anyway.
#[cfg(unix)]
fn open_nonblocking(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::File::open(path)
}

#[cfg(unix)]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

#[cfg(not(unix))]
fn same_file(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    true
}

fn tensor_values(name: &str, view: &safetensors::tensor::TensorView<'_>) -> Result<Vec<f32>, String> {
    use safetensors::Dtype;
    let bytes = view.data();
    let values: Vec<f32> = match view.dtype() {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(format!("tensor {name:?} has dtype {other:?}; expected F32, F16 or BF16")),
    };
    if view.shape().len() != 2 {
        return Err(format!("tensor {name:?} has shape {:?}; expected a matrix", view.shape()));
    }
    if values.iter().any(|v| !v.is_finite()) {
        return Err(format!("tensor {name:?} holds a non-finite value"));
    }
    Ok(values)
}

/// What `adapter_config.json` says that changes the math, checked.
struct PeftOptions {
    rank: usize,
    scale: f32,
    targets: Vec<LoraTarget>,
}

impl PeftOptions {
    fn parse(config: &Value, max_rank: usize) -> Result<PeftOptions, String> {
        let obj = config.as_object().ok_or("adapter_config.json is not an object")?;
        if let Some(kind) = obj.get("peft_type").and_then(Value::as_str)
            && kind != "LORA"
        {
            return Err(format!("peft_type {kind:?}: only LORA adapters are served"));
        }
        let rank = obj.get("r").and_then(Value::as_u64).ok_or("`r` (the rank) must be a positive integer")?;
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        if rank == 0 || rank > max_rank {
            return Err(format!("rank {rank} is outside 1..={max_rank} (--max-lora-rank)"));
        }
        // PEFT's default lora_alpha is 8.
        let alpha = match obj.get("lora_alpha") {
            None | Some(Value::Null) => 8.0,
            Some(v) => v.as_f64().ok_or("`lora_alpha` must be a number")?,
        };
        if !(alpha.is_finite() && alpha > 0.0 && alpha <= 1e6) {
            return Err(format!("lora_alpha {alpha} must be in (0, 1e6]"));
        }
        let flag = |key: &str| obj.get(key).and_then(Value::as_bool).unwrap_or(false);
        for refused in ["use_dora", "fan_in_fan_out"] {
            if flag(refused) {
                return Err(format!("`{refused}: true` is not supported"));
            }
        }
        if let Some(bias) = obj.get("bias").and_then(Value::as_str)
            && bias != "none"
        {
            return Err(format!("bias {bias:?}: only \"none\" is supported"));
        }
        for refused in ["rank_pattern", "alpha_pattern"] {
            if obj.get(refused).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
                return Err(format!("per-module ranks or alphas (`{refused}`) are not supported"));
            }
        }
        if obj.get("modules_to_save").and_then(Value::as_array).is_some_and(|m| !m.is_empty()) {
            return Err("`modules_to_save` (fully trained extra modules) is not supported".into());
        }
        let modules: Vec<&str> = match obj.get("target_modules") {
            Some(Value::Array(list)) => {
                list.iter().map(|m| m.as_str().ok_or("target_modules must be strings")).collect::<Result<_, _>>()?
            }
            Some(Value::String(one)) if one == "all-linear" => LoraTarget::ALL.iter().map(|t| t.module()).collect(),
            Some(Value::String(one)) => vec![one.as_str()],
            _ => return Err("`target_modules` must list the adapted modules".into()),
        };
        let mut targets = Vec::new();
        for m in modules {
            let t = LoraTarget::from_module(m).ok_or_else(|| {
                format!(
                    "target module {m:?} is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
                )
            })?;
            if !targets.contains(&t) {
                targets.push(t);
            }
        }
        if targets.is_empty() {
            return Err("`target_modules` is empty".into());
        }
        let scale = if flag("use_rslora") { alpha / (rank as f64).sqrt() } else { alpha / rank as f64 };
        Ok(PeftOptions { rank, scale: scale as f32, targets })
    }
}

/// Rows `[start, end)` of a step's batch that run with one adapter.
pub(super) type AdapterRun<'a> = (usize, usize, &'a LoraAdapter);

/// The step's runs of consecutive sequences that share an adapter, in row order (sequences without one are left
/// out), into `runs`. A step computes them once for all its projections.
pub(super) fn adapter_runs<'a>(seqs: &[ForwardSeq<'a>], runs: &mut Vec<AdapterRun<'a>>) {
    runs.clear();
    let mut row = 0;
    for s in seqs {
        let (start, end) = (row, row + s.tokens.len());
        row = end;
        let Some(adapter) = s.lora else { continue };
        match runs.last_mut() {
            Some((_, last_end, last)) if *last_end == start && std::ptr::eq(*last, adapter) => *last_end = end,
            _ => runs.push((start, end, adapter)),
        }
    }
}

/// Adds each run's adapter delta of `target` in block `layer` to its rows of `y` (`[rows][out_dim]`), computed
/// from `x` (`[rows][in_dim]`): one segment per run, all in one kernel call (so a batch of sequences on different
/// adapters is split across the pool together). Rows outside the runs are left as the base matmul made them.
/// `segments` is a reused buffer.
pub(super) fn apply_lora<'a>(
    backend: &dyn Backend,
    runs: &[AdapterRun<'a>],
    (layer, target): (usize, LoraTarget),
    (x, in_dim): (&[f32], usize),
    (y, out_dim): (&mut [f32], usize),
    segments: &mut Vec<LoraSegment<'a>>,
) {
    segments.clear();
    segments.extend(runs.iter().filter_map(|&(start, end, adapter)| {
        let pair = adapter.pair(layer, target)?;
        Some(LoraSegment { rows: (start, end), a: &pair.a, bt: &pair.bt, rank: adapter.rank })
    }));
    if !segments.is_empty() {
        backend.lora_add(x, in_dim, y, out_dim, segments);
    }
}

/// What [`write_synthetic_peft`] writes.
#[derive(Debug, Clone)]
pub struct SyntheticLora {
    pub rank: usize,
    pub alpha: f32,
    pub targets: Vec<LoraTarget>,
    pub seed: u64,
    /// Standard deviation of `B`'s entries; `A`'s are uniform in ±1/√input (PEFT's Kaiming-uniform start).
    pub b_std: f32,
}

impl Default for SyntheticLora {
    fn default() -> SyntheticLora {
        SyntheticLora { rank: 8, alpha: 16.0, targets: LoraTarget::ALL.to_vec(), seed: 1, b_std: 0.02 }
    }
}

/// Writes a PEFT adapter of random weights for a model of shape `cfg` into `dir` (created if missing), in f32 and
/// Hugging Face row order, with a README saying it is synthetic. Its outputs mean nothing: it exists so that tests
/// and benchmarks exercise the real loading and serving path without a trained adapter for this model.
pub fn write_synthetic_peft(dir: &Path, cfg: &ModelConfig, spec: &SyntheticLora) -> Result<(), ModelError> {
    use rand::{Rng, SeedableRng};
    if spec.rank == 0 || spec.rank > MAX_LORA_RANK {
        return Err(lora_err(format!("rank {} is outside 1..={MAX_LORA_RANK}", spec.rank)));
    }
    let io = |source| ModelError::Io { path: dir.display().to_string(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in 0..cfg.n_layers {
        for &target in &spec.targets {
            let (input, output) = target.dims(cfg);
            let bound = 1.0 / (input as f32).sqrt();
            let a: Vec<f32> = (0..spec.rank * input).map(|_| rng.random_range(-bound..bound)).collect();
            // The sum of 12 uniforms is close to normal; scaled to the asked standard deviation.
            let b: Vec<f32> = (0..output * spec.rank)
                .map(|_| ((0..12).map(|_| rng.random::<f32>()).sum::<f32>() - 6.0) * spec.b_std)
                .collect();
            let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            tensors.push((target.tensor_name(layer, false), vec![spec.rank, input], bytes(&a)));
            tensors.push((target.tensor_name(layer, true), vec![output, spec.rank], bytes(&b)));
        }
    }
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| lora_err(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(metadata), &dir.join("adapter_model.safetensors"))
        .map_err(|e| lora_err(e.to_string()))?;
    let config = serde_json::json!({
        "peft_type": "LORA",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": spec.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "use_dora": false,
        "task_type": "CAUSAL_LM",
        "pagoda_synthetic": { "seed": spec.seed, "b_std": (f64::from(spec.b_std) * 1e6).round() / 1e6 },
    });
    let text = serde_json::to_string_pretty(&config).map_err(|e| lora_err(e.to_string()))?;
    std::fs::write(dir.join("adapter_config.json"), text).map_err(io)?;
    let readme = format!(
        "SYNTHETIC LoRA adapter written by `pagoda lora synth` (seed {}, rank {}, alpha {}): random weights, not \
         trained. Its outputs are meaningless; it exists to exercise adapter loading and serving.\n",
        spec.seed, spec.rank, spec.alpha
    );
    std::fs::write(dir.join("README.md"), readme).map_err(io)?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The model shape of the adapter tests (also the registry's, `crate::adapters`).
    pub(crate) fn tiny() -> ModelConfig {
        ModelConfig {
            arch: "llama".into(),
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            hidden: 32,
            ffn: 64,
            vocab: 100,
            ctx_len: 256,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
        }
    }

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("pagoda-lora-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn synthetic_adapters_load_back_with_their_scale_and_targets() {
        let (cfg, d) = (tiny(), dir("roundtrip"));
        let spec =
            SyntheticLora { rank: 4, alpha: 8.0, targets: vec![LoraTarget::Q, LoraTarget::Down], ..Default::default() };
        write_synthetic_peft(&d, &cfg, &spec).unwrap();
        let a = LoraAdapter::load("tiny", &d, &cfg, 16).unwrap();
        assert_eq!((a.rank(), a.scale(), a.targets()), (4, 2.0, &[LoraTarget::Q, LoraTarget::Down][..]));
        assert!(a.cache_id().starts_with("tiny@"));
        assert!(a.delta(0, LoraTarget::Q, &cfg).is_some() && a.delta(1, LoraTarget::V, &cfg).is_none());
        // The same weights give the same cache id; another seed another.
        assert_eq!(LoraAdapter::load("tiny", &d, &cfg, 16).unwrap().cache_id(), a.cache_id());
        write_synthetic_peft(&d, &cfg, &SyntheticLora { seed: 2, ..spec }).unwrap();
        assert_ne!(LoraAdapter::load("tiny", &d, &cfg, 16).unwrap().cache_id(), a.cache_id());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_delta_is_scale_times_b_a_with_q_rows_in_gguf_order() {
        let (cfg, d) = (tiny(), dir("delta"));
        let spec =
            SyntheticLora { rank: 2, alpha: 6.0, targets: vec![LoraTarget::Q, LoraTarget::V], ..Default::default() };
        write_synthetic_peft(&d, &cfg, &spec).unwrap();
        let bytes = std::fs::read(d.join("adapter_model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let get = |name: String| tensor_values(&name, &st.tensor(&name).unwrap()).unwrap();
        let adapter = LoraAdapter::load("t", &d, &cfg, 8).unwrap();
        for (target, heads) in [(LoraTarget::Q, cfg.n_heads), (LoraTarget::V, 0)] {
            let (a, b) = (get(target.tensor_name(1, false)), get(target.tensor_name(1, true)));
            let (input, output) = target.dims(&cfg);
            let delta = adapter.delta(1, target, &cfg).unwrap();
            for hf_row in 0..output {
                // Where llama.cpp's converter put this Hugging Face row.
                let row = if heads > 0 {
                    let (h, within) = (hf_row / cfg.head_dim, hf_row % cfg.head_dim);
                    let (side, j) = (within / (cfg.head_dim / 2), within % (cfg.head_dim / 2));
                    h * cfg.head_dim + 2 * j + side
                } else {
                    hf_row
                };
                for c in 0..input {
                    let want: f32 = (0..2).map(|j| b[hf_row * 2 + j] * a[j * input + c]).sum::<f32>() * 3.0;
                    // A and B are kept in f16: 2^-11 relative per factor, on terms below 0.1.
                    assert!((delta[row * input + c] - want).abs() < 2e-4, "{target:?} row {hf_row} col {c}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    fn write_config(d: &Path, config: Value) {
        std::fs::write(d.join("adapter_config.json"), config.to_string()).unwrap();
    }

    #[test]
    fn options_that_change_the_math_and_bad_files_are_refused_by_name() {
        let (cfg, d) = (tiny(), dir("refuse"));
        write_synthetic_peft(&d, &cfg, &SyntheticLora { rank: 4, ..Default::default() }).unwrap();
        let base = serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "all-linear"});
        assert!(LoraAdapter::load("ok", &d, &cfg, 4).is_ok());
        let cases: Vec<(Value, &str)> = vec![
            (serde_json::json!({"use_dora": true}), "use_dora"),
            (serde_json::json!({"fan_in_fan_out": true}), "fan_in_fan_out"),
            (serde_json::json!({"bias": "all"}), "bias"),
            (serde_json::json!({"rank_pattern": {"q_proj": 2}}), "rank_pattern"),
            (serde_json::json!({"modules_to_save": ["lm_head"]}), "modules_to_save"),
            (serde_json::json!({"target_modules": ["embed_tokens"]}), "embed_tokens"),
            (serde_json::json!({"peft_type": "IA3"}), "IA3"),
            (serde_json::json!({"r": 0}), "rank 0"),
            (serde_json::json!({"lora_alpha": -1}), "lora_alpha"),
            (serde_json::json!({"r": 2}), "expected [2,"),
        ];
        for (patch, want) in cases {
            let mut config = base.clone();
            for (k, v) in patch.as_object().unwrap() {
                config[k] = v.clone();
            }
            write_config(&d, config);
            let err = LoraAdapter::load("x", &d, &cfg, 4).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
        write_config(&d, base.clone());
        assert!(LoraAdapter::load("x", &d, &cfg, 2).unwrap_err().to_string().contains("--max-lora-rank"));
        assert!(LoraAdapter::load("bad name", &d, &cfg, 4).unwrap_err().to_string().contains("adapter name"));
        // A model of another shape does not take it.
        let other = ModelConfig { hidden: 48, ..tiny() };
        assert!(LoraAdapter::load("x", &d, &other, 4).unwrap_err().to_string().contains("expected [4, 48]"));
        std::fs::write(d.join("adapter_model.safetensors"), b"not safetensors").unwrap();
        assert!(LoraAdapter::load("x", &d, &cfg, 4).unwrap_err().to_string().contains("safetensors"));
        std::fs::write(d.join("adapter_config.json"), b"{").unwrap();
        assert!(LoraAdapter::load("x", &d, &cfg, 4).unwrap_err().to_string().contains("not JSON"));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Rewrites the adapter's safetensors with `edit` applied to each (name, shape, values).
    fn rewrite_weights(d: &Path, edit: impl Fn(&str, &mut Vec<usize>, &mut Vec<f32>)) {
        let bytes = std::fs::read(d.join("adapter_model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (name, view) in st.tensors() {
            let (mut shape, mut values) = (view.shape().to_vec(), tensor_values(&name, &view).unwrap());
            edit(&name, &mut shape, &mut values);
            tensors.push((name, shape, values.iter().flat_map(|x| x.to_le_bytes()).collect()));
        }
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, shape, data)| {
                (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap())
            })
            .collect();
        safetensors::tensor::serialize_to_file(views, None, &d.join("adapter_model.safetensors")).unwrap();
    }

    #[test]
    fn a_transposed_matrix_is_refused_by_shape() {
        let (cfg, d) = (tiny(), dir("transposed"));
        let spec = SyntheticLora { rank: 4, targets: vec![LoraTarget::Q], ..Default::default() };
        write_synthetic_peft(&d, &cfg, &spec).unwrap();
        // Same element count, [in, r] instead of [r, in].
        rewrite_weights(&d, |name, shape, _| {
            if name.ends_with("lora_A.weight") {
                shape.reverse();
            }
        });
        let err = LoraAdapter::load("x", &d, &cfg, 4).unwrap_err().to_string();
        assert!(err.contains("shape [32, 4], expected [4, 32] ([r, in])"), "{err}");
        write_synthetic_peft(&d, &cfg, &spec).unwrap();
        rewrite_weights(&d, |name, shape, _| {
            if name.ends_with("lora_B.weight") {
                shape.reverse();
            }
        });
        let err = LoraAdapter::load("x", &d, &cfg, 4).unwrap_err().to_string();
        assert!(err.contains("expected [32, 4] ([out, r])"), "{err}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn values_that_overflow_f16_once_scaled_are_refused() {
        let (cfg, d) = (tiny(), dir("overflow"));
        write_synthetic_peft(&d, &cfg, &SyntheticLora { rank: 1, targets: vec![LoraTarget::V], ..Default::default() })
            .unwrap();
        rewrite_weights(&d, |name, _, values| {
            if name.ends_with("lora_B.weight") {
                values.fill(0.1);
            }
        });
        // α/r = 1e6: B becomes 1e5, past f16's 65504.
        let config = serde_json::json!({"peft_type": "LORA", "r": 1, "lora_alpha": 1e6, "target_modules": ["v_proj"]});
        write_config(&d, config);
        let err = LoraAdapter::load("x", &d, &cfg, 4).unwrap_err().to_string();
        assert!(err.contains("lora_B.weight") && err.contains("not finite in f16"), "{err}");
        // A is stored in f16 unscaled, so a finite f32 above 65504 is refused too.
        write_config(
            &d,
            serde_json::json!({"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["v_proj"]}),
        );
        rewrite_weights(&d, |name, _, values| {
            if name.ends_with("lora_A.weight") {
                values[0] = 1e5;
            }
        });
        let err = LoraAdapter::load("x", &d, &cfg, 4).unwrap_err().to_string();
        assert!(err.contains("lora_A.weight") && err.contains("not finite in f16"), "{err}");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Runs `load` on another thread and fails the test if it has not returned within a few seconds, so that a
    /// regression to a blocking read fails rather than hangs.
    fn load_promptly(d: &Path, root: Option<&Path>) -> String {
        let (d, root) = (d.to_path_buf(), root.map(Path::to_path_buf));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(LoraAdapter::load_within("x", &d, root.as_deref(), &tiny(), 8).map(|_| ()));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(10)) {
            Ok(result) => result.unwrap_err().to_string(),
            Err(_) => panic!("loading the adapter did not return within 10 s"),
        }
    }

    #[cfg(unix)]
    #[test]
    fn only_regular_files_inside_the_root_are_read() {
        let (cfg, d) = (tiny(), dir("files"));
        write_synthetic_peft(&d, &cfg, &SyntheticLora { rank: 2, ..Default::default() }).unwrap();
        let root = d.canonicalize().unwrap();
        let weights = d.join("adapter_model.safetensors");
        assert!(LoraAdapter::load_within("x", &d, Some(&root), &cfg, 8).is_ok());

        // A device that reports length 0 and never ends.
        std::fs::remove_file(&weights).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &weights).unwrap();
        let err = load_promptly(&d, None);
        assert!(err.contains("not a regular file"), "{err}");
        let err = load_promptly(&d, Some(&root));
        assert!(err.contains("outside"), "{err}");

        // A FIFO without a writer: opening it would block.
        std::fs::remove_file(&weights).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&weights).status().unwrap();
        assert!(made.success());
        let err = load_promptly(&d, Some(&root));
        assert!(err.contains("not a regular file"), "{err}");
        // A FIFO swapped in between the type check and the open: the open itself returns at once, and what it
        // opened is then refused as not the file checked.
        let (fifo, (tx, rx)) = (weights.clone(), std::sync::mpsc::channel());
        std::thread::spawn(move || {
            let _ = tx.send(open_nonblocking(&fifo).and_then(|f| f.metadata()).map(|m| m.is_file()));
        });
        let opened = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("opening a FIFO did not block");
        assert!(!opened.unwrap(), "a FIFO is no regular file");

        // A regular adapter file outside the root, through a link.
        let outside = dir("files-outside");
        write_synthetic_peft(&outside, &cfg, &SyntheticLora { rank: 2, ..Default::default() }).unwrap();
        std::fs::remove_file(&weights).unwrap();
        std::os::unix::fs::symlink(outside.join("adapter_model.safetensors"), &weights).unwrap();
        let err = load_promptly(&d, Some(&root));
        assert!(err.contains("outside the worker's --lora-dir"), "{err}");
        // Without a root (an operator's --lora DIR) the link is followed.
        assert!(LoraAdapter::load("x", &d, &cfg, 8).is_ok());
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&outside);
    }

    #[test]
    fn cache_namespaces_differ_by_adapter_and_tenant() {
        let a = cache_namespace("t1", "x@1");
        assert_ne!(a, cache_namespace("t1", "x@2"));
        assert_ne!(a, cache_namespace("t2", "x@1"));
        assert_ne!(a, "t1");
        assert!(check_lora_name("org/sql-lora:v1").is_ok());
        assert!(check_lora_name("").is_err() && check_lora_name("a\u{0}b").is_err());
    }
}
