//! Device-tier KV storage ([`KvStorage`]: one arena for K, one for V, addressed by block index, holding f16 or
//! f32 elements) and the per-sequence attention view ([`AttnSeq`]) that `kv_write` and `paged_attention` read
//! through.
//!
//! Block `b`, slot `s` starts at `(b * block_size + s) * head_dim` in each arena. A block holds `block_size`
//! consecutive slots of ONE (layer, kv-head).
//!
//! f16 is the serving default (DESIGN §5 names it the native codec; llama.cpp's default cache type too): decode
//! attention over many sequences streams the whole cache from memory every step, so halving its bytes is what
//! batched decode gains most from. f32 stays for exact comparisons against an f32 reference. int8 is the `int8`
//! codec of [`crate::codec`] kept in the device pool itself: each slot is quantised as it is written (symmetric,
//! one f32 scale per slot and head), so blocks fill token by token like the float ones, hold 1.9× as many tokens per
//! byte as f16 at head_dim 64, and the attention kernel dequantises them as it loads (llama.cpp's `q8_0` cache type
//! and vLLM's fp8 KV cache are the same trade). fp8 (`fp8_e4m3`) is the same with e4m3 codes: the `fp8_e4m3`
//! codec's element format, with the scale per slot instead of per block because the pool writes a slot at a time
//! (vLLM's `fp8_e4m3` cache scales per tensor; a finer scale only lowers the error). `fp8_e4m3_rotated` is fp8
//! with every key rotated by the normalised Walsh-Hadamard transform before it is quantised (the
//! `fp8_e4m3_rotated` codec's idea in the pool): a few outlier channels no longer set every slot's scale, so the
//! small channels keep their mantissa bits. Reads rotate keys back; the attention kernel instead rotates the query
//! once per head (`q·k = Hq·Hk`), so blocks are read exactly as fp8's. Values are stored as plain fp8.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::key_rounding::KeyRounding;

/// Element type of a [`KvStorage`]'s arenas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE half precision (rounded to nearest on write, exact on read).
    #[default]
    F16,
    /// Single precision: the values the model computed, unrounded.
    F32,
    /// Symmetric 8-bit integers with one f32 scale per slot (scale = absmax / 127, error ≤ scale / 2).
    Int8,
    /// e4m3 floats with one f32 scale per slot (scale = absmax / 448; relative error ≤ 2⁻⁴ for normals).
    Fp8,
    /// [`KvDtype::Fp8`] over keys rotated by [`crate::codec::hadamard_rotate`] (values as fp8's). Every read
    /// rotates keys back; only the attention kernels see the rotated codes (and rotate the query to match).
    Fp8Rotated,
}

impl KvDtype {
    /// Every dtype, in decreasing size.
    pub const ALL: [KvDtype; 5] = [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Fp8, KvDtype::Fp8Rotated];

