//! An opened peer: its connection slots (connected on demand, replaced
//! when dead or retired), its cached region table, and the control
//! requests (table refresh, notification) sent to it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use ferry_core::__private::sync::lock;
use ferry_core::{Error, Notification, Result};

use super::conn::{Conn, ConnShared, TableCache};
use super::send::{fail_ops, send_ops, OutKind, OutOp, GRANTED_ALWAYS};
use super::wire_ops::WireOps;
use crate::frame::TableEntry;
use crate::server::Core;

/// One connection slot of a peer.
#[derive(Default)]
pub(crate) struct SlotState {
    /// The connection, if made.
    pub(crate) cur: RwLock<Option<Arc<Conn>>>,
    /// Held while connecting.
    pub(crate) connect: tokio::sync::Mutex<()>,
}

/// An opened peer segment.
pub struct Peer {
    /// Segment name (`host:port`).
    pub(crate) name: String,
    /// This engine's state (configuration, regions, name).
    pub(crate) core: Arc<Core>,
    /// `connections` connection slots.
    pub(crate) slots: Vec<SlotState>,
    /// The peer's region table as last received.
    pub(crate) table: Arc<TableCache>,
    /// Round-robin counter spreading chunks over the slots.
    pub(crate) rr: AtomicUsize,
    /// The payload path of the latest connection, as reported.
    pub(crate) path: Mutex<Option<String>>,
    /// The latest connection moves payloads by cross-memory attach.
    pub(crate) same_host: std::sync::atomic::AtomicBool,
    /// What the latest connection negotiated.
    pub(crate) report: Mutex<Option<crate::negotiate::PeerReport>>,
    /// The version of the hellos sent to it: the legacy one, or an older
    /// one the target named (see `connect`).
    pub(crate) hello_version: std::sync::atomic::AtomicU16,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("name", &self.name).finish()
    }
}

impl Peer {
    /// A peer with no connection yet.
    pub(crate) fn new(name: &str, core: Arc<Core>) -> Arc<Peer> {
        let n = core.config.connections;
        Arc::new(Peer {
            name: name.to_owned(),
            core,
            slots: (0..n).map(|_| SlotState::default()).collect(),
            table: Arc::new(RwLock::new(Arc::new(Vec::new()))),
            rr: AtomicUsize::new(0),
            path: Mutex::new(None),
            same_host: std::sync::atomic::AtomicBool::new(false),
            report: Mutex::new(None),
            hello_version: std::sync::atomic::AtomicU16::new(crate::negotiate::LEGACY_VERSION),
        })
    }

    /// The payload path in use: `cma`, or `tcp (reason)`; `None` before
    /// the first connection.
    pub(crate) fn path(&self) -> Option<String> {
        lock(&self.path).clone()
    }

    /// What the latest connection negotiated; `None` before the first.
    pub(crate) fn report(&self) -> Option<crate::negotiate::PeerReport> {
        lock(&self.report).clone()
    }

    /// Closes every connection (pending requests fail with `Canceled`).
    pub(crate) fn close(&self) {
        for s in &self.slots {
            ferry_core::__private::sync::write(&s.cur).take();
        }
    }

    pub(crate) fn table(&self) -> Arc<Vec<TableEntry>> {
        Arc::clone(&ferry_core::__private::sync::read(&self.table))
    }

    /// The live connection of slot `i`, connecting (and handshaking) if it
    /// is absent or dead.
    pub(crate) async fn conn(&self, i: usize) -> Result<Arc<ConnShared>> {
        let slot = &self.slots[i];
        if let Some(c) = live(slot) {
            return Ok(c);
        }
        let _g = slot.connect.lock().await;
        if let Some(c) = live(slot) {
            return Ok(c);
        }
        let cfg = &self.core.config;
        let conn = tokio::time::timeout(cfg.connect_timeout, self.connect())
            .await
            .map_err(|_| Error::Timeout {
                operation: "connect and handshake".to_owned(),
                peer: Some(self.name.clone()),
                after: cfg.connect_timeout,
            })??;
        let shared = Arc::clone(&conn.shared);
        let old = ferry_core::__private::sync::write(&slot.cur).replace(Arc::new(conn));
        drop(old);
        Ok(shared)
    }

    /// One transfer of at most [`GRANTED_ALWAYS`] bytes as a granted copy
    /// on the caller's thread, without the batch machinery (no frame, no
    /// driver, no deadline: the copy does not wait for the target): what
    /// [`Peer::run_batch`] would do for this one request on a same-host
    /// connection whose target granted the range, minus the planning.
    /// `true`: every byte landed. `false`: nothing is known to have moved
    /// (no live same-host connection with grants yet, the local range is
    /// not registered, the cached table does not cover the remote range,
    /// or the grant does not (any more)); the caller takes the general
    /// path, which reports the reason or moves the bytes its way.
    pub(crate) fn granted_one(&self, r: &ferry_core::TransferRequest) -> bool {
        if r.len == 0
            || r.len > GRANTED_ALWAYS
            || r.len > self.core.config.same_host_chunk as u64
            || !self.same_host.load(Ordering::Relaxed)
        {
            return false;
        }
        let Some(conn) = live(&self.slots[0]) else {
            return false;
        };
        let Some(grants) = conn.stage.as_ref().and_then(|s| s.grants.as_ref()) else {
            return false;
        };
        if !conn.cma {
            return false;
        }
        let Ok(guard) =
            self.core
                .regions
                .acquire(r.local_addr, r.len, ferry_core::Side::Local, None)
        else {
            return false;
        };
        // Looked up under the table's read lock, not through a clone of it.
        let table = ferry_core::__private::sync::read(&self.table);
        let Some(gen) = crate::frame::table_lookup(&table, r.remote_addr, r.len) else {
            return false;
        };
        drop(table);
        let part = crate::same_host::grant::Part {
            local: guard.as_ptr(),
            len: r.len,
            remote: r.remote_addr,
            gen,
        };
        // SAFETY: the local range is the one `guard` keeps registered (it
        // is held until this returns), checked by `acquire` above.
        unsafe { grants.copy(r.op == ferry_core::TransferOp::Read, &[part]) }
    }

