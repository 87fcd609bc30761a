//! What the multi engine costs over verbs, and how long a failover to TCP
//! takes (issue 45, item 5), on a real verbs stack: soft-RoCE in the guest
//! of `scripts/verbs-tests.sh --bench`, which runs it as
//!
//! ```text
//! multi_verbs_bench verbs://rxe0 [ROUNDS]
//! ```
//!
//! Two pairs of engines in one process: a verbs-only pair
//! (`Engine::open(URL)`) and a multi pair (`Engine::open_multi(&[URL,
//! "tcp://127.0.0.1:0?same_host=off"])`, verbs chosen). Each round measures
//! both, one after the other (the order alternates between rounds):
//! 4 KiB × 1 (the p50 of 500 single writes, after 20 for warm-up) and
//! 1 MiB × 16 (MiB/s over 3 batches of 16 writes of 1 MiB, after one for
//! warm-up). The medians over ROUNDS (default 5) rounds are printed.
//!
//! Then, where the link may be taken down (`FERRY_TEST_BREAK_LINK=1`, as
//! root; see `tests/rxe_link`), ROUNDS times: a batch of 32 × 1 MiB over
//! the multi pair, the link under verbs taken down once its first block
//! has landed; the time from the link down (`ip link set … down`
//! returned) to the first byte served by the peer's TCP transport, and to
//! the batch's end. The link comes back, and after the back-off the next
//! sample starts over verbs again.
#[path = "../tests/rxe_link/mod.rs"]
mod rxe_link;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::multi::MultiEngine;
use ferry::{Engine, RegisteredBuffer, SegmentId, TransferEngine, TransferRequest};

const MIB: usize = 1 << 20;
const TCP: &str = "tcp://127.0.0.1:0?same_host=off";
const SMALL_ITER: usize = 500;
const BIG_REPS: usize = 3;

struct Pair {
    a: Arc<Engine>,
    b: Arc<Engine>,
    src: RegisteredBuffer<Engine>,
    dst: RegisteredBuffer<Engine>,
    seg: SegmentId,
}

async fn pair(url: &str, multi: bool, len: usize) -> ferry::Result<Pair> {
    let open = || async {
        let e = if multi {
            Engine::open_multi(&[url, TCP]).await?
        } else {
            Engine::open(url).await?
        };
        Ok::<_, ferry::Error>(Arc::new(e))
    };
    let (a, b) = (open().await?, open().await?);
    let src = RegisteredBuffer::new(a.clone(), len).await?;
    let dst = RegisteredBuffer::new(b.clone(), len).await?;
    let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
    src.memory().write(0, &bytes)?;
    let seg = a.open_segment(b.segment_name()).await?;
    if multi {
        let m = a.backend::<MultiEngine>().expect("a multi engine");
        let choice = m.choice(seg).expect("open");
        assert_eq!(choice.transport, "verbs", "{choice}");
    }
    Ok(Pair {
        a,
        b,
        src,
        dst,
        seg,
    })
}

/// p50 of single 4 KiB writes.
async fn small(p: &Pair) -> ferry::Result<Duration> {
    let req = TransferRequest::write(p.src.addr(), p.dst.addr(), 4096);
    for _ in 0..20 {
        p.a.transfer(p.seg, req).await?;
    }
    let mut t = Vec::with_capacity(SMALL_ITER);
    for _ in 0..SMALL_ITER {
        let s = Instant::now();
        p.a.transfer(p.seg, req).await?;
        t.push(s.elapsed());
    }
    t.sort();
    Ok(t[SMALL_ITER / 2])
}