    /// Bytes per stored element (not counting the per-slot scale of the 8-bit dtypes: see [`KvDtype::slot_bytes`]).
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
            KvDtype::Int8 | KvDtype::Fp8 | KvDtype::Fp8Rotated => 1,
        }
    }

    /// Whether each slot carries its own f32 scale (the 8-bit dtypes).
    pub fn slot_scaled(self) -> bool {
        matches!(self, KvDtype::Int8 | KvDtype::Fp8 | KvDtype::Fp8Rotated)
    }

    /// Whether the codes are e4m3 floats (both fp8 dtypes).
    pub fn is_e4m3(self) -> bool {
        matches!(self, KvDtype::Fp8 | KvDtype::Fp8Rotated)
    }

    /// Whether keys are stored rotated by [`crate::codec::hadamard_rotate`] (values never are).
    pub fn rotates_keys(self) -> bool {
        self == KvDtype::Fp8Rotated
    }

    /// The element type values are stored in: the dtype itself, less the key rotation.
    pub fn value_dtype(self) -> KvDtype {
        if self.rotates_keys() { KvDtype::Fp8 } else { self }
    }

    /// Bytes of one slot of K (or of V) of `head_dim` elements, scale included.
    pub fn slot_bytes(self, head_dim: usize) -> usize {
        head_dim * self.bytes() + if self.slot_scaled() { 4 } else { 0 }
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
            KvDtype::Int8 => "int8",
            KvDtype::Fp8 => "fp8_e4m3",
            KvDtype::Fp8Rotated => "fp8_e4m3_rotated",
        }
    }

    /// One code of a slot-scaled dtype as f32, before its slot's scale (int8: the two's-complement byte; fp8: the
    /// e4m3 value). Float dtypes have no codes; this reads their bytes as int8.
    #[inline]
    pub fn widen_code(self, c: u8) -> f32 {
        match self {
            KvDtype::Fp8 | KvDtype::Fp8Rotated => crate::codec::e4m3_to_f32(c),
            _ => f32::from(c as i8),
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<KvDtype, String> {
        match s {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            "int8" => Ok(KvDtype::Int8),
            "fp8_e4m3" => Ok(KvDtype::Fp8),
            "fp8_e4m3_rotated" => Ok(KvDtype::Fp8Rotated),
            other => {
                Err(format!("unknown KV cache dtype `{other}` (expected f16, f32, int8, fp8_e4m3 or fp8_e4m3_rotated)"))
            }
        }
    }
}

/// Asks the kernel to back `v`'s pages with transparent huge pages (Linux, where THP is in `madvise` mode, the
/// default of most distributions). An arena is read block by block in table order, which is no order in memory: at
/// long contexts every 1-2 KiB block read costs a TLB miss with 4 KiB pages, and a 2 MiB page covers a thousand
/// blocks. Called on freshly zeroed vectors, before their pages are touched, so the faults take huge pages; the
/// advice only changes how memory is mapped, never its contents, and a refusal (THP off) leaves 4 KiB pages.
fn huge_pages<T>(v: Vec<T>) -> Vec<T> {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = v.as_ptr() as usize;
        // The whole huge pages inside the vector (none below 2 MiB).
        let (lo, hi) = (start.next_multiple_of(HUGE), (start + std::mem::size_of_val(v.as_slice())) / HUGE * HUGE);
        if hi > lo {
            // SAFETY: [lo, hi) lies inside `v`'s allocation, which `v` owns; MADV_HUGEPAGE is advice about how
            // to map it and changes no byte of it.
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
        }
    }
    v
}

/// Bytes every arena's first element is aligned to. A block then starts on a cache line (all block sizes are
/// multiples of 64 bytes, a block's slot scales too), so no block shares a line with its neighbour, the kernels'
/// 32- and 64-byte loads never straddle two lines, and a prefetch of a block's lines fetches exactly the block.
/// The allocator's own alignment is 16: a large vector starts 16 bytes into its mapping, and each 2 KiB f16 block
/// then touched 33 lines, the last of them behind its prefetch.
const ARENA_ALIGN: usize = 64;

/// A zeroed arena starting on an [`ARENA_ALIGN`] boundary, advised into huge pages: a vector with
/// [`Aligned::PAD`] elements more than the arena holds, and the offset of the aligned start inside it.
#[derive(Debug)]
struct Aligned<T> {
    buf: Vec<T>,
    start: usize,
}

impl<T> Aligned<T> {
    /// Elements allocated beyond the arena's length: room to move its start to the boundary.
    const PAD: usize = ARENA_ALIGN / size_of::<T>();

    fn range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.buf.len() - Self::PAD
    }
}

impl<T: Copy + Default> Aligned<T> {
    fn zeroed(len: usize) -> Aligned<T> {
        // `T::default()` is zero for the arenas' element types, so the vector comes zeroed from the allocator
        // (fresh pages for a large one, untouched until `huge_pages` has advised them).
        let buf = huge_pages(vec![T::default(); len + Self::PAD]);
        let start = buf.as_ptr().align_offset(ARENA_ALIGN);
        assert!(start <= Self::PAD, "an arena cannot be aligned to {ARENA_ALIGN} bytes");
        Aligned { buf, start }
    }
}

impl<T: Copy + Default> Clone for Aligned<T> {
    fn clone(&self) -> Aligned<T> {
        let mut copy = Aligned::zeroed(self.len());
        copy.copy_from_slice(self);
        copy
    }
}

impl<T> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.range()]
    }
}

impl<T> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let r = self.range();
        &mut self.buf[r]
    }
}

/// One arena's elements. Offsets are in elements; a slot-scaled arena is only ever addressed by whole slots (`at`
/// and lengths multiples of `head_dim`), which is how [`KvStorage`] addresses every arena.
#[derive(Clone, Debug)]
enum Arena {
    F32(Aligned<f32>),
    /// f16 bit patterns.
    F16(Aligned<u16>),
    /// Quantised elements (int8: two's-complement bytes; fp8: e4m3 bytes) and one scale per slot of `head_dim`
    /// elements. A [`KvDtype::Fp8Rotated`] arena rotates each row before quantising it and after widening it.
    Scaled {
        q: Aligned<u8>,
        scale: Aligned<f32>,
        head_dim: usize,
        dtype: KvDtype,
    },
}

