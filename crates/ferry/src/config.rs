//! Engine configuration: which backend, how to start it, and how the
//! capability adapter wraps it — from a URL or built in code.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use ferry_core::raw::ParsedUrl;
use ferry_core::{AdapterConfig, Error, Metrics, Operation, Result};

/// The backends Ferry knows, whether or not this build includes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// `tcp://` — tokio TCP transport (cargo feature `tcp`, on by default).
    Tcp,
    /// `mooncake://` — Mooncake Transfer Engine loaded at run time (feature `mooncake`).
    Mooncake,
    /// `verbs://` — native RDMA verbs (feature `verbs`).
    Verbs,
    /// `nixl://` — NVIDIA NIXL loaded at run time (feature `nixl`).
    Nixl,
}

impl BackendKind {
    /// Every known backend, in documentation order.
    pub const ALL: [BackendKind; 4] = [
        BackendKind::Tcp,
        BackendKind::Mooncake,
        BackendKind::Verbs,
        BackendKind::Nixl,
    ];

    /// The URL scheme, which is also the backend name and the cargo feature.
    pub fn scheme(self) -> &'static str {
        match self {
            BackendKind::Tcp => "tcp",
            BackendKind::Mooncake => "mooncake",
            BackendKind::Verbs => "verbs",
            BackendKind::Nixl => "nixl",
        }
    }

    /// Whether this build of `ferry` includes the backend (its cargo feature
    /// is on).
    pub fn is_enabled(self) -> bool {
        match self {
            BackendKind::Tcp => cfg!(feature = "tcp"),
            BackendKind::Mooncake => cfg!(feature = "mooncake"),
            BackendKind::Verbs => cfg!(feature = "verbs"),
            BackendKind::Nixl => cfg!(feature = "nixl"),
        }
    }

    /// The error for a backend whose feature is off: it names the feature.
    pub fn disabled_error(self) -> Error {
        let s = self.scheme();
        Error::Unavailable {
            backend: s.to_owned(),
            reason: format!(
                "this build of ferry does not include it; enable the cargo feature `{s}` \
                 (ferry = {{ version = \"0.1\", features = [\"{s}\"] }}, or \
                 `cargo run -p ferry-cli --features {s}`)"
            ),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.scheme())
    }
}

impl FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        BackendKind::ALL
            .into_iter()
            .find(|k| k.scheme().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown backend {s:?}; known: tcp://, mooncake://, verbs://, nixl://"
                ))
            })
    }
}

/// A backend's own configuration. One variant per backend compiled in.
#[non_exhaustive]
pub enum BackendConfig {
    /// The TCP backend's configuration.
    #[cfg(feature = "tcp")]
    Tcp(ferry_tcp::TcpConfig),
    /// The Mooncake backend's configuration.
    #[cfg(feature = "mooncake")]
    Mooncake(ferry_mooncake::MooncakeConfig),
    /// The verbs backend's configuration.
    #[cfg(feature = "verbs")]
    Verbs(ferry_verbs::VerbsConfig),
    /// The NIXL backend's configuration.
    #[cfg(feature = "nixl")]
    Nixl(ferry_nixl::NixlConfig),
}

impl BackendConfig {
    /// Which backend this configures.
    pub fn kind(&self) -> BackendKind {
        match *self {
            #[cfg(feature = "tcp")]
            BackendConfig::Tcp(_) => BackendKind::Tcp,
            #[cfg(feature = "mooncake")]
            BackendConfig::Mooncake(_) => BackendKind::Mooncake,
            #[cfg(feature = "verbs")]
            BackendConfig::Verbs(_) => BackendKind::Verbs,
            #[cfg(feature = "nixl")]
            BackendConfig::Nixl(_) => BackendKind::Nixl,
        }
    }

    /// Parses a backend URL (without Ferry's own parameters) with the
    /// backend's `from_url`. A scheme whose feature is off gives
    /// [`Error::Unavailable`] naming the feature.
    pub fn from_url(url: &str) -> Result<Self> {
        BackendConfig::from_parts(ParsedUrl::parse(url)?)
    }

