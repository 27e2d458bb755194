//! The GPU side of `pagoda bench kernels` (and the `cuda-bench` binary): device-to-device copy bandwidth, and
//! paged decode attention over an f16 [`CudaKv`], and dequantise-on-load decode attention over an encoded arena
//! ([`CudaEncodedKv`]) per codec, at the batch sizes and contexts asked for, timed with CUDA events.
//! Shapes, block tables and the result type are the CPU measurement's ([`crate::attention_bench`]).

use super::codecs::CudaEncodedKv;
use super::context::CudaContext;
use super::error::CudaError;
use super::kv::CudaKv;
use crate::attention_bench::{AttnBenchPoint, AttnBenchShape, arena_blocks, decode_seqs, scattered_tables};
use crate::codec::{Codec, EncodedKv};
use crate::paged::AttnSeq;
use cudarc::driver::CudaSlice;

/// Seconds per call of `f`, timed with CUDA events over enough repetitions to fill about `budget_ms`.
pub fn time_it(
    cx: &CudaContext,
    budget_ms: f32,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    let drv = cx.driver();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    for _ in 0..3 {
        f()?;
    }
    let (a, b) = (drv.new_event(flags)?, drv.new_event(flags)?);
    a.record(cx.stream())?;
    f()?;
    b.record(cx.stream())?;
    let one = a.elapsed_ms(&b)?.max(1e-3);
    let reps = ((budget_ms / one) as usize).clamp(5, 500);
    a.record(cx.stream())?;
    for _ in 0..reps {
        f()?;
    }
    b.record(cx.stream())?;
    Ok(f64::from(a.elapsed_ms(&b)?) / 1e3 / reps as f64)
}

/// Bytes read plus bytes written per second by a device-to-device copy of 1 GiB.
pub fn copy_bandwidth(cx: &CudaContext) -> Result<f64, CudaError> {
    let n = 1usize << 28;
    let src = cx.zeros::<f32>(n)?;
    let mut dst = cx.zeros::<f32>(n)?;
    let t = time_it(cx, 200.0, || Ok(cx.stream().memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * (n * 4) as f64 / t)
}

/// Paged decode attention over an f16 cache: one point per (batch, context), each sequence at `context` slots per
/// kv-head over scattered blocks of an arena sized for the largest point.
pub fn decode_attention(
    cx: &CudaContext,
    shape: &AttnBenchShape,
    batches: &[usize],
    contexts: &[usize],
) -> Result<Vec<AttnBenchPoint>, CudaError> {
    let (bs, hd, nkv, nh) = (shape.block_size, shape.head_dim, shape.n_kv_heads, shape.n_heads);
    let max_blocks = arena_blocks(shape, batches, contexts);
    let kv = CudaKv::new(cx, max_blocks, bs, hd)?;
    let scale = 1.0 / (hd as f32).sqrt();
    decode_points(cx, shape, "f16", batches, contexts, max_blocks, |seqs, q, out, b| {
        let mut plan = cx.plan_attention(&kv, seqs, b, nh, nkv)?;
        let t = time_it(cx, 100.0, || cx.run_attention(&mut plan, q, &kv, scale, out))?;
        Ok((t, plan.decode_kv_bytes()))
    })
}

/// Dequantise-on-load decode attention over an arena of `codec` blocks, the points and tables of
/// [`decode_attention`]. Every block of the arena is one random block encoded once (all slots filled), so the
/// arena is built without encoding millions of blocks; the kernel reads each block's own bytes all the same.
pub fn decode_attention_encoded(
    cx: &CudaContext,
    shape: &AttnBenchShape,
    codec: Codec,
    batches: &[usize],
    contexts: &[usize],
) -> Result<Vec<AttnBenchPoint>, CudaError> {
    let (bs, hd, nkv, nh) = (shape.block_size, shape.head_dim, shape.n_kv_heads, shape.n_heads);
    let max_blocks = arena_blocks(shape, batches, contexts);
    let invalid = |e: crate::codec::CodecError| CudaError::invalid("decode_attention_encoded", e.to_string());
    let block_len = codec.encoded_len(bs, hd).map_err(invalid)?;
    // A fixed pseudo-random block in [-1, 1): finite, with every code in use.
    let mut state = 0x9E37_79B9u32;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        (state as f32 / u32::MAX as f32) * 2.0 - 1.0
    };
    let (k, v): (Vec<f32>, Vec<f32>) = (0..bs * hd).map(|_| (next(), next())).unzip();
    let mut one = vec![0u8; block_len];
    codec.encode_block(bs, hd, &k, &v, &mut one).map_err(invalid)?;
    let mut host = EncodedKv::new(codec, max_blocks, bs, hd).map_err(invalid)?;
    for b in 0..max_blocks {
        host.load(b, &one).map_err(invalid)?;
    }
    let kv = CudaEncodedKv::from_host(cx, &host)?;
    drop(host);
    let scale = 1.0 / (hd as f32).sqrt();
    decode_points(cx, shape, codec.name(), batches, contexts, max_blocks, |seqs, q, out, b| {
        let mut plan = cx.plan_attention_encoded(&kv, seqs, b, nh, nkv)?;
        let t = time_it(cx, 100.0, || cx.run_attention_encoded(&mut plan, q, &kv, scale, out))?;
        Ok((t, plan.decode_kv_bytes()))
    })
}

/// One point per (batch, context): decode rows over scattered tables of a `max_blocks` arena, each timed by
/// `measure(seqs, q, out, batch)`, which returns the seconds per call and the K/V bytes one call reads.
fn decode_points(
    cx: &CudaContext,
    shape: &AttnBenchShape,
    format: &str,
    batches: &[usize],
    contexts: &[usize],
    max_blocks: usize,
    mut measure: impl FnMut(&[AttnSeq<'_>], &CudaSlice<f32>, &mut CudaSlice<f32>, usize) -> Result<(f64, usize), CudaError>,
) -> Result<Vec<AttnBenchPoint>, CudaError> {
    let (hd, nkv, nh) = (shape.head_dim, shape.n_kv_heads, shape.n_heads);
    let mut points = Vec::new();
    for &b in batches {
        for &ctx in contexts {
            let tables = scattered_tables(shape, b, ctx, max_blocks);
            let prior = vec![ctx - 1; nkv];
            let seqs = decode_seqs(&tables, &prior);
            let q = cx.zeros::<f32>(b * nh * hd)?;
            let mut out = cx.zeros::<f32>(b * nh * hd)?;
            let (seconds, kv_bytes) = measure(&seqs, &q, &mut out, b)?;
            points.push(AttnBenchPoint {
                format: format.into(),
                batch: b,
                context: ctx,
                kv_bytes,
                seconds,
                bytes_per_s: kv_bytes as f64 / seconds,
            });
        }
    }
    Ok(points)
}