/// One row (`head_dim` floats) as a scaled arena of `dtype` stores it: its codes into `codes` and its scale
/// returned. int8 and e4m3 quantise with one scale per row. The rotated e4m3 dtype rotates the row first, in a
/// stack copy, because writes run once per token per (layer, kv-head) and must not allocate (`with_dtype` bounds a
/// rotated arena's head_dim).
fn encode_scaled_row(dtype: KvDtype, x: &[f32], codes: &mut [u8]) -> f32 {
    let quantize = if dtype.is_e4m3() { crate::codec::quantize_row_e4m3 } else { crate::codec::quantize_row_i8 };
    if !dtype.rotates_keys() {
        return quantize(x, codes);
    }
    let mut buf = [0.0f32; crate::codec::MAX_HEAD_DIM];
    quantize(crate::codec::rotated_copy(x, &mut buf), codes)
}

impl Arena {
    fn zeroed(dtype: KvDtype, len: usize, head_dim: usize) -> Arena {
        match dtype {
            KvDtype::F32 => Arena::F32(Aligned::zeroed(len)),
            KvDtype::F16 => Arena::F16(Aligned::zeroed(len)),
            KvDtype::Int8 | KvDtype::Fp8 | KvDtype::Fp8Rotated => {
                Arena::Scaled { q: Aligned::zeroed(len), scale: Aligned::zeroed(len / head_dim), head_dim, dtype }
            }
        }
    }

    fn copy_within(&mut self, src: std::ops::Range<usize>, dst: usize) {
        match self {
            Arena::F32(a) => a.copy_within(src, dst),
            Arena::F16(a) => a.copy_within(src, dst),
            Arena::Scaled { q, scale, head_dim, .. } => {
                let hd = *head_dim;
                debug_assert!(
                    src.start.is_multiple_of(hd) && src.end.is_multiple_of(hd) && dst.is_multiple_of(hd),
                    "slot-scaled arena: unaligned copy"
                );
                scale.copy_within(src.start / hd..src.end / hd, dst / hd);
                q.copy_within(src, dst);
            }
        }
    }

    fn write(&mut self, at: usize, x: &[f32]) {
        match self {
            Arena::F32(a) => a[at..at + x.len()].copy_from_slice(x),
            // The slice conversions use F16C where the CPU has it (a scalar loop is ~10x slower).
            Arena::F16(a) => a[at..at + x.len()].reinterpret_cast_mut::<f16>().convert_from_f32_slice(x),
            Arena::Scaled { q, scale, head_dim, dtype } => {
                let hd = *head_dim;
                debug_assert!(at.is_multiple_of(hd) && x.len().is_multiple_of(hd), "scaled arena: unaligned write");
                let rows = q[at..at + x.len()].chunks_exact_mut(hd).zip(&mut scale[at / hd..(at + x.len()) / hd]);
                for ((qr, s), xr) in rows.zip(x.chunks_exact(hd)) {
                    *s = encode_scaled_row(*dtype, xr, qr);
                }
            }
        }
    }

    /// Stores rows that [`encode_scaled_row`] encoded for this (scaled) arena: codes from `at`, a scale per row.
    fn write_encoded(&mut self, at: usize, codes: &[u8], scales: &[f32]) {
        match self {
            Arena::Scaled { q, scale, head_dim, .. } => {
                let hd = *head_dim;
                debug_assert!(at.is_multiple_of(hd) && codes.len() == scales.len() * hd, "scaled arena: bad rows");
                q[at..at + codes.len()].copy_from_slice(codes);
                scale[at / hd..at / hd + scales.len()].copy_from_slice(scales);
            }
            Arena::F32(_) | Arena::F16(_) => panic!("write_encoded: the arena holds floats, not codes"),
        }
    }

