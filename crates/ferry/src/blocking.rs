//! [`Engine`] for programs that are not async: every call blocks the
//! calling thread until it is done.
//!
//! A blocking call does not wait to be woken by a runtime thread: it runs
//! on the calling thread through [`crate::assist::block_on`], which drives
//! the connection the call uses while it waits (the caller reads its own
//! answer), so a small transfer costs about what it costs an async caller
//! on a runtime worker (`examples/blocking_latency.rs` measures both).
//!
//! The engine runs its background work (serving peers, connections no
//! caller is waiting on) on a Tokio runtime: its own ([`Engine::open`],
//! [`Engine::start`], one worker thread by default, [`Builder`] to change
//! it) or one the program already has ([`Engine::with_runtime`]).
//!
//! ```no_run
//! use ferry::blocking::Engine;
//! use ferry::TransferRequest;
//!
//! # fn demo() -> ferry::Result<()> {
//! // Two engines in one process for the example; usually they are in two.
//! let decode = Engine::open("tcp://127.0.0.1:0")?;
//! let prefill = Engine::open("tcp://127.0.0.1:0")?;
//! let kv = decode.buffer(1 << 20)?; // registered until dropped
//! let src = prefill.buffer(4096)?;
//! src.memory().fill(7);
//! let peer = prefill.open_segment(decode.segment_name())?;
//! prefill.transfer(peer, TransferRequest::write(src.addr(), kv.addr(), 4096))?;
//! let report = prefill.batch_transfer(
//!     peer,
//!     &[TransferRequest::write(src.addr(), kv.addr() + 4096, 4096)],
//!     None,
//! )?;
//! report.into_result()?;
//! # Ok(()) }
//! ```
//!
//! Calls must not be made from async code (a runtime's thread would
//! block, and with it the work the call waits for): from inside a spawned
//! task they return [`Error::InvalidArgument`]; inside the future given
//! to a runtime's own `block_on` that cannot be detected, so don't. Async
//! code uses [`crate::Engine`] directly.

use std::future::Future;
use std::sync::Arc;

use crate::{
    BatchId, BatchReport, BatchStatus, Capabilities, CapabilityReport, EngineConfig, Error,
    MemoryRegion, Notification, RegisteredBuffer, Result, SegmentId, TransferEngine,
    TransferRequest,
};

/// Where the engine's background work runs.
enum Runtime {
    /// Made by the facade, shut down when it is dropped.
    Owned(Option<tokio::runtime::Runtime>),
    /// The program's.
    Borrowed(tokio::runtime::Handle),
}

impl Runtime {
    fn handle(&self) -> &tokio::runtime::Handle {
        match self {
            Runtime::Owned(Some(rt)) => rt.handle(),
            Runtime::Borrowed(h) => h,
            Runtime::Owned(None) => unreachable!("the runtime is only taken by Drop"),
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Runtime::Owned(rt) = self {
            if let Some(rt) = rt.take() {
                // Dropping a runtime waits for its threads, which Tokio
                // refuses (a panic) inside another runtime's context.
                if tokio::runtime::Handle::try_current().is_ok() {
                    rt.shutdown_background();
                } else {
                    drop(rt);
                }
            }
        }
    }
}

/// Options of an engine with its own runtime.
#[derive(Clone, Debug)]
pub struct Builder {
    worker_threads: usize,
}

impl Default for Builder {
    fn default() -> Self {
        Builder { worker_threads: 1 }
    }
}

impl Builder {
    /// One worker thread: blocked callers do their own I/O, the worker
    /// serves peers and whatever no caller waits on.
    pub fn new() -> Builder {
        Builder::default()
    }

    /// The runtime's worker threads (at least 1). More serve more peers
    /// at once; on a small host each one that spins takes a CPU from the
    /// callers.
    pub fn worker_threads(mut self, n: usize) -> Builder {
        self.worker_threads = n.max(1);
        self
    }

    /// Starts the backend `url` names, through the scheme registry (see
    /// [`crate::Engine::open`], whose trust rules apply).
    pub fn open(self, url: &str) -> Result<Engine> {
        let url = ferry_core::raw::ParsedUrl::parse(url)?;
        self.run(move || crate::Engine::open_parsed(url, crate::registry::OpenOptions::default()))
    }

