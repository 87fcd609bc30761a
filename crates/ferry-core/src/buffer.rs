//! Owned memory: [`HostBuffer`] (page-aligned, zeroed allocation) and
//! [`RegisteredBuffer`] (a `HostBuffer` registered with one or more engines
//! and unregistered from all of them before it is freed). Safe code can
//! register memory only through `RegisteredBuffer`, so it cannot free memory
//! a peer may still write.

use crate::DynTransferEngine;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::engine::TransferEngine;
use crate::error::{Error, Result};
use crate::span::{LocalSpan, RemoteSpan};
use crate::types::{Location, MemoryRegion};

const PAGE: usize = 4096;

/// A page-aligned, zero-initialised heap allocation whose bytes may be
/// changed behind Rust's back by transfers once registered. All access goes
/// through copying methods, never through long-lived references.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: HostBuffer owns its allocation exclusively; the raw pointer is not
// tied to a thread, and all accesses are byte copies.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only copies bytes in or out through raw pointers.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to 4096.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a buffer needs at least one byte".into(),
            ));
        }
        let layout = Layout::from_size_align(len, PAGE)
            .map_err(|e| Error::InvalidArgument(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| Error::Io {
            context: format!("allocating {len} bytes"),
            kind: std::io::ErrorKind::OutOfMemory,
            message: "allocation failed".into(),
            source: None,
        })?;
        Ok(HostBuffer { ptr, len })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always false (a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The buffer as a region to register at `location`. Safe code
    /// registers owned memory with [`RegisteredBuffer::from_owned`] instead.
    ///
    /// # Safety
    ///
    /// As [`MemoryRegion::from_raw_parts`]: an engine that registers the
    /// region may write into it until it is unregistered, so `self` must
    /// not be dropped (freed) while the region is registered with any
    /// engine.
    pub unsafe fn region(&self, location: Location) -> MemoryRegion {
        // SAFETY: the allocation is valid for `len` bytes while `self`
        // lives; keeping it alive while registered is the caller's duty.
        unsafe { raw_region(self, location) }
    }

    fn check(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "range {offset}+{n} is outside a buffer of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `out.len()` bytes starting at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        // SAFETY: bounds checked above; `out` is a distinct Rust allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: bounds checked above; `data` is a distinct Rust allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Sets every byte to `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole allocation is writable.
        unsafe { std::ptr::write_bytes(self.as_ptr(), byte, self.len) };
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len];
        // The range is the whole buffer, so this cannot fail.
        let _ = self.read(0, &mut v);
        v
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout, which was valid.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, PAGE),
            )
        };
    }
}

/// Host memory registered with one or more engines for as long as the value
/// lives: the only safe way to register memory (registering raw parts is
/// `unsafe`), because it ties the memory's lifetime to its registrations.
///
/// Dropping it unregisters the memory from every engine before freeing it:
/// on a Tokio runtime the unregisters (which wait for in-flight transfers)
/// run on a spawned task that owns the memory until they finish; without a
/// runtime, or if the runtime drops that task, the memory is leaked rather
/// than freed while possibly registered. Call [`RegisteredBuffer::release`]
/// to unregister deterministically.
pub struct RegisteredBuffer<E: TransferEngine + ?Sized = dyn DynTransferEngine> {
    /// Every engine the memory is registered with; never empty.
    engines: Vec<Arc<E>>,
    location: Location,
    memory: Option<HostBuffer>,
}

impl<E: TransferEngine + ?Sized> std::fmt::Debug for RegisteredBuffer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backends: Vec<&str> = self.engines.iter().map(|e| e.backend_name()).collect();
        f.debug_struct("RegisteredBuffer")
            .field("backends", &backends)
            .field("location", &self.location)
            .field("memory", &self.memory)
            .finish()
    }
}

