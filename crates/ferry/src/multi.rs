//! `multi://`: one engine over several transports (issue 45; the design is
//! `docs/design/multi-transport.md`).
//!
//! A [`MultiEngine`] owns one inner [`Engine`] per transport, each opened
//! through the scheme [`registry`](crate::registry) from its own URL, in
//! the order of preference. It owns no socket of its own:
//!
//! - **Memory** is registered in every inner engine, the same address and
//!   length in each, all or nothing (a failure unregisters it from the
//!   engines that took it); `unregister` returns once every inner engine's
//!   `unregister` returned, so the promise of each transport holds for the
//!   union.
//! - **Its segment name** lists the inner engines' own, best first:
//!   `ferry-multi:tcp=10.0.0.1:7000;tcp=10.0.0.1:7001` (each part
//!   `scheme=segment name`, `%`, `;` and `=` percent-encoded). A peer given
//!   by a plain `host:port` is a TCP-only peer (a single-transport Ferry,
//!   an older one, a Mooncake peer).
//! - **`open_segment`** keeps the transports both sides have, in *our*
//!   order of preference (for each of ours, the peer's of that scheme in
//!   its order), opens the first and falls to the next on a
//!   transport-class error (the peer unreachable or lost, a timeout, an
//!   I/O or protocol error, a transport that is unavailable or shut down).
//!   None in common is [`Error::Unavailable`] naming both lists. Which
//!   transport was chosen, to which address and why is
//!   [`MultiEngine::choice`] ([`Engine::transport_choice`] by name).
//! - **Transfers** on a segment go over the transport chosen for it; a
//!   batch id is the multi engine's own, mapped to the inner engine's.
//! - **Notifications** received are the union of the inner engines'.
//!
//! Failover of a batch whose transport dies under it (the design's §4) is
//! not built yet: a transfer fails with the inner engine's error, and a
//! later `open_segment` chooses again.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use ferry_core::__private::sync::lock;
use ferry_core::inbound::InboundSource;
use ferry_core::raw::ParsedUrl;
use ferry_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, DynTransferEngine, Error,
    ErrorKind, Inbound, InboundSnapshot, MemoryRegion, MissingCapability, Notification,
    NotificationsDropped, Operation, Result, SegmentId, TransferEngine, TransferRequest,
};

use crate::registry::{OpenOptions, Registry};
use crate::Engine;

/// The scheme of a multi engine's URL.
pub const SCHEME: &str = "multi";

/// What a multi engine's segment name starts with.
pub const SEGMENT_PREFIX: &str = "ferry-multi:";

/// The backend name a multi engine reports.
const BACKEND: &str = "multi";

/// One engine over several transports (see the [module](self)). Open it
/// with [`Engine::open`] of a `multi://` URL or [`Engine::open_multi`]
/// (both put it in the default stack), or bare with
/// [`MultiEngine::start`].
pub struct MultiEngine {
    /// The inner engines, best first.
    transports: Vec<Transport>,
    /// `ferry-multi:scheme=name;…`.
    name: String,
    /// What every inner engine does natively.
    caps: Capabilities,
    segments: Mutex<HashMap<SegmentId, Route>>,
    batches: Mutex<HashMap<BatchId, (usize, BatchId)>>,
    /// Notifications taken from an inner engine by a call that was dropped
    /// before it returned them: the next call returns them first.
    pending: Mutex<VecDeque<Notification>>,
    stopping: AtomicBool,
}

struct Transport {
    scheme: String,
    engine: Arc<Engine>,
}

/// A segment: the inner engine and its segment, and why.
struct Route {
    transport: usize,
    segment: SegmentId,
    choice: Arc<Choice>,
}

/// Which transport [`MultiEngine`]'s `open_segment` chose for a peer, and
/// why: the segment's report.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Choice {
    /// The segment name the peer was opened by.
    pub peer: String,
    /// The transport chosen (its scheme).
    pub transport: String,
    /// Which of our inner engines carries it (index into
    /// [`MultiEngine::transports`]).
    pub index: usize,
    /// The peer's segment name on that transport.
    pub address: String,
    /// Our transports, best first.
    pub ours: Vec<String>,
    /// The peer's transports as its segment name lists them (`tcp` alone
    /// for a plain `host:port`).
    pub theirs: Vec<String>,
    /// Whether the peer is a single-transport peer (a plain segment name).
    pub single_transport_peer: bool,
    /// The transports tried first that failed, with their errors.
    pub failed: Vec<(String, Error)>,
    /// Why this transport, in words.
    pub reason: String,
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} to {} (ours: {}; the peer's: {}): {}",
            self.transport,
            self.address,
            self.ours.join(", "),
            self.theirs.join(", "),
            self.reason
        )
    }
}

