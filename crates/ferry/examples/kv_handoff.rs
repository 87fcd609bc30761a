//! KV-cache hand-off between a prefill and a decode engine, the way a
//! disaggregated serving stack does it.
//!
//! - The decode engine owns the paged KV cache: one region per layer, each
//!   `BLOCKS` blocks of `BLOCK_BYTES`, registered at start-up in one batch.
//! - A request arrives. The decode side allocates KV blocks for it — mostly
//!   contiguous runs, a few scattered where the free list had holes — and
//!   tells the prefill side (in a real stack: over the bootstrap/RPC channel)
//!   the layer base addresses and the block ids.
//! - The prefill engine computes the request's KV (here: deterministic
//!   bytes), writes every layer's blocks straight into decode memory in one
//!   batch, with a notification that lands after the data.
//! - The decode side waits for the notification, then checks every byte it
//!   received and that nothing outside the allocated blocks changed.
//!
//! Run: `cargo run -p ferry --example kv_handoff [-- URL]` (default
//! `tcp://127.0.0.1:0`; any backend URL with notifications works).

use std::sync::Arc;
use std::time::Duration;

use ferry::{
    Engine, Error, Notification, RegisteredBuffer, RegisteredBuffers, TransferEngine,
    TransferRequest,
};

/// Transformer layers in the model.
pub const LAYERS: usize = 4;
/// KV blocks per layer in the decode engine's cache.
pub const BLOCKS: usize = 64;
/// Bytes of one block of one layer (K and V for 16 tokens of a small model).
pub const BLOCK_BYTES: usize = 16 * 1024;

/// What one hand-off did.
#[derive(Debug)]
pub struct Summary {
    /// The decode engine's segment name.
    pub decode: String,
    /// Transfer requests the prefill side issued (one per layer and block).
    pub requests: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// The notification the decode side received.
    pub notification: Notification,
    /// How the backend provides batch register / batch transfer / notify.
    pub support: Vec<(String, &'static str)>,
}

/// Decode-side block allocation for one request: two contiguous runs and a
/// few scattered blocks.
pub fn allocate_blocks() -> Vec<usize> {
    let mut ids: Vec<usize> = (3..13).collect();
    ids.extend(20..30);
    ids.extend([41, 47, 55, 60]);
    ids
}

/// The KV bytes prefill computes for (`layer`, the request's `j`-th block).
fn kv_bytes(layer: usize, j: usize, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = ((layer * 131 + j * 31 + i * 7) % 251) as u8 + 1;
    }
}

/// The decode engine's KV cache: one host buffer per layer, registered
/// together (all layers or none; emulated with single registers where the
/// backend has no native batch register) for as long as the cache lives.
struct KvCache {
    layers: RegisteredBuffers<Engine>,
}

impl KvCache {
    async fn new(engine: Arc<Engine>) -> ferry::Result<Self> {
        let layers = RegisteredBuffers::new(engine, &[BLOCKS * BLOCK_BYTES; LAYERS]).await?;
        Ok(KvCache { layers })
    }

    fn layer_addrs(&self) -> Vec<u64> {
        self.layers.addrs()
    }

    /// Unregisters every layer; only then is the memory freed.
    async fn close(self) -> ferry::Result<()> {
        self.layers.release().await
    }
}

/// Waits until the prefill notification arrives on `engine` (awaited, not
/// polled: the engine wakes the caller when it comes), or fails after
/// `timeout`; a timed-out wait takes nothing from the queue.
async fn wait_notification(engine: &Engine, timeout: Duration) -> ferry::Result<Notification> {
    match tokio::time::timeout(timeout, engine.next_notification(None)).await {
        Ok(n) => n,
        Err(_) => Err(Error::Timeout {
            operation: "waiting for the prefill notification".into(),
            peer: None,
            after: timeout,
        }),
    }
}

