//! # ferry
//!
//! Moves bytes between the memories of cooperating processes — the KV-cache
//! hand-off of disaggregated LLM serving — through one trait,
//! [`TransferEngine`], and several transports behind it.
//!
//! The backend is a cargo feature plus a URL, not a code change:
//!
//! | feature | URL | backend |
//! |---|---|---|
//! | `tcp` (default) | `tcp://127.0.0.1:0?secret=…` | tokio TCP, no system library |
//! | `mooncake` | `mooncake://?lib=/path/libtransfer_engine.so&metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1` | Mooncake Transfer Engine, loaded at run time |
//! | `verbs` | `verbs://mlx5_0?port=1&gid_index=3` | native RDMA verbs |
//! | `nixl` | `nixl://?backends=UCX&host=127.0.0.1` | NVIDIA NIXL (`libnixl_capi.so`), loaded at run time |
//!
//! [`Engine::open`] starts the backend the URL's scheme names (looked up
//! in the scheme [`registry`], where a backend outside Ferry registers its
//! own scheme too; `inproc://`, engines of this process, with the feature
//! `inproc`) and wraps it in the
//! [`CapabilityAdapter`]: every operation of the trait is available, either
//! natively or emulated with the same observable semantics, and
//! [`Engine::report`] says which. `?strict=1` turns emulation off and
//! `?require=batch_transfer,notify` makes opening fail when an operation is
//! missing (see [`EngineConfig`] for every parameter).
//!
//! ```no_run
//! use std::sync::Arc;
//! use ferry::{Engine, RegisteredBuffer, TransferEngine, TransferRequest};
//!
//! # async fn demo() -> ferry::Result<()> {
//! let decode = Arc::new(Engine::open("tcp://127.0.0.1:0").await?);
//! let prefill = Arc::new(Engine::open("tcp://127.0.0.1:0").await?);
//! let kv = RegisteredBuffer::new(decode.clone(), 1 << 20).await?;
//! let src = RegisteredBuffer::new(prefill.clone(), 4096).await?;
//! let peer = prefill.open_segment(decode.segment_name()).await?;
//! prefill
//!     .transfer(peer, TransferRequest::write(src.addr(), kv.addr(), 4096))
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! The user's API of `ferry_core` is re-exported here, so users depend
//! on `ferry` alone; what only backend authors need is in [`raw`].
#![forbid(unsafe_code)]
// With no backend feature on, `Engine` and `BackendConfig` are empty enums:
// the dispatch code is then unreachable by construction.
#![cfg_attr(
    not(any(
        feature = "tcp",
        feature = "mooncake",
        feature = "verbs",
        feature = "nixl"
    )),
    allow(unreachable_code, unused_variables, unused_imports, dead_code)
)]

pub mod blocking;
mod builtin;
mod config;
mod discovery;
mod dispatch;
pub mod multi;
pub mod registry;
pub mod secret;

pub use config::{BackendConfig, BackendKind, DiscoveryConfig, EngineConfig};
pub use dispatch::{Engine, Stack};

pub use ferry_core::{
    AdapterConfig, BackendInfo, BatchId, BatchReport, BatchStatus, BoxFuture, Capabilities,
    CapabilityAdapter, CapabilityReport, DynTransferEngine, Error, ErrorKind, FastPath, HostBuffer,
    IoSource, LocalSpan, Location, MemoryKinds, MemoryRegion, MissingCapability, Notification,
    Operation, RegionInfo, RegisteredBuffer, RegisteredBuffers, RemoteSpan, Result, Retry,
    SegmentId, Side, Support, TransferEngine, TransferEngineExt, TransferOp, TransferRequest,
    TransferState, MAX_LIVE_BATCHES, MAX_NOTIFICATION_MESSAGE, MAX_NOTIFICATION_NAME,
};

/// Layers over an engine ([`Engine::layer`]): metrics, tracing, timeouts,
/// the capability adapter's own three (coalescing, emulation, the
/// concurrency limit of emulated batches), and the [`Layer`] trait for a
/// user's own.
pub use ferry_core::layer;
pub use ferry_core::layer::LayerExt;
pub use ferry_core::{
    ConcurrencyLimitLayer, Layer, Metrics, MetricsLayer, MetricsSnapshot, TimeoutLayer,
    TracingLayer,
};

/// What backend authors need and users do not: the region table, the
/// adapter as a layer, request coalescing (see `ferry_core::raw`). The
/// conformance suite and the in-process engine are in `ferry_core`
/// behind its `conformance` and `inproc` features.
pub use ferry_core::raw;

/// A shared secret that never prints (`TcpConfig::secret`,
/// `VerbsConfig::secret`).
pub use ferry_core::Secret;

