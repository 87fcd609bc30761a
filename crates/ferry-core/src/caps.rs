//! What a backend can do natively, and how the adapter reports it.

use std::fmt;
use std::str::FromStr;

use crate::error::Error;
pub use crate::operation::{MissingCapability, Operation};

impl FromStr for Operation {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let all = [
            Operation::Register,
            Operation::Unregister,
            Operation::BatchRegister,
            Operation::BatchUnregister,
            Operation::OpenSegment,
            Operation::Transfer,
            Operation::BatchTransfer,
            Operation::AsyncBatch,
            Operation::BatchWait,
            Operation::Notify,
            Operation::LandedWrites,
            Operation::PeerValidation,
        ];
        let wanted = s.trim().replace('-', "_");
        all.into_iter()
            .find(|op| op.name() == wanted)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown operation {s:?}; known: {}",
                    all.map(Operation::name).join(", ")
                ))
            })
    }
}

/// Kinds of memory a backend can register.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemoryKinds {
    /// Host memory (`cpu:N`, `*`).
    pub host: bool,
    /// CUDA device memory (`cuda:N`).
    pub cuda: bool,
}

impl Default for MemoryKinds {
    fn default() -> Self {
        MemoryKinds {
            host: true,
            cuda: false,
        }
    }
}

/// What a backend does natively, one public field per optional operation.
///
/// `#[non_exhaustive]`, so that a new capability is not a breaking change:
/// outside this crate start from [`Capabilities::default`] (nothing
/// optional) or [`Capabilities::all`] and set fields:
///
/// ```
/// let mut caps = ferry_core::Capabilities::default();
/// caps.batch_transfer = true;
/// caps.max_batch_len = Some(1024);
/// assert!(!caps.notify);
/// ```
///
/// Through a [`crate::CapabilityAdapter`], `capabilities()` returns the
/// *effective* set instead: what works through the adapter, natively or by
/// emulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Capabilities {
    /// `batch_register` is native (all-or-nothing).
    pub batch_register: bool,
    /// `batch_unregister` is native.
    pub batch_unregister: bool,
    /// `batch_transfer` is native.
    pub batch_transfer: bool,
    /// `submit` / `status` / `release_batch` are native.
    pub async_batch: bool,
    /// `wait` is native.
    pub batch_wait: bool,
    /// Notifications are native.
    pub notify: bool,
    /// Most requests one batch may hold (`None`: no limit).
    pub max_batch_len: Option<usize>,
    /// Memory kinds that can be registered.
    pub memory: MemoryKinds,
    /// Guarantee: `Completed` for a write means its bytes are in the peer's
    /// memory (see [`Operation::LandedWrites`]). `true` by default.
    pub landed_writes: bool,
    /// Guarantee: the peer checks every address against its registered
    /// memory (see [`Operation::PeerValidation`]). `true` by default.
    pub peer_validation: bool,
}

impl Default for Capabilities {
    /// Nothing optional; host memory only; no batch limit; both guarantees
    /// (every backend gives them unless it says otherwise).
    fn default() -> Self {
        Capabilities {
            batch_register: false,
            batch_unregister: false,
            batch_transfer: false,
            async_batch: false,
            batch_wait: false,
            notify: false,
            max_batch_len: None,
            memory: MemoryKinds::default(),
            landed_writes: true,
            peer_validation: true,
        }
    }
}

impl Capabilities {
    /// Everything optional on; host memory; no batch limit.
    pub fn all() -> Self {
        Capabilities {
            batch_register: true,
            batch_unregister: true,
            batch_transfer: true,
            async_batch: true,
            batch_wait: true,
            notify: true,
            ..Default::default()
        }
    }

    /// Whether `op` is available: required operations always are; optional
    /// ones as the fields say.
    pub fn supports(&self, op: Operation) -> bool {
        match op {
            Operation::BatchRegister => self.batch_register,
            Operation::BatchUnregister => self.batch_unregister,
            Operation::BatchTransfer => self.batch_transfer,
            Operation::AsyncBatch => self.async_batch,
            Operation::BatchWait => self.batch_wait,
            Operation::Notify => self.notify,
            Operation::LandedWrites => self.landed_writes,
            Operation::PeerValidation => self.peer_validation,
            _ => true,
        }
    }

    /// Sets the field of optional `op` (required operations are ignored).
    pub fn set(&mut self, op: Operation, on: bool) {
        match op {
            Operation::BatchRegister => self.batch_register = on,
            Operation::BatchUnregister => self.batch_unregister = on,
            Operation::BatchTransfer => self.batch_transfer = on,
            Operation::AsyncBatch => self.async_batch = on,
            Operation::BatchWait => self.batch_wait = on,
            Operation::Notify => self.notify = on,
            Operation::LandedWrites => self.landed_writes = on,
            Operation::PeerValidation => self.peer_validation = on,
            _ => {}
        }
    }
}