impl fmt::Debug for MultiEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiEngine")
            .field("segment", &self.name)
            .finish_non_exhaustive()
    }
}

impl MultiEngine {
    /// Opens one inner engine per URL, in order of preference (each through
    /// [`Registry::global`], without metrics or tracing of its own: the
    /// multi engine's stack observes), and composes them. If one fails to
    /// open, those already open are shut down and its error is returned.
    ///
    /// Errors: [`Error::InvalidArgument`] for no URL or a `multi://` URL
    /// among them; every error of [`Engine::open`].
    pub async fn start(urls: &[&str]) -> Result<MultiEngine> {
        let parsed = urls
            .iter()
            .map(|u| ParsedUrl::parse(u))
            .collect::<Result<Vec<_>>>()?;
        MultiEngine::open_parsed(parsed).await
    }

    async fn open_parsed(urls: Vec<ParsedUrl>) -> Result<MultiEngine> {
        if urls.is_empty() {
            return Err(Error::InvalidArgument(
                "a multi engine needs at least one transport".to_owned(),
            ));
        }
        if let Some(u) = urls.iter().find(|u| u.scheme() == SCHEME) {
            return Err(Error::InvalidArgument(format!(
                "a multi engine's transport cannot be a multi engine ({:?})",
                u.shown()
            )));
        }
        let mut transports: Vec<Transport> = Vec::with_capacity(urls.len());
        for url in urls {
            let options = OpenOptions::default().metrics(None).tracing(false);
            match Registry::global().open_parsed(url, options).await {
                Ok(engine) => transports.push(Transport {
                    scheme: engine.scheme().to_owned(),
                    engine: Arc::new(engine),
                }),
                Err(e) => {
                    for t in &transports {
                        if let Err(s) = t.engine.shutdown().await {
                            tracing::warn!(error = %s, "ferry multi: shutdown after a failed start");
                        }
                    }
                    return Err(e);
                }
            }
        }
        let name = format!(
            "{SEGMENT_PREFIX}{}",
            transports
                .iter()
                .map(|t| format!("{}={}", encode(&t.scheme), encode(t.engine.segment_name())))
                .collect::<Vec<_>>()
                .join(";")
        );
        let caps = common_capabilities(&transports);
        Ok(MultiEngine {
            transports,
            name,
            caps,
            segments: Mutex::new(HashMap::new()),
            batches: Mutex::new(HashMap::new()),
            pending: Mutex::new(VecDeque::new()),
            stopping: AtomicBool::new(false),
        })
    }

