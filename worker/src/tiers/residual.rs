//! KIVI's full-precision residual for stored prompts: which groups keep the device's own lossless format when a
//! placement stores a prompt in a KIVI codec (`int4_kivi`, `int2_kivi`).
//!
//! KIVI (Liu et al., 2024) quantises the KV cache in groups but keeps the most recent `R` tokens (`R = 128` in its
//! paper) in full precision: the tokens a next token attends to most. On the device Pagoda keeps the block being
//! filled in the arena's format, which plays that role while a sequence runs. A prompt stored in a lower tier has
//! no block being filled: every group of it would be quantised, its last tokens included, and the request that
//! continues it (the next chat turn, another question on the same document) attends to those first. So the last
//! `⌈R / block_size⌉` full groups of every stored prompt stay in the arena's format; the groups before them take
//! the codec. Codecs other than KIVI's store every group alike (their formats define no residual).
//!
//! [`ResidualTails`] remembers, for the LRU placement, which chain hashes ended a finished prompt; EvicPress knows
//! its contexts' tails itself (a context is the unowned run of a prompt's groups, so it ends where the prompt
//! does) and asks only [`stored_codec`].

use std::collections::{HashSet, VecDeque};

use pagoda_kernels::Codec;

use super::GroupCodec;

/// Largest residual accepted, in tokens (a bound on the flag; KIVI's own default is 128).
pub const MAX_RESIDUAL_TOKENS: usize = 4096;

/// Most tail hashes [`ResidualTails`] remembers; the oldest are forgotten first.
pub const MAX_TAIL_HASHES: usize = 1 << 16;

/// Checks a residual length against [`MAX_RESIDUAL_TOKENS`] (every entry point takes the same bound).
pub fn check_tokens(tokens: usize) -> Result<(), String> {
    if tokens > MAX_RESIDUAL_TOKENS {
        return Err(format!("a residual of at most {MAX_RESIDUAL_TOKENS} tokens, got {tokens}"));
    }
    Ok(())
}

/// Whether `codec` is one of KIVI's, the codecs with a full-precision residual.
pub fn has_residual(codec: GroupCodec) -> bool {
    matches!(codec.chosen(), Some(Codec::Int4Kivi | Codec::Int2Kivi))
}

/// Groups of the residual: `residual_tokens` rounded up to whole groups of `block_size`.
pub fn residual_groups(residual_tokens: usize, block_size: usize) -> usize {
    residual_tokens.div_ceil(block_size.max(1))
}

/// The codec group `index` of a prompt of `groups` groups is stored in when the placement chose `codec`: the
/// arena's `native` format for the last `residual` groups under a KIVI codec, `codec` otherwise.
pub fn stored_codec(codec: GroupCodec, native: GroupCodec, index: usize, groups: usize, residual: usize) -> GroupCodec {
    if has_residual(codec) && index + residual >= groups { native } else { codec }
}

/// The chain hashes of the last residual groups of recently finished prompts, bounded by [`MAX_TAIL_HASHES`].
#[derive(Debug, Default)]
pub struct ResidualTails {
    groups: usize,
    tails: HashSet<u64>,
    order: VecDeque<u64>,
}

impl ResidualTails {
    /// Tails of `groups` groups (0: no residual, nothing is remembered).
    pub fn new(groups: usize) -> ResidualTails {
        ResidualTails { groups, ..ResidualTails::default() }
    }

    /// Remembers the tail of a finished prompt whose full groups have chain hashes `prompt_groups`.
    pub fn finished(&mut self, prompt_groups: &[u64]) {
        let tail = &prompt_groups[prompt_groups.len().saturating_sub(self.groups)..];
        for &h in tail {
            if self.tails.insert(h) {
                self.order.push_back(h);
            }
        }
        while self.order.len() > MAX_TAIL_HASHES {
            if let Some(old) = self.order.pop_front() {
                self.tails.remove(&old);
            }
        }
    }

    /// The codec group `hash` is stored in when the placement chose `codec`.
    pub fn codec_for(&self, hash: u64, codec: GroupCodec, native: GroupCodec) -> GroupCodec {
        if has_residual(codec) && self.tails.contains(&hash) { native } else { codec }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_kernels::KvDtype;

    const NATIVE: GroupCodec = GroupCodec::Native(KvDtype::F16);

    #[test]
    fn only_kivi_codecs_keep_their_last_groups_native() {
        let int2 = GroupCodec::Kv(Codec::Int2Kivi);
        let at = |i| stored_codec(int2, NATIVE, i, 10, residual_groups(32, 16));
        assert_eq!((0..10).map(at).filter(|&c| c == NATIVE).count(), 2);
        assert_eq!(at(7), int2);
        assert_eq!(at(8), NATIVE);
        assert_eq!(at(9), NATIVE);
        assert_eq!(residual_groups(33, 16), 3);
        // A prompt shorter than the residual is native whole; no residual leaves every group in the codec.
        assert!((0..2).all(|i| stored_codec(int2, NATIVE, i, 2, 8) == NATIVE));
        assert!((0..10).all(|i| stored_codec(int2, NATIVE, i, 10, 0) == int2));
        let fp8 = GroupCodec::Kv(Codec::Fp8E4m3);
        assert!((0..10).all(|i| stored_codec(fp8, NATIVE, i, 10, 2) == fp8));
    }

    #[test]
    fn tails_are_the_last_groups_of_each_prompt_and_bounded() {
        let int4 = GroupCodec::Kv(Codec::Int4Kivi);
        let mut t = ResidualTails::new(2);
        t.finished(&[1, 2, 3, 4]);
        assert_eq!(t.codec_for(2, int4, NATIVE), int4);
        assert_eq!(t.codec_for(3, int4, NATIVE), NATIVE);
        assert_eq!(t.codec_for(4, int4, NATIVE), NATIVE);
        assert_eq!(t.codec_for(4, GroupCodec::Kv(Codec::Int8), NATIVE), GroupCodec::Kv(Codec::Int8));
        let mut none = ResidualTails::new(0);
        none.finished(&[1, 2, 3]);
        assert_eq!(none.codec_for(3, int4, NATIVE), int4);
        for i in 0..(MAX_TAIL_HASHES as u64 + 10) {
            t.finished(&[i << 8]);
        }
        assert!(t.tails.len() <= MAX_TAIL_HASHES && t.order.len() == t.tails.len());
        assert_eq!(t.codec_for(3, int4, NATIVE), int4, "the oldest tails are forgotten first");
    }
}
