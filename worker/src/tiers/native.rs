//! The native group codecs: each block's K then V in the device cache's own element type, little-endian, blocks in
//! group order (`layer * n_kv_heads + head`). Lossless and cheap (a copy of what the arena holds), so they are the
//! fallback while no compressing codec is configured. The codec is named after the element type (`f16`, `f32`);
//! `native` is the name groups written before f16 caches existed carry (f32). A group is decoded into a cache of
//! either dtype, so a disk tier survives a restart with another `--kv-dtype`.

use pagoda_kernels::{KvArenas, KvDtype, KvStorage, codec};

#[cfg(test)]
use super::KV_MAGNITUDE_LIMIT;
use super::{EncodedGroup, TierError, fits_dtype};
use crate::cache::BlockId;

/// Codec name of groups written by f32 caches before the dtype was part of the name.
const LEGACY_F32: &str = "native";

/// Codec name of a cache's groups. The 8-bit caches get their own names: the kernels' `int8` and `fp8_e4m3` codecs
/// (compressing group codecs of the tiers) have other byte layouts (a header per block, fp8 one scale per block).
pub fn codec_name(dtype: KvDtype) -> &'static str {
    match dtype {
        KvDtype::F32 => "f32",
        KvDtype::F16 => "f16",
        KvDtype::Int8 => "native-int8",
        KvDtype::Fp8 => "native-fp8_e4m3",
        KvDtype::Fp8Rotated => "native-fp8_e4m3_rotated",
    }
}

/// The dtype whose native groups carry `name`, if any.
pub fn dtype_of(name: &str) -> Option<KvDtype> {
    match name {
        LEGACY_F32 => Some(KvDtype::F32),
        _ => KvDtype::ALL.into_iter().find(|&d| codec_name(d) == name),
    }
}

/// Encoded size of a group of `n_blocks` blocks of `block_size` slots × `head_dim` elements of `dtype` each.
pub fn group_bytes(n_blocks: usize, block_size: usize, head_dim: usize, dtype: KvDtype) -> usize {
    n_blocks * 2 * block_size * dtype.slot_bytes(head_dim)
}

/// Bytes of one half (K or V) of one block in the native layout: the elements, then (8-bit) the slots' scales.
fn half_bytes(block_size: usize, head_dim: usize, dtype: KvDtype) -> usize {
    block_size * dtype.slot_bytes(head_dim)
}

