//! Device-to-device links of the peer tier (DESIGN §5–§7): between GPU workers the payloads of a `Transfer.Fetch`
//! travel over an NCCL link while the batches' metadata (hashes, codecs, lengths, checksums) stays on the gRPC
//! stream. This module owns everything about links that does not depend on CUDA:
//!
//! - [`LinkFactory`] / [`LinkEnd`]: what a backend provides (the NCCL one is `peer_link_nccl`, feature `cuda`): a
//!   way to make a communicator id, join a communicator, and move byte strings over it with bounded waits.
//! - [`ServedLinks`]: the serving side's table of links opened by `Transfer.OpenLink`, each lent to one fetch at a
//!   time and dropped (aborted) when a fetch over it fails.
//! - [`PeerLinks`]: the pulling side's link per peer address. A pull never waits for a link to open: the first
//!   pull to a peer goes over gRPC while the link opens in the background, and a peer that refuses (a CPU
//!   worker, no libnccl) is not asked again for a while. gRPC payloads remain the fallback throughout.
//! - [`split_payloads`] / [`attach_payloads`]: a batch's framing with its payloads carried out of band.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pagoda_proto::transfer::BlockBatch;

/// Bytes of a communicator id (NCCL's unique id).
pub const LINK_ID_BYTES: usize = 128;
/// Links one worker serves at once; more get RESOURCE_EXHAUSTED.
pub const MAX_SERVED_LINKS: usize = 8;
/// Peers one worker keeps a link (or a refusal) for.
pub const MAX_PEER_LINKS: usize = 16;
/// Longest wait for both ranks to join a communicator.
pub const LINK_JOIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a serving worker waits for its peer to receive one batch's payloads.
pub const LINK_TRANSFER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a pulling worker leaves a peer that refused links (no NCCL there) before asking again.
const REFUSED_BACKOFF: Duration = Duration::from_secs(600);
/// How long after a failed open (timeout, NCCL error) it tries again.
const FAILED_BACKOFF: Duration = Duration::from_secs(30);

/// Why a link could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("the link did not come up or finish within its deadline")]
    Timeout,
    #[error("bad link id: {0}")]
    BadId(String),
    #[error("{0}")]
    Failed(String),
}

/// One end of a byte link to one peer. Every call is blocking and bounded by its timeout: run it off the async
/// runtime. After an error the end is unusable; dropping it aborts the link.
pub trait LinkEnd: Send + std::fmt::Debug + 'static {
    /// Sends `send` and/or receives `recv.0` bytes into `recv.1` (resized to fit), in one exchange.
    fn transfer(
        &mut self,
        send: Option<&[u8]>,
        recv: Option<(usize, &mut Vec<u8>)>,
        timeout: Duration,
    ) -> Result<(), LinkError>;
}

/// This worker's side of link bootstraps. Blocking: run off the async runtime.
pub trait LinkFactory: Send + Sync + 'static {
    /// A fresh communicator id, [`LINK_ID_BYTES`] long; the caller joins as rank 0 and sends it to the peer.
    fn new_id(&self) -> Result<Vec<u8>, LinkError>;
    /// Joins the communicator of `id` as `rank` (0 or 1) of two, waiting at most `timeout` for the other rank,
    /// and giving up early when `cancel` is set.
    fn join(
        &self,
        id: &[u8],
        rank: usize,
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Result<Box<dyn LinkEnd>, LinkError>;
}

/// Moves a batch's payloads out of its blocks: the blocks keep their metadata with `nccl_bytes` set and `bytes`
/// empty; the payloads are concatenated in block order.
pub fn split_payloads(mut batch: BlockBatch) -> (BlockBatch, Vec<u8>) {
    let total = batch.blocks.iter().map(|b| b.bytes.len()).sum();
    let mut payload = Vec::with_capacity(total);
    for b in &mut batch.blocks {
        b.nccl_bytes = b.bytes.len() as u64;
        payload.extend_from_slice(&b.bytes);
        b.bytes = Vec::new();
    }
    (batch, payload)
}

