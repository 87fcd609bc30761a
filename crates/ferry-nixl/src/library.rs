//! Loading `libnixl_capi.so` at run time: resolution, symbol probing,
//! generation detection.
//!
//! The declarations here are Ferry's own, written from the facts of NIXL's
//! C API header (`src/bindings/rust/wrapper.h` of NIXL); nothing is linked
//! at build time. Every signature Ferry calls has been the same from NIXL
//! 0.9.0 (the first release with `nixl_capi_create_params` and
//! `nixl_capi_is_stub`) to 1.5.1, the release the tests run.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_core::raw::dl::CLibrary;
use ferry_core::{Error, Result};

use crate::config::NixlConfig;

/// Environment variable naming the library to load when the configuration
/// does not (see [`NixlLibrary::resolve`] for the whole order).
pub const LIBRARY_ENV: &str = "FERRY_NIXL_LIB";

/// File name handed to the dynamic loader when neither the configuration nor
/// [`LIBRARY_ENV`] names a library.
pub const DEFAULT_LIBRARY: &str = "libnixl_capi.so";

/// The directory, inside a Python environment's `site-packages`, where the
/// `nixl-cu12` / `nixl-cu13` wheels put `libnixl_capi.so` (meson-python's
/// private library folder of the `nixl_cu12` package).
pub const WHEEL_LIBRARY_DIRS: [&str; 2] = [".nixl_cu12.mesonpy.libs", ".nixl_cu13.mesonpy.libs"];

// ------------------------------------------------------------------ C types

/// Every opaque handle of the C API (`nixl_capi_agent_t`, lists, requests…).
pub(crate) type Handle = *mut c_void;
/// `nixl_capi_status_t`.
pub(crate) type Status = c_int;

/// `nixl_capi_status_t` values.
pub(crate) mod status {
    pub const SUCCESS: i32 = 0;
    pub const IN_PROG: i32 = 1;
    pub const INVALID_PARAM: i32 = -1;
    pub const BACKEND: i32 = -2;
    pub const INVALID_STATE: i32 = -3;
    pub const EXCEPTION: i32 = -4;
    pub const NO_TELEMETRY: i32 = -5;
    pub const NOT_FOUND: i32 = -6;

    /// The symbolic name of a status code.
    pub fn name(code: i32) -> &'static str {
        match code {
            SUCCESS => "NIXL_CAPI_SUCCESS",
            IN_PROG => "NIXL_CAPI_IN_PROG",
            INVALID_PARAM => "NIXL_CAPI_ERROR_INVALID_PARAM",
            BACKEND => "NIXL_CAPI_ERROR_BACKEND",
            INVALID_STATE => "NIXL_CAPI_ERROR_INVALID_STATE",
            EXCEPTION => "NIXL_CAPI_ERROR_EXCEPTION",
            NO_TELEMETRY => "NIXL_CAPI_ERROR_NO_TELEMETRY",
            NOT_FOUND => "NIXL_CAPI_ERROR_NOT_FOUND",
            _ => "unknown status",
        }
    }
}

/// `nixl_capi_mem_type_t`.
pub(crate) const MEM_DRAM: c_int = 0;
pub(crate) const MEM_VRAM: c_int = 1;
/// `nixl_capi_xfer_op_t`.
pub(crate) const OP_READ: c_int = 0;
pub(crate) const OP_WRITE: c_int = 1;
/// `nixl_capi_thread_sync_t`: `NIXL_CAPI_THREAD_SYNC_STRICT`.
pub(crate) const THREAD_SYNC_STRICT: c_int = 1;

/// `nixl_capi_agent_config_t` (the same layout from NIXL 0.6.1 on).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    pub thread_sync: c_int,
    pub num_workers: c_uint,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

const _: () = assert!(std::mem::size_of::<AgentConfig>() == 40);
const _: () = assert!(std::mem::offset_of!(AgentConfig, pthr_delay_us) == 16);

