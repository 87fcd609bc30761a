//! Bad input on Ferry's metadata exchange, from either side, is a typed
//! error for that connection, never a panic, and leaves the engine serving.

mod common;

use ferry_core::DynTransferEngine;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use ferry_core::conformance::skip_unavailable;
use ferry_core::{Error, RegisteredBuffer, TransferEngine, TransferRequest};

fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut b = ((payload.len() + 1) as u32).to_le_bytes().to_vec();
    b.push(kind);
    b.extend_from_slice(payload);
    b
}

/// What the engine answers to `bytes` before it closes (or 2 s pass).
fn answer(segment: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(segment).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    s.write_all(bytes).expect("write");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

/// A listener that answers every connection with `reply` (after reading
/// whatever comes first), on its own thread.
fn fake_peer(reply: Vec<u8>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { break };
            let mut buf = [0u8; 64];
            let _ = s.read(&mut buf);
            let _ = s.write_all(&reply);
        }
    });
    addr
}

#[test]
fn hostile_peers_get_errors_and_the_engine_keeps_serving() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let (a, b) = match (common::engine().await, common::engine().await) {
            (Ok(a), Ok(b)) => (
                a as Arc<dyn DynTransferEngine>,
                b as Arc<dyn DynTransferEngine>,
            ),
            (Err(e), _) | (_, Err(e)) => {
                skip_unavailable("hostile_peers_get_errors_and_the_engine_keeps_serving", &e);
                return;
            }
        };
        let seg_b = b.segment_name().to_owned();
        let blocking = |bytes: Vec<u8>| {
            let s = seg_b.clone();
            tokio::task::spawn_blocking(move || answer(&s, &bytes))
        };
        // Garbage, an unknown frame kind, a huge length, a bad magic: the
        // connection closes without an answer.
        for junk in [
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            frame(0x42, b""),
            u32::MAX.to_le_bytes().to_vec(),
            frame(0x01, b"NOT-FERRY!\x01\x00\x01\x00"),
        ] {
            let got = blocking(junk.clone()).await.expect("task");
            assert!(got.is_empty(), "answered {got:?} to {junk:?}");
        }
        // No common version: REFUSE naming both ranges.
        let mut hello = b"FERRY-NIXL".to_vec();
        hello.extend_from_slice(&7u16.to_le_bytes());
        hello.extend_from_slice(&9u16.to_le_bytes());
        let got = blocking(frame(0x01, &hello)).await.expect("task");
        assert!(
            got.len() > 5 && got[4] == 0x06,
            "expected REFUSE, got {got:?}"
        );
        let text = String::from_utf8_lossy(&got[5..]);
        assert!(text.contains("7..=9") && text.contains("1..=1"), "{text}");

        // Fake targets: open_segment fails with a typed error.
        let mut state = vec![1u8, 0]; // version 1
        state.extend_from_slice(&5u32.to_le_bytes());
        state.extend_from_slice(b"other");
        state.extend_from_slice(&4u32.to_le_bytes());
        state.extend_from_slice(b"junk"); // not NIXL metadata
        state.extend_from_slice(&0u32.to_le_bytes());
        for (reply, what) in [
            (b"SSH-2.0-OpenSSH\r\n".to_vec(), "not Ferry"),
            (Vec::new(), "closes at once"),
            (frame(0x02, &state[..7]), "truncated STATE"),
            (frame(0x02, &state), "STATE with bad NIXL metadata"),
            (frame(0x04, &[0u8; 16]), "REVOKE before STATE"),
        ] {
            let name = fake_peer(reply);
            match a.open_segment(&name).await {
                Err(
                    Error::SegmentUnavailable { .. }
                    | Error::Protocol { .. }
                    | Error::Backend { .. }
                    | Error::InvalidArgument(_),
                ) => {}
                other => panic!("{what}: expected a typed refusal, got {other:?}"),
            }
        }
        // A segment name that is not host:port.
        assert!(matches!(
            a.open_segment("no-such-host-name.invalid:x").await,
            Err(Error::SegmentUnavailable { .. })
        ));

        // The engine still serves real peers.
        let src = RegisteredBuffer::new(Arc::clone(&a), 4096)
            .await
            .expect("src");
        let dst = RegisteredBuffer::new(Arc::clone(&b), 4096)
            .await
            .expect("dst");
        src.memory().fill(0x33);
        let seg = a.open_segment(b.segment_name()).await.expect("open");
        a.transfer(seg, TransferRequest::write(src.addr(), dst.addr(), 4096))
            .await
            .expect("write");
        assert!(dst.memory().to_vec().iter().all(|&x| x == 0x33));
        a.close_segment(seg).await.expect("close");
        src.release().await.expect("release");
        dst.release().await.expect("release");
    });
}

