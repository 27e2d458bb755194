//! AMX bf16 tile kernels (x86-64, Sapphire Rapids and later): the Q4_1 and Q8_0 matmuls.
//!
//! The quantised weights are widened once to bf16 tiles and kept ([`widen_matrix`], cached on the matrix): weight-
//! only quantisation with bf16 compute, as oneDNN and IPEX run int4 weights on AMX. Each call rounds its
//! activations to bf16; one `tdpbf16ps` then multiplies 16 tokens × 32 columns by 32 columns × 16 weight rows and
//! adds into 16 × 16 f32 sums that stay in a tile register across the whole row, so no per-block scale step runs on
//! the vector units.
//!
//! Every row of a call takes the same path whatever the call's size, and a row's sums depend only on its own
//! activations (tiles compute rows independently, in a fixed order over the columns), so a token's result does
//! not depend on what shares its step: batch invariance holds as with the VNNI kernel.
//!
//! Why not int8 tiles over the VNNI kernel's Q8_1 activations: Q4_1 and Q8_1 carry a scale per 32 columns, so each
//! 32-column product must leave the tile and be scaled on the vector units; in a build that did so (not kept), the
//! tile store and read-back cost about what the `vpdpbusd` they replaced did. And why resident weights: widening per
//! call cost as much as a 32-row VNNI product (`git checkout 5447a32`, `amx_vs_vnni_speed`).
//!
//! Numerics: bf16 keeps 8 significant bits, so each weight and activation is within 2⁻⁹ of its value; the VNNI
//! kernel's Q8_1 activations are within `amax / 254` of theirs, a bound this kernel also meets (the matmul tests
//! hold both to it).
//!
//! Linux hands out the 8 KiB of tile state only on request ([`available`] asks once per process). Rust has no
//! stable AMX intrinsics, so the tile instructions are inline assembly; the compiler never allocates the tile
//! registers, so their contents persist between the `asm!` blocks of one kernel call.

#![allow(unsafe_op_in_unsafe_fn, clippy::needless_range_loop)]

use super::SyncPtr;
pub(crate) use crate::quant::Align64;
use crate::quant::{Q4_1X16_BLOCK_BYTES, Q4_1X16_ROWS, Q8_0X16_BLOCK_BYTES, QK};
use core::arch::asm;
use core::arch::x86_64::*;
use std::sync::OnceLock;

/// Tokens per A tile, and weight rows per B tile.
const TILE: usize = 16;

/// Activation rows are padded to a multiple of this: the kernel takes token tiles in pairs.
const TOKEN_PAIR: usize = 2 * TILE;

/// Bytes of one weight tile: 16 rows (column pairs) × 16 weight rows × 2 bf16.
pub(crate) const W_TILE_BYTES: usize = 1024;

/// True when the CPU has AMX-TILE and AMX-BF16, AVX-512 BF16 and VBMI (to widen the weights), and the kernel
/// granted this process the tile data state.
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        cpu_has_amx_bf16()
            && is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512vbmi")
            && request_tile_data()
    })
}

fn cpu_has_amx_bf16() -> bool {
    // CPUID leaf 7, sub-leaf 0: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
    #[allow(unused_unsafe)]
    // SAFETY: CPUID is available on every x86-64 CPU; leaf 7 is read only if the CPU reports it.
    let edx = unsafe { if __cpuid(0).eax >= 7 { __cpuid_count(7, 0).edx } else { 0 } };
    edx & (1 << 22) != 0 && edx & (1 << 24) != 0
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: this arch_prctl only extends the set of xsave features the process may use; it touches no memory.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// The tile configuration `ldtilecfg` reads (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// tmm0, tmm1: two token tiles (16 tokens × 32 bf16); tmm2, tmm3: two weight groups (16 column pairs × 16 rows ×
/// 2 bf16); tmm4–tmm7: their four 16 × 16 f32 products.
const CONFIG: TileConfig = {
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 8 {
        colsb[t] = 64;
        rows[t] = TILE as u8;
        t += 1;
    }
    TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb, rows }
};

/// Rows of activations a call of `n` rows packs: whole token tiles, and whole pairs of them beyond one.
fn padded_rows(n: usize) -> usize {
    if n <= TILE { TILE } else { n.next_multiple_of(TOKEN_PAIR) }
}

