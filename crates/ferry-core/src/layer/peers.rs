//! The peer name behind each open segment handle, for labels and span
//! fields, with the number of distinct names bounded.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use crate::__private::sync::{lock, read, write};
use crate::types::{SegmentId, TransferOp, TransferRequest};

/// The label of peers beyond the limit.
pub(crate) const OTHER: &str = "other";
/// The label of a segment handle this layer did not see opened.
pub(crate) const UNKNOWN: &str = "unknown";

/// Segment handle → peer label; with a limit, at most that many distinct
/// names, the rest fold into [`OTHER`]; without, the names as they are.
#[derive(Debug)]
pub(crate) struct Peers {
    limit: Option<usize>,
    names: Mutex<HashSet<Arc<str>>>,
    segments: RwLock<HashMap<SegmentId, Arc<str>>>,
}

impl Peers {
    pub(crate) fn new(limit: Option<usize>) -> Self {
        Peers {
            limit,
            names: Mutex::new(HashSet::new()),
            segments: RwLock::new(HashMap::new()),
        }
    }

    /// The label for the peer called `name`: itself while fewer than
    /// `limit` names are known, [`OTHER`] after.
    pub(crate) fn label(&self, name: &str) -> Arc<str> {
        let Some(limit) = self.limit else {
            return Arc::from(name);
        };
        let mut names = lock(&self.names);
        if let Some(known) = names.get(name) {
            return Arc::clone(known);
        }
        if names.len() >= limit {
            return Arc::from(OTHER);
        }
        let label: Arc<str> = Arc::from(name);
        names.insert(Arc::clone(&label));
        label
    }

    /// Records that `segment` reaches the peer called `name`.
    pub(crate) fn opened(&self, segment: SegmentId, name: &str) {
        let label = self.label(name);
        write(&self.segments).insert(segment, label);
    }

    /// Forgets `segment` (its label stays known).
    pub(crate) fn closed(&self, segment: SegmentId) {
        write(&self.segments).remove(&segment);
    }

    /// The label of the peer behind `segment`.
    pub(crate) fn of(&self, segment: SegmentId) -> Arc<str> {
        read(&self.segments)
            .get(&segment)
            .cloned()
            .unwrap_or_else(|| Arc::from(UNKNOWN))
    }

    /// The labels known so far (without `other` / `unknown`).
    pub(crate) fn known(&self) -> Vec<Arc<str>> {
        lock(&self.names).iter().cloned().collect()
    }
}

/// `read`, `write`, or `mixed` for a batch of both (`none` when empty).
pub(crate) fn batch_op(requests: &[TransferRequest]) -> &'static str {
    let mut ops = requests.iter().map(|r| r.op);
    match ops.next() {
        None => "none",
        Some(first) if ops.all(|op| op == first) => op_label(first),
        Some(_) => "mixed",
    }
}

/// `read` or `write`.
pub(crate) fn op_label(op: TransferOp) -> &'static str {
    match op {
        TransferOp::Read => "read",
        TransferOp::Write => "write",
    }
}

/// Bytes the requests ask to move.
pub(crate) fn batch_bytes(requests: &[TransferRequest]) -> u64 {
    requests.iter().map(|r| r.len).fold(0, u64::saturating_add)
}