    /// A live connection of a slot other than `c`, if there is one.
    fn live_other(&self, c: usize) -> Option<Arc<ConnShared>> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != c)
            .find_map(|(_, slot)| live(slot))
    }

    /// Sends `ops` on connection slot `c` (connecting if needed; a
    /// connection retired for idleness is replaced; if `c` cannot be
    /// connected, on another slot's live connection). Returns the
    /// connection they went out on, or `None` if they failed up front.
    pub(crate) async fn send_on(
        &self,
        c: usize,
        state: &Arc<WireOps>,
        mut ops: Vec<OutOp>,
    ) -> Option<Arc<ConnShared>> {
        for _ in 0..3 {
            let conn = match self.conn(c).await {
                Ok(conn) => conn,
                // An extra connection that cannot be opened (a handshake
                // slower than its timeout on a loaded host, the target at
                // its connection limit) is no reason to fail requests a
                // live connection can carry.
                Err(e) => match self.live_other(c) {
                    Some(conn) => {
                        tracing::debug!(peer = %self.name, slot = c, error = %e,
                            "cannot open this connection; using another");
                        conn
                    }
                    None => {
                        fail_ops(state, &ops, &e);
                        return None;
                    }
                },
            };
            match send_ops(&conn, state, ops).await {
                Ok(()) => return Some(conn),
                Err(back) => ops = back,
            }
        }
        let e = Error::PeerLost {
            peer: self.name.clone(),
            reason: "every new connection was retired before use".to_owned(),
        };
        fail_ops(state, &ops, &e);
        None
    }

    /// Asks the target for its current region table and caches it.
    pub(crate) async fn refresh_table(&self) -> Result<()> {
        let state = WireOps::new(1);
        state.arm(&[1]);
        let ops = vec![OutOp {
            index: 0,
            kind: OutKind::Table(Arc::clone(&self.table)),
        }];
        self.start_clock(&state, 0);
        let conns: Vec<_> = self.send_on(0, &state, ops).await.into_iter().collect();
        self.await_state(&state, &conns, 0).await;
        state
            .results()
            .pop()
            .unwrap_or_else(|| Err(Error::Canceled("no result".into())))
    }

    /// Starts the clock of `state`, which moves `bytes`: it expires
    /// `request_timeout + bytes / min_rate` from now. Called before its
    /// first frame is sent, so that the time spent sending (and moving
    /// staged bytes) counts.
    pub(crate) fn start_clock(&self, state: &WireOps, bytes: u64) -> std::time::Instant {
        let cfg = &self.core.config;
        state.start_clock(cfg.deadline_for(cfg.request_timeout, bytes))
    }

    /// Waits for `state`, which moves `bytes`, until its deadline
    /// (`request_timeout + bytes / min_rate` from when its clock started);
    /// on expiry only its requests fail, with [`Error::Timeout`] (a
    /// connection is dropped only if the peer has been silent for
    /// `request_timeout`).
    pub(crate) async fn await_state(
        &self,
        state: &Arc<WireOps>,
        conns: &[Arc<ConnShared>],
        bytes: u64,
    ) {
        let cfg = &self.core.config;
        let t = cfg.deadline_for(cfg.request_timeout, bytes);
        let deadline = tokio::time::Instant::from_std(self.start_clock(state, bytes));
        if tokio::time::timeout_at(deadline, state.wait())
            .await
            .is_err()
        {
            let err = Error::Timeout {
                operation: format!("a batch of {bytes} bytes"),
                peer: Some(self.name.clone()),
                after: t,
            };
            for c in conns {
                c.abandon(state, &err, cfg.request_timeout);
            }
            // What is left is a payload being received right now, which
            // the minimum rate bounds.
            state.wait().await;
        }
    }

    /// Delivers a notification (after the batch it follows has landed).
    pub(crate) async fn notify(&self, n: &Notification) -> Result<()> {
        let state = WireOps::new(1);
        state.arm(&[1]);
        let mut bytes = Vec::with_capacity(n.name.len() + n.message.len());
        bytes.extend_from_slice(n.name.as_bytes());
        bytes.extend_from_slice(n.message.as_bytes());
        let size = bytes.len() as u64;
        let ops = vec![OutOp {
            index: 0,
            kind: OutKind::Notify {
                bytes,
                name_len: n.name.len() as u64,
            },
        }];
        self.start_clock(&state, size);
        let conns: Vec<_> = self.send_on(0, &state, ops).await.into_iter().collect();
        self.await_state(&state, &conns, size).await;
        state
            .results()
            .pop()
            .unwrap_or_else(|| Err(Error::Canceled("no result".into())))
    }
}

/// The slot's connection, if it has one that is not dead.
fn live(slot: &SlotState) -> Option<Arc<ConnShared>> {
    ferry_core::__private::sync::read(&slot.cur)
        .as_ref()
        .filter(|c| !c.shared.dead.load(Ordering::Acquire))
        .map(|c| Arc::clone(&c.shared))
}
