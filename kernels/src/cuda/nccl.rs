//! NCCL links between GPUs (DESIGN §7). A [`NcclLink`] is one rank's end of a communicator, built from a
//! [`NcclUniqueId`] that one rank creates and the other receives out of band (the worker's `Transfer.OpenLink` RPC
//! carries its 128 bytes). It moves whole blocks of a [`CudaKv`] arena with grouped `ncclSend`/`ncclRecv`, straight
//! from and into the arena's blocks; a [`NcclPipe`] is a link with device staging buffers that moves byte strings
//! (the tiers' encoded groups) between two workers' host memory over the GPUs' fabric.
//!
//! Communicators are non-blocking (`ncclCommInitRankConfig` with `blocking = 0`), and every wait on one is bounded:
//! joining, enqueueing a group and waiting for its completion all poll `ncclCommGetAsyncError` until a deadline
//! (or a cancel flag), so a peer that never joins or dies mid-transfer returns [`CudaError::NcclTimeout`] instead
//! of hanging a thread. A link is aborted (`ncclCommAbort`) when dropped, never finalized: finalizing waits for the
//! peer, which may be gone. After a timeout the link is unusable and must be dropped.
//!
//! libnccl is loaded at run time like every CUDA library here; [`nccl_available`] says whether it can be, so a
//! caller falls back to the gRPC block stream when it cannot. Both ends must issue their transfers in the same
//! order (K then V of each block, blocks in list order): NCCL matches a pair of ranks' sends and receives in the
//! order they are issued.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::result::{NcclStatus, group_end, group_start};
use cudarc::nccl::{Id, result, sys};

use super::error::CudaError;
use super::kv::{CudaKv, sorted_distinct};

/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = 128;
/// Largest communicator a link joins (two workers need 2; the bound keeps a bad peer from asking for anything).
pub const MAX_WORLD: usize = 64;
/// Longest wait for NCCL to finish enqueueing a group on a non-blocking communicator (not for the transfer).
const ENQUEUE_TIMEOUT: Duration = Duration::from_secs(10);
/// Poll interval of the bounded waits: well under a millisecond-scale transfer's own cost.
const POLL: Duration = Duration::from_micros(200);

/// Whether libnccl can be loaded on this machine.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to dlopen libnccl.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn nccl_err(what: &'static str) -> impl Fn(result::NcclError) -> CudaError {
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

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId { internal: self.0.map(|b| b as c_char) }
    }
}

/// A communicator handle, aborted when dropped.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one at a time; `NcclLink` methods take `&self`/`&mut
// self` on the one owner, and NCCL itself serialises the calls on one communicator.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful ncclCommInitRankConfig and is dropped once. Abort, not
        // finalize: it frees the communicator without waiting on a peer that may be gone. Its error has nowhere
        // to go from a destructor.
        let _ = unsafe { result::comm_abort(self.0) };
    }
}

impl RawComm {
    /// Polls the communicator's state until it leaves `ncclInProgress`, `deadline` passes or `cancel` is set.
    fn wait_ready(&self, op: &'static str, deadline: Instant, cancel: Option<&AtomicBool>) -> Result<(), CudaError> {
        loop {
            let mut state = sys::ncclResult_t::ncclInProgress;
            // SAFETY: a live communicator and a valid out-pointer.
            unsafe { sys::ncclCommGetAsyncError(self.0, &mut state) }.result().map_err(nccl_err(op))?;
            match state.result() {
                Ok(NcclStatus::InProgress) => {}
                Ok(_) => return Ok(()),
                Err(e) => return Err(nccl_err(op)(e)),
            }
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(CudaError::Nccl(format!("{op}: cancelled")));
            }
            if Instant::now() >= deadline {
                return Err(CudaError::NcclTimeout { op });
            }
            std::thread::sleep(POLL);
        }
    }
}