type CreateAgentFn = unsafe extern "C" fn(*const c_char, *const AgentConfig, *mut Handle) -> Status;
type DestroyFn = unsafe extern "C" fn(Handle) -> Status;
type CreateFn = unsafe extern "C" fn(*mut Handle) -> Status;
type GetLocalMdFn = unsafe extern "C" fn(Handle, *mut *mut c_void, *mut usize) -> Status;
type LoadRemoteMdFn =
    unsafe extern "C" fn(Handle, *const c_void, usize, *mut *mut c_char) -> Status;
type InvalidateRemoteMdFn = unsafe extern "C" fn(Handle, *const c_char) -> Status;
type GetPluginsFn = unsafe extern "C" fn(Handle, *mut Handle) -> Status;
type ListSizeFn = unsafe extern "C" fn(Handle, *mut usize) -> Status;
type StringListGetFn = unsafe extern "C" fn(Handle, usize, *mut *const c_char) -> Status;
type GetPluginParamsFn =
    unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *mut Handle) -> Status;
type ParamsAddFn = unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> Status;
type CreateBackendFn = unsafe extern "C" fn(Handle, *const c_char, Handle, *mut Handle) -> Status;
type OptArgsAddBackendFn = unsafe extern "C" fn(Handle, Handle) -> Status;
type OptArgsSetNotifMsgFn = unsafe extern "C" fn(Handle, *const c_void, usize) -> Status;
type OptArgsSetBoolFn = unsafe extern "C" fn(Handle, bool) -> Status;
type CreateDlistFn = unsafe extern "C" fn(c_int, *mut Handle) -> Status;
type RegDlistAddFn =
    unsafe extern "C" fn(Handle, usize, usize, u64, *const c_void, usize) -> Status;
type XferDlistAddFn = unsafe extern "C" fn(Handle, usize, usize, u64) -> Status;
type MemFn = unsafe extern "C" fn(Handle, Handle, Handle) -> Status;
type CreateXferReqFn = unsafe extern "C" fn(
    Handle,
    c_int,
    Handle,
    Handle,
    *const c_char,
    *mut Handle,
    Handle,
) -> Status;
type AgentReqFn = unsafe extern "C" fn(Handle, Handle) -> Status;
type NotifMapAgentAtFn = unsafe extern "C" fn(Handle, usize, *mut *const c_char) -> Status;
type NotifMapNotifsSizeFn = unsafe extern "C" fn(Handle, *const c_char, *mut usize) -> Status;
type NotifMapGetNotifFn =
    unsafe extern "C" fn(Handle, *const c_char, usize, *mut *const c_void, *mut usize) -> Status;
type GenNotifFn =
    unsafe extern "C" fn(Handle, *const c_char, *const c_void, usize, Handle) -> Status;
type IsStubFn = unsafe extern "C" fn() -> bool;

/// The entry points Ferry uses. Required ones are plain function pointers (a
/// library without one is refused at load); optional ones are `Option`s. A
/// few are resolved only so that a library lacking them is refused.
#[derive(Clone, Copy)]
#[allow(dead_code)]
pub(crate) struct Api {
    pub create_configured_agent: CreateAgentFn,
    pub destroy_agent: DestroyFn,
    pub get_local_md: GetLocalMdFn,
    pub load_remote_md: LoadRemoteMdFn,
    pub invalidate_remote_md: InvalidateRemoteMdFn,
    pub get_available_plugins: GetPluginsFn,
    pub string_list_size: ListSizeFn,
    pub string_list_get: StringListGetFn,
    pub destroy_string_list: DestroyFn,
    pub get_plugin_params: GetPluginParamsFn,
    pub destroy_mem_list: DestroyFn,
    pub create_params: CreateFn,
    pub params_add: ParamsAddFn,
    pub destroy_params: DestroyFn,
    pub create_backend: CreateBackendFn,
    pub destroy_backend: DestroyFn,
    pub create_opt_args: CreateFn,
    pub destroy_opt_args: DestroyFn,
    pub opt_args_add_backend: OptArgsAddBackendFn,
    pub opt_args_set_notif_msg: OptArgsSetNotifMsgFn,
    pub opt_args_set_has_notif: OptArgsSetBoolFn,
    pub create_reg_dlist: CreateDlistFn,
    pub reg_dlist_add_desc: RegDlistAddFn,
    pub destroy_reg_dlist: DestroyFn,
    pub register_mem: MemFn,
    pub deregister_mem: MemFn,
    pub create_xfer_dlist: CreateDlistFn,
    pub xfer_dlist_add_desc: XferDlistAddFn,
    pub destroy_xfer_dlist: DestroyFn,
    pub create_xfer_req: CreateXferReqFn,
    pub post_xfer_req: MemFn,
    pub get_xfer_status: AgentReqFn,
    pub release_xfer_req: AgentReqFn,
    pub destroy_xfer_req: DestroyFn,
    pub create_notif_map: CreateFn,
    pub destroy_notif_map: DestroyFn,
    pub get_notifs: MemFn,
    pub notif_map_size: ListSizeFn,
    pub notif_map_get_agent_at: NotifMapAgentAtFn,
    pub notif_map_get_notifs_size: NotifMapNotifsSizeFn,
    pub notif_map_get_notif: NotifMapGetNotifFn,
    pub gen_notif: GenNotifFn,
    // optional
    pub is_stub: Option<IsStubFn>,
}