/// Number of [`Align64`] units [`pack_activations`] needs for `n` rows of `cols` values.
pub(crate) fn act_len(n: usize, cols: usize) -> usize {
    padded_rows(n) * cols * 2 / 64
}

/// Rounds `x` (`[n][cols]`, `cols` a multiple of 32) to bf16, row-major with row stride `2 * cols` bytes, rows
/// padded with zeros to [`padded_rows`].
///
/// # Safety
/// The CPU supports AVX-512 F and BF16; `out.len() == act_len(n, cols)`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn pack_activations(x: &[f32], n: usize, cols: usize, out: &mut [Align64]) {
    debug_assert!(cols.is_multiple_of(QK) && x.len() == n * cols && out.len() == act_len(n, cols));
    let dst = out.as_mut_ptr() as *mut __m512bh;
    for k in 0..n * cols / 32 {
        let lo = _mm512_loadu_ps(x.as_ptr().add(32 * k));
        let hi = _mm512_loadu_ps(x.as_ptr().add(32 * k + 16));
        _mm512_store_si512(
            dst.add(k) as *mut _,
            core::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)),
        );
    }
    for k in n * cols / 32..out.len() {
        _mm512_store_si512(dst.add(k) as *mut _, _mm512_setzero_si512());
    }
}

/// Byte shuffle that turns one 64-byte chunk of the 16-row layout (row `j`'s columns `c..c+4` at bytes `4j..4j+4`)
/// into two tile rows: columns `c, c+1` of rows 0..16, then columns `c+2, c+3`.
const PAIR_SPLIT: [u8; 64] = {
    let mut idx = [0u8; 64];
    let mut q = 0;
    while q < 64 {
        let (half, p) = (q / 32, q % 32);
        idx[q] = (4 * (p / 2) + 2 * half + p % 2) as u8;
        q += 1;
    }
    idx
};

/// Widens one 16-row group's packed weights (`nb` blocks) into `nb` bf16 weight tiles: tile `b`, row `p` holds
/// columns `32b + 2p` and `32b + 2p + 1` of the 16 rows, interleaved (AMX's pair layout for the B operand).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16,f16c")]
unsafe fn widen_group<const Q8: bool>(group: *const u8, nb: usize, tiles: *mut u8) {
    let bb = if Q8 { Q8_0X16_BLOCK_BYTES } else { Q4_1X16_BLOCK_BYTES };
    let split = _mm512_loadu_si512(PAIR_SPLIT.as_ptr() as *const _);
    // Each weight row's scale repeated for its two columns: rows 0–7, then rows 8–15.
    let rep_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    let rep_hi = _mm512_add_epi32(rep_lo, _mm512_set1_epi32(8));
    let m4 = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        let blk = group.add(b * bb);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let m =
            if Q8 { _mm512_setzero_ps() } else { _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(32) as *const __m256i)) };
        let (d_lo, d_hi) = (_mm512_permutexvar_ps(rep_lo, d), _mm512_permutexvar_ps(rep_hi, d));
        let (m_lo, m_hi) = (_mm512_permutexvar_ps(rep_lo, m), _mm512_permutexvar_ps(rep_hi, m));
        let tile = tiles.add(b * W_TILE_BYTES);
        // Writes tile rows `p` and `p + 1` from one chunk of 64 quants (already shuffled by `split`).
        let emit = |q: __m512i, p: usize| {
            let widen = |i: usize| {
                let lane = match i {
                    0 => _mm512_extracti32x4_epi32::<0>(q),
                    1 => _mm512_extracti32x4_epi32::<1>(q),
                    2 => _mm512_extracti32x4_epi32::<2>(q),
                    _ => _mm512_extracti32x4_epi32::<3>(q),
                };
                let ints = if Q8 { _mm512_cvtepi8_epi32(lane) } else { _mm512_cvtepu8_epi32(lane) };
                let (dd, mm) = if i.is_multiple_of(2) { (d_lo, m_lo) } else { (d_hi, m_hi) };
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), dd, mm)
            };
            for (row, i) in [(p, 0), (p + 1, 2)] {
                let bf = _mm512_cvtne2ps_pbh(widen(i + 1), widen(i));
                _mm512_store_si512(tile.add(64 * row) as *mut _, core::mem::transmute::<__m512bh, __m512i>(bf));
            }
        };
        if Q8 {
            for k in 0..8 {
                let q = _mm512_loadu_si512(blk.add(64 + 64 * k) as *const _);
                emit(_mm512_permutexvar_epi8(split, q), 2 * k);
            }
        } else {
            for t in 0..4 {
                let q = _mm512_loadu_si512(blk.add(64 + 64 * t) as *const _);
                emit(_mm512_permutexvar_epi8(split, _mm512_and_si512(q, m4)), 2 * t);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
                emit(_mm512_permutexvar_epi8(split, hi), 8 + 2 * t);
            }
        }
    }
}

