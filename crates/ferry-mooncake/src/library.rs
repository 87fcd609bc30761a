//! Loading `libtransfer_engine.so` at run time: resolution, symbol probing,
//! generation detection.
//!
//! Declarations here are Ferry's own, written from the facts of Mooncake's
//! `transfer_engine_c.h`; nothing is linked at build time.

use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_core::raw::dl::{self, CLibrary};
use ferry_core::{Error, Result};

use crate::config::MooncakeConfig;

/// Environment variable naming the library to load when the configuration
/// does not (see [`MooncakeLibrary::resolve`] for the whole order).
pub const LIBRARY_ENV: &str = "FERRY_MOONCAKE_LIB";

/// File name handed to the dynamic loader when neither the configuration nor
/// [`LIBRARY_ENV`] names a library (found through `LD_LIBRARY_PATH`, the
/// `ld.so` cache and the default directories).
pub const DEFAULT_LIBRARY: &str = "libtransfer_engine.so";

// ------------------------------------------------------------------ C types

/// `transfer_engine_t` / `transport_t`.
pub(crate) type Handle = *mut c_void;

/// `struct transfer_request`. The four bytes between `target_id` and
/// `target_offset` are alignment padding in every released header (v0.2.0
/// to v0.3.12); Ferry declares them explicitly and always writes 0, so that
/// no uninitialised byte reaches the library.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CTransferRequest {
    pub opcode: c_int,
    pub source: *mut c_void,
    pub target_id: i32,
    pub file_id_or_padding: u32,
    pub target_offset: u64,
    pub length: u64,
}

// SAFETY: the pointer is the address of registered memory, handed to the
// library and never dereferenced by Ferry.
unsafe impl Send for CTransferRequest {}

/// `struct transfer_status`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CTransferStatus {
    pub status: c_int,
    pub transferred_bytes: u64,
}

/// `struct buffer_entry`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CBufferEntry {
    pub addr: *mut c_void,
    pub length: usize,
}

// SAFETY: as for `CTransferRequest`.
unsafe impl Send for CBufferEntry {}

/// `struct notify_msg` (passed by value).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CNotifyMsg {
    pub name: *mut c_char,
    pub msg: *mut c_char,
}

const _: () = assert!(std::mem::size_of::<CTransferRequest>() == 40);
const _: () = assert!(std::mem::offset_of!(CTransferRequest, target_offset) == 24);
const _: () = assert!(std::mem::size_of::<CTransferStatus>() == 16);

pub(crate) const OPCODE_READ: c_int = 0;
pub(crate) const OPCODE_WRITE: c_int = 1;
pub(crate) const INVALID_BATCH: u64 = u64::MAX;

/// `transfer_status.status` values.
pub(crate) mod status {
    pub const WAITING: i32 = 0;
    pub const PENDING: i32 = 1;
    pub const INVALID: i32 = 2;
    pub const CANCELED: i32 = 3;
    pub const COMPLETED: i32 = 4;
    pub const TIMEOUT: i32 = 5;
    pub const FAILED: i32 = 6;
}

/// `createTransferEngine`, always declared with five arguments.
///
/// Mooncake v0.2.0 exported a 4-argument `createTransferEngine(metadata,
/// local_server_name, ip_or_host, rpc_port)`; from 2025-01-23 (and in every
/// v0.3.x) the same symbol takes a fifth `int auto_discover`. Builds between
/// v0.2.0 and that date have no symbol that tells them apart, so Ferry calls
/// every build through this 5-argument type and passes `auto_discover = 0`:
///
/// - on the C calling conventions Ferry supports (x86-64 System V and
///   AArch64 AAPCS64) the first six/eight integer and pointer arguments
///   travel in registers and the caller owns the stack, so a 4-argument
///   callee simply never reads the fifth register: the call is well defined
///   for both kinds of build;
/// - `0` is also what a 4-argument build does (no topology auto-discovery;
///   the transport is installed explicitly with `installTransport`), so both
///   kinds of build behave the same.
///
/// The crate refuses to compile for other architectures rather than guess
/// (see `lib.rs`). `registerLocalMemory` gets the same treatment: it is
/// always called with the trailing `remote_accessible = 1` that some builds
/// declare and others do not.
pub(crate) type CreateFn =
    unsafe extern "C" fn(*const c_char, *const c_char, *const c_char, u64, c_int) -> Handle;
