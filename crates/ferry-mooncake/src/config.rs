//! Engine configuration and the `mooncake://` URL.

use std::path::PathBuf;
use std::time::Duration;

use ferry_core::raw::ParsedUrl;
use ferry_core::{Error, Result};

/// Metadata connection string that makes current Mooncake builds (≥ v0.3.0)
/// exchange segment descriptors peer to peer, without a metadata server.
pub const P2P_HANDSHAKE: &str = "P2PHANDSHAKE";

/// Everything [`crate::MooncakeEngine::start`] needs.
///
/// `Default` gives: library resolved as described in
/// [`crate::MooncakeLibrary::resolve`], metadata `P2PHANDSHAKE`, protocol
/// `tcp`, host `127.0.0.1`, port 0, a generated server name, no device
/// filter, and a per-batch deadline of 30 s + 1 ns per byte (Mooncake's own).
///
/// `#[non_exhaustive]`: build it with [`MooncakeConfig::builder`] (which
/// validates like [`MooncakeConfig::from_url`]), parse it, or start from
/// `default()` and assign fields.
///
/// ```
/// use ferry_mooncake::MooncakeConfig;
///
/// let config = MooncakeConfig::builder()
///     .library("/opt/mooncake/libtransfer_engine.so")
///     .protocol("rdma")
///     .device("mlx5_0")
///     .build()?;
/// assert_eq!(
///     config,
///     MooncakeConfig::from_url(
///         "mooncake://?lib=/opt/mooncake/libtransfer_engine.so&protocol=rdma&device=mlx5_0"
///     )?
/// );
/// assert!(MooncakeConfig::builder().host("").build().is_err());
/// # Ok::<(), ferry_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MooncakeConfig {
    /// Path of `libtransfer_engine.so`; `None` = environment variable, then
    /// the loader's search path.
    pub library: Option<PathBuf>,
    /// Metadata connection string: `P2PHANDSHAKE` (Mooncake ≥ v0.3.0), or a
    /// metadata server (`http://host:port/metadata`, `etcd://host:port`,
    /// `redis://host:port`, or what the loaded library accepts).
    pub metadata: String,
    /// Transport to install: `tcp`, `rdma`, `nvlink`, … (as the library
    /// names them).
    pub protocol: String,
    /// Address or host name the engine announces to peers.
    pub host: String,
    /// RPC port (0: let the library choose; `P2PHANDSHAKE` builds always
    /// choose their own).
    pub port: u16,
    /// `local_server_name`; with a metadata server it is the segment name
    /// peers open. `None`: `ferry-<pid>-<n>`.
    pub name: Option<String>,
    /// Device filter for the transport: a comma-separated list of NIC names
    /// (`mlx5_0,mlx5_1`) or a full Mooncake NIC priority matrix (JSON,
    /// starting with `{`), passed to `installTransport` (ignored by `tcp`).
    pub device: Option<String>,
    /// Fixed part of each batch's deadline.
    pub timeout: Duration,
    /// Per-byte part of each batch's deadline, in nanoseconds.
    pub timeout_ns_per_byte: u64,
    /// On builds whose TCP transport reports a write completed when it is
    /// sent (before v0.3.12), confirm that each write landed by reading its
    /// last byte back before reporting it completed. `None` = yes (the
    /// facade says no in strict mode). Ignored where the build acknowledges
    /// writes itself.
    pub confirm_writes: Option<bool>,
}

impl Default for MooncakeConfig {
    fn default() -> Self {
        MooncakeConfig {
            library: None,
            metadata: P2P_HANDSHAKE.to_owned(),
            protocol: "tcp".to_owned(),
            host: "127.0.0.1".to_owned(),
            port: 0,
            name: None,
            device: None,
            timeout: Duration::from_secs(30),
            timeout_ns_per_byte: 1,
            confirm_writes: None,
        }
    }
}

ferry_core::__config_builder! {
    /// Builds a [`MooncakeConfig`] ([`MooncakeConfig::builder`]): one
    /// setter per field; `build()` validates.
    pub struct MooncakeConfigBuilder for MooncakeConfig {
        some library: PathBuf,
        into metadata: String,
        into protocol: String,
        into host: String,
        set port: u16,
        some name: String,
        some device: String,
        set timeout: Duration,
        set timeout_ns_per_byte: u64,
        some confirm_writes: bool,
    }
}