/// The whole matrix (`rows` rows of `nb` blocks, in the 16-row packing of Q4_1 or, with `q8`, Q8_0) as bf16 tiles:
/// group `g`'s tile for block `b` at unit offset `(g * nb + b) * 16`.
pub(crate) fn widen_matrix(packed: &[u8], rows: usize, nb: usize, q8: bool) -> Vec<Align64> {
    assert!(super::bf16_dot::available(), "bf16 weights requested on a CPU without AVX-512 BF16");
    let groups = rows.div_ceil(Q4_1X16_ROWS);
    let bb = if q8 { Q8_0X16_BLOCK_BYTES } else { Q4_1X16_BLOCK_BYTES };
    assert!(packed.len() >= groups * nb * bb, "widen_matrix: packing too short");
    let mut tiles = vec![Align64::default(); groups * nb * W_TILE_BYTES / 64];
    let dst = tiles.as_mut_ptr() as *mut u8;
    for g in 0..groups {
        // SAFETY: available() implies AVX-512 F/BW, VBMI, BF16 and F16C (checked by its caller's detection:
        // `amx_available` requires avx512_available); source and destination ranges were checked above.
        unsafe {
            let (src, out) = (packed.as_ptr().add(g * nb * bb), dst.add(g * nb * W_TILE_BYTES));
            if q8 { widen_group::<true>(src, nb, out) } else { widen_group::<false>(src, nb, out) }
        }
    }
    tiles
}

/// `tileloadd tmm{T}` from `p`, rows `stride` bytes apart.
macro_rules! tile_load {
    ($t:literal, $p:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd tmm", $t, ", [{p} + {s} * 1]"),
            p = in(reg) $p,
            s = in(reg) $stride,
            options(nostack, preserves_flags, readonly),
        )
    };
}

/// `tmm{C} += tmm{A} · tmm{B}` in bf16 with f32 sums.
macro_rules! tile_dp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, preserves_flags, nomem))
    };
}

/// Adds one 32-column block into the sums: tmm4/tmm5 (tokens of `a0`/`a1` × group of `w0`), and with `w1`
/// tmm6/tmm7 (× the second group). Without `a1` (a call of at most 16 rows), only tmm4 and tmm6.
#[inline(always)]
unsafe fn block_product(a0: *const u8, a1: Option<*const u8>, stride: usize, w0: *const u8, w1: Option<*const u8>) {
    tile_load!("0", a0, stride);
    tile_load!("2", w0, 64usize);
    tile_dp!("4", "0", "2");
    if let Some(w1) = w1 {
        tile_load!("3", w1, 64usize);
        tile_dp!("6", "0", "3");
    }
    if let Some(a1) = a1 {
        tile_load!("1", a1, stride);
        tile_dp!("5", "1", "2");
        if w1.is_some() {
            tile_dp!("7", "1", "3");
        }
    }
}

/// Stores sum tile `tmm{4 + which}` (16 tokens × 16 f32) at `dst`, rows `stride` bytes apart.
#[inline(always)]
unsafe fn store_sums(which: usize, dst: *mut f32, stride: usize) {
    macro_rules! st {
        ($t:literal) => {
            asm!(concat!("tilestored [{d} + {s} * 1], tmm", $t), d = in(reg) dst, s = in(reg) stride, options(nostack, preserves_flags))
        };
    }
    match which {
        0 => st!("4"),
        1 => st!("5"),
        2 => st!("6"),
        _ => st!("7"),
    }
}

