//! [`TracingLayer`]: one `tracing` span per transfer and per batch.
//!
//! The span is `ferry_batch` at `debug` level (so a `tracing-subscriber`
//! filter such as `ferry_core=debug`, or `ferry bench -vv`, shows it),
//! with the fields `engine` (this engine's segment name), `peer` (the
//! segment name the handle was opened with), `call` (`transfer`,
//! `batch_transfer`, `submit`), `op` (`read`, `write`, `mixed`), `bytes`,
//! `requests`, and `outcome` recorded when the call returns: `ok`,
//! `failed` (some requests failed: `failed` holds how many) or `refused`
//! (the call failed as a whole: `error` holds the error kind). The
//! backend's own events inside the call are children of the span.
//! `open_segment` gets a `ferry_connect` span (engine, peer, outcome, and
//! the handshake's details where the backend records them on it, see
//! [`CONNECT_FIELDS`]).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tracing::field::Empty;
use tracing::instrument::Instrumented;
use tracing::{Instrument, Span};

use super::peers::{batch_bytes, batch_op, Peers};
use crate::engine::TransferEngine;
use crate::error::Result;
use crate::layer::metrics::kind_label;
use crate::layer::Layer;
use crate::types::{BatchId, BatchReport, Notification, SegmentId, TransferRequest};

/// The fields of the `ferry_connect` span a backend may record from inside
/// its `open_segment` (on `tracing::Span::current()`, which is that span
/// when the call runs under this layer; recording a field a span does not
/// have does nothing, so a backend records them unconditionally):
/// `version` (the protocol version in use), `peer_versions` (the range the
/// peer speaks), `path` (the payload path: `socket`, `same-host cma`,
/// `same-host staged`, …), `tls` (the cipher suite and identity, or why it
/// is off) and `features` (the optional features agreed). ferry-tcp
/// records all of them; the other backends none.
pub const CONNECT_FIELDS: [&str; 5] = ["version", "peer_versions", "path", "tls", "features"];

/// [`Layer`] that wraps engines in a [`TracingEngine`].
#[derive(Clone, Copy, Debug)]
pub struct TracingLayer {
    enabled: bool,
}

impl Default for TracingLayer {
    fn default() -> Self {
        TracingLayer::new()
    }
}

impl TracingLayer {
    /// The layer.
    pub fn new() -> Self {
        TracingLayer { enabled: true }
    }

    /// A layer whose engines open no spans and forward every call:
    /// tracing switched off without changing the engine's type.
    pub fn disabled() -> Self {
        TracingLayer { enabled: false }
    }
}

impl<E: TransferEngine> Layer<E> for TracingLayer {
    type Engine = TracingEngine<E>;
    fn layer(&self, inner: E) -> TracingEngine<E> {
        TracingEngine {
            engine: Arc::from(inner.segment_name()),
            inner,
            // A span is not a series: peer names are not folded.
            peers: Peers::new(None),
            enabled: self.enabled,
        }
    }
}

/// Opens a span around each transfer, batch and connection of its inner
/// engine (see the module docs). Capabilities are the inner engine's.
pub struct TracingEngine<E> {
    inner: E,
    engine: Arc<str>,
    peers: Peers,
    enabled: bool,
}

impl<E: TransferEngine> fmt::Debug for TracingEngine<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TracingEngine")
            .field("backend", &self.inner.backend_name())
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

accessors!(TracingEngine);

impl<E> TracingEngine<E> {
    /// `path` (a [`FastPath`](crate::FastPath) of a segment under this
    /// layer) as this layer passes it on: declined while `ferry_batch`
    /// spans may be recorded (the layer on and DEBUG enabled), so that
    /// such calls go the traced way; untouched otherwise.
    pub fn wrap_fast(&self, path: crate::FastPath) -> crate::FastPath {
        if !self.enabled {
            return path;
        }
        path.guarded(|| (!tracing::level_enabled!(tracing::Level::DEBUG)).then_some(()))
    }

    fn span(&self, call: &'static str, segment: SegmentId, requests: &[TransferRequest]) -> Span {
        if !self.enabled {
            return Span::none();
        }
        tracing::debug_span!(
            "ferry_batch",
            engine = %self.engine,
            peer = %self.peers.of(segment),
            call,
            op = batch_op(requests),
            bytes = batch_bytes(requests),
            requests = requests.len(),
            outcome = Empty,
            failed = Empty,
            error = Empty,
        )
    }
}

pin_project_lite::pin_project! {
    /// `fut` in its span, the outcome recorded there when it ends. A
    /// future of its own rather than an `async fn`: that one kept both the
    /// inner future it was given and the instrumented one it awaited, so
    /// every call's state (and what each layer above moves) was twice the
    /// inner call's.
    struct Traced<F, C> {
        #[pin]
        fut: Instrumented<F>,
        failed: Option<C>,
    }
}