/// Symbols every supported library must export (NIXL ≥ 0.9.0).
pub const REQUIRED_SYMBOLS: [&str; 42] = [
    "nixl_capi_create_configured_agent",
    "nixl_capi_destroy_agent",
    "nixl_capi_get_local_md",
    "nixl_capi_load_remote_md",
    "nixl_capi_invalidate_remote_md",
    "nixl_capi_get_available_plugins",
    "nixl_capi_string_list_size",
    "nixl_capi_string_list_get",
    "nixl_capi_destroy_string_list",
    "nixl_capi_get_plugin_params",
    "nixl_capi_destroy_mem_list",
    "nixl_capi_create_params",
    "nixl_capi_params_add",
    "nixl_capi_destroy_params",
    "nixl_capi_create_backend",
    "nixl_capi_destroy_backend",
    "nixl_capi_create_opt_args",
    "nixl_capi_destroy_opt_args",
    "nixl_capi_opt_args_add_backend",
    "nixl_capi_opt_args_set_notif_msg",
    "nixl_capi_opt_args_set_has_notif",
    "nixl_capi_create_reg_dlist",
    "nixl_capi_reg_dlist_add_desc",
    "nixl_capi_destroy_reg_dlist",
    "nixl_capi_register_mem",
    "nixl_capi_deregister_mem",
    "nixl_capi_create_xfer_dlist",
    "nixl_capi_xfer_dlist_add_desc",
    "nixl_capi_destroy_xfer_dlist",
    "nixl_capi_create_xfer_req",
    "nixl_capi_post_xfer_req",
    "nixl_capi_get_xfer_status",
    "nixl_capi_release_xfer_req",
    "nixl_capi_destroy_xfer_req",
    "nixl_capi_create_notif_map",
    "nixl_capi_destroy_notif_map",
    "nixl_capi_get_notifs",
    "nixl_capi_notif_map_size",
    "nixl_capi_notif_map_get_agent_at",
    "nixl_capi_notif_map_get_notifs_size",
    "nixl_capi_notif_map_get_notif",
    "nixl_capi_gen_notif",
];

/// Optional symbols Ferry probes, with the NIXL release that added each.
/// Ferry calls only `nixl_capi_is_stub`; the others date the library.
pub const OPTIONAL_SYMBOLS: [(&str, Generation); 5] = [
    ("nixl_capi_is_stub", Generation::V0_9),
    ("nixl_capi_prep_xfer_dlist", Generation::V0_9),
    ("nixl_capi_create_remote_dlist", Generation::V1_5),
    ("nixl_capi_prep_mem_view_remote", Generation::V1_5),
    ("nixl_capi_opt_args_set_custom_param", Generation::V1_5),
];

extern "C" {
    /// The C library's `free`, for the buffers the C API allocates with
    /// `malloc` / `strdup` (`nixl_capi_get_local_md`,
    /// `nixl_capi_load_remote_md`).
    pub(crate) fn free(p: *mut c_void);
}

// ------------------------------------------------------------------ generations