    /// Starts the backend `config` names (see [`crate::Engine::start`]).
    pub fn start(self, config: EngineConfig) -> Result<Engine> {
        self.run(move || crate::Engine::start(config))
    }

    /// Makes the runtime and starts the engine `start` gives on it.
    fn run<F, Fut>(self, start: F) -> Result<Engine>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<crate::Engine>>,
    {
        not_in_a_task("start")?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.worker_threads)
            .thread_name("ferry-worker")
            .enable_all()
            .build()
            .map_err(|e| Error::from_io("starting the engine's runtime", e))?;
        let engine = crate::assist::block_on(rt.handle(), start())?;
        Ok(Engine {
            inner: Arc::new(engine),
            rt: Runtime::Owned(Some(rt)),
        })
    }
}

/// A [`crate::Engine`] whose calls block the calling thread (see the
/// module docs).
pub struct Engine {
    // Dropped before the runtime: its background tasks go first.
    inner: Arc<crate::Engine>,
    rt: Runtime,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("blocking::Engine")
            .field("backend", &self.inner.backend_name())
            .field("segment", &self.inner.segment_name())
            .finish()
    }
}

/// [`Error::InvalidArgument`] when called from inside an async task.
fn not_in_a_task(call: &str) -> Result<()> {
    if tokio::task::try_id().is_some() {
        return Err(Error::InvalidArgument(format!(
            "ferry::blocking::Engine::{call} called from an async task: it would block the \
             runtime's thread; use ferry::Engine there"
        )));
    }
    Ok(())
}

impl Engine {
    /// Starts the backend `url` names on a runtime of its own with one
    /// worker thread ([`Builder`] for more).
    pub fn open(url: &str) -> Result<Engine> {
        Builder::new().open(url)
    }

    /// Starts the backend `config` names on a runtime of its own.
    pub fn start(config: EngineConfig) -> Result<Engine> {
        Builder::new().start(config)
    }

    /// Wraps an engine started on the runtime of `handle` (which must
    /// outlive this value's calls). Its async users keep using it too.
    pub fn with_runtime(engine: Arc<crate::Engine>, handle: tokio::runtime::Handle) -> Engine {
        Engine {
            inner: engine,
            rt: Runtime::Borrowed(handle),
        }
    }

    /// The async engine, for async code of the same program.
    pub fn get_ref(&self) -> &Arc<crate::Engine> {
        &self.inner
    }

    /// Runs `fut` to completion on the calling thread, inside the engine's
    /// runtime (for timers and spawned tasks), driving the connections it
    /// uses: for async calls the facade does not wrap.
    pub fn block_on<F: Future>(&self, fut: F) -> Result<F::Output> {
        not_in_a_task("block_on")?;
        Ok(crate::assist::block_on(self.rt.handle(), fut))
    }

    fn run<T>(&self, call: &str, fut: impl Future<Output = Result<T>>) -> Result<T> {
        not_in_a_task(call)?;
        crate::assist::block_on(self.rt.handle(), fut)
    }

    /// See [`TransferEngine::backend_name`].
    pub fn backend_name(&self) -> &str {
        self.inner.backend_name()
    }

    /// The name peers open this engine by ([`TransferEngine::segment_name`]).
    pub fn segment_name(&self) -> &str {
        self.inner.segment_name()
    }

    /// See [`TransferEngine::capabilities`].
    pub fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    /// See [`crate::Engine::report`].
    pub fn report(&self) -> CapabilityReport {
        self.inner.report()
    }

    /// Allocates `len` zeroed bytes registered with this engine until the
    /// returned buffer is dropped (then unregistered, then freed).
    pub fn buffer(&self, len: usize) -> Result<Buffer> {
        let inner = self.run(
            "buffer",
            RegisteredBuffer::new(Arc::clone(&self.inner), len),
        )?;
        Ok(Buffer {
            inner: Some(inner),
            rt: self.rt.handle().clone(),
        })
    }