    fn read(&self, at: usize, out: &mut [f32]) {
        match self {
            Arena::F32(a) => out.copy_from_slice(&a[at..at + out.len()]),
            Arena::F16(a) => crate::cpu::widen_f16(&a[at..at + out.len()], out),
            Arena::Scaled { q, scale, head_dim, dtype } => {
                let hd = *head_dim;
                debug_assert!(at.is_multiple_of(hd) && out.len().is_multiple_of(hd), "scaled arena: unaligned read");
                let rows = q[at..at + out.len()].chunks_exact(hd).zip(&scale[at / hd..(at + out.len()) / hd]);
                for ((qr, &s), o) in rows.zip(out.chunks_exact_mut(hd)) {
                    for (o, &c) in o.iter_mut().zip(qr) {
                        *o = dtype.widen_code(c) * s;
                    }
                    // The normalised transform is its own inverse.
                    if dtype.rotates_keys() {
                        crate::codec::hadamard_rotate(o);
                    }
                }
            }
        }
    }
}

/// Both arenas, whole, in their stored element type: what attention kernels dispatch on.
#[derive(Clone, Copy, Debug)]
pub enum KvArenas<'a> {
    F32 {
        k: &'a [f32],
        v: &'a [f32],
    },
    /// f16 bit patterns.
    F16 {
        k: &'a [u16],
        v: &'a [u16],
    },
    /// Quantised elements of a slot-scaled `dtype` ([`KvDtype::Int8`]: two's-complement bytes, [`KvDtype::Fp8`]:
    /// e4m3 bytes; [`KvDtype::Fp8Rotated`]: e4m3 bytes of rotated keys, so a reader of `k` must rotate its query)
    /// and one scale per slot (`k_scale[b * block_size + s]` for slot `s` of block `b`).
    Scaled {
        k: &'a [u8],
        v: &'a [u8],
        k_scale: &'a [f32],
        v_scale: &'a [f32],
        dtype: KvDtype,
    },
}

/// K and V arenas of `num_blocks` blocks, each `[block_size][head_dim]` elements of [`KvDtype`].
#[derive(Clone, Debug)]
pub struct KvStorage {
    num_blocks: usize,
    block_size: usize,
    head_dim: usize,
    dtype: KvDtype,
    k: Arena,
    v: Arena,
    /// How blocks of this arena encoded as `fp8_e4m3_rotated` round their keys, per table (`layer * n_kv_heads +
    /// head`); `None`: to the nearest code.
    key_rounding: Option<Arc<[KeyRounding]>>,
}

impl KvStorage {
    /// Allocates zeroed f32 K and V arenas. Panics if the size overflows or a dimension is zero.
    pub fn new(num_blocks: usize, block_size: usize, head_dim: usize) -> KvStorage {
        KvStorage::with_dtype(num_blocks, block_size, head_dim, KvDtype::F32)
    }

    /// Allocates zeroed K and V arenas of `dtype`. Panics if the size overflows, a dimension is zero, or a
    /// rotated-key arena's head_dim exceeds [`crate::codec::MAX_HEAD_DIM`] (the codecs' bound too).
    pub fn with_dtype(num_blocks: usize, block_size: usize, head_dim: usize, dtype: KvDtype) -> KvStorage {
        assert!(block_size > 0 && head_dim > 0, "block_size and head_dim must be non-zero");
        assert!(
            !dtype.rotates_keys() || head_dim <= crate::codec::MAX_HEAD_DIM,
            "{dtype} rotates keys of at most {} elements",
            crate::codec::MAX_HEAD_DIM
        );
        let len = num_blocks
            .checked_mul(block_size)
            .and_then(|x| x.checked_mul(head_dim))
            .expect("KvStorage size overflows usize");
        KvStorage {
            num_blocks,
            block_size,
            head_dim,
            dtype,
            k: Arena::zeroed(dtype, len, head_dim),
            v: Arena::zeroed(dtype.value_dtype(), len, head_dim),
            key_rounding: None,
        }
    }

    /// Has blocks encoded as `fp8_e4m3_rotated` round their keys for the model's queries (one [`KeyRounding`] per
    /// table, `layer * n_kv_heads + head`) rather than to the nearest code.
    pub fn set_key_rounding(&mut self, rounding: Arc<[KeyRounding]>) {
        self.key_rounding = Some(rounding);
    }

    /// Every table's key rounding ([`KvStorage::set_key_rounding`]), to give another arena the same.
    pub fn key_roundings(&self) -> Option<Arc<[KeyRounding]>> {
        self.key_rounding.clone()
    }

