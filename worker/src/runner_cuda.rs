//! [`CudaRunner`] (feature `cuda`): the engine's [`ModelRunner`] on an NVIDIA GPU. The scheduler, block pool,
//! prefix cache, tiers and API are the CPU worker's; only the forward step runs on the device ([`CudaLlama`]), with
//! the KV cache in device memory under the same block tables.
//!
//! The host, disk and peer tiers copy block groups through [`GroupKv`]: the four compressing codecs encode and
//! decode on the GPU (`codecs.cu`), f16 groups move as packed blocks (`kv.cu`), and the other formats go through a
//! host copy of the group and the CPU codecs. The bytes are the CPU runner's, so a tier holds groups from either.
//!
//! The eviction policies run through [`PolicyKv`]: the scores come from the score kernels (`slot_norms`,
//! `anchor_cosine`, `unit_key_sum`, `window_scores` in `kv.cu`), the compactions are batched slot moves, and the
//! forward step copies the queries a policy captures back to the host ([`CapturedQueries`]). The policy logic is
//! the CPU's, unchanged. The CUDA attention kernels do not sum attention probabilities for H2O and KV-Compress
//! ([`ModelRunner::sums_attention`] is false), so those policies take the step's queries and score them with
//! `window_scores`: the same metric, one more pass over the keys.
//!
//! What the GPU runner does not serve yet, each refused at start-up with a clear error rather than run
//! differently: KV dtypes other than f16, bf16 CPU matmuls and EvicPress placement.

use std::cell::RefCell;
use std::ops::Range;

use pagoda_kernels::codec::validate_block;
use pagoda_kernels::cuda::codecs::GPU_CODECS;
use pagoda_kernels::cuda::{CudaContext, CudaError, CudaKv, ScoreEntry, SlotRange, WindowEntry};
use pagoda_kernels::scores::Window;
use pagoda_kernels::{KvDtype, KvStorage, decoded_magnitude_bound, scores};

use crate::cache::BlockId;
use crate::engine::{
    Device, EngineConfig, EngineError, EvictionIo, ModelInfo, ModelRunner, StepCaptures, StepSeq, TierPlacement,
    load_model, recycle_forward,
};
use crate::model::ForwardSeq;
use crate::model::cuda::CudaLlama;
use crate::model::llama::CapturedQueries;
use crate::policy::PolicyKv;
use crate::tiers::codec::{self, GroupKv};
use crate::tiers::{EncodedGroup, GroupCodec, TierError, fits_dtype, native};

/// The model on a GPU, driven by the engine thread.
pub struct CudaRunner {
    device: DeviceKv,
    /// The queries the last step captured for the eviction policies.
    captured: CapturedQueries,
    info: ModelInfo,
    batch: Vec<ForwardSeq<'static>>,
}

/// The model and its device arenas as the tiers ([`GroupKv`]) and the eviction policies ([`PolicyKv`]) see them.
/// A policy call cannot fail, so the first device error it meets is kept here and fails the step
/// ([`ModelRunner::take_error`]).
struct DeviceKv {
    model: CudaLlama,
    error: RefCell<Option<CudaError>>,
}

impl std::fmt::Debug for CudaRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRunner").field("model", &self.device.model).finish()
    }
}

/// Why `cfg` cannot run on the GPU runner, if it cannot.
fn unsupported(cfg: &EngineConfig) -> Option<String> {
    if cfg.kv_dtype != KvDtype::F16 {
        return Some(format!("the CUDA backend keeps its KV cache in f16; --kv-dtype {} is CPU-only", cfg.kv_dtype));
    }
    if cfg.bf16_matmuls {
        return Some("--bf16-matmuls is a CPU option".into());
    }
    if matches!(cfg.placement, TierPlacement::EvicPress(_)) {
        return Some(
            "--tier-placement evicpress profiles pruned copies with the eviction policies, which run on the CPU \
             backend only for now (lru and lru+CODEC placements run on the GPU)"
                .into(),
        );
    }
    None
}

