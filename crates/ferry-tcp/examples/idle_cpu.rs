//! Shows that engines spin on no core while idle: two engines in this
//! process (an initiator and a target, on the same-host path if the kernel
//! allows it), a burst of 4 KiB writes, then an idle period with the
//! connection open; prints the process's CPU time during the burst and
//! during the idle period (which should be ~0: the busy-poll windows,
//! `spin_us` / `spin_pending_us`, end a few hundred µs after the last
//! request).
//!
//! ```text
//! cargo run --release -p ferry-tcp --example idle_cpu -- [IDLE_SECONDS] [URL_PARAMS]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{RegisteredBuffer, TransferEngine, TransferRequest};
use ferry_tcp::{TcpConfig, TcpEngine};

/// User + system CPU time of this process.
fn cpu_time() -> Duration {
    let mut ru: libc::rusage = unsafe_zeroed();
    // SAFETY: a valid pointer to a rusage for the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn unsafe_zeroed() -> libc::rusage {
    // SAFETY: rusage is plain integers; all-zero is valid.
    unsafe { std::mem::zeroed() }
}

#[tokio::main]
async fn main() -> ferry_core::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let idle: f64 = args.first().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let params = args.get(1).cloned().unwrap_or_default();
    let url = |p: &str| format!("tcp://127.0.0.1:0?{p}");
    let target = Arc::new(TcpEngine::start(TcpConfig::from_url(&url(&params))?).await?);
    let init = Arc::new(TcpEngine::start(TcpConfig::from_url(&url(&params))?).await?);
    let dst = RegisteredBuffer::new(Arc::clone(&target), 1 << 20).await?;
    let src = RegisteredBuffer::new(Arc::clone(&init), 1 << 20).await?;
    let seg = init.open_segment(target.segment_name()).await?;
    let n = 20_000;
    let (c0, t0) = (cpu_time(), Instant::now());
    for i in 0..n {
        let off = (i % 256) * 4096;
        let req = TransferRequest::write(src.addr() + off, dst.addr() + off, 4096);
        init.transfer(seg, req).await?;
    }
    let (c1, t1) = (cpu_time(), Instant::now());
    let path = init
        .backend_info()
        .details
        .into_iter()
        .find(|(k, _)| k.starts_with("peer "))
        .map(|(_, v)| v)
        .unwrap_or_default();
    println!(
        "burst: {n} writes of 4 KiB in {:.0} ms ({:.1} µs each), CPU {:.0} ms ({path})",
        (t1 - t0).as_secs_f64() * 1e3,
        (t1 - t0).as_secs_f64() * 1e6 / n as f64,
        (c1 - c0).as_secs_f64() * 1e3
    );
    tokio::time::sleep(Duration::from_secs_f64(idle)).await;
    let c2 = cpu_time();
    println!(
        "idle, connection open: {idle} s, CPU {:.1} ms ({:.2}% of one core)",
        (c2 - c1).as_secs_f64() * 1e3,
        (c2 - c1).as_secs_f64() / idle * 100.0
    );
    init.close_segment(seg).await?;
    src.release().await?;
    dst.release().await?;
    Ok(())
}
