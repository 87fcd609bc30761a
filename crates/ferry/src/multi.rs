//! `multi://`: one engine over several transports (issue 45; the design is
//! `docs/design/multi-transport.md`).
//!
//! A [`MultiEngine`] owns one inner [`Engine`] per transport, each opened
//! through the scheme [`registry`](crate::registry) from its own URL, in
//! the order of preference. It owns no socket of its own:
//!
//! - **Memory** is registered in every inner engine, the same address and
//!   length in each, all or nothing (a failure unregisters it from the
//!   engines that took it; where that undo fails, its error is returned
//!   instead of the refusal, e.g. `RegionHeld`); `unregister` returns once every inner engine's
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
//! - **Transfers** on a segment go over the transport chosen for it. When
//!   that transport fails under them (the same errors, but a timeout: a
//!   transport may still land a timed-out request's bytes), the requests not
//!   confirmed go again, as one batch, over the next transport both sides
//!   have (`transfer`, `batch_transfer`, `submit` alike); every outcome is
//!   reported once, and a request confirmed is never sent again. The
//!   failed transport backs off for that segment (1 s, doubling to 30 s)
//!   and is tried again by the first call after it. A batch's
//!   notification, where the peer can be reached over more than one
//!   transport, is sent alone once every request succeeded, over the
//!   transport that carried the end. To a multi engine listing two or more
//!   transports it carries a batch tag (in its message, stripped by the
//!   receiving multi engine, which drops a tag it delivered already: the
//!   latest 4096 per sending segment), so after any failure of the
//!   transport it goes again over the next; to any other peer it goes
//!   again only when the failure says it was not sent (`Retry::Temporary`),
//!   else the batch fails `MaybeApplied`. Delivered once either way. The
//!   caller's deadline (`TransferEngineExt`, `TimeoutLayer`) bounds it all.
//!   Failovers are counted (`ferry_failovers_total{peer, from, to}`, and
//!   `ferry_transport_chosen{peer, transport}`, through
//!   [`TransferEngine::inbound`]) and listed in the segment's [`Choice`].
//!   After a failover the bytes of every request that succeeded are the
//!   source's; a request that failed may have written some, all or none
//!   of its destination (as for any `MaybeApplied` error).
//! - **Notifications** received are the union of the inner engines'.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use ferry_core::__private::sync::lock;
use ferry_core::inbound::InboundSource;
use ferry_core::raw::{BatchDriver, BatchTable, ParsedUrl};
use ferry_core::{
    BackendInfo, BatchId, BatchReport, BatchStatus, Capabilities, DynTransferEngine, Error,
    ErrorKind, Inbound, InboundSnapshot, MemoryRegion, MissingCapability, Notification,
    NotificationsDropped, Operation, Result, Retry, SegmentId, TransferEngine, TransferRequest,
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
    transports: Arc<Vec<Transport>>,
    /// `ferry-multi:scheme=name;…`.
    name: String,
    /// What every inner engine does natively.
    caps: Capabilities,
    segments: Arc<Mutex<HashMap<SegmentId, Arc<Route>>>>,
    /// Failovers per peer and transports, for the metrics.
    counts: Arc<Counts>,
    /// The notification tags delivered, per sending segment.
    seen: Mutex<Seen>,
    /// Submitted batches (each run by a task of its own, failing over).
    table: BatchTable,
    /// Notifications taken from an inner engine by a call that was dropped
    /// before it returned them: the next call returns them first.
    pending: Mutex<VecDeque<Notification>>,
    stopping: Arc<AtomicBool>,
}

struct Transport {
    scheme: String,
    engine: Arc<Engine>,
}

/// First back-off of a transport that failed to a peer; it doubles at
/// each failure in a row, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest back-off.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Failures a [`Choice`] keeps (the latest).
const MAX_FAILED_KEPT: usize = 16;

/// A segment: the transports both sides have, in order (the candidates),
/// what was opened on each, how each fared, and the report.
struct Route {
    id: SegmentId,
    candidates: Vec<Candidate>,
    state: Mutex<RouteState>,
    /// Where the peer is a multi engine listing two or more transports:
    /// this segment's tag sender (random) and its last notification
    /// sequence number (see [`Tag`]).
    tags: Option<(u64, AtomicU64)>,
}

impl Route {
    /// The tag of the next notified batch, where the peer reads tags.
    fn next_tag(&self) -> Option<Tag> {
        let (sender, seq) = self.tags.as_ref()?;
        Some(Tag {
            sender: *sender,
            seq: seq.fetch_add(1, Ordering::Relaxed) + 1,
        })
    }
}