    /// Hands `url`, already parsed (and maybe with Ferry's own parameters
    /// taken out), to the backend its scheme names: the backend's
    /// `from_parts` takes its parameters and refuses what is left.
    pub fn from_parts(url: ParsedUrl) -> Result<Self> {
        let kind: BackendKind = url.scheme().parse()?;
        match kind {
            #[cfg(feature = "tcp")]
            BackendKind::Tcp => Ok(BackendConfig::Tcp(ferry_tcp::TcpConfig::from_parts(url)?)),
            #[cfg(feature = "mooncake")]
            BackendKind::Mooncake => Ok(BackendConfig::Mooncake(
                ferry_mooncake::MooncakeConfig::from_parts(url)?,
            )),
            #[cfg(feature = "verbs")]
            BackendKind::Verbs => Ok(BackendConfig::Verbs(ferry_verbs::VerbsConfig::from_parts(
                url,
            )?)),
            #[cfg(feature = "nixl")]
            BackendKind::Nixl => Ok(BackendConfig::Nixl(ferry_nixl::NixlConfig::from_parts(
                url,
            )?)),
            #[allow(unreachable_patterns)]
            other => {
                drop(url);
                Err(other.disabled_error())
            }
        }
    }
}

impl fmt::Debug for BackendConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Backend configs may hold secrets (`tcp://…?secret=`): show the kind only.
        f.debug_tuple("BackendConfig")
            .field(&self.kind().scheme())
            .finish()
    }
}

