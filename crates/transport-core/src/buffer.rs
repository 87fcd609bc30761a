//! Safe owned memory: [`HostBuffer`] (page-aligned, zeroed allocation) and
//! [`RegisteredBuffer`] (a `HostBuffer` registered with an engine on creation
//! and unregistered before it is freed).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::engine::TransferEngine;
use crate::error::{Error, Result};
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

    /// The buffer as a region to register at `location`.
    pub fn region(&self, location: Location) -> MemoryRegion {
        // SAFETY: the allocation lives as long as `self`; callers that
        // register this region must unregister it before dropping `self`
        // (RegisteredBuffer does so).
        unsafe { MemoryRegion::from_raw_parts(self.as_ptr(), self.len, location) }
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

/// Host memory registered with an engine for as long as the value lives.
///
/// Dropping it unregisters the memory before freeing it: on a Tokio runtime
/// the unregister (which waits for in-flight transfers) runs on a spawned
/// task that owns the memory until it finishes; without a runtime, or if the
/// runtime drops that task, the memory is leaked rather than freed while
/// possibly registered. Call
/// [`RegisteredBuffer::release`] to unregister deterministically.
pub struct RegisteredBuffer<E: TransferEngine + ?Sized = dyn TransferEngine> {
    engine: Arc<E>,
    memory: Option<HostBuffer>,
}

impl<E: TransferEngine + ?Sized> std::fmt::Debug for RegisteredBuffer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("backend", &self.engine.backend_name())
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
        let memory = HostBuffer::new(len)?;
        engine.register(&memory.region(location)).await?;
        Ok(RegisteredBuffer {
            engine,
            memory: Some(memory),
        })
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
    /// The engine it is registered with.
    pub fn engine(&self) -> &Arc<E> {
        &self.engine
    }

    /// Unregisters (waiting for transfers in flight) and frees the memory.
    ///
    /// If the unregister fails for any reason other than the region not
    /// being registered, the memory may still be registered and is leaked
    /// rather than freed. If this future is dropped before it completes, the
    /// memory is leaked too.
    pub async fn release(mut self) -> Result<()> {
        match self.memory.take() {
            Some(m) => unregister_then_free(self.engine.as_ref(), m).await,
            None => Ok(()),
        }
    }
}

/// Owns memory that may be registered: dropping it leaks the memory unless
/// [`Pending::free`] was called, so that a cancelled unregister never frees
/// memory an engine may still write.
struct Pending(Option<HostBuffer>);

impl Pending {
    fn free(mut self) {
        drop(self.0.take());
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

async fn unregister_then_free<E: TransferEngine + ?Sized>(
    engine: &E,
    memory: HostBuffer,
) -> Result<()> {
    let addr = memory.addr();
    let pending = Pending(Some(memory));
    match engine.unregister(addr).await {
        Ok(()) => {
            pending.free();
            Ok(())
        }
        Err(e @ Error::RegionNotRegistered { .. }) => {
            pending.free();
            Err(e)
        }
        // `pending` leaks the memory: it may still be registered.
        Err(e) => Err(e),
    }
}

impl<E: TransferEngine + ?Sized> Drop for RegisteredBuffer<E> {
    fn drop(&mut self) {
        let Some(memory) = self.memory.take() else {
            return;
        };
        let engine = Arc::clone(&self.engine);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                // If the runtime shuts down before the task finishes, the
                // task is dropped and `unregister_then_free` leaks the memory.
                handle.spawn(async move {
                    let addr = memory.addr();
                    if let Err(e) = unregister_then_free(engine.as_ref(), memory).await {
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
