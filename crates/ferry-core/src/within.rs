//! Per-call deadlines on any engine.
//!
//! Every method of [`TransferEngine`] is cancel-safe in the way its docs
//! state (checked by the conformance suite's `cancellation` and
//! `awaited_notification` checks), so a deadline is the method's future
//! dropped when the time is up: what that leaves behind is exactly what a
//! dropped future leaves. [`TransferEngineExt`] gives every engine (and
//! `dyn DynTransferEngine`, and the `ferry::Engine` facade) the `*_within`
//! forms.

use std::future::Future;
use std::time::Duration;

use crate::engine::TransferEngine;
use crate::error::{Error, Result};
use crate::types::{BatchReport, Notification, SegmentId, TransferRequest};

/// Deadlines for the calls that wait on peers. Implemented for every
/// [`TransferEngine`], sized or not.
pub trait TransferEngineExt: TransferEngine {
    /// [`TransferEngine::transfer`], or [`Error::Timeout`] once `within`
    /// has passed. A timed-out transfer may have moved some, all or none of
    /// its bytes ([`crate::Retry::MaybeApplied`]) and leaves nothing behind.
    fn transfer_within(
        &self,
        segment: SegmentId,
        request: TransferRequest,
        within: Duration,
    ) -> impl Future<Output = Result<()>> + Send + '_ {
        deadline(
            within,
            move || format!("transfer on segment {segment}"),
            self.transfer(segment, request),
        )
    }

    /// [`TransferEngine::batch_transfer`], or [`Error::Timeout`] once
    /// `within` has passed (then as for
    /// [`TransferEngineExt::transfer_within`], for every request; the
    /// notification may or may not have been sent).
    fn batch_transfer_within<'a>(
        &'a self,
        segment: SegmentId,
        requests: &'a [TransferRequest],
        notify: Option<&'a Notification>,
        within: Duration,
    ) -> impl Future<Output = Result<BatchReport>> + Send + 'a {
        deadline(
            within,
            move || {
                format!(
                    "batch_transfer of {} requests on segment {segment}",
                    requests.len()
                )
            },
            self.batch_transfer(segment, requests, notify),
        )
    }

    /// [`TransferEngine::next_notification`] for at most `within`:
    /// `Ok(None)` when none came (nothing was taken).
    fn next_notification_within<'a>(
        &'a self,
        name: Option<&'a str>,
        within: Duration,
    ) -> impl Future<Output = Result<Option<Notification>>> + Send + 'a {
        async move {
            match tokio::time::timeout(within, self.next_notification(name)).await {
                Ok(r) => r.map(Some),
                Err(_) => Ok(None),
            }
        }
    }
}

impl<E: TransferEngine + ?Sized> TransferEngineExt for E {}

pub(crate) async fn deadline<T>(
    within: Duration,
    operation: impl FnOnce() -> String,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(within, fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            operation: operation(),
            peer: None,
            after: within,
        }),
    }
}
