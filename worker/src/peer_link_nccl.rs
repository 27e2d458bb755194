//! The NCCL backend of the peer tier's device links ([`NcclLinks`]): communicator ids from `ncclGetUniqueId`,
//! joins through `pagoda_kernels::cuda::NcclPipe` on the worker's GPU (a stream of its own, so transfers do not
//! queue behind the engine's kernels), and byte strings moved through device staging buffers with bounded waits.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use pagoda_kernels::cuda::{CudaError, NcclPipe, NcclUniqueId, nccl_available};

use crate::peer_link::{LinkEnd, LinkError, LinkFactory};
use crate::transfer::MAX_BATCH_BYTES;

/// Makes and joins NCCL links on one GPU.
#[derive(Debug)]
pub struct NcclLinks {
    ordinal: usize,
}

impl NcclLinks {
    /// Links on GPU `ordinal`, or why there can be none (libnccl cannot be loaded).
    pub fn new(ordinal: usize) -> Result<NcclLinks, String> {
        if !nccl_available() {
            return Err(CudaError::NcclUnavailable.to_string());
        }
        Ok(NcclLinks { ordinal })
    }
}

fn link_error(e: CudaError) -> LinkError {
    match e {
        CudaError::NcclTimeout { .. } => LinkError::Timeout,
        CudaError::Invalid { .. } => LinkError::BadId(e.to_string()),
        e => LinkError::Failed(e.to_string()),
    }
}

impl LinkFactory for NcclLinks {
    fn new_id(&self) -> Result<Vec<u8>, LinkError> {
        Ok(NcclUniqueId::new().map_err(link_error)?.as_bytes().to_vec())
    }

    fn join(
        &self,
        id: &[u8],
        rank: usize,
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Result<Box<dyn LinkEnd>, LinkError> {
        let id = NcclUniqueId::from_bytes(id).map_err(link_error)?;
        // A batch of the largest size a fetch may ask for fits one transfer.
        let capacity = MAX_BATCH_BYTES as usize;
        let pipe = NcclPipe::connect(self.ordinal, &id, rank, capacity, timeout, Some(cancel)).map_err(link_error)?;
        Ok(Box::new(PipeEnd(pipe)))
    }
}

/// One worker's end of an NCCL link.
#[derive(Debug)]
struct PipeEnd(NcclPipe);

impl LinkEnd for PipeEnd {
    fn transfer(
        &mut self,
        send: Option<&[u8]>,
        recv: Option<(usize, &mut Vec<u8>)>,
        timeout: Duration,
    ) -> Result<(), LinkError> {
        self.0.transfer(send, recv, timeout).map_err(link_error)
    }
}