/// Encodes blocks `blocks` of `kv` in its own dtype: per block K then V, each the block's elements in slot order
/// (little-endian), 8-bit codes followed by the block's f32 slot scales.
pub fn encode(kv: &KvStorage, blocks: &[BlockId]) -> EncodedGroup {
    let (bs, bl) = (kv.block_size(), kv.block_len());
    let mut bytes = Vec::with_capacity(group_bytes(blocks.len(), bs, kv.head_dim(), kv.dtype()));
    let arenas = kv.arenas_any();
    for &b in blocks {
        let r = b as usize * bl..(b as usize + 1) * bl;
        match arenas {
            KvArenas::F32 { k, v } => {
                for x in k[r.clone()].iter().chain(&v[r]) {
                    bytes.extend_from_slice(&x.to_le_bytes());
                }
            }
            KvArenas::F16 { k, v } => {
                for x in k[r.clone()].iter().chain(&v[r]) {
                    bytes.extend_from_slice(&x.to_le_bytes());
                }
            }
            KvArenas::Scaled { k, v, k_scale, v_scale, .. } => {
                let slots = b as usize * bs..(b as usize + 1) * bs;
                for (codes, scales) in [(&k[r.clone()], &k_scale[slots.clone()]), (&v[r.clone()], &v_scale[slots])] {
                    bytes.extend_from_slice(codes);
                    for x in scales {
                        bytes.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
    }
    EncodedGroup { codec: codec_name(kv.dtype()).to_owned(), bytes }
}

/// Decodes `group` into blocks `blocks` of `kv`, converting when the group's dtype is not the cache's (an f16 or
/// 8-bit group into a cache of its dtype is copied as is, so a restore is bit-exact). Checks the codec, the exact
/// length, every 8-bit scale, (fp8) every code and every value's magnitude ([`fits_dtype`]) first, so a group from a
/// different model shape, corrupt scales, NaN codes or values too large to compute on are refused instead of
/// half-written.
pub fn decode(group: &EncodedGroup, kv: &mut KvStorage, blocks: &[BlockId]) -> Result<(), TierError> {
    let dtype = dtype_of(&group.codec).ok_or_else(|| TierError::UnknownCodec(group.codec.clone()))?;
    let (bs, hd, bl) = (kv.block_size(), kv.head_dim(), kv.block_len());
    let expected = group_bytes(blocks.len(), bs, hd, dtype);
    if group.bytes.len() != expected {
        return Err(TierError::BadLength { codec: group.codec.clone(), expected, got: group.bytes.len() });
    }
    if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= kv.num_blocks()) {
        return Err(TierError::BadLength { codec: group.codec.clone(), expected: kv.num_blocks(), got: bad as usize });
    }
    let half = half_bytes(bs, hd, dtype);
    let corrupt = |reason: &str| TierError::Corrupt {
        path: std::path::PathBuf::from(format!("<{} group>", group.codec)),
        reason: reason.into(),
    };
    // A float group has no scale to validate, and its values go into the cache as they are: an infinity or a NaN
    // (a peer's checksum proves only that the bytes arrived as sent) would poison every attention row reading it.
    if !dtype.slot_scaled() && has_non_finite(dtype, &group.bytes) {
        return Err(corrupt("non-finite element"));
    }
    if dtype.slot_scaled() {
        // Halves alternate K, V; only keys are rotated, and their inverse rotation grows what a code decodes to.
        let top = |i: usize| {
            if dtype.is_e4m3() {
                codec::max_e4m3_magnitude(dtype.rotates_keys() && i.is_multiple_of(2), hd)
            } else {
                codec::I8_MAX_CODE
            }
        };
        let bad_scale = group.bytes.chunks_exact(half).enumerate().any(|(i, h)| {
            h[bl..].chunks_exact(4).any(|c| !codec::valid_scale(f32::from_le_bytes([c[0], c[1], c[2], c[3]]), top(i)))
        });
        if bad_scale {
            return Err(corrupt("negative or non-finite slot scale, or one that overflows a code"));
        }
        // e4m3fn's only non-finite codes (S.1111.111) are NaN; the writer never produces them.
        if dtype.is_e4m3() && group.bytes.chunks_exact(half).any(|h| h[..bl].iter().any(|&c| c & 0x7F == 0x7F)) {
            return Err(corrupt("e4m3 NaN code"));
        }
        // Int8 slots are quantised symmetrically, clamped to ±127: a -128 code is a corrupt byte.
        if !dtype.is_e4m3() && group.bytes.chunks_exact(half).any(|h| h[..bl].contains(&codec::I8_NEVER_WRITTEN)) {
            return Err(corrupt("int8 code -128"));
        }
    }
    let (mut k, mut v) = (vec![0.0f32; bl], vec![0.0f32; bl]);
    // Values past what the arena holds (f16's range) or computes on (`KV_MAGNITUDE_LIMIT`) would come out as
    // infinities or NaN: the whole group is checked before anything is written.
    if !group_fits(dtype, kv.dtype(), hd, half, &group.bytes, &mut k) {
        return Err(TierError::DoesNotFit { codec: group.codec.clone(), dtype: kv.dtype() });
    }
    let raw = dtype.slot_scaled() && kv.dtype() == dtype;
    let (mut codes, mut scales) =
        if raw { (vec![0u8; 2 * bl], vec![0.0f32; 2 * bs]) } else { (Vec::new(), Vec::new()) };
    for (&b, block) in blocks.iter().zip(group.bytes.chunks_exact(2 * half)) {
        let (kb, vb) = block.split_at(half);
        if dtype == KvDtype::F16 && kv.dtype() == KvDtype::F16 {
            kv.write_block_f16_le(b, kb, vb);
            continue;
        }
        if raw {
            let (kc, vc) = codes.split_at_mut(bl);
            let (ks, vs) = scales.split_at_mut(bs);
            split_scaled(kb, kc, ks);
            split_scaled(vb, vc, vs);
            kv.write_block_scaled(b, kc, ks, vc, vs);
            continue;
        }
        widen_block(dtype, hd, kb, vb, &mut k, &mut v);
        kv.write_block(b, &k, &v);
    }
    Ok(())
}

/// Whether every value of a group of `dtype` (its length, scales and codes already checked) fits an arena of
/// `arena` ([`fits_dtype`]), each block half of `half` bytes widened into `scratch` only where it has to be. An f16
/// group fits every arena. An unrotated 8-bit slot's largest value is its largest code times its scale (the scale
/// is finite and non-negative, so the product grows with the code). A rotated key slot's values are bounded by its
/// length (the inverse rotation is orthonormal; twice it covers the rotation's rounding): only a half where that
/// bound does not settle it is widened and rotated back.
fn group_fits(dtype: KvDtype, arena: KvDtype, head_dim: usize, half: usize, bytes: &[u8], scratch: &mut [f32]) -> bool {
    if dtype == KvDtype::F16 {
        return true;
    }
    for (i, h) in bytes.chunks_exact(half).enumerate() {
        let rotated_keys = dtype.rotates_keys() && i.is_multiple_of(2);
        if dtype.slot_scaled() {
            let (codes, scales) = h.split_at(scratch.len());
            let slots_fit = codes.chunks_exact(head_dim).zip(scales.chunks_exact(4)).all(|(slot, s)| {
                let top = if rotated_keys {
                    2.0 * slot.iter().map(|&c| dtype.widen_code(c).powi(2)).sum::<f32>().sqrt()
                } else {
                    slot.iter().map(|&c| dtype.widen_code(c).abs()).fold(0.0f32, f32::max)
                };
                fits_dtype(arena, &[top * f32::from_le_bytes([s[0], s[1], s[2], s[3]])])
            });
            if slots_fit {
                continue;
            }
            if !rotated_keys {
                return false;
            }
        }
        widen(dtype, head_dim, h, scratch);
        if rotated_keys {
            scratch.chunks_exact_mut(head_dim).for_each(pagoda_kernels::codec::hadamard_rotate);
        }
        if !fits_dtype(arena, scratch) {
            return false;
        }
    }
    true
}

/// Whether a float group's bytes (`F32` or `F16`, little-endian) hold an infinity or a NaN: their exponent bits are
/// all set. Read from the bits, so the check costs one pass over the bytes and no widening.
fn has_non_finite(dtype: KvDtype, bytes: &[u8]) -> bool {
    match dtype {
        // Counted, not searched with `any`: a branch-free count vectorises, and a valid group is read whole anyway.
        KvDtype::F32 => {
            bytes
                .chunks_exact(4)
                .map(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7F80_0000 == 0x7F80_0000) as usize)
                .sum::<usize>()
                > 0
        }
        KvDtype::F16 => {
            bytes.chunks_exact(2).map(|c| (u16::from_le_bytes([c[0], c[1]]) & 0x7C00 == 0x7C00) as usize).sum::<usize>()
                > 0
        }
        KvDtype::Int8 | KvDtype::Fp8 | KvDtype::Fp8Rotated => false,
    }
}

/// One block of `dtype` (its K and V halves) as the f32 values the cache reads: keys rotated back.
fn widen_block(dtype: KvDtype, head_dim: usize, kb: &[u8], vb: &[u8], k: &mut [f32], v: &mut [f32]) {
    widen(dtype, head_dim, kb, k);
    widen(dtype, head_dim, vb, v);
    if dtype.rotates_keys() {
        // The normalised transform is its own inverse.
        k.chunks_exact_mut(head_dim).for_each(pagoda_kernels::codec::hadamard_rotate);
    }
}

/// One 8-bit block half (codes, then little-endian slot scales) into its codes and scales.
fn split_scaled(src: &[u8], codes: &mut [u8], scales: &mut [f32]) {
    let (c, s) = src.split_at(codes.len());
    codes.copy_from_slice(c);
    for (d, x) in scales.iter_mut().zip(s.chunks_exact(4)) {
        *d = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
    }
}

/// One block half of `dtype` in `src` (little-endian; 8-bit codes then slot scales) as f32.
fn widen(dtype: KvDtype, head_dim: usize, src: &[u8], out: &mut [f32]) {
    match dtype {
        KvDtype::F32 => {
            for (d, s) in out.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        KvDtype::F16 => {
            for (d, s) in out.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        KvDtype::Int8 | KvDtype::Fp8 | KvDtype::Fp8Rotated => {
            let (codes, scales) = src.split_at(out.len());
            for ((o, c), s) in
                out.chunks_exact_mut(head_dim).zip(codes.chunks_exact(head_dim)).zip(scales.chunks_exact(4))
            {
                let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                for (o, &c) in o.iter_mut().zip(c) {
                    *o = dtype.widen_code(c) * s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(dtype: KvDtype) -> KvStorage {
        let mut kv = KvStorage::with_dtype(6, 4, 3, dtype);
        for b in 0..6u32 {
            let k: Vec<f32> = (0..12).map(|i| b as f32 * 100.0 + i as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            kv.write_block(b, &k, &v);
        }
        kv
    }

    fn block(kv: &KvStorage, b: u32) -> (Vec<f32>, Vec<f32>) {
        let (mut k, mut v) = (vec![0.0; kv.block_len()], vec![0.0; kv.block_len()]);
        kv.read_block(b, &mut k, &mut v);
        (k, v)
    }

    #[test]
    fn round_trips_and_refuses_bad_shapes() {
        for dtype in KvDtype::ALL {
            let mut kv = filled(dtype);
            let g = encode(&kv, &[1, 4]);
            assert_eq!(g.codec, codec_name(dtype));
            assert_eq!(g.bytes.len(), group_bytes(2, 4, 3, dtype));
            decode(&g, &mut kv, &[2, 5]).unwrap();
            assert_eq!(block(&kv, 2), block(&kv, 1));
            assert_eq!(block(&kv, 5), block(&kv, 4));
            assert!(matches!(decode(&g, &mut kv, &[0]), Err(TierError::BadLength { .. })));
            assert!(matches!(decode(&g, &mut kv, &[0, 9]), Err(TierError::BadLength { .. })));
            let other = EncodedGroup { codec: "int8".into(), bytes: g.bytes.clone() };
            assert!(matches!(decode(&other, &mut kv, &[2, 5]), Err(TierError::UnknownCodec(_))));
        }
    }

    #[test]
    fn corrupt_scales_and_nan_codes_are_refused() {
        for dtype in [KvDtype::Int8, KvDtype::Fp8, KvDtype::Fp8Rotated] {
            let kv = filled(dtype);
            let mut target = filled(dtype);
            let g = encode(&kv, &[1]);
            let half = half_bytes(4, 3, dtype);
            // The first slot scale of K.
            let mut bad = g.clone();
            bad.bytes[half - 16..half - 12].copy_from_slice(&(-1.0f32).to_le_bytes());
            assert!(matches!(decode(&bad, &mut target, &[2]), Err(TierError::Corrupt { .. })), "{dtype}");
            let mut nan = g.clone();
            nan.bytes[0] = 0x7F;
            let got = decode(&nan, &mut target, &[2]);
            if dtype.is_e4m3() {
                assert!(matches!(got, Err(TierError::Corrupt { .. })), "e4m3 NaN code refused");
            } else {
                assert!(got.is_ok(), "0x7F is int8's 127");
            }
        }
    }

    /// A finite scale so large that a code decodes to infinity (3e38 × 127), and int8's -128 that no writer
    /// produces, are refused; a scale that keeps every code within [`KV_MAGNITUDE_LIMIT`] decodes.
    #[test]
    fn scales_that_overflow_a_code_and_int8_minus_128_are_refused() {
        for dtype in [KvDtype::Int8, KvDtype::Fp8, KvDtype::Fp8Rotated] {
            let kv = filled(dtype);
            let g = encode(&kv, &[1]);
            let half = half_bytes(4, 3, dtype);
            let bl = 12;
            // Block 1's K then V half: codes, then 4 slot scales each.
            for h in [0, half] {
                let mut huge = g.clone();
                huge.bytes[h] = 0x7E;
                huge.bytes[h + bl..h + bl + 4].copy_from_slice(&3e38f32.to_le_bytes());
                let mut target = filled(dtype);
                let before = block(&target, 2);
                let got = decode(&huge, &mut target, &[2]);
                assert!(matches!(got, Err(TierError::Corrupt { .. })), "{dtype} half at {h}: {got:?}");
                assert_eq!(block(&target, 2), before, "nothing written");
            }
            let mut target = filled(dtype);
            let mut largest = g.clone();
            let top = if dtype.is_e4m3() { codec::max_e4m3_magnitude(dtype.rotates_keys(), 3) } else { 127.0 };
            largest.bytes[bl..bl + 4].copy_from_slice(&(KV_MAGNITUDE_LIMIT / top / 2.0).to_le_bytes());
            decode(&largest, &mut target, &[2]).unwrap();
            let (k, v) = block(&target, 2);
            assert!(k.iter().chain(&v).all(|x| x.is_finite()), "{dtype}");
        }
        let mut minus_128 = encode(&filled(KvDtype::Int8), &[1]);
        minus_128.bytes[5] = 0x80;
        let got = decode(&minus_128, &mut filled(KvDtype::Int8), &[2]);
        assert!(matches!(got, Err(TierError::Corrupt { .. })), "{got:?}");
    }

    /// A float group holding an infinity or a NaN is refused by a cache of any dtype, and nothing is written; the
    /// largest finite values do not fit (past [`KV_MAGNITUDE_LIMIT`]), values within it decode.
    #[test]
    fn float_groups_holding_infinity_or_nan_are_refused() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let g = encode(&filled(dtype), &[1]);
            let elem = if dtype == KvDtype::F32 { 4 } else { 2 };
            let bits: [&[u8]; 3] = if dtype == KvDtype::F32 {
                [&f32::INFINITY.to_le_bytes(), &f32::NEG_INFINITY.to_le_bytes(), &f32::NAN.to_le_bytes()]
            } else {
                [
                    &half::f16::INFINITY.to_le_bytes(),
                    &half::f16::NEG_INFINITY.to_le_bytes(),
                    &half::f16::NAN.to_le_bytes(),
                ]
            };
            // The first element of K, and the last of V.
            for at in [0, g.bytes.len() - elem] {
                for bad_value in bits {
                    let mut bad = g.clone();
                    bad.bytes[at..at + elem].copy_from_slice(bad_value);
                    for arena in KvDtype::ALL {
                        let mut target = filled(arena);
                        let before = block(&target, 2);
                        let got = decode(&bad, &mut target, &[2]);
                        assert!(matches!(got, Err(TierError::Corrupt { .. })), "{dtype} into {arena} at {at}: {got:?}");
                        assert_eq!(block(&target, 2), before, "nothing written");
                    }
                }
            }
            let mut largest = g.clone();
            let (max, within): (&[u8], &[u8]) = if dtype == KvDtype::F32 {
                (&f32::MAX.to_le_bytes(), &(KV_MAGNITUDE_LIMIT * 0.99).to_le_bytes())
            } else {
                (&half::f16::MAX.to_le_bytes(), &half::f16::MAX.to_le_bytes())
            };
            largest.bytes[..elem].copy_from_slice(max);
            let got = decode(&largest, &mut filled(KvDtype::F32), &[2]);
            if dtype == KvDtype::F32 {
                assert!(matches!(got, Err(TierError::DoesNotFit { .. })), "{got:?}");
            } else {
                got.unwrap();
            }
            largest.bytes[..elem].copy_from_slice(within);
            decode(&largest, &mut filled(KvDtype::F32), &[2]).unwrap();
        }
    }

    /// Groups whose values an f16 cache cannot hold (an f32 group past 65504, an int8 one whose scale makes its
    /// codes decode past it) are refused whole: nothing is written, where they would have landed as infinities.
    /// Up to the edge of f16's range they decode.
    #[test]
    fn groups_past_f16s_range_are_refused_by_an_f16_cache() {
        for dtype in [KvDtype::F32, KvDtype::Int8, KvDtype::Fp8] {
            let mut src = KvStorage::with_dtype(2, 4, 3, dtype);
            let k: Vec<f32> = (0..12).map(|i| i as f32 * 10.0).collect();
            let huge: Vec<f32> = (0..12).map(|i| 7e4 + i as f32).collect();
            src.write_block(0, &k, &k);
            src.write_block(1, &k, &huge);
            let g = encode(&src, &[0, 1]);
            let mut target = filled(KvDtype::F16);
            let before = (block(&target, 2), block(&target, 3));
            let got = decode(&g, &mut target, &[2, 3]);
            assert!(matches!(got, Err(TierError::DoesNotFit { .. })), "{dtype}: {got:?}");
            assert_eq!((block(&target, 2), block(&target, 3)), before, "{dtype}: nothing written");
            // An f32 cache holds them.
            decode(&g, &mut filled(KvDtype::F32), &[2, 3]).unwrap();
        }
        let mut edge = KvStorage::with_dtype(1, 4, 3, KvDtype::F32);
        edge.write_block(0, &[65504.0; 12], &[-65519.0; 12]);
        let mut target = filled(KvDtype::F16);
        decode(&encode(&edge, &[0]), &mut target, &[1]).unwrap();
        assert_eq!(block(&target, 1), (vec![65504.0; 12], vec![-65504.0; 12]), "rounded to f16's largest");
    }

    /// Finite values too large for the arithmetic an arena does on them are refused by a cache of every dtype,
    /// nothing written: an f32 group of 1e37 (the rotated fp8 arena's butterfly overflowed it to infinity and
    /// stored a NaN scale; an f32 arena's q·k overflowed), and an int8 group whose valid scale decodes a code to
    /// 2.5e38. Values up to [`KV_MAGNITUDE_LIMIT`] decode, and read back finite.
    #[test]
    fn groups_past_the_kv_magnitude_limit_are_refused_by_every_cache() {
        let (bs, hd) = (4, 64);
        let small: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut f32_src = KvStorage::with_dtype(1, bs, hd, KvDtype::F32);
        f32_src.write_block(0, &vec![1e37; bs * hd], &small);
        let huge_f32 = encode(&f32_src, &[0]);
        let mut int8_src = KvStorage::with_dtype(1, bs, hd, KvDtype::Int8);
        int8_src.write_block(0, &small, &small);
        let mut huge_int8 = encode(&int8_src, &[0]);
        // K's first code at the top, and its slot's scale 2e36: 127 × 2e36 is finite, a valid scale.
        huge_int8.bytes[0] = 127;
        huge_int8.bytes[bs * hd..bs * hd + 4].copy_from_slice(&2e36f32.to_le_bytes());
        // The same past the limit in fp8: e4m3's largest code (448) at a scale of 1e33, in the keys and in the
        // values (for rotated keys it is the inverse rotation that spreads it over the slot, still past the limit).
        let mut huge_fp8 = Vec::new();
        for dtype in [KvDtype::Fp8, KvDtype::Fp8Rotated] {
            let mut src = KvStorage::with_dtype(1, bs, hd, dtype);
            src.write_block(0, &small, &small);
            let g = encode(&src, &[0]);
            for half in [0, half_bytes(bs, hd, dtype)] {
                let mut huge = g.clone();
                huge.bytes[half] = 0x7E;
                huge.bytes[half + bs * hd..half + bs * hd + 4].copy_from_slice(&1e33f32.to_le_bytes());
                huge_fp8.push(huge);
            }
        }
        for g in [&huge_f32, &huge_int8].into_iter().chain(&huge_fp8) {
            for arena in KvDtype::ALL {
                let mut target = KvStorage::with_dtype(2, bs, hd, arena);
                target.write_block(1, &small, &small);
                let before = block(&target, 1);
                let got = decode(g, &mut target, &[1]);
                assert!(matches!(got, Err(TierError::DoesNotFit { .. })), "{} into {arena}: {got:?}", g.codec);
                assert_eq!(block(&target, 1), before, "{} into {arena}: nothing written", g.codec);
            }
        }
        // A rotated key slot whose length bound passes the limit while its values do not: every code 448 rotates
        // back to one value of 448 × 8 × scale, under the limit, where the bound says twice the length, 448 × 16 ×
        // scale, over it. The exact check decides, and the group decodes.
        let mut src = KvStorage::with_dtype(1, bs, hd, KvDtype::Fp8Rotated);
        src.write_block(0, &small, &small);
        let mut long_slot = encode(&src, &[0]);
        long_slot.bytes[..hd].fill(0x7E);
        long_slot.bytes[bs * hd..bs * hd + 4].copy_from_slice(&(KV_MAGNITUDE_LIMIT / 5000.0).to_le_bytes());
        for arena in KvDtype::ALL.into_iter().filter(|&d| d != KvDtype::F16) {
            let mut target = KvStorage::with_dtype(1, bs, hd, arena);
            decode(&long_slot, &mut target, &[0]).unwrap();
            let (k, _) = block(&target, 0);
            let top = k.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            assert!(top > KV_MAGNITUDE_LIMIT / 2.0 && top < KV_MAGNITUDE_LIMIT, "{arena}: {top}");
        }
        let mut edge = KvStorage::with_dtype(1, bs, hd, KvDtype::F32);
        let below = KV_MAGNITUDE_LIMIT * 0.99;
        edge.write_block(0, &vec![below; bs * hd], &vec![-below; bs * hd]);
        for arena in KvDtype::ALL.into_iter().filter(|&d| d != KvDtype::F16) {
            let mut target = KvStorage::with_dtype(1, bs, hd, arena);
            decode(&encode(&edge, &[0]), &mut target, &[0]).unwrap();
            let (k, v) = block(&target, 0);
            assert!(k.iter().chain(&v).all(|x| x.is_finite()), "{arena}");
        }
    }

    #[test]
    fn decodes_across_dtypes_and_the_legacy_name() {
        // These values are exact in f16, so the conversion is lossless both ways.
        let (f32_kv, mut f16_kv) = (filled(KvDtype::F32), filled(KvDtype::F16));
        let mut g = encode(&f32_kv, &[3]);
        decode(&g, &mut f16_kv, &[0]).unwrap();
        assert_eq!(block(&f16_kv, 0), block(&f32_kv, 3));
        g.codec = LEGACY_F32.into();
        decode(&g, &mut f16_kv, &[1]).unwrap();
        assert_eq!(block(&f16_kv, 1), block(&f32_kv, 3));
        let mut back = filled(KvDtype::F32);
        decode(&encode(&f16_kv, &[4]), &mut back, &[0]).unwrap();
        assert_eq!(block(&back, 0), block(&f32_kv, 4));
    }

    #[test]
    fn rotated_fp8_groups_decode_to_the_keys_the_cache_reads() {
        // head_dim 8: the rotation mixes every element of a row (head_dim 3 above leaves it the identity).
        let (bs, hd) = (4, 8);
        let k: Vec<f32> =
            (0..bs * hd).map(|i| ((i * 7 % 11) as f32 - 5.0) * if i % hd == 3 { 9.0 } else { 0.3 }).collect();
        let v: Vec<f32> = k.iter().map(|x| x * 0.5 - 0.1).collect();
        let mut rotated = KvStorage::with_dtype(2, bs, hd, KvDtype::Fp8Rotated);
        rotated.write_block(1, &k, &v);
        let (mut rk, mut rv) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
        rotated.read_block(1, &mut rk, &mut rv);
        let g = encode(&rotated, &[1]);
        assert_eq!(g.codec, "native-fp8_e4m3_rotated");
        // Into another dtype the keys come back un-rotated, equal to what the rotated cache itself reads.
        let mut wide = KvStorage::with_dtype(1, bs, hd, KvDtype::F32);
        decode(&g, &mut wide, &[0]).unwrap();
        assert_eq!(wide.block_k(0), &rk[..]);
        assert_eq!(wide.block_v(0), &rv[..]);
        // Into a rotated cache the codes are copied: bit-exact.
        let mut again = KvStorage::with_dtype(1, bs, hd, KvDtype::Fp8Rotated);
        decode(&g, &mut again, &[0]).unwrap();
        assert_eq!(encode(&again, &[0]).bytes, g.bytes);
        // A plain fp8 group into a rotated cache is widened and re-rotated, not copied as rotated codes.
        let mut plain = KvStorage::with_dtype(1, bs, hd, KvDtype::Fp8);
        plain.write_block(0, &k, &v);
        let mut from_plain = KvStorage::with_dtype(1, bs, hd, KvDtype::Fp8Rotated);
        decode(&encode(&plain, &[0]), &mut from_plain, &[0]).unwrap();
        let (mut pk, mut pv) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
        from_plain.read_block(0, &mut pk, &mut pv);
        let worst = pk.iter().zip(&k).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 3.0, "keys survive fp8 then rotated fp8: worst error {worst}");
    }

    /// Timing, not a check: decoding one 2K-token group of SmolLM2's layer shape (128 blocks of 16 slots, 3 kv-heads
    /// of 64) into a cache of its own dtype, medians of 41. `cargo test --release -p pagoda-worker --lib
    /// native_decode_speed -- --ignored --nocapture`; docs/BENCHMARKS.md has the figures.
    #[test]
    #[ignore = "timing; run by hand in release"]
    fn native_decode_speed() {
        let (blocks, bs, hd) = (128u32, 16, 64 * 3);
        for dtype in KvDtype::ALL {
            let mut kv = KvStorage::with_dtype(blocks as usize * 2, bs, hd, dtype);
            let values: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.37).sin()).collect();
            for b in 0..blocks {
                kv.write_block(b, &values, &values);
            }
            let (from, to): (Vec<u32>, Vec<u32>) = ((0..blocks).collect(), (blocks..2 * blocks).collect());
            let g = encode(&kv, &from);
            let ms = crate::tiers::median_ms(41, || decode(&g, &mut kv, &to).unwrap());
            println!("{dtype}: median {ms:.3} ms");
        }
    }
}
