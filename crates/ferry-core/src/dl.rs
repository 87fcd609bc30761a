//! Loading a backend's C library at run time (feature `dlopen`): the part
//! the C-API backends (Mooncake, NIXL) share. Each backend keeps its own
//! symbol table, generations and messages; this module holds the loading,
//! the choice of path and the symbol checks.
//!
//! Invariants:
//! - A library is opened with `RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE`: every
//!   symbol resolves at load (a missing one fails here, not at first call),
//!   nothing leaks into the global namespace, and the code stays mapped after
//!   the last handle closes (the C libraries run threads of their own that
//!   may still be returning through library code after their destroy call;
//!   unmapping it under them would crash the process).
//! - Only the first configured source is tried ([`choose`]): an explicit
//!   choice that fails is an error, never a silent fall-back to another
//!   library.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Where a library path came from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LibrarySource {
    /// The engine's configuration (`lib=` in its URL).
    Config,
    /// The backend's environment variable (named).
    Environment(&'static str),
    /// The backend's default file name through the dynamic loader's search
    /// path (`LD_LIBRARY_PATH`, `ld.so.cache`, system directories).
    LoaderSearch,
    /// The backend's wheel in the active Python environment.
    PythonWheel,
}

impl fmt::Display for LibrarySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LibrarySource::Config => f.write_str("engine config (lib=)"),
            LibrarySource::Environment(var) => write!(f, "environment variable {var}"),
            LibrarySource::LoaderSearch => f.write_str("dynamic loader search path"),
            LibrarySource::PythonWheel => f.write_str("Python wheel of the active environment"),
        }
    }
}

/// The path to load and where it came from, in this order: `configured`
/// (`lib=`), then the environment variable `env` if set and not empty, then
/// `default` through the loader's search.
pub fn choose(
    configured: Option<&Path>,
    env: &'static str,
    default: &str,
) -> (PathBuf, LibrarySource) {
    if let Some(p) = configured {
        (p.to_path_buf(), LibrarySource::Config)
    } else if let Some(p) = std::env::var_os(env).filter(|v| !v.is_empty()) {
        (PathBuf::from(p), LibrarySource::Environment(env))
    } else {
        (PathBuf::from(default), LibrarySource::LoaderSearch)
    }
}

/// A C library opened for a backend. Keep it beside the function pointers
/// taken from it: it must outlive every call through them (and
/// `RTLD_NODELETE` keeps the code mapped even after it is dropped).
pub struct CLibrary {
    lib: libloading::Library,
    shown: String,
}

impl fmt::Debug for CLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CLibrary")
            .field("path", &self.shown)
            .finish()
    }
}

impl CLibrary {
    /// Opens `path` (see the module's invariants for the flags).
    ///
    /// # Safety
    ///
    /// Loading a shared library runs its initialisers: `path` must name a
    /// library the operator chose, and its symbols are later called with
    /// the signatures the backend declares for them.
    pub unsafe fn open(path: &Path) -> std::result::Result<CLibrary, libloading::Error> {
        use libloading::os::unix::{Library as UnixLibrary, RTLD_LOCAL, RTLD_NOW};
        /// glibc's `RTLD_NODELETE` (not in libloading's unix constants).
        const RTLD_NODELETE: c_int = 0x1000;
        // SAFETY: forwarded to the caller (see above).
        let lib = unsafe { UnixLibrary::open(Some(path), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE) }?;
        Ok(CLibrary {
            lib: lib.into(),
            shown: path.display().to_string(),
        })
    }

    /// The path as given, for messages.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// Whether the library exports `name` (only the address is looked up;
    /// nothing is called).
    pub fn has(&self, name: &str) -> bool {
        // SAFETY: a symbol lookup; the pointer is neither called nor read.
        unsafe { self.lib.get::<*const c_void>(name.as_bytes()) }.is_ok()
    }

    /// The first of `required` the library lacks, as
    /// [`Error::MissingSymbol`] naming `min_version` (the release that
    /// has all of them).
    pub fn require_all(&self, required: &[&str], min_version: &str) -> Result<()> {
        match required.iter().find(|s| !self.has(s)) {
            None => Ok(()),
            Some(sym) => Err(Error::MissingSymbol {
                library: self.shown.clone(),
                symbol: (*sym).to_owned(),
                min_version: Some(min_version.to_owned()),
            }),
        }
    }

