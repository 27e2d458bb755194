//! [`PolicyKv`]: the KV operations eviction needs from a runner's cache — the scores the policies rank slots by and
//! the block and slot moves that compact a table — so that the policies and [`crate::cache::SeqBlocks`] run over
//! the CPU's [`KvStorage`] (the kernels' CPU scores) and over the CUDA runner's device arenas (its score and move
//! kernels) alike. Every method keeps the contract of the `pagoda_kernels::scores` function or `KvStorage` method
//! of the same name.
//!
//! The methods cannot fail: a runner whose device call fails keeps the error and fails the step that follows
//! ([`crate::engine::ModelRunner::take_error`]), so a policy never acts on half an answer twice.

use std::ops::Range;

use pagoda_kernels::KvStorage;
use pagoda_kernels::scores::{self, Window};

/// KV reads and moves for the eviction policies, over one (layer, kv-head) table at a time.
pub trait PolicyKv {
    /// `‖K‖₂` of the slots `slots` of `table`, into `out[slots]` (`scores::key_norms`).
    fn key_norms(&self, table: &[u32], slots: Range<usize>, out: &mut [f32]);
    /// `‖V‖₂ / ‖K‖₂` of slots `0..len` into `out[..len]` (`scores::value_key_ratio`).
    fn value_key_ratio(&self, table: &[u32], len: usize, out: &mut [f32]);
    /// [`PolicyKv::value_key_ratio`] of several `(table, len)` entries, entry `i` into `out[i]` (resized to its
    /// `len`). A GPU runner answers in one launch and one copy instead of one per table; the default asks table by
    /// table.
    fn value_key_ratios(&self, entries: &[(&[u32], usize)], out: &mut [Vec<f32>]) {
        for (&(table, len), o) in entries.iter().zip(out) {
            o.resize(len, 0.0);
            self.value_key_ratio(table, len, o);
        }
    }
    /// [`PolicyKv::value_key_ratio`] of the slots `slots` of each `(table, slots)` entry, entry `i` into
    /// `out[i][slots]` (a slice indexed by slot, as a per-slot metric is). By default the tables are scored whole
    /// in one [`PolicyKv::value_key_ratios`] call (a device's one launch) and the slots asked for copied out.
    fn value_key_ratios_in(&self, entries: &[(&[u32], Range<usize>)], out: &mut [&mut [f32]]) {
        let whole: Vec<(&[u32], usize)> = entries.iter().map(|(table, slots)| (*table, slots.end)).collect();
        let mut scored = vec![Vec::new(); entries.len()];
        self.value_key_ratios(&whole, &mut scored);
        for (((_, slots), o), s) in entries.iter().zip(out).zip(&scored) {
            o[slots.clone()].copy_from_slice(&s[slots.clone()]);
        }
    }
    /// KeyDiff's cosine of each key with the anchor of normalised keys (`scores::keydiff_cosine`).
    fn keydiff_cosine(&self, table: &[u32], len: usize, anchor: &mut Vec<f32>, out: &mut [f32]);
    /// Adds `sign · k_i / ‖k_i‖` (norms from `norms`) of the slots `slots` to `unit_key_sum`
    /// (`scores::add_unit_keys`).
    fn add_unit_keys(&self, table: &[u32], slots: Range<usize>, norms: &[f32], sign: f64, unit_key_sum: &mut [f64]);
    /// KeyDiff's cosine from a kept anchor sum and kept norms (`scores::keydiff_cosine_kept`).
    #[allow(clippy::too_many_arguments)]
    fn keydiff_cosine_kept(
        &self,
        table: &[u32],
        len: usize,
        unit_key_sum: &[f64],
        norms: &[f32],
        anchor: &mut Vec<f32>,
        out: &mut [f32],
    );
    /// Observation-window attention (raised to its power) of the window's queries, added to `out[..len]`
    /// (`scores::window_attention_scores`).
    fn window_attention_scores(
        &self,
        table: &[u32],
        len: usize,
        window: Window<'_>,
        probs: &mut Vec<f32>,
        out: &mut [f32],
    );
    /// Block `dst` becomes a copy of block `src` (K and V).
    fn copy_block(&mut self, src: u32, dst: u32);
    /// Slot `dst_slot` of block `dst` becomes slot `src_slot` of block `src`.
    fn move_slot(&mut self, src: u32, src_slot: usize, dst: u32, dst_slot: usize);
    /// Moves the slots `keep` (ascending, below `len`) of `table` to slots `0..keep.len()`, in order; returns how
    /// many were kept.
    fn compact_table(&mut self, table: &[u32], len: usize, keep: &[u32]) -> usize;
}

impl PolicyKv for KvStorage {
    fn key_norms(&self, table: &[u32], slots: Range<usize>, out: &mut [f32]) {
        scores::key_norms(self, table, slots, out);
    }

    fn value_key_ratio(&self, table: &[u32], len: usize, out: &mut [f32]) {
        scores::value_key_ratio(self, table, len, out);
    }

    fn value_key_ratios_in(&self, entries: &[(&[u32], Range<usize>)], out: &mut [&mut [f32]]) {
        for ((table, slots), o) in entries.iter().zip(out) {
            scores::value_key_ratio_in(self, table, slots.clone(), o);
        }
    }

    fn keydiff_cosine(&self, table: &[u32], len: usize, anchor: &mut Vec<f32>, out: &mut [f32]) {
        scores::keydiff_cosine(self, table, len, anchor, out);
    }

    fn add_unit_keys(&self, table: &[u32], slots: Range<usize>, norms: &[f32], sign: f64, unit_key_sum: &mut [f64]) {
        scores::add_unit_keys(self, table, slots, norms, sign, unit_key_sum);
    }

    fn keydiff_cosine_kept(
        &self,
        table: &[u32],
        len: usize,
        unit_key_sum: &[f64],
        norms: &[f32],
        anchor: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        scores::keydiff_cosine_kept(self, table, len, unit_key_sum, norms, anchor, out);
    }

    fn window_attention_scores(
        &self,
        table: &[u32],
        len: usize,
        window: Window<'_>,
        probs: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        scores::window_attention_scores(self, table, len, window, probs, out);
    }

    fn copy_block(&mut self, src: u32, dst: u32) {
        KvStorage::copy_block(self, src, dst);
    }

    fn move_slot(&mut self, src: u32, src_slot: usize, dst: u32, dst_slot: usize) {
        KvStorage::move_slot(self, src, src_slot, dst, dst_slot);
    }

    fn compact_table(&mut self, table: &[u32], len: usize, keep: &[u32]) -> usize {
        KvStorage::compact_table(self, table, len, keep)
    }
}