pub(crate) type DestroyFn = unsafe extern "C" fn(Handle);
pub(crate) type InstallTransportFn =
    unsafe extern "C" fn(Handle, *const c_char, *mut *mut c_void) -> Handle;
pub(crate) type UninstallTransportFn = unsafe extern "C" fn(Handle, *const c_char) -> c_int;
pub(crate) type OpenSegmentFn = unsafe extern "C" fn(Handle, *const c_char) -> i32;
pub(crate) type CloseSegmentFn = unsafe extern "C" fn(Handle, i32) -> c_int;
pub(crate) type RegisterFn =
    unsafe extern "C" fn(Handle, *mut c_void, usize, *const c_char, c_int) -> c_int;
pub(crate) type UnregisterFn = unsafe extern "C" fn(Handle, *mut c_void) -> c_int;
pub(crate) type RegisterBatchFn =
    unsafe extern "C" fn(Handle, *mut CBufferEntry, usize, *const c_char) -> c_int;
pub(crate) type UnregisterBatchFn = unsafe extern "C" fn(Handle, *mut *mut c_void, usize) -> c_int;
pub(crate) type AllocateBatchFn = unsafe extern "C" fn(Handle, usize) -> u64;
pub(crate) type SubmitFn = unsafe extern "C" fn(Handle, u64, *mut CTransferRequest, usize) -> c_int;
pub(crate) type GetStatusFn =
    unsafe extern "C" fn(Handle, u64, usize, *mut CTransferStatus) -> c_int;
pub(crate) type FreeBatchFn = unsafe extern "C" fn(Handle, u64) -> c_int;
pub(crate) type SyncSegmentCacheFn = unsafe extern "C" fn(Handle) -> c_int;
pub(crate) type GetLocalIpAndPortFn = unsafe extern "C" fn(Handle, *mut c_char, usize) -> c_int;
pub(crate) type RemoveLocalSegmentFn = unsafe extern "C" fn(Handle, *const c_char) -> c_int;
pub(crate) type SubmitWithNotifyFn =
    unsafe extern "C" fn(Handle, u64, *mut CTransferRequest, usize, CNotifyMsg) -> c_int;
pub(crate) type GetNotifsFn = unsafe extern "C" fn(Handle, *mut c_int) -> *mut CNotifyMsg;
pub(crate) type GenNotifyFn = unsafe extern "C" fn(Handle, u64, CNotifyMsg) -> c_int;
pub(crate) type FreeNotifsFn = unsafe extern "C" fn(*mut CNotifyMsg, c_int) -> c_int;

/// The entry points Ferry uses. Required ones are plain function pointers
/// (a library without one is refused at load); optional ones are `Option`s
/// and become capabilities. A few are resolved only so that a library
/// lacking them is refused or classified; Ferry does not call them yet.
#[derive(Clone, Copy)]
#[allow(dead_code)]
pub(crate) struct Api {
    pub create: CreateFn,
    pub destroy: DestroyFn,
    pub install_transport: InstallTransportFn,
    pub uninstall_transport: UninstallTransportFn,
    pub open_segment: OpenSegmentFn,
    pub close_segment: CloseSegmentFn,
    pub register: RegisterFn,
    pub unregister: UnregisterFn,
    pub register_batch: RegisterBatchFn,
    pub unregister_batch: UnregisterBatchFn,
    pub allocate_batch: AllocateBatchFn,
    pub submit: SubmitFn,
    pub get_status: GetStatusFn,
    pub free_batch: FreeBatchFn,
    pub sync_segment_cache: SyncSegmentCacheFn,
    // v0.3.0
    pub get_local_ip_and_port: Option<GetLocalIpAndPortFn>,
    pub open_segment_no_cache: Option<OpenSegmentFn>,
    pub remove_local_segment: Option<RemoveLocalSegmentFn>,
    // v0.3.5
    pub submit_with_notify: Option<SubmitWithNotifyFn>,
    pub get_notifs: Option<GetNotifsFn>,
    pub gen_notify: Option<GenNotifyFn>,
    // v0.3.6
    pub free_notifs: Option<FreeNotifsFn>,
}

