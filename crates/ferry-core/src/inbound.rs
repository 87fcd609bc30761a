//! What peers did to an engine: the bytes they wrote into and read from
//! its registered memory through requests it served (the *target* side of
//! a transfer), and the notifications its inbox dropped.
//!
//! A backend that sees inbound traffic (ferry-tcp's server: socket frames
//! and the same-host copies it performs) keeps a [`ServedTraffic`] table of
//! per-peer atomic counters: each connection looks its peer's counters up
//! once ([`ServedTraffic::peer`]) and then only adds to atomics. The engine
//! hands out an [`Inbound`] handle ([`TransferEngine::inbound`]) that reads
//! them on demand, so [`crate::MetricsLayer`] exports them at scrape time
//! (pull model: nothing on the hot path but the backend's own additions).
//!
//! Backends whose inbound traffic is one-sided (verbs RDMA, Mooncake,
//! NIXL: the NIC or the library moves the bytes without the target's CPU)
//! cannot count it: their snapshot's `served` is `None`.
//!
//! [`TransferEngine::inbound`]: crate::TransferEngine::inbound

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::__private::sync::lock;

/// Distinct peers a [`ServedTraffic`] table gives counters of their own by
/// default; the rest share those of [`OTHER_PEER`].
pub const DEFAULT_SERVED_PEER_LIMIT: usize = 64;

/// The peer label of the peers beyond a table's limit.
pub const OTHER_PEER: &str = "other";

/// Longest peer label kept (characters); longer names are cut.
const MAX_LABEL_CHARS: usize = 128;

/// What an engine's inbound side has seen so far (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboundSnapshot {
    /// Per peer label: what peers moved through requests this engine
    /// served. `None` where the backend cannot see inbound traffic.
    pub served: Option<BTreeMap<String, ServedCounts>>,
    /// Notifications the engine's inbox refused and dropped. `None` where
    /// the backend does not count them.
    pub notifications_dropped: Option<NotificationsDropped>,
    /// An engine over several transports (ferry's multi engine): per
    /// `(peer, from, to)`, how many times transfers to the peer moved from
    /// one transport to another (labels the engine chose, e.g. `verbs`,
    /// `tcp`). Not inbound traffic, but read at scrape time the same way.
    /// `None` elsewhere.
    pub failovers: Option<BTreeMap<(String, String, String), u64>>,
    /// The same engines: per `(peer, transport)`, how many of the open
    /// segments to the peer that transport carries now. `None` elsewhere.
    pub transports_chosen: Option<BTreeMap<(String, String), u64>>,
}

impl InboundSnapshot {
    /// An empty snapshot: nothing counted (`served` and
    /// `notifications_dropped` both `None`).
    pub fn new() -> Self {
        Self::default()
    }

    /// With `served` set.
    pub fn with_served(mut self, served: BTreeMap<String, ServedCounts>) -> Self {
        self.served = Some(served);
        self
    }

    /// With `notifications_dropped` set.
    pub fn with_notifications_dropped(mut self, dropped: NotificationsDropped) -> Self {
        self.notifications_dropped = Some(dropped);
        self
    }

    /// With `failovers` set.
    pub fn with_failovers(mut self, failovers: BTreeMap<(String, String, String), u64>) -> Self {
        self.failovers = Some(failovers);
        self
    }

    /// With `transports_chosen` set.
    pub fn with_transports_chosen(mut self, chosen: BTreeMap<(String, String), u64>) -> Self {
        self.transports_chosen = Some(chosen);
        self
    }

    /// Bytes served in both directions, every peer (0 without `served`).
    pub fn served_bytes(&self) -> u64 {
        self.served
            .iter()
            .flat_map(|m| m.values())
            .map(|c| c.bytes_written.saturating_add(c.bytes_read))
            .fold(0, u64::saturating_add)
    }
}

/// One peer's inbound traffic. A *segment* is one contiguous range of the
/// engine's memory one wire request named (an initiator's request, or
/// several merged by coalescing); zero-length ones are not counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServedCounts {
    /// Bytes the peer wrote into this engine's memory (landed).
    pub bytes_written: u64,
    /// Bytes the peer read from this engine's memory (sent or copied out).
    pub bytes_read: u64,
    /// Segments written.
    pub segments_written: u64,
    /// Segments read.
    pub segments_read: u64,
}

