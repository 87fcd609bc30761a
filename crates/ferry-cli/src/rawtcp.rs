//! The raw-TCP baseline: plain tokio streams, no protocol.
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

/// What a sink has received so far.
#[derive(Debug, Default)]
pub struct SinkStats {
    /// Connections served to the end.
    pub streams: AtomicU64,
    /// Bytes received over all connections.
    pub bytes: AtomicU64,
}

/// Serves `listener` until the task is dropped/aborted.
pub async fn run_sink(listener: TcpListener, stats: Arc<SinkStats>) {
    loop {
        let Ok((mut stream, peer)) = listener.accept().await else {
            continue;
        };
        let stats = Arc::clone(&stats);
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let mut buf = vec![0u8; 1 << 20];
            let mut got = 0u64;
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => got += n as u64,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "raw sink stream failed");
                        return;
                    }
                }
            }
            stats.bytes.fetch_add(got, Ordering::Relaxed);
            stats.streams.fetch_add(1, Ordering::Relaxed);
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
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::with_capacity(streams);
    for mut s in conns {
        tasks.push(tokio::spawn(async move {
            let buf = vec![0x5au8; block];
            let mut sent = 0u64;
            while sent < per_stream && Instant::now() < deadline {
                s.write_all(&buf).await?;
                sent += block as u64;
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
