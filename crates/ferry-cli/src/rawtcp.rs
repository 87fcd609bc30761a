//! The raw-TCP baseline: plain tokio streams, no protocol.
//!
//! Like the engines under test, both ends walk through a large buffer
//! ([`SPAN`] bytes) rather than reusing one cache-hot block, so the baseline
//! moves the same bytes with the same memory footprint.
//!
//! A sink accepts connections, reads each to end of stream, then answers
//! with the number of bytes it received (8 bytes, little-endian). The
//! sender writes block-sized chunks for a while, shuts down its write side
//! and waits for that answer, so the measured time covers delivery, not just
//! buffering in the kernel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bytes each end of a raw stream cycles through (at least one block).
pub const SPAN: usize = 64 << 20;

/// Most raw streams a sink serves at once.
pub const MAX_SINK_STREAMS: usize = 8;

/// Largest single read of the sink.
const READ_CHUNK: usize = 1 << 20;

/// A sink stream that sends nothing for this long is dropped (its slot and
/// buffer freed). The sink has no authentication: this and
/// [`MAX_SINK_STREAMS`] bound what an unknown peer can hold.
pub const SINK_IDLE: Duration = Duration::from_secs(10);

/// What a sink has received so far.
#[derive(Debug, Default)]
pub struct SinkStats {
    /// Connections served to the end.
    pub streams: AtomicU64,
    /// Bytes received over all connections.
    pub bytes: AtomicU64,
}

/// Serves `listener` until the task is dropped/aborted.
/// At most [`MAX_SINK_STREAMS`] streams are served at once (each holds a
/// [`SPAN`]-byte buffer, allocated only once its first bytes arrive);
/// further connections wait in the accept queue. A stream silent for
/// [`SINK_IDLE`] is dropped, so idle connections cannot hold the slots (or
/// memory) for long.
pub async fn run_sink(listener: TcpListener, stats: Arc<SinkStats>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_SINK_STREAMS));
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Ok((mut stream, peer)) = listener.accept().await else {
            continue;
        };
        let stats = Arc::clone(&stats);
        tokio::spawn(async move {
            let _slot = slot;
            let _ = stream.set_nodelay(true);
            // Nothing is allocated for a connection that sends nothing.
            let mut first = [0u8; 1];
            match tokio::time::timeout(SINK_IDLE, stream.peek(&mut first)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => {
                    tracing::debug!(%peer, "raw sink stream idle, dropped");
                    return;
                }
            }
            // Touched up front, like registered memory.
            let mut buf = vec![1u8; SPAN];
            let mut got = 0u64;
            let mut off = 0usize;
            loop {
                let end = (off + READ_CHUNK).min(SPAN);
                match tokio::time::timeout(SINK_IDLE, stream.read(&mut buf[off..end])).await {
                    Ok(Ok(0)) => break,
                    Ok(Ok(n)) => {
                        got = got.saturating_add(n as u64);
                        off = (off + n) % SPAN;
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "raw sink stream failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "raw sink stream stalled, dropped");
                        return;
                    }
                }
            }
            drop(buf);
            let add = |c: &AtomicU64, n: u64| {
                let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    Some(v.saturating_add(n))
                });
            };
            add(&stats.bytes, got);
            add(&stats.streams, 1);
            let _ = stream.write_all(&got.to_le_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}

/// Sends `block`-sized writes over `streams` parallel connections to the
/// sink at `addr` until `duration` has passed or `total` bytes are sent;
/// returns GB/s (10^9 bytes per second) as confirmed by the sink.
pub async fn measure(
    addr: &str,
    block: usize,
    streams: usize,
    duration: Duration,
    total: u64,
) -> anyhow::Result<f64> {
    let mut conns = Vec::with_capacity(streams);
    for _ in 0..streams {
        let s = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to the raw-TCP sink {addr}"))?;
        s.set_nodelay(true).ok();
        conns.push(s);
    }
    let per_stream = (total / streams as u64).max(block as u64);
    // Source buffers are filled before the clock starts (page faults are not
    // the network's cost).
    let span = SPAN.max(block);
    let blocks = span / block;
    let buffers: Vec<Vec<u8>> = (0..streams).map(|_| vec![0x5au8; span]).collect();
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::with_capacity(streams);
    for (mut s, buf) in conns.into_iter().zip(buffers) {
        tasks.push(tokio::spawn(async move {
            let mut sent = 0u64;
            let mut i = 0usize;
            while sent < per_stream && (sent == 0 || Instant::now() < deadline) {
                let off = (i % blocks) * block;
                s.write_all(&buf[off..off + block]).await?;
                sent += block as u64;
                i += 1;
            }
            s.shutdown().await?;
            let mut ack = [0u8; 8];
            s.read_exact(&mut ack).await?;
            Ok::<_, std::io::Error>((sent, u64::from_le_bytes(ack)))
        }));
    }
    let mut confirmed = 0u64;
    for t in tasks {
        let (sent, got) = t
            .await
            .context("raw-TCP sender task failed")?
            .context("raw-TCP stream failed")?;
        if sent != got {
            bail!("raw-TCP sink confirmed {got} bytes of {sent} sent");
        }
        confirmed += got;
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(confirmed as f64 / secs / 1e9)
}