struct Candidate {
    transport: usize,
    address: String,
    /// Its label in the metrics: the scheme where each side has one
    /// transport of it, else `scheme#i.j` (our transport `i`, the peer's
    /// `j`-th entry).
    label: String,
}

struct RouteState {
    /// The inner segment opened on each candidate.
    open: Vec<Option<SegmentId>>,
    /// Inner segments opened twice by calls that raced: closed with the
    /// segment.
    spare: Vec<(usize, SegmentId)>,
    /// The candidates backing off after a failure.
    down: Vec<Option<Down>>,
    /// The candidate that carried the latest transfer.
    current: usize,
    choice: Choice,
}

#[derive(Clone, Copy)]
struct Down {
    until: Instant,
    backoff: Duration,
}

/// Which transport [`MultiEngine`]'s `open_segment` chose for a peer, and
/// why: the segment's report. After a failover it names the transport
/// that carries the segment now.
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
    /// The transports that failed (when opening, or under a transfer),
    /// with their errors: the latest 16.
    pub failed: Vec<(String, Error)>,
    /// How many times transfers on the segment moved to another transport.
    pub failovers: u64,
    /// Those moves: from which transport to which (each `scheme to
    /// address`), and how many times, in the order first seen.
    pub failed_over: Vec<(String, String, u64)>,
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
        )?;
        for (k, (from, to, n)) in self.failed_over.iter().enumerate() {
            let lead = if k == 0 { "; failed over: " } else { ", " };
            write!(f, "{lead}{from} -> {to} ({n}x)")?;
        }
        Ok(())
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
            transports: Arc::new(transports),
            name,
            caps,
            segments: Arc::new(Mutex::new(HashMap::new())),
            counts: Arc::new(Counts::default()),
            seen: Mutex::new(Seen::default()),
            table: BatchTable::new(BACKEND),
            pending: Mutex::new(VecDeque::new()),
            stopping: Arc::new(AtomicBool::new(false)),
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

    /// The transport carrying `segment` (a handle of this engine) and why.
    pub fn choice(&self, segment: SegmentId) -> Option<Choice> {
        let route = Arc::clone(lock(&self.segments).get(&segment)?);
        let choice = lock(&route.state).choice.clone();
        Some(choice)
    }

    /// The transport carrying the peer opened as `name` (the latest open
    /// segment to it) and why.
    pub fn choice_for(&self, name: &str) -> Option<Choice> {
        let routes: Vec<Arc<Route>> = lock(&self.segments).values().cloned().collect();
        routes
            .into_iter()
            .filter_map(|r| {
                let choice = lock(&r.state).choice.clone();
                (choice.peer == name).then_some((r.id, choice))
            })
            .max_by_key(|(id, _)| *id)
            .map(|(_, c)| c)
    }

    /// `n` as received from an inner engine: without its tag, or `None`
    /// for a tag delivered already (a resend whose first copy arrived).
    fn received(&self, n: Notification) -> Option<Notification> {
        match Tag::strip(n) {
            (None, n) => Some(n),
            (Some(tag), n) => {
                if lock(&self.seen).first(tag) {
                    Some(n)
                } else {
                    tracing::debug!(name = %n.name, "ferry multi: a notification delivered already, dropped");
                    None
                }
            }
        }
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

    /// What a call on `segment` works with.
    fn ctx(&self, segment: SegmentId) -> Result<Ctx> {
        let route = lock(&self.segments)
            .get(&segment)
            .cloned()
            .ok_or(Error::UnknownSegment(segment))?;
        Ok(Ctx {
            transports: Arc::clone(&self.transports),
            route,
            stopping: Arc::clone(&self.stopping),
            counts: Arc::clone(&self.counts),
        })
    }
}

/// What a transfer on one segment needs, shared with the task of a
/// submitted batch: the transports, the segment's route, the stop flag.
#[derive(Clone)]
struct Ctx {
    transports: Arc<Vec<Transport>>,
    route: Arc<Route>,
    stopping: Arc<AtomicBool>,
    counts: Arc<Counts>,
}