impl CudaRunner {
    /// Opens the GPU of `cfg.device`, loads the model ([`load_model`]) and uploads it with an f16 KV arena of
    /// `info.num_blocks` blocks. The host copy of the weights is dropped once uploaded.
    pub fn load(cfg: &EngineConfig) -> Result<CudaRunner, EngineError> {
        let Device::Cuda(ordinal) = cfg.device else {
            return Err(EngineError::Config(format!("the CUDA runner cannot serve --device {}", cfg.device)));
        };
        if let Some(why) = unsupported(cfg) {
            return Err(EngineError::Config(why));
        }
        let cx = CudaContext::new(ordinal)
            .map_err(|e| EngineError::Config(format!("cannot start the CUDA backend on device {ordinal}: {e}")))?;
        tracing::info!(device = %cx.info().name, arch = %cx.info().arch, "CUDA backend ready");
        let (model, info) = load_model(cfg)?;
        let model = CudaLlama::new(cx, &model, info.num_blocks, cfg.block_size)
            .map_err(|e| EngineError::Model(format!("cannot upload the model to the GPU: {e}")))?;
        Ok(CudaRunner {
            device: DeviceKv { model, error: RefCell::new(None) },
            captured: CapturedQueries::default(),
            info,
            batch: Vec::new(),
        })
    }

    /// The GPU model (for benchmarks that report the device).
    pub fn model(&self) -> &CudaLlama {
        &self.device.model
    }

