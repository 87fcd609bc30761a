//! How much of this use one etcd carries: a few hundred simulated engines
//! in one process publish, look each other up and watch each other against
//! one local etcd member (started here, as the tests start theirs, unless
//! `--endpoint HOST:PORT` names one).
//!
//! ```sh
//! cargo run --release -p ferry-discovery --features etcd,test-support \
//!     --example scale -- [--engines 300] [--lookups 20000] [--concurrency 64]
//! ```
//!
//! Prints a Markdown table: per phase, operations, wall time, rate, and the
//! latency percentiles of single operations (for watches: from the start of
//! the batch of changes to each event's arrival).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_discovery::test_support::Etcd;
use ferry_discovery::{Descriptor, EtcdDiscovery, ProtocolRange, SegmentEvent};
use tokio::task::JoinSet;

const PREFIX: &str = "/ferry-scale";
/// The TTL of the simulated engines: renewals run during every phase
/// (engines / (TTL / 3) per second).
const TTL: Duration = Duration::from_secs(10);

struct Args {
    engines: usize,
    lookups: usize,
    concurrency: usize,
    endpoint: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        engines: 300,
        lookups: 20_000,
        concurrency: 64,
        endpoint: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let count = |v: String| v.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--engines" => a.engines = count(value()?)?.max(2),
            "--lookups" => a.lookups = count(value()?)?.max(1),
            "--concurrency" => a.concurrency = count(value()?)?.max(1),
            "--endpoint" => a.endpoint = Some(value()?),
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(a)
}

fn descriptor(i: usize, port: u16) -> Descriptor {
    let mut d = Descriptor::new(
        format!("engine-{i}"),
        vec![format!("10.0.{}.{}:{port}", i / 250, i % 250 + 1)],
        ProtocolRange { min: 3, max: 4 },
    );
    d.features = vec!["tls".into()];
    d
}

/// One row: `ops` operations in `wall`, with single-operation latencies.
fn row(phase: &str, ops: usize, wall: Duration, mut lat: Vec<Duration>) {
    lat.sort();
    let pct = |p: f64| {
        let i = ((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len()) - 1;
        lat[i].as_secs_f64() * 1e3
    };
    println!(
        "| {phase} | {ops} | {:.2} s | {:.0}/s | {:.1} ms | {:.1} ms | {:.1} ms |",
        wall.as_secs_f64(),
        ops as f64 / wall.as_secs_f64(),
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let mut _etcd = None;
    let endpoint = match &a.endpoint {
        Some(e) => e.clone(),
        None => {
            let tmp = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
            std::fs::create_dir_all(&tmp)?;
            let etcd = Etcd::start("scale", &tmp)
                .await
                .ok_or("etcd is not available (see the skip line above)")?;
            let ep = etcd.endpoint();
            _etcd = Some(etcd);
            ep
        }
    };
    let n = a.engines;
    eprintln!("{n} engines against etcd at {endpoint}");
    // One connection per simulated engine, as separate processes would have.
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(EtcdDiscovery::connect(&[endpoint.as_str()], PREFIX, TTL).await?);
    }
    let clients = Arc::new(clients);
    println!("| phase | operations | wall | rate | p50 | p99 | max |");
    println!("|---|---|---|---|---|---|---|");

    // Publish: every engine at once.
    let t0 = Instant::now();
    let mut set = JoinSet::new();
    for i in 0..n {
        let c = Arc::clone(&clients);
        set.spawn(async move {
            let t = Instant::now();
            let p = c[i].publish(&descriptor(i, 4000)).await;
            (i, p, t.elapsed())
        });
    }
    let mut pubs: Vec<Option<_>> = (0..n).map(|_| None).collect();
    let mut lat = Vec::new();
    while let Some(r) = set.join_next().await {
        let (i, p, l) = r?;
        pubs[i] = Some(p?);
        lat.push(l);
    }
    row("publish (all at once)", n, t0.elapsed(), lat);

    // Lookups: `concurrency` at a time, names spread over all engines.
    let t0 = Instant::now();
    let per = a.lookups.div_ceil(a.concurrency);
    let mut set = JoinSet::new();
    for w in 0..a.concurrency {
        let c = Arc::clone(&clients);
        set.spawn(async move {
            let mut lat = Vec::with_capacity(per);
            for k in 0..per {
                let i = (w * per + k) % n;
                let t = Instant::now();
                c[(i + 1) % n].lookup(&format!("engine-{i}")).await?;
                lat.push(t.elapsed());
            }
            Ok::<_, ferry_discovery::Error>(lat)
        });
    }
    let mut lat = Vec::new();
    while let Some(r) = set.join_next().await {
        lat.extend(r??);
    }
    let ops = lat.len();
    row(
        &format!("lookup ({} at a time)", a.concurrency),
        ops,
        t0.elapsed(),
        lat,
    );

    // Watches: engine i watches engine i+1; each phase changes every name
    // at once and waits for every watcher's event.
    let mut watches = Vec::with_capacity(n);
    for i in 0..n {
        watches.push(clients[i].watch(&format!("engine-{}", (i + 1) % n)).await?);
    }
    for (phase, republish) in [
        ("watch: deletions (all revoked)", false),
        ("watch: re-registrations at new addresses", true),
    ] {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let t0 = Instant::now();
        let mut waiters = JoinSet::new();
        for mut w in watches.drain(..) {
            let tx = tx.clone();
            waiters.spawn(async move {
                let ev = tokio::time::timeout(Duration::from_secs(60), w.next()).await;
                let ok = matches!(
                    (&ev, republish),
                    (Ok(Ok(SegmentEvent::Registered(_))), true)
                        | (Ok(Ok(SegmentEvent::Deleted { .. })), false)
                );
                let _ = tx.send((ok, t0.elapsed()));
                w
            });
        }
        drop(tx);
        let mut changes = JoinSet::new();
        for (i, slot) in pubs.iter_mut().enumerate() {
            let c = Arc::clone(&clients);
            let old = slot.take();
            changes.spawn(async move {
                if republish {
                    (i, Some(c[i].publish(&descriptor(i, 5000)).await))
                } else {
                    if let Some(p) = old {
                        let _ = p.shutdown().await;
                    }
                    (i, None)
                }
            });
        }
        while let Some(r) = changes.join_next().await {
            let (i, p) = r?;
            if let Some(p) = p {
                pubs[i] = Some(p?);
            }
        }
        let mut lat = Vec::new();
        let mut wrong = 0;
        while let Some((ok, l)) = rx.recv().await {
            wrong += usize::from(!ok);
            lat.push(l);
        }
        if wrong > 0 {
            return Err(format!("{phase}: {wrong} watchers saw no or the wrong event").into());
        }
        row(phase, lat.len(), t0.elapsed(), lat);
        while let Some(w) = waiters.join_next().await {
            watches.push(w?);
        }
    }
    for p in pubs.into_iter().flatten() {
        p.shutdown().await?;
    }
    Ok(())
}