/// Everything [`crate::Engine::start`] needs: the backend's configuration and
/// the capability adapter's.
///
/// From a URL (`EngineConfig::from_url` / `str::parse`):
///
/// ```text
/// tcp://127.0.0.1:0?secret=s3cret&strict=1
/// mooncake://?lib=/opt/mooncake/libtransfer_engine.so&metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1
/// verbs://mlx5_0?port=1&gid_index=3
/// nixl://?backends=UCX&host=127.0.0.1
/// ```
///
/// The URL is parsed once, by [`ferry_core::raw::ParsedUrl`] (strict
/// percent-decoding, `+` is a space, a key given twice refused, no
/// fragment, no userinfo). The scheme picks the backend (here, one of
/// Ferry's four, into a typed [`BackendConfig`]; [`crate::Engine::open`]
/// finds every scheme, `inproc` and those registered outside Ferry
/// included, in the scheme [`registry`](crate::registry), by the same
/// rules); Ferry takes its own
/// parameters out of the parsed URL ([`AdapterConfig::take_url_params`]) and
/// hands the rest to the backend's `from_parts`, which takes its own and
/// rejects unknown ones by name, listing the known ones. No message quotes
/// a secret. The backends' parameters (full tables, defaults and limits in
/// `ferry_tcp::TcpConfig::from_url`, `ferry_mooncake::MooncakeConfig::from_url`,
/// `ferry_verbs::VerbsConfig::from_url`, `ferry_nixl::NixlConfig::from_url`):
///
/// | scheme | address part | parameters |
/// |---|---|---|
/// | `tcp://` | `host:port` to listen on (port 0: any); also the segment name | `secret` (shared secret, HMAC handshake), `connections`, `timeout_ms`, `connect_timeout_ms`, `chunk_size`, `max_batch`, `max_inbound`, `spin_us`, `socket_buffer` |
/// | `mooncake://` | none (everything is a parameter) | `lib` (path of `libtransfer_engine.so`; else `FERRY_MOONCAKE_LIB`, then the loader path), `metadata` (`P2PHANDSHAKE` or a metadata server), `protocol` (`tcp`, `rdma`, …), `host`, `port`, `name`, `device`, `timeout_ms`, `ns_per_byte` |
/// | `verbs://` | RDMA device name (`mlx5_0`; empty: the first with an active port) | `port`, `gid_index`, `listen` (control channel, also the segment name), `mtu`, `sq_depth`, `max_sge`, `signal_every`, `max_message`, `timeout`, `retry_cnt`, `rnr_retry`, `min_rnr_timer`, `max_rd_atomic`, `hop_limit`, `traffic_class`, `sl`, `connect_timeout_ms` |
/// | `nixl://` | none (everything is a parameter) | `lib` (path of `libnixl_capi.so`; else `FERRY_NIXL_LIB`, the loader path, the active Python's `nixl` wheel), `backends` (`UCX`, …), `host`, `port` (metadata listener; `host:port` is the segment name), `name` (agent), `progress_thread`, `timeout_ms`, `ns_per_byte`, `insecure` (a listener beyond loopback; refused without it) |
///
/// Ferry's own parameters, taken before the backend sees the URL:
///
/// | parameter | default | meaning |
/// |---|---|---|
/// | `strict` | `0` | `1`/`true`/`yes`/`on` (or a bare `strict`): emulate nothing; missing optional operations are refused ([`AdapterConfig::strict`]) |
/// | `coalesce` | `1` | merge contiguous requests of a batch ([`AdapterConfig::coalesce`]) |
/// | `max_concurrency` | `16` | emulated single transfers in flight, across batches ([`AdapterConfig::max_concurrency`], the adapter's [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer)) |
/// | `require` | none | comma-separated operations (`batch_transfer,notify`) or guarantees (`landed_writes`, `peer_validation`) that must be available, else opening fails with [`Error::MissingCapabilities`] |
///
/// On `tcp://` and `verbs://` only (Mooncake's `metadata=` is its own),
/// segment discovery through etcd ([`DiscoveryConfig`], cargo feature
/// `etcd`):
///
/// | parameter | default | meaning |
/// |---|---|---|
/// | `metadata` | none | `etcd://h1:2379,h2:2379`: publish this engine's segment in etcd and open logical names through it |
/// | `prefix` | `/ferry` | etcd key prefix (keys `<prefix>/segments/<name>`) |
/// | `lease_ttl_ms` | `10000` | lease TTL (etcd rounds up to whole seconds) |
/// | `segment_name` | the engine's segment name | the logical name to publish |
///
/// In code (`#[non_exhaustive]`: no struct literal outside this crate):
/// [`EngineConfig::new`] and the setters that consume and return it.
///
/// ```
/// # #[cfg(feature = "tcp")]
/// # fn main() -> ferry::Result<()> {
/// use ferry::tcp::TcpConfig;
/// use ferry::{AdapterConfig, BackendConfig, EngineConfig, Operation, Secret};
///
/// let tcp = TcpConfig::builder()
///     .listen("127.0.0.1:0")
///     .secret(Secret::new("s3cret"))
///     .build()?;
/// let config = EngineConfig::new(BackendConfig::Tcp(tcp))
///     .adapter(AdapterConfig::builder().max_concurrency(4).build()?)
///     .strict(true)
///     .require(&[Operation::BatchTransfer]);
/// let parsed: EngineConfig =
///     "tcp://127.0.0.1:0?secret=s3cret&max_concurrency=4&strict&require=batch_transfer".parse()?;
/// assert_eq!((config.adapter, config.require), (parsed.adapter, parsed.require));
/// # Ok(())
/// # }
/// # #[cfg(not(feature = "tcp"))]
/// # fn main() {}
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// The backend and its configuration.
    pub backend: BackendConfig,
    /// How the capability adapter wraps the backend.
    pub adapter: AdapterConfig,
    /// Operations that must be available (natively, or emulated unless
    /// strict) for [`crate::Engine::start`] to succeed.
    pub require: Vec<Operation>,
    /// Where the engine's metrics layer counts: the process-wide
    /// [`Metrics::global`] by default (what `ferry serve --metrics-listen`
    /// serves); `None` switches the layer off.
    pub metrics: Option<Metrics>,
    /// Whether the tracing layer opens a `debug` span per batch (default
    /// on; a span no subscriber wants costs a check of the filter).
    pub tracing: bool,
    /// Segment discovery through etcd (`metadata=etcd://…`); `None`
    /// (the default): peer-to-peer `host:port` names only.
    pub discovery: Option<DiscoveryConfig>,
}