    /// The key rounding of table `table` ([`KvStorage::set_key_rounding`]), if any.
    pub fn key_rounding(&self, table: usize) -> Option<&KeyRounding> {
        self.key_rounding.as_deref().and_then(|r| r.get(table))
    }

    /// Element type of the arenas.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Number of blocks in each arena.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Elements per slot.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Elements per block.
    #[inline]
    pub fn block_len(&self) -> usize {
        self.block_size * self.head_dim
    }

    /// Bytes of K plus V of one block.
    pub fn block_bytes(&self) -> usize {
        2 * self.block_size * self.dtype.slot_bytes(self.head_dim)
    }

    #[inline]
    fn range(&self, b: u32) -> std::ops::Range<usize> {
        let b = b as usize;
        assert!(b < self.num_blocks, "block {b} out of range ({} blocks)", self.num_blocks);
        let l = self.block_len();
        b * l..(b + 1) * l
    }

    fn f32_arenas(&self) -> (&[f32], &[f32]) {
        match (&self.k, &self.v) {
            (Arena::F32(k), Arena::F32(v)) => (k, v),
            _ => panic!("f32 view of an {} KV cache: use read_block/write_block/arenas_any", self.dtype),
        }
    }

    fn f32_arenas_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        match (&mut self.k, &mut self.v) {
            (Arena::F32(k), Arena::F32(v)) => (k, v),
            _ => panic!("f32 view of an {} KV cache: use read_block/write_block/arenas_any", self.dtype),
        }
    }

    /// K of block `b`: `[block_size][head_dim]`. f32 caches only (panics on f16; [`KvStorage::read_block`]
    /// works for both).
    pub fn block_k(&self, b: u32) -> &[f32] {
        &self.f32_arenas().0[self.range(b)]
    }

    /// V of block `b`: `[block_size][head_dim]`. f32 caches only.
    pub fn block_v(&self, b: u32) -> &[f32] {
        &self.f32_arenas().1[self.range(b)]
    }

    /// Mutable K of block `b`. f32 caches only.
    pub fn block_k_mut(&mut self, b: u32) -> &mut [f32] {
        let r = self.range(b);
        &mut self.f32_arenas_mut().0[r]
    }

    /// Mutable V of block `b`. f32 caches only.
    pub fn block_v_mut(&mut self, b: u32) -> &mut [f32] {
        let r = self.range(b);
        &mut self.f32_arenas_mut().1[r]
    }

    /// Reads the first `k_out.len()` (= `v_out.len()`) elements of block `b`'s K and V as f32, whatever the dtype.
    pub fn read_block(&self, b: u32, k_out: &mut [f32], v_out: &mut [f32]) {
        let r = self.range(b);
        assert!(k_out.len() == v_out.len() && k_out.len() <= r.len(), "read_block: bad output lengths");
        self.k.read(r.start, k_out);
        self.v.read(r.start, v_out);
    }

    /// Reads the first `k_out.len()` elements of block `b`'s K as f32.
    pub fn read_block_k(&self, b: u32, k_out: &mut [f32]) {
        let r = self.range(b);
        assert!(k_out.len() <= r.len(), "read_block_k: output longer than a block");
        self.k.read(r.start, k_out);
    }

    /// Writes `k` and `v` (equal lengths, at most a block) over the start of block `b`, rounding to the dtype.
    pub fn write_block(&mut self, b: u32, k: &[f32], v: &[f32]) {
        let r = self.range(b);
        assert!(k.len() == v.len() && k.len() <= r.len(), "write_block: bad input lengths");
        self.k.write(r.start, k);
        self.v.write(r.start, v);
    }

    /// Overwrites block `b` of a slot-scaled cache (int8, fp8) with codes and slot scales as they are (`block_len`
    /// codes and `block_size` scales per half): how a stored block comes back bit-exactly. Panics on a float cache
    /// or on wrong lengths.
    pub fn write_block_scaled(&mut self, b: u32, k: &[u8], k_scale: &[f32], v: &[u8], v_scale: &[f32]) {
        let r = self.range(b);
        let bs = self.block_size;
        assert!(k.len() == r.len() && v.len() == r.len(), "write_block_scaled: codes must fill the block");
        assert!(k_scale.len() == bs && v_scale.len() == bs, "write_block_scaled: one scale per slot");
        assert!(self.slot_scaled(), "write_block_scaled on an {} KV cache", self.dtype);
        self.k.write_encoded(r.start, k, k_scale);
        self.v.write_encoded(r.start, v, v_scale);
    }

    /// Overwrites block `b` of an f16 cache with little-endian f16 bit patterns (`2 × block_len` bytes per half) as
    /// they are: how a stored f16 block comes back without a round trip through f32. Panics on another dtype or on
    /// wrong lengths.
    pub fn write_block_f16_le(&mut self, b: u32, k: &[u8], v: &[u8]) {
        let r = self.range(b);
        assert!(k.len() == 2 * r.len() && v.len() == 2 * r.len(), "write_block_f16_le: bytes must fill the block");
        for (arena, bytes) in [(&mut self.k, k), (&mut self.v, v)] {
            let Arena::F16(a) = arena else { panic!("write_block_f16_le on an {} KV cache", self.dtype) };
            for (d, s) in a[r.clone()].iter_mut().zip(bytes.chunks_exact(2)) {
                *d = u16::from_le_bytes([s[0], s[1]]);
            }
        }
    }

    /// Reads one slot's K and V rows (`head_dim` each) as f32, whatever the dtype.
    pub fn read_slot(&self, b: u32, slot: usize, k_out: &mut [f32], v_out: &mut [f32]) {
        let hd = self.head_dim;
        assert!(slot < self.block_size && k_out.len() == hd && v_out.len() == hd, "read_slot: bad slot or row length");
        let at = self.range(b).start + slot * hd;
        self.k.read(at, k_out);
        self.v.read(at, v_out);
    }

    /// Whether this storage keeps codes and a scale per slot (int8, e4m3): then [`KvStorage::encode_slot`] encodes a
    /// slot's rows apart from the storage, and [`KvStorage::write_encoded_slot`] stores them.
    pub fn slot_scaled(&self) -> bool {
        self.dtype.slot_scaled()
    }

    /// Encodes one slot's K and V rows (`head_dim` floats each) as [`KvStorage::write_slot`] would store them:
    /// codes into `k_codes` and `v_codes` (`head_dim` bytes each), the two scales returned. It reads nothing
    /// of the storage but its dtype, so a step's rows can be encoded in parallel before they are stored. Panics
    /// unless [`KvStorage::slot_scaled`], or on a row of the wrong length.
    pub fn encode_slot(&self, k: &[f32], v: &[f32], k_codes: &mut [u8], v_codes: &mut [u8]) -> (f32, f32) {
        let hd = self.head_dim;
        assert!(self.slot_scaled(), "encode_slot: a {} storage keeps no codes", self.dtype);
        assert!(k.len() == hd && v.len() == hd && k_codes.len() == hd && v_codes.len() == hd, "encode_slot: bad row");
        (encode_scaled_row(self.dtype, k, k_codes), encode_scaled_row(self.dtype.value_dtype(), v, v_codes))
    }

    /// Stores one slot that [`KvStorage::encode_slot`] encoded: bit for bit what [`KvStorage::write_slot`] of the
    /// same rows stores.
    pub fn write_encoded_slot(
        &mut self,
        b: u32,
        slot: usize,
        (k_codes, k_scale): (&[u8], f32),
        (v_codes, v_scale): (&[u8], f32),
    ) {
        let hd = self.head_dim;
        assert!(
            slot < self.block_size && k_codes.len() == hd && v_codes.len() == hd,
            "write_encoded_slot: bad slot or row length"
        );
        let at = self.range(b).start + slot * hd;
        self.k.write_encoded(at, k_codes, &[k_scale]);
        self.v.write_encoded(at, v_codes, &[v_scale]);
    }

    /// Writes one slot's K and V rows (`head_dim` each), rounding to the dtype.
    pub fn write_slot(&mut self, b: u32, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        assert!(slot < self.block_size && k.len() == hd && v.len() == hd, "write_slot: bad slot or row length");
        let at = self.range(b).start + slot * hd;
        self.k.write(at, k);
        self.v.write(at, v);
    }

    /// Copies K and V of block `src` into block `dst`.
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let s = self.range(src);
        let d = self.range(dst);
        self.k.copy_within(s.clone(), d.start);
        self.v.copy_within(s, d.start);
    }

    /// Copies K and V of slot `src_slot` of block `src` over slot `dst_slot` of block `dst`: the per-KV move of the
    /// KV-Compress paper's MoveCache (Alg. 1 lines 12–13), used to pack surviving slots after eviction so whole
    /// blocks can be freed. `src == dst` with `src_slot == dst_slot` is a no-op. Panics if a block or slot is out
    /// of range.
    pub fn move_slot(&mut self, src: u32, src_slot: usize, dst: u32, dst_slot: usize) {
        assert!(src_slot < self.block_size && dst_slot < self.block_size, "move_slot: slot out of range");
        let (s, d) = (self.range(src).start, self.range(dst).start);
        if s == d && src_slot == dst_slot {
            return;
        }
        let hd = self.head_dim;
        let (s, d) = (s + src_slot * hd, d + dst_slot * hd);
        self.k.copy_within(s..s + hd, d);
        self.v.copy_within(s..s + hd, d);
    }

    /// Compacts one (layer, kv-head) cache in place after eviction: slot `keep[j]` moves to slot `j`, so the
    /// survivors occupy `0..keep.len()` and blocks from `keep.len().div_ceil(block_size)` on can be freed by the
    /// caller. Returns `keep.len()`, the new length.
    ///
    /// Unlike KV-Compress's MoveCache, which fills holes with KVs taken from the tail (fewer moves, order lost),
    /// this preserves slot order: attention is causal in slot space ([`AttnSeq`]), so reordering would change
    /// which cached tokens later chunk tokens may see. `keep` must be strictly ascending with every entry `< len`
    /// (checked in debug builds); then each destination `j <= keep[j]` is never the source of a later move. Slots
    /// past the new length keep stale data.
    pub fn compact_table(&mut self, table: &[u32], len: usize, keep: &[u32]) -> usize {
        debug_assert!(keep.windows(2).all(|w| w[0] < w[1]), "compact_table: keep is not strictly ascending");
        debug_assert!(keep.last().is_none_or(|&l| (l as usize) < len), "compact_table: keep has a slot >= len");
        debug_assert!(table.len() >= len.div_ceil(self.block_size), "compact_table: table too short for len");
        let bs = self.block_size;
        for (j, &src) in keep.iter().enumerate() {
            let src = src as usize;
            if src != j {
                self.move_slot(table[src / bs], src % bs, table[j / bs], j % bs);
            }
        }
        keep.len()
    }

    /// Both arenas, whole (`num_blocks * block_size * head_dim` each). f32 caches only.
    pub fn arenas(&self) -> (&[f32], &[f32]) {
        let (k, v) = self.f32_arenas();
        (k, v)
    }

    /// Both arenas, mutable. f32 caches only.
    pub fn arenas_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        let (k, v) = self.f32_arenas_mut();
        (k, v)
    }

    /// Both arenas in their stored element type.
    pub fn arenas_any(&self) -> KvArenas<'_> {
        match (&self.k, &self.v) {
            (Arena::F32(k), Arena::F32(v)) => KvArenas::F32 { k, v },
            (Arena::F16(k), Arena::F16(v)) => KvArenas::F16 { k, v },
            (Arena::Scaled { q: k, scale: k_scale, dtype, .. }, Arena::Scaled { q: v, scale: v_scale, .. }) => {
                KvArenas::Scaled { k, v, k_scale, v_scale, dtype: *dtype }
            }
            _ => unreachable!("K and V arenas are created with one dtype"),
        }
    }
}