    /// The inner engines, best first, with their schemes. Calls on an
    /// inner engine bypass the multi engine (its registrations, its
    /// segment table): for reports, and for tests that stop one transport.
    pub fn transports(&self) -> impl Iterator<Item = (&str, &Arc<Engine>)> + '_ {
        self.transports
            .iter()
            .map(|t| (t.scheme.as_str(), &t.engine))
    }

    /// The transport chosen for `segment` (a handle of this engine) and why.
    pub fn choice(&self, segment: SegmentId) -> Option<Choice> {
        lock(&self.segments)
            .get(&segment)
            .map(|r| Choice::clone(&r.choice))
    }

    /// The transport chosen for the peer opened as `name` (the latest open
    /// segment to it) and why.
    pub fn choice_for(&self, name: &str) -> Option<Choice> {
        lock(&self.segments)
            .iter()
            .filter(|(_, r)| r.choice.peer == name)
            .max_by_key(|(id, _)| **id)
            .map(|(_, r)| Choice::clone(&r.choice))
    }

    fn schemes(&self) -> Vec<String> {
        self.transports.iter().map(|t| t.scheme.clone()).collect()
    }

    fn dyns(&self) -> Vec<Arc<dyn DynTransferEngine>> {
        self.transports
            .iter()
            .map(|t| Arc::clone(&t.engine) as Arc<dyn DynTransferEngine>)
            .collect()
    }

    fn running(&self) -> Result<()> {
        if self.stopping.load(Ordering::Acquire) {
            Err(Error::Canceled(
                "the multi engine is shutting down".to_owned(),
            ))
        } else {
            Ok(())
        }
    }

    fn route(&self, segment: SegmentId) -> Result<(Arc<Engine>, SegmentId)> {
        let segments = lock(&self.segments);
        let r = segments
            .get(&segment)
            .ok_or(Error::UnknownSegment(segment))?;
        Ok((Arc::clone(&self.transports[r.transport].engine), r.segment))
    }

    fn batch(&self, batch: BatchId) -> Result<(Arc<Engine>, BatchId)> {
        let (i, inner) = *lock(&self.batches)
            .get(&batch)
            .ok_or(Error::UnknownBatch(batch))?;
        Ok((Arc::clone(&self.transports[i].engine), inner))
    }

    /// Whether `e`, from an inner engine opening a segment, means "try the
    /// next transport": the transport failed, not the request.
    fn falls_through(&self, e: &Error) -> bool {
        !self.stopping.load(Ordering::Acquire)
            && matches!(
                e.kind(),
                ErrorKind::PeerUnreachable
                    | ErrorKind::PeerLost
                    | ErrorKind::Timeout
                    | ErrorKind::Protocol
                    | ErrorKind::Io
                    | ErrorKind::Unavailable
                    | ErrorKind::Backend
                    | ErrorKind::Canceled
            )
    }
}

/// An inner engine's error about its own handle, about ours.
fn seg_err(e: Error, inner: SegmentId, ours: SegmentId) -> Error {
    match e {
        Error::UnknownSegment(s) if s == inner => Error::UnknownSegment(ours),
        other => other,
    }
}

fn batch_err(e: Error, inner: BatchId, ours: BatchId) -> Error {
    match e {
        Error::UnknownBatch(b) if b == inner => Error::UnknownBatch(ours),
        Error::BatchBusy(b) if b == inner => Error::BatchBusy(ours),
        other => other,
    }
}

/// What every inner engine does natively: what the multi engine declares
/// native (its stack's adapter emulates the rest, or refuses it when
/// strict).
fn common_capabilities(transports: &[Transport]) -> Capabilities {
    let mut caps = Capabilities::all();
    for t in transports {
        let native = t.engine.report().native;
        for op in Operation::OPTIONAL {
            if !native.supports(op) {
                caps.set(op, false);
            }
        }
        caps.landed_writes &= native.landed_writes;
        caps.peer_validation &= native.peer_validation;
        caps.memory.host &= native.memory.host;
        caps.memory.cuda &= native.memory.cuda;
        caps.max_batch_len = match (caps.max_batch_len, native.max_batch_len) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    caps
}

/// Percent-encodes `%`, `;` and `=` (the separators of a multi segment
/// name).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            ';' => out.push_str("%3B"),
            '=' => out.push_str("%3D"),
            c => out.push(c),
        }
    }
    out
}

fn decode(s: &str, whole: &str) -> Result<String> {
    let bad = || {
        Error::InvalidArgument(format!(
            "multi segment name {whole:?}: a `%` not followed by two hex digits"
        ))
    };
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3).ok_or_else(bad)?;
            let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| Error::InvalidArgument(format!("multi segment name {whole:?} is not UTF-8")))
}

/// A peer's transports: `(scheme, segment name)`, best first.
#[derive(Debug, PartialEq, Eq)]
struct Peer {
    entries: Vec<(String, String)>,
    /// A plain segment name (no list).
    single: bool,
}

impl Peer {
    fn parse(name: &str) -> Result<Peer> {
        let Some(list) = name.strip_prefix(SEGMENT_PREFIX) else {
            // A plain name: TCP where it is host:port, else nothing known.
            let entries = if is_host_port(name) {
                vec![("tcp".to_owned(), name.to_owned())]
            } else {
                Vec::new()
            };
            return Ok(Peer {
                entries,
                single: true,
            });
        };
        let mut entries = Vec::new();
        for part in list.split(';').filter(|p| !p.is_empty()) {
            let Some((scheme, address)) = part.split_once('=') else {
                return Err(Error::InvalidArgument(format!(
                    "multi segment name {name:?}: {part:?} is not scheme=segment"
                )));
            };
            let scheme = decode(scheme, name)?.to_ascii_lowercase();
            let address = decode(address, name)?;
            if scheme.is_empty() || address.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "multi segment name {name:?}: {part:?} has an empty scheme or segment"
                )));
            }
            entries.push((scheme, address));
        }
        Ok(Peer {
            entries,
            single: false,
        })
    }

    fn schemes(&self) -> Vec<String> {
        self.entries.iter().map(|(s, _)| s.clone()).collect()
    }
}