/// MiB/s of batches of 16 writes of 1 MiB.
async fn big(p: &Pair) -> ferry::Result<f64> {
    let reqs: Vec<TransferRequest> = (0..16)
        .map(|i| {
            let at = (i * MIB) as u64;
            TransferRequest::write(p.src.addr() + at, p.dst.addr() + at, MIB as u64)
        })
        .collect();
    p.a.batch_transfer(p.seg, &reqs, None)
        .await?
        .into_result()?;
    let s = Instant::now();
    for _ in 0..BIG_REPS {
        p.a.batch_transfer(p.seg, &reqs, None)
            .await?
            .into_result()?;
    }
    Ok((16 * BIG_REPS) as f64 / s.elapsed().as_secs_f64())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spread(v: &mut [f64]) -> String {
    v.sort_by(f64::total_cmp);
    format!("{:.1} [{:.1}–{:.1}]", v[v.len() / 2], v[0], v[v.len() - 1])
}

fn spread3(v: &mut [f64]) -> String {
    v.sort_by(f64::total_cmp);
    format!("{:.3} [{:.3}–{:.3}]", v[v.len() / 2], v[0], v[v.len() - 1])
}

/// One failover sample on the multi pair, in ms: the link down (`ip`
/// returned) → the first byte over TCP; the same from `ip` started (the
/// link goes down somewhere in between); the link down → the batch done.
async fn failover(p: &Pair, link: &rxe_link::Link) -> ferry::Result<(f64, f64, f64)> {
    const N: usize = 32;
    let m = p.a.backend::<MultiEngine>().expect("multi");
    let tcp =
        p.b.backend::<MultiEngine>()
            .expect("multi")
            .transports()
            .nth(1)
            .expect("tcp")
            .1
            .inbound()
            .expect("TCP counts what it serves");
    assert_eq!(m.choice(p.seg).expect("open").transport, "verbs");
    p.dst.memory().fill(0);
    let reqs: Vec<TransferRequest> = (0..N)
        .map(|i| {
            let at = (i * MIB) as u64;
            TransferRequest::write(p.src.addr() + at, p.dst.addr() + at, MIB as u64)
        })
        .collect();
    let before = tcp.snapshot().served_bytes();
    let batch = tokio::spawn({
        let (a, seg) = (p.a.clone(), p.seg);
        async move { a.batch_transfer(seg, &reqs, None).await }
    });
    let mut b = [0u8];
    loop {
        p.dst.memory().read(0, &mut b)?;
        if b[0] != 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let issued = Instant::now();
    link.down().await;
    let t0 = Instant::now();
    while tcp.snapshot().served_bytes() == before {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let first = t0.elapsed();
    let first_from_issued = issued.elapsed();
    batch.await.expect("the batch task")?.into_result()?;
    let done = t0.elapsed();
    assert_eq!(m.choice(p.seg).expect("open").transport, "tcp");
    assert!(p.dst.memory().to_vec() == p.src.memory().to_vec()[..N * MIB]);
    link.up().await;
    // Wait out the back-off, then bring the segment back to verbs.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    p.a.transfer(
        p.seg,
        TransferRequest::write(p.src.addr(), p.dst.addr(), 4096),
    )
    .await?;
    assert_eq!(m.choice(p.seg).expect("open").transport, "verbs");
    Ok((
        first.as_secs_f64() * 1e3,
        first_from_issued.as_secs_f64() * 1e3,
        done.as_secs_f64() * 1e3,
    ))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ferry::Result<()> {
    // Flags are ignored (the guest passes `--test-threads=1` to every
    // binary).
    let mut args = std::env::args().skip(1).filter(|a| !a.starts_with('-'));
    let url = args
        .next()
        .or_else(|| std::env::var("FERRY_VERBS_URL").ok())
        .unwrap_or_else(|| "verbs://".to_owned());
    let rounds: usize = args
        .next()
        .map(|r| r.parse().expect("ROUNDS is a number"))
        .unwrap_or(5);
    let verbs = pair(&url, false, 16 * MIB).await?;
    let multi = pair(&url, true, 32 * MIB).await?;
    let (mut small_v, mut small_m, mut big_v, mut big_m) = (vec![], vec![], vec![], vec![]);
    for r in 0..rounds {
        let order = if r % 2 == 0 {
            [(&verbs, false), (&multi, true)]
        } else {
            [(&multi, true), (&verbs, false)]
        };
        for (p, is_multi) in order {
            let s = small(p).await?.as_secs_f64() * 1e6;
            let b = big(p).await?;
            let (sv, bv) = if is_multi {
                (&mut small_m, &mut big_m)
            } else {
                (&mut small_v, &mut big_v)
            };
            sv.push(s);
            bv.push(b);
        }
        println!(
            "round {}: 4 KiB p50 verbs {:.1} µs, multi {:.1} µs; 1 MiB × 16 verbs {:.1} MiB/s, multi {:.1} MiB/s",
            r + 1,
            small_v[r],
            small_m[r],
            big_v[r],
            big_m[r]
        );
    }
    println!("\n{url}, {rounds} rounds interleaved: median [min–max]");
    println!("| engine | 4 KiB × 1 p50 µs | 1 MiB × 16 MiB/s |");
    println!("|---|---|---|");
    println!(
        "| verbs only | {} | {} |",
        spread(&mut small_v.clone()),
        spread(&mut big_v.clone())
    );
    println!(
        "| multi (verbs, tcp), verbs chosen | {} | {} |",
        spread(&mut small_m.clone()),
        spread(&mut big_m.clone())
    );
    let mut small_r: Vec<f64> = small_m.iter().zip(&small_v).map(|(m, v)| m / v).collect();
    let mut big_r: Vec<f64> = big_m.iter().zip(&big_v).map(|(m, v)| m / v).collect();
    println!(
        "| multi / verbs only (ratio of the medians) | {:.3} | {:.3} |",
        median(&mut small_m) / median(&mut small_v),
        median(&mut big_m) / median(&mut big_v)
    );
    println!(
        "| multi / verbs only (median of the {rounds} rounds' ratios) | {} | {} |",
        spread3(&mut small_r),
        spread3(&mut big_r)
    );

    match rxe_link::Link::find(&url) {
        Err(why) => println!("\nfailover: not measured: {why}"),
        Ok(link) => {
            let (mut first, mut issued, mut done) = (vec![], vec![], vec![]);
            for _ in 0..rounds {
                let (f, i, d) = failover(&multi, &link).await?;
                println!(
                    "failover sample: first byte over TCP {f:.1} ms after the link went down \
                     ({i:.1} ms after `ip` started), batch done {d:.1} ms after"
                );
                first.push(f);
                issued.push(i);
                done.push(d);
            }
            println!(
                "\nfailover (32 × 1 MiB, link down once the first block landed over verbs), \
                 {rounds} samples, median [min–max]:"
            );
            println!(
                "link down (`ip` returned) → first byte over TCP: {} ms; from `ip` started: {} \
                 ms; link down → batch done: {} ms",
                spread(&mut first),
                spread(&mut issued),
                spread(&mut done)
            );
        }
    }
    verbs.src.release().await?;
    verbs.dst.release().await?;
    multi.src.release().await?;
    multi.dst.release().await?;
    Ok(())
}