impl<E: TransferEngine + ?Sized> RegisteredBuffer<E> {
    /// Allocates `len` zeroed bytes and registers them with `engine` as `cpu:0`.
    pub async fn new(engine: Arc<E>, len: usize) -> Result<Self> {
        Self::with_location(engine, len, Location::cpu(0)).await
    }

    /// Allocates `len` zeroed bytes and registers them at `location`.
    pub async fn with_location(engine: Arc<E>, len: usize, location: Location) -> Result<Self> {
        Self::from_owned(engine, HostBuffer::new(len)?, location).await
    }

    /// Registers `memory`, which the buffer then owns, with `engine` at
    /// `location`. On error the memory is not registered and is freed,
    /// except on [`Error::RegionHeld`] (the registration failed but may
    /// have stayed in the backend's library): then the memory is leaked,
    /// never freed, and stays in the engine's table.
    pub async fn from_owned(
        engine: Arc<E>,
        memory: HostBuffer,
        location: Location,
    ) -> Result<Self> {
        // SAFETY: `memory` moves into the returned value, which unregisters
        // it from every engine before freeing it (or leaks it).
        let region = unsafe { raw_region(&memory, location.clone()) };
        // If this future is dropped while the register runs, the memory may
        // end up registered: it is leaked then, never freed.
        let held = Pending(Some(memory));
        match engine.register(region).await {
            Ok(()) => Ok(RegisteredBuffer {
                engines: vec![engine],
                location,
                memory: held.keep(),
            }),
            Err(e) if may_stay_registered(&e) => {
                held.leak("a failed register may have left the memory registered");
                Err(e)
            }
            Err(e) => {
                // A failed register registered nothing.
                held.free();
                Err(e)
            }
        }
    }

    /// Registers the same memory with one more engine (e.g. a second NIC's
    /// engine), at the same location; it is unregistered from that one too
    /// before the memory is freed. On [`Error::RegionHeld`] (the register
    /// failed but may have stayed registered) the engine stays in
    /// [`RegisteredBuffer::engines`], so that release and drop unregister
    /// the memory from it too.
    pub async fn register_with(&mut self, engine: Arc<E>) -> Result<()> {
        // SAFETY: as in `from_owned`: the memory is unregistered from every
        // engine in `self.engines` before it is freed.
        let region = unsafe { raw_region(self.mem(), self.location.clone()) };
        // Listed before the register runs: if this future is dropped half
        // way, the memory is still unregistered from it before being freed.
        self.engines.push(Arc::clone(&engine));
        match engine.register(region).await {
            Ok(()) => Ok(()),
            Err(e) if may_stay_registered(&e) => Err(e),
            Err(e) => {
                self.engines.pop();
                Err(e)
            }
        }
    }

    fn mem(&self) -> &HostBuffer {
        // `memory` is only taken by `release` (which consumes self) and Drop.
        self.memory
            .as_ref()
            .unwrap_or_else(|| unreachable!("buffer used after release"))
    }

    /// Start address (what a peer uses as `remote_addr`).
    pub fn addr(&self) -> u64 {
        self.mem().addr()
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem().len()
    }
    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// The underlying memory, for copying bytes in and out.
    pub fn memory(&self) -> &HostBuffer {
        self.mem()
    }
    /// The whole buffer as a [`LocalSpan`] for building requests.
    pub fn span(&self) -> LocalSpan {
        LocalSpan::new(self.addr(), self.len() as u64)
    }
    /// The bytes `range` (offsets from the start) as a [`LocalSpan`];
    /// [`crate::Error::InvalidArgument`] if the range leaves the buffer.
    pub fn slice(&self, range: impl std::ops::RangeBounds<u64>) -> Result<LocalSpan> {
        self.span().slice(range)
    }
    /// What a peer needs to reach this buffer: the segment name of the
    /// engine it was first registered with, its address and length (send
    /// it out of band; it serialises with the feature `serde`).
    pub fn descriptor(&self) -> RemoteSpan {
        RemoteSpan::new(self.engine().segment_name(), self.addr(), self.len() as u64)
    }
    /// The engine it was first registered with.
    pub fn engine(&self) -> &Arc<E> {
        &self.engines[0]
    }
    /// Every engine it is registered with.
    pub fn engines(&self) -> &[Arc<E>] {
        &self.engines
    }

