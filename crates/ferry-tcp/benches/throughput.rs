//! Throughput and latency of the TCP backend against raw baselines measured
//! in the same run: `memcpy`, plain Tokio TCP streaming of the same bytes
//! over loopback with one and two streams, and a raw 4 KiB request/ack
//! ping-pong.
//!
//! Run: `cargo bench -p ferry-tcp --bench throughput` (add
//! `-- --total-mib 256` for a shorter run; `--quick` = 256 MiB per size and
//! fewer small-transfer rounds). It prints one table with ratios; nothing
//! here asserts anything.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{HostBuffer, Location, SegmentId, TransferEngine, TransferRequest};
use ferry_tcp::{TcpConfig, TcpEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

struct Opts {
    total: usize,
    small_secs: f64,
    latency_samples: usize,
    connections: Vec<usize>,
    /// Extra `tcp://` URL parameters for both engines.
    params: String,
    /// Run only this section (`blocks`, `small`, `latency`).
    only: Option<String>,
    /// Repetitions of every measurement; the median is printed.
    reps: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().collect();
    let mut o = Opts {
        total: 1024 * MIB,
        small_secs: 2.0,
        latency_samples: 20_000,
        connections: vec![1, 2],
        params: String::new(),
        only: None,
        reps: 3,
    };
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--quick" => {
                o.total = 256 * MIB;
                o.small_secs = 0.5;
                o.latency_samples = 5_000;
            }
            "--total-mib" if i + 1 < args.len() => {
                o.total = args[i + 1].parse::<usize>().unwrap_or(1024) * MIB;
                i += 1;
            }
            "--connections" if i + 1 < args.len() => {
                o.connections = args[i + 1]
                    .split(',')
                    .filter_map(|s| s.parse().ok())
                    .collect();
                i += 1;
            }
            "--reps" if i + 1 < args.len() => {
                o.reps = args[i + 1].parse::<usize>().unwrap_or(3).max(1);
                i += 1;
            }
            "--only" if i + 1 < args.len() => {
                o.only = Some(args[i + 1].clone());
                i += 1;
            }
            "--params" if i + 1 < args.len() => {
                o.params = args[i + 1].clone();
                i += 1;
            }
            _ => {} // cargo bench passes --bench
        }
        i += 1;
    }
    o
}

/// utime + stime of this process in clock ticks (1/100 s), from procfs.
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // Fields 14 and 15 of stat; `after` starts at field 3.
    get(11) + get(12)
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// `memcpy` of `size` blocks between two 64 MiB buffers, block after block.
fn memcpy(size: usize, total: usize) -> f64 {
    let span = (64 * MIB).max(size);
    let src = vec![0x5au8; span];
    // Touched before timing (no page faults in the measurement).
    let mut dst = vec![1u8; span];
    let n = (total / size).max(1);
    let t = Instant::now();
    for i in 0..n {
        let off = (i * size) % span;
        dst[off..off + size].copy_from_slice(&src[off..off + size]);
        std::hint::black_box(&mut dst);
    }
    gbps(n * size, t.elapsed())
}

/// Plain Tokio TCP: `streams` connections each stream `total/streams` bytes
/// in `size` writes. Like the backend, the sender sends from and the
/// receiver stores into a 64 MiB buffer, block after block (the same bytes
/// and the same memory footprint).
async fn raw_tcp(size: usize, total: usize, streams: usize) -> f64 {
    let span = (64 * MIB).max(size);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let per = (total / streams / size).max(1) * size;
    let recv = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..streams {
            let (mut s, _) = listener.accept().await.expect("accept");
            tasks.push(tokio::spawn(async move {
                // Touched before timing, like the backend's registered memory.
                let mut buf = vec![1u8; span];
                let mut got = 0;
                while got < per {
                    let off = got % span;
                    s.read_exact(&mut buf[off..off + size]).await.expect("read");
                    got += size;
                }
                s.write_all(&[1]).await.expect("ack");
            }));
        }
        for t in tasks {
            t.await.expect("join");
        }
    });
    let mut senders = Vec::new();
    for _ in 0..streams {
        let s = TcpStream::connect(addr).await.expect("connect");
        s.set_nodelay(true).ok();
        senders.push(s);
    }
    let t = Instant::now();
    let mut tasks = Vec::new();
    for mut s in senders {
        tasks.push(tokio::spawn(async move {
            let buf = vec![0x5au8; span];
            let mut sent = 0;
            while sent < per {
                let off = sent % span;
                s.write_all(&buf[off..off + size]).await.expect("write");
                sent += size;
            }
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack).await.expect("ack");
        }));
    }
    for t in tasks {
        t.await.expect("join");
    }
    let d = t.elapsed();
    recv.await.expect("join");
    gbps(per * streams, d)
}