    /// The symbols of `names` the library exports, in the given order.
    pub fn present(&self, names: impl IntoIterator<Item = &'static str>) -> Vec<&'static str> {
        names.into_iter().filter(|s| self.has(s)).collect()
    }

    /// The function `name`, which must exist ([`Error::MissingSymbol`]
    /// naming `min_version` otherwise).
    ///
    /// # Safety
    ///
    /// `T` is the function pointer type of the symbol's C signature.
    pub unsafe fn required<T: Copy>(&self, name: &str, min_version: &str) -> Result<T> {
        // SAFETY: forwarded to the caller: `T` is the symbol's type.
        let s =
            unsafe { self.lib.get::<T>(name.as_bytes()) }.map_err(|e| Error::MissingSymbol {
                library: self.shown.clone(),
                symbol: format!("{name} ({e})"),
                min_version: Some(min_version.to_owned()),
            })?;
        Ok(*s)
    }

    /// The function `name` if the library exports it.
    ///
    /// # Safety
    ///
    /// As [`CLibrary::required`].
    pub unsafe fn optional<T: Copy>(&self, name: &str) -> Option<T> {
        // SAFETY: forwarded to the caller.
        unsafe { self.lib.get::<T>(name.as_bytes()) }
            .ok()
            .map(|s| *s)
    }
}

/// glibc's `Dl_info` (identical on x86-64 and AArch64).
#[repr(C)]
struct DlInfo {
    dli_fname: *const c_char,
    dli_fbase: *mut c_void,
    dli_sname: *const c_char,
    dli_saddr: *mut c_void,
}

extern "C" {
    fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
}

/// The file the loaded object containing `addr` came from, as the dynamic
/// loader reports it (for a library found by the loader's search, the
/// directory it was found in).
// `addr` is compared with the loaded objects' address ranges, never read.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn loaded_from(addr: *const c_void) -> Option<PathBuf> {
    let mut info = DlInfo {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only fills `info` (for an address in no object it
    // returns 0); its strings belong to the loader and live as long as the
    // object, which is never unloaded (RTLD_NODELETE).
    let ok = unsafe { dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string owned by the loader (see above).
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// A C string the library owns, copied out (lossily as UTF-8); `None` for
/// a null pointer.
///
/// # Safety
///
/// `p` is null or points to a NUL-terminated string that stays valid for
/// the duration of the call.
pub unsafe fn c_string(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: per the contract.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_source_set_is_chosen() {
        let cfg = Path::new("/opt/x/libfoo.so");
        assert_eq!(
            choose(Some(cfg), "FERRY_DL_TEST_UNSET_VAR", "libfoo.so"),
            (cfg.to_path_buf(), LibrarySource::Config)
        );
        assert_eq!(
            choose(None, "FERRY_DL_TEST_UNSET_VAR", "libfoo.so"),
            (PathBuf::from("libfoo.so"), LibrarySource::LoaderSearch)
        );
        assert_eq!(
            LibrarySource::Environment("FERRY_X_LIB").to_string(),
            "environment variable FERRY_X_LIB"
        );
    }

    #[test]
    fn libc_is_real_and_its_symbols_are_checked() {
        // The C library every process here has: a real dlopen, not a double.
        // SAFETY: libc's initialisers already ran in this process.
        let lib = unsafe { CLibrary::open(Path::new("libc.so.6")) }.expect("libc.so.6 loads");
        assert!(lib.has("getpid"));
        assert!(!lib.has("ferry_no_such_symbol"));
        assert_eq!(
            lib.present(["getpid", "ferry_no_such_symbol"]),
            vec!["getpid"]
        );
        assert!(lib.require_all(&["getpid", "getppid"], "any").is_ok());
        match lib.require_all(&["getpid", "ferry_no_such_symbol"], "v9") {
            Err(Error::MissingSymbol {
                symbol,
                min_version,
                ..
            }) => {
                assert_eq!(symbol, "ferry_no_such_symbol");
                assert_eq!(min_version.as_deref(), Some("v9"));
            }
            other => panic!("expected MissingSymbol, got {other:?}"),
        }
        // SAFETY: getpid's C signature.
        let getpid: unsafe extern "C" fn() -> c_int =
            unsafe { lib.required("getpid", "any") }.unwrap();
        // SAFETY: getpid has no preconditions.
        assert_eq!(unsafe { getpid() } as u32, std::process::id());
        // SAFETY: as above.
        let none: Option<unsafe extern "C" fn() -> c_int> =
            unsafe { lib.optional("ferry_no_such_symbol") };
        assert!(none.is_none());
        let from = loaded_from(getpid as *const c_void).expect("dladdr knows libc");
        assert!(from.to_string_lossy().contains("libc"), "{from:?}");
        // SAFETY: a static NUL-terminated string.
        assert_eq!(unsafe { c_string(c"abc".as_ptr()) }.as_deref(), Some("abc"));
        // SAFETY: null is allowed.
        assert_eq!(unsafe { c_string(std::ptr::null()) }, None);
    }
}
