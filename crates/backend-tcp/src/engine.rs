//! [`TcpEngine`]: the [`TransferEngine`] implementation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use transport_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, MemoryKinds, MemoryRegion,
    Notification, Result, SegmentId, TransferEngine, TransferRequest, TransferState,
};

use crate::client::{BatchState, Peer};
use crate::config::TcpConfig;
use crate::frame::VERSION;
use crate::server::{accept_loop, lock, Core};

const BACKEND: &str = "tcp";

/// An open segment handle. Handles to the same name share one [`Peer`]
/// (and its connections).
struct Handle {
    peer: Arc<Peer>,
    /// Transfers hold it shared; closing the handle takes it exclusively.
    gate: tokio::sync::RwLock<bool>,
}

#[derive(Default)]
struct Segments {
    by_id: HashMap<u64, Arc<Handle>>,
    /// Peer and number of open handles to it.
    by_name: HashMap<String, (Arc<Peer>, usize)>,
}

struct AsyncBatch {
    state: Arc<BatchState>,
    /// `None` while running; then the notification outcome of an empty batch.
    done: watch::Receiver<Option<Result<()>>>,
    /// The task driving the batch (none for a batch completed in `submit`).
    task: Option<AbortHandle>,
}

struct Inner {
    core: Arc<Core>,
    segments: Mutex<Segments>,
    batches: Mutex<HashMap<u64, AsyncBatch>>,
    next_segment: AtomicU64,
    next_batch: AtomicU64,
    accept: Mutex<Option<AbortHandle>>,
}

/// A TCP transfer engine: listens on [`TcpConfig::listen`], serves peers'
/// requests against its registered regions, and moves bytes to and from
/// peers' registered regions.
///
/// Every optional operation of [`TransferEngine`] is native. Dropping the
/// engine (or calling [`TcpEngine::shutdown`]) stops the listener, closes
/// every connection and cancels its asynchronous batches. Must be used
/// inside a Tokio runtime (it spawns tasks).
pub struct TcpEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpEngine")
            .field("segment", &self.inner.core.name)
            .field("config", &self.inner.core.config)
            .finish()
    }
}

