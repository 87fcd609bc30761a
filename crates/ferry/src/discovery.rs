//! The engine's side of segment discovery through etcd ([`DiscoveryConfig`]):
//! connecting, publishing the descriptor, resolving logical names, revoking
//! the lease at shutdown. Only `Engine::start`, `open_segment` (for a
//! logical name) and `shutdown` come here: transfers never do.

use crate::config::DiscoveryConfig;
#[cfg(feature = "etcd")]
pub(crate) use enabled::{Discovery, Etcd};

/// Whether `open_segment(name)` resolves `name` through etcd: a logical
/// name has no `:` (`host:port` and `[v6]:port` go to the backend).
pub(crate) fn is_logical(name: &str) -> bool {
    !name.contains(':')
}

/// Without the `etcd` feature no value exists: `EngineConfig` refuses
/// `metadata=etcd://` and `Engine::start` a [`DiscoveryConfig`].
#[cfg(not(feature = "etcd"))]
pub(crate) enum Discovery {}

#[cfg(not(feature = "etcd"))]
pub(crate) enum Etcd {}

#[cfg(not(feature = "etcd"))]
impl Etcd {
    pub(crate) async fn connect(config: &DiscoveryConfig) -> ferry_core::Result<Etcd> {
        let _ = config;
        DiscoveryConfig::check_enabled()?;
        unreachable!("check_enabled fails without the `etcd` feature")
    }
}

#[cfg(not(feature = "etcd"))]
impl Discovery {
    pub(crate) fn name(&self) -> &str {
        match *self {}
    }
    pub(crate) async fn lookup(&self, _name: &str) -> ferry_core::Result<Vec<String>> {
        match *self {}
    }
    pub(crate) async fn shutdown(&self) -> ferry_core::Result<()> {
        match *self {}
    }
}

#[cfg(feature = "etcd")]
mod enabled {
    use std::sync::Mutex;

    use ferry_core::{Error, Result};
    use ferry_discovery::{Descriptor, EtcdDiscovery, Publication};

    use super::DiscoveryConfig;

    /// A connection to etcd, made before the backend starts (an etcd that
    /// does not answer fails the start with nothing running).
    pub(crate) struct Etcd {
        client: EtcdDiscovery,
        name: Option<String>,
    }

    impl Etcd {
        pub(crate) async fn connect(config: &DiscoveryConfig) -> Result<Etcd> {
            if let Some(n) = &config.segment_name {
                crate::config::check_logical_name(n)?;
            }
            let client =
                EtcdDiscovery::connect(&config.endpoints, &config.prefix, config.lease_ttl).await?;
            Ok(Etcd {
                client,
                name: config.segment_name.clone(),
            })
        }

        /// Publishes `descriptor` (its name replaced by the configured
        /// logical name, if any): `InvalidArgument` when another engine
        /// holds the name.
        pub(crate) async fn publish(self, mut descriptor: Descriptor) -> Result<Discovery> {
            if let Some(n) = self.name {
                descriptor.name = n;
            }
            let publication = self.client.publish(&descriptor).await?;
            tracing::debug!(
                segment = %descriptor.name,
                key = publication.key(),
                addresses = ?descriptor.addresses,
                "ferry: segment published in etcd"
            );
            Ok(Discovery {
                client: self.client,
                name: descriptor.name,
                publication: Mutex::new(Some(publication)),
            })
        }
    }

    /// A published engine: the key lives while this does (dropping it
    /// revokes the lease in the background, best effort).
    pub(crate) struct Discovery {
        client: EtcdDiscovery,
        name: String,
        publication: Mutex<Option<Publication>>,
    }

    impl Discovery {
        /// The logical name published.
        pub(crate) fn name(&self) -> &str {
            &self.name
        }

        /// The addresses `name` is published at, in the order to try them;
        /// `SegmentUnavailable` naming it when it is not published.
        pub(crate) async fn lookup(&self, name: &str) -> Result<Vec<String>> {
            let d = self.client.lookup(name).await?;
            if d.addresses.is_empty() {
                return Err(Error::SegmentUnavailable {
                    name: name.to_owned(),
                    reason: "its etcd descriptor lists no address".to_owned(),
                });
            }
            Ok(d.addresses)
        }

        /// Revokes the lease (once; later calls do nothing).
        pub(crate) async fn shutdown(&self) -> Result<()> {
            let p = self
                .publication
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            match p {
                Some(p) => p.shutdown().await,
                None => Ok(()),
            }
        }
    }

    impl std::fmt::Debug for Discovery {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Discovery")
                .field("etcd", &self.client)
                .field("name", &self.name)
                .finish()
        }
    }
}