impl EngineConfig {
    /// A configuration for `backend` with the default (emulating) adapter
    /// and no requirements.
    pub fn new(backend: BackendConfig) -> Self {
        EngineConfig {
            backend,
            adapter: AdapterConfig::default(),
            require: Vec::new(),
            metrics: Some(Metrics::global().clone()),
            tracing: true,
            discovery: None,
        }
    }

    /// Sets segment discovery (`None`: peer-to-peer names only).
    pub fn discovery(mut self, discovery: Option<DiscoveryConfig>) -> Self {
        self.discovery = discovery;
        self
    }

    /// Counts into `metrics` (`None`: metrics off).
    pub fn metrics(mut self, metrics: Option<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Switches the per-batch tracing spans on or off.
    pub fn tracing(mut self, on: bool) -> Self {
        self.tracing = on;
        self
    }

    /// Replaces the adapter configuration.
    pub fn adapter(mut self, adapter: AdapterConfig) -> Self {
        self.adapter = adapter;
        self
    }

    /// Sets strict mode (no emulation).
    pub fn strict(mut self, strict: bool) -> Self {
        self.adapter.strict = strict;
        self
    }

    /// Adds operations that must be available at start-up.
    pub fn require(mut self, ops: &[Operation]) -> Self {
        self.require.extend_from_slice(ops);
        self
    }

    /// Parses `url` (see the type's documentation). A `secret_file=PATH`
    /// parameter is replaced by `secret=` with the file's first line
    /// ([`crate::secret`]); the environment is not read here (programs add
    /// it with [`crate::secret::from_environment`]).
    ///
    /// Errors: [`Error::InvalidArgument`] for a malformed URL, an unknown
    /// scheme or a bad Ferry parameter; [`Error::Unavailable`] naming the
    /// cargo feature for a backend this build does not include; whatever the
    /// backend's `from_url` returns for its own parameters.
    pub fn from_url(url: &str) -> Result<Self> {
        EngineConfig::from_parts(ParsedUrl::parse(url)?)
    }

    /// [`EngineConfig::from_url`] on a URL already parsed: the scheme must
    /// name a known backend; Ferry's own parameters are taken out of `url`
    /// ([`AdapterConfig::take_url_params`]) and the same `url` goes to
    /// [`BackendConfig::from_parts`].
    pub fn from_parts(mut url: ParsedUrl) -> Result<Self> {
        let kind = url.scheme().parse::<BackendKind>()?;
        crate::secret::resolve_url_file(&mut url)?;
        let (adapter, require) = AdapterConfig::take_url_params(&mut url)?;
        let discovery = match kind {
            BackendKind::Tcp | BackendKind::Verbs => DiscoveryConfig::take_url_params(&mut url)?,
            _ => None,
        };
        if discovery.is_some() {
            DiscoveryConfig::check_enabled()?;
        }
        Ok(EngineConfig::new(BackendConfig::from_parts(url)?)
            .adapter(adapter)
            .require(&require)
            .discovery(discovery))
    }
}

/// Segment discovery through etcd (crate `ferry-discovery`, cargo feature
/// `etcd`): [`crate::Engine::start`] publishes the engine's segment
/// descriptor under `<prefix>/segments/<segment_name>`, bound to a lease it
/// keeps alive, and `open_segment` resolves a logical name (one without
/// `:`) through etcd; a `host:port` name goes to the backend as always.
/// [`TransferEngine::shutdown`](ferry_core::TransferEngine::shutdown)
/// revokes the lease. From a URL: `metadata=etcd://h1:2379,h2:2379` with
/// `prefix=`, `lease_ttl_ms=`, `segment_name=` (see [`EngineConfig`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DiscoveryConfig {
    /// The etcd endpoints, `host:port` (or `http://host:port`).
    pub endpoints: Vec<String>,
    /// The key prefix (default [`DiscoveryConfig::DEFAULT_PREFIX`]).
    pub prefix: String,
    /// The lease TTL (default [`DiscoveryConfig::DEFAULT_LEASE_TTL`];
    /// etcd rounds it up to whole seconds and raises it to its minimum).
    pub lease_ttl: Duration,
    /// The logical name to publish; `None`: the engine's segment name.
    pub segment_name: Option<String>,
}

