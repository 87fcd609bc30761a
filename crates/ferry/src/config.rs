//! Engine configuration: which backend, how to start it, and how the
//! capability adapter wraps it — from a URL or built in code.

use std::fmt;
use std::str::FromStr;

use ferry_core::{AdapterConfig, Error, Operation, Result};

/// Query parameters that belong to Ferry (the adapter), not to a backend.
/// They are removed from the URL before the backend parses it.
const FERRY_PARAMS: [&str; 4] = ["strict", "coalesce", "max_concurrency", "require"];

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
        let (scheme, _) = split_scheme(url)?;
        let kind: BackendKind = scheme.parse()?;
        match kind {
            #[cfg(feature = "tcp")]
            BackendKind::Tcp => Ok(BackendConfig::Tcp(ferry_tcp::TcpConfig::from_url(url)?)),
            #[cfg(feature = "mooncake")]
            BackendKind::Mooncake => Ok(BackendConfig::Mooncake(
                ferry_mooncake::MooncakeConfig::from_url(url)?,
            )),
            #[cfg(feature = "verbs")]
            BackendKind::Verbs => Ok(BackendConfig::Verbs(ferry_verbs::VerbsConfig::from_url(
                url,
            )?)),
            #[cfg(feature = "nixl")]
            BackendKind::Nixl => Ok(BackendConfig::Nixl(ferry_nixl::NixlConfig::from_url(url)?)),
            #[allow(unreachable_patterns)]
            other => Err(other.disabled_error()),
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
/// The scheme picks the backend; every query parameter except Ferry's own
/// goes to the backend's `from_url` unchanged, which rejects unknown ones by
/// name. The backends' parameters (full tables, defaults and limits in
/// `ferry_tcp::TcpConfig::from_url`, `ferry_mooncake::MooncakeConfig::from_url`,
/// `ferry_verbs::VerbsConfig::from_url`, `ferry_nixl::NixlConfig::from_url`):
///
/// | scheme | address part | parameters |
/// |---|---|---|
/// | `tcp://` | `host:port` to listen on (port 0: any); also the segment name | `secret` (shared secret, HMAC handshake), `connections`, `timeout_ms`, `connect_timeout_ms`, `chunk_size`, `max_batch`, `max_inbound`, `spin_us`, `socket_buffer` |
/// | `mooncake://` | none (everything is a parameter) | `lib` (path of `libtransfer_engine.so`; else `FERRY_MOONCAKE_LIB`, then the loader path), `metadata` (`P2PHANDSHAKE` or a metadata server), `protocol` (`tcp`, `rdma`, …), `host`, `port`, `name`, `device`, `timeout_ms`, `ns_per_byte` |
/// | `verbs://` | RDMA device name (`mlx5_0`; empty: the first with an active port) | `port`, `gid_index`, `listen` (control channel, also the segment name), `mtu`, `sq_depth`, `max_sge`, `signal_every`, `max_message`, `timeout`, `retry_cnt`, `rnr_retry`, `min_rnr_timer`, `max_rd_atomic`, `hop_limit`, `traffic_class`, `sl`, `connect_timeout_ms` |
/// | `nixl://` | none (everything is a parameter) | `lib` (path of `libnixl_capi.so`; else `FERRY_NIXL_LIB`, the loader path, the active Python's `nixl` wheel), `backends` (`UCX`, …), `host`, `port` (metadata listener; `host:port` is the segment name), `name` (agent), `progress_thread`, `timeout_ms`, `ns_per_byte` |
///
/// Ferry's own parameters, removed before the backend sees the URL:
///
/// | parameter | default | meaning |
/// |---|---|---|
/// | `strict` | `0` | `1`/`true`: emulate nothing; missing optional operations are refused ([`AdapterConfig::strict`]) |
/// | `coalesce` | `1` | merge contiguous requests of a batch ([`AdapterConfig::coalesce`]) |
/// | `max_concurrency` | `16` | emulated single transfers in flight ([`AdapterConfig::max_concurrency`]) |
/// | `require` | none | comma-separated operations (`batch_transfer,notify`) or guarantees (`landed_writes`, `peer_validation`) that must be available, else opening fails with [`Error::MissingCapabilities`] |
#[derive(Debug)]
pub struct EngineConfig {
    /// The backend and its configuration.
    pub backend: BackendConfig,
    /// How the capability adapter wraps the backend.
    pub adapter: AdapterConfig,
    /// Operations that must be available (natively, or emulated unless
    /// strict) for [`crate::Engine::start`] to succeed.
    pub require: Vec<Operation>,
}

impl EngineConfig {
    /// A configuration for `backend` with the default (emulating) adapter
    /// and no requirements.
    pub fn new(backend: BackendConfig) -> Self {
        EngineConfig {
            backend,
            adapter: AdapterConfig::default(),
            require: Vec::new(),
        }
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

    /// Parses `url` (see the type's documentation).
    ///
    /// Errors: [`Error::InvalidArgument`] for a malformed URL, an unknown
    /// scheme or a bad Ferry parameter; [`Error::Unavailable`] naming the
    /// cargo feature for a backend this build does not include; whatever the
    /// backend's `from_url` returns for its own parameters.
    pub fn from_url(url: &str) -> Result<Self> {
        let split = split_ferry_params(url)?;
        let mut adapter = AdapterConfig::default();
        let mut require = Vec::new();
        for (key, value) in &split.ferry {
            match key.as_str() {
                "strict" => adapter.strict = parse_bool(key, value)?,
                "coalesce" => adapter.coalesce = parse_bool(key, value)?,
                "max_concurrency" => {
                    adapter.max_concurrency = value.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(
                        || {
                            Error::InvalidArgument(format!(
                                "max_concurrency={value:?} in the backend URL is not a positive integer"
                            ))
                        },
                    )?
                }
                "require" => {
                    for op in value.split(',').filter(|s| !s.trim().is_empty()) {
                        require.push(op.parse::<Operation>()?);
                    }
                }
                // split_ferry_params returns only the keys in FERRY_PARAMS.
                _ => {}
            }
        }
        Ok(EngineConfig {
            backend: BackendConfig::from_url(&split.backend_url)?,
            adapter,
            require,
        })
    }
}

impl FromStr for EngineConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        EngineConfig::from_url(s)
    }
}