/// A NIXL C API generation, detected from the symbols a library exports (no
/// symbol reports the version). Each is "this release or a later one that
/// added nothing Ferry probes".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Generation {
    /// 0.9.0 to 1.4.x: configured agents, descriptor lists without the
    /// `sorted` flag, `nixl_capi_create_params`, `nixl_capi_is_stub`.
    V0_9,
    /// 1.5.0 and later: remote descriptor lists, memory views, custom
    /// parameters.
    V1_5,
}

impl Generation {
    /// The release, as `NIXL 1.5`.
    pub fn version(self) -> &'static str {
        match self {
            Generation::V0_9 => "NIXL 0.9.0",
            Generation::V1_5 => "NIXL 1.5.0",
        }
    }

    fn detect(has: impl Fn(&str) -> bool) -> Generation {
        if has("nixl_capi_create_remote_dlist") || has("nixl_capi_opt_args_set_custom_param") {
            Generation::V1_5
        } else {
            Generation::V0_9
        }
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.version())
    }
}

// ------------------------------------------------------------------ library

pub use ferry_core::raw::dl::LibrarySource;

/// A loaded `libnixl_capi.so`. Every engine made from it holds an `Arc` to
/// it, so the code stays mapped while anything can still call into it.
pub struct NixlLibrary {
    path: PathBuf,
    source: LibrarySource,
    generation: Generation,
    present: Vec<&'static str>,
    pub(crate) api: Api,
    _lib: CLibrary,
}

impl fmt::Debug for NixlLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlLibrary")
            .field("path", &self.path)
            .field("source", &self.source)
            .field("generation", &self.generation)
            .field("optional_symbols", &self.present)
            .finish()
    }
}

pub(crate) fn unavailable(reason: String) -> Error {
    Error::Unavailable {
        backend: "nixl".to_owned(),
        reason,
    }
}

/// `libnixl_capi.so` of the `nixl` wheel installed in the Python
/// environment at `prefix` (a virtual environment or an installation
/// prefix), if there is one.
pub fn wheel_library_in(prefix: &Path) -> Option<PathBuf> {
    let lib = prefix.join("lib");
    let entries = std::fs::read_dir(&lib).ok()?;
    let mut pythons: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("python3"))
        })
        .collect();
    pythons.sort();
    for py in pythons {
        for dir in WHEEL_LIBRARY_DIRS {
            let cand = py.join("site-packages").join(dir).join(DEFAULT_LIBRARY);
            if cand.is_file() {
                return Some(cand);
            }
        }
    }
    None
}

/// The wheel library of the active Python environment: `VIRTUAL_ENV` if
/// set, else the prefix of the first `python3` on `PATH` (its
/// `bin/..`, without running it).
pub fn active_python_wheel_library() -> Option<PathBuf> {
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        return wheel_library_in(Path::new(&venv));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        let py = dir.join("python3");
        if py.is_file() {
            let prefix = dir.parent()?;
            if let Some(found) = wheel_library_in(prefix) {
                return Some(found);
            }
            // Only the first python3 on PATH is the active one.
            return None;
        }
    }
    None
}

