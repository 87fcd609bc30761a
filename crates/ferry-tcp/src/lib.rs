//! # ferry-tcp
//!
//! Ferry's TCP transport, the backend every machine has. Each
//! [`TcpEngine`] listens on a socket (default `127.0.0.1:0`); its segment
//! name is the bound `host:port`. Peers connect, run a versioned handshake
//! that carries the target's region table (and, with a shared secret, an
//! HMAC-SHA256 challenge–response in both directions), then pipeline
//! WRITE / READ / NOTIFY requests on one or more connections.
//!
//! Properties (see `PROTOCOL.md` for the wire format):
//!
//! - **Zero user-space payload copies**: write payloads go from registered
//!   memory to the socket with one vectored `sendmsg` (header and payload
//!   together) and from the socket straight into the destination region with
//!   a vectored `recvmsg`; read responses likewise. The I/O uses raw
//!   `iovec`s, so no Rust reference into registered memory ever exists.
//! - **Gathering**: the small requests of a batch travel as WRITEV / READV
//!   frames, one system call per side for up to 512 of them.
//! - **Never trust the peer**: the initiator validates every request against
//!   its own regions and the target's table before sending; the target
//!   validates again under a [`ferry_core::RegionGuard`] and answers
//!   `AddressNotRegistered` without touching memory. Frame sizes and counts
//!   are bounded; nothing a peer sends makes the engine allocate more than a
//!   fixed amount or spawn a task per frame. Inbound connections are capped
//!   twice: a small handshake budget with a short deadline and per-source
//!   eviction, and `max_inbound` established ones (beyond: `Busy`); idle
//!   ones expire. Frames carry the generation of the region they target, so
//!   none lands in memory registered after it was sent.
//! - **Failure isolation**: a peer that dies, stalls or speaks garbage fails
//!   only the requests on its connections, with [`ferry_core::Error::PeerLost`],
//!   [`ferry_core::Error::Timeout`] or [`ferry_core::Error::Protocol`];
//!   the next use reconnects.
//! - **Unregister waits** for in-flight transfers on both sides — for a
//!   bounded time: payloads must move at `min_rate` after a `stall_timeout`
//!   grace, and batches expire at `request_timeout + bytes / min_rate`
//!   (failing only themselves). See the README for the guarantees under
//!   hostile load.
//! - **Same-host path**: between engines of one machine (same boot id and
//!   PID namespace, and the kernel lets the target `ptrace` the
//!   initiator), payloads bypass the socket: frames below 8 MiB through a
//!   sealed shared-memory staging area, copied by both processes at once
//!   (see the README), larger ones by `process_vm_readv` / `process_vm_writev`
//!   performed by the target — always after its usual checks; the socket
//!   carries only requests and (some) acknowledgements.
//!   `same_host=auto|cma|off`; the path to each peer (or why not) is in
//!   `backend_info()`. See the README.
//! - **TLS 1.3** (`tls=on|require`, rustls, no OpenSSL), negotiated in the
//!   handshake: certificates (`tls_cert`, `tls_key`, `tls_ca`, mutual) or an
//!   identity derived from the shared secret; the HMAC proofs run inside TLS
//!   bound to its exporter. The same-host path is not encrypted (it never
//!   leaves the machine). See the README and `PROTOCOL.md` §1.3.
//! - **Latency**: `TCP_NODELAY`, a bounded busy-poll before sleeping (no
//!   core spins while idle), and acknowledgements coalesced per batch.
//!
//! ```no_run
//! # async fn demo() -> ferry_core::Result<()> {
//! use ferry_tcp::{TcpConfig, TcpEngine};
//! use ferry_core::{TransferEngine, TransferRequest};
//! let engine = TcpEngine::start(TcpConfig::from_url("tcp://10.0.0.1:7000?secret=s3cret")?).await?;
//! let seg = engine.open_segment("10.0.0.2:7000").await?;
//! # let (local, remote) = (0u64, 0u64);
//! engine.transfer(seg, TransferRequest::write(local, remote, 4096)).await?;
//! # Ok(()) }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

mod client;
mod config;
mod copy_gate;
mod engine;
mod handshake;
mod io;
mod quiet;
mod same_host;
mod server;
mod stream;
mod tls;

// The sans-IO core (issue 42), under the paths the modules had here.
pub(crate) use ferry_tcp_proto::{frame, negotiate};

// The core has no ferry-core (which needs tokio): its notification limits
// are literals that must stay ferry-core's.
const _: () = assert!(
    frame::MAX_NOTIFY_NAME == ferry_core::MAX_NOTIFICATION_NAME as u64
        && frame::MAX_NOTIFY_MESSAGE == ferry_core::MAX_NOTIFICATION_MESSAGE as u64
);

pub use config::{SameHost, TcpConfig, TcpConfigBuilder};
pub use engine::TcpEngine;
pub use negotiate::{FeatureOff, FeatureState, PeerReport, VersionRange};
pub use server::{MAX_QUEUED_NOTIFICATIONS, MAX_QUEUED_NOTIFICATION_BYTES};
pub use tls::TlsMode;

/// The wire format, the staging area and the same-host checks, for this
/// crate's own tests (raw and hostile peers speak the protocol by hand).
/// Feature `test-support`, off by default; not part of the API. Other
/// crates' hostile tests take the frames from `ferry_tcp_proto::frame`.
#[cfg(feature = "test-support")]
pub mod test_support {
    /// The frames (see PROTOCOL.md).
    pub mod frame {
        pub use crate::frame::*;
    }
    /// The same-host offer and its checks.
    pub mod cma {
        pub use crate::config::SameHost;
        pub use crate::same_host::cma::*;
    }
    /// The staging area.
    pub mod stage {
        pub use crate::same_host::stage::*;
    }
    /// The handshake's negotiation (extension blocks, features).
    pub mod negotiate {
        pub use crate::negotiate::*;
    }
}
