//! The one error type every Ferry operation returns.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::ids::{BatchId, SegmentId, MAX_LIVE_BATCHES};
use crate::operation::{MissingCapability, Operation};

/// Result alias used throughout Ferry.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which side of a transfer an address belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// Memory registered with the engine that issues the request.
    Local,
    /// Memory registered with the peer engine (the segment's owner).
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

fn since(min_version: &Option<String>) -> String {
    match min_version {
        Some(v) => format!(" (native since {v})"),
        None => String::new(),
    }
}

fn at_peer(peer: &Option<String>) -> String {
    match peer {
        Some(p) => format!(" on peer {p}"),
        None => String::new(),
    }
}

fn list_missing(missing: &[MissingCapability]) -> String {
    missing
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Everything that can go wrong in Ferry.
///
/// Every variant carries what a person needs to act on it: the address, the
/// peer, the operation, the symbol, the minimum version. [`Error::is_retryable`]
/// separates transient failures (a peer that went away, a timeout) from
/// permanent ones (an address that is not registered, an unsupported
/// operation). The type is `Clone` so that one failure can be reported for
/// every request it affected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The backend does not offer this operation (and it was not emulated).
    #[error("{operation} is not supported by the {backend} backend: {reason}{}", since(.min_version))]
    Unsupported {
        /// Backend name (`tcp`, `mooncake`, `verbs`, `inproc`).
        backend: String,
        /// The operation that was asked for.
        operation: Operation,
        /// Why, in words a person can act on.
        reason: String,
        /// The backend version that offers it natively, where one does.
        min_version: Option<String>,
    },
    /// Strict mode: operations required at start-up are missing.
    #[error("the {backend} backend lacks required capabilities: {}", list_missing(.missing))]
    MissingCapabilities {
        /// Backend name.
        backend: String,
        /// Every missing capability with its reason.
        missing: Vec<MissingCapability>,
    },
    /// `[addr, addr+len)` does not lie inside one registered region.
    #[error("{side} address range {addr:#x}+{len} is not inside a registered region{}", at_peer(.peer))]
    AddressNotRegistered {
        /// Which engine's registrations were checked.
        side: Side,
        /// Start of the range.
        addr: u64,
        /// Length of the range.
        len: u64,
        /// The peer, for remote addresses.
        peer: Option<String>,
    },
    /// A region to register overlaps one that is already registered.
    #[error(
        "region {addr:#x}+{len} overlaps the registered region {existing_addr:#x}+{existing_len}"
    )]
    RegionOverlap {
        /// Start of the new region.
        addr: u64,
        /// Length of the new region.
        len: u64,
        /// Start of the region already registered.
        existing_addr: u64,
        /// Length of the region already registered.
        existing_len: u64,
    },
    /// `unregister` named an address where no region starts.
    #[error("no region is registered at {addr:#x}")]
    RegionNotRegistered {
        /// The address given.
        addr: u64,
    },
    /// `unregister` stopped waiting for a region that a peer may still
    /// write: a transfer into it was given up (its batch failed) but the
    /// peer could not be shown to have stopped copying. The region stays
    /// registered until it has (its addresses cannot be registered again
    /// meanwhile), and its memory must not be freed or reused:
    /// `RegisteredBuffer` leaks it.
    #[error("region {addr:#x} cannot be released yet: {reason}; it stays registered until then, and its memory must not be freed")]
    RegionHeld {
        /// Start of the region.
        addr: u64,
        /// Which peer, and why it cannot be shown to be done.
        reason: String,
    },
    /// A batch register failed part-way; everything it registered was
    /// unregistered again.
    #[error(
        "batch register failed at region {index} ({addr:#x}); nothing stays registered: {source}"
    )]
    BatchRegisterFailed {
        /// Index of the region that failed in the caller's slice.
        index: usize,
        /// Its address.
        addr: u64,
        /// Why it failed.
        source: Box<Error>,
    },
    /// An argument is malformed (zero-length region, oversized notification…).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A peer segment could not be opened or reached.
    #[error("segment {name:?} is unavailable: {reason}")]
    SegmentUnavailable {
        /// The segment name (`host:port` for most backends).
        name: String,
        /// Why.
        reason: String,
    },
    /// The segment handle is not open on this engine.
    #[error("segment handle {0} is not open")]
    UnknownSegment(SegmentId),
    /// The batch id is not known (never issued, or already released).
    #[error("batch {0} is unknown (never submitted, or already released)")]
    UnknownBatch(BatchId),
    /// The batch still has requests in flight.
    #[error("batch {0} still has requests in flight")]
    BatchBusy(BatchId),
    /// More requests in one batch than the backend accepts.
    #[error("a batch of {len} requests exceeds the limit of {max}")]
    BatchTooLarge {
        /// Requests given.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Some requests of a batch failed (see [`crate::BatchReport`] for each).
    #[error("{failed} of {total} requests failed; first (request {first_index}): {first}")]
    BatchFailed {
        /// How many failed.
        failed: usize,
        /// How many there were.
        total: usize,
        /// Index of the first failed request.
        first_index: usize,
        /// Its error.
        first: Box<Error>,
    },
    /// The peer went away or reset the connection.
    #[error("peer {peer} was lost: {reason}")]
    PeerLost {
        /// The peer segment name.
        peer: String,
        /// What happened.
        reason: String,
    },
    /// An operation did not finish in time.
    #[error("{operation} timed out after {after:?}{}", at_peer(.peer))]
    Timeout {
        /// What was being done.
        operation: String,
        /// The peer involved, if any.
        peer: Option<String>,
        /// The deadline that passed.
        after: Duration,
    },
    /// A peer sent something that breaks the protocol.
    #[error("protocol error from {peer}: {reason}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// Authentication with a peer failed.
    #[error("authentication with {peer} failed: {reason}")]
    Authentication {
        /// The peer.
        peer: String,
        /// What failed.
        reason: String,
    },
    /// An operating-system I/O error.
    #[error("I/O error while {context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The error kind.
        kind: std::io::ErrorKind,
        /// The OS message.
        message: String,
        /// The `std::io::Error` itself, where there was one (its
        /// `raw_os_error`, its own source), as [`std::error::Error::source`].
        #[source]
        source: Option<IoSource>,
    },
    /// The backend cannot run here (library not found, no device…).
    #[error("the {backend} backend is unavailable: {reason}")]
    Unavailable {
        /// Backend name.
        backend: String,
        /// Why, including what was tried.
        reason: String,
    },
    /// A shared library lacks a symbol that is required.
    #[error("{library} does not export the required symbol {symbol}{}", since(.min_version))]
    MissingSymbol {
        /// The library path.
        library: String,
        /// The symbol.
        symbol: String,
        /// The version that introduced it, where known.
        min_version: Option<String>,
    },
    /// A backend returned an error code.
    #[error("{backend} returned error {code} ({name}) during {operation}")]
    Backend {
        /// Backend name.
        backend: String,
        /// The call that failed.
        operation: String,
        /// The raw code.
        code: i64,
        /// Its symbolic name.
        name: String,
    },
    /// A transfer the backend ran reached a failed state with no error
    /// code of its own (Mooncake's task status FAILED or INVALID): the
    /// backend cannot tell which of the usual causes it was.
    #[error("{backend}: transfer to {peer} ended with status {status}: {detail}")]
    TransferFailed {
        /// Backend name.
        backend: String,
        /// The peer segment.
        peer: String,
        /// The backend's status name (`FAILED`).
        status: String,
        /// What the status can mean on this backend and build.
        detail: String,
    },
    /// The engine is shutting down or the request was canceled.
    #[error("canceled: {0}")]
    Canceled(String),
    /// A bounded queue or table is full (batches not yet released,
    /// notifications not yet taken): nothing was done; try again once the
    /// consumer has caught up.
    #[error(
        "{backend}: {what} is full ({}); release or consume some and try again",
        limit_text(*queue, *limit)
    )]
    QueueFull {
        /// Backend name (or `adapter`).
        backend: String,
        /// Which queue is full.
        queue: Queue,
        /// Whose queue, in words (e.g. "127.0.0.1:4000's notification queue").
        what: String,
        /// The bound that was reached, in [`Queue::unit`]s; `None` when the
        /// peer that refused did not say.
        limit: Option<u64>,
    },
}