/// The config of a non-blocking communicator, written as NCCL 2.17's struct (the first with `ncclConfig_t`):
/// `size` and `version` tell any later library which fields follow, so the newer fields keep their defaults
/// whatever libnccl the machine loads.
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    sys::ncclConfig_t {
        size: std::mem::offset_of!(sys::ncclConfig_t, trafficClass),
        magic: 0xcafe_beef,
        version: 21_700,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// One rank's end of a communicator, talking to one peer rank on one stream.
pub struct NcclLink {
    comm: RawComm,
    stream: Arc<CudaStream>,
    rank: usize,
    peer: i32,
}

impl std::fmt::Debug for NcclLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLink").field("rank", &self.rank).field("peer", &self.peer).finish()
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
    /// Joins the communicator of `id` as `rank` of `world` on `stream`'s device; transfers go to and come from
    /// `peer` on `stream`. Waits until every rank has joined, at most `timeout`, and gives up early when `cancel`
    /// is set (the caller learned that the peer will not join). Either way the half-built communicator is aborted.
    pub fn connect(
        stream: &Arc<CudaStream>,
        id: &NcclUniqueId,
        rank: usize,
        world: usize,
        peer: usize,
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> Result<NcclLink, CudaError> {
        const OP: &str = "ncclCommInitRankConfig";
        if world == 0 || world > MAX_WORLD || rank >= world || peer >= world {
            return Err(CudaError::invalid(
                "NcclLink::connect",
                format!("rank {rank} and peer {peer} of a world of {world}"),
            ));
        }
        if !nccl_available() {
            return Err(CudaError::NcclUnavailable);
        }
        let deadline = Instant::now() + timeout;
        // NCCL picks its device from the calling thread's current context.
        stream.context().bind_to_thread()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = nonblocking_config();
        // SAFETY: valid out-pointer and config; world and rank were bounded above, so the casts are exact.
        unsafe { result::comm_init_rank_config(&mut comm, world as c_int, id.raw(), rank as c_int, &mut config) }
            .map_err(nccl_err(OP))?;
        let comm = RawComm(comm);
        comm.wait_ready(OP, deadline, cancel)?;
        Ok(NcclLink { comm, stream: stream.clone(), rank, peer: peer as i32 })
    }

    /// Runs `queue` (sends and receives) as one NCCL group. The group is closed whatever happened inside it: an
    /// open group would swallow the next NCCL call.
    fn group(&self, queue: impl FnOnce() -> Result<(), CudaError>) -> Result<(), CudaError> {
        self.stream.context().bind_to_thread()?;
        group_start().map_err(nccl_err("ncclGroupStart"))?;
        let queued = queue();
        let ended = group_end().map_err(nccl_err("ncclGroupEnd"));
        queued?;
        ended?;
        self.comm.wait_ready("ncclGroupEnd", Instant::now() + ENQUEUE_TIMEOUT, None)
    }

    /// Queues one point-to-point transfer of `bytes` bytes at device address `ptr` to (`send`) or from the peer.
    fn p2p(&self, send: bool, ptr: u64, bytes: usize) -> Result<(), CudaError> {
        let (ty, stream) = (sys::ncclDataType_t::ncclUint8, self.stream.cu_stream() as _);
        // SAFETY: `ptr` addresses at least `bytes` bytes of device memory that stay alive until the stream
        // reaches the transfer (the callers hold the buffer and wait on the stream, or keep the arena), and a
        // receive's buffer is held mutably by its caller.
        let queued = unsafe {
            if send {
                result::send(ptr as *const c_void, bytes, ty, self.peer, self.comm.0, stream)
            } else {
                result::recv(ptr as *mut c_void, bytes, ty, self.peer, self.comm.0, stream)
            }
        };
        queued.map(|_| ()).map_err(nccl_err(if send { "ncclSend" } else { "ncclRecv" }))
    }

    /// One grouped exchange with the peer: sends the K and V of `send`'s blocks, in order, and receives as many
    /// blocks into `recv`'s blocks, in order (either may be absent: a pull receives only, a serve sends only; a
    /// rank linked to itself does both in one group, which is how one GPU exercises the path). Arenas must share
    /// the block shape; destinations must be distinct. Queued on the link's stream: [`NcclLink::wait`] (or
    /// synchronise the stream) before reading `recv`.
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
        self.group(|| self.queue_blocks(send, recv))
    }

    fn queue_blocks(
        &self,
        send: Option<(&CudaKv, &[u32])>,
        recv: Option<(&mut CudaKv, &[u32])>,
    ) -> Result<(), CudaError> {
        if let Some((kv, blocks)) = send {
            let n = kv.block_size() * kv.head_dim();
            let (k, v) = kv.arenas();
            for &b in blocks {
                let r = b as usize * n..(b as usize + 1) * n;
                for arena in [k, v] {
                    let view = arena.slice(r.clone());
                    let (ptr, _record) = view.device_ptr(&self.stream);
                    self.p2p(true, ptr, 2 * n)?;
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
                    let (ptr, _record) = view.device_ptr_mut(&self.stream);
                    self.p2p(false, ptr, 2 * n)?;
                }
            }
        }
        Ok(())
    }

    /// Waits, at most `timeout`, until everything queued on the link's stream has run, watching the communicator
    /// for a failed peer meanwhile. After [`CudaError::NcclTimeout`] the link must be dropped.
    pub fn wait(&self, timeout: Duration) -> Result<(), CudaError> {
        let deadline = Instant::now() + timeout;
        let done = self.stream.record_event(None)?;
        loop {
            if done.try_is_complete()? {
                return Ok(());
            }
            // A transport error ends the transfer without completing the stream.
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator and a valid out-pointer.
            unsafe { sys::ncclCommGetAsyncError(self.comm.0, &mut state) }
                .result()
                .map_err(nccl_err("ncclCommGetAsyncError"))?;
            state.result().map_err(nccl_err("NCCL transfer"))?;
            if Instant::now() >= deadline {
                return Err(CudaError::NcclTimeout { op: "NcclLink::wait" });
            }
            std::thread::sleep(POLL);
        }
    }
}

