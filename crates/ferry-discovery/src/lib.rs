//! Segment discovery through etcd.
//!
//! An engine *publishes* its segment [`Descriptor`] (logical name, the
//! addresses it listens on, its protocol version range and feature names)
//! under the key `<prefix>/segments/<name>`, bound to an etcd lease that a
//! background task keeps alive. A peer *looks up* a logical name and gets the
//! descriptor back, or *watches* it to learn of a re-registration at a new
//! address and of its deletion. When the publishing process dies its lease
//! expires and etcd deletes the key: a lookup then fails with
//! [`Error::SegmentUnavailable`] naming the segment. A clean
//! [`Publication::shutdown`] revokes the lease, which deletes the key at once.
//!
//! What is stored: the JSON of a [`Descriptor`] (see [`Descriptor::to_json`])
//! and nothing else. No shared secret, key material or token is ever written.
//!
//! The etcd client sits behind the cargo feature `etcd` (its build runs
//! `protoc`); without it [`EtcdDiscovery::connect`] returns
//! [`Error::Unavailable`] naming the feature and the rest of the API is the
//! same (no value of [`EtcdDiscovery`], [`Publication`] or [`SegmentWatch`]
//! can exist in such a build).
//!
//! Errors, all of them [`ferry_core::Error`]:
//! - etcd unreachable or not answering in time (at connect, lookup, publish,
//!   watch): [`Error::Unavailable`] with backend `etcd`, naming the endpoints
//!   and the operation (and the segment where there is one);
//! - a name that is not published (never was, lease expired, revoked):
//!   [`Error::SegmentUnavailable`] with the segment name;
//! - a name already published by another engine:
//!   [`Error::InvalidArgument`] naming the segment, the key and the lease that
//!   holds it;
//! - a value under the key that is not a descriptor: [`Error::Protocol`].

use std::time::Duration;

pub use ferry_core::{Error, Result};
use serde::{Deserialize, Serialize};

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
pub use etcd::{EtcdDiscovery, Publication, SegmentWatch};

#[cfg(feature = "test-support")]
#[doc(hidden)]
pub mod test_support;

#[cfg(not(feature = "etcd"))]
mod disabled;
#[cfg(not(feature = "etcd"))]
pub use disabled::{EtcdDiscovery, Publication, SegmentWatch};

/// The backend name in [`Error::Unavailable`].
pub const BACKEND: &str = "etcd";

/// How long connecting, and each request to etcd, may take by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// The version of the stored JSON ([`Descriptor::to_json`]'s `format`).
pub const DESCRIPTOR_FORMAT: u32 = 1;

/// The etcd key of segment `name` under `prefix`: `<prefix>/segments/<name>`
/// (a trailing `/` of `prefix` is dropped; an empty prefix gives
/// `/segments/<name>`).
pub fn segment_key(prefix: &str, name: &str) -> String {
    format!("{}/segments/{name}", prefix.trim_end_matches('/'))
}

/// The protocol version range an engine speaks (both ends inclusive).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProtocolRange {
    /// Lowest version.
    pub min: u32,
    /// Highest version.
    pub max: u32,
}

/// What an engine publishes about its segment. Everything here is public:
/// peers read it without authentication.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    /// The logical segment name (`decode-3`): the last component of the key.
    pub name: String,
    /// The addresses the engine listens on (`10.0.0.7:4000`, a URL…), in the
    /// order peers should try them.
    pub addresses: Vec<String>,
    /// The protocol versions the engine speaks.
    pub protocol: ProtocolRange,
    /// Feature names the engine offers (`tls`, `same-host`…).
    pub features: Vec<String>,
}

/// The stored JSON: the descriptor's fields plus `format`.
#[derive(Serialize, Deserialize)]
struct Stored {
    format: u32,
    #[serde(flatten)]
    descriptor: Descriptor,
}

impl Descriptor {
    /// A descriptor with no features.
    pub fn new(name: impl Into<String>, addresses: Vec<String>, protocol: ProtocolRange) -> Self {
        Descriptor {
            name: name.into(),
            addresses,
            protocol,
            features: Vec::new(),
        }
    }