/// The bounded queues and tables that refuse with [`Error::QueueFull`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Queue {
    /// The table of submitted batches not yet waited for or released
    /// (release some, or wait for them).
    Batches,
    /// A peer's queue of notifications not yet taken (the peer must take
    /// some; the data of the batch has landed).
    Notifications,
    /// A control channel to a peer that does not read it.
    Control,
}

impl Queue {
    /// What the queue's limit counts: `batches`, `notifications`, `messages`.
    pub fn unit(self) -> &'static str {
        match self {
            Queue::Batches => "batches",
            Queue::Notifications => "notifications",
            Queue::Control => "messages",
        }
    }

    /// The name used in Python's error attributes and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Queue::Batches => "batches",
            Queue::Notifications => "notifications",
            Queue::Control => "control",
        }
    }
}

fn limit_text(queue: Queue, limit: Option<u64>) -> String {
    match limit {
        Some(n) => format!("{n} {}", queue.unit()),
        None => "the peer's bound".to_owned(),
    }
}

impl Error {
    /// Whether trying the same thing again later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::PeerLost { .. }
            | Error::Timeout { .. }
            | Error::SegmentUnavailable { .. }
            | Error::QueueFull { .. }
            | Error::BatchBusy(_) => true,
            Error::Io { kind, .. } => io_kind_is_transient(*kind),
            Error::BatchFailed { first, .. } => first.is_retryable(),
            _ => false,
        }
    }

    /// Builds [`Error::Unsupported`].
    pub fn unsupported(backend: &str, operation: Operation, reason: impl Into<String>) -> Self {
        Error::Unsupported {
            backend: backend.to_owned(),
            operation,
            reason: reason.into(),
            min_version: None,
        }
    }

    /// Builds [`Error::Io`] from an `std::io::Error` and what was being done.
    /// The error is kept as the source (a copy with the same kind, OS code
    /// and message: `std::io::Error` is not `Clone`).
    pub fn io(context: impl Into<String>, err: &std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            kind: err.kind(),
            message: err.to_string(),
            source: Some(IoSource::copy_of(err)),
        }
    }

    /// [`Error::io`] taking the error by value (kept whole as the source).
    pub fn from_io(context: impl Into<String>, err: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            kind: err.kind(),
            message: err.to_string(),
            source: Some(IoSource(Arc::new(err))),
        }
    }

    /// What kind of failure this is, for a program that branches on it.
    /// For [`Error::BatchFailed`] and [`Error::BatchRegisterFailed`] it is
    /// the kind of the first failure (the cause), so that a batch failing
    /// because its peer was lost reads as [`ErrorKind::PeerLost`].
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Unsupported { .. } | Error::MissingCapabilities { .. } => ErrorKind::Unsupported,
            Error::AddressNotRegistered { .. } | Error::RegionNotRegistered { .. } => {
                ErrorKind::NotRegistered
            }
            Error::RegionOverlap { .. } => ErrorKind::AlreadyRegistered,
            Error::RegionHeld { .. } => ErrorKind::RegionHeld,
            Error::BatchRegisterFailed { source, .. } => source.kind(),
            Error::InvalidArgument(_) | Error::BatchTooLarge { .. } => ErrorKind::InvalidArgument,
            Error::SegmentUnavailable { .. } => ErrorKind::PeerUnreachable,
            Error::UnknownSegment(_) | Error::UnknownBatch(_) => ErrorKind::UnknownHandle,
            Error::BatchBusy(_) => ErrorKind::Busy,
            Error::BatchFailed { first, .. } => first.kind(),
            Error::PeerLost { .. } => ErrorKind::PeerLost,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Protocol { .. } => ErrorKind::Protocol,
            Error::Authentication { .. } => ErrorKind::Authentication,
            Error::Io { .. } => ErrorKind::Io,
            Error::Unavailable { .. } | Error::MissingSymbol { .. } => ErrorKind::Unavailable,
            Error::Backend { .. } | Error::TransferFailed { .. } => ErrorKind::Backend,
            Error::Canceled(_) => ErrorKind::Canceled,
            Error::QueueFull { .. } => ErrorKind::QueueFull,
        }
    }

    /// Whether, and how, trying again can help (see [`Retry`]).
    pub fn retry(&self) -> Retry {
        match self {
            // Refused before anything was done; the condition can pass.
            Error::QueueFull { .. }
            | Error::BatchBusy(_)
            | Error::RegionHeld { .. }
            | Error::SegmentUnavailable { .. } => Retry::Temporary,
            // A transfer was (or may have been) under way: some or all of
            // its bytes may have landed, and a notification may have been
            // delivered.
            Error::PeerLost { .. }
            | Error::Timeout { .. }
            | Error::TransferFailed { .. }
            | Error::Backend { .. }
            | Error::Canceled(_) => Retry::MaybeApplied,
            Error::Io { kind, .. } => {
                if io_kind_is_transient(*kind) {
                    Retry::MaybeApplied
                } else {
                    Retry::Permanent
                }
            }
            Error::BatchFailed { first, .. } => first.retry(),
            // Nothing stays registered after a failed batch register.
            Error::BatchRegisterFailed { source, .. } => match source.retry() {
                Retry::MaybeApplied => Retry::Temporary,
                other => other,
            },
            Error::Unsupported { .. }
            | Error::MissingCapabilities { .. }
            | Error::AddressNotRegistered { .. }
            | Error::RegionOverlap { .. }
            | Error::RegionNotRegistered { .. }
            | Error::InvalidArgument(_)
            | Error::UnknownSegment(_)
            | Error::UnknownBatch(_)
            | Error::BatchTooLarge { .. }
            | Error::Protocol { .. }
            | Error::Authentication { .. }
            | Error::Unavailable { .. }
            | Error::MissingSymbol { .. } => Retry::Permanent,
        }
    }
}

