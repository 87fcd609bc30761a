//! [`TcpEngine`]: the [`TransferEngine`] implementation.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use ferry_core::__private::sync::lock;
use ferry_core::raw::{BatchDriver, BatchTable};
use ferry_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, Error, FastCall, FastPath,
    MemoryKinds, MemoryRegion, Notification, Result, SegmentId, TransferEngine, TransferRequest,
};
use tokio::task::AbortHandle;

use crate::client::Peer;
use crate::config::TcpConfig;
use crate::copy_gate::CopyGate;
use crate::server::{accept_loop, Core};

const BACKEND: &str = "tcp";

/// An open segment handle. Handles to the same name share one [`Peer`]
/// (and its connections).
struct Handle {
    peer: Arc<Peer>,
    /// Transfers hold it shared; closing the handle takes it exclusively.
    gate: tokio::sync::RwLock<bool>,
    /// Copies on the calling thread (granted ones) pass it; closing the
    /// handle closes it after the `gate`, waiting for them.
    copies: CopyGate,
}

#[derive(Default)]
struct Segments {
    by_id: HashMap<u64, Arc<Handle>>,
    /// Peer and number of open handles to it.
    by_name: HashMap<String, (Arc<Peer>, usize)>,
}

struct Inner {
    core: Arc<Core>,
    segments: Mutex<Segments>,
    /// The asynchronous batches callers hold ids for.
    batches: BatchTable,
    /// The tasks driving asynchronous batches (finished ones are pruned
    /// as new ones start); aborted by `shutdown`.
    tasks: Mutex<Vec<AbortHandle>>,
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
///
/// Memory it has registered may be freed once `unregister` of it, or
/// `shutdown`, has returned `Ok`. Dropping the engine does not wait: a
/// same-host initiator that marked a granted copy before the drop (and was
/// stopped between its mark and its copy) may still complete that one
/// copy, so free memory of a dropped engine only after `shutdown` (or
/// `RegisteredBuffer`, which unregisters before it frees).
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
    /// Fails with [`Error::InvalidArgument`] for a bad configuration — an
    /// address beyond loopback without a `secret` included, unless
    /// `insecure` says so — and [`Error::Io`] if the address cannot be
    /// resolved or bound. The
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
        // Files first: a bad one is an error before anything is bound.
        let tls = crate::tls::TlsContext::new(&config)?;
        // Mutual certificate authentication that no peer can skip counts
        // as authentication too.
        let certified = tls.as_ref().is_some_and(|t| {
            t.mode == crate::tls::TlsMode::Require
                && t.identity == crate::tls::Identity::Certificates
        });
        if !addr.ip().is_loopback() && config.secret.is_none() && !config.insecure && !certified {
            return Err(Error::InvalidArgument(format!(
                "refusing to listen on {addr} without a secret: any host that can reach this \
                 port could read and write every registered byte. Set a shared secret (for \
                 `ferry serve`: the FERRY_SECRET environment variable or --secret-file; in a \
                 URL: secret=, visible in the process list), listen on a loopback address, or \
                 accept the exposure explicitly with insecure=1 (`ferry serve --insecure`)"
            )));
        }
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
        let mut core = Core::new(bound.to_string(), config);
        core.tls = tls;
        let core = Arc::new(core);
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&core))).abort_handle();
        tracing::debug!(segment = %core.name, "tcp engine started");
        Ok(TcpEngine {
            inner: Arc::new(Inner {
                core,
                segments: Mutex::new(Segments::default()),
                batches: BatchTable::new(BACKEND),
                tasks: Mutex::new(Vec::new()),
                accept: Mutex::new(Some(accept)),
            }),
        })
    }

    /// Parses `url` with [`TcpConfig::from_url`] and starts an engine.
    pub async fn open(url: &str) -> Result<TcpEngine> {
        Self::start(TcpConfig::from_url(url)?).await
    }

    /// What this engine negotiated with the peer segment `name` on its
    /// latest connection: both version ranges, the version in use, every
    /// optional feature on or off and why, and the payload path. `None` if
    /// the segment is not open (or never connected). Cheap; meant to be
    /// logged after `open_segment`.
    pub fn peer_report(&self, name: &str) -> Option<crate::PeerReport> {
        let peer = lock(&self.inner.segments)
            .by_name
            .get(name)
            .map(|(p, _)| Arc::clone(p))?;
        peer.report()
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &TcpConfig {
        &self.inner.core.config
    }

    /// Stops the listener and every inbound connection, closes every peer
    /// connection (their pending requests fail with [`Error::Canceled`]) and
    /// cancels the asynchronous batches, without waiting for the engine's
    /// tasks to end (`TransferEngine::shutdown` waits). From the moment it
    /// returns no inbound request is acted on (one already being served
    /// finishes) and no connection is welcomed: a peer sees its connection
    /// end, never an answer from an engine that has stopped. Registered
    /// regions stay registered. Idempotent; also done on drop.
    pub fn shutdown_now(&self) {
        drop(self.stop());
    }

    /// [`TcpEngine::shutdown_now`], returning the aborted tasks.
    fn stop(&self) -> Vec<AbortHandle> {
        self.inner.core.close();
        let mut stopped = Vec::new();
        if let Some(a) = lock(&self.inner.accept).take() {
            a.abort();
            stopped.push(a);
        }
        let peers: Vec<Arc<Peer>> = {
            let mut segs = lock(&self.inner.segments);
            segs.by_id.clear();
            segs.by_name.drain().map(|(_, (p, _))| p).collect()
        };
        for p in peers {
            p.close();
        }
        // An aborted task drops its batch's driver, which fails what the
        // batch had not reported with `Canceled`: no waiter hangs.
        for t in lock(&self.inner.tasks).drain(..) {
            t.abort();
            stopped.push(t);
        }
        stopped
    }

    /// Makes this engine refuse (`true`) or accept again (`false`) the
    /// notifications peers send it. A refused notification is answered
    /// `NotifyQueueFull`: the sender's batch (whose data has landed) fails
    /// its last request. For fault tests.
    pub fn set_refuse_notifications(&self, refuse: bool) {
        self.inner
            .core
            .refuse_notifications
            .store(refuse, Ordering::Relaxed);
    }

    /// The synchronous fast path of `segment` ([`FastPath`]): a request
    /// the target granted (a small same-host copy) is done by the calling
    /// thread, exactly as `transfer` does it first; anything else is
    /// declined, and `transfer` runs it. `None` for an unknown segment.
    /// The path keeps the segment's handle: once the segment is closed it
    /// declines everything (the handle's gate is shut), and `transfer`
    /// says the segment is unknown.
    pub fn fast_path(&self, segment: SegmentId) -> Option<FastPath> {
        let handle = self.handle(segment).ok()?;
        // A batch of one is checked as `check_batch` would (its only
        // limit for one request without a notification).
        let batch_ok = self.inner.core.config.max_batch >= 1;
        Some(FastPath::new(move |request, call| {
            if call == FastCall::BatchOfOne && !batch_ok {
                return None;
            }
            granted_now(&handle, request).then_some(Ok(()))
        }))
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

/// Records what the handshake with `peer` settled on the current span:
/// the `ferry_connect` span of `ferry_core`'s tracing layer when one wraps
/// this engine (its `CONNECT_FIELDS`); nothing, and no work, otherwise.
fn record_handshake(peer: &Peer) {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    let Some(r) = peer.report() else {
        return;
    };
    span.record("version", r.version);
    span.record("peer_versions", tracing::field::display(&r.theirs));
    span.record("path", r.path.as_str());
    match &r.tls {
        Ok(suite) => span.record("tls", suite.as_str()),
        Err(why) => span.record("tls", tracing::field::display(format_args!("off: {why}"))),
    };
    let on: Vec<&str> = r
        .features
        .iter()
        .filter(|f| f.off.is_none())
        .map(|f| f.name)
        .collect();
    span.record("features", on.join(",").as_str());
}

impl Drop for TcpEngine {
    fn drop(&mut self) {
        self.shutdown_now();
    }
}

/// A small call the target granted, copied here and now while the handle
/// is open (a closing handle waits for it, as for a batch): whether it was
/// (see [`Peer::granted_one`]).
fn granted_now(handle: &Handle, request: &TransferRequest) -> bool {
    handle
        .copies
        .enter()
        .is_some_and(|_pass| handle.peer.granted_one(request))
}

/// Runs a batch on the peer behind `handle`, reporting to `driver`;
/// [`Error::UnknownSegment`] (nothing moved) if the handle is being closed.
async fn run_on(
    handle: &Handle,
    segment: SegmentId,
    requests: &[TransferRequest],
    notify: Option<&Notification>,
    driver: &BatchDriver,
) -> Result<BatchReport> {
    let open = handle.gate.read().await;
    if !*open {
        return Err(Error::UnknownSegment(segment));
    }
    handle.peer.run_batch(requests, notify, driver).await
}

impl TransferEngine for TcpEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        &self.inner.core.name
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::all();
        caps.max_batch_len = Some(self.inner.core.config.max_batch);
        caps.memory = MemoryKinds {
            host: true,
            cuda: false,
        };
        caps
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
            (
                "protocol".to_owned(),
                format!("ferry-tcp {} (negotiated)", crate::VersionRange::OURS),
            ),
            ("connections per peer".to_owned(), c.connections.to_string()),
            (
                "authentication".to_owned(),
                if c.secret.is_some() {
                    "HMAC-SHA256 shared secret".to_owned()
                } else {
                    "none".to_owned()
                },
            ),
            (
                "tls".to_owned(),
                match &self.inner.core.tls {
                    None => "off".to_owned(),
                    Some(t) => format!(
                        "{} (TLS 1.3, {}; the same-host path is not encrypted)",
                        if t.mode == crate::tls::TlsMode::Require {
                            "require"
                        } else {
                            "on"
                        },
                        t.identity.describe()
                    ),
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

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        region.require_host("tcp")?;
        self.inner.core.register(region)
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.core.unregister(addr).await
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
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
        record_handshake(&peer);
        let mut segs = lock(&self.inner.segments);
        let entry = segs
            .by_name
            .entry(name.to_owned())
            .or_insert_with(|| (Arc::clone(&peer), 0));
        entry.1 += 1;
        let peer = Arc::clone(&entry.0);
        let id = SegmentId::fresh().0;
        segs.by_id.insert(
            id,
            Arc::new(Handle {
                peer,
                gate: tokio::sync::RwLock::new(true),
                copies: CopyGate::new(),
            }),
        );
        Ok(SegmentId(id))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let handle = self.handle(segment)?;
        // Wait for the handle's transfers in flight. Up to here a dropped
        // future has changed nothing: the handle is still open and in the
        // table. From the gate on nothing awaits, so the handle is closed,
        // leaves the table and its peer's count drops in one step (before,
        // the handle left the table first, and a future dropped while it
        // waited for the gate leaked the peer and its tasks until shutdown).
        let mut open = handle.gate.write().await;
        if !*open {
            return Err(Error::UnknownSegment(segment));
        }
        *open = false;
        handle.copies.close();
        drop(open);
        let last = {
            let mut segs = lock(&self.inner.segments);
            if segs
                .by_id
                .get(&segment.0)
                .is_some_and(|h| Arc::ptr_eq(h, &handle))
            {
                segs.by_id.remove(&segment.0);
            }
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
        if granted_now(&handle, &request) {
            return Ok(());
        }
        // The general path, boxed: its state (some kilobytes) would
        // otherwise be part of every caller's future, moved by each layer
        // above on every call, the granted ones included.
        Box::pin(async move {
            let driver = BatchDriver::detached(1);
            let report = run_on(
                &handle,
                segment,
                std::slice::from_ref(&request),
                None,
                &driver,
            )
            .await?;
            report
                .results
                .into_iter()
                .next()
                .unwrap_or_else(|| Err(Error::Canceled("no result".into())))
        })
        .await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let handle = self.handle(segment)?;
        self.check_batch(requests, notify)?;
        // One small request the target granted, nothing to deliver after:
        // as `transfer`.
        if let ([request], None) = (requests, notify) {
            if granted_now(&handle, request) {
                return Ok(BatchReport::all_ok(1));
            }
        }
        // Boxed as in `transfer`.
        Box::pin(async move {
            let driver = BatchDriver::detached(requests.len());
            run_on(&handle, segment, requests, notify, &driver).await
        })
        .await
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let handle = self.handle(segment)?;
        self.check_batch(requests, notify)?;
        // Claimed only when the id is returned: a submit dropped before
        // that takes the id back.
        let admission = self.inner.batches.admit(requests.len())?;
        let driver = admission.driver().clone();
        if requests.is_empty() {
            // Nothing to wait for: deliver the notification now, so that a
            // batch that `status` shows finished has delivered it; a failed
            // notification refuses the batch (nothing moved) and the
            // unclaimed admission takes the id back.
            Box::pin(run_on(&handle, segment, requests, notify, &driver)).await?;
            return Ok(admission.claim());
        }
        let requests = requests.to_vec();
        let notify = notify.cloned();
        // Hold the task list while spawning, so that `shutdown` cannot miss
        // the task.
        let mut tasks = lock(&self.inner.tasks);
        tasks.retain(|t| !t.is_finished());
        let task = tokio::spawn(async move {
            if let Err(e) = run_on(&handle, segment, &requests, notify.as_ref(), &driver).await {
                // Refused before anything moved (the handle was closing).
                driver.fail_unreported(&e);
                let _ = driver.finish(None);
            }
        })
        .abort_handle();
        tasks.push(task);
        drop(tasks);
        Ok(admission.claim())
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.batches.status(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        self.inner.batches.wait(batch).await
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        self.inner.batches.release(batch)
    }

    fn live_batches(&self) -> Option<usize> {
        Some(self.inner.batches.len())
    }

    /// Counted by the server where each inbound request is served: the
    /// bytes of WRITE / WRITEV frames once they have landed, of READ /
    /// READV once sent, and of the same-host copies (CWRITE / CREAD and
    /// the staged SWRITE / SREAD) once done, per peer (by the engine name
    /// it gave in the handshake) and direction; refused segments are not
    /// counted. With the inbox's dropped notifications.
    fn inbound(&self) -> Option<ferry_core::Inbound> {
        Some(ferry_core::Inbound::weak(&self.inner.core))
    }

    async fn shutdown(&self) -> Result<()> {
        // An aborted task ends at its next poll; the listener's and the
        // batches' tasks hold no lock across an await that could keep it.
        let stopped = self.stop();
        while stopped.iter().any(|t| !t.is_finished()) {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        // Same-host initiators copy into the regions themselves, under
        // grants `stop` has revoked: a copy marked before may still be on
        // its way. Shut down means none is.
        let patience = self.inner.core.config.stall_timeout;
        if let Err((addr, pid)) = self.inner.core.grants.settle_all(patience).await {
            return Err(Error::RegionHeld {
                addr,
                reason: format!(
                    "the engine is shut down, but the same-host peer process {pid} may still \
                     copy into its region under a grant it marked before, and has not finished \
                     within {patience:?} (is its process stopped?); shut down again later"
                ),
            });
        }
        Ok(())
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        // The queue's memory goes to the caller with it (the count restarts
        // from zero; see MAX_QUEUED_NOTIFICATION_BYTES for the bound).
        Ok(self.inner.core.notifications.take_all())
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        Ok(self.inner.core.notifications.next(name).await?)
    }
}