/// Splits `scheme://rest`, checking the scheme's spelling.
fn split_scheme(url: &str) -> Result<(&str, &str)> {
    let shown = || ferry_core::raw::redact_url(url);
    let (scheme, rest) = url.split_once("://").ok_or_else(|| {
        Error::InvalidArgument(format!(
            "backend URL {:?} has no scheme; expected tcp://…, mooncake://…, verbs://… or nixl://…",
            shown()
        ))
    })?;
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '+' || c == '-' || c == '.')
    {
        return Err(Error::InvalidArgument(format!(
            "backend URL {:?} has a malformed scheme",
            shown()
        )));
    }
    Ok((scheme, rest))
}

/// A URL with Ferry's parameters taken out.
#[derive(Debug, PartialEq, Eq)]
struct SplitUrl {
    /// The URL the backend parses: Ferry's parameters removed, everything
    /// else (including percent-encoding) byte for byte as given.
    backend_url: String,
    /// Ferry's parameters in order (keys from [`FERRY_PARAMS`]; a bare key
    /// has the value `""`).
    ferry: Vec<(String, String)>,
}

fn split_ferry_params(url: &str) -> Result<SplitUrl> {
    split_scheme(url)?;
    let (base, query_and_fragment) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let Some(qf) = query_and_fragment else {
        return Ok(SplitUrl {
            backend_url: url.to_owned(),
            ferry: Vec::new(),
        });
    };
    let (query, fragment) = match qf.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (qf, None),
    };
    let mut kept = Vec::new();
    let mut ferry = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if FERRY_PARAMS.contains(&key) {
            if ferry.iter().any(|(k, _): &(String, String)| k == key) {
                return Err(Error::InvalidArgument(format!(
                    "parameter {key:?} appears twice in the backend URL"
                )));
            }
            ferry.push((key.to_owned(), value.to_owned()));
        } else {
            kept.push(pair);
        }
    }
    let mut backend_url = base.to_owned();
    if !kept.is_empty() {
        backend_url.push('?');
        backend_url.push_str(&kept.join("&"));
    }
    if let Some(f) = fragment {
        backend_url.push('#');
        backend_url.push_str(f);
    }
    Ok(SplitUrl { backend_url, ferry })
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value.to_ascii_lowercase().as_str() {
        "" | "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::InvalidArgument(format!(
            "{key}={value:?} in the backend URL is not a boolean (use 1/0, true/false)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ferry_params_are_stripped_and_the_rest_kept_verbatim() {
        let s = split_ferry_params(
            "mooncake://?lib=/opt/a%20b.so&strict=1&metadata=P2PHANDSHAKE&require=notify#frag",
        )
        .unwrap();
        assert_eq!(
            s.backend_url,
            "mooncake://?lib=/opt/a%20b.so&metadata=P2PHANDSHAKE#frag"
        );
        assert_eq!(
            s.ferry,
            vec![
                ("strict".to_owned(), "1".to_owned()),
                ("require".to_owned(), "notify".to_owned())
            ]
        );
    }

    #[test]
    fn only_ferry_params_leave_no_question_mark() {
        let s = split_ferry_params("tcp://127.0.0.1:0?strict").unwrap();
        assert_eq!(s.backend_url, "tcp://127.0.0.1:0");
        assert_eq!(s.ferry, vec![("strict".to_owned(), String::new())]);
        let s = split_ferry_params("tcp://127.0.0.1:0").unwrap();
        assert_eq!(s.backend_url, "tcp://127.0.0.1:0");
        assert!(s.ferry.is_empty());
    }

    #[test]
    fn malformed_urls_are_invalid_arguments() {
        for url in ["127.0.0.1:0", "://x", "t cp://x"] {
            let e = split_ferry_params(url).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{url}: {e}");
        }
        let e = split_ferry_params("tcp://h?strict=1&strict=0").unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
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
    }
}