impl DiscoveryConfig {
    /// The default key prefix.
    pub const DEFAULT_PREFIX: &'static str = "/ferry";
    /// The default lease TTL.
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

    /// etcd at `endpoints`, with the default prefix and TTL, publishing
    /// the engine's segment name.
    pub fn etcd<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        DiscoveryConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: Self::DEFAULT_PREFIX.to_owned(),
            lease_ttl: Self::DEFAULT_LEASE_TTL,
            segment_name: None,
        }
    }

    /// Sets the key prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the lease TTL.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets the logical name to publish.
    pub fn segment_name(mut self, name: impl Into<String>) -> Self {
        self.segment_name = Some(name.into());
        self
    }

    /// Takes `metadata`, `prefix`, `lease_ttl_ms` and `segment_name` out of
    /// `url`: `None` without `metadata`. [`Error::InvalidArgument`] for a
    /// `metadata` that is not `etcd://host:port[,host:port…]`, an empty or
    /// zero value, a logical name with `/`, `:` or a control character,
    /// or the other three without `metadata`.
    pub fn take_url_params(url: &mut ParsedUrl) -> Result<Option<Self>> {
        let metadata = url.take_str("metadata")?;
        let prefix = url.take_str("prefix")?;
        let ttl = url.take_with("lease_ttl_ms", "a positive number of milliseconds", |v| {
            v.parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .map(Duration::from_millis)
        })?;
        let name = url.take_str("segment_name")?;
        let Some(metadata) = metadata else {
            if let Some(key) = [
                prefix.as_ref().map(|_| "prefix"),
                ttl.map(|_| "lease_ttl_ms"),
                name.as_ref().map(|_| "segment_name"),
            ]
            .into_iter()
            .flatten()
            .next()
            {
                return Err(Error::InvalidArgument(format!(
                    "`{key}` is a parameter of etcd discovery: it needs `metadata=etcd://host:port`"
                )));
            }
            return Ok(None);
        };
        let expected = "etcd://host:port[,host:port…]";
        let endpoints = match metadata.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("etcd") => rest
                .split(',')
                .map(|e| e.trim().to_owned())
                .collect::<Vec<_>>(),
            _ => return Err(url.bad_value("metadata", &metadata, expected)),
        };
        if endpoints.iter().any(|e| {
            e.is_empty() || e.contains(['/', '?', '#', '@']) || e.contains(char::is_whitespace)
        }) {
            return Err(url.bad_value("metadata", &metadata, expected));
        }
        let mut c = DiscoveryConfig::etcd(endpoints);
        if let Some(p) = prefix {
            c = c.prefix(p);
        }
        if let Some(t) = ttl {
            c = c.lease_ttl(t);
        }
        if let Some(n) = name {
            check_logical_name(&n)?;
            c = c.segment_name(n);
        }
        Ok(Some(c))
    }

    /// [`Error::Unavailable`] naming the cargo feature `etcd` when this
    /// build does not include it.
    pub(crate) fn check_enabled() -> Result<()> {
        if cfg!(feature = "etcd") {
            return Ok(());
        }
        Err(Error::Unavailable {
            backend: "etcd".to_owned(),
            reason: "this build of ferry does not include etcd discovery (`metadata=etcd://`); \
                     enable the cargo feature `etcd` (ferry = { version = \"0.1\", features = \
                     [\"etcd\"] }; its build needs `protoc`)"
                .to_owned(),
        })
    }
}

/// A logical segment name: not empty, no `/` (the key layout), no `:`
/// (what `open_segment` takes for `host:port`), no control character.
pub(crate) fn check_logical_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains(['/', ':']) || name.chars().any(char::is_control) {
        return Err(Error::InvalidArgument(format!(
            "segment_name {name:?}: a logical name must be non-empty, without '/', ':' \
             or control characters"
        )));
    }
    Ok(())
}