    /// Runs `step` over `seqs` as the model's batch (in the reused buffer) with the capture store.
    fn with_batch(
        &mut self,
        seqs: &[StepSeq<'_>],
        step: impl FnOnce(&mut CudaLlama, &[ForwardSeq<'_>], &mut CapturedQueries) -> Result<(), crate::model::ModelError>,
    ) -> Result<(), EngineError> {
        let mut batch = recycle_forward(std::mem::take(&mut self.batch));
        batch.extend(seqs.iter().map(StepSeq::forward_seq));
        let r = step(&mut self.device.model, &batch, &mut self.captured);
        self.batch = recycle_forward(batch);
        r.map_err(|e| EngineError::Forward(e.to_string()))
    }
}

impl ModelRunner for CudaRunner {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(&mut self, seqs: &[StepSeq<'_>], logits: &mut Vec<f32>) -> Result<(), EngineError> {
        self.with_batch(seqs, |model, batch, captured| model.forward(batch, logits, captured))
    }

    fn forward_greedy(
        &mut self,
        seqs: &[StepSeq<'_>],
        _scratch: &mut Vec<f32>,
        tokens: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        self.with_batch(seqs, |model, batch, captured| model.forward_greedy(batch, tokens, captured))
    }

    fn group_kv(&mut self) -> Option<&mut dyn GroupKv> {
        Some(&mut self.device)
    }

    fn eviction_io(&mut self) -> Option<EvictionIo<'_>> {
        Some(EvictionIo { kv: &mut self.device, captured: &self.captured })
    }

    fn sums_attention(&self) -> bool {
        false
    }

    fn take_error(&mut self) -> Option<EngineError> {
        self.device.error.get_mut().take().map(|e| EngineError::Forward(format!("device KV operation: {e}")))
    }
}

impl StepCaptures for CapturedQueries {
    fn captured_q(&self, seq: usize) -> &[f32] {
        self.of(seq)
    }

    fn attn_probs(&self, _seq: usize) -> Option<(&[f32], usize)> {
        None
    }
}

impl DeviceKv {
    /// Blocks `blocks` of the device arenas as a host f16 cache of `blocks.len()` blocks, in order.
    fn host_copy(&self, blocks: &[BlockId]) -> Result<KvStorage, TierError> {
        let (cx, kv) = self.model.kv();
        let (bs, hd) = (kv.block_size(), kv.head_dim());
        let packed = cx.read_blocks(kv, blocks).map_err(device_err)?;
        let mut host = KvStorage::with_dtype(blocks.len(), bs, hd, KvDtype::F16);
        let group =
            EncodedGroup { codec: native::codec_name(KvDtype::F16).to_owned(), bytes: halves_to_bytes(&packed) };
        let all: Vec<BlockId> = (0..blocks.len() as BlockId).collect();
        native::decode(&group, &mut host, &all)?;
        Ok(host)
    }

    /// `r`'s value, or `None` after keeping its error (the first one of the step).
    fn ok<T>(&self, op: &'static str, r: Result<T, CudaError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                let mut kept = self.error.borrow_mut();
                if kept.is_none() {
                    tracing::error!(op, error = %e, "device KV operation failed; the step fails");
                    *kept = Some(e);
                }
                None
            }
        }
    }

    fn block_size(&self) -> usize {
        self.model.kv().1.block_size()
    }

    /// KeyDiff's anchor from a sum of normalised keys over `len` slots, into `anchor`; then the cosine of every
    /// key of slots `0..len` with it into `out`.
    fn anchor_cosines(
        &self,
        table: &[u32],
        len: usize,
        sum: impl Iterator<Item = f64>,
        anchor: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let inv_len = 1.0 / len.max(1) as f64;
        anchor.clear();
        anchor.extend(sum.map(|a| (a * inv_len) as f32));
        if len == 0 {
            return;
        }
        let (cx, kv) = self.model.kv();
        match self.ok("anchor_cosine", cx.anchor_cosine(kv, &[ScoreEntry { table, len }], anchor)) {
            Some(s) => out[..len].copy_from_slice(&s.score[..len]),
            None => out[..len].fill(0.0),
        }
    }

    /// `Σ k / ‖k‖` over slots `slots` of `table` (zeros after a device error).
    fn unit_key_sum(&self, table: &[u32], slots: Range<usize>) -> Vec<f32> {
        let (cx, kv) = self.model.kv();
        let range = SlotRange { table, from: slots.start, to: slots.end };
        self.ok("unit_key_sums", cx.unit_key_sums(kv, &[range], scores::COSINE_EPS))
            .unwrap_or_else(|| vec![0.0; kv.head_dim()])
    }
}

/// The policies' scores from the GPU's score kernels (`kv.cu`), the moves as batched slot moves. Where the CPU
/// divides by kept norms (KeyDiff's), the kernels recompute them from the same keys: equal up to rounding.
impl PolicyKv for DeviceKv {
    fn key_norms(&self, table: &[u32], slots: Range<usize>, out: &mut [f32]) {
        if slots.is_empty() {
            return;
        }
        // Only the blocks holding `slots` are scored: a decode step's one new slot costs one block.
        let bs = self.block_size();
        let base = slots.start / bs * bs;
        let entry = ScoreEntry { table: &table[base / bs..], len: slots.end - base };
        let (cx, kv) = self.model.kv();
        match self.ok("key_norms", cx.slot_norms(kv, &[entry])) {
            Some(s) => out[slots.clone()].copy_from_slice(&s.knorm[slots.start - base..]),
            None => out[slots].fill(0.0),
        }
    }

    fn value_key_ratio(&self, table: &[u32], len: usize, out: &mut [f32]) {
        let mut one = [Vec::new()];
        self.value_key_ratios(&[(table, len)], &mut one);
        out[..len].copy_from_slice(&one[0]);
    }

    fn value_key_ratios(&self, entries: &[(&[u32], usize)], out: &mut [Vec<f32>]) {
        let list: Vec<ScoreEntry<'_>> =
            entries.iter().filter(|e| e.1 > 0).map(|&(table, len)| ScoreEntry { table, len }).collect();
        let (cx, kv) = self.model.kv();
        let scores = self.ok("value_key_ratio", cx.slot_norms(kv, &list));
        let mut next = 0;
        for (&(_, len), o) in entries.iter().zip(out) {
            o.clear();
            o.resize(len, 0.0);
            if len == 0 {
                continue;
            }
            if let Some(s) = &scores {
                let got = &s.score[s.offsets[next]..s.offsets[next + 1]];
                for (o, &r) in o.iter_mut().zip(got) {
                    // As in value_key_ratio: +inf (a zero key) ranks first with a finite stand-in.
                    *o = if r.is_finite() { r } else { f32::MAX };
                }
            }
            next += 1;
        }
    }

    fn keydiff_cosine(&self, table: &[u32], len: usize, anchor: &mut Vec<f32>, out: &mut [f32]) {
        let sum = self.unit_key_sum(table, 0..len);
        self.anchor_cosines(table, len, sum.into_iter().map(f64::from), anchor, out);
    }

    fn add_unit_keys(&self, table: &[u32], slots: Range<usize>, _norms: &[f32], sign: f64, unit_key_sum: &mut [f64]) {
        if slots.is_empty() {
            return;
        }
        for (a, x) in unit_key_sum.iter_mut().zip(self.unit_key_sum(table, slots)) {
            *a += sign * f64::from(x);
        }
    }

    fn keydiff_cosine_kept(
        &self,
        table: &[u32],
        len: usize,
        unit_key_sum: &[f64],
        _norms: &[f32],
        anchor: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        self.anchor_cosines(table, len, unit_key_sum.iter().copied(), anchor, out);
    }

    fn window_attention_scores(
        &self,
        table: &[u32],
        len: usize,
        window: Window<'_>,
        _probs: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let Window { q, n_q, group, scale, first_q_slot, power } = window;
        if len == 0 || n_q == 0 {
            return;
        }
        let (cx, kv) = self.model.kv();
        let entry = WindowEntry { table, len, q, n_q, first_q_slot };
        if let Some(s) = self.ok("window_scores", cx.window_attention_scores(kv, &[entry], group, scale, power)) {
            for (o, &x) in out[..len].iter_mut().zip(&s.score) {
                *o += x;
            }
        }
    }

    fn copy_block(&mut self, src: u32, dst: u32) {
        let (cx, kv) = self.model.kv_mut();
        let r = cx.copy_blocks(kv, &[(src, dst)]);
        self.ok("copy_blocks", r);
    }

    fn move_slot(&mut self, src: u32, src_slot: usize, dst: u32, dst_slot: usize) {
        let bs = self.block_size() as u32;
        let pair = (src * bs + src_slot as u32, dst * bs + dst_slot as u32);
        let (cx, kv) = self.model.kv_mut();
        let r = cx.move_slots(kv, &[pair]);
        self.ok("move_slots", r);
    }

    fn compact_table(&mut self, table: &[u32], _len: usize, keep: &[u32]) -> usize {
        let bs = self.block_size();
        let slot = |i: usize| table[i / bs] * bs as u32 + (i % bs) as u32;
        let pairs: Vec<(u32, u32)> = keep.iter().enumerate().map(|(i, &k)| (slot(k as usize), slot(i))).collect();
        let (cx, kv) = self.model.kv_mut();
        let r = cx.move_slots(kv, &pairs);
        self.ok("move_slots", r);
        keep.len()
    }
}

fn device_err(e: CudaError) -> TierError {
    TierError::Device(e.to_string())
}

/// A failed [`CudaContext::decode_blocks`] as a tier error. Only its argument checks (`Invalid`: the group's length,
/// headers, scales or codes) are the group's fault, which the engine answers by dropping the group. A driver call,
/// a launch or an allocation failing is the device's: the group is sound and stays in its tier. (A missing kernel
/// never gets here: [`kernel_missing`] sends the group through the host decoder instead.)
fn decode_blocks_err(codec: &str, e: CudaError) -> TierError {
    match e {
        CudaError::Invalid { .. } => {
            TierError::Corrupt { path: format!("<{codec} group>").into(), reason: e.to_string() }
        }
        e => device_err(e),
    }
}

/// Whether a failed device decode says only that this device has no kernel for the codec (its module did not
/// compile or load, or the shape has none), not that the group or the device is bad. Such a group decodes on the
/// host like a format the kernels never had: dropping it would lose a sound copy, and keeping it for the kernels
/// would fail every later onboard of it the same way.
fn kernel_missing(e: &CudaError) -> bool {
    matches!(e, CudaError::Unsupported(_) | CudaError::Compile { .. } | CudaError::Cache { .. })
}

/// Decodes `group` on the host (checked whole there) and moves it up as packed f16 blocks into `blocks`.
fn decode_on_host(
    cx: &CudaContext,
    kv: &mut CudaKv,
    group: &EncodedGroup,
    blocks: &[BlockId],
) -> Result<(), TierError> {
    let mut host = KvStorage::with_dtype(blocks.len(), kv.block_size(), kv.head_dim(), KvDtype::F16);
    let all: Vec<BlockId> = (0..blocks.len() as BlockId).collect();
    codec::decode(group, &mut host, &all)?;
    let packed = native::encode(&host, &all).bytes;
    let halves: Vec<u16> = packed.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
    cx.write_blocks(kv, blocks, &halves).map_err(device_err)
}

/// Packed f16 halves (the layout of [`CudaContext::read_blocks`]) as a native f16 group's bytes, and back.
fn halves_to_bytes(halves: &[u16]) -> Vec<u8> {
    halves.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl GroupKv for DeviceKv {
    fn native_codec(&self) -> GroupCodec {
        GroupCodec::Native(KvDtype::F16)
    }

    fn encode_group(&self, blocks: &[BlockId], codec: GroupCodec) -> Result<EncodedGroup, TierError> {
        let (cx, kv) = self.model.kv();
        match codec {
            GroupCodec::Kv(c) if GPU_CODECS.contains(&c) => {
                let full: Vec<(u32, usize)> = blocks.iter().map(|&b| (b, kv.block_size())).collect();
                let bytes = cx.encode_blocks(kv, c, &full).map_err(device_err)?;
                // The CPU encoder refuses non-finite KV; the kernels do not look, so the blocks are checked here
                // and such a group falls back to the native format as it would on the CPU.
                let len = bytes.len() / blocks.len().max(1);
                for blk in bytes.chunks_exact(len.max(1)) {
                    validate_block(blk).map_err(|e| TierError::Config(format!("encoding with {c}: {e}")))?;
                }
                Ok(EncodedGroup { codec: c.name().to_owned(), bytes })
            }
            GroupCodec::Native(KvDtype::F16) => {
                let packed = cx.read_blocks(kv, blocks).map_err(device_err)?;
                Ok(EncodedGroup { codec: native::codec_name(KvDtype::F16).to_owned(), bytes: halves_to_bytes(&packed) })
            }
            _ => {
                let all: Vec<BlockId> = (0..blocks.len() as BlockId).collect();
                codec::encode(&self.host_copy(blocks)?, &all, codec)
            }
        }
    }

    fn decode_group(&mut self, group: &EncodedGroup, blocks: &[BlockId]) -> Result<(), TierError> {
        let (cx, kv) = self.model.kv_mut();
        let (bs, hd) = (kv.block_size(), kv.head_dim());
        match group.codec.parse::<GroupCodec>()? {
            // decode_blocks validates every block (header, shape, scales, codes) before it launches, but its
            // kernel rounds into the f16 arena without looking: a block past f16's range is refused here, where
            // the CPU decoder would refuse it (`codec::decode`).
            GroupCodec::Kv(c) if GPU_CODECS.contains(&c) => {
                let corrupt =
                    |reason: String| TierError::Corrupt { path: format!("<{} group>", group.codec).into(), reason };
                let len = c.encoded_len(bs, hd).map_err(|e| corrupt(e.to_string()))?;
                for blk in group.bytes.chunks(len) {
                    let bound = decoded_magnitude_bound(blk).map_err(|e| corrupt(e.to_string()))?;
                    if !fits_dtype(KvDtype::F16, &[bound]) {
                        return Err(TierError::DoesNotFit { codec: group.codec.clone(), dtype: KvDtype::F16 });
                    }
                }
                match cx.decode_blocks(kv, c, &group.bytes, blocks) {
                    Err(e) if kernel_missing(&e) => {
                        tracing::debug!(codec = %group.codec, error = %e, "no device kernel; decoding on the host");
                        decode_on_host(cx, kv, group, blocks)
                    }
                    r => r.map_err(|e| decode_blocks_err(&group.codec, e)),
                }
            }
            // Every other format decodes on the host.
            _ => decode_on_host(cx, kv, group, blocks),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_the_gpu_runner_does_not_serve_are_refused_by_name() {
        let ok = EngineConfig { device: Device::Cuda(0), ..EngineConfig::default() };
        assert_eq!(unsupported(&ok), None);
        let f32_kv = EngineConfig { kv_dtype: KvDtype::F32, ..ok.clone() };
        assert!(unsupported(&f32_kv).is_some_and(|w| w.contains("f32")));
        let bf16 = EngineConfig { bf16_matmuls: true, ..ok.clone() };
        assert!(unsupported(&bf16).is_some_and(|w| w.contains("--bf16-matmuls")));
        let mut tiers = ok.clone();
        tiers.tiers.host_bytes = 1 << 20;
        assert_eq!(unsupported(&tiers), None);
        let evicpress = EngineConfig { placement: TierPlacement::EvicPress(Default::default()), ..tiers };
        assert!(unsupported(&evicpress).is_some_and(|w| w.contains("evicpress")));
        let cpu = EngineConfig::default();
        assert!(CudaRunner::load(&cpu).is_err_and(|e| e.to_string().contains("--device cpu")));
    }

    /// A group the kernels refuse is corrupt (dropped from its tier); any other failure of the decode is the
    /// device's and leaves the group where it is. (A `CudaError::Driver` cannot be built into a message without
    /// libcuda, so the device side is shown with the other variants a decode can return.)
    #[test]
    fn only_a_refused_group_is_corrupt_when_decoding_on_the_device() {
        let invalid = CudaError::Invalid { op: "decode_blocks", why: "block 0: bad scale".into() };
        let got = decode_blocks_err("int4_kivi", invalid);
        assert!(matches!(&got, TierError::Corrupt { reason, .. } if reason.contains("bad scale")), "{got:?}");
        for device in [CudaError::NoDevice(Some(0)), CudaError::Nccl("unhandled".into())] {
            assert!(!kernel_missing(&device), "{device}");
            let got = decode_blocks_err("int4_kivi", device);
            assert!(matches!(got, TierError::Device(_)), "{got:?}");
        }
    }

    /// A device without the codec's kernel (not compiled, not loaded, no shape for it) decodes the group on the
    /// host instead of failing it; a group the kernels refuse, or a device that fails, is not sent there.
    #[test]
    fn a_missing_kernel_sends_the_group_to_the_host_decoder() {
        for missing in [
            CudaError::Unsupported("kernel decode_int4_kivi is not loaded".into()),
            CudaError::Compile { module: "codecs", arch: "sm_90".into(), log: "error".into() },
            CudaError::Cache { path: "/tmp/ptx".into(), source: std::io::ErrorKind::PermissionDenied.into() },
        ] {
            assert!(kernel_missing(&missing), "{missing}");
        }
        for other in [
            CudaError::Invalid { op: "decode_blocks", why: "bad scale".into() },
            CudaError::NoDevice(None),
            CudaError::DriverUnavailable,
            CudaError::NcclTimeout { op: "recv" },
        ] {
            assert!(!kernel_missing(&other), "{other}");
        }
    }
}
