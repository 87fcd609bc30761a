//! Engine configuration: which backend, how to start it, and how the
//! capability adapter wraps it — from a URL or built in code.

use std::fmt;
use std::str::FromStr;

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
/// fragment, no userinfo). The scheme picks the backend; Ferry takes its own
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
/// In code (`#[non_exhaustive]`: no struct literal outside this crate):
/// [`EngineConfig::new`] and the setters that consume and return it.
///
/// ```
/// # #[cfg(feature = "tcp")]
/// # fn main() -> ferry::Result<()> {
/// use ferry::ferry_tcp::TcpConfig;
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
        }
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
        url.scheme().parse::<BackendKind>()?;
        crate::secret::resolve_url_file(&mut url)?;
        let (adapter, require) = AdapterConfig::take_url_params(&mut url)?;
        Ok(EngineConfig::new(BackendConfig::from_parts(url)?)
            .adapter(adapter)
            .require(&require))
    }
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

    #[cfg(feature = "tcp")]
    #[test]
    fn unknown_parameters_name_ferry_and_backend_keys() {
        let e = EngineConfig::from_url("tcp://127.0.0.1:0?colour=blue").unwrap_err();
        let m = e.to_string();
        assert!(m.contains("`colour`"), "{m}");
        assert!(
            m.contains("known: strict, coalesce, max_concurrency, require, secret"),
            "{m}"
        );
    }
}