impl FromStr for EngineConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        EngineConfig::from_url(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ferry_params_are_taken_and_the_rest_left_for_the_backend() {
        let mut url = ParsedUrl::parse(
            "mooncake://?lib=/opt/a%20b.so&strict=1&metadata=P2PHANDSHAKE&require=notify",
        )
        .unwrap();
        let (adapter, require) = AdapterConfig::take_url_params(&mut url).unwrap();
        assert!(adapter.strict && adapter.coalesce);
        assert_eq!(require, vec![Operation::Notify]);
        assert_eq!(url.keys().collect::<Vec<_>>(), ["lib", "metadata"]);
        assert_eq!(url.take_str("lib").unwrap().as_deref(), Some("/opt/a b.so"));
        // A bare key is `true`.
        let mut url = ParsedUrl::parse("tcp://127.0.0.1:0?strict").unwrap();
        assert!(AdapterConfig::take_url_params(&mut url).unwrap().0.strict);
        assert_eq!(url.keys().count(), 0);
    }

    #[test]
    fn malformed_urls_are_invalid_arguments() {
        for url in [
            "127.0.0.1:0",
            "://x",
            "t cp://x",
            "tcp://h?strict=%+5",
            "tcp://h?strict=1#frag",
        ] {
            let e = EngineConfig::from_url(url).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{url}: {e}");
        }
        // A key twice, however it is encoded (it used to be compared as
        // written, so `str%69ct` slipped past as a second `strict`).
        for url in ["tcp://h?strict=1&strict=0", "tcp://h?strict=1&str%69ct=0"] {
            let e = EngineConfig::from_url(url).unwrap_err();
            assert!(e.to_string().contains("`strict` given twice"), "{e}");
        }
    }

    #[test]
    fn unknown_scheme_names_the_known_ones() {
        let e = EngineConfig::from_url("udp://127.0.0.1:0").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("tcp://"), "{e}");
    }

    #[test]
    fn disabled_backends_name_their_feature() {
        for kind in BackendKind::ALL {
            if kind.is_enabled() {
                continue;
            }
            let url = format!("{}://x", kind.scheme());
            let e = EngineConfig::from_url(&url).unwrap_err();
            let text = e.to_string();
            assert!(matches!(e, Error::Unavailable { .. }), "{text}");
            assert!(
                text.contains(&format!("cargo feature `{}`", kind.scheme())),
                "{text}"
            );
        }
    }

    #[test]
    fn bad_ferry_values_are_rejected() {
        for url in [
            "tcp://127.0.0.1:0?strict=maybe",
            "tcp://127.0.0.1:0?max_concurrency=0",
            "tcp://127.0.0.1:0?require=teleport",
        ] {
            let e = EngineConfig::from_url(url).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{url}: {e}");
        }
    }

    #[cfg(feature = "tcp")]
    #[test]
    fn tcp_url_with_ferry_params() {
        let c = EngineConfig::from_url(
            "tcp://127.0.0.1:0?strict=1&coalesce=0&max_concurrency=4&require=batch_transfer",
        )
        .unwrap();
        assert_eq!(c.backend.kind(), BackendKind::Tcp);
        assert!(c.adapter.strict);
        assert!(!c.adapter.coalesce);
        assert_eq!(c.adapter.max_concurrency, 4);
        assert_eq!(c.require, vec![Operation::BatchTransfer]);
        // Encoded keys are the keys they decode to, for Ferry's and the
        // backend's parameters alike, in one parse.
        let c = EngineConfig::from_url("tcp://127.0.0.1:0?%73trict=yes&c%6Fnnections=3").unwrap();
        assert!(c.adapter.strict);
        match c.backend {
            BackendConfig::Tcp(t) => assert_eq!(t.connections, 3),
            #[allow(unreachable_patterns)]
            _ => unreachable!(),
        }
    }

    #[test]
    fn discovery_params_on_tcp_and_verbs_only() {
        let mut url = ParsedUrl::parse(
            "tcp://127.0.0.1:0?metadata=etcd://h1:2379,h2:2379&prefix=/p&lease_ttl_ms=2500\
             &segment_name=decode-3&secret=s",
        )
        .unwrap();
        let d = DiscoveryConfig::take_url_params(&mut url).unwrap().unwrap();
        assert_eq!(
            d,
            DiscoveryConfig::etcd(["h1:2379", "h2:2379"])
                .prefix("/p")
                .lease_ttl(Duration::from_millis(2500))
                .segment_name("decode-3")
        );
        assert_eq!(url.keys().collect::<Vec<_>>(), ["secret"]);
        // Defaults.
        let mut url = ParsedUrl::parse("tcp://h:1?metadata=etcd://h:2379").unwrap();
        let d = DiscoveryConfig::take_url_params(&mut url).unwrap().unwrap();
        assert_eq!(d, DiscoveryConfig::etcd(["h:2379"]));
        assert_eq!(
            (d.prefix.as_str(), d.lease_ttl),
            ("/ferry", Duration::from_secs(10))
        );
        // None without `metadata`.
        let mut url = ParsedUrl::parse("tcp://h:1").unwrap();
        assert_eq!(DiscoveryConfig::take_url_params(&mut url).unwrap(), None);
        // Mooncake's `metadata=` stays Mooncake's.
        let e = EngineConfig::from_url("mooncake://?metadata=etcd://h:2379");
        if let Err(e) = e {
            assert!(!e.to_string().contains("etcd discovery"), "{e}");
        }
    }

    #[test]
    fn bad_discovery_params_are_rejected() {
        for url in [
            "tcp://h:1?metadata=P2PHANDSHAKE",
            "tcp://h:1?metadata=http://h:2379",
            "tcp://h:1?metadata=etcd://",
            "tcp://h:1?metadata=etcd://a,,b",
            "tcp://h:1?metadata=etcd://u:p@h:2379",
            "tcp://h:1?metadata=etcd://h:2379&lease_ttl_ms=0",
            "tcp://h:1?metadata=etcd://h:2379&segment_name=a/b",
            "tcp://h:1?metadata=etcd://h:2379&segment_name=h:7000",
            "tcp://h:1?metadata=etcd://h:2379&segment_name=",
            "tcp://h:1?prefix=/p",
            "tcp://h:1?segment_name=x",
            "tcp://h:1?lease_ttl_ms=100",
        ] {
            let mut parsed = ParsedUrl::parse(url).unwrap();
            let e = DiscoveryConfig::take_url_params(&mut parsed).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{url}: {e}");
        }
    }

    #[cfg(all(feature = "tcp", not(feature = "etcd")))]
    #[test]
    fn etcd_without_the_feature_names_it() {
        let e = EngineConfig::from_url("tcp://127.0.0.1:0?metadata=etcd://h:2379").unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
        assert!(e.to_string().contains("cargo feature `etcd`"), "{e}");
    }

    #[cfg(all(feature = "tcp", feature = "etcd"))]
    #[test]
    fn etcd_with_the_feature_is_configured() {
        let c = EngineConfig::from_url("tcp://127.0.0.1:0?metadata=etcd://h:2379&segment_name=a")
            .unwrap();
        assert_eq!(
            c.discovery,
            Some(DiscoveryConfig::etcd(["h:2379"]).segment_name("a"))
        );
    }

    #[cfg(feature = "tcp")]
    #[test]
    fn unknown_parameters_name_ferry_and_backend_keys() {
        let e = EngineConfig::from_url("tcp://127.0.0.1:0?colour=blue").unwrap_err();
        let m = e.to_string();
        assert!(m.contains("`colour`"), "{m}");
        assert!(
            m.contains(
                "known: strict, coalesce, max_concurrency, require, metadata, prefix, \
                 lease_ttl_ms, segment_name, secret"
            ),
            "{m}"
        );
    }
}