fn io_kind_is_transient(kind: std::io::ErrorKind) -> bool {
    matches!(
        kind,
        std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
            | std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::UnexpectedEof
    )
}

/// What kind of failure an [`Error`] is ([`Error::kind`]): one value per
/// situation a program handles differently, stable across backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The backend does not offer the operation (or strict mode found
    /// required operations missing).
    Unsupported,
    /// An address range or region is not registered.
    NotRegistered,
    /// A region overlaps one already registered.
    AlreadyRegistered,
    /// A region cannot be released yet: a peer may still write it.
    RegionHeld,
    /// A malformed argument (zero length, too many requests…).
    InvalidArgument,
    /// A peer segment could not be opened or reached.
    PeerUnreachable,
    /// A segment or batch handle this engine does not know.
    UnknownHandle,
    /// The batch still has requests in flight.
    Busy,
    /// The peer went away.
    PeerLost,
    /// A deadline passed.
    Timeout,
    /// The peer broke the protocol (or speaks another one).
    Protocol,
    /// Authentication failed.
    Authentication,
    /// An operating-system I/O error.
    Io,
    /// The backend cannot run here (library, symbol or device missing).
    Unavailable,
    /// The backend's library reported a failure of its own.
    Backend,
    /// The engine is shutting down, or the operation was canceled.
    Canceled,
    /// A bounded queue or table is full.
    QueueFull,
}

