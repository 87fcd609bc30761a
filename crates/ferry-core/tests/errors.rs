//! Errors a program can act on: every error has a kind and a retry class,
//! a batch's error reads as its cause, and an I/O error keeps its
//! `std::io::Error` as the source.

use std::error::Error as _;
use std::time::Duration;

use ferry_core::{BatchId, Error, ErrorKind, Operation, Retry, SegmentId, Side};

fn peer_lost() -> Error {
    Error::PeerLost {
        peer: "10.0.0.2:1".into(),
        reason: "reset".into(),
    }
}

#[test]
fn kinds_and_retry_classes() {
    let cases: Vec<(Error, ErrorKind, Retry)> = vec![
        (
            Error::unsupported("tcp", Operation::Notify, "no"),
            ErrorKind::Unsupported,
            Retry::Permanent,
        ),
        (
            Error::AddressNotRegistered {
                side: Side::Remote,
                addr: 1,
                len: 2,
                peer: None,
            },
            ErrorKind::NotRegistered,
            Retry::Permanent,
        ),
        (
            Error::RegionNotRegistered { addr: 1 },
            ErrorKind::NotRegistered,
            Retry::Permanent,
        ),
        (
            Error::RegionOverlap {
                addr: 0,
                len: 1,
                existing_addr: 0,
                existing_len: 1,
            },
            ErrorKind::AlreadyRegistered,
            Retry::Permanent,
        ),
        (
            Error::RegionHeld {
                addr: 1,
                reason: "peer".into(),
            },
            ErrorKind::RegionHeld,
            Retry::Temporary,
        ),
        (
            Error::InvalidArgument("x".into()),
            ErrorKind::InvalidArgument,
            Retry::Permanent,
        ),
        (
            Error::BatchTooLarge { len: 9, max: 8 },
            ErrorKind::InvalidArgument,
            Retry::Permanent,
        ),
        (
            Error::SegmentUnavailable {
                name: "h:1".into(),
                reason: "refused".into(),
            },
            ErrorKind::PeerUnreachable,
            Retry::Temporary,
        ),
        (
            Error::UnknownSegment(SegmentId::fresh()),
            ErrorKind::UnknownHandle,
            Retry::Permanent,
        ),
        (
            Error::UnknownBatch(BatchId::fresh()),
            ErrorKind::UnknownHandle,
            Retry::Permanent,
        ),
        (
            Error::BatchBusy(BatchId::fresh()),
            ErrorKind::Busy,
            Retry::Temporary,
        ),
        (peer_lost(), ErrorKind::PeerLost, Retry::MaybeApplied),
        (
            Error::Timeout {
                operation: "write".into(),
                peer: None,
                after: Duration::from_secs(1),
            },
            ErrorKind::Timeout,
            Retry::MaybeApplied,
        ),
        (
            Error::Protocol {
                peer: "p".into(),
                reason: "r".into(),
            },
            ErrorKind::Protocol,
            Retry::Permanent,
        ),
        (
            Error::Authentication {
                peer: "p".into(),
                reason: "r".into(),
            },
            ErrorKind::Authentication,
            Retry::Permanent,
        ),
        (
            Error::Unavailable {
                backend: "nixl".into(),
                reason: "r".into(),
            },
            ErrorKind::Unavailable,
            Retry::Permanent,
        ),
        (
            Error::MissingSymbol {
                library: "l".into(),
                symbol: "s".into(),
                min_version: None,
            },
            ErrorKind::Unavailable,
            Retry::Permanent,
        ),
        (
            Error::Backend {
                backend: "mooncake".into(),
                operation: "submit".into(),
                code: -1,
                name: "E".into(),
            },
            ErrorKind::Backend,
            Retry::MaybeApplied,
        ),
        (
            Error::Canceled("shutdown".into()),
            ErrorKind::Canceled,
            Retry::MaybeApplied,
        ),
        (
            ferry_core::live_batches_full("tcp"),
            ErrorKind::QueueFull,
            Retry::Temporary,
        ),
        (
            Error::io(
                "connecting",
                &std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            ),
            ErrorKind::Io,
            Retry::MaybeApplied,
        ),
        (
            Error::io(
                "opening",
                &std::io::Error::from(std::io::ErrorKind::PermissionDenied),
            ),
            ErrorKind::Io,
            Retry::Permanent,
        ),
    ];
    for (e, kind, retry) in cases {
        assert_eq!(e.kind(), kind, "{e}");
        assert_eq!(e.retry(), retry, "{e}");
        // The older boolean agrees: nothing retryable is permanent.
        if e.is_retryable() {
            assert_ne!(e.retry(), Retry::Permanent, "{e}");
        }
    }
}

#[test]
fn a_batch_error_reads_as_its_cause() {
    let e = Error::BatchFailed {
        failed: 1,
        total: 4,
        first_index: 2,
        first: Box::new(peer_lost()),
    };
    assert_eq!(e.kind(), ErrorKind::PeerLost);
    assert_eq!(e.retry(), Retry::MaybeApplied);
    // A failed batch register undid everything: retrying is clean.
    let e = Error::BatchRegisterFailed {
        index: 0,
        addr: 0x1000,
        source: Box::new(Error::io(
            "pinning",
            &std::io::Error::from(std::io::ErrorKind::Interrupted),
        )),
    };
    assert_eq!(e.kind(), ErrorKind::Io);
    assert_eq!(e.retry(), Retry::Temporary);
}

#[test]
fn an_io_error_keeps_its_source() {
    let os = std::io::Error::from_raw_os_error(libc_eacces());
    let e = Error::io("opening /dev/infiniband/uverbs0", &os);
    let src = e.source().expect("an Io error has a source");
    let io = src
        .downcast_ref::<ferry_core::IoSource>()
        .expect("the source is the io error")
        .get();
    assert_eq!(io.raw_os_error(), Some(libc_eacces()));
    assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
    // Clone and equality survive.
    assert_eq!(e.clone(), e);
    // By value: the very error is kept.
    let custom = std::io::Error::other("custom");
    let e = Error::from_io("reading", custom);
    assert_eq!(e.source().unwrap().to_string(), "custom");
    // The message is unchanged by the source.
    assert!(e.to_string().starts_with("I/O error while reading: custom"));
}

fn libc_eacces() -> i32 {
    13
}
