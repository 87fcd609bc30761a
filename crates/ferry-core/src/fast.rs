//! A segment's synchronous fast path: a backend that can finish some
//! transfers on the calling thread, with no future (the TCP backend's
//! granted same-host copies), hands out a [`FastPath`] per segment; the
//! layers of the default stack wrap it with their own bookkeeping
//! (the adapter's drain, the metrics, the tracing switch), and a caller
//! that waits anyway (the blocking API, Python) tries it before
//! `transfer`.
//!
//! The trait has no method for it: a stack whose layers do not all know
//! how to wrap a fast path (a user's layer, say) simply has none, and
//! every call goes through `transfer`. See `ferry::Engine::fast_path`.
//!
//! Invariant of every fast path: [`FastPath::try_transfer`] returns
//! `Some(result)` only when the request was carried out, or failed, by
//! that call, exactly as `transfer` would have done it (the same bytes,
//! the same error, counted once by the metrics); it returns `None` when
//! it did nothing at all (no byte moved, nothing counted), and the caller
//! then calls `transfer`, which decides.

use std::fmt;
use std::sync::Arc;

use crate::error::Result;
use crate::types::TransferRequest;

type Try = dyn Fn(&TransferRequest, FastCall) -> Option<Result<()>> + Send + Sync;

/// The call a fast path stands in for: each layer treats it as that call
/// (the adapter's checks, the metrics' `call` series).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FastCall {
    /// `transfer` of the request.
    Transfer,
    /// `batch_transfer` of this one request, without a notification.
    BatchOfOne,
}

/// One segment's synchronous fast path (see the [module](self)); cheap to
/// clone.
#[derive(Clone)]
pub struct FastPath {
    try_transfer: Arc<Try>,
}

impl FastPath {
    /// A fast path that runs `f`: `Some(result)` when `f` carried the
    /// request out (or failed it) itself, `None` when it did nothing.
    pub fn new(
        f: impl Fn(&TransferRequest, FastCall) -> Option<Result<()>> + Send + Sync + 'static,
    ) -> FastPath {
        FastPath {
            try_transfer: Arc::new(f),
        }
    }

    /// Tries `request` on the calling thread: `Some(result)` if it was
    /// done (or failed) here, `None` if not a byte moved and the caller
    /// must call `transfer`.
    pub fn try_transfer(&self, request: &TransferRequest) -> Option<Result<()>> {
        (self.try_transfer)(request, FastCall::Transfer)
    }

    /// As [`FastPath::try_transfer`], standing in for a `batch_transfer`
    /// of `request` alone with no notification: `Some(result)` is that
    /// request's outcome in the batch's report (counted as a batch of
    /// one); `None`: the caller calls `batch_transfer`.
    pub fn try_batch_of_one(&self, request: &TransferRequest) -> Option<Result<()>> {
        (self.try_transfer)(request, FastCall::BatchOfOne)
    }

    /// Runs `request` as `call` on the inner path (for the layers'
    /// wrappers, which pass the call on as they got it).
    pub fn try_call(&self, request: &TransferRequest, call: FastCall) -> Option<Result<()>> {
        (self.try_transfer)(request, call)
    }

    /// This fast path behind `guard`: `guard` runs first and may decline
    /// (`None`: nothing done) or hand over its token, held across the
    /// inner call. The layers' wrappers are written with it.
    pub fn guarded<G, T>(self, guard: G) -> FastPath
    where
        G: Fn() -> Option<T> + Send + Sync + 'static,
    {
        FastPath::new(move |request, call| {
            let _token = guard()?;
            self.try_call(request, call)
        })
    }
}

impl fmt::Debug for FastPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FastPath").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::types::TransferOp;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn req() -> TransferRequest {
        TransferRequest {
            op: TransferOp::Write,
            local_addr: 0x1000,
            remote_addr: 0x2000,
            len: 4096,
        }
    }

    #[test]
    fn a_guard_that_declines_keeps_the_inner_path_from_running() {
        let ran = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&ran);
        let inner = FastPath::new(move |_, _| {
            r.fetch_add(1, Ordering::SeqCst);
            Some(Ok(()))
        });
        let open = FastPath::guarded(inner.clone(), || Some(()));
        let shut = FastPath::guarded(inner, || None::<()>);
        assert!(shut.try_transfer(&req()).is_none());
        assert_eq!(ran.load(Ordering::SeqCst), 0, "declined: nothing ran");
        assert!(matches!(open.try_transfer(&req()), Some(Ok(()))));
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_inner_result_comes_back_as_it_is() {
        let p = FastPath::new(|r, _| Some(Err(Error::InvalidArgument(format!("len {}", r.len)))));
        match p.try_transfer(&req()) {
            Some(Err(Error::InvalidArgument(m))) => assert_eq!(m, "len 4096"),
            other => panic!("{other:?}"),
        }
    }
}
