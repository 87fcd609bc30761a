//! The record layer on real sockets: against itself (any cutting of the
//! stream into writes and reads, key updates both ways), against a peer
//! running plain rustls (the wire did not change), and under a forged byte.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::Secret;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{TlsContext, TlsMode};
use crate::io::{write_all, Bytes, FrameReader, Pace};
use crate::stream::Stream;

fn ctx() -> Arc<TlsContext> {
    let cfg = crate::TcpConfig {
        secret: Some(Secret::new("record-layer-test")),
        tls: TlsMode::Require,
        ..Default::default()
    };
    TlsContext::new(&cfg).unwrap().unwrap()
}

const T: Duration = Duration::from_secs(20);

/// A TLS pair over loopback: (initiator, target), both our record layer.
async fn pair() -> (Stream, Stream) {
    let c = ctx();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let c2 = Arc::clone(&c);
    let server = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let mut s = Stream::Tcp(s);
        c2.accept(&mut s, "initiator", T).await.unwrap();
        s
    });
    let mut a = Stream::Tcp(TcpStream::connect(&addr).await.unwrap());
    c.connect(&mut a, &addr, T).await.unwrap();
    (a, server.await.unwrap())
}

/// A reproducible byte pattern.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Cuts `len` into pieces drawn from `sizes` (cycled with a seed).
fn cuts(len: usize, sizes: &[usize], seed: u64) -> Vec<usize> {
    let r = pattern(len / 64 + 64, seed);
    let mut out = Vec::new();
    let (mut left, mut i) = (len, 0);
    while left > 0 {
        let s = sizes[usize::from(r[i % r.len()]) % sizes.len()]
            .min(left)
            .max(1);
        out.push(s);
        left -= s;
        i += 1;
    }
    out
}

const SIZES: &[usize] = &[
    1,
    5,
    24,
    31,
    4096,
    8 << 10,
    (16 << 10) + 7,
    64 << 10,
    100_000,
    1 << 20,
];

/// Writes `data` as writes of several ranges each (cut by `seed`).
async fn send(s: &Stream, data: &[u8], seed: u64) {
    let pieces = cuts(data.len(), SIZES, seed);
    let mut at = 0;
    for group in pieces.chunks(3) {
        let mut bufs = Vec::new();
        for &p in group {
            bufs.push(Bytes::from_ref(&data[at..at + p]));
            at += p;
        }
        write_all(s, &bufs, Pace::stall_only(T)).await.unwrap();
    }
}