/// Whether `e` means "the transport failed, try the next": the peer
/// unreachable or lost, a timeout, an I/O, protocol or backend error, a
/// transport unavailable, or one shut down (`Canceled`) while the multi
/// engine runs. Not: addresses, registrations, arguments, authentication,
/// full queues (those are the request's, on every transport).
fn transport_failed(e: &Error, stopping: &AtomicBool) -> bool {
    !stopping.load(Ordering::Acquire)
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

impl Ctx {
    /// Whether a transfer that failed with `e` goes again over the next
    /// transport: [`transport_failed`], but not a `Timeout`, after which
    /// a transport may keep the connection and still land the request's
    /// bytes late (TCP does), after the batch succeeded elsewhere.
    fn fails_over(&self, e: &Error) -> bool {
        transport_failed(e, &self.stopping) && e.kind() != ErrorKind::Timeout
    }

    /// Whether opening candidate `c` failed so that the next is tried (no
    /// request was sent: a timeout too).
    fn open_fails_over(&self, e: &Error) -> bool {
        transport_failed(e, &self.stopping)
    }

    fn describe(&self, c: usize) -> String {
        let cand = &self.route.candidates[c];
        format!(
            "{} to {}",
            self.transports[cand.transport].scheme, cand.address
        )
    }

    /// The candidates for a new call: those not backing off, best first,
    /// then those backing off (a last resort), best first.
    fn order(&self) -> Vec<usize> {
        let now = Instant::now();
        let state = lock(&self.route.state);
        let (up, down): (Vec<usize>, Vec<usize>) = (0..self.route.candidates.len())
            .partition(|&c| state.down[c].is_none_or(|d| d.until <= now));
        up.into_iter().chain(down).collect()
    }

    /// The inner engine and segment of candidate `c`, opened on first use.
    async fn segment(&self, c: usize) -> Result<(Arc<Engine>, SegmentId)> {
        let cand = &self.route.candidates[c];
        let engine = Arc::clone(&self.transports[cand.transport].engine);
        if let Some(s) = lock(&self.route.state).open[c] {
            return Ok((engine, s));
        }
        let opened = engine.open_segment(&cand.address).await?;
        let mut state = lock(&self.route.state);
        match state.open[c] {
            Some(first) => {
                state.spare.push((c, opened));
                Ok((engine, first))
            }
            None => {
                state.open[c] = Some(opened);
                Ok((engine, opened))
            }
        }
    }

    /// Candidate `c`'s inner engine and segment for a call that fails over:
    /// `None` when opening it failed so that the next is tried (it backs
    /// off, and the error is kept in `last`); `Err` for any other error.
    async fn open(
        &self,
        c: usize,
        last: &mut Option<Error>,
    ) -> Result<Option<(Arc<Engine>, SegmentId)>> {
        match self.segment(c).await {
            Ok(x) => Ok(Some(x)),
            Err(e) if self.open_fails_over(&e) => {
                self.failed(c, &e);
                *last = Some(e);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Candidate `c` failed with `e`: it backs off.
    fn failed(&self, c: usize, e: &Error) {
        let what = self.describe(c);
        tracing::warn!(peer = %lock(&self.route.state).choice.peer, transport = %what, error = %e,
            "ferry multi: a transport failed; its requests go over the next");
        let mut state = lock(&self.route.state);
        let backoff = match state.down[c] {
            Some(d) => (d.backoff * 2).min(MAX_BACKOFF),
            None => FIRST_BACKOFF,
        };
        state.down[c] = Some(Down {
            until: Instant::now() + backoff,
            backoff,
        });
        let failed = &mut state.choice.failed;
        if failed.len() == MAX_FAILED_KEPT {
            failed.remove(0);
        }
        failed.push((what, e.clone()));
    }

    /// Candidate `c` carried a transfer: its back-off ends, and it is the
    /// segment's transport now.
    fn worked(&self, c: usize) {
        let mut state = lock(&self.route.state);
        state.down[c] = None;
        if state.current == c {
            return;
        }
        let cand = &self.route.candidates[c];
        let scheme = self.transports[cand.transport].scheme.clone();
        let before = self.describe(state.current);
        let from = state.current;
        state.current = c;
        let choice = &mut state.choice;
        choice.failovers += 1;
        let now = self.describe(c);
        match choice
            .failed_over
            .iter_mut()
            .find(|(f, t, _)| *f == before && *t == now)
        {
            Some((_, _, n)) => *n += 1,
            None => choice.failed_over.push((before.clone(), now, 1)),
        }
        self.counts.failover(
            &choice.peer,
            &self.route.candidates[from].label,
            &cand.label,
        );
        choice.reason = match choice.failed.last() {
            Some((what, e)) if *what == before => {
                format!("{scheme}: failed over from {what}: {e}")
            }
            // Candidates are in order of preference: a better one than
            // the current that works again is back after its back-off.
            _ if c < from => format!("{scheme}: back after its back-off (preferred to {before})"),
            _ => format!("{scheme}: {before} was backing off"),
        };
        choice.transport = scheme;
        choice.index = cand.transport;
        choice.address = cand.address.clone();
    }

    /// One request, failing over.
    async fn transfer(&self, request: TransferRequest) -> Result<()> {
        let mut last = None;
        for c in self.order() {
            let Some((engine, inner)) = self.open(c, &mut last).await? else {
                continue;
            };
            match engine.transfer(inner, request).await {
                Ok(()) => {
                    self.worked(c);
                    return Ok(());
                }
                Err(e) if self.fails_over(&e) => {
                    self.failed(c, &e);
                    last = Some(e);
                }
                Err(e) => return Err(seg_err(e, inner, self.route.id)),
            }
        }
        Err(last.unwrap_or_else(no_transport))
    }

    /// A batch, failing over (the design's §4): the requests not confirmed
    /// (failed with a transport's error) go again, as one batch, over the
    /// next candidate; each outcome is reported to `driver` once. The
    /// notification, where the segment has more than one candidate, is sent
    /// alone once every request succeeded, over the transport that carried
    /// the end (again over the next only where the failure says nothing
    /// was sent). `Err`: the batch was refused as a whole, nothing moved.
    /// `Ok`: the notification's outcome, for `BatchDriver::finish`.
    async fn batch(
        &self,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
        driver: &BatchDriver,
    ) -> Result<Option<Result<()>>> {
        let together = self.route.candidates.len() == 1;
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        let mut last: Option<Error> = None;
        let mut moved = false;
        let mut carried = None;
        for c in self.order() {
            if pending.is_empty() {
                break;
            }
            let (engine, inner) = match self.open(c, &mut last).await {
                Ok(Some(x)) => x,
                Ok(None) => continue,
                Err(e) if !moved => return Err(e),
                Err(e) => {
                    driver.fail_unreported(&e);
                    return Ok(None);
                }
            };
            let reqs: Vec<TransferRequest> = pending.iter().map(|&i| requests[i]).collect();
            let note = if together { notify } else { None };
            match engine.batch_transfer(inner, &reqs, note).await {
                Ok(report) => {
                    moved = true;
                    carried = Some(c);
                    let mut again = Vec::new();
                    let mut failure = None;
                    for (&i, r) in pending.iter().zip(report.results) {
                        match r {
                            Err(e) if self.fails_over(&e) => {
                                again.push(i);
                                failure.get_or_insert(e);
                            }
                            r => driver.complete(i, r),
                        }
                    }
                    match failure {
                        Some(e) => {
                            self.failed(c, &e);
                            last = Some(e);
                        }
                        None => self.worked(c),
                    }
                    pending = again;
                }
                Err(e) if self.fails_over(&e) => {
                    self.failed(c, &e);
                    last = Some(e);
                }
                Err(e) if !moved => return Err(seg_err(e, inner, self.route.id)),
                Err(e) => {
                    driver.fail_unreported(&e);
                    return Ok(None);
                }
            }
        }
        if !pending.is_empty() {
            let e = last.unwrap_or_else(no_transport);
            if !moved {
                return Err(e);
            }
            driver.fail_unreported(&e);
            return Ok(None);
        }
        let Some(note) = notify else {
            return Ok(None);
        };
        if (together && !requests.is_empty()) || !driver.all_ok() {
            // Sent with the data, or not to be sent.
            return Ok(None);
        }
        // The notification alone: first over the transport that carried
        // the end, then over the others. Untagged, only after a failure
        // that says it was not sent (a second delivery is worse than
        // none); tagged (the peer drops a tag it delivered already), after
        // any failure of the transport.
        let tagged = self.route.next_tag().and_then(|t| t.apply(note));
        let note = tagged.as_ref().unwrap_or(note);
        let mut order = self.order();
        if let Some(c) = carried {
            order.retain(|&o| o != c);
            order.insert(0, c);
        }
        let mut last = None;
        for c in order {
            let (engine, inner) = match self.open(c, &mut last).await {
                Ok(Some(x)) => x,
                Ok(None) => continue,
                Err(e) => return Ok(Some(Err(e))),
            };
            match engine.batch_transfer(inner, &[], Some(note)).await {
                Ok(_) => {
                    self.worked(c);
                    return Ok(Some(Ok(())));
                }
                Err(e)
                    if (tagged.is_some() && transport_failed(&e, &self.stopping))
                        || (self.fails_over(&e) && e.retry() == Retry::Temporary) =>
                {
                    self.failed(c, &e);
                    last = Some(e);
                }
                Err(e) => {
                    if self.fails_over(&e) {
                        self.failed(c, &e);
                    }
                    return Ok(Some(Err(seg_err(e, inner, self.route.id))));
                }
            }
        }
        Ok(Some(Err(last.unwrap_or_else(no_transport))))
    }

    /// Closes every inner segment opened for the route; the first error
    /// other than a segment closed already.
    async fn close(&self) -> Result<()> {
        let opened: Vec<(usize, SegmentId)> = {
            let state = lock(&self.route.state);
            let open = state
                .open
                .iter()
                .enumerate()
                .filter_map(|(c, s)| s.map(|s| (c, s)));
            open.chain(state.spare.iter().copied()).collect()
        };
        let mut first = Ok(());
        for (c, inner) in opened {
            let engine = &self.transports[self.route.candidates[c].transport].engine;
            match engine.close_segment(inner).await {
                Ok(()) | Err(Error::UnknownSegment(_)) => {}
                Err(e) => {
                    if first.is_ok() {
                        first = Err(e);
                    }
                }
            }
        }
        first
    }
}

fn no_transport() -> Error {
    Error::Canceled("no transport of the multi engine is left for this peer".to_owned())
}

/// An inner engine's error about its own handle, about ours.
fn seg_err(e: Error, inner: SegmentId, ours: SegmentId) -> Error {
    match e {
        Error::UnknownSegment(s) if s == inner => Error::UnknownSegment(ours),
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

/// What a tagged notification's message starts with, before the tag's
/// 32 hexadecimal digits and the message itself. Reserved: a message that
/// starts so is taken for a tag by a multi engine.
const TAG_PREFIX: &str = "\u{1}ferry-multi-tag:";
/// Hexadecimal digits of a tag.
const TAG_HEX: usize = 32;
/// Tags remembered per sending segment: the latest 4096 sequence numbers.
const TAG_WINDOW: u64 = 4096;
const TAG_WORDS: usize = (TAG_WINDOW / 64) as usize;
/// Sending segments whose tags are remembered; beyond, the one heard from
/// least recently is forgotten.
const MAX_TAG_SENDERS: usize = 1024;

/// A notification's batch tag (design §4 and §8): 16 bytes, the sending
/// segment's random id and the batch's sequence number on that segment
/// (from 1). It travels in the notification's message (`TAG_PREFIX`, 32
/// hex digits, the message), not its name, so that the inner engines'
/// `next_notification(Some(name))` still matches it; no frame or
/// handshake changes. Sent only to a peer whose segment name lists two or
/// more transports (a multi engine, which strips it); a single-transport
/// peer never sees one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tag {
    sender: u64,
    seq: u64,
}

impl Tag {
    /// `n` with this tag; `None` where the tagged message would pass the
    /// size limit (then it goes untagged).
    fn apply(self, n: &Notification) -> Option<Notification> {
        let tagged = Notification::new(
            n.name.clone(),
            format!(
                "{TAG_PREFIX}{:016x}{:016x}{}",
                self.sender, self.seq, n.message
            ),
        );
        tagged.validate().is_ok().then_some(tagged)
    }

    /// The tag of `n`, and `n` without it; `None` and `n` as it is for an
    /// untagged one.
    fn strip(mut n: Notification) -> (Option<Tag>, Notification) {
        let Some(rest) = n.message.strip_prefix(TAG_PREFIX) else {
            return (None, n);
        };
        let Some(hex) = rest.get(..TAG_HEX) else {
            return (None, n);
        };
        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return (None, n);
        }
        let (Ok(sender), Ok(seq)) = (
            u64::from_str_radix(&hex[..16], 16),
            u64::from_str_radix(&hex[16..], 16),
        ) else {
            return (None, n);
        };
        n.message.drain(..TAG_PREFIX.len() + TAG_HEX);
        (Some(Tag { sender, seq }), n)
    }
}

/// The tags delivered: per sending segment, a window over its latest
/// [`TAG_WINDOW`] sequence numbers (512 bytes); at most
/// [`MAX_TAG_SENDERS`] segments.
#[derive(Default)]
struct Seen {
    senders: HashMap<u64, Window>,
    tick: u64,
}

struct Window {
    /// The highest sequence number delivered.
    max: u64,
    /// Bit `k`: `max - k` was delivered.
    bits: [u64; TAG_WORDS],
    /// When the sender was last heard from (`Seen::tick`).
    heard: u64,
}

impl Seen {
    /// Whether `tag` is delivered for the first time (it is remembered
    /// now). A tag older than its sender's window counts as delivered:
    /// a second delivery is worse than none.
    fn first(&mut self, tag: Tag) -> bool {
        self.tick += 1;
        if !self.senders.contains_key(&tag.sender) && self.senders.len() >= MAX_TAG_SENDERS {
            let oldest = self
                .senders
                .iter()
                .min_by_key(|(_, w)| w.heard)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.senders.remove(&k);
            }
        }
        let w = self.senders.entry(tag.sender).or_insert(Window {
            max: 0,
            bits: [0; TAG_WORDS],
            heard: 0,
        });
        w.heard = self.tick;
        w.admit(tag.seq)
    }
}

impl Window {
    fn admit(&mut self, seq: u64) -> bool {
        if seq > self.max {
            self.shift(seq - self.max);
            self.max = seq;
            self.bits[0] |= 1;
            return true;
        }
        let back = self.max - seq;
        if back >= TAG_WINDOW {
            return false;
        }
        let (word, bit) = ((back / 64) as usize, back % 64);
        let had = self.bits[word] & (1 << bit) != 0;
        self.bits[word] |= 1 << bit;
        !had
    }

    /// Moves every bit `by` places up (older), dropping those past the
    /// window.
    fn shift(&mut self, by: u64) {
        if by >= TAG_WINDOW {
            self.bits = [0; TAG_WORDS];
            return;
        }
        let (words, bits) = ((by / 64) as usize, (by % 64) as u32);
        for i in (0..TAG_WORDS).rev() {
            let hi = if i >= words {
                self.bits[i - words] << bits
            } else {
                0
            };
            let lo = if bits > 0 && i > words {
                self.bits[i - words - 1] >> (64 - bits)
            } else {
                0
            };
            self.bits[i] = hi | lo;
        }
    }
}

/// Most `(peer, from, to)` failover counters kept; beyond, new peers
/// count under `other`.
const MAX_FAILOVER_SERIES: usize = 1024;

/// The engine's failovers, for the metrics: per (peer, from, to) labels
/// (see `Candidate::label`). They only grow.
#[derive(Default)]
struct Counts {
    failovers: Mutex<BTreeMap<(String, String, String), u64>>,
}

impl Counts {
    fn failover(&self, peer: &str, from: &str, to: &str) {
        let mut all = lock(&self.failovers);
        let key = (peer.to_owned(), from.to_owned(), to.to_owned());
        let key = if all.len() >= MAX_FAILOVER_SERIES && !all.contains_key(&key) {
            ("other".to_owned(), from.to_owned(), to.to_owned())
        } else {
            key
        };
        *all.entry(key).or_default() += 1;
    }
}

/// The union of the inner engines' inbound counters, with the engine's
/// failovers and the transport each open segment uses.
struct InboundUnion {
    inner: Vec<Inbound>,
    counts: Arc<Counts>,
    segments: std::sync::Weak<Mutex<HashMap<SegmentId, Arc<Route>>>>,
}

impl InboundSource for InboundUnion {
    fn snapshot(&self) -> InboundSnapshot {
        let mut served: Option<BTreeMap<String, ferry_core::ServedCounts>> = None;
        let mut dropped: Option<NotificationsDropped> = None;
        for s in self.inner.iter().map(Inbound::snapshot) {
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
        let mut chosen: BTreeMap<(String, String), u64> = BTreeMap::new();
        if let Some(segments) = self.segments.upgrade() {
            let routes: Vec<Arc<Route>> = lock(&segments).values().cloned().collect();
            for r in routes {
                let key = {
                    let state = lock(&r.state);
                    let label = r.candidates[state.current].label.clone();
                    (state.choice.peer.clone(), label)
                };
                *chosen.entry(key).or_default() += 1;
            }
        }
        out.with_failovers(lock(&self.counts.failovers).clone())
            .with_transports_chosen(chosen)
    }
}

/// Undoes a registration in the first `n` engines; the error of the
/// first undo that failed (the region may stay registered there: the
/// caller returns it instead of the refusal, e.g. `RegionHeld`).
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

/// What a registration refused with `e` returns once `undone`: `e`, or
/// the undo's error where an undo failed (the region may stay registered
/// in that transport until `unregister`), `e` logged.
fn refused(e: Error, undone: Result<()>) -> Error {
    match undone {
        Ok(()) => e,
        Err(u) => {
            tracing::warn!(refusal = %e, error = %u,
                "ferry multi: a registration was refused, and undoing it failed");
            u
        }
    }
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
        for t in self.transports.iter() {
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
                return Err(refused(e, undo(&engines, n, &[addr]).await));
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
                return Err(refused(e, undo(&engines, n, &addrs).await));
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
        let count = |list: &[String], s: &str| list.iter().filter(|t| *t == s).count();
        let candidates: Vec<Candidate> = ours
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                let alone = count(&ours, s) == 1 && count(&theirs, s) == 1;
                peer.entries
                    .iter()
                    .enumerate()
                    .filter(move |(_, (t, _))| t == s)
                    .map(move |(j, (_, address))| Candidate {
                        transport: i,
                        address: address.clone(),
                        label: if alone {
                            s.clone()
                        } else {
                            format!("{s}#{i}.{j}")
                        },
                    })
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
        let n = candidates.len();
        let first = &self.transports[candidates[0].transport];
        let route = Arc::new(Route {
            id: SegmentId::fresh(),
            state: Mutex::new(RouteState {
                open: vec![None; n],
                spare: Vec::new(),
                down: vec![None; n],
                current: 0,
                choice: Choice {
                    peer: name.to_owned(),
                    transport: first.scheme.clone(),
                    index: candidates[0].transport,
                    address: candidates[0].address.clone(),
                    ours,
                    theirs,
                    single_transport_peer: peer.single,
                    failed: Vec::new(),
                    failovers: 0,
                    failed_over: Vec::new(),
                    reason: String::new(),
                },
            }),
            candidates,
            // Only a multi engine strips tags, and only one listing two or
            // more transports is sent them (see `Tag`).
            tags: (!peer.single && peer.entries.len() >= 2)
                .then(|| (rand::random::<u64>(), AtomicU64::new(0))),
        });
        let ctx = Ctx {
            transports: Arc::clone(&self.transports),
            route: Arc::clone(&route),
            stopping: Arc::clone(&self.stopping),
            counts: Arc::clone(&self.counts),
        };
        let mut failed: Vec<Error> = Vec::new();
        for c in 0..n {
            match ctx.segment(c).await {
                Ok(_) => {
                    let scheme = &self.transports[route.candidates[c].transport].scheme;
                    let mut reason = if peer.single {
                        format!(
                            "{scheme}: the peer is a single-transport peer ({name} is host:port)"
                        )
                    } else {
                        format!("{scheme}: both sides have it")
                    };
                    match failed.last() {
                        None if !peer.single => reason.push_str("; the first of ours in common"),
                        None => {}
                        Some(e) => {
                            let what = ctx.describe(c - 1);
                            reason.push_str(&format!("; {what} failed first: {e}"));
                        }
                    }
                    {
                        let mut state = lock(&route.state);
                        let cand = &route.candidates[c];
                        state.current = c;
                        state.choice.transport = scheme.clone();
                        state.choice.index = cand.transport;
                        state.choice.address = cand.address.clone();
                        state.choice.reason = reason;
                        tracing::debug!(peer = name, choice = %state.choice, "ferry multi: segment open");
                    }
                    lock(&self.segments).insert(route.id, Arc::clone(&route));
                    return Ok(route.id);
                }
                Err(e) if transport_failed(&e, &self.stopping) => {
                    ctx.failed(c, &e);
                    failed.push(e);
                }
                Err(e) => return Err(e),
            }
        }
        if failed.len() == 1 {
            return Err(failed.remove(0));
        }
        Err(Error::SegmentUnavailable {
            name: name.to_owned(),
            reason: failed
                .iter()
                .enumerate()
                .map(|(c, e)| format!("{}: {e}", ctx.describe(c)))
                .collect::<Vec<_>>()
                .join("; "),
        })
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let ctx = self.ctx(segment)?;
        ctx.close().await?;
        lock(&self.segments).remove(&segment);
        Ok(())
    }

    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        self.ctx(segment)?.transfer(request).await
    }

    async fn batch_transfer(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchReport> {
        let ctx = self.ctx(segment)?;
        if let Some(n) = notify {
            n.validate()?;
        }
        let driver = BatchDriver::detached(requests.len());
        let notified = ctx.batch(requests, notify, &driver).await?;
        driver.finish(notified)
    }

    async fn submit(
        &self,
        segment: SegmentId,
        requests: &[TransferRequest],
        notify: Option<&Notification>,
    ) -> Result<BatchId> {
        let ctx = self.ctx(segment)?;
        self.running()?;
        if let Some(n) = notify {
            n.validate()?;
        }
        let admission = self.table.admit(requests.len())?;
        let driver = admission.driver().clone();
        if requests.is_empty() {
            // Only a notification: sent before the id is handed out (a
            // batch of no requests has no state to show it pending).
            let notified = ctx.batch(requests, notify, &driver).await?;
            driver.finish(notified)?;
            return Ok(admission.claim());
        }
        let requests = requests.to_vec();
        let notify = notify.cloned();
        tokio::spawn(async move {
            match ctx.batch(&requests, notify.as_ref(), &driver).await {
                Ok(notified) => {
                    let _ = driver.finish(notified);
                }
                Err(e) => {
                    driver.fail_unreported(&e);
                    let _ = driver.finish(requests.is_empty().then_some(Err(e)));
                }
            }
        });
        Ok(admission.claim())
    }

    fn status(&self, batch: BatchId) -> Result<BatchStatus> {
        self.table.status(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<BatchReport> {
        self.table.wait(batch).await
    }

    async fn release_batch(&self, batch: BatchId) -> Result<()> {
        self.table.release(batch)
    }

    async fn take_notifications(&self) -> Result<Vec<Notification>> {
        let mut first_err = None;
        let mut any = false;
        for t in self.transports.iter() {
            match t.engine.take_notifications().await {
                Ok(v) => {
                    any = true;
                    // Kept before anything else is awaited: a call dropped
                    // from here on loses none.
                    let v: Vec<Notification> =
                        v.into_iter().filter_map(|n| self.received(n)).collect();
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
        // A duplicate (a tag delivered already) is dropped and that inner
        // engine waited on again.
        let mut first_err: Option<Error> = None;
        std::future::poll_fn(|cx| {
            let mut live = 0;
            for (t, slot) in self.transports.iter().zip(waits.iter_mut()) {
                while let Some(w) = slot {
                    match w.as_mut().poll(cx) {
                        Poll::Ready(Ok(n)) => match self.received(n) {
                            Some(n) => return Poll::Ready(Ok(n)),
                            None => *slot = Some(t.engine.next_notification_dyn(name)),
                        },
                        Poll::Ready(Err(e)) => {
                            *slot = None;
                            first_err.get_or_insert(e);
                        }
                        Poll::Pending => {
                            live += 1;
                            break;
                        }
                    }
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
        let inner: Option<usize> = self
            .transports
            .iter()
            .map(|t| t.engine.live_batches())
            .sum();
        inner.map(|n| n + self.table.len())
    }

    fn inbound(&self) -> Option<Inbound> {
        let inner: Vec<Inbound> = self
            .transports
            .iter()
            .filter_map(|t| t.engine.inbound())
            .collect();
        Some(Inbound::new(Arc::new(InboundUnion {
            inner,
            counts: Arc::clone(&self.counts),
            segments: Arc::downgrade(&self.segments),
        })))
    }

    async fn shutdown(&self) -> Result<()> {
        self.stopping.store(true, Ordering::Release);
        let mut first = Ok(());
        for t in self.transports.iter() {
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
    fn tags_round_trip_and_untagged_messages_pass_as_they_are() {
        let n = Notification::new("kv", "done");
        let tag = Tag {
            sender: 0x0123_4567_89ab_cdef,
            seq: 7,
        };
        let t = tag.apply(&n).unwrap();
        assert_eq!(t.name, "kv");
        assert!(t.message.starts_with(TAG_PREFIX) && t.message.ends_with("done"));
        assert_eq!(Tag::strip(t), (Some(tag), n.clone()));
        assert_eq!(Tag::strip(n.clone()), (None, n));
        // A prefix without 32 hex digits after it is a message like any.
        for odd in [
            format!("{TAG_PREFIX}12"),
            format!("{TAG_PREFIX}{}", "g".repeat(40)),
            format!("{TAG_PREFIX}+{}", "0".repeat(40)),
        ] {
            let m = Notification::new("x", odd.clone());
            assert_eq!(Tag::strip(m.clone()), (None, m), "{odd}");
        }
        // Too long to tag: sent untagged.
        let big = Notification::new("x", "m".repeat(ferry_core::MAX_NOTIFICATION_MESSAGE - 10));
        assert!(tag.apply(&big).is_none());
    }

    #[test]
    fn a_tag_is_delivered_once_within_its_senders_window() {
        let mut seen = Seen::default();
        let t = |sender, seq| Tag { sender, seq };
        assert!(seen.first(t(1, 5)));
        assert!(!seen.first(t(1, 5)), "twice");
        assert!(seen.first(t(2, 5)), "another sender's");
        // Out of order inside the window: each once.
        for seq in [3, 1, 4, 2] {
            assert!(seen.first(t(1, seq)), "{seq}");
            assert!(!seen.first(t(1, seq)), "{seq} twice");
        }
        // Far ahead: older ones still within the window are remembered
        // (across word boundaries), those past it count as delivered.
        for seq in [70, 200, 5 + TAG_WINDOW - 1] {
            assert!(seen.first(t(1, seq)), "{seq}");
        }
        assert!(!seen.first(t(1, 70)) && !seen.first(t(1, 200)));
        assert!(seen.first(t(1, 71)) && seen.first(t(1, 199)));
        assert!(!seen.first(t(1, 5)), "remembered at the window's edge");
        assert!(!seen.first(t(1, 4)), "past the window: taken as delivered");
        assert!(seen.first(t(1, 1 << 40)) && !seen.first(t(1, 1 << 40)));
        assert!(seen.first(t(1, (1 << 40) - 1)));
        // Bounded: the sender heard from least recently is forgotten.
        for sender in 100..100 + MAX_TAG_SENDERS as u64 {
            seen.first(t(sender, 1));
        }
        assert_eq!(seen.senders.len(), MAX_TAG_SENDERS);
        assert!(!seen.senders.contains_key(&1) && !seen.senders.contains_key(&2));
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