    /// Unregisters from every engine (waiting for transfers in flight) and
    /// frees the memory.
    ///
    /// If an unregister fails for any reason other than the region not
    /// being registered, the memory may still be registered and is leaked
    /// rather than freed. If this future is dropped before it completes, the
    /// memory is leaked too.
    pub async fn release(mut self) -> Result<()> {
        let engines = std::mem::take(&mut self.engines);
        match self.memory.take() {
            Some(m) => unregister_then_free(&engines, m).await,
            None => Ok(()),
        }
    }
}

/// `memory` as a region. Safety: as [`HostBuffer::region`].
unsafe fn raw_region(memory: &HostBuffer, location: Location) -> MemoryRegion {
    // SAFETY: forwarded to the caller.
    unsafe { MemoryRegion::from_raw_parts(memory.as_ptr(), memory.len(), location) }
}

/// Whether a failed register may have left the memory registered: the
/// backend says so with [`Error::RegionHeld`] (also as the source of a
/// [`Error::BatchRegisterFailed`]).
fn may_stay_registered(e: &Error) -> bool {
    match e {
        Error::RegionHeld { .. } => true,
        Error::BatchRegisterFailed { source, .. } => may_stay_registered(source),
        _ => false,
    }
}

#[cfg(test)]
thread_local! {
    /// Memory leaked by `Pending::leak` on this thread (for the tests).
    static LEAKED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Owns memory that may be registered: dropping it leaks the memory unless
/// [`Pending::free`] was called, so that a cancelled unregister never frees
/// memory an engine may still write.
struct Pending(Option<HostBuffer>);

impl Pending {
    fn free(mut self) {
        drop(self.0.take());
    }

    fn keep(mut self) -> Option<HostBuffer> {
        self.0.take()
    }

    /// Leaks the memory (it may be registered), saying why once.
    fn leak(mut self, why: &str) {
        if let Some(m) = self.0.take() {
            tracing::warn!(addr = m.addr(), "leaking memory: {why}");
            #[cfg(test)]
            LEAKED.with(|n| n.set(n.get() + 1));
            std::mem::forget(m);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            tracing::warn!(
                addr = m.addr(),
                "leaking memory whose unregister did not complete"
            );
            std::mem::forget(m);
        }
    }
}

/// Unregisters `memory` from every engine, last registered first, then
/// frees it; leaks it if any unregister may have left it registered.
async fn unregister_then_free<E: TransferEngine + ?Sized>(
    engines: &[Arc<E>],
    memory: HostBuffer,
) -> Result<()> {
    let addr = memory.addr();
    let pending = Pending(Some(memory));
    let mut first_err = None;
    let mut may_be_registered = false;
    for engine in engines.iter().rev() {
        match engine.unregister(addr).await {
            Ok(()) => {}
            Err(e @ Error::RegionNotRegistered { .. }) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                may_be_registered = true;
                first_err.get_or_insert(e);
            }
        }
    }
    if !may_be_registered {
        pending.free();
    }
    // Otherwise `pending` leaks the memory: it may still be registered.
    first_err.map_or(Ok(()), Err)
}

impl<E: TransferEngine + ?Sized> Drop for RegisteredBuffer<E> {
    fn drop(&mut self) {
        let Some(memory) = self.memory.take() else {
            return;
        };
        let engines = std::mem::take(&mut self.engines);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                // If the runtime shuts down before the task finishes, the
                // task is dropped and `unregister_then_free` leaks the memory.
                handle.spawn(async move {
                    let addr = memory.addr();
                    if let Err(e) = unregister_then_free(&engines, memory).await {
                        tracing::warn!(addr, error = %e, "unregister on drop failed");
                    }
                });
            }
            Err(_) => {
                tracing::warn!(
                    addr = memory.addr(),
                    "RegisteredBuffer dropped outside a Tokio runtime: leaking it rather than freeing registered memory"
                );
                std::mem::forget(memory);
            }
        }
    }
}

