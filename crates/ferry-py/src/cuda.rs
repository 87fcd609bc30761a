//! The memory kind of a pointer, asked of the CUDA driver at run time.
//!
//! `libcuda.so.1` (or the library `FERRY_CUDA_LIB` names) is opened on
//! first use; where it is absent, or `cuInit` fails, every pointer is taken
//! as host memory, as before. With it, `cuPointerGetAttribute(
//! CU_POINTER_ATTRIBUTE_MEMORY_TYPE)` says whether a pointer is device
//! memory, and `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` which GPU.

use std::ffi::c_void;
use std::sync::OnceLock;

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
const ATTR_MEMORY_TYPE: i32 = 2;
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
const ATTR_DEVICE_ORDINAL: i32 = 9;
/// `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_DEVICE: u32 = 2;

type CuInit = unsafe extern "C" fn(u32) -> i32;
type CuPointerGetAttribute = unsafe extern "C" fn(*mut c_void, i32, u64) -> i32;

/// What the driver says about a pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Host memory, or no driver to ask.
    Host,
    /// Device memory of GPU `ordinal`.
    Device { ordinal: u32 },
}

struct Driver {
    // Held so that the function pointer stays valid.
    _lib: libloading::Library,
    get_attribute: CuPointerGetAttribute,
}

static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();

fn load() -> Option<Driver> {
    let path = std::env::var("FERRY_CUDA_LIB").unwrap_or_else(|_| "libcuda.so.1".to_owned());
    // SAFETY: loading the CUDA driver (or the library the user named in its
    // place) runs its initialisers, which is what every CUDA program does.
    let lib = unsafe { libloading::Library::new(&path) }.ok()?;
    // SAFETY: the signatures are those of the CUDA driver API (cuda.h).
    let init: CuInit = unsafe { *lib.get::<CuInit>(b"cuInit\0").ok()? };
    // SAFETY: as above.
    let get_attribute: CuPointerGetAttribute = unsafe {
        *lib.get::<CuPointerGetAttribute>(b"cuPointerGetAttribute\0")
            .ok()?
    };
    // SAFETY: cuInit takes flags 0 and may be called more than once.
    if unsafe { init(0) } != 0 {
        return None;
    }
    Some(Driver {
        _lib: lib,
        get_attribute,
    })
}

/// Whether a CUDA driver was found (for the report and the docs' claim).
pub(crate) fn driver_present() -> bool {
    DRIVER.get_or_init(load).is_some()
}

/// The kind of memory at `addr`.
pub(crate) fn classify(addr: u64) -> Kind {
    let Some(driver) = DRIVER.get_or_init(load) else {
        return Kind::Host;
    };
    let query = |attr: i32| -> Option<u32> {
        let mut out: u32 = 0;
        // SAFETY: `out` is a valid u32 for both attributes asked here
        // (CUmemorytype and int); the driver only reads the pointer value.
        let rc = unsafe { (driver.get_attribute)(&mut out as *mut u32 as *mut c_void, attr, addr) };
        (rc == 0).then_some(out)
    };
    // A pointer the driver does not know (CUDA_ERROR_INVALID_VALUE) is host
    // memory that CUDA never saw.
    match query(ATTR_MEMORY_TYPE) {
        Some(MEMORYTYPE_DEVICE) => Kind::Device {
            ordinal: query(ATTR_DEVICE_ORDINAL).unwrap_or(0),
        },
        _ => Kind::Host,
    }
}