/// Reads `len` bytes through a frame reader into destinations cut by
/// `seed` (several per read, like a vectored frame).
async fn recv(s: &Stream, len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let pieces = cuts(len, SIZES, seed);
    let mut rd = FrameReader::new(Duration::from_micros(50), Pace::stall_only(T));
    let mut rest = &mut out[..];
    for group in pieces.chunks(2) {
        let mut segs = Vec::new();
        for &p in group {
            let (a, b) = std::mem::take(&mut rest).split_at_mut(p);
            segs.push(Bytes::from_mut(a));
            rest = b;
        }
        rd.read_v(s, &segs, false).await.unwrap();
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_cutting_of_writes_and_reads_arrives_whole_both_ways() {
    let (a, b) = pair().await;
    let (a, b) = (Arc::new(a), Arc::new(b));
    for seed in 1..=4u64 {
        let len = 3_000_000 + seed as usize * 7919;
        let (up, down) = (pattern(len, seed), pattern(len, seed + 100));
        let (a2, b2, up2, down2) = (a.clone(), b.clone(), up.clone(), down.clone());
        let w1 = tokio::spawn(async move { send(&a2, &up2, seed).await });
        let w2 = tokio::spawn(async move { send(&b2, &down2, seed + 7).await });
        let got_up = recv(&b, len, seed + 13).await;
        let got_down = recv(&a, len, seed + 21).await;
        w1.await.unwrap();
        w2.await.unwrap();
        assert!(got_up == up, "seed {seed}: initiator → target differs");
        assert!(got_down == down, "seed {seed}: target → initiator differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_transfer_crosses_several_key_updates_both_ways() {
    let (a, b) = pair().await;
    a.tls().unwrap().set_key_update_after(40);
    b.tls().unwrap().set_key_update_after(40);
    let (a, b) = (Arc::new(a), Arc::new(b));
    let len = 4 << 20; // 256+ records each way: 6+ key updates
    let (up, down) = (pattern(len, 5), pattern(len, 6));
    let (a2, b2, up2, down2) = (a.clone(), b.clone(), up.clone(), down.clone());
    let w1 = tokio::spawn(async move { send(&a2, &up2, 3).await });
    let w2 = tokio::spawn(async move { send(&b2, &down2, 4).await });
    assert!(recv(&b, len, 8).await == up);
    assert!(recv(&a, len, 9).await == down);
    w1.await.unwrap();
    w2.await.unwrap();
    let (ua, ub) = (
        a.tls().unwrap().key_updates(),
        b.tls().unwrap().key_updates(),
    );
    eprintln!("key updates (sent, received): initiator {ua:?}, target {ub:?}");
    assert!(ua.0 >= 5 && ua.1 >= 5, "{ua:?}");
    assert!(ub.0 >= 5 && ub.1 >= 5, "{ub:?}");
}

/// A rustls peer (tokio-rustls, as an older Ferry has it) on one side.
async fn with_rustls_peer(ours_is_client: bool) {
    let c = ctx();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let len = 2_000_000;
    let (up, down) = (pattern(len, 31), pattern(len, 32));
    let down2 = down.clone();
    let c2 = Arc::clone(&c);
    let (l_plain, l_ours) = if ours_is_client {
        (Some(l), None)
    } else {
        (None, Some(l))
    };
    let addr2 = addr.clone();
    // The rustls side echoes nothing: it reads `up`, sends `down`, asks
    // for a key update in the middle (ours must answer), and reads the
    // rest.
    let plain = tokio::spawn(async move {
        let tcp = match l_plain {
            Some(l) => l.accept().await.unwrap().0,
            None => TcpStream::connect(&addr2).await.unwrap(),
        };
        let mut got = vec![0u8; len];
        if ours_is_client {
            // An older Ferry target: rustls's defaults, session tickets on.
            let mut cfg = (*c2.server).clone();
            cfg.send_tls13_tickets = 2;
            let mut s = tokio_rustls::TlsAcceptor::from(Arc::new(cfg))
                .accept(tcp)
                .await
                .unwrap();
            s.write_all(&down2[..len / 2]).await.unwrap();
            s.get_mut().1.refresh_traffic_keys().unwrap();
            s.write_all(&down2[len / 2..]).await.unwrap();
            s.flush().await.unwrap();
            s.read_exact(&mut got).await.unwrap();
            s.shutdown().await.unwrap();
        } else {
            let name = rustls::pki_types::ServerName::try_from("ferry-tcp").unwrap();
            let mut s = tokio_rustls::TlsConnector::from(Arc::clone(&c2.client))
                .connect(name, tcp)
                .await
                .unwrap();
            s.write_all(&down2[..len / 2]).await.unwrap();
            s.get_mut().1.refresh_traffic_keys().unwrap();
            s.write_all(&down2[len / 2..]).await.unwrap();
            s.flush().await.unwrap();
            s.read_exact(&mut got).await.unwrap();
            s.shutdown().await.unwrap();
        }
        got
    });
    let mut ours = if ours_is_client {
        let mut s = Stream::Tcp(TcpStream::connect(&addr).await.unwrap());
        c.connect(&mut s, &addr, T).await.unwrap();
        s
    } else {
        let (s, _) = l_ours.unwrap().accept().await.unwrap();
        let mut s = Stream::Tcp(s);
        c.accept(&mut s, "rustls", T).await.unwrap();
        s
    };
    ours.tls().unwrap().set_key_update_after(30);
    assert!(recv(&ours, len, 41).await == down, "rustls → ours differs");
    send(&ours, &up, 42).await;
    assert!(plain.await.unwrap() == up, "ours → rustls differs");
    // close_notify from rustls reads as the end of the stream.
    let mut one = [0u8; 1];
    let n = crate::io::read_some(&ours, &mut one, Some(T))
        .await
        .unwrap();
    assert_eq!(n, 0);
    let (sent, received) = ours.tls().unwrap().key_updates();
    eprintln!("ours (client: {ours_is_client}): key updates sent {sent}, received {received}");
    assert!(sent >= 3, "{sent}");
    assert!(received >= 1, "{received}");
    let _ = &mut ours;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rustls_target_and_our_initiator_exchange_data_both_ways() {
    with_rustls_peer(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rustls_initiator_and_our_target_exchange_data_both_ways() {
    with_rustls_peer(false).await;
}

/// A forged byte in the stream: the read fails with `BadRecordMac` (or a
/// bad length, in a header), no
/// plaintext of the record is delivered, and the connection stays failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_ciphertext_byte_fails_the_connection_without_plaintext() {
    for flip_at in [3usize, 700, 40_000, 70_000] {
        let c = ctx();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let pl = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let paddr = pl.local_addr().unwrap().to_string();
        // The proxy flips one byte of the initiator's stream once armed.
        let armed = Arc::new(AtomicUsize::new(usize::MAX));
        let armed2 = armed.clone();
        tokio::spawn(async move {
            let (mut from, _) = pl.accept().await.unwrap();
            let mut to = TcpStream::connect(&addr).await.unwrap();
            let (mut fr, mut fw) = from.split();
            let (mut tr, mut tw) = to.split();
            let up = async {
                let mut buf = vec![0u8; 65536];
                let mut seen = 0usize;
                let mut base = None;
                loop {
                    let n = fr.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    if base.is_none() && armed2.load(Ordering::SeqCst) != usize::MAX {
                        base = Some(seen);
                    }
                    if let Some(b) = base {
                        let at = b + flip_at;
                        if (seen..seen + n).contains(&at) {
                            buf[at - seen] ^= 0x20;
                        }
                    }
                    seen += n;
                    if tw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            };
            let down = tokio::io::copy(&mut tr, &mut fw);
            let _ = tokio::join!(up, down);
        });
        let c2 = Arc::clone(&c);
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut s = Stream::Tcp(s);
            c2.accept(&mut s, "initiator", T).await.unwrap();
            s
        });
        let mut a = Stream::Tcp(TcpStream::connect(&paddr).await.unwrap());
        c.connect(&mut a, &paddr, T).await.unwrap();
        let b = server.await.unwrap();
        armed.store(0, Ordering::SeqCst);
        let data = pattern(100_000, 9);
        let a = Arc::new(a);
        let a2 = a.clone();
        let d2 = data.clone();
        let w = tokio::spawn(async move {
            let _ = write_all(&a2, &[Bytes::from_ref(&d2)], Pace::stall_only(T)).await;
        });
        let mut dst = vec![0u8; 100_000];
        let mut rd = FrameReader::new(Duration::ZERO, Pace::stall_only(T));
        let e = rd
            .read_v(&b, &[Bytes::from_mut(&mut dst)], false)
            .await
            .unwrap_err();
        let inner = e
            .get_ref()
            .and_then(|i| i.downcast_ref::<ferry_tcp_proto::record::RecordError>());
        use ferry_tcp_proto::record::RecordError;
        // Byte 3 is in the first record's length field (records are 16406
        // bytes on the wire: the other offsets fall in bodies).
        let want_header = flip_at == 3;
        assert!(
            match inner {
                Some(RecordError::BadLength(_)) => want_header,
                Some(RecordError::BadRecordMac) => !want_header,
                _ => false,
            },
            "flip at {flip_at}: {e}"
        );
        // Records before the forged one were genuine; none after it may
        // have been delivered: the record holding the flipped byte starts
        // at most `flip_at` bytes into the stream, so at most that many
        // plaintext bytes can match.
        let good = dst.iter().zip(&data).take_while(|(x, y)| x == y).count();
        assert!(good <= flip_at, "flip at {flip_at}: {good} bytes delivered");
        let mut one = [0u8; 1];
        assert!(crate::io::read_some(&b, &mut one, Some(T)).await.is_err());
        w.abort();
    }
}

/// Not a test of behaviour: GB/s and CPU of one direction over loopback,
/// clear and TLS (`cargo test --release -p ferry-tcp --lib tls_lab --
/// --ignored --nocapture`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn tls_lab() {
    let block = 1 << 20;
    let total = 2usize << 30;
    for tls in [false, true, false, true] {
        let (a, b) = if tls {
            pair().await
        } else {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
            (Stream::Tcp(a), Stream::Tcp(l.accept().await.unwrap().0))
        };
        let src = pattern(16 * block, 1);
        let cpu0 = cpu();
        let t = Instant::now();
        let w = tokio::spawn(async move {
            let mut sent = 0;
            while sent < total {
                let bufs: Vec<Bytes<'_>> = src.chunks(block).map(Bytes::from_ref).collect();
                write_all(&a, &bufs, Pace::stall_only(T)).await.unwrap();
                sent += src.len();
            }
        });
        let mut dst = vec![0u8; 16 * block];
        let mut rd = FrameReader::new(Duration::from_micros(50), Pace::stall_only(T));
        let mut got = 0;
        while got < total {
            let segs: Vec<Bytes<'_>> = dst.chunks_mut(block).map(Bytes::from_mut).collect();
            rd.read_v(&b, &segs, false).await.unwrap();
            got += dst.len();
        }
        w.await.unwrap();
        let s = t.elapsed().as_secs_f64();
        let c = cpu() - cpu0;
        eprintln!(
            "tls {tls}: {:.2} GB/s, {:.2} cpu-s/GB",
            total as f64 / s / 1e9,
            c / (total as f64 / 1e9)
        );
    }
}

fn cpu() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is valid for writes.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}
