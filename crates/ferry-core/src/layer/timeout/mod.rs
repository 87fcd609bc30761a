//! [`TimeoutLayer`]: a deadline on every call that waits on a peer.
//!
//! `open_segment`, `transfer`, `batch_transfer`, `submit` and `wait` end
//! with [`Error::Timeout`](crate::Error::Timeout) once the deadline has
//! passed, exactly as the `*_within` calls of
//! [`TransferEngineExt`](crate::TransferEngineExt) do: the call's future is
//! dropped, which leaves behind what each method's cancel-safety note
//! says (a transfer may have moved some, all or none of its bytes).
//! `next_notification` waits without a bound by contract and is not
//! limited (use `next_notification_within`); `register`, `unregister`
//! and `shutdown` do not wait on peers and are not limited either.

use std::fmt;
use std::time::Duration;

use crate::engine::TransferEngine;
use crate::error::Result;
use crate::layer::Layer;
use crate::types::{BatchId, BatchReport, Notification, SegmentId, TransferRequest};
use crate::within::deadline;

/// [`Layer`] that wraps engines in a [`TimeoutEngine`].
#[derive(Clone, Copy, Debug)]
pub struct TimeoutLayer {
    within: Duration,
}

impl TimeoutLayer {
    /// Every limited call ends at most `within` after it started.
    pub fn new(within: Duration) -> Self {
        TimeoutLayer { within }
    }
}

impl<E: TransferEngine> Layer<E> for TimeoutLayer {
    type Engine = TimeoutEngine<E>;
    fn layer(&self, inner: E) -> TimeoutEngine<E> {
        TimeoutEngine {
            inner,
            within: self.within,
        }
    }
}

/// Puts a deadline on the calls of its inner engine that wait on a peer
/// (see the module docs). Capabilities are the inner engine's.
pub struct TimeoutEngine<E> {
    inner: E,
    within: Duration,
}

impl<E: TransferEngine> fmt::Debug for TimeoutEngine<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimeoutEngine")
            .field("backend", &self.inner.backend_name())
            .field("within", &self.within)
            .finish_non_exhaustive()
    }
}

accessors!(TimeoutEngine);

impl<E> TimeoutEngine<E> {
    /// The deadline of each limited call.
    pub fn within(&self) -> Duration {
        self.within
    }
}

#[deny(clippy::missing_trait_methods)]
impl<E: TransferEngine> TransferEngine for TimeoutEngine<E> {
    forward!(
        backend_name,
        segment_name,
        capabilities,
        backend_info,
        register,
        unregister,
        batch_register,
        batch_unregister,
        close_segment,
        status,
        release_batch,
        take_notifications,
        next_notification,
        live_batches,
        inbound,
        shutdown
    );

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        deadline(
            self.within,
            || format!("open_segment {name}"),
            self.inner.open_segment(name),
        )
        .await
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        deadline(
            self.within,
            || format!("transfer on segment {segment}"),
            self.inner.transfer(segment, request),
        )
        .await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        deadline(
            self.within,
            || {
                format!(
                    "batch_transfer of {} requests on segment {segment}",
                    requests.len()
                )
            },
            self.inner.batch_transfer(segment, requests, notify),
        )
        .await
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        deadline(
            self.within,
            || format!("submit of {} requests on segment {segment}", requests.len()),
            self.inner.submit(segment, requests, notify),
        )
        .await
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        deadline(
            self.within,
            || format!("wait for batch {batch}"),
            self.inner.wait(batch),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::inproc::InprocEngine;
    use crate::{Capabilities, DynTransferEngine, ErrorKind, RegisteredBuffer};

    #[tokio::test]
    async fn a_slow_transfer_ends_with_timeout_and_a_fast_one_passes() {
        let caps = Capabilities::all();
        let slow = InprocEngine::auto(caps);
        // A pause after every copied chunk: 1 MiB takes far longer than 20 ms.
        slow.set_pace(Some(Duration::from_millis(50)));
        let a = Arc::new(TimeoutLayer::new(Duration::from_millis(20)).layer(slow));
        let b: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(caps));
        let src = RegisteredBuffer::new(Arc::clone(&a), 1 << 20)
            .await
            .unwrap();
        let dst = RegisteredBuffer::new(Arc::clone(&b), 1 << 20)
            .await
            .unwrap();
        let peer = a.open_segment(b.segment_name()).await.unwrap();
        let big = TransferRequest::write(src.addr(), dst.addr(), 1 << 20);
        let err = a.transfer(peer, big).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        let err = a.batch_transfer(peer, &[big], None).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        // Nothing to copy: done well within the deadline.
        a.transfer(peer, TransferRequest::write(src.addr(), dst.addr(), 0))
            .await
            .unwrap();
        assert_eq!(a.within(), Duration::from_millis(20));
    }
}
