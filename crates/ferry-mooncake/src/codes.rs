//! Mooncake's error codes, both signs.
//!
//! Failures are non-zero: older builds return `ERR_*` macros (negative),
//! newer ones return `Status` codes (positive) with the same magnitudes,
//! except "not implemented", which is -303 in older builds and 999 in newer
//! ones. Current builds mix both signs: C calls that wrap a `Status` return
//! it positive, calls that return a plain `int` keep the negative macros.
//! Code 8 (`kNotSupportedTransport`) exists only as a positive `Status`.
//!
//! Some calls return a bare `-1` that is no code at all: `openSegment`
//! answers `-1` for "the segment could not be found or reached" on every
//! build, which [`open_segment_failure`] explains instead of calling it
//! `ERR_INVALID_ARGUMENT`.

use std::fmt;

use ferry_core::Error;

/// A Mooncake error code, sign removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MooncakeErrorCode {
    /// 1: invalid argument.
    InvalidArgument,
    /// 2: too many requests for the batch.
    TooManyRequests,
    /// 3: address not registered.
    AddressNotRegistered,
    /// 4: batch busy (tasks still running).
    BatchBusy,
    /// 6: device not found.
    DeviceNotFound,
    /// 7: address overlaps a registered region.
    AddressOverlapped,
    /// 8 (current builds' `Status` only): the transport is not supported.
    NotSupportedTransport,
    /// 101: DNS failure.
    Dns,
    /// 102: socket error.
    Socket,
    /// 103: malformed JSON.
    MalformedJson,
    /// 104: handshake rejected by the peer.
    RejectHandshake,
    /// 200: metadata service error.
    Metadata,
    /// 201: endpoint error.
    Endpoint,
    /// 202: context error.
    Context,
    /// 300: NUMA error.
    Numa,
    /// 301: clock error.
    Clock,
    /// 302: out of memory.
    Memory,
    /// -303 (older builds) / 999 (newer builds): not implemented.
    NotImplemented,
}

impl MooncakeErrorCode {
    /// Interprets a raw return value; `None` for 0 and for unknown codes.
    pub fn from_raw(code: i64) -> Option<MooncakeErrorCode> {
        use MooncakeErrorCode::*;
        match code {
            -303 | 999 => return Some(NotImplemented),
            0 | 303 | -999 => return None,
            _ => {}
        }
        Some(match code.unsigned_abs() {
            1 => InvalidArgument,
            2 => TooManyRequests,
            3 => AddressNotRegistered,
            4 => BatchBusy,
            6 => DeviceNotFound,
            7 => AddressOverlapped,
            8 => NotSupportedTransport,
            101 => Dns,
            102 => Socket,
            103 => MalformedJson,
            104 => RejectHandshake,
            200 => Metadata,
            201 => Endpoint,
            202 => Context,
            300 => Numa,
            301 => Clock,
            302 => Memory,
            _ => return None,
        })
    }

    /// The name of the macro in Mooncake's `error.h` (`ERR_BATCH_BUSY`).
    pub fn name(self) -> &'static str {
        use MooncakeErrorCode::*;
        match self {
            InvalidArgument => "ERR_INVALID_ARGUMENT",
            TooManyRequests => "ERR_TOO_MANY_REQUESTS",
            AddressNotRegistered => "ERR_ADDRESS_NOT_REGISTERED",
            BatchBusy => "ERR_BATCH_BUSY",
            DeviceNotFound => "ERR_DEVICE_NOT_FOUND",
            AddressOverlapped => "ERR_ADDRESS_OVERLAPPED",
            NotSupportedTransport => "NOT_SUPPORTED_TRANSPORT",
            Dns => "ERR_DNS",
            Socket => "ERR_SOCKET",
            MalformedJson => "ERR_MALFORMED_JSON",
            RejectHandshake => "ERR_REJECT_HANDSHAKE",
            Metadata => "ERR_METADATA",
            Endpoint => "ERR_ENDPOINT",
            Context => "ERR_CONTEXT",
            Numa => "ERR_NUMA",
            Clock => "ERR_CLOCK",
            Memory => "ERR_MEMORY",
            NotImplemented => "ERR_NOT_IMPLEMENTED",
        }
    }
}

impl fmt::Display for MooncakeErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The symbolic name of a raw code, or `unknown Mooncake error code`.
pub fn code_name(code: i64) -> &'static str {
    MooncakeErrorCode::from_raw(code).map_or("unknown Mooncake error code", |c| c.name())
}

/// Why `openSegment` returned `rc` (< 0), in words: its `-1` is the
/// library's generic "no such segment, or unreachable", not a code.
pub(crate) fn open_segment_failure(rc: i32, generation: crate::Generation) -> String {
    let hint = if generation >= crate::Generation::V0_3_0 {
        "with P2PHANDSHAKE the name must be the peer's <host>:<port> as its engine \
         reports it (segment_name()); with a metadata server, the peer's name= and the same \
         metadata= on both sides"
    } else {
        "the name must be the peer's name= registered with the same metadata server"
    };
    if rc == -1 {
        format!(
            "openSegment returned -1: the library found no such segment or could not reach \
             it ({hint}); its log says which"
        )
    } else {
        format!(
            "openSegment returned {rc} ({}; {hint})",
            code_name(i64::from(rc))
        )
    }
}

/// [`Error::Backend`] for a failed C call.
pub(crate) fn call_error(operation: &str, code: i64) -> Error {
    Error::Backend {
        backend: "mooncake".to_owned(),
        operation: operation.to_owned(),
        code,
        name: code_name(code).to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_signs_map_to_the_same_name() {
        for (old, new, name) in [
            (-1, 1, "ERR_INVALID_ARGUMENT"),
            (-2, 2, "ERR_TOO_MANY_REQUESTS"),
            (-3, 3, "ERR_ADDRESS_NOT_REGISTERED"),
            (-4, 4, "ERR_BATCH_BUSY"),
            (-6, 6, "ERR_DEVICE_NOT_FOUND"),
            (-7, 7, "ERR_ADDRESS_OVERLAPPED"),
            (-8, 8, "NOT_SUPPORTED_TRANSPORT"),
            (-101, 101, "ERR_DNS"),
            (-102, 102, "ERR_SOCKET"),
            (-103, 103, "ERR_MALFORMED_JSON"),
            (-104, 104, "ERR_REJECT_HANDSHAKE"),
            (-200, 200, "ERR_METADATA"),
            (-201, 201, "ERR_ENDPOINT"),
            (-202, 202, "ERR_CONTEXT"),
            (-300, 300, "ERR_NUMA"),
            (-301, 301, "ERR_CLOCK"),
            (-302, 302, "ERR_MEMORY"),
            (-303, 999, "ERR_NOT_IMPLEMENTED"),
        ] {
            assert_eq!(code_name(old), name, "{old}");
            assert_eq!(code_name(new), name, "{new}");
        }
        for unknown in [0, 5, -5, 303, -999, 12345] {
            assert_eq!(MooncakeErrorCode::from_raw(unknown), None, "{unknown}");
        }
        assert_eq!(
            call_error("freeBatchID", -4),
            Error::Backend {
                backend: "mooncake".into(),
                operation: "freeBatchID".into(),
                code: -4,
                name: "ERR_BATCH_BUSY".into()
            }
        );
    }
}