/// Writes sum tile `which` for tokens `i0..` and weight rows `r..` into `out[i][ld]`, keeping to `i < n` and
/// `r < r1`: straight from the tile when all 16 × 16 are in range, through `scratch` otherwise.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn write_sums(
    which: usize,
    i0: usize,
    n: usize,
    r: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
    scratch: *mut f32,
) {
    let (tokens, rows) = ((n - i0.min(n)).min(TILE), (r1 - r).min(TILE));
    if tokens == 0 {
        return;
    }
    if tokens == TILE && rows == TILE {
        store_sums(which, out.add(i0 * ld + r), 4 * ld);
        return;
    }
    store_sums(which, scratch, 64);
    let mask: __mmask16 = if rows == TILE { !0 } else { (1u16 << rows) - 1 };
    for t in 0..tokens {
        _mm512_mask_storeu_ps(out.add((i0 + t) * ld + r), mask, _mm512_load_ps(scratch.add(TILE * t)));
    }
}

/// Output rows `r0..r1` (`r0` a multiple of 16) of a matmul over the weight tiles of [`widen_matrix`], for all
/// `n` activation rows packed by [`pack_activations`]: `out[i][r] = w[r] · x[i]`.
///
/// # Safety
/// [`available`] returned true and the CPU supports AVX-512 F; `tiles` is [`widen_matrix`] of a matrix of `nb`
/// blocks per row with at least `r1` rows; `act` is [`pack_activations`] of `n` rows of `32 nb` values; `out`
/// points at `[n][ld]` floats with `ld >= r1`, and this task alone writes rows `r0..r1` of it.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn quant_rows(
    tiles: &[Align64],
    nb: usize,
    act: &[Align64],
    n: usize,
    r0: usize,
    r1: usize,
    out: SyncPtr,
    ld: usize,
) {
    debug_assert!(r0.is_multiple_of(Q4_1X16_ROWS) && r1 <= ld);
    debug_assert!(act.len() >= act_len(n, nb * QK) && tiles.len() >= r1.div_ceil(Q4_1X16_ROWS) * nb * 16);
    let out = out.get();
    let group_bytes = nb * W_TILE_BYTES;
    let wp = tiles.as_ptr() as *const u8;
    let a = act.as_ptr() as *const u8;
    let stride = 2 * nb * QK;
    #[repr(C, align(64))]
    struct Scratch([f32; TILE * TILE]);
    let mut scratch = Scratch([0.0; TILE * TILE]);
    let sp = scratch.0.as_mut_ptr();
    asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, preserves_flags, readonly));
    let (g0, g1) = (r0 / Q4_1X16_ROWS, r1.div_ceil(Q4_1X16_ROWS));
    let pair = n > TILE;
    // Token tiles outside, weight groups inside: a tile pair's activations stay in L1 while the weights stream.
    for i0 in (0..n).step_by(if pair { TOKEN_PAIR } else { TILE }) {
        let a0 = a.add(i0 * stride);
        let a1 = pair.then(|| a.add((i0 + TILE) * stride));
        let mut g = g0;
        while g < g1 {
            let two = g + 1 < g1;
            let w0 = wp.add(g * group_bytes);
            asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                options(nostack, preserves_flags, nomem)
            );
            for b in 0..nb {
                let wb1 = two.then(|| w0.add(group_bytes + b * W_TILE_BYTES));
                block_product(a0.add(64 * b), a1.map(|p| p.add(64 * b)), stride, w0.add(b * W_TILE_BYTES), wb1);
            }
            let r = g * Q4_1X16_ROWS;
            write_sums(0, i0, n, r, r1, out, ld, sp);
            if two {
                write_sums(2, i0, n, r + TILE, r1, out, ld, sp);
            }
            if pair {
                write_sums(1, i0 + TILE, n, r, r1, out, ld, sp);
                if two {
                    write_sums(3, i0 + TILE, n, r + TILE, r1, out, ld, sp);
                }
            }
            g += if two { 2 } else { 1 };
        }
    }
    asm!("tilerelease", options(nostack, preserves_flags, nomem));
}