/// Raw 4 KiB request / 8-byte ack ping-pong with `inflight` requests in
/// flight: requests per second.
async fn raw_pingpong(inflight: usize, secs: f64) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.expect("accept");
        s.set_nodelay(true).ok();
        let (mut r, mut w) = s.into_split();
        let mut buf = vec![0u8; 4 * KIB];
        while r.read_exact(&mut buf).await.is_ok() {
            if w.write_all(&[0u8; 8]).await.is_err() {
                break;
            }
        }
    });
    let s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).ok();
    let (mut r, mut w) = s.into_split();
    let buf = vec![0x5au8; 4 * KIB * inflight];
    let mut acks = vec![0u8; 8 * inflight];
    let t = Instant::now();
    let mut n = 0usize;
    while t.elapsed().as_secs_f64() < secs {
        w.write_all(&buf).await.expect("write");
        r.read_exact(&mut acks).await.expect("acks");
        n += inflight;
    }
    n as f64 / t.elapsed().as_secs_f64()
}

struct Pair {
    a: Arc<TcpEngine>,
    _b: Arc<TcpEngine>,
    seg: SegmentId,
    local: HostBuffer,
    remote: HostBuffer,
}

async fn pair(connections: usize, params: &str, buf: usize) -> Pair {
    let mut url = format!("tcp://127.0.0.1:0?connections={connections}");
    if !params.is_empty() {
        url.push('&');
        url.push_str(params);
    }
    // The socket path unless --params chooses (same_host=auto measures the
    // cross-memory path; `ferry bench --same-host` compares both).
    if !params.contains("same_host=") {
        url.push_str("&same_host=off");
    }
    let cfg = TcpConfig::from_url(&url).expect("valid --params");
    let a = Arc::new(TcpEngine::start(cfg.clone()).await.expect("start a"));
    let b = Arc::new(TcpEngine::start(cfg).await.expect("start b"));
    let local = HostBuffer::new(buf).expect("alloc");
    let remote = HostBuffer::new(buf).expect("alloc");
    local.fill(0x5a);
    remote.fill(1);
    // SAFETY: the buffers live until the end of the benchmark, after the engines.
    a.register(unsafe { local.region(Location::cpu(0)) })
        .await
        .expect("register");
    // SAFETY: the buffers live until the end of the benchmark, after the engines.
    b.register(unsafe { remote.region(Location::cpu(0)) })
        .await
        .expect("register");
    let seg = a.open_segment(b.segment_name()).await.expect("open");
    Pair {
        a,
        _b: b,
        seg,
        local,
        remote,
    }
}

/// Backend throughput: writes of `size` blocks, `total` bytes, in batches
/// of 64 MiB (at least one block).
async fn backend_blocks(p: &Pair, size: usize, total: usize) -> f64 {
    let window = (64 * MIB).max(size);
    let per_batch = window / size;
    let reqs: Vec<TransferRequest> = (0..per_batch)
        .map(|i| {
            TransferRequest::write(
                p.local.addr() + (i * size) as u64,
                p.remote.addr() + (i * size) as u64,
                size as u64,
            )
        })
        .collect();
    let batches = (total / window).max(1);
    // Warm up.
    p.a.batch_transfer(p.seg, &reqs, None)
        .await
        .expect("batch")
        .into_result()
        .expect("ok");
    let t = Instant::now();
    for _ in 0..batches {
        p.a.batch_transfer(p.seg, &reqs, None)
            .await
            .expect("batch")
            .into_result()
            .expect("ok");
    }
    gbps(batches * window, t.elapsed())
}