/// A link with device staging buffers that moves byte strings between two processes' host memory: the sender's
/// bytes are copied to its device, sent over NCCL into the receiver's device buffer, and copied to its host.
/// Each call moves at most [`NcclPipe::capacity`] bytes each way; the buffers are allocated on first use of each
/// direction, so a pure sender or receiver holds one.
pub struct NcclPipe {
    link: NcclLink,
    capacity: usize,
    send_buf: Option<CudaSlice<u8>>,
    recv_buf: Option<CudaSlice<u8>>,
}

impl std::fmt::Debug for NcclPipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclPipe").field("link", &self.link).field("capacity", &self.capacity).finish()
    }
}

impl NcclPipe {
    /// Joins `id`'s communicator as `rank` of a world of two on device `ordinal`, on a stream of its own (so
    /// transfers do not queue behind the engine's kernels). See [`NcclLink::connect`] for `timeout` and `cancel`.
    pub fn connect(
        ordinal: usize,
        id: &NcclUniqueId,
        rank: usize,
        capacity: usize,
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> Result<NcclPipe, CudaError> {
        NcclPipe::on_own_stream(ordinal, id, (rank, 2, 1 - rank.min(1)), capacity, timeout, cancel)
    }

    /// A pipe over a communicator of one rank linked to itself: what one GPU can test.
    pub fn loopback(ordinal: usize, capacity: usize, timeout: Duration) -> Result<NcclPipe, CudaError> {
        NcclPipe::on_own_stream(ordinal, &NcclUniqueId::new()?, (0, 1, 0), capacity, timeout, None)
    }

    /// `(rank, world, peer)` of `id`'s communicator on a new stream of device `ordinal`.
    fn on_own_stream(
        ordinal: usize,
        id: &NcclUniqueId,
        (rank, world, peer): (usize, usize, usize),
        capacity: usize,
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> Result<NcclPipe, CudaError> {
        if capacity == 0 {
            return Err(CudaError::invalid("NcclPipe::connect", "a pipe of 0 bytes"));
        }
        let stream = cudarc::driver::CudaContext::new(ordinal)?.new_stream()?;
        let link = NcclLink::connect(&stream, id, rank, world, peer, timeout, cancel)?;
        Ok(NcclPipe { link, capacity, send_buf: None, recv_buf: None })
    }

    /// Sends `send` to the peer and receives `recv.0` bytes from it into `recv.1` (resized to fit), in one group,
    /// waiting at most `timeout` for both. A failure leaves the pipe unusable: drop it.
    pub fn transfer(
        &mut self,
        send: Option<&[u8]>,
        recv: Option<(usize, &mut Vec<u8>)>,
        timeout: Duration,
    ) -> Result<(), CudaError> {
        const OP: &str = "NcclPipe::transfer";
        let (send_len, recv_len) = (send.map_or(0, <[u8]>::len), recv.as_ref().map_or(0, |r| r.0));
        if send_len > self.capacity || recv_len > self.capacity {
            return Err(CudaError::invalid(
                OP,
                format!("{send_len} and {recv_len} bytes through a pipe of {}", self.capacity),
            ));
        }
        let deadline = Instant::now() + timeout;
        let stream = self.link.stream.clone();
        if let Some(bytes) = send.filter(|b| !b.is_empty()) {
            let buf = match &mut self.send_buf {
                Some(b) => b,
                slot => slot.insert(stream.alloc_zeros::<u8>(self.capacity)?),
            };
            stream.memcpy_htod(bytes, &mut buf.slice_mut(..bytes.len()))?;
        }
        if recv_len > 0 && self.recv_buf.is_none() {
            self.recv_buf = Some(stream.alloc_zeros::<u8>(self.capacity)?);
        }
        let (link, send_buf, recv_buf) = (&self.link, &self.send_buf, &mut self.recv_buf);
        link.group(|| {
            if let (Some(buf), true) = (send_buf, send_len > 0) {
                let (ptr, _record) = buf.device_ptr(&stream);
                link.p2p(true, ptr, send_len)?;
            }
            if let (Some(buf), true) = (recv_buf.as_mut(), recv_len > 0) {
                let (ptr, _record) = buf.device_ptr_mut(&stream);
                link.p2p(false, ptr, recv_len)?;
            }
            Ok(())
        })?;
        let left = deadline.saturating_duration_since(Instant::now());
        link.wait(left)?;
        if let (Some((len, out)), Some(buf)) = (recv, &self.recv_buf) {
            out.resize(len, 0);
            // The transfer has completed, so this copy waits on nothing but the device itself.
            stream.memcpy_dtoh(&buf.slice(..len), &mut out[..])?;
            stream.synchronize()?;
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
        assert_eq!(id.raw().internal.map(|c| c as u8), *id.as_bytes());
        assert!(NcclUniqueId::from_bytes(&bytes[..127]).is_err());
        assert!(NcclUniqueId::from_bytes(&[0u8; 129]).is_err());
        assert!(NcclUniqueId::from_bytes(&[]).is_err());
        assert_eq!(format!("{id:?}"), "NcclUniqueId(..)", "never logged");
    }
}