/// A peer that opened this engine's segment and then neither answers a
/// `REVOKE` nor closes its connection (a peer stopped, or one whose NIXL
/// request never finishes) cannot make `unregister` wait forever: it
/// fails with `RegionHeld` at the revocation limit (the region stays
/// registered: its memory must not be freed while that peer may still
/// write it), and succeeds once the peer's connection is gone.
#[test]
fn a_silent_peer_holds_a_region_and_unregister_says_so() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        const LIMIT: Duration = Duration::from_millis(400);
        let cfg = match common::config() {
            Ok(c) => c,
            Err(e) => {
                skip_unavailable("a_silent_peer_holds_a_region_and_unregister_says_so", &e);
                return;
            }
        };
        let mut cfg = cfg;
        cfg.timeout = LIMIT;
        cfg.timeout_ns_per_byte = 0;
        let b = common::start(cfg).await.expect("engine");
        let mem = ferry_core::HostBuffer::new(1 << 16).expect("memory");
        // SAFETY: `mem` outlives its registration (it is dropped at the
        // end, after the region was unregistered) and no Rust reference
        // into it is held while a peer could write it.
        let region = unsafe {
            ferry_core::MemoryRegion::from_raw_parts(
                mem.as_ptr(),
                mem.len(),
                ferry_core::Location::cpu(0),
            )
        };
        b.register(region).await.expect("register");

        // The silent peer: HELLO, reads the STATE, then nothing.
        let seg = b.segment_name().to_owned();
        let mut peer = tokio::task::spawn_blocking(move || {
            let mut s = TcpStream::connect(&seg).expect("connect");
            let mut hello = b"FERRY-NIXL".to_vec();
            hello.extend_from_slice(&1u16.to_le_bytes());
            hello.extend_from_slice(&1u16.to_le_bytes());
            s.write_all(&frame(0x01, &hello)).expect("hello");
            let mut len = [0u8; 4];
            s.read_exact(&mut len).expect("state length");
            let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
            s.read_exact(&mut body).expect("state");
            assert_eq!(body[0], 0x02, "expected STATE");
            s
        })
        .await
        .expect("peer");

        let start = std::time::Instant::now();
        let held = tokio::time::timeout(LIMIT * 20, b.unregister(mem.addr()))
            .await
            .expect("unregister must not wait for a silent peer past its limit");
        match &held {
            Err(Error::RegionHeld { addr, reason }) => {
                assert_eq!(*addr, mem.addr());
                assert!(reason.contains("must not be freed"), "{reason}");
            }
            other => panic!("expected RegionHeld from a silent peer, got {other:?}"),
        }
        assert!(start.elapsed() >= LIMIT, "gave up before the limit");
        // The peer was sent a REVOKE it never answered.
        peer.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let mut head = [0u8; 5];
        peer.read_exact(&mut head).expect("a REVOKE");
        assert_eq!(head[4], 0x04, "expected REVOKE, got {head:?}");
        // Still registered: the range cannot be registered again.
        // SAFETY: as above; refused, so never used.
        let again = unsafe {
            ferry_core::MemoryRegion::from_raw_parts(
                mem.as_ptr(),
                mem.len(),
                ferry_core::Location::cpu(0),
            )
        };
        assert!(
            matches!(b.register(again).await, Err(Error::RegionOverlap { .. })),
            "a held region must stay registered"
        );
        // The peer closes its connection (its write side first, as Ferry's
        // initiator does once NIXL released its last request): nothing of
        // it can be in flight any more. (A reset instead would leave the
        // region held for good: tests/control_loss.rs.)
        peer.shutdown(std::net::Shutdown::Write).expect("shutdown");
        drop(peer);
        tokio::time::timeout(LIMIT * 20, b.unregister(mem.addr()))
            .await
            .expect("unregister after the peer left")
            .expect("unregister after the peer left");
        drop(mem);
    });
}
