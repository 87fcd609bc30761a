//! # ferry-py — the Python package `ferry`
//!
//! The native half of the wheel (`ferry._native`): one class, `Engine`, a
//! thin layer over [`ferry::Engine`], plus one backend of its own,
//! `mooncake-py://` (`wheel.rs`: the installed Mooncake wheel's engine,
//! called through pyo3, behind the same capability adapter as every
//! backend), and the memory-kind check at registration (`cuda.rs`). The
//! Python half (`python/ferry`) adds
//! the exception classes, the `asyncio` flavour of the waiting calls and
//! `ferry.mooncake.TransferEngine`, the drop-in for Mooncake's Python API.
//!
//! Rules this crate keeps:
//! - every blocking call releases the GIL (`Python::detach`) while it runs
//!   on the shared tokio runtime;
//! - no Rust panic reaches Python: every `ferry::Error` becomes an instance
//!   of the matching class in `ferry.errors`, every bad argument a
//!   `TypeError`/`ValueError`;
//! - memory given as an object (buffer protocol, `__array_interface__`,
//!   `data_ptr()`/`nbytes`) is kept alive — and, for the buffer protocol,
//!   exported so that it cannot be resized — until it is unregistered.
#![deny(unsafe_op_in_unsafe_fn)]

mod convert;
mod cuda;
mod engine;
mod memory;
mod runtime;
mod wheel;

use pyo3::prelude::*;

/// The extension module `ferry._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::PyEngine>()?;
    engine::register_schemes()?;
    m.add("__version__", ferry::pep440_version())?;
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(parse_url, m)?)?;
    // See `runtime::exiting`: from interpreter exit on, no call waits for
    // a thread that needs the GIL.
    let at_exit = wrap_pyfunction!(runtime::_at_exit, m)?;
    m.py()
        .import("atexit")?
        .call_method1("register", (at_exit,))?;
    m.add(
        "BACKENDS",
        ferry::BackendKind::ALL
            .iter()
            .filter(|k| k.is_enabled())
            .map(|k| k.scheme())
            .collect::<Vec<_>>(),
    )?;
    // Whether the wheel has the cargo feature `etcd` (ferry's etcd
    // discovery): `ferry.mooncake` says so when etcd mode is asked of a
    // wheel without it. Private: not part of the typed API.
    m.add("_ETCD", cfg!(feature = "etcd"))?;
    Ok(())
}

/// One URL split by Ferry's one parser (`ferry::raw::ParsedUrl`: strict
/// percent-decoding, `+` a space, a key given twice refused naming it, no
/// fragment), for the Python code that combines a URL with settings of its
/// own (`ferry.mooncake`): `(scheme, authority, path, [(key, value)])`,
/// decoded, in URL order, `value` `None` for a bare key. A
/// `user:password@` part, which no Ferry URL takes, is refused. Errors are
/// raised as `ferry.errors` classes (`InvalidArgument`).
#[pyfunction]
#[pyo3(name = "_parse_url")]
#[allow(clippy::type_complexity)]
fn parse_url(
    py: Python<'_>,
    url: &str,
) -> PyResult<(String, String, String, Vec<(String, Option<String>)>)> {
    let parse = || -> ferry::Result<_> {
        let mut u = ferry::raw::ParsedUrl::parse(url)?;
        if u.take_userinfo().is_some() {
            return Err(ferry::Error::InvalidArgument(format!(
                "{} {:?}: no Ferry URL takes a `user:password@` part",
                u.label(),
                u.shown()
            )));
        }
        let keys: Vec<String> = u.keys().map(str::to_owned).collect();
        let params = keys
            .into_iter()
            .map(|k| {
                let v = u.take_value(&k).flatten();
                (k, v)
            })
            .collect();
        Ok((
            u.scheme().to_owned(),
            u.authority().to_owned(),
            u.path().to_owned(),
            params,
        ))
    };
    parse().map_err(|e| convert::to_pyerr(py, &e))
}

/// Whether a CUDA driver (`libcuda.so.1`, or `FERRY_CUDA_LIB`) was found:
/// without one every registered pointer is taken as host memory.
#[pyfunction]
fn cuda_driver_present() -> bool {
    cuda::driver_present()
}
