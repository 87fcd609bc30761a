//! The operations of [`crate::TransferEngine`] by name, and why a backend
//! lacks one. A leaf module: [`crate::error`] names these types, so they
//! depend on nothing of the crate (their `FromStr` lives in
//! [`crate::caps`]).

use std::fmt;

/// Every operation of [`crate::TransferEngine`], by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Operation {
    /// `register` (required).
    Register,
    /// `unregister` (required).
    Unregister,
    /// `batch_register` (optional).
    BatchRegister,
    /// `batch_unregister` (optional).
    BatchUnregister,
    /// `open_segment` / `close_segment` (required).
    OpenSegment,
    /// `transfer` (required).
    Transfer,
    /// `batch_transfer` (optional).
    BatchTransfer,
    /// `submit` / `status` / `release_batch` (optional).
    AsyncBatch,
    /// `wait` on an asynchronous batch (optional).
    BatchWait,
    /// Notifications with a batch and `take_notifications` (optional).
    Notify,
    /// Guarantee: a write reported completed has landed in the peer's memory
    /// (not merely been sent).
    LandedWrites,
    /// Guarantee: the peer refuses reads and writes outside the memory it
    /// registered.
    PeerValidation,
}

impl Operation {
    /// The optional operations, the ones [`crate::caps::Capabilities`] describes.
    pub const OPTIONAL: [Operation; 6] = [
        Operation::BatchRegister,
        Operation::BatchUnregister,
        Operation::BatchTransfer,
        Operation::AsyncBatch,
        Operation::BatchWait,
        Operation::Notify,
    ];

    /// The guarantees, which [`crate::caps::Capabilities`] also describes: not operations
    /// one calls, but promises about the required ones that some builds of a
    /// backend cannot make. `require=` accepts them.
    pub const GUARANTEES: [Operation; 2] = [Operation::LandedWrites, Operation::PeerValidation];

    /// The operation's name as used in reports and on command lines.
    pub fn name(self) -> &'static str {
        match self {
            Operation::Register => "register",
            Operation::Unregister => "unregister",
            Operation::BatchRegister => "batch_register",
            Operation::BatchUnregister => "batch_unregister",
            Operation::OpenSegment => "open_segment",
            Operation::Transfer => "transfer",
            Operation::BatchTransfer => "batch_transfer",
            Operation::AsyncBatch => "async_batch",
            Operation::BatchWait => "batch_wait",
            Operation::Notify => "notify",
            Operation::LandedWrites => "landed_writes",
            Operation::PeerValidation => "peer_validation",
        }
    }

    /// Whether the operation is optional (described by [`crate::caps::Capabilities`]).
    pub fn is_optional(self) -> bool {
        Self::OPTIONAL.contains(&self)
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a backend lacks an optional operation natively, and what would add it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MissingCapability {
    /// The operation.
    pub operation: Operation,
    /// Why it is not native (e.g. "libtransfer_engine.so has no submitTransferWithNotify").
    pub reason: String,
    /// The backend version that has it natively (e.g. "Mooncake v0.3.5").
    pub min_version: Option<String>,
}

impl fmt::Display for MissingCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.operation, self.reason)?;
        if let Some(v) = &self.min_version {
            write!(f, " (needs {v})")?;
        }
        Ok(())
    }
}