/// Symbols every supported library must export (the v0.2.0 C API).
pub const REQUIRED_SYMBOLS: [&str; 15] = [
    "createTransferEngine",
    "destroyTransferEngine",
    "installTransport",
    "uninstallTransport",
    "openSegment",
    "closeSegment",
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

/// Optional symbols Ferry probes, with the Mooncake release that added each.
pub const OPTIONAL_SYMBOLS: [(&str, Generation); 13] = [
    ("getLocalIpAndPort", Generation::V0_3_0),
    ("openSegmentNoCache", Generation::V0_3_0),
    ("removeLocalSegment", Generation::V0_3_0),
    ("submitTransferWithNotify", Generation::V0_3_5),
    ("getNotifsFromEngine", Generation::V0_3_5),
    ("genNotifyInEngine", Generation::V0_3_5),
    ("freeNotifsMsgBuf", Generation::V0_3_6),
    ("discoverTopology", Generation::V0_3_11),
    ("warmupEfaSegment", Generation::V0_3_11),
    ("getNicLoadStats", Generation::V0_3_12),
    ("showLinks", Generation::V0_3_12),
    ("enableGracefulShutdown", Generation::V0_3_12),
    // Listed for completeness of the probe; never called.
    ("syncSegmentCache", Generation::V0_2_0),
];

/// Symbols only the pre-v0.2.0 C API had.
const PRE_V0_2_0_MARKERS: [&str; 2] = ["initTransferEngine", "installOrGetTransport"];

// ------------------------------------------------------------------ generations

/// A Mooncake C API generation, detected from the symbols a library exports
/// (no symbol reports the version). Each is "this release or a later one
/// that added nothing Ferry probes".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Generation {
    /// v0.2.0 (2025-01): the engine-handle C API; needs a metadata server.
    V0_2_0,
    /// v0.3.0 (2025-05): `getLocalIpAndPort`, `openSegmentNoCache`,
    /// `removeLocalSegment`; `P2PHANDSHAKE` metadata.
    V0_3_0,
    /// v0.3.5 (2025-07): notifications (`submitTransferWithNotify`,
    /// `getNotifsFromEngine`, `genNotifyInEngine`).
    V0_3_5,
    /// v0.3.6 (2025-09): `freeNotifsMsgBuf`.
    V0_3_6,
    /// v0.3.11: `discoverTopology`, `warmupEfaSegment`.
    V0_3_11,
    /// v0.3.12 (2026-07): `getNicLoadStats`, `showLinks`,
    /// `enableGracefulShutdown`.
    V0_3_12,
}

impl Generation {
    /// The release, as `v0.3.5`.
    pub fn version(self) -> &'static str {
        match self {
            Generation::V0_2_0 => "v0.2.0",
            Generation::V0_3_0 => "v0.3.0",
            Generation::V0_3_5 => "v0.3.5",
            Generation::V0_3_6 => "v0.3.6",
            Generation::V0_3_11 => "v0.3.11",
            Generation::V0_3_12 => "v0.3.12",
        }
    }

    /// `Mooncake v0.3.5`, the form used in capability reports.
    pub fn mooncake_version(self) -> String {
        format!("Mooncake {}", self.version())
    }

    /// The symbol whose presence identifies this generation.
    pub fn marker(self) -> &'static str {
        match self {
            Generation::V0_2_0 => "submitTransfer",
            Generation::V0_3_0 => "getLocalIpAndPort",
            Generation::V0_3_5 => "submitTransferWithNotify",
            Generation::V0_3_6 => "freeNotifsMsgBuf",
            Generation::V0_3_11 => "discoverTopology",
            Generation::V0_3_12 => "getNicLoadStats",
        }
    }

    fn detect(has: impl Fn(&str) -> bool) -> Generation {
        [
            Generation::V0_3_12,
            Generation::V0_3_11,
            Generation::V0_3_6,
            Generation::V0_3_5,
            Generation::V0_3_0,
        ]
        .into_iter()
        .find(|g| has(g.marker()))
        .unwrap_or(Generation::V0_2_0)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.version())
    }
}

// ------------------------------------------------------------------ library

/// Where the library path came from ([`LibrarySource::PythonWheel`] is
/// never the source of a Mooncake library: `mooncake-py://` loads the wheel
/// through Python).
pub use ferry_core::raw::dl::LibrarySource;

/// A loaded Mooncake Transfer Engine library. Every engine (and every batch
/// reaper) made from it holds an `Arc` to it, so the code stays mapped while
/// anything can still call into it.
pub struct MooncakeLibrary {
    path: PathBuf,
    requested: PathBuf,
    source: LibrarySource,
    generation: Generation,
    present: Vec<&'static str>,
    pub(crate) api: Api,
    // Declared last: dropped after everything above (plain data anyway).
    _lib: CLibrary,
}