/// Notifications an inbox refused, by reason. The sender of each saw an
/// error (retryable for `full`), but the notification is gone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NotificationsDropped {
    /// The inbox held its most notifications or bytes (the consumer is
    /// behind), or refused them on purpose (a fault test's switch).
    pub full: u64,
    /// The engine had shut down.
    pub closed: u64,
}

impl NotificationsDropped {
    /// Both reasons together.
    pub fn total(&self) -> u64 {
        self.full.saturating_add(self.closed)
    }
}

/// Reads an engine's inbound counters: implemented by a backend's shared
/// state, held by [`Inbound`].
pub trait InboundSource: Send + Sync + 'static {
    /// What was counted so far. Cheap (a lock and some atomic loads per
    /// peer); called at every metrics scrape.
    fn snapshot(&self) -> InboundSnapshot;
}

/// A handle on an engine's inbound counters ([`TransferEngine::inbound`]):
/// cheap to clone. The backends hold their state weakly in it
/// ([`Inbound::weak`]): it keeps nothing of the engine alive, and once the
/// engine is gone its snapshot is empty.
///
/// [`TransferEngine::inbound`]: crate::TransferEngine::inbound
#[derive(Clone)]
pub struct Inbound(Arc<dyn InboundSource>);

impl fmt::Debug for Inbound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Inbound").finish_non_exhaustive()
    }
}

impl Inbound {
    /// A handle reading `source`.
    pub fn new(source: Arc<dyn InboundSource>) -> Self {
        Inbound(source)
    }

    /// A handle reading `source` while it lives (an empty snapshot after).
    pub fn weak<T: InboundSource>(source: &Arc<T>) -> Self {
        Inbound(Arc::new(Arc::downgrade(source)))
    }

    /// What was counted so far.
    pub fn snapshot(&self) -> InboundSnapshot {
        self.0.snapshot()
    }
}

impl<T: InboundSource> InboundSource for std::sync::Weak<T> {
    fn snapshot(&self) -> InboundSnapshot {
        self.upgrade().map(|s| s.snapshot()).unwrap_or_default()
    }
}

#[derive(Debug, Default)]
struct Counters {
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    segments_written: AtomicU64,
    segments_read: AtomicU64,
}

impl Counters {
    fn load(&self) -> ServedCounts {
        ServedCounts {
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            segments_written: self.segments_written.load(Ordering::Relaxed),
            segments_read: self.segments_read.load(Ordering::Relaxed),
        }
    }
}

/// A backend's table of per-peer served-traffic counters, bounded: at most
/// `limit` peer labels of their own, then [`OTHER_PEER`] (first come,
/// first labelled; a label once given stays, so a series never moves).
/// Entries are never removed: a peer that reconnects counts on.
#[derive(Debug)]
pub struct ServedTraffic {
    limit: usize,
    peers: Mutex<HashMap<Arc<str>, Arc<Counters>>>,
}

impl Default for ServedTraffic {
    fn default() -> Self {
        ServedTraffic::new(DEFAULT_SERVED_PEER_LIMIT)
    }
}