impl NixlLibrary {
    /// Resolves and loads the library for `config`, in this order:
    ///
    /// 1. `config.library` (`lib=` in a `nixl://` URL), if set;
    /// 2. the [`LIBRARY_ENV`] (`FERRY_NIXL_LIB`) environment variable, if
    ///    set and not empty;
    /// 3. [`DEFAULT_LIBRARY`] through the dynamic loader's search
    ///    (`LD_LIBRARY_PATH`, `ld.so.cache`, system directories);
    /// 4. the `nixl-cu12`/`nixl-cu13` wheel of the active Python environment
    ///    (see [`active_python_wheel_library`]).
    ///
    /// An explicit choice (1 or 2) that fails is an error, never a silent
    /// fall-back. The error ([`Error::Unavailable`]) names every path tried
    /// and why it failed.
    ///
    /// # Safety
    ///
    /// As [`NixlLibrary::load`], for whichever library the order above
    /// picks: `lib=` and `FERRY_NIXL_LIB` choose native code that runs in
    /// this process, so they must come from the operator.
    pub unsafe fn resolve(config: &NixlConfig) -> Result<Arc<NixlLibrary>> {
        if let Some(p) = &config.library {
            // SAFETY: forwarded to the caller.
            return unsafe { Self::load_from(p, LibrarySource::Config) };
        }
        if let Some(p) = std::env::var_os(LIBRARY_ENV).filter(|v| !v.is_empty()) {
            // SAFETY: forwarded to the caller.
            return unsafe {
                Self::load_from(Path::new(&p), LibrarySource::Environment(LIBRARY_ENV))
            };
        }
        // SAFETY: forwarded to the caller.
        let first = match unsafe {
            Self::load_from(Path::new(DEFAULT_LIBRARY), LibrarySource::LoaderSearch)
        } {
            Ok(lib) => return Ok(lib),
            Err(Error::Unavailable { reason, .. }) => reason,
            Err(other) => return Err(other),
        };
        match active_python_wheel_library() {
            Some(p) => {
                // SAFETY: forwarded to the caller.
                unsafe { Self::load_from(&p, LibrarySource::PythonWheel) }.map_err(|e| match e {
                    Error::Unavailable { reason, .. } => unavailable(format!(
                        "{first}; then the nixl wheel of the active Python environment: {reason}"
                    )),
                    other => other,
                })
            }
            None => Err(unavailable(format!(
                "{first}; no nixl wheel found in the active Python environment \
                 (VIRTUAL_ENV, or the python3 on PATH): `pip install --no-deps nixl-cu12`"
            ))),
        }
    }

    /// Loads the library at `path` and checks it.
    ///
    /// # Safety
    ///
    /// Loading a shared library runs its initialisers, and the symbols found
    /// are called with the signatures of NIXL's C API: `path` must be NIXL's
    /// `libnixl_capi.so` (any release from 0.9.0) or a library implementing
    /// the same C API, not merely one exporting functions with the same
    /// names. The first load in a process may set `UCX_MODULES=^efa` in the
    /// environment (see the README, "Exit crash of the wheel's UCX"): no
    /// other thread may call libc's `getenv`/`setenv` at that moment.
    pub unsafe fn load(path: &Path) -> Result<Arc<NixlLibrary>> {
        // SAFETY: forwarded to the caller.
        unsafe { Self::load_from(path, LibrarySource::Config) }
    }

