//! The metadata listener and its control connections, on the real
//! library: a listener beyond loopback needs `insecure=1`; a control
//! connection that ends without the peer closing it (a reset) leaves the
//! regions it could use registered (`RegionHeld`). The initiator's side
//! (aborting its requests in flight) is `tests/control_abort.rs`.

mod common;

use ferry_core::conformance::skip_unavailable;
use ferry_core::{Error, HostBuffer, Location, MemoryRegion, TransferEngine};
use ferry_nixl::NixlConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn region(b: &HostBuffer) -> MemoryRegion {
    // SAFETY: every buffer of these tests outlives its registration, or is
    // leaked when it stays registered.
    unsafe { b.region(Location::cpu(0)) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_beyond_loopback_needs_insecure() {
    let lib = match common::nixl_library() {
        Ok(l) => l,
        Err(e) => {
            skip_unavailable("listener_beyond_loopback_needs_insecure", &e);
            return;
        }
    };
    let url = |extra: &str| {
        format!(
            "nixl://?host=0.0.0.0&lib={}{extra}",
            lib.display().to_string().replace('%', "%25")
        )
    };
    let refused = common::start(NixlConfig::from_url(&url("")).unwrap()).await;
    match refused {
        Err(Error::InvalidArgument(m)) => {
            assert!(
                m.contains("insecure=1"),
                "the refusal names insecure=1: {m}"
            );
            assert!(m.contains("0.0.0.0"), "the refusal names the address: {m}");
        }
        other => panic!("nixl://?host=0.0.0.0 without insecure=1 must be refused, got {other:?}"),
    }
    let e = common::start(NixlConfig::from_url(&url("&insecure=1")).unwrap())
        .await
        .expect("insecure=1 starts");
    assert!(
        e.segment_name().starts_with("0.0.0.0:"),
        "{}",
        e.segment_name()
    );
    // Loopback needs nothing.
    let cfg = NixlConfig::builder()
        .library(lib)
        .host("localhost")
        .build()
        .unwrap();
    common::start(cfg).await.expect("localhost starts");
}

/// A `HELLO` of protocol version 1 (see `src/control.rs`).
fn hello() -> Vec<u8> {
    let mut b = vec![0u8; 4];
    b.push(0x01);
    b.extend_from_slice(b"FERRY-NIXL");
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes());
    let len = (b.len() - 4) as u32;
    b[..4].copy_from_slice(&len.to_le_bytes());
    b
}

/// Reads one frame; its kind.
async fn read_frame(s: &mut TcpStream) -> u8 {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.expect("frame length");
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).await.expect("frame body");
    body[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_control_connection_keeps_the_regions_it_could_use() {
    let target = match common::engine().await {
        Ok(e) => e,
        Err(e) => {
            skip_unavailable(
                "a_reset_control_connection_keeps_the_regions_it_could_use",
                &e,
            );
            return;
        }
    };
    let buf = HostBuffer::new(1 << 20).unwrap();
    target.register(region(&buf)).await.unwrap();
    // A peer takes the metadata (with it, any NIXL agent could now write
    // the region), then its connection is reset: it did not close it, so
    // nothing shows that it has no request into the region in flight.
    let mut peer = TcpStream::connect(target.segment_name()).await.unwrap();
    peer.write_all(&hello()).await.unwrap();
    assert_eq!(read_frame(&mut peer).await, 0x02, "STATE");
    peer.set_zero_linger().unwrap();
    drop(peer);
    let r = target.unregister(buf.addr()).await;
    assert!(
        matches!(r, Err(Error::RegionHeld { .. })),
        "unregister after a peer's control connection was reset must answer RegionHeld, \
         got {r:?}"
    );
    // Still registered: asked again, the same answer.
    let again = target.unregister(buf.addr()).await;
    assert!(matches!(again, Err(Error::RegionHeld { .. })), "{again:?}");
    drop(target);
    std::mem::forget(buf);
}

/// A relay for one connection to `upstream` that writes the bytes sent on
/// `inject` to the downstream side (towards the initiator) between the
/// upstream's bytes; end of stream is passed on both ways.
async fn injecting_relay(upstream: String) -> (String, tokio::sync::oneshot::Sender<Vec<u8>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("relay bind");
    let addr = l.local_addr().expect("relay addr").to_string();
    let (inject, on_inject) = tokio::sync::oneshot::channel::<Vec<u8>>();
    tokio::spawn(async move {
        let (down, _) = l.accept().await.expect("relay accept");
        let up = TcpStream::connect(&upstream).await.expect("relay connect");
        let (mut dr, mut dw) = down.into_split();
        let (mut ur, mut uw) = up.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut dr, &mut uw).await;
            let _ = uw.shutdown().await;
        });
        let mut buf = vec![0u8; 64 << 10];
        let mut on_inject = Some(on_inject);
        loop {
            tokio::select! {
                n = ur.read(&mut buf) => match n {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if dw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                },
                bytes = async { on_inject.as_mut().expect("armed").await }, if on_inject.is_some() => {
                    on_inject = None;
                    if let Ok(b) = bytes {
                        if dw.write_all(&b).await.is_err() {
                            break;
                        }
                    }
                }
            }
        }
        let _ = dw.shutdown().await;
    });
    (addr, inject)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_that_gives_up_a_working_connection_does_not_close_it_cleanly() {
    let target = match common::engine().await {
        Ok(e) => e,
        Err(e) => {
            skip_unavailable(
                "an_initiator_that_gives_up_a_working_connection_does_not_close_it_cleanly",
                &e,
            );
            return;
        }
    };
    let initiator = common::engine().await.expect("initiator");
    let buf = HostBuffer::new(1 << 20).unwrap();
    let src = HostBuffer::new(4096).unwrap();
    target.register(region(&buf)).await.unwrap();
    initiator.register(region(&src)).await.unwrap();
    let (via, inject) = injecting_relay(target.segment_name().to_owned()).await;
    let seg = initiator.open_segment(&via).await.unwrap();
    initiator
        .transfer(
            seg,
            ferry_core::TransferRequest::write(src.addr(), buf.addr(), 64),
        )
        .await
        .expect("a write through the relay");
    // A frame the initiator cannot take (a HELLO, target → initiator): it
    // gives the connection up, which still works.
    inject.send(hello()).expect("inject");
    let lost = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let r = initiator
                .transfer(
                    seg,
                    ferry_core::TransferRequest::write(src.addr(), buf.addr(), 64),
                )
                .await;
            if let Err(Error::PeerLost { .. }) = r {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(lost.is_ok(), "the initiator did not give the connection up");
    // The initiator goes away; its socket ends with end of stream, which
    // alone would read as "the peer closed it, nothing in flight". It
    // could not be asked about the region since it gave the connection
    // up, so the region must stay registered.
    drop(initiator);
    let r = target.unregister(buf.addr()).await;
    assert!(
        matches!(r, Err(Error::RegionHeld { .. })),
        "after an initiator gave up a working control connection, the target must keep the \
         region: got {r:?}"
    );
    drop(target);
    std::mem::forget(buf);
    std::mem::forget(src);
}
