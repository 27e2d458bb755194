//! NCCL links between GPUs for KV blocks (DESIGN §7): a [`NcclLink`] is one rank's end of a communicator, built
//! from a [`NcclUniqueId`] that one rank creates and the others receive out of band (the worker protocol carries
//! its 128 bytes), and it moves whole blocks of a [`CudaKv`] arena to or from its peer with grouped
//! `ncclSend`/`ncclRecv`, straight from and into the arena's blocks with no staging copy.
//!
//! libnccl is loaded at run time like every CUDA library here; [`nccl_available`] says whether it can be, so a
//! caller falls back to the gRPC block stream when it cannot. Both ends must issue their blocks in the same order
//! (K then V of each block, blocks in list order): NCCL matches the sends and receives of a pair of ranks in the
//! order they are issued.

use std::ffi::c_char;

use cudarc::nccl::result::{group_end, group_start};
use cudarc::nccl::{Comm, Id};

use super::context::CudaContext;
use super::error::CudaError;
use super::kv::{CudaKv, sorted_distinct};

/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = 128;
/// Largest communicator a link joins (two workers need 2; the bound keeps a bad peer from asking for anything).
pub const MAX_WORLD: usize = 64;

/// Whether libnccl can be loaded on this machine.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to dlopen libnccl.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn nccl_err(what: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> CudaError {
    move |e| CudaError::Nccl(format!("{what}: {:?}", e.0))
}

/// The out-of-band token a communicator is built from: created by one rank, sent to the others as bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId([u8; NCCL_ID_BYTES]);

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id is a bootstrap address and secret of the communicator: never logged.
        f.write_str("NcclUniqueId(..)")
    }
}

impl NcclUniqueId {
    /// A fresh id (`ncclGetUniqueId`); this rank's process hosts the bootstrap.
    pub fn new() -> Result<NcclUniqueId, CudaError> {
        if !nccl_available() {
            return Err(CudaError::NcclUnavailable);
        }
        let id = Id::new().map_err(nccl_err("ncclGetUniqueId"))?;
        Ok(NcclUniqueId(id.internal().map(|c| c as u8)))
    }

    /// The id from the bytes another rank sent; exactly [`NCCL_ID_BYTES`] of them.
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclUniqueId, CudaError> {
        let b: [u8; NCCL_ID_BYTES] = bytes.try_into().map_err(|_| {
            CudaError::invalid("NcclUniqueId::from_bytes", format!("{} bytes, not {NCCL_ID_BYTES}", bytes.len()))
        })?;
        Ok(NcclUniqueId(b))
    }

    pub fn as_bytes(&self) -> &[u8; NCCL_ID_BYTES] {
        &self.0
    }

    fn id(&self) -> Id {
        Id::uninit(self.0.map(|b| b as c_char))
    }
}

/// One rank's end of a communicator, talking to one peer rank on the context's stream.
pub struct NcclLink {
    comm: Comm,
    peer: i32,
}

impl std::fmt::Debug for NcclLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLink").field("rank", &self.comm.rank()).field("peer", &self.peer).finish()
    }
}

/// Blocks of one arena taking part in an exchange.
fn checked_blocks(op: &'static str, kv: &CudaKv, blocks: &[u32], distinct: bool) -> Result<(), CudaError> {
    if blocks.iter().any(|&b| b as usize >= kv.num_blocks()) {
        return Err(CudaError::invalid(op, "a block id is outside the arena"));
    }
    if distinct && sorted_distinct(blocks.iter().copied()).is_none() {
        return Err(CudaError::invalid(op, "destination blocks must be distinct"));
    }
    Ok(())
}

impl NcclLink {
    /// Joins the communicator of `id` as `rank` of `world` on `cx`'s device and stream; transfers go to and come
    /// from `peer`. Blocks until every rank has joined (`ncclCommInitRank`).
    pub fn connect(
        cx: &CudaContext,
        id: &NcclUniqueId,
        rank: usize,
        world: usize,
        peer: usize,
    ) -> Result<NcclLink, CudaError> {
        const OP: &str = "NcclLink::connect";
        if world == 0 || world > MAX_WORLD || rank >= world || peer >= world {
            return Err(CudaError::invalid(OP, format!("rank {rank} and peer {peer} of a world of {world}")));
        }
        if !nccl_available() {
            return Err(CudaError::NcclUnavailable);
        }
        let comm = Comm::from_rank(cx.stream().clone(), rank, world, id.id()).map_err(nccl_err("ncclCommInitRank"))?;
        Ok(NcclLink { comm, peer: peer as i32 })
    }

