//! The engine's side of segment discovery through etcd ([`DiscoveryConfig`]):
//! connecting, publishing the descriptor, resolving logical names, revoking
//! the lease at shutdown, and following the names this engine opened.
//!
//! A segment opened by logical name is a *route*: the handle the engine
//! gives out (a fresh [`SegmentId`]) leads to a backend segment opened at
//! one of the published addresses. An etcd watch per route keeps what etcd
//! says about the name; transfers read it from memory and never ask etcd:
//! - the name is published at the address the backend segment was opened
//!   at: the transfer goes there (a lost connection is the backend's to
//!   reconnect);
//! - published elsewhere (the peer restarted at a new address): the next
//!   transfer opens the new address, uses it, and closes the old segment;
//! - deleted (lease expired or revoked): transfers fail with
//!   `SegmentUnavailable` naming the segment and the lease, until the name
//!   is published again.
//!
//! etcd lost while running: routes keep what they knew (transfers go on),
//! their watches resume when etcd is back; new lookups fail `Unavailable`.

#[cfg(not(feature = "etcd"))]
use ferry_core::Result;
use ferry_core::{Error, SegmentId};

use crate::config::DiscoveryConfig;
#[cfg(feature = "etcd")]
pub(crate) use enabled::{Discovery, Etcd};

/// Where a segment handle given out by the engine leads now.
// Without `etcd` no `Discovery` exists to build one.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) enum Target {
    /// Not a route: the handle is the backend's own.
    Direct,
    /// The backend segment to use.
    Open(SegmentId),
    /// The name moved: [`Discovery::reconnect`] first.
    Moved,
    /// The name is not published (the error to return).
    Gone(Error),
}

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
    pub(crate) async fn connect(config: &DiscoveryConfig) -> Result<Etcd> {
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
    pub(crate) async fn open<F, Fut>(&self, _name: &str, _open: F) -> Result<SegmentId>
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = Result<SegmentId>>,
    {
        match *self {}
    }
    pub(crate) fn target(&self, _segment: SegmentId) -> Target {
        match *self {}
    }
    pub(crate) async fn reconnect<F, Fut>(
        &self,
        _segment: SegmentId,
        _open: F,
    ) -> Result<(SegmentId, Option<SegmentId>)>
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = Result<SegmentId>>,
    {
        match *self {}
    }
    pub(crate) fn remove(&self, _segment: SegmentId) -> Option<SegmentId> {
        match *self {}
    }
    pub(crate) async fn shutdown(&self) -> Result<()> {
        match *self {}
    }
}

#[cfg(feature = "etcd")]
mod enabled {
    use std::collections::HashMap;
    use std::future::Future;
    use std::sync::{Arc, Mutex, MutexGuard, Weak};

    use ferry_core::{Error, Result, SegmentId};
    use ferry_discovery::{Descriptor, EtcdDiscovery, Publication, SegmentEvent, SegmentWatch};
    use tokio::task::JoinHandle;

