//! The API without the `etcd` feature: connecting fails with
//! [`Error::Unavailable`]; no other value can exist.

use std::convert::Infallible;
use std::time::Duration;

use crate::{Descriptor, Error, Registration, Result, SegmentEvent, BACKEND};

fn unavailable() -> Error {
    Error::Unavailable {
        backend: BACKEND.to_owned(),
        reason: "ferry-discovery was built without its `etcd` cargo feature \
                 (build with `--features etcd`; that build needs `protoc`)"
            .to_owned(),
    }
}

/// A connection to etcd for publishing and finding segments (this build
/// has no etcd client: [`EtcdDiscovery::connect`] always fails).
#[derive(Debug)]
pub struct EtcdDiscovery(Infallible);

/// A published segment (none can exist in this build).
#[derive(Debug)]
pub struct Publication(Infallible);

/// A watch on one segment name (none can exist in this build).
#[derive(Debug)]
pub struct SegmentWatch(Infallible);

impl EtcdDiscovery {
    /// Always [`Error::Unavailable`] naming the missing `etcd` feature.
    pub async fn connect<S: AsRef<str>>(
        endpoints: &[S],
        prefix: &str,
        lease_ttl: Duration,
    ) -> Result<Self> {
        Self::connect_with_timeout(endpoints, prefix, lease_ttl, crate::DEFAULT_TIMEOUT).await
    }

    /// Always [`Error::Unavailable`] naming the missing `etcd` feature.
    pub async fn connect_with_timeout<S: AsRef<str>>(
        _endpoints: &[S],
        _prefix: &str,
        _lease_ttl: Duration,
        _timeout: Duration,
    ) -> Result<Self> {
        Err(unavailable())
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        match self.0 {}
    }

    /// The lease TTL publications ask for.
    pub fn lease_ttl(&self) -> Duration {
        match self.0 {}
    }

    /// Publishes `descriptor`.
    pub async fn publish(&self, _descriptor: &Descriptor) -> Result<Publication> {
        match self.0 {}
    }

    /// Looks a segment up by name.
    pub async fn lookup(&self, _name: &str) -> Result<Descriptor> {
        match self.0 {}
    }

    /// Looks a segment up, with its lease.
    pub async fn resolve(&self, _name: &str) -> Result<Registration> {
        match self.0 {}
    }

    /// Watches a segment name.
    pub async fn watch(&self, _name: &str) -> Result<SegmentWatch> {
        match self.0 {}
    }
}

impl Publication {
    /// The segment name.
    pub fn name(&self) -> &str {
        match self.0 {}
    }

    /// The etcd key.
    pub fn key(&self) -> &str {
        match self.0 {}
    }

    /// The lease the key is bound to now.
    pub fn lease_id(&self) -> i64 {
        match self.0 {}
    }

    /// The TTL etcd granted.
    pub fn lease_ttl(&self) -> Duration {
        match self.0 {}
    }

    /// Revokes the lease.
    pub async fn shutdown(self) -> Result<()> {
        match self.0 {}
    }
}

impl SegmentWatch {
    /// The next change.
    pub async fn next(&mut self) -> Result<SegmentEvent> {
        match self.0 {}
    }
}

impl Drop for Publication {
    fn drop(&mut self) {
        match self.0 {}
    }
}
