//! Diagnostic for issue 24 (small transfers from Python): the p50 latency
//! of one 4 KiB write when the caller is (a) a task on a runtime worker
//! thread (what `ferry bench` does), (b) a thread outside the runtime that
//! polls the future itself, spinning then parking (what ferry-py's
//! `block_on` did before `ferry::assist`), (c) a thread outside the
//! runtime that spawns the call on the runtime and waits for it (spin, then
//! park), (d) a thread outside the runtime in `ferry::assist::block_on`,
//! which drives the connection's reader itself (what ferry-py does now),
//! (e) a plain thread calling `ferry::blocking::Engine` (its own engine and
//! runtime with one worker thread: the facade for programs that are not
//! async, on the same assist path as (d)).
//!
//! Run against a `ferry serve` on the same host:
//!
//! ```text
//! ferry serve --backend tcp://127.0.0.1:0 --size 64MiB     # prints --peer and --remote-addr
//! cargo run --release -p ferry --example blocking_latency -- \
//!     'tcp://127.0.0.1:0' PEER REMOTE_ADDR [ITERATIONS]    # add ?same_host=off for the socket path
//! ```
//!
//! `MODE=a`, `MODE=b`, `MODE=d` or `MODE=e` runs only that caller kind
//! (for `strace -c`).
//!
//! `MODE=t` and `MODE=w` measure many callers at once: `THREADS` (default
//! 10) plain threads in `ferry::assist::block_on` (t) or runtime tasks (w),
//! each writing its own 4 KiB block, aggregate calls/s against one caller.
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use ferry::{Engine, HostBuffer, Location, SegmentId, TransferEngine, TransferRequest};

struct Signal {
    woken: AtomicBool,
    thread: std::thread::Thread,
}
impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}
const SPIN: Duration = Duration::from_micros(50);
fn run<F: Future>(rt: &tokio::runtime::Runtime, fut: F) -> F::Output {
    let _g = rt.enter();
    let s = Arc::new(Signal {
        woken: AtomicBool::new(false),
        thread: std::thread::current(),
    });
    let w = Waker::from(s.clone());
    let mut cx = Context::from_waker(&w);
    let mut fut = pin!(fut);
    loop {
        if let Poll::Ready(o) = fut.as_mut().poll(&mut cx) {
            return o;
        }
        let start = Instant::now();
        while !s.woken.swap(false, Ordering::AcqRel) {
            if start.elapsed() < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::park();
            }
        }
    }
}
/// Spawn on the runtime, wait with spin then park.
fn spawn_wait<F>(rt: &tokio::runtime::Runtime, fut: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let slot = Arc::new((
        Mutex::new(None),
        AtomicBool::new(false),
        std::thread::current(),
    ));
    let s2 = slot.clone();
    rt.spawn(async move {
        let o = fut.await;
        *s2.0.lock().unwrap() = Some(o);
        s2.1.store(true, Ordering::Release);
        s2.2.unpark();
    });
    let start = Instant::now();
    while !slot.1.load(Ordering::Acquire) {
        if start.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::park();
        }
    }
    let o = slot.0.lock().unwrap().take().unwrap();
    o
}