/// `host:port` with a numeric port (`[v6]:port` too).
fn is_host_port(name: &str) -> bool {
    match name.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty() && !name.contains(['@', '/', ';']) && port.parse::<u16>().is_ok()
        }
        None => false,
    }
}

fn list(names: &[String], none: &str) -> String {
    if names.is_empty() {
        none.to_owned()
    } else {
        names.join(", ")
    }
}

/// The union of the inner engines' inbound counters.
struct InboundUnion(Vec<Inbound>);

impl InboundSource for InboundUnion {
    fn snapshot(&self) -> InboundSnapshot {
        let mut served: Option<BTreeMap<String, ferry_core::ServedCounts>> = None;
        let mut dropped: Option<NotificationsDropped> = None;
        for s in self.0.iter().map(Inbound::snapshot) {
            if let Some(m) = s.served {
                let all = served.get_or_insert_with(BTreeMap::new);
                for (peer, c) in m {
                    let t = all.entry(peer).or_default();
                    t.bytes_written = t.bytes_written.saturating_add(c.bytes_written);
                    t.bytes_read = t.bytes_read.saturating_add(c.bytes_read);
                    t.segments_written = t.segments_written.saturating_add(c.segments_written);
                    t.segments_read = t.segments_read.saturating_add(c.segments_read);
                }
            }
            if let Some(d) = s.notifications_dropped {
                let t = dropped.get_or_insert_with(NotificationsDropped::default);
                t.full = t.full.saturating_add(d.full);
                t.closed = t.closed.saturating_add(d.closed);
            }
        }
        let mut out = InboundSnapshot::new();
        if let Some(s) = served {
            out = out.with_served(s);
        }
        if let Some(d) = dropped {
            out = out.with_notifications_dropped(d);
        }
        out
    }
}

/// Undoes a registration in the first `n` engines; the error of the
/// first undo that failed (the region may stay registered there).
async fn undo(engines: &[Arc<dyn DynTransferEngine>], n: usize, addrs: &[u64]) -> Result<()> {
    let mut first = Ok(());
    for e in &engines[..n] {
        let r = if addrs.len() == 1 {
            e.unregister_dyn(addrs[0]).await
        } else {
            e.batch_unregister_dyn(addrs).await
        };
        if let Err(err) = r {
            tracing::warn!(error = %err, "ferry multi: undoing a registration failed");
            if first.is_ok() {
                first = Err(err);
            }
        }
    }
    first
}