/// Runs `fut` in `span` and records its outcome there.
fn traced<T, F, C>(span: Span, fut: F, failed: C) -> Traced<F, C>
where
    F: Future<Output = Result<T>>,
    C: FnOnce(&T) -> usize,
{
    Traced {
        fut: fut.instrument(span),
        failed: Some(failed),
    }
}

impl<T, F, C> Future for Traced<F, C>
where
    F: Future<Output = Result<T>>,
    C: FnOnce(&T) -> usize,
{
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.project();
        let mut fut = this.fut;
        let r = std::task::ready!(fut.as_mut().poll(cx));
        let span = fut.span();
        if !span.is_disabled() {
            match &r {
                Ok(v) => match this.failed.take().map_or(0, |f| f(v)) {
                    0 => {
                        span.record("outcome", "ok");
                    }
                    n => {
                        span.record("outcome", "failed");
                        span.record("failed", n);
                    }
                },
                Err(e) => {
                    span.record("outcome", "refused");
                    span.record("error", kind_label(e.kind()));
                }
            }
        }
        Poll::Ready(r)
    }
}

fn failures(report: &BatchReport) -> usize {
    report.results.iter().filter(|r| r.is_err()).count()
}

#[deny(clippy::missing_trait_methods)]
impl<E: TransferEngine> TransferEngine for TracingEngine<E> {
    forward!(
        backend_name,
        segment_name,
        capabilities,
        backend_info,
        register,
        unregister,
        batch_register,
        batch_unregister,
        status,
        wait,
        release_batch,
        take_notifications,
        next_notification,
        live_batches,
        inbound,
        shutdown
    );

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        if !self.enabled {
            return self.inner.open_segment(name).await;
        }
        let span = tracing::debug_span!(
            "ferry_connect",
            engine = %self.engine,
            peer = name,
            outcome = Empty,
            error = Empty,
            // CONNECT_FIELDS, recorded by the backend.
            version = Empty,
            peer_versions = Empty,
            path = Empty,
            tls = Empty,
            features = Empty,
        );
        let segment = traced(span, self.inner.open_segment(name), |_| 0).await?;
        self.peers.opened(segment, name);
        Ok(segment)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.close_segment(segment).await?;
        if self.enabled {
            self.peers.closed(segment);
        }
        Ok(())
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let span = self.span("transfer", segment, std::slice::from_ref(&request));
        traced(span, self.inner.transfer(segment, request), |_| 0).await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let span = self.span("batch_transfer", segment, requests);
        traced(
            span,
            self.inner.batch_transfer(segment, requests, notify),
            failures,
        )
        .await
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let span = self.span("submit", segment, requests);
        traced(span, self.inner.submit(segment, requests, notify), |_| 0).await
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::inproc::InprocEngine;
    use crate::{Capabilities, DynTransferEngine, RegisteredBuffer};

    /// What the subscriber wrote.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            crate::__private::sync::lock(&self.0).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    async fn one_batch(layer: TracingLayer) -> String {
        let sink = Sink::default();
        let out = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let a = Arc::new(layer.layer(InprocEngine::auto(Capabilities::all())));
        let b: Arc<dyn DynTransferEngine> = Arc::new(InprocEngine::auto(Capabilities::all()));
        let src = RegisteredBuffer::new(Arc::clone(&a), 256).await.unwrap();
        let dst = RegisteredBuffer::new(Arc::clone(&b), 256).await.unwrap();
        let peer = a.open_segment(b.segment_name()).await.unwrap();
        let requests = [
            TransferRequest::write(src.addr(), dst.addr(), 100),
            TransferRequest::write(src.addr(), dst.addr() + 4096, 10),
        ];
        let report = a.batch_transfer(peer, &requests, None).await.unwrap();
        assert_eq!(report.failures().count(), 1);
        let text = String::from_utf8_lossy(&crate::__private::sync::lock(&out.0)).into_owned();
        text
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_batch_closes_one_span_with_its_fields_and_outcome() {
        let text = one_batch(TracingLayer::new()).await;
        let batch: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("ferry_batch") && l.contains("close"))
            .collect();
        assert_eq!(batch.len(), 1, "{text}");
        for field in [
            "call=\"batch_transfer\"",
            "op=\"write\"",
            "bytes=110",
            "requests=2",
            "outcome=\"failed\"",
            "failed=1",
        ] {
            assert!(batch[0].contains(field), "{field} missing in {}", batch[0]);
        }
        assert!(text.contains("ferry_connect"), "{text}");
        let off = one_batch(TracingLayer::disabled()).await;
        assert!(!off.contains("ferry_batch"), "{off}");
    }
}