/// What a backend says about itself beyond [`Capabilities`]: details for the
/// capability report (library path, detected generation, device) and the
/// reason for every optional operation it lacks.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct BackendInfo {
    /// Backend name (`tcp`, `mooncake`, `verbs`, `inproc`).
    pub backend: String,
    /// Free-form `(key, value)` facts, in display order.
    pub details: Vec<(String, String)>,
    /// For each optional operation that is not native: why, and which version
    /// would make it native. Operations not listed get a generic reason.
    pub not_native: Vec<MissingCapability>,
    /// Operations or guarantees the backend declares available but provides
    /// by its own emulation, with how (e.g. confirming each write by reading
    /// it back). Reported as emulated; the reason and version come from
    /// `not_native`.
    pub emulated: Vec<(Operation, String)>,
}

impl BackendInfo {
    /// The backend's note on `op`, if it gave one.
    pub fn note(&self, op: Operation) -> Option<&MissingCapability> {
        self.not_native.iter().find(|m| m.operation == op)
    }

    /// How the backend emulates `op` itself, if it does.
    pub fn emulation(&self, op: Operation) -> Option<&str> {
        self.emulated
            .iter()
            .find(|(o, _)| *o == op)
            .map(|(_, via)| via.as_str())
    }
}

/// How an operation is provided through the adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Support {
    /// The backend does it itself.
    Native,
    /// The adapter emulates it with the same observable semantics.
    Emulated {
        /// How (e.g. "single registers, all-or-nothing").
        via: String,
        /// Why the backend lacks it and which version adds it natively.
        missing: MissingCapability,
    },
    /// Neither the backend nor the adapter offers it.
    Unsupported(MissingCapability),
}

impl Support {
    /// Whether the operation can be used (natively or emulated).
    pub fn is_available(&self) -> bool {
        !matches!(self, Support::Unsupported(_))
    }
    /// `native`, `emulated` or `unsupported`.
    pub fn kind(&self) -> &'static str {
        match self {
            Support::Native => "native",
            Support::Emulated { .. } => "emulated",
            Support::Unsupported(_) => "unsupported",
        }
    }
}

/// The report a person reads before deploying: native and effective
/// capabilities and, per optional operation, how it is provided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapabilityReport {
    /// What the backend said about itself.
    pub info: BackendInfo,
    /// What the backend does natively.
    pub native: Capabilities,
    /// What works through the adapter.
    pub effective: Capabilities,
    /// One entry per optional operation, in [`Operation::OPTIONAL`] order.
    pub operations: Vec<(Operation, Support)>,
    /// One entry per guarantee, in [`Operation::GUARANTEES`] order.
    pub guarantees: Vec<(Operation, Support)>,
    /// Whether the adapter runs in strict mode (no emulation).
    pub strict: bool,
}

impl CapabilityReport {
    /// How `op` is provided (required operations are always native).
    pub fn support(&self, op: Operation) -> Support {
        self.operations
            .iter()
            .chain(&self.guarantees)
            .find(|(o, _)| *o == op)
            .map(|(_, s)| s.clone())
            .unwrap_or(Support::Native)
    }

    /// The operations among `ops` that are not available, with reasons.
    pub fn missing(&self, ops: &[Operation]) -> Vec<MissingCapability> {
        ops.iter()
            .filter_map(|op| match self.support(*op) {
                Support::Unsupported(m) => Some(m),
                _ => None,
            })
            .collect()
    }
}

impl fmt::Display for CapabilityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "backend: {}", self.info.backend)?;
        for (k, v) in &self.info.details {
            writeln!(f, "{k}: {v}")?;
        }
        if self.strict {
            writeln!(f, "mode: strict (no emulation)")?;
        }
        match self.native.max_batch_len {
            Some(n) => writeln!(f, "max batch length: {n}")?,
            None => writeln!(f, "max batch length: unlimited")?,
        }
        writeln!(
            f,
            "memory: host {}, cuda {}",
            yes_no(self.native.memory.host),
            yes_no(self.native.memory.cuda)
        )?;
        writeln!(f, "operations:")?;
        for (op, support) in &self.operations {
            write_support(f, *op, support, "native", "unsupported", "needs")?;
        }
        writeln!(f, "guarantees:")?;
        for (op, support) in &self.guarantees {
            write_support(f, *op, support, "yes", "no", "from")?;
        }
        Ok(())
    }
}

/// One line of the report: `native`/`yes`, `emulated (how): why`, or
/// `unsupported`/`no` with the reason and the version that adds it.
fn write_support(
    f: &mut fmt::Formatter<'_>,
    op: Operation,
    support: &Support,
    yes: &str,
    no: &str,
    version_word: &str,
) -> fmt::Result {
    match support {
        Support::Native => writeln!(f, "  {:<17} {yes}", op.name()),
        Support::Emulated { via, missing } => {
            write!(
                f,
                "  {:<17} emulated ({via}): {}",
                op.name(),
                missing.reason
            )?;
            if let Some(v) = &missing.min_version {
                write!(f, "; native with {v}")?;
            }
            writeln!(f)
        }
        Support::Unsupported(missing) => {
            write!(f, "  {:<17} {no}: {}", op.name(), missing.reason)?;
            if let Some(v) = &missing.min_version {
                write!(f, "; {version_word} {v}")?;
            }
            writeln!(f)
        }
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}