/// What unregistering in every engine adds up to: `Ok` when it is
/// registered in none any more (some may not have had it); the
/// engines' `RegionNotRegistered` when none had it; else the first other
/// error.
fn combine_unregister(results: Vec<Result<()>>) -> Result<()> {
    let mut not_registered = None;
    let mut any_ok = false;
    for r in results {
        match r {
            Ok(()) => any_ok = true,
            Err(e @ Error::RegionNotRegistered { .. }) => {
                not_registered.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    match (any_ok, not_registered) {
        (false, Some(e)) => Err(e),
        _ => Ok(()),
    }
}

/// Runs `work` on a task of its own and waits for it: a dropped caller
/// leaves it running to its end (registration all or nothing, unregister
/// in every engine).
async fn detached<T: Send + 'static>(
    work: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    tokio::spawn(work)
        .await
        .map_err(|e| Error::Canceled(format!("the multi engine's task ended: {e}")))?
}

#[deny(clippy::missing_trait_methods)]
impl TransferEngine for MultiEngine {
    fn backend_name(&self) -> &str {
        BACKEND
    }

    fn segment_name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    fn backend_info(&self) -> BackendInfo {
        let mut details = vec![("transports".to_owned(), self.schemes().join(", "))];
        for t in &self.transports {
            details.push((t.scheme.clone(), t.engine.segment_name().to_owned()));
        }
        let not_native = Operation::OPTIONAL
            .into_iter()
            .filter(|op| !self.caps.supports(*op))
            .map(|op| MissingCapability {
                operation: op,
                reason: format!(
                    "not native on every transport ({})",
                    self.transports
                        .iter()
                        .filter(|t| !t.engine.report().native.supports(op))
                        .map(|t| t.scheme.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                min_version: None,
            })
            .collect();
        BackendInfo {
            backend: BACKEND.to_owned(),
            details,
            not_native,
            emulated: Vec::new(),
        }
    }

    async fn register(&self, region: MemoryRegion) -> Result<()> {
        self.running()?;
        let engines = self.dyns();
        let addr = region.addr();
        detached(async move {
            let (n, r) = ferry_core::raw::register_in_each(&engines, region).await;
            if let Err(e) = r {
                undo(&engines, n, &[addr]).await?;
                return Err(e);
            }
            Ok(())
        })
        .await
    }

    async fn unregister(&self, addr: u64) -> Result<()> {
        let engines = self.dyns();
        detached(async move {
            let mut results = Vec::with_capacity(engines.len());
            for e in &engines {
                results.push(e.unregister_dyn(addr).await);
            }
            combine_unregister(results)
        })
        .await
    }

    async fn batch_register(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        self.running()?;
        let engines = self.dyns();
        let addrs: Vec<u64> = regions.iter().map(|r| r.addr()).collect();
        detached(async move {
            let (n, r) = ferry_core::raw::batch_register_in_each(&engines, regions).await;
            if let Err(e) = r {
                undo(&engines, n, &addrs).await?;
                return Err(e);
            }
            Ok(())
        })
        .await
    }

    async fn batch_unregister(&self, addrs: &[u64]) -> Result<()> {
        let engines = self.dyns();
        let addrs = addrs.to_vec();
        detached(async move {
            let mut first = Ok(());
            for e in &engines {
                if let Err(err) = e.batch_unregister_dyn(&addrs).await {
                    if first.is_ok() {
                        first = Err(err);
                    }
                }
            }
            first
        })
        .await
    }

    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.running()?;
        let peer = Peer::parse(name)?;
        let ours = self.schemes();
        let theirs = peer.schemes();
        let candidates: Vec<(usize, usize)> = ours
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                peer.entries
                    .iter()
                    .enumerate()
                    .filter(move |(_, (t, _))| t == s)
                    .map(move |(j, _)| (i, j))
            })
            .collect();
        if candidates.is_empty() {
            return Err(Error::Unavailable {
                backend: BACKEND.to_owned(),
                reason: format!(
                    "no transport in common with {name:?}: ours: {}; the peer's: {}",
                    list(&ours, "none"),
                    list(&theirs, "none (not host:port, not a multi segment name)")
                ),
            });
        }
        let mut failed: Vec<(String, Error)> = Vec::new();
        for (i, j) in candidates {
            let t = &self.transports[i];
            let address = &peer.entries[j].1;
            match t.engine.open_segment(address).await {
                Ok(inner) => {
                    let mut reason = if peer.single {
                        format!(
                            "{}: the peer is a single-transport peer ({name} is host:port)",
                            t.scheme
                        )
                    } else {
                        format!("{}: both sides have it", t.scheme)
                    };
                    match failed.last() {
                        None if !peer.single => reason.push_str("; the first of ours in common"),
                        None => {}
                        Some((what, e)) => {
                            reason.push_str(&format!("; {what} failed first: {e}"));
                        }
                    }
                    let choice = Choice {
                        peer: name.to_owned(),
                        transport: t.scheme.clone(),
                        index: i,
                        address: address.clone(),
                        ours,
                        theirs,
                        single_transport_peer: peer.single,
                        failed,
                        reason,
                    };
                    tracing::debug!(peer = name, choice = %choice, "ferry multi: segment open");
                    let id = SegmentId::fresh();
                    lock(&self.segments).insert(
                        id,
                        Route {
                            transport: i,
                            segment: inner,
                            choice: Arc::new(choice),
                        },
                    );
                    return Ok(id);
                }
                Err(e) if self.falls_through(&e) => {
                    failed.push((format!("{} to {address}", t.scheme), e));
                }
                Err(e) => return Err(e),
            }
        }
        if failed.len() == 1 {
            return Err(failed.remove(0).1);
        }
        Err(Error::SegmentUnavailable {
            name: name.to_owned(),
            reason: failed
                .iter()
                .map(|(what, e)| format!("{what}: {e}"))
                .collect::<Vec<_>>()
                .join("; "),
        })
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let (engine, inner) = self.route(segment)?;
        match engine.close_segment(inner).await {
            // Closed before (a close dropped after the inner one ended).
            Ok(()) | Err(Error::UnknownSegment(_)) => {
                lock(&self.segments).remove(&segment);
                Ok(())
            }
            Err(e) => Err(seg_err(e, inner, segment)),
        }
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        let (engine, inner) = self.route(segment)?;
        engine
            .transfer(inner, request)
            .await
            .map_err(|e| seg_err(e, inner, segment))
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let (engine, inner) = self.route(segment)?;
        engine
            .batch_transfer(inner, requests, notify)
            .await
            .map_err(|e| seg_err(e, inner, segment))
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let (index, inner) = {
            let segments = lock(&self.segments);
            let r = segments
                .get(&segment)
                .ok_or(Error::UnknownSegment(segment))?;
            (r.transport, r.segment)
        };
        let engine = Arc::clone(&self.transports[index].engine);
        let batch = engine
            .submit(inner, requests, notify)
            .await
            .map_err(|e| seg_err(e, inner, segment))?;
        let id = BatchId::fresh();
        lock(&self.batches).insert(id, (index, batch));
        Ok(id)
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        let (engine, inner) = self.batch(batch)?;
        engine.status(inner).map_err(|e| batch_err(e, inner, batch))
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        let (engine, inner) = self.batch(batch)?;
        let r = engine.wait(inner).await;
        if matches!(r, Ok(_) | Err(Error::UnknownBatch(_))) {
            lock(&self.batches).remove(&batch);
        }
        r.map_err(|e| batch_err(e, inner, batch))
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        let (engine, inner) = self.batch(batch)?;
        let r = engine.release_batch(inner).await;
        if matches!(r, Ok(()) | Err(Error::UnknownBatch(_))) {
            lock(&self.batches).remove(&batch);
        }
        r.map_err(|e| batch_err(e, inner, batch))
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        let mut first_err = None;
        let mut any = false;
        for t in &self.transports {
            match t.engine.take_notifications().await {
                Ok(v) => {
                    any = true;
                    // Kept before anything else is awaited: a call dropped
                    // from here on loses none.
                    lock(&self.pending).extend(v);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let taken: Vec<Notification> = lock(&self.pending).drain(..).collect();
        match first_err {
            Some(e) if !any && taken.is_empty() => Err(e),
            _ => Ok(taken),
        }
    }

    async fn next_notification(&self, name: Option<&str>) -> Result<Notification> {
        {
            let mut pending = lock(&self.pending);
            if let Some(i) = pending
                .iter()
                .position(|n| name.is_none_or(|want| n.name == want))
            {
                if let Some(n) = pending.remove(i) {
                    return Ok(n);
                }
            }
        }
        // Each inner wait is cancel-safe and the first to end is returned:
        // the others are dropped having taken nothing. An inner engine that
        // ends (shut down alone, or without notifications) leaves the
        // others waiting; the first error is returned when all have ended.
        let mut waits: Vec<Option<_>> = self
            .transports
            .iter()
            .map(|t| Some(t.engine.next_notification_dyn(name)))
            .collect();
        let mut first_err: Option<Error> = None;
        std::future::poll_fn(|cx| {
            let mut live = 0;
            for slot in waits.iter_mut() {
                let Some(w) = slot else { continue };
                match w.as_mut().poll(cx) {
                    Poll::Ready(Ok(n)) => return Poll::Ready(Ok(n)),
                    Poll::Ready(Err(e)) => {
                        *slot = None;
                        first_err.get_or_insert(e);
                    }
                    Poll::Pending => live += 1,
                }
            }
            if live == 0 {
                Poll::Ready(Err(first_err.take().unwrap_or_else(|| {
                    Error::Canceled("the multi engine has no transport left".to_owned())
                })))
            } else {
                Poll::Pending
            }
        })
        .await
    }

    fn live_batches(&self) -> Option<usize> {
        self.transports
            .iter()
            .map(|t| t.engine.live_batches())
            .sum()
    }

    fn inbound(&self) -> Option<Inbound> {
        let all: Vec<Inbound> = self
            .transports
            .iter()
            .filter_map(|t| t.engine.inbound())
            .collect();
        (!all.is_empty()).then(|| Inbound::new(Arc::new(InboundUnion(all))))
    }

    async fn shutdown(&self) -> Result<()> {
        self.stopping.store(true, Ordering::Release);
        let mut first = Ok(());
        for t in &self.transports {
            if let Err(e) = t.engine.shutdown().await {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

/// `multi://?transports=a,b&a.url=…&b.url=…&secret=…`: the inner URLs,
/// best first, from the URL's parameters (see the crate README).
pub(crate) fn from_url(
    mut url: ParsedUrl,
) -> Result<impl Future<Output = Result<MultiEngine>> + Send + 'static> {
    url.expect_params_only(
        SCHEME,
        "multi://?transports=tcp,tcp2&tcp2.url=tcp%3A%2F%2F0.0.0.0%3A7001",
    )?;
    let names = url.take_list("transports")?.unwrap_or_default();
    if names.is_empty() {
        return Err(Error::InvalidArgument(
            "a multi:// URL needs `transports=` (its transports, best first, e.g. \
             `transports=verbs,tcp`)"
                .to_owned(),
        ));
    }
    let secret = url.take_secret("secret")?;
    let mut inner = Vec::with_capacity(names.len());
    for (k, name) in names.iter().enumerate() {
        if names[..k].contains(name) {
            return Err(Error::InvalidArgument(format!(
                "multi:// transport {name:?} is listed twice; give the second another name \
                 and its URL under `<name>.url`"
            )));
        }
        let given = url.take_str(&format!("{name}.url"))?;
        let text = match (&given, name.as_str()) {
            (Some(u), _) => u.clone(),
            (None, "tcp") => "tcp://0.0.0.0:0".to_owned(),
            (None, other) => format!("{other}://"),
        };
        let mut parsed = ParsedUrl::parse(&text)?;
        if given.is_some() && crate::secret::url_has_secret(&parsed) {
            return Err(Error::InvalidArgument(format!(
                "multi:// transport {name:?}: give the secret to the multi URL (`secret=`, \
                 `secret_file=` or the environment), not inside `{name}.url`; it passes to \
                 every transport that takes one"
            )));
        }
        if let Some(s) = &secret {
            if crate::secret::takes_secret(parsed.scheme()) {
                parsed.insert("secret", s.expose())?;
            }
        }
        inner.push(parsed);
    }
    url.finish()?;
    Ok(MultiEngine::open_parsed(inner))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_round_trip_and_plain_names_are_tcp() {
        let odd = "a;b=c%d";
        let name = format!("{SEGMENT_PREFIX}tcp=127.0.0.1:1;verbs={}", encode(odd));
        let p = Peer::parse(&name).unwrap();
        assert_eq!(
            p.entries,
            [
                ("tcp".to_owned(), "127.0.0.1:1".to_owned()),
                ("verbs".to_owned(), odd.to_owned())
            ]
        );
        assert!(!p.single);
        let p = Peer::parse("10.0.0.1:7000").unwrap();
        assert_eq!(p.schemes(), ["tcp"]);
        assert!(p.single);
        assert!(Peer::parse("[::1]:7000").unwrap().schemes() == ["tcp"]);
        assert!(Peer::parse("no-port").unwrap().entries.is_empty());
        for bad in ["tcp", "=x", "tcp=%4", "tcp=%zz"] {
            assert!(
                matches!(
                    Peer::parse(&format!("{SEGMENT_PREFIX}{bad}")),
                    Err(Error::InvalidArgument(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn unregister_adds_up() {
        let nr = || Err(Error::RegionNotRegistered { addr: 1 });
        assert_eq!(combine_unregister(vec![Ok(()), nr()]), Ok(()));
        assert_eq!(combine_unregister(vec![nr(), nr()]), nr());
        let held = Err(Error::RegionHeld {
            addr: 1,
            reason: "x".into(),
        });
        assert_eq!(combine_unregister(vec![Ok(()), held.clone()]), held);
    }
}