    use super::{DiscoveryConfig, Target};

    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The error of a route whose name was deleted from etcd.
    fn gone(name: &str, lease: i64) -> Error {
        Error::SegmentUnavailable {
            name: name.to_owned(),
            reason: format!(
                "its etcd lease {lease:x} ended (expired: the engine died or lost etcd for \
                 longer than its lease TTL; or revoked at its shutdown) and no engine \
                 publishes the name now"
            ),
        }
    }

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
                routes: Mutex::new(HashMap::new()),
            })
        }
    }

    /// What etcd says about a route's name (as its watch last told).
    enum Published {
        At { addresses: Vec<String>, lease: i64 },
        Gone { lease: i64 },
    }

    struct State {
        /// The backend segment in use.
        backend: SegmentId,
        /// The address it was opened at.
        opened_at: String,
        published: Published,
    }

    /// A segment opened by logical name.
    struct Route {
        name: String,
        state: Mutex<State>,
        /// One reconnection at a time.
        reconnecting: tokio::sync::Mutex<()>,
    }

    impl Route {
        fn target(&self) -> Target {
            let s = lock(&self.state);
            match &s.published {
                Published::Gone { lease } => Target::Gone(gone(&self.name, *lease)),
                Published::At { addresses, .. } if addresses.contains(&s.opened_at) => {
                    Target::Open(s.backend)
                }
                Published::At { .. } => Target::Moved,
            }
        }

        /// Applies one watch event.
        fn apply(&self, event: SegmentEvent) {
            let mut s = lock(&self.state);
            s.published = match event {
                SegmentEvent::Registered(r) => {
                    tracing::debug!(
                        segment = %self.name,
                        addresses = ?r.descriptor.addresses,
                        lease = %format_args!("{:x}", r.lease),
                        "ferry: segment (re-)registered in etcd"
                    );
                    Published::At {
                        addresses: r.descriptor.addresses,
                        lease: r.lease,
                    }
                }
                SegmentEvent::Deleted { .. } => {
                    let lease = match s.published {
                        Published::At { lease, .. } | Published::Gone { lease } => lease,
                    };
                    tracing::debug!(
                        segment = %self.name,
                        lease = %format_args!("{lease:x}"),
                        "ferry: segment deleted from etcd"
                    );
                    Published::Gone { lease }
                }
            };
        }
    }

    /// The watch task of a route: applies its events until the route
    /// goes (the task is aborted when the route leaves the table).
    async fn follow(route: Weak<Route>, mut watch: SegmentWatch) {
        loop {
            let event = watch.next().await;
            let Some(route) = route.upgrade() else { return };
            match event {
                Ok(e) => route.apply(e),
                Err(Error::Canceled(_)) => return,
                // A value that is not a descriptor: keep what we knew.
                Err(e) => tracing::warn!(segment = %route.name, "ferry: etcd watch: {e}"),
            }
        }
    }

    /// A route in the table, with its watch task (aborted on drop).
    struct Entry {
        route: Arc<Route>,
        follow: JoinHandle<()>,
    }

    impl Drop for Entry {
        fn drop(&mut self) {
            self.follow.abort();
        }
    }

    /// A published engine: the key lives while this does (dropping it
    /// revokes the lease in the background, best effort).
    pub(crate) struct Discovery {
        client: EtcdDiscovery,
        name: String,
        publication: Mutex<Option<Publication>>,
        /// The segments opened by logical name, by the handle given out.
        routes: Mutex<HashMap<u64, Entry>>,
    }

    impl Discovery {
        /// The logical name published.
        pub(crate) fn name(&self) -> &str {
            &self.name
        }

        /// Opens the segment published as `name`: watches the name, looks
        /// it up, opens the first address that `open` (the backend's
        /// open) accepts, and returns a new handle for the route.
        /// `SegmentUnavailable` naming it when it is not published (with
        /// the lease this engine saw end, if it had the name open);
        /// `Unavailable` when etcd does not answer; the last address's
        /// error when none opens.
        pub(crate) async fn open<F, Fut>(&self, name: &str, open: F) -> Result<SegmentId>
        where
            F: Fn(String) -> Fut,
            Fut: Future<Output = Result<SegmentId>>,
        {
            // The watch first: nothing published after the lookup is missed.
            let watch = self.client.watch(name).await?;
            let found = match self.client.resolve(name).await {
                Ok(r) => r,
                Err(e @ Error::SegmentUnavailable { .. }) => {
                    return Err(self.ended_lease(name).map_or(e, |l| gone(name, l)))
                }
                Err(e) => return Err(e),
            };
            let mut last = Error::SegmentUnavailable {
                name: name.to_owned(),
                reason: "its etcd descriptor lists no address".to_owned(),
            };
            for address in &found.descriptor.addresses {
                match open(address.clone()).await {
                    Ok(backend) => {
                        let route = Arc::new(Route {
                            name: name.to_owned(),
                            state: Mutex::new(State {
                                backend,
                                opened_at: address.clone(),
                                published: Published::At {
                                    addresses: found.descriptor.addresses.clone(),
                                    lease: found.lease,
                                },
                            }),
                            reconnecting: tokio::sync::Mutex::new(()),
                        });
                        let follow = tokio::spawn(follow(Arc::downgrade(&route), watch));
                        let id = SegmentId::fresh();
                        lock(&self.routes).insert(id.0, Entry { route, follow });
                        return Ok(id);
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }

        /// The lease of `name` this engine saw deleted, if a route of it
        /// is open.
        fn ended_lease(&self, name: &str) -> Option<i64> {
            lock(&self.routes).values().find_map(|e| {
                if e.route.name != name {
                    return None;
                }
                match lock(&e.route.state).published {
                    Published::Gone { lease } => Some(lease),
                    Published::At { .. } => None,
                }
            })
        }

        fn route(&self, segment: SegmentId) -> Option<Arc<Route>> {
            lock(&self.routes)
                .get(&segment.0)
                .map(|e| Arc::clone(&e.route))
        }

        /// Where `segment` leads now (no etcd request).
        pub(crate) fn target(&self, segment: SegmentId) -> Target {
            match self.route(segment) {
                Some(r) => r.target(),
                None => Target::Direct,
            }
        }

        /// After [`Target::Moved`]: opens the route's name at its new
        /// addresses with `open` (one reconnection at a time; later
        /// callers find it done). Returns the backend segment to use and
        /// the one it replaced, for the caller to close.
        pub(crate) async fn reconnect<F, Fut>(
            &self,
            segment: SegmentId,
            open: F,
        ) -> Result<(SegmentId, Option<SegmentId>)>
        where
            F: Fn(String) -> Fut,
            Fut: Future<Output = Result<SegmentId>>,
        {
            let Some(route) = self.route(segment) else {
                return Ok((segment, None));
            };
            let _one = route.reconnecting.lock().await;
            let addresses = match route.target() {
                Target::Direct => return Ok((segment, None)),
                Target::Open(b) => return Ok((b, None)),
                Target::Gone(e) => return Err(e),
                Target::Moved => match &lock(&route.state).published {
                    Published::At { addresses, .. } => addresses.clone(),
                    Published::Gone { lease } => return Err(gone(&route.name, *lease)),
                },
            };
            let mut last = None;
            for address in addresses {
                match open(address.clone()).await {
                    Ok(new) => {
                        let mut s = lock(&route.state);
                        let old = std::mem::replace(&mut s.backend, new);
                        tracing::info!(
                            segment = %route.name,
                            from = %s.opened_at,
                            to = %address,
                            "ferry: segment moved; reconnected"
                        );
                        s.opened_at = address;
                        return Ok((new, Some(old)));
                    }
                    Err(e) => last = Some(e),
                }
            }
            Err(last.unwrap_or_else(|| Error::SegmentUnavailable {
                name: route.name.clone(),
                reason: "its etcd descriptor lists no address".to_owned(),
            }))
        }

        /// Forgets the route of `segment` (its watch ends); the backend
        /// segment to close, or `None` when `segment` is not a route.
        pub(crate) fn remove(&self, segment: SegmentId) -> Option<SegmentId> {
            let entry = lock(&self.routes).remove(&segment.0)?;
            let backend = lock(&entry.route.state).backend;
            Some(backend)
        }

        /// Revokes the lease (once; later calls do nothing). The routes'
        /// watches end with the engine.
        pub(crate) async fn shutdown(&self) -> Result<()> {
            let p = lock(&self.publication).take();
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
                .field("routes", &lock(&self.routes).len())
                .finish()
        }
    }
}