/// Bytes a batch framed by [`split_payloads`] says follow it on the link, checked against the bounds before
/// anything is received: each block's payload non-empty and at most `max_group_bytes`, their sum at most
/// `max_batch_bytes`, and no payload inline as well.
pub fn linked_payload_bytes(batch: &BlockBatch, max_batch_bytes: u64, max_group_bytes: u64) -> Result<usize, String> {
    let mut total = 0u64;
    for b in &batch.blocks {
        if !b.bytes.is_empty() {
            return Err(format!("block {:#x} carries its payload inline on a linked fetch", b.hash));
        }
        if b.nccl_bytes == 0 || b.nccl_bytes > max_group_bytes {
            return Err(format!("block {:#x} announces {} bytes (at most {max_group_bytes})", b.hash, b.nccl_bytes));
        }
        total += b.nccl_bytes;
    }
    if total > max_batch_bytes {
        return Err(format!("{total} linked bytes in a batch limited to {max_batch_bytes}"));
    }
    Ok(total as usize)
}

/// Puts the payloads received for a batch back into its blocks (the inverse of [`split_payloads`]). The payload
/// must be exactly as long as the blocks announce.
pub fn attach_payloads(mut batch: BlockBatch, payload: &[u8]) -> Result<BlockBatch, String> {
    let announced: u64 = batch.blocks.iter().map(|b| b.nccl_bytes).sum();
    if announced != payload.len() as u64 {
        return Err(format!("{} bytes received where the batch announced {announced}", payload.len()));
    }
    let mut at = 0usize;
    for b in &mut batch.blocks {
        let n = b.nccl_bytes as usize;
        b.bytes = payload[at..at + n].to_vec();
        b.nccl_bytes = 0;
        at += n;
    }
    Ok(batch)
}

/// A lent link's state in [`ServedLinks`].
enum Served {
    Idle(Box<dyn LinkEnd>),
    Lent,
}

/// Why [`ServedLinks::lend`] refused.
#[derive(Debug, PartialEq, Eq)]
pub enum LendError {
    Unknown,
    Busy,
}

/// The serving side's links, by id. One owner (the `Transfer` service), behind a mutex never held across an
/// await.
#[derive(Default)]
pub struct ServedLinks {
    next: u64,
    links: HashMap<u64, Served>,
}

impl ServedLinks {
    /// Whether another link may be opened: there is a free slot, or an idle link to make room from.
    pub fn has_room(&self) -> bool {
        self.links.len() < MAX_SERVED_LINKS || self.links.values().any(|l| matches!(l, Served::Idle(_)))
    }

    /// Stores a newly joined link and names it (never 0). When full, the oldest idle link is dropped (aborted)
    /// to make room: a caller that lost the `OpenLink` reply never uses its link, which must not hold a slot
    /// for ever. `None` when every link is lent.
    pub fn insert(&mut self, end: Box<dyn LinkEnd>) -> Option<u64> {
        if self.links.len() >= MAX_SERVED_LINKS {
            let oldest_idle =
                self.links.iter().filter(|(_, l)| matches!(l, Served::Idle(_))).map(|(&id, _)| id).min()?;
            self.links.remove(&oldest_idle);
        }
        self.next += 1;
        self.links.insert(self.next, Served::Idle(end));
        Some(self.next)
    }

    /// Lends link `id` to one fetch.
    pub fn lend(&mut self, id: u64) -> Result<Box<dyn LinkEnd>, LendError> {
        match self.links.get_mut(&id) {
            None => Err(LendError::Unknown),
            Some(Served::Lent) => Err(LendError::Busy),
            Some(slot) => match std::mem::replace(slot, Served::Lent) {
                Served::Idle(end) => Ok(end),
                Served::Lent => Err(LendError::Busy),
            },
        }
    }

    /// Ends a loan: the link comes back when the fetch left it in step with its peer, and is forgotten (its end
    /// dropped, aborting the communicator) otherwise.
    pub fn give_back(&mut self, id: u64, end: Option<Box<dyn LinkEnd>>) {
        match end {
            Some(end) => {
                self.links.insert(id, Served::Idle(end));
            }
            None => {
                self.links.remove(&id);
            }
        }
    }
}

/// The pulling side's state for one peer address.
enum PeerLink {
    Opening,
    Idle(u64, Box<dyn LinkEnd>),
    Lent,
    /// Not asked again before this instant.
    Refused(Instant),
}