/// Whether trying again can help ([`Error::retry`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Retry {
    /// Nothing was done, and the condition can pass (a full queue, a busy
    /// batch, a peer not reachable yet): the same call may succeed later.
    Temporary,
    /// The operation was under way when it failed: some or all of it may
    /// have taken effect (bytes written, a notification delivered). A
    /// transfer may be retried (writing the same bytes again is harmless),
    /// but nothing may be assumed about what landed.
    MaybeApplied,
    /// Trying the same call again cannot succeed: change the input, the
    /// configuration or the peer.
    Permanent,
}

/// The `std::io::Error` behind an [`Error::Io`], shared so that the error
/// stays `Clone`. Two are equal when kind, OS code and message are.
#[derive(Clone)]
pub struct IoSource(Arc<std::io::Error>);

impl IoSource {
    /// A copy of `err` with the same kind, OS error code and message.
    pub fn copy_of(err: &std::io::Error) -> Self {
        let copy = match err.raw_os_error() {
            Some(code) => std::io::Error::from_raw_os_error(code),
            None => std::io::Error::new(err.kind(), err.to_string()),
        };
        IoSource(Arc::new(copy))
    }

    /// The error.
    pub fn get(&self) -> &std::io::Error {
        &self.0
    }
}

impl std::fmt::Debug for IoSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for IoSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for IoSource {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for IoSource {
    fn eq(&self, other: &Self) -> bool {
        self.0.kind() == other.0.kind()
            && self.0.raw_os_error() == other.0.raw_os_error()
            && self.0.to_string() == other.0.to_string()
    }
}

impl Eq for IoSource {}

/// [`Error::QueueFull`] for an engine holding [`crate::MAX_LIVE_BATCHES`]
/// batches.
pub fn live_batches_full(backend: &str) -> Error {
    batches_full(backend, MAX_LIVE_BATCHES)
}

/// [`Error::QueueFull`] for a batch table holding `limit` batches.
pub(crate) fn batches_full(backend: &str, limit: usize) -> Error {
    Error::QueueFull {
        backend: backend.to_owned(),
        queue: Queue::Batches,
        what: "the table of submitted, not yet released batches".to_owned(),
        limit: Some(limit as u64),
    }
}