impl fmt::Debug for MooncakeLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MooncakeLibrary")
            .field("path", &self.path)
            .field("source", &self.source)
            .field("generation", &self.generation)
            .field("optional_symbols", &self.present)
            .finish()
    }
}

fn unavailable(reason: String) -> Error {
    Error::Unavailable {
        backend: "mooncake".to_owned(),
        reason,
    }
}

impl MooncakeLibrary {
    /// Resolves and loads the library for `config`, in this order:
    ///
    /// 1. `config.library` (`lib=` in a `mooncake://` URL), if set;
    /// 2. the [`LIBRARY_ENV`] (`FERRY_MOONCAKE_LIB`) environment variable, if
    ///    set and not empty;
    /// 3. [`DEFAULT_LIBRARY`] (`libtransfer_engine.so`) through the dynamic
    ///    loader's normal search (`LD_LIBRARY_PATH`, `ld.so.cache`, system
    ///    directories).
    ///
    /// Only the first source that is set is tried: an explicit choice that
    /// fails is an error, never a silent fall-back to another library. The
    /// error ([`Error::Unavailable`]) names what was tried and why it failed.
    ///
    /// # Safety
    ///
    /// As [`MooncakeLibrary::load`], for whichever library the order above
    /// picks: `lib=` and `FERRY_MOONCAKE_LIB` choose native code that runs
    /// in this process, so they must come from the operator.
    pub unsafe fn resolve(config: &MooncakeConfig) -> Result<Arc<MooncakeLibrary>> {
        let (path, source) = dl::choose(config.library.as_deref(), LIBRARY_ENV, DEFAULT_LIBRARY);
        tracing::debug!(path = %path.display(), source = %source, "ferry: loading the Mooncake library");
        // SAFETY: forwarded to the caller; `load_from` checks that the
        // library exports Mooncake's C API before any of its functions runs.
        let lib = unsafe { Self::load_from(&path, source) }?;
        tracing::info!(
            path = %lib.path.display(),
            source = %lib.source,
            generation = %lib.generation,
            "ferry: loaded the Mooncake Transfer Engine library"
        );
        Ok(lib)
    }

    /// Loads the library at `path` and checks it.
    ///
    /// # Safety
    ///
    /// Loading a shared library runs its initialisers, and the symbols found
    /// are called with the signatures of Mooncake's C API: `path` must be a
    /// Mooncake Transfer Engine library (any release from v0.2.0) or a
    /// library implementing the same C API, not merely one exporting
    /// functions with the same names and different signatures.
    pub unsafe fn load(path: &Path) -> Result<Arc<MooncakeLibrary>> {
        // SAFETY: forwarded to the caller.
        unsafe { Self::load_from(path, LibrarySource::Config) }
    }