    unsafe fn load_from(path: &Path, source: LibrarySource) -> Result<Arc<NixlLibrary>> {
        let shown = path.display().to_string();
        tracing::debug!(path = %shown, source = %source, "ferry: loading the NIXL C API library");
        // SAFETY: this function's contract (loading native code, which runs
        // its initialisers) covers the environment write `apply` may make;
        // see crate::ucx_env for why it is made.
        unsafe { crate::ucx_env::apply() };
        // SAFETY: see the function contract; the flags: see ferry_core::raw::dl.
        let lib = unsafe { CLibrary::open(path) }.map_err(|e| {
            unavailable(format!(
                "cannot load {shown} (from the {source}): {e}; set `lib=` in the URL or \
                 {LIBRARY_ENV} to the path of libnixl_capi.so (NIXL ≥ 0.9.0, e.g. from \
                 `pip install --no-deps nixl-cu12`)"
            ))
        })?;
        let has = |name: &str| lib.has(name);
        if !REQUIRED_SYMBOLS.iter().any(|s| has(s)) {
            return Err(unavailable(format!(
                "{shown} is not NIXL's C API library: it exports none of nixl_capi_create_agent, \
                 nixl_capi_create_xfer_req or any other symbol Ferry uses"
            )));
        }
        let oldest = Generation::V0_9.version();
        lib.require_all(&REQUIRED_SYMBOLS, oldest)?;
        let present: Vec<&'static str> = OPTIONAL_SYMBOLS
            .iter()
            .map(|(s, _)| *s)
            .filter(|s| has(s))
            .collect();
        let generation = Generation::detect(has);
        macro_rules! req {
            ($name:literal) => {
                // SAFETY: the declared type is the C API's signature (see the
                // module docs).
                unsafe { lib.required($name, oldest) }?
            };
        }
        let api = Api {
            create_configured_agent: req!("nixl_capi_create_configured_agent"),
            destroy_agent: req!("nixl_capi_destroy_agent"),
            get_local_md: req!("nixl_capi_get_local_md"),
            load_remote_md: req!("nixl_capi_load_remote_md"),
            invalidate_remote_md: req!("nixl_capi_invalidate_remote_md"),
            get_available_plugins: req!("nixl_capi_get_available_plugins"),
            string_list_size: req!("nixl_capi_string_list_size"),
            string_list_get: req!("nixl_capi_string_list_get"),
            destroy_string_list: req!("nixl_capi_destroy_string_list"),
            get_plugin_params: req!("nixl_capi_get_plugin_params"),
            destroy_mem_list: req!("nixl_capi_destroy_mem_list"),
            create_params: req!("nixl_capi_create_params"),
            params_add: req!("nixl_capi_params_add"),
            destroy_params: req!("nixl_capi_destroy_params"),
            create_backend: req!("nixl_capi_create_backend"),
            destroy_backend: req!("nixl_capi_destroy_backend"),
            create_opt_args: req!("nixl_capi_create_opt_args"),
            destroy_opt_args: req!("nixl_capi_destroy_opt_args"),
            opt_args_add_backend: req!("nixl_capi_opt_args_add_backend"),
            opt_args_set_notif_msg: req!("nixl_capi_opt_args_set_notif_msg"),
            opt_args_set_has_notif: req!("nixl_capi_opt_args_set_has_notif"),
            create_reg_dlist: req!("nixl_capi_create_reg_dlist"),
            reg_dlist_add_desc: req!("nixl_capi_reg_dlist_add_desc"),
            destroy_reg_dlist: req!("nixl_capi_destroy_reg_dlist"),
            register_mem: req!("nixl_capi_register_mem"),
            deregister_mem: req!("nixl_capi_deregister_mem"),
            create_xfer_dlist: req!("nixl_capi_create_xfer_dlist"),
            xfer_dlist_add_desc: req!("nixl_capi_xfer_dlist_add_desc"),
            destroy_xfer_dlist: req!("nixl_capi_destroy_xfer_dlist"),
            create_xfer_req: req!("nixl_capi_create_xfer_req"),
            post_xfer_req: req!("nixl_capi_post_xfer_req"),
            get_xfer_status: req!("nixl_capi_get_xfer_status"),
            release_xfer_req: req!("nixl_capi_release_xfer_req"),
            destroy_xfer_req: req!("nixl_capi_destroy_xfer_req"),
            create_notif_map: req!("nixl_capi_create_notif_map"),
            destroy_notif_map: req!("nixl_capi_destroy_notif_map"),
            get_notifs: req!("nixl_capi_get_notifs"),
            notif_map_size: req!("nixl_capi_notif_map_size"),
            notif_map_get_agent_at: req!("nixl_capi_notif_map_get_agent_at"),
            notif_map_get_notifs_size: req!("nixl_capi_notif_map_get_notifs_size"),
            notif_map_get_notif: req!("nixl_capi_notif_map_get_notif"),
            gen_notif: req!("nixl_capi_gen_notif"),
            // SAFETY: as in `req!`; absence is an ordinary `None`.
            is_stub: unsafe { lib.optional::<IsStubFn>("nixl_capi_is_stub") },
        };
        if let Some(is_stub) = api.is_stub {
            // SAFETY: a function of no arguments that returns a constant.
            if unsafe { is_stub() } {
                return Err(unavailable(format!(
                    "{shown} is NIXL's stub C API (built without NIXL; every call fails)"
                )));
            }
        }
        Ok(Arc::new(NixlLibrary {
            path: path.to_path_buf(),
            source,
            generation,
            present,
            api,
            _lib: lib,
        }))
    }

    /// The path that was loaded.
    pub fn path(&self) -> &Path {
        &self.path
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
}

pub(crate) use ferry_core::raw::dl::c_string;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_the_newest_marker_present() {
        assert_eq!(Generation::detect(|_| false), Generation::V0_9);
        assert_eq!(
            Generation::detect(|s| s == "nixl_capi_create_remote_dlist"),
            Generation::V1_5
        );
        assert!(Generation::V0_9 < Generation::V1_5);
    }

    #[test]
    fn a_missing_wheel_is_none() {
        assert_eq!(wheel_library_in(Path::new("/nonexistent-prefix")), None);
    }
}
