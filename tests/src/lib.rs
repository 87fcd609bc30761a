//! Support for the workspace-level tests in `tests/tests/`.
//!
//! - [`Masked`]: an engine wrapper that hides native capabilities, so that
//!   the adapter's emulation can be compared with a backend's native batch
//!   paths on the same backend;
//! - [`normalize`]: makes per-request outcomes of different engine pairs
//!   comparable (drops the peer name, which differs between pairs).
#![forbid(unsafe_code)]

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use ferry_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, MemoryRegion,
    MissingCapability, Notification, Operation, Result, SegmentId, TransferEngine, TransferRequest,
};

/// Forwards to `inner` but declares only `caps` (intersected with the inner
/// engine's) and answers [`Error::Unsupported`] for every optional operation
/// it hides, exactly like a backend that lacks them.
pub struct Masked {
    inner: Arc<dyn DynTransferEngine>,
    caps: Capabilities,
}

impl Masked {
    /// Wraps `inner`, keeping only the optional operations set in `keep`.
    pub fn new(inner: Arc<dyn DynTransferEngine>, keep: Capabilities) -> Self {
        let native = inner.capabilities();
        let mut caps = native;
        for op in Operation::OPTIONAL {
            caps.set(op, native.supports(op) && keep.supports(op));
        }
        Masked { inner, caps }
    }

    fn check(&self, op: Operation) -> Result<()> {
        if self.caps.supports(op) {
            Ok(())
        } else {
            Err(Error::unsupported(
                self.inner.backend_name(),
                op,
                "hidden by the test's capability mask",
            ))
        }
    }
}

#[deny(clippy::missing_trait_methods)]
impl TransferEngine for Masked {
    fn backend_name(&self) -> &str {
        self.inner.backend_name()
    }
    fn segment_name(&self) -> &str {
        self.inner.segment_name()
    }
    fn capabilities(&self) -> Capabilities {
        self.caps
    }
    fn backend_info(&self) -> BackendInfo {
        let mut info = self.inner.backend_info();
        for op in Operation::OPTIONAL {
            if !self.caps.supports(op) && info.note(op).is_none() {
                info.not_native.push(MissingCapability {
                    operation: op,
                    reason: "hidden by the test's capability mask".to_owned(),
                    min_version: None,
                });
            }
        }
        info
    }
    async fn register(&self, region: MemoryRegion) -> Result<()> {
        self.inner.register(region).await
    }
    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.unregister(addr).await
    }
    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        self.check(Operation::BatchRegister)?;
        self.inner.batch_register(regions).await
    }
    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        self.check(Operation::BatchUnregister)?;
        self.inner.batch_unregister(addrs).await
    }
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.inner.open_segment(name).await
    }
    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.close_segment(segment).await
    }
    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        self.inner.transfer(segment, request).await
    }
    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        self.check(Operation::BatchTransfer)?;
        if notify.is_some() {
            self.check(Operation::Notify)?;
        }
        self.inner.batch_transfer(segment, requests, notify).await
    }
    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        self.check(Operation::AsyncBatch)?;
        if notify.is_some() {
            self.check(Operation::Notify)?;
        }
        self.inner.submit(segment, requests, notify).await
    }
    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.check(Operation::AsyncBatch)?;
        self.inner.status(batch)
    }
    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        self.check(Operation::BatchWait)?;
        self.inner.wait(batch).await
    }
    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        self.check(Operation::AsyncBatch)?;
        self.inner.release_batch(batch).await
    }
    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        self.check(Operation::Notify)?;
        self.inner.take_notifications().await
    }
    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        self.check(Operation::Notify)?;
        self.inner.next_notification(name).await
    }
    fn live_batches(&self) -> Option<usize> {
        self.inner.live_batches()
    }
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        self.inner.inbound()
    }

    async fn shutdown(&self) -> Result<()> {
        self.inner.shutdown().await
    }
}

/// The outcome with peer names removed (they differ between engine pairs
/// that are otherwise set up identically).
pub fn normalize(r: &Result<()>) -> Result<()> {
    match r {
        Err(Error::AddressNotRegistered {
            side, addr, len, ..
        }) => Err(Error::AddressNotRegistered {
            side: *side,
            addr: *addr,
            len: *len,
            peer: None,
        }),
        other => other.clone(),
    }
}
