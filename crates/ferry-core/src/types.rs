//! Plain data types of the model: regions, requests, segments, batches,
//! notifications and batch outcomes.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
pub use crate::ids::{BatchId, SegmentId, MAX_LIVE_BATCHES};

/// Where registered memory lives, in Mooncake's notation: `cpu:N` (NUMA node
/// N), `cuda:N` (GPU N), or `*` (let the backend find out).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Location(String);

impl Location {
    /// Host memory on NUMA node `node`.
    pub fn cpu(node: u32) -> Self {
        Location(format!("cpu:{node}"))
    }
    /// Device memory of CUDA device `device`.
    pub fn cuda(device: u32) -> Self {
        Location(format!("cuda:{device}"))
    }
    /// Unspecified: the backend detects it (`*`).
    pub fn any() -> Self {
        Location("*".to_owned())
    }
    /// The location as Mooncake spells it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// Whether this is host memory (`cpu:*` or `*`).
    pub fn is_host(&self) -> bool {
        self.0 == "*" || self.0.starts_with("cpu")
    }
    /// Whether this is CUDA device memory.
    pub fn is_cuda(&self) -> bool {
        self.0.starts_with("cuda")
    }
}

impl Default for Location {
    fn default() -> Self {
        Location::cpu(0)
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Location {
    type Err = Error;
    /// Accepts `*`, `cpu`, `cpu:N`, `cuda:N` (and other `kind:N` names a
    /// backend may know, such as `npu:0`).
    fn from_str(s: &str) -> Result<Self> {
        let ok = s == "*"
            || s == "cpu"
            || s.split_once(':').is_some_and(|(kind, idx)| {
                !kind.is_empty()
                    && kind.chars().all(|c| c.is_ascii_alphanumeric())
                    && (idx == "*" || idx.parse::<u32>().is_ok())
            });
        if ok {
            Ok(Location(s.to_owned()))
        } else {
            Err(Error::InvalidArgument(format!(
                "memory location {s:?} is not `*`, `cpu:N` or `cuda:N`"
            )))
        }
    }
}

/// A range of process memory that may be registered with an engine.
///
/// Constructing one is the single place where Ferry relies on a caller's
/// promise about raw memory (see [`MemoryRegion::from_raw_parts`]); every
/// transfer is checked against registered regions, so transfers themselves
/// are safe to call.
///
/// Not `Clone`, and [`crate::TransferEngine::register`] takes it by value:
/// each `unsafe` construction vouches for one registration, so a copy kept
/// somewhere cannot register the memory again after it was freed:
///
/// ```compile_fail
/// fn copies<T: Clone>() {}
/// copies::<ferry_core::MemoryRegion>();
/// ```
#[derive(Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    /// Its bounds and location; every accessor comes from there (`Deref`).
    info: RegionInfo,
}

impl MemoryRegion {
    /// Describes `len` bytes at `ptr` living at `location`.
    ///
    /// # Safety
    ///
    /// From the moment the region is registered with any engine until the
    /// `unregister` of that engine returns, `[ptr, ptr+len)` must stay
    /// allocated and valid for reads and writes, and the caller must not hold
    /// Rust references into it across a transfer that may write it (a peer
    /// writes into registered memory the way a NIC's DMA does). Device memory
    /// (`cuda:N`) must be memory the backend can address.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize, location: Location) -> Self {
        MemoryRegion {
            info: RegionInfo {
                addr: ptr as u64,
                len: len as u64,
                location,
            },
        }
    }

    /// What a listing shows of it (a copy that cannot be registered).
    pub fn info(&self) -> RegionInfo {
        self.info.clone()
    }
}

/// The bounds and location of a region: what a [`MemoryRegion`] derefs to,
/// and what listings return (`RegionTable::regions`) — a copy with no way
/// to register the memory again.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RegionInfo {
    addr: u64,
    len: u64,
    location: Location,
}

impl std::ops::Deref for MemoryRegion {
    type Target = RegionInfo;
    fn deref(&self) -> &RegionInfo {
        &self.info
    }
}

impl RegionInfo {
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the region has no bytes (such a region cannot be registered).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// One past the last byte (saturating).
    pub fn end(&self) -> u64 {
        self.addr.saturating_add(self.len)
    }
    /// Where the memory lives.
    pub fn location(&self) -> &Location {
        &self.location
    }
    /// Whether `[addr, addr+len)` lies entirely inside this region
    /// (`len == 0` never does; an overflowing range never does).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match addr.checked_add(len) {
            Some(end) => len > 0 && addr >= self.addr && end <= self.end(),
            None => false,
        }
    }
    /// `Ok` for host memory; for anything else the
    /// [`Error::InvalidArgument`] a host-only backend returns.
    pub fn require_host(&self, backend: &str) -> Result<()> {
        if self.location.is_host() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "the {backend} backend registers host memory only, not {}",
                self.location
            )))
        }
    }

    /// Whether the two regions share at least one byte.
    pub fn overlaps(&self, other: &RegionInfo) -> bool {
        self.addr < other.end() && other.addr < self.end()
    }
}

/// Direction of a transfer, seen from the engine that issues it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferOp {
    /// Copy from the peer's memory into local memory.
    Read,
    /// Copy from local memory into the peer's memory.
    Write,
}

impl fmt::Display for TransferOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransferOp::Read => "read",
            TransferOp::Write => "write",
        })
    }
}

