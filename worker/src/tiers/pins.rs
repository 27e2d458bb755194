//! Codecs that requests chose for their own KV (the `kv.codec` request extension, DESIGN §8) under LRU placement:
//! which codec the groups of a request that named one are stored in when they go down a tier, in place of the
//! worker's `--tier-codec`.
//!
//! A request names the codec; its groups become idle when it ends, and the engine's LRU offload then asks
//! [`CodecPins::codec_for`]. A group shared by several requests takes the codec of the last one that ended naming
//! one. A copy already stored stands (the first stored copy of a group is the one the tiers keep). EvicPress chooses
//! every context's codec by utility and refuses such requests.

use std::collections::{HashMap, VecDeque};

use super::GroupCodec;

/// Most groups [`CodecPins`] remembers a codec for; the oldest are forgotten first (they then take the worker's
/// default).
pub const MAX_PINNED_GROUPS: usize = 1 << 16;

/// The codec named for each of the recently ended requests' groups, bounded by [`MAX_PINNED_GROUPS`].
#[derive(Debug, Default)]
pub struct CodecPins {
    codecs: HashMap<u64, GroupCodec>,
    order: VecDeque<u64>,
}

impl CodecPins {
    /// The groups with chain hashes `hashes` are to be stored in `codec`.
    pub fn pin(&mut self, hashes: &[u64], codec: GroupCodec) {
        for &h in hashes {
            if self.codecs.insert(h, codec).is_none() {
                self.order.push_back(h);
            }
        }
        while self.order.len() > MAX_PINNED_GROUPS {
            if let Some(old) = self.order.pop_front() {
                self.codecs.remove(&old);
            }
        }
    }

    /// The codec group `hash` goes down a tier in: the one a request named for it, else `default`.
    pub fn codec_for(&self, hash: u64, default: GroupCodec) -> GroupCodec {
        self.codecs.get(&hash).copied().unwrap_or(default)
    }

    /// How many groups have a codec named.
    pub fn len(&self) -> usize {
        self.codecs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.codecs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_kernels::{Codec, KvDtype};

    const NATIVE: GroupCodec = GroupCodec::Native(KvDtype::F16);

    #[test]
    fn a_named_codec_replaces_the_default_until_forgotten() {
        let int8 = GroupCodec::Kv(Codec::Int8);
        let int4 = GroupCodec::Kv(Codec::Int4Kivi);
        let mut pins = CodecPins::default();
        pins.pin(&[1, 2], int8);
        assert_eq!((pins.codec_for(1, NATIVE), pins.codec_for(3, NATIVE)), (int8, NATIVE));
        // The last request to name a codec for a shared group decides.
        pins.pin(&[2, 3], int4);
        assert_eq!([1, 2, 3].map(|h| pins.codec_for(h, NATIVE)), [int8, int4, int4]);
        assert_eq!(pins.len(), 3);
        // Bounded: the oldest go first.
        let many: Vec<u64> = (10..10 + MAX_PINNED_GROUPS as u64).collect();
        pins.pin(&many, NATIVE);
        assert_eq!(pins.len(), MAX_PINNED_GROUPS);
        assert_eq!(pins.codec_for(1, int4), int4, "forgotten: the default");
        assert_eq!(pins.codec_for(10, int4), NATIVE);
    }
}
