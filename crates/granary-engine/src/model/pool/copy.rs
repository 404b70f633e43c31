//! The KV pool's copy stream on CUDA: blocks taken in are copied from host
//! memory on a stream of their own, so that a layer's copies run while the
//! layers before it compute (LMCache's `use_layerwise`).
//!
//! Ordering, with two events and one per layer, all on the raw driver API
//! (candle's tensors run on one stream; a stream made through cudarc's
//! context would switch every kernel launch of the process to event
//! tracking):
//! - before a step's copies, an event recorded on the compute stream, which
//!   the copy stream waits for: kernels already queued may still read
//!   blocks that were given back and are now being reused;
//! - after each layer's copies, that layer's event on the copy stream,
//!   which the compute stream waits for before its first operation on that
//!   layer of the pool.
//!
//! Host memory is pageable: the driver has copied it to its staging memory
//! when `cuMemcpyHtoDAsync` returns, so the payload may be dropped then.

use std::sync::Arc;

use anyhow::Result;
use candle_core::cuda_backend::cudarc::driver::sys::{self, CUevent_flags, CUevent_wait_flags};
use candle_core::cuda_backend::cudarc::driver::{result, CudaSlice, CudaStream, DevicePtrMut};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use half::f16;

pub(crate) struct CopyStream {
    /// Candle's stream for the device, on which the forward pass runs.
    compute: Arc<CudaStream>,
    stream: sys::CUstream,
    /// Recorded on the compute stream before a step's copies.
    ready: sys::CUevent,
    /// Per layer, recorded on the copy stream after that layer's copies.
    done: Vec<sys::CUevent>,
}

// SAFETY: CUDA streams and events may be used from any thread of the
// process; the context is bound before every call.
unsafe impl Send for CopyStream {}
unsafe impl Sync for CopyStream {}

impl CopyStream {
    pub(crate) fn new(dev: &CudaDevice, layers: usize) -> Result<Self> {
        let compute = dev.cuda_stream();
        compute.context().bind_to_thread()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        let event = || result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let mut made = CopyStream { compute, stream, ready: event()?, done: Vec::with_capacity(layers) };
        for _ in 0..layers {
            made.done.push(event()?);
        }
        Ok(made)
    }

    /// The copy stream waits for everything queued on the compute stream
    /// so far.
    pub(crate) fn begin(&self) -> Result<()> {
        self.compute.context().bind_to_thread()?;
        // SAFETY: the events and streams are live (dropped with `self`).
        unsafe {
            result::event::record(self.ready, self.compute.cu_stream())?;
            result::stream::wait_event(self.stream, self.ready, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)?;
        }
        Ok(())
    }

    /// Marks the end of layer `layer`'s copies.
    pub(crate) fn layer_done(&self, layer: usize) -> Result<()> {
        self.compute.context().bind_to_thread()?;
        // SAFETY: as in `begin`.
        unsafe { result::event::record(self.done[layer], self.stream)? };
        Ok(())
    }

    /// The compute stream waits for layer `layer`'s copies.
    pub(crate) fn wait(&self, layer: usize) -> Result<()> {
        self.compute.context().bind_to_thread()?;
        // SAFETY: as in `begin`.
        unsafe {
            result::stream::wait_event(
                self.compute.cu_stream(),
                self.done[layer],
                CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )?
        };
        Ok(())
    }

    /// Queues the copy of each block's values (`per` f16, little-endian
    /// bytes) into `dst` at `start + id * per`, within `start..end`.
    pub(crate) fn put(
        &self,
        dst: &mut CudaSlice<f16>,
        start: usize,
        end: usize,
        per: usize,
        blocks: &[(u32, &[u8])],
    ) -> candle_core::Result<()> {
        self.compute.context().bind_to_thread().w()?;
        let (base, _record) = dst.device_ptr_mut(&self.compute);
        for &(id, bytes) in blocks {
            let at = start + id as usize * per;
            if at + per > end || bytes.len() != per * 2 {
                candle_core::bail!("block {id} ({} bytes) does not fit the KV pool", bytes.len());
            }
            // SAFETY: `at..at + per` lies inside the tensor's elements, and
            // the copy stream was made to wait for every kernel queued
            // before the step (`begin`); the step's own kernels wait for
            // this layer's event before they touch it (`wait`).
            unsafe { result::memcpy_htod_async(base + (at * 2) as u64, bytes, self.stream) }.w()?;
        }
        Ok(())
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        if self.compute.context().bind_to_thread().is_err() {
            return;
        }
        // SAFETY: destroying waits for nothing; work queued on the stream
        // completes first (cuStreamDestroy's documented behaviour).
        unsafe {
            for &e in self.done.iter().chain([&self.ready]) {
                let _ = result::event::destroy(e);
            }
            let _ = result::stream::destroy(self.stream);
        }
    }
}
