//! # mooncake-testlibs — faithful C-ABI test implementations (NOT Mooncake)
//!
//! The real `libtransfer_engine.so` cannot be installed on CI machines, so
//! Ferry's tests load these instead: small, independent C implementations of
//! Mooncake Transfer Engine's C API, one shared library per release
//! generation, each exporting exactly that generation's symbols with the same
//! argument lists and struct layouts, and really moving bytes between the
//! registered memory of engines (in one process or in several, over loopback
//! TCP sockets). They are test doubles written for Ferry; they share no code
//! with Mooncake.
//!
//! The build script compiles them with the system C compiler (found by the
//! `cc` crate) into this crate's `OUT_DIR`; [`library_path`] and
//! [`broken_library_path`] return absolute paths fixed at compile time, so
//! any crate that lists `mooncake-testlibs` as a (dev-)dependency can load
//! them from its own tests.
//!
//! What the libraries reproduce from real builds, and the test-only
//! conventions they add (a `file://<dir>` metadata "server" for generations
//! that have no `P2PHANDSHAKE`; in `installTransport`'s NIC priority matrix,
//! `stall=<ms>`, which delays every read/write the engine serves, and, up to
//! v0.3.6, `land_delay=<ms>` and `land_cap_mib=<n>`, which time and bound
//! the old TCP transport's late landing of written bytes, and
//! `unreg_refuse_len=<n>`, which makes the library keep regions of `n`
//! bytes when asked to unregister them, and `reg_fail_len=<n>`, which makes
//! it refuse to register regions of `n` bytes), are listed at the
//! top of `csrc/mooncake_testlib.c`.
#![forbid(unsafe_code)]

use std::fmt;
use std::path::PathBuf;

/// A Mooncake Transfer Engine C API generation, as told apart by its symbols.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Generation {
    /// Before v0.2.0 (late 2024): `createTransferEngine(metadata_uri)` +
    /// `initTransferEngine`, `installOrGetTransport`, batch/status calls on a
    /// transport handle.
    PreV0_2_0,
    /// v0.2.0 (2025-01): the engine-handle API, 4-argument
    /// `createTransferEngine`, needs a metadata server.
    V0_2_0,
    /// v0.3.0 (2025-05): 5-argument `createTransferEngine`,
    /// `getLocalIpAndPort`, `openSegmentNoCache`, `removeLocalSegment`,
    /// `P2PHANDSHAKE`.
    V0_3_0,
    /// v0.3.5 (2025-07): `submitTransferWithNotify`, `getNotifsFromEngine`,
    /// `genNotifyInEngine`.
    V0_3_5,
    /// v0.3.6 (2025-09): `freeNotifsMsgBuf`.
    V0_3_6,
    /// Current, v0.3.12 (2026-07): adds v0.3.11's `discoverTopology`,
    /// `warmupEfaSegment` and v0.3.12's `getNicLoadStats`, `showLinks`,
    /// `enableGracefulShutdown`.
    Current,
}

impl Generation {
    /// Every generation, oldest first.
    pub const ALL: [Generation; 6] = [
        Generation::PreV0_2_0,
        Generation::V0_2_0,
        Generation::V0_3_0,
        Generation::V0_3_5,
        Generation::V0_3_6,
        Generation::Current,
    ];

    /// The release this library stands for (`"v0.3.5"`; `"pre-v0.2.0"`).
    pub fn version(self) -> &'static str {
        match self {
            Generation::PreV0_2_0 => "pre-v0.2.0",
            Generation::V0_2_0 => "v0.2.0",
            Generation::V0_3_0 => "v0.3.0",
            Generation::V0_3_5 => "v0.3.5",
            Generation::V0_3_6 => "v0.3.6",
            Generation::Current => "v0.3.12",
        }
    }

    /// Whether the library understands the `P2PHANDSHAKE` metadata string
    /// (otherwise use [`file_metadata`]).
    pub fn has_p2p_handshake(self) -> bool {
        self >= Generation::V0_3_0
    }

    /// Whether error codes are negative (older builds) or positive.
    pub fn negative_error_codes(self) -> bool {
        self <= Generation::V0_3_0
    }

    /// Whether the library reproduces the TCP transport of real builds
    /// before v0.3.12 (up to v0.3.6 here): a WRITE is reported completed
    /// before its bytes land in the peer's memory (some milliseconds later,
    /// the last byte last), and the peer checks no address (a WRITE lands
    /// wherever it points, an unmapped target is silently dropped; a READ is
    /// served from wherever it points, FAILED only if that is unmapped).
    pub fn has_old_tcp_transport(self) -> bool {
        self <= Generation::V0_3_6
    }

    /// Exactly the symbols the library exports, sorted.
    pub fn symbols(self) -> Vec<&'static str> {
        let mut v: Vec<&'static str> = match self {
            Generation::PreV0_2_0 => PRE_V0_2_0.to_vec(),
            _ => V0_2_0.to_vec(),
        };
        if self >= Generation::V0_3_0 {
            v.extend(V0_3_0_ADDS);
        }
        if self >= Generation::V0_3_5 {
            v.extend(V0_3_5_ADDS);
        }
        if self >= Generation::V0_3_6 {
            v.extend(V0_3_6_ADDS);
        }
        if self >= Generation::Current {
            v.extend(V0_3_11_ADDS);
            v.extend(V0_3_12_ADDS);
        }
        v.sort_unstable();
        v
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.version())
    }
}