/// One sequence's view for ONE layer during a forward step.
///
/// Causality is in slot space: new token `j` of a sequence attends to slots `[0, prior_lens[h] + j]` of each
/// kv-head `h`. The caller guarantees `tables[h]` has capacity for `prior_lens[h] + n_new` slots.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    /// First row of this sequence in the batch's q/k/v/out matrices.
    pub q_row: usize,
    /// Tokens computed this step (1 for decode, chunk length for prefill).
    pub n_new: usize,
    /// Block table per kv-head of this layer (len n_kv_heads).
    pub tables: &'a [Vec<u32>],
    /// Cache length per kv-head BEFORE this step's tokens (len n_kv_heads).
    pub prior_lens: &'a [usize],
}

/// Where [`crate::Backend::paged_attention_with_probs`] writes the attention weights of one sequence of the batch
/// for one layer, summed over the step's new tokens, so that eviction policies that rank slots by accumulated
/// attention (H2O's running sum, KV-Compress's Eq. 20 metric) read the weights the attention kernel already
/// computed instead of walking the keys a second time.
///
/// Row `qh` (query head) starts at `sums[qh * stride]`. Its entry `s`, for every slot of its kv-head up to
/// `prior_lens[qh / group] + n_new`, becomes `Σ_j p_j(s)^power` over the new tokens `j` that see slot `s` (those
/// with `prior + j >= s`), where `p_j` is token `j`'s softmax over its visible slots. A prefill chunk of `n` tokens thus
/// costs `n_heads × stride` floats, not `n_heads × n × stride`. A probability row holding a NaN or an infinity
/// adds nothing (it carries no usable ranking). Entries past a row's visible length are left untouched.
#[derive(Debug)]
pub struct AttnProbs<'a> {
    /// Index of the sequence in the batch's `seqs`.
    pub seq: usize,
    /// Each probability is raised to this power before it is summed (1 for H2O, 2 for KV-Compress).
    pub power: u32,
    /// Row stride: at least `prior_lens[h] + n_new` for every kv-head `h` of the sequence.
    pub stride: usize,
    /// `[n_heads][stride]`.
    pub sums: &'a mut [f32],
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// `THPeligible` of the mapping of `/proc/self/smaps` that holds `addr` (None when the field is missing).
    fn thp_eligible(addr: usize) -> Option<bool> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_once(' ').map_or(line, |(r, _)| r);
            if let Some((lo, hi)) = range.split_once('-')
                && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
            } else if inside && let Some(v) = line.strip_prefix("THPeligible:") {
                return Some(v.trim() == "1");
            }
        }
        None
    }

    /// Every arena and scale array starts on a cache line, in a fresh pool and in a clone of one, for every dtype
    /// and block shape the pool takes: a block's lines are then its own (`ARENA_ALIGN`).
    #[test]
    fn arenas_start_on_a_cache_line() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Fp8, KvDtype::Fp8Rotated] {
            for (blocks, bs, hd) in [(1, 16, 64), (4096, 16, 64), (300, 32, 128), (7, 16, 32)] {
                let kv = KvStorage::with_dtype(blocks, bs, hd, dtype);
                for kv in [&kv, &kv.clone()] {
                    let mut addrs = Vec::new();
                    match kv.arenas_any() {
                        KvArenas::F32 { k, v } => addrs.extend([k.as_ptr() as usize, v.as_ptr() as usize]),
                        KvArenas::F16 { k, v } => addrs.extend([k.as_ptr() as usize, v.as_ptr() as usize]),
                        KvArenas::Scaled { k, v, k_scale, v_scale, .. } => {
                            assert_eq!((k.len(), k_scale.len()), (blocks * bs * hd, blocks * bs));
                            addrs.extend([k.as_ptr() as usize, v.as_ptr() as usize]);
                            addrs.extend([k_scale.as_ptr() as usize, v_scale.as_ptr() as usize]);
                        }
                    }
                    for a in addrs {
                        assert_eq!(a % ARENA_ALIGN, 0, "{dtype} {blocks}x{bs}x{hd}: arena at {a:#x}");
                    }
                }
            }
        }
    }

    /// Every arena of a pool large enough for huge pages is advised into them (in THP's `madvise` mode, the
    /// default, a mapping is eligible only when advised). Skipped where the kernel has THP off or hides the field.
    #[test]
    fn arenas_are_eligible_for_transparent_huge_pages() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !mode.contains("[madvise]") && !mode.contains("[always]") {
            return;
        }
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Fp8] {
            // 4,096 blocks of 16 slots of 64: 4 MiB of int8 codes, 1 MiB of their scales.
            let kv = KvStorage::with_dtype(4096, 16, 64, dtype);
            let mut addrs = Vec::new();
            match kv.arenas_any() {
                KvArenas::F32 { k, v } => addrs.extend([k.as_ptr() as usize, v.as_ptr() as usize]),
                KvArenas::F16 { k, v } => addrs.extend([k.as_ptr() as usize, v.as_ptr() as usize]),
                KvArenas::Scaled { k, v, .. } => addrs.extend([k.as_ptr() as usize, v.as_ptr() as usize]),
            }
            for a in addrs {
                // The first 2 MiB boundary inside the arena is where the advice starts.
                let Some(eligible) = thp_eligible(a.next_multiple_of(2 << 20)) else { return };
                assert!(eligible, "{dtype}: arena at {a:#x} not advised into huge pages");
            }
        }
        // Below one huge page nothing is advised (a small vector would only round the range away).
        let small = huge_pages(vec![0u8; 1 << 20]);
        assert_eq!(small.len(), 1 << 20);
    }
}
