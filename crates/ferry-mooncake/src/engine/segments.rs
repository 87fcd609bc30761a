//! Segment handles: `open_segment` / `close_segment`, and the region tables
//! of the engines of this process (in-process peers).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use ferry_core::__private::sync::lock;
use ferry_core::{Error, RegionTable, Result, SegmentId};
use tokio::sync::RwLock;

use super::peer_wire::{fetch_descriptor, peer_check_enabled, TcpWire};
use super::{blocking, cstring, MooncakeEngine};
use crate::codes::call_error;

/// Region tables of the Mooncake engines of this process, by segment name.
///
/// Mooncake's C API cannot list a remote segment's buffers, and builds
/// before v0.3.12 write at the peer wherever the address points, registered
/// or not. For peers in this process Ferry knows the regions and checks
/// every remote range before submitting (and holds the peer's region while
/// the transfer runs, so the peer's `unregister` waits for it). Peers in
/// other processes are checked by the library alone (from v0.3.12; older
/// builds do not check, which the capability report says).
pub(super) static PEERS: LazyLock<Mutex<HashMap<String, (u64, RegionTable)>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// One handle returned by `open_segment`. Handles to the same name share
/// the library's segment (Mooncake caches it by name), which is closed when
/// the last handle is.
pub(super) struct Segment {
    pub(super) c_id: i32,
    pub(super) name: String,
    pub(super) gate: Arc<RwLock<()>>,
    pub(super) peer: Option<RegionTable>,
    /// The peer's generation does not acknowledge writes although this
    /// build does (a ≥ v0.3.12 engine and a v0.3.5–v0.3.11 peer): writes to
    /// it are confirmed by reading them back (see `landed`).
    pub(super) unacknowledged_peer: bool,
}

#[derive(Default)]
pub(super) struct Segments {
    pub(super) by_id: HashMap<u64, Segment>,
    /// Library segment id, number of open handles and whether the peer
    /// leaves writes unacknowledged, by name.
    by_name: HashMap<String, (i32, usize, bool)>,
}

impl Segments {
    /// The name of the segment library id `c_id` opens, when its peer's
    /// generation does not acknowledge writes (see `Segment`).
    pub(super) fn unacknowledged_peer_name(&self, c_id: i32) -> Option<String> {
        self.by_name
            .iter()
            .find(|(_, (id, _, unacked))| *id == c_id && *unacked)
            .map(|(name, _)| name.clone())
    }

    fn add(
        &mut self,
        name: &str,
        c_id: i32,
        peer: Option<RegionTable>,
        unacknowledged_peer: bool,
    ) -> SegmentId {
        let id = SegmentId::fresh().0;
        self.by_id.insert(
            id,
            Segment {
                c_id,
                name: name.to_owned(),
                gate: Arc::new(RwLock::new(())),
                peer,
                unacknowledged_peer,
            },
        );
        SegmentId(id)
    }
}

impl MooncakeEngine {
    /// `open_segment`: a new handle to segment `name`, opening it in the
    /// library unless another handle already did.
    pub(super) async fn open_handle(&self, name: &str) -> Result<SegmentId> {
        let peer = || lock(&PEERS).get(name).map(|(_, t)| t.clone());
        {
            let mut segs = lock(&self.inner.segments);
            if let Some((c_id, refs, unacked)) = segs.by_name.get_mut(name) {
                *refs += 1;
                let (c_id, unacked) = (*c_id, *unacked);
                return Ok(segs.add(name, c_id, peer(), unacked));
            }
        }
        let unacked = self.check_peer_generation(name).await?;
        let name_c = cstring("segment name", name)?;
        let this = Arc::clone(&self.inner);
        let c_id = blocking(move || {
            // SAFETY: live engine; the name outlives the call.
            unsafe { (this.lib.api.open_segment)(this.raw(), name_c.as_ptr()) }
        })
        .await?;
        if c_id < 0 {
            return Err(Error::SegmentUnavailable {
                name: name.to_owned(),
                reason: crate::codes::open_segment_failure(c_id, self.inner.lib.generation()),
            });
        }
        let mut segs = lock(&self.inner.segments);
        // Another open of the same name may have won the race; the library
        // returned the same cached segment to both.
        let entry = segs
            .by_name
            .entry(name.to_owned())
            .or_insert((c_id, 0, unacked));
        entry.1 += 1;
        let (c_id, unacked) = (entry.0, entry.2);
        Ok(segs.add(name, c_id, peer(), unacked))
    }

    /// Refuses a peer whose segment descriptor shows a Mooncake generation
    /// this engine's TCP transport cannot exchange bytes with (see
    /// `peer_wire`), before the library tries and fails. `Ok(true)`: the
    /// peer can be reached but does not acknowledge writes although this
    /// build does.
    async fn check_peer_generation(&self, name: &str) -> Result<bool> {
        if self.inner.config.protocol != "tcp" || !peer_check_enabled() {
            return Ok(false);
        }
        let Some(desc) = fetch_descriptor(&self.inner.config.metadata, name).await else {
            return Ok(false);
        };
        let Some(peer) = TcpWire::of_descriptor(&desc) else {
            return Ok(false);
        };
        let generation = self.inner.lib.generation();
        let local = TcpWire::of_generation(generation);
        local.check_peer(generation, peer, name)?;
        let unacked = local == TcpWire::Acknowledged && peer != TcpWire::Acknowledged;
        if unacked {
            tracing::warn!(
                segment = name,
                "mooncake: the peer is {}: it neither acknowledges writes nor checks \
                 addresses; {}",
                peer.releases(),
                if self.inner.scratch.is_some() {
                    "Ferry confirms writes to it by reading them back"
                } else {
                    "confirm_writes is off, so a write to it is reported when it is sent, \
                     before it has landed"
                }
            );
        } else {
            tracing::debug!(
                segment = name,
                peer = peer.releases(),
                "mooncake: peer generation"
            );
        }
        Ok(unacked)
    }

    /// `close_segment`: waits for the transfers on the handle, then closes
    /// the library's segment if this was its last handle.
    pub(super) async fn close_handle(&self, segment: SegmentId) -> Result<()> {
        let closing = lock(&self.inner.segments)
            .by_id
            .remove(&segment.0)
            .ok_or(Error::UnknownSegment(segment))?;
        // Transfers in flight on the handle hold its gate; wait for them.
        let _closed = closing.gate.write().await;
        let last = {
            let mut segs = lock(&self.inner.segments);
            match segs.by_name.get_mut(&closing.name) {
                Some((_, refs, _)) if *refs > 1 => {
                    *refs -= 1;
                    false
                }
                _ => {
                    segs.by_name.remove(&closing.name);
                    true
                }
            }
        };
        if !last {
            return Ok(());
        }
        let this = Arc::clone(&self.inner);
        let c_id = closing.c_id;
        // SAFETY: live engine; the id came from openSegment; no handle uses it.
        let rc =
            blocking(move || unsafe { (this.lib.api.close_segment)(this.raw(), c_id) }).await?;
        if rc != 0 {
            return Err(call_error("closeSegment", i64::from(rc)));
        }
        Ok(())
    }
}