/// One complete hand-off over the backend `url`; checks every byte.
pub async fn run(url: &str) -> ferry::Result<Summary> {
    // --- decode node: owns the KV cache ------------------------------------
    let decode = Arc::new(Engine::open(url).await?);
    let cache = KvCache::new(Arc::clone(&decode)).await?;

    // --- prefill node -------------------------------------------------------
    let prefill = Arc::new(Engine::open(url).await?);
    let report = prefill.report();
    let support = ["batch_register", "batch_transfer", "notify"]
        .into_iter()
        .filter_map(|name| {
            let op = name.parse().ok()?;
            Some((name.to_owned(), report.support(op).kind()))
        })
        .collect();

    // The request: decode allocates blocks and sends (addresses, ids) to
    // prefill over its bootstrap channel.
    let block_ids = allocate_blocks();
    let layer_addrs = cache.layer_addrs();
    let n = block_ids.len();

    // The decode side starts waiting before prefill begins.
    let waiter = {
        let decode = Arc::clone(&decode);
        tokio::spawn(async move { wait_notification(&decode, Duration::from_secs(30)).await })
    };

    // Prefill computes the request's KV into its own registered buffer:
    // layer-major, the request's blocks contiguous.
    let local = RegisteredBuffer::new(Arc::clone(&prefill), LAYERS * n * BLOCK_BYTES).await?;
    let mut block = vec![0u8; BLOCK_BYTES];
    for layer in 0..LAYERS {
        for j in 0..n {
            kv_bytes(layer, j, &mut block);
            local
                .memory()
                .write((layer * n + j) * BLOCK_BYTES, &block)?;
        }
    }

    // One write per (layer, block); contiguous runs are merged by the adapter.
    let requests: Vec<TransferRequest> = (0..LAYERS)
        .flat_map(|layer| {
            let local_base = local.addr() + (layer * n * BLOCK_BYTES) as u64;
            let remote_base = layer_addrs[layer];
            block_ids.iter().enumerate().map(move |(j, &id)| {
                TransferRequest::write(
                    local_base + (j * BLOCK_BYTES) as u64,
                    remote_base + (id * BLOCK_BYTES) as u64,
                    BLOCK_BYTES as u64,
                )
            })
        })
        .collect();
    let peer = prefill.open_segment(decode.segment_name()).await?;
    let done = Notification::new(
        "prefill-0",
        format!("req-42 kv-ready layers={LAYERS} blocks={n}"),
    );
    prefill
        .batch_transfer(peer, &requests, Some(&done))
        .await?
        .into_result()?;
    prefill.close_segment(peer).await?;

    // --- decode node: wait, then check --------------------------------------
    let got = waiter
        .await
        .map_err(|e| Error::Canceled(format!("decode waiter: {e}")))??;
    if got != done {
        return Err(Error::InvalidArgument(format!(
            "decode received an unexpected notification {got:?}"
        )));
    }
    let mut want = vec![0u8; BLOCK_BYTES];
    let mut have = vec![0u8; BLOCK_BYTES];
    for (layer, mem) in cache.layers.buffers().iter().enumerate() {
        for id in 0..BLOCKS {
            mem.read(id * BLOCK_BYTES, &mut have)?;
            match block_ids.iter().position(|&b| b == id) {
                Some(j) => kv_bytes(layer, j, &mut want),
                None => want.fill(0),
            }
            if want != have {
                return Err(Error::InvalidArgument(format!(
                    "layer {layer} block {id}: decode memory does not hold what prefill sent"
                )));
            }
        }
    }

    local.release().await?;
    cache.close().await?;
    Ok(Summary {
        decode: decode.segment_name().to_owned(),
        requests: requests.len(),
        bytes: (requests.len() * BLOCK_BYTES) as u64,
        notification: got,
        support,
    })
}

#[tokio::main]
async fn main() -> ferry::Result<()> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tcp://127.0.0.1:0".to_owned());
    let s = run(&url).await?;
    println!(
        "prefill wrote {} requests ({} KiB) into decode {}: {} layers x {} scattered/contiguous blocks",
        s.requests,
        s.bytes / 1024,
        s.decode,
        LAYERS,
        allocate_blocks().len()
    );
    for (op, kind) in &s.support {
        println!("  {op}: {kind}");
    }
    println!(
        "decode got notification {:?} from {:?}; every byte checked",
        s.notification.message, s.notification.name
    );
    Ok(())
}
