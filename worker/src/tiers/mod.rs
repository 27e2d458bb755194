//! The KV tiers below the device pool (DESIGN §5): `host` (a bounded RAM pool) and `disk` (checksummed block
//! files under the data dir), the measured cost model that decides between onboarding and recomputing, and
//! [`TierStore`], which owns both stores on the engine thread and moves groups between them.
//!
//! The unit of storage is a block *group* (every (layer, kv-head) block of one 16-token chunk), keyed by its
//! prefix chain hash and stored as opaque encoded bytes tagged with a codec name: [`native`] (the device blocks'
//! own elements) or one of the compressing KV codecs ([`codec`]); onboarding decodes by the stored name. Which
//! codec a group gets is the placement's choice: the LRU placement uses one fixed codec (`--tier-codec`, native by
//! default), EvicPress ([`crate::placement`]) chooses per context.
//!
//! Groups reach the lower tiers write-back: when a device group becomes idle (joins the pool's LRU queue) the
//! engine copies it into the host tier between steps, while its blocks are still immutable and owned by the
//! prefix index. A later device eviction therefore loses nothing, and never has to race the forward step that
//! reuses the blocks. Host LRU victims are demoted to disk.

pub mod codec;
pub mod cost;
pub mod disk;
pub mod host;
pub mod native;
pub mod pins;
pub mod pruned;
pub mod residual;
pub mod store;

pub use codec::{GroupCodec, Int8Layers};
pub use cost::CostModel;
pub use disk::DiskStore;
pub use host::HostStore;
pub use store::{TierConfig, TierStore};

/// Where a group lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }

    /// Position in per-tier arrays ([`Tier::ALL`] order).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// One block group in some codec's byte format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedGroup {
    pub codec: String,
    pub bytes: Vec<u8>,
}

impl EncodedGroup {
    pub fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// Bytes held in one tier under one codec (borrowed for the device's fixed names: the engine publishes its stats
/// every step).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierUsage {
    pub tier: Tier,
    pub codec: std::borrow::Cow<'static, str>,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("corrupt KV file {path}: {reason}")]
    Corrupt { path: std::path::PathBuf, reason: String },
    #[error("codec {codec}: expected {expected} bytes, got {got}")]
    BadLength { codec: String, expected: usize, got: usize },
    #[error("unknown KV codec {0:?}")]
    UnknownCodec(String),
    #[error("tier config: {0}")]
    Config(String),
    /// Moving a group between the device arenas and host memory failed (a GPU error).
    #[error("device KV: {0}")]
    Device(String),
    /// A well-formed group decodes to values the arena's dtype cannot hold: an f16 arena would store them as
    /// infinities, and one infinite key turns attention into NaN; in any dtype, values past
    /// [`KV_MAGNITUDE_LIMIT`] overflow the arena's own arithmetic the same way.
    #[error("codec {codec}: the group's values do not fit a {dtype} KV cache")]
    DoesNotFit { codec: String, dtype: pagoda_kernels::KvDtype },
}

/// The smallest magnitude an f16 arena rounds to infinity: halfway from f16's largest finite value (65504) to
/// 65536, a tie that round-to-nearest-even settles upwards.
pub const F16_OVERFLOW: f32 = 65520.0;

/// The largest magnitude a decoded KV value may have in an arena of any dtype: 2^56 (about 7.2e16). Finite is not
/// enough, because the arenas do arithmetic on what they hold: attention sums `head_dim` products q·k, and the
/// rotated fp8 arena's Hadamard butterfly sums `head_dim` keys before it normalises (a group of 1e37 keys came out
/// of it as infinities and a NaN scale). A key within the limit meets a query within it in a dot product of at most
/// `head_dim` × 2^112, finite (under f32's 2^128) for any `head_dim` up to 2^15, which no model comes near. Real
/// KV is within about 10^4 (every model serves from f16 arenas), so nothing a model computes is refused: only a
/// corrupt or hostile group (a peer's checksum proves only that the bytes arrived as sent).
pub const KV_MAGNITUDE_LIMIT: f32 = (1u64 << 56) as f32;

/// Whether an arena of `dtype` stores every value of `values` and computes on them without overflowing: below
/// [`F16_OVERFLOW`] for f16, whose larger values would be stored as infinities, and below [`KV_MAGNITUDE_LIMIT`]
/// for every dtype (the 8-bit dtypes scale each slot to its own largest value, so their range is f32's). NaN never
/// fits.
pub fn fits_dtype(dtype: pagoda_kernels::KvDtype, values: &[f32]) -> bool {
    let limit = if dtype == pagoda_kernels::KvDtype::F16 { F16_OVERFLOW } else { KV_MAGNITUDE_LIMIT };
    values.iter().all(|x| x.abs() < limit)
}

/// The median over `runs` calls of `f`, in milliseconds: the timing tests' measure of one decode.
#[cfg(test)]
pub(crate) fn median_ms(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut ms: Vec<f64> = (0..runs)
        .map(|_| {
            let start = std::time::Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms[runs / 2]
}