/// What [`PeerLinks::take`] says to do for one pull.
pub enum TakeLink {
    /// Pull over this link (its id at the peer, and this end).
    Use(u64, Box<dyn LinkEnd>),
    /// Pull over gRPC, and open a link to the peer in the background for later pulls.
    Open,
    /// Pull over gRPC.
    Grpc,
}

/// The pulling side's link per peer address, bounded to [`MAX_PEER_LINKS`] peers.
#[derive(Default)]
pub struct PeerLinks {
    peers: HashMap<String, PeerLink>,
}

impl PeerLinks {
    /// Decides how a pull from `addr` moves its payloads, lending the link if one is idle.
    pub fn take(&mut self, addr: &str, now: Instant) -> TakeLink {
        match self.peers.get_mut(addr) {
            Some(PeerLink::Opening | PeerLink::Lent) => TakeLink::Grpc,
            Some(PeerLink::Refused(until)) if now < *until => TakeLink::Grpc,
            Some(slot @ PeerLink::Idle(..)) => match std::mem::replace(slot, PeerLink::Lent) {
                PeerLink::Idle(id, end) => TakeLink::Use(id, end),
                _ => TakeLink::Grpc,
            },
            Some(slot) => {
                *slot = PeerLink::Opening;
                TakeLink::Open
            }
            None => {
                if self.peers.len() >= MAX_PEER_LINKS {
                    // Make room from expired refusals only: live links and opens in flight are kept.
                    self.peers.retain(|_, p| !matches!(p, PeerLink::Refused(until) if now >= *until));
                    if self.peers.len() >= MAX_PEER_LINKS {
                        return TakeLink::Grpc;
                    }
                }
                self.peers.insert(addr.to_owned(), PeerLink::Opening);
                TakeLink::Open
            }
        }
    }

    /// The outcome of a background open: a joined link, or a refusal (`permanent` when the peer has no NCCL).
    pub fn opened(&mut self, addr: &str, link: Result<(u64, Box<dyn LinkEnd>), bool>, now: Instant) {
        let state = match link {
            Ok((id, end)) => PeerLink::Idle(id, end),
            Err(permanent) => PeerLink::Refused(now + if permanent { REFUSED_BACKOFF } else { FAILED_BACKOFF }),
        };
        self.peers.insert(addr.to_owned(), state);
    }

    /// Ends a pull's loan: the link comes back if the pull left it in step, and is dropped (aborted) otherwise,
    /// after which the next pull opens a fresh one.
    pub fn give_back(&mut self, addr: &str, link: Option<(u64, Box<dyn LinkEnd>)>, now: Instant) {
        match link {
            Some((id, end)) => {
                self.peers.insert(addr.to_owned(), PeerLink::Idle(id, end));
            }
            None => {
                self.peers.insert(addr.to_owned(), PeerLink::Refused(now + FAILED_BACKOFF));
            }
        }
    }
}