/// p50, p90 and mean of a run.
struct Stats(Duration, Duration, Duration);

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "p50 {:?} p90 {:?} mean {:?}", self.0, self.1, self.2)
    }
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    let mean = v.iter().sum::<Duration>() / v.len().max(1) as u32;
    Stats(v[v.len() / 2], v[v.len() * 9 / 10], mean)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let url = &args[1];
    let peer = args[2].clone();
    let remote = u64::from_str_radix(args[3].trim_start_matches("0x"), 16).unwrap();
    let n: usize = args.get(4).map(|s| s.parse().unwrap()).unwrap_or(5000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let engine: Arc<Engine> = Arc::new(rt.block_on(Engine::open(url)).unwrap());
    let src = HostBuffer::new(1 << 20).unwrap();
    src.fill(7);
    // SAFETY: `src` lives until the end of `main`, after the engine is
    // done with it (the process ends there).
    let region = unsafe { src.region(Location::cpu(0)) };
    rt.block_on(engine.register(region)).unwrap();
    let seg: SegmentId = rt.block_on(engine.open_segment(&peer)).unwrap();
    let req = TransferRequest::write(src.addr(), remote, 4096);
    println!(
        "{}",
        engine
            .backend_info()
            .details
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let mode = std::env::var("MODE").unwrap_or_default();
    // (e): the blocking facade, its own engine and runtime.
    let blocking = ferry::blocking::Engine::open(url).unwrap();
    let bsrc = blocking.buffer(1 << 20).unwrap();
    bsrc.memory().fill(7);
    let bseg = blocking.open_segment(&peer).unwrap();
    let breq = TransferRequest::write(bsrc.addr(), remote + (1 << 20), 4096);
    let facade = |n: usize| {
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            blocking.transfer(bseg, breq).unwrap();
            v.push(t.elapsed());
        }
        v
    };
    if mode == "e" {
        println!("blocking-facade {:?}", stats(facade(n)));
        return;
    }
    if mode == "b" {
        let mut b = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            run(&rt, engine.transfer(seg, req)).unwrap();
            b.push(t.elapsed());
        }
        println!("foreign-poll {:?}", stats(b));
        return;
    }
    if mode == "d" {
        let mut d = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            ferry::assist::block_on(rt.handle(), engine.transfer(seg, req)).unwrap();
            d.push(t.elapsed());
        }
        println!("assisted {:?}", stats(d));
        return;
    }
    if mode == "t" || mode == "w" {
        let base = src.addr();
        // Aggregate calls/s of THREADS callers at once (plain threads in
        // `assist::block_on` for "t", runtime tasks for "w") against one.
        let threads: usize = std::env::var("THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10);
        for round in 0..3 {
            let mut line = format!("round {round}:");
            for k in [1, threads] {
                let t0 = Instant::now();
                if mode == "t" {
                    std::thread::scope(|s| {
                        for i in 0..k {
                            let (engine, rt) = (&engine, &rt);
                            s.spawn(move || {
                                let r = TransferRequest::write(
                                    base + (i as u64) * 4096,
                                    remote + (i as u64) * 4096,
                                    4096,
                                );
                                for _ in 0..n {
                                    ferry::assist::block_on(rt.handle(), engine.transfer(seg, r))
                                        .unwrap();
                                }
                            });
                        }
                    });
                } else {
                    let joins: Vec<_> = (0..k)
                        .map(|i| {
                            let e = engine.clone();
                            let r = TransferRequest::write(
                                base + (i as u64) * 4096,
                                remote + (i as u64) * 4096,
                                4096,
                            );
                            rt.spawn(async move {
                                for _ in 0..n {
                                    e.transfer(seg, r).await.unwrap();
                                }
                            })
                        })
                        .collect();
                    rt.block_on(async {
                        for j in joins {
                            j.await.unwrap();
                        }
                    });
                }
                let rate = (k * n) as f64 / t0.elapsed().as_secs_f64();
                line += &format!("  {k} x: {:.1}k/s", rate / 1e3);
            }
            println!("{line}");
        }
        return;
    }
    if mode == "f" || mode == "F" {
        // Fairness: THREADS (default 1) callers of 4 KiB writes beside one
        // caller of 16 x 1 MiB batches, for 2 s a round: the small calls'
        // latency spread against one batch. "f": plain threads in
        // `assist::block_on`; "F": runtime tasks.
        let threads: usize = std::env::var("THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let big = HostBuffer::new(16 << 20).unwrap();
        big.fill(3);
        // SAFETY: `big` lives until the end of `main`, as `src` above.
        rt.block_on(engine.register(unsafe { big.region(Location::cpu(0)) }))
            .unwrap();
        // GAP=1: remote blocks 4 KiB apart (nothing to merge).
        let gap = u64::from(std::env::var("GAP").is_ok_and(|v| v == "1")) * 4096;
        let bigs: Vec<TransferRequest> = (0..16u64)
            .map(|k| {
                let to = remote + (32 << 20) + k * ((1 << 20) + gap);
                TransferRequest::write(big.addr() + (k << 20), to, 1 << 20)
            })
            .collect();
        let base = src.addr();
        let assisted = mode == "f";
        // SEP=1: the small calls on an engine of their own (own connection).
        let (small_engine, small_seg) = if std::env::var("SEP").is_ok_and(|v| v == "1") {
            let e: Arc<Engine> = Arc::new(rt.block_on(Engine::open(url)).unwrap());
            // SAFETY: as `src` above.
            rt.block_on(e.register(unsafe { src.region(Location::cpu(0)) }))
                .unwrap();
            let sg = rt.block_on(e.open_segment(&peer)).unwrap();
            (e, sg)
        } else {
            (engine.clone(), seg)
        };
        for round in 0..3 {
            let stop = AtomicBool::new(false);
            let (small, large) = std::thread::scope(|s| {
                let smalls: Vec<_> = (0..threads)
                    .map(|i| {
                        let (engine, rt, stop, seg) = (&small_engine, &rt, &stop, small_seg);
                        s.spawn(move || {
                            let r = TransferRequest::write(
                                base + (i as u64) * 4096,
                                remote + (i as u64) * 4096,
                                4096,
                            );
                            let mut v = Vec::new();
                            let sched = || {
                                let s = std::fs::read_to_string("/proc/thread-self/schedstat")
                                    .unwrap_or_default();
                                let f: Vec<u64> = s
                                    .split_whitespace()
                                    .filter_map(|x| x.parse().ok())
                                    .collect();
                                (
                                    f.first().copied().unwrap_or(0),
                                    f.get(1).copied().unwrap_or(0),
                                )
                            };
                            let s0 = sched();
                            while !stop.load(Ordering::Relaxed) {
                                let t = Instant::now();
                                if assisted {
                                    ferry::assist::block_on(rt.handle(), engine.transfer(seg, r))
                                        .unwrap();
                                } else {
                                    let e = engine.clone();
                                    rt.block_on(rt.spawn(async move { e.transfer(seg, r).await }))
                                        .unwrap()
                                        .unwrap();
                                }
                                v.push(t.elapsed());
                            }
                            let s1 = sched();
                            eprintln!(
                                "small thread: ran {:.3} s, waited to run {:.3} s",
                                (s1.0 - s0.0) as f64 / 1e9,
                                (s1.1 - s0.1) as f64 / 1e9
                            );
                            v
                        })
                    })
                    .collect();
                let large = {
                    let (engine, rt, stop, bigs) = (&engine, &rt, &stop, &bigs);
                    s.spawn(move || {
                        let mut v = Vec::new();
                        while !stop.load(Ordering::Relaxed) {
                            let t = Instant::now();
                            ferry::assist::block_on(
                                rt.handle(),
                                engine.batch_transfer(seg, bigs, None),
                            )
                            .unwrap();
                            v.push(t.elapsed());
                        }
                        v
                    })
                };
                std::thread::sleep(Duration::from_secs(2));
                stop.store(true, Ordering::Relaxed);
                let small: Vec<Duration> =
                    smalls.into_iter().flat_map(|j| j.join().unwrap()).collect();
                (small, large.join().unwrap())
            });
            let mut small = small;
            small.sort();
            let q = |f: f64| small[((small.len() as f64 * f) as usize).min(small.len() - 1)];
            let big_med = stats(large.clone()).0;
            let over = small.iter().filter(|d| **d > big_med / 2).count();
            println!(
                "round {round}: small {} calls p50 {:?} p99 {:?} max {:?}; > half a batch: {over}; \
                 batches {} median {big_med:?}",
                small.len(),
                q(0.5),
                q(0.99),
                small[small.len() - 1],
                large.len(),
            );
        }
        return;
    }
    if mode == "a" {
        let e = engine.clone();
        let a = rt
            .block_on(rt.spawn(async move {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let t = Instant::now();
                    e.transfer(seg, req).await.unwrap();
                    v.push(t.elapsed());
                }
                v
            }))
            .unwrap();
        println!("worker {:?}", stats(a));
        return;
    }
    for round in 0..3 {
        // (a) worker task
        let e = engine.clone();
        let a = rt
            .block_on(rt.spawn(async move {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let t = Instant::now();
                    e.transfer(seg, req).await.unwrap();
                    v.push(t.elapsed());
                }
                v
            }))
            .unwrap();
        // (b) foreign poll
        let mut b = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            run(&rt, engine.transfer(seg, req)).unwrap();
            b.push(t.elapsed());
        }
        // (c) spawn + wait
        let mut c = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            let e = engine.clone();
            spawn_wait(&rt, async move { e.transfer(seg, req).await }).unwrap();
            c.push(t.elapsed());
        }
        // (d) assisted: the caller drives the reader
        let mut d = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            ferry::assist::block_on(rt.handle(), engine.transfer(seg, req)).unwrap();
            d.push(t.elapsed());
        }
        // (e) the blocking facade
        let e = facade(n);
        println!(
            "round {round}: worker {:?}  foreign-poll {:?}  spawn-wait {:?}  assisted {:?}  \
             blocking-facade {:?}",
            stats(a),
            stats(b),
            stats(c),
            stats(d),
            stats(e)
        );
    }
}