/// The URL parameters [`MooncakeConfig::from_url`] accepts.
pub const URL_PARAMETERS: [&str; 10] = [
    "lib",
    "metadata",
    "protocol",
    "host",
    "port",
    "name",
    "device",
    "timeout_ms",
    "ns_per_byte",
    "confirm_writes",
];

impl MooncakeConfig {
    /// Parses `mooncake://?param=value&…`. Parameters (all optional; values
    /// percent-decoded):
    ///
    /// | parameter | meaning | default |
    /// |---|---|---|
    /// | `lib` | path of `libtransfer_engine.so` | `FERRY_MOONCAKE_LIB`, then `libtransfer_engine.so` via the loader |
    /// | `metadata` | metadata connection string | `P2PHANDSHAKE` |
    /// | `protocol` | transport (`tcp`, `rdma`, …) | `tcp` |
    /// | `host` | address announced to peers | `127.0.0.1` |
    /// | `port` | RPC port (0: library's choice) | `0` |
    /// | `name` | `local_server_name` | `ferry-<pid>-<n>` |
    /// | `device` | NIC list or NIC priority matrix JSON | none |
    /// | `timeout_ms` | fixed part of each batch's deadline | `30000` |
    /// | `ns_per_byte` | per-byte part of the deadline, ns | `1` |
    /// | `confirm_writes` | `1`/`0`: on builds before v0.3.12, confirm each write landed before reporting it completed | `1` (`0` in strict mode) |
    ///
    /// The URL is parsed by [`ParsedUrl`]: strict percent-decoding (`+` is
    /// a space), no fragment, no userinfo; `confirm_writes` takes `1`/`0`,
    /// `true`/`false`, `yes`/`no`, `on`/`off`.
    ///
    /// Errors ([`Error::InvalidArgument`]): another scheme, a host or path in
    /// the URL (put them in parameters), an unknown parameter (named, with
    /// the known ones) or a repeated one (named), a malformed
    /// percent-escape, an unparsable number, an empty `metadata`, `protocol`
    /// or `host`.
    pub fn from_url(url: &str) -> Result<MooncakeConfig> {
        MooncakeConfig::from_parts(ParsedUrl::parse(url)?)
    }