/// Shared handle to the pulling side's links.
pub type SharedPeerLinks = Arc<Mutex<PeerLinks>>;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use pagoda_proto::transfer::Block;

    fn block(hash: u64, n: usize) -> Block {
        Block {
            hash,
            codec: "f16".into(),
            bytes: (0..n).map(|i| (i as u64 ^ hash) as u8).collect(),
            checksum: hash,
            nccl_bytes: 0,
        }
    }

    #[test]
    fn payloads_leave_and_rejoin_their_blocks_exactly() {
        let batch = BlockBatch { blocks: vec![block(1, 300), block(2, 5), block(3, 4096)] };
        let (meta, payload) = split_payloads(batch.clone());
        assert_eq!(payload.len(), 4401);
        assert!(meta.blocks.iter().all(|b| b.bytes.is_empty()));
        assert_eq!(meta.blocks.iter().map(|b| b.nccl_bytes).collect::<Vec<_>>(), vec![300, 5, 4096]);
        assert_eq!(linked_payload_bytes(&meta, 1 << 20, 4096), Ok(4401));
        assert_eq!(attach_payloads(meta.clone(), &payload).unwrap(), batch);
        // Lengths that do not add up, or break the bounds, are refused before anything is received or used.
        assert!(attach_payloads(meta.clone(), &payload[1..]).is_err());
        assert!(linked_payload_bytes(&meta, 4400, 4096).is_err(), "over the batch bound");
        assert!(linked_payload_bytes(&meta, 1 << 20, 4095).is_err(), "over the group bound");
        let mut zero = meta.clone();
        zero.blocks[1].nccl_bytes = 0;
        assert!(linked_payload_bytes(&zero, 1 << 20, 4096).is_err(), "an empty payload");
        assert!(linked_payload_bytes(&batch, 1 << 20, 4096).is_err(), "inline payloads on a linked fetch");
    }

    /// A link end that has never been joined: tests that only move link ends (here and in `transfer`) never call
    /// it.
    #[derive(Debug)]
    pub(crate) struct Unjoined;
    impl LinkEnd for Unjoined {
        fn transfer(
            &mut self,
            _: Option<&[u8]>,
            _: Option<(usize, &mut Vec<u8>)>,
            _: Duration,
        ) -> Result<(), LinkError> {
            Err(LinkError::Failed("never joined".into()))
        }
    }

    #[test]
    fn a_served_link_is_lent_to_one_fetch_and_forgotten_when_it_fails() {
        let mut t = ServedLinks::default();
        let id = t.insert(Box::new(Unjoined)).unwrap();
        assert_ne!(id, 0);
        assert_eq!(t.lend(id + 1).err(), Some(LendError::Unknown));
        let end = t.lend(id).ok().unwrap();
        assert_eq!(t.lend(id).err(), Some(LendError::Busy), "one fetch at a time");
        t.give_back(id, Some(end));
        let _ = t.lend(id).ok().unwrap();
        t.give_back(id, None);
        assert_eq!(t.lend(id).err(), Some(LendError::Unknown), "a failed loan drops the link");
        let ids: Vec<u64> = (0..MAX_SERVED_LINKS).map(|_| t.insert(Box::new(Unjoined)).unwrap()).collect();
        assert_eq!(t.links.len(), MAX_SERVED_LINKS);
        // Full: a new link replaces the oldest idle one.
        let newest = t.insert(Box::new(Unjoined)).unwrap();
        assert_eq!(t.links.len(), MAX_SERVED_LINKS);
        assert_eq!(t.lend(ids[0]).err(), Some(LendError::Unknown), "the oldest idle link made room");
        // With every link lent, there is no room.
        let lent: Vec<_> = ids[1..].iter().chain([&newest]).map(|&id| t.lend(id).ok().unwrap()).collect();
        assert!(!t.has_room());
        assert!(t.insert(Box::new(Unjoined)).is_none(), "bounded");
        drop(lent);
    }

    #[test]
    fn pulls_never_wait_for_a_link_and_refusals_back_off() {
        let now = Instant::now();
        let mut p = PeerLinks::default();
        assert!(matches!(p.take("a", now), TakeLink::Open));
        assert!(matches!(p.take("a", now), TakeLink::Grpc), "while it opens, pulls go over gRPC");
        p.opened("a", Ok((7, Box::new(Unjoined))), now);
        let TakeLink::Use(id, end) = p.take("a", now) else { panic!("an idle link is lent") };
        assert_eq!(id, 7);
        assert!(matches!(p.take("a", now), TakeLink::Grpc), "one pull per link");
        p.give_back("a", Some((id, end)), now);
        assert!(matches!(p.take("a", now), TakeLink::Use(7, _)));
        p.give_back("a", None, now);
        assert!(matches!(p.take("a", now), TakeLink::Grpc), "a broken link backs off");
        assert!(matches!(p.take("a", now + FAILED_BACKOFF), TakeLink::Open), "then opens afresh");
        // A peer without NCCL is not asked again for long.
        assert!(matches!(p.take("cpu", now), TakeLink::Open));
        p.opened("cpu", Err(true), now);
        assert!(matches!(p.take("cpu", now + FAILED_BACKOFF), TakeLink::Grpc));
        assert!(matches!(p.take("cpu", now + REFUSED_BACKOFF), TakeLink::Open));
        // Bounded: with every slot live, a new peer is pulled over gRPC and not remembered.
        let mut q = PeerLinks::default();
        for i in 0..MAX_PEER_LINKS {
            assert!(matches!(q.take(&format!("p{i}"), now), TakeLink::Open));
        }
        assert!(matches!(q.take("one-more", now), TakeLink::Grpc));
        assert_eq!(q.peers.len(), MAX_PEER_LINKS);
    }
}