/// 4 KiB writes in batches of `batch`: transfers per second.
async fn backend_small(p: &Pair, batch: usize, secs: f64, read: bool) -> f64 {
    let reqs: Vec<TransferRequest> = (0..batch)
        .map(|i| {
            let (l, r) = (
                p.local.addr() + (i * 4 * KIB) as u64,
                p.remote.addr() + (i * 4 * KIB) as u64,
            );
            if read {
                TransferRequest::read(l, r, 4096)
            } else {
                TransferRequest::write(l, r, 4096)
            }
        })
        .collect();
    for _ in 0..50 {
        p.a.batch_transfer(p.seg, &reqs, None).await.expect("batch");
    }
    let t = Instant::now();
    let mut n = 0;
    while t.elapsed().as_secs_f64() < secs {
        if batch == 1 {
            p.a.transfer(p.seg, reqs[0]).await.expect("transfer");
        } else {
            p.a.batch_transfer(p.seg, &reqs, None)
                .await
                .expect("batch")
                .into_result()
                .expect("ok");
        }
        n += batch;
    }
    n as f64 / t.elapsed().as_secs_f64()
}

async fn backend_latency(p: &Pair, samples: usize) -> (Duration, Duration, Duration) {
    let req = TransferRequest::write(p.local.addr(), p.remote.addr(), 4096);
    for _ in 0..1000 {
        p.a.transfer(p.seg, req).await.expect("transfer");
    }
    let mut lat = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        p.a.transfer(p.seg, req).await.expect("transfer");
        lat.push(t.elapsed());
    }
    lat.sort();
    let q = |f: f64| lat[((lat.len() as f64 * f) as usize).min(lat.len() - 1)];
    (q(0.5), q(0.99), q(0.999))
}

fn main() {
    let o = opts();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "ferry ferry-tcp benchmark — {} cores, {} MiB per block size, loopback, one process, \
         median of {} interleaved runs",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        o.total / MIB,
        o.reps
    );
    if !o.params.is_empty() {
        println!("engine URL parameters: {}", o.params);
    }
    // The measurements run in a task on the runtime's workers, as a server's
    // code would (not on the thread blocked in `block_on`).
    rt.block_on(async { tokio::spawn(run(o)).await.expect("bench task") });
}