    /// [`MooncakeConfig::from_url`] on a URL already parsed (the facade
    /// takes its own parameters out of it first): takes the parameters of
    /// [`URL_PARAMETERS`], then refuses what is left.
    pub fn from_parts(mut url: ParsedUrl) -> Result<MooncakeConfig> {
        url.expect_params_only("mooncake", "mooncake://?host=10.0.0.1&port=12345")?;
        let mut cfg = MooncakeConfig::default();
        if let Some(v) = url.take_str("lib")? {
            cfg.library = Some(PathBuf::from(v));
        }
        if let Some(v) = url.take_str("metadata")? {
            cfg.metadata = v;
        }
        if let Some(v) = url.take_str("protocol")? {
            cfg.protocol = v;
        }
        if let Some(v) = url.take_str("host")? {
            cfg.host = v;
        }
        if let Some(p) = url.take::<u16>("port")? {
            cfg.port = p;
        }
        cfg.name = url.take_str("name")?;
        cfg.device = url.take_str("device")?;
        if let Some(d) = url.take_duration_ms("timeout_ms")? {
            cfg.timeout = d;
        }
        if let Some(n) = url.take("ns_per_byte")? {
            cfg.timeout_ns_per_byte = n;
        }
        cfg.confirm_writes = url.take_bool("confirm_writes")?;
        url.finish()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the fields that must not be empty or contain NUL bytes.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("metadata", &self.metadata),
            ("protocol", &self.protocol),
            ("host", &self.host),
        ] {
            if v.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "mooncake config: `{what}` is empty"
                )));
            }
        }
        let texts = [
            Some(&self.metadata),
            Some(&self.protocol),
            Some(&self.host),
            self.name.as_ref(),
            self.device.as_ref(),
        ];
        if texts.into_iter().flatten().any(|s| s.contains('\0')) {
            return Err(Error::InvalidArgument(
                "mooncake config: values may not contain NUL bytes".to_owned(),
            ));
        }
        if self.name.as_ref().is_some_and(String::is_empty) {
            return Err(Error::InvalidArgument(
                "mooncake config: `name` is empty".to_owned(),
            ));
        }
        Ok(())
    }

    /// The deadline of a batch moving `bytes` bytes: `timeout` +
    /// `timeout_ns_per_byte` × `bytes` (saturating).
    pub fn deadline_for(&self, bytes: u64) -> Duration {
        self.timeout.saturating_add(Duration::from_nanos(
            bytes.saturating_mul(self.timeout_ns_per_byte),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_parameter() {
        let c = MooncakeConfig::from_url(
            "mooncake://?lib=/opt/mc/libtransfer_engine.so&metadata=http%3A%2F%2Fm%3A8080%2Fmetadata\
             &protocol=rdma&host=10.0.0.2&port=12345&name=prefill-0&device=mlx5_0,mlx5_1\
             &timeout_ms=5000&ns_per_byte=2&confirm_writes=0",
        )
        .unwrap();
        assert_eq!(
            c,
            MooncakeConfig {
                library: Some(PathBuf::from("/opt/mc/libtransfer_engine.so")),
                metadata: "http://m:8080/metadata".into(),
                protocol: "rdma".into(),
                host: "10.0.0.2".into(),
                port: 12345,
                name: Some("prefill-0".into()),
                device: Some("mlx5_0,mlx5_1".into()),
                timeout: Duration::from_secs(5),
                timeout_ns_per_byte: 2,
                confirm_writes: Some(false),
            }
        );
        let built = MooncakeConfig::builder()
            .library("/opt/mc/libtransfer_engine.so")
            .metadata("http://m:8080/metadata")
            .protocol("rdma")
            .host("10.0.0.2")
            .port(12345)
            .name("prefill-0")
            .device("mlx5_0,mlx5_1")
            .timeout(Duration::from_secs(5))
            .timeout_ns_per_byte(2)
            .confirm_writes(false)
            .build()
            .unwrap();
        assert_eq!(built, c);
        assert_eq!(
            MooncakeConfig::from_url("mooncake://").unwrap(),
            MooncakeConfig::default()
        );
        assert_eq!(c.deadline_for(1000), Duration::from_nanos(5_000_002_000));
    }

    #[test]
    fn rejects_bad_urls_naming_the_problem() {
        let err = |u: &str| match MooncakeConfig::from_url(u) {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("{u}: expected InvalidArgument, got {other:?}"),
        };
        assert!(err("mooncake://?colour=blue").contains("`colour`"));
        assert!(err("mooncake://?port=1&port=2").contains("`port` given twice"));
        assert!(err("mooncake://?port=70000").contains("an integer 0..=65535"));
        assert!(err("mooncake://?timeout_ms=soon").contains("`timeout_ms`"));
        assert!(err("tcp://?lib=x").contains("not a mooncake://"));
        assert!(err("mooncake://somehost:1/").contains("parameters"));
        assert!(err("mooncake://?protocol=").contains("`protocol` is empty"));
        assert!(err("mooncake://?name=a%00b").contains("NUL"));
        // Strict percent-decoding (the `url` crate let `%+5` through as it
        // was), encoded keys, no fragment, the known parameters listed.
        assert!(err("mooncake://?port=%+5").contains("`port`"));
        assert!(err("mooncake://?lib=/x%G1.so").contains("percent-escape"));
        assert!(err("mooncake://?port=1&p%6Frt=2").contains("`port` given twice"));
        assert!(err("mooncake://?colour=blue").contains(&URL_PARAMETERS.join(", ")));
        assert!(err("mooncake://?lib=x#frag").contains("fragment"));
        assert!(err("mooncake://?confirm_writes=maybe").contains("`confirm_writes`"));
        assert!(err("mooncake://?name").contains("`name` has no value"));
        let c = MooncakeConfig::from_url("mooncake://?%6Eame=a+b&confirm_writes").unwrap();
        assert_eq!(c.name.as_deref(), Some("a b"));
        assert_eq!(c.confirm_writes, Some(true));
        assert!(MooncakeConfig::builder().name("").build().is_err());
    }
}