    /// Registers memory the caller owns ([`TransferEngine::register`]; the
    /// region's constructor states what the caller guarantees).
    pub fn register(&self, region: MemoryRegion) -> Result<()> {
        self.run("register", self.inner.register(region))
    }

    /// See [`TransferEngine::unregister`].
    pub fn unregister(&self, addr: u64) -> Result<()> {
        self.run("unregister", self.inner.unregister(addr))
    }

    /// See [`TransferEngine::batch_register`].
    pub fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        self.run("batch_register", self.inner.batch_register(regions))
    }

    /// See [`TransferEngine::batch_unregister`].
    pub fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        self.run("batch_unregister", self.inner.batch_unregister(addrs))
    }

    /// See [`TransferEngine::open_segment`].
    pub fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.run("open_segment", self.inner.open_segment(name))
    }

    /// See [`TransferEngine::close_segment`].
    pub fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.run("close_segment", self.inner.close_segment(segment))
    }

    /// One request, waited for ([`TransferEngine::transfer`]).
    ///
    /// A call whose future finishes on its first poll (on the TCP backend's
    /// same-host path, a small request the peer granted: one copy by this
    /// thread) returns without waking any other thread
    /// ([`ferry_core::assist::block_on`]).
    pub fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        not_in_a_task("transfer")?;
        self.run("transfer", self.inner.transfer(segment, request))
    }

    /// Every request, waited for ([`TransferEngine::batch_transfer`]).
    pub fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        self.run(
            "batch_transfer",
            self.inner.batch_transfer(segment, requests, notify),
        )
    }

    /// Starts a batch ([`TransferEngine::submit`]).
    pub fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        self.run("submit", self.inner.submit(segment, requests, notify))
    }

    /// See [`TransferEngine::status`] (never blocks).
    pub fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.status(batch)
    }

    /// Waits for a batch ([`TransferEngine::wait`]).
    pub fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        self.run("wait", self.inner.wait(batch))
    }

    /// See [`TransferEngine::release_batch`].
    pub fn release_batch(&self, batch: BatchId) -> Result<()> {
        self.run("release_batch", self.inner.release_batch(batch))
    }

    /// See [`TransferEngine::take_notifications`].
    pub fn take_notifications(&self) -> Result<Vec<Notification>> {
        self.run("take_notifications", self.inner.take_notifications())
    }

    /// The next notification named `name` (any with `None`), waiting at
    /// most `timeout` ([`Error::Timeout`] then; nothing is taken).
    pub fn next_notification(
        &self,
        name: Option<&str>,
        timeout: std::time::Duration,
    ) -> Result<Notification> {
        self.run("next_notification", async {
            match tokio::time::timeout(timeout, self.inner.next_notification(name)).await {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout {
                    operation: "next_notification".to_owned(),
                    peer: None,
                    after: timeout,
                }),
            }
        })
    }

    /// Stops the engine ([`TransferEngine::shutdown`]).
    pub fn shutdown(&self) -> Result<()> {
        self.run("shutdown", self.inner.shutdown())
    }
}

/// Memory registered with a blocking [`Engine`] for as long as it lives
/// ([`Engine::buffer`]): a [`RegisteredBuffer`] whose drop unregisters it
/// on the engine's runtime.
pub struct Buffer {
    inner: Option<RegisteredBuffer<crate::Engine>>,
    rt: tokio::runtime::Handle,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("blocking::Buffer")
            .field("addr", &self.addr())
            .field("len", &self.len())
            .finish()
    }
}

impl Buffer {
    fn get(&self) -> &RegisteredBuffer<crate::Engine> {
        self.inner
            .as_ref()
            .unwrap_or_else(|| unreachable!("only Drop takes the buffer"))
    }

    /// Start address (what a peer uses as `remote_addr`).
    pub fn addr(&self) -> u64 {
        self.get().addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.get().len()
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memory, for copying bytes in and out.
    pub fn memory(&self) -> &crate::HostBuffer {
        self.get().memory()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // Inside the runtime, the registered buffer unregisters itself on
        // it (outside any runtime it would leak its memory).
        let _g = self.rt.enter();
        self.inner.take();
    }
}