/// Symbols of the pre-v0.2.0 generation.
pub const PRE_V0_2_0: &[&str] = &[
    "createTransferEngine",
    "initTransferEngine",
    "installOrGetTransport",
    "uninstallTransport",
    "destroyTransferEngine",
    "openSegment",
    "closeSegment",
    "registerLocalMemory",
    "unregisterLocalMemory",
    "allocateBatchID",
    "submitTransfer",
    "getTransferStatus",
    "freeBatchID",
];
/// Symbols of v0.2.0.
pub const V0_2_0: &[&str] = &[
    "createTransferEngine",
    "installTransport",
    "uninstallTransport",
    "openSegment",
    "closeSegment",
    "destroyTransferEngine",
    "registerLocalMemory",
    "unregisterLocalMemory",
    "registerLocalMemoryBatch",
    "unregisterLocalMemoryBatch",
    "allocateBatchID",
    "submitTransfer",
    "getTransferStatus",
    "freeBatchID",
    "syncSegmentCache",
];
/// Added by v0.3.0.
pub const V0_3_0_ADDS: &[&str] = &[
    "getLocalIpAndPort",
    "openSegmentNoCache",
    "removeLocalSegment",
];
/// Added by v0.3.5.
pub const V0_3_5_ADDS: &[&str] = &[
    "submitTransferWithNotify",
    "getNotifsFromEngine",
    "genNotifyInEngine",
];
/// Added by v0.3.6.
pub const V0_3_6_ADDS: &[&str] = &["freeNotifsMsgBuf"];
/// Added by v0.3.11.
pub const V0_3_11_ADDS: &[&str] = &["discoverTopology", "warmupEfaSegment"];
/// Added by v0.3.12.
pub const V0_3_12_ADDS: &[&str] = &["getNicLoadStats", "showLinks", "enableGracefulShutdown"];

/// Every symbol any generation exports (for probing a library's exact set).
pub fn all_known_symbols() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = PRE_V0_2_0
        .iter()
        .chain(V0_2_0)
        .chain(V0_3_0_ADDS)
        .chain(V0_3_5_ADDS)
        .chain(V0_3_6_ADDS)
        .chain(V0_3_11_ADDS)
        .chain(V0_3_12_ADDS)
        .copied()
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Libraries that must be refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Broken {
    /// The v0.3.0 test library without `submitTransfer` (a required symbol).
    MissingSubmitTransfer,
    /// A shared library that exports none of Mooncake's symbols.
    NotMooncake,
}

const OUT_DIR: &str = env!("OUT_DIR");

/// Absolute path of the test library for `gen` (built into this crate's
/// `OUT_DIR`; valid from any crate's tests).
pub fn library_path(gen: Generation) -> PathBuf {
    let stem = match gen {
        Generation::PreV0_2_0 => "mooncake_testlib_pre_v0_2_0",
        Generation::V0_2_0 => "mooncake_testlib_v0_2_0",
        Generation::V0_3_0 => "mooncake_testlib_v0_3_0",
        Generation::V0_3_5 => "mooncake_testlib_v0_3_5",
        Generation::V0_3_6 => "mooncake_testlib_v0_3_6",
        Generation::Current => "mooncake_testlib_v0_3_12",
    };
    PathBuf::from(OUT_DIR).join(format!("lib{stem}.so"))
}

/// Absolute path of a library that the backend must refuse.
pub fn broken_library_path(kind: Broken) -> PathBuf {
    let stem = match kind {
        Broken::MissingSubmitTransfer => "mooncake_testlib_missing_submit",
        Broken::NotMooncake => "not_mooncake",
    };
    PathBuf::from(OUT_DIR).join(format!("lib{stem}.so"))
}

/// A fresh directory for the test libraries' `file://` metadata convention
/// (generations without `P2PHANDSHAKE`), and the metadata string naming it.
/// The directory lives under the system temp dir; the caller may remove it,
/// and the first call in a process removes those left by processes that no
/// longer run.
pub fn file_metadata(tag: &str) -> (PathBuf, String) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(sweep_stale_metadata_dirs);
    let dir = std::env::temp_dir().join(format!(
        "ferry-mooncake-meta-{}-{}-{}",
        std::process::id(),
        tag,
        N.fetch_add(1, Ordering::Relaxed)
    ));
    // Creating a directory under the temp dir only fails when the machine is
    // badly broken; the test that uses it will then fail with a clear error
    // from the library.
    let _ = std::fs::create_dir_all(&dir);
    let url = format!("file://{}", dir.display());
    (dir, url)
}

/// Removes `ferry-mooncake-meta-<pid>-…` directories of dead processes.
fn sweep_stale_metadata_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix("ferry-mooncake-meta-"))
        else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