impl TcpEngine {
    /// Binds the listener and starts serving.
    ///
    /// Fails with [`Error::InvalidArgument`] for a bad configuration and
    /// [`Error::Io`] if the address cannot be resolved or bound. The
    /// segment name is the bound `host:port` (so listen on a concrete
    /// address, not `0.0.0.0`, when peers should use the name as is).
    pub async fn start(config: TcpConfig) -> Result<TcpEngine> {
        config.validate()?;
        let addr = tokio::net::lookup_host(&config.listen)
            .await
            .map_err(|e| Error::io(format!("resolving {}", config.listen), &e))?
            .next()
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{} resolves to no address", config.listen))
            })?;
        let sock = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .map_err(|e| Error::io("creating the listening socket", &e))?;
        let _ = sock.set_reuseaddr(true);
        if let Some(n) = config.socket_buffer {
            // Inherited by accepted sockets (and needed before listen for
            // the window scale to match).
            let _ = sock.set_send_buffer_size(n as u32);
            let _ = sock.set_recv_buffer_size(n as u32);
        }
        sock.bind(addr)
            .map_err(|e| Error::io(format!("binding {addr}"), &e))?;
        let listener = sock
            .listen(1024)
            .map_err(|e| Error::io(format!("listening on {addr}"), &e))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("reading the bound address", &e))?;
        let core = Arc::new(Core::new(bound.to_string(), config));
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&core))).abort_handle();
        tracing::debug!(segment = %core.name, "tcp engine started");
        Ok(TcpEngine {
            inner: Arc::new(Inner {
                core,
                segments: Mutex::new(Segments::default()),
                batches: Mutex::new(HashMap::new()),
                next_segment: AtomicU64::new(1),
                next_batch: AtomicU64::new(1),
                accept: Mutex::new(Some(accept)),
            }),
        })
    }

    /// Parses `url` with [`TcpConfig::from_url`] and starts an engine.
    pub async fn open(url: &str) -> Result<TcpEngine> {
        Self::start(TcpConfig::from_url(url)?).await
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &TcpConfig {
        &self.inner.core.config
    }

    /// Stops the listener and every inbound connection, closes every peer
    /// connection (their pending requests fail with [`Error::Canceled`]) and
    /// cancels the asynchronous batches. Registered regions stay
    /// registered. Idempotent; also done on drop.
    pub fn shutdown(&self) {
        if let Some(a) = lock(&self.inner.accept).take() {
            a.abort();
        }
        let peers: Vec<Arc<Peer>> = {
            let mut segs = lock(&self.inner.segments);
            segs.by_id.clear();
            segs.by_name.drain().map(|(_, (p, _))| p).collect()
        };
        for p in peers {
            p.close();
        }
        for (_, b) in lock(&self.inner.batches).drain() {
            if let Some(t) = b.task {
                t.abort();
            }
        }
    }

    fn handle(&self, segment: SegmentId) -> Result<Arc<Handle>> {
        lock(&self.inner.segments)
            .by_id
            .get(&segment.0)
            .cloned()
            .ok_or(Error::UnknownSegment(segment))
    }

    fn check_batch(
        &self,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<()> {
        let max = self.inner.core.config.max_batch;
        if requests.len() > max {
            return Err(Error::BatchTooLarge {
                len: requests.len(),
                max,
            });
        }
        if let Some(n) = notify {
            n.validate()?;
        }
        Ok(())
    }
}

impl Drop for TcpEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn run_on(
    handle: &Handle,
    segment: SegmentId,
    requests: &[TransferRequest],
    notify: Option<&Notification>,
    state: &Arc<BatchState>,
) -> Result<()> {
    let open = handle.gate.read().await;
    if !*open {
        return Err(Error::UnknownSegment(segment));
    }
    handle.peer.run_batch(requests, notify, state).await
}

#[async_trait]
impl TransferEngine for TcpEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        &self.inner.core.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_batch_len: Some(self.inner.core.config.max_batch),
            memory: MemoryKinds {
                host: true,
                cuda: false,
            },
            ..Capabilities::all()
        }
    }

    fn backend_info(&self) -> BackendInfo {
        let c = &self.inner.core.config;
        let mut peers: Vec<(String, String)> = lock(&self.inner.segments)
            .by_name
            .iter()
            .map(|(name, (p, _))| {
                let path = p.path().unwrap_or_else(|| "not connected".to_owned());
                (format!("peer {name}"), format!("path: {path}"))
            })
            .collect();
        peers.sort();
        let mut details = vec![
            ("segment".to_owned(), self.inner.core.name.clone()),
            ("protocol".to_owned(), format!("ferry-tcp v{VERSION}")),
            ("connections per peer".to_owned(), c.connections.to_string()),
            (
                "authentication".to_owned(),
                if c.secret.is_some() {
                    "HMAC-SHA256 shared secret".to_owned()
                } else {
                    "none".to_owned()
                },
            ),
            ("same_host".to_owned(), c.same_host.to_string()),
        ];
        // Per open peer: the payload path and why.
        details.extend(peers);
        BackendInfo {
            backend: BACKEND.to_owned(),
            details,
            not_native: Vec::new(),
            emulated: Vec::new(),
        }
    }

    async fn register(&self, region: &MemoryRegion) -> Result<()> {
        region.require_host("tcp")?;
        self.inner.core.register(region)
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.core.unregister(addr).await
    }

    async fn batch_register(&self, regions: &[MemoryRegion]) -> Result<()> {
        for (index, region) in regions.iter().enumerate() {
            region
                .require_host("tcp")
                .map_err(|source| Error::BatchRegisterFailed {
                    index,
                    addr: region.addr(),
                    source: Box::new(source),
                })?;
        }
        self.inner.core.register_all(regions)
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        let mut first = None;
        for &addr in addrs {
            if let Err(e) = self.unregister(addr).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let existing = lock(&self.inner.segments)
            .by_name
            .get(name)
            .map(|(p, _)| Arc::clone(p));
        let peer = match existing {
            Some(p) => p,
            None => {
                let p = Peer::new(name, Arc::clone(&self.inner.core));
                // Connect now: reachability and authentication errors
                // surface here.
                p.conn(0).await?;
                p
            }
        };
        let mut segs = lock(&self.inner.segments);
        let entry = segs
            .by_name
            .entry(name.to_owned())
            .or_insert_with(|| (Arc::clone(&peer), 0));
        entry.1 += 1;
        let peer = Arc::clone(&entry.0);
        let id = self.inner.next_segment.fetch_add(1, Ordering::Relaxed);
        segs.by_id.insert(
            id,
            Arc::new(Handle {
                peer,
                gate: tokio::sync::RwLock::new(true),
            }),
        );
        Ok(SegmentId(id))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let handle = lock(&self.inner.segments)
            .by_id
            .remove(&segment.0)
            .ok_or(Error::UnknownSegment(segment))?;
        // Wait for the handle's transfers in flight.
        *handle.gate.write().await = false;
        let last = {
            let mut segs = lock(&self.inner.segments);
            match segs.by_name.get_mut(&handle.peer.name) {
                Some((p, n)) if Arc::ptr_eq(p, &handle.peer) => {
                    *n -= 1;
                    if *n == 0 {
                        segs.by_name.remove(&handle.peer.name);
                        true
                    } else {
                        false
                    }
                }
                _ => false,
            }
        };
        if last {
            handle.peer.close();
        }
        Ok(())
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let handle = self.handle(segment)?;
        let state = BatchState::new(1);
        run_on(
            &handle,
            segment,
            std::slice::from_ref(&request),
            None,
            &state,
        )
        .await?;
        state
            .results()
            .pop()
            .unwrap_or_else(|| Err(Error::Canceled("no result".into())))
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let handle = self.handle(segment)?;
        self.check_batch(requests, notify)?;
        let state = BatchState::new(requests.len());
        run_on(&handle, segment, requests, notify, &state).await?;
        Ok(BatchReport {
            results: state.results(),
        })
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let handle = self.handle(segment)?;
        self.check_batch(requests, notify)?;
        let state = BatchState::new(requests.len());
        let id = self.inner.next_batch.fetch_add(1, Ordering::Relaxed);
        if requests.is_empty() {
            // Nothing to track: complete it here (delivering the
            // notification, if any), so that status and release agree at
            // once.
            let r = run_on(&handle, segment, requests, notify, &state).await;
            let (_, rx) = watch::channel(Some(r));
            lock(&self.inner.batches).insert(
                id,
                AsyncBatch {
                    state,
                    done: rx,
                    task: None,
                },
            );
            return Ok(BatchId(id));
        }
        let (tx, rx) = watch::channel(None);
        let requests = requests.to_vec();
        let notify = notify.cloned();
        let task_state = Arc::clone(&state);
        // Hold the batch table lock while spawning so the task cannot be
        // missing from it when `shutdown` aborts the others.
        let mut batches = lock(&self.inner.batches);
        let task = tokio::spawn(async move {
            let r = run_on(&handle, segment, &requests, notify.as_ref(), &task_state).await;
            let _ = tx.send(Some(r));
        })
        .abort_handle();
        batches.insert(
            id,
            AsyncBatch {
                state,
                done: rx,
                task: Some(task),
            },
        );
        Ok(BatchId(id))
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        let batches = lock(&self.inner.batches);
        let b = batches.get(&batch.0).ok_or(Error::UnknownBatch(batch))?;
        let mut states = b.state.states();
        let finished = b.done.borrow().is_some();
        if !finished {
            // A notification may still be on its way: keep the last request
            // pending until the batch is really over.
            if let Some(last) = states.last_mut() {
                if last.is_terminal() {
                    *last = TransferState::Pending { transferred: 0 };
                }
            }
        }
        Ok(BatchStatus { states })
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        let mut done = lock(&self.inner.batches)
            .get(&batch.0)
            .ok_or(Error::UnknownBatch(batch))?
            .done
            .clone();
        let outcome = match done.wait_for(Option::is_some).await {
            Ok(v) => v.clone().unwrap_or(Ok(())),
            Err(_) => Err(Error::Canceled(format!("batch {batch} was canceled"))),
        };
        let b = lock(&self.inner.batches)
            .remove(&batch.0)
            .ok_or(Error::UnknownBatch(batch))?;
        outcome?;
        Ok(BatchReport {
            results: b.state.results(),
        })
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        let mut batches = lock(&self.inner.batches);
        let b = batches.get(&batch.0).ok_or(Error::UnknownBatch(batch))?;
        if b.done.borrow().is_none() {
            return Err(Error::BatchBusy(batch));
        }
        batches.remove(&batch.0);
        Ok(())
    }

    fn live_batches(&self) -> Option<usize> {
        Some(lock(&self.inner.batches).len())
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        // The queue's memory goes to the caller with it (the count restarts
        // from zero; see MAX_QUEUED_NOTIFICATION_BYTES for the bound).
        let mut q = lock(&self.inner.core.notifications);
        q.bytes = 0;
        Ok(Vec::from(std::mem::take(&mut q.queue)))
    }
}