    unsafe fn load_from(path: &Path, source: LibrarySource) -> Result<Arc<MooncakeLibrary>> {
        let shown = path.display().to_string();
        // SAFETY: see the function contract; the flags: see ferry_core::raw::dl.
        let lib = unsafe { CLibrary::open(path) }.map_err(|e| {
            unavailable(format!(
                "cannot load {shown} (from the {source}): {e}; set `lib=` in the URL or \
                 {LIBRARY_ENV} to the path of libtransfer_engine.so (Mooncake ≥ v0.2.0)"
            ))
        })?;
        let has = |name: &str| lib.has(name);
        if PRE_V0_2_0_MARKERS.iter().any(|s| has(s)) {
            return Err(unavailable(format!(
                "{shown} is a Mooncake Transfer Engine from before v0.2.0 (it exports \
                 initTransferEngine/installOrGetTransport): that C API changed between \
                 snapshots without a symbol to tell them apart, and calling the wrong shape \
                 would corrupt memory, so Ferry does not support it; install Mooncake ≥ v0.2.0"
            )));
        }
        let all_known = REQUIRED_SYMBOLS
            .iter()
            .chain(OPTIONAL_SYMBOLS.iter().map(|(s, _)| s));
        if !all_known.clone().any(|s| has(s)) {
            return Err(unavailable(format!(
                "{shown} is not a Mooncake Transfer Engine library: it exports none of \
                 createTransferEngine, submitTransfer, getTransferStatus or any other symbol of \
                 Mooncake's C API"
            )));
        }
        let oldest = Generation::V0_2_0.mooncake_version();
        lib.require_all(&REQUIRED_SYMBOLS, &oldest)?;
        let present: Vec<&'static str> = OPTIONAL_SYMBOLS
            .iter()
            .map(|(s, _)| *s)
            .filter(|s| *s != "syncSegmentCache" && has(s))
            .collect();
        let generation = Generation::detect(has);

        macro_rules! req {
            ($name:literal) => {
                // SAFETY: the declared type is the C API's signature (see the
                // module docs).
                unsafe { lib.required($name, &oldest) }?
            };
        }
        macro_rules! opt {
            ($name:literal) => {
                // SAFETY: as above; absence is an ordinary `None`.
                unsafe { lib.optional($name) }
            };
        }
        let api = Api {
            create: req!("createTransferEngine"),
            destroy: req!("destroyTransferEngine"),
            install_transport: req!("installTransport"),
            uninstall_transport: req!("uninstallTransport"),
            open_segment: req!("openSegment"),
            close_segment: req!("closeSegment"),
            register: req!("registerLocalMemory"),
            unregister: req!("unregisterLocalMemory"),
            register_batch: req!("registerLocalMemoryBatch"),
            unregister_batch: req!("unregisterLocalMemoryBatch"),
            allocate_batch: req!("allocateBatchID"),
            submit: req!("submitTransfer"),
            get_status: req!("getTransferStatus"),
            free_batch: req!("freeBatchID"),
            sync_segment_cache: req!("syncSegmentCache"),
            get_local_ip_and_port: opt!("getLocalIpAndPort"),
            open_segment_no_cache: opt!("openSegmentNoCache"),
            remove_local_segment: opt!("removeLocalSegment"),
            submit_with_notify: opt!("submitTransferWithNotify"),
            get_notifs: opt!("getNotifsFromEngine"),
            gen_notify: opt!("genNotifyInEngine"),
            free_notifs: opt!("freeNotifsMsgBuf"),
        };
        let resolved =
            dl::loaded_from(api.create as *const c_void).unwrap_or_else(|| path.to_path_buf());
        Ok(Arc::new(MooncakeLibrary {
            path: resolved,
            requested: path.to_path_buf(),
            source,
            generation,
            present,
            api,
            _lib: lib,
        }))
    }

    /// The file that was loaded, as the dynamic loader reports it (for a
    /// library found through the loader's search, the directory it was found
    /// in; otherwise the path as given).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path that was asked for (`libtransfer_engine.so` for the loader
    /// search).
    pub fn requested_path(&self) -> &Path {
        &self.requested
    }

    /// Where the path came from.
    pub fn source(&self) -> &LibrarySource {
        &self.source
    }

    /// The generation detected from the exported symbols.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The optional symbols the library exports, in probe order.
    pub fn optional_symbols(&self) -> &[&'static str] {
        &self.present
    }

    /// Whether the library has everything native notifications need.
    pub fn has_notify(&self) -> bool {
        self.api.submit_with_notify.is_some()
            && self.api.get_notifs.is_some()
            && self.api.gen_notify.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detect(symbols: &[&str]) -> Generation {
        Generation::detect(|s| symbols.contains(&s) || REQUIRED_SYMBOLS.contains(&s))
    }

    #[test]
    fn generation_is_the_newest_marker_present() {
        assert_eq!(detect(&[]), Generation::V0_2_0);
        assert_eq!(detect(&["getLocalIpAndPort"]), Generation::V0_3_0);
        assert_eq!(
            detect(&["getLocalIpAndPort", "submitTransferWithNotify"]),
            Generation::V0_3_5
        );
        assert_eq!(detect(&["freeNotifsMsgBuf"]), Generation::V0_3_6);
        assert_eq!(
            detect(&["freeNotifsMsgBuf", "discoverTopology", "warmupEfaSegment"]),
            Generation::V0_3_11
        );
        assert_eq!(
            detect(&["discoverTopology", "getNicLoadStats"]),
            Generation::V0_3_12
        );
        for (sym, gen) in OPTIONAL_SYMBOLS {
            assert!(detect(&[sym]) <= gen || sym == "syncSegmentCache", "{sym}");
        }
        assert_eq!(Generation::V0_3_5.mooncake_version(), "Mooncake v0.3.5");
    }
}