async fn run(o: Opts) {
    let want = |s: &str| o.only.as_deref().is_none_or(|x| x == s);
    let mut pairs = Vec::new();
    for &c in &o.connections {
        pairs.push(pair(c, &o.params, 64 * MIB).await);
    }
    if want("blocks") {
        let sizes = [64 * KIB, MIB, 16 * MIB];
        println!("\n== large blocks (GB/s; ratio = backend / best of raw 1 and 2 streams) ==");
        println!(
            "{:>8} {:>8} {:>8} {:>8} {}",
            "block",
            "memcpy",
            "raw x1",
            "raw x2",
            o.connections
                .iter()
                .map(|c| format!("{:>9} {:>6}", format!("tcp c={c}"), "ratio"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        for &size in &sizes {
            let (mut m, mut r1, mut r2) = (Vec::new(), Vec::new(), Vec::new());
            let mut tcp = vec![Vec::new(); pairs.len()];
            // Interleaved repetitions, so that load from elsewhere hits
            // every column alike.
            for _ in 0..o.reps {
                m.push(memcpy(size, o.total.min(4096 * MIB)));
                r1.push(raw_tcp(size, o.total, 1).await);
                r2.push(raw_tcp(size, o.total, 2).await);
                for (k, p) in pairs.iter().enumerate() {
                    tcp[k].push(backend_blocks(p, size, o.total).await);
                }
            }
            let (m, r1, r2) = (median(m), median(r1), median(r2));
            let best = r1.max(r2);
            let mut cols = Vec::new();
            for t in tcp {
                let g = median(t);
                cols.push(format!("{g:>9.2} {:>5.0}%", 100.0 * g / best));
            }
            println!(
                "{:>8} {m:>8.2} {r1:>8.2} {r2:>8.2} {}",
                if size >= MIB {
                    format!("{}MiB", size / MIB)
                } else {
                    format!("{}KiB", size / KIB)
                },
                cols.join(" ")
            );
        }
    }
    if want("small") {
        println!("\n== 4 KiB transfers (writes unless noted; transfers/s) ==");
        let (mut raw1, mut raw256) = (Vec::new(), Vec::new());
        let mut tcp = vec![[const { Vec::new() }; 4]; pairs.len()];
        for _ in 0..o.reps {
            raw1.push(raw_pingpong(1, o.small_secs).await);
            raw256.push(raw_pingpong(256, o.small_secs).await);
            for (k, p) in pairs.iter().enumerate() {
                for (j, batch) in [1, 32, 256].into_iter().enumerate() {
                    tcp[k][j].push(backend_small(p, batch, o.small_secs, false).await);
                }
                tcp[k][3].push(backend_small(p, 256, o.small_secs, true).await);
            }
        }
        let (raw1, raw256) = (median(raw1), median(raw256));
        println!(
            "raw ping-pong: {:>10.0}/s with 1 in flight, {:>10.0}/s with 256 in flight",
            raw1, raw256
        );
        for (i, p) in pairs.iter().enumerate() {
            let c = o.connections[i];
            let _ = p;
            for (j, batch) in [1, 32, 256].into_iter().enumerate() {
                let r = median(std::mem::take(&mut tcp[i][j]));
                let base = if batch == 1 { raw1 } else { raw256 };
                println!(
                    "tcp c={c} batch {batch:>3}: {r:>10.0}/s  ({:>4.0}% of raw ping-pong {})",
                    100.0 * r / base,
                    if batch == 1 { "x1" } else { "x256" }
                );
            }
            let r = median(std::mem::take(&mut tcp[i][3]));
            println!("tcp c={c} batch 256 (reads): {r:>10.0}/s");
        }
    }
    if want("latency") {
        println!("\n== single 4 KiB write latency ==");
        for (i, p) in pairs.iter().enumerate() {
            let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..o.reps {
                let (p50, p99, p999) = backend_latency(p, o.latency_samples).await;
                a.push(p50.as_secs_f64());
                b.push(p99.as_secs_f64());
                c.push(p999.as_secs_f64());
            }
            let (p50, p99, p999) = (
                Duration::from_secs_f64(median(a)),
                Duration::from_secs_f64(median(b)),
                Duration::from_secs_f64(median(c)),
            );
            println!(
                "tcp c={}: p50 {:>6.1} us  p99 {:>6.1} us  p99.9 {:>6.1} us  ({} samples)",
                o.connections[i],
                p50.as_secs_f64() * 1e6,
                p99.as_secs_f64() * 1e6,
                p999.as_secs_f64() * 1e6,
                o.latency_samples
            );
        }
    }
    if want("latency") {
        // Idle cost: the engines stay connected; nothing may poll.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = cpu_ticks();
        let t = Instant::now();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let used = cpu_ticks().saturating_sub(before);
        println!(
            "idle: {} engines connected, process CPU {:.1} ms over {:.1} s",
            pairs.len() * 2,
            used as f64 * 10.0,
            t.elapsed().as_secs_f64()
        );
    }
    println!("\ntargets (issue 5): blocks >= 80% of best raw; batch 256 >= 250k/s; p50 <= 45 us, p99 <= 110 us");
}