/// Blocking calls from threads outside the runtime (Python, C callers):
/// [`assist::block_on`] runs a call on the calling thread, which drives the
/// connections the call uses while it waits instead of waiting to be woken
/// by a runtime worker.
pub use ferry_core::assist;

/// The TCP backend (feature `tcp`): its configuration, its engine and what
/// it reports about a peer. Reach the engine behind an [`Engine`] with
/// `engine.backend::<ferry::tcp::TcpEngine>()`.
#[cfg(feature = "tcp")]
pub mod tcp {
    pub use ferry_tcp::{
        FeatureOff, FeatureState, PeerReport, SameHost, TcpConfig, TcpConfigBuilder, TcpEngine,
        TlsMode, VersionRange, MAX_QUEUED_NOTIFICATIONS, MAX_QUEUED_NOTIFICATION_BYTES,
    };
}

/// What a TCP engine negotiated with a peer ([`Engine::peer_report`]).
#[cfg(feature = "tcp")]
pub use ferry_tcp::{FeatureOff, FeatureState, PeerReport, VersionRange};

/// A wire protocol this build speaks, with the range of its versions a
/// peer may use (the pair negotiates the highest common one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireProtocol {
    /// Its name (`ferry-tcp`).
    pub name: &'static str,
    /// Oldest version spoken.
    pub min: u16,
    /// Newest version spoken.
    pub max: u16,
}

/// The wire protocols of the backends compiled into this build (Ferry's
/// own protocols only: the Mooncake backend speaks the installed
/// library's).
pub fn wire_protocols() -> Vec<WireProtocol> {
    [
        #[cfg(feature = "tcp")]
        WireProtocol {
            name: "ferry-tcp",
            min: ferry_tcp::VersionRange::OURS.min,
            max: ferry_tcp::VersionRange::OURS.max,
        },
    ]
    .to_vec()
}

/// `VERSION (wire protocols: ferry-tcp 4..=6)`: the crate version and the
/// range of every wire protocol in [`wire_protocols`], for `--version`
/// lines and logs.
pub fn version_line() -> String {
    let protocols: Vec<String> = wire_protocols()
        .iter()
        .map(|p| format!("{} {}..={}", p.name, p.min, p.max))
        .collect();
    let protocols = if protocols.is_empty() {
        "none".to_owned()
    } else {
        protocols.join(", ")
    };
    format!(
        "{} (wire protocols: {protocols})",
        env!("CARGO_PKG_VERSION")
    )
}

/// The crate version as a PEP 440 version whose local label names the
/// wire-protocol ranges (`0.1.0+tcp4to6`): what the Python package's
/// `ferry.__version__` is, so that `packaging.version.Version` still
/// parses it and a person still reads which peers it talks to.
pub fn pep440_version() -> String {
    let labels: Vec<String> = wire_protocols()
        .iter()
        .map(|p| {
            let short = p.name.trim_start_matches("ferry-");
            format!("{short}{}to{}", p.min, p.max)
        })
        .collect();
    if labels.is_empty() {
        env!("CARGO_PKG_VERSION").to_owned()
    } else {
        format!("{}+{}", env!("CARGO_PKG_VERSION"), labels.join("."))
    }
}

/// The Mooncake Transfer Engine backend (feature `mooncake`): its
/// configuration, its engine and the loaded library with its generation.
#[cfg(feature = "mooncake")]
pub mod mooncake {
    pub use ferry_mooncake::{
        code_name, Generation, LibrarySource, LibraryTrust, MooncakeConfig, MooncakeConfigBuilder,
        MooncakeEngine, MooncakeErrorCode, MooncakeLibrary, DEFAULT_LIBRARY, LIBRARY_ENV,
    };
}

/// The RDMA verbs backend (feature `verbs`): its configuration, its engine
/// and what it negotiated with a peer.
#[cfg(feature = "verbs")]
pub mod verbs {
    pub use ferry_verbs::{
        Feature, FeatureState, PeerProtocol, VerbsConfig, VerbsConfigBuilder, VerbsEngine,
        VersionRange,
    };
}

/// The NVIDIA NIXL backend (feature `nixl`): its configuration, its engine
/// and the loaded library with its generation.
#[cfg(feature = "nixl")]
pub mod nixl {
    pub use ferry_nixl::{
        active_python_wheel_library, Generation, LibrarySource, LibraryTrust, NixlConfig,
        NixlConfigBuilder, NixlEngine, NixlLibrary, DEFAULT_LIBRARY, LIBRARY_ENV,
    };
}

/// For Ferry's own crates only (the CLI, the Python package): not part of
/// the API, not covered by semver, hidden from the documentation.
#[doc(hidden)]
pub mod __private {
    pub use ferry_core::__private::sync;
}

/// The repository README's examples, compiled as doc tests so that they stay
/// true to the API.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// This crate's README (`multi://`), compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct CrateReadmeDoctests;