/// One transfer: `len` bytes between `local_addr` (inside a region registered
/// with the issuing engine) and `remote_addr` (a raw virtual address inside a
/// region registered with the peer — what SGLang calls
/// `peer_buffer_address`).
///
/// A zero-length request succeeds, moves nothing and checks no address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferRequest {
    /// Read or write.
    pub op: TransferOp,
    /// Address in local registered memory.
    pub local_addr: u64,
    /// Address in the peer's registered memory.
    pub remote_addr: u64,
    /// Number of bytes.
    pub len: u64,
}

impl TransferRequest {
    /// A write of `len` bytes from `local_addr` to the peer's `remote_addr`.
    pub fn write(local_addr: u64, remote_addr: u64, len: u64) -> Self {
        TransferRequest {
            op: TransferOp::Write,
            local_addr,
            remote_addr,
            len,
        }
    }
    /// A read of `len` bytes from the peer's `remote_addr` into `local_addr`.
    pub fn read(local_addr: u64, remote_addr: u64, len: u64) -> Self {
        TransferRequest {
            op: TransferOp::Read,
            local_addr,
            remote_addr,
            len,
        }
    }
}

/// Longest notification name, in bytes.
pub const MAX_NOTIFICATION_NAME: usize = 256;

/// Longest notification message, in bytes.
pub const MAX_NOTIFICATION_MESSAGE: usize = 64 * 1024;

/// A short message delivered to the peer after a batch has landed (Mooncake's
/// `notify_msg`). Neither field may contain a NUL byte (Mooncake passes them
/// as C strings).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Notification {
    /// A tag, usually the sender's name or a request id.
    pub name: String,
    /// The message.
    pub message: String,
}

impl Notification {
    /// A notification with `name` and `message`.
    pub fn new(name: impl Into<String>, message: impl Into<String>) -> Self {
        Notification {
            name: name.into(),
            message: message.into(),
        }
    }

    /// Checks the size limits and the no-NUL rule.
    pub fn validate(&self) -> Result<()> {
        if self.name.len() > MAX_NOTIFICATION_NAME {
            return Err(Error::InvalidArgument(format!(
                "notification name is {} bytes; the limit is {MAX_NOTIFICATION_NAME}",
                self.name.len()
            )));
        }
        if self.message.len() > MAX_NOTIFICATION_MESSAGE {
            return Err(Error::InvalidArgument(format!(
                "notification message is {} bytes; the limit is {MAX_NOTIFICATION_MESSAGE}",
                self.message.len()
            )));
        }
        if self.name.contains('\0') || self.message.contains('\0') {
            return Err(Error::InvalidArgument(
                "notification name and message may not contain NUL bytes".to_owned(),
            ));
        }
        Ok(())
    }
}

/// Outcome of every request of a finished batch, in the caller's order.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct BatchReport {
    /// `Ok(())` or the error of request `i`.
    pub results: Vec<Result<()>>,
}

impl BatchReport {
    /// A report where all `n` requests succeeded.
    pub fn all_ok(n: usize) -> Self {
        BatchReport {
            results: vec![Ok(()); n],
        }
    }
    /// Number of requests.
    pub fn len(&self) -> usize {
        self.results.len()
    }
    /// Whether the batch had no requests.
    pub fn is_empty(&self) -> bool {
        self.results.is_empty()
    }
    /// Whether every request succeeded.
    pub fn is_success(&self) -> bool {
        self.results.iter().all(Result::is_ok)
    }
    /// The failed requests: index and error.
    pub fn failures(&self) -> impl Iterator<Item = (usize, &Error)> + '_ {
        self.results
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().err().map(|e| (i, e)))
    }
    /// `Ok(())` if everything succeeded, else [`Error::BatchFailed`].
    pub fn into_result(self) -> Result<()> {
        let total = self.results.len();
        let mut failed = 0;
        let mut first = None;
        for (i, r) in self.results.into_iter().enumerate() {
            if let Err(e) = r {
                failed += 1;
                if first.is_none() {
                    first = Some((i, e));
                }
            }
        }
        match first {
            None => Ok(()),
            Some((first_index, e)) => Err(Error::BatchFailed {
                failed,
                total,
                first_index,
                first: Box::new(e),
            }),
        }
    }
}

/// State of one request of an asynchronous batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferState {
    /// Not finished; `transferred` bytes have moved so far.
    Pending {
        /// Bytes moved so far (may stay 0 until completion).
        transferred: u64,
    },
    /// Finished successfully.
    Completed,
    /// Finished with an error.
    Failed(Error),
}

impl TransferState {
    /// Whether the request has reached a terminal state.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, TransferState::Pending { .. })
    }
}

/// A snapshot of an asynchronous batch, one state per request in the
/// caller's order.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct BatchStatus {
    /// State of request `i`.
    pub states: Vec<TransferState>,
}

impl BatchStatus {
    /// Whether every request is terminal.
    pub fn is_finished(&self) -> bool {
        self.states.iter().all(TransferState::is_terminal)
    }
    /// The report, once the batch is finished.
    pub fn to_report(&self) -> Option<BatchReport> {
        if !self.is_finished() {
            return None;
        }
        Some(BatchReport {
            results: self
                .states
                .iter()
                .map(|s| match s {
                    TransferState::Failed(e) => Err(e.clone()),
                    _ => Ok(()),
                })
                .collect(),
        })
    }
}
