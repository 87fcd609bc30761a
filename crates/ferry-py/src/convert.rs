//! Conversions to Python: `ferry::Error` → an instance of the matching
//! class in `ferry.errors` (same name as the variant, same fields as
//! attributes), and the capability report → plain dicts.

use ferry::{
    Capabilities, CapabilityReport, Error, MetricsSnapshot, MissingCapability, Operation, Support,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// The exception to raise for `e`.
pub(crate) fn to_pyerr(py: Python<'_>, e: &Error) -> PyErr {
    match error_object(py, e) {
        Ok(obj) => PyErr::from_value(obj),
        // Building the exception failed (e.g. `ferry.errors` cannot be
        // imported): raise that failure, which says why.
        Err(err) => err,
    }
}

/// `Ok(())` → `None`, `Err(e)` → the exception instance (not raised): the
/// per-request results of a batch.
pub(crate) fn result_object<'py>(
    py: Python<'py>,
    r: &Result<(), Error>,
) -> PyResult<Bound<'py, PyAny>> {
    match r {
        Ok(()) => Ok(py.None().into_bound(py)),
        Err(e) => error_object(py, e),
    }
}

/// An instance of `ferry.errors.<Variant>` built from `e`.
pub(crate) fn error_object<'py>(py: Python<'py>, e: &Error) -> PyResult<Bound<'py, PyAny>> {
    let fields = PyDict::new(py);
    let name = describe(py, e, &fields)?;
    fields.set_item("retryable", e.is_retryable())?;
    let cls = py.import("ferry.errors")?.getattr(name)?;
    cls.call((e.to_string(),), Some(&fields))
}

fn missing_dict<'py>(py: Python<'py>, m: &MissingCapability) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("operation", m.operation.name())?;
    d.set_item("reason", &m.reason)?;
    d.set_item("min_version", m.min_version.as_deref())?;
    Ok(d)
}