    /// One grouped exchange with the peer: sends the K and V of `send`'s blocks, in order, and receives as many
    /// blocks into `recv`'s blocks, in order (either may be absent: a pull receives only, a serve sends only; a
    /// rank linked to itself does both in one group, which is how one GPU exercises the path). Arenas must share
    /// the block shape; destinations must be distinct. Queued on the stream: synchronise before reading `recv`.
    pub fn exchange(
        &self,
        send: Option<(&CudaKv, &[u32])>,
        recv: Option<(&mut CudaKv, &[u32])>,
    ) -> Result<(), CudaError> {
        const OP: &str = "NcclLink::exchange";
        if let Some((kv, blocks)) = send {
            checked_blocks(OP, kv, blocks, false)?;
        }
        if let Some((kv, blocks)) = &recv {
            checked_blocks(OP, kv, blocks, true)?;
        }
        if let (Some((a, _)), Some((b, _))) = (&send, &recv)
            && (a.block_size(), a.head_dim()) != (b.block_size(), b.head_dim())
        {
            return Err(CudaError::invalid(OP, "the two arenas' blocks differ in shape"));
        }
        group_start().map_err(nccl_err("ncclGroupStart"))?;
        let queued = self.queue(send, recv);
        // The group is closed whatever happened inside it: an open group would swallow the next NCCL call.
        let ended = group_end().map_err(nccl_err("ncclGroupEnd"));
        queued?;
        ended.map(|_| ())
    }

    fn queue(&self, send: Option<(&CudaKv, &[u32])>, recv: Option<(&mut CudaKv, &[u32])>) -> Result<(), CudaError> {
        const OP: &str = "NcclLink::exchange";
        let bad_view = || CudaError::invalid(OP, "a block does not fit its arena");
        if let Some((kv, blocks)) = send {
            let n = kv.block_size() * kv.head_dim();
            let (k, v) = kv.arenas();
            for &b in blocks {
                let r = b as usize * n..(b as usize + 1) * n;
                for arena in [k, v] {
                    let view = arena.slice(r.clone());
                    // SAFETY: f16 bits reinterpreted as their bytes: every byte pattern is a valid u8.
                    let bytes = unsafe { view.transmute::<u8>(2 * n) }.ok_or_else(bad_view)?;
                    self.comm.send(&bytes, self.peer).map_err(nccl_err("ncclSend"))?;
                }
            }
        }
        if let Some((kv, blocks)) = recv {
            let n = kv.block_size() * kv.head_dim();
            let (k, v) = kv.arenas_mut();
            for &b in blocks {
                let r = b as usize * n..(b as usize + 1) * n;
                for arena in [&mut *k, &mut *v] {
                    let mut view = arena.slice_mut(r.clone());
                    // SAFETY: the bytes received are f16 bits the peer's arena held; any pattern is a valid u16.
                    let mut bytes = unsafe { view.transmute_mut::<u8>(2 * n) }.ok_or_else(bad_view)?;
                    self.comm.recv(&mut bytes, self.peer).map_err(nccl_err("ncclRecv"))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_travel_as_exactly_128_bytes() {
        let bytes: Vec<u8> = (0..NCCL_ID_BYTES as u32).map(|i| (i * 7 + 3) as u8).collect();
        let id = NcclUniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(&id.as_bytes()[..], &bytes[..]);
        // The bytes survive the c_char round trip into NCCL's struct.
        assert_eq!(id.id().internal().map(|c| c as u8), *id.as_bytes());
        assert!(NcclUniqueId::from_bytes(&bytes[..127]).is_err());
        assert!(NcclUniqueId::from_bytes(&[0u8; 129]).is_err());
        assert!(NcclUniqueId::from_bytes(&[]).is_err());
        assert_eq!(format!("{id:?}"), "NcclUniqueId(..)", "never logged");
    }
}