/// Several host buffers registered together with one engine by one
/// `batch_register` (all or none), for as long as the value lives: the safe
/// way to register, say, the layers of a KV cache in one call.
///
/// Dropping it, [`RegisteredBuffers::release`] and a failed or dropped
/// registration follow the rules of [`RegisteredBuffer`]: memory that may
/// be registered is never freed, only leaked.
pub struct RegisteredBuffers<E: TransferEngine + ?Sized = dyn DynTransferEngine> {
    engine: Arc<E>,
    buffers: Vec<HostBuffer>,
}

impl<E: TransferEngine + ?Sized> std::fmt::Debug for RegisteredBuffers<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffers")
            .field("backend", &self.engine.backend_name())
            .field("buffers", &self.buffers)
            .finish()
    }
}

impl<E: TransferEngine + ?Sized> RegisteredBuffers<E> {
    /// Allocates one zeroed buffer per length in `lens` and registers them
    /// all with `engine` as `cpu:0`, with one `batch_register`.
    pub async fn new(engine: Arc<E>, lens: &[usize]) -> Result<Self> {
        let buffers = lens
            .iter()
            .map(|&len| HostBuffer::new(len))
            .collect::<Result<Vec<_>>>()?;
        Self::from_owned(engine, buffers, Location::cpu(0)).await
    }

    /// Registers every buffer of `buffers`, which the value then owns, with
    /// `engine` at `location`, all or none ([`TransferEngine::batch_register`]).
    /// On error nothing is registered and the memory is freed, except on
    /// [`Error::RegionHeld`] (some of it may have stayed registered): then
    /// every buffer is leaked, never freed.
    pub async fn from_owned(
        engine: Arc<E>,
        buffers: Vec<HostBuffer>,
        location: Location,
    ) -> Result<Self> {
        let regions: Vec<MemoryRegion> = buffers
            .iter()
            // SAFETY: the buffers move into the returned value, which
            // unregisters them before freeing them (or leaks them).
            .map(|b| unsafe { raw_region(b, location.clone()) })
            .collect();
        // Dropped half way, the registration may go on: leak, never free.
        let held: Vec<Pending> = buffers.into_iter().map(|b| Pending(Some(b))).collect();
        match engine.batch_register(regions).await {
            Ok(()) => Ok(RegisteredBuffers {
                engine,
                buffers: held.into_iter().filter_map(Pending::keep).collect(),
            }),
            Err(e) if may_stay_registered(&e) => {
                for h in held {
                    h.leak("a failed batch register may have left the memory registered");
                }
                Err(e)
            }
            Err(e) => {
                // All or nothing: a failed batch registered nothing.
                held.into_iter().for_each(Pending::free);
                Err(e)
            }
        }
    }

    /// The buffers, in the order they were given.
    pub fn buffers(&self) -> &[HostBuffer] {
        &self.buffers
    }

    /// The start address of every buffer, in order.
    pub fn addrs(&self) -> Vec<u64> {
        self.buffers.iter().map(HostBuffer::addr).collect()
    }

    /// The engine they are registered with.
    pub fn engine(&self) -> &Arc<E> {
        &self.engine
    }

    /// Unregisters every buffer (waiting for transfers in flight) and frees
    /// the memory; memory whose unregister failed is leaked.
    pub async fn release(mut self) -> Result<()> {
        let buffers = std::mem::take(&mut self.buffers);
        unregister_all_then_free(&self.engine, buffers).await
    }
}