/// Fills `f` with the variant's fields and returns the class name.
fn describe(py: Python<'_>, e: &Error, f: &Bound<'_, PyDict>) -> PyResult<&'static str> {
    Ok(match e {
        Error::Unsupported {
            backend,
            operation,
            reason,
            min_version,
        } => {
            f.set_item("backend", backend)?;
            f.set_item("operation", operation.name())?;
            f.set_item("reason", reason)?;
            f.set_item("min_version", min_version.as_deref())?;
            "Unsupported"
        }
        Error::MissingCapabilities { backend, missing } => {
            f.set_item("backend", backend)?;
            let list = PyList::empty(py);
            for m in missing {
                list.append(missing_dict(py, m)?)?;
            }
            f.set_item("missing", list)?;
            "MissingCapabilities"
        }
        Error::AddressNotRegistered {
            side,
            addr,
            len,
            peer,
        } => {
            f.set_item("side", side.to_string())?;
            f.set_item("addr", addr)?;
            f.set_item("length", len)?;
            f.set_item("peer", peer.as_deref())?;
            "AddressNotRegistered"
        }
        Error::RegionOverlap {
            addr,
            len,
            existing_addr,
            existing_len,
        } => {
            f.set_item("addr", addr)?;
            f.set_item("length", len)?;
            f.set_item("existing_addr", existing_addr)?;
            f.set_item("existing_length", existing_len)?;
            "RegionOverlap"
        }
        Error::RegionNotRegistered { addr } => {
            f.set_item("addr", addr)?;
            "RegionNotRegistered"
        }
        Error::BatchRegisterFailed {
            index,
            addr,
            source,
        } => {
            f.set_item("index", index)?;
            f.set_item("addr", addr)?;
            f.set_item("source", error_object(py, source)?)?;
            "BatchRegisterFailed"
        }
        Error::InvalidArgument(reason) => {
            f.set_item("reason", reason)?;
            "InvalidArgument"
        }
        Error::SegmentUnavailable { name, reason } => {
            f.set_item("name", name)?;
            f.set_item("reason", reason)?;
            "SegmentUnavailable"
        }
        Error::UnknownSegment(s) => {
            f.set_item("segment", s.0)?;
            "UnknownSegment"
        }
        Error::UnknownBatch(b) => {
            f.set_item("batch", b.0)?;
            "UnknownBatch"
        }
        Error::BatchBusy(b) => {
            f.set_item("batch", b.0)?;
            "BatchBusy"
        }
        Error::BatchTooLarge { len, max } => {
            f.set_item("length", len)?;
            f.set_item("max", max)?;
            "BatchTooLarge"
        }
        Error::BatchFailed {
            failed,
            total,
            first_index,
            first,
        } => {
            f.set_item("failed", failed)?;
            f.set_item("total", total)?;
            f.set_item("first_index", first_index)?;
            f.set_item("first", error_object(py, first)?)?;
            "BatchFailed"
        }
        Error::PeerLost { peer, reason } => {
            f.set_item("peer", peer)?;
            f.set_item("reason", reason)?;
            "PeerLost"
        }
        Error::Timeout {
            operation,
            peer,
            after,
        } => {
            f.set_item("operation", operation)?;
            f.set_item("peer", peer.as_deref())?;
            f.set_item("after", after.as_secs_f64())?;
            "Timeout"
        }
        Error::Protocol { peer, reason } => {
            f.set_item("peer", peer)?;
            f.set_item("reason", reason)?;
            "Protocol"
        }
        Error::Authentication { peer, reason } => {
            f.set_item("peer", peer)?;
            f.set_item("reason", reason)?;
            "Authentication"
        }
        Error::Io {
            context,
            kind,
            message,
            ..
        } => {
            f.set_item("context", context)?;
            f.set_item("kind", format!("{kind:?}"))?;
            f.set_item("message", message)?;
            "Io"
        }
        Error::Unavailable { backend, reason } => {
            f.set_item("backend", backend)?;
            f.set_item("reason", reason)?;
            "Unavailable"
        }
        Error::MissingSymbol {
            library,
            symbol,
            min_version,
        } => {
            f.set_item("library", library)?;
            f.set_item("symbol", symbol)?;
            f.set_item("min_version", min_version.as_deref())?;
            "MissingSymbol"
        }
        Error::Backend {
            backend,
            operation,
            code,
            name,
        } => {
            f.set_item("backend", backend)?;
            f.set_item("operation", operation)?;
            f.set_item("code", code)?;
            f.set_item("name", name)?;
            "Backend"
        }
        Error::TransferFailed {
            backend,
            peer,
            status,
            detail,
        } => {
            f.set_item("backend", backend)?;
            f.set_item("peer", peer)?;
            f.set_item("status", status)?;
            f.set_item("detail", detail)?;
            "TransferFailed"
        }
        Error::Canceled(reason) => {
            f.set_item("reason", reason)?;
            "Canceled"
        }
        Error::QueueFull {
            backend,
            queue,
            what,
            limit,
        } => {
            f.set_item("backend", backend)?;
            f.set_item("queue", queue.name())?;
            f.set_item("what", what)?;
            f.set_item("limit", limit)?;
            "QueueFull"
        }
        // `ferry::Error` is non-exhaustive: a variant added later is still
        // an exception, of the base class.
        _ => "FerryError",
    })
}

fn caps_dict<'py>(py: Python<'py>, c: &Capabilities) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for op in Operation::OPTIONAL.iter().chain(&Operation::GUARANTEES) {
        d.set_item(op.name(), c.supports(*op))?;
    }
    d.set_item("max_batch_len", c.max_batch_len)?;
    d.set_item("host_memory", c.memory.host)?;
    d.set_item("cuda_memory", c.memory.cuda)?;
    Ok(d)
}

