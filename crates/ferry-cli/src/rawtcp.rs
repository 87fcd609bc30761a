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

/// Most bytes of buffer all of a sink's streams hold together: one
/// [`SPAN`], so the baseline's footprint is the engines' while a peer that
/// opens streams (the sink has no authentication) cannot make it grow.
pub const SINK_BUDGET: usize = SPAN;

/// Each stream's own small buffer, used until (or while) it holds no chunk
/// of the shared budget.
const SCRATCH: usize = 64 << 10;

/// Chunks of the shared budget: what is left of [`SINK_BUDGET`] once every
/// stream's scratch buffer is counted.
const BUDGET_CHUNKS: usize = (SINK_BUDGET - MAX_SINK_STREAMS * SCRATCH) / READ_CHUNK;

/// The shared budget: permits for [`BUDGET_CHUNKS`] chunks and the chunks
/// already made. A chunk a stream gives back is kept for the next stream
/// rather than freed, so the sink's footprint is bounded by the budget
/// itself, not by how the allocator reuses what it was given back (freed
/// 1 MiB blocks spread over the runtime's per-thread arenas once took
/// serve 16 MiB past the budget).
struct Budget {
    permits: Arc<tokio::sync::Semaphore>,
    spare: std::sync::Mutex<Vec<Vec<u8>>>,
    /// Chunks made so far (never more than [`BUDGET_CHUNKS`]).
    made: AtomicU64,
}

impl Budget {
    fn new() -> Arc<Budget> {
        Arc::new(Budget {
            permits: Arc::new(tokio::sync::Semaphore::new(BUDGET_CHUNKS)),
            spare: std::sync::Mutex::new(Vec::new()),
            made: AtomicU64::new(0),
        })
    }

    /// A chunk, if the budget has one left.
    fn take(self: &Arc<Budget>) -> Option<Chunk> {
        let permit = Arc::clone(&self.permits).try_acquire_owned().ok()?;
        let spare = self.spare.lock().ok().and_then(|mut s| s.pop());
        let buf = spare.unwrap_or_else(|| {
            self.made.fetch_add(1, Ordering::Relaxed);
            // Touched up front, like registered memory.
            vec![1u8; READ_CHUNK]
        });
        Some(Chunk {
            buf,
            budget: Arc::clone(self),
            _permit: permit,
        })
    }
}

/// One chunk of the budget, held by a stream.
struct Chunk {
    buf: Vec<u8>,
    budget: Arc<Budget>,
    /// Released after `drop` has put the buffer back (fields drop after
    /// the body), so chunks made never exceed the permits.
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if let Ok(mut spare) = self.budget.spare.lock() {
            spare.push(buf);
        }
    }
}

/// One stream's buffers: chunks of the shared budget, taken as data
/// arrives (up to [`SPAN`]), and cycled through once no more can be had;
/// the scratch buffer while it has none.
struct StreamBuffers {
    budget: Arc<Budget>,
    scratch: Vec<u8>,
    chunks: Vec<Chunk>,
    /// The chunk being filled (`None`: the scratch buffer) and the offset in it.
    cur: Option<usize>,
    off: usize,
}

impl StreamBuffers {
    fn new(budget: Arc<Budget>) -> StreamBuffers {
        StreamBuffers {
            budget,
            // Touched up front, like registered memory.
            scratch: vec![1u8; SCRATCH],
            chunks: Vec::new(),
            cur: None,
            off: 0,
        }
    }

    /// Where the next read goes (at most [`READ_CHUNK`] bytes).
    fn next(&mut self) -> &mut [u8] {
        let len = self.cur.map_or(SCRATCH, |_| READ_CHUNK);
        if self.off >= len {
            self.off = 0;
            let room = self.chunks.len() < SPAN / READ_CHUNK;
            let chunk = if room { self.budget.take() } else { None };
            self.cur = match chunk {
                Some(c) => {
                    self.chunks.push(c);
                    Some(self.chunks.len() - 1)
                }
                None if self.chunks.is_empty() => None,
                None => Some(self.cur.map_or(0, |c| (c + 1) % self.chunks.len())),
            };
        }
        let off = self.off;
        match self.cur {
            Some(c) => &mut self.chunks[c].buf[off..],
            None => &mut self.scratch[off..],
        }
    }

    fn advance(&mut self, n: usize) {
        self.off += n;
    }
}

/// Serves `listener` until the task is dropped/aborted.
/// At most [`MAX_SINK_STREAMS`] streams are served at once; together they
/// hold at most [`SINK_BUDGET`] bytes of buffer, taken as data arrives
/// (nothing for a connection that sends nothing); further connections wait
/// in the accept queue. A stream silent for [`SINK_IDLE`] is dropped, so
/// idle connections cannot hold the slots (or memory) for long.
pub async fn run_sink(listener: TcpListener, stats: Arc<SinkStats>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_SINK_STREAMS));
    let budget = Budget::new();
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Ok((mut stream, peer)) = listener.accept().await else {
            continue;
        };
        let stats = Arc::clone(&stats);
        let budget = Arc::clone(&budget);
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
            let mut bufs = StreamBuffers::new(budget);
            let mut got = 0u64;
            loop {
                match tokio::time::timeout(SINK_IDLE, stream.read(bufs.next())).await {
                    Ok(Ok(0)) => break,
                    Ok(Ok(n)) => {
                        got = got.saturating_add(n as u64);
                        bufs.advance(n);
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
            drop(bufs);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams take chunks of the shared budget as they fill them, never
    /// more than [`SPAN`] each nor [`SINK_BUDGET`] together (scratch
    /// buffers counted), and cycle through what they hold once the budget
    /// is gone.
    #[test]
    fn streams_share_one_budget() {
        let budget = Budget::new();
        let mut streams: Vec<StreamBuffers> = (0..MAX_SINK_STREAMS)
            .map(|_| StreamBuffers::new(Arc::clone(&budget)))
            .collect();
        // Each stream receives two spans' worth, interleaved.
        for _ in 0..2 * SPAN / READ_CHUNK {
            for s in &mut streams {
                let n = s.next().len();
                assert!(n > 0 && n <= READ_CHUNK);
                s.advance(n);
            }
        }
        let held: usize = streams
            .iter()
            .map(|s| s.scratch.len() + s.chunks.len() * READ_CHUNK)
            .sum();
        assert!(held <= SINK_BUDGET, "{held} bytes held");
        assert_eq!(budget.permits.available_permits(), 0, "the budget was used");
        assert!(streams.iter().all(|s| s.chunks.len() * READ_CHUNK <= SPAN));
        drop(streams);
        assert_eq!(
            budget.permits.available_permits(),
            BUDGET_CHUNKS,
            "chunks returned"
        );
        // Alone, a stream grows to one span and then cycles.
        let mut one = StreamBuffers::new(Arc::clone(&budget));
        for _ in 0..2 * SPAN / SCRATCH {
            let n = one.next().len();
            one.advance(n);
        }
        assert_eq!(one.chunks.len(), BUDGET_CHUNKS.min(SPAN / READ_CHUNK));
        // Streams after the first reuse the chunks given back: the sink
        // never made more than its budget.
        drop(one);
        for _ in 0..3 {
            let mut streams: Vec<StreamBuffers> = (0..3)
                .map(|_| StreamBuffers::new(Arc::clone(&budget)))
                .collect();
            for _ in 0..SPAN / READ_CHUNK {
                for s in &mut streams {
                    let n = s.next().len();
                    s.advance(n);
                }
            }
        }
        assert_eq!(
            budget.made.load(Ordering::Relaxed),
            BUDGET_CHUNKS as u64,
            "chunks made"
        );
    }
}