/// Unregisters every buffer from `engine`, one by one (every address is
/// attempted), and frees those that are surely unregistered.
async fn unregister_all_then_free<E: TransferEngine + ?Sized>(
    engine: &Arc<E>,
    buffers: Vec<HostBuffer>,
) -> Result<()> {
    let mut first_err = None;
    for b in buffers {
        let engines = std::slice::from_ref(engine);
        if let Err(e) = unregister_then_free(engines, b).await {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

impl<E: TransferEngine + ?Sized> Drop for RegisteredBuffers<E> {
    fn drop(&mut self) {
        let buffers = std::mem::take(&mut self.buffers);
        if buffers.is_empty() {
            return;
        }
        let engine = Arc::clone(&self.engine);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                // A dropped task leaks (see `unregister_then_free`).
                handle.spawn(async move {
                    if let Err(e) = unregister_all_then_free(&engine, buffers).await {
                        tracing::warn!(error = %e, "unregister on drop failed");
                    }
                });
            }
            Err(_) => {
                tracing::warn!(
                    buffers = buffers.len(),
                    "RegisteredBuffers dropped outside a Tokio runtime: leaking registered memory"
                );
                buffers.into_iter().for_each(std::mem::forget);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::Capabilities;
    use crate::inproc::InprocEngine;

    /// Registers with an in-process engine (the region stays in its table)
    /// and then fails with `RegionHeld`: a backend whose library may have
    /// kept a registration that failed half way.
    struct HeldOnRegister {
        inner: InprocEngine,
    }

    impl HeldOnRegister {
        fn new() -> HeldOnRegister {
            HeldOnRegister {
                inner: InprocEngine::auto(Capabilities::default()),
            }
        }
    }

    impl TransferEngine for HeldOnRegister {
        forward!(
            backend_name,
            segment_name,
            capabilities,
            backend_info,
            unregister,
            open_segment,
            close_segment,
            transfer
        );

        async fn register(&self, region: MemoryRegion) -> Result<()> {
            let addr = region.addr();
            self.inner.register(region).await?;
            Err(Error::RegionHeld {
                addr,
                reason: "test: the registration failed and may have stayed".into(),
            })
        }
    }

    fn leaked() -> usize {
        LEAKED.with(|n| n.get())
    }

    #[tokio::test(flavor = "current_thread")]
    async fn from_owned_leaks_memory_a_failed_register_may_have_left_registered() {
        let engine = Arc::new(HeldOnRegister::new());
        let memory = HostBuffer::new(4096).unwrap();
        let addr = memory.addr();
        let before = leaked();
        let err = RegisteredBuffer::from_owned(Arc::clone(&engine), memory, Location::cpu(0))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::RegionHeld { addr: a, .. } if a == addr),
            "{err:?}"
        );
        assert_eq!(leaked(), before + 1, "the memory was freed, not leaked");
        // Still registered where the backend kept it: unregistering it
        // reaches the engine (the leaked memory stays valid for it).
        engine.unregister(addr).await.unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn register_with_keeps_an_engine_whose_register_may_have_stayed() {
        let first: Arc<dyn DynTransferEngine> =
            Arc::new(InprocEngine::auto(Capabilities::default()));
        let held = Arc::new(HeldOnRegister::new());
        let second: Arc<dyn DynTransferEngine> = held.clone();
        let mut buf = RegisteredBuffer::new(first, 4096).await.unwrap();
        let addr = buf.addr();
        let err = buf.register_with(second).await.unwrap_err();
        assert!(matches!(err, Error::RegionHeld { .. }), "{err:?}");
        assert_eq!(
            buf.engines().len(),
            2,
            "the engine that may hold it was dropped"
        );
        // Release unregisters from it too, then frees.
        let before = leaked();
        buf.release().await.unwrap();
        assert_eq!(leaked(), before);
        assert_eq!(
            held.inner.unregister(addr).await,
            Err(Error::RegionNotRegistered { addr })
        );
    }
}