fn support_dict<'py>(py: Python<'py>, s: &Support) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("support", s.kind())?;
    match s {
        Support::Native => {
            d.set_item("via", py.None())?;
            d.set_item("reason", py.None())?;
            d.set_item("min_version", py.None())?;
        }
        Support::Emulated { via, missing } => {
            d.set_item("via", via)?;
            d.set_item("reason", &missing.reason)?;
            d.set_item("min_version", missing.min_version.as_deref())?;
        }
        Support::Unsupported(missing) => {
            d.set_item("via", py.None())?;
            d.set_item("reason", &missing.reason)?;
            d.set_item("min_version", missing.min_version.as_deref())?;
        }
    }
    Ok(d)
}

/// A metrics snapshot as a dict (see `Engine.metrics`).
pub(crate) fn metrics_dict<'py>(
    py: Python<'py>,
    m: &MetricsSnapshot,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("engine", &m.engine)?;
    d.set_item("bytes_total", m.bytes_total())?;
    d.set_item("requests_ok", m.requests_ok())?;
    d.set_item("requests_failed", m.requests_failed())?;
    d.set_item("batches_in_flight", m.batches_in_flight)?;
    d.set_item("registered_bytes", m.registered_bytes)?;
    d.set_item("notifications_received", m.notifications_received)?;
    d.set_item("queue_full", m.queue_full)?;
    let emulated = PyDict::new(py);
    for (op, n) in &m.emulated {
        emulated.set_item(op, n)?;
    }
    d.set_item("emulated", emulated)?;
    let peers = PyDict::new(py);
    for (name, p) in &m.peers {
        let pd = PyDict::new(py);
        pd.set_item("bytes_written", p.bytes_written)?;
        pd.set_item("bytes_read", p.bytes_read)?;
        pd.set_item("requests_ok", p.requests_ok)?;
        let failed = PyDict::new(py);
        for (kind, n) in &p.requests_failed {
            failed.set_item(kind, n)?;
        }
        pd.set_item("requests_failed", failed)?;
        pd.set_item("notifications_sent", p.notifications_sent)?;
        pd.set_item("path", &p.path)?;
        peers.set_item(name, pd)?;
    }
    d.set_item("peers", peers)?;
    // The target side: None where the engine cannot see it.
    let inbound = m.inbound.as_ref();
    match inbound.and_then(|i| i.served.as_ref()) {
        None => d.set_item("served", py.None())?,
        Some(served) => {
            let sd = PyDict::new(py);
            for (name, c) in served {
                let pd = PyDict::new(py);
                pd.set_item("bytes_written", c.bytes_written)?;
                pd.set_item("bytes_read", c.bytes_read)?;
                pd.set_item("segments_written", c.segments_written)?;
                pd.set_item("segments_read", c.segments_read)?;
                sd.set_item(name, pd)?;
            }
            d.set_item("served", sd)?;
        }
    }
    let dropped = inbound
        .and_then(|i| i.notifications_dropped)
        .map(|n| n.total());
    d.set_item("notifications_dropped", dropped)?;
    Ok(d)
}

/// The capability report as a dict: `backend`, `details`, `strict`,
/// `native`, `effective`, `operations`, `guarantees` and `text` (the
/// report as `ferry caps` prints it).
pub(crate) fn report_dict<'py>(
    py: Python<'py>,
    r: &CapabilityReport,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("backend", &r.info.backend)?;
    let details = PyDict::new(py);
    for (k, v) in &r.info.details {
        details.set_item(k, v)?;
    }
    d.set_item("details", details)?;
    d.set_item("strict", r.strict)?;
    d.set_item("native", caps_dict(py, &r.native)?)?;
    d.set_item("effective", caps_dict(py, &r.effective)?)?;
    let ops = PyDict::new(py);
    for (op, s) in &r.operations {
        ops.set_item(op.name(), support_dict(py, s)?)?;
    }
    d.set_item("operations", ops)?;
    let guarantees = PyDict::new(py);
    for (op, s) in &r.guarantees {
        guarantees.set_item(op.name(), support_dict(py, s)?)?;
    }
    d.set_item("guarantees", guarantees)?;
    d.set_item("text", r.to_string())?;
    Ok(d)
}
