//! Scaffolding shared by the facade's TCP tests: two engines on loopback
//! (socket path, so every byte crosses the wire), a registered buffer on
//! each, the source filled, the target's segment open, and the request
//! that writes the whole source over the whole target.
#![allow(dead_code)] // each test binary uses its own part of it

use std::sync::Arc;

use ferry::{Engine, RegisteredBuffer, SegmentId, TransferEngine, TransferRequest};

/// Two TCP engines with one buffer each (see the module's text).
pub struct Pair {
    /// The initiator.
    pub a: Arc<Engine>,
    /// The target.
    pub b: Arc<Engine>,
    /// `len` bytes on `a`, every byte `fill`.
    pub src: RegisteredBuffer<Engine>,
    /// `len` zero bytes on `b`.
    pub dst: RegisteredBuffer<Engine>,
    /// `b`'s segment, opened by `a`.
    pub seg: SegmentId,
    /// Writes all of `src` over all of `dst`.
    pub whole: TransferRequest,
}

/// [`Pair`] of `len` bytes, the source filled with `fill`.
pub async fn tcp_pair(len: usize, fill: u8) -> Pair {
    let open = || async {
        Arc::new(
            Engine::open("tcp://127.0.0.1:0?same_host=off")
                .await
                .expect("a loopback TCP engine"),
        )
    };
    let (a, b) = (open().await, open().await);
    let src = RegisteredBuffer::new(a.clone(), len).await.unwrap();
    let dst = RegisteredBuffer::new(b.clone(), len).await.unwrap();
    src.memory().fill(fill);
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let whole = TransferRequest::write_span(src.span(), &dst.descriptor()).unwrap();
    Pair {
        a,
        b,
        src,
        dst,
        seg,
        whole,
    }
}