impl ServedTraffic {
    /// An empty table giving at most `limit` peers a label of their own.
    pub fn new(limit: usize) -> Self {
        ServedTraffic {
            limit,
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// The counters of the peer called `name` (what it calls itself; see
    /// [`peer_label`] for how it becomes a label). Look it up once per
    /// connection and keep the handle: adding to it is a few atomics.
    pub fn peer(&self, name: &str) -> ServedPeer {
        let label = peer_label(name);
        let mut peers = lock(&self.peers);
        if let Some(c) = peers.get(label.as_str()) {
            return ServedPeer(Arc::clone(c));
        }
        let key: Arc<str> = if peers.len() >= self.limit {
            Arc::from(OTHER_PEER)
        } else {
            Arc::from(label)
        };
        ServedPeer(Arc::clone(peers.entry(key).or_default()))
    }

    /// Every peer label's counts so far.
    pub fn snapshot(&self) -> BTreeMap<String, ServedCounts> {
        lock(&self.peers)
            .iter()
            .map(|(k, c)| (k.to_string(), c.load()))
            .filter(|(_, c)| *c != ServedCounts::default())
            .collect()
    }
}

/// One peer's counters in a [`ServedTraffic`] table (cheap to clone).
#[derive(Clone, Debug)]
pub struct ServedPeer(Arc<Counters>);

impl ServedPeer {
    /// `bytes` in `segments` ranges landed in this engine's memory.
    pub fn wrote(&self, bytes: u64, segments: u64) {
        if bytes > 0 {
            self.0.bytes_written.fetch_add(bytes, Ordering::Relaxed);
            self.0
                .segments_written
                .fetch_add(segments, Ordering::Relaxed);
        }
    }

    /// `bytes` in `segments` ranges of this engine's memory went to the
    /// peer.
    pub fn read(&self, bytes: u64, segments: u64) {
        if bytes > 0 {
            self.0.bytes_read.fetch_add(bytes, Ordering::Relaxed);
            self.0.segments_read.fetch_add(segments, Ordering::Relaxed);
        }
    }
}

/// A peer's name as a metrics label: what it calls itself, with every
/// character that is not printable ASCII, `"` or `\` replaced by `_` (the
/// name comes from the peer; the text exposition does not escape label
/// values) and cut at 128 characters; `unnamed` if empty.
pub fn peer_label(name: &str) -> String {
    let label: String = name
        .chars()
        .take(MAX_LABEL_CHARS)
        .map(|c| {
            if c.is_ascii_graphic() && c != '"' && c != '\\' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if label.is_empty() {
        "unnamed".to_owned()
    } else {
        label
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_beyond_the_limit_share_other_and_labels_stay() {
        let t = ServedTraffic::new(2);
        let a = t.peer("a:1");
        let b = t.peer("b:2");
        let c = t.peer("c:3");
        let d = t.peer("d:4");
        a.wrote(10, 1);
        b.read(20, 2);
        c.wrote(5, 1);
        d.read(7, 1);
        // `a` again: still its own label.
        t.peer("a:1").wrote(1, 1);
        let s = t.snapshot();
        assert_eq!(s.len(), 3, "{s:?}");
        assert_eq!(s["a:1"].bytes_written, 11);
        assert_eq!(s["a:1"].segments_written, 2);
        assert_eq!(s["b:2"].bytes_read, 20);
        assert_eq!(s[OTHER_PEER].bytes_written, 5);
        assert_eq!(s[OTHER_PEER].bytes_read, 7);
        let snap = InboundSnapshot::new().with_served(s);
        assert_eq!(snap.served_bytes(), 11 + 20 + 5 + 7);
    }

    struct Fixed(u64);
    impl InboundSource for Fixed {
        fn snapshot(&self) -> InboundSnapshot {
            let t = ServedTraffic::default();
            t.peer("p").wrote(self.0, 1);
            InboundSnapshot::new().with_served(t.snapshot())
        }
    }

    #[test]
    fn a_weak_handle_keeps_nothing_alive() {
        let source = Arc::new(Fixed(5));
        let handle = Inbound::weak(&source);
        assert_eq!(handle.snapshot().served_bytes(), 5);
        assert_eq!(Arc::strong_count(&source), 1);
        drop(source);
        assert_eq!(handle.snapshot(), InboundSnapshot::default());
    }

    #[test]
    fn zero_bytes_count_nothing() {
        let t = ServedTraffic::default();
        t.peer("p").wrote(0, 1);
        t.peer("p").read(0, 3);
        assert!(t.snapshot().is_empty());
    }

    #[test]
    fn labels_are_safe_for_the_exposition() {
        assert_eq!(peer_label("10.0.0.1:7000"), "10.0.0.1:7000");
        assert_eq!(peer_label("a\"b\\c\nd é"), "a_b_c_d__");
        assert_eq!(peer_label(""), "unnamed");
        assert_eq!(peer_label(&"x".repeat(500)).len(), MAX_LABEL_CHARS);
    }
}
