//! `forward!`: the methods of a [`TransferEngine`](crate::TransferEngine)
//! wrapper that only pass the call to `self.inner`, written once for every
//! layer. Each wrapper names in its `impl` the methods it forwards (the
//! others it writes itself), so `#[deny(clippy::missing_trait_methods)]`
//! still sees every method.

/// `get_ref` and `into_inner` (tower's accessors) of a wrapper whose
/// engine is its field `inner`.
macro_rules! accessors {
    ($ty:ident) => {
        impl<E> $ty<E> {
            /// The wrapped engine.
            pub fn get_ref(&self) -> &E {
                &self.inner
            }
            /// Unwraps.
            pub fn into_inner(self) -> E {
                self.inner
            }
        }
    };
}

/// Expands to forwarding bodies (`self.inner.method(args)`) for the named
/// methods of `TransferEngine`.
macro_rules! forward {
    ($($method:ident),* $(,)?) => { $( forward!(@ $method); )* };
    (@ backend_name) => {
        fn backend_name(&self) -> &str {
            self.inner.backend_name()
        }
    };
    (@ segment_name) => {
        fn segment_name(&self) -> &str {
            self.inner.segment_name()
        }
    };
    (@ capabilities) => {
        fn capabilities(&self) -> $crate::caps::Capabilities {
            self.inner.capabilities()
        }
    };
    (@ backend_info) => {
        fn backend_info(&self) -> $crate::caps::BackendInfo {
            self.inner.backend_info()
        }
    };
    (@ register) => {
        fn register(
            &self,
            region: $crate::types::MemoryRegion,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<()>> + Send {
            self.inner.register(region)
        }
    };
    (@ unregister) => {
        fn unregister(
            &self,
            addr: u64,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<()>> + Send {
            self.inner.unregister(addr)
        }
    };
    (@ batch_register) => {
        fn batch_register(
            &self,
            regions: Vec<$crate::types::MemoryRegion>,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<()>> + Send {
            self.inner.batch_register(regions)
        }
    };
    (@ batch_unregister) => {
        fn batch_unregister(
            &self,
            addrs: &[u64],
        ) -> impl ::std::future::Future<Output = $crate::error::Result<()>> + Send {
            self.inner.batch_unregister(addrs)
        }
    };
    (@ open_segment) => {
        fn open_segment(
            &self,
            name: &str,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<$crate::types::SegmentId>> + Send
        {
            self.inner.open_segment(name)
        }
    };
    (@ close_segment) => {
        fn close_segment(
            &self,
            segment: $crate::types::SegmentId,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<()>> + Send {
            self.inner.close_segment(segment)
        }
    };
    (@ transfer) => {
        fn transfer(
            &self,
            segment: $crate::types::SegmentId,
            request: $crate::types::TransferRequest,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<()>> + Send {
            self.inner.transfer(segment, request)
        }
    };
    (@ batch_transfer) => {
        fn batch_transfer(
            &self,
            segment: $crate::types::SegmentId,
            requests: &[$crate::types::TransferRequest],
            notify: Option<&$crate::types::Notification>,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<$crate::types::BatchReport>>
               + Send {
            self.inner.batch_transfer(segment, requests, notify)
        }
    };
    (@ submit) => {
        fn submit(
            &self,
            segment: $crate::types::SegmentId,
            requests: &[$crate::types::TransferRequest],
            notify: Option<&$crate::types::Notification>,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<$crate::types::BatchId>> + Send
        {
            self.inner.submit(segment, requests, notify)
        }
    };
    (@ status) => {
        fn status(
            &self,
            batch: $crate::types::BatchId,
        ) -> $crate::error::Result<$crate::types::BatchStatus> {
            self.inner.status(batch)
        }
    };
    (@ wait) => {
        fn wait(
            &self,
            batch: $crate::types::BatchId,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<$crate::types::BatchReport>>
               + Send {
            self.inner.wait(batch)
        }
    };
    (@ release_batch) => {
        fn release_batch(
            &self,
            batch: $crate::types::BatchId,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<()>> + Send {
            self.inner.release_batch(batch)
        }
    };
    (@ take_notifications) => {
        fn take_notifications(
            &self,
        ) -> impl ::std::future::Future<
            Output = $crate::error::Result<Vec<$crate::types::Notification>>,
        > + Send {
            self.inner.take_notifications()
        }
    };
    (@ next_notification) => {
        fn next_notification(
            &self,
            name: Option<&str>,
        ) -> impl ::std::future::Future<Output = $crate::error::Result<$crate::types::Notification>>
               + Send {
            self.inner.next_notification(name)
        }
    };
    (@ live_batches) => {
        fn live_batches(&self) -> Option<usize> {
            self.inner.live_batches()
        }
    };
    (@ inbound) => {
        fn inbound(&self) -> Option<$crate::inbound::Inbound> {
            self.inner.inbound()
        }
    };
    (@ shutdown) => {
        fn shutdown(&self) -> impl ::std::future::Future<Output = $crate::error::Result<()>> + Send {
            self.inner.shutdown()
        }
    };
}
