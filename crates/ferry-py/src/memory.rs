//! Python objects as memory: an address and a length, or any object that
//! exposes writable contiguous memory, and what must be held to keep that
//! memory valid while it is registered.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyTuple};

/// What keeps registered memory valid until it is unregistered.
pub(crate) enum Keep {
    /// A raw address: the caller promised (as with Mooncake's
    /// `register_memory`) to keep the memory allocated.
    Raw,
    /// A strong reference to an object that keeps the memory valid while
    /// it lives: for the buffer protocol, a ctypes array made with
    /// `from_buffer`, which holds a buffer export and so stops the exporter
    /// from resizing or freeing the memory (`bytearray`, `memoryview`,
    /// `array.array`, numpy, `mmap`); otherwise the object itself, which owns
    /// its memory (`__array_interface__` or `data_ptr()`/`nbytes` objects such
    /// as torch tensors).
    // Never read: held only so that dropping it releases the object.
    Object(#[allow(dead_code)] Py<PyAny>),
}

/// Memory named by a Python value.
pub(crate) struct Resolved {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// What to hold while registered.
    pub keep: Keep,
    /// The location the object itself reports (`cuda:N` for a CUDA torch
    /// tensor), if any.
    pub location: Option<String>,
}

/// Resolves `target`: an `int` address (then `length` is required), or an
/// object exposing writable, contiguous memory. With an object, `length`
/// (if given) takes only the first `length` bytes and may not exceed it.
pub(crate) fn resolve(target: &Bound<'_, PyAny>, length: Option<u64>) -> PyResult<Resolved> {
    if target.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(
            "expected an address (int) or an object exposing writable memory, got bool",
        ));
    }
    if target.is_instance_of::<PyInt>() {
        let addr: u64 = target
            .extract()
            .map_err(|_| PyValueError::new_err("an address must be an integer in 0..2**64"))?;
        let len = length.ok_or_else(|| {
            PyTypeError::new_err("a raw address needs a length: register(addr, length)")
        })?;
        return Ok(Resolved {
            addr,
            len,
            keep: Keep::Raw,
            location: None,
        });
    }
    // The buffer protocol is in the stable ABI only from Python 3.11 and this
    // wheel supports 3.9: `ferry._memory.buffer_info` takes the export with
    // ctypes (`from_buffer`) and returns `(addr, nbytes, holder)`, or `None`
    // for an object without the buffer protocol.
    let info = target
        .py()
        .import("ferry._memory")?
        .getattr("buffer_info")?
        .call1((target,))?;
    let (addr, full, keep, location) = if !info.is_none() {
        let (addr, len, holder): (u64, u64, Bound<'_, PyAny>) = info.extract()?;
        (addr, len, Keep::Object(holder.unbind()), None)
    } else if let Ok(ai) = target.getattr("__array_interface__") {
        let (addr, len) = array_interface(target, &ai)?;
        (addr, len, Keep::Object(target.clone().unbind()), None)
    } else if target.hasattr("data_ptr")? && target.hasattr("nbytes")? {
        let addr: u64 = target.call_method0("data_ptr")?.extract()?;
        let len: u64 = target.getattr("nbytes")?.extract()?;
        if target.hasattr("is_contiguous")? {
            let contiguous: bool = target.call_method0("is_contiguous")?.extract()?;
            if !contiguous {
                return Err(PyValueError::new_err(format!(
                    "{} is not contiguous; register a contiguous tensor",
                    type_name(target)
                )));
            }
        }
        let location = device_location(target)?;
        (addr, len, Keep::Object(target.clone().unbind()), location)
    } else {
        return Err(PyTypeError::new_err(format!(
            "expected an address (int) or an object exposing writable memory (buffer \
             protocol, __array_interface__, or data_ptr()/nbytes), got {}",
            type_name(target)
        )));
    };
    let len = match length {
        Some(l) if l > full => {
            return Err(PyValueError::new_err(format!(
                "length {l} exceeds the {full} bytes of the {}",
                type_name(target)
            )))
        }
        Some(l) => l,
        None => full,
    };
    Ok(Resolved {
        addr,
        len,
        keep,
        location,
    })
}

/// The address of `target` as `unregister` needs it (no length needed).
pub(crate) fn address_of(target: &Bound<'_, PyAny>) -> PyResult<u64> {
    if target.is_instance_of::<PyInt>() && !target.is_instance_of::<PyBool>() {
        return target
            .extract()
            .map_err(|_| PyValueError::new_err("an address must be an integer in 0..2**64"));
    }
    resolve(target, None).map(|r| r.addr)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".to_owned())
}

/// `(address, byte length)` from numpy's `__array_interface__` (version 3):
/// `data` = `(ptr, readonly)`, `strides` = `None` for C-contiguous data.
fn array_interface(obj: &Bound<'_, PyAny>, ai: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    let ai = ai.cast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{}.__array_interface__ is not a dict",
            type_name(obj)
        ))
    })?;
    let data = ai
        .get_item("data")?
        .ok_or_else(|| PyValueError::new_err("__array_interface__ has no 'data'"))?;
    let data = data.cast::<PyTuple>().map_err(|_| {
        PyValueError::new_err("__array_interface__['data'] is not a (pointer, readonly) tuple")
    })?;
    let addr: u64 = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    if readonly {
        return Err(PyValueError::new_err(format!(
            "{} is read-only; registered memory must be writable",
            type_name(obj)
        )));
    }
    if let Some(strides) = ai.get_item("strides")? {
        if !strides.is_none() {
            return Err(PyValueError::new_err(format!(
                "{} is not C-contiguous; register a contiguous array",
                type_name(obj)
            )));
        }
    }
    let shape: Vec<u64> = ai
        .get_item("shape")?
        .ok_or_else(|| PyValueError::new_err("__array_interface__ has no 'shape'"))?
        .extract()?;
    let typestr: String = ai
        .get_item("typestr")?
        .ok_or_else(|| PyValueError::new_err("__array_interface__ has no 'typestr'"))?
        .extract()?;
    let itemsize: u64 = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| PyValueError::new_err(format!("unknown typestr {typestr:?}")))?;
    let len = shape
        .iter()
        .try_fold(itemsize, |acc, d| acc.checked_mul(*d))
        .ok_or_else(|| PyValueError::new_err("array size overflows"))?;
    Ok((addr, len))
}

/// `cuda:N` for an object whose `device` says it lives on a CUDA device
/// (torch: `device.type == "cuda"`, `device.index`).
fn device_location(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let Ok(device) = obj.getattr("device") else {
        return Ok(None);
    };
    let Ok(kind) = device.getattr("type") else {
        return Ok(None);
    };
    let kind: String = kind.extract().unwrap_or_default();
    if kind == "cpu" || kind.is_empty() {
        return Ok(None);
    }
    let index: Option<u32> = device.getattr("index").ok().and_then(|i| i.extract().ok());
    Ok(Some(format!("{kind}:{}", index.unwrap_or(0))))
}