    /// Checks what etcd and the key layout need: a non-empty name without
    /// `/` or control characters, at least one address, `min <= max`.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: &str| {
            Err(Error::InvalidArgument(format!(
                "segment descriptor {:?}: {why}",
                self.name
            )))
        };
        if self.name.is_empty() {
            return bad("the name is empty");
        }
        if self.name.contains('/') || self.name.chars().any(char::is_control) {
            return bad("the name contains '/' or a control character");
        }
        if self.addresses.is_empty() {
            return bad("no address to publish");
        }
        if self.protocol.min > self.protocol.max {
            return bad("protocol range min > max");
        }
        Ok(())
    }

    /// The value stored in etcd: one JSON object,
    /// `{"format":1,"name":…,"addresses":[…],"protocol":{"min":…,"max":…},"features":[…]}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string(&Stored {
            format: DESCRIPTOR_FORMAT,
            descriptor: self.clone(),
        })
        .expect("a descriptor always serializes")
    }

    /// Parses what [`Descriptor::to_json`] wrote; `key` names the etcd key
    /// in the error. Unknown fields are ignored (a newer writer may add
    /// some); a different `format` is refused.
    pub fn from_json(key: &str, value: &[u8]) -> Result<Self> {
        let stored: Stored = serde_json::from_slice(value).map_err(|e| Error::Protocol {
            peer: format!("etcd key {key}"),
            reason: format!("the value is not a segment descriptor: {e}"),
        })?;
        if stored.format != DESCRIPTOR_FORMAT {
            return Err(Error::Protocol {
                peer: format!("etcd key {key}"),
                reason: format!(
                    "descriptor format {} (this build reads format {DESCRIPTOR_FORMAT})",
                    stored.format
                ),
            });
        }
        Ok(stored.descriptor)
    }
}

/// A published descriptor and the etcd lease its key is bound to
/// ([`EtcdDiscovery::resolve`], [`SegmentEvent::Registered`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// What is published.
    pub descriptor: Descriptor,
    /// The lease id (etcdctl prints it in hex; so do Ferry's errors).
    pub lease: i64,
}

/// A change to a watched segment name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SegmentEvent {
    /// The name was published (again), possibly at new addresses or under
    /// a new lease.
    Registered(Registration),
    /// The key was deleted: lease expired or revoked.
    Deleted {
        /// The segment name.
        name: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d() -> Descriptor {
        Descriptor {
            name: "decode-3".into(),
            addresses: vec!["127.0.0.1:4000".into()],
            protocol: ProtocolRange { min: 3, max: 5 },
            features: vec!["tls".into()],
        }
    }

    #[test]
    fn json_round_trips_and_is_what_the_docs_say() {
        let j = d().to_json();
        assert_eq!(
            j,
            r#"{"format":1,"name":"decode-3","addresses":["127.0.0.1:4000"],"protocol":{"min":3,"max":5},"features":["tls"]}"#
        );
        assert_eq!(Descriptor::from_json("k", j.as_bytes()).unwrap(), d());
    }

    #[test]
    fn foreign_values_are_protocol_errors() {
        assert!(matches!(
            Descriptor::from_json("k", b"{\"format\":2}"),
            Err(Error::Protocol { .. })
        ));
        assert!(matches!(
            Descriptor::from_json("k", b"hello"),
            Err(Error::Protocol { .. })
        ));
    }

    #[test]
    fn key_layout() {
        assert_eq!(segment_key("/ferry", "a"), "/ferry/segments/a");
        assert_eq!(segment_key("/ferry/", "a"), "/ferry/segments/a");
        assert_eq!(segment_key("", "a"), "/segments/a");
    }

    #[test]
    fn validate_refuses_bad_names() {
        let mut x = d();
        x.name = "a/b".into();
        assert!(matches!(x.validate(), Err(Error::InvalidArgument(_))));
        x.name = String::new();
        assert!(x.validate().is_err());
        assert!(d().validate().is_ok());
    }
}
